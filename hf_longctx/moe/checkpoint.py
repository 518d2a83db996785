"""Expert shards in state dicts: merge the ranks' shards into full tensors, cut a full state dict into one.

An expert-parallel model's state dict has the keys of the unsharded model; each expert tensor holds
this rank's E/ep experts on dim 0. Saving every rank's state dict and merging them with
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

from .layer import expert_parallel_modules


@dataclass(frozen=True)
class ExpertShard:
    """Rows ``[start, stop)`` of a tensor of ``num_experts`` experts on dim 0; ``ep_size`` shards make it whole."""

    start: int
    stop: int
    num_experts: int
    ep_size: int


def expert_shards(model: nn.Module) -> dict[str, ExpertShard]:
    """State-dict key -> shard of every sharded expert tensor of ``model``."""
    shards = {}
    for prefix, module in expert_parallel_modules(model):
        shard = ExpertShard(module.expert_start, module.expert_start + module.num_local_experts,
                            module.num_experts_total, module.ep_size)
        for name, _ in module.named_parameters(recurse=False):
            shards[f"{prefix}.{name}"] = shard
    return shards


def merge_expert_shards(shard_state_dicts: Sequence[Mapping[str, torch.Tensor]],
                        shards: Mapping[str, ExpertShard]) -> dict[str, torch.Tensor]:
    """Full state dict from the state dicts of the ranks of ONE EP group, in EP-rank order.

    Expert tensors are concatenated on dim 0; every other tensor is replicated and taken from the
    first shard. ``shards`` is :func:`expert_shards` of any rank's model.
    """
    if not shard_state_dicts:
        raise ValueError("no shards to merge")
    first = shard_state_dicts[0]
    merged = {}
    for key, value in first.items():
        shard = shards.get(key)
        if shard is None:
            merged[key] = value
            continue
        if len(shard_state_dicts) != shard.ep_size:
            raise ValueError(f"{key} is split over {shard.ep_size} ranks but {len(shard_state_dicts)} shards "
                             "were given")
        merged[key] = torch.cat([sd[key] for sd in shard_state_dicts], dim=0)
        if merged[key].shape[0] != shard.num_experts:
            raise ValueError(f"merged {key} has {merged[key].shape[0]} experts, expected {shard.num_experts}")
    return merged


def shard_state_dict(full_state_dict: Mapping[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's view of an unsharded state dict: expert tensors cut to the rows ``model`` holds."""
    shards = expert_shards(model)
    out = {}
    for key, value in full_state_dict.items():
        shard = shards.get(key)
        if shard is not None:
            if value.shape[0] != shard.num_experts:
                raise ValueError(f"{key} has {value.shape[0]} experts in the state dict, the model {shard.num_experts}")
            value = value[shard.start : shard.stop]
        out[key] = value
    return out


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict on every rank: expert tensors all-gathered over their EP groups (collective)."""
    state = model.state_dict()
    modules = dict(expert_parallel_modules(model))
    for prefix, module in modules.items():
        for name, param in module.named_parameters(recurse=False):
            local = param.detach().contiguous()
            full = local.new_empty((module.ep_size * local.shape[0], *local.shape[1:]))
            if module.ep_size > 1:
                gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
                gather(full, local, group=module.group)
            else:
                full.copy_(local)
            state[f"{prefix}.{name}"] = full
    return state
