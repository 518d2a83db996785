"""``backend="auto"``: every backend priced on the batch, the placement of the best chosen before sharding, the
candidates that could win timed once per shape class; every rank agrees, and the result is exact."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_backends import make_problem, reference

from hf_longctx.backends import auto, sequence_parallel_attention
from hf_longctx.backends.contract import Candidate
from hf_longctx.backends.prediction import AttentionShape, fixed_rates
from hf_longctx.layout import PackedBatch, shard_plan

from distributed import run_distributed

SHAPE = AttentionShape(32, 8, 128)  # Llama-3-8B's attention, bf16
RATES = fixed_rates(500.0, call_s=20e-6)  # a kernel of 500 TFLOP/s and 20 us per call


def labels(cands) -> list[str]:
    return [f"{c.label}@{c.strategy}" for c in cands]


def check_auto_is_exact_and_agreed(rank, world):
    auto.reset_auto_decisions()
    for strategy in ("zigzag", "contiguous"):
        batch, q, k, v, dout = make_problem(7 + world, world, torch.float64)
        ref_out, ref_dq, ref_dk, ref_dv = reference(batch, q, k, v, dout)
        plan = shard_plan(batch, world, strategy)
        idx = plan.local_indices(rank)
        ql, kl, vl = (t[idx].clone().requires_grad_() for t in (q, k, v))
        # every candidate within 100x of the best prediction is timed: all of them run on the group
        out = sequence_parallel_attention(ql, kl, vl, plan=plan, backend="auto", options={"shortlist": 100.0})
        out.backward(dout[idx])
        for got, want in ((out, ref_out), (ql.grad, ref_dq), (kl.grad, ref_dk), (vl.grad, ref_dv)):
            torch.testing.assert_close(got, want[idx], rtol=1e-9, atol=1e-9)
    decisions = auto.auto_decisions()
    assert len(decisions) == 2
    chosen = [(d["backend"], d["strategy"]) for d in decisions]
    gathered = [None] * world
    dist.all_gather_object(gathered, chosen)
    assert all(g == chosen for g in gathered), f"ranks chose differently: {gathered}"
    timed = set(decisions[0]["seconds"]) | set(decisions[1]["seconds"])
    assert {"zigzag", "tasp", "ring", "distfa", "ulysses", "cad"} <= timed
    for d in decisions:
        assert set(d["seconds"]) <= set(d["predicted_s"]) and d["backend"] in d["seconds"]


@pytest.mark.parametrize("world", [2, 3])
def test_auto_is_exact_and_every_rank_picks_the_same_backend(world):
    run_distributed(world, check_auto_is_exact_and_agreed)


def check_slowest_rank_decides(rank, world):
    """ulysses is fastest on rank 0 but slowest on rank 1: the verdict follows the slowest rank."""
    auto.reset_auto_decisions()
    batch, q, k, v, _ = make_problem(3, world, torch.float64)
    plan = shard_plan(batch, world, "zigzag")
    idx = plan.local_indices(rank)
    imposed = {"zigzag": 2.0, "tasp": 3.0, "ulysses": 1.0 if rank == 0 else 5.0}
    calls = []

    def probe(candidate):
        calls.append(candidate.backend)

    def timer(fn, device):
        fn()
        return imposed[calls[-1]]

    auto.AUTO.timer = timer
    try:
        options = auto.AutoOptions(shortlist=100.0)
        chosen = auto.AUTO.resolve(q[idx], k[idx], v[idx], plan, None, probe, options)
        assert chosen.backend == "zigzag"
        assert auto.auto_decisions()[0]["seconds"] == {"zigzag": 2.0, "tasp": 3.0, "ulysses": 5.0}
        # the verdict is cached: a second call of the shape class times nothing
        calls.clear()
        assert auto.AUTO.resolve(q[idx], k[idx], v[idx], plan, None, probe, options).backend == "zigzag"
        assert calls == []
        # a sliding window changes the problem: its layers get a verdict of their own, the others keep theirs
        imposed["tasp"] = 1.0
        assert auto.AUTO.resolve(q[idx], k[idx], v[idx], plan.with_window(3), None, probe, options).backend == "tasp"
        assert calls and auto.AUTO.resolve(q[idx], k[idx], v[idx], plan, None, probe, options).backend == "zigzag"
    finally:
        auto.AUTO.timer = auto.time_forward


def test_the_slowest_rank_decides():
    run_distributed(2, check_slowest_rank_decides)


def test_a_measured_tie_keeps_the_predicted_best():
    assert auto.pick([1.00, 0.99], margin=0.03) == 0
    assert auto.pick([1.00, 0.90], margin=0.03) == 1
    assert auto.pick([1.0, 0.5, 0.6], margin=0.03) == 1


def test_candidates_follow_the_placement_the_heads_and_the_nodes():
    one_node = auto.AutoOptions(node_size=8)
    assert labels(auto.candidates(4, SHAPE, one_node)) == [
        "zigzag@zigzag", "ulysses@zigzag", "tasp@zigzag",
        "ring@contiguous", "distfa@contiguous", "ulysses@contiguous", "tasp@contiguous", "cad@contiguous"]
    # 6 ranks do not split 32 query heads: no Ulysses
    assert "ulysses@zigzag" not in labels(auto.candidates(6, SHAPE, one_node))
    # past one node: Ulysses over each node's 8 GPUs x the ring family or CAD across nodes
    two_nodes = labels(auto.candidates(16, SHAPE, one_node, ("zigzag",)))
    assert two_nodes == ["zigzag@zigzag", "ulysses@zigzag", "tasp@zigzag", "ulysses_zigzag(ulysses_size=8)@zigzag",
                         "ulysses_tasp(ulysses_size=8)@zigzag"]
    # ... but only where the group holds every rank of the world (making its groups needs all of them)
    assert "ulysses_zigzag(ulysses_size=8)@zigzag" not in labels(
        auto.candidates(16, SHAPE, one_node, ("zigzag",), spans_world=False))
    # 64 ranks do not split 32 heads: the composition is the only way Ulysses takes part
    assert not [c for c in labels(auto.candidates(64, SHAPE, one_node)) if c.startswith("ulysses@")]
    assert auto.candidates(4, SHAPE, auto.AutoOptions(candidates=["cad", "zigzag"])) == [
        Candidate("zigzag", "zigzag", auto.candidates(4, SHAPE, one_node)[0].options),
        Candidate("cad", "contiguous", auto.candidates(4, SHAPE, one_node)[-1].options)]


def test_bad_options_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="node_size must be a whole number"):
        auto.AutoOptions(node_size=0)
    with pytest.raises(ValueError, match="no auto candidates; choose among"):
        auto.AutoOptions(candidates=["local"])
    with pytest.raises(ValueError, match="shortlist must be a number >= 1"):
        auto.AutoOptions(shortlist=0.5)


def _placed(doc_lens, world):
    batch = PackedBatch.from_doc_lens(doc_lens)
    plans = {s: shard_plan(batch, world, s) for s in auto.PLACEMENTS}
    predictions = auto.price(plans, SHAPE, RATES, auto.AutoOptions(node_size=8))
    return auto.best_candidate(predictions), predictions


def test_the_prices_follow_the_batch():
    """Long documents: the ring family on contiguous cuts is unbalanced, Ulysses and CAD are not; many short
    documents: Ulysses' all_to_alls cost more than the ring's few transfers, which the kernels hide."""
    best, predictions = _placed([65536], 4)
    by = {f"{c.label}@{c.strategy}": p.step_s for c, p in predictions.items()}
    assert by["ring@contiguous"] > 1.5 * by["zigzag@zigzag"]  # rank 3 computes 7x what rank 0 does
    assert f"{best.label}@{best.strategy}" not in ("ring@contiguous", "tasp@contiguous")
    best, predictions = _placed([512] * 128, 4)
    by = {f"{c.label}@{c.strategy}": p.step_s for c, p in predictions.items()}
    assert by["ulysses@zigzag"] > by["zigzag@zigzag"] and best.backend != "ulysses"


def test_the_shortlist_is_the_placements_candidates_near_the_best_prediction():
    _, predictions = _placed([65536], 5)
    on = {c.label: p.step_s for c, p in predictions.items() if c.strategy == "zigzag"}
    timed = auto.shortlist(predictions, "zigzag", 1.25)
    assert {c.strategy for c in timed} == {"zigzag"} and timed[0].label == min(on, key=on.get)
    assert [c.label for c in timed] == sorted((n for n in on if on[n] <= 1.25 * min(on.values())), key=on.get)
    assert [c.label for c in auto.shortlist(predictions, "zigzag", 1.0)] == [timed[0].label]


def test_past_one_node_the_network_is_priced():
    """A group of 16 over 2 nodes: Ulysses' all_to_all crosses the network for half its bytes, the composition
    keeps it inside each node and sends only the ring's blocks across."""
    batch = PackedBatch.from_doc_lens([131072] * 2)
    plans = {"zigzag": shard_plan(batch, 16, "zigzag")}
    slow = auto.price(plans, SHAPE, RATES, auto.AutoOptions(node_size=8, inter_node_gbps=5))
    fast = auto.price(plans, SHAPE, RATES, auto.AutoOptions(node_size=16))
    by_slow = {c.backend: p for c, p in slow.items()}
    by_fast = {c.backend: p for c, p in fast.items()}
    assert by_slow["ulysses"].step_s > 1.5 * by_fast["ulysses"].step_s
    assert by_slow["ulysses_zigzag"].step_s < by_slow["ulysses"].step_s
    assert by_slow["ulysses"].kernel_s == by_fast["ulysses"].kernel_s  # the network changes transfers only


def test_plan_batch_places_the_batch_for_the_best_prediction(monkeypatch):
    monkeypatch.setattr(auto, "measure_kernel_rates", lambda *a, **k: RATES)
    auto.reset_auto_decisions()
    try:
        batch = PackedBatch.from_doc_lens([65536])
        expected, _ = _placed([65536], 5)
        assert expected.strategy == "contiguous"  # DistFlashAttn balances one document over 5 ranks best
        monkeypatch.setattr(auto, "group_rank_and_size", lambda group: (0, 5))  # five ranks; the rates are imposed
        plan = auto.AUTO.plan_batch(batch, None, SHAPE, torch.bfloat16, torch.device("cpu"), "auto",
                                    auto.AutoOptions(node_size=8))
        assert plan.strategy == "contiguous" and plan.world_size == 5
        # a model whose layers differ in shape cannot be priced as one: the default placement
        assert auto.AUTO.plan_batch(PackedBatch.from_doc_lens([9000]), None, None, torch.bfloat16,
                                    torch.device("cpu"), "auto", auto.AutoOptions()).strategy == "zigzag"
        # the shape class keeps its placement: a later batch of similar length is not priced again
        monkeypatch.setattr(auto, "price", lambda *a, **k: pytest.fail("priced again"))
        again = auto.AUTO.plan_batch(PackedBatch.from_doc_lens([60000]), None, SHAPE, torch.bfloat16,
                                     torch.device("cpu"), "auto", auto.AutoOptions(node_size=8))
        assert again.strategy == "contiguous"
    finally:
        auto.reset_auto_decisions()


def test_a_verdict_dies_with_its_group():
    """A later group may take a freed group's address: keyed by ``id``, it would inherit the verdict on some ranks
    and time the candidates on others, which then wait in collectives their peers never issue."""

    class Group:
        pass

    group = Group()
    key = auto._group_key(group)
    assert key == auto._group_key(group)  # the same live group: the same verdict
    del group
    for _ in range(8):  # whether or not the allocator hands the address out again
        assert key != auto._group_key(Group())
