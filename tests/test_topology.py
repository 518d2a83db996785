"""Pure-math checks of the TASP topology: Hamiltonian decompositions, multi-node rings, routing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_longctx.comm.topology import (
    cycle_arcs,
    hamiltonian_decomposition,
    hamiltonian_path_decomposition,
    idle_arcs,
    multi_node_decomposition,
    multi_node_idle_links,
    multi_node_rail_aligned,
    rail_links,
    routing_table,
    verify_arc_disjoint_cycles,
)

MULTI_NODE = [(2, 2), (4, 2), (8, 2), (8, 4), (1, 3), (3, 2), (4, 3), (6, 3), (8, 3), (7, 2)]


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


@pytest.mark.parametrize("m", range(1, 13))
def test_path_decomposition(m: int) -> None:
    paths = hamiltonian_path_decomposition(m)
    assert len(paths) == (m - 1 if m in (3, 5) else m)
    arcs = [(p[i], p[i + 1]) for p in paths for i in range(m - 1)]
    assert len(arcs) == len(set(arcs))
    for p in paths:
        assert sorted(p) == list(range(m))
    assert len({p[0] for p in paths}) == len(paths)
    assert len({p[-1] for p in paths}) == len(paths)
    if m not in (3, 5):
        assert set(arcs) == all_arcs(m)


@pytest.mark.parametrize(("m", "u"), MULTI_NODE)
def test_multi_node(m: int, u: int) -> None:
    cycles = multi_node_decomposition(m, u)
    n = m * u
    k = m - 1 if m in (3, 5) else m
    assert len(cycles) == k
    verify_arc_disjoint_cycles(cycles, n)
    node = [r // m for r in range(n)]
    crossings: dict[int, list[tuple[int, int]]] = {j: [] for j in range(u)}
    for cycle in cycles:
        assert cycle[0] == 0
        per_cycle = [(a, b) for a, b in cycle_arcs(cycle) if node[a] != node[b]]
        # exactly one crossing from every node j to node j + 1, none elsewhere
        assert sorted(node[a] for a, _ in per_cycle) == list(range(u))
        for a, b in per_cycle:
            assert node[b] == (node[a] + 1) % u
            crossings[node[a]].append((a, b))
    intra = {arc for c in cycles for arc in cycle_arcs(c) if node[arc[0]] == node[arc[1]]}
    for j in range(u):
        tails = [a % m for a, _ in crossings[j]]
        heads = [b % m for _, b in crossings[j]]
        assert len(set(tails)) == len(set(heads)) == k  # a matching: one stream per NIC and direction
        if k == m:
            node_arcs = {(j * m + a, j * m + b) for a in range(m) for b in range(m) if a != b}
            assert node_arcs <= intra  # every intra-node link carries one ring
    if multi_node_rail_aligned(m, u):
        rails = set(rail_links(m, u))
        assert all(arc in rails for arcs in crossings.values() for arc in arcs)
        if k == m:
            assert multi_node_idle_links(m, u) == []


def test_multi_node_rail_alignment_cases() -> None:
    for m, u in [(2, 2), (4, 2), (8, 2), (8, 4), (8, 3), (4, 3), (1, 3)]:
        assert multi_node_rail_aligned(m, u)
    assert multi_node_decomposition(6, 1) == hamiltonian_decomposition(6)


def check_routing(cycles: list[list[int]], n: int) -> None:
    table = routing_table(cycles, n)
    k = len(cycles)
    assert table.num_cycles == k
    assert table.num_hops == n - 1
    disjoint = len({a for c in cycles for a in cycle_arcs(c)}) == sum(len(cycle_arcs(c)) for c in cycles)
    if k:
        assert (table.max_arc_load == 1) == disjoint
    for r in range(n):
        assert table.held(0, r) == [(r, c) for c in range(k)]
    seen: dict[int, list[tuple[int, int]]] = {r: [] for r in range(n)}
    for t in range(n):
        for r in range(n):
            seen[r].extend(table.held(t, r))
    for r in range(n):  # every sub-block of every cycle seen exactly once, own at step 0
        assert sorted(seen[r]) == sorted((s, c) for s in range(n) for c in range(k))
    arc_sets = [set(cycle_arcs(c)) for c in cycles]
    for t in range(n):  # hops 0..n-2 forward, n-1 brings gradients home
        load: dict[tuple[int, int], int] = {}
        for r in range(n):
            for (source, c), dest in table.sends(t, r):
                assert (r, dest) in arc_sets[c]
                assert table.holder(source, c, t) == r
                assert table.holder(source, c, t + 1) == dest
                load[(r, dest)] = load.get((r, dest), 0) + 1
            send = table.send_layout(t, r)
            for d in range(n):
                assert send[d] == table.recv_layout(t, d)[r]
                assert send[d] == sorted(send[d], key=lambda b: b[1])
            assert [len(x) for x in send] == table.send_counts(r)
            assert [len(x) for x in table.recv_layout(t, r)] == table.recv_counts(r)
        if disjoint:
            assert max(load.values(), default=0) <= 1
    for r in range(n):  # the extra hop n - 1 returns each rank its own sub-blocks (their gradients)
        assert sorted(b for b, _ in table.receives(n - 1, r)) == [(r, c) for c in range(k)]
    for c in range(k):
        for s in range(n):
            route = table.grad_route(s, c)
            assert len(route) == n + 1 and route[0] == route[-1] == s
            assert all((a, b) in arc_sets[c] for a, b in zip(route, route[1:]))


@pytest.mark.parametrize("n", range(2, 17))
def test_routing_single_node(n: int) -> None:
    check_routing(hamiltonian_decomposition(n), n)


@pytest.mark.parametrize(("m", "u"), MULTI_NODE)
def test_routing_multi_node(m: int, u: int) -> None:
    check_routing(multi_node_decomposition(m, u), m * u)


def test_routing_shared_arcs() -> None:
    ring = [0, 1, 2, 3, 4]
    table = routing_table([ring, ring], 5)
    assert table.max_arc_load == 2
    assert table.send_layout(0, 0)[1] == [(0, 0), (0, 1)]
    check_routing([ring, ring], 5)
    with pytest.raises(ValueError):
        routing_table([[0, 1, 1]], 3)


@settings(max_examples=25, deadline=None)
@given(st.integers(min_value=2, max_value=9).flatmap(lambda n: st.lists(st.permutations(range(n)), max_size=4)))
def test_routing_any_hamiltonian_cycles(cycles: list[list[int]]) -> None:
    n = len(cycles[0]) if cycles else 3
    check_routing([list(c) for c in cycles], n)
