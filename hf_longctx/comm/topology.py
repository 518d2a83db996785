"""Hamiltonian decompositions and routing tables for TASP (topology-aware sequence parallelism).

TASP (the paper "Topology-Aware Sequence Parallelism") replaces the single ring of ring attention
by several rings that share no link. On n ranks joined all-to-all (NVSwitch), the links form the
complete symmetric digraph K_n*: one arc a -> b for every ordered pair a != b. A ring is a directed
Hamiltonian cycle; rings that use pairwise different arcs move data at the same time without two of
them competing for a link, and n - 1 of them use all n(n - 1) arcs, so every link is busy at every
step. Each rank cuts its KV block into one sub-block per ring; one step moves every sub-block one
hop along its own ring, all together in one all_to_all. After n - 1 hops every rank has seen every
sub-block of every other rank.

Facts this module relies on:

* Odd n: Walecki's construction (published by Lucas, 1892) splits the undirected K_n into
  (n - 1) / 2 Hamiltonian cycles; each used in both directions gives n - 1 arc-disjoint directed
  Hamiltonian cycles, i.e. a Hamiltonian decomposition of K_n*.
* Even n: K_n* has a Hamiltonian decomposition for every n except 4 and 6 (Tillson, "A Hamiltonian
  decomposition of K*_2m, 2m >= 8", J. Combin. Theory B 29, 1980). Instead of Tillson's case
  analysis we extend a decomposition of K_{n-1}* (n - 1 odd) by one vertex, which only needs a
  "rainbow" Hamiltonian path (one arc from each cycle, see :func:`_extend_by_one_vertex`). For
  n % 4 == 0 (n >= 12) a closed form gives the path; otherwise (n = 8 and n % 4 == 2) a small
  deterministic search finds one (milliseconds up to n = 32, seconds around n = 64). The result is
  verified before use.
* n = 4 and 6: no decomposition exists (Tillson), so n - 1 arc-disjoint Hamiltonian cycles do not
  exist (they would use every arc). An exhaustive search (cheap at these sizes) confirms it and
  returns n - 2 cycles; the n arcs they leave idle are listed by :func:`idle_arcs`.
* Hamiltonian paths: a decomposition of K_m* into m Hamiltonian paths has distinct start and end
  vertices (each vertex has m - 1 out-arcs, so it ends exactly one path), and adding or deleting
  one vertex turns such paths into the cycles of K_{m+1}* and back. Hence K_m* has one exactly when
  K_{m+1}* has a Hamiltonian decomposition: for every m except 3 and 5. (For even m the zig-zag
  sequencing of Z_m gives one directly.) These paths build the multi-node rings.

Everything here is pure Python, deterministic and cached; nothing touches torch.distributed.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

Arc = tuple[int, int]
SubBlock = tuple[int, int]  # (source rank, cycle index)

__all__ = [
    "Arc",
    "RoutingTable",
    "SubBlock",
    "cycle_arcs",
    "hamiltonian_decomposition",
    "hamiltonian_path_decomposition",
    "idle_arcs",
    "multi_node_decomposition",
    "multi_node_idle_links",
    "multi_node_rail_aligned",
    "rail_links",
    "routing_table",
    "verify_arc_disjoint_cycles",
]


# --------------------------------------------------------------------------------------------
# helpers


def cycle_arcs(cycle: Sequence[int]) -> list[Arc]:
    """Arcs ``c[i] -> c[(i + 1) % len(c)]`` of a cycle given as a vertex order (none for length 1)."""
    k = len(cycle)
    if k < 2:
        return []
    return [(cycle[i], cycle[(i + 1) % k]) for i in range(k)]


def verify_arc_disjoint_cycles(cycles: Sequence[Sequence[int]], n: int) -> None:
    """Raise ``ValueError`` unless every cycle is a Hamiltonian cycle of K_n* and no arc repeats.

    Every construction goes through this before it is handed out, so a wrong table never reaches
    the communication code.
    """
    seen: set[Arc] = set()
    for index, cycle in enumerate(cycles):
        if sorted(cycle) != list(range(n)):
            raise ValueError(f"cycle {index} is not a Hamiltonian cycle on {n} vertices: {list(cycle)}")
        for arc in cycle_arcs(cycle):
            if arc in seen:
                raise ValueError(f"arc {arc} is used twice (again by cycle {index})")
            seen.add(arc)


def _rotate_to_zero(cycle: Sequence[int]) -> list[int]:
    i = list(cycle).index(0)
    return list(cycle[i:]) + list(cycle[:i])


def _reverse_cycle(cycle: Sequence[int]) -> list[int]:
    return [cycle[0]] + list(reversed(cycle[1:]))


# --------------------------------------------------------------------------------------------
# single node: K_n*


def _walecki(n: int) -> list[list[int]]:
    """Walecki, n odd: vertex 0 is the hub, 1..n-1 sit on a circle of 2k = n - 1 positions.

    The zig-zag paths i, i+1, i-1, i+2, i-2, ..., i+k (positions mod 2k), i = 0..k-1, are k
    edge-disjoint Hamiltonian paths of K_2k; joining both ends to the hub closes them into the k
    Hamiltonian cycles of the undirected K_n. Each is used forwards and backwards.
    """
    k = (n - 1) // 2
    m = 2 * k
    out: list[list[int]] = []
    for i in range(k):
        seq = [i]
        for j in range(1, k + 1):
            seq.append((i + j) % m)
            if j < k:
                seq.append((i - j) % m)
        cycle = [0] + [x + 1 for x in seq]
        out.append(cycle)
        out.append(_reverse_cycle(cycle))
    return out


def _zigzag_paths(m: int) -> list[list[int]]:
    """m directed Hamiltonian paths decomposing K_m*, m even (zig-zag sequencing of Z_m).

    The order 0, 1, -1, 2, -2, ..., m/2 (mod m) has the consecutive differences 1, -2, 3, -4, ...,
    which are the m - 1 non-zero elements of Z_m once each (Williams 1949; Gordon 1961), so its m
    translates use every arc of K_m* exactly once. Path i runs from i to i + m/2.
    """
    base = [0]
    for j in range(1, m // 2 + 1):
        base.append(j % m)
        if j < m // 2:
            base.append((-j) % m)
    return [[(x + i) % m for x in base] for i in range(m)]


def _rainbow_path_search(cycles: Sequence[Sequence[int]], n: int) -> list[int] | None:
    """A Hamiltonian path of K_n* taking exactly one arc from each of the n - 1 given cycles.

    The cycles decompose K_n*, so from every vertex each cycle offers exactly one out-arc: a step
    is "pick an unused cycle, follow its arc". Depth-first search choosing first the cycle with the
    fewest arcs left inside the unvisited part (and pruning when some cycle has none left), with
    seeded random tie-breaking and restarts under a node budget, since long unlucky searches are
    the usual failure of such searches. Deterministic (the seed is n).
    """
    k = len(cycles)
    succ = [[0] * n for _ in range(k)]
    for index, cycle in enumerate(cycles):
        for a, b in cycle_arcs(cycle):
            succ[index][a] = b
    rng = random.Random(n)

    def candidates(v: int, visited: int, used: int) -> list[int]:
        free = [x for x in range(n) if not (visited >> x) & 1]
        ranked: list[tuple[int, float, int]] = []
        for c in range(k):
            if (used >> c) & 1:
                continue
            nc = succ[c]
            left = sum(1 for x in free if not (visited >> nc[x]) & 1)
            here = not (visited >> nc[v]) & 1
            if left + here == 0:
                return []  # cycle c can no longer contribute an arc: dead end
            if here:
                ranked.append((left, rng.random(), c))
        ranked.sort(reverse=True)  # popped from the end: most constrained cycle first
        return [c for _, _, c in ranked]

    per_restart = 4 * n
    for _ in range(400):
        start = rng.randrange(n)
        path, used_cycles = [start], []
        visited, used = 1 << start, 0
        stack = [candidates(start, visited, used)]
        expanded = 0
        while stack and expanded < per_restart:
            if len(path) == n:
                return path
            cands = stack[-1]
            if not cands:
                stack.pop()
                if used_cycles:
                    used &= ~(1 << used_cycles.pop())
                    visited &= ~(1 << path.pop())
                continue
            expanded += 1
            c = cands.pop()
            u = succ[c][path[-1]]
            visited |= 1 << u
            used |= 1 << c
            path.append(u)
            used_cycles.append(c)
            stack.append(candidates(u, visited, used))
        if len(path) == n:
            return path
    return None


def _rainbow_path_formula(base: Sequence[Sequence[int]], n_base: int) -> list[int] | None:
    """Closed-form rainbow path for the cyclic base of :func:`_cyclic_odd`, n_base + 1 = 4(k + 1).

    Cycle i gives up the arc ending at its position s_i (positions taken cyclically, the hub at 0):
    s_0 = 1, s_{k+1} = 4k + 2, s_{2k+2} = 3, s_{3k+2} = 4k and s_i = 2k otherwise. Chaining these
    arcs from the hub gives the path; the same shift pattern is used by the TASP reference
    implementation for n divisible by 4. Returns None when the arcs do not chain into a
    Hamiltonian path (n = 8), so the caller falls back to the search.
    """
    n = n_base + 1
    if n % 4 or n < 12:
        return None
    k = n // 4 - 1
    special = {0: 1, k + 1: 4 * k + 2, 2 * k + 2: 3, 3 * k + 2: 4 * k}
    follow: dict[int, int] = {}
    for i, cycle in enumerate(base):
        s = special.get(i, 2 * k) % n_base
        follow[cycle[(s - 1) % n_base]] = cycle[s]
    path = [0]
    while path[-1] in follow and len(path) <= n_base:
        path.append(follow[path[-1]])
    return path if sorted(path) == list(range(n_base)) else None


def _extend_by_one_vertex(base: Sequence[Sequence[int]], n_base: int, path: Sequence[int]) -> list[list[int]]:
    """From n_base - 1 arc-disjoint Hamiltonian cycles of K_{n_base}* build n_base of K_{n_base+1}*.

    ``path`` is a rainbow Hamiltonian path x_0 -> x_1 -> ... -> x_{N-1} (N = n_base) taking each of
    its arcs from a different cycle. In the cycle owning x_i -> x_{i+1} that arc is replaced by
    x_i -> v -> x_{i+1} (v the new vertex), and v -> x_0 -> ... -> x_{N-1} -> v is added. Every old
    arc is still used once (the path arcs moved into the new cycle) and v gets every out-arc (to
    x_1..x_{N-1} and x_0) and every in-arc (from x_0..x_{N-2} and x_{N-1}) once.
    """
    v = n_base
    owner = {arc: i for i, cycle in enumerate(base) for arc in cycle_arcs(cycle)}
    out = [list(c) for c in base]
    for a, b in zip(path, path[1:]):
        cycle = out[owner[(a, b)]]
        cycle.insert(cycle.index(a) + 1, v)
    out.append([v, *path])
    return [_rotate_to_zero(c) for c in out]


def _cyclic_odd(n: int) -> list[list[int]]:
    """Hamiltonian decomposition of K_n*, n odd: hub 0 plus the n - 1 zig-zag paths on 1..n-1."""
    return [[0] + [x + 1 for x in path] for path in _zigzag_paths(n - 1)]


def _even_decomposition(n: int) -> list[list[int]]:
    """n - 1 arc-disjoint Hamiltonian cycles of K_n*, n even >= 8, by extending K_{n-1}* by a vertex.

    The rainbow path comes from the closed form of :func:`_rainbow_path_formula` when n % 4 == 0
    (n >= 12), else from the search, first on the cyclic base and then on Walecki's.
    """
    cyclic = _cyclic_odd(n - 1)
    path = _rainbow_path_formula(cyclic, n - 1)
    if path is not None:
        return _extend_by_one_vertex(cyclic, n - 1, path)
    for base in (cyclic, _walecki(n - 1)):
        path = _rainbow_path_search(base, n - 1)
        if path is not None:
            return _extend_by_one_vertex(base, n - 1, path)
    raise RuntimeError(f"no Hamiltonian decomposition of K_{n}* found by the search")


def _max_disjoint_search(n: int) -> list[list[int]]:
    """Largest set of arc-disjoint Hamiltonian cycles of K_n*, by exhaustive search (small n only).

    Every cycle leaves vertex 0 by a different arc, so cycles are grouped by their first arc
    0 -> x; the search fills as many of the n - 1 groups as it can, trying n - 1 cycles first.
    For n = 4 and 6 that fails (Tillson) and n - 2 succeeds.
    """
    by_first: dict[int, list[tuple[list[int], frozenset[Arc]]]] = {x: [] for x in range(1, n)}
    for perm in itertools.permutations(range(1, n)):
        cycle = [0, *perm]
        by_first[perm[0]].append((cycle, frozenset(cycle_arcs(cycle))))

    def search(x: int, skips_left: int, used: frozenset[Arc], chosen: list[list[int]]) -> list[list[int]] | None:
        if x == n:
            return list(chosen)
        for cycle, arcs in by_first[x]:
            if used.isdisjoint(arcs):
                chosen.append(cycle)
                found = search(x + 1, skips_left, used | arcs, chosen)
                chosen.pop()
                if found is not None:
                    return found
        if skips_left > 0:
            return search(x + 1, skips_left - 1, used, chosen)
        return None

    for target in range(n - 1, 0, -1):
        found = search(1, n - 1 - target, frozenset(), [])
        if found is not None:
            return found
    return []


@cache
def _decomposition(n: int) -> tuple[tuple[int, ...], ...]:
    if n < 1:
        raise ValueError(f"need at least one rank, got {n}")
    if n == 1:
        cycles: list[list[int]] = []
    elif n == 2:
        cycles = [[0, 1]]
    elif n % 2 == 1:
        cycles = _walecki(n)
    elif n in (4, 6):
        cycles = _max_disjoint_search(n)
    else:
        cycles = _even_decomposition(n)
    verify_arc_disjoint_cycles(cycles, n)
    expected = n - 2 if n in (4, 6) else n - 1
    if len(cycles) != expected:  # pragma: no cover - guarded by the tests
        raise RuntimeError(f"expected {expected} cycles for n={n}, built {len(cycles)}")
    return tuple(tuple(c) for c in cycles)


def hamiltonian_decomposition(n: int) -> list[list[int]]:
    """Arc-disjoint directed Hamiltonian cycles of K_n*, each a rank order starting with rank 0.

    Cycle ``c`` uses the arcs ``c[i] -> c[(i + 1) % n]``. There are n - 1 of them (every arc of
    K_n* used exactly once) except for n = 4 and n = 6, where no such decomposition exists
    (Tillson 1980) and the n - 2 returned cycles are the most possible; :func:`idle_arcs` lists
    the n arcs they leave unused (every rank has exactly one idle out-link and one idle in-link).

    * n = 1: ``[]``; n = 2: ``[[0, 1]]``; n = 3: ``[[0, 1, 2], [0, 2, 1]]``.
    * odd n: Walecki's construction, each undirected cycle in both directions.
    * even n >= 8: a decomposition of K_{n-1}* extended by one vertex through a rainbow
      Hamiltonian path (see ``_extend_by_one_vertex``): closed form for n % 4 == 0, n >= 12,
      deterministic search otherwise.
    * n = 4, 6: exhaustive search, deterministic.

    Results are verified and cached; each call returns fresh lists.
    """
    return [list(c) for c in _decomposition(n)]


def idle_arcs(n: int) -> list[Arc]:
    """Arcs of K_n* that no cycle of :func:`hamiltonian_decomposition` uses (empty unless n is 4 or 6)."""
    used = {arc for cycle in _decomposition(n) for arc in cycle_arcs(cycle)}
    return [(a, b) for a in range(n) for b in range(n) if a != b and (a, b) not in used]


# --------------------------------------------------------------------------------------------
# several nodes: (m-K_m-m)_u


@cache
def _path_decomposition(m: int) -> tuple[tuple[int, ...], ...]:
    if m < 1:
        raise ValueError(f"need at least one rank per node, got {m}")
    if m == 1:
        return ((0,),)
    if m % 2 == 0:
        paths = _zigzag_paths(m)
    else:  # delete vertex m from the cycles of K_{m+1}*
        paths = []
        for cycle in _decomposition(m + 1):
            j = cycle.index(m)
            paths.append(list(cycle[j + 1 :]) + list(cycle[:j]))
    return tuple(tuple(p) for p in paths)


def hamiltonian_path_decomposition(m: int) -> list[list[int]]:
    """Arc-disjoint directed Hamiltonian paths of K_m*, with distinct start ranks and distinct ends.

    m even: the m translates of the zig-zag sequencing 0, 1, -1, 2, -2, ..., m/2 of Z_m (path i
    runs from i to i + m/2); they use every arc of K_m*. m odd: the cycles of
    :func:`hamiltonian_decomposition` (m + 1) with vertex m deleted: m paths using every arc for
    m >= 7, but only m - 1 for m = 3 and 5, where no decomposition into m paths exists (it would
    give one of K_4* or K_6* by adding a vertex); m - 1 arcs stay idle there. m = 1: ``[[0]]``.
    """
    return [list(p) for p in _path_decomposition(m)]


def _klein_relabellings(m: int) -> tuple[list[int], list[int]]:
    """Relabellings phi_1, phi_2 of local ranks for the zig-zag paths when m % 4 == 0.

    The zig-zag decomposition moves each start x to the end tau(x) = x + m/2. Relabelled by phi it
    moves x to phi tau phi^-1 (x). We want three nodes whose start-to-end maps compose to the
    identity: tau, iota = (x -> x xor 1) and iota tau, three commuting fixed-point-free involutions
    (m/2 even keeps x xor 1 in the same half). phi maps tau's pairs {x, x + m/2} onto the target's.
    """
    half = m // 2

    def conjugator(target: Sequence[int]) -> list[int]:
        firsts = sorted(x for x in range(m) if x < target[x])
        phi = [0] * m
        for x, p in enumerate(firsts):
            phi[x], phi[x + half] = p, target[p]
        return phi

    iota = [x ^ 1 for x in range(m)]
    return conjugator(iota), conjugator([(x + half) % m ^ 1 for x in range(m)])


def _node_paths(m: int, u: int) -> list[dict[int, tuple[int, ...]]]:
    """For each node, its Hamiltonian paths keyed by start rank (see :func:`multi_node_decomposition`)."""
    base = _path_decomposition(m)
    forward = {p[0]: p for p in base}
    backward = {p[-1]: p[::-1] for p in base}
    nodes = [forward if j % 2 == 0 else backward for j in range(u)]
    if u % 2 == 1 and m % 4 == 0:
        for j, phi in zip((1, 2), _klein_relabellings(m)):
            nodes[j] = {phi[p[0]]: tuple(phi[x] for x in p) for p in base}
    return nodes


def multi_node_rail_aligned(m: int, u: int) -> bool:
    """Whether every inter-node hop of :func:`multi_node_decomposition` stays on one rail.

    True for u even, for m % 4 == 0 and for m = 1; otherwise only the hop from node u - 1 back to
    node 0 changes rail.
    """
    return u % 2 == 0 or m % 4 == 0 or m == 1


@cache
def _multi_node(m: int, u: int) -> tuple[tuple[int, ...], ...]:
    if u < 1:
        raise ValueError(f"need at least one node, got {u}")
    if u == 1:
        return _decomposition(m)
    nodes = _node_paths(m, u)
    cycles: list[list[int]] = []
    for start in sorted(nodes[0]):
        cycle: list[int] = []
        local = start
        for j, paths in enumerate(nodes):
            path = paths[local]
            cycle.extend(j * m + x for x in path)
            local = path[-1]
        cycles.append(_rotate_to_zero(cycle))
    verify_arc_disjoint_cycles(cycles, m * u)
    return tuple(tuple(c) for c in cycles)


def multi_node_decomposition(m: int, u: int) -> list[list[int]]:
    """Arc-disjoint Hamiltonian cycles over u nodes of m ranks (global rank = node * m + local).

    The (m-K_m-m)_u topology of the TASP paper: inside a node all m ranks are joined pairwise
    (K_m*), and between nodes every rank has one link of its own (its NIC), forming rails: rank
    (j, a) is linked to rank (j + 1 mod u, a). These "rail links" are :func:`rail_links` (m, u).
    Construction: take the Hamiltonian paths P of :func:`hamiltonian_path_decomposition` (m)
    (k = m of them, k = m - 1 for m = 3 and 5). Ring i starts on node 0 at the start of P_i,
    walks it, hops along its rail to node 1, walks there the path that starts where it arrived,
    and so on through nodes 0, 1, ..., u - 1 and back to node 0. Even nodes use the paths P,
    odd nodes the reversed paths, so the ring arrives on node 2 where it started on node 0. With
    u odd and m % 4 == 0 nodes 1 and 2 use relabelled paths whose start-to-end maps compose to
    the identity (see ``_klein_relabellings``), so the ring still closes on its own rail; with u
    odd otherwise, the hop from node u - 1 to node 0 goes from the end of P_i to its start, a
    different local rank. Cycles are rotated to start at rank 0; u = 1 returns
    :func:`hamiltonian_decomposition` (m).

    Properties for u >= 2, checked by the tests:

    * k cycles, each Hamiltonian on the m * u ranks, no arc used twice;
    * intra-node: every node uses the arcs of a Hamiltonian path decomposition of its K_m*, so
      every intra-node arc exactly once when k = m;
    * inter-node: each cycle crosses from node j to node j + 1 (mod u) exactly once for every j
      and never between other pairs of nodes. For each j the k crossing arcs have distinct tails
      and distinct heads (a matching), and when :func:`multi_node_rail_aligned` they all join equal
      local ranks. "Uses every inter-node link" means: when k = m and the rings are rail-aligned,
      every rail link (j, a) -> (j + 1 mod u, a) carries exactly one ring, so every rank's NIC
      sends and receives exactly one stream per step. Together with the intra-node property the
      rings then use every link of the topology exactly once (:func:`multi_node_idle_links` is
      empty). For u = 2 both directions of each rail are used (node 0 -> 1 and node 1 -> 0).
    """
    return [list(c) for c in _multi_node(m, u)]


def rail_links(m: int, u: int) -> list[Arc]:
    """Inter-node links (j * m + a) -> ((j + 1) % u * m + a) of the (m-K_m-m)_u topology (none for u = 1)."""
    if u < 2:
        return []
    return [(j * m + a, (j + 1) % u * m + a) for j in range(u) for a in range(m)]


def multi_node_idle_links(m: int, u: int) -> list[Arc]:
    """Links of the (m-K_m-m)_u topology (intra-node K_m* arcs and rail links) no ring uses.

    Empty exactly when every link carries one ring: m not 3 or 5 and rail-aligned rings.
    """
    used = {arc for cycle in _multi_node(m, u) for arc in cycle_arcs(cycle)}
    intra = [(j * m + a, j * m + b) for j in range(u) for a in range(m) for b in range(m) if a != b]
    return [arc for arc in intra + rail_links(m, u) if arc not in used]


# --------------------------------------------------------------------------------------------
# routing


@dataclass(frozen=True)
class RoutingTable:
    """Schedule for moving one KV sub-block per cycle per rank along that cycle.

    Rank r owns one sub-block per cycle c, named ``(r, c)`` (a :data:`SubBlock`). Compute steps
    are t = 0..n-1 and hop t moves every sub-block one arc forward along its own cycle, from step
    t to step t + 1:

    * at step t rank r holds ``(prev_c^t(r), c)`` for every c (:meth:`held`); at step 0 its own;
    * in hop t rank r sends the sub-block of cycle c to ``next_rank[c][r]`` and receives the next
      one from ``prev_rank[c][r]`` (:meth:`sends`, :meth:`receives`);
    * the forward pass uses hops 0..n-2: over steps 0..n-1 every rank holds, for every cycle,
      every rank's sub-block exactly once (its own at step 0), because the cycle is Hamiltonian;
    * one all_to_all per hop: :meth:`send_layout` (t, r) lists, per destination rank, the
      sub-blocks r sends there, ordered by cycle; :meth:`recv_layout` (t, r) lists per sender
      what r receives, in the same order, so ``send_layout(t, r)[d] == recv_layout(t, d)[r]``.
      Which cycles go from r to d does not depend on t, so the split sizes
      (:meth:`send_counts`, :meth:`recv_counts`) are the same in every hop. With arc-disjoint
      cycles every (r, d) entry holds at most one sub-block (``max_arc_load == 1``).

    Backward: the gradient of sub-block (s, c) travels forward along the rest of its cycle to its
    owner. Each rank recirculates the keys and values exactly as in forward, starting from its
    own sub-blocks, and the dK/dV accumulator of a sub-block rides in the same all_to_all as the
    sub-block; the holder at step t adds its contribution in place. After step n - 1 the
    accumulator of (s, c) sits at prev_c(s), one arc of cycle c before its owner, and one more
    hop t = n - 1 (gradients only) takes it home: :meth:`send_layout` (n - 1, r) is exactly that
    hop and :meth:`grad_route` the whole way. This needs no extra copies: nothing is kept from
    forward beyond each rank's own K/V (already saved for backward), every hop has the forward
    layout and split sizes, and the links stay arc-disjoint. Sending gradients back along the
    reversed path would instead need, at the start of backward, the last sub-blocks held in
    forward (a KV-sized buffer kept per layer, or an extra fetch).
    """

    n: int
    cycles: tuple[tuple[int, ...], ...]
    next_rank: tuple[tuple[int, ...], ...]  # [cycle][rank]
    prev_rank: tuple[tuple[int, ...], ...]  # [cycle][rank]
    position: tuple[tuple[int, ...], ...]  # [cycle][rank]: index of rank in the cycle
    max_arc_load: int  # most cycles sharing one arc: 1 for arc-disjoint cycles, 0 without cycles

    @property
    def num_cycles(self) -> int:
        return len(self.cycles)

    @property
    def num_hops(self) -> int:
        """Hops of the forward pass (n - 1); backward makes one more, t = n - 1."""
        return self.n - 1

    def _check_step(self, t: int, last: int) -> None:
        if not 0 <= t <= last:
            raise IndexError(f"step {t} outside 0..{last}")

    def holder(self, source: int, cycle: int, t: int) -> int:
        """Rank that holds sub-block (source, cycle) at step t (t taken mod n)."""
        return self.cycles[cycle][(self.position[cycle][source] + t) % self.n]

    def route(self, source: int, cycle: int) -> list[int]:
        """Holders of (source, cycle) at steps 0..n-1: source, next, next of next, ..."""
        return [self.holder(source, cycle, t) for t in range(self.n)]

    def grad_route(self, source: int, cycle: int) -> list[int]:
        """Ranks the gradient of (source, cycle) passes: its route, then back to the owner (n hops)."""
        return [*self.route(source, cycle), source]

    def held(self, t: int, r: int) -> list[SubBlock]:
        """Sub-blocks present at rank r during compute step t (0..n-1), one per cycle, by cycle."""
        self._check_step(t, self.n - 1)
        return [(c[(self.position[i][r] - t) % self.n], i) for i, c in enumerate(self.cycles)]

    def sends(self, t: int, r: int) -> list[tuple[SubBlock, int]]:
        """(sub-block, destination) for each cycle, sent by r in hop t (0..n-1; n-1: gradients)."""
        self._check_step(t, self.n - 1)
        return [(block, self.next_rank[block[1]][r]) for block in self.held(t, r)]

    def receives(self, t: int, r: int) -> list[tuple[SubBlock, int]]:
        """(sub-block, sender) for each cycle, received by r in hop t (0..n-1; n-1: own gradients)."""
        self._check_step(t, self.n - 1)
        return [(block, self.prev_rank[block[1]][r]) for block in self.held((t + 1) % self.n, r)]

    def send_layout(self, t: int, r: int) -> list[list[SubBlock]]:
        """Per destination rank, the sub-blocks r sends there in hop t, ordered by cycle."""
        out: list[list[SubBlock]] = [[] for _ in range(self.n)]
        for block, dest in self.sends(t, r):
            out[dest].append(block)
        return out

    def recv_layout(self, t: int, r: int) -> list[list[SubBlock]]:
        """Per sender rank, the sub-blocks r receives from it in hop t, ordered by cycle."""
        out: list[list[SubBlock]] = [[] for _ in range(self.n)]
        for block, src in self.receives(t, r):
            out[src].append(block)
        return out

    def send_counts(self, r: int) -> list[int]:
        """Sub-blocks r sends to each rank in any hop (all_to_all split sizes, in sub-blocks)."""
        counts = [0] * self.n
        for nxt in self.next_rank:
            counts[nxt[r]] += 1
        return counts

    def recv_counts(self, r: int) -> list[int]:
        """Sub-blocks r receives from each rank in any hop."""
        counts = [0] * self.n
        for prv in self.prev_rank:
            counts[prv[r]] += 1
        return counts


def routing_table(cycles: Sequence[Sequence[int]], n: int) -> RoutingTable:
    """Build the :class:`RoutingTable` for Hamiltonian ``cycles`` on ranks 0..n-1.

    Every cycle must be Hamiltonian (``ValueError`` otherwise). Cycles may share arcs; then
    ``max_arc_load`` > 1 and several sub-blocks go to the same destination in one hop.
    """
    cyc = tuple(tuple(int(x) for x in c) for c in cycles)
    for index, c in enumerate(cyc):
        if sorted(c) != list(range(n)):
            raise ValueError(f"cycle {index} is not a Hamiltonian cycle on {n} ranks: {list(c)}")
    load: dict[Arc, int] = {}
    for c in cyc:
        for arc in cycle_arcs(c):
            load[arc] = load.get(arc, 0) + 1
    position = tuple(tuple(c.index(r) for r in range(n)) for c in cyc)
    return RoutingTable(
        n=n,
        cycles=cyc,
        next_rank=tuple(tuple(c[(p[r] + 1) % n] for r in range(n)) for c, p in zip(cyc, position)),
        prev_rank=tuple(tuple(c[(p[r] - 1) % n] for r in range(n)) for c, p in zip(cyc, position)),
        position=position,
        max_arc_load=max(load.values(), default=0),
    )
