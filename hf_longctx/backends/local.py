"""Exact causal attention of packed segments on this process alone: no group, no communication.

What a ``longctx_*`` model runs whenever no sequence-parallel batch was prepared for it: evaluation,
``generate()`` with a KV cache, a padded batch, or plain training in one process. Segment ``i`` pairs
queries ``cu_q[i]:cu_q[i+1]`` with keys ``cu_k[i]:cu_k[i+1]``; with a KV cache a segment has fewer
queries than keys and the causal mask is bottom-right aligned (the kernels' contract), so the last
query sees every key. It goes through the same ``hf_longctx::core_attention`` op as the distributed
backends, so recompute-aware checkpointing keeps its output too; without autograd (inference) it
calls the kernel directly and registers nothing.
"""

from __future__ import annotations

import math

import torch

from ..kernels import attention_backward, attention_forward
from .contract import ScheduleBackend
from .engine import RunContext
from .op import run_core_attention
from .schedule import rotation_schedule


class LocalBackend(ScheduleBackend):
    """Backend ``local``: the rotation schedule on one rank (refused on a group of several)."""

    sequence_parallel = False

    def __init__(self) -> None:
        super().__init__("local", rotation_schedule,
                         "single-device attention over the whole sequence (sequence-parallel size 1)")


def _kernel_kwargs(run: RunContext) -> dict:
    window = run.options.get("window")
    return {} if window is None else {"window": window}


def _forward(run: RunContext, q, k, v):
    o = run.options
    return attention_forward(q, k, v, o["cu_q"], o["cu_k"], o["max_q"], o["max_k"], causal=o.get("causal", True),
                             softmax_scale=run.scale, kernel=run.kernel, **_kernel_kwargs(run))


def _backward(run: RunContext, dout, q, k, v, out, lse):
    o = run.options
    return attention_backward(dout, q, k, v, out, lse, o["cu_q"], o["cu_k"], o["max_q"], o["max_k"],
                              causal=o.get("causal", True),
                              softmax_scale=run.scale, kernel=run.kernel, **_kernel_kwargs(run))


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: list[int],
    cu_seqlens_k: list[int],
    *,
    softmax_scale: float | None = None,
    kernel: str = "auto",
    window: int | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Attention of packed (T, H, D) segments in this process; returns (Tq, Hq, D).

    ``window`` (a sliding-window size, None = full causal) is handed to the kernels unchanged;
    ``causal=False`` lets every query see every key of its segment (bidirectional layers).
    """
    cu_q, cu_k = [int(x) for x in cu_seqlens_q], [int(x) for x in cu_seqlens_k]
    if len(cu_q) != len(cu_k) or cu_q[-1] != q.shape[0] or cu_k[-1] != k.shape[0]:
        raise ValueError(f"segments do not match the tensors: cu_seqlens_q ends at {cu_q[-1]} for {q.shape[0]} "
                         f"queries, cu_seqlens_k at {cu_k[-1]} for {k.shape[0]} keys")
    max_q = max((b - a for a, b in zip(cu_q, cu_q[1:])), default=0)
    max_k = max((b - a for a, b in zip(cu_k, cu_k[1:])), default=0)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    options = {"cu_q": cu_q, "cu_k": cu_k, "max_q": max_q, "max_k": max_k, "window": window, "causal": causal}
    run = RunContext(None, (), None, 0, scale, kernel, _forward, _backward, options)
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))):
        return _forward(run, q, k, v)[0]
    return run_core_attention(q, k, v, run)
