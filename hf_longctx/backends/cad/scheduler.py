"""Communication-aware greedy scheduler for core attention disaggregation (CAD / DistCA).

Each rank keeps its documents for the context-independent layers (equal token counts keep linear
layers and activation memory balanced); only core attention is rebalanced. Core attention is
divisible at token granularity: any run of query rows of a document can be computed anywhere, given
its causal KV prefix. Every rank is also an *attention server* (in-place servers: server ``s`` lives
on rank ``s``). The scheduler (:func:`assign_servers`) decides which server computes which query rows: its
:class:`CadSchedule` is an assignment of rows to servers, with no steps (the backends' step-by-step
:data:`~hf_longctx.backends.schedule.Schedule` of blocks is another thing).

Algorithm (the paper's greedy, with numpy/heap bookkeeping so 512 ranks schedule in milliseconds):

1. Every server starts with its own rank's documents; ``F = total cost / num_servers`` is the target.
2. Repeatedly take the server with the largest deficit ``F - load`` and, among the items of the
   ``search_width`` servers with the largest surplus ``load - F``, pick the move with the most cost
   moved per byte sent. A move transfers ``dF <= min(item cost, surplus, deficit)``: a whole item
   when it fits, else a shard sized to ``dF``. Moves never push a source below ``F`` or a receiver
   above it, so the process cannot oscillate.
3. Stop when every server is within ``eps * F`` of the target, or when no move is possible (shards
   would fall below ``min_shard`` rows), worth at least ``min_move_frac * F``, or pays
   ``min_gain_per_byte`` for its bytes.

Head-tail pairing (the paper's appendix B). A shard cut from a document is a ring: a head chunk
``[lo, lo + k)`` and the mirrored tail chunk ``[hi - k, hi)`` of the rows still held, which stay
``[lo + k, hi - k)``. Row ``i`` of a piece at offset ``o`` sees ``o + i + 1`` keys, so rows ``i`` and
``L - 1 - i`` together always see ``2 o + L + 1``: a ring costs the document's average per row, its
cost is linear in ``k`` (the shard for a given ``dF`` is found in one Newton step, exactly for FLOPs)
and the estimate a profiled model gives per token stays accurate. The rows left behind stay one
contiguous run, which the source computes in place.

Per-segment cost. A profiled model may charge every segment a fixed ``segment_cost`` on top of its
rows (:class:`~.cost_model.ProfiledCostModel`): a ring then costs its receiver two segment terms
more than the source sheds (the source's remainder stays one segment). The ring's size is solved on
its rows alone (the cap less the two terms), moves are ranked by what the source sheds, and each
ring raises the target ``F`` by ``2 * segment_cost / num_servers``, so that ``F`` stays the mean of
what the servers will compute. Final loads are the tasks priced one by one (adjacent shards merged
into one task pay one term). With FLOPs (no such term) every step is as if the term did not exist.

Bytes. A task computed on a server other than its token owner's rank moves its query rows there,
its KV prefix (offset tokens plus piece rows ``[0, q_end)``) unless that server already received it
for another task of the same piece, and its output rows plus log-sum-exp back. Offset tokens live on
another rank (the piece continues a document cut at a rank boundary), so even an in-place task fetches
``offset`` KV rows. All bytes of a task are charged to its token owner's rank (``bytes_per_rank``) and
to its server (``bytes_per_server``). Items are candidates only for moves from their home server, so
the search stays small; a piece's rows are thus split into the home run and rings on other servers.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np

from .cost_model import CostModel, FlopsCostModel, TokenBytes, segment_overhead
from .tasks import CadTask

__all__ = ["CadSchedule", "CadTask", "assign_servers", "parse_docs", "verify_schedule"]

DocItem = int | tuple[int, int]
OVERSHOOT_WIDE = 0.9  # the second balancing run's overshoot share of the gap (see schedule)


@dataclass
class CadSchedule:
    """Result of :func:`schedule`. Task fields are stored as parallel int64 arrays (``task_*``);
    :attr:`tasks` builds :class:`~.tasks.CadTask` objects on first access (``task_owner``: the rank
    holding the piece, ``task_piece``: its index in ``docs_per_rank[owner]``).

    Tasks are ordered: first one per piece for the rows computed at the piece's home server (in
    (rank, doc) order), then the moved shards in the order they were moved, adjacent rows on the
    same server merged into one task.
    """

    task_owner: np.ndarray
    task_piece: np.ndarray
    task_q_start: np.ndarray
    task_q_end: np.ndarray
    task_server: np.ndarray
    loads: np.ndarray  # cost per server
    initial_loads: np.ndarray  # cost per server before balancing (every rank serves its own documents)
    target: float  # F = total / num_servers (with a per-segment cost term: grown by the terms the splits added)
    bytes_per_rank: np.ndarray  # bytes of the tasks of each token owner
    bytes_per_server: np.ndarray  # the same bytes, by the server that computes the task
    num_moves: int
    converged: bool  # every server within eps * target
    eps: float
    offsets: np.ndarray | None = None  # fixed cost per server beyond its tasks, in ``loads`` (``server_offsets``)
    stats: dict = field(default_factory=dict)
    task_key_lo: np.ndarray | None = None  # key cuts (see .tasks): first key, document-relative (None: all 0)
    task_key_hi: np.ndarray | None = None  # a rectangle's key end, -1 for a causal task (None: all -1)

    @property
    def num_servers(self) -> int:
        return len(self.loads)

    @property
    def imbalance(self) -> float:
        """max / mean of the server loads (1.0 is perfect)."""
        mean = float(self.loads.mean()) if len(self.loads) else 0.0
        return float(self.loads.max()) / mean if mean > 0 else 1.0

    @property
    def initial_imbalance(self) -> float:
        mean = float(self.initial_loads.mean()) if len(self.initial_loads) else 0.0
        return float(self.initial_loads.max()) / mean if mean > 0 else 1.0

    @cached_property
    def tasks(self) -> list[CadTask]:
        cols = (self.task_owner, self.task_piece, self.task_q_start, self.task_q_end, self.task_server)
        if self.task_key_lo is not None:
            cols += (self.task_key_lo, self.task_key_hi)
        return [CadTask(*row) for row in zip(*(c.tolist() for c in cols))]

    def tasks_of_server(self, server: int) -> np.ndarray:
        """Indices of the tasks computed on ``server``."""
        return np.flatnonzero(self.task_server == server)


def _pair(d) -> tuple[int, int]:
    if isinstance(d, (int, np.integer)):
        return int(d), 0
    length, offset = d  # anything but a pair raises here
    return int(length), int(offset)


def parse_docs(docs_per_rank: Sequence[Sequence[DocItem]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Flatten ``docs_per_rank`` into (length, offset, rank, doc index) int64 arrays.

    A rank's list may also be an int array (lengths) or an (m, 2) array of (length, offset) rows.
    Pairs usually sit at the ends of a rank's list (pieces cut at rank boundaries): those are
    unpacked first and the rest converted in one numpy call; only lists with pairs inside fall back
    to a per-item loop.
    """
    counts = np.fromiter((len(d) for d in docs_per_rank), dtype=np.int64, count=len(docs_per_rank))
    total = int(counts.sum())
    rank = np.repeat(np.arange(len(docs_per_rank), dtype=np.int64), counts)
    first = (np.cumsum(counts) - counts).astype(np.int64)
    doc = np.arange(total, dtype=np.int64) - first[rank]
    if any(isinstance(d, np.ndarray) for d in docs_per_rank):
        flat: list = []
        for d in docs_per_rank:
            flat.extend(d.tolist() if isinstance(d, np.ndarray) else d)
    else:
        flat = list(itertools.chain.from_iterable(docs_per_rank))
    off = np.zeros(total, dtype=np.int64)
    nonempty = counts > 0
    for j in (*first[nonempty].tolist(), *(first + counts - 1)[nonempty].tolist()):
        if not isinstance(flat[j], int):
            flat[j], off[j] = _pair(flat[j])
    try:
        length = np.fromiter(flat, dtype=np.int64, count=total)
    except (TypeError, ValueError):  # pairs inside a list
        for j, d in enumerate(flat):
            if not isinstance(d, int):
                flat[j], off[j] = _pair(d)
        length = np.fromiter(flat, dtype=np.int64, count=total)
    if total and (length.min() < 1 or off.min() < 0):
        raise ValueError("document lengths must be >= 1 and offsets >= 0")
    return length, off, rank, doc


# an overshoot's first rows leave their receiver at most this share of the target (or one smallest cut) above it
OVERSHOOT_ABOVE_TARGET = 0.25


class _Balancer:
    """Mutable state of one scheduling run; :func:`schedule` wraps it in a pure function."""

    def __init__(self, length, off, rank, num_servers, cost_model, tb, eps, min_shard, search_width,
                 min_move_frac, min_gain_per_byte, max_moves, overshoot=0.5, offsets=None):
        self.n = num_servers
        self.overshoot = overshoot  # an overshoot move may cost up to this share of the gap between the two loads
        self.cm = cost_model
        self.tb = tb
        self.min_shard = max(int(min_shard), 1)
        self.width = max(int(search_width), 1)
        self.min_gain = float(min_gain_per_byte)
        self.max_moves = max_moves
        self.home = rank % num_servers
        item_cost = cost_model.cost_array(length, off + length) if len(length) else np.zeros(0)
        self.item_cost = item_cost
        loads = np.bincount(self.home, weights=item_cost, minlength=num_servers).astype(np.float64)
        if offsets is not None:
            loads = loads + offsets
        self.initial_loads = loads.copy()
        self.target = float(loads.sum()) / num_servers
        self.eps = eps
        self.tol = eps * self.target
        self.min_move = min_move_frac * self.target
        self.seg = segment_overhead(cost_model)  # what every segment costs on top of its rows (a cut adds one)
        self.loads = loads.tolist()
        self.version = [0] * num_servers
        self.length, self.off, self.rank = length, off, rank
        # per touched item: [lo, hi] rows still at home; per (item, server): largest q_end shipped there
        self.info: dict[int, tuple[int, int, int]] = {}  # item -> (length, offset, rank), for indexed servers
        self.q_out_bytes = tb.q + tb.out
        self.pair_flops = cost_model.flops_per_pair if isinstance(cost_model, FlopsCostModel) else 0.0
        self.span: dict[int, list[int]] = {}
        self.shipped: dict[tuple[int, int], int] = {}
        self.moved: list[tuple[int, int, int, int]] = []  # (item, server, q_start, q_end)
        self.retired_src: set[int] = set()
        self.retired_dst: set[int] = set()
        self._by_server = None
        self._sorted: dict[int, list[tuple[float, int]]] = {}
        self.surplus_heap = [(-(v - self.target), s, 0) for s, v in enumerate(self.loads) if v > self.target]
        self.deficit_heap = [(-(self.target - v), s, 0) for s, v in enumerate(self.loads) if v < self.target]
        heapq.heapify(self.surplus_heap)
        heapq.heapify(self.deficit_heap)
        self.num_moves = 0

    # -- per-server candidate lists, built only for servers that act as sources -------------------

    def items_of(self, s: int) -> list[tuple[float, int]]:
        """Items whose home is ``s``, as (remaining cost, item) sorted ascending."""
        lst = self._sorted.get(s)
        if lst is None:
            if self._by_server is None:
                home = self.home
                # items arrive in rank order, so with a server per rank they are already grouped
                order = (np.arange(len(home)) if len(home) < 2 or np.all(home[1:] >= home[:-1])
                         else np.argsort(home, kind="stable"))
                bounds = np.searchsorted(home[order], np.arange(self.n + 1))
                self._by_server = (order, bounds)
            order, bounds = self._by_server
            ids = order[bounds[s]:bounds[s + 1]]
            ids = ids[np.argsort(self.item_cost[ids], kind="stable")]
            lst = list(zip(self.item_cost[ids].tolist(), ids.tolist()))
            self._sorted[s] = lst
        return lst

    def _info(self, i: int) -> tuple[int, int, int]:
        """(length, offset, rank) of item ``i`` as Python ints, cached (numpy scalars are slow)."""
        info = self.info.get(i)
        if info is None:
            info = self.info[i] = (int(self.length[i]), int(self.off[i]), int(self.rank[i]))
        return info

    # -- heaps with lazy invalidation -------------------------------------------------------------

    def _top(self, heap: list, k: int, retired: set[int], sign: float) -> list[tuple[float, int, int]]:
        out = []
        while heap and len(out) < k:
            negv, s, ver = heap[0]
            if ver != self.version[s] or s in retired or sign * (self.loads[s] - self.target) <= 0:
                heapq.heappop(heap)
                continue
            out.append(heapq.heappop(heap))
        for e in out:
            heapq.heappush(heap, e)
        return out

    def _update(self, s: int, delta: float) -> None:
        self.loads[s] += delta
        self.version[s] += 1
        v = self.loads[s] - self.target
        if v > 0:
            heapq.heappush(self.surplus_heap, (-v, s, self.version[s]))
        elif v < 0:
            heapq.heappush(self.deficit_heap, (v, s, self.version[s]))

    # -- pricing a move ---------------------------------------------------------------------------

    def _ring_cost(self, o: int, lo: int, hi: int, k: int) -> float:
        cost = self.cm.cost
        return cost(k, o + lo + k) + cost(k, o + hi)

    def _evaluate(self, i: int, f_item: float, dst: int, cap: float, slack: float):
        """Best move of item ``i`` to ``dst``: (dF, bytes, k, overshoot, gain) or None.

        ``k`` is the ring's chunk size, -1 for the whole remainder, ``-h - 1`` for the remainder's first ``h``
        rows alone (when no ring fits: half the rows of the smallest ring). The move shifts at most ``cap``
        (the source's surplus and the receiver's deficit) when it can; failing that, a whole item, the
        remainder's first rows (:meth:`_overshoot_head`: not far past the receiver's deficit) or a
        ``min_shard`` ring, of cost up to ``slack`` (half the gap between the two loads, so the larger
        of the two still falls), is an *overshoot* move, used when granularity leaves no exact one
        (e.g. ``eps = 0``).

        Per-segment cost (:func:`~.cost_model.segment_overhead`, 0 for FLOPs): a ring is two new
        segments, so it costs the receiver its rows plus two segment terms while the source sheds only
        the rows (its remainder stays one segment). ``dF`` is what the receiver takes on; ``gain``, what
        the source sheds, ranks the moves (a whole item: both are its cost).
        """
        L, o, r = self._info(i)
        span = self.span.get(i)
        lo, hi = (span[0], span[1]) if span else (0, L)
        over = False
        fixed = 2 * self.seg  # a ring's two new segments
        if f_item <= cap:
            df, rows, k = f_item, hi - lo, -1
        else:
            ms = self.min_shard
            kmax = (hi - lo - ms) // 2
            k, c = 0, 0.0
            if kmax >= ms and self.pair_flops:  # FLOPs: every row pair of a ring costs the same
                unit = self.pair_flops * (2 * o + lo + hi + 1)
                k = min(int(cap / unit), kmax)
                c = k * unit
            elif kmax >= ms and (not fixed or cap > fixed):
                # the ring's rows must fit in what its two segment terms leave of ``cap``
                room = cap - fixed
                k = int(room * (hi - lo) / (2.0 * (f_item - self.seg)))  # rows cost the piece average
                k = min(max(k, 1), kmax)
                c = self._ring_cost(o, lo, hi, k)
                if c > fixed:  # one Newton step on the (nearly) linear ring cost
                    k = min(int(k * room / (c - fixed)), kmax)
                for _ in range(4):
                    if k < ms:
                        break
                    c = self._ring_cost(o, lo, hi, k)
                    if c <= cap:
                        break
                    k = min(k - 1, int(k * room / (c - fixed)))
                else:
                    k = 0
            head = 0
            if k >= ms:
                df, rows = c, 2 * k
            elif (head := self._head_rows(o, lo, hi, cap)) or (head := self._overshoot_head(o, lo, hi, slack, dst)):
                # no ring fits: the piece's first rows alone, within the cap or else as a bounded overshoot
                df, rows, k = self.cm.cost(head, o + lo + head), head, 0
                over = df > cap
            elif kmax >= ms and (c := self._ring_cost(o, lo, hi, ms)) <= slack:
                df, rows, k, over = c, 2 * ms, ms, True
            elif f_item <= slack:
                df, rows, k, over = f_item, hi - lo, -1, True
            else:
                return None
            if head:
                end = lo + head
                gain = f_item - self.cm.cost(hi - end, o + hi)
                return self._priced(i, dst, r, o, df, rows, end, -head - 1, over, gain)
        if k > 0 and not self.pair_flops:
            # a measured cost need not be additive over rows: thin segments run below the piece's throughput
            # (thin segments over long prefixes at about half the rate of thick ones;
            # bench/results/2026-12-04_from-modules.md), so the source sheds what its remainder stops costing, which may
            # be much less than the ring costs
            gain = f_item - self.cm.cost(hi - lo - 2 * k, o + hi - k)
        else:
            gain = df - fixed if k > 0 else df
        return self._priced(i, dst, r, o, df, rows, hi, k, over, gain)

    def _head_rows(self, o: int, lo: int, hi: int, cap: float) -> int:
        """Most of the remainder's first rows (at least ``min_shard``, leaving at least ``min_shard``) whose
        segment costs at most ``cap``; 0 if none. Cost grows with the rows: a bisection."""
        ms = self.min_shard
        a, b = ms, hi - lo - ms
        if b < a or self.cm.cost(a, o + lo + a) > cap:
            return 0
        while a < b:
            mid = (a + b + 1) // 2
            if self.cm.cost(mid, o + lo + mid) <= cap:
                a = mid
            else:
                b = mid - 1
        return a

    def _overshoot_head(self, o: int, lo: int, hi: int, slack: float, dst: int) -> int:
        """Most of the remainder's first rows for an overshoot move: up to ``slack``, but leaving ``dst`` no more
        than :data:`OVERSHOOT_ABOVE_TARGET` of the target (or the smallest cut, ``min_shard`` rows, if larger)
        above it. Bounded by ``slack`` alone, a source far above the target (the holder of a long document's end)
        handed a receiver a shard worth up to half their gap, which then moves on only whole: far above the mean
        at 64 servers with a wider search. A tighter bound (the smallest cut alone) balanced that batch but changed
        most other schedules, some of them worse in emulated kernel time (bench/results/2026-12-04_from-modules.md)."""
        ms = self.min_shard
        above = max(self.cm.cost(ms, o + lo + ms), OVERSHOOT_ABOVE_TARGET * self.target)
        return self._head_rows(o, lo, hi, min(slack, max(self.target - self.loads[dst], 0.0) + above))

    def _priced(self, i, dst, r, o, df, rows, end, k, over, gain):
        """The move's tuple with its bytes (queries and outputs of ``rows``, keys up to row ``end`` unless
        already shipped to ``dst``), or None when it gains too little."""
        if gain < self.min_move or gain <= 0:
            return None
        if r == dst:
            nbytes = 0.0
        else:
            have = self.shipped.get((i, dst), -1)
            kv_extra = (o + end) if have < 0 else max(0, end - have)
            nbytes = rows * self.q_out_bytes + kv_extra * self.tb.kv
        return df, nbytes, k, over, gain

    def _best(self, dst: int, sources: list[int]):
        best, best_key = None, None
        deficit = self.target - self.loads[dst]
        for s in sources:
            cap = min(self.loads[s] - self.target, deficit)
            slack = (self.loads[s] - self.loads[dst]) * self.overshoot
            if max(cap, slack) < self.min_move:
                continue
            lst = self.items_of(s)
            if not lst:
                continue
            pos = bisect.bisect_right(lst, (cap, 1 << 62))
            cands = lst[max(pos - 2, 0):pos + 2]
            if pos + 2 < len(lst):
                cands.append(lst[-1])
            for f_item, i in cands:
                res = self._evaluate(i, f_item, dst, cap, slack)
                if res is None:
                    continue
                df, nbytes, k, over, gain = res
                ratio = gain / nbytes if nbytes > 0 else float("inf")
                key = (not over, ratio, gain)
                if best_key is None or key > best_key:
                    best_key, best = key, (s, i, f_item, df, nbytes, k)
        return best, (best_key[1] if best_key else 0.0)

    def _apply(self, dst: int, move) -> None:
        s, i, f_item, df, _nbytes, k = move
        L, o, _ = self._info(i)
        span = self.span.setdefault(i, [0, L])
        lo, hi = span
        lst = self._sorted[s]
        del lst[bisect.bisect_left(lst, (f_item, i))]
        released = f_item  # what the source stops computing; equals df unless the model is not additive
        if k < -1:  # the remainder's first -k - 1 rows
            end = lo - k - 1
            self.moved.append((i, dst, lo, end))
            span[0] = end
            new_cost = self.cm.cost(hi - end, o + hi)
            bisect.insort(lst, (new_cost, i))
            released = f_item - new_cost
        elif k < 0:  # whole remainder
            self.moved.append((i, dst, lo, hi))
            span[0] = span[1] = lo
            end = hi
        else:
            self.moved.append((i, dst, lo, lo + k))
            self.moved.append((i, dst, hi - k, hi))
            span[0], span[1] = lo + k, hi - k
            end = hi
            new_cost = self.cm.cost(span[1] - span[0], o + span[1])
            bisect.insort(lst, (new_cost, i))
            released = f_item - new_cost
        key = (i, dst)
        self.shipped[key] = max(self.shipped.get(key, -1), end)
        if df != released:  # a ring's segment terms, or thin segments' lower throughput: the work grew, and the
            self.target += (df - released) / self.n  # target stays the mean of what the servers will compute
            self.tol = self.eps * self.target
        self._update(s, -released)
        self._update(dst, df)
        self.num_moves += 1

    def refine(self, receivers: int = 8) -> None:
        """Lower the largest load while a move does: the greedy stops where no move fits a receiver's deficit,
        which coarse items (a piece whose smallest cut is a sizeable share of ``F``) cause when servers hold
        few thousand rows. Here the busiest server offers each of its items to the ``receivers`` least loaded
        servers, sized to even the pair out (or overshoot up to most of their gap), and each shard it received
        whole; the move that leaves the pair's larger load smallest is taken, if it is below the busiest load.
        Where no single move helps, a chain of two may (:meth:`_chain`). Every move lowers the busiest load of
        the servers it touches, so the loop ends; it stops when the busiest server can give nothing (or at
        ``max_moves``).
        """
        while self.num_moves < self.max_moves:
            loads = self.loads
            s = max(range(self.n), key=loads.__getitem__)
            if loads[s] - self.target <= self.tol:
                return
            best, best_peak = None, loads[s] * (1 - 1e-6)
            # passing shards on and chains are priced without their bytes: only when moves need not pay for them
            shards = [] if self.min_gain > 0 else [
                (j, self.cm.cost(b - a, self._info(i)[1] + b))
                for j, (i, srv, a, b) in enumerate(self.moved) if srv == s]
            for dst in sorted(range(self.n), key=loads.__getitem__)[:receivers]:
                gap = loads[s] - loads[dst]
                if dst == s or gap <= 0:
                    continue
                for f_item, i in list(self.items_of(s)):
                    res = self._evaluate(i, f_item, dst, gap / 2, gap * 0.99)
                    if res is None:
                        continue
                    df, _nbytes, k, _over, gain = res
                    if _nbytes > 0 and gain / _nbytes < self.min_gain:
                        continue
                    peak = max(loads[s] - gain, loads[dst] + df)
                    if peak < best_peak:
                        best_peak, best = peak, (dst, (s, i, f_item, df, _nbytes, k))
                # a shard this server received passes on whole (an earlier overshoot may have left it here)
                for j, c in shards:
                    if self.home[self.moved[j][0]] == dst:  # not back home: its rows there stay one run
                        continue
                    peak = max(loads[s] - c, loads[dst] + c)
                    if peak < best_peak:
                        best_peak, best = peak, (dst, j, c)
            if best is None and self.min_gain <= 0:
                best = self._chain(s)
            if best is None:
                return
            if best[0] == "chain":
                _, first, second = best
                self._apply(*first)
                self._apply(*second)
            elif len(best) == 3:
                self._pass_on(s, *best)
            else:
                self._apply(*best)

    def _pass_on(self, s: int, dst: int, j: int, cost: float) -> None:
        """Move the shard ``self.moved[j]`` (on server ``s``, costing ``cost``) on to ``dst`` whole."""
        i, _, a, b = self.moved[j]
        self.moved[j] = (i, dst, a, b)
        self.shipped[i, dst] = max(self.shipped.get((i, dst), -1), b)
        self._update(s, -cost)
        self._update(dst, cost)
        self.num_moves += 1

    def _chain(self, s: int, receivers: int = 8):
        """Two moves that lower the busiest load ``s`` where no single one does: the smallest head chunk of one
        of ``s``'s items goes to a lightly loaded server ``d`` (pushing it above ``s`` alone), and ``d`` passes one
        of its own whole items to the least loaded other server. None if no pair lowers the largest of the three."""
        loads, ms = self.loads, self.min_shard
        if self.n < 3:
            return None
        order = sorted(range(self.n), key=loads.__getitem__)
        best, best_peak = None, loads[s] * (1 - 1e-6)
        for f_item, i in list(self.items_of(s)):
            L, o, r = self._info(i)
            lo, hi = self.span.get(i, (0, L))
            if hi - lo < 2 * ms:
                continue
            df = self.cm.cost(ms, o + lo + ms)
            gain = f_item - self.cm.cost(hi - lo - ms, o + hi)
            if gain <= 0:
                continue
            for d in order[:receivers]:
                if d == s:
                    continue
                e = next(x for x in order if x not in (s, d))
                for f_j, j in self.items_of(d):
                    peak = max(loads[s] - gain, loads[d] + df - f_j, loads[e] + f_j)
                    if peak < best_peak:
                        first = (d, (s, i, f_item, df, 0.0, -ms - 1))
                        best_peak, best = peak, ("chain", first, (e, (d, j, f_j, f_j, 0.0, -1)))
        return best

    def run(self) -> bool:
        while self.num_moves < self.max_moves:
            dtop = self._top(self.deficit_heap, 1, self.retired_dst, -1.0)
            if not dtop:
                break
            dst, deficit = dtop[0][1], -dtop[0][0]
            if deficit > self.tol:
                srcs = [e[1] for e in self._top(self.surplus_heap, self.width, self.retired_src, 1.0)]
            else:
                stop = self._top(self.surplus_heap, 1, self.retired_src, 1.0)
                if not stop or -stop[0][0] <= self.tol:
                    break
                srcs = [stop[0][1]]
            if not srcs:
                break
            move, ratio = self._best(dst, srcs)
            if move is None or ratio < self.min_gain:
                if deficit > self.tol:
                    self.retired_dst.add(dst)
                else:
                    self.retired_src.add(srcs[0])
                continue
            self._apply(dst, move)
        return self.converged()

    def converged(self) -> bool:
        """Every server within ``eps * F`` of the target (up to rounding)."""
        return all(abs(v - self.target) <= self.tol * (1 + 1e-9) + 1e-9 * self.target for v in self.loads)


def _merge_moved(moved: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
    """Merge shards of the same item on the same server whose rows touch."""
    moved = sorted(moved)
    out: list[list[int]] = []
    for i, s, a, b in moved:
        if out and out[-1][0] == i and out[-1][1] == s and out[-1][3] == a:
            out[-1][3] = b
        else:
            out.append([i, s, a, b])
    return [tuple(t) for t in out]


def _bytes(off, rank, n_ranks, n_servers, tb, home_items, home_lo, home_hi, moved):
    """Bytes per rank and per server of the final task set (see the module docstring)."""
    # home runs: one task per (item, home server); local unless the rank has no server of its own
    r = rank[home_items]
    o = off[home_items]
    b = o * float(tb.kv)
    if n_ranks > n_servers:
        remote = r >= n_servers
        b[remote] = ((home_hi - home_lo)[remote] * (tb.q + tb.out) + (o[remote] + home_hi[remote]) * tb.kv)
    per_rank = np.bincount(r, weights=b, minlength=n_ranks)
    per_server = np.bincount(r % n_servers, weights=b, minlength=n_servers)
    if len(moved):
        # moved shards, grouped by (item, server): KV prefix once, up to the largest q_end
        mv = np.asarray(moved, dtype=np.int64).reshape(-1, 4)
        keys, inv = np.unique(mv[:, 0] * n_servers + mv[:, 1], return_inverse=True)
        item, srv = keys // n_servers, keys % n_servers
        nrows = np.bincount(inv, weights=mv[:, 3] - mv[:, 2], minlength=len(keys))
        end = np.zeros(len(keys), dtype=np.int64)
        np.maximum.at(end, inv, mv[:, 3])
        gr = rank[item]
        nb = np.where(gr == srv, off[item] * float(tb.kv), nrows * (tb.q + tb.out) + (off[item] + end) * tb.kv)
        per_rank += np.bincount(gr, weights=nb, minlength=n_ranks)
        per_server += np.bincount(srv, weights=nb, minlength=n_servers)
    return per_rank, per_server


def assign_servers(
    docs_per_rank: Sequence[Sequence[DocItem]],
    num_servers: int | None = None,
    eps: float = 0.1,
    cost_model: CostModel | None = None,
    min_shard: int = 128,
    *,
    token_bytes: TokenBytes | None = None,
    search_width: int = 1,
    min_move_frac: float = 1e-4,
    min_gain_per_byte: float = 0.0,
    max_moves: int | None = None,
    server_offsets: Sequence[float] | None = None,
) -> CadSchedule:
    """Assign every query row of every document to an attention server, balancing attention cost.

    Pure function of its arguments (deterministic, no global state).

    Args:
        docs_per_rank: ``docs_per_rank[r]`` lists what rank ``r`` holds: ints (a whole document) or
            ``(length, offset)`` pairs, ``offset`` tokens of the same document preceding the piece
            (held elsewhere; its queries attend to them too).
        num_servers: attention servers; server ``s`` lives on rank ``s``. Default: one per rank.
            Ranks ``r >= num_servers`` start on server ``r % num_servers`` (their tasks are remote).
        eps: stop once every server's cost is within ``eps * F`` of ``F = total / num_servers``.
        cost_model: :class:`FlopsCostModel` (default) or a ``ProfiledCostModel``.
        min_shard: a split never makes a task shorter than this many rows; pieces shorter than
            ``3 * min_shard`` (a ring of two chunks plus the run left behind) move only whole.
        token_bytes: wire bytes per token (Q, KV, out + lse); default Llama-3-8B bf16.
        search_width: surplus servers whose items are priced for each move (the largest surpluses).
        min_move_frac: moves smaller than this fraction of ``F`` are not worth a transfer.
        min_gain_per_byte: a move must shift at least this much cost per byte sent (0: any move).
        max_moves: safety cap on moves (default ``50 * num_servers + 1000``).
        server_offsets: a cost per server on top of its tasks (>= 0; e.g. what the runtime's cuts of its
            tasks add, see ``runtime.cad_schedule``), balanced with them and included in ``loads``.
    """
    n_ranks = len(docs_per_rank)
    n = n_ranks if num_servers is None else int(num_servers)
    if n < 1:
        raise ValueError("num_servers must be >= 1")
    if eps < 0:
        raise ValueError("eps must be >= 0")
    cm = cost_model if cost_model is not None else FlopsCostModel()
    tb = token_bytes if token_bytes is not None else TokenBytes()
    length, off, rank, doc = parse_docs(docs_per_rank)
    offsets = None
    if server_offsets is not None:
        offsets = np.asarray(server_offsets, dtype=np.float64)
        if offsets.shape != (n,) or not np.all(np.isfinite(offsets)) or offsets.min() < 0:
            raise ValueError(f"server_offsets must hold {n} finite costs >= 0, one per server")

    def balance(overshoot: float) -> tuple[_Balancer, bool]:
        bal = _Balancer(length, off, rank, n, cm, tb, eps, min_shard, search_width, min_move_frac,
                        min_gain_per_byte, max_moves if max_moves is not None else 50 * n + 1000, overshoot, offsets)
        converged = bal.run()
        if not converged:
            bal.refine()
            converged = bal.converged()
        return bal, converged

    # overshoot moves place coarse cuts (pieces whose smallest cut is a sizeable share of F): up to half the gap
    # keeps receivers from ending up stuck above F, up to most of it lets coarser cuts through; neither wins
    # everywhere (64 servers of 2K-8K rows: 1.03-1.07 against 1.01-1.05), so both run (milliseconds) and the
    # better balance is kept
    bal, converged = balance(0.5)
    if not converged:
        other, other_converged = balance(OVERSHOOT_WIDE)
        if max(other.loads) < max(bal.loads) * (1 - 1e-9):
            bal, converged = other, other_converged

    lo = np.zeros(len(length), dtype=np.int64)
    hi = length.copy()
    if bal.span:
        touched = np.fromiter(bal.span.keys(), dtype=np.int64, count=len(bal.span))
        spans = np.array(list(bal.span.values()), dtype=np.int64).reshape(-1, 2)
        lo[touched], hi[touched] = spans[:, 0], spans[:, 1]
    keep = np.flatnonzero(hi > lo)
    moved = _merge_moved(bal.moved)
    mv = np.array(moved, dtype=np.int64).reshape(-1, 4)
    mi = mv[:, 0]
    task_owner = np.concatenate([rank[keep], rank[mi]])
    task_piece = np.concatenate([doc[keep], doc[mi]])
    task_q_start = np.concatenate([lo[keep], mv[:, 2]])
    task_q_end = np.concatenate([hi[keep], mv[:, 3]])
    task_server = np.concatenate([bal.home[keep], mv[:, 1]])
    loads = np.asarray(bal.loads)
    if not isinstance(cm, FlopsCostModel):  # merged shards may cost less than their parts: price the tasks
        loads = _task_loads(cm, off[np.concatenate([keep, mi])], task_q_start, task_q_end, task_server, n, offsets)
    per_rank, per_server = _bytes(off, rank, n_ranks, n, tb, keep, lo[keep], hi[keep], moved)
    return CadSchedule(
        task_owner=task_owner, task_piece=task_piece, task_q_start=task_q_start, task_q_end=task_q_end,
        task_server=task_server, loads=loads, initial_loads=bal.initial_loads,
        target=bal.target, bytes_per_rank=per_rank, bytes_per_server=per_server, num_moves=bal.num_moves,
        converged=converged, eps=eps, offsets=offsets if offsets is not None else np.zeros(n),
        stats={"items": len(length), "sources_indexed": len(bal._sorted), "retired_servers": len(bal.retired_dst),
               "retired_sources": len(bal.retired_src)},
    )


def _item_of(docs_per_rank: Sequence[Sequence[DocItem]], owner: np.ndarray, piece: np.ndarray) -> np.ndarray:
    """Flat item index (as :func:`parse_docs` numbers them) of tasks' (owner, piece)."""
    first = np.concatenate([[0], np.cumsum([len(d) for d in docs_per_rank])])[:-1].astype(np.int64)
    return first[owner] + piece if len(owner) else np.zeros(0, dtype=np.int64)


def _task_loads(cost_model: CostModel, offset: np.ndarray, q_start: np.ndarray, q_end: np.ndarray,
                server: np.ndarray, num_servers: int, offsets: np.ndarray | None,
                key_lo: np.ndarray | None = None, key_hi: np.ndarray | None = None) -> np.ndarray:
    """Per-server cost of tasks (query rows ``[q_start, q_end)`` of pieces preceded by ``offset`` tokens, over
    keys from ``key_lo``, or rectangles up to ``key_hi``; see :mod:`.tasks`), plus the servers' fixed
    ``offsets``."""
    lo = key_lo if key_lo is not None else np.zeros_like(q_end)
    costs = cost_model.cost_array(q_end - q_start, offset + q_end - lo) if len(q_end) else np.zeros(0)
    if key_hi is not None:
        for i in np.flatnonzero(key_hi >= 0):
            costs[i] = cost_model.rect_cost(int(q_end[i] - q_start[i]), int(key_hi[i] - lo[i]))
    loads = np.bincount(server, weights=costs, minlength=num_servers)
    return loads + offsets if offsets is not None else loads


def task_bytes(docs_per_rank: Sequence[Sequence[DocItem]], task_owner: np.ndarray, task_piece: np.ndarray,
               task_q_start: np.ndarray, task_q_end: np.ndarray, task_server: np.ndarray, num_servers: int,
               token_bytes: TokenBytes | None = None, task_key_lo: np.ndarray | None = None,
               task_key_hi: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(bytes per rank, bytes per server) of any task set, counted as :func:`schedule` counts its own: the tasks
    of one piece on one server read the key prefix once, up to their last row; at the piece's own rank only
    the prefix held by earlier ranks travels, elsewhere also the query rows and the outputs coming back. With
    key cuts (``task_key_lo``, ``task_key_hi``, see :mod:`.tasks`) the keys are the union of the tasks' ranges."""
    tb = token_bytes if token_bytes is not None else TokenBytes()
    _length, off, rank, _doc = parse_docs(docs_per_rank)
    item = _item_of(docs_per_rank, task_owner, task_piece)
    n_ranks = len(docs_per_rank)
    per_rank, per_server = np.zeros(n_ranks), np.zeros(num_servers)
    if not len(item):
        return per_rank, per_server
    if _has_key_cuts(task_key_lo, task_key_hi):
        return _key_cut_bytes(off, rank, item, task_q_start, task_q_end, task_server, task_key_lo, task_key_hi, tb,
                              per_rank, per_server)
    keys, inv = np.unique(item * num_servers + task_server, return_inverse=True)
    it, srv = keys // num_servers, keys % num_servers
    rows = np.bincount(inv, weights=task_q_end - task_q_start, minlength=len(keys))
    end = np.zeros(len(keys), dtype=np.int64)
    np.maximum.at(end, inv, task_q_end)
    owner = rank[it]
    home = owner == srv
    b = np.where(home, off[it] * float(tb.kv), rows * (tb.q + tb.out) + (off[it] + end) * tb.kv)
    per_rank += np.bincount(owner, weights=b, minlength=n_ranks)
    per_server += np.bincount(srv, weights=b, minlength=num_servers)
    return per_rank, per_server


def _has_key_cuts(key_lo: np.ndarray | None, key_hi: np.ndarray | None) -> bool:
    """Whether any task reads only part of its rows' keys (see :mod:`.tasks`; None: no key columns)."""
    return key_lo is not None and bool(np.any(key_lo) or np.any(key_hi >= 0))


def _key_cut_bytes(off, rank, item, q_start, q_end, server, key_lo, key_hi, tb: TokenBytes, per_rank, per_server):
    """:func:`task_bytes` of tasks with key cuts: per (piece, server), the union of its tasks' key ranges."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (it, srv) in enumerate(zip(item.tolist(), server.tolist())):
        groups.setdefault((it, srv), []).append(i)
    for (it, srv), members in groups.items():
        o = int(off[it])
        spans = sorted((int(key_lo[i]), int(key_hi[i]) if key_hi[i] >= 0 else o + int(q_end[i])) for i in members)
        remote_keys, all_keys, end = 0, 0, -1
        for a, b in spans:  # the union, and its part before the piece (held by earlier ranks)
            a = max(a, end)
            if b > a:
                all_keys += b - a
                remote_keys += max(0, min(b, o) - a)
                end = b
        owner = int(rank[it])
        if owner == srv:
            b = remote_keys * float(tb.kv)
        else:
            rows = sum(int(q_end[i] - q_start[i]) for i in members)
            b = rows * (tb.q + tb.out) + all_keys * tb.kv
        per_rank[owner] += b
        per_server[srv] += b
    return per_rank, per_server


def with_tasks(docs_per_rank: Sequence[Sequence[DocItem]], sched: CadSchedule, tasks: Sequence[CadTask],
               cost_model: CostModel | None = None, token_bytes: TokenBytes | None = None) -> CadSchedule:
    """``sched`` with its tasks replaced by ``tasks`` (the same rows, e.g. moved by a later refinement): loads
    priced under ``cost_model`` (plus the schedule's offsets) and bytes counted again (:func:`task_bytes`)."""
    owner = np.array([t.owner for t in tasks], dtype=np.int64)
    piece = np.array([t.piece for t in tasks], dtype=np.int64)
    q_start = np.array([t.q_start for t in tasks], dtype=np.int64)
    q_end = np.array([t.q_end for t in tasks], dtype=np.int64)
    server = np.array([t.server for t in tasks], dtype=np.int64)
    key_lo = np.array([t.key_lo for t in tasks], dtype=np.int64)
    key_hi = np.array([t.key_hi for t in tasks], dtype=np.int64)
    _length, off, _rank, _doc = parse_docs(docs_per_rank)
    n = sched.num_servers
    loads = _task_loads(cost_model if cost_model is not None else FlopsCostModel(),
                        off[_item_of(docs_per_rank, owner, piece)], q_start, q_end, server, n, sched.offsets,
                        key_lo, key_hi)
    per_rank, per_server = task_bytes(docs_per_rank, owner, piece, q_start, q_end, server, n, token_bytes,
                                      key_lo, key_hi)
    return replace(sched, task_owner=owner, task_piece=piece, task_q_start=q_start, task_q_end=q_end,
                   task_server=server, loads=loads, bytes_per_rank=per_rank, bytes_per_server=per_server,
                   task_key_lo=key_lo, task_key_hi=key_hi)


def verify_schedule(docs_per_rank: Sequence[Sequence[DocItem]], sched: CadSchedule,
                    cost_model: CostModel | None = None, rtol: float = 1e-6) -> None:
    """Raise ``AssertionError`` unless every query row of every piece is in exactly one task (with key cuts:
    every (row, key) pair of its causal prefix) and the per-server loads equal the summed task costs (under
    ``cost_model``, FLOPs by default)."""
    length, off, rank, doc = parse_docs(docs_per_rank)
    item = _item_of(docs_per_rank, sched.task_owner, sched.task_piece)
    if _has_key_cuts(sched.task_key_lo, sched.task_key_hi):
        _verify_key_cuts(length, off, item, sched)
    else:
        _verify_rows(length, item, sched)
    loads = _task_loads(cost_model if cost_model is not None else FlopsCostModel(), off[item], sched.task_q_start,
                        sched.task_q_end, sched.task_server, sched.num_servers, sched.offsets,
                        sched.task_key_lo, sched.task_key_hi)
    assert np.allclose(loads, sched.loads, rtol=rtol, atol=rtol * max(float(loads.max(initial=0)), 1.0)), \
        "server loads differ from the summed task costs"


def _verify_key_cuts(length, off, item, sched: CadSchedule) -> None:
    """Every row of every piece: one causal task from some key ``K`` on, and rectangles tiling keys ``[0, K)``."""
    by_item: dict[int, list[int]] = {}
    for i, it in enumerate(item.tolist()):
        by_item.setdefault(it, []).append(i)
    assert sorted(by_item) == np.flatnonzero(length > 0).tolist(), "a piece has no task"
    a, b = sched.task_q_start, sched.task_q_end
    lo, hi = sched.task_key_lo, sched.task_key_hi
    for it, members in by_item.items():
        assert all(b[i] > a[i] and a[i] >= 0 and b[i] <= length[it] for i in members), "empty or misplaced task"
        bounds = sorted({0, int(length[it])} | {int(a[i]) for i in members} | {int(b[i]) for i in members})
        for x, y in zip(bounds, bounds[1:]):
            over = [i for i in members if a[i] <= x and y <= b[i]]
            causal = [i for i in over if hi[i] < 0]
            assert len(causal) == 1, f"rows [{x}, {y}) of piece {it} have {len(causal)} causal tasks, not one"
            end = 0
            for i in sorted((i for i in over if hi[i] >= 0), key=lambda i: lo[i]):
                assert lo[i] == end, f"rows [{x}, {y}) of piece {it}: keys from {end} covered twice or not at all"
                end = int(hi[i])
            assert lo[causal[0]] == end, f"rows [{x}, {y}) of piece {it}: causal keys start at {lo[causal[0]]}, " \
                f"the rectangles end at {end}"
            assert end <= off[it] + x, f"rows [{x}, {y}) of piece {it}: a rectangle reaches past the first row"


def _verify_rows(length, item, sched: CadSchedule) -> None:
    order = np.lexsort((sched.task_q_start, item))
    it, a, b = item[order], sched.task_q_start[order], sched.task_q_end[order]
    assert np.all(b > a), "empty or reversed task"
    assert np.all(b <= length[it]), "task past the end of its piece"
    new_item = np.ones(len(it), dtype=bool)
    new_item[1:] = it[1:] != it[:-1]
    assert np.all(a[new_item] == 0), "a piece's first rows are not covered"
    assert np.all(a[~new_item] == b[np.flatnonzero(~new_item) - 1]), "rows covered twice or not at all"
    last = np.ones(len(it), dtype=bool)
    last[:-1] = it[1:] != it[:-1]
    assert np.array_equal(np.sort(it[last]), np.flatnonzero(length > 0)), "a piece has no task"
    assert np.all(b[last] == length[it[last]]), "a piece's last rows are not covered"
