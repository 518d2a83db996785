"""One Triton kernel that assembles a rank's segment rows from its own rows and the rows it received (CUDA only;
imported lazily).

A :class:`~hf_longctx.comm.gather.GatherPlan` builds each segment sequence from two sources: rows this rank holds
and the unique rows the all_to_all brought. In eager torch that is two row gathers into temporaries and two
``index_copy_`` into the segment buffer, four passes over the rows, the copies through torch's generic indexing
kernel; in an emulated CAD step of short documents on an H200, row gathers and index copies took more than half as
long as the attention kernels. Here each program copies one block of one segment row from whichever source holds it:
one read and one write per row.
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
