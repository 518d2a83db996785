"""Shard plans place every token on exactly one rank, and zig-zag placements balance causal work."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_longctx.layout import SHARD_STRATEGIES, PackedBatch, clip_pair, exchange_plan, shard_plan

doc_lens_st = st.lists(st.integers(1, 300), min_size=1, max_size=30)


def test_packed_batch_fields():
    b = PackedBatch.from_doc_lens([3, 1, 4])
    assert b.num_tokens == 8 and b.num_docs == 3 and b.max_seqlen == 4
    assert b.cu_seqlens.tolist() == [0, 3, 4, 8] and b.cu_seqlens.dtype == torch.int32
    assert b.position_ids.tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    assert b.doc_ids.tolist() == [0, 0, 0, 1, 2, 2, 2, 2]
    assert PackedBatch.from_position_ids(b.position_ids.unsqueeze(0)) == b


@pytest.mark.parametrize("bad", [[], [3, 0], [-1]])
def test_packed_batch_rejects_empty_documents(bad):
    with pytest.raises(ValueError):
        PackedBatch.from_doc_lens(bad)


def test_documents_start_where_positions_do_not_step_by_one():
    """transformers' rule (find_packed_sequence_indices): any position that is not the previous + 1 starts one."""
    lens = lambda pos: PackedBatch.from_position_ids(torch.tensor(pos)).doc_lens  # noqa: E731
    assert lens([1, 2, 3]) == (3,)  # positions need not start at 0
    assert lens([0, 1, 3, 0]) == (2, 1, 1)
    assert lens([5, 6, 7, 3, 4]) == (3, 2)
    assert lens([0, 1, 2, 7, 8]) == (3, 2)
    assert lens([[4, 4, 4]]) == (1, 1, 1)
    with pytest.raises(ValueError, match="empty"):
        PackedBatch.from_position_ids(torch.tensor([], dtype=torch.long))


@settings(max_examples=60, deadline=None)
@given(doc_lens=doc_lens_st, world=st.integers(1, 7), strategy=st.sampled_from(SHARD_STRATEGIES))
def test_every_token_on_exactly_one_rank(doc_lens, world, strategy):
    batch = PackedBatch.from_doc_lens(doc_lens)
    plan = shard_plan(batch, world, strategy)
    idx = torch.cat([plan.local_indices(r) for r in range(world)])
    assert sorted(idx.tolist()) == list(range(batch.num_tokens))
    for r in range(world):
        slots = plan.rank_slots(r)
        # slots are back to back and each holds at most one piece per document, documents ascending
        assert [s.offset for s in slots] == [sum(x.length for x in slots[:i]) for i in range(len(slots))]
        for s in slots:
            docs = [p.doc for p in s.pieces]
            assert docs == sorted(set(docs))
            for p in s.pieces:
                d0 = batch.doc_starts[p.doc]
                assert d0 <= p.start < p.end <= d0 + batch.doc_lens[p.doc]


@settings(max_examples=40, deadline=None)
@given(doc_lens=doc_lens_st, world=st.integers(1, 7), strategy=st.sampled_from(SHARD_STRATEGIES))
def test_token_counts_nearly_equal(doc_lens, world, strategy):
    plan = shard_plan(PackedBatch.from_doc_lens(doc_lens), world, strategy)
    counts = plan.token_counts
    assert max(counts) - min(counts) <= 2


def _rank_work(plan, rank):
    return sum(exchange_plan(plan, rank, s).work for s in range(plan.world_size))


@settings(max_examples=40, deadline=None)
@given(doc_lens=doc_lens_st, world=st.integers(1, 6), strategy=st.sampled_from(SHARD_STRATEGIES))
def test_exchange_work_adds_up_to_causal_pairs(doc_lens, world, strategy):
    """Pairs cover every visible (query, key) pair exactly once: their work sums to the causal total."""
    batch = PackedBatch.from_doc_lens(doc_lens)
    plan = shard_plan(batch, world, strategy)
    assert sum(_rank_work(plan, r) for r in range(world)) == batch.causal_pairs()


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_zigzag_balances_one_long_document(world):
    plan_c = shard_plan(PackedBatch.from_doc_lens([4096 * world]), world, "contiguous")
    plan_z = shard_plan(PackedBatch.from_doc_lens([4096 * world]), world, "zigzag")
    work_c = [_rank_work(plan_c, r) for r in range(world)]
    work_z = [_rank_work(plan_z, r) for r in range(world)]
    assert max(work_c) / min(work_c) > world  # last rank does ~2P-1 times the first
    assert max(work_z) / min(work_z) < 1.01


@pytest.mark.parametrize("world", [2, 3, 5])
def test_doc_zigzag_balances_packed_documents(world):
    rng = random.Random(0)
    lens = [rng.choice([50, 200, 3000, 9000]) for _ in range(40)]
    plan_z = shard_plan(PackedBatch.from_doc_lens(lens), world, "zigzag")
    plan_d = shard_plan(PackedBatch.from_doc_lens(lens), world, "doc_zigzag")
    work_z = [_rank_work(plan_z, r) for r in range(world)]
    work_d = [_rank_work(plan_d, r) for r in range(world)]
    assert max(work_d) / min(work_d) < 1.02
    assert max(work_d) / min(work_d) <= max(work_z) / min(work_z)


def test_documents_inside_shards_need_no_exchange():
    plan = shard_plan(PackedBatch.from_doc_lens([10, 6] * 4), 4, "contiguous")  # every shard = one 10 + one 6
    for r in range(4):
        for s in range(4):
            ex = exchange_plan(plan, r, s)
            assert (ex.pairs == ()) == (r != s)
            assert ex.num_kv_rows == (16 if r == s else 0)


def test_exchange_sends_only_needed_rows():
    # One document crosses the boundary between rank 0 and rank 1 by 3 tokens of rank 0.
    plan = shard_plan(PackedBatch.from_doc_lens([7, 6, 3]), 2, "contiguous")  # shards [0,8) and [8,16)
    ex = exchange_plan(plan, 1, 0)
    assert ex.kv_ranges == ((7, 8),)  # only the first token of doc 1 lives on rank 0
    (pair,) = ex.pairs
    assert not pair.causal and (pair.q_start, pair.q_end) == (0, 5) and pair.work == 5


@pytest.mark.parametrize("strategy", ["spiral", "Zigzag"])
def test_unknown_strategy_is_named(strategy):
    with pytest.raises(ValueError, match="unknown shard strategy"):
        shard_plan(PackedBatch.from_doc_lens([4]), 2, strategy)


# ----------------------------------------------------------------------------- sliding window


def _visible_global_pairs(plan, q_rank, kv_rank, ex):
    """The (query token, key token) pairs an exchange's kernel calls compute, in global token indices."""
    q_idx = plan.local_indices(q_rank).tolist()
    k_local = [r for a, b in ex.kv_ranges for r in range(a, b)]  # transfer buffer row -> key rank local row
    k_idx = plan.local_indices(kv_rank).tolist()
    seen = []
    for p in ex.pairs:
        for i in range(len(p.cu_q) - 1):
            sq, sk = p.cu_q[i + 1] - p.cu_q[i], p.cu_k[i + 1] - p.cu_k[i]
            for a in range(sq):
                for b in range(sk):
                    diag = a + sk - sq
                    if (p.causal and b > diag) or (p.window is not None and b <= diag - p.window):
                        continue
                    seen.append((q_idx[p.q_start + p.cu_q[i] + a], k_idx[k_local[p.k_start + p.cu_k[i] + b]]))
    return seen


def _window_pairs(batch, window):
    """Brute force: (p, s) visible under per-document causal masking with a sliding window."""
    out = set()
    for start, n in zip(batch.doc_starts, batch.doc_lens):
        for p in range(start, start + n):
            out |= {(p, s) for s in range(max(start, p - window + 1), p + 1)}
    return out


@settings(max_examples=60, deadline=None)
@given(doc_lens=st.lists(st.integers(1, 40), min_size=1, max_size=8), world=st.integers(1, 5),
       strategy=st.sampled_from(SHARD_STRATEGIES), window=st.integers(1, 45))
def test_windowed_pairs_compute_each_visible_pair_once_and_send_only_keys_in_reach(doc_lens, world, strategy,
                                                                                   window):
    """Under sliding_window = W every (query, key) pair with 0 <= q - k < W inside a document is
    computed exactly once, nothing else is, and an exchange sends exactly the key rows some query reads
    (so a block whose keys are all out of reach moves nothing and runs no kernel)."""
    batch = PackedBatch.from_doc_lens(doc_lens)
    plan = shard_plan(batch, world, strategy).with_window(window)
    seen, work = [], 0
    for r in range(world):
        for s in range(world):
            ex = exchange_plan(plan, r, s)
            pairs = _visible_global_pairs(plan, r, s, ex)
            seen += pairs
            work += ex.work
            assert ex.work == len(pairs)
            k_idx = plan.local_indices(s).tolist()
            sent = {k_idx[row] for a, b in ex.kv_ranges for row in range(a, b)}
            assert sent == {k for _, k in pairs}, "rows sent that no query reads, or rows missing"
            if r != s and not ex.pairs:
                assert ex.num_kv_rows == 0
            if r != s and ex.pairs and not any(p.causal for p in ex.pairs):
                # distfa shares such a block by query rows, TASP by key rows: the parts add up
                halves = [exchange_plan(plan, r, s, part, 2) for part in range(2)]
                assert sorted(pairs) == sorted(x for h in halves for x in _visible_global_pairs(plan, r, s, h))
                cut = ex.num_kv_rows // 2
                parts = [replace(ex, pairs=tuple(c for p in ex.pairs for c in clip_pair(p, k_lo=lo, k_hi=hi)))
                         for lo, hi in ((0, cut), (cut, ex.num_kv_rows))]
                assert sorted(pairs) == sorted(x for h in parts for x in _visible_global_pairs(plan, r, s, h))
    assert sorted(seen) == sorted(_window_pairs(batch, window))
    assert work == batch.causal_pairs(window)


def test_windowed_block_out_of_reach_has_no_pairs_and_window_views_are_cached():
    # one document of 24 tokens on 3 ranks (8 each): with W = 4 rank 2 reads only rows 5..7 of rank 1
    base = shard_plan(PackedBatch.from_doc_lens([24]), 3, "contiguous")
    plan = base.with_window(4)
    assert exchange_plan(plan, 2, 0).pairs == () and exchange_plan(plan, 2, 0).num_kv_rows == 0
    assert exchange_plan(plan, 2, 1).kv_ranges == ((5, 8),)
    assert exchange_plan(base, 2, 0).num_kv_rows == 8  # without the window rank 2 reads all of rank 0
    # one view per window, cached on the unwindowed plan; a window as long as any document is no window
    assert base.with_window(4) is plan and plan.with_window(4) is plan and plan.with_window(None) is base
    assert base.with_window(24) is base and base.with_window(7) is not plan and plan.window == 4
    for bad in (0, -2, 2.0, True):
        with pytest.raises(ValueError, match="sliding window"):
            base.with_window(bad)


def test_plans_and_their_window_views_are_freed_without_the_garbage_collector():
    """Device tensors cached on a plan go with it: no reference cycle runs through a plan or its views."""
    import gc
    import weakref

    gc.collect()
    gc.disable()
    try:
        base = shard_plan(PackedBatch.from_doc_lens([24, 9]), 3, "contiguous")
        view = base.with_window(4)
        exchange_plan(view, 2, 1)
        refs = [weakref.ref(base), weakref.ref(view)]
        del base, view
        assert [r() for r in refs] == [None, None]
        # a view that outlives its unwindowed plan still finds one (an equal plan that holds the view)
        view = shard_plan(PackedBatch.from_doc_lens([24, 9]), 3, "contiguous").with_window(4)
        again = view.with_window(None)
        assert again.window is None and again.slots == view.slots and again.with_window(4) is view
        assert view.with_window(7).window == 7 and view.with_window(4) is view
    finally:
        gc.enable()
