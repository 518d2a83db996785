"""Triton kernels of the expert path's memory-bound steps (CUDA only; imported lazily).

Around the two grouped GEMMs of an MoE layer sit steps that only move rows: summing each token's
weighted expert outputs, the matching backward, and the SwiGLU gate. In eager PyTorch each is several
kernels with float32 temporaries of all (token, expert) pairs; on the many-small-expert shapes
(Qwen3-MoE: 128 experts, top-8) those passes cost more than the GEMMs. Each kernel here reads its
inputs once and writes its result once, accumulating in float32, in the same order as the torch
fallback of :mod:`~hf_longctx.moe.row_ops` (slot 0 first), so results are deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _pair_sum_kernel(rows_ptr, table_ptr, weights_ptr, out_ptr, hidden, top_k, rows_stride, out_stride,
                     HAS_WEIGHTS: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < hidden
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for slot in range(top_k):
        pair = tl.load(table_ptr + token * top_k + slot).to(tl.int64)
        if pair >= 0:
            row = tl.load(rows_ptr + pair * rows_stride + cols, mask=in_row, other=0.0).to(tl.float32)
            if HAS_WEIGHTS:
                row = row * tl.load(weights_ptr + pair).to(tl.float32)
            acc += row
    tl.store(out_ptr + token * out_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=in_row)


@triton.jit
def _pair_grads_kernel(grad_ptr, token_ptr, weights_ptr, rows_ptr, grad_rows_ptr, grad_weights_ptr, hidden,
                       grad_stride, rows_stride, BLOCK: tl.constexpr):
    pair = tl.program_id(0).to(tl.int64)
    token = tl.load(token_ptr + pair).to(tl.int64)
    weight = tl.load(weights_ptr + pair).to(tl.float32)
    dot = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, hidden, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        in_row = cols < hidden
        grad = tl.load(grad_ptr + token * grad_stride + cols, mask=in_row, other=0.0).to(tl.float32)
        row = tl.load(rows_ptr + pair * rows_stride + cols, mask=in_row, other=0.0).to(tl.float32)
        tl.store(grad_rows_ptr + pair * hidden + cols, (grad * weight).to(grad_rows_ptr.dtype.element_ty), mask=in_row)
        dot += grad * row
    tl.store(grad_weights_ptr + pair, tl.sum(dot, axis=0))


@triton.jit
def _swiglu_fwd_kernel(h_ptr, out_ptr, total, inter, BLOCK: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = idx < total
    row, col = idx // inter, idx % inter
    gate = tl.load(h_ptr + row * 2 * inter + col, mask=live, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + row * 2 * inter + inter + col, mask=live, other=0.0).to(tl.float32)
    # rounded to the activation dtype between the two steps, as act_fn(gate) * up rounds in eager mode
    act = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + idx, (act * up).to(out_ptr.dtype.element_ty), mask=live)


@triton.jit
def _swiglu_bwd_kernel(grad_ptr, h_ptr, grad_h_ptr, total, inter, BLOCK: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = idx < total
    row, col = idx // inter, idx % inter
    gate_at = row * 2 * inter + col
    gate = tl.load(h_ptr + gate_at, mask=live, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + gate_at + inter, mask=live, other=0.0).to(tl.float32)
    grad = tl.load(grad_ptr + idx, mask=live, other=0.0).to(tl.float32)
    dtype = grad_h_ptr.dtype.element_ty
    sig = tl.sigmoid(gate)
    act = (gate * sig).to(dtype).to(tl.float32)
    grad_act = (grad * up).to(dtype).to(tl.float32)
    tl.store(grad_h_ptr + gate_at, (grad_act * sig * (1.0 + gate * (1.0 - sig))).to(dtype), mask=live)
    tl.store(grad_h_ptr + gate_at + inter, (grad * act).to(dtype), mask=live)


def _block(width: int, cap: int = 1024) -> int:
    return min(cap, triton.next_power_of_2(max(width, 16)))


def pair_sum(rows: torch.Tensor, table: torch.Tensor, weights: torch.Tensor | None, out: torch.Tensor) -> None:
    """``out[t] = sum_j weights[p] * rows[p]`` over ``p = table[t, j] >= 0`` (rows and out: unit column stride)."""
    tokens, top_k = table.shape
    hidden = rows.shape[1]
    if tokens == 0:
        return
    block = _block(hidden)
    _pair_sum_kernel[(tokens, triton.cdiv(hidden, block))](
        rows, table, weights if weights is not None else rows, out, hidden, top_k, rows.stride(0), out.stride(0),
        HAS_WEIGHTS=weights is not None, BLOCK=block)


def pair_grads(grad_tokens: torch.Tensor, token_index: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    pairs, hidden = rows.shape
    grad_rows = torch.empty((pairs, hidden), dtype=rows.dtype, device=rows.device)
    grad_weights = torch.empty(pairs, dtype=torch.float32, device=rows.device)
    if pairs:
        _pair_grads_kernel[(pairs,)](grad_tokens, token_index, weights, rows, grad_rows, grad_weights, hidden,
                                     grad_tokens.stride(0), rows.stride(0), BLOCK=_block(hidden))
    return grad_rows, grad_weights


def swiglu_forward(h: torch.Tensor) -> torch.Tensor:
    rows, inter = h.shape[0], h.shape[1] // 2
    out = torch.empty((rows, inter), dtype=h.dtype, device=h.device)
    total = rows * inter
    if total:
        _swiglu_fwd_kernel[(triton.cdiv(total, 2048),)](h, out, total, inter, BLOCK=2048)
    return out


def swiglu_backward(grad: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    grad_h = torch.empty_like(h)
    total = grad.numel()
    if total:
        _swiglu_bwd_kernel[(triton.cdiv(total, 2048),)](grad, h, grad_h, total, h.shape[1] // 2, BLOCK=2048)
    return grad_h
