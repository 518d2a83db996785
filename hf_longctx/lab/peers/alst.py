"""ALST (Arctic Long Sequence Training): DeepSpeed's Ulysses sequence parallelism through accelerate, with the
memory features of its one-GPU recipes.

Sources: Snowflake's ArcticTraining (``projects/sequence-parallelism/run-h100-sp1-llama-8b.yml`` and
``run-h200-sp1-llama-8b-liger-offload-tiled-mlp.yml``, and how ``arctic_training/trainer`` applies them, as of
April 2026), the ALST paper (arXiv 2506.13996), DeepSpeed 0.19.8's
``deepspeed/runtime/sequence_parallel/ulysses_sp.py`` (``TiledMLP``, ``TiledFusedLogitsLoss``) and accelerate
1.15's ``ParallelismConfig(sp_backend="deepspeed")``. What the recipes set, and how it is set here:

- ``sequence_parallel_size: 1``: ``ParallelismConfig(sp_size=1, sp_backend="deepspeed", sp_handler=
  DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation=...))``; accelerate
  registers ``UlyssesSPAttentionHF`` only for ``sp_size > 1``, so at one GPU the core attention is the model's own;
- ZeRO-3 with ``offload_optimizer`` and ``offload_param`` to the CPU, ``optimizer: cpu_adam`` (DeepSpeed's CPU
  Adam; accelerate maps a torch AdamW to it), ``seq_parallel_communication_data_type: bf16``, bf16, lr 1e-5;
  the model is built as every system's (the same weights) and partitioned by ``deepspeed.initialize``, where
  ArcticTraining creates it under ``zero.Init``: at one GPU a partition is the whole model either way, and the
  construction's transient memory is gone before the timed steps. Where DeepSpeed's CPU Adam cannot be built,
  torch's AdamW runs on the offloaded states instead, and the result says so;
- ``tiled_mlp_compute: true``: every ``LlamaMLP`` runs through DeepSpeed's ``TiledMLP`` in ``ceil(seq / hidden)``
  shards (the recipes' automatic count);
- ``model.type: liger``: Liger-Kernel's RMSNorm, RoPE and fused linear cross-entropy, SwiGLU off (the tiled MLP
  owns the MLP); without Liger the loss is DeepSpeed's ``TiledFusedLogitsLoss`` over shards of about 1 GiB of
  float32 logits with a token-weighted sum, as ArcticTraining's SFT trainer falls back to;
- activation checkpointing of every decoder layer (ArcticTraining enables it unless disabled) with
  ``activation_checkpoint_cpu_offload: true``: each checkpointed layer's input waits in host memory until its
  recomputation (:func:`offloading_checkpoint`, written here after the behaviour ArcticTraining describes);
- attention: ``flash_attention_2`` in the recipes where installed, else SDPA (:func:`~.common.choose_attention`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .common import choose_attention, liger_available
from .workload import Workload, build_model, packed_batch

LOGITS_SHARD_BYTES = 1 << 30  # ArcticTraining's tiled loss: about 1 GiB of float32 logits per shard


def deepspeed_config(cuda: bool) -> dict:
    """The one-GPU recipes' DeepSpeed config (offload only where there is a GPU to offload from)."""
    zero: dict = {"stage": 3}
    if cuda:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": 1,
            "bf16": {"enabled": cuda}, "zero_optimization": zero, "seq_parallel_communication_data_type": "bf16",
            "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 30, "wall_clock_breakdown": False}


def cpu_adam_problem() -> str | None:
    """None where DeepSpeed's CPU Adam builds and runs here, else why not (it is a C++ op compiled on first use)."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        p = torch.nn.Parameter(torch.zeros(4))
        p.grad = torch.ones(4)
        DeepSpeedCPUAdam([p], lr=1e-3).step()
        return None
    except Exception as err:  # noqa: BLE001 - any failure to build or load the op means "not available"
        return f"{type(err).__name__}: {str(err)[:200]}"


class _OffloadedCheckpoint(torch.autograd.Function):
    """Reentrant checkpoint of ``run(hidden, *rest)`` whose ``hidden`` waits on the host until the recompute.

    Forward: copy ``hidden`` to (pinned) host memory, run without autograd. Backward: copy it back, run again
    with autograd, back-propagate the incoming gradient, return ``hidden``'s gradient. Llama has no dropout, so
    no RNG state is replayed."""

    @staticmethod
    def forward(ctx, run: Callable, hidden: torch.Tensor, *rest):
        ctx.run, ctx.device, ctx.hidden_requires_grad = run, hidden.device, hidden.requires_grad
        host = torch.empty(hidden.shape, dtype=hidden.dtype, pin_memory=hidden.is_cuda)
        host.copy_(hidden.detach())
        ctx.host, ctx.rest = host, rest
        with torch.no_grad():
            return run(hidden, *rest)

    @staticmethod
    def backward(ctx, *grads):
        hidden = ctx.host.to(ctx.device, non_blocking=True).detach().requires_grad_(ctx.hidden_requires_grad)
        ctx.host = None
        with torch.enable_grad():
            out = ctx.run(hidden, *ctx.rest)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads) if torch.is_tensor(o) and o.requires_grad and g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, hidden.grad, *([None] * len(ctx.rest)))


def offloading_checkpoint(run: Callable, hidden: torch.Tensor, *rest, **kwargs):
    """transformers' ``_gradient_checkpointing_func`` contract (``func(layer_call, hidden_states, ...)``)."""
    return _OffloadedCheckpoint.apply(run, hidden, *rest)


def enable_offloaded_checkpointing(model) -> int:
    """Checkpoint every decoder layer with :func:`offloading_checkpoint`; the number of layers it covers."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    covered = 0
    for module in model.modules():
        if hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = offloading_checkpoint
            covered += isinstance(module, type(model.model.layers[0]))
    return covered


def tiled_mlp_forward(mlp, x: torch.Tensor) -> torch.Tensor:
    """``LlamaMLP.forward`` through DeepSpeed's ``TiledMLP``: ``ceil(seq / hidden)`` shards along the sequence."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    seq, hidden = x.shape[-2:]
    weights = [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    return TiledMLP.apply(_mlp, mlp, x, max(1, math.ceil(seq / hidden)), weights)


def _mlp(mlp, x: torch.Tensor) -> torch.Tensor:
    return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))


def enable_tiled_mlp(model) -> None:
    for layer in model.model.layers:
        layer.mlp.forward = tiled_mlp_forward.__get__(layer.mlp)


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """Next-token targets of (1, T) ``labels``: ``labels[t + 1]`` at ``t``, ``-100`` at the end."""
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)


def _loss_sum(model, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model.lm_head(hidden).float()
    return F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")


def tiled_logits_loss(model, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss without the whole logits tensor: DeepSpeed's ``TiledFusedLogitsLoss`` over shards of
    about :data:`LOGITS_SHARD_BYTES` of float32 logits, summed, over the count of counted targets."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    seq, vocab = targets.shape[1], model.config.vocab_size
    shards = max(1, math.ceil(seq * vocab * 4 / LOGITS_SHARD_BYTES))
    total = TiledFusedLogitsLoss.apply(_loss_sum, model, hidden, targets, None, shards, [model.lm_head.weight], "sum")
    return total / (targets != -100).sum().clamp(min=1)


class AlstRun:
    name = "alst"
    process_group = True  # as scripts/bench_train.py, accelerate launch: a one-rank group

    def __init__(self, work: Workload, device: torch.device) -> None:
        from accelerate import Accelerator
        from accelerate.parallelism_config import ParallelismConfig
        from accelerate.utils import DeepSpeedPlugin, DeepSpeedSequenceParallelConfig

        cuda = device.type == "cuda"
        if not cuda:  # DeepSpeed compiles a shared-memory collective for CPU runs on first use; one process has no
            import deepspeed.ops  # use for it, and the smoke runs need no compiler

            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        attention, masked = choose_attention(work.sdpa_mask)
        self.liger = liger_available(device)
        if self.liger:  # ArcticTraining's liger model type: class-level patches before the model exists
            from liger_kernel.transformers import apply_liger_kernel_to_llama

            apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=False, cross_entropy=False,
                                        fused_linear_cross_entropy=True)
        config = deepspeed_config(cuda)
        adam_problem = cpu_adam_problem() if cuda else "no GPU: nothing is offloaded"
        if adam_problem is not None:
            config["zero_force_ds_cpu_optimizer"] = False
        sp = ParallelismConfig(sp_size=1, sp_backend="deepspeed", dp_shard_size=1, dp_replicate_size=1,
                               sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True,
                                                                          sp_attn_implementation=attention))
        self.accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config, zero3_init_flag=False),
                                       parallelism_config=sp, mixed_precision="bf16" if cuda else "no")
        model = build_model(work, attention, device)  # the weights every system starts from
        enable_tiled_mlp(model)
        layers = enable_offloaded_checkpointing(model)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=work.lr, weight_decay=0.0)
        self.engine, self.optimizer = self.accelerator.prepare(model, optimizer)
        batch = packed_batch(work, model.config.vocab_size)
        self.batch = {k: v.to(self.accelerator.device) for k, v in batch.items()}
        self.targets = shifted_labels(self.batch["labels"])
        self.settings = {
            "attention": attention, "document_masking": masked, "sp_size": 1, "sp_backend": "deepspeed",
            "ulysses_attention": "not registered at sp_size 1 (accelerate registers it for sp_size > 1)",
            "zero_stage": 3, "offload_optimizer": "cpu" if cuda else None, "offload_param": "cpu" if cuda else None,
            "optimizer": "DeepSpeed CPU Adam" if adam_problem is None else f"torch AdamW ({adam_problem})",
            "tiled_mlp": "DeepSpeed TiledMLP, ceil(seq / hidden) shards", "checkpointing": f"{layers} layers, "
            "inputs offloaded to the host", "liger": self.liger,
            "loss": "Liger fused linear cross-entropy" if self.liger else "DeepSpeed TiledFusedLogitsLoss (~1 GiB)",
            "precision": "bf16 (DeepSpeed fp32 master weights)" if cuda else "fp32 (CPU)"}

    def loss(self) -> torch.Tensor:
        module = self.engine.module
        if self.liger:  # Liger's forward computes the loss chunk by chunk from the final hidden states
            return self.engine(input_ids=self.batch["input_ids"], position_ids=self.batch["position_ids"],
                               labels=self.batch["labels"]).loss
        hidden = module.model(input_ids=self.batch["input_ids"], position_ids=self.batch["position_ids"],
                              use_cache=False).last_hidden_state
        return tiled_logits_loss(module, hidden, self.targets)

    def train(self, steps: int, clock) -> None:
        for _ in range(steps):
            clock.begin()
            loss = self.loss()
            self.accelerator.backward(loss)  # DeepSpeed's engine: backward, then its optimizer step
            self.optimizer.step()
            self.optimizer.zero_grad()
            clock.end(loss.detach().float().item())
