"""Expert tensor parallelism: which part of each expert tensor an expert-TP rank keeps.

An expert MLP is ``down(act(gate(x)) * up(x))``; its intermediate dimension I is independent per
column, so t ranks can each keep 1/t of it: rank j keeps columns ``[j I/t, (j + 1) I/t)`` of the
gate AND of the up projection, the matching I rows of ``down_proj``, and its partial outputs sum to
the expert's output. Where those columns sit depends on the model's fused layout, read from the
experts module (transformers' ``use_experts_implementation`` flags):

* ``gate_up_proj`` (E, 2I, H), or (E, H, 2I) when ``is_transposed`` (GPT-OSS). Concatenated
  ``[gate; up]`` (``is_concatenated``, the default: Qwen2/3-MoE, Mixtral, OLMoE) keeps the slice of
  each half, stored again as ``[gate slice; up slice]`` so the module's own ``_apply_gate``
  (``chunk(2)``) still splits it right; interleaved ``[g0, u0, g1, u1, ...]`` (GPT-OSS) keeps the
  contiguous run ``[2 j I/t, 2 (j + 1) I/t)``, still interleaved.
* ``gate_up_proj_bias`` (E, 2I): as the 2I axis of ``gate_up_proj``.
* ``down_proj`` (E, H, I), or (E, I, H) transposed: the contiguous slice of I.
* ``down_proj_bias`` (E, H): not split; every expert-TP rank keeps it whole and only one adds it.

:class:`TensorSlice` names the kept positions along one dimension, so the same description slices a
parameter, cuts a full checkpoint tensor and puts shards back together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class TensorSlice:
    """Positions ``positions(rank)`` along ``dim`` (of ``full_size``) that expert-TP rank ``rank`` of ``size`` keeps.

    ``halves``: the dimension is two concatenated halves (gate, up), each cut into ``size`` pieces;
    otherwise one contiguous piece per rank.
    """

    dim: int
    full_size: int
    size: int
    halves: bool

    def positions(self, rank: int) -> torch.Tensor:
        if self.halves:
            half, piece = self.full_size // 2, self.full_size // (2 * self.size)
            first = torch.arange(rank * piece, (rank + 1) * piece)
            return torch.cat([first, first + half])
        piece = self.full_size // self.size
        return torch.arange(rank * piece, (rank + 1) * piece)

    def cut(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s piece of a tensor that is whole along ``dim``."""
        return full.index_select(self.dim, self.positions(rank).to(full.device))

    def join(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The whole tensor from the pieces of ranks 0 .. size-1 (inverse of :meth:`cut`)."""
        if len(pieces) != self.size:
            raise ValueError(f"a tensor split over {self.size} expert-TP ranks needs {self.size} pieces, "
                             f"got {len(pieces)}")
        shape = list(pieces[0].shape)
        shape[self.dim] = self.full_size
        full = pieces[0].new_empty(shape)
        for rank, piece in enumerate(pieces):
            full.index_copy_(self.dim, self.positions(rank).to(full.device), piece)
        return full


def intermediate_size(experts: nn.Module) -> int:
    """The experts' intermediate size I, from ``down_proj`` (E, H, I) or its transpose (E, I, H)."""
    transposed = bool(getattr(experts, "is_transposed", False))
    return experts.down_proj.shape[1] if transposed else experts.down_proj.shape[2]


def expert_tp_slices(experts: nn.Module, tp_size: int) -> dict[str, TensorSlice | None]:
    """Parameter name -> how expert-TP splits it (None: kept whole on every expert-TP rank).

    Raises if the module has a parameter whose split is unknown, or if ``tp_size`` does not divide
    the intermediate size.
    """
    if not getattr(experts, "has_gate", True):
        raise ValueError(f"{type(experts).__name__} has no fused gate_up_proj; expert tensor parallelism covers "
                         "gated experts (Qwen2/3-MoE, Mixtral, OLMoE, GPT-OSS)")
    inter = intermediate_size(experts)
    if inter % tp_size:
        raise ValueError(f"expert_tp_size {tp_size} does not divide the experts' intermediate size {inter}; pick one "
                         f"of {[d for d in range(1, inter + 1) if inter % d == 0]}")
    transposed = bool(getattr(experts, "is_transposed", False))
    halves = bool(getattr(experts, "is_concatenated", True))
    gate_up = TensorSlice(2 if transposed else 1, 2 * inter, tp_size, halves)
    known = {
        "gate_up_proj": gate_up,
        "gate_up_proj_bias": TensorSlice(1, 2 * inter, tp_size, halves),
        "down_proj": TensorSlice(1 if transposed else 2, inter, tp_size, False),
        "down_proj_bias": None,
    }
    slices = {}
    for name, param in experts.named_parameters(recurse=False):
        if name not in known:
            raise ValueError(f"{type(experts).__name__} has an expert parameter {name!r} that expert tensor "
                             f"parallelism does not know how to split (it splits {sorted(known)})")
        slices[name] = known[name]
        if known[name] is not None and param.shape[known[name].dim] != known[name].full_size:
            raise ValueError(f"{name} of {type(experts).__name__} has shape {tuple(param.shape)}; expected "
                             f"{known[name].full_size} on dim {known[name].dim}")
    return slices
