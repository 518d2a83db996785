"""Fused RMSNorm, RoPE and SwiGLU from Liger-Kernel: the same numbers with less kept for backward.

Why: at long context a decoder layer's autograd tensors, not its weights, set the longest context.
transformers' ``LlamaRMSNorm`` upcasts its input to float32 and autograd keeps that copy, the
normalized input cast back and the output: ``(4 + 2 a) h`` bytes per token per norm, two norms per
layer, plus float32 temporaries in its backward. Liger's RMSNorm keeps its input and a float32 rsqrt
per token; its RoPE keeps only cos and sin; its SwiGLU keeps gate and up, recomputes the activation and
writes d(gate) and d(up) over them. A layer's backward so needs less with the fused norm and less again with
Liger's SwiGLU than with an un-fused MLP's gradients. A checkpointed layer's forward peaks the same either way, one
without checkpointing lower with the fused norm (measured layer by layer: bench/results/2026-12-04_from-modules.md,
bench/results/2026-12-08_planner-refit-h100-peers.md); the memory model (:mod:`.model`) counts both.

Liger's kernels are Triton: they need a GPU. ``fused_ops_available`` says whether they can run here;
:func:`enable_fused_ops` patches a model instance (Liger's own ``_apply_liger_kernel_to_instance``)
and leaves the loss alone: hf_longctx's loss (tiled or not) keeps the sequence-parallel loss
contract, and Liger's fused linear cross-entropy is not switched on here. A model that the Trainer
already patched (``TrainingArguments(use_liger_kernel=True)``, also TRL's flag) is recognised by
:func:`uses_fused_norms`.
"""

from __future__ import annotations

import torch

from ..settings.schema import liger_installed
from .decoder_layers import checkpointed_layers as _decoder_layers


def fused_ops_reason(device: torch.device | str | None = None) -> str | None:
    """Why Liger's fused ops cannot run on ``device`` (default: the current one), or None."""
    if not liger_installed():
        return "Liger-Kernel is not installed (pip install 'hf_longctx[liger]', or liger-kernel)"
    on_gpu = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    if not on_gpu:
        return "Liger-Kernel's Triton kernels need a CUDA GPU"
    return None


def fused_ops_available(device: torch.device | str | None = None) -> bool:
    """Liger-Kernel is installed and ``device`` is a CUDA GPU its Triton kernels run on."""
    return fused_ops_reason(device) is None


def uses_fused_norms(model: torch.nn.Module) -> bool:
    """Whether every decoder layer's norms already run Liger's RMSNorm (patched by us or by the Trainer)."""
    layers = _decoder_layers(model)
    if not layers or not liger_installed():
        return False
    from liger_kernel.transformers.rms_norm import LigerRMSNorm

    def fused(norm) -> bool:
        forward = getattr(getattr(norm, "forward", None), "__func__", None)
        return isinstance(norm, LigerRMSNorm) or forward is LigerRMSNorm.forward

    return all(fused(getattr(layer, name, None)) for layer in layers
               for name in ("input_layernorm", "post_attention_layernorm"))


def enable_fused_ops(model: torch.nn.Module, swiglu: bool = True) -> None:
    """Switch ``model``'s RMSNorms, RoPE and (``swiglu``) MLPs to Liger's kernels; the loss is left as it is.

    Like the Trainer's ``use_liger_kernel``, this patches the model type's transformers module too (Liger's
    RoPE replaces the module's function; models built later in this process get Liger's norms and MLP).

    Raises RuntimeError naming the fix when Liger cannot run here or does not know the model type.
    ``swiglu=False`` keeps the MLP module as it is (the tiled MLP wraps it instead).
    """
    reason = fused_ops_reason(next(model.parameters()).device)
    if reason is not None:
        raise RuntimeError(f"fused ops (Liger-Kernel) requested but {reason}; set fused_ops: off")
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN, _apply_liger_kernel_to_instance

    model_type = getattr(model.config, "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise RuntimeError(f"Liger-Kernel has no fused ops for model type {model_type!r}; set fused_ops: off")
    _apply_liger_kernel_to_instance(model=model, rope=True, rms_norm=True, swiglu=swiglu,
                                    cross_entropy=False, fused_linear_cross_entropy=False)
    if not uses_fused_norms(model):
        raise RuntimeError(f"Liger-Kernel did not replace the RMSNorms of this {model_type} model; set fused_ops: off")
