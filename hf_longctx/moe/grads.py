"""Gradients of sharded experts: kept out of DDP, averaged over their own replicas only.

Why. After :func:`~hf_longctx.moe.apply_expert_parallel`, the tensor named
``layers.0.mlp.experts.gate_up_proj`` holds different experts on different ranks of an EP group. DDP
would average it with the other ranks' tensors of the same name (other experts), and at construction
it would overwrite every rank's slice with rank 0's. So DDP must ignore these parameters
(:func:`ignore_expert_params_in_ddp`), and their gradients are reduced over the expert-data-parallel
group instead: the ranks that hold the SAME experts (one per EP group)
(:func:`all_reduce_expert_grads`).

Scaling. The token gradients reaching an expert already cover every rank of its EP group (the
dispatch backward sums them), so summing over the replicas covers every rank of the world exactly
once. DDP divides the dense gradients by the number of ranks it averages over; dividing the expert
sums by the same number keeps both kinds of parameters on one scale (Megatron scales its expert
gradients the same way). That number is the world size (ranks of a tensor-parallel group compute
the same tokens, and their copies of an expert's gradient add up to tp times the sum).

Expert tensor parallelism. Each expert-TP rank holds its own intermediate slice of an expert, so
the replicas are still one per MoE group (same EP rank, same expert-TP rank); only
``down_proj_bias``, kept whole on every expert-TP rank and added by rank 0 of them, is first summed
over the expert-TP group (the other ranks contribute zeros).

Clipping. ``torch.nn.utils.clip_grad_norm_`` (and Trainer's ``max_grad_norm``) would measure each
rank's own expert slices only: ranks would clip by different factors and their replicated
parameters would drift apart. :func:`clip_grad_norm_` adds the expert norms of the whole expert group
(ep x expert_tp ranks).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..comm.groups import group_rank_and_size
from .layer import expert_parallel_modules


def expert_parameter_names(model: nn.Module) -> list[str]:
    """Qualified names (as in ``model.named_parameters()``) of the sharded expert parameters."""
    names = []
    for prefix, module in expert_parallel_modules(model):
        names += [f"{prefix}.{name}" for name, p in module.named_parameters(recurse=False)]
    return names


def ignore_expert_params_in_ddp(model: nn.Module) -> list[str]:
    """Tell DDP (and accelerate's DDP wrapping) to leave the sharded expert parameters alone.

    Sets ``model._ddp_params_and_buffers_to_ignore`` (kept names plus the expert ones), which
    ``DistributedDataParallel`` reads when it wraps ``model``: call this before wrapping. Returns the
    names now ignored.
    """
    names = sorted(set(getattr(model, "_ddp_params_and_buffers_to_ignore", ())) | set(expert_parameter_names(model)))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
    return names


def all_reduce_expert_grads(model: nn.Module, expert_dp_group: dist.ProcessGroup | None,
                            divide_by: int | None = None, expert_tp_group: dist.ProcessGroup | None = None) -> None:
    """Sum every sharded expert gradient over ``expert_dp_group``, then divide by ``divide_by``.

    ``expert_dp_group``: the ranks holding the same expert slices (``ParallelGroups.expert_dp``).
    ``divide_by`` defaults to the world size, matching DDP's averaging of the dense gradients (see
    the module docstring); pass 1 for plain sums. With expert tensor parallelism, ``expert_tp_group``
    (``ParallelGroups.expert_tp``) is required: the parameters every expert-TP rank keeps whole
    (``down_proj_bias``, added by expert-TP rank 0 only) are first summed over it. Call it after
    backward and before the optimizer step, on every rank. A parameter without a gradient (its
    experts got no tokens anywhere in the step) joins with zeros, so ranks never disagree on the
    collective.
    """
    divisor = divide_by if divide_by is not None else (dist.get_world_size() if dist.is_initialized() else 1)
    _, replicas = group_rank_and_size(expert_dp_group)
    modules = [m for _, m in expert_parallel_modules(model)]
    params = [p for m in modules for p in m.parameters(recurse=False) if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    tp_whole = [getattr(m, name) for m in modules if m.expert_tp_size > 1 for name in m.expert_tp_replicated()]
    tp_whole = [p for p in tp_whole if p.requires_grad]
    if tp_whole:
        tp_sizes = {m.expert_tp_size for m in modules}
        if expert_tp_group is None or group_rank_and_size(expert_tp_group)[1] not in tp_sizes:
            raise ValueError(f"the experts are split over expert-TP groups of {sorted(tp_sizes)} ranks: pass their "
                             "group as expert_tp_group (ParallelGroups.expert_tp)")
        _all_reduce_flat(tp_whole, expert_tp_group, 1)
    if replicas == 1 and divisor == 1:
        return
    _all_reduce_flat(params, expert_dp_group if replicas > 1 else None, divisor)


def _all_reduce_flat(params: list[nn.Parameter], group: dist.ProcessGroup | None, divisor: int) -> None:
    """Sum the gradients of ``params`` over ``group`` (None: no collective), one collective per dtype; divide."""
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    for group_params in by_dtype.values():
        flat = torch.cat([p.grad.reshape(-1) for p in group_params])
        if group is not None:
            dist.all_reduce(flat, group=group)
        if divisor != 1:
            flat.div_(divisor)
        offset = 0
        for p in group_params:
            n = p.grad.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip all gradients by their total 2-norm over the whole model, expert shards of the expert group included.

    Call it after :func:`all_reduce_expert_grads` (every replica then holds the same expert gradients),
    on every rank. Dense gradients are replicated (tensor-parallel DTensor shards are gathered into the
    norm); each expert slice is counted once, through a sum of squares over the expert group (ep x expert_tp
    ranks, ``ParallelGroups.moe``). Returns the
    total norm, the same on every rank.
    """
    modules = [m for _, m in expert_parallel_modules(model)]
    groups = {id(m.group): m.group for m in modules if m.group_size > 1}
    if len(groups) > 1:
        raise ValueError("the model's expert modules use different expert groups; clip them group by group")
    experts = {id(p) for m in modules for p in m.parameters(recurse=False)}
    # kept whole on every expert-TP rank: counted on expert-TP rank 0 only
    skipped = {id(getattr(m, name).grad) for m in modules if m.expert_tp_rank > 0 for name in m.expert_tp_replicated()}
    grads = [(p.grad, id(p) in experts) for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros(())
    device = grads[0][0].device
    dense_sq = torch.zeros((), dtype=torch.float64, device=device)
    expert_sq = torch.zeros((), dtype=torch.float64, device=device)
    for grad, is_expert in grads:
        if id(grad) in skipped:
            continue
        sq = torch.linalg.vector_norm(grad, dtype=torch.float64) ** 2
        if hasattr(sq, "full_tensor"):  # a tensor-parallel DTensor: the norm of the whole tensor
            sq = sq.full_tensor()
        if is_expert:
            expert_sq += sq
        else:
            dense_sq += sq
    if groups:
        dist.all_reduce(expert_sq, group=next(iter(groups.values())))
    total = (dense_sq + expert_sq).sqrt()
    if math.isinf(max_norm):  # measuring only: no pass over the gradients
        return total
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for grad, _ in grads:
        grad.mul_(coef.to(grad.dtype))
    return total
