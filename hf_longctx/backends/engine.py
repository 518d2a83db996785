"""Runs a :mod:`schedule <.schedule>` forward and backward on one rank.

Forward: for every step, receive the rows the step needs (posted one step ahead, so transfers
overlap the previous step's kernels), run one kernel call per :class:`~hf_longctx.layout.Pair`,
merge partial results into a float32 (out, lse) accumulator, and return helper results to their
owners. Backward mirrors it with the FINAL out/lse: the same rows travel again, dq stays with (or
returns to) the query owner and dk/dv return to the key owner, accumulated in float32.

A sliding window lives in the plan (:meth:`~hf_longctx.layout.ShardPlan.with_window`): its pairs
carry their kernel window, and blocks the window leaves empty drop out of every step.

Every rank walks the same global schedule and posts its messages in schedule order, which is what
keeps NCCL (issue-order matching) and gloo (tag matching) from ever pairing the wrong messages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..comm.p2p import PendingExchange, post_exchange
from ..kernels import PartialAccumulator, accumulation_dtype, kernel_backward, kernel_call, kernel_forward
from ..layout import Exchange, Pair, ShardPlan, exchange_plan
from .options import BackendOptions, NoOptions
from .prediction import AttentionShape, RankWork, pair_segments
from .schedule import BlockTask, Schedule

# Message kinds, part of the tag so gloo matches messages exactly.
_KV, _Q, _RESULT, _GRAD = range(4)


def _tag(step: int, kind: int) -> int:
    return step * 8 + kind


def gather_rows(x: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Rows of ``x`` in ``ranges`` back to back: a view for one range, a copy otherwise."""
    if len(ranges) == 1:
        a, b = ranges[0]
        return x[a:b]
    return torch.cat([x[a:b] for a, b in ranges])


def scatter_add_rows(dst: torch.Tensor, ranges: Sequence[tuple[int, int]], src: torch.Tensor) -> None:
    """dst[ranges] += src, the inverse of :func:`gather_rows`."""
    pos = 0
    for a, b in ranges:
        dst[a:b] += src[pos : pos + b - a].to(dst.dtype)
        pos += b - a


ForwardFn = Callable[["RunContext", torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
BackwardFn = Callable[["RunContext", torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                       torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass
class RunContext:
    """One rank's attention call: the plan, the schedule, the group, and the backend's forward/backward.

    ``forward_fn(run, q, k, v) -> (out, lse)`` and ``backward_fn(run, dout, q, k, v, out, lse) -> (dq, dk,
    dv)`` are what the core-attention op runs (a backend's :meth:`~.contract.Backend.forward` and
    :meth:`~.contract.Backend.backward`); left out, they are this module's schedule runner. ``options`` are the
    call's (never written: they serve every call of the run), ``state`` what belongs to this run alone.
    """

    plan: ShardPlan
    schedule: Schedule
    group: dist.ProcessGroup | None
    rank: int
    scale: float
    kernel: str
    forward_fn: ForwardFn | None = None
    backward_fn: BackwardFn | None = None
    options: BackendOptions = field(default_factory=NoOptions)  # the backend's options, read only
    state: object = None  # what the backend's prepare gave this run of the plan (CAD: its tasks, the eps used)
    causal: bool = True  # False: a bidirectional layer (every query sees every key of its document)

    def __post_init__(self) -> None:
        if self.forward_fn is None:
            self.forward_fn = run_forward
        if self.backward_fn is None:
            self.backward_fn = run_backward

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.forward_fn(self, q, k, v)

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.backward_fn(self, dout, q, k, v, out, lse)

    def exchange(self, task: BlockTask) -> Exchange:
        return exchange_plan(self.plan, task.q_rank, task.kv_rank, task.part, task.parts)

    def active(self, step: int):
        """Tasks of ``step`` that involve this rank and have work."""
        for task in self.schedule[step]:
            if self.rank in (task.q_rank, task.kv_rank) and self.exchange(task).pairs:
                yield task


def _empty(rows: int, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.empty(rows, *like.shape[1:], dtype=dtype or like.dtype, device=like.device)


def _empty_lse(rows: int, heads: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(heads, rows, dtype=dtype, device=device)


# ----------------------------------------------------------------------------- forward


def _kv_messages(ctx: RunContext, step: int, task: BlockTask, ex: Exchange, k: torch.Tensor, v: torch.Tensor,
                 sends: list, recvs: list) -> None:
    """Keys and values of a ring-style task travel from their owner to the query rank."""
    tag = _tag(step, _KV)
    if task.kv_rank == ctx.rank:
        sends += [(task.q_rank, gather_rows(k, ex.kv_ranges), tag), (task.q_rank, gather_rows(v, ex.kv_ranges), tag)]
    else:
        recvs += [(("k", task), task.kv_rank, _empty(ex.num_kv_rows, k), tag),
                  (("v", task), task.kv_rank, _empty(ex.num_kv_rows, v), tag)]


def _post_forward_fetch(ctx: RunContext, step: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                       ) -> PendingExchange:
    sends, recvs = [], []
    for task in ctx.active(step):
        if task.q_rank == task.kv_rank:
            continue
        ex = ctx.exchange(task)
        if not task.at_kv_owner:
            _kv_messages(ctx, step, task, ex, k, v, sends, recvs)
        else:
            if task.q_rank == ctx.rank:
                sends.append((task.kv_rank, gather_rows(q, ex.q_ranges), _tag(step, _Q)))
            else:
                recvs.append((("q", task), task.q_rank, _empty(ex.num_q_rows, q), _tag(step, _Q)))
    return post_exchange(sends, recvs, ctx.group, f"forward step {step} transfer")


def _run_pairs_forward(ctx: RunContext, pairs: Sequence[Pair], qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
                       acc: PartialAccumulator) -> None:
    for p in pairs:
        call = kernel_call(qs[p.q_start : p.q_end], ks[p.k_start : p.k_end], vs[p.k_start : p.k_end], p.cu_q,
                           p.cu_k, p.max_q, p.max_k, causal=p.causal, softmax_scale=ctx.scale, window=p.window)
        out, lse = kernel_forward(call, ctx.kernel)
        acc.add(p.q_start, out, lse)


def _post_results(ctx: RunContext, step: int, results: dict, q: torch.Tensor, lse_dtype: torch.dtype
                 ) -> PendingExchange:
    sends, recvs = [], []
    for task in ctx.active(step):
        if not task.at_kv_owner:
            continue
        ex = ctx.exchange(task)
        if task.kv_rank == ctx.rank:
            out, lse = results[task]
            sends += [(task.q_rank, out, _tag(step, _RESULT)), (task.q_rank, lse, _tag(step, _RESULT))]
        else:
            recvs += [(("out", task), task.kv_rank, _empty(ex.num_q_rows, q), _tag(step, _RESULT)),
                      (("lse", task), task.kv_rank, _empty_lse(ex.num_q_rows, q.shape[1], lse_dtype, q.device),
                       _tag(step, _RESULT))]
    return post_exchange(sends, recvs, ctx.group, f"forward step {step} result return")


def _merge_results(ctx: RunContext, pending: PendingExchange | None, acc: PartialAccumulator) -> None:
    if pending is None:
        return
    got = pending.wait()
    for key, out in got.items():
        if key[0] != "out":
            continue
        task = key[1]
        lse = got[("lse", task)]
        pos = 0
        for a, b in ctx.exchange(task).q_ranges:
            acc.add(a, out[pos : pos + b - a], lse[:, pos : pos + b - a])
            pos += b - a


def run_forward(ctx: RunContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (out, lse) for its local queries under ``ctx.schedule``."""
    acc = PartialAccumulator(q.shape[0], q.shape[1], q.shape[2], q.dtype, q.device)
    lse_dtype = accumulation_dtype(q.dtype)
    fetch = _post_forward_fetch(ctx, 0, q, k, v)
    pending_results = None
    for step in range(len(ctx.schedule)):
        got = fetch.wait()
        if step + 1 < len(ctx.schedule):
            fetch = _post_forward_fetch(ctx, step + 1, q, k, v)
        results = {}
        for task in ctx.active(step):
            ex = ctx.exchange(task)
            if task.computed_by() != ctx.rank:
                continue
            if not task.at_kv_owner:
                if task.kv_rank == ctx.rank:
                    ks, vs = gather_rows(k, ex.kv_ranges), gather_rows(v, ex.kv_ranges)
                else:
                    ks, vs = got[("k", task)], got[("v", task)]
                _run_pairs_forward(ctx, ex.pairs, q, ks, vs, acc)
            else:
                helper_acc = PartialAccumulator(ex.num_q_rows, q.shape[1], q.shape[2], q.dtype, q.device)
                _run_pairs_forward(ctx, ex.pairs_in_q_buffer(), got[("q", task)], gather_rows(k, ex.kv_ranges),
                                   gather_rows(v, ex.kv_ranges), helper_acc)
                out, lse = helper_acc.result()
                results[task] = (out, lse.contiguous())
        previous = pending_results
        pending_results = _post_results(ctx, step, results, q, lse_dtype)
        _merge_results(ctx, previous, acc)
    _merge_results(ctx, pending_results, acc)
    return acc.result()


# ----------------------------------------------------------------------------- backward


def _post_backward_fetch(ctx: RunContext, step: int, tensors: dict) -> PendingExchange:
    q, k, v = tensors["q"], tensors["k"], tensors["v"]
    sends, recvs = [], []
    for task in ctx.active(step):
        if task.q_rank == task.kv_rank:
            continue
        ex = ctx.exchange(task)
        tag = _tag(step, _Q)
        if not task.at_kv_owner:
            _kv_messages(ctx, step, task, ex, k, v, sends, recvs)
        else:
            names = ("q", "out", "dout")
            if task.q_rank == ctx.rank:
                sends += [(task.kv_rank, gather_rows(tensors[n], ex.q_ranges), tag) for n in names]
                lse_rows = torch.cat([tensors["lse"][:, a:b] for a, b in ex.q_ranges], dim=1)
                sends.append((task.kv_rank, lse_rows, tag))
            else:
                recvs += [((n, task), task.q_rank, _empty(ex.num_q_rows, tensors[n]), tag) for n in names]
                recvs.append((("lse", task), task.q_rank,
                              _empty_lse(ex.num_q_rows, q.shape[1], tensors["lse"].dtype, q.device), tag))
    return post_exchange(sends, recvs, ctx.group, f"backward step {step} transfer")


def _run_pairs_backward(ctx: RunContext, pairs: Sequence[Pair], qs: torch.Tensor, outs: torch.Tensor,
                        douts: torch.Tensor, lses: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, dq: torch.Tensor,
                        dk: torch.Tensor, dv: torch.Tensor) -> None:
    for p in pairs:
        sq, sk = slice(p.q_start, p.q_end), slice(p.k_start, p.k_end)
        call = kernel_call(qs[sq], ks[sk], vs[sk], p.cu_q, p.cu_k, p.max_q, p.max_k, causal=p.causal,
                           softmax_scale=ctx.scale, window=p.window)
        gq, gk, gv = kernel_backward(call, douts[sq], outs[sq], lses[:, sq], ctx.kernel)
        dq[sq] += gq
        dk[sk] += gk
        dv[sk] += gv


def _post_grads(ctx: RunContext, step: int, grads: dict, like: dict, acc_dtype: torch.dtype) -> PendingExchange:
    sends, recvs = [], []
    tag = _tag(step, _GRAD)
    for task in ctx.active(step):
        if task.q_rank == task.kv_rank:
            continue
        ex = ctx.exchange(task)
        if not task.at_kv_owner:
            if task.q_rank == ctx.rank:  # I computed against remote keys: dk, dv go home
                sends += [(task.kv_rank, grads[task][0], tag), (task.kv_rank, grads[task][1], tag)]
            else:
                recvs += [(("dk", task), task.q_rank, _empty(ex.num_kv_rows, like["k"], acc_dtype), tag),
                          (("dv", task), task.q_rank, _empty(ex.num_kv_rows, like["v"], acc_dtype), tag)]
        else:
            if task.kv_rank == ctx.rank:  # I helped: dq goes home
                sends.append((task.q_rank, grads[task], tag))
            else:
                recvs.append((("dq", task), task.kv_rank, _empty(ex.num_q_rows, like["q"], acc_dtype), tag))
    return post_exchange(sends, recvs, ctx.group, f"backward step {step} gradient return")


def _apply_grads(ctx: RunContext, pending: PendingExchange | None, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor
                ) -> None:
    if pending is None:
        return
    for (name, task), grad in pending.wait().items():
        ex = ctx.exchange(task)
        if name == "dq":
            scatter_add_rows(dq, ex.q_ranges, grad)
        else:
            scatter_add_rows(dk if name == "dk" else dv, ex.kv_ranges, grad)


def _zeros(ks: torch.Tensor, vs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(ks.shape, dtype=dtype, device=ks.device), torch.zeros(vs.shape, dtype=dtype, device=vs.device)


def _own_key_grads(ranges: Sequence[tuple[int, int]], dk: torch.Tensor, dv: torch.Tensor, ks: torch.Tensor,
                   vs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Where a block of this rank's own keys accumulates its dk, dv, and whether they must be added back into the
    rank's gradients: straight into them when the block is one range of rows (a view; no buffer to fill and add
    back), else into buffers."""
    if len(ranges) == 1:
        a, b = ranges[0]
        return dk[a:b], dv[a:b], False
    return (*_zeros(ks, vs, dk.dtype), True)


def zero_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv accumulators of q, k, v's shapes in the accumulation dtype (float32, float64 for float64)."""
    acc_dtype = accumulation_dtype(q.dtype)
    return (torch.zeros(q.shape, dtype=acc_dtype, device=q.device),
            torch.zeros(k.shape, dtype=acc_dtype, device=k.device),
            torch.zeros(v.shape, dtype=acc_dtype, device=v.device))


def run_backward(ctx: RunContext, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of this rank's local tensors under ``ctx.schedule``."""
    acc_dtype = accumulation_dtype(q.dtype)
    dq, dk, dv = zero_grads(q, k, v)
    dout = dout.contiguous()
    tensors = {"q": q, "k": k, "v": v, "out": out, "dout": dout, "lse": lse}
    fetch = _post_backward_fetch(ctx, 0, tensors)
    pending_grads = None
    for step in range(len(ctx.schedule)):
        got = fetch.wait()
        if step + 1 < len(ctx.schedule):
            fetch = _post_backward_fetch(ctx, step + 1, tensors)
        grads = {}
        for task in ctx.active(step):
            ex = ctx.exchange(task)
            if task.computed_by() != ctx.rank:
                continue
            if not task.at_kv_owner:
                local = task.kv_rank == ctx.rank
                ks = gather_rows(k, ex.kv_ranges) if local else got[("k", task)]
                vs = gather_rows(v, ex.kv_ranges) if local else got[("v", task)]
                gk, gv, add_back = _own_key_grads(ex.kv_ranges, dk, dv, ks, vs) if local \
                    else (*_zeros(ks, vs, acc_dtype), False)
                _run_pairs_backward(ctx, ex.pairs, q, out, dout, lse, ks, vs, dq, gk, gv)
                if add_back:
                    scatter_add_rows(dk, ex.kv_ranges, gk)
                    scatter_add_rows(dv, ex.kv_ranges, gv)
                if not local:  # computed against remote keys: their gradients go home
                    grads[task] = (gk, gv)
            else:
                ks, vs = gather_rows(k, ex.kv_ranges), gather_rows(v, ex.kv_ranges)
                gq = torch.zeros(ex.num_q_rows, *q.shape[1:], dtype=acc_dtype, device=q.device)
                gk, gv, add_back = _own_key_grads(ex.kv_ranges, dk, dv, ks, vs)
                _run_pairs_backward(ctx, ex.pairs_in_q_buffer(), got[("q", task)], got[("out", task)],
                                    got[("dout", task)], got[("lse", task)], ks, vs, gq, gk, gv)
                if add_back:
                    scatter_add_rows(dk, ex.kv_ranges, gk)
                    scatter_add_rows(dv, ex.kv_ranges, gv)
                grads[task] = gq
        previous = pending_grads
        pending_grads = _post_grads(ctx, step, grads, tensors, acc_dtype)
        _apply_grads(ctx, previous, dq, dk, dv)
    _apply_grads(ctx, pending_grads, dq, dk, dv)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ----------------------------------------------------------------------------- what a run costs


def schedule_rank_work(plan: ShardPlan, schedule: Schedule, shape: AttentionShape) -> list[RankWork]:
    """Every rank's kernel segments, kernel calls and sends of one forward+backward of ``schedule`` (see
    :mod:`.prediction`), counted as :func:`run_forward` and :func:`run_backward` send them: per step one
    batch of fetches (keys and values to the query rank, or query-side rows to a helping key owner) and one of
    returns (partial results forward; dk/dv or dq in the accumulation dtype backward)."""
    world = plan.world_size
    work = [RankWork(heads=shape.heads) for _ in range(world)]
    kv, q_side_fwd = 2 * shape.kv_row, shape.q_row
    q_side_bwd = 3 * shape.q_row + shape.lse_row  # q, out, dout and lse go to a helping key owner
    result = shape.q_row + shape.lse_row
    for step in schedule:
        fetch: list[dict[int, int]] = [{} for _ in range(world)]
        fetch_bwd: list[dict[int, int]] = [{} for _ in range(world)]
        back: list[dict[int, int]] = [{} for _ in range(world)]
        back_bwd: list[dict[int, int]] = [{} for _ in range(world)]
        for task in step:
            ex = exchange_plan(plan, task.q_rank, task.kv_rank, task.part, task.parts)
            if not ex.pairs:
                continue
            runner = work[task.computed_by()]
            runner.segments += [s for p in ex.pairs for s in pair_segments(p)]
            runner.calls += 2 * len(ex.pairs)
            if task.q_rank == task.kv_rank:
                continue
            if task.at_kv_owner:
                q, k = task.q_rank, task.kv_rank
                fetch[q][k] = fetch[q].get(k, 0) + ex.num_q_rows * q_side_fwd
                fetch_bwd[q][k] = fetch_bwd[q].get(k, 0) + ex.num_q_rows * q_side_bwd
                back[k][q] = back[k].get(q, 0) + ex.num_q_rows * result
                back_bwd[k][q] = back_bwd[k].get(q, 0) + ex.num_q_rows * shape.q_grad_row
            else:
                q, k = task.q_rank, task.kv_rank
                for phase in (fetch, fetch_bwd):
                    phase[k][q] = phase[k].get(q, 0) + ex.num_kv_rows * kv
                back_bwd[q][k] = back_bwd[q].get(k, 0) + ex.num_kv_rows * 2 * shape.kv_grad_row
        for r in range(world):
            work[r].sent("p2p", fetch[r])
            work[r].sent("p2p", back[r])
            work[r].sent("p2p", fetch_bwd[r])
            work[r].sent("p2p", back_bwd[r])
    return work
