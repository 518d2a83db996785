"""Attention load per rank: visible (query, key) pairs each rank computes under a backend.

The max/mean of these is the straggler factor of one attention layer, what training logs report as
``attn_imbalance``. It is computed from the plan alone (no collective), by the backend's
:meth:`~.contract.Backend.attention_load`: schedule backends by their tasks, Ulysses by heads, CAD
by the tasks its scheduler gives each server, and the others (TASP, and ``auto``, whose candidates
share the placement's per-rank query work) by each rank's own queries against every key.
"""

from __future__ import annotations

from ..layout import ShardPlan
from .registry import get_backend


def attention_load(plan: ShardPlan, backend: str) -> list[int]:
    """Visible (query, key) pairs computed by each rank of ``plan`` under ``backend``."""
    return get_backend(backend).attention_load(plan)
