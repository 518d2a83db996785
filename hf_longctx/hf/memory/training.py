"""The memory plan of a training run whose recipe says ``memory: auto``: the planner fed from the run itself.

:func:`plan_for_training` reads what :func:`~.search.plan_memory` needs from the run: the tokens per GPU (the
data's rows, else the recipe's ``seq_len``), ZeRO's stage or FSDP2, the model's precision, whether Liger's fused ops
run, where the optimizer may live and the machine's memory (:mod:`.machine`).
"""

from __future__ import annotations

import dataclasses
import os

from ..settings.launcher import requested_fsdp_version
from ..settings.schema import ConfigError
from .adam_states import AdamStates
from .machine import gpu_memory_bytes, host_memory_bytes
from .model import CHECKPOINTING_CHOICES
from .plan import MemoryPlan
from .search import plan_memory

_MODES_OF_RECIPE = {"recompute_aware": CHECKPOINTING_CHOICES, "layer": ("none", "layer"), "none": ("none",)}


def row_tokens(dataloader) -> int | None:
    """Tokens of one training row of ``dataloader``'s dataset (None when it cannot tell)."""
    try:
        row = dataloader.dataset[0]
        ids = row["input_ids"] if isinstance(row, dict) else row
        return len(ids)
    except Exception:  # an iterable dataset, or rows without input_ids
        return None


def precision_of(model, zero_stage: int = 0) -> str:
    """The :data:`PRECISIONS` entry of a model: its parameter dtype, and float32 master copies under ZeRO."""
    import torch

    dtype = next(model.parameters()).dtype
    if dtype in (torch.bfloat16, torch.float16):
        return "fp32_master" if zero_stage else "bf16"
    return "fp64" if dtype == torch.float64 else "fp32"


def plan_for_training(model, cfg, args=None, *, tokens_per_gpu: int | None = None, world: int = 1,
                      sp_size: int = 1, train_dataloader=None, processes_per_host: int | None = None,
                      zero_stage: int | None = None, precision: str | None = None,
                      fused_ops: bool | None = None, allow_optimizer_on_host: bool | None = None,
                      optimizer=None, adam_states: AdamStates | None = None) -> MemoryPlan:
    """The memory plan of a run whose recipe says ``memory: auto``.

    ``model``: the model or its config. Tokens per GPU: ``tokens_per_gpu``, else the length of a row of
    ``train_dataloader`` (what the data really brings) x the per-device batch size, else the recipe's
    ``seq_len`` x that batch size. The recipe's
    ``checkpointing`` bounds the modes (``recompute_aware``: any; ``layer``: none or layer;
    ``none``: none); a non-zero ``tiled_loss`` / ``tiled_mlp`` is kept as given, otherwise the plan
    chooses; ``offload_checkpoints`` is the plan's to decide. ZeRO's stage comes from ``args``'s
    DeepSpeed plugin (or ``zero_stage``, or accelerate's ``ACCELERATE_DEEPSPEED_ZERO_STAGE``); the
    precision from the model's parameters (or ``precision`` when ``model`` is a config). On a GPU
    the budgets are the device's total memory and the host's; on CPU the "device" is the host
    itself: the plan takes the host's available memory, split over the processes on it, as the
    device budget, and offloads nothing (a host copy would save nothing). ``fused_ops``: plan (and apply)
    Liger's fused RMSNorm/RoPE/SwiGLU; None: where they run (a CUDA device, Liger installed) or where the
    model runs them already (``use_liger_kernel=True``). ``allow_optimizer_on_host``: let the plan keep AdamW
    on the host when nothing fits otherwise; None: where torchao's offload optimizer can run (one process on
    a CUDA device, no ZeRO or FSDP, an Adam optimizer). ``optimizer``: the optimizer the run already has (the
    Trainer's): the plan takes its place as given, and a plan that needs AdamW on the host while it is on the GPU
    says so. AdamW's states are counted as the run keeps them (:mod:`.adam_states`): the optimizer's, else the
    Trainer's ``optim`` (``adamw_torch_8bit`` / ``adamw_torch_4bit``: torchao's low-bit moments); DeepSpeed's
    optimizer keeps float32 ones; an optimizer that is not Adam's is planned with AdamW's states (more than SGD,
    Adafactor or Lion keep). ``adam_states``: how the AdamW a script builds from the plan
    (:meth:`~.plan.MemoryPlan.make_optimizer`) is to keep them, where there is neither optimizer nor ``optim``.
    """

    config = getattr(model, "config", model)
    plugin = getattr(args, "deepspeed_plugin", None) if args is not None else None
    # FSDP2 keeps what ZeRO-3 keeps: weights, gradients and optimizer states sharded over the world and one
    # or two layers gathered at a time, in the model's own dtype (no float32 master copy); the tiled loss
    # is refused under it (see hf.parallel.fsdp)
    fsdp = requested_fsdp_version(args) == 2
    if fsdp:
        cfg = dataclasses.replace(cfg, tiled_loss=0)
        if hasattr(model, "parameters"):
            precision = precision_of(model, 0)
    if fsdp:
        zero = 3
    elif plugin is not None:
        zero = int(getattr(plugin, "zero_stage", 0) or 0)
    elif zero_stage is not None:
        zero = zero_stage
    elif os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        zero = int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "0") or 0)
    else:
        zero = 0
    if tokens_per_gpu is None:  # what the data really brings, where it can tell; else the recipe's seq_len
        batch = getattr(args, "per_device_train_batch_size", 1) if args is not None else 1
        row = row_tokens(train_dataloader) if train_dataloader is not None else None
        tokens_per_gpu = (row or cfg.seq_len) * batch
    if not tokens_per_gpu:
        raise ConfigError("memory: auto needs the tokens per GPU: set seq_len in the recipe (or --seq-len)")
    ppn = processes_per_host or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    device = getattr(args, "device", None) if args is not None else None
    on_gpu = device.type == "cuda" if device is not None else _cuda_available()
    if not fsdp:
        precision = precision_of(model, zero) if hasattr(model, "parameters") else precision
    from .fused_ops import fused_ops_available, fused_ops_reason, uses_fused_norms

    already = hasattr(model, "parameters") and uses_fused_norms(model)  # the Trainer's use_liger_kernel
    if fused_ops is None and cfg.fused_ops == "liger":
        reason = fused_ops_reason(device if on_gpu else "cpu")
        if reason:
            raise ConfigError(f"fused_ops: liger, but {reason}; set fused_ops: auto or off")
        fused_ops = True
    elif fused_ops is None and cfg.fused_ops == "off":
        fused_ops = already  # what the model runs is what the plan must count
    elif fused_ops is None:
        fused_ops = already or (on_gpu and fused_ops_available(device))
    from .optimizer_offload import check_optimizer_place, host_optimizer_of, optimizer_offload_available

    fixed_place = True if optimizer is not None and host_optimizer_of(optimizer) is not None else None
    deepspeed = plugin is not None or (not fsdp and zero > 0)
    if adam_states is not None and (optimizer is not None or deepspeed):
        raise ValueError("adam_states is for a run whose optimizer the plan builds: not with an optimizer, nor "
                         "under DeepSpeed, whose optimizer keeps its own")
    if adam_states is None:
        adam_states = None if deepspeed else _run_adam_states(optimizer, args)
    if allow_optimizer_on_host is None:
        allow_optimizer_on_host = (on_gpu and zero == 0 and not fsdp and world == 1 and adam_states is not None
                                   and optimizer_offload_available(device))
    from .kernel_buffers import planned_kernel

    kernel = planned_kernel(cfg.kernel, device if device is not None else ("cuda" if on_gpu else "cpu"))
    common = dict(sp_size=sp_size, zero_stage=zero, world=world, precision=precision, fused_ops=fused_ops,
                  kernel=kernel,
                  allow_optimizer_on_host=allow_optimizer_on_host, optimizer_on_host=fixed_place,
                  modes=_MODES_OF_RECIPE[cfg.checkpointing], tiled_loss=0 if fsdp else (cfg.tiled_loss or None),
                  tiled_mlp=cfg.tiled_mlp or None, processes_per_host=ppn, adam_states=adam_states)
    if on_gpu:
        plan = plan_memory(config, tokens_per_gpu, gpu_bytes=gpu_memory_bytes(device), **common)
    else:
        budget = host_memory_bytes(available=True) // ppn
        plan = plan_memory(config, tokens_per_gpu, gpu_bytes=budget, host_bytes=budget, allow_offload=False,
                           host_overhead_bytes=0, **common)
    check_optimizer_place(plan, optimizer)
    return plan


def _run_adam_states(optimizer, args):
    """How the run's AdamW keeps its moments: from the optimizer it has, else from the Trainer's ``optim``; None for
    an optimizer that is not Adam's (planned with AdamW's states in the parameters' dtype, and never on the host,
    whose optimizer is AdamW)."""
    from .adam_states import adam_states_of, trainer_adam_states

    if optimizer is not None:
        return adam_states_of(optimizer)
    if args is not None and hasattr(args, "optim"):
        return trainer_adam_states(args)
    return AdamStates()


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
