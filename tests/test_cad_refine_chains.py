"""CAD's refinement, where no single move lowers the busiest server: ejection chains.

A busiest server holding one long task can give away no part that costs its receiver less than it saves the busiest
(on a GPU: a thin cut of rows over a long prefix runs slowly, a rectangle is a call of its own). Here every task costs
its rows plus a fixed cost, so a cut adds that fixed cost to whichever server computes the new part: the least busy
servers all sit so close below the busiest that any part of its one task leaves them above it. A chain gives such a
part to a receiver anyway, which then passes its own short tasks on to the others until all end below the busiest's
old time. The tests check that the busiest falls only so (single moves alone leave it where it was), that every
(query row, key) pair is still computed exactly once, that a receiver may pass its excess on in several moves, that
ranks pricing together take the same chain, and that no chain is tried near the mean.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from hf_longctx.backends.cad import refine
from hf_longctx.backends.cad.cost_model import FlopsCostModel
from hf_longctx.backends.cad.refine import refine_in_time
from hf_longctx.backends.cad.shared_pricing import PricingShare
from hf_longctx.backends.cad.tasks import CadTask, all_pieces
from hf_longctx.layout import PackedBatch, shard_plan

WORLD = 4
# rank 0 holds one 1024-row document; ranks 1-3 two of 32 rows and one of 960 (every rank 1024 rows)
DOC_LENS = [1024] + [32, 32, 960] * (WORLD - 1)
FIXED = 64.0  # what every task costs beyond its rows: a part cut off costs its receiver this much more


def home_tasks(plan) -> list[CadTask]:
    """Every piece whole, on its own rank: server 0 computes the long document alone."""
    return [CadTask(r, i, 0, p.length, r) for r in range(WORLD) for i, (p, _) in enumerate(all_pieces(plan)[r])]


def server_cost_for(long_row: float):
    """A server's time: per task its rows (each row of rank 0's long document costing ``long_row``) plus
    :data:`FIXED`. With ``long_row`` 1.3, the busiest (1395) gives its first 128 rows to a server at 1216, which
    then stands at 1446 and gives one 32-row document (96) to another; with 1.24 it must give two."""
    def server_cost(tasks) -> float:
        return sum((t.q_end - t.q_start) * (long_row if t.owner == 0 else 1.0) + FIXED for t in tasks)
    return server_cost


def times(tasks, server_cost) -> list[float]:
    return [server_cost([t for t in tasks if t.server == s]) for s in range(WORLD)]


def assert_every_pair_once(plan, tasks) -> None:
    """Each query row's keys, over the tasks that compute it, tile its causal prefix [document start, row] with no
    gap and no overlap; and no server computes a row twice."""
    spans = defaultdict(list)
    for t in tasks:
        piece, _ = all_pieces(plan)[t.owner][t.piece]
        doc_start = plan.batch.doc_starts[piece.doc]
        for q in range(t.q_start, t.q_end):
            row = piece.start + q
            spans[row].append((doc_start + t.key_lo, doc_start + t.key_hi if t.is_rect else row + 1, t.server))
    for doc, start in enumerate(plan.batch.doc_starts):
        for row in range(start, start + plan.batch.doc_lens[doc]):
            parts = sorted(spans.pop(row))
            ends = [start] + [last for _, last, _ in parts]
            assert [first for first, _, _ in parts] == ends[:-1] and ends[-1] == row + 1, (row, parts)
            assert len({server for _, _, server in parts}) == len(parts), (row, parts)
    assert not spans


@pytest.mark.parametrize("long_row", [1.3, 1.24])
def test_a_busiest_no_single_move_lowers_is_lowered_by_a_chain_and_every_pair_is_computed_once(long_row):
    plan = shard_plan(PackedBatch.from_doc_lens(DOC_LENS), WORLD, "cad")
    tasks, server_cost = home_tasks(plan), server_cost_for(long_row)
    before = times(tasks, server_cost)
    assert before.index(max(before)) == 0 and max(before) > refine.CHAIN_ABOVE * sum(before) / WORLD
    # alone, no move helps: every part of server 0's one task leaves its receiver above server 0's time
    assert refine_in_time(plan, tasks, FlopsCostModel(), server_cost, chains=False) == tasks
    chained = refine_in_time(plan, tasks, FlopsCostModel(), server_cost)
    after = times(chained, server_cost)
    assert max(after) < max(before) and after[0] < before[0], (before, after)
    # the long document's first rows went to a receiver, which passed a short document of its own on
    moved = [t for t in chained if t.server != t.owner]
    assert any(t.owner == 0 for t in moved) and any(t.owner != 0 for t in moved), moved
    assert_every_pair_once(plan, chained)
    assert sum(after) == pytest.approx(sum(before) + FIXED * (len(chained) - len(tasks)))  # rows moved, not lost


def test_a_receiver_passes_its_excess_on_in_several_moves(monkeypatch):
    """With ``long_row`` 1.24 the receiver's excess (158.72 + 64 over its 1216) fits nowhere in one piece: one
    32-row document leaves it above the busiest's old time and a 128-row cut of its long one leaves the server given
    to above it. Two documents to two servers do: with one move per chain the busiest stays where it was."""
    plan = shard_plan(PackedBatch.from_doc_lens(DOC_LENS), WORLD, "cad")
    tasks, server_cost = home_tasks(plan), server_cost_for(1.24)
    monkeypatch.setattr(refine, "CHAIN_SHEDS", 1)
    assert refine_in_time(plan, tasks, FlopsCostModel(), server_cost) == tasks
    monkeypatch.setattr(refine, "CHAIN_SHEDS", 2)
    chained = refine_in_time(plan, tasks, FlopsCostModel(), server_cost)
    assert max(times(chained, server_cost)) < max(times(tasks, server_cost))
    assert_every_pair_once(plan, chained)


def test_no_chain_is_tried_while_the_busiest_is_near_the_mean(monkeypatch):
    """Chains price many moves for little where the balance is already close (SFT at 64 servers, 0.0005 below
    1.003 for seconds of host time): below ``CHAIN_ABOVE`` times the mean, the refinement stops where single moves
    do."""
    plan = shard_plan(PackedBatch.from_doc_lens(DOC_LENS), WORLD, "cad")
    tasks, server_cost = home_tasks(plan), server_cost_for(1.3)
    before = times(tasks, server_cost)
    monkeypatch.setattr(refine, "CHAIN_ABOVE", max(before) / (sum(before) / WORLD) + 1e-3)
    assert refine_in_time(plan, tasks, FlopsCostModel(), server_cost) == tasks


@pytest.mark.parametrize("screen", [None, 1])
def test_ranks_pricing_together_take_the_chain_one_rank_takes(monkeypatch, screen):
    """A group prices a chain's moves a batch at a time (here 5 ranks stood in for by pricing every item in this
    process, as in test_cad_shared_pricing): walked in order, the same chain and the same tasks as one rank alone,
    also with every step screened."""
    monkeypatch.setattr(refine, "priced_together", lambda price, items, share: [float(price(x)) for x in items])
    monkeypatch.setattr(refine, "SCREEN_ABOVE", 0)
    plan = shard_plan(PackedBatch.from_doc_lens(DOC_LENS), WORLD, "cad")
    for long_row in (1.3, 1.24):
        tasks, server_cost = home_tasks(plan), server_cost_for(long_row)
        alone = refine_in_time(plan, tasks, FlopsCostModel(), server_cost, screen=screen)
        together = refine_in_time(plan, tasks, FlopsCostModel(), server_cost, screen=screen,
                                  share=PricingShare(None, 0, 5))
        assert together == alone and alone != tasks


def test_the_schedules_option_turns_chains_off_and_keys_its_cache(monkeypatch):
    """``options["refine_chains"]`` reaches the refinement (default on), and a schedule made without chains is
    not served from the cache to a caller who wants them."""
    from hf_longctx.backends.cad import runtime
    from hf_longctx.backends.cad.launch_cost import LaunchCostModel, PhaseTerms
    from hf_longctx.kernels.launch import LaunchGrid

    seen = []
    real = runtime.refine_in_time

    def spy(*args, **kwargs):
        seen.append(kwargs["chains"])
        return real(*args, **kwargs)

    monkeypatch.setattr(runtime, "refine_in_time", spy)
    model = LaunchCostModel(LaunchGrid(forward_tile=(16, 16), backward_tile=(16, 16), slots=4), 2,
                            PhaseTerms(1e-3, block=1e-3, call=0.05), PhaseTerms(2e-3, block=2e-3, call=0.08))
    plan = shard_plan(PackedBatch.from_doc_lens(DOC_LENS), WORLD, "cad")
    runtime.cad_schedule(plan, {"cost_model": model, "eps": 0.01, "refine_chains": False})
    runtime.cad_schedule(plan, {"cost_model": model, "eps": 0.01})
    runtime.cad_schedule(plan, {"cost_model": model, "eps": 0.01, "refine_chains": True})  # the cached one
    assert seen == [False, True]
