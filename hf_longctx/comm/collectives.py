"""Collectives the backends issue, through the group's comm ops (:func:`~.mode.ops_for`).

The backends call these instead of ``torch.distributed`` directly, so the same code runs on a real
process group (gloo, NCCL) and on any group that carries its own comm ops (e.g. W ranks in one process).
"""

from __future__ import annotations

import torch

from .mode import ops_for


def is_distributed(group) -> bool:
    """Whether ``group`` reaches other ranks (False: one process, no collectives)."""
    return ops_for(group).is_distributed()


def all_to_all_single(recv: torch.Tensor, send: torch.Tensor, in_split: list[int] | None,
                      out_split: list[int] | None, group=None, async_op: bool = False):
    """``torch.distributed.all_to_all_single(recv, send, in_split, out_split, group, async_op)``."""
    return ops_for(group).all_to_all_single(recv, send, in_split, out_split, async_op=async_op)


def all_gather(tensors: list[torch.Tensor], tensor: torch.Tensor, group=None) -> None:
    ops_for(group).all_gather(tensors, tensor)


def all_reduce_max(tensor: torch.Tensor, group=None) -> None:
    """In-place maximum over the ranks of ``group`` (nothing to do in one process)."""
    ops = ops_for(group)
    if ops.is_distributed():
        ops.all_reduce(tensor, "max")


def collective_device(group) -> torch.device:
    """Where a collective of ``group`` takes its tensors: this process's device (CUDA under NCCL), or where the
    group's own comm ops say (the CPU for ranks that share one process)."""
    return ops_for(group).collective_device()


def in_one_process(group) -> bool:
    """Whether every rank of ``group`` runs in this process (host work split between them gains nothing)."""
    return ops_for(group).in_one_process()


def group_state(group) -> dict:
    """State kept for this rank of ``group`` as long as the group lives, per group object (see
    :meth:`~.mode.CommOps.state`)."""
    return ops_for(group).state()
