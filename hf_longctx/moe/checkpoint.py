"""Expert shards in state dicts: merge the ranks' shards into full tensors, cut a full state dict into one.

An expert-parallel model's state dict has the keys of the unsharded model; each expert tensor holds
this rank's E/ep experts on dim 0 (and, with expert tensor parallelism, its slice of their
intermediate dimension). Saving every rank's state dict and merging them with
:func:`merge_expert_shards` gives the checkpoint of the unsharded model (transformers can load it
as usual); :func:`shard_state_dict` cuts a full state dict into what one rank's ``load_state_dict``
takes. :func:`gather_full_state_dict` does the merge with collectives instead of files.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .expert_tp import TensorSlice
from .layer import expert_parallel_modules


@dataclass(frozen=True)
class ExpertShard:
    """Rows ``[start, stop)`` of a tensor of ``num_experts`` experts on dim 0; ``ep_size`` shards make it whole.

    With expert tensor parallelism the rows are also cut along ``tp_slice`` (None: kept whole by
    every expert-TP rank) into ``tp_size`` pieces, of which this rank holds piece ``tp_rank``; the
    shards of a group are then ordered EP-major, expert-TP fastest.
    """

    start: int
    stop: int
    num_experts: int
    ep_size: int
    tp_rank: int = 0
    tp_size: int = 1
    tp_slice: TensorSlice | None = None

    @property
    def group_size(self) -> int:
        """How many ranks' shards make the tensor whole."""
        return self.ep_size * self.tp_size


def expert_shards(model: nn.Module) -> dict[str, ExpertShard]:
    """State-dict key -> shard of every sharded expert tensor of ``model``."""
    shards = {}
    for prefix, module in expert_parallel_modules(model):
        for name, _ in module.named_parameters(recurse=False):
            shards[f"{prefix}.{name}"] = ExpertShard(
                module.expert_start, module.expert_start + module.num_local_experts, module.num_experts_total,
                module.ep_size, module.expert_tp_rank, module.expert_tp_size, module.expert_tp_slices.get(name))
    return shards


def merge_shard(pieces: Sequence[torch.Tensor], shard: ExpertShard, key: str = "tensor") -> torch.Tensor:
    """One whole expert tensor from the pieces of every rank of its group, in group-rank order."""
    if len(pieces) != shard.group_size:
        raise ValueError(f"{key} is split over {shard.ep_size} EP x {shard.tp_size} expert-TP ranks but "
                         f"{len(pieces)} shards were given")
    by_ep = []
    for ep_rank in range(shard.ep_size):
        mine = list(pieces[ep_rank * shard.tp_size : (ep_rank + 1) * shard.tp_size])
        by_ep.append(shard.tp_slice.join(mine) if shard.tp_slice is not None else mine[0])
    merged = torch.cat(by_ep, dim=0)
    if merged.shape[0] != shard.num_experts:
        raise ValueError(f"merged {key} has {merged.shape[0]} experts, expected {shard.num_experts}")
    return merged


def merge_expert_shards(shard_state_dicts: Sequence[Mapping[str, torch.Tensor]],
                        shards: Mapping[str, ExpertShard]) -> dict[str, torch.Tensor]:
    """Full state dict from the state dicts of the ranks of ONE expert group, in group-rank order.

    The group is the one :func:`~hf_longctx.moe.apply_expert_parallel` was given (EP-major,
    expert-TP fastest). Expert tensors are put back together; every other tensor is replicated and
    taken from the first shard. ``shards`` is :func:`expert_shards` of any rank's model.
    """
    if not shard_state_dicts:
        raise ValueError("no shards to merge")
    first = shard_state_dicts[0]
    merged = {}
    for key, value in first.items():
        shard = shards.get(key)
        merged[key] = value if shard is None else merge_shard([sd[key] for sd in shard_state_dicts], shard, key)
    return merged


def shard_state_dict(full_state_dict: Mapping[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's view of an unsharded state dict: expert tensors cut to the part ``model`` holds."""
    shards = expert_shards(model)
    out = {}
    for key, value in full_state_dict.items():
        shard = shards.get(key)
        if shard is not None:
            if value.shape[0] != shard.num_experts:
                raise ValueError(f"{key} has {value.shape[0]} experts in the state dict, the model {shard.num_experts}")
            value = value[shard.start : shard.stop]
            if shard.tp_slice is not None:
                value = shard.tp_slice.cut(value, shard.tp_rank)
        out[key] = value
    return out


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict on every rank: expert tensors all-gathered over their groups (collective)."""
    state = model.state_dict()
    shards = expert_shards(model)
    for prefix, module in expert_parallel_modules(model):
        for name, param in module.named_parameters(recurse=False):
            key = f"{prefix}.{name}"
            state[key] = merge_shard(gather_pieces(param.detach(), module), shards[key], key)
    return state


def gather_pieces(local: torch.Tensor, module: nn.Module) -> list[torch.Tensor]:
    """Every rank's ``local`` tensor of ``module``'s expert group, in group-rank order (collective)."""
    local = local.contiguous()
    if module.group_size == 1:
        return [local]
    full = local.new_empty((module.group_size * local.shape[0], *local.shape[1:]))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(full, local, group=module.group)
    return list(full.chunk(module.group_size))
