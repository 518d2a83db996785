"""Backend ``local``: the engine's rotation schedule on a group of one rank.

The registered single-device backend, for recipes with a sequence-parallel size of 1; it goes through
the plan, checks and op of every backend. A model call that has no sharded batch at all runs
:func:`~.one_process.one_process_attention` instead.
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
