"""Triton kernels that assemble a rank's segment rows from its own rows and the rows it received, and return results
the other way (CUDA only; imported lazily).

A :class:`~hf_longctx.comm.gather.GatherPlan` builds each segment sequence from two sources: rows this rank holds
and the unique rows the all_to_all brought. In eager torch that is two row gathers into temporaries and two
``index_copy_`` into the segment buffer, four passes over the rows, the copies through torch's generic indexing
kernel; in an emulated CAD step of short documents on an H200, row gathers and index copies took more than half as
long as the attention kernels. Here each program copies one block of one segment row from whichever source holds it:
one read and one write per row.

The return is the inverse (:func:`scatter_two`): each segment row's result goes to the local row it read, or to
the send buffer's slot of the received row it read, converted to the destination's dtype in registers, added
atomically where several segments read one row (key gradients). Torch made a dtype copy of every segment, two
row gathers, a concatenation and two ``index_add_``.
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
def _scatter_two_kernel(seg_ptr, local_ptr, buf_ptr, index_ptr, local_rows, width, local_stride, buf_stride, buf_col,
                        seg_stride, ADD: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < width
    dst = tl.load(index_ptr + i)
    row = tl.load(seg_ptr + i * seg_stride + cols, mask=live)
    if dst < local_rows:
        ptr = local_ptr + dst * local_stride + cols
    else:
        ptr = buf_ptr + (dst - local_rows) * buf_stride + buf_col + cols
    value = row.to(ptr.dtype.element_ty)
    if ADD:
        tl.atomic_add(ptr, value, mask=live, sem="relaxed")
    else:
        tl.store(ptr, value, mask=live)


def scatter_two(segment: torch.Tensor, local: torch.Tensor, buf: torch.Tensor, index: torch.Tensor, column: int,
                add: bool) -> None:
    """Row ``i`` of ``segment`` into row ``index[i]`` of ``[local ; buf]`` (the inverse of :func:`gather_two`), at
    column ``column`` of ``buf``'s rows (tensors packed side by side), in the destination's dtype; added (atomically:
    several rows of ``segment`` may name one row) or copied. ``buf`` has ``local``'s dtype; every row of the three
    is contiguous. With every index below ``local``'s rows (``buf`` then unused), it adds returned rows at the rows
    they were sent from."""
    width = math.prod(local.shape[1:])
    if segment.shape[0] == 0 or width == 0:
        return
    block = min(1024, triton.next_power_of_2(width))
    _scatter_two_kernel[(segment.shape[0], triton.cdiv(width, block))](
        segment, local, buf, index, local.shape[0], width, local.stride(0), buf.stride(0),
        column, segment.stride(0), ADD=add, BLOCK=block, num_warps=4)
