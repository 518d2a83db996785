"""One Triton kernel that merges every row's partial attention results at once (CUDA only; imported lazily).

A forward cut into chunks of its keys (:mod:`~hf_longctx.kernels.key_split`) leaves each cut row with several
partial (out, lse) pairs. Merged segment by segment in eager torch, that is a dozen small kernels per segment,
launched from the host: on a CAD server's short calls the launches cost more than the merge's bytes and made the
call's time depend on how many segments it cut. Here one launch merges them all: each program takes one row and a
block of heads, folds the row's parts in with a running maximum (the online softmax's rescaling) in float32, and
writes the row once. :func:`~hf_longctx.kernels.merge.merge_row_parts_` is the entry point, with a torch version
of the same merge for CPU and float64.

The same kernel merges one partial result into a block of consecutive rows of a running result
(:meth:`~hf_longctx.kernels.merge.PartialAccumulator.add`, every ring step's and helper's result): rows
``start + m`` from part ``m``, no table. In eager torch that merge is a dozen elementwise passes over the block in
float32 (conversions, logaddexp, two weights, products, copies back); this one launch takes a fraction of their
time (measured: bench/results/2026-11-22_backends-multi-gpu.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_row_parts_kernel(out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, table_ptr, rows, heads, dim,
                            out_s_t, out_s_h, lse_s_h, lse_s_t, po_s_t, po_s_h, pl_s_h, pl_s_t, start,
                            INCLUDE_SELF: tl.constexpr, BLOCK: tl.constexpr, BLOCK_H: tl.constexpr,
                            BLOCK_D: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    if BLOCK:  # rows start + m, each from part m: no table
        row = start + m
        first = m
        stride = 0
        count = 1
    else:
        row = tl.load(table_ptr + m)
        first = tl.load(table_ptr + rows + m)
        stride = tl.load(table_ptr + 2 * rows + m)
        count = tl.load(table_ptr + 3 * rows + m)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    live_h = h < heads
    live = live_h[:, None] & (d < dim)[None, :]
    if INCLUDE_SELF:
        peak = tl.load(lse_ptr + h * lse_s_h + row * lse_s_t, mask=live_h, other=float("-inf")).to(tl.float32)
        has = peak > float("-inf")
        total = tl.where(has, 1.0, 0.0)
        acc = tl.load(out_ptr + row * out_s_t + h[:, None] * out_s_h + d[None, :], mask=live, other=0.0)
        acc = tl.where(has[:, None], acc.to(tl.float32), 0.0)
    else:
        peak = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        total = tl.zeros((BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    for j in range(count):
        p = first + j * stride
        x = tl.load(part_lse_ptr + h * pl_s_h + p * pl_s_t, mask=live_h, other=float("-inf")).to(tl.float32)
        o = tl.load(part_out_ptr + p * po_s_t + h[:, None] * po_s_h + d[None, :], mask=live, other=0.0)
        new = tl.maximum(peak, x)
        safe = tl.where(new > float("-inf"), new, 0.0)
        alpha = tl.exp(peak - safe)
        beta = tl.exp(x - safe)
        acc = acc * alpha[:, None] + tl.where((x > float("-inf"))[:, None], o.to(tl.float32), 0.0) * beta[:, None]
        total = total * alpha + beta
        peak = new
    seen = total > 0
    denom = tl.where(seen, total, 1.0)
    merged = tl.where(seen[:, None], acc / denom[:, None], 0.0)
    tl.store(out_ptr + row * out_s_t + h[:, None] * out_s_h + d[None, :], merged.to(out_ptr.dtype.element_ty),
             mask=live)
    merged_lse = tl.where(seen, peak + tl.log(denom), float("-inf"))
    tl.store(lse_ptr + h * lse_s_h + row * lse_s_t, merged_lse.to(lse_ptr.dtype.element_ty), mask=live_h)


def merge_row_parts(out: torch.Tensor, lse: torch.Tensor, table: torch.Tensor, part_out: torch.Tensor,
                    part_lse: torch.Tensor, include_self: bool) -> None:
    """In place: ``out`` (T, H, D) and ``lse`` (H, T) at each row of ``table`` (4, M), int64 on the device: result
    row, first part, part stride, part count) merged from parts ``part_out`` (P, H, D) / ``part_lse`` (H, P), and
    with the row's own result when ``include_self``. Unit stride along D."""
    _launch(out, lse, table, table.shape[1], 0, part_out, part_lse, include_self)


def merge_block(out: torch.Tensor, lse: torch.Tensor, start: int, part_out: torch.Tensor, part_lse: torch.Tensor
                ) -> None:
    """In place: rows ``start + m`` of ``out`` (T, H, D) and ``lse`` (H, T) merged with part ``m`` of ``part_out``
    (n, H, D) / ``part_lse`` (H, n), for every ``m < n``. Unit stride along D."""
    _launch(out, lse, None, part_out.shape[0], start, part_out, part_lse, True)


def _launch(out, lse, table, rows, start, part_out, part_lse, include_self):
    heads, dim = out.shape[1], out.shape[2]
    if rows == 0:
        return
    block_d = triton.next_power_of_2(dim)
    block_h = min(triton.next_power_of_2(heads), max(1, 4096 // block_d))
    _merge_row_parts_kernel[(rows, triton.cdiv(heads, block_h))](
        out, lse, part_out, part_lse, out if table is None else table, rows, heads, dim, out.stride(0),
        out.stride(1), lse.stride(0), lse.stride(1), part_out.stride(0), part_out.stride(1), part_lse.stride(0),
        part_lse.stride(1), start, INCLUDE_SELF=include_self, BLOCK=table is None, BLOCK_H=block_h,
        BLOCK_D=block_d, num_warps=4)
