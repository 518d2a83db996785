"""Hamiltonian decompositions of the complete digraph K_n*: the rings TASP moves keys and values on.

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

Pure graph theory: deterministic, cached, no torch. Which key rows travel on which cycle, hop by
hop, is :func:`hf_longctx.backends.tasp.routes`.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from functools import cache

Arc = tuple[int, int]

__all__ = [
    "Arc",
    "cycle_arcs",
    "hamiltonian_decomposition",
    "idle_arcs",
    "verify_arc_disjoint_cycles",
]


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
