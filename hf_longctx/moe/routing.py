"""Which (token, slot) pairs go to a range of experts, and where each one's row lives.

A router gives every token ``k`` (expert id, weight) slots. The experts of one rank only compute the
pairs whose expert falls in the rank's range, so the pairs are compacted into **expert order**: one
contiguous block of rows per local expert (the layout a grouped GEMM takes, described by
cumulative counts), and inside an expert by ascending token. The way back is the **pair table**:
``pair_table[t, j]`` is the row of pair (t, j) in expert order, or -1 where slot j of token t goes
to another rank's expert. Summing a token's pair rows through the table slot by slot touches each
token row once, with no index repeated, so the sum is deterministic on GPUs (no atomics) and its
order is fixed (slot 0 first) on every device (:func:`~hf_longctx.moe.row_ops.pair_sum`).

Compaction reads one number back to the host, the pair count (through ``nonzero``): the size of the
rows the GEMMs run, which dropless routing cannot know in advance. When the range holds every expert
and no id is out of range (one rank with all experts), every pair is local and nothing is read back;
an out-of-range id then fails a device-side assertion instead of being dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PairLayout:
    """(token, slot) pairs routed to experts ``[expert_start, expert_start + num_local_experts)``, in expert order.

    ``token_index[p]`` and ``slot_index[p]`` name the p-th pair, ``flat_index[p]`` = token * top_k + slot
    its position in a flattened (tokens, k) routing tensor; ``expert_counts[e]`` pairs go to local
    expert e; ``pair_table`` (num_tokens, top_k) maps each (token, slot) back to its pair, or -1.
    """

    token_index: torch.Tensor
    slot_index: torch.Tensor
    flat_index: torch.Tensor
    expert_counts: torch.Tensor
    pair_table: torch.Tensor
    num_tokens: int
    top_k: int

    @property
    def num_pairs(self) -> int:
        return int(self.token_index.numel())

    def scatter_to_slots(self, pair_values: torch.Tensor) -> torch.Tensor:
        """(num_tokens, top_k) tensor holding each pair's value at its (token, slot), zeros elsewhere."""
        out = pair_values.new_zeros(self.num_tokens * self.top_k)
        out[self.flat_index] = pair_values
        return out.view(self.num_tokens, self.top_k)


def pair_layout(expert_ids: torch.Tensor, expert_start: int, num_local_experts: int, *,
                all_local: bool = False) -> PairLayout:
    """Compact the pairs of ``expert_ids`` (tokens, k) whose expert is in ``[start, start + num_local)``.

    Ids outside the range (other ranks' experts, or -1 for padding rows) are left out. ``all_local``
    promises every id is in range (one rank holding all experts): then no count is read back to the
    host, and a broken promise fails a device-side assertion.
    """
    if expert_ids.dim() != 2:
        raise ValueError(f"expert ids must be (tokens, top_k), got shape {tuple(expert_ids.shape)}")
    num_tokens, top_k = expert_ids.shape
    local = expert_ids.reshape(-1).long() - expert_start
    in_range = (local >= 0) & (local < num_local_experts)
    if all_local:
        if local.numel():
            torch._assert_async(in_range.all(), "an expert id is outside [0, num_experts)")
        positions = torch.arange(local.numel(), device=local.device)
    else:
        positions = in_range.nonzero().squeeze(1)
        local = local[positions]
    # stable: inside one expert, pairs keep ascending (token, slot) order, so the layout is a pure function of the ids
    order = torch.argsort(local, stable=True)
    positions = positions[order]
    expert_counts = torch.zeros(num_local_experts, dtype=torch.int64, device=local.device)
    expert_counts.scatter_add_(0, local, torch.ones_like(local))
    table = torch.full((num_tokens * top_k,), -1, dtype=torch.int64, device=local.device)
    table[positions] = torch.arange(positions.numel(), device=local.device)
    return PairLayout(
        token_index=positions // top_k,
        slot_index=positions % top_k,
        flat_index=positions,
        expert_counts=expert_counts,
        pair_table=table.view(num_tokens, top_k),
        num_tokens=num_tokens,
        top_k=top_k,
    )


def expert_load(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Pairs per expert (num_experts,) of a (tokens, k) routing; ids outside [0, num_experts) are ignored."""
    ids = expert_ids.reshape(-1)
    ids = ids[(ids >= 0) & (ids < num_experts)]
    return torch.bincount(ids, minlength=num_experts)
