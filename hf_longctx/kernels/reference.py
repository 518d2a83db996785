"""Reference core attention in pure torch: blockwise online softmax, any dtype, any device.

This is the kernel CI runs and the yardstick the fast kernels are checked against. It walks the
segments of a packed batch one by one and, inside a segment, tiles queries and keys into blocks so
memory stays linear in the sequence length. GQA is computed by viewing the query heads as
(kv_heads, group) instead of repeating keys and values. Arithmetic runs in float32 (float64 for
float64 inputs). A sliding window (see :func:`hf_longctx.kernels.attention_forward`) masks the
edge tiles of the band and never reads key tiles wholly outside it.
"""

from __future__ import annotations

import torch

from .contract import KernelCall
from .merge import accumulation_dtype

name = "reference"
BLOCK = 256


def _key_span(q0: int, q1: int, sk: int, offset: int, causal: bool, window: int | None) -> tuple[int, int]:
    """Key rows [begin, end) that any query of the block [q0, q1) can see: tiles outside are never read."""
    end = min(sk, q1 + offset) if causal else sk
    begin = max(0, q0 + offset - window + 1) if window is not None else 0
    return begin, max(begin, end)


def _visible_mask(q0: int, q1: int, k0: int, k1: int, offset: int, causal: bool, window: int | None,
                  device: torch.device) -> torch.Tensor | None:
    """Mask of a (query block, key block) tile, or None when every key in it is visible to every query.

    Bottom-right alignment, offset = Sk - Sq: query i sees key j iff j <= i + offset (causal) and
    j > i + offset - window (window).
    """
    below = not causal or k1 - 1 <= q0 + offset
    inside = window is None or k0 > q1 - 1 + offset - window
    if below and inside:
        return None
    qi = torch.arange(q0, q1, device=device).unsqueeze(1)
    kj = torch.arange(k0, k1, device=device).unsqueeze(0)
    mask = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=device)
    if causal:
        mask &= kj <= qi + offset
    if window is not None:
        mask &= kj > qi + offset - window
    return mask


def _segment_forward(q, k, v, causal: bool, window: int | None, scale: float, acc: torch.dtype):
    """q (Sq, Hkv, G, D), k/v (Sk, Hkv, D) -> out (Sq, Hkv, G, D) in acc, lse (Hkv, G, Sq) in acc."""
    sq, hkv, g, d = q.shape
    sk = k.shape[0]
    offset = sk - sq
    out = torch.zeros(sq, hkv, g, d, dtype=acc, device=q.device)
    lse = torch.full((hkv, g, sq), float("-inf"), dtype=acc, device=q.device)
    for q0 in range(0, sq, BLOCK):
        q1 = min(q0 + BLOCK, sq)
        qb = q[q0:q1].to(acc)
        k_begin, k_end = _key_span(q0, q1, sk, offset, causal, window)
        m = torch.full((hkv, g, q1 - q0), float("-inf"), dtype=acc, device=q.device)
        l_sum = torch.zeros((hkv, g, q1 - q0), dtype=acc, device=q.device)
        o = torch.zeros((hkv, g, q1 - q0, d), dtype=acc, device=q.device)
        for k0 in range(k_begin, k_end, BLOCK):
            k1 = min(k0 + BLOCK, k_end)
            kb = k[k0:k1].to(acc)
            vb = v[k0:k1].to(acc)
            s = torch.einsum("qhgd,khd->hgqk", qb, kb) * scale
            mask = _visible_mask(q0, q1, k0, k1, offset, causal, window, q.device)
            if mask is not None:
                s = s.masked_fill(~mask, float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))
            m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
            p = torch.exp(s - m_safe.unsqueeze(-1))
            correction = torch.exp(m - m_safe)
            l_sum = l_sum * correction + p.sum(dim=-1)
            o = o * correction.unsqueeze(-1) + torch.einsum("hgqk,khd->hgqd", p, vb)
            m = m_new
        seen = l_sum > 0
        safe_l = torch.where(seen, l_sum, torch.ones_like(l_sum))
        out[q0:q1] = (o / safe_l.unsqueeze(-1)).permute(2, 0, 1, 3)
        lse[:, :, q0:q1] = torch.where(seen, m + torch.log(safe_l), torch.full_like(m, float("-inf")))
    return out, lse


def _segment_backward(dout, q, k, v, out, lse, causal: bool, window: int | None, scale: float, acc: torch.dtype):
    """Gradients of one segment given the FINAL out/lse of its rows (flash-attn convention)."""
    sq, hkv, g, d = q.shape
    sk = k.shape[0]
    offset = sk - sq
    dq = torch.zeros(sq, hkv, g, d, dtype=acc, device=q.device)
    dk = torch.zeros(sk, hkv, d, dtype=acc, device=q.device)
    dv = torch.zeros(sk, hkv, d, dtype=acc, device=q.device)
    # delta_i = sum_d dout_id * out_id is the softmax-Jacobian term shared by every key block.
    delta = (dout.to(acc) * out.to(acc)).sum(dim=-1).permute(1, 2, 0)  # (Hkv, G, Sq)
    # Rows that saw no key have lse -inf; +inf makes exp(s - lse) exactly 0 for them.
    lse_safe = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("inf")))
    for q0 in range(0, sq, BLOCK):
        q1 = min(q0 + BLOCK, sq)
        qb = q[q0:q1].to(acc)
        dob = dout[q0:q1].to(acc)
        k_begin, k_end = _key_span(q0, q1, sk, offset, causal, window)
        for k0 in range(k_begin, k_end, BLOCK):
            k1 = min(k0 + BLOCK, k_end)
            kb = k[k0:k1].to(acc)
            vb = v[k0:k1].to(acc)
            s = torch.einsum("qhgd,khd->hgqk", qb, kb) * scale
            p = torch.exp(s - lse_safe[:, :, q0:q1].unsqueeze(-1))
            mask = _visible_mask(q0, q1, k0, k1, offset, causal, window, q.device)
            if mask is not None:
                p = p.masked_fill(~mask, 0.0)
            dv[k0:k1] += torch.einsum("hgqk,qhgd->khd", p, dob)
            dp = torch.einsum("qhgd,khd->hgqk", dob, vb)
            ds = p * (dp - delta[:, :, q0:q1].unsqueeze(-1)) * scale
            dq[q0:q1] += torch.einsum("hgqk,khd->qhgd", ds, kb)
            dk[k0:k1] += torch.einsum("hgqk,qhgd->khd", ds, qb)
    return dq, dk, dv


def _segments(cu_q: tuple[int, ...], cu_k: tuple[int, ...]):
    for i in range(len(cu_q) - 1):
        yield cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]


def reference_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cu_seqlens_q: tuple[int, ...],
                      cu_seqlens_k: tuple[int, ...], causal: bool, softmax_scale: float, window: int | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed varlen forward. Returns out (Tq, Hq, D) in q's dtype and lse (Hq, Tq) in acc dtype."""
    acc = accumulation_dtype(q.dtype)
    tq, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    out = torch.zeros(tq, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.full((hq, tq), float("-inf"), dtype=acc, device=q.device)
    qg = q.view(tq, hkv, g, d)
    for q0, q1, k0, k1 in _segments(cu_seqlens_q, cu_seqlens_k):
        if q1 == q0 or k1 == k0:
            continue
        o, s_lse = _segment_forward(qg[q0:q1], k[k0:k1], v[k0:k1], causal, window, softmax_scale, acc)
        out[q0:q1] = o.reshape(q1 - q0, hq, d).to(q.dtype)
        lse[:, q0:q1] = s_lse.reshape(hq, q1 - q0)
    return out, lse


def reference_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, *, cu_seqlens_q: tuple[int, ...], cu_seqlens_k: tuple[int, ...],
                       causal: bool, softmax_scale: float, window: int | None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed varlen backward; dk/dv are summed over each KV head's query group (no repeat)."""
    acc = accumulation_dtype(q.dtype)
    tq, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    dq = torch.zeros(tq, hkv, g, d, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    qg = q.view(tq, hkv, g, d)
    og = out.reshape(tq, hkv, g, d)
    dog = dout.reshape(tq, hkv, g, d)
    lse_g = lse.to(acc).reshape(hkv, g, tq)
    for q0, q1, k0, k1 in _segments(cu_seqlens_q, cu_seqlens_k):
        if q1 == q0 or k1 == k0:
            continue
        sdq, sdk, sdv = _segment_backward(
            dog[q0:q1], qg[q0:q1], k[k0:k1], v[k0:k1], og[q0:q1], lse_g[:, :, q0:q1], causal, window, softmax_scale, acc
        )
        dq[q0:q1] += sdq
        dk[k0:k1] += sdk
        dv[k0:k1] += sdv
    return dq.reshape(tq, hq, d).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def supports(call: KernelCall) -> str | None:
    """The reference serves every input on every device: ``auto``'s last candidate."""
    return None


def forward(call: KernelCall) -> tuple[torch.Tensor, torch.Tensor]:
    return reference_forward(call.q, call.k, call.v, cu_seqlens_q=call.cu_seqlens_q, cu_seqlens_k=call.cu_seqlens_k,
                             causal=call.causal, softmax_scale=call.softmax_scale, window=call.window)


def backward(call: KernelCall, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return reference_backward(dout, call.q, call.k, call.v, out, lse, cu_seqlens_q=call.cu_seqlens_q,
                              cu_seqlens_k=call.cu_seqlens_k, causal=call.causal, softmax_scale=call.softmax_scale,
                              window=call.window)
