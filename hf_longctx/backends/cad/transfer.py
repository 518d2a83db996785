"""Row transfers between ranks with one all_to_all_single, and their exact inverse.

A transfer is a list of items "rows [a, b) of rank src go to offset o of rank dst's buffer", in an
order every rank derives identically from the plan. Forward gathers the rows each rank sends into one
buffer, trades with ``all_to_all_single`` and places received rows at their buffer offsets. Reverse
sends buffer rows back and adds (or copies) them into the source rows: gradients of keys that several
tasks read add up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...comm.p2p import count_all_to_all


@dataclass(frozen=True)
class Item:
    src: int
    start: int
    end: int
    dst: int
    offset: int

    @property
    def rows(self) -> int:
        return self.end - self.start


class RowTransfer:
    """The part of a list of :class:`Item` that concerns ``rank``; reusable for any tensor of those rows."""

    def __init__(self, items: list[Item], rank: int, world: int, buffer_rows: int):
        self.world = world
        self.rank = rank
        self.buffer_rows = buffer_rows
        by_dst = [[it for it in items if it.src == rank and it.dst == d] for d in range(world)]
        by_src = [[it for it in items if it.dst == rank and it.src == s] for s in range(world)]
        self.send_counts = [sum(it.rows for it in group) for group in by_dst]
        self.recv_counts = [sum(it.rows for it in group) for group in by_src]
        src_rows = [r for group in by_dst for it in group for r in range(it.start, it.end)]
        place = [r for group in by_src for it in group for r in range(it.offset, it.offset + it.rows)]
        self.src_index = torch.tensor(src_rows, dtype=torch.long)
        self.place = torch.tensor(place, dtype=torch.long)

    def to(self, device) -> RowTransfer:
        self.src_index = self.src_index.to(device)
        self.place = self.place.to(device)
        return self

    def start(self, local: torch.Tensor, group) -> tuple:
        """Post the forward all_to_all of ``local``'s rows; :meth:`finish` gives the filled buffer."""
        send = local.index_select(0, self.src_index).contiguous()
        recv = local.new_empty(sum(self.recv_counts), *local.shape[1:])
        count_all_to_all(send, self.send_counts, self.recv_counts, self.rank)
        work = _a2a(recv, send, self.recv_counts, self.send_counts, group)
        return work, recv

    def finish(self, pending) -> torch.Tensor:
        work, recv = pending
        if work is not None:
            work.wait()
        buffer = recv.new_empty(self.buffer_rows, *recv.shape[1:])
        buffer[self.place] = recv
        return buffer

    def start_reverse(self, buffer: torch.Tensor, group) -> tuple:
        """Post sending buffer rows back to the rows they came from."""
        send = buffer.index_select(0, self.place).contiguous()
        recv = buffer.new_empty(sum(self.send_counts), *buffer.shape[1:])
        count_all_to_all(send, self.recv_counts, self.send_counts, self.rank)
        work = _a2a(recv, send, self.send_counts, self.recv_counts, group)
        return work, recv

    def finish_reverse(self, pending, local: torch.Tensor, add: bool) -> None:
        work, recv = pending
        if work is not None:
            work.wait()
        recv = recv.to(local.dtype)
        if add:
            local.index_add_(0, self.src_index, recv)
        else:
            local.index_copy_(0, self.src_index, recv)


def _a2a(recv, send, recv_counts, send_counts, group):
    if dist.is_available() and dist.is_initialized() and len(recv_counts) > 1:
        return dist.all_to_all_single(recv, send, recv_counts, send_counts, group=group, async_op=True)
    recv.copy_(send)
    return None
