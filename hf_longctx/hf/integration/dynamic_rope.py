"""RoPE that sizes its frequencies by the batch's longest position sees the whole sequence's, not a shard's.

transformers' ``dynamic`` (dynamic NTK) and ``longrope`` (Phi-3 and its kin) rotary embeddings choose their
frequencies in every forward from ``max(position_ids) + 1``: longrope switches from its short to its long factors
past ``original_max_position_embeddings``, dynamic NTK rescales its base past the cached length and goes back
below it. Under sequence parallelism each rank's ``position_ids`` are a shard's, whose largest position is not the
sequence's: ranks would rotate their queries and keys with different frequencies than one process running the
whole batch does, a silently different loss.

:func:`follow_whole_sequence_positions` puts two hooks on each such rotary module of a model: in a sharded forward
the module gets one extra position, the whole sequence's largest (:attr:`~.context.SequenceParallelContext.
position_limit`), appended to this rank's ``position_ids``, so that transformers' own update reads the maximum one
process would read; the extra row of the cosines and sines it returns is dropped again. Every other position is
rotated exactly as transformers rotates it. The input hook installs them, and so does ``shard_batch(..., model=)``;
a sharded forward of such a model that reaches its attention without them is refused
(:func:`refuse_unfollowed_rope`), before any collective. They stay on the model once installed: outside a sharded
forward (one process, evaluation without the hook, ``generate()``) they leave every call as it is.
"""

from __future__ import annotations

import weakref

import torch

from .context import SequenceParallelContext, context_of

_INSTALLED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # rotary module -> its hook handles
_FOLLOWED: weakref.WeakSet = weakref.WeakSet()  # contexts whose forward gave a rotary module the whole maximum
_EXTENDED: weakref.WeakSet = weakref.WeakSet()  # rotary modules whose running call got the extra position


def _reads_batch_maximum(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a transformers rotary embedding whose frequencies follow the batch's longest position."""
    rope_type = getattr(module, "rope_type", None)
    types = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
    return any(isinstance(t, str) and ("dynamic" in t or t == "longrope") for t in types)


def batch_maximum_rope_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The rotary modules of ``model`` that size their frequencies by the batch's longest position."""
    return [m for m in model.modules() if _reads_batch_maximum(m)]


def _append_whole_maximum(module, args, kwargs):
    ctx = context_of(module)
    if ctx is None or ctx.plan.world_size == 1 or ctx.position_limit is None:
        return None  # unsharded, or one rank holds the whole sequence: its own maximum is the whole one
    in_args = len(args) > 1
    positions = args[1] if in_args else kwargs.get("position_ids")
    if not isinstance(positions, torch.Tensor):
        raise ValueError(f"{type(module).__name__} got no position_ids tensor in a sharded forward; its frequencies "
                         "follow the batch's longest position, which each rank must take from the whole sequence")
    extra = positions.new_full((*positions.shape[:-1], 1), ctx.position_limit - 1)
    positions = torch.cat([positions, extra], dim=-1)
    _FOLLOWED.add(ctx)
    _EXTENDED.add(module)
    if in_args:
        return (args[0], positions, *args[2:]), kwargs
    return args, {**kwargs, "position_ids": positions}


def _drop_extra_position(module, args, kwargs, output):
    if module not in _EXTENDED:
        return None
    _EXTENDED.discard(module)
    if not isinstance(output, tuple | list) or not all(isinstance(t, torch.Tensor) for t in output):
        raise ValueError(f"{type(module).__name__} returned {type(output).__name__}, not its cosines and sines")
    return type(output)(t[..., :-1, :] for t in output)


def follow_whole_sequence_positions(model: torch.nn.Module) -> int:
    """Make every rotary module of ``model`` that sizes its frequencies by the batch's longest position read the
    whole sequence's in a sharded forward (module docstring). Idempotent; returns how many modules follow it."""
    modules = batch_maximum_rope_modules(model)
    for module in modules:
        if module not in _INSTALLED:
            _INSTALLED[module] = (module.register_forward_pre_hook(_append_whole_maximum, with_kwargs=True),
                                  module.register_forward_hook(_drop_extra_position, with_kwargs=True))
    return len(modules)


def refuse_unfollowed_rope(model: torch.nn.Module | None, ctx: SequenceParallelContext) -> str | None:
    """Why the sharded forward of ``ctx`` cannot go on: ``model`` has a rotary embedding that reads the batch's
    longest position, and no rank gave it the whole sequence's (no hooks: ``shard_batch`` without ``model=``).
    None when it can."""
    if model is None or ctx.plan.world_size == 1 or ctx in _FOLLOWED:
        return None
    modules = batch_maximum_rope_modules(model)
    if not modules:
        return None
    rope_type = getattr(modules[0], "rope_type", None)
    return (f"{type(model).__name__}'s rotary embedding (rope_type {rope_type!r}) sizes its frequencies by the batch's "
            "longest position, which each rank would read from its own shard: pass model=<the model> to "
            "hf_longctx.hf.shard_batch (or train through LongContextCallback), so that every rank reads the whole "
            "sequence's")
