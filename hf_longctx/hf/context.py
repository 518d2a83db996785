"""What the attention layers of a sharded forward need: the shard plan, the group and the kernel.

It travels as the ``longctx`` keyword of ``model(**inputs)``; transformers hands model keywords down
to every attention function. ``rank`` is this process's index in ``group``, found once when the batch
is sharded and handed to every attention call (which then does not ask the group again).

Some decoder layers do not pass their keywords on to the attention module (StableLM and Nemotron in
transformers 5). Their attention would silently attend only inside this rank's shard, so the input
hook also records the context of the model's current forward for every module of the model
(:func:`bind_modules`), and an attention call without the keyword asks :func:`context_of` its
module. The record is per model, never global: a second model in the same process (a reference
model, a teacher) is not touched by the first one's batch.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from ..layout import ShardPlan


@dataclass(frozen=True)
class SequenceParallelContext:
    """``padding``: this rank's rows that are padding tokens (their attention output is zero), or None.
    ``options``: the backend's options (the settings' ``backend_options``), handed to every attention call."""

    plan: ShardPlan
    group: dist.ProcessGroup | None
    rank: int
    kernel: str = "auto"
    padding: torch.Tensor | None = None
    options: dict | None = field(default=None, hash=False)


class ContextHolder(Protocol):
    """Who knows the context of a model's current forward (the input hook): ``current`` is None when none;
    ``attention_calls`` counts the attention calls of its modules that ran under a context."""

    current: SequenceParallelContext | None
    attention_calls: int


_HOLDERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> ContextHolder


def bind_modules(model: torch.nn.Module, holder: ContextHolder) -> None:
    """Every module of ``model`` reports ``holder.current`` through :func:`context_of` from now on."""
    for module in model.modules():
        _HOLDERS[module] = holder


def unbind_modules(model: torch.nn.Module, holder: ContextHolder) -> None:
    """Undo :func:`bind_modules` (modules bound to another holder stay bound)."""
    for module in model.modules():
        if _HOLDERS.get(module) is holder:
            del _HOLDERS[module]


def context_of(module: torch.nn.Module) -> SequenceParallelContext | None:
    """The context of the current sharded forward of the model ``module`` belongs to, or None."""
    holder = _HOLDERS.get(module)
    return holder.current if holder is not None else None


def count_attention_call(module: torch.nn.Module) -> None:
    """Tell the holder of ``module``'s model that an attention call ran on its sharded batch."""
    holder = _HOLDERS.get(module)
    if holder is not None:
        holder.attention_calls += 1
