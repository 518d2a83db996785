"""Comm modes: how the comm layer reaches the peers of a group, chosen by the group object itself.

Why: the backends talk to their peers only through this package's comm functions (collectives, point-to-point
batches, row gathers), and those never ask what kind of group they were given. They ask :func:`ops_for` for the
group's :class:`CommOps` and call its methods. A torch.distributed process group (or None, the default group) gets
:class:`TorchDistributedOps`. Any other group object may carry its own ops as its ``comm_ops`` attribute: e.g. W ranks
run as threads of one process, whose transfers are local copies, satisfy the same protocol, and the backends run on
them unchanged.

Ranks are group ranks throughout; point-to-point messages are ``(peer, tensor, tag)``, matched FIFO per (source,
destination, tag). A group's sub-groups (e.g. the inner and outer groups of a two-dimensional mesh) are made through
its ops too (:meth:`CommOps.sub_groups`), so they are groups of the same mode.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from .subgroups import SubGroupMismatch, make_sub_groups

__all__ = ["CommOps", "CommunicationError", "SubGroupMismatch", "TorchDistributedOps", "current_device", "ops_for"]


class CommunicationError(RuntimeError):
    """A peer rank did not answer: it most likely raised or died. Carries the step for diagnosis."""


@runtime_checkable
class CommOps(Protocol):
    """What the comm layer asks of one rank's handle on a group."""

    def is_distributed(self) -> bool:
        """Whether the group reaches other ranks (False: one process alone, no collectives to issue)."""

    def rank_and_size(self) -> tuple[int, int]:
        """(this rank inside the group, the group's size)."""

    def global_rank(self, group_rank: int) -> int:
        """The rank a point-to-point call addresses for ``group_rank``."""

    def post(self, sends: Sequence[tuple[int, torch.Tensor, int]], recvs: Sequence[tuple[int, torch.Tensor, int]],
             what: str) -> list:
        """Post contiguous sends ``(dst, tensor, tag)`` and receives ``(src, buffer, tag)`` as one batch; their
        works (each with ``wait()``). A sender must not change a tensor before its work completes."""

    def all_to_all_single(self, recv: torch.Tensor, send: torch.Tensor, in_split: list[int] | None,
                          out_split: list[int] | None, async_op: bool = False):
        """``torch.distributed.all_to_all_single`` on this group: its work with ``async_op``, else None."""

    def all_gather(self, tensors: list[torch.Tensor], tensor: torch.Tensor) -> None:
        """``torch.distributed.all_gather`` on this group."""

    def all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        """In-place reduction over the group's ranks; ``op`` is ``sum``, ``max`` or ``min``."""

    def collective_device(self) -> torch.device:
        """Where the group's collectives take their tensors."""

    def stages_on_host(self) -> bool:
        """Whether all_to_all buffers of device tensors live in host memory instead (one device that holds every
        rank's buffers at once would run out of memory)."""

    def in_one_process(self) -> bool:
        """Whether every rank of the group runs in this process (splitting host work between them gains
        nothing)."""

    def state(self) -> dict[Any, Any]:
        """State the package keeps for this rank of this group as long as the group lives: per group object,
        never per ``id`` (a later group may reuse an ``id``, and a rank that took the old group's state for its own
        would skip a collective its peers make)."""

    def sub_groups(self, members: Sequence[Sequence[int]], setting: Hashable) -> list[Any]:
        """Groups of the same mode over the ranks of ``members`` (lists of ranks of this group), in the order of
        ``members``: the entry of a list this rank is in is its group to pass to the comm layer (it may be None for
        a list of one rank: that rank alone); the other entries are of no use to this rank. A collective: every
        rank of the group asks at the same point, with the same lists, made from the same ``setting`` (orderable,
        e.g. a mesh's inner size); ranks that give different settings all raise :class:`SubGroupMismatch`, none
        waits. Made once per group object, setting and lists: a later ask returns the same groups (handles on them)
        and makes no collective."""


_STATE_BY_GROUP: dict[Any, dict[Any, Any]] = {}  # torch.distributed group (None: the default one) -> its state

_REDUCE_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


@dataclass(frozen=True)
class TorchDistributedOps:
    """The default comm mode: torch.distributed (gloo, NCCL) on ``group`` (None: the default group)."""

    group: Any = None

    def is_distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def rank_and_size(self) -> tuple[int, int]:
        if not self.is_distributed():
            return 0, 1
        return dist.get_rank(self.group), dist.get_world_size(self.group)

    def global_rank(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def post(self, sends, recvs, what: str) -> list:
        ops = [dist.P2POp(dist.isend, t, self.global_rank(dst), self.group, tag) for dst, t, tag in sends]
        ops += [dist.P2POp(dist.irecv, buf, self.global_rank(src), self.group, tag) for src, buf, tag in recvs]
        if not ops:
            return []
        try:
            return dist.batch_isend_irecv(ops)
        except Exception as exc:
            raise CommunicationError(f"hf_longctx: posting {what} failed: {exc}") from exc

    def all_to_all_single(self, recv, send, in_split, out_split, async_op: bool = False):
        return dist.all_to_all_single(recv, send, in_split, out_split, group=self.group, async_op=async_op)

    def all_gather(self, tensors, tensor) -> None:
        dist.all_gather(tensors, tensor, group=self.group)

    def all_reduce(self, tensor, op: str) -> None:
        dist.all_reduce(tensor, op=getattr(dist.ReduceOp, _REDUCE_OPS[op]), group=self.group)

    def collective_device(self) -> torch.device:
        return current_device()

    def stages_on_host(self) -> bool:
        return False

    def in_one_process(self) -> bool:
        return False

    def state(self) -> dict[Any, Any]:
        return _STATE_BY_GROUP.setdefault(self.group, {})

    def sub_groups(self, members: Sequence[Sequence[int]], setting: Hashable) -> list[Any]:
        """Made by every rank of the world, in one order (:mod:`.subgroups`: torch needs them all at every group it
        makes), and kept until :func:`~.groups.release_groups`."""
        ranks = [self.global_rank(r) for r in range(self.rank_and_size()[1])]
        return make_sub_groups(self.group, ranks, members, setting)


def ops_for(group) -> CommOps:
    """The comm ops of ``group``: its own ``comm_ops`` where it carries them, else torch.distributed's."""
    own = getattr(group, "comm_ops", None)
    return own if own is not None else TorchDistributedOps(group)


def current_device() -> torch.device:
    """This process's device for collectives: its CUDA device under NCCL, else the CPU."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
