"""Attention work between the tokens of two ranks, as varlen kernel calls on contiguous rows.

Query tokens of rank r attend to key tokens of rank s only inside a shared document and only
backwards (causal). For a (query slot, key slot) pair every shared document falls in one of three
cases: the key piece lies wholly before the query piece (full attention), it *is* the query piece
(causal, aligned), or it lies after (nothing). Within one pair all shared documents are in the same
case for every strategy we build, so a pair is ONE kernel call over a contiguous run of query rows
and a contiguous run of key rows; documents present on only one side become zero-length segments.

:func:`exchange_plan` gathers the pairs between two ranks plus the key rows the owner must send
(only those that some query actually needs), which is how packed batches skip transfers and
kernels for documents that do not meet.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .plan import Piece, ShardPlan, Slot


@dataclass(frozen=True)
class Pair:
    """One kernel call: query rows [q_start, q_end) of the query rank against key rows [k_start, k_end).

    Query rows are local to the query rank. Key rows are local to the key rank in a plan from
    :func:`pair_between_slots`, and index the packed transfer buffer in an :class:`Exchange`.
    """

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    cu_q: tuple[int, ...]
    cu_k: tuple[int, ...]
    causal: bool
    work: int  # visible (query, key) pairs: the cost unit of every scheduler

    @property
    def max_q(self) -> int:
        return max(b - a for a, b in zip(self.cu_q, self.cu_q[1:]))

    @property
    def max_k(self) -> int:
        return max(b - a for a, b in zip(self.cu_k, self.cu_k[1:]))


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


def pair_between_slots(q_slot: Slot, k_slot: Slot) -> Pair | None:
    """The kernel call that covers all attention from ``q_slot`` to ``k_slot``, or None if there is none."""
    q_rows = _local_ranges(q_slot)
    k_rows = _local_ranges(k_slot)
    matched = {}
    for doc, (_, _, qp) in q_rows.items():
        if doc in k_rows:
            rel = _relation(qp, k_rows[doc][2])
            if rel is not None:
                matched[doc] = rel
    if not matched:
        return None
    kinds = set(matched.values())
    if len(kinds) != 1:
        raise ValueError("a (query slot, key slot) pair mixes causal and full documents; unsupported shard plan")
    causal = kinds.pop() == "diag"
    first, last = min(matched), max(matched)
    q_lo, q_hi = q_rows[first][0], q_rows[last][1]
    k_lo, k_hi = k_rows[first][0], k_rows[last][1]
    # Every document with rows inside either range becomes a segment; unmatched sides are empty.
    docs = sorted(
        {d for d, (a, _, _) in q_rows.items() if q_lo <= a < q_hi}
        | {d for d, (a, _, _) in k_rows.items() if k_lo <= a < k_hi}
    )
    cu_q, cu_k, work = [0], [0], 0
    for d in docs:
        lq = q_rows[d][2].length if d in q_rows and q_lo <= q_rows[d][0] < q_hi else 0
        lk = k_rows[d][2].length if d in k_rows and k_lo <= k_rows[d][0] < k_hi else 0
        if d in matched:
            cu_q.append(cu_q[-1] + lq)
            cu_k.append(cu_k[-1] + lk)
            work += lq * (lq + 1) // 2 if causal else lq * lk
        else:  # present on one side only, or keys after queries: no attention, two empty-sided segments
            if lq:
                cu_q.append(cu_q[-1] + lq)
                cu_k.append(cu_k[-1])
            if lk:
                cu_q.append(cu_q[-1])
                cu_k.append(cu_k[-1] + lk)
    assert cu_q[-1] == q_hi - q_lo and cu_k[-1] == k_hi - k_lo
    return Pair(q_lo, q_hi, k_lo, k_hi, tuple(cu_q), tuple(cu_k), causal, work)


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
        if (pair := pair_between_slots(qs, ks)) is not None
    ]
    ranges = _merge_ranges([(p.k_start, p.k_end) for p in raw])
    packed = _packed_offsets(ranges)
    pairs = []
    for p in raw:
        base = _rebase(packed, p.k_start, p.k_end)
        pairs.append(replace(p, k_start=base, k_end=base + (p.k_end - p.k_start)))
    return Exchange(q_rank, kv_rank, tuple(pairs), tuple(ranges))


def _clip_pair(p: Pair, lo: int, hi: int) -> Pair | None:
    """The part of a full (non-causal) pair whose query rows fall in [lo, hi); keys are unchanged."""
    cu_q = [0]
    start, end = max(lo, p.q_start), min(hi, p.q_end)
    if start >= end:
        return None
    work = 0
    for i in range(len(p.cu_q) - 1):
        a, b = p.q_start + p.cu_q[i], p.q_start + p.cu_q[i + 1]
        kept = max(0, min(b, end) - max(a, start))
        cu_q.append(cu_q[-1] + kept)
        work += kept * (p.cu_k[i + 1] - p.cu_k[i])
    return replace(p, q_start=start, q_end=end, cu_q=tuple(cu_q), work=work)


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
    pairs = tuple(c for p in ex.pairs if (c := _clip_pair(p, lo, hi)) is not None and c.work)
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
