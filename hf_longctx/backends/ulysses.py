"""Ulysses (DeepSpeed-Ulysses style) sequence parallelism: all_to_all from token shards to head shards.

Each rank trades its token shard of every head for the whole sequence of P-th of the heads, runs
single-device attention over the whole packed sequence (document masking from cu_seqlens), and trades
back. Work is balanced whatever the placement or documents; communication is four all_to_alls of the
local activations per direction, independent of P. Limits: query heads must split over the ranks;
KV heads that do not are repeated locally just enough to split (GQA), never more.

Backward repeats the forward exchanges instead of saving the head-sharded tensors, so memory stays
that of the local shard (recompute-friendly, like the rest of the package).
"""

from __future__ import annotations

from math import gcd

import torch

from ..comm.collectives import all_to_all_single
from ..comm.links import Transfer
from ..comm.p2p import count_all_to_all
from ..kernels import attention_backward, attention_forward
from ..layout import ShardPlan
from .contract import Backend
from .engine import RunContext
from .options import BackendOptions
from .prediction import AttentionShape, RankWork


def attention_load(plan: ShardPlan) -> list[int]:
    """Every rank computes the whole sequence for 1/P of the heads: the pairs split evenly."""
    total, world = plan.batch.causal_pairs(plan.window), plan.world_size
    return [total // world + (r < total % world) for r in range(world)]


def kv_repeat(hq: int, hkv: int, world: int) -> int:
    """How many times KV heads are repeated so they split over ``world`` ranks (1 when they already do)."""
    rep = world // gcd(hkv, world)
    if hq % world or hq % (hkv * rep):
        raise ValueError(f"ulysses needs query heads ({hq}) divisible by the sequence-parallel size ({world}); "
                         "use a ring backend (ring, zigzag, distfa) for this head count")
    return rep


def _token_counts(ctx: RunContext) -> list[int]:
    return ctx.plan.token_counts


def _order(ctx: RunContext, device: torch.device) -> torch.Tensor | None:
    """Global token index of each row of the rank-order concatenation (None when already global order)."""
    idx = torch.cat([ctx.plan.local_indices(r) for r in range(ctx.plan.world_size)])
    if torch.equal(idx, torch.arange(idx.numel())):
        return None
    return idx.to(device)


def tokens_to_heads(x: torch.Tensor, counts: list[int], rank: int, group) -> torch.Tensor:
    """(T_local, H, D) token shard of ``rank`` -> (sum(counts), H / P, D): every rank's tokens, in rank order, for
    this rank's P-th of the heads; ``counts`` are the token counts of the P ranks of ``group``."""
    world = len(counts)
    if world == 1:
        return x
    t, h, d = x.shape
    send = x.view(t, world, h // world, d).transpose(0, 1).contiguous()  # (P, T_local, H/P, D)
    recv = x.new_empty(sum(counts), h // world, d)
    count_all_to_all(send.view(world * t, h // world, d), [t] * world, counts, rank)
    all_to_all_single(recv, send.view(world * t, h // world, d), counts, [t] * world, group=group)
    return recv


def heads_to_tokens(x: torch.Tensor, counts: list[int], rank: int, group) -> torch.Tensor:
    """Inverse of :func:`tokens_to_heads`: (sum(counts), H / P, D) in rank order -> (T_local, H, D) of ``rank``."""
    world = len(counts)
    if world == 1:
        return x
    t = counts[rank]
    recv = x.new_empty(world * t, *x.shape[1:])
    count_all_to_all(x, counts, [t] * world, rank)
    all_to_all_single(recv, x.contiguous(), [t] * world, counts, group=group)
    return recv.view(world, t, *x.shape[1:]).transpose(0, 1).reshape(t, world * x.shape[1], x.shape[2])


def _to_heads(x: torch.Tensor, ctx: RunContext, order: torch.Tensor | None) -> torch.Tensor:
    """(T_local, H, D) token shard -> (T, H / P, D) head shard in global token order."""
    recv = tokens_to_heads(x, _token_counts(ctx), ctx.rank, ctx.group)
    if order is None or ctx.plan.world_size == 1:
        return recv
    out = torch.empty_like(recv)
    out[order] = recv
    return out


def _to_tokens(x: torch.Tensor, ctx: RunContext, order: torch.Tensor | None, rank: int) -> torch.Tensor:
    """Inverse of :func:`_to_heads`: (T, H / P, D) -> (T_local, H, D)."""
    if order is not None and ctx.plan.world_size > 1:
        x = x[order]
    return heads_to_tokens(x, _token_counts(ctx), rank, ctx.group)


def _heads(ctx: RunContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    rep = kv_repeat(q.shape[1], k.shape[1], ctx.plan.world_size)
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    order = _order(ctx, q.device)
    return order, rep, [_to_heads(t, ctx, order) for t in (q, k, v)]


def run_forward(ctx: RunContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    order, _, (qh, kh, vh) = _heads(ctx, q, k, v)
    cu = ctx.plan.batch.cu_seqlens.tolist()
    m = ctx.plan.batch.max_seqlen
    out, lse = attention_forward(qh, kh, vh, cu, cu, m, m, causal=ctx.causal,
                                 softmax_scale=ctx.scale, kernel=ctx.kernel, window=ctx.plan.window)
    out_local = _to_tokens(out, ctx, order, ctx.rank)
    lse_local = _to_tokens(lse.t().unsqueeze(-1).contiguous(), ctx, order, ctx.rank).squeeze(-1).t()
    return out_local, lse_local.contiguous()


def run_backward(ctx: RunContext, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor):
    order, rep, (qh, kh, vh) = _heads(ctx, q, k, v)
    outh, douth = (_to_heads(t, ctx, order) for t in (out, dout.contiguous()))
    lseh = _to_heads(lse.t().unsqueeze(-1).contiguous(), ctx, order).squeeze(-1).t().contiguous()
    cu = ctx.plan.batch.cu_seqlens.tolist()
    m = ctx.plan.batch.max_seqlen
    dq, dk, dv = attention_backward(douth, qh, kh, vh, outh, lseh, cu, cu, m, m, causal=ctx.causal,
                                    softmax_scale=ctx.scale, kernel=ctx.kernel, window=ctx.plan.window)
    dq, dk, dv = (_to_tokens(g, ctx, order, ctx.rank) for g in (dq, dk, dv))
    if rep > 1:  # repeated KV heads: their gradients add up on the original head
        dk = dk.view(dk.shape[0], -1, rep, dk.shape[2]).sum(2)
        dv = dv.view(dv.shape[0], -1, rep, dv.shape[2]).sum(2)
    return dq, dk, dv


class UlyssesBackend(Backend):
    """Backend ``ulysses``: the runner above behind the backend contract."""

    name = "ulysses"
    summary = "Ulysses: all_to_all from token shards to head shards, whole-sequence attention per head group"
    bidirectional = True  # each rank holds whole documents for its heads: any mask the kernel knows works

    def validate(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: ShardPlan, world: int):
        try:
            kv_repeat(q.shape[1], k.shape[1], world)
        except ValueError as exc:
            return str(exc)
        return None

    auto_candidate_for = ("contiguous", "zigzag")  # any placement: every rank gets whole documents for its heads

    def auto_candidate_options(self, world: int, shape: AttentionShape, node_size: int) -> BackendOptions | None:
        try:
            kv_repeat(shape.heads, shape.kv_heads, world)
        except ValueError:
            return None
        return super().auto_candidate_options(world, shape, node_size)

    def rank_work(self, plan: ShardPlan, shape: AttentionShape, options: BackendOptions) -> list[RankWork] | None:
        return rank_work(plan, shape)

    # the runner's module functions are the contract's methods
    forward = staticmethod(run_forward)
    backward = staticmethod(run_backward)
    attention_load = staticmethod(attention_load)


def exchange_transfers(counts: list[int], rank: int, shape: AttentionShape, members: list[int] | None = None
                       ) -> list[Transfer]:
    """The all_to_alls ``rank`` makes in one forward+backward to trade ``counts`` token shards (a group of
    ``len(counts)`` ranks) for head shards and back, as :func:`run_forward`/:func:`run_backward` make them:
    q, k, v (KV heads repeated to split) and back out and lse; in backward q, k, v, out, dout and lse, and back
    dq, dk, dv. ``members`` numbers the group's ranks in the world the transfers are priced in (default: as
    they are)."""
    world = len(counts)
    if world == 1:
        return []
    members = members if members is not None else list(range(world))
    split = shape.split_heads(world, kv_repeat(shape.heads, shape.kv_heads, world))
    mine = counts[rank]
    q, kv, lse = split.q_row, split.kv_row, split.lse_row

    def to_heads(row: int) -> Transfer:
        return "a2a", {members[d]: mine * row for d in range(world) if d != rank}

    def to_tokens(row: int) -> Transfer:
        return "a2a", {members[s]: counts[s] * row for s in range(world) if s != rank}

    forward = [to_heads(q), to_heads(kv), to_heads(kv), to_tokens(q), to_tokens(lse)]
    backward = [to_heads(q), to_heads(kv), to_heads(kv), to_heads(q), to_heads(q), to_heads(lse),
                to_tokens(q), to_tokens(kv), to_tokens(kv)]
    return [t for t in forward + backward if any(t[1].values())]


def rank_work(plan: ShardPlan, shape: AttentionShape) -> list[RankWork]:
    """Every rank runs every document whole for its share of the heads (one forward and one backward call)
    and trades its tokens for heads and back (:func:`exchange_transfers`)."""
    world = plan.world_size
    heads = shape.heads // world
    docs = [(n, n, True, plan.window) for n in plan.batch.doc_lens]
    counts = plan.token_counts
    return [RankWork(list(docs), 2, exchange_transfers(counts, r, shape), heads) for r in range(world)]
