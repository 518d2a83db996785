"""What each single-device attention kernel allocates beyond its inputs and outputs, for the memory planner.

A layer's backward peaks inside its attention kernel's backward, where kernels differ most: FlashAttention-style
backwards accumulate dq in float32 and add per-document padding rows; torch's FlashAttention-2 writes every query
head's dK and dV (the GQA-expanded gradients, in the input dtype) and sums them afterwards, where FlashAttention-4
accumulates dK and dV per KV head in float32. :func:`kernel_buffer_bytes` states each kernel's buffers from how
its library allocates them (the sources are named per kernel below); ``scripts/bench_kernel_memory.py`` measures
them on a GPU and ``tests/gpu/test_kernel_buffers_gpu.py`` holds the two together.

The memory model (:mod:`.model`) was calibrated with torch's FlashAttention-2 (every whole-step and layer-by-layer
measurement before kernels were told apart), so it counts another kernel's backward as torch's plus the difference
of their buffers (:func:`backward_bytes_beyond_torch_flash`), per token at a planned document length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

PADDED_ROWS_PER_DOCUMENT = 128
"""Rows a FlashAttention backward pads each document's float32 buffers to (torch's FlashAttention-2 adds 128 per
document to its dq accumulator and softmax_d; FlashAttention-4 rounds each document up to its tile, at most 128)."""

PLANNED_DOCUMENT_TOKENS = 1024
"""Mean document length the planner assumes for the per-document padding: short for long-context packing
(ProLong's mix at 512K tokens averages 4K), so rows of shorter documents rarely pad more than planned."""

CALIBRATION_KERNEL = "torch_flash"
"""The kernel the memory model's constants were measured with."""

SMALL_TENSOR_BYTES = 64 << 10
"""Per call: the small tensors a call allocates besides its buffers (offsets, RNG state, scheduler metadata), each
rounded up to the caching allocator's 512-byte blocks."""

UNMEASURED_KERNELS = ("cudnn_varlen", "cudnn")
"""Kernels counted with an upper bound until measured (``scripts/bench_kernel_memory.py``): torch
FlashAttention-2's buffers, copies of q, k, v, out and d(out) (what the cuDNN wrappers copy when they pad a call's
rows onto their grid of graph shapes) and :data:`UNMEASURED_LSE_BYTES`."""

UNMEASURED_LSE_BYTES = 512 * 2**20
"""The padded log-sum-exp the cuDNN varlen backward takes (its wrapper splits calls to stay under this size)."""


REFERENCE_TILE_SCORES = 4
"""The reference kernel's (query block x key block) float32 tensors alive together in its forward: the previous key
block's scores and probabilities while the next block's scores are computed and scaled."""

REFERENCE_TILE_ROWS = 4
"""Its (query block x head_dim) float32 tensors alive together: the query block, the running output, its rescaled
copy and the next block's contribution."""


class KernelBuffers(NamedTuple):
    """Bytes a kernel holds at its peak beyond its inputs and its outputs (out and lse; dq, dk and dv)."""

    forward: int
    backward: int


def kernel_buffer_bytes(kernel: str, doc_lens: Sequence[int], heads: int, kv_heads: int, head_dim: int,
                        itemsize: int) -> KernelBuffers:
    """The buffers of one call of ``kernel`` on packed documents of ``doc_lens`` tokens (queries = keys).

    ``torch_flash``: aten's varlen FlashAttention-2 backward (``mha_varlen_bwd``) allocates ``dq_accum`` (float32,
    ``tokens + 128 x documents`` rows, every query head) and ``softmax_d`` (float32, one per head and padded row),
    and with GQA ``dk_expanded`` and ``dv_expanded`` (every query head, input dtype); the wrapper
    (:mod:`hf_longctx.kernels.torch_flash`) flips the lse's sign into a float32 copy through a boolean mask, forward
    and backward. ``fa4``: FlashAttention-4's ``_flash_attn_bwd`` allocates ``dq_accum``, ``dpsum`` and ``lse_log2``
    (float32, padded rows) and with GQA ``dk_accum`` and ``dv_accum`` (float32, per KV head). ``reference``
    (:mod:`hf_longctx.kernels.reference`, blockwise in float32, one document at a time): forward, a document's
    float32 output and lse beside the previous one's, and the larger of its cast and a tile's temporaries; backward,
    float32 dq, dk and dv of the row and of the document, the document's delta and finite lse, and the float32
    copies of its out and d(out) that the delta is computed from. ``cudnn_varlen`` and ``cudnn``: not
    measured yet, so bounded from above (:data:`UNMEASURED_KERNELS`).
    """
    forward, backward = _buffers(kernel, doc_lens, heads, kv_heads, head_dim, itemsize)
    return KernelBuffers(forward=forward + SMALL_TENSOR_BYTES, backward=backward + SMALL_TENSOR_BYTES)


def _buffers(kernel: str, doc_lens: Sequence[int], heads: int, kv_heads: int, head_dim: int,
             itemsize: int) -> tuple[int, int]:
    tokens = sum(doc_lens)
    padded = tokens + PADDED_ROWS_PER_DOCUMENT * len(doc_lens)
    f32 = 4
    gqa = heads != kv_heads
    if kernel == "torch_flash":
        lse_flip = tokens * heads * (f32 + 1)  # the float32 copy and its boolean mask
        backward = padded * heads * (head_dim * f32 + f32) + lse_flip
        if gqa:
            backward += 2 * tokens * heads * head_dim * itemsize
        return lse_flip, backward
    if kernel == "fa4":
        backward = padded * heads * (head_dim * f32 + 2 * f32)
        if gqa:
            backward += 2 * padded * kv_heads * head_dim * f32
        return 0, backward
    if kernel == "reference":
        from ...kernels.reference import BLOCK

        longest = max(doc_lens, default=0)
        # a document's float32 output and lse, then either its cast to the input dtype or a tile's temporaries,
        # while the previous document's float32 output and lse wait to be released (the loop rebinds them after)
        tile = heads * BLOCK * (REFERENCE_TILE_SCORES * BLOCK + REFERENCE_TILE_ROWS * head_dim) * f32
        kept = [n * heads * (head_dim + 1) * f32 for n in doc_lens]
        forward = max((kept[i - 1] if i else 0) + kept[i] + max(n * heads * head_dim * itemsize, tile)
                      for i, n in enumerate(doc_lens)) if doc_lens else 0
        backward = (f32 * (heads + 2 * kv_heads) * head_dim * (tokens + longest) + 2 * f32 * heads * longest
                    + 2 * f32 * heads * head_dim * longest)
        return forward, backward
    if kernel in UNMEASURED_KERNELS:
        forward, backward = _buffers("torch_flash", doc_lens, heads, kv_heads, head_dim, itemsize)
        copies = tokens * itemsize * (3 * heads + 2 * kv_heads) * head_dim
        return forward + copies, backward + copies + UNMEASURED_LSE_BYTES
    raise ValueError(f"memory: auto has no buffer model for attention kernel {kernel!r} (known: torch_flash, fa4, "
                     f"reference, {', '.join(UNMEASURED_KERNELS)}); set kernel to one of them, or memory: manual")


def backward_bytes_beyond_torch_flash(kernel: str, heads: int, kv_heads: int, head_dim: int, itemsize: int,
                                      tokens: int) -> int:
    """``kernel``'s backward buffers less torch FlashAttention-2's on ``tokens`` tokens (negative: it needs less).

    Both on :data:`PLANNED_DOCUMENT_TOKENS`-token documents, the kernel's also on one document where that needs
    more (the reference's buffers grow with the longest document, FlashAttention's padding with their count)."""
    if kernel == CALIBRATION_KERNEL:
        return 0
    docs = max(1, -(-tokens // PLANNED_DOCUMENT_TOKENS))
    lens = [tokens // docs] * docs
    lens[-1] += tokens - sum(lens)
    own = max(kernel_buffer_bytes(kernel, layout, heads, kv_heads, head_dim, itemsize).backward
              for layout in (lens, [tokens]))
    return own - kernel_buffer_bytes(CALIBRATION_KERNEL, lens, heads, kv_heads, head_dim, itemsize).backward


def planned_kernel(kernel: str, device=None) -> str:
    """The kernel whose buffers a plan counts: ``kernel`` itself, or for ``auto`` the one ``auto`` runs first on
    ``device`` (FlashAttention-4 where it is installed on Hopper or Blackwell, else torch's FlashAttention-2; the
    reference on a CPU). A kernel without a buffer model makes the plan raise (:func:`kernel_buffer_bytes`)."""
    if kernel != "auto":
        return kernel
    import torch

    from ...kernels import available_kernels

    if device is None or torch.device(device).type != "cuda":
        return "reference"
    return next(iter(available_kernels(device)), CALIBRATION_KERNEL)
