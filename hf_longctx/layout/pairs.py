"""Attention work between the tokens of two ranks, as varlen kernel calls on contiguous rows.

Query tokens of rank r attend to key tokens of rank s only inside a shared document and only
backwards (causal). For a (query slot, key slot) pair every shared document falls in one of three
cases: the key piece lies wholly before the query piece (full attention), it *is* the query piece
(causal, aligned), or it lies after (nothing). Within one pair all shared documents are in the same
case for every strategy we build, so a pair is ONE kernel call over a contiguous run of query rows
and a contiguous run of key rows; documents present on only one side become zero-length segments.

Sliding window (transformers' ``sliding_window = W``: position p sees positions p - W + 1 .. p). The
kernel takes one window per call, counted in its bottom-right frame (see
:func:`hf_longctx.kernels.attention_forward`). A segment whose last query sits at document position
``qe - 1`` and whose last key at ``ke - 1`` needs window ``W - (qe - ke)``: W on a diagonal segment,
less on an off-diagonal one. Before that, every segment sheds the rows the window hides wholly:
leading keys no query reaches (never sent, never read) and trailing queries that reach no key (they
become a query-only segment); a segment with nothing visible is dropped like a document that does not
meet, and a window that hides nothing is dropped too. Segments that still need different windows go
to different kernel calls (one :class:`Pair` each), so a slot pair may give several pairs; with
contiguous and zig-zag placements a slot pair shares at most one document and gives at most one.

:func:`exchange_plan` gathers the pairs between two ranks plus the key rows the owner must send
(only those that some query actually needs), which is how packed batches and sliding windows skip
transfers and kernels for documents, or parts of them, that do not meet.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, replace

from .plan import Piece, ShardPlan, Slot


@dataclass(frozen=True)
class Pair:
    """One kernel call: query rows [q_start, q_end) of the query rank against key rows [k_start, k_end).

    Query rows are local to the query rank. Key rows are local to the key rank in a plan from
    :func:`pairs_between_slots`, and index the packed transfer buffer in an :class:`Exchange`.
    ``window`` is the kernel's window for every segment of the call (None: no window).
    """

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    cu_q: tuple[int, ...]
    cu_k: tuple[int, ...]
    causal: bool
    work: int  # visible (query, key) pairs: the cost unit of every scheduler
    window: int | None = None

    @property
    def max_q(self) -> int:
        return max(b - a for a, b in zip(self.cu_q, self.cu_q[1:]))

    @property
    def max_k(self) -> int:
        return max(b - a for a, b in zip(self.cu_k, self.cu_k[1:]))


def _pairs_at_or_below(lq: int, lk: int, c: int) -> int:
    """#{(i, j): 0 <= i < lq, 0 <= j < lk, j <= i + c}, in closed form."""
    first, last = c + 1, c + lq  # row i counts clamp(i + c + 1, 0, lk) keys
    total = 0
    lo, hi = max(first, 1), min(last, lk)
    if hi >= lo:
        total += (lo + hi) * (hi - lo + 1) // 2
    lo = max(first, lk + 1)
    if last >= lo:
        total += lk * (last - lo + 1)
    return total


def band_work(lq: int, lk: int, causal: bool, window: int | None) -> int:
    """Visible (query, key) pairs of one kernel segment (the kernel's bottom-right masks)."""
    if lq <= 0 or lk <= 0:
        return 0
    o = lk - lq
    seen = _pairs_at_or_below(lq, lk, o) if causal else lq * lk
    return seen - (_pairs_at_or_below(lq, lk, o - window) if window is not None else 0)


def _trim(lq: int, lk: int, causal: bool, window: int | None) -> tuple[int, int, int | None] | None:
    """What of a segment the window leaves: (query rows kept from the front, key rows dropped from the
    front, window or None when it hides nothing more), or None when no query sees any key."""
    if window is None:
        return lq, 0, None
    if causal and window < 1:
        return None
    head = max(0, lk - lq - window + 1)  # keys before the band of the first query
    tail = 0 if causal else max(0, min(lq, 1 - window))  # trailing queries whose band starts past the last key
    kept, window = lq - tail, window + tail  # dropping trailing queries moves the bottom-right frame
    if kept == 0 or head >= lk:
        return None
    return kept, head, None if window >= lk - head else window


Segment = tuple[int, int, int | None]  # (query rows, key rows, kernel window; None: no window)
_APART = object()  # marks rows of a segment that attend to nothing in the call


def pairs_from_segments(q_start: int, k_start: int, segments: list[Segment], causal: bool) -> tuple[Pair, ...]:
    """Kernel calls for back-to-back segments (rows from ``q_start`` and ``k_start``).

    Segments are trimmed to what their window leaves visible (:func:`_trim`), grouped by the window
    they still need, and each group becomes one :class:`Pair` over the tightest row ranges that hold
    its segments; the other segments inside those ranges become one-sided (no attention).
    """
    atoms = []  # (q0, q1, k0, k1, kernel window, or _APART for rows that attend to nothing here)
    q, k = q_start, k_start
    for lq, lk, window in segments:
        cut = _trim(lq, lk, causal, window) if lq and lk else None
        if cut is None:
            atoms += [(q, q + lq, k, k, _APART), (q + lq, q + lq, k, k + lk, _APART)]
        else:
            kept, head, need = cut
            atoms += [(q, q, k, k + head, _APART), (q, q + kept, k + head, k + lk, need),
                      (q + kept, q + lq, k + lk, k + lk, _APART)]
        q, k = q + lq, k + lk
    groups = sorted({a[4] for a in atoms if a[4] is not _APART}, key=lambda w: (w is not None, w or 0))
    pairs = []
    for group in groups:
        mine = [a for a in atoms if a[4] == group]
        q_lo, q_hi = mine[0][0], mine[-1][1]
        k_lo, k_hi = mine[0][2], mine[-1][3]
        cu_q, cu_k, work = [0], [0], 0
        for q0, q1, k0, k1, w in atoms:
            if w == group:
                cu_q.append(cu_q[-1] + q1 - q0)
                cu_k.append(cu_k[-1] + k1 - k0)
                work += band_work(q1 - q0, k1 - k0, causal, group)
                continue
            nq = max(0, min(q1, q_hi) - max(q0, q_lo))
            nk = max(0, min(k1, k_hi) - max(k0, k_lo))
            if nq:
                cu_q.append(cu_q[-1] + nq)
                cu_k.append(cu_k[-1])
            if nk:
                cu_q.append(cu_q[-1])
                cu_k.append(cu_k[-1] + nk)
        assert cu_q[-1] == q_hi - q_lo and cu_k[-1] == k_hi - k_lo
        pairs.append(Pair(q_lo, q_hi, k_lo, k_hi, tuple(cu_q), tuple(cu_k), causal, work, group))
    return tuple(pairs)


def clip_pair(p: Pair, q_lo: int | None = None, q_hi: int | None = None, k_lo: int | None = None,
              k_hi: int | None = None) -> tuple[Pair, ...]:
    """The kernel calls of a full (non-causal) pair restricted to query rows [q_lo, q_hi) and key rows
    [k_lo, k_hi) (None: no bound), in the same row numbering.

    Dropping trailing rows of a segment moves its bottom-right frame: its window grows by the query
    rows dropped and shrinks by the key rows dropped, so a clipped pair may split into several.
    """
    if p.causal:
        raise ValueError("only blocks of full (non-causal) attention can be clipped")
    q_lo = p.q_start if q_lo is None else max(q_lo, p.q_start)
    q_hi = p.q_end if q_hi is None else min(q_hi, p.q_end)
    k_lo = p.k_start if k_lo is None else max(k_lo, p.k_start)
    k_hi = p.k_end if k_hi is None else min(k_hi, p.k_end)
    if q_lo >= q_hi or k_lo >= k_hi:
        return ()
    segments = []
    for i in range(len(p.cu_q) - 1):
        a, b = p.q_start + p.cu_q[i], p.q_start + p.cu_q[i + 1]
        c, d = p.k_start + p.cu_k[i], p.k_start + p.cu_k[i + 1]
        qa, qb, kc, kd = max(a, q_lo), min(b, q_hi), max(c, k_lo), min(d, k_hi)
        lq, lk = max(0, qb - qa), max(0, kd - kc)
        window = p.window + (b - qb) - (d - kd) if p.window is not None and lq and lk else None
        segments.append((lq, lk, window))
    return pairs_from_segments(q_lo, k_lo, segments, False)


def _relation(q: Piece, k: Piece) -> str | None:
    if k.end <= q.start:
        return "full"
    if k.start == q.start and k.end == q.end:
        return "diag"
    if k.start >= q.end:
        return None
    raise ValueError(f"pieces {q} and {k} partly overlap; a shard plan must cut documents consistently")


def _local_ranges(slot: Slot) -> dict[int, tuple[int, int, Piece]]:
    out, pos = {}, slot.offset
    for p in slot.pieces:
        out[p.doc] = (pos, pos + p.length, p)
        pos += p.length
    return out


def pairs_between_slots(q_slot: Slot, k_slot: Slot, window: int | None = None) -> tuple[Pair, ...]:
    """The kernel calls that cover all attention from ``q_slot`` to ``k_slot`` under a sliding window
    of ``window`` positions (None: plain causal attention); empty when the slots do not meet."""
    q_rows = _local_ranges(q_slot)
    k_rows = _local_ranges(k_slot)
    matched = {}
    for doc, (_, _, qp) in q_rows.items():
        if doc in k_rows:
            rel = _relation(qp, k_rows[doc][2])
            if rel is not None:
                matched[doc] = rel
    if not matched:
        return ()
    kinds = set(matched.values())
    if len(kinds) != 1:
        raise ValueError("a (query slot, key slot) pair mixes causal and full documents; unsupported shard plan")
    causal = kinds.pop() == "diag"
    segments: list[Segment] = []
    for d in sorted(q_rows.keys() | k_rows.keys()):
        lq = q_rows[d][2].length if d in q_rows else 0
        lk = k_rows[d][2].length if d in k_rows else 0
        if d in matched:
            gap = q_rows[d][2].end - k_rows[d][2].end  # last query position minus last key position
            segments.append((lq, lk, None if window is None else window - gap))
        else:  # present on one side only, or keys after queries: no attention
            segments += [(lq, 0, None), (0, lk, None)]
    return pairs_from_segments(q_slot.offset, k_slot.offset, segments, causal)


@dataclass(frozen=True)
class Exchange:
    """Everything the query rank r computes against the keys of rank s.

    ``kv_ranges`` are the key rows of s to send, back to back; the pairs' key rows index that
    buffer. An exchange with no pairs means no transfer and no kernel call.
    """

    q_rank: int
    kv_rank: int
    pairs: tuple[Pair, ...]
    kv_ranges: tuple[tuple[int, int], ...]

    @property
    def num_kv_rows(self) -> int:
        return sum(b - a for a, b in self.kv_ranges)

    @property
    def work(self) -> int:
        return sum(p.work for p in self.pairs)

    @property
    def q_ranges(self) -> tuple[tuple[int, int], ...]:
        """Query rows of the query rank that the pairs read, merged: what travels when queries move."""
        return tuple(_merge_ranges([(p.q_start, p.q_end) for p in self.pairs]))

    @property
    def num_q_rows(self) -> int:
        return sum(b - a for a, b in self.q_ranges)

    def pairs_in_q_buffer(self) -> tuple[Pair, ...]:
        """The pairs with query rows re-based onto the packed buffer of :attr:`q_ranges`."""
        packed = _packed_offsets(self.q_ranges)
        return tuple(
            replace(p, q_start=_rebase(packed, p.q_start, p.q_end), q_end=_rebase(packed, p.q_start, p.q_end) + p.q_end
                    - p.q_start)
            for p in self.pairs
        )


def _packed_offsets(ranges) -> list[tuple[int, int, int]]:
    """(start, end, offset in the packed buffer) for back-to-back ranges."""
    out, pos = [], 0
    for a, b in ranges:
        out.append((a, b, pos))
        pos += b - a
    return out


def _rebase(packed: list[tuple[int, int, int]], start: int, end: int) -> int:
    return next(off + (start - a) for a, b, off in packed if a <= start and end <= b)


def _merge_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _build_exchange(plan: ShardPlan, q_rank: int, kv_rank: int) -> Exchange:
    raw = [
        pair
        for qs in plan.rank_slots(q_rank)
        for ks in plan.rank_slots(kv_rank)
        for pair in pairs_between_slots(qs, ks, plan.window)
    ]
    # Only key rows that some segment attends to travel; key-only segments inside a pair's rows (keys of
    # other documents, keys a window hides) shrink to the rows other pairs need, usually none.
    ranges = _merge_ranges([
        (p.k_start + p.cu_k[i], p.k_start + p.cu_k[i + 1])
        for p in raw
        for i in range(len(p.cu_q) - 1)
        if p.cu_q[i + 1] > p.cu_q[i] and p.cu_k[i + 1] > p.cu_k[i]
    ])
    return Exchange(q_rank, kv_rank, tuple(_onto_buffer(p, ranges) for p in raw), tuple(ranges))


def _onto_buffer(p: Pair, ranges: list[tuple[int, int]]) -> Pair:
    """``p`` with key rows numbered in the buffer of ``ranges`` (rows outside them dropped)."""
    starts = [a for a, _ in ranges]
    offsets = [off for _, _, off in _packed_offsets(ranges)]

    def pos(row: int) -> int:  # buffer rows before local key row ``row``
        i = bisect_right(starts, row) - 1
        return 0 if i < 0 else offsets[i] + min(row - ranges[i][0], ranges[i][1] - ranges[i][0])

    cu_q, cu_k = [0], [0]
    for i in range(len(p.cu_q) - 1):
        nq = p.cu_q[i + 1] - p.cu_q[i]
        nk = pos(p.k_start + p.cu_k[i + 1]) - pos(p.k_start + p.cu_k[i])
        if nq or nk:
            cu_q.append(cu_q[-1] + nq)
            cu_k.append(cu_k[-1] + nk)
    start = pos(p.k_start)
    return replace(p, k_start=start, k_end=start + cu_k[-1], cu_q=tuple(cu_q), cu_k=tuple(cu_k))


def _split_exchange(ex: Exchange, part: int, parts: int) -> Exchange:
    if not ex.pairs:
        return ex
    if any(p.causal for p in ex.pairs):
        raise ValueError("only blocks of full (non-causal) attention can be split by query rows")
    rows = sorted({r for a, b in ex.q_ranges for r in (a, b)})
    lo_all, hi_all = rows[0], rows[-1]
    total = hi_all - lo_all
    lo = lo_all + total * part // parts
    hi = lo_all + total * (part + 1) // parts
    pairs = tuple(c for p in ex.pairs for c in clip_pair(p, q_lo=lo, q_hi=hi))
    return replace(ex, pairs=pairs, kv_ranges=ex.kv_ranges if pairs else ())


def exchange_plan(plan: ShardPlan, q_rank: int, kv_rank: int, part: int = 0, parts: int = 1) -> Exchange:
    """Cached :class:`Exchange` of query rank ``q_rank`` against the keys of ``kv_rank``.

    ``part``/``parts`` restrict it to one of ``parts`` equal slices of its query rows (keys unchanged),
    which is how a block's work is shared between its query owner and an idle key owner.
    """
    if parts == 1:
        return plan.cached(("exchange", q_rank, kv_rank), lambda: _build_exchange(plan, q_rank, kv_rank))
    return plan.cached(("exchange", q_rank, kv_rank, part, parts),
                       lambda: _split_exchange(exchange_plan(plan, q_rank, kv_rank), part, parts))
