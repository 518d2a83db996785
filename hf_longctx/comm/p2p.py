"""Overlapped point-to-point exchange between sequence-parallel ranks.

Backends post the transfers of the next step, compute the current one, then wait: the transfers
run on the communication backend's own stream (NCCL's internal stream on GPU, gloo's worker
threads on CPU) while the current stream computes, and :meth:`PendingExchange.wait` makes the
compute stream wait for them. The same code runs on gloo and NCCL.

Every message carries a tag built from the step and message kind. NCCL matches messages between
two ranks in issue order and ignores tags; gloo matches by tag; both are satisfied because all
ranks issue the phases of a schedule in the same order.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .mode import CommunicationError, ops_for

_counters: Counter = Counter()


def comm_stats() -> dict[str, int]:
    """Messages and bytes this process sent to and received from other ranks: point-to-point through
    :func:`post_exchange`, collectives through :func:`count_collective` (calls per kind, e.g.
    ``all_to_all_calls``)."""
    return dict(_counters)


def reset_comm_stats() -> None:
    _counters.clear()


def count_collective(kind: str, sent_bytes: int, recv_bytes: int) -> None:
    """Record one collective call and the bytes it moved to and from OTHER ranks, in :func:`comm_stats`."""
    _counters[f"{kind}_calls"] += 1
    _counters["sent_bytes"] += sent_bytes
    _counters["recv_bytes"] += recv_bytes


def count_all_to_all(send: torch.Tensor, send_counts: list[int], recv_counts: list[int], rank: int) -> None:
    """Record the bytes an all_to_all moves to and from OTHER ranks (the self chunk is a local copy)."""
    row = send.element_size()  # bytes of one row, from the shape: a rank that sends nothing may still receive
    for size in send.shape[1:]:
        row *= size
    count_collective("all_to_all", row * sum(c for d, c in enumerate(send_counts) if d != rank),
                     row * sum(c for s, c in enumerate(recv_counts) if s != rank))


@dataclass
class PendingExchange:
    """Posted sends and receives; ``recv`` holds the receive buffers, usable after :meth:`wait`."""

    works: list = field(default_factory=list)
    recv: dict = field(default_factory=dict)
    what: str = ""

    def wait(self) -> dict:
        try:
            for w in self.works:
                w.wait()
        except Exception as exc:  # gloo/NCCL raise RuntimeError subclasses on timeout or peer failure
            raise CommunicationError(
                f"hf_longctx: {self.what} failed; a peer rank of the sequence-parallel group probably raised "
                f"or died (see its log). Original error: {exc}"
            ) from exc
        self.works = []
        return self.recv


def post_exchange(
    sends: list[tuple[int, torch.Tensor, int]],
    recvs: list[tuple[object, int, torch.Tensor, int]],
    group: dist.ProcessGroup | None,
    what: str,
) -> PendingExchange:
    """Post ``sends`` [(dst, tensor, tag)] and ``recvs`` [(key, src, buffer, tag)] as one batch.

    Ranks are group ranks. Returns at once; receive buffers appear under their key after wait().
    """
    pending = PendingExchange(recv={key: buf for key, _, buf, _ in recvs}, what=what)
    _counters["sent_messages"] += len(sends)
    _counters["sent_bytes"] += sum(t.numel() * t.element_size() for _, t, _ in sends)
    _counters["recv_messages"] += len(recvs)
    _counters["recv_bytes"] += sum(b.numel() * b.element_size() for _, _, b, _ in recvs)
    pending.works = ops_for(group).post([(dst, t.contiguous(), tag) for dst, t, tag in sends],
                                        [(src, buf, tag) for _, src, buf, tag in recvs], what)
    return pending
