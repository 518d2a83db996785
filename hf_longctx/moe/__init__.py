"""Mixture-of-experts training: allgather expert parallelism over transformers' own MoE blocks.

``apply_expert_parallel(model, ep_group)`` keeps each rank's slice of every MoE block's experts and
runs them through allgather (or all-to-all) dispatch with grouped GEMMs; router, shared experts and
router-logit outputs stay transformers' own, state-dict keys do not change.
"""

from .dispatch import DISPATCHES, dispatch_experts, moe_comm_stats, reset_moe_comm_stats
from .experts import expert_mlp, expert_mlp_flops
from .layer import ExpertParallelExperts, apply_expert_parallel, find_experts_modules
from .routing import PairLayout, expert_load, pair_layout

__all__ = [
    "DISPATCHES",
    "ExpertParallelExperts",
    "PairLayout",
    "apply_expert_parallel",
    "dispatch_experts",
    "expert_load",
    "expert_mlp",
    "expert_mlp_flops",
    "find_experts_modules",
    "moe_comm_stats",
    "pair_layout",
    "reset_moe_comm_stats",
]
