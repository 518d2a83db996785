"""``apply_model_parallelism``: a recipe's tp_size / ep_size / moe_dispatch / expert_tp_size applied to a model.

One call after building (or loading) the model and before the Trainer, the optimizer or DDP exist,
on every rank alike. From the run's :class:`~hf_longctx.hf.settings.schema.LongContextConfig` it builds the
process groups of :func:`~hf_longctx.comm.mesh.parallel_groups` and:

* splits the attention heads over the tensor-parallel group (``tp_size``, transformers' own plan,
  :mod:`~hf_longctx.hf.parallel.heads`);
* shards the experts of every MoE block over the expert group (``ep_size`` x ``expert_tp_size``
  ranks, ``moe_dispatch``, :func:`~hf_longctx.moe.apply_expert_parallel`), tells DDP to leave the
  expert slices alone and installs :class:`ExpertGradSync`;
* makes a MoE model add the batch-exact load-balancing loss (:mod:`~hf_longctx.moe.aux_loss`)
  whenever several processes share the batch, with or without expert parallelism.

Why a gradient hook. DDP averages the dense gradients inside backward; the expert gradients must
be averaged over their own replicas before anything reads them, and transformers' Trainer clips
(and logs the norm) right after backward, before any callback runs. So at the end of every backward
that ends a gradient-accumulation cycle (accelerate's ``sync_gradients``, as DDP's own reduction),
:class:`ExpertGradSync` sums the expert gradients over their replicas and divides by the world
size. The Trainer's clipping would measure each rank's own expert slices (different norms, so
different clip factors, on ranks whose dense weights must stay equal): :class:`LongContextCallback`
hands ``max_grad_norm`` to the hook, which clips by the norm of the whole model
(:func:`~hf_longctx.moe.clip_grad_norm_`) and reports it in the logs as ``grad_norm``.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..settings.schema import LongContextConfig
from ..settings.sources import load_config

# what apply_model_parallelism did to each model (read by the callback); kept beside the model, not on it,
# so deepcopy / pickling of the model never meets process groups
_APPLIED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def accelerate_sync_gradients() -> bool:
    """Whether this backward ends a gradient-accumulation cycle (accelerate's flag; True outside accelerate)."""
    try:
        from accelerate.state import GradientState
    except ImportError:
        return True
    if not GradientState._shared_state:
        return True
    return bool(GradientState().sync_gradients)


class ExpertGradSync:
    """At the end of each synchronising backward: expert gradients averaged over replicas, then optionally clipped.

    A forward hook on ``model`` puts a gradient hook on the output's loss (or logits); the first time it
    fires in a backward it queues the reduction to run when that backward has finished, after DDP's
    own end-of-backward averaging (the clip must see the averaged dense gradients). ``should_sync``
    says whether the backward ends an accumulation cycle (default: accelerate's flag). ``max_grad_norm``
    (None: off) clips every gradient by the norm of the whole model; ``last_norm`` keeps that norm.
    """

    def __init__(self, model: nn.Module, expert_dp_group: dist.ProcessGroup | None,
                 expert_tp_group: dist.ProcessGroup | None = None,
                 should_sync: Callable[[], bool] = accelerate_sync_gradients, max_grad_norm: float | None = None):
        self.model, self.expert_dp_group, self.expert_tp_group = model, expert_dp_group, expert_tp_group
        self.should_sync, self.max_grad_norm = should_sync, max_grad_norm
        self.last_norm: torch.Tensor | None = None
        self.syncs = 0
        self._queued = False
        self.handle = model.register_forward_hook(self._attach)

    def _attach(self, module, args, output) -> None:
        if not torch.is_grad_enabled():
            return
        candidates = [getattr(output, "loss", None), getattr(output, "logits", None)]
        if isinstance(output, (tuple, list)) and output:
            candidates.append(output[0])
        anchor = next((t for t in candidates if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if anchor is not None:
            anchor.register_hook(self._on_grad)

    def _on_grad(self, grad: torch.Tensor) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._queue_last)

    def _queue_last(self) -> None:
        # The loss's gradient is the first of the backward, so this runs before the end-of-backward work DDP
        # queued later (averaging the dense gradients into .grad); queued again from here, the sync runs after it.
        torch.autograd.Variable._execution_engine.queue_callback(self._sync)

    def _sync(self) -> None:
        self._queued = False
        if not self.should_sync():
            return  # gradients keep accumulating locally, as DDP's do under no_sync
        from ...moe import all_reduce_expert_grads, clip_grad_norm_

        all_reduce_expert_grads(self.model, self.expert_dp_group, expert_tp_group=self.expert_tp_group)
        if self.max_grad_norm is not None:
            self.last_norm = clip_grad_norm_(self.model, self.max_grad_norm)
        self.syncs += 1

    def remove(self) -> None:
        self.handle.remove()


@dataclass
class ModelParallelism:
    """What :func:`apply_model_parallelism` did to a model (found again by :func:`model_parallelism`)."""

    groups: object  # hf_longctx.comm.mesh.ParallelGroups
    attention_modules: int  # modules whose heads were split
    expert_blocks: int  # MoE blocks whose experts were sharded
    aux_loss: object | None  # hf_longctx.moe.DistributedAuxLoss
    grad_sync: ExpertGradSync | None


def apply_model_parallelism(model: nn.Module, config: LongContextConfig | None = None) -> ModelParallelism | None:
    """Apply the config's tensor (head) and expert parallelism to ``model``; None when there is nothing to do.

    A MoE model on several processes always gets the batch-exact load-balancing loss (each rank's
    own aux loss on its tokens, summed over ranks, is not the batch's), even without expert parallelism.

    ``config`` defaults to the run's (:func:`~hf_longctx.hf.settings.sources.load_config`). Call on every rank
    after the weights are loaded and before the Trainer, the optimizer or DDP are created: expert
    slices must exist before DDP broadcasts rank 0's parameters. Sizes are checked against the world
    and the model first (errors name the fix).
    """
    from ...moe.layer import find_experts_modules

    cfg = config or load_config()
    split = cfg.tp_size * cfg.ep_size * cfg.expert_tp_size > 1
    is_moe = bool(find_experts_modules(model))
    if split or is_moe:
        _join_launched_world()
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if not split and not (is_moe and world > 1):
        return None
    if model in _APPLIED:
        raise ValueError("model parallelism is already applied to this model")
    if world == 1:
        raise RuntimeError(f"tp_size={cfg.tp_size}, ep_size={cfg.ep_size}, expert_tp_size={cfg.expert_tp_size} need "
                           "several processes: launch with accelerate/torchrun, or set them to 1")
    from ...comm.mesh import parallel_groups
    from ...moe import apply_expert_parallel, enable_distributed_aux_loss, ignore_expert_params_in_ddp

    _, sp, tp, ep = cfg.resolved_sizes(world, model.config)
    groups = parallel_groups(sp, tp, ep, cfg.expert_tp_size)
    attention = 0
    if tp > 1:
        from .heads import apply_head_parallel_attention

        attention = apply_head_parallel_attention(model, groups.tp_mesh)
    blocks, aux, sync = 0, None, None
    if ep * cfg.expert_tp_size > 1:
        blocks = apply_expert_parallel(model, groups.moe, cfg.moe_dispatch, expert_tp_size=cfg.expert_tp_size)
        ignore_expert_params_in_ddp(model)
        sync = ExpertGradSync(model, groups.expert_dp, groups.expert_tp)
    if is_moe and getattr(model.config, "router_aux_loss_coef", None) is not None:
        aux = enable_distributed_aux_loss(model, group=groups.batch)
    done = ModelParallelism(groups, attention, blocks, aux, sync)
    _APPLIED[model] = done
    return done


def _join_launched_world() -> None:
    """Start torch.distributed the way TrainingArguments would, if a launcher started several processes.

    Training scripts build the model before TrainingArguments, whose device setup is what joins the
    process group; accelerate's ``PartialState`` does the same join (same backend, same state), so the
    Trainer created afterwards finds the group ready.
    """
    if dist.is_available() and not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from accelerate import PartialState

        PartialState(cpu=not torch.cuda.is_available())


def model_parallelism(model: nn.Module) -> ModelParallelism | None:
    """The :class:`ModelParallelism` :func:`apply_model_parallelism` left on ``model`` (None if never applied)."""
    return _APPLIED.get(model)
