"""cuDNN fused attention through torch's dense SDPA op, for packed inputs of few distinct shapes.

On Hopper cuDNN's attention runs well ahead of torch's FlashAttention-2 on single documents (measured:
bench/results/2026-11-22_kernels.md), but torch exposes it only for dense (B, H, S, D) batches (its varlen path is
unproven).
Distributed attention pieces are mostly one segment (a single document crossing a shard boundary)
or a run of equal-length documents, so this module groups the segments of a packed call by
(q_len, k_len) and runs one dense batched call per group. A single group that is contiguous in
memory needs no copy at all: (T, H, D) is viewed as (B, S, H, D) and transposed.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from .contract import KernelCall
from .validate import gpu_input_problem

name = "cudnn"
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 128
MAX_GROUPS = 4
# cuDNN's dense backward (torch 2.11, cuDNN 9.19; bench/results/2026-11-22_kernels.md) crashes the process with a
# segmentation fault when a graph for single-token segments is run a second time; those calls go to torch_flash.
MIN_SEGMENT_LEN = 2


def segment_groups(cu_q: tuple[int, ...], cu_k: tuple[int, ...]) -> dict[tuple[int, int], list[int]]:
    """Segment indices keyed by (q_len, k_len), skipping segments with no query or no key."""
    groups: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i in range(len(cu_q) - 1):
        lq, lk = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
        if lq and lk:
            groups[(lq, lk)].append(i)
    return groups


def supports(call: KernelCall) -> str | None:
    """Why cuDNN's dense op cannot take this call, or None when it can."""
    q, causal = call.q, call.causal
    if call.window is not None:
        return "cudnn's dense SDPA path takes no sliding window; torch_flash or the reference kernel serve it"
    groups = segment_groups(call.cu_seqlens_q, call.cu_seqlens_k)
    if any(lq < MIN_SEGMENT_LEN or lk < MIN_SEGMENT_LEN for lq, lk in groups):
        return ("cudnn's dense backward crashes on single-token segments (torch 2.11, cuDNN 9.19); "
                "torch_flash serves them")
    problem = gpu_input_problem("cudnn", q, SUPPORTED_DTYPES, MAX_HEAD_DIM)
    if problem:
        return problem
    if not torch.backends.cudnn.is_available():
        return "cuDNN is not available in this torch build"
    if not hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
        return "this torch build has no aten._scaled_dot_product_cudnn_attention"
    if len(groups) > MAX_GROUPS:
        return f"cudnn runs one dense call per distinct segment shape; {len(groups)} shapes is too many"
    if causal and any(lq != lk for lq, lk in groups):
        return "cudnn causal masking is top-left aligned; segments with q_len != k_len need torch_flash"
    return None


def _dense(x: torch.Tensor, starts: list[int], length: int) -> torch.Tensor:
    """(T, H, D) rows of equal-length segments -> (B, H, S, D), a view when they are back to back."""
    b = len(starts)
    if all(s == starts[0] + i * length for i, s in enumerate(starts)):
        base = x[starts[0] : starts[0] + b * length]
    else:
        base = torch.cat([x[s : s + length] for s in starts])
    return base.view(b, length, x.shape[1], x.shape[2]).transpose(1, 2)


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


# cuDNN takes fewer KV heads than query heads natively in forward (checked on Hopper, torch 2.11); its
# backward is tried natively once and falls back to repeated KV heads if this build rejects it.
_native_gqa_backward: bool | None = None


def _covers(starts: list[int], length: int, total: int) -> bool:
    """Do equal-length segments at ``starts`` tile all ``total`` rows back to back?"""
    return starts[0] == 0 and len(starts) * length == total and all(s == i * length for i, s in enumerate(starts))


def _packed(dense: torch.Tensor) -> torch.Tensor:
    """(B, H, S, D) laid out as (B, S, H, D) -> (B*S, H, D); a view when the layout allows."""
    b, h, s, d = dense.shape
    return dense.transpose(1, 2).reshape(b * s, h, d)


def _scatter(dst: torch.Tensor, dense: torch.Tensor, starts: list[int], length: int) -> None:
    rows = dense.transpose(1, 2)  # (B, S, H, D)
    for i, s in enumerate(starts):
        dst[s : s + length] = rows[i]


def forward(call: KernelCall) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v, causal, scale = call.q, call.k, call.v, call.causal, call.softmax_scale
    cu_q, cu_k = call.cu_seqlens_q, call.cu_seqlens_k
    tq, hq, d = q.shape
    groups = segment_groups(cu_q, cu_k)
    out, lse = None, None
    for (lq, lk), idx in groups.items():
        qs = [cu_q[i] for i in idx]
        ks = [cu_k[i] for i in idx]
        o, l_dense = torch.ops.aten._scaled_dot_product_cudnn_attention(
            _dense(q, qs, lq), _dense(k, ks, lk), _dense(v, ks, lk), None, True, 0.0, causal, False, scale=scale,
        )[:2]
        if len(groups) == 1 and _covers(qs, lq, tq):  # the common case: no copy of the output
            return _packed(o), l_dense.reshape(len(idx), hq, lq).transpose(0, 1).reshape(hq, tq)
        if out is None:
            out = torch.zeros_like(q)
            lse = torch.full((hq, tq), float("-inf"), dtype=torch.float32, device=q.device)
        _scatter(out, o, qs, lq)
        l_dense = l_dense.reshape(len(idx), hq, lq)
        for j, s in enumerate(qs):
            lse[:, s : s + lq] = l_dense[j]
    if out is None:  # no segment had both queries and keys
        out = torch.zeros_like(q)
        lse = torch.full((hq, tq), float("-inf"), dtype=torch.float32, device=q.device)
    return out, lse


def backward(call: KernelCall, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v, causal, scale = call.q, call.k, call.v, call.causal, call.softmax_scale
    cu_q, cu_k = call.cu_seqlens_q, call.cu_seqlens_k
    tq, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    global _native_gqa_backward
    dq = dk = dv = None
    seed = torch.zeros((), dtype=torch.long, device=q.device)
    groups = segment_groups(cu_q, cu_k)
    for (lq, lk), idx in groups.items():
        qs = [cu_q[i] for i in idx]
        ks = [cu_k[i] for i in idx]
        b = len(idx)
        lse_dense = torch.stack([lse[:, s : s + lq] for s in qs]).float().unsqueeze(-1)
        args = (_dense(dout, qs, lq), _dense(q, qs, lq))
        rest = (_dense(out, qs, lq), lse_dense, seed, seed, None, None, None, lq, lk, 0.0, causal)
        kd, vd = _dense(k, ks, lk), _dense(v, ks, lk)
        grads = None
        if g == 1 or _native_gqa_backward is not False:
            try:
                grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(*args, kd, vd, *rest, scale=scale)
                if grads[1].shape[1] != kd.shape[1]:
                    raise RuntimeError("cuDNN returned key gradients for repeated heads")
                _native_gqa_backward = True
            except RuntimeError:
                if g == 1:
                    raise
                _native_gqa_backward = False
        if grads is None:
            grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                *args, _expand_kv(kd, g), _expand_kv(vd, g), *rest, scale=scale
            )
        gq, gk, gv = grads
        if gk.shape[1] != hkv:
            gk = gk.view(b, hkv, g, lk, d).sum(2)
            gv = gv.view(b, hkv, g, lk, d).sum(2)
        if len(groups) == 1 and _covers(qs, lq, tq) and _covers(ks, lk, k.shape[0]):
            return _packed(gq), _packed(gk), _packed(gv)
        if dq is None:
            dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        _scatter(dq, gq, qs, lq)
        _scatter(dk, gk, ks, lk)
        _scatter(dv, gv, ks, lk)
    if dq is None:  # no segment had both queries and keys
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    return dq, dk, dv

