"""Mixture-of-experts training: allgather expert parallelism over transformers' own MoE blocks.

``apply_expert_parallel(model, ep_group)`` keeps each rank's slice of every MoE block's experts and
runs them through allgather (or all-to-all) dispatch with grouped GEMMs, optionally with each expert's
intermediate dimension split over expert-TP ranks (``expert_tp_size``); router, shared experts and
router-logit outputs stay transformers' own, state-dict keys do not change. Around it: expert
gradients kept out of DDP and averaged over their replicas, the batch-exact load-balancing loss,
and merging/cutting of expert shards in state dicts. Process groups: :mod:`hf_longctx.comm.mesh`.
"""

from .aux_loss import DistributedAuxLoss, enable_distributed_aux_loss, installed_aux_loss
from .checkpoint import (
    expert_shards,
    gather_full_state_dict,
    gather_pieces,
    merge_expert_shards,
    merge_shard,
    shard_state_dict,
)
from .expert_tp import expert_tp_slices
from .experts import expert_mlp_flops
from .grads import all_reduce_expert_grads, clip_grad_norm_, ignore_expert_params_in_ddp
from .layer import ExpertParallelExperts, apply_expert_parallel, find_experts_modules
from .routing import expert_load, pair_layout

__all__ = [
    "DistributedAuxLoss",
    "ExpertParallelExperts",
    "all_reduce_expert_grads",
    "apply_expert_parallel",
    "clip_grad_norm_",
    "enable_distributed_aux_loss",
    "expert_load",
    "expert_mlp_flops",
    "expert_shards",
    "expert_tp_slices",
    "find_experts_modules",
    "gather_full_state_dict",
    "gather_pieces",
    "ignore_expert_params_in_ddp",
    "installed_aux_loss",
    "merge_expert_shards",
    "merge_shard",
    "pair_layout",
    "shard_state_dict",
]
