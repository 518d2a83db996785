"""Recompute-aware gradient checkpointing (DistFlashAttn).

Plain checkpointing at the decoder-layer boundary re-runs the whole layer in backward, attention and
its communication included. Core attention is the most expensive part of a long-context layer and
its output is only (T, H, D) plus an fp32 log-sum-exp, so it is worth keeping: a selective
checkpointing policy marks the single ``hf_longctx::core_attention`` op MUST_SAVE and lets
everything else be recomputed (norms, projections, RoPE, MLP).

Both modes take ``offload=True``: what each layer keeps between forward and backward (its input and,
recompute-aware, its attention output) waits in pinned host memory instead (see :mod:`.offload`).
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
    """``activation_checkpointing_kwargs`` for ``model.activation_checkpointing_enable`` / TrainingArguments
    (``gradient_checkpointing_*`` in transformers releases before the rename)."""
    return {"use_reentrant": False, "context_fn": partial(create_selective_checkpoint_contexts, recompute_aware_policy)}


def enable_recompute_aware_checkpointing(model, offload: bool = False) -> None:
    """Checkpoint every decoder layer but keep the core-attention output (and lse) of each.

    ``offload=True`` keeps those outputs and the layer inputs in pinned host memory between the passes.
    """
    enable_layer_checkpointing(model, recompute_aware_checkpointing_kwargs(), offload=offload)


def enable_layer_checkpointing(model, kwargs: dict | None = None, offload: bool = False) -> None:
    """Checkpoint every decoder layer through whichever entry point this transformers version has.

    ``offload=True`` swaps in :class:`~hf_longctx.hf.offload.CheckpointOffloader` as each layer's
    checkpoint function (transformers' own ``offload`` flag copies synchronously on the compute
    stream and cannot reach the selective-checkpoint cache).
    """
    kwargs = kwargs or {"use_reentrant": False}
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support gradient checkpointing")
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if not offload:
        model.__dict__.pop("_hf_longctx_offloader", None)
        return
    from .offload import CheckpointOffloader

    offloader = CheckpointOffloader(keep_attention_outputs=kwargs.get("context_fn") is not None)
    function = partial(offloader, **kwargs)
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)
              and hasattr(m, "_gradient_checkpointing_func")]
    if not layers:
        raise RuntimeError(f"{type(model).__name__}: no checkpointed layer found to offload")
    for module in layers:
        module._gradient_checkpointing_func = function
    model._hf_longctx_offloader = offloader


def _decoder_layers(model) -> list:
    """The layers transformers checkpoints (its GradientCheckpointingLayer modules), in model order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def enable_per_layer_checkpointing(model, layers) -> None:
    """Checkpoint each decoder layer its own way: ``layers[i]`` is ``(mode, offload)`` for layer ``i``.

    ``mode``: ``none`` (the layer keeps its activations), ``layer`` or ``recompute_aware``;
    ``offload``: that layer's checkpoint waits in pinned host memory (one
    :class:`~hf_longctx.hf.offload.CheckpointOffloader` serves every offloaded layer, so the copies
    of those layers keep their side streams and the next offloaded layer is prefetched in backward).
    The layers that stay on the device use ``torch.utils.checkpoint`` as usual. Gradients are those
    of any other choice (the same operations run; only where tensors wait differs).
    """
    from torch.utils.checkpoint import checkpoint

    from .settings import CHECKPOINTING_MODES

    choices = [(c, False) if isinstance(c, str) else (c[0], bool(c[1])) for c in layers]
    for mode, offload in choices:
        if mode not in CHECKPOINTING_MODES:
            raise ValueError(f"unknown checkpointing {mode!r}; choose one of {CHECKPOINTING_MODES}")
        if offload and mode == "none":
            raise ValueError("a layer without checkpointing has no checkpoint to offload")
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support gradient checkpointing")
    decoder = _decoder_layers(model)
    if len(decoder) != len(choices):
        raise ValueError(f"{len(choices)} per-layer choices for the {len(decoder)} checkpointable layers of "
                         f"{type(model).__name__}")
    if any(mode != "none" for mode, _ in choices):
        enable_layer_checkpointing(model)  # transformers' own set-up (flags, PEFT input gradients)
    model.__dict__.pop("_hf_longctx_offloader", None)
    offloader = None
    if any(offload for _, offload in choices):
        from .offload import CheckpointOffloader

        offloader = model._hf_longctx_offloader = CheckpointOffloader(keep_attention_outputs=None)
    for module, (mode, offload) in zip(decoder, choices):
        kwargs = recompute_aware_checkpointing_kwargs() if mode == "recompute_aware" else {"use_reentrant": False}
        module.gradient_checkpointing = mode != "none"
        module._gradient_checkpointing_func = partial(offloader if offload else checkpoint, **kwargs)


def checkpointing_argument() -> str:
    """Name of the ``TrainingArguments`` field that turns activation checkpointing on in this transformers.

    transformers 5.x renamed ``gradient_checkpointing`` to ``activation_checkpointing``; the old name is
    a deprecated alias that warns (``FutureWarning``, to be removed in v6), so it is used only where
    the new one does not exist yet.
    """
    from transformers import TrainingArguments

    fields = getattr(TrainingArguments, "__dataclass_fields__", {})
    return "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"


def checkpointing_training_args(enabled: bool) -> dict:
    """``TrainingArguments`` keyword that turns activation checkpointing on or off, by its current name
    (:func:`checkpointing_argument`); :class:`~hf_longctx.hf.callback.LongContextCallback` makes it
    recompute-aware."""
    return {checkpointing_argument(): enabled}
