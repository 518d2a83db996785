"""cuDNN fused attention through torch's dense SDPA op, for packed inputs of few distinct shapes.

On Hopper cuDNN's attention runs about 1.7x faster than torch's FlashAttention-2 (DESIGN.md
section 7), but torch exposes it only for dense (B, H, S, D) batches (its varlen path is unproven).
Distributed attention pieces are mostly one segment (a single document crossing a shard boundary)
or a run of equal-length documents, so this module groups the segments of a packed call by
(q_len, k_len) and runs one dense batched call per group. A single group that is contiguous in
memory needs no copy at all: (T, H, D) is viewed as (B, S, H, D) and transposed.
"""

from __future__ import annotations

from collections import defaultdict

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 128
MAX_GROUPS = 4


def segment_groups(cu_q: list[int], cu_k: list[int]) -> dict[tuple[int, int], list[int]]:
    """Segment indices keyed by (q_len, k_len), skipping segments with no query or no key."""
    groups: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i in range(len(cu_q) - 1):
        lq, lk = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
        if lq and lk:
            groups[(lq, lk)].append(i)
    return groups


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, cu_q: list[int], cu_k: list[int], causal: bool) -> str | None:
    if q.device.type != "cuda":
        return "cudnn needs CUDA tensors"
    if q.dtype not in SUPPORTED_DTYPES:
        return f"cudnn takes float16/bfloat16, not {q.dtype}"
    d = q.shape[-1]
    if d % 8 != 0 or d > MAX_HEAD_DIM:
        return f"cudnn needs head_dim a multiple of 8 and <= {MAX_HEAD_DIM}, got {d}"
    if not torch.backends.cudnn.is_available():
        return "cuDNN is not available in this torch build"
    groups = segment_groups(cu_q, cu_k)
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


def _scatter(dst: torch.Tensor, dense: torch.Tensor, starts: list[int], length: int) -> None:
    rows = dense.transpose(1, 2)  # (B, S, H, D)
    for i, s in enumerate(starts):
        dst[s : s + length] = rows[i]


def forward(q, k, v, cu_q: list[int], cu_k: list[int], causal: bool, scale: float):
    tq, hq, d = q.shape
    g = hq // k.shape[1]
    out = torch.zeros_like(q)
    lse = torch.full((hq, tq), float("-inf"), dtype=torch.float32, device=q.device)
    for (lq, lk), idx in segment_groups(cu_q, cu_k).items():
        qs = [cu_q[i] for i in idx]
        ks = [cu_k[i] for i in idx]
        o, l_dense = torch.ops.aten._scaled_dot_product_cudnn_attention(
            _dense(q, qs, lq), _expand_kv(_dense(k, ks, lk), g), _expand_kv(_dense(v, ks, lk), g),
            None, True, 0.0, causal, False, scale=scale,
        )[:2]
        _scatter(out, o, qs, lq)
        l_dense = l_dense.reshape(len(idx), hq, lq)
        for j, s in enumerate(qs):
            lse[:, s : s + lq] = l_dense[j]
    return out, lse


def backward(dout, q, k, v, out, lse, cu_q: list[int], cu_k: list[int], causal: bool, scale: float):
    tq, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    empty = torch.empty(0, device=q.device)
    for (lq, lk), idx in segment_groups(cu_q, cu_k).items():
        qs = [cu_q[i] for i in idx]
        ks = [cu_k[i] for i in idx]
        b = len(idx)
        lse_dense = torch.stack([lse[:, s : s + lq] for s in qs]).float().contiguous()
        kd = _expand_kv(_dense(k, ks, lk), g)
        vd = _expand_kv(_dense(v, ks, lk), g)
        gq, gk, gv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            _dense(dout, qs, lq), _dense(q, qs, lq), kd, vd, _dense(out, qs, lq), lse_dense,
            empty, empty, empty, empty, empty, lq, lk, 0.0, causal, scale=scale,
        )
        _scatter(dq, gq, qs, lq)
        if g > 1:
            gk = gk.view(b, hkv, g, lk, d).sum(2)
            gv = gv.view(b, hkv, g, lk, d).sum(2)
        _scatter(dk, gk, ks, lk)
        _scatter(dv, gv, ks, lk)
    return dq, dk, dv
