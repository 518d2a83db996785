"""cuDNN fused attention on packed (T, H, D) documents through NVIDIA's cuDNN frontend, an optional extra.

``pip install "hf-longctx[cudnn]"`` brings ``nvidia-cudnn-frontend`` (one 11 MB wheel that uses the
libcudnn torch already ships; its packed-document path builds its offset tables with the CUTLASS
Python DSL, so that comes along). Its ``torch.ops.cudnn.sdpa_fwd/sdpa_bwd`` take cu_seqlens, native
GQA and bottom-right causal masks, so any mix of document lengths runs in one call, faster than
torch's FlashAttention-2 on Hopper (measured: bench/results/2026-11-22_kernels.md). Sliding windows are declined:
cuDNN's band did not match the reference on the GPU. Unlike the dense path in
:mod:`.cudnn` it is not limited to a few distinct document shapes.

Two costs shape this module:

* cuDNN builds one graph per (segment count, max length) in forward and additionally per total
  tokens (rounded to 64) in backward, 0.1-3 s each. Every one of those numbers is rounded up onto
  a coarse grid (:mod:`.buckets`): the segment count by appending empty segments, max lengths by
  passing a larger bound, and in backward the token count by padding rows that no segment covers
  (a copy of q, k, v, out and dout when the count is off the grid: the price of a bounded number
  of graphs).
* The backward takes its LSE padded to (segments, heads, max_len). A call whose padded LSE would
  pass :data:`LSE_BUDGET_BYTES` is split into contiguous runs of segments (views, no copies of the
  inputs), each with its own smaller bound.
"""

from __future__ import annotations

import functools
import os

import torch

from .buckets import bucket, lse_runs, padded_segments
from .contract import KernelCall, int32_on
from .validate import gpu_input_problem

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 128
name = "cudnn_varlen"
INSTALL_HINT = 'pip install "hf-longctx[cudnn]" (nvidia-cudnn-frontend and nvidia-cutlass-dsl)'
# cuDNN before 9.26 can return NaN gradients for rows whose LSE is below about -88.7, which is what
# a row without any visible key has; such inputs go to another kernel on older cuDNN.
EMPTY_ROWS_FIXED_IN = 92600
# Packed (ragged) tensors in cuDNN's fused attention graphs need cuDNN 9.
MIN_CUDNN = 90000
LSE_BUDGET_BYTES = int(os.environ.get("HF_LONGCTX_CUDNN_LSE_BUDGET_MB", "512")) * 2**20
# Steps per octave of the rounding grid: segment counts and max lengths, total tokens.
SHAPE_STEPS, TOKEN_STEPS = 2, 8


@functools.lru_cache(maxsize=1)
def _ops():
    """torch.ops.cudnn with sdpa_fwd/sdpa_bwd registered, or the ImportError text when missing."""
    try:
        import cudnn.sdpa.fwd.torch_op  # noqa: F401 - importing registers torch.ops.cudnn.sdpa_*
        import cutlass.cute  # noqa: F401 - the varlen path compiles its offset tables with it
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable", with the reason kept
        return f"{type(exc).__name__}: {exc}"
    return torch.ops.cudnn


def is_installed() -> bool:
    return not isinstance(_ops(), str)


def missing_extra(device: torch.device) -> str | None:
    """The install command when the extra is absent and would serve ``device``, else None."""
    return None if is_installed() or not worth_installing(device) else INSTALL_HINT


def worth_installing(device: torch.device) -> bool:
    """Would installing the extra give this device a faster kernel? Any CUDA GPU with cuDNN."""
    return device.type == "cuda" and torch.backends.cudnn.is_available()


def _has_rows_without_keys(cu_q: tuple[int, ...], cu_k: tuple[int, ...], causal: bool) -> bool:
    for i in range(len(cu_q) - 1):
        lq, lk = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
        if lq and (lk == 0 or (causal and lq > lk)):
            return True
    return False


def supports(call: KernelCall) -> str | None:
    """Why the cuDNN frontend cannot take this call, or None when it can."""
    q, cu_q, cu_k, causal = call.q, call.cu_seqlens_q, call.cu_seqlens_k, call.causal
    if call.window is not None:
        # cuDNN 9.19, frontend 1.32: its diagonal band missed the reference in every windowed case
        # (bench/results/2026-11-22_kernels.md), so windows go to FlashAttention-4 or torch's FlashAttention-2.
        return "cudnn_varlen does not serve sliding windows (its band did not match the reference on the GPU)"
    ops = _ops()
    if isinstance(ops, str):
        return f"the cuDNN frontend is not usable ({ops}); {INSTALL_HINT}"
    problem = gpu_input_problem("cudnn_varlen", q, SUPPORTED_DTYPES, MAX_HEAD_DIM)
    if problem:
        return problem
    if not torch.backends.cudnn.is_available():
        return "cuDNN is not available in this torch build"
    version = torch.backends.cudnn.version() or 0
    if version < MIN_CUDNN:
        return f"cudnn_varlen needs cuDNN >= 9.0 for packed documents, this torch has cuDNN {version}"
    if version < EMPTY_ROWS_FIXED_IN and _has_rows_without_keys(cu_q, cu_k, causal):
        return (f"cuDNN {version} returns NaN gradients for query rows without a visible key (fixed in 9.26); "
                "this input has such rows")
    return None


def _mask_args(cu_q: list[int], cu_k: list[int], causal: bool, window: int | None) -> dict:
    """cuDNN mask flags for the contract's masks (a window of w keys is a left bound of w - 1).

    Bottom-right alignment is asked for only where some segment needs it (q_len != k_len, or a
    window, which must be anchored at the bottom-right diagonal): for square causal segments it
    equals the default top-left one.
    """
    uneven = any(b - a != d - c for a, b, c, d in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]))
    if window is None:
        return {"is_causal": causal, "causal_bottom_right": causal and uneven}
    return {"is_causal": causal, "causal_bottom_right": causal and uneven or not causal,
            "window_left": window - 1, "window_right": 0 if causal else -1}


def _device_cu(cu: list[int], device: torch.device) -> torch.Tensor:
    return int32_on(tuple(cu), device)


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` with zero rows appended up to ``rows`` (rows no segment covers: never read)."""
    if x.shape[0] == rows:
        return x
    padded = x.new_zeros(rows, *x.shape[1:])
    padded[: x.shape[0]] = x
    return padded


def forward(call: KernelCall) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v, causal, window = call.q, call.k, call.v, call.causal, call.window
    cu_q, cu_k, scale = list(call.cu_seqlens_q), list(call.cu_seqlens_k), call.softmax_scale
    tq, hq, _ = q.shape
    segments = bucket(len(cu_q) - 1, SHAPE_STEPS)
    cq, ck = padded_segments(cu_q, segments), padded_segments(cu_k, segments)
    max_q = bucket(max(b - a for a, b in zip(cq, cq[1:])), SHAPE_STEPS)
    max_k = bucket(max(b - a for a, b in zip(ck, ck[1:])), SHAPE_STEPS)
    out, stats = _ops().sdpa_fwd(
        q, k, v, scale, cu_seqlens_q=_device_cu(cq, q.device), cu_seqlens_kv=_device_cu(ck, q.device),
        max_seqlen_q=max(max_q, 1), max_seqlen_kv=max(max_k, 1), return_lse=True,
        **_mask_args(cu_q, cu_k, causal, window),
    )
    return out, stats.view(tq, hq).t().contiguous()


def padded_lse(lse: torch.Tensor, cu_q: list[int], segments: int, max_len: int) -> torch.Tensor:
    """(H, T) lse -> the (segments, H, max_len, 1) float32 layout cuDNN's packed backward reads.

    Row j of segment i lands at [i, :, j]; padding positions are never read and stay 0.
    """
    heads, tokens = lse.shape
    lengths = torch.tensor([b - a for a, b in zip(cu_q, cu_q[1:])], device=lse.device)
    seg = torch.repeat_interleave(torch.arange(len(lengths), device=lse.device), lengths, output_size=tokens)
    starts = torch.tensor(cu_q[:-1], device=lse.device)
    slot = seg * max_len + torch.arange(tokens, device=lse.device) - starts[seg]
    out = torch.zeros(segments * max_len, heads, dtype=torch.float32, device=lse.device)
    out[slot] = lse.t().float()
    return out.view(segments, max_len, heads).permute(0, 2, 1).contiguous().unsqueeze(-1)


def _backward_run(dout, q, k, v, out, lse, cu_q: list[int], cu_k: list[int], causal, scale, window):
    """One sdpa_bwd call on a run of whole segments, with every graph-keying number bucketed."""
    tq, tk = q.shape[0], k.shape[0]
    segments = bucket(len(cu_q) - 1, SHAPE_STEPS)
    cq, ck = padded_segments(cu_q, segments), padded_segments(cu_k, segments)
    max_q = max(bucket(max(b - a for a, b in zip(cq, cq[1:])), SHAPE_STEPS), 1)
    max_k = max(bucket(max(b - a for a, b in zip(ck, ck[1:])), SHAPE_STEPS), 1)
    rows_q, rows_k = bucket(tq, TOKEN_STEPS), bucket(tk, TOKEN_STEPS)
    ops = _ops()
    cu_q_dev = _device_cu(cq, q.device)
    dq, dk, dv = ops.sdpa_bwd(
        _pad_rows(dout, rows_q), _pad_rows(q, rows_q), _pad_rows(k, rows_k), _pad_rows(v, rows_k),
        _pad_rows(out, rows_q), padded_lse(lse, cu_q, segments, max_q), scale, cu_seqlens_q=cu_q_dev,
        cu_seqlens_kv=_device_cu(ck, q.device), max_seqlen_q=max_q, max_seqlen_kv=max_k,
        **_mask_args(cu_q, cu_k, causal, window),
    )
    return dq[:tq], dk[:tk], dv[:tk]


def backward(call: KernelCall, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v, causal, window = call.q, call.k, call.v, call.causal, call.window
    cu_q, cu_k, scale = list(call.cu_seqlens_q), list(call.cu_seqlens_k), call.softmax_scale
    runs = lse_runs(cu_q, q.shape[1], LSE_BUDGET_BYTES, SHAPE_STEPS)
    if len(runs) == 1:
        return _backward_run(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale, window)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for a, b in runs:
        q0, q1, k0, k1 = cu_q[a], cu_q[b], cu_k[a], cu_k[b]
        if q1 == q0 or k1 == k0:
            continue  # no query or no key in the run: zero gradients
        local_q = [x - q0 for x in cu_q[a : b + 1]]
        local_k = [x - k0 for x in cu_k[a : b + 1]]
        gq, gk, gv = _backward_run(dout[q0:q1], q[q0:q1], k[k0:k1], v[k0:k1], out[q0:q1], lse[:, q0:q1],
                                   local_q, local_k, causal, scale, window)
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = gq, gk, gv
    return dq, dk, dv

