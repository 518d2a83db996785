"""The expert MLP on compacted rows: grouped GEMM where it serves, a per-expert loop elsewhere.

Input rows are grouped by local expert (``counts[e]`` rows for expert e, in order). The weights are
those of a transformers experts module (``@use_experts_implementation``): ``gate_up_proj`` (E, 2I, H)
and ``down_proj`` (E, H, I), or their transposes (E, H, 2I) / (E, I, H) when the module says
``is_transposed`` (GPT-OSS), with optional per-expert biases. The activation is the module's own
``_apply_gate`` (SwiGLU for Qwen/Mixtral/OLMoE, GPT-OSS's clamped variant), so a model's numerics are
its own.

Why two paths. ``torch._grouped_mm`` runs every expert's GEMM in one kernel from device-side offsets:
on the Qwen3-30B-A3B and Mixtral shapes it runs several times faster than a Python loop over experts (many small GEMMs,
one launch each; measured: bench/results/2026-12-04_from-modules.md). It takes bf16/fp16/fp32 only and wants 16-byte
aligned strides, so float64 (the exactness tests) and odd shapes go through the loop, which
computes the same thing with ``F.linear`` per expert. On the grouped path a plain SwiGLU gate runs as
one fused kernel (:func:`~hf_longctx.moe.row_ops.swiglu`) with the same rounding as eager mode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .row_ops import swiglu

_GROUPED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def grouped_mm_available() -> bool:
    return hasattr(torch, "_grouped_mm")


def use_grouped_mm(rows: torch.Tensor, weight: torch.Tensor, preference: bool | None) -> bool:
    """``preference`` True/False forces a path (True raises where grouped GEMM cannot run); None: bf16/fp16 on CUDA."""
    servable = (grouped_mm_available() and rows.dtype in _GROUPED_DTYPES and weight.dtype == rows.dtype
                and rows.shape[-1] * rows.element_size() % 16 == 0)
    if preference is None:
        return servable and rows.is_cuda and rows.dtype != torch.float32
    if preference and not servable:
        raise ValueError(f"grouped GEMM cannot run on {rows.dtype} rows of width {rows.shape[-1]} "
                         f"(needs bf16/fp16/fp32 and 16-byte aligned rows); use grouped_mm=None or False")
    return preference


def _weights(experts: nn.Module):
    """(gate_up, gate_up_bias, down, down_bias, transposed) of a transformers experts module."""
    if not getattr(experts, "has_gate", True) or not hasattr(experts, "gate_up_proj"):
        raise TypeError(f"{type(experts).__name__} has no fused gate_up_proj; expert parallelism here covers "
                        "gated experts (Qwen2/3-MoE, Mixtral, OLMoE, GPT-OSS)")
    has_bias = getattr(experts, "has_bias", False)
    return (experts.gate_up_proj, experts.gate_up_proj_bias if has_bias else None, experts.down_proj,
            experts.down_proj_bias if has_bias else None, bool(getattr(experts, "is_transposed", False)))


def _grouped_linear(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, transposed: bool) -> torch.Tensor:
    # grouped_mm computes rows @ W[e] per group; an (out, in) weight is used through its transposed view
    return torch._grouped_mm(rows, weight if transposed else weight.transpose(-2, -1), offs=offsets)


def expert_mlp(rows: torch.Tensor, counts: torch.Tensor, experts: nn.Module, grouped_mm: bool | None = None,
               add_down_bias: bool = True) -> torch.Tensor:
    """``down(gate(up(rows)))`` per local expert for rows grouped by expert (``counts`` rows each).

    Differentiable in rows and in the expert parameters. Rows of experts with no rows cost nothing.
    ``add_down_bias`` False leaves out ``down_proj_bias``: with expert tensor parallelism the outputs
    of several intermediate slices are summed, and the bias must enter that sum once.
    """
    gate_up, gate_up_bias, down, down_bias, transposed = _weights(experts)
    if not add_down_bias:
        down_bias = None
    if rows.shape[0] == 0:
        hidden = down.shape[-1] if transposed else down.shape[-2]
        return rows.new_zeros((0, hidden))
    if use_grouped_mm(rows, gate_up, grouped_mm):
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        expert_of_row = None
        if gate_up_bias is not None or down_bias is not None:
            expert_of_row = torch.repeat_interleave(torch.arange(counts.numel(), device=rows.device), counts,
                                                    output_size=rows.shape[0])
        h = _grouped_linear(rows, gate_up, offsets, transposed)
        if gate_up_bias is not None:
            h = h + gate_up_bias[expert_of_row]
        h = swiglu(experts, h)
        out = _grouped_linear(h.to(rows.dtype), down, offsets, transposed)
        if down_bias is not None:
            out = out + down_bias[expert_of_row]
        return out
    pieces, start = [], 0
    for e, count in enumerate(counts.tolist()):
        if not count:
            continue
        x = rows[start : start + count]
        start += count
        h = x @ gate_up[e] if transposed else F.linear(x, gate_up[e])
        if gate_up_bias is not None:
            h = h + gate_up_bias[e]
        h = experts._apply_gate(h)
        y = h @ down[e] if transposed else F.linear(h, down[e])
        if down_bias is not None:
            y = y + down_bias[e]
        pieces.append(y)
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def expert_mlp_flops(rows: int, experts: nn.Module) -> float:
    """Forward FLOPs of :func:`expert_mlp` on ``rows`` rows: two GEMMs, 2 * rows * H * 3I."""
    gate_up = experts.gate_up_proj
    hidden, two_inter = (gate_up.shape[1], gate_up.shape[2]) if getattr(experts, "is_transposed", False) else (
        gate_up.shape[2], gate_up.shape[1])
    return 2.0 * rows * hidden * (two_inter + two_inter // 2)
