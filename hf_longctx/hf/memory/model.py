"""The memory model of one training step at long context: peak GPU and host bytes of a choice of memory options.

The model (:class:`MemoryModel`) predicts the peak GPU bytes of one step as the largest of its
phases, and the peak host bytes, for per-layer choices (:class:`LayerChoice`) that the planner
(:mod:`.search`) compares. All sizes are bytes; ``T`` is tokens per GPU, ``a`` the bytes of
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
  gradients, float32 norm temporaries, dq/dk/dv, the kernel's float32 dq accumulator, d(out)), as torch's
  FlashAttention-2 needs it; another kernel's differs by its own buffers (:mod:`.kernel_buffers`).

* ``group`` (a run of ``k`` layers under ONE checkpoint, its first layer's ``a h``): ``k`` times fewer checkpoints;
  the backward of the group's ``p``-th layer (from 0) also holds the recomputed tensors of the ``p`` layers below
  it in the group, ``saved`` each. The planner groups layers (2-4 a group) only where nothing fits without
  groups; a grouped layer costs what a layer-checkpointed one does (one recompute).

Phases of a step (GPU): the last layer's forward; the loss (every kept checkpoint, the final hidden
states and the logits: ``T x V x (2 a + 8)`` for the logits, their float32 copy, its gradient and
the gradient cast back, or one chunk's with the tiled loss, and the output projection's gradient:
:data:`LOSS_HEAD_GRADIENT_COPIES`); each layer's backward (the checkpoints of the layers
below it, the gradients of the layers above it, its own working set); the optimizer step. Static
terms: weights, gradients, optimizer states and master weights as the precision and the ZeRO stage
put them. Host: an overhead (:func:`default_host_overhead`: 3 GiB per process, see :data:`HOST_PROCESS_BYTES`, and 3 GiB
for the system) plus the pinned checkpoints of every process on the host, plus the optimizer when it lives
there. Optimizer states on the host: in one process (no ZeRO) torchao's offload optimizer
(:mod:`.optimizer_offload`): pinned host copies of every parameter and gradient (power-of-two blocks) plus the
AdamW moments (in the parameters' dtype, or torchao's 8- or 4-bit blocks: :mod:`.adam_states`); on the GPU only
the weights and one layer's gradients in flight. Under ZeRO the host layout is DeepSpeed's ``offload_optimizer``.

Calibration: measured peaks (``torch.cuda.max_memory_allocated``, whole steps and layer by layer with
:mod:`.layer_peaks`) against this model, which is to stay above every one of them by a few percent (measured:
bench/results/2026-11-22_training-memory.md; the per-layer windows the tests check are in
``tests/memory_measurements.json``).

On CPU the tests check the saved tensors of each checkpointing mode byte for byte
(``tests/test_memory_plan.py``).
Every coefficient is a module constant, so newer measurements can move it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ..settings.schema import GROUP_MODE, ConfigError, group_heads
from .adam_states import AdamStates
from .kernel_buffers import CALIBRATION_KERNEL, backward_bytes_beyond_torch_flash

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
is the checkpoint itself, which a layer's backward counts once (:attr:`MemoryModel.input_is_checkpoint`).

What the fused norm does not change, measured layer by layer (:mod:`.layer_peaks`, 8B shape): the peak of a
checkpointed layer's forward (the same with either norm; a layer without checkpointing peaks lower with it:
:data:`FUSED_NORM_FORWARD_UPCAST`) and the temporaries of a layer's backward (Liger's backward needs as
much as transformers' float32 ones there). A layer's backward with the fused norm needs less per token than with
transformers': the float32 upcasts it does not keep (measured: bench/results/2026-12-04_from-modules.md)."""

FORWARD_ATTENTION_TRANSIENT_HIDDEN = 8
"""Per token, in units of ``a h``: what a checkpointed layer's forward holds at its attention part (its input,
the norm's output, q, k and v before and after the rotary embedding, the attention output and the projection after
it), with a kernel of :data:`LAYER_MEASURED_KERNELS`. Measured layer by layer (:mod:`.layer_peaks`), 8B shape,
torch_flash and FlashAttention-4, either norm, 64K to 512K tokens: at most 6.9 ``a h``
(bench/results/2026-12-08_planner-refit-h100-peers.md); 8 keeps the margin."""

UNMEASURED_FORWARD_ATTENTION_TRANSIENT_HIDDEN = 13
"""The same with any other kernel: what the layers needed on 2026-11-24 with kernel ``auto`` on a GPU without
FlashAttention-4 (cuDNN's kernels where installed and serving, whose wrappers may copy q, k, v and the output onto
their grid, torch's FlashAttention-2 elsewhere): just under 13 ``a h``. An upper bound until such a kernel's layers
are measured."""

LAYER_MEASURED_KERNELS = ("torch_flash", "fa4")
"""Kernels whose decoder layers were measured whole, forward and backward, with the current code
(:data:`FORWARD_ATTENTION_TRANSIENT_HIDDEN`, :data:`ATTENTION_BACKWARD_OVERLAP_BYTES`)."""

FUSED_NORM_FORWARD_UPCAST = 4
"""Per hidden element, per norm: what the forward of a layer without checkpointing holds with Liger's RMSNorm beyond
what it keeps, the size of a float32 copy of the norm's input. Measured layer by layer (8B shape, both kernels, 128K
to 512K): such a layer's forward peaked 46-55 KiB per token under the size of transformers' norm, whose
``(4 + a) h`` per norm the model counted before (bench/results/2026-12-08_planner-refit-h100-peers.md); this
keeps 32 KiB of the 48."""

ATTENTION_BACKWARD_OVERLAP_BYTES = 10 << 10
"""Per token, with a kernel of :data:`LAYER_MEASURED_KERNELS`: what the attention part of a layer's backward needs
less than the sum of its terms (residual-stream gradients, the norm's float32 temporaries, dq/dk/dv, the kernel's
buffers, d(out)), which are not all alive at once. Measured layer by layer with either kernel and either norm (8B
shape, 64K to 512K, the tiled MLP): 12.0 to 17.5 KiB per token below the sum
(bench/results/2026-12-08_planner-refit-h100-peers.md); 10 keeps the margin. The runs of 2026-11-24
with kernel ``auto`` (:data:`UNMEASURED_FORWARD_ATTENTION_TRANSIENT_HIDDEN`) needed 5-8 KiB per token more there."""

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

LOSS_HEAD_GRADIENT_COPIES = 2
"""Copies of the output projection's gradient alive during the loss's backward with the tiled loss: autograd sums the
chunks' gradients of the weight in its input buffer before the weight's ``.grad`` exists, so the sum of the chunks
done so far and the chunk being added (``vocab x h`` each) are there together. Only after the last chunk does the
sum become ``.grad`` and the hooks run (a host optimizer's copy, ZeRO's reduce). One copy without tiling. Found in
the last layer's measured window, which holds the loss's backward (:mod:`.layer_peaks`): with AdamW on the host,
where the model had counted no gradient there, it was 0.6 GiB above the loss phase of the model (8B shape, 128K and
256K, both kernels; bench/results/2026-12-08_planner-refit-h100-peers.md)."""

OPTIMIZER_STEP_TEMP_COPIES = 0
"""Optimizer-state-sized temporaries of the step: 0 for fused AdamW (the Trainer's default on CUDA);
the foreach implementation would need 1."""

LOW_BIT_STEP_FLOAT32_COPIES = 3
"""torchao's low-bit AdamW steps one parameter at a time in float32 (the two moments dequantized and the parameter):
at most this many float32 copies of the largest parameter tensor, where it runs on the GPU. Not measured: an upper
bound, since the compiled step may fuse them away."""

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


CHECKPOINTING_CHOICES = ("none", "recompute_aware", "layer")
PRECISIONS_HELP = "bf16, bf16_fp32_adam, fp32_master, fp32 or fp64"


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


def format_gib(n: float) -> str:
    """Bytes as GiB with one decimal, as the plan's table and messages print them."""
    return f"{n / GiB:.1f}"


def usable_gpu_bytes(total: int) -> int:
    """What the caching allocator can really use of a GPU of ``total`` bytes."""
    return int(total * (1 - GPU_FRAGMENTATION)) - GPU_RESERVED_BYTES



class MemoryModel:
    """Peak GPU and host bytes of one training step (see the module docstring for the equations).

    Fixed: the model, tokens per GPU, sequence-parallel size, precision, ZeRO stage and ranks, tiled
    loss and MLP chunks (0: off), where the optimizer lives. :meth:`gpu_phases` and
    :meth:`host_items` take the per-layer choices.
    """

    def __init__(self, shape: ModelShape, tokens: int, sp_size: int = 1, precision: str | Precision = "bf16",
                 zero_stage: int = 0, world: int = 1, tiled_loss: int = 0, tiled_mlp: int = 0,
                 optimizer_on_host: bool = False, processes_per_host: int = 1,
                 host_overhead_bytes: int | None = None, fused_ops: bool = False,
                 kernel: str = CALIBRATION_KERNEL, adam_states: AdamStates | None = None):
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
        self.kernel = kernel
        self.adam_states = adam_states or AdamStates()
        if self.adam_states.low_bit and precision.master:
            raise ValueError(f"AdamW's {self.adam_states.bits}-bit states are torchao's optimizer, which updates the "
                             f"parameters themselves; precision {precision.name!r} keeps float32 master weights "
                             "(DeepSpeed's optimizer): plan it with bits None")
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
        attention_phase += backward_bytes_beyond_torch_flash(self.kernel, s.heads, s.kv_heads, s.head_dim, a, T)
        measured_layers = self.kernel in LAYER_MEASURED_KERNELS
        attention_phase -= T * ATTENTION_BACKWARD_OVERLAP_BYTES if measured_layers else 0
        chunk = mlp_chunk * (MLP_SAVED_INTERMEDIATES + MLP_GRAD_INTERMEDIATES) * a * inter
        mlp_grads = T * (residual + (0 if mlp_chunk else grad_intermediates * a * inter)) + chunk
        self.saved_layer = T * (saved_rest + saved_mlp)  # a layer without checkpointing keeps this
        self.checkpoint = {"none": self.saved_layer, "layer": T * a * h, "recompute_aware": T * (a * h + attention_out),
                           GROUP_MODE: 0}  # a group's one checkpoint is its first layer's
        self.host_checkpoint = {"none": 0, "layer": _pow2(T * a * h),
                                "recompute_aware": _pow2(T * a * h) + _pow2(T * a * q) + _pow2(T * LSE_BYTES * s.heads),
                                GROUP_MODE: 0}
        recomputed = {"none": 0, "layer": T * saved_rest, "recompute_aware": T * (saved_rest - attention_out)}
        # the fused norm keeps the layer's input, which under checkpointing is the checkpoint (counted on its own)
        self.input_is_checkpoint = T * a * h if self.fused_ops else 0
        self.backward_work = {m: recomputed[m] + max(attention_phase, mlp_grads + (T * saved_mlp if m != "none" else 0))
                              - (self.input_is_checkpoint if m != "none" else 0) for m in CHECKPOINTING_CHOICES}
        # a group's layer is back-propagated as a layer-checkpointed one whose input is not the checkpoint, while the
        # recomputed tensors of the group's layers below it wait for their own backward: each holds what a layer
        # without checkpointing keeps (the first of them, the group's checkpoint among them)
        self.backward_work[GROUP_MODE] = self.backward_work["layer"] + self.input_is_checkpoint
        self.group_held = self.saved_layer
        # forward of one layer. A checkpointed layer frees what it does not keep as it goes: its peak is the
        # larger of its attention part and its MLP part (the layer's input, the residual sum, the MLP's input and
        # output, and the MLP's intermediates of a chunk or of every token). A layer without checkpointing keeps
        # everything it saves, with the fused norm a float32 copy of each norm's input beside (measured).
        mlp_rows = mlp_chunk or T
        attention_transient = (FORWARD_ATTENTION_TRANSIENT_HIDDEN if measured_layers
                               else UNMEASURED_FORWARD_ATTENTION_TRANSIENT_HIDDEN)
        transient = max(T * (attention_transient * a * h + sp),
                        T * MLP_FORWARD_HIDDEN_TENSORS * a * h + mlp_rows * kept_intermediates * a * inter)
        fused_norm_upcasts = T * NORMS_PER_LAYER * FUSED_NORM_FORWARD_UPCAST * h
        forward_saved = self.saved_layer + (fused_norm_upcasts if self.fused_ops else 0)
        kept_whole = forward_saved + T * (a * h + sp) + mlp_chunk * kept_intermediates * a * inter
        self.forward_work = {"none": max(transient, kept_whole), "layer": transient, "recompute_aware": transient,
                             GROUP_MODE: transient}
        loss_chunk = min(self.tiled_loss, T) if self.tiled_loss else T
        self.loss_work = (T * (a * h + norm + a * h)  # final hidden, the final norm's tensors, d(hidden)
                          + loss_chunk * s.vocab * (2 * a + LOGIT_BYTES_BEYOND_ACTIVATION))
        self.always = T * (TOKEN_INPUT_BYTES + ROPE_TENSORS * s.head_dim * a)
        # the head's gradient is whole on every rank until the hooks after its last chunk (ZeRO reduces it then)
        self.loss_head_grads = ((LOSS_HEAD_GRADIENT_COPIES if loss_chunk < T else 1)
                                * s.vocab * h * p.grad)
        # static terms
        n, zero = self.world, self.zero_stage
        P = s.params
        shard_states = n if zero >= 1 else 1
        shard_grads = n if zero >= 2 else 1
        self.weights = P * p.weight // (n if zero == 3 else 1)
        if zero == 3:
            self.weights += ZERO3_LIVE_LAYERS * max(s.layer_params, s.embedding_params) * p.weight
        states = P * p.states
        if self.adam_states.low_bit:  # torchao quantizes tensor by tensor; what the list leaves out stays plain
            elements = parameter_tensor_elements(s)
            states = self.adam_states.state_bytes(elements, p.states // 2) + max(0, P - sum(elements)) * p.states
        optimizer = (P * (p.master + p.master_grad) + states) // shard_states
        self.optimizer_gpu = 0 if self.optimizer_on_host else optimizer
        self.optimizer_host = optimizer if self.optimizer_on_host else 0
        self.grad_layer = s.layer_params * p.grad // shard_grads
        self.grad_head = s.head_params * p.grad // shard_grads
        self.grad_embedding = s.embedding_params * p.grad // shard_grads
        host_adamw = self.optimizer_on_host and zero == 0
        if host_adamw:  # torchao's offload optimizer: pinned copies of parameters and gradients, moments on the host
            self.optimizer_host = (pinned_parameter_bytes(s, p.weight) + pinned_parameter_bytes(s, p.grad)
                                   + states)
            # each GPU gradient is freed once its copy has left: one layer's gradients in flight
            self.grad_layer = self.grad_head = self.grad_embedding = 0
        buffers = s.layer_params * p.grad if host_adamw else 0
        if zero >= 2:
            buffers = min(P, ZERO_REDUCE_BUCKET_ELEMENTS) * p.grad
        elif zero == 0 and n > 1:
            buffers = DDP_BUCKET_COPIES * P * p.grad
        self.buffers = buffers
        self.optimizer_step_temp = OPTIMIZER_STEP_TEMP_COPIES * P * p.states // 2 // shard_states
        if self.adam_states.low_bit and not self.optimizer_on_host:
            self.optimizer_step_temp += LOW_BIT_STEP_FLOAT32_COPIES * 4 * max(parameter_tensor_elements(s)) \
                // shard_states

    # phases --------------------------------------------------------------------------------
    def _static(self) -> dict[str, int]:
        return {"weights": self.weights, "optimizer": self.optimizer_gpu, "buffers": self.buffers,
                "inputs": self.always}

    def layer_items(self, layers: Sequence[LayerChoice]) -> tuple[list[dict[str, int]], list[dict[str, int]]]:
        """Itemised GPU bytes while each layer runs forward and while it runs backward (index = layer); what
        :class:`~.layer_peaks.LayerPeakProbe` measures, window by window."""
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
            below_head = heads[heads[i] - 1] if heads[i] > 0 else None
            backward.append(self._backward_items(layers, i, heads[i], below_head, prefix[heads[i]], offloaded, static))
        return forward, backward

    def _backward_items(self, layers, i: int, g: int, below_head: int | None, below: tuple[int, int],
                        offloaded: list[int], static: dict[str, int]) -> dict[str, int]:
        """GPU bytes while layer ``i`` runs backward; ``g``: the first layer of its checkpoint (``i`` unless grouped);
        ``below_head``: the first layer of the checkpoint below ``g``'s.

        The checkpoint of the group (restored from the host or kept) is part of the working set; the layers of the
        group below ``i`` hold their recomputed tensors (:attr:`group_held` each, the group's checkpoint counted
        once) until their own backward; in flight: the checkpoint below, prefetched once the group's own is restored
        (both offloaded; where the layers below are a group too, its first layer's checkpoint).
        """
        ckpt, act = below
        held = (i - g) * self.group_held - (self.input_is_checkpoint if i > g else 0)
        work = self.backward_work[layers[i].checkpointing] + held + self.checkpoint[layers[g].checkpointing]
        prefetch = below_head is not None and layers[below_head].offload and layers[g].offload
        return {**static, "checkpoints": ckpt, "activations": act,
                "grads": self.grad_head + (len(layers) - i) * self.grad_layer, "layer working set": work,
                "offload in flight": offloaded[below_head] if prefetch else 0}

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
                          "grads": max(self.grad_head, self.loss_head_grads), "logits and loss": self.loss_work}
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

