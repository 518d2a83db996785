"""``LongContextCallback``: sequence parallelism for transformers.Trainer without a Trainer subclass.

The model decides the backend: it is the one the model was loaded with
(``attn_implementation="longctx_<backend>"``). The recipe (or ``HF_LONGCTX_*``, or nothing at all)
only says how many processes share a sequence and which memory knobs to turn.

At ``on_train_begin`` it builds the sequence-parallel group (a ("dp", "sp") DeviceMesh over the
processes accelerate started), installs the input hook that shards every batch, switches on
recompute-aware checkpointing when ``TrainingArguments.activation_checkpointing`` is on (the model may
be FSDP2-sharded by then: see :mod:`..parallel.fsdp`, which also names what is refused with it), and from then
on adds to the logs: tokens/s, an MFU estimate, the attention-load imbalance of the schedule across
ranks. A MoE model (``router_aux_loss_coef`` in its config) gets the batch-exact load-balancing loss
(:mod:`~hf_longctx.moe.aux_loss`) unless :func:`~..parallel.model_parallelism.apply_model_parallelism` installed it
already: the input hook takes ``attention_mask`` out of the call and spreads the batch over the group,
so transformers' own aux loss would count padding and be each shard's own, not the batch's; its
shares are scaled as the Trainer scales the language-model loss (:func:`follow_loss_averaging`): the
Trainer passes ``num_items_in_batch`` and multiplies by the process count only for a model that
accepts loss keywords and with ``average_tokens_across_devices`` (:func:`trainer_averages_processes`). At
``on_train_end`` it takes its hooks off again, so evaluation and ``generate()`` after
training run the model as loaded (exact attention in each process).
"""

from __future__ import annotations

import inspect
import logging
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from ...benchmarking import model_flops_per_token, peak_flops, training_mfu
from ...comm.groups import sequence_parallel_group
from ...kernels import available_kernels
from ..memory.checkpointing import checkpointing_argument
from ..memory.enable import enable_memory_options
from ..memory.optimizer_offload import host_optimizer_of
from ..parallel.fsdp import check_fsdp_model
from ..parallel.model_parallelism import model_parallelism
from ..settings.backend_names import PREFIX
from ..settings.schema import LongContextConfig
from ..settings.sources import load_config
from .inputs import install_input_hook
from .preflight import check_process_count, check_training_arguments

if TYPE_CHECKING:
    from ...moe import DistributedAuxLoss

logger = logging.getLogger("hf_longctx")


def check_moe_layout(model, cfg: LongContextConfig, world: int) -> None:
    """ep_size / expert_tp_size must already be applied, and tp_size must be 1: DDP wraps the model first.

    Expert slices have to exist before DDP is built (it would copy rank 0's experts everywhere), so
    the training script shards the model before creating the Trainer
    (:func:`~hf_longctx.hf.parallel.model_parallelism.apply_model_parallelism`); this check turns a recipe whose
    sizes were never applied into an error instead of a silently unsharded run. Head-parallel
    attention needs the ranks of a tensor-parallel group to train on the same batch, while the
    Trainer's sampler gives every process its own: that layout runs in a custom loop, not here.
    """
    from ...moe import ExpertParallelExperts

    cfg.resolved_sizes(world, model.config)
    if cfg.tp_size > 1:
        raise ValueError(f"the recipe sets tp_size={cfg.tp_size}: head-parallel attention needs the tensor-parallel "
                         "ranks to see the same batch, but the Trainer gives every process its own rows. Set tp_size: "
                         "1 for Trainer runs (sp_size and ep_size work), or train in a loop of your own after "
                         "hf_longctx.hf.apply_model_parallelism(model, config)")
    moe = cfg.ep_size * cfg.expert_tp_size > 1
    if moe and not any(isinstance(m, ExpertParallelExperts) and m.ep_size == cfg.ep_size
                       and m.expert_tp_size == cfg.expert_tp_size for m in model.modules()):
        raise ValueError(f"the recipe sets ep_size={cfg.ep_size}, expert_tp_size={cfg.expert_tp_size} but the "
                         "model's experts are not sharded that way; before creating the Trainer call "
                         "hf_longctx.hf.apply_model_parallelism(model, config)")
    if moe and model_parallelism(model) is None:
        raise ValueError("the experts were sharded by hand: the Trainer needs their gradients averaged and clipped "
                         "by hf_longctx.hf.apply_model_parallelism(model, config); shard the model with it instead")


def install_aux_loss(model: torch.nn.Module) -> DistributedAuxLoss | None:
    """The batch-exact aux loss for a MoE model that has none yet (None: not MoE, or already installed).

    Its default group is each sharded batch's own (the sequence-parallel group), so every group's aux
    is what one device of plain data parallelism computes; apply_model_parallelism's whole-world
    group, when installed before, is kept.
    """
    from ...moe import enable_distributed_aux_loss, find_experts_modules, installed_aux_loss

    if getattr(model.config, "router_aux_loss_coef", None) is None or installed_aux_loss(model) is not None:
        return None
    if not find_experts_modules(model):
        return None
    return enable_distributed_aux_loss(model)


def trainer_passes_counts(model: torch.nn.Module) -> bool:
    """Whether the Trainer hands the model ``num_items_in_batch`` (and then scales its loss by the process count).

    The Trainer's own rule (``Trainer.model_accepts_loss_kwargs``): the model's ``accepts_loss_kwargs``
    attribute where it has one (several causal LMs set it False), else whether its ``forward`` takes
    ``**kwargs``; a wrapped (DDP) or PEFT model is judged by the model inside, as the Trainer does. A
    ``compute_loss_func`` takes the labels away from the model, so its count never reaches the input hook.
    """
    from accelerate.utils import extract_model_from_parallel
    from transformers.trainer_utils import unwrap_peft_model

    model = unwrap_peft_model(extract_model_from_parallel(model))
    if hasattr(model, "accepts_loss_kwargs"):
        return bool(model.accepts_loss_kwargs)
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values())


def trainer_averages_processes(model: torch.nn.Module, args) -> bool:
    """Whether the step's gradient is DDP's plain AVERAGE of the processes' losses, the Trainer scaling nothing.

    So it is with ``average_tokens_across_devices=False`` (each process's own count), and for a model the
    Trainer passes no count to (:func:`trainer_passes_counts`: the model's own mean, no scaling). Otherwise
    the Trainer passes the world's count and multiplies each loss by the process count: DDP's average is
    then the SUM of the processes' losses.
    """
    return not getattr(args, "average_tokens_across_devices", True) or not trainer_passes_counts(model)


def follow_loss_averaging(model: torch.nn.Module, args) -> tuple[DistributedAuxLoss, bool] | None:
    """Scale the batch-exact aux loss as the Trainer scales the language-model loss; returns (the hooks, their
    setting before) to put back at the end, or None for a model without them.

    Where DDP's plain average over processes meets the shares (:func:`trainer_averages_processes`), each is
    multiplied by its group's size (:attr:`~hf_longctx.moe.DistributedAuxLoss.averaged_over_processes`,
    the arithmetic is in :mod:`hf_longctx.moe.aux_loss`), as the input hook divides each shard's loss by
    its group's target count over the group size
    (:attr:`~hf_longctx.hf.integration.inputs.SequenceParallelInputs.average_in_group`).
    """
    from ...moe import installed_aux_loss

    aux = installed_aux_loss(model)
    if aux is None:
        return None
    before = aux.averaged_over_processes
    aux.averaged_over_processes = trainer_averages_processes(model, args)
    return aux, before


def checkpointing_requested(args) -> bool:
    """Whether the TrainingArguments turn activation checkpointing on (either of transformers' names)."""
    return bool(getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False))


class LongContextCallback(TrainerCallback):
    """Shards every training batch of a ``longctx_*`` model over the sequence-parallel group (module docstring)."""

    def __init__(self, config: LongContextConfig | None = None):
        self.config = config
        self.hook = None
        self.summary: dict = {}
        self._last = None
        self._memory = None
        self._model = None
        self._grad_sync = None
        self._max_grad_norm = None
        self._host_optimizer = None
        self._aux_loss = None
        self._aux_averaging = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        cfg = self.config = self.config or load_config()
        impl = getattr(model.config, "_attn_implementation", None) or ""
        if not impl.startswith(PREFIX):
            raise ValueError(f"LongContextCallback needs a model loaded with attn_implementation='longctx_<backend>' "
                             f"(e.g. 'longctx_zigzag'); this one uses {impl!r}")
        world = dist.get_world_size() if dist.is_initialized() else 1
        check_process_count(world)
        sp = cfg.resolved_sp_size(world)
        check_training_arguments(args, sp)  # options sharding would silently change, accelerate's own axes
        fsdp_shards = check_fsdp_model(model, args, cfg)  # FSDP2: what works with it, or an error naming it
        if cfg.tp_size > 1 or cfg.ep_size > 1 or cfg.expert_tp_size > 1:
            check_moe_layout(model, cfg, world)
            self._take_over_clipping(args, model)
        group = sequence_parallel_group(sp) if world > 1 else None
        checkpointing = "none"
        if checkpointing_requested(args):
            # layer-boundary checkpointing would re-run attention and its communication in backward
            checkpointing = "layer" if cfg.checkpointing == "layer" else "recompute_aware"
        plan = None
        if cfg.memory == "auto":  # the plan picks per-layer checkpointing, offload and tiling (hf.memory_plan)
            from ..memory.training import plan_for_training

            plan = plan_for_training(model, cfg, args, world=world, sp_size=sp,
                                     train_dataloader=kwargs.get("train_dataloader"), optimizer=kwargs.get("optimizer"))
            self._memory = plan.apply(model)  # before the input hook, as below
            checkpointing = self._memory.checkpointing
        else:
            if cfg.fused_ops == "liger":  # under memory: auto the plan switches them on
                from ..memory.fused_ops import enable_fused_ops, uses_fused_norms

                if not uses_fused_norms(model):
                    enable_fused_ops(model, swiglu=not cfg.tiled_mlp)
            # before the input hook: its output hook must run after the tiled loss's
            self._memory = enable_memory_options(model, checkpointing, cfg.offload_checkpoints and
                                                 checkpointing != "none", cfg.tiled_loss, cfg.tiled_mlp)
        self._host_optimizer = host_optimizer_of(kwargs.get("optimizer"))
        if self._host_optimizer is not None:
            self._take_over_clipping_on_the_host(args)
        self.hook = install_input_hook(model, group, cfg.kernel, cfg.backend_options)
        # where the Trainer scales nothing (average_tokens_across_devices=False, or a model it passes no count
        # to), every sequence-parallel group averages its own tokens, as one device of plain DDP averages its
        # batch (the group, not the process, holds a sequence)
        self.hook.average_in_group = sp > 1 and trainer_averages_processes(model, args)
        self._aux_loss = install_aux_loss(model)  # in either order with the tiled loss (hf.tiled_loss)
        self._aux_averaging = follow_loss_averaging(model, args)
        self.summary = {"backend": impl[len(PREFIX):], "attn_implementation": impl, "sp_size": sp,
                        "dp_size": world // sp, "checkpointing": checkpointing, "kernel": cfg.kernel,
                        "backend_options": {k: v if isinstance(v, (str, int, float, bool, type(None))) else repr(v)
                                            for k, v in cfg.backend_options.given().items()},  # printable as JSON
                        "tiled_loss": cfg.tiled_loss, "tiled_mlp": cfg.tiled_mlp, "fused_ops": cfg.fused_ops,
                        "offload_checkpoints": cfg.offload_checkpoints and checkpointing != "none",
                        "kernels_available": available_kernels(args.device)}
        if fsdp_shards is not None:
            self.summary["fsdp_shard_size"] = fsdp_shards  # dp x sp: one sharding dimension over the world
        if plan is not None:
            self.summary.update(plan.summary())
        if cfg.ep_size * cfg.expert_tp_size > 1:
            self.summary.update(ep_size=cfg.ep_size, expert_tp_size=cfg.expert_tp_size, moe_dispatch=cfg.moe_dispatch)
        self._flops_per_token = model_flops_per_token(model)
        self._peak = peak_flops(args.device)
        self._model = model
        self._last = (time.perf_counter(), 0, 0)
        if state.is_world_process_zero:
            logger.info("hf_longctx: %s", self.summary)
            if plan is not None:
                where = "" if str(args.device).startswith("cuda") else (" (CPU: the host's available memory is the "
                                                                         "device budget, nothing is offloaded)")
                logger.info("hf_longctx: memory: auto%s\n%s", where, plan)
            if checkpointing == "recompute_aware":
                logger.info("hf_longctx: activation checkpointing is on: recompute-aware (every decoder layer is "
                            "checkpointed, its core-attention output is kept, so backward never re-runs attention)")
            elif checkpointing == "none" and cfg.checkpointing != "none" and plan is None:
                logger.info("hf_longctx: activation checkpointing is off (set TrainingArguments(%s=True) for "
                            "recompute-aware checkpointing)", checkpointing_argument())

    def _take_over_clipping(self, args, model) -> None:
        """Expert gradients: clipped by the expert-gradient hook with the whole model's norm (see hf.parallelism)."""
        sync = model_parallelism(model).grad_sync
        if sync is None:
            return
        if getattr(args, "deepspeed_plugin", None) is not None:
            raise ValueError("expert parallelism (ep_size / expert_tp_size > 1) runs under DDP: DeepSpeed's ZeRO would "
                             "average the expert slices of different ranks as one tensor. Use a DDP recipe, or set "
                             "ep_size: 1 and expert_tp_size: 1 with DeepSpeed")
        self._grad_sync = sync
        self._max_grad_norm = args.max_grad_norm
        clip = args.max_grad_norm is not None and args.max_grad_norm > 0
        sync.max_grad_norm = args.max_grad_norm if clip else float("inf")  # inf: only measure, for the logs
        args.max_grad_norm = 0.0

    def _take_over_clipping_on_the_host(self, args) -> None:
        """AdamW on the host: the GPU gradients are gone when the Trainer would clip them; the optimizer clips the
        host copies with the whole model's norm (hf.optimizer_offload)."""
        if args.gradient_accumulation_steps != 1:
            raise ValueError("AdamW on the host (HostOffloadAdamW) does not accumulate gradients over micro-batches: "
                             "set gradient_accumulation_steps=1 (a longer sequence per step instead), or keep the "
                             "optimizer on the GPU")
        self._max_grad_norm = args.max_grad_norm
        self._host_optimizer.max_grad_norm = args.max_grad_norm
        args.max_grad_norm = 0.0

    def on_train_end(self, args, state, control, model=None, **kwargs):
        """Remove what ``on_train_begin`` installed; checkpointing stays as the Trainer left it."""
        if self._host_optimizer is not None:
            args.max_grad_norm, self._host_optimizer = self._max_grad_norm, None
        if self._grad_sync is not None:
            args.max_grad_norm, self._grad_sync.max_grad_norm = self._max_grad_norm, None
            self._grad_sync = None
        if self.hook is not None:
            self.hook.remove()
        if self._aux_averaging is not None:
            aux, before = self._aux_averaging
            aux.averaged_over_processes, self._aux_averaging = before, None
        if self._aux_loss is not None:
            self._aux_loss.remove()
            self._aux_loss = None
        if self._memory is not None:
            self._memory.remove()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.hook is None or logs is None or "loss" not in logs:
            return
        if self._host_optimizer is not None and self._host_optimizer.last_grad_norm is not None:
            logs["grad_norm"] = self._host_optimizer.last_grad_norm  # the Trainer no longer sees the gradients
            if state.log_history and "loss" in state.log_history[-1]:
                state.log_history[-1]["grad_norm"] = logs["grad_norm"]
        sync = self._grad_sync
        if sync is not None and sync.last_norm is not None and "grad_norm" in logs:
            # the Trainer measured this rank's own expert slices; the hook's norm is the whole model's
            logs["grad_norm"] = float(sync.last_norm)
            if state.log_history and "grad_norm" in state.log_history[-1]:
                state.log_history[-1]["grad_norm"] = logs["grad_norm"]
        now, tokens, pairs = time.perf_counter(), self.hook.tokens, self.hook.causal_pairs
        t0, tok0, pairs0 = self._last
        self._last = (now, tokens, pairs)
        seconds = max(now - t0, 1e-9)
        dp, sp = self.summary["dp_size"], self.summary["sp_size"]
        # each rank counts the tokens of its sequence-parallel group; data-parallel groups add up
        tokens_per_s = (tokens - tok0) / seconds * dp
        logs["tokens_per_s"] = round(tokens_per_s, 1)
        logs["attn_imbalance"] = round(self.hook.work_max / max(self.hook.work_mean, 1), 3)
        mfu = training_mfu(self._model.config, self._flops_per_token, (tokens - tok0) * dp, (pairs - pairs0) * dp,
                           seconds, dp * sp, self._peak)
        if mfu is not None:
            logs["mfu"] = round(mfu, 4)
        self.summary.update({k: logs[k] for k in ("tokens_per_s", "attn_imbalance", "mfu") if k in logs})
