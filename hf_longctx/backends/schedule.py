"""Schedules: which (query rank, key rank) attention blocks are computed at which step, and where.

A schedule is a list of steps; a step is a list of :class:`Task`. A task names one (query rank,
key rank) block of the shard plan's exchange table and who computes it:

- ``at_kv_owner=False``: the query rank computes; the key/value rows travel to it (ring style).
- ``at_kv_owner=True``: the key owner computes for the query rank; the query rows travel to it and
  the partial (out, lse) travels back (DistFlashAttn's helper tasks).

The executor (:mod:`.engine`) runs any schedule forward and backward, so an algorithm is just a
schedule builder. A block whose exchange is empty (documents that never meet) is skipped: no
transfer, no kernel.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Task:
    q_rank: int
    kv_rank: int
    at_kv_owner: bool = False

    def computed_by(self) -> int:
        return self.kv_rank if self.at_kv_owner else self.q_rank


Schedule = tuple[tuple[Task, ...], ...]


def rotation_schedule(world_size: int) -> Schedule:
    """Ring order: at step s every rank r computes its queries against the keys of rank r - s.

    Keys are sent directly by their owner (not forwarded), which moves the same bytes per step as a
    classic ring on a switched fabric and lets every block be skipped on its own.
    """
    return tuple(
        tuple(Task(r, (r - s) % world_size) for r in range(world_size)) for s in range(world_size)
    )


def distflash_schedule(world_size: int) -> Schedule:
    """DistFlashAttn's load-balanced causal schedule for contiguous placement.

    With contiguous chunks, query rank i needs key ranks 0..i. At step t (1 <= t <= P // 2) rank i
    computes its own block (i, i - t) when i >= t; the ranks i < t, idle otherwise, compute the block
    (i + P - t, i) of a busy rank with their own keys. Steps cover distances t and P - t, so every
    rank works at every step for odd P; for even P the last step only has distance P / 2.
    """
    p = world_size
    steps = [tuple(Task(r, r) for r in range(p))]
    for t in range(1, p // 2 + 1):
        own = [Task(i, i - t) for i in range(t, p)]
        helper = [Task(i + p - t, i, at_kv_owner=True) for i in range(t)] if p - t != t else []
        steps.append(tuple(own + helper))
    return tuple(steps)


def covered_blocks(schedule: Schedule) -> list[tuple[int, int]]:
    """Every (query rank, key rank) block of the schedule, with repetition (for coverage checks)."""
    return [(t.q_rank, t.kv_rank) for step in schedule for t in step]
