"""Two-dimensional backends in emulation: sub-groups of an emulated group, and every ``ulysses_<outer>`` on them.

An emulated group makes its sub-groups through its own comm ops (the comm layer and the mesh never ask what type it
is): channels of the same hub, with point-to-point messages and collectives matched per sub-group, traffic counted on
the hub's ranks, made once per ask. On them every ``ulysses_<outer>`` gives each rank's output and q/k/v gradient rows
of one device (float64, random packed documents, GQA with one and two KV heads) on meshes 2 x 2, 2 x 3 and 3 x 2, and
sends what a count by hand says on one document.
"""

from __future__ import annotations

import gc
import weakref
from collections import Counter

import pytest
import torch
from test_backends import reference
from test_ulysses_mesh import QUERY_HEADS, mesh_problem

from hf_longctx.backends import sequence_parallel_attention
from hf_longctx.backends.ulysses_mesh import OUTER_BACKENDS, composed_name
from hf_longctx.comm.links import LINKS, LinkTiers
from hf_longctx.comm.subgroups import SubGroupMismatch
from hf_longctx.lab.emulation import emulate_step
from hf_longctx.lab.emulation.group import EmulatedGroup, EmulationError, EmulationHub
from hf_longctx.layout import PackedBatch, shard_plan

TOL = dict(rtol=1e-9, atol=1e-9)


# ----------------------------------------------------------------------------- sub-groups of a hub


def _mesh_of_two(group: EmulatedGroup):
    """Inner groups {0, 1} {2, 3}, outer groups {0, 2} {1, 3} of a group of 4: this rank's (inner, outer)."""
    made = group.sub_groups([(0, 1), (2, 3), (0, 2), (1, 3)], 2)
    o, i = divmod(group.rank, 2)
    assert sum(g is not None for g in made) == 2  # the groups this rank is not in are None
    return made[o], made[2 + i]


def test_sub_groups_match_messages_and_collectives_per_group_and_count_on_the_hubs_ranks():
    def rank_fn(group):
        inner, outer = _mesh_of_two(group)
        me = group.rank
        # the same (source, destination, tag) in group ranks on the whole group and on the inner group: for ranks
        # 0 and 1 the very same pair of hub ranks, matched apart all the same
        if inner.rank == 0:
            works = group.post([(me + 1, torch.tensor([100.0 + me]), 0)], [], "whole") \
                + inner.post([(1, torch.tensor([200.0 + me]), 0)], [], "inner")
            received = []
        else:
            received = [torch.empty(1), torch.empty(1)]  # from the inner group's rank 0, from the whole group's
            works = inner.post([], [(0, received[0], 0)], "inner") + group.post([], [(me - 1, received[1], 0)],
                                                                                  "whole")
        for w in works:
            w.wait()
        got = tuple(t.item() for t in received) or None
        # collectives per group, in a different order on different ranks of the whole group: the outer group {0, 2}
        # reduces before the whole group does, the outer group {1, 3} after it
        x, y = torch.tensor([float(me)]), torch.tensor([float(me)])
        if outer.global_rank(0) == 0:
            outer.all_reduce(x, "sum")
            group.all_reduce(y, "sum")
        else:
            group.all_reduce(y, "sum")
            outer.all_reduce(x, "sum")
        # an all_to_all of the outer group: its traffic on the hub's ranks
        recv = torch.empty(2, 3, dtype=torch.float64)
        outer.all_to_all_single(recv, torch.full((2, 3), float(me), dtype=torch.float64), [1, 1], [1, 1])
        return got, x.item(), y.item(), recv[:, 0].tolist(), (inner.rank, inner.world), outer.global_rank(1)

    hub = EmulationHub(4, timeout_s=30.0)
    got = hub.run(rank_fn)
    assert [g[0] for g in got] == [None, (200.0, 100.0), None, (202.0, 102.0)]
    assert [g[1] for g in got] == [2.0, 4.0, 2.0, 4.0]  # outer sums: 0 + 2 and 1 + 3
    assert [g[2] for g in got] == [6.0] * 4
    assert [g[3] for g in got] == [[0.0, 2.0], [1.0, 3.0], [0.0, 2.0], [1.0, 3.0]]
    assert [g[4] for g in got] == [(0, 2), (1, 2), (0, 2), (1, 2)] and [g[5] for g in got] == [2, 3, 2, 3]
    a2a = [[call for call in t.calls if call[0] == "a2a"] for t in hub.traffic]
    assert a2a == [[("a2a", {2: 24})], [("a2a", {3: 24})], [("a2a", {0: 24})], [("a2a", {1: 24})]]
    assert hub.traffic[0].calls[:2] == [("p2p", {1: 4})] * 2  # a float32 each, on the whole group and the inner one


def test_sub_groups_are_made_once_and_ranks_that_disagree_are_all_refused():
    def asks_again_alone(group):
        first = group.sub_groups([(0, 1), (2, 3)], "pairs")
        if group.rank == 0:  # no collective: the ranks that do not ask again are not waited for
            again = group.sub_groups([(0, 1), (2, 3)], "pairs")
            assert [g.channel if g else None for g in again] == [g.channel if g else None for g in first]
        single = group.sub_groups([(r,) for r in range(4)], "singles")[group.rank]
        t = torch.ones(1)
        single.all_reduce(t, "sum")  # a group of one rank: done at once
        return first[group.rank // 2].channel.id, single.world, group.global_rank(group.rank)

    got = EmulationHub(4, timeout_s=5.0).run(asks_again_alone)
    assert [g[1:] for g in got] == [(1, 0), (1, 1), (1, 2), (1, 3)]
    assert got[0][0] == got[1][0] != got[2][0] == got[3][0]

    def disagree(group):
        try:
            group.sub_groups([(0, 1), (2, 3)] if group.rank < 2 else [(0, 1, 2, 3)], 2 if group.rank < 2 else 4)
        except SubGroupMismatch as err:
            return err.settings
        return None

    assert EmulationHub(4, timeout_s=5.0).run(disagree) == [{(0, 1, 2, 3): [2, 4]}] * 4


def test_ranks_that_run_different_ulysses_sizes_are_all_refused():
    world = 4
    batch, q, k, v, _ = mesh_problem(7, world, 2)
    plan = shard_plan(batch, world, "zigzag")

    def rank_fn(group):
        idx = plan.local_indices(group.rank)
        with pytest.raises(ValueError, match="run different ulysses_sizes"):
            sequence_parallel_attention(q[idx], k[idx], v[idx], plan=plan, backend="ulysses_zigzag", group=group,
                                        kernel="reference", options={"ulysses_size": 2 if group.rank < 2 else 4})
        return True

    assert EmulationHub(world, timeout_s=30.0).run(rank_fn) == [True] * world


def test_an_unmatched_collective_on_a_sub_group_names_the_group():
    def rank_fn(group):
        inner, _ = _mesh_of_two(group)
        if group.rank == 0:
            inner.barrier()
        elif group.rank == 1:
            inner.all_reduce(torch.ones(1), "sum")

    with pytest.raises(EmulationError, match=r"hub ranks \(0, 1\)"):
        EmulationHub(4, timeout_s=5.0).run(rank_fn)


# ----------------------------------------------------------------------------- every ulysses_<outer>


@pytest.mark.parametrize("world,inner", [(4, 2), (6, 2), (6, 3)])
@pytest.mark.parametrize("hkv", [1, 2])
def test_every_ulysses_mesh_backend_emulated_matches_one_device(world, inner, hkv):
    batch, q, k, v, dout = mesh_problem(1000 + 100 * world + 10 * inner + hkv, world, hkv)
    want = reference(batch, q, k, v, dout)
    tiers = LinkTiers(node_size=inner)  # a node per inner group
    for outer in OUTER_BACKENDS:
        backend = composed_name(outer)
        step = emulate_step(batch, world, (q, k, v, dout), backend, options={"ulysses_size": inner},
                            kernel="reference", keep_results=True, tiers=tiers)
        plan = shard_plan(batch, world, step.strategy)
        for r in step.ranks:
            idx = plan.local_indices(r.rank)
            for name, got, ref in zip(("out", "dq", "dk", "dv"), r.results, want):
                torch.testing.assert_close(got, ref[idx], **TOL, msg=lambda m, w=f"{backend} {inner}x{world // inner} "
                                           f"hkv={hkv} rank {r.rank} {name}": f"{w}: {m}")
            # every call goes to the rank's inner group (Ulysses) or to its outer group (the outer backend)
            o, i = divmod(r.rank, inner)
            node = {o * inner + j for j in range(inner)} - {r.rank}
            column = {p * inner + i for p in range(world // inner)} - {r.rank}
            assert all(set(peers) <= node or set(peers) <= column for _, peers in r.traffic), (backend, r.rank)
            assert any(set(peers) <= node for _, peers in r.traffic), (backend, r.rank)
        assert sum(step.intra_node_bytes) > 0


@pytest.mark.parametrize("world,inner", [(4, 1), (3, 3)])
def test_meshes_with_groups_of_one_rank_match_one_device(world, inner):
    """Inner groups of one rank (4 x 1), or outer groups of one rank (3 x 3: one inner group): still one device's
    rows (sub-groups of one rank are handles of their own, see the sub-group tests above)."""
    batch, q, k, v, dout = mesh_problem(2000 + 10 * world + inner, world, 1)
    want = reference(batch, q, k, v, dout)
    for outer in OUTER_BACKENDS:
        step = emulate_step(batch, world, (q, k, v, dout), composed_name(outer), options={"ulysses_size": inner},
                            kernel="reference", keep_results=True)
        plan = shard_plan(batch, world, step.strategy)
        for r in step.ranks:
            for got, ref in zip(r.results, want):
                torch.testing.assert_close(got, ref[plan.local_indices(r.rank)], **TOL)


def test_ulysses_over_the_ring_sends_what_a_count_by_hand_says():
    """One document of 4 x 6 tokens on a 2 x 2 mesh, contiguous: each all_to_all sends half of a rank's heads of
    its 6 tokens to its inner partner; the outer ring sends an outer shard's keys and values (12 tokens) whole to
    the other outer shard's rank of the same inner index, forward and backward, and their gradients come back.
    In nodes of two ranks, the all_to_alls stay inside a node and the ring crosses the network."""
    world, inner, shard, d, heads, kv_heads = 4, 2, 6, 8, 4, 2
    batch = PackedBatch.from_doc_lens([world * shard])
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(world * shard, h, d, generator=g, dtype=torch.float64)
                     for h in (heads, kv_heads, kv_heads, heads))
    tiers = LinkTiers(node_size=2, inter_node_bytes_per_s=20e9)
    step = emulate_step(batch, world, (q, k, v, dout), "ulysses_ring", options={"ulysses_size": inner},
                        kernel="reference", tiers=tiers)
    head = shard * d * 8  # bytes of one head of a rank's tokens
    lse = shard * 8  # one head of a rank's log-sum-exps
    q_part, kv_part, lse_part = head * heads // inner, head * kv_heads // inner, lse * heads // inner
    # forward: q, k, v to heads, out and lse back; backward: q, k, v, out, dout and lse to heads, dq, dk, dv back
    a2a_sizes = [q_part, kv_part, kv_part, q_part, lse_part] \
        + [q_part, kv_part, kv_part, q_part, q_part, lse_part, q_part, kv_part, kv_part]
    block = 2 * shard * (kv_heads // inner) * d * 8  # an outer shard's keys (or values), its heads of the node
    for r in step.ranks:
        partner, other = r.rank ^ 1, (r.rank + 2) % 4
        ring = [2 * block] * (2 if r.rank < 2 else 1)  # keys and values twice; or their gradients once
        want = Counter([("a2a", ((partner, n),)) for n in a2a_sizes] + [("p2p", ((other, n),)) for n in ring])
        assert Counter((kind, tuple(sorted(p.items()))) for kind, p in r.traffic) == want, r.rank
        assert r.node_bytes == (sum(a2a_sizes), sum(ring))
        assert r.transfer_s == pytest.approx(sum(LINKS["a2a"].seconds(n) for n in a2a_sizes)
                                             + sum(ring) / 20e9, rel=1e-12)


def test_an_emulated_mesh_step_leaves_nothing_referenced(monkeypatch):
    """Sub-groups, their channels and their state go with the step's hub, freed without the collector."""
    import hf_longctx.lab.emulation.runner as runner

    hubs, plans = [], []
    real_hub, real_plan = runner.EmulationHub, runner.shard_plan

    def hub_spy(*args, **kwargs):
        hub = real_hub(*args, **kwargs)
        hubs.append(weakref.ref(hub))
        return hub

    def plan_spy(*args, **kwargs):
        plan = real_plan(*args, **kwargs)
        plans.append(weakref.ref(plan))
        return plan

    monkeypatch.setattr(runner, "EmulationHub", hub_spy)
    monkeypatch.setattr(runner, "shard_plan", plan_spy)
    batch, q, k, v, dout = mesh_problem(5, 4, 2)
    gc.collect()
    gc.disable()
    try:
        for outer in OUTER_BACKENDS:
            emulate_step(batch, 4, (q, k, v, dout), composed_name(outer), options={"ulysses_size": 2},
                         kernel="reference", warmup=1)
        assert len(hubs) == 2 * len(OUTER_BACKENDS) and all(h() is None for h in hubs)
        assert plans and all(p() is None for p in plans)
    finally:
        gc.enable()


def test_the_op_and_autograd_run_a_mesh_backend_on_an_emulated_group():
    world, inner = 6, 3
    batch, q, k, v, dout = mesh_problem(11, world, 1)
    want = reference(batch, q, k, v, dout)
    plan = shard_plan(batch, world, "zigzag")

    def rank_fn(group):
        idx = plan.local_indices(group.rank)
        ql, kl, vl = (t[idx].clone().requires_grad_() for t in (q, k, v))
        out = sequence_parallel_attention(ql, kl, vl, plan=plan, backend="ulysses_zigzag", group=group,
                                          kernel="reference", options={"ulysses_size": inner})
        out.backward(dout[idx])
        return idx, out.detach(), ql.grad, kl.grad, vl.grad

    for idx, *got in EmulationHub(world).run(rank_fn):
        for g, ref in zip(got, want):
            torch.testing.assert_close(g, ref[idx], **TOL)
    assert QUERY_HEADS % inner == 0
