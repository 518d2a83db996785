"""Which (token, slot) pairs go to a range of experts, in the two orders the expert path needs.

A router gives every token ``k`` (expert id, weight) slots. The experts of one rank only compute the
pairs whose expert falls in the rank's range, so the pairs are compacted first. Two orders matter:

* **expert order** - pairs grouped by local expert, the row layout a grouped GEMM takes (one
  contiguous block of rows per expert, described by cumulative offsets);
* **slot-major order** - all pairs of slot 0 (ascending token), then slot 1, and so on. Inside one
  slot a token appears at most once, so summing pair rows back into token rows slot by slot is an
  ``index_add_`` whose indices never repeat: no two additions race for one row, which keeps the sum
  deterministic on GPUs (where ``index_add_`` with repeated indices uses atomics) and fixes its
  order (slot 0 first) on every device.

:class:`PairLayout` holds both and the permutation between them. It reads two small things back to
the host (pair counts per slot, needed to cut the slot segments, and the pair total through
``nonzero``): one synchronisation per MoE layer, which the dropless compaction cannot avoid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PairLayout:
    """(token, slot) pairs routed to experts ``[expert_start, expert_start + num_local_experts)``.

    ``token_index`` and ``slot_index`` list the pairs in slot-major order; ``slot_counts[j]`` pairs
    belong to slot j. ``expert_order[i]`` is the slot-major position of the i-th pair in expert order;
    ``expert_counts[e]`` pairs go to local expert e.
    """

    token_index: torch.Tensor
    slot_index: torch.Tensor
    slot_counts: tuple[int, ...]
    expert_order: torch.Tensor
    expert_counts: torch.Tensor
    num_tokens: int
    top_k: int

    @property
    def num_pairs(self) -> int:
        return int(self.token_index.numel())

    def slot_segments(self):
        """(start, stop) of each slot's pairs in slot-major order (tokens unique inside each)."""
        start = 0
        for count in self.slot_counts:
            if count:
                yield start, start + count
            start += count

    def inverse_expert_order(self) -> torch.Tensor:
        """``inverse[slot_major_position]`` = position of that pair in expert order."""
        inverse = torch.empty_like(self.expert_order)
        inverse[self.expert_order] = torch.arange(self.num_pairs, device=self.expert_order.device)
        return inverse


def pair_layout(expert_ids: torch.Tensor, expert_start: int, num_local_experts: int) -> PairLayout:
    """Compact the pairs of ``expert_ids`` (tokens, k) whose expert is in ``[start, start + num_local)``.

    Ids outside the range (other ranks' experts, or -1 for padding rows) are left out.
    """
    if expert_ids.dim() != 2:
        raise ValueError(f"expert ids must be (tokens, top_k), got shape {tuple(expert_ids.shape)}")
    num_tokens, top_k = expert_ids.shape
    by_slot = expert_ids.t()  # (k, T): flattening it gives slot-major order
    selected = (by_slot >= expert_start) & (by_slot < expert_start + num_local_experts)
    flat = selected.reshape(-1).nonzero().squeeze(1)
    slot_counts = tuple(int(c) for c in selected.sum(dim=1).tolist())
    local_expert = by_slot.reshape(-1)[flat] - expert_start
    # stable: inside one expert, pairs keep slot-major order, so the layout is a pure function of the ids
    expert_order = torch.argsort(local_expert, stable=True)
    expert_counts = torch.bincount(local_expert, minlength=num_local_experts)
    return PairLayout(
        token_index=flat % max(num_tokens, 1),
        slot_index=flat // max(num_tokens, 1),
        slot_counts=slot_counts,
        expert_order=expert_order,
        expert_counts=expert_counts,
        num_tokens=num_tokens,
        top_k=top_k,
    )


def scatter_pairs_to_tokens(rows_slot_major: torch.Tensor, layout: PairLayout, dtype: torch.dtype) -> torch.Tensor:
    """(num_tokens, H) sums of pair rows per token in ``dtype``, slot by slot (deterministic; no autograd)."""
    out = rows_slot_major.new_zeros((layout.num_tokens, rows_slot_major.shape[-1]), dtype=dtype)
    for start, stop in layout.slot_segments():
        out.index_add_(0, layout.token_index[start:stop], rows_slot_major[start:stop].to(dtype))
    return out


def expert_load(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Pairs per expert (num_experts,) of a (tokens, k) routing; ids outside [0, num_experts) are ignored."""
    ids = expert_ids.reshape(-1)
    ids = ids[(ids >= 0) & (ids < num_experts)]
    return torch.bincount(ids, minlength=num_experts)
