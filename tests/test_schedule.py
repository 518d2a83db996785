"""Schedules cover every visible (query, key) pair exactly once; DistFlashAttn balances the work."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_longctx.backends import distfa_schedule, get_backend
from hf_longctx.layout import PackedBatch, exchange_plan, shard_plan


def per_rank_work(plan, schedule):
    work = [0] * plan.world_size
    for step in schedule:
        for t in step:
            work[t.computed_by()] += exchange_plan(plan, t.q_rank, t.kv_rank, t.part, t.parts).work
    return work


@settings(max_examples=50, deadline=None)
@given(doc_lens=st.lists(st.integers(1, 200), min_size=1, max_size=20), world=st.integers(1, 7),
       backend=st.sampled_from(["ring", "zigzag", "distfa"]))
def test_schedule_covers_every_visible_pair_once(doc_lens, world, backend):
    spec = get_backend(backend)
    for strategy in spec.strategies:
        plan = shard_plan(PackedBatch.from_doc_lens(doc_lens), world, strategy)
        assert sum(per_rank_work(plan, spec.schedule(world))) == plan.batch.causal_pairs()


@pytest.mark.parametrize("world", [2, 3, 4, 5, 6, 8])
def test_distflash_balances_one_long_document_for_odd_and_even_world(world):
    plan = shard_plan(PackedBatch.from_doc_lens([1024 * world]), world, "contiguous")
    work = per_rank_work(plan, distfa_schedule(world))
    assert max(work) / min(work) < 1.01
    assert len(distfa_schedule(world)) == world // 2 + 1


def test_split_blocks_are_only_full_attention():
    plan = shard_plan(PackedBatch.from_doc_lens([64]), 2, "contiguous")
    with pytest.raises(ValueError, match="non-causal"):
        exchange_plan(plan, 0, 0, 0, 2)
    halves = [exchange_plan(plan, 1, 0, p, 2) for p in range(2)]
    assert [h.work for h in halves] == [16 * 32, 16 * 32]
    assert halves[0].q_ranges == ((0, 16),) and halves[1].q_ranges == ((16, 32),)
