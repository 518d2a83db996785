"""The backends this package ships, registered in the order ``auto`` tries its candidates.

Ring and zigzag run the same rotation schedule, so ``auto`` measures ring on contiguous placements and
zigzag on zig-zag ones, never both; the first candidate of a placement is the plain ring that a tie keeps.
"""

from __future__ import annotations

from .auto import AUTO
from .cad.runtime import CadBackend
from .contract import ScheduleBackend
from .local import LocalBackend
from .registry import register_backend
from .schedule import distfa_schedule, rotation_schedule
from .tasp import TaspBackend
from .ulysses import UlyssesBackend
from .ulysses_mesh import OUTER_BACKENDS, UlyssesMeshBackend

register_backend(LocalBackend())
register_backend(ScheduleBackend(
    "ring", rotation_schedule, "ring attention: keys and values of rank r - s visit rank r at step s",
    auto_candidate_for=("contiguous",),
))
register_backend(ScheduleBackend(
    "zigzag", rotation_schedule,
    "ring attention over zig-zag placement (doc_zigzag placement: per-document zig-zag ring)",
    default_strategy="zigzag", auto_candidate_for=("zigzag", "doc_zigzag"),
))
register_backend(ScheduleBackend(
    "distfa", distfa_schedule,
    "DistFlashAttn: contiguous chunks, idle ranks compute for busy ones, P // 2 + 1 steps",
    strategies=("contiguous",), auto_candidate_for=("contiguous",),
))
register_backend(UlyssesBackend())
register_backend(TaspBackend())
register_backend(CadBackend())
for _outer in OUTER_BACKENDS:  # Ulysses inside a node x a ring-family backend or CAD across nodes
    register_backend(UlyssesMeshBackend(_outer))
register_backend(AUTO)
