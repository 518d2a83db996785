"""TASP topology and routing: Hamiltonian decompositions of K_n*, and the routes sub-blocks take on them."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_longctx.backends.tasp import build_routes, cycles_for, grad_hop_receives, kv_hop_layout, max_hops, routes
from hf_longctx.backends.tasp_topology import (
    cycle_arcs,
    hamiltonian_decomposition,
    idle_arcs,
    verify_arc_disjoint_cycles,
)
from hf_longctx.layout import PackedBatch, shard_plan


def all_arcs(n: int) -> set[tuple[int, int]]:
    return {(a, b) for a in range(n) for b in range(n) if a != b}


def expected_count(n: int) -> int:
    return n - 2 if n in (4, 6) else max(n - 1, 0)


def check_decomposition(n: int) -> list[list[int]]:
    cycles = hamiltonian_decomposition(n)
    assert len(cycles) == expected_count(n)
    used: list[tuple[int, int]] = []
    for cycle in cycles:
        assert cycle[0] == 0
        assert sorted(cycle) == list(range(n))
        used.extend(cycle_arcs(cycle))
    assert len(used) == len(set(used)), "an arc is used twice"
    assert set(idle_arcs(n)) == all_arcs(n) - set(used)
    assert len(idle_arcs(n)) == len(set(idle_arcs(n)))
    return cycles


def test_smallest_cases() -> None:
    assert hamiltonian_decomposition(1) == []
    assert hamiltonian_decomposition(2) == [[0, 1]]
    assert hamiltonian_decomposition(3) == [[0, 1, 2], [0, 2, 1]]
    assert idle_arcs(1) == idle_arcs(2) == idle_arcs(3) == []
    with pytest.raises(ValueError):
        hamiltonian_decomposition(0)


@pytest.mark.parametrize("n", range(2, 17))
def test_decomposition_small(n: int) -> None:
    check_decomposition(n)
    if n not in (4, 6):
        assert idle_arcs(n) == []


@pytest.mark.parametrize("n", [4, 6])
def test_tillson_exceptions_leave_one_idle_link_per_rank(n: int) -> None:
    # n - 1 cycles would use every arc; the exhaustive search inside rules that out (Tillson 1980).
    idle = idle_arcs(n)
    assert len(idle) == n
    assert sorted(a for a, _ in idle) == list(range(n))
    assert sorted(b for _, b in idle) == list(range(n))


@settings(max_examples=8, deadline=None)
@given(st.integers(min_value=17, max_value=34))
def test_decomposition_larger(n: int) -> None:
    check_decomposition(n)


@pytest.mark.parametrize("n", [48, 64])
def test_decomposition_powers_of_two_scale(n: int) -> None:
    check_decomposition(n)


def test_results_are_deterministic_and_fresh() -> None:
    first = hamiltonian_decomposition(10)
    first[0][1] = -1
    assert hamiltonian_decomposition(10) != first
    assert hamiltonian_decomposition(10) == hamiltonian_decomposition(10)


def test_verify_rejects_bad_cycles() -> None:
    with pytest.raises(ValueError):
        verify_arc_disjoint_cycles([[0, 1, 1]], 3)
    with pytest.raises(ValueError):
        verify_arc_disjoint_cycles([[0, 1, 2], [0, 1, 2]], 3)
    verify_arc_disjoint_cycles([[0, 1, 2], [0, 2, 1]], 3)


def full_attention_plan(n: int, rows_per_rank: int = 12):
    """A plan in which every rank reads every other rank's keys (one long document, zig-zag placement)."""
    return shard_plan(PackedBatch.from_doc_lens([n * rows_per_rank]), n, "zigzag")


def check_routing(plan, cycles: list[list[int]]) -> None:
    """Routes follow their cycles, reach every rank once, and every hop's sends match its receives."""
    n = plan.world_size
    rts = build_routes(plan, cycles)
    k = len(cycles)
    assert [(r.block.owner, r.block.cycle) for r in rts] == [(s, c) for s in range(n) for c in range(k)]
    arc_sets = [set(cycle_arcs(c)) for c in cycles]
    disjoint = len({a for c in cycles for a in cycle_arcs(c)}) == sum(len(cycle_arcs(c)) for c in cycles)
    for s in range(n):  # a rank's sub-blocks cut its rows into consecutive parts, one per cycle
        own = [r.block for r in rts if r.block.owner == s]
        assert [(b.start, b.end) for b in own] == list(zip([0] + [b.end for b in own[:-1]], [b.end for b in own]))
        if own:
            assert own[-1].end == plan.num_local_tokens(s)
    for r in rts:
        b = r.block
        # Hamiltonian: the sub-block can reach every other rank exactly once, one arc of its cycle per hop
        assert sorted(r.visits) == [x for x in range(n) if x != b.owner]
        path = [b.owner, *r.visits]
        assert all((a, c) in arc_sets[b.cycle] for a, c in zip(path, path[1:]))
        # it travels exactly as far as some rank computes with it, and carries only rows read from here on
        assert r.hops == max((h for h in range(1, n) if r.pairs[h - 1]), default=0)
        for h in range(1, r.hops + 1):
            lo, hi = r.span(h)
            assert 0 <= lo <= hi <= b.end - b.start
            if h > 1:
                plo, phi = r.span(h - 1)
                assert plo <= lo <= hi <= phi  # a holder forwards a slice of what it received
            for p in r.pairs[h - 1]:
                assert 0 <= p.k_start < p.k_end <= hi - lo
    for hop in range(1, n):
        load: dict[tuple[int, int], int] = {}
        layouts = [kv_hop_layout(rts, rank, hop) for rank in range(n)]
        for rank, (sends, recvs) in enumerate(layouts):
            for dst, items in sends.items():
                assert dst != rank
                assert layouts[dst][1][rank] == items  # the receiver expects the same items in the same order
                for i, rows in items:
                    assert rows == 2 * rts[i].rows(hop)
                    assert (rank, dst) in arc_sets[rts[i].block.cycle]
                load[(rank, dst)] = load.get((rank, dst), 0) + len(items)
            assert set(recvs) == {src for src in range(n) if rank in layouts[src][0]}
        if disjoint:
            assert max(load.values(), default=0) <= 1  # arc-disjoint cycles: one sub-block per link and hop
        for owner in range(n):  # dK/dV come home from exactly the ranks that computed with the sub-block
            expect = grad_hop_receives(rts, owner, hop)
            computed: dict[int, list[tuple[int, int]]] = {}
            for visitor, (_, recvs) in enumerate(layouts):
                for i, rows in sorted(x for items in recvs.values() for x in items):
                    if rts[i].block.owner == owner and rts[i].pairs[hop - 1]:
                        computed.setdefault(visitor, []).append((i, rows))
            assert expect == computed


def check_pairs_covered(plan, rts) -> None:
    """The kernel calls of all sub-blocks of rank s at rank v do the work of the whole (v, s) block."""
    from hf_longctx.layout import pairs_between_slots

    n = plan.world_size
    for s in range(n):
        for v in range(n):
            if v == s:
                continue
            whole = sum(p.work for qs in plan.rank_slots(v) for ks in plan.rank_slots(s)
                        for p in pairs_between_slots(qs, ks, plan.window))
            split = sum(p.work for r in rts if r.block.owner == s for h, x in enumerate(r.visits) if x == v
                        for p in r.pairs[h])
            assert split == whole, (s, v)


@pytest.mark.parametrize("n", range(2, 17))
def test_routing_single_node(n: int) -> None:
    plan = full_attention_plan(n)
    check_routing(plan, hamiltonian_decomposition(n))
    rts = routes(plan)
    assert rts == build_routes(plan, [list(c) for c in cycles_for(n)])
    assert max_hops(plan) == n - 1  # one long document: the furthest sub-block goes all the way round
    check_pairs_covered(plan, rts)


@pytest.mark.parametrize("doc_lens", [[5, 30, 1, 17, 11], [64], [3] * 20])
@pytest.mark.parametrize("window", [None, 4])
def test_routing_packed_documents(doc_lens: list[int], window: int | None) -> None:
    for n in (3, 5, 6):
        plan = shard_plan(PackedBatch.from_doc_lens(doc_lens), n, "zigzag").with_window(window)
        check_routing(plan, hamiltonian_decomposition(n))
        check_pairs_covered(plan, routes(plan))


def test_routing_shared_arcs() -> None:
    ring = [0, 1, 2, 3, 4]
    plan = full_attention_plan(5)
    rts = build_routes(plan, [ring, ring])
    sends, _ = kv_hop_layout(rts, 4, 1)  # rank 0's late zig-zag chunk reads both sub-blocks of rank 4
    assert [rts[i].block for i, _ in sends[0]] == [rts[8].block, rts[9].block]  # both on the link 4 -> 0
    check_routing(plan, [ring, ring])
    check_pairs_covered(plan, rts)
    with pytest.raises(ValueError, match="not a Hamiltonian cycle"):
        build_routes(full_attention_plan(3), [[0, 1, 1]])


@settings(max_examples=25, deadline=None)
@given(st.integers(min_value=2, max_value=9).flatmap(
    lambda n: st.lists(st.permutations(range(n)), min_size=1, max_size=4)))
def test_routing_any_hamiltonian_cycles(cycles: list[list[int]]) -> None:
    plan = full_attention_plan(len(cycles[0]))
    check_routing(plan, [list(c) for c in cycles])
    check_pairs_covered(plan, build_routes(plan, cycles))
