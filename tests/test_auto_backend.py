"""``backend="auto"`` times the candidates on the real inputs, every rank agrees, and the result is exact."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_backends import make_problem, reference

from hf_longctx.backends import auto, sequence_parallel_attention
from hf_longctx.layout import PackedBatch, shard_plan

from distributed import run_distributed


def check_auto_is_exact_and_agreed(rank, world):
    auto.reset_auto_decisions()
    for strategy in ("zigzag", "contiguous"):
        batch, q, k, v, dout = make_problem(7 + world, world, torch.float64)
        ref_out, ref_dq, ref_dk, ref_dv = reference(batch, q, k, v, dout)
        plan = shard_plan(batch, world, strategy)
        idx = plan.local_indices(rank)
        ql, kl, vl = (t[idx].clone().requires_grad_() for t in (q, k, v))
        out = sequence_parallel_attention(ql, kl, vl, plan=plan, backend="auto")
        out.backward(dout[idx])
        for got, want in ((out, ref_out), (ql.grad, ref_dq), (kl.grad, ref_dk), (vl.grad, ref_dv)):
            torch.testing.assert_close(got, want[idx], rtol=1e-9, atol=1e-9)
    decisions = auto.auto_decisions()
    assert len(decisions) == 2
    chosen = [d["backend"] for d in decisions]
    gathered = [None] * world
    dist.all_gather_object(gathered, chosen)
    assert all(g == chosen for g in gathered), f"ranks chose differently: {gathered}"
    assert set(decisions[0]["seconds"]) | set(decisions[1]["seconds"]) == {"zigzag", "tasp", "ring", "distfa"}


@pytest.mark.parametrize("world", [2, 3])
def test_auto_is_exact_and_every_rank_picks_the_same_backend(world):
    run_distributed(world, check_auto_is_exact_and_agreed)


def check_slowest_rank_decides(rank, world):
    """tasp is fastest on rank 0 but slowest on rank 1: the verdict must follow the slowest rank."""
    auto.reset_auto_decisions()
    batch, q, k, v, _ = make_problem(3, world, torch.float64)
    plan = shard_plan(batch, world, "zigzag")
    idx = plan.local_indices(rank)
    imposed = {"zigzag": 2.0, "tasp": 1.0 if rank == 0 else 5.0}
    calls = []

    def forward(name):
        calls.append(name)

    def timer(fn, device):
        fn()
        return imposed[calls[-1]]

    chosen = auto.choose_backend(q[idx], k[idx], v[idx], plan, None, forward, timer=timer)
    assert chosen == "zigzag"
    assert auto.auto_decisions()[0]["seconds"] == {"zigzag": 2.0, "tasp": 5.0}
    # the verdict is cached: a second call for the same shape times nothing
    calls.clear()
    assert auto.choose_backend(q[idx], k[idx], v[idx], plan, None, forward, timer=timer) == "zigzag"
    assert calls == []
    # a sliding window changes the problem: its layers get a verdict of their own, the others keep theirs
    imposed["tasp"] = 1.0
    assert auto.choose_backend(q[idx], k[idx], v[idx], plan.with_window(3), None, forward, timer=timer) == "tasp"
    assert calls and auto.choose_backend(q[idx], k[idx], v[idx], plan, None, forward, timer=timer) == "zigzag"


def test_the_slowest_rank_decides():
    run_distributed(2, check_slowest_rank_decides)


def test_a_tie_keeps_the_plain_ring():
    assert auto._pick(["zigzag", "tasp"], [1.00, 0.99], margin=0.03) == "zigzag"
    assert auto._pick(["zigzag", "tasp"], [1.00, 0.90], margin=0.03) == "tasp"
    assert auto._pick(["ring", "distfa", "tasp"], [1.0, 0.5, 0.6], margin=0.03) == "distfa"


def test_candidates_follow_the_placement():
    batch = PackedBatch.from_doc_lens([50, 30, 20])
    assert auto.candidates_for(shard_plan(batch, 3, "zigzag")) == ["zigzag", "tasp"]
    assert auto.candidates_for(shard_plan(batch, 3, "contiguous")) == ["ring", "distfa", "tasp"]
    with pytest.raises(ValueError, match="no candidate for plan strategy 'cad'"):
        auto.candidates_for(shard_plan(batch, 3, "cad"))


def test_a_verdict_dies_with_its_group():
    """A later group may take a freed group's address: keyed by ``id``, it would inherit the verdict on some ranks
    and time the candidates on others, which then wait in collectives their peers never issue."""
    from hf_longctx.lab.emulation.group import EmulatedGroup, EmulationHub

    q, k = torch.zeros(8, 4, 16), torch.zeros(8, 2, 16)
    plan = shard_plan(PackedBatch.from_doc_lens([8]), 2, "contiguous")
    hub = EmulationHub(2)
    group = EmulatedGroup(hub, 0)
    key = auto._decision_key(q, k, plan, group)
    assert key == auto._decision_key(q, k, plan, group)  # the same live group: the same verdict
    del group
    for _ in range(8):  # whether or not the allocator hands the address out again
        assert key != auto._decision_key(q, k, plan, EmulatedGroup(hub, 0))
