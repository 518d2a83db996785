"""Token dispatch for expert parallelism: allgather (with reduce-scatter back) and all-to-all.

Both run the same pieces: :func:`~hf_longctx.moe.routing.pair_layout` compacts the (token, slot)
pairs of this rank's experts, :func:`~hf_longctx.moe.experts.expert_mlp` runs them grouped by
expert, and the weighted expert outputs are summed back into token rows slot by slot in at least
float32. They differ in how rows travel.

**allgather** (the design of Megatron's ``MoEAllGatherTokenDispatcher``, our own code). Every rank
of the EP group all-gathers the group's tokens together with their routing weights and expert ids
(one collective: the routing is bit-packed behind the hidden states), computes the pairs of its own
experts, sums each token's weighted outputs in float32 into a buffer of all the group's tokens, and
one reduce-scatter in float32 returns each token's sum to its owner. Backward is the transpose: one
all-gather of the output gradients (in the activation dtype: they are exact there), and one
reduce-scatter in float32 of the input and routing-weight gradients. Collectives have fixed sizes:
ranks may hold different token counts, so every rank pads to the group's largest count, learned
from a small all-gather of counts per call (padding rows carry expert id -1 and are never
computed). Padding keeps ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (NCCL's fastest
collectives) instead of uneven all-gathers, which NCCL runs as one broadcast per rank. Bytes per rank
(ep ranks, T tokens each, hidden H, activations of b bytes): (ep - 1) T (H b + 8k) gathered and
(ep - 1) T H 4 reduce-scattered forward; the all-to-all moves about 2 (ep - 1)/ep T k H b. So the
gather wins when top-k is large against ep (Qwen3-MoE and OLMoE route 8 experts per token) and loses
for top-2 Mixtral. Reduce-scattering in float32 costs twice the bytes of bf16 and rounds once,
where a bf16 reduce-scatter would round at every hop.

**all_to_all** (the baseline). Each rank sends each pair's row to the rank of its expert, which
receives them grouped by (source rank, expert), regroups them by expert for the GEMM, and sends the
outputs back; the owner applies the routing weights and sums in float32. Split sizes are read back
to the host every call.

Ordering is deterministic in both: each token's pair rows are summed slot by slot through the pair
table (see :mod:`~hf_longctx.moe.routing` and :mod:`~hf_longctx.moe.row_ops`: one Triton kernel on
GPUs, no atomics), and permutations are stable sorts. On one rank holding every expert nothing
travels and no pair count is read back to the host. The gathered rows of all
the group's tokens are never saved for backward: only the compacted rows of local pairs survive
(inside the expert GEMMs' autograd), and the combine keeps the pairs' outputs for the weight
gradient.

A rank whose experts get no rows still takes part in every collective of forward and backward: a
zero-size ``link`` tensor ties the combine step to the dispatch step in the autograd graph, so the
dispatch's backward (a reduce-scatter every rank must join) runs even when no expert row connects
them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..comm.groups import DTYPE_CODES
from ..comm.p2p import count_all_to_all, count_collective
from ..kernels import accumulation_dtype
from .experts import expert_mlp
from .routing import PairLayout, pair_layout
from .row_ops import pair_grads, pair_sum

DISPATCHES = ("allgather", "all_to_all")

def _count_symmetric(kind: str, chunk_bytes: int, world: int) -> None:
    """all-gather / reduce-scatter: each rank sends its chunk to, and receives one from, each other rank."""
    count_collective(kind, (world - 1) * chunk_bytes, (world - 1) * chunk_bytes)


def _all_gather(chunk: torch.Tensor, group, world: int) -> torch.Tensor:
    if world == 1:
        return chunk
    out = chunk.new_empty((world * chunk.shape[0], *chunk.shape[1:]))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, chunk.contiguous(), group=group)
    _count_symmetric("all_gather", chunk.numel() * chunk.element_size(), world)
    return out


def _reduce_scatter(full: torch.Tensor, group, world: int) -> torch.Tensor:
    if world == 1:
        return full
    out = full.new_empty((full.shape[0] // world, *full.shape[1:]))
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, full.contiguous(), group=group)
    _count_symmetric("reduce_scatter", out.numel() * out.element_size(), world)
    return out


def _all_to_all(rows: torch.Tensor, send_splits: list[int], recv_splits: list[int], group, rank: int, world: int
                ) -> torch.Tensor:
    if world == 1:
        return rows
    out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=recv_splits, input_split_sizes=send_splits,
                           group=group)
    count_all_to_all(rows, send_splits, recv_splits, rank)
    return out


@dataclass
class DispatchState:
    """What one dispatch call shares between its dispatch and combine steps (filled during forward)."""

    group: dist.ProcessGroup | None
    rank: int
    world: int
    expert_start: int
    num_local_experts: int
    max_tokens: int = 0  # allgather: rows per rank in the fixed-size collectives
    all_local: bool = False  # every routed expert id is in this rank's range: nothing to compact away
    layout: PairLayout | None = None
    # all_to_all: split sizes and the regrouping of received rows by expert
    send_splits: list[int] = field(default_factory=list)
    recv_splits: list[int] = field(default_factory=list)
    recv_order: torch.Tensor | None = None
    recv_counts: torch.Tensor | None = None


def _routing_dtype(x: torch.Tensor, weights: torch.Tensor) -> torch.dtype:
    """Float dtype that carries weights and expert ids exactly and packs behind rows of ``x`` (whole elements)."""
    dtype = accumulation_dtype(weights.dtype)
    if torch.empty((), dtype=dtype).element_size() < x.element_size():
        dtype = x.dtype  # e.g. float32 weights beside float64 activations
    return dtype


class _AllGatherDispatch(torch.autograd.Function):
    """Rows and weights of the group's pairs routed to this rank's experts, in expert order."""

    @staticmethod
    def forward(ctx, x, weights, expert_ids, state: DispatchState):
        tokens, hidden = x.shape
        top_k = expert_ids.shape[1]
        if state.world == 1:  # nothing travels: the rows are this rank's own
            x_all, weights_all, ids_all = x, weights, expert_ids
        else:
            routing_dtype = _routing_dtype(x, weights)
            routing = torch.cat([weights.to(routing_dtype), expert_ids.to(routing_dtype)], dim=1)
            packed = torch.cat([x, routing.view(x.dtype)], dim=1)
            if tokens < state.max_tokens:  # padding rows: zero states, weight 0, expert -1 (never selected)
                pad_routing = torch.cat([torch.zeros(1, top_k, dtype=routing_dtype, device=x.device),
                                         torch.full((1, top_k), -1, dtype=routing_dtype, device=x.device)], dim=1)
                pad = torch.cat([x.new_zeros(1, hidden), pad_routing.view(x.dtype)], dim=1)
                packed = torch.cat([packed, pad.expand(state.max_tokens - tokens, -1)])
            gathered = _all_gather(packed, state.group, state.world)
            routing_all = gathered[:, hidden:].contiguous().view(routing_dtype)
            x_all, weights_all, ids_all = gathered[:, :hidden], routing_all[:, :top_k], routing_all[:, top_k:]
        layout = pair_layout(ids_all, state.expert_start, state.num_local_experts, all_local=state.all_local)
        state.layout = layout
        rows = x_all.index_select(0, layout.token_index)
        # kept in the routing dtype (>= float32): with expert-TP the weight gradients are partial sums over ranks
        pair_weights = weights_all.reshape(-1).index_select(0, layout.flat_index)
        del x_all, weights_all  # the gathered rows of every token are not kept for backward
        ctx.state, ctx.x_dtype, ctx.w_dtype, ctx.tokens = state, x.dtype, weights.dtype, tokens
        return rows, pair_weights, x.new_empty(0)

    @staticmethod
    def backward(ctx, grad_rows, grad_pair_weights, _grad_link):
        state, layout = ctx.state, ctx.state.layout
        hidden = grad_rows.shape[1]  # autograd materialises an unused output's gradient as zeros
        if state.world == 1:
            grad_x = pair_sum(grad_rows, layout.pair_table, out_dtype=ctx.x_dtype)
            return grad_x, layout.scatter_to_slots(grad_pair_weights.to(ctx.w_dtype)), None, None
        # one float32 buffer of every group token: input gradients, then the k routing-weight gradients
        full = grad_rows.new_empty((state.world * state.max_tokens, hidden + layout.top_k),
                                   dtype=accumulation_dtype(ctx.x_dtype))
        pair_sum(grad_rows, layout.pair_table, out=full[:, :hidden])
        full[:, hidden:] = layout.scatter_to_slots(grad_pair_weights.to(full.dtype))
        mine = _reduce_scatter(full, state.group, state.world)[: ctx.tokens]
        return mine[:, :hidden].to(ctx.x_dtype), mine[:, hidden:].to(ctx.w_dtype), None, None


class _AllGatherCombine(torch.autograd.Function):
    """Each token's weighted sum of its experts' outputs, summed over the group, back on its owner."""

    @staticmethod
    def forward(ctx, expert_out, pair_weights, link, state: DispatchState, out_dtype: torch.dtype, tokens: int):
        layout = state.layout
        if state.world == 1:
            out = pair_sum(expert_out, layout.pair_table, pair_weights, out_dtype=out_dtype)
        else:
            partial = pair_sum(expert_out, layout.pair_table, pair_weights, out_dtype=accumulation_dtype(out_dtype))
            out = _reduce_scatter(partial, state.group, state.world)[:tokens].to(out_dtype)
        ctx.save_for_backward(expert_out, pair_weights)
        ctx.state, ctx.tokens = state, tokens
        return out

    @staticmethod
    def backward(ctx, grad_out):
        expert_out, pair_weights = ctx.saved_tensors
        state, layout = ctx.state, ctx.state.layout
        grad_all = grad_out
        if state.world > 1:
            if ctx.tokens < state.max_tokens:
                grad_out = torch.cat([grad_out, grad_out.new_zeros(state.max_tokens - ctx.tokens, grad_out.shape[1])])
            grad_all = _all_gather(grad_out, state.group, state.world)
        grad_expert_out, grad_weights = pair_grads(grad_all, layout.token_index, pair_weights, expert_out)
        return grad_expert_out, grad_weights, grad_out.new_zeros(0), None, None, None


class _AllToAllDispatch(torch.autograd.Function):
    """Rows of this rank's pairs sent to their experts' ranks; returns the rows this rank's experts run."""

    @staticmethod
    def forward(ctx, x, expert_ids, state: DispatchState):
        num_experts = state.world * state.num_local_experts
        layout = pair_layout(expert_ids, 0, num_experts, all_local=state.all_local)
        state.layout = layout
        send_counts = layout.expert_counts.view(state.world, state.num_local_experts)
        recv_counts = send_counts
        if state.world > 1:
            recv_counts = torch.empty_like(send_counts)
            dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=state.group)
            splits = torch.stack([send_counts.sum(dim=1), recv_counts.sum(dim=1)]).tolist()
            state.send_splits, state.recv_splits = splits
        else:
            state.send_splits = state.recv_splits = [layout.num_pairs]
        send_rows = x.index_select(0, layout.token_index)
        received = _all_to_all(send_rows, state.send_splits, state.recv_splits, state.group, state.rank, state.world)
        state.recv_counts = recv_counts.sum(dim=0)
        if state.world > 1:  # received rows are grouped by (source rank, expert): regroup them by expert
            expert_of_row = torch.arange(state.num_local_experts, device=x.device).repeat(state.world)
            expert_of_row = torch.repeat_interleave(expert_of_row, recv_counts.reshape(-1),
                                                    output_size=received.shape[0])
            state.recv_order = torch.argsort(expert_of_row, stable=True)
            received = received.index_select(0, state.recv_order)
        ctx.state, ctx.x_dtype = state, x.dtype
        return received, x.new_empty(0)

    @staticmethod
    def backward(ctx, grad_rows, _grad_link):
        state, layout = ctx.state, ctx.state.layout
        grad_received = grad_rows
        if state.recv_order is not None:
            grad_received = torch.empty_like(grad_rows)
            grad_received[state.recv_order] = grad_rows
        grad_sent = _all_to_all(grad_received, state.recv_splits, state.send_splits, state.group, state.rank,
                                state.world)
        return pair_sum(grad_sent, layout.pair_table, out_dtype=ctx.x_dtype), None, None


class _AllToAllCombine(torch.autograd.Function):
    """Expert outputs back to the tokens' owner, weighted and summed per token in at least float32."""

    @staticmethod
    def forward(ctx, expert_out, weights, link, state: DispatchState, out_dtype: torch.dtype):
        layout = state.layout
        back = expert_out
        if state.recv_order is not None:
            back = torch.empty_like(expert_out)
            back[state.recv_order] = expert_out
        returned = _all_to_all(back, state.recv_splits, state.send_splits, state.group, state.rank, state.world)
        pair_weights = weights.reshape(-1).index_select(0, layout.flat_index)
        out = pair_sum(returned, layout.pair_table, pair_weights, out_dtype=out_dtype)
        ctx.save_for_backward(returned, pair_weights)
        ctx.state, ctx.w_dtype = state, weights.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        returned, pair_weights = ctx.saved_tensors
        state, layout = ctx.state, ctx.state.layout
        grad_returned, grad_pair_weights = pair_grads(grad_out, layout.token_index, pair_weights, returned)
        grad_sent = _all_to_all(grad_returned, state.send_splits, state.recv_splits, state.group, state.rank,
                                state.world)
        grad_expert_out = grad_sent if state.recv_order is None else grad_sent.index_select(0, state.recv_order)
        grad_weights = layout.scatter_to_slots(grad_pair_weights.to(ctx.w_dtype))
        return grad_expert_out, grad_weights, grad_out.new_zeros(0), None, None


def _group_token_counts(tokens: int, signature: list[int], group, world: int, device: torch.device) -> list[int]:
    """Token counts of every rank of the group; raises on every rank alike if their problems disagree."""
    if world == 1:
        return [tokens]
    mine = torch.tensor([tokens, *signature], dtype=torch.int64, device=device)
    everyone = mine.new_empty(world * mine.numel())
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(everyone, mine, group=group)
    rows = everyone.view(world, -1).tolist()
    if any(row[1:] != rows[0][1:] for row in rows):
        raise ValueError("expert-parallel ranks disagree on (hidden size, top-k, dtype, experts, dispatch): "
                         f"{[row[1:] for row in rows]}; every rank of an EP group must run the same model")
    return [row[0] for row in rows]


def chunk_bounds(max_tokens: int, chunk_tokens: int | None) -> list[tuple[int, int]]:
    """(start, stop) token ranges every rank of a group runs in turn (the same list on every rank)."""
    if max_tokens == 0:
        return [(0, 0)]
    step = max_tokens if not chunk_tokens else max(1, chunk_tokens)
    return [(start, min(start + step, max_tokens)) for start in range(0, max_tokens, step)]


def dispatch_experts(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    experts: nn.Module,
    *,
    group: dist.ProcessGroup | None,
    rank: int,
    world: int,
    expert_start: int,
    num_local_experts: int,
    dispatch: str = "allgather",
    grouped_mm: bool | None = None,
    chunk_tokens: int | None = None,
    record: dict | None = None,
    add_down_bias: bool = True,
) -> torch.Tensor:
    """(T, H) weighted expert outputs of this rank's tokens, with the experts spread over ``group``.

    ``experts`` holds the weights of experts ``[expert_start, expert_start + num_local_experts)``
    (``gate_up_proj``/``down_proj`` sliced on dim 0). ``chunk_tokens`` runs the tokens in chunks
    (every rank the same number of chunks), so the gathered rows of a long shard never exist at once.
    ``record``, if given, receives ``rows_per_expert``: the rows each local expert computed (for
    benchmarks: the same rows timed through a bare grouped GEMM). ``add_down_bias``: see
    :func:`~hf_longctx.moe.experts.expert_mlp` (False on all but one rank of an expert-TP group).
    """
    if dispatch not in DISPATCHES:
        raise ValueError(f"unknown dispatch {dispatch!r}; choose one of {DISPATCHES}")
    tokens, hidden = hidden_states.shape
    signature = [hidden, top_k_index.shape[1], DTYPE_CODES.get(hidden_states.dtype, 0), num_local_experts,
                 DISPATCHES.index(dispatch), int(chunk_tokens or 0)]
    counts = _group_token_counts(tokens, signature, group, world, hidden_states.device)
    pieces = []
    for start, stop in chunk_bounds(max(counts), chunk_tokens):
        mine = slice(min(start, tokens), min(stop, tokens))
        # all-to-all sends every pair somewhere; allgather on one rank holding every expert keeps them all
        all_local = dispatch == "all_to_all" or (world == 1 and num_local_experts == experts.num_experts)
        state = DispatchState(group, rank, world, expert_start, num_local_experts, max_tokens=stop - start,
                              all_local=all_local)
        x, ids, weights = hidden_states[mine], top_k_index[mine], top_k_weights[mine]
        if dispatch == "allgather":
            rows, pair_weights, link = _AllGatherDispatch.apply(x, weights, ids, state)
            counts = state.layout.expert_counts
            out = expert_mlp(rows, counts, experts, grouped_mm, add_down_bias)
            pieces.append(_AllGatherCombine.apply(out, pair_weights, link, state, x.dtype, x.shape[0]))
        else:
            rows, link = _AllToAllDispatch.apply(x, ids, state)
            counts = state.recv_counts
            out = expert_mlp(rows, counts, experts, grouped_mm, add_down_bias)
            pieces.append(_AllToAllCombine.apply(out, weights, link, state, x.dtype))
        if record is not None:
            record["rows_per_expert"] = record.get("rows_per_expert", 0) + counts.detach()
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
