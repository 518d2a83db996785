"""Recompute-aware gradient checkpointing (DistFlashAttn).

Plain checkpointing at the decoder-layer boundary re-runs the whole layer in backward, attention and
its communication included. Core attention is the most expensive part of a long-context layer and
its output is only (T, H, D) plus an fp32 log-sum-exp, so it is worth keeping: a selective
checkpointing policy marks the single ``hf_longctx::core_attention`` op MUST_SAVE and lets
everything else be recomputed (norms, projections, RoPE, MLP).
"""

from __future__ import annotations

from functools import partial

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ..backends.op import core_attention  # noqa: F401 - registers torch.ops.hf_longctx.core_attention


def recompute_aware_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Keep distributed core attention, recompute the rest."""
    if op is torch.ops.hf_longctx.core_attention.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def recompute_aware_checkpointing_kwargs() -> dict:
    """``gradient_checkpointing_kwargs`` for ``model.gradient_checkpointing_enable`` / TrainingArguments."""
    return {"use_reentrant": False, "context_fn": partial(create_selective_checkpoint_contexts, recompute_aware_policy)}


def enable_recompute_aware_checkpointing(model) -> None:
    """Checkpoint every decoder layer but keep the core-attention output (and lse) of each."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support gradient checkpointing")
    enable_layer_checkpointing(model, recompute_aware_checkpointing_kwargs())


def enable_layer_checkpointing(model, kwargs: dict | None = None) -> None:
    """Checkpoint every decoder layer through whichever entry point this transformers version has."""
    kwargs = kwargs or {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
