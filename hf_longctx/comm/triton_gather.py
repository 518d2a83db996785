"""Triton kernels that assemble a rank's segment rows from its own rows and the rows it received, and return results
the other way (CUDA only; imported lazily).

A :class:`~hf_longctx.comm.gather.GatherPlan` builds each segment sequence from two sources: rows this rank holds
and the unique rows the all_to_all brought. In eager torch that is two row gathers into temporaries and two
``index_copy_`` into the segment buffer, four passes over the rows, the copies through torch's generic indexing
kernel; in an emulated CAD step of short documents, row gathers and index copies took more than half as long as the
attention kernels (measured: bench/results/2026-11-22_backends-multi-gpu.md). Here each program copies one block of one
segment row from whichever source holds it: one read and one write per row.

The return is the inverse (:func:`scatter_rows`): each local row and each slot of the send buffer gets the sum of
the segment rows that read it (key gradients: several), in a fixed order, converted to the destination's dtype in
registers. Torch made a dtype copy of every segment, two row gathers, a concatenation and two ``index_add_``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_two_kernel(seg_ptr, local_ptr, recv_ptr, index_ptr, local_rows, width, local_stride, recv_stride,
                       BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < width
    src = tl.load(index_ptr + i)
    if src < local_rows:
        row = tl.load(local_ptr + src * local_stride + cols, mask=live)
    else:
        row = tl.load(recv_ptr + (src - local_rows) * recv_stride + cols, mask=live)
    tl.store(seg_ptr + i * width + cols, row, mask=live)


def gather_two(local: torch.Tensor, received: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` of ``[local ; received]`` (index int64 on the device), without concatenating the two. Each
    row of both must be contiguous (any row stride)."""
    seg = local.new_empty(index.shape[0], *local.shape[1:])
    width = math.prod(local.shape[1:])
    if seg.numel() == 0:
        return seg
    block = min(1024, triton.next_power_of_2(width))
    _gather_two_kernel[(seg.shape[0], triton.cdiv(width, block))](
        seg, local, received, index, local.shape[0], width, local.stride(0), received.stride(0), BLOCK=block,
        num_warps=4)
    return seg


@triton.jit
def _scatter_rows_kernel(seg_ptr, local_ptr, buf_ptr, dst_ptr, start_ptr, order_ptr, local_rows, width, seg_stride,
                         local_stride, buf_stride, buf_col, ADD: tl.constexpr, BLOCK: tl.constexpr):
    j = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < width
    dst = tl.load(dst_ptr + j)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(tl.load(start_ptr + j), tl.load(start_ptr + j + 1)):  # its segment rows, in order
        i = tl.load(order_ptr + s)
        acc += tl.load(seg_ptr + i * seg_stride + cols, mask=live, other=0.0).to(tl.float32)
    if dst < local_rows:
        ptr = local_ptr + dst * local_stride + cols
        if ADD:
            acc += tl.load(ptr, mask=live, other=0.0).to(tl.float32)
    else:  # a received row's slot: written once, by this program
        ptr = buf_ptr + (dst - local_rows) * buf_stride + buf_col + cols
    tl.store(ptr, acc.to(ptr.dtype.element_ty), mask=live)


def scatter_rows(segment: torch.Tensor, local: torch.Tensor, buf: torch.Tensor, sums: tuple[torch.Tensor, ...],
                 column: int, add: bool) -> None:
    """The inverse of :func:`gather_two`: row ``d`` of ``[local ; buf]`` gets the sum of the rows of ``segment`` that
    read it, in the destination's dtype, added to a local row's value (``add``) or in its place. ``sums`` =
    (destination rows, each one's start in ``order``, one more at the end; segment rows by destination, in segment
    order) from :func:`~hf_longctx.comm.gather.row_sums`; ``buf``'s rows are written at column ``column`` (tensors
    packed side by side) and never read. ``buf`` has ``local``'s dtype; every row of the three is contiguous.

    Why one program per destination and not atomics: the sum is in a fixed order, so key gradients are the same
    run after run (Trainer's ``full_determinism``), and the send buffer needs no zeroing."""
    dst, starts, order = sums
    width = math.prod(local.shape[1:])
    if dst.shape[0] == 0 or width == 0:
        return
    block = min(1024, triton.next_power_of_2(width))
    _scatter_rows_kernel[(dst.shape[0], triton.cdiv(width, block))](
        segment, local, buf, dst, starts, order, local.shape[0], width, segment.stride(0), local.stride(0),
        buf.stride(0), column, ADD=add, BLOCK=block, num_warps=4)
