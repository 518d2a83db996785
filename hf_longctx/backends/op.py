"""Distributed core attention as ONE torch custom op: ``torch.ops.hf_longctx.core_attention``.

Making the whole distributed attention (all its steps and transfers) a single opaque op is what
lets selective activation checkpointing keep its output: a policy that MUST_SAVEs this op makes the
recompute of a checkpointed layer re-run norms and projections but never attention or its
communication (DistFlashAttn's recompute-aware checkpointing). Process groups and shard plans are
not op arguments; they are registered under an integer key that the op receives.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

import torch
from torch._subclasses.fake_tensor import is_fake

from ..kernels import count


class AttentionRun(Protocol):
    """What the op runs: one rank's attention call, forward and backward, with everything but q/k/v bound.

    A distributed call is a :class:`~.engine.RunContext`; a call of packed segments without a plan is a
    :class:`~.segments.SegmentRun`.
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


_CONTEXTS: OrderedDict[int, AttentionRun] = OrderedDict()
_MAX_CONTEXTS = 64
_next_key = 0


def register_context(run: AttentionRun) -> int:
    """Keep ``run`` reachable by the op under a fresh key (the oldest keys are dropped)."""
    global _next_key
    _next_key += 1
    _CONTEXTS[_next_key] = run
    while len(_CONTEXTS) > _MAX_CONTEXTS:
        _CONTEXTS.popitem(last=False)
    return _next_key


class OutputObservers:
    """Callbacks that see the output tensors of every core-attention call while they are watching.

    Checkpoint offload uses it to find the outputs that selective checkpointing keeps: the op's
    outputs are the tensors the checkpoint cache holds, and nothing else names them.
    """

    def __init__(self) -> None:
        self._observers: list[Callable[[torch.Tensor], None]] = []

    @contextmanager
    def watch(self, observer: Callable[[torch.Tensor], None]) -> Iterator[None]:
        """Call ``observer`` on each output tensor of every core-attention call made inside the block."""
        self._observers.append(observer)
        try:
            yield
        finally:
            self._observers.remove(observer)

    def report(self, *outputs: torch.Tensor) -> None:
        """Hand a core-attention call's outputs to the watching observers (no-op when none watches)."""
        for observer in self._observers:
            for t in outputs:
                observer(t)


ATTENTION_OUTPUTS = OutputObservers()


def run_core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, run: AttentionRun) -> torch.Tensor:
    """This rank's attention output under ``run``, through the op (so autograd and checkpointing see it)."""
    out, lse = core_attention(q, k, v, register_context(run))
    ATTENTION_OUTPUTS.report(out, lse)
    return out


COMPILE_REFUSAL = ("hf_longctx: torch.compile cannot trace the backward of a longctx_* attention, whose schedule "
                   "lives outside the graph, one per call; train without torch_compile (TrainingArguments("
                   "torch_compile=False)) and compile other parts of the model on their own if you like")


def _context(key: int) -> AttentionRun:
    try:
        return _CONTEXTS[key]
    except KeyError:
        raise RuntimeError(
            f"hf_longctx: attention context {key} is gone; more than {_MAX_CONTEXTS} attention calls are waiting "
            "for their backward at once"
        ) from None


@torch.library.custom_op("hf_longctx::core_attention", mutates_args=())
def core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of this rank's queries under the schedule registered as ``key``."""
    count("core_attention.forward")
    return _context(key).forward(q, k, v)


@core_attention.register_fake
def _(q, k, v, key):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=acc)


def _setup_context(ctx, inputs, output):
    q, k, v, key = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.key = key


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if is_fake(q):
        raise RuntimeError(COMPILE_REFUSAL)
    if dout is None:
        dout = torch.zeros_like(out)
    count("core_attention.backward")
    dq, dk, dv = _context(ctx.key).backward(dout, q, k, v, out, lse)
    return dq, dk, dv, None


core_attention.register_autograd(_backward, setup_context=_setup_context)
