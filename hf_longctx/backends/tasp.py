"""TASP: keys and values travel on the arc-disjoint Hamiltonian cycles of the complete digraph K_n.

A ring uses one of the n (n - 1) directed links of a fully connected fabric per rank and step. TASP
(Topology-Aware Sequence Parallelism) splits every rank's keys/values into one sub-block per
Hamiltonian cycle of a decomposition of K_n* (n - 1 cycles; n - 2 for n = 4 and 6) and moves every
sub-block one hop along its own cycle per step, all of them in ONE all_to_all, so every link carries
data at once. After n - 1 hops each sub-block has visited every rank. The cycles come from
:mod:`.tasp_topology`; :func:`routes` says where each sub-block is at every hop.

Packed documents: a sub-block is forwarded only as far as some rank on its cycle still needs it, each
hop carries only the span of its rows that this and later ranks read, and (query, key) pieces whose
documents do not meet, or that a sliding window keeps apart, cost nothing. Backward re-sends the
keys along the same routes and returns each rank's dK/dV of a visiting sub-block straight to its
owner (one extra all_to_all per step, in float32 so gradients add up exactly, overlapped with the
next hop's kernels).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cache

import torch

from ..comm.collectives import all_to_all_single
from ..comm.p2p import PendingExchange, count_all_to_all
from ..kernels import PartialAccumulator, accumulation_dtype, attention_backward, attention_forward
from ..layout import Pair, ShardPlan, clip_pair, exchange_plan, pairs_between_slots
from .contract import Backend
from .engine import RunContext, gather_rows, scatter_add_rows, zero_grads
from .options import BackendOptions
from .prediction import AttentionShape, RankWork, pair_segments
from .tasp_topology import hamiltonian_decomposition, idle_arcs

log = logging.getLogger(__name__)


@cache
def cycles_for(n: int) -> tuple[tuple[int, ...], ...]:
    """Arc-disjoint directed Hamiltonian cycles used for ``n`` ranks (empty for one rank)."""
    if n == 1:
        return ()
    idle = idle_arcs(n)
    if idle:  # K_4* and K_6* have no Hamiltonian decomposition (Tillson 1980)
        log.info("hf_longctx tasp: %d ranks use %d Hamiltonian cycles; %d directed links stay idle: %s", n, n - 2,
                 len(idle), idle)
    return tuple(tuple(c) for c in hamiltonian_decomposition(n))


@dataclass(frozen=True)
class SubBlock:
    """The part of ``owner``'s key rows that travels on cycle ``cycle``: one per cycle, cut in order."""

    owner: int
    cycle: int
    start: int  # key rows [start, end) of the owner's local tensor
    end: int


@dataclass(frozen=True)
class Route:
    """Where a sub-block is at each hop, and how far it has to go."""

    block: SubBlock
    visits: tuple[int, ...]  # visits[h - 1] = rank holding it after h hops
    hops: int  # hops actually made (0: nobody else needs it)
    pairs: tuple[tuple[Pair, ...], ...]  # pairs[h - 1]: kernel calls at visits[h - 1], keys relative to spans[h - 1]
    spans: tuple[tuple[int, int], ...]  # spans[h - 1]: key rows (relative to start) that travel on hop h

    def span(self, hop: int) -> tuple[int, int]:
        return self.spans[hop - 1]

    def rows(self, hop: int) -> int:
        lo, hi = self.spans[hop - 1]
        return hi - lo


def _clip_keys(p: Pair, lo: int, hi: int) -> tuple[Pair, ...]:
    """Kernel calls of a full (non-causal) pair over its key rows in [lo, hi), keys re-based to lo."""
    return tuple(replace(c, k_start=c.k_start - lo, k_end=c.k_end - lo) for c in clip_pair(p, k_lo=lo, k_hi=hi))


def _raw_pairs(plan: ShardPlan, q_rank: int, kv_rank: int) -> list[Pair]:
    pairs = [p for qs in plan.rank_slots(q_rank) for ks in plan.rank_slots(kv_rank)
             for p in pairs_between_slots(qs, ks, plan.window)]
    if any(p.causal for p in pairs):
        raise ValueError("TASP needs a placement where blocks of different ranks never share a diagonal")
    return pairs


def _travelling_spans(pairs: tuple[tuple[Pair, ...], ...], hops: int) -> tuple[tuple[int, int], ...]:
    """Per hop, the smallest row span holding every key that this and all later hops use.

    With packed documents most ranks on a cycle need only the tail of a sub-block (the start of the
    document crossing into their shard), so a sub-block shrinks as it travels. Spans are nested, so
    each holder forwards a slice of what it received.
    """
    spans, lo, hi = [], None, None
    for h in range(hops, 0, -1):
        for p in pairs[h - 1]:
            lo = p.k_start if lo is None else min(lo, p.k_start)
            hi = p.k_end if hi is None else max(hi, p.k_end)
        spans.append((lo or 0, hi or 0))
    return tuple(reversed(spans))


def routes(plan: ShardPlan) -> tuple[Route, ...]:
    """Every sub-block's route on the cycles of :func:`cycles_for` (cached on the plan)."""
    return plan.cached("tasp_routes", lambda: build_routes(plan, cycles_for(plan.world_size)))


def build_routes(plan: ShardPlan, cycles: Sequence[Sequence[int]]) -> tuple[Route, ...]:
    """Routes of every rank's sub-blocks, one sub-block per cycle, each moving one arc of its cycle per hop.

    Rank s cuts its key rows into ``len(cycles)`` consecutive sub-blocks; sub-block c visits the ranks
    after s on cycle c in cycle order. The cycles must be Hamiltonian on the plan's ranks (so every
    sub-block can reach every rank); they may share arcs (then one hop sends several sub-blocks over
    one link), which :func:`routes` never does. Routes are ordered by owner, then cycle: every rank
    derives the same order, which is the order of the items in every all_to_all message.
    """
    n = plan.world_size
    cycles = tuple(tuple(int(x) for x in c) for c in cycles)
    for index, cyc in enumerate(cycles):
        if sorted(cyc) != list(range(n)):
            raise ValueError(f"cycle {index} is not a Hamiltonian cycle on {n} ranks: {list(cyc)}; "
                             "every rank must appear exactly once")
    out = []
    for s in range(n):
        rows = plan.num_local_tokens(s)
        raw = {v: _raw_pairs(plan, v, s) for v in range(n) if v != s}  # shared by every cycle
        for c, cyc in enumerate(cycles):
            block = SubBlock(s, c, rows * c // len(cycles), rows * (c + 1) // len(cycles))
            pos = cyc.index(s)
            visits = tuple(cyc[(pos + h) % n] for h in range(1, n))
            pairs = tuple(
                tuple(c for p in raw[v] for c in _clip_keys(p, block.start, block.end))
                for v in visits
            )
            hops = max((h + 1 for h, ps in enumerate(pairs) if ps), default=0)
            spans = _travelling_spans(pairs, hops)
            pairs = tuple(  # keys relative to the span that arrives on that hop
                tuple(replace(p, k_start=p.k_start - spans[h][0], k_end=p.k_end - spans[h][0]) for p in ps)
                if h < hops else ps
                for h, ps in enumerate(pairs)
            )
            out.append(Route(block, visits, hops, pairs, spans))
    return tuple(out)


def _exchange(sends: dict[int, list[torch.Tensor]], recv_rows: dict[int, int], like: torch.Tensor, ctx: RunContext):
    """One all_to_all_single: ``sends[dst]`` tensors (rows back to back) out, ``recv_rows[src]`` rows in."""
    world = ctx.plan.world_size
    width = like.shape[1:]
    parts = [t for d in range(world) for t in sends.get(d, [])]
    send = torch.cat(parts) if parts else like.new_empty(0, *width)  # one copy into the send buffer
    out_split = [sum(t.shape[0] for t in sends.get(d, [])) for d in range(world)]
    in_split = [recv_rows.get(s, 0) for s in range(world)]
    recv = like.new_empty(sum(in_split), *width)
    count_all_to_all(send, out_split, in_split, ctx.rank)
    work = all_to_all_single(recv, send, in_split, out_split, group=ctx.group, async_op=True)
    return work, recv, in_split


def _split_recv(recv: torch.Tensor, in_split: list[int], layout: dict[int, list[tuple[object, int]]]) -> dict:
    """Cut the receive buffer back into the items each source sent, in the agreed order."""
    items, pos = {}, 0
    for src, rows in enumerate(in_split):
        end = pos + rows
        for key, n in layout.get(src, []):
            items[key] = recv[pos : pos + n]
            pos += n
        assert pos == end
    return items


def kv_hop_layout(rts: Sequence[Route], rank: int, hop: int):
    """Sends (dst -> [(route index, rows)]) and receives (src -> [(route index, rows)]) of keys and
    values for ``hop`` at ``rank``, both in route order, so what one rank sends another expects."""
    sends, recvs = {}, {}
    for i, r in enumerate(rts):
        if hop > r.hops:
            continue
        holder = r.block.owner if hop == 1 else r.visits[hop - 2]
        dst = r.visits[hop - 1]
        rows = 2 * r.rows(hop)  # keys then values
        if holder == rank:
            sends.setdefault(dst, []).append((i, rows))
        if dst == rank:
            recvs.setdefault(holder, []).append((i, rows))
    return sends, recvs


def _post_kv(ctx: RunContext, hop: int, held: dict[int, tuple[torch.Tensor, torch.Tensor]], k: torch.Tensor,
             v: torch.Tensor):
    sends, recvs = kv_hop_layout(routes(ctx.plan), ctx.rank, hop)
    payload = {}
    rts = routes(ctx.plan)
    for dst, items in sends.items():
        payload[dst] = []
        for i, _ in items:
            b, (lo, hi) = rts[i].block, rts[i].span(hop)
            if i in held:  # forward the part of what arrived on the previous hop that is still needed
                base = rts[i].span(hop - 1)[0]
                kb, vb = (t[lo - base : hi - base] for t in held[i])
            else:
                kb, vb = k[b.start + lo : b.start + hi], v[b.start + lo : b.start + hi]
            payload[dst] += [kb, vb]
    work, recv, split = _exchange(payload, {s: sum(n for _, n in it) for s, it in recvs.items()}, k, ctx)
    return work, recv, split, recvs


def _receive_kv(pending: PendingExchange) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    work, recv, split, layout = pending
    work.wait()
    items = _split_recv(recv, split, layout)
    out = {}
    for i, kv in items.items():
        half = kv.shape[0] // 2
        out[i] = (kv[:half], kv[half:])
    return out


def run_forward(ctx: RunContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    acc = PartialAccumulator(q.shape[0], q.shape[1], q.shape[2], q.dtype, q.device)
    last = max_hops(ctx.plan)
    pending = _post_kv(ctx, 1, {}, k, v) if last else None
    _local_forward(ctx, q, k, v, acc)
    rts = routes(ctx.plan)
    for hop in range(1, last + 1):
        held = _receive_kv(pending)
        pending = _post_kv(ctx, hop + 1, held, k, v) if hop < last else None
        for i, (kb, vb) in held.items():
            for p in rts[i].pairs[hop - 1]:
                out, lse = attention_forward(q[p.q_start : p.q_end], kb[p.k_start : p.k_end], vb[p.k_start : p.k_end],
                                             p.cu_q, p.cu_k, p.max_q, p.max_k, causal=False,
                                             softmax_scale=ctx.scale, kernel=ctx.kernel, window=p.window)
                acc.add(p.q_start, out, lse)
    return acc.result()


def _local_forward(ctx: RunContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, acc: PartialAccumulator):
    ex = exchange_plan(ctx.plan, ctx.rank, ctx.rank)
    ks, vs = gather_rows(k, ex.kv_ranges), gather_rows(v, ex.kv_ranges)
    for p in ex.pairs:
        out, lse = attention_forward(q[p.q_start : p.q_end], ks[p.k_start : p.k_end], vs[p.k_start : p.k_end],
                                     p.cu_q, p.cu_k, p.max_q, p.max_k, causal=p.causal, softmax_scale=ctx.scale,
                                     kernel=ctx.kernel, window=p.window)
        acc.add(p.q_start, out, lse)


def _grad_sends(ctx: RunContext, grads: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> dict[int, list[torch.Tensor]]:
    """dK/dV of every visiting sub-block, grouped by owner in route order (the order owners expect)."""
    rts = routes(ctx.plan)
    sends: dict[int, list] = {}
    for i, (gk, gv) in sorted(grads.items()):
        sends.setdefault(rts[i].block.owner, []).extend([gk, gv])
    return sends


def grad_hop_receives(rts: Sequence[Route], rank: int, hop: int) -> dict[int, list[tuple[int, int]]]:
    """Which ranks return dK/dV (route index, rows) of ``rank``'s sub-blocks after ``hop``, in route order:
    every rank that computed with a sub-block on that hop, and only those."""
    expect: dict[int, list] = {}
    for i, r in enumerate(rts):
        if r.block.owner == rank and hop <= r.hops and r.pairs[hop - 1]:
            expect.setdefault(r.visits[hop - 1], []).append((i, 2 * r.rows(hop)))
    return expect


def max_hops(plan: ShardPlan) -> int:
    """Hops the furthest-travelling sub-block makes; no step past it costs anything."""
    return max((r.hops for r in routes(plan)), default=0)


def run_backward(ctx: RunContext, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    acc_dtype = accumulation_dtype(q.dtype)
    dq, dk, dv = zero_grads(q, k, v)
    dout = dout.contiguous()
    last = max_hops(ctx.plan)
    rts = routes(ctx.plan)
    pending = _post_kv(ctx, 1, {}, k, v) if last else None
    ex = exchange_plan(ctx.plan, ctx.rank, ctx.rank)
    ks, vs = gather_rows(k, ex.kv_ranges), gather_rows(v, ex.kv_ranges)
    gk = torch.zeros(ks.shape, dtype=acc_dtype, device=k.device)
    gv = torch.zeros(vs.shape, dtype=acc_dtype, device=v.device)
    _pairs_backward(ctx, ex.pairs, dout, q, out, lse, ks, vs, dq, gk, gv, causal=None)
    scatter_add_rows(dk, ex.kv_ranges, gk)
    scatter_add_rows(dv, ex.kv_ranges, gv)
    like = torch.empty(0, *k.shape[1:], dtype=acc_dtype, device=k.device)
    returning = None  # dK/dV of the previous hop, on their way home while this hop computes
    for hop in range(1, last + 1):
        held = _receive_kv(pending)
        pending = _post_kv(ctx, hop + 1, held, k, v) if hop < last else None
        grads = {}
        for i, (kb, vb) in held.items():
            if not rts[i].pairs[hop - 1]:
                continue  # only passing through
            gk = torch.zeros(kb.shape, dtype=acc_dtype, device=k.device)
            gv = torch.zeros(vb.shape, dtype=acc_dtype, device=v.device)
            _pairs_backward(ctx, rts[i].pairs[hop - 1], dout, q, out, lse, kb, vb, dq, gk, gv, causal=False)
            grads[i] = (gk, gv)
        _add_returned(returning, rts, dk, dv)
        returning = None
        if any(r.pairs[hop - 1] for r in rts if hop <= r.hops):  # every rank knows whether anyone computed
            # dK/dV of this hop go straight home; the owner knows which of its blocks visited whom
            expect = grad_hop_receives(rts, ctx.rank, hop)
            work, recv, split = _exchange(_grad_sends(ctx, grads), {s: sum(m for _, m in it) for s, it in
                                                                     expect.items()}, like, ctx)
            returning = (hop, work, recv, split, expect)
    _add_returned(returning, rts, dk, dv)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _add_returned(returning: tuple | None, rts: Sequence[Route], dk: torch.Tensor, dv: torch.Tensor) -> None:
    """Wait for one hop's returned dK/dV and add them at the rows of the sub-blocks they belong to."""
    if returning is None:
        return
    hop, work, recv, split, expect = returning
    work.wait()
    for i, g in _split_recv(recv, split, expect).items():
        b, (lo, hi) = rts[i].block, rts[i].span(hop)
        half = g.shape[0] // 2
        dk[b.start + lo : b.start + hi] += g[:half]
        dv[b.start + lo : b.start + hi] += g[half:]


def _pairs_backward(ctx: RunContext, pairs: Sequence[Pair], dout: torch.Tensor, q: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, dq: torch.Tensor, gk: torch.Tensor,
                    gv: torch.Tensor, causal: bool):
    for p in pairs:
        sq, sk = slice(p.q_start, p.q_end), slice(p.k_start, p.k_end)
        a, b, c = attention_backward(dout[sq], q[sq], ks[sk], vs[sk], out[sq], lse[:, sq], p.cu_q, p.cu_k, p.max_q,
                                     p.max_k, causal=p.causal if causal is None else causal,
                                     softmax_scale=ctx.scale, kernel=ctx.kernel, window=p.window)
        dq[sq] += a
        gk[sk] += b
        gv[sk] += c


class TaspBackend(Backend):
    """Backend ``tasp``: the runner above behind the backend contract (load: each rank's own queries)."""

    name = "tasp"
    summary = ("TASP: key/value sub-blocks travel on the arc-disjoint Hamiltonian cycles of K_n, one all_to_all "
               "per hop")
    default_strategy = "zigzag"
    auto_candidate_for = ("contiguous", "zigzag", "doc_zigzag")

    def rank_work(self, plan: ShardPlan, shape: AttentionShape, options: BackendOptions) -> list[RankWork] | None:
        return rank_work(plan, shape)

    # the runner's module functions are the contract's methods
    forward = staticmethod(run_forward)
    backward = staticmethod(run_backward)


def rank_work(plan: ShardPlan, shape: AttentionShape) -> list[RankWork]:
    """Each rank's own block, then the sub-blocks visiting it hop by hop; per hop one all_to_all of keys and
    values (forward, and again backward) and, backward, one of the visitors' dK/dV going home in the
    accumulation dtype (see :func:`run_forward`, :func:`run_backward`)."""
    world = plan.world_size
    work = [RankWork(heads=shape.heads) for _ in range(world)]
    for r in range(world):
        pairs = exchange_plan(plan, r, r).pairs
        work[r].segments += [s for p in pairs for s in pair_segments(p)]
        work[r].calls += 2 * len(pairs)
    rts = routes(plan)
    for hop in range(1, max_hops(plan) + 1):
        kv: list[dict[int, int]] = [{} for _ in range(world)]
        grads: list[dict[int, int]] = [{} for _ in range(world)]
        for r in rts:
            if hop > r.hops:
                continue
            holder = r.block.owner if hop == 1 else r.visits[hop - 2]
            dst = r.visits[hop - 1]
            kv[holder][dst] = kv[holder].get(dst, 0) + 2 * r.rows(hop) * shape.kv_row
            if r.pairs[hop - 1]:
                work[dst].segments += [s for p in r.pairs[hop - 1] for s in pair_segments(p)]
                work[dst].calls += 2 * len(r.pairs[hop - 1])
                owner = r.block.owner
                grads[dst][owner] = grads[dst].get(owner, 0) + 2 * r.rows(hop) * shape.kv_grad_row
        for rank in range(world):
            work[rank].sent("a2a", kv[rank])
            work[rank].sent("a2a", kv[rank])
            work[rank].sent("a2a", grads[rank])
    return work
