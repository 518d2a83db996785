"""What the attention layers of a sharded forward need, and how every attention call finds it.

The context (shard plan, group, kernel) travels as the ``longctx`` keyword of ``model(**inputs)``:
:func:`~hf_longctx.hf.shard_batch` puts it there, and so does the callback's input hook, in the
keywords of the model call it shards. ``rank`` is this process's index in ``group``, found once when
the batch is sharded and handed to every attention call (which then does not ask the group again).

transformers hands model keywords down to every attention function, but some decoder layers take them
and do not pass them on to their attention module (StableLM and Nemotron in transformers 5). Their
attention would silently attend only inside this rank's shard, so an attention call without the
keyword looks for the sharded forward it runs in on the call stack (:func:`context_of`): the innermost
call of a module that contains the attention module and whose ``**kwargs`` hold ``longctx``
(``Module.__call__``'s own frame, or a ``forward(self, ..., **kwargs)``). The answer is the same on
every path (the input hook, ``shard_batch`` + ``model(**local)``, ``model.forward(**local)``, a
checkpointed layer recomputed in backward, which calls the layer's ``forward`` with its keywords
again) and belongs to the attention module's own model: another model in the same process (a
reference model, a teacher) is never inside that call, so it is never touched, even when it runs
from within the first model's forward.

Cost: none while no context object is alive (a sharded forward can only run while its context is;
plain evaluation and ``generate()`` pay one length check per attention call), else one walk over
the frames of the stack per attention call that lacks the keyword.
"""

from __future__ import annotations

import functools
import inspect
import sys
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ...backends.options import BackendOptions
from ...layout import ShardPlan

# every context alive now, by id: while it is empty no sharded forward runs, so nothing walks the stack
_LIVE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_ATTENTION_CALLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # context -> attention calls under it


@dataclass(frozen=True, eq=False)
class SequenceParallelContext:
    """``padding``: this rank's rows that are padding tokens (their attention output is zero), or None.
    ``positions``: the positions of the whole sequence before sharding (:attr:`position_limit`). ``options``: the
    backend's options (the settings' ``backend_options``), handed to every attention call: its options object, or
    a mapping that :meth:`options_for` parses once for the backend the layers run.

    Compared by identity: each sharded forward has its own context.
    """

    plan: ShardPlan
    group: dist.ProcessGroup | None
    rank: int
    kernel: str = "auto"
    padding: torch.Tensor | None = None
    options: BackendOptions | Mapping | None = field(default=None, hash=False)
    positions: torch.Tensor | None = field(default=None, hash=False)  # the whole sequence's, of every rank

    def __post_init__(self):
        _LIVE[id(self)] = self

    @functools.cached_property
    def position_limit(self) -> int | None:
        """The largest position of the whole sharded sequence + 1 (what a model that sizes its RoPE by its batch's
        longest position reads from one unsharded forward), or None without positions. Read only by such models
        (:mod:`.dynamic_rope`): the maximum of a tensor on the GPU waits for it."""
        if self.positions is None or not self.positions.numel():
            return None
        return int(self.positions.max()) + 1

    def options_for(self, backend: str) -> BackendOptions:
        """``options`` as ``backend``'s options object: parsed at the first attention call of this forward when they
        came as a mapping (:func:`~hf_longctx.hf.shard_batch` without the model cannot know the backend), kept
        for every later layer."""
        if isinstance(self.options, BackendOptions):
            return self.options
        parsed = _PARSED_OPTIONS.get(self)
        if parsed is None or parsed[0] != backend:
            from ...backends.api import check_options

            parsed = _PARSED_OPTIONS[self] = (backend, check_options(backend, self.options))
        return parsed[1]


_PARSED_OPTIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # context -> (backend, its options)


def count_attention_call(ctx: SequenceParallelContext) -> None:
    """Record that an attention call ran under ``ctx`` (the input hook checks that some did)."""
    _ATTENTION_CALLS[ctx] = _ATTENTION_CALLS.get(ctx, 0) + 1


def attention_calls(ctx: SequenceParallelContext | None) -> int:
    """How many attention calls ran under ``ctx`` so far."""
    return _ATTENTION_CALLS.get(ctx, 0) if ctx is not None else 0


_UNSEEN = object()
_KEYWORDS_NAME: dict = {}  # code object -> name of its **kwargs parameter, None when it has none or no self


def _keywords_name(code) -> str | None:
    """``kwargs`` of ``def f(self, ..., **kwargs)``; None for a function without ``**`` or without a first argument."""
    name = _KEYWORDS_NAME.get(code, _UNSEEN)
    if name is _UNSEEN:
        name = None
        if code.co_flags & inspect.CO_VARKEYWORDS and code.co_argcount:
            name = code.co_varnames[code.co_argcount + code.co_kwonlyargcount
                                    + bool(code.co_flags & inspect.CO_VARARGS)]
        _KEYWORDS_NAME[code] = name
    return name


_KNOWN_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> WeakSet of modules holding it


def _contains(owner: torch.nn.Module, module: torch.nn.Module) -> bool:
    """Whether ``module`` is ``owner`` or one of its submodules (found once per pair, then remembered)."""
    if owner is module:
        return True
    known = _KNOWN_OWNERS.get(module)
    if known is not None and owner in known:
        return True
    if any(m is module for m in owner.modules()):
        _KNOWN_OWNERS.setdefault(module, weakref.WeakSet()).add(owner)
        return True
    return False


def _module_calls(frame) -> Iterator[tuple[torch.nn.Module, dict]]:
    """(module, keywords) of every frame from ``frame`` outwards that is a method of a module taking ``**kwargs``."""
    while frame is not None:
        code = frame.f_code
        name = _keywords_name(code)
        if name is not None:
            local = frame.f_locals
            owner, keywords = local.get(code.co_varnames[0]), local.get(name)
            if isinstance(owner, torch.nn.Module) and isinstance(keywords, dict):
                yield owner, keywords
        frame = frame.f_back


def context_of(module: torch.nn.Module) -> SequenceParallelContext | None:
    """The context of the sharded forward of ``module``'s own model that this call runs in, or None."""
    if not _LIVE:
        return None
    for owner, keywords in _module_calls(sys._getframe(1)):
        ctx = keywords.get("longctx")
        if isinstance(ctx, SequenceParallelContext) and _contains(owner, module):
            return ctx
    return None


def calls_under(ctx: SequenceParallelContext) -> list[tuple[torch.nn.Module, dict]]:
    """(module, keywords) of every module call on the stack that runs the sharded forward of ``ctx``, innermost
    first: the model, its wrappers and its layers, whose keywords hold this very context."""
    return [(owner, keywords) for owner, keywords in _module_calls(sys._getframe(1))
            if keywords.get("longctx") is ctx]
