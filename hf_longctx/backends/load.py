"""Attention load per rank: visible (query, key) pairs each rank computes under a backend.

The max/mean of these is the straggler factor of one attention layer, what training logs report as
``attn_imbalance``. It is computed from the plan alone (no collective), for every backend: rotation
schedules by their tasks, TASP (and ``auto``, whose candidates share the placement's per-rank query
work) by each rank's own queries against every key, Ulysses by heads (every rank computes the whole
sequence for 1/P of the heads), CAD by the tasks its scheduler gives each server.
"""

from __future__ import annotations

from ..layout import ShardPlan, exchange_plan
from .registry import get_backend


def _own_queries(plan: ShardPlan) -> list[int]:
    world = plan.world_size
    return [sum(exchange_plan(plan, r, s).work for s in range(world)) for r in range(world)]


def _cad(plan: ShardPlan) -> list[int]:
    from .cad import runtime

    work = [0] * plan.world_size
    for t in runtime.prepare(plan, {})["tasks"]:
        work[t.server] += round(runtime.task_cost(plan, t))
    return work


def attention_load(plan: ShardPlan, backend: str) -> list[int]:
    """Visible (query, key) pairs computed by each rank of ``plan`` under ``backend``."""
    spec = get_backend(backend)
    world = plan.world_size
    if spec.schedule is not None:
        work = [0] * world
        for step in spec.schedule(world):
            for task in step:
                work[task.computed_by()] += exchange_plan(plan, task.q_rank, task.kv_rank, task.part,
                                                          task.parts).work
        return work
    if spec.name == "ulysses":
        total = plan.batch.causal_pairs()
        return [total // world + (r < total % world) for r in range(world)]
    if spec.name == "cad":
        return _cad(plan)
    return _own_queries(plan)
