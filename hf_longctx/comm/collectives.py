"""Collectives the backends issue, dispatched on the group: torch.distributed, or an emulated group.

Backends call these instead of ``torch.distributed`` directly, so the same backend code runs on a real
process group (gloo, NCCL) and on an :class:`~.emulated.EmulatedGroup` (W ranks emulated on one device).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .emulated import EmulatedGroup
from .groups import current_device


def is_distributed(group) -> bool:
    """Whether ``group`` reaches other processes or emulated ranks (False: one process, no collectives)."""
    return isinstance(group, EmulatedGroup) or (dist.is_available() and dist.is_initialized())


def all_to_all_single(recv: torch.Tensor, send: torch.Tensor, in_split: list[int] | None,
                      out_split: list[int] | None, group=None, async_op: bool = False):
    """``torch.distributed.all_to_all_single(recv, send, in_split, out_split, group, async_op)``."""
    if isinstance(group, EmulatedGroup):
        return group.all_to_all_single(recv, send, in_split, out_split, async_op=async_op)
    return dist.all_to_all_single(recv, send, in_split, out_split, group=group, async_op=async_op)


def all_gather(tensors: list[torch.Tensor], tensor: torch.Tensor, group=None) -> None:
    if isinstance(group, EmulatedGroup):
        group.all_gather(tensors, tensor)
    else:
        dist.all_gather(tensors, tensor, group=group)


def all_reduce_max(tensor: torch.Tensor, group=None) -> None:
    """In-place maximum over the ranks of ``group`` (nothing to do in one process)."""
    if isinstance(group, EmulatedGroup):
        group.all_reduce(tensor, "max")
    elif dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)


def collective_device(group) -> torch.device:
    """Where a collective of ``group`` takes its tensors: the CPU for an emulated group (its ranks share a
    process), else this process's device (CUDA under NCCL)."""
    return torch.device("cpu") if isinstance(group, EmulatedGroup) else current_device()
