"""A memory model of one training step at long context, and a planner that picks the fastest memory options that fit.

Six knobs decide whether a long context fits a GPU: per decoder layer, no checkpointing,
recompute-aware or layer checkpointing, and whether the checkpoint waits on the host; the tiled
loss's and the tiled MLP's chunk sizes; where the optimizer states live. :func:`plan_memory` picks
them from a transformers config, the tokens per GPU and the GPU's and host's sizes, and returns a
:class:`MemoryPlan` that prints as one short table and switches the options on
(:meth:`MemoryPlan.apply`, through :func:`~hf_longctx.hf.memory.enable.enable_memory_options`).

The model (:class:`MemoryModel`) predicts the peak GPU bytes of one step as the largest of its
phases, and the peak host bytes. All sizes are bytes; ``T`` is tokens per GPU, ``a`` the bytes of
one activation element (2 for bf16), ``h`` the hidden size, ``q = heads x head_dim``,
``kv = kv_heads x head_dim``, ``I`` the MLP's intermediate size, ``V`` the vocabulary, ``L`` layers.

Per layer (per token):

* ``saved``, what a layer keeps for backward when it is not checkpointed:
  ``2 ((4 + 2 a) h + 4)`` (each RMSNorm keeps its float32 upcast, its input cast back, its output
  and a float32 rsqrt) ``+ a (2q + 2kv) + 4 heads``
  (q, k, v after RoPE, the core-attention output, its float32 log-sum-exp) ``+ 4 a I`` (gate, up,
  act(gate) and their product; 0 with the tiled MLP, which keeps only its input, the norm output).
* ``checkpoint``: layer checkpointing keeps the input, ``a h``; recompute-aware also the
  core-attention output and lse, ``a h + a q + 4 heads``. Offloaded, these live in pinned host
  memory, each tensor rounded up to a power of two (torch's caching host allocator does).
* ``backward working set`` of the layer being differentiated: what the recompute rebuilds (its
  ``saved`` less the kept attention output under recompute-aware) plus the larger of two sub-phases,
  the MLP's (``2 a h`` residual-stream gradients, its recomputed intermediates and ``3 a I``
  gradients, or with the tiled MLP one chunk's ``chunk x 7 a I``) and, once the MLP's tensors are
  freed, the norms' and attention's (``2 a h + 2 x 4 h + a (q + 2 kv) + 4 q + a q``: residual-stream
  gradients, float32 norm temporaries, dq/dk/dv, the kernel's float32 dq accumulator, d(out)).

* ``group`` (a run of ``k`` layers under ONE checkpoint, its first layer's ``a h``): ``k`` times fewer checkpoints;
  the backward of the group's ``p``-th layer (from 0) also holds the recomputed tensors of the ``p`` layers below
  it in the group, ``saved`` each. The planner groups layers (2-4 a group) only where nothing fits without
  groups; a grouped layer costs what a layer-checkpointed one does (one recompute).

Phases of a step (GPU): the last layer's forward; the loss (every kept checkpoint, the final hidden
states and the logits: ``T x V x (2 a + 8)`` for the logits, their float32 copy, its gradient and
the gradient cast back, or one chunk's with the tiled loss); each layer's backward (the checkpoints of the layers
below it, the gradients of the layers above it, its own working set); the optimizer step. Static
terms: weights, gradients, optimizer states and master weights as the precision and the ZeRO stage
put them. Host: an overhead (:func:`default_host_overhead`: 3 GiB per process, see :data:`HOST_PROCESS_BYTES`, and 3 GiB
for the system) plus the pinned checkpoints of every process on the host, plus the optimizer when it lives
there.

Calibration: measured peaks (``torch.cuda.max_memory_allocated``, whole steps and layer by layer with
``memory_probe``) against this model, which is to stay above every one of them by a few percent (measured:
bench/results/2026-11-22_training-memory.md; the per-layer windows the tests check are in
``tests/memory_measurements.json``).

On CPU the tests check the saved tensors of each checkpointing mode byte for byte
(``tests/test_memory_plan.py``).
Every coefficient is a module constant, so newer measurements can move it.

Cost model (which plan is fastest), in FLOPs per token: a layer's forward is its matmuls
(``2 x its parameters``) plus causal attention (``4 q x keys per query``), its backward twice the
matmuls plus :data:`ATTENTION_BACKWARD_FACTOR` times the attention. Layer checkpointing adds a layer's forward;
recompute-aware only its matmuls (as measured against layer checkpointing, bench/results/2026-11-22_checkpointing.md);
the tiled MLP one MLP forward per layer; the tiled loss one output-projection forward; an offloaded checkpoint
:data:`OFFLOAD_OVERHEAD` of the layer's step or the
copy time that the layer's compute does not hide, whichever is more. So spare memory buys speed:
first untiled loss and MLP, then fewer checkpointed layers, recompute-aware before layer
checkpointing, and checkpoints on the host while host memory lasts.

Optimizer states on the host: in one process (no ZeRO) AdamW runs on the host through torchao's
offload optimizer (:mod:`.optimizer_offload`): pinned host copies of every parameter and gradient
(power-of-two blocks) plus the AdamW moments; on the GPU only the weights and one layer's gradients in
flight. :func:`plan_for_training` allows it where it can run (torchao, a CUDA device, one process) and
the plan chooses it only when nothing fits with the optimizer on the GPU (its host AdamW step costs
seconds). Under ZeRO the host layout is DeepSpeed's ``offload_optimizer`` (modelled, set in the recipe).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from ..settings.schema import GROUP_MODE, ConfigError, group_heads

if TYPE_CHECKING:
    import torch

GiB = 1 << 30

# ---------------------------------------------------------------------------------------------
# Coefficients of the memory model (bytes), each documented with why.
# ---------------------------------------------------------------------------------------------

NORM_UPCAST_BYTES = 4
"""Per hidden element, per RMSNorm: Llama's RMSNorm upcasts its input to float32 and autograd keeps
that copy (for ``pow`` and the multiply by rsqrt); it also keeps the normalized input cast back (``a``
bytes, for the weight's gradient) and its output (``a`` bytes, the next projection's input)."""

NORM_SAVED_ACTIVATIONS = 2
"""The two activation-dtype tensors each RMSNorm keeps (see :data:`NORM_UPCAST_BYTES`)."""

NORM_RSQRT_BYTES = 4
"""Per token, per RMSNorm: the float32 rsqrt of the variance."""

NORMS_PER_LAYER = 2
"""input_layernorm and post_attention_layernorm."""

FUSED_NORM_KEPT_INPUTS = 2
"""Per layer, the inputs a fused RMSNorm (Liger) keeps for backward: the layer's input and the residual sum
before the MLP (transformers' norm keeps its float32 upcast instead). Measured on a tiny bf16 Llama: a layer without
checkpointing keeps exactly this model's bytes (bench/results/2026-12-04_from-modules.md). Each fused norm also keeps
its output (the next projection's input) and a float32 rsqrt per token. Under checkpointing the layer's input
is the checkpoint itself: counted twice, which leaves ``a h`` per token of margin in the recomputed layer.

What the fused norm does not change, measured layer by layer (``memory_probe``, 8B shape): the peak of a
layer's forward (the same with either norm) and the temporaries of a layer's backward (Liger's backward needs as
much as transformers' float32 ones there). A layer's backward with the fused norm needs less per token than with
transformers': the float32 upcasts it does not keep (measured: bench/results/2026-12-04_from-modules.md)."""

FORWARD_ATTENTION_TRANSIENT_HIDDEN = 13
"""Per token, in units of ``a h``: what a checkpointed layer's forward holds at its attention part (its input,
the norm's output, q, k and v before and after the rotary embedding and in the kernel's layout, the attention
output and the projection after it). Measured layer by layer (``memory_probe``), 8B shape, with either norm:
just under 13 ``a h`` per token (bench/results/2026-12-04_from-modules.md)."""

MLP_FORWARD_HIDDEN_TENSORS = 4
"""T x h tensors alive during a checkpointed layer's MLP forward besides its intermediates: the layer's input,
the residual sum, the MLP's input and its output (measured with Liger's SwiGLU: 4 ``a h`` + 3 ``a I``
per token, exactly; bench/results/2026-12-04_from-modules.md)."""

FUSED_MLP_GRAD_INTERMEDIATES = 1
"""Liger's SwiGLU backward writes d(gate) and d(up) over its saved gate(x) and up(x): of the MLP's gradients
only d(product) is a new T x I tensor (the un-fused count of 3 over-predicted a layer's backward; measured:
bench/results/2026-12-04_from-modules.md)."""

LSE_BYTES = 4
"""Per head per token: the core attention's log-sum-exp is float32."""

MLP_SAVED_INTERMEDIATES = 4
"""gate(x), up(x), act(gate(x)) and their product (the down projection's input), each T x I."""

FUSED_MLP_SAVED_INTERMEDIATES = 3
"""Liger's SwiGLU keeps gate(x) and up(x) and recomputes act(gate(x)) in backward; the down projection keeps
the product."""

MLP_GRAD_INTERMEDIATES = 3
"""MLP gradients alive together in its backward: d(product), d(gate), d(up)."""

RESIDUAL_GRAD_TENSORS = 2
"""The layer's incoming and outgoing residual-stream gradients (T x h each, activation dtype)."""

NORM_BACKWARD_FP32_TEMPS = 2
"""float32 T x h temporaries of an RMSNorm backward."""

ATTENTION_DQ_ACCUMULATOR_BYTES = 4
"""Per query element: FlashAttention-style backward kernels accumulate dq in float32."""

LOGIT_BYTES_BEYOND_ACTIVATION = 4 + 4
"""Per token and vocabulary entry, besides the logits and their gradient in activation dtype
(``2 a``): cross-entropy's float32 copy (transformers upcasts) and its float32 gradient. ``2 a + 8`` = 12 bytes for bf16
matches what the tiled loss saved (Llama-3 vocabulary; measured: bench/results/2026-11-22_training-memory.md)."""

TOKEN_INPUT_BYTES = 3 * 8
"""input_ids, position_ids and labels (int64) per token."""

ROPE_TENSORS = 2
"""cos and sin (T x head_dim, activation dtype), passed to every layer and alive all step."""

SEQUENCE_PARALLEL_KV_BUFFERS = 2
"""Ring-style sequence parallelism (zigzag, ring, distfa) holds a received K/V block and the next
one in flight (2 x the local k and v); its backward adds float32 dk/dv accumulators. Not calibrated;
backends that gather the whole K/V need more."""

OFFLOAD_IN_FLIGHT_LAYERS = 1
"""Offloaded layers whose checkpoint is on the GPU besides the one in use: in forward the copy of the
previous layer still running, in backward the prefetched next layer."""

ZERO_REDUCE_BUCKET_ELEMENTS = 500_000_000
"""DeepSpeed's default reduce_bucket_size (ZeRO-2/3): one bucket of gradients, in gradient dtype."""

ZERO3_LIVE_LAYERS = 2
"""ZeRO-3 gathers the current layer's full parameters and prefetches the next."""

DDP_BUCKET_COPIES = 1
"""DDP (gradient_as_bucket_view off, the Trainer's default) keeps its buckets: a second copy of the gradients."""

OPTIMIZER_STEP_TEMP_COPIES = 0
"""Optimizer-state-sized temporaries of the step: 0 for fused AdamW (the Trainer's default on CUDA);
the foreach implementation would need 1."""

GPU_RESERVED_BYTES = 2 * GiB
"""GPU memory the caching allocator never sees: CUDA context, cuBLAS/cuDNN workspaces, NCCL buffers."""

GPU_FRAGMENTATION = 0.08
"""Share of the GPU lost to the caching allocator's fragmentation. A plan that filled 96% of the GPU ran out of memory
with the default allocator, with nearly this share reserved but unallocated (measured:
bench/results/2026-11-22_training-memory.md); expandable_segments (which the training scripts turn on) leaves less, this
keeps the margin."""

HOST_PROCESS_BYTES = 3 * GiB
"""Host memory of one training process besides what the plan models (its pinned checkpoints and host optimizer):
Python, torch, CUDA's host side, the data: the process's peak resident memory (VmHWM) stayed about 2 GiB above
its pinned checkpoints, full 8B shape (measured: bench/results/2026-11-22_training-memory.md); 1 GiB more is margin."""

HOST_RESERVED_BYTES = 3 * GiB
"""Host memory for everything besides the training processes (the system, the page cache it cannot drop)."""


def default_host_overhead(processes_per_host: int = 1) -> int:
    """Host bytes the plan keeps free of checkpoints and optimizer states: the system plus each process's own."""
    return HOST_RESERVED_BYTES + max(1, processes_per_host) * HOST_PROCESS_BYTES

# ---------------------------------------------------------------------------------------------
# Coefficients of the cost model.
# ---------------------------------------------------------------------------------------------

ATTENTION_BACKWARD_FACTOR = 2.5
"""Attention backward / forward FLOPs: FlashAttention's backward runs 5 matmuls to the forward's 2."""

OFFLOAD_OVERHEAD = 0.01
"""Share of an offloaded layer's step spent on its copies: well under it on one GPU with side streams (measured:
bench/results/2026-11-22_checkpointing.md), counted as 1% for copies that share PCIe with NCCL traffic and for the
pinned host memory they take, so a plan offloads only where that buys a whole non-checkpointed layer or a fit."""

HOST_LINK_BYTES_PER_S = 25e9
"""Pinned host <-> GPU copy bandwidth assumed (PCIe Gen4 x16 measures ~25 GB/s, Gen5 ~50)."""

GPU_FLOPS = 400e12
"""Achieved bf16 FLOP/s assumed when a copy's time is turned into FLOPs (~40% of an H100/H200)."""

SMALL_CHUNK_PENALTY = 0.05
"""Extra cost of each halving of a tiled chunk below its default (smaller GEMMs run slower)."""

HOST_ADAM_PARAMS_PER_S = 1e9
"""Parameters per second one process's host AdamW updates (DeepSpeed CPU Adam)."""

LOSS_CHUNKS = (8192, 4096, 2048, 1024)
"""Tiled-loss chunk sizes the planner tries, preferred first (8192 is the recipes' default)."""

MLP_CHUNKS = (16384, 8192, 4096, 2048)
"""Tiled-MLP chunk sizes the planner tries, preferred first (16384: full-speed GEMMs on H100/H200)."""

CHECKPOINTING_CHOICES = ("none", "recompute_aware", "layer")
PRECISIONS_HELP = "bf16, bf16_fp32_adam, fp32_master, fp32 or fp64"


class MemoryPlanError(ConfigError):
    """No plan fits: the message names the shortfall and what would make the run fit."""


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a dense Llama-family decoder that decide its memory."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_config(cls, config) -> ModelShape:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None):
            raise ConfigError("memory: auto models dense Llama-family decoders; this model has experts: set "
                              "memory: manual and pick checkpointing, offload_checkpoints, tiled_loss by hand")
        heads = text.num_attention_heads
        return cls(hidden=text.hidden_size, layers=text.num_hidden_layers, heads=heads,
                   kv_heads=getattr(text, "num_key_value_heads", None) or heads,
                   head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
                   intermediate=text.intermediate_size, vocab=text.vocab_size,
                   tied_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
                   attention_bias=bool(getattr(text, "attention_bias", False)),
                   mlp_bias=bool(getattr(text, "mlp_bias", False)))

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_matmul_params(self) -> int:
        h = self.hidden
        return h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h + 3 * h * self.intermediate

    @property
    def layer_params(self) -> int:
        bias = (self.q_dim + 2 * self.kv_dim + self.hidden) * self.attention_bias
        bias += (2 * self.intermediate + self.hidden) * self.mlp_bias
        return self.layer_matmul_params + NORMS_PER_LAYER * self.hidden + bias

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        """The output projection and the final norm (the projection is the embedding when tied)."""
        return (0 if self.tied_embeddings else self.vocab * self.hidden) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.embedding_params + self.head_params


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each copy the training keeps, and per activation element."""

    name: str
    weight: int
    grad: int
    master: int  # float32 master weights (mixed precision), 0 when the weights are the master
    master_grad: int  # float32 gradient partition the mixed-precision optimizer keeps
    states: int  # both AdamW moments together
    activation: int


PRECISIONS = {
    # torch AdamW on a bf16 model keeps its moments in bf16 (scripts/train.py, scripts/bench_train.py)
    "bf16": Precision("bf16", 2, 2, 0, 0, 4, 2),
    "bf16_fp32_adam": Precision("bf16_fp32_adam", 2, 2, 0, 0, 8, 2),
    # DeepSpeed bf16 / mixed precision: bf16 weights and gradients, float32 master, gradients and moments
    "fp32_master": Precision("fp32_master", 2, 2, 4, 4, 8, 2),
    "fp32": Precision("fp32", 4, 4, 0, 0, 8, 4),
    "fp64": Precision("fp64", 8, 8, 0, 0, 16, 8),  # the CPU tests' exactness runs
}


def parameter_tensor_elements(shape: ModelShape) -> list[int]:
    """Elements of each parameter tensor of the model (biases left out: too small to matter)."""
    s = shape
    per_layer = [s.hidden * s.q_dim, s.hidden * s.kv_dim, s.hidden * s.kv_dim, s.q_dim * s.hidden,
                 s.hidden * s.intermediate, s.hidden * s.intermediate, s.intermediate * s.hidden, s.hidden, s.hidden]
    head = [] if s.tied_embeddings else [s.vocab * s.hidden]
    return per_layer * s.layers + [s.vocab * s.hidden, *head, s.hidden]


def pinned_parameter_bytes(shape: ModelShape, bytes_per_element: int) -> int:
    """Pinned host bytes of one copy of every parameter tensor: torch's caching host allocator rounds each
    block up to a power of two."""
    return sum(_pow2(n * bytes_per_element) for n in parameter_tensor_elements(shape))


class LayerChoice(NamedTuple):
    """How one decoder layer keeps what its backward needs."""

    checkpointing: str  # none, recompute_aware, layer, or group (inside the checkpoint of the layer layer below)
    offload: bool = False  # the checkpoint waits in pinned host memory (a group's: its first layer's flag)


def _pow2(n: int) -> int:
    return 1 << (int(n) - 1).bit_length() if n > 0 else 0


def _gib(n: float) -> str:
    return f"{n / GiB:.1f}"


class MemoryModel:
    """Peak GPU and host bytes of one training step (see the module docstring for the equations).

    Fixed: the model, tokens per GPU, sequence-parallel size, precision, ZeRO stage and ranks, tiled
    loss and MLP chunks (0: off), where the optimizer lives. :meth:`gpu_phases` and
    :meth:`host_items` take the per-layer choices.
    """

    def __init__(self, shape: ModelShape, tokens: int, sp_size: int = 1, precision: str | Precision = "bf16",
                 zero_stage: int = 0, world: int = 1, tiled_loss: int = 0, tiled_mlp: int = 0,
                 optimizer_on_host: bool = False, processes_per_host: int = 1,
                 host_overhead_bytes: int | None = None, fused_ops: bool = False):
        if zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
        if isinstance(precision, str):
            if precision not in PRECISIONS:
                raise ValueError(f"unknown precision {precision!r}; choose one of {PRECISIONS_HELP}")
            precision = PRECISIONS[precision]
        self.shape, self.tokens, self.sp_size, self.precision = shape, int(tokens), sp_size, precision
        self.zero_stage, self.world = zero_stage, max(1, world)
        self.tiled_loss, self.tiled_mlp, self.optimizer_on_host = tiled_loss, tiled_mlp, optimizer_on_host
        self.processes_per_host = max(1, processes_per_host)
        self.host_overhead_bytes = (host_overhead_bytes if host_overhead_bytes is not None
                                    else default_host_overhead(self.processes_per_host))
        self.fused_ops = fused_ops
        self._precompute()

    # per-token and per-layer terms ------------------------------------------------------------
    def _precompute(self) -> None:
        s, p, T = self.shape, self.precision, self.tokens
        a, h, q, kv, inter = p.activation, s.hidden, s.q_dim, s.kv_dim, s.intermediate
        mlp_chunk = min(self.tiled_mlp, T) if self.tiled_mlp else 0
        attention_out = a * q + LSE_BYTES * s.heads
        unfused_norm = (NORM_UPCAST_BYTES + NORM_SAVED_ACTIVATIONS * a) * h + NORM_RSQRT_BYTES
        if self.fused_ops:  # Liger's RMSNorm: output, rsqrt, and the one input nothing else keeps
            norm = a * h + NORM_RSQRT_BYTES
            norms = NORMS_PER_LAYER * norm + FUSED_NORM_KEPT_INPUTS * a * h
        else:
            norm = unfused_norm
            norms = NORMS_PER_LAYER * norm
        norm_temps = NORM_BACKWARD_FP32_TEMPS * 4 * h  # measured: the same with Liger's norm
        saved_rest = norms + a * (q + 2 * kv) + attention_out
        kept_intermediates = FUSED_MLP_SAVED_INTERMEDIATES if self.fused_ops else MLP_SAVED_INTERMEDIATES
        grad_intermediates = FUSED_MLP_GRAD_INTERMEDIATES if self.fused_ops else MLP_GRAD_INTERMEDIATES
        saved_mlp = 0 if mlp_chunk else kept_intermediates * a * inter
        sp = SEQUENCE_PARALLEL_KV_BUFFERS * a * 2 * kv + 4 * 2 * kv if self.sp_size > 1 else 0
        residual = RESIDUAL_GRAD_TENSORS * a * h
        # backward of one layer: first its MLP (with its saved intermediates), then, once those are
        # freed, norms and attention; the working set is the larger of the two sub-phases
        attention_phase = T * (residual + norm_temps + a * (q + 2 * kv)
                               + ATTENTION_DQ_ACCUMULATOR_BYTES * q + a * q + sp)
        chunk = mlp_chunk * (MLP_SAVED_INTERMEDIATES + MLP_GRAD_INTERMEDIATES) * a * inter
        mlp_grads = T * (residual + (0 if mlp_chunk else grad_intermediates * a * inter)) + chunk
        self.saved_layer = T * (saved_rest + saved_mlp)  # a layer without checkpointing keeps this
        self.checkpoint = {"none": self.saved_layer, "layer": T * a * h, "recompute_aware": T * (a * h + attention_out),
                           GROUP_MODE: 0}  # a group's one checkpoint is its first layer's
        self.host_checkpoint = {"none": 0, "layer": _pow2(T * a * h),
                                "recompute_aware": _pow2(T * a * h) + _pow2(T * a * q) + _pow2(T * LSE_BYTES * s.heads),
                                GROUP_MODE: 0}
        recomputed = {"none": 0, "layer": T * saved_rest, "recompute_aware": T * (saved_rest - attention_out)}
        self.backward_work = {m: recomputed[m] + max(attention_phase, mlp_grads + (T * saved_mlp if m != "none" else 0))
                              for m in CHECKPOINTING_CHOICES}
        # a group's layer is back-propagated as a layer-checkpointed one, while the recomputed tensors of the
        # group's layers below it wait for their own backward: each holds what a layer without checkpointing keeps
        self.backward_work[GROUP_MODE] = self.backward_work["layer"]
        self.group_held = self.saved_layer
        # forward of one layer. A checkpointed layer frees what it does not keep as it goes: its peak is the
        # larger of its attention part and its MLP part (the layer's input, the residual sum, the MLP's input and
        # output, and the MLP's intermediates of a chunk or of every token). A layer without checkpointing keeps
        # everything it saves; its peak is the un-fused size (a fused norm lowers no forward peak: measured).
        mlp_rows = mlp_chunk or T
        transient = max(T * (FORWARD_ATTENTION_TRANSIENT_HIDDEN * a * h + sp),
                        T * MLP_FORWARD_HIDDEN_TENSORS * a * h + mlp_rows * kept_intermediates * a * inter)
        forward_saved = self.saved_layer + (T * NORMS_PER_LAYER * (unfused_norm - norm) if self.fused_ops else 0)
        kept_whole = forward_saved + T * (a * h + sp) + mlp_chunk * kept_intermediates * a * inter
        self.forward_work = {"none": max(transient, kept_whole), "layer": transient, "recompute_aware": transient,
                             GROUP_MODE: transient}
        loss_chunk = min(self.tiled_loss, T) if self.tiled_loss else T
        self.loss_work = (T * (a * h + norm + a * h)  # final hidden, the final norm's tensors, d(hidden)
                          + loss_chunk * s.vocab * (2 * a + LOGIT_BYTES_BEYOND_ACTIVATION))
        self.always = T * (TOKEN_INPUT_BYTES + ROPE_TENSORS * s.head_dim * a)
        # static terms
        n, zero = self.world, self.zero_stage
        P = s.params
        shard_states = n if zero >= 1 else 1
        shard_grads = n if zero >= 2 else 1
        self.weights = P * p.weight // (n if zero == 3 else 1)
        if zero == 3:
            self.weights += ZERO3_LIVE_LAYERS * max(s.layer_params, s.embedding_params) * p.weight
        optimizer = P * (p.master + p.master_grad + p.states) // shard_states
        self.optimizer_gpu = 0 if self.optimizer_on_host else optimizer
        self.optimizer_host = optimizer if self.optimizer_on_host else 0
        self.grad_layer = s.layer_params * p.grad // shard_grads
        self.grad_head = s.head_params * p.grad // shard_grads
        self.grad_embedding = s.embedding_params * p.grad // shard_grads
        host_adamw = self.optimizer_on_host and zero == 0
        if host_adamw:  # torchao's offload optimizer: pinned copies of parameters and gradients, moments on the host
            self.optimizer_host = (pinned_parameter_bytes(s, p.weight) + pinned_parameter_bytes(s, p.grad)
                                   + P * p.states)
            # each GPU gradient is freed once its copy has left: one layer's gradients in flight
            self.grad_layer = self.grad_head = self.grad_embedding = 0
        buffers = s.layer_params * p.grad if host_adamw else 0
        if zero >= 2:
            buffers = min(P, ZERO_REDUCE_BUCKET_ELEMENTS) * p.grad
        elif zero == 0 and n > 1:
            buffers = DDP_BUCKET_COPIES * P * p.grad
        self.buffers = buffers
        self.optimizer_step_temp = OPTIMIZER_STEP_TEMP_COPIES * P * p.states // 2 // shard_states

    # phases --------------------------------------------------------------------------------
    def _static(self) -> dict[str, int]:
        return {"weights": self.weights, "optimizer": self.optimizer_gpu, "buffers": self.buffers,
                "inputs": self.always}

    def layer_items(self, layers: Sequence[LayerChoice]) -> tuple[list[dict[str, int]], list[dict[str, int]]]:
        """Itemised GPU bytes while each layer runs forward and while it runs backward (index = layer); what
        :class:`~.memory_probe.LayerPeakProbe` measures, window by window."""
        resident = [0 if c.offload else self.checkpoint[c.checkpointing] for c in layers]
        offloaded = [self.checkpoint[c.checkpointing] if c.offload else 0 for c in layers]
        in_flight = OFFLOAD_IN_FLIGHT_LAYERS * max(offloaded, default=0)
        static = self._static()
        below_ckpt = below_act = 0
        prefix = []  # checkpoints and activations the layers below a layer keep
        for r, c in zip(resident, layers):
            prefix.append((below_ckpt, below_act))
            if c.checkpointing == "none":
                below_act += r
            else:
                below_ckpt += r
        heads = group_heads([c.checkpointing for c in layers])
        forward, backward = [], []
        for i, c in enumerate(layers):
            ckpt, act = prefix[i]
            forward.append({**static, "checkpoints": ckpt, "activations": act,
                            "layer working set": self.forward_work[c.checkpointing], "offload in flight": in_flight})
            backward.append(self._backward_items(layers, i, heads[i], prefix[heads[i]], offloaded, static))
        return forward, backward

    def _backward_items(self, layers, i: int, g: int, below: tuple[int, int], offloaded: list[int],
                        static: dict[str, int]) -> dict[str, int]:
        """GPU bytes while layer ``i`` runs backward; ``g``: the first layer of its checkpoint (``i`` unless grouped).

        The checkpoint of the group (restored from the host or kept) is part of the working set; the layers of the
        group below ``i`` hold their recomputed tensors (:attr:`group_held` each) until their own backward; in
        flight: the checkpoint below the group, prefetched once the group's own is restored (both offloaded).
        """
        ckpt, act = below
        work = (self.backward_work[layers[i].checkpointing] + (i - g) * self.group_held
                + self.checkpoint[layers[g].checkpointing])
        prefetch = g > 0 and layers[g - 1].offload and layers[g].offload
        return {**static, "checkpoints": ckpt, "activations": act,
                "grads": self.grad_head + (len(layers) - i) * self.grad_layer, "layer working set": work,
                "offload in flight": offloaded[g - 1] if prefetch else 0}

    def gpu_phases(self, layers: Sequence[LayerChoice]) -> dict[str, dict[str, int]]:
        """Itemised GPU bytes of each phase of a step ({phase: {item: bytes}}): the last layer's forward, the
        loss, the backward of the layer that needs most, the optimizer step."""
        resident = [0 if c.offload else self.checkpoint[c.checkpointing] for c in layers]
        ckpt_kept = sum(r for r, c in zip(resident, layers) if c.checkpointing != "none")
        activations = sum(r for r, c in zip(resident, layers) if c.checkpointing == "none")
        static = self._static()
        forward, backward = self.layer_items(layers)
        phases = {}
        if layers:
            phases["forward"] = forward[-1]
        phases["loss"] = {**static, "checkpoints": ckpt_kept, "activations": activations,
                          "grads": self.grad_head, "logits and loss": self.loss_work}
        if backward:
            worst = max(range(len(backward) - 1, -1, -1), key=lambda i: sum(backward[i].values()))
            phases[f"backward (layer {worst})"] = backward[worst]
        phases["optimizer step"] = {**static, "grads": self.grad_head + len(layers) * self.grad_layer
                                    + self.grad_embedding, "optimizer step": self.optimizer_step_temp}
        return phases

    def gpu_peak(self, layers: Sequence[LayerChoice]) -> tuple[int, str, dict[str, int]]:
        """(bytes, phase, items) of the largest phase."""
        phase, items = max(self.gpu_phases(layers).items(), key=lambda kv: sum(kv[1].values()))
        return sum(items.values()), phase, items

    def host_items(self, layers: Sequence[LayerChoice]) -> dict[str, int]:
        """Host bytes of the whole host (every process on it)."""
        pinned = sum(self.host_checkpoint[c.checkpointing] for c in layers if c.offload)
        return {"fixed overhead": self.host_overhead_bytes, "pinned checkpoints": pinned * self.processes_per_host,
                "optimizer": self.optimizer_host * self.processes_per_host}


# ---------------------------------------------------------------------------------------------
# The cost model.
# ---------------------------------------------------------------------------------------------


class _Costs:
    """FLOPs per token of a step and of each option's extra work (module docstring, "Cost model")."""

    def __init__(self, shape: ModelShape, tokens: int, sp_size: int, attention_context: float | None,
                 precision: Precision, zero_stage: int, world: int):
        s = shape
        keys = attention_context if attention_context is not None else tokens * sp_size / 2
        self.matmul = 2 * s.layer_matmul_params
        self.attention = 4 * s.q_dim * keys
        self.layer_forward = self.matmul + self.attention
        self.layer_step = 3 * self.matmul + (1 + ATTENTION_BACKWARD_FACTOR) * self.attention
        self.head_forward = 2 * s.vocab * s.hidden
        self.base = s.layers * self.layer_step + 3 * self.head_forward
        self.mlp_forward = 2 * 3 * s.hidden * s.intermediate
        self.tokens = tokens
        a = precision.activation
        self._copy_flops = {m: b * a / HOST_LINK_BYTES_PER_S * GPU_FLOPS for m, b in
                            (("layer", s.hidden), ("recompute_aware", s.hidden + s.q_dim))}
        shard = world if zero_stage >= 1 else 1
        per_rank = s.params / shard
        seconds = (per_rank * (precision.grad + precision.weight) / HOST_LINK_BYTES_PER_S
                   + per_rank / HOST_ADAM_PARAMS_PER_S)
        self.optimizer_host = seconds * GPU_FLOPS / max(1, tokens)

    def checkpointing(self, mode: str) -> float:
        return {"none": 0.0, "layer": self.layer_forward, "recompute_aware": self.matmul,
                GROUP_MODE: self.layer_forward}[mode]

    def offload(self, mode: str) -> float:
        exposed = max(0.0, 2 * self._copy_flops[mode] - self.layer_forward)  # copies out and back, hidden by compute
        return max(OFFLOAD_OVERHEAD * self.layer_step, exposed)

    @staticmethod
    def _halvings(chunk: int, default: int) -> float:
        return max(0.0, math.log2(default / chunk)) if chunk else 0.0

    def tiling(self, tiled_loss: int, tiled_mlp: int, layers: int) -> float:
        cost = 0.0
        if tiled_loss:
            cost += self.head_forward * (1 + SMALL_CHUNK_PENALTY * self._halvings(tiled_loss, LOSS_CHUNKS[0]))
        if tiled_mlp:
            cost += layers * self.mlp_forward * (1 + SMALL_CHUNK_PENALTY * self._halvings(tiled_mlp, MLP_CHUNKS[0]))
        return cost

    def plan(self, layers: Sequence[LayerChoice], tiled_loss: int, tiled_mlp: int, optimizer_on_host: bool) -> float:
        cost = self.tiling(tiled_loss, tiled_mlp, len(layers)) + (self.optimizer_host if optimizer_on_host else 0.0)
        for c in layers:
            cost += self.checkpointing(c.checkpointing) + (self.offload(c.checkpointing) if c.offload else 0.0)
        return cost


# ---------------------------------------------------------------------------------------------
# The plan.
# ---------------------------------------------------------------------------------------------


@dataclass
class MemoryPlan:
    """The chosen memory options and what the model predicts for them; ``str(plan)`` is a short table."""

    shape: ModelShape
    tokens_per_gpu: int
    sp_size: int
    layers: tuple[LayerChoice, ...]
    tiled_loss: int
    tiled_mlp: int
    optimizer_on_host: bool
    gpu_peak: int
    gpu_phase: str
    gpu_items: dict[str, int]
    gpu_usable: int
    gpu_total: int
    host_peak: int
    host_items: dict[str, int]
    host_total: int
    step_factor: float  # estimated step time / that of no checkpointing and no tiling
    fused_ops: bool = False  # Liger's RMSNorm, RoPE and (untiled) SwiGLU (hf.fused_ops)
    layer_gpu: list[int] = field(default_factory=list)  # per layer, bytes kept on the GPU between the passes
    layer_host: list[int] = field(default_factory=list)  # per layer, pinned host bytes
    # per layer, predicted GPU bytes while it runs forward / backward (what memory_probe.LayerPeakProbe measures)
    layer_forward_peak: list[int] = field(default_factory=list)
    layer_backward_peak: list[int] = field(default_factory=list)

    @property
    def checkpointing(self) -> str:
        """The most common checkpointing mode among the checkpointed layers ("none" if none is; a group is layer
        checkpointing)."""
        modes = ["layer" if c.checkpointing == GROUP_MODE else c.checkpointing for c in self.layers
                 if c.checkpointing != "none"]
        return max(set(modes), key=modes.count) if modes else "none"

    @property
    def offloaded_layers(self) -> int:
        return sum(c.offload for c in self.layers)

    @property
    def checkpointed_layers(self) -> int:
        return sum(c.checkpointing != "none" for c in self.layers)

    def memory_options(self) -> dict:
        """Keyword arguments of :func:`~hf_longctx.hf.memory.enable.enable_memory_options` for this plan."""
        return {"checkpointing": self.checkpointing, "offload": self.offloaded_layers > 0,
                "tiled_loss": self.tiled_loss, "tiled_mlp": self.tiled_mlp, "layers": list(self.layers)}

    def apply(self, model):
        """Switch this plan's options on (returns :class:`~hf_longctx.hf.memory.enable.MemoryOptions`).

        The optimizer is the caller's: :meth:`make_optimizer` builds the one this plan assumes (the Trainer
        takes :func:`~hf_longctx.hf.memory.optimizer_offload.trainer_optimizer_cls_and_kwargs` when
        ``optimizer_on_host``; the callback refuses a Trainer whose optimizer is not it).
        """
        from .enable import enable_memory_options

        if self.fused_ops:
            from .fused_ops import enable_fused_ops, uses_fused_norms

            if not uses_fused_norms(model):  # the Trainer's use_liger_kernel may have done it already
                enable_fused_ops(model, swiglu=not self.tiled_mlp)
        return enable_memory_options(model, **self.memory_options())

    def make_optimizer(self, params, lr: float, **adamw) -> torch.optim.Optimizer:
        """AdamW where this plan keeps it: on the host (torchao's offload optimizer) or fused on the GPU."""
        import torch

        if self.optimizer_on_host:
            from .optimizer_offload import HostOffloadAdamW

            return HostOffloadAdamW(params, lr=lr, **adamw)
        return torch.optim.AdamW(params, lr=lr, fused=torch.cuda.is_available(), **adamw)

    def checkpoint_runs(self) -> list[tuple[int, int, LayerChoice, int]]:
        """Runs of consecutive checkpoints made alike: (first layer, last layer, choice, layers per checkpoint); a
        run of groups is one run, not alternating ``layer`` and ``group`` layers."""
        heads = group_heads([c.checkpointing for c in self.layers])
        units: list[list] = []  # [first, last, choice, size] per checkpoint (or per layer without one)
        for i, c in enumerate(self.layers):
            if heads[i] != i:
                units[-1][1], units[-1][3] = i, units[-1][3] + 1
            else:
                units.append([i, i, c, 1])
        runs: list[tuple[int, int, LayerChoice, int]] = []
        for first, last, c, size in units:
            if runs and runs[-1][2:] == (c, size):
                runs[-1] = (runs[-1][0], last, c, size)
            else:
                runs.append((first, last, c, size))
        return runs

    def summary(self) -> dict:
        """The plan in a few JSON-friendly keys (for logs)."""
        return {"memory": "auto", "checkpointed_layers": self.checkpointed_layers,
                "offloaded_layers": self.offloaded_layers, "checkpointing": self.checkpointing,
                "tiled_loss": self.tiled_loss, "tiled_mlp": self.tiled_mlp,
                "optimizer_on_host": self.optimizer_on_host, "fused_ops": self.fused_ops,
                "predicted_gpu_gib": round(self.gpu_peak / GiB, 1),
                "predicted_host_gib": round(self.host_peak / GiB, 1), "step_factor": round(self.step_factor, 3)}

    def __str__(self) -> str:
        s = self.shape
        head = (f"memory plan: {s.layers} layers (hidden {s.hidden}), {self.tokens_per_gpu} tokens/GPU, "
                f"sp {self.sp_size}; "
                f"GPU {_gib(self.gpu_peak)} of {_gib(self.gpu_usable)} GiB usable (peak: {self.gpu_phase}), "
                f"host {_gib(self.host_peak)} of {_gib(self.host_total)} GiB; "
                f"step ~x{self.step_factor:.2f} of no checkpointing")
        rows = [f"  {'layers':<8}{'checkpointing':<21}{'kept on':<9}{'GPU GiB':>9}{'host GiB':>10}"]
        for first, last, c, size in self.checkpoint_runs():
            span = f"{first}" if first == last else f"{first}-{last}"
            mode = c.checkpointing if size == 1 else f"{c.checkpointing}, groups of {size}"
            where = "-" if c.checkpointing == "none" else ("host" if c.offload else "GPU")
            rows.append(f"  {span:<8}{mode:<21}{where:<9}{_gib(sum(self.layer_gpu[first:last + 1])):>9}"
                        f"{_gib(sum(self.layer_host[first:last + 1])):>10}")
        other = ", ".join(f"{k} {_gib(v)}" for k, v in self.gpu_items.items()
                          if k not in ("checkpoints", "activations") and v)
        host = ", ".join(f"{k} {_gib(v)}" for k, v in self.host_items.items() if v)
        rows.append(f"  at the peak: {other} GiB; host: " + (f"{host} GiB" if host else "nothing planned"))
        opt = "host" if self.optimizer_on_host else "GPU"
        fused = "Liger RMSNorm/RoPE" + ("" if self.tiled_mlp else "/SwiGLU") if self.fused_ops else "off"
        rows.append(f"  tiled loss {self.tiled_loss or 'off'}, tiled MLP {self.tiled_mlp or 'off'}, "
                    f"optimizer on {opt}, fused ops {fused}")
        return "\n".join([head, *rows])


# ---------------------------------------------------------------------------------------------
# Budgets.
# ---------------------------------------------------------------------------------------------


def gpu_memory_bytes(device=None) -> int:
    """Total memory of the current (or given) CUDA device (torch.cuda.mem_get_info)."""
    import torch

    return int(torch.cuda.mem_get_info(device)[1])


def host_memory_bytes(available: bool = False) -> int:
    """Total (or available) host memory this process may use.

    ``HF_LONGCTX_HOST_MEMORY_GIB`` overrides it: some virtual machines report a small MemTotal that grows
    as memory is touched, and a container's limit is not what /proc/meminfo says. Otherwise psutil (or
    /proc/meminfo), capped by the cgroup's memory limit where one is set.
    """
    override = os.environ.get("HF_LONGCTX_HOST_MEMORY_GIB")
    if override:
        return int(float(override) * GiB)
    try:
        import psutil

        vm = psutil.virtual_memory()
        found = int(vm.available if available else vm.total)
    except ImportError:
        key = "MemAvailable:" if available else "MemTotal:"
        found = None
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key):
                    found = int(line.split()[1]) * 1024
        if found is None:
            raise RuntimeError("cannot read the host's memory size; set HF_LONGCTX_HOST_MEMORY_GIB") from None
    return min(found, _cgroup_limit() or found)


def _cgroup_limit() -> int | None:
    """The memory limit of this process's cgroup (v2, then v1), or None."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            return int(text)
    return None


def usable_gpu_bytes(total: int) -> int:
    """What the caching allocator can really use of a GPU of ``total`` bytes."""
    return int(total * (1 - GPU_FRAGMENTATION)) - GPU_RESERVED_BYTES


# ---------------------------------------------------------------------------------------------
# The planner.
# ---------------------------------------------------------------------------------------------


class Grouping(NamedTuple):
    """``count`` checkpoints of ``size`` consecutive layers each (``size`` 1: no groups)."""

    size: int = 1
    count: int = 0

    @property
    def layers(self) -> int:
        return self.size * self.count if self.size > 1 else 0


NO_GROUPS = Grouping()

GROUP_SIZES = (2, 3, 4)
"""Layers per group the planner tries, smallest first, and only where nothing fits without groups: a group's
backward holds the recomputed tensors of its lower layers (more memory in flight, no fewer FLOPs)."""


def _layout(L: int, n_none: int, n_layer: int, n_off: int, grouping: Grouping = NO_GROUPS) -> list[LayerChoice]:
    """Per-layer choices from counts: offloaded checkpoints first (their copies have the most time to hide),
    groups (``n_layer`` counts their layers) before recompute-aware before layer checkpointing, non-checkpointed
    layers last (their activations are used, and freed, first in backward)."""
    n_ckpt = L - n_none
    units = [["layer"] + [GROUP_MODE] * (grouping.size - 1)] * grouping.count if grouping.layers else []
    units += [["recompute_aware"]] * (n_ckpt - n_layer) + [["layer"]] * (n_layer - grouping.layers)
    return ([LayerChoice(m, i < n_off and m != GROUP_MODE) for i, unit in enumerate(units) for m in unit]
            + [LayerChoice("none")] * n_none)


@dataclass
class _Budget:
    gpu: int
    host: int


class _Search:
    """Finds the cheapest per-layer layout for one global choice (tiles, optimizer place)."""

    def __init__(self, model: MemoryModel, costs: _Costs, budget: _Budget, modes: tuple[str, ...], allow_offload: bool,
                 grouping: Grouping = NO_GROUPS):
        self.model, self.costs, self.budget, self.modes, self.allow_offload = model, costs, budget, modes, allow_offload
        self.L = model.shape.layers
        self.grouping = grouping

    def _layout(self, n_none: int, n_layer: int, n_off: int) -> list[LayerChoice]:
        return _layout(self.L, n_none, n_layer, n_off, self.grouping)

    def fits(self, layers) -> bool:
        return (self.model.gpu_peak(layers)[0] <= self.budget.gpu
                and sum(self.model.host_items(layers).values()) <= self.budget.host)

    def min_offload(self, n_none: int, n_layer: int) -> int | None:
        """Fewest offloaded layers that fit (None: nothing fits with these counts)."""
        n_ckpt = self.L - n_none
        top = n_ckpt - self.grouping.layers + self.grouping.count if self.allow_offload else 0  # checkpoints

        def gpu_ok(k):
            return self.model.gpu_peak(self._layout(n_none, n_layer, k))[0] <= self.budget.gpu

        if not gpu_ok(top):
            return None
        lo, hi = 0, top  # gpu_ok(hi) holds
        while lo < hi:
            mid = (lo + hi) // 2
            if gpu_ok(mid):
                hi = mid
            else:
                lo = mid + 1
        layers = self._layout(n_none, n_layer, lo)
        return lo if sum(self.model.host_items(layers).values()) <= self.budget.host else None

    def best(self, bound: float, fixed: float) -> tuple[float, list[LayerChoice]] | None:
        """The cheapest layout costing less than ``bound`` (or None); ``fixed``: the global choice's own cost."""
        best = None
        none_ok = "none" in self.modes
        ra_ok, layer_ok = "recompute_aware" in self.modes, "layer" in self.modes
        ckpt_cost = self.costs.checkpointing("recompute_aware" if ra_ok else "layer")
        if (ra_ok or layer_ok) and self.min_offload(0, self.L if layer_ok else 0) is None:
            return None  # not even the layout needing the least memory fits
        for n_ckpt in range(0 if none_ok else self.L, self.L + 1):
            if fixed + n_ckpt * ckpt_cost >= (best[0] if best else bound):
                break
            n_none = self.L - n_ckpt
            grouped = self.grouping.layers
            if grouped > n_ckpt or (grouped and not layer_ok):
                continue
            # fewest layer-checkpointed layers that fit (more of them: less memory)
            if ra_ok and layer_ok:
                candidates = range(grouped, n_ckpt + 1)
            else:
                candidates = [0] if ra_ok else [n_ckpt]
            found = None
            lo, hi = candidates[0], candidates[-1]
            if self.min_offload(n_none, hi) is None:
                continue
            while lo < hi:
                mid = (lo + hi) // 2
                if self.min_offload(n_none, mid) is not None:
                    hi = mid
                else:
                    lo = mid + 1
            n_off = self.min_offload(n_none, lo)
            found = self._layout(n_none, lo, n_off)
            cost = self.costs.plan(found, self.model.tiled_loss, self.model.tiled_mlp, self.model.optimizer_on_host)
            if cost < (best[0] if best else bound):
                best = (cost, found)
        return best


def _cheapest(models: list[MemoryModel], costs: _Costs, budget: _Budget, modes: tuple[str, ...], allow_offload: bool,
              groupings: list[Grouping]) -> tuple[float, list[LayerChoice], MemoryModel] | None:
    """The cheapest fitting (cost, layers, model) over the global choices and ``groupings``; at equal cost the
    earlier model (untiled first, optimizer on the GPU first) and the earlier grouping (fewer layers held) win."""
    best = None
    for model in models:
        fixed = costs.tiling(model.tiled_loss, model.tiled_mlp, model.shape.layers)
        fixed += costs.optimizer_host if model.optimizer_on_host else 0.0
        for grouping in groupings:
            if best is not None and fixed >= best[0]:
                break
            found = _Search(model, costs, budget, modes, allow_offload, grouping).best(best[0] if best else math.inf,
                                                                                    fixed)
            if found is not None:
                best = (found[0], found[1], model)
    return best


def _precision_for(precision: str | None, zero_stage: int) -> str:
    return precision or ("fp32_master" if zero_stage else "bf16")


def plan_memory(config, tokens_per_gpu: int, sp_size: int = 1, gpu_bytes: int | None = None,
                host_bytes: int | None = None, zero_stage: int = 0, world: int = 1, *,
                precision: str | None = None, modes: Sequence[str] = CHECKPOINTING_CHOICES,
                allow_offload: bool = True, allow_optimizer_on_host: bool = False,
                tiled_loss: int | None = None, tiled_mlp: int | None = None,
                host_overhead_bytes: int | None = None, processes_per_host: int = 1,
                attention_context: float | None = None, fused_ops: bool | None = None,
                optimizer_on_host: bool | None = None, allow_groups: bool = True) -> MemoryPlan:
    """The fastest memory plan for ``tokens_per_gpu`` tokens per GPU that fits the GPU and the host.

    ``config``: a transformers config (or a :class:`ModelShape`). ``gpu_bytes``: the GPU's total
    memory (default: torch.cuda.mem_get_info of the current device); the plan keeps under
    :func:`usable_gpu_bytes` of it. ``host_bytes``: the host's total memory (default: psutil or
    /proc/meminfo), shared by ``processes_per_host`` processes and ``host_overhead_bytes`` of
    everything else. ``precision``: ``bf16`` (bf16 weights, gradients and AdamW moments, what a
    bf16 model with torch AdamW keeps), ``bf16_fp32_adam``, ``fp32_master`` (DeepSpeed bf16: float32
    master weights, gradients and moments; the default under ZeRO) or ``fp32``. ZeRO ``zero_stage``
    shards over ``world`` ranks. ``modes``: the checkpointing modes allowed per layer.
    ``tiled_loss`` / ``tiled_mlp``: a chunk size fixes it (0: off), None lets the planner choose.
    ``attention_context``: mean keys per query for the cost model (default: one document over the
    whole context). ``fused_ops``: the model runs Liger's fused RMSNorm/RoPE/SwiGLU (:mod:`.fused_ops`), which
    keeps less per layer; None: wherever they can run here. ``optimizer_on_host``: where AdamW is (an optimizer
    that already exists); None lets the plan choose (the host only with ``allow_optimizer_on_host``).
    ``allow_groups``: where nothing fits otherwise, checkpoint groups of 2-4 layers as one (:data:`GROUP_SIZES`).
    Raises :class:`MemoryPlanError` naming the shortfall and what would fit.
    """
    shape = config if isinstance(config, ModelShape) else ModelShape.from_config(config)
    tokens = int(tokens_per_gpu)
    if tokens < 1:
        raise ValueError(f"tokens_per_gpu must be positive, got {tokens_per_gpu!r}")
    modes = tuple(modes)
    unknown = [m for m in modes if m not in CHECKPOINTING_CHOICES]
    if unknown or not modes:
        raise ValueError(f"modes must be some of {CHECKPOINTING_CHOICES}, got {modes!r}")
    gpu_total = int(gpu_bytes) if gpu_bytes is not None else gpu_memory_bytes()
    host_total = int(host_bytes) if host_bytes is not None else host_memory_bytes()
    if fused_ops is None:
        from .fused_ops import fused_ops_available

        fused_ops = fused_ops_available()
    settings = dict(sp_size=sp_size, precision=_precision_for(precision, zero_stage), zero_stage=zero_stage,
                    world=world, processes_per_host=processes_per_host, host_overhead_bytes=host_overhead_bytes,
                    fused_ops=bool(fused_ops))
    budget = _Budget(usable_gpu_bytes(gpu_total), host_total)
    if optimizer_on_host is not None:
        places = [bool(optimizer_on_host)]
        allow_optimizer_on_host = bool(optimizer_on_host)
    else:
        places = [False, True] if allow_optimizer_on_host else [False]
    # groups only where nothing fits without them; not under ZeRO-3/FSDP, whose hooks gather each layer's weights
    group = allow_groups and "layer" in modes and zero_stage != 3
    groupings = [Grouping(k, n) for k in GROUP_SIZES for n in range(1, shape.layers // k + 1)] if group else []

    def cheapest(t: int, any_fit: bool = False):
        """The cheapest plan for ``t`` tokens, or None. ``any_fit``: only whether one fits, so only the
        finest tiles (the least memory) are tried."""
        loss_options = [tiled_loss] if tiled_loss is not None else [0, *[c for c in LOSS_CHUNKS if c < t]]
        mlp_options = [tiled_mlp] if tiled_mlp is not None else [0, *[c for c in MLP_CHUNKS if c < t]]
        if any_fit:
            loss_options, mlp_options = loss_options[-1:], mlp_options[-1:]
        if zero_stage == 3:  # the chunked backward reads weights ZeRO-3 has freed (see tiled_mlp)
            mlp_options = [0]
        costs = _Costs(shape, t, sp_size, attention_context, PRECISIONS[settings["precision"]], zero_stage, world)
        models = [MemoryModel(shape, t, tiled_loss=loss, tiled_mlp=mlp, optimizer_on_host=on_host, **settings)
                  for on_host in places for loss in loss_options for mlp in mlp_options]
        best = _cheapest(models, costs, budget, modes, allow_offload, [NO_GROUPS])
        if best is None and groupings:
            best = _cheapest(models, costs, budget, modes, allow_offload, groupings)
        return best, costs

    best, costs = cheapest(tokens)
    if best is None:
        grouped_fits = (lambda t: cheapest(t, any_fit=True)[0] is not None) if groupings else None
        raise MemoryPlanError(_no_fit_message(shape, tokens, gpu_total, host_total, modes, allow_offload,
                                              allow_optimizer_on_host, tiled_loss, tiled_mlp, settings, grouped_fits))
    cost, layers, model = best
    peak, phase, items = model.gpu_peak(layers)
    host = model.host_items(layers)
    forward, backward = model.layer_items(layers)
    return MemoryPlan(shape=shape, tokens_per_gpu=tokens, sp_size=sp_size, layers=tuple(layers),
                      tiled_loss=model.tiled_loss, tiled_mlp=model.tiled_mlp, optimizer_on_host=model.optimizer_on_host,
                      fused_ops=model.fused_ops,
                      gpu_peak=peak, gpu_phase=phase, gpu_items=items, gpu_usable=budget.gpu, gpu_total=gpu_total,
                      host_peak=sum(host.values()), host_items=host, host_total=host_total,
                      step_factor=(costs.base + cost) / costs.base,
                      layer_gpu=[0 if c.offload else model.checkpoint[c.checkpointing] for c in layers],
                      layer_host=[model.host_checkpoint[c.checkpointing] if c.offload else 0 for c in layers],
                      layer_forward_peak=[sum(it.values()) for it in forward],
                      layer_backward_peak=[sum(it.values()) for it in backward])


# ---------------------------------------------------------------------------------------------
# When nothing fits: the shortfall and what would fit.
# ---------------------------------------------------------------------------------------------


def _longest_grouped(known: int, tokens: int, fits) -> int:
    """The longest length below ``tokens`` that ``fits`` (group checkpointing allowed) accepts, at least
    ``known`` (what fits layer by layer), searched in steps of 1024 tokens: each try is a full plan search."""
    step = 1024
    lo, hi = known // step, (tokens - 1) // step  # in units of ``step``: lo fits (or is 0), hi may not
    if hi <= lo or not fits(max(1, (lo + 1) * step)):
        return known
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * step):
            lo = mid
        else:
            hi = mid - 1
    return lo * step


def _least_memory(shape, tokens, gpu_total, host_total, modes, allow_offload, on_host, tiled_loss, tiled_mlp,
                  settings) -> tuple[bool, int, int, MemoryModel, list[LayerChoice]]:
    """(fits, GPU bytes, host bytes) of the plan needing the least GPU memory that the host allows."""
    settings = dict(settings)
    zero3 = settings["zero_stage"] == 3
    loss = tiled_loss if tiled_loss is not None else (LOSS_CHUNKS[-1] if LOSS_CHUNKS[-1] < tokens else 0)
    mlp = 0 if zero3 else (tiled_mlp if tiled_mlp is not None else (MLP_CHUNKS[-1] if MLP_CHUNKS[-1] < tokens else 0))
    model = MemoryModel(shape, tokens, tiled_loss=loss, tiled_mlp=mlp, optimizer_on_host=on_host, **settings)
    mode = "layer" if "layer" in modes else ("recompute_aware" if "recompute_aware" in modes else "none")
    L = shape.layers
    n_none = L if mode == "none" else 0
    n_layer = L - n_none if mode == "layer" else 0
    # offload as many layers as the host takes
    n_off = 0
    if allow_offload and mode != "none":
        lo, hi = 0, L
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if sum(model.host_items(_layout(L, n_none, n_layer, mid)).values()) <= host_total:
                lo = mid
            else:
                hi = mid - 1
        n_off = lo
    layers = _layout(L, n_none, n_layer, n_off)
    gpu = model.gpu_peak(layers)[0]
    host = sum(model.host_items(layers).values())
    return gpu <= usable_gpu_bytes(gpu_total) and host <= host_total, gpu, host, model, layers


def _no_fit_message(shape, tokens, gpu_total, host_total, modes, allow_offload, allow_opt, tiled_loss, tiled_mlp,
                    settings, grouped_fits=None) -> str:
    """The shortfall and what would fit. The bounds price layer-by-layer layouts (cheap to bisect);
    ``grouped_fits(tokens)``, where group checkpointing is allowed, raises the shorter-context bound to
    what groups fit."""
    sp, world = settings["sp_size"], settings["world"]

    def fits(t, sp_size=sp, world_size=world, host=host_total, on_host=allow_opt, **changes):
        s = dict(settings, sp_size=sp_size, world=world_size, **changes)
        return any(_least_memory(shape, t, gpu_total, host, modes, allow_offload, place, tiled_loss, tiled_mlp, s)[0]
                   for place in ([False, True] if on_host else [False]))

    _, gpu, host, model, layers = _least_memory(shape, tokens, gpu_total, host_total, modes, allow_offload, allow_opt,
                                                tiled_loss, tiled_mlp, settings)
    usable = usable_gpu_bytes(gpu_total)
    off = sum(c.offload for c in layers)
    what = (f"the plan needing the least GPU memory ({layers[0].checkpointing} checkpointing on every layer, "
            f"{off} of {shape.layers} checkpoints on the host, tiled loss {model.tiled_loss or 'off'}, tiled MLP "
            f"{model.tiled_mlp or 'off'})")
    lines = [f"{tokens} tokens per GPU do not fit: {what} needs {_gib(gpu)} GiB of GPU memory, "
             f"{_gib(usable)} GiB usable of {_gib(gpu_total)}"]
    if host > host_total:
        lines[0] += f"; and {_gib(host)} GiB of host memory, the host has {_gib(host_total)}"
    hints = []
    context = tokens * sp
    # more GPUs for the same context: as configured, else with DeepSpeed ZeRO sharding the optimizer
    sharded = [({}, "")] + [({"zero_stage": z, "precision": "fp32_master"}, f" under DeepSpeed ZeRO-{z}")
                            for z in (2, 3) if settings["zero_stage"] < z]
    for changes, how in sharded:
        more = next((n for n in range(sp + 1, 1025)
                     if fits(math.ceil(context / n), n, world * n // sp, **changes)), None)
        if more is not None:
            hints.append(f"sequence parallelism over {more} GPUs{how} (sp_size {more}: {math.ceil(context / more)} "
                         f"tokens per GPU for the same {context}-token context, each GPU with this much GPU and "
                         "host memory)")
            break
    lo, hi = 0, tokens - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    grouped = _longest_grouped(lo, tokens, grouped_fits) if grouped_fits is not None else lo
    if grouped > lo:
        hints.append(f"a shorter context: at most {grouped} tokens per GPU fit here with group checkpointing "
                     f"({grouped * sp} tokens over sp_size {sp})")
    elif lo > 0:
        hints.append(f"a shorter context: at most {lo} tokens per GPU fit here ({lo * sp} tokens over sp_size {sp})")
    if allow_offload and gpu > usable:
        full = sum(model.host_items(_layout(shape.layers, 0, shape.layers, shape.layers)).values())
        if off < shape.layers and full > host_total:
            full_fits = _least_memory(shape, tokens, gpu_total, full, modes, allow_offload, allow_opt, tiled_loss,
                                      tiled_mlp, settings)[0]
            if full_fits:
                hints.append(f"more host memory: {_gib(full)} GiB (has {_gib(host_total)}) to offload every "
                             "layer's checkpoint")
    if not allow_opt and fits(tokens, on_host=True):
        hints.append("the optimizer states on the host (allow_optimizer_on_host=True: torchao's offload optimizer "
                     "in one process, pip install 'hf_longctx[offload]'; DeepSpeed's offload_optimizer under ZeRO)")
    if not hints:
        hints.append("none found among sequence parallelism up to 1024 GPUs, more host memory or a shorter context")
    return lines[0] + ". Would fit: " + "; or ".join(hints)


# ---------------------------------------------------------------------------------------------
# A training run's plan (recipe key ``memory: auto``).
# ---------------------------------------------------------------------------------------------

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
                      optimizer=None) -> MemoryPlan:
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
    a CUDA device, no ZeRO or FSDP). ``optimizer``: the optimizer the run already has (the Trainer's): the
    plan takes its place as given, and a plan that needs AdamW on the host while it is on the GPU says so.
    """
    from ..settings.launcher import requested_fsdp_version

    config = getattr(model, "config", model)
    plugin = getattr(args, "deepspeed_plugin", None) if args is not None else None
    # FSDP2 keeps what ZeRO-3 keeps: weights, gradients and optimizer states sharded over the world and one
    # or two layers gathered at a time, in the model's own dtype (no float32 master copy); the tiled loss
    # is refused under it (see hf.fsdp)
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
    if allow_optimizer_on_host is None:
        allow_optimizer_on_host = (on_gpu and zero == 0 and not fsdp and world == 1
                                   and optimizer_offload_available(device))
    common = dict(sp_size=sp_size, zero_stage=zero, world=world, precision=precision, fused_ops=fused_ops,
                  allow_optimizer_on_host=allow_optimizer_on_host, optimizer_on_host=fixed_place,
                  modes=_MODES_OF_RECIPE[cfg.checkpointing], tiled_loss=0 if fsdp else (cfg.tiled_loss or None),
                  tiled_mlp=cfg.tiled_mlp or None, processes_per_host=ppn)
    if on_gpu:
        plan = plan_memory(config, tokens_per_gpu, gpu_bytes=gpu_memory_bytes(device), **common)
    else:
        budget = host_memory_bytes(available=True) // ppn
        plan = plan_memory(config, tokens_per_gpu, gpu_bytes=budget, host_bytes=budget, allow_offload=False,
                           host_overhead_bytes=0, **common)
    check_optimizer_place(plan, optimizer)
    return plan


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
