"""``LongContextCallback``: sequence parallelism for transformers.Trainer without a Trainer subclass.

The model decides the backend: it is the one the model was loaded with
(``attn_implementation="longctx_<backend>"``). The recipe (or ``HF_LONGCTX_*``, or nothing at all)
only says how many processes share a sequence and which memory knobs to turn.

At ``on_train_begin`` it builds the sequence-parallel group (a ("dp", "sp") DeviceMesh over the
processes accelerate started), installs the input hook that shards every batch, switches on
recompute-aware checkpointing when ``TrainingArguments.gradient_checkpointing`` is on, and from then
on adds to the logs: tokens/s, an MFU estimate, the attention-load imbalance of the schedule across
ranks. At ``on_train_end`` it takes its hooks off again, so evaluation and ``generate()`` after
training run the model as loaded (exact attention in each process).
"""

from __future__ import annotations

import logging
import time

import torch.distributed as dist
from transformers import TrainerCallback

from ..benchmarking import model_flops_per_token, peak_flops, training_mfu
from ..comm.groups import sequence_parallel_group
from ..kernels import available_kernels
from .attention import PREFIX
from .config import LongContextConfig, load_config
from .inputs import install_input_hook
from .memory import enable_memory_options
from .preflight import check_process_count

logger = logging.getLogger("hf_longctx")


def check_moe_layout(model, cfg: LongContextConfig, world: int) -> None:
    """tp_size / ep_size must already be applied: DDP wraps the model before any callback runs.

    Expert slices have to exist before DDP is built (it would copy rank 0's experts everywhere), so
    the training script shards the model before creating the Trainer; this check turns a recipe
    whose sizes were never applied into an error instead of a silently unsharded run.
    """
    from ..moe import ExpertParallelExperts

    cfg.resolved_sizes(world, model.config)
    modules = list(model.modules())
    if cfg.ep_size > 1 and not any(isinstance(m, ExpertParallelExperts) and m.ep_size == cfg.ep_size
                                   for m in modules):
        raise ValueError(f"the recipe sets ep_size={cfg.ep_size} but the model's experts are not sharded; before "
                         "creating the Trainer call hf_longctx.moe.apply_expert_parallel(model, groups.ep) and "
                         "ignore_expert_params_in_ddp(model), with groups = hf_longctx.comm.mesh.parallel_groups(...)")
    if cfg.tp_size > 1 and not any(type(p).__name__ == "DTensor" for p in model.parameters()):
        raise ValueError(f"the recipe sets tp_size={cfg.tp_size} but the attention heads are not split; before "
                         "creating the Trainer call hf_longctx.hf.head_parallel.apply_head_parallel_attention("
                         "model, groups.tp_mesh)")


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

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        cfg = self.config = self.config or load_config()
        impl = getattr(model.config, "_attn_implementation", None) or ""
        if not impl.startswith(PREFIX):
            raise ValueError(f"LongContextCallback needs a model loaded with attn_implementation='longctx_<backend>' "
                             f"(e.g. 'longctx_zigzag'); this one uses {impl!r}")
        world = dist.get_world_size() if dist.is_initialized() else 1
        check_process_count(world)
        sp = cfg.resolved_sp_size(world)
        if cfg.tp_size > 1 or cfg.ep_size > 1:
            check_moe_layout(model, cfg, world)
        group = sequence_parallel_group(sp) if world > 1 else None
        checkpointing = "none"
        if checkpointing_requested(args):
            # layer-boundary checkpointing would re-run attention and its communication in backward
            checkpointing = "layer" if cfg.checkpointing == "layer" else "recompute_aware"
        # before the input hook: its output hook must run after the tiled loss's
        self._memory = enable_memory_options(model, checkpointing, cfg.offload_checkpoints and checkpointing != "none",
                                             cfg.tiled_loss, cfg.tiled_mlp)
        self.hook = install_input_hook(model, group, cfg.kernel)
        self.summary = {"backend": impl[len(PREFIX):], "attn_implementation": impl, "sp_size": sp,
                        "dp_size": world // sp, "checkpointing": checkpointing, "kernel": cfg.kernel,
                        "tiled_loss": cfg.tiled_loss, "tiled_mlp": cfg.tiled_mlp,
                        "offload_checkpoints": cfg.offload_checkpoints and checkpointing != "none",
                        "kernels_available": available_kernels(args.device)}
        self._flops_per_token = model_flops_per_token(model)
        self._peak = peak_flops(args.device)
        self._model = model
        self._last = (time.perf_counter(), 0, 0)
        if state.is_world_process_zero:
            logger.info("hf_longctx: %s", self.summary)
            if checkpointing == "recompute_aware":
                logger.info("hf_longctx: gradient_checkpointing is on: recompute-aware (every decoder layer is "
                            "checkpointed, its core-attention output is kept, so backward never re-runs attention)")
            elif checkpointing == "none" and cfg.checkpointing != "none":
                logger.info("hf_longctx: gradient_checkpointing is off: no activation checkpointing (set "
                            "gradient_checkpointing=True for recompute-aware checkpointing)")

    def on_train_end(self, args, state, control, model=None, **kwargs):
        """Remove what ``on_train_begin`` installed; checkpointing stays as the Trainer left it."""
        if self.hook is not None:
            self.hook.remove()
        if self._memory is not None:
            self._memory.remove()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.hook is None or logs is None or "loss" not in logs:
            return
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
