"""The row-moving steps of the expert path, each one pass: Triton on CUDA, torch everywhere else.

Pairs are the (token, slot) entries of a routing whose expert this rank runs, in expert order
(:class:`~hf_longctx.moe.routing.PairLayout`). Three steps move rows between pairs and tokens:

* :func:`pair_sum` - each token's (weighted) sum of its pairs' rows: the combine of expert
  outputs (forward) and the input gradient of the dispatch (backward). Slots are summed in order,
  slot 0 first, in at least float32: deterministic, with no atomics.
* :func:`pair_grads` - the combine's backward: each pair's output gradient (its weight times its
  token's gradient) and its weight's gradient (the dot product of the two rows).
* :func:`swiglu` - ``silu(gate) * up`` on the fused gate/up GEMM output, with its backward.

Why. In eager PyTorch each step is several kernels with float32 copies of every pair row; with 128
experts and top-8 (Qwen3-MoE) the pairs are 8x the tokens and those passes cost more than the
grouped GEMMs themselves. The Triton kernels (:mod:`~hf_longctx.moe.triton_row_ops`) read and write
each row once. The torch versions compute the same thing in the same order and serve CPU, float64
and machines without Triton; ``HF_LONGCTX_MOE_TRITON=0`` forces them on GPUs too.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels import accumulation_dtype
from ..optional_triton import TRITON_DTYPES, switched_on, triton_module


def _triton_ops():
    return triton_module("hf_longctx.moe.triton_row_ops")


def triton_serves(*tensors: torch.Tensor) -> bool:
    """True where the Triton kernels run: CUDA tensors of bf16/fp16/fp32, Triton importable, not disabled."""
    if not switched_on("HF_LONGCTX_MOE_TRITON"):
        return False
    return (all(t.is_cuda and t.dtype in TRITON_DTYPES for t in tensors)
            and _triton_ops() is not None)


def pair_sum(rows: torch.Tensor, table: torch.Tensor, weights: torch.Tensor | None = None, *,
             out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """(tokens, H): ``sum_j weights[p] * rows[p]`` over the pairs ``p = table[t, j] >= 0`` of each token t.

    ``table`` (tokens, k) holds each (token, slot)'s row in ``rows`` or -1; ``weights`` (pairs,) or
    None for 1. Sums run slot by slot in at least float32 and are written to ``out`` (any row stride,
    e.g. the columns of a wider buffer) or returned in ``out_dtype`` (default: the accumulation dtype).
    No autograd: the callers' autograd functions pair it with :func:`pair_grads`.
    """
    tokens = table.shape[0]
    acc = accumulation_dtype(rows.dtype)
    if out is None:
        out = rows.new_empty((tokens, rows.shape[1]), dtype=out_dtype or acc)
    if triton_serves(rows, out) and rows.stride(1) == 1 and out.stride(1) == 1:
        _triton_ops().pair_sum(rows, table.contiguous(), None if weights is None else weights.contiguous(), out)
        return out
    total = out if out.dtype == acc else torch.zeros_like(out, dtype=acc)
    total.zero_()
    for slot in range(table.shape[1]):
        pairs = table[:, slot]
        owners = (pairs >= 0).nonzero().squeeze(1)
        chosen = pairs[owners]
        contribution = rows.index_select(0, chosen).to(acc)
        if weights is not None:
            contribution = contribution * weights.index_select(0, chosen).to(acc)[:, None]
        total.index_add_(0, owners, contribution)  # one pair per token and slot: no index repeats
    if total is not out:
        out.copy_(total)
    return out


def pair_grads(grad_tokens: torch.Tensor, token_index: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward of ``pair_sum(rows, table, weights)`` for pairs of tokens ``token_index``.

    Returns ``(grad_rows, grad_weights)``: ``weights[p] * grad_tokens[token p]`` in ``rows``' dtype, and
    ``<grad_tokens[token p], rows[p]>`` in ``weights``' dtype, both computed in at least float32.
    """
    if triton_serves(grad_tokens, rows) and weights.is_cuda and grad_tokens.stride(1) == 1 and rows.stride(1) == 1:
        grad_rows, grad_weights = _triton_ops().pair_grads(grad_tokens, token_index.contiguous(),
                                                           weights.contiguous(), rows)
        return grad_rows, grad_weights.to(weights.dtype)
    acc = accumulation_dtype(rows.dtype)
    grad_pairs = grad_tokens.index_select(0, token_index).to(acc)
    grad_rows = (grad_pairs * weights.to(acc)[:, None]).to(rows.dtype)
    grad_weights = (grad_pairs * rows.to(acc)).sum(dim=1).to(weights.dtype)
    return grad_rows, grad_weights


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        h = h.contiguous()
        ctx.save_for_backward(h)
        return _triton_ops().swiglu_forward(h)

    @staticmethod
    def backward(ctx, grad):
        (h,) = ctx.saved_tensors
        return _triton_ops().swiglu_backward(grad.contiguous(), h)


def _is_plain_swiglu(experts: nn.Module) -> bool:
    """The experts gate with transformers' default ``act_fn(gate) * up`` on halves, and act_fn is SiLU."""
    gate = getattr(type(experts), "_apply_gate", None)
    default = getattr(gate, "__name__", "") == "_default_apply_gate" and "transformers" in getattr(
        gate, "__module__", "")
    act = getattr(experts, "act_fn", None)
    return default and (isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation")


def swiglu(experts: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The experts' gate on the gate/up GEMM output ``h`` (rows, 2I): one fused kernel where it is SwiGLU.

    Models with a gate of their own (GPT-OSS's clamped variant, other activations) run their own
    ``_apply_gate``, as do CPU tensors.
    """
    if _is_plain_swiglu(experts) and triton_serves(h) and h.shape[-1] % 2 == 0:
        return _SwiGLU.apply(h)
    return experts._apply_gate(h)
