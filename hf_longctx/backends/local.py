"""Backend ``local``: the engine's rotation schedule on a group of one rank.

Why it exists: a recipe with a sequence-parallel size of 1 names a backend like any other (``longctx_local``), and
its run goes through the shard plan, checks, op and attention-load logs of every backend, so one rank trains and
logs what a group does and the backends' tests have a one-rank member. A model call that has no sharded batch at
all has no plan either: it runs :func:`~.segments.segment_attention` instead.
"""

from __future__ import annotations

from .contract import ScheduleBackend
from .schedule import rotation_schedule


class LocalBackend(ScheduleBackend):
    """Backend ``local``: the rotation schedule on one rank (refused on a group of several)."""

    sequence_parallel = False

    def __init__(self) -> None:
        super().__init__("local", rotation_schedule,
                         "single-device attention over the whole sequence (sequence-parallel size 1)")
