"""Process groups of a run that combines data, sequence, tensor (head) and expert parallelism.

Layout. The world is a (dp, sp, tp) DeviceMesh, tp fastest: the ranks of a tensor-parallel group
hold the same tokens and split the attention heads; the ranks of a sequence-parallel row split one
packed sequence; data-parallel rows train on different sequences. Experts are token-local, so expert
parallelism only needs ranks with DIFFERENT tokens: an EP group is ``ep`` consecutive ranks of the
flattened (dp, sp) order at one tp position (a sequence shard is just more local tokens). The ranks
holding the same experts (the same position in their EP groups, same tp position) form the
expert-data-parallel group over which expert gradients are averaged.

Expert tensor parallelism (``expert_tp_size`` t, optional) splits each expert's intermediate
dimension over t more ranks with different tokens: the expert group (``moe``, what
:func:`~hf_longctx.moe.apply_expert_parallel` takes) is then ep x t consecutive token ranks,
expert-TP fastest; ``expert_tp`` holds the t ranks of one EP rank, ``ep`` the ranks of one expert-TP
rank, and ``expert_dp`` the ranks holding the same (experts, slice). It is a separate axis from the
attention's tp: tensor-parallel attention ranks hold the same tokens, and gathering them into one
expert group would compute each token t times. With t = 1, ``moe`` is ``ep``.
Example, 8 ranks, sp=2, tp=2, ep=2:

    mesh (dp, sp, tp)   [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    sp groups           {0,2} {1,3} {4,6} {5,7}      tp groups {0,1} {2,3} {4,5} {6,7}
    ep groups           {0,2} {1,3} {4,6} {5,7}      expert-dp {0,4} {2,6} {1,5} {3,7}
    batch groups        {0,2,4,6} {1,3,5,7}          (ranks whose tokens make up one step's batch)

The same 8 ranks with tp=1, ep=2, expert_tp_size=2: moe {0,1,2,3} {4,5,6,7}, expert_tp {0,1} {2,3}
{4,5} {6,7}, ep {0,2} {1,3} {4,6} {5,7}, expert-dp {0,4} {1,5} {2,6} {3,7}.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import cache

import torch
import torch.distributed as dist

from .groups import clear_with_groups, mesh_device_type, remember_mesh, sequence_parallel_override


def check_parallel_sizes(world_size: int, sp_size: int = 1, tp_size: int = 1, ep_size: int = 1,
                         num_experts: int | None = None, num_heads: int | None = None,
                         num_kv_heads: int | None = None, expert_tp_size: int = 1,
                         expert_intermediate_size: int | None = None) -> int:
    """Raise a ValueError naming the fix if the sizes do not fit the world or the model; returns dp."""
    for name, value in (("sp_size", sp_size), ("tp_size", tp_size), ("ep_size", ep_size),
                        ("expert_tp_size", expert_tp_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    if world_size % (sp_size * tp_size):
        raise ValueError(f"sp_size x tp_size = {sp_size} x {tp_size} does not divide the {world_size} processes; "
                         f"their product must be one of {divisors}")
    token_ranks = world_size // tp_size  # ranks holding different tokens, at one tensor-parallel position
    if token_ranks % ep_size:
        raise ValueError(f"ep_size {ep_size} must divide the {token_ranks} ranks with different tokens "
                         f"(world {world_size} / tp_size {tp_size}); pick one of "
                         f"{[d for d in range(1, token_ranks + 1) if token_ranks % d == 0]}")
    moe_ranks = ep_size * expert_tp_size
    if token_ranks % moe_ranks:
        raise ValueError(f"ep_size x expert_tp_size = {ep_size} x {expert_tp_size} must divide the {token_ranks} "
                         f"ranks with different tokens (world {world_size} / tp_size {tp_size}); their product must "
                         f"be one of {[d for d in range(1, token_ranks + 1) if token_ranks % d == 0]}")
    if expert_intermediate_size is not None and expert_intermediate_size % expert_tp_size:
        raise ValueError(f"expert_tp_size {expert_tp_size} does not divide the experts' intermediate size "
                         f"{expert_intermediate_size}; pick one of "
                         f"{[d for d in range(1, expert_intermediate_size + 1) if expert_intermediate_size % d == 0]}")
    if num_experts is not None and num_experts % ep_size:
        expert_ranks = token_ranks // expert_tp_size
        fits = [d for d in range(1, num_experts + 1) if num_experts % d == 0 and expert_ranks % d == 0]
        raise ValueError(f"ep_size {ep_size} does not divide the model's {num_experts} experts; pick one of {fits}")
    for what, heads in (("attention heads", num_heads), ("key/value heads", num_kv_heads)):
        if heads is not None and heads % tp_size:
            raise ValueError(f"tp_size {tp_size} does not split the model's {heads} {what} evenly; heads must "
                             f"split over the tensor-parallel ranks")
    return world_size // (sp_size * tp_size)


@dataclass(frozen=True)
class ParallelGroups:
    """The groups of this rank (see the module docstring), with the meshes they come from."""

    mesh: object  # DeviceMesh ("dp", "sp", "tp")
    dp_size: int
    sp_size: int
    tp_size: int
    ep_size: int
    expert_tp_size: int
    dp: dist.ProcessGroup
    sp: dist.ProcessGroup
    tp: dist.ProcessGroup
    ep: dist.ProcessGroup
    expert_tp: dist.ProcessGroup
    moe: dist.ProcessGroup
    expert_dp: dist.ProcessGroup
    batch: dist.ProcessGroup

    @property
    def tp_mesh(self):
        """1-D tensor-parallel DeviceMesh, the one transformers' tensor-parallel styles take."""
        return self.mesh["tp"]


@cache
def _groups(world: int, sp: int, tp: int, ep: int, etp: int, device_type: str) -> ParallelGroups:
    from torch.distributed.device_mesh import DeviceMesh

    dp = world // (sp * tp)
    edp = world // (tp * ep * etp)
    ranks = torch.arange(world)
    # the "sp" groups on high-priority NCCL streams, as sequence_parallel_mesh makes them (see its override)
    override = sequence_parallel_override(device_type, sp, world) \
        if "backend_override" in inspect.signature(DeviceMesh).parameters else None
    mesh = remember_mesh(DeviceMesh(device_type, ranks.view(dp, sp, tp), mesh_dim_names=("dp", "sp", "tp"),
                                    **({"backend_override": ((None, None), override["sp"], (None, None))}
                                       if override else {})))
    expert_mesh = remember_mesh(DeviceMesh(device_type, ranks.view(edp, ep, etp, tp),
                                           mesh_dim_names=("edp", "ep", "etp", "tp")))
    moe_mesh = remember_mesh(DeviceMesh(device_type, ranks.view(edp, ep * etp, tp),
                                        mesh_dim_names=("edp", "moe", "tp")))
    batch_mesh = remember_mesh(DeviceMesh(device_type, ranks.view(world // tp, tp), mesh_dim_names=("batch", "tp")))
    return ParallelGroups(mesh, dp, sp, tp, ep, etp, dp=mesh.get_group("dp"), sp=mesh.get_group("sp"),
                          tp=mesh.get_group("tp"), ep=expert_mesh.get_group("ep"),
                          expert_tp=expert_mesh.get_group("etp"), moe=moe_mesh.get_group("moe"),
                          expert_dp=expert_mesh.get_group("edp"), batch=batch_mesh.get_group("batch"))


clear_with_groups(_groups.cache_clear)


def parallel_groups(sp_size: int = 1, tp_size: int = 1, ep_size: int = 1, expert_tp_size: int = 1) -> ParallelGroups:
    """The (dp, sp, tp) mesh and expert groups of the initialised world; every rank must call it alike."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("torch.distributed is not initialised; launch with accelerate/torchrun first")
    world = dist.get_world_size()
    check_parallel_sizes(world, sp_size, tp_size, ep_size, expert_tp_size=expert_tp_size)
    return _groups(world, sp_size, tp_size, ep_size, expert_tp_size, mesh_device_type())
