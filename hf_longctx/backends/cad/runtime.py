"""CAD runtime: every rank is an in-place attention server for core-attention tasks of any rank.

A task is "query rows [q_start, q_end) of one document piece held by ``owner``, computed on
``server``"; its keys are the causal prefix of those rows in the document, which may span the pieces
of several ranks. Per nano-batch, one all_to_all brings each server the queries and one the keys and
values of its tasks, the server runs all of them in ONE varlen kernel call (bottom-right causal
segments), and one all_to_all returns outputs and log-sum-exps (each query row belongs to exactly one
task, so no merge is needed). Backward trades the same rows plus output gradients and returns dQ to
owners and dK/dV, summed, to every holder.

Ping-pong: tasks are split into two nano-batches; the transfers of one are posted before the other
computes, so communication hides behind compute (on GPU the collectives run on NCCL's stream).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kernels import accumulation_dtype, attention_backward, attention_forward
from ...layout import ShardPlan
from .transfer import Item, RowTransfer


@dataclass(frozen=True)
class CadTask:
    owner: int
    piece: int  # index into the owner's pieces
    q_start: int  # piece-local query rows
    q_end: int
    server: int


def pieces_of(plan: ShardPlan, rank: int):
    """(piece, local row offset) of a rank, in local order."""
    out, pos = [], 0
    for slot in plan.rank_slots(rank):
        for p in slot.pieces:
            out.append((p, pos))
            pos += p.length
    return out


def docs_per_rank(plan: ShardPlan) -> list[list[tuple[int, int]]]:
    """What the scheduler takes: per rank, (piece length, tokens of its document before the piece)."""
    starts = plan.batch.doc_starts
    return [[(p.length, p.start - starts[p.doc]) for p, _ in pieces_of(plan, r)] for r in range(plan.world_size)]


@dataclass
class NanoBatch:
    tasks: list[CadTask]
    q: RowTransfer
    kv: RowTransfer
    cu_q: list[int]
    cu_k: list[int]
    max_q: int
    max_k: int


def _holders(plan: ShardPlan):
    """doc -> [(rank, piece, local offset)] in global order."""
    out: dict[int, list] = {}
    for r in range(plan.world_size):
        for p, off in pieces_of(plan, r):
            out.setdefault(p.doc, []).append((r, p, off))
    for v in out.values():
        v.sort(key=lambda x: x[1].start)
    return out


def build_nano_batch(plan: ShardPlan, tasks: list[CadTask], rank: int) -> NanoBatch:
    world = plan.world_size
    pieces = [pieces_of(plan, r) for r in range(world)]
    holders = _holders(plan)
    q_items, kv_items = [], []
    q_rows = [0] * world
    kv_rows = [0] * world
    cu_q, cu_k, max_q, max_k = [0], [0], 1, 1
    for t in tasks:
        piece, local = pieces[t.owner][t.piece]
        n_q = t.q_end - t.q_start
        q_items.append(Item(t.owner, local + t.q_start, local + t.q_end, t.server, q_rows[t.server]))
        q_rows[t.server] += n_q
        last = piece.start + t.q_end  # keys: the document up to the last query row
        n_k = 0
        for h, hp, hoff in holders[piece.doc]:
            lo, hi = hp.start, min(hp.end, last)
            if lo >= hi:
                continue
            kv_items.append(Item(h, hoff + lo - hp.start, hoff + hi - hp.start, t.server, kv_rows[t.server]))
            kv_rows[t.server] += hi - lo
            n_k += hi - lo
        if t.server == rank:
            cu_q.append(cu_q[-1] + n_q)
            cu_k.append(cu_k[-1] + n_k)
            max_q, max_k = max(max_q, n_q), max(max_k, n_k)
    return NanoBatch([t for t in tasks if t.server == rank], RowTransfer(q_items, rank, world, q_rows[rank]),
                     RowTransfer(kv_items, rank, world, kv_rows[rank]), cu_q, cu_k, max_q, max_k)


def nano_batches(plan: ShardPlan, tasks: list[CadTask], rank: int, pingpong: bool, device) -> list[NanoBatch]:
    """Two nano-batches (alternating tasks of each server, so both halves are balanced) or one."""
    def build():
        groups = [tasks[0::2], tasks[1::2]] if pingpong and len(tasks) > 1 else [tasks]
        out = []
        for g in groups:
            nb = build_nano_batch(plan, g, rank)
            nb.q.to(device)
            nb.kv.to(device)
            out.append(nb)
        return out

    return plan.cached(("cad_nano", tuple(tasks), rank, pingpong, str(device)), build)


def prepare(plan: ShardPlan, options: dict) -> dict:
    """Runner hook: schedule the plan's documents onto servers (cached per plan and eps)."""
    if "tasks" in options:
        return options
    eps = options.get("eps", 0.1)

    def build():
        from .scheduler import schedule

        sched = schedule(docs_per_rank(plan), plan.world_size, eps=eps)
        return [CadTask(t.rank, t.doc, t.q_start, t.q_end, t.server) for t in sched.tasks]

    return {**options, "tasks": plan.cached(("cad_tasks", eps), build)}


def _rows_t(lse: torch.Tensor) -> torch.Tensor:
    """(H, T) -> (T, H) rows for transfer."""
    return lse.t().contiguous()


def run_forward(ctx, q, k, v):
    nbs = nano_batches(ctx.plan, ctx.options["tasks"], ctx.rank, ctx.options.get("pingpong", True), q.device)
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=accumulation_dtype(q.dtype), device=q.device)
    posted = [(nb.q.start(q, ctx.group), nb.kv.start(k, ctx.group), nb.kv.start(v, ctx.group)) for nb in nbs]
    returns = []
    for nb, (pq, pk, pv) in zip(nbs, posted):
        qb, kb, vb = nb.q.finish(pq), nb.kv.finish(pk), nb.kv.finish(pv)
        if nb.tasks:
            ob, lb = attention_forward(qb, kb, vb, nb.cu_q, nb.cu_k, nb.max_q, nb.max_k, causal=True,
                                       softmax_scale=ctx.scale, kernel=ctx.kernel)
        else:
            ob = qb.new_empty(0, *q.shape[1:])
            lb = torch.empty(q.shape[1], 0, dtype=lse.dtype, device=q.device)
        returns.append((nb, nb.q.start_reverse(ob, ctx.group), nb.q.start_reverse(_rows_t(lb.to(lse.dtype)),
                                                                                    ctx.group)))
    lse_rows = _rows_t(lse)
    for nb, po, pl in returns:
        nb.q.finish_reverse(po, out, add=False)
        nb.q.finish_reverse(pl, lse_rows, add=False)
    return out, lse_rows.t().contiguous()


def run_backward(ctx, dout, q, k, v, out, lse):
    acc = accumulation_dtype(q.dtype)
    nbs = nano_batches(ctx.plan, ctx.options["tasks"], ctx.rank, ctx.options.get("pingpong", True), q.device)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    lse_rows = _rows_t(lse)
    dout = dout.contiguous()
    posted = [tuple(nb.q.start(t, ctx.group) for t in (q, out, dout, lse_rows))
              + (nb.kv.start(k, ctx.group), nb.kv.start(v, ctx.group)) for nb in nbs]
    returns = []
    for nb, (pq, po, pd, pl, pk, pv) in zip(nbs, posted):
        qb, ob, db, lb = (nb.q.finish(p) for p in (pq, po, pd, pl))
        kb, vb = nb.kv.finish(pk), nb.kv.finish(pv)
        if nb.tasks:
            gq, gk, gv = attention_backward(db, qb, kb, vb, ob, lb.t().contiguous(), nb.cu_q, nb.cu_k, nb.max_q,
                                            nb.max_k, causal=True, softmax_scale=ctx.scale, kernel=ctx.kernel)
        else:
            gq, gk, gv = torch.zeros_like(qb), torch.zeros_like(kb), torch.zeros_like(vb)
        returns.append((nb, nb.q.start_reverse(gq.to(acc), ctx.group), nb.kv.start_reverse(gk.to(acc), ctx.group),
                        nb.kv.start_reverse(gv.to(acc), ctx.group)))
    for nb, pq, pk, pv in returns:
        nb.q.finish_reverse(pq, dq, add=True)
        nb.kv.finish_reverse(pk, dk, add=True)
        nb.kv.finish_reverse(pv, dv, add=True)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
