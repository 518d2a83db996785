"""Attention load per rank: visible (query, key) pairs each rank computes under a backend.

The max/mean of these is the straggler factor of one attention layer, what training logs report as
``attn_imbalance``. It is computed from the plan alone (no collective), for every backend: rotation
schedules by their tasks; a backend with a runner of its own by the runner's ``attention_load(plan)``
when it has one (Ulysses: by heads; CAD: by the tasks its scheduler gives each server); otherwise
(TASP, and ``auto``, whose candidates share the placement's per-rank query work) by each rank's own
queries against every key.
"""

from __future__ import annotations

import importlib

from ..layout import ShardPlan, exchange_plan
from .registry import get_backend


def own_query_load(plan: ShardPlan) -> list[int]:
    """Pairs of each rank's own queries against every key: the load when nobody computes for others."""
    world = plan.world_size
    return [sum(exchange_plan(plan, r, s).work for s in range(world)) for r in range(world)]


def attention_load(plan: ShardPlan, backend: str) -> list[int]:
    """Visible (query, key) pairs computed by each rank of ``plan`` under ``backend``."""
    spec = get_backend(backend)
    if spec.schedule is not None:
        work = [0] * plan.world_size
        for step in spec.schedule(plan.world_size):
            for task in step:
                work[task.computed_by()] += exchange_plan(plan, task.q_rank, task.kv_rank, task.part,
                                                          task.parts).work
        return work
    if spec.runner is not None:
        runner = importlib.import_module(f"{__package__}.{spec.runner}")
        if hasattr(runner, "attention_load"):
            return runner.attention_load(plan)
    return own_query_load(plan)
