"""Schedules: which (query rank, key rank) attention blocks are computed at which step, and where.

A schedule is a list of steps; a step is a list of :class:`BlockTask`. A block task names one (query
rank, key rank) block of the shard plan's exchange table and who computes it:

- ``at_kv_owner=False``: the query rank computes; the key/value rows travel to it (ring style).
- ``at_kv_owner=True``: the key owner computes for the query rank; the query rows travel to it and
  the partial (out, lse) travels back (DistFlashAttn's helper tasks).
- ``part``/``parts``: the task covers one of ``parts`` equal slices of the block's query rows, so two
  ranks can share one block (only blocks of full, non-causal attention are split).

The executor (:mod:`.engine`) runs any schedule forward and backward, so an algorithm is just a
schedule builder. A block whose exchange is empty (documents that never meet) is skipped: no
transfer, no kernel.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockTask:
    """One (query rank, key rank) block of a step, and which of the two ranks computes it."""

    q_rank: int
    kv_rank: int
    at_kv_owner: bool = False
    part: int = 0
    parts: int = 1

    def computed_by(self) -> int:
        return self.kv_rank if self.at_kv_owner else self.q_rank


Schedule = tuple[tuple[BlockTask, ...], ...]


def rotation_schedule(world_size: int) -> Schedule:
    """Ring order: at step s every rank r computes its queries against the keys of rank r - s.

    Keys are sent directly by their owner (not forwarded), which moves the same bytes per step as a
    classic ring on a switched fabric and lets every block be skipped on its own.
    """
    return tuple(
        tuple(BlockTask(r, (r - s) % world_size) for r in range(world_size)) for s in range(world_size)
    )


def distfa_schedule(world_size: int) -> Schedule:
    """DistFlashAttn's load-balanced causal schedule for contiguous placement.

    With contiguous chunks, query rank i needs key ranks 0..i. At step t (1 <= t <= P // 2) rank i
    computes its own block (i, i - t) when i >= t; the ranks i < t, idle otherwise, compute the block
    (i + P - t, i) of a busy rank with their own keys. Steps cover distances t and P - t, so every
    rank works at every step for odd P. For even P the last step has only distance P / 2, which the
    original schedule leaves to the P / 2 busy ranks; here each of those blocks is split in two by
    query rows and its idle key owner computes the second half, so even P is balanced as well.
    """
    p = world_size
    steps = [tuple(BlockTask(r, r) for r in range(p))]
    for t in range(1, p // 2 + 1):
        if p - t != t:
            own = [BlockTask(i, i - t) for i in range(t, p)]
            helper = [BlockTask(i + p - t, i, at_kv_owner=True) for i in range(t)]
        else:  # distance P/2 only: share every block between its query owner and its key owner
            own = [BlockTask(i, i - t, part=0, parts=2) for i in range(t, p)]
            helper = [BlockTask(i, i - t, at_kv_owner=True, part=1, parts=2) for i in range(t, p)]
        steps.append(tuple(own + helper))
    return tuple(steps)
