"""The ranks of a group price CAD's schedule together and make the schedule one rank makes alone.

Every rank makes the same schedule from the same documents; on a measured cost model the refinement's pricing of
candidate moves is most of that host time. With a share, each rank prices its part of every batch of moves and one
all_reduce gives all ranks every price. The tests check what that must keep: the very tasks a lone rank chooses
(screened steps too), less pricing per rank, results equal to one device through the backend, and a rank whose
pricing fails stopping its peers with it instead of leaving them in a collective.
"""

from __future__ import annotations

import pytest
import torch
from test_cad_call_split import DOC_LENS, make_tensors, single_device

from hf_longctx.backends import sequence_parallel_attention
from hf_longctx.backends.cad import refine
from hf_longctx.backends.cad.cost_model import ProfiledCostModel
from hf_longctx.backends.cad.options import CadOptions
from hf_longctx.backends.cad.refine import refine_in_time
from hf_longctx.backends.cad.runtime import _server_time, cad_schedule
from hf_longctx.backends.cad.scheduler import assign_servers
from hf_longctx.backends.cad.shared_pricing import PricingShare, priced_together
from hf_longctx.backends.cad.tasks import docs_per_rank
from hf_longctx.kernels.launch import LaunchGrid
from hf_longctx.layout import PackedBatch, shard_plan

from distributed import run_distributed

# a profile whose calls have tails on a 3-slot machine: the refinement has something to move at 3 servers
CELLS = dict(q_lens=[16, 64, 256, 1024], kv_lens=[16, 64, 256, 1024],
             table=[[0.2, 0.5, 1.5, 5.0], [0.0, 1.5, 5.0, 18.0], [0.0, 0.0, 20.0, 70.0], [0.0, 0.0, 0.0, 300.0]],
             interpolate="rate", tile=16)
MODEL = ProfiledCostModel.from_grid(**CELLS, launch=LaunchGrid((16, 16), (16, 16), 0.3, 3), launch_heads=4)
OPTIONS = CadOptions(eps=0.0, min_shard=16, cost_model=MODEL)


def rows(tasks) -> set:
    return {(t.owner, t.piece, t.q_start, t.q_end, t.key_lo, t.key_hi, t.server) for t in tasks}


def refined(plan, share, screen=None) -> tuple[list, int]:
    """(tasks, server pricings made by this rank) of refining the plan's first schedule."""
    first = assign_servers(docs_per_rank(plan), plan.world_size, eps=0.0, cost_model=MODEL, min_shard=16)
    count = [0]

    def server_cost(ts):
        count[0] += 1
        return _server_time(plan, ts, OPTIONS, MODEL, None)

    return refine_in_time(plan, first.tasks, MODEL, server_cost, screen=screen, share=share), count[0]


def check_same_tasks_less_pricing(rank, world):
    plan = shard_plan(PackedBatch.from_doc_lens(DOC_LENS), world, "cad")
    first = assign_servers(docs_per_rank(plan), world, eps=0.0, cost_model=MODEL, min_shard=16)
    alone, alone_count = refined(plan, None)
    together, together_count = refined(plan, PricingShare(None, rank, world))
    assert rows(alone) != rows(first.tasks), "the refinement moved nothing: the test tests nothing"
    assert rows(together) == rows(alone) and len(together) == len(alone)
    assert together_count < alone_count * 0.6, (together_count, alone_count)
    # screened steps (here every step): priced a batch at a time, walked in order as one rank walks them
    refine.SCREEN_ABOVE = 0
    alone, alone_count = refined(plan, None, screen=1)
    together, together_count = refined(plan, PricingShare(None, rank, world), screen=1)
    assert rows(together) == rows(alone)


def test_ranks_that_price_together_choose_the_tasks_one_rank_chooses_alone():
    run_distributed(3, check_same_tasks_less_pricing)


def test_a_batch_of_moves_priced_at_once_is_walked_as_one_rank_walks_them(monkeypatch):
    """A group prices a step's moves a batch at a time (here 5 ranks, stood in for by pricing every item in this
    process: the collective only spreads the work). Walked in order, the batch gives the lone rank's tasks, also
    where a screened step stops in the middle of a batch whose later moves would have won."""
    monkeypatch.setattr(refine, "priced_together", lambda price, items, share: [float(price(x)) for x in items])
    monkeypatch.setattr(refine, "SCREEN_ABOVE", 0)  # every step screened
    plan = shard_plan(PackedBatch.from_doc_lens([36] * 12), 5, "cad")
    for screen in (None, 1, 2):
        alone, alone_count = refined(plan, None, screen)
        batched, batched_count = refined(plan, PricingShare(None, 0, 5), screen)
        assert rows(batched) == rows(alone), screen
        assert batched_count > alone_count  # whole batches priced: moves a lone rank skipped or never reached


def test_a_step_without_moves_ends_the_refinement_alone_and_together(monkeypatch):
    """The busiest server's only task is a key cut's rectangle whose rows the other server computes over their other
    keys: no move is possible (a server computes a row once), with or without a group pricing."""
    from hf_longctx.backends.cad.tasks import CadTask

    monkeypatch.setattr(refine, "priced_together", lambda price, items, share: [float(price(x)) for x in items])
    plan = shard_plan(PackedBatch.from_doc_lens([128]), 2, "cad")
    tasks = [CadTask(1, 0, 0, 64, 0, key_lo=0, key_hi=64), CadTask(1, 0, 0, 64, 1, key_lo=64),
             CadTask(0, 0, 0, 64, 1)]

    def server_cost(ts):  # server 0 made the busiest
        return sum((t.q_end - t.q_start) * (10.0 if t.server == 0 else 1.0) for t in ts)

    for share in (None, PricingShare(None, 0, 2)):
        assert refine_in_time(plan, tasks, MODEL, server_cost, share=share) == tasks


def check_backend_prices_together(rank, world):
    batch = PackedBatch.from_doc_lens(DOC_LENS)
    q, k, v, dout = make_tensors(batch)
    want = single_device(batch, q, k, v, dout)
    plan = shard_plan(batch, world, "cad")
    idx = plan.local_indices(rank)
    ql, kl, vl = (t[idx].clone().requires_grad_() for t in (q, k, v))
    out = sequence_parallel_attention(ql, kl, vl, plan=plan, backend="cad", kernel="reference", options=OPTIONS)
    out.backward(dout[idx])
    for name, got, ref in (("out", out, want[0]), ("dq", ql.grad, want[1]), ("dk", kl.grad, want[2]),
                           ("dv", vl.grad, want[3])):
        torch.testing.assert_close(got, ref[idx], rtol=1e-9, atol=1e-9, msg=lambda m, n=name: f"{n} rank {rank} {m}")
    # the run's schedule (made with the group, cached on the plan) is the one a lone rank makes
    lone = cad_schedule(shard_plan(batch, world, "cad"), OPTIONS)
    first = assign_servers(docs_per_rank(plan), world, eps=0.0, cost_model=MODEL, min_shard=16)
    assert rows(lone.tasks) != rows(first.tasks), "no move was refined: the test tests nothing"
    assert rows(cad_schedule(plan, OPTIONS).tasks) == rows(lone.tasks)


def test_the_backend_prices_its_schedule_over_the_group_and_stays_exact():
    run_distributed(3, check_backend_prices_together)


def check_a_failing_rank(rank, world):
    def price(x: int) -> float:
        if rank == 1 and x == 4:
            raise ValueError("no price for item 4")
        return 0.5 * x

    if rank == 1:
        with pytest.raises(ValueError, match="no price for item 4"):
            priced_together(price, list(range(6)), PricingShare(None, rank, world))
    else:
        with pytest.raises(RuntimeError, match="failed on 1 other rank"):
            priced_together(price, list(range(6)), PricingShare(None, rank, world))
    # the group is still usable: every rank left the same collective
    assert priced_together(lambda x: 0.5 * x, list(range(5)), PricingShare(None, rank, world)) == \
        [0.0, 0.5, 1.0, 1.5, 2.0]


def test_a_rank_whose_pricing_fails_stops_its_peers_with_it():
    run_distributed(3, check_a_failing_rank, timeout_s=20.0)


def test_alone_every_item_is_priced_here_and_a_share_needs_a_rank_in_its_world():
    assert priced_together(lambda x: x * 2, [1, 2, 3], None) == [2.0, 4.0, 6.0]
    with pytest.raises(ValueError, match="0 <= rank < world"):
        PricingShare(None, 3, 3)


def test_items_are_dealt_round_robin_from_call_to_call(monkeypatch):
    """Steps of fewer moves than ranks are common; dealing each call from rank 0 would give rank 0 all of them. The
    deal goes on where the last call stopped, so every rank prices its share over the calls (here the collective is
    left out: only who prices what is looked at)."""
    from hf_longctx.backends.cad import shared_pricing

    monkeypatch.setattr(shared_pricing.dist, "all_reduce", lambda tensor, group=None: None)
    priced_by = {}
    for rank in range(3):
        share = PricingShare(None, rank, 3)
        mine = []
        for call in range(4):  # calls of 1, 2, 1 and 4 items
            items = [(call, i) for i in range((1, 2, 1, 4)[call])]
            priced_together(lambda x, mine=mine: mine.append(x) or 0.0, items, share)
        priced_by[rank] = mine
    assert sorted(x for mine in priced_by.values() for x in mine) == sorted(
        (call, i) for call in range(4) for i in range((1, 2, 1, 4)[call]))  # each item by exactly one rank
    assert [len(mine) for mine in priced_by.values()] == [3, 3, 2]
