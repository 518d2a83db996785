"""Exact attention of packed segments given by their boundaries, in this process alone: no shard plan, no group.

Why it exists beside the backend ``local`` (:mod:`.local`): a backend runs a shard plan, the document lengths of one
packed sequence, through the checks, schedule and op every backend shares; a model call that no sequence-parallel
batch was prepared for (evaluation, ``generate()`` with a KV cache, a padded batch, plain training in one process)
has no plan, only segments, and decoding segments have fewer queries than keys, which no shard plan describes. The
transformers layer finds those segments in what transformers hands its attention function
(:mod:`hf_longctx.hf.integration.unsharded`) and calls :func:`segment_attention`. Segment ``i`` pairs
queries ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` with keys ``cu_seqlens_k[i]:cu_seqlens_k[i+1]``; with a
KV cache a segment has fewer queries than keys and the causal mask is bottom-right aligned (the
kernels' contract), so the last query sees every key. With autograd it goes through the same
``hf_longctx::core_attention`` op as the distributed backends, so recompute-aware checkpointing keeps
its output too; without autograd (inference) it calls the kernel directly and registers nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..kernels import KernelCall, kernel_backward, kernel_call, kernel_forward
from .op import run_core_attention


@dataclass(frozen=True)
class SegmentRun:
    """What the core-attention op runs for a call of :func:`segment_attention`: the checked kernel call and the kernel.

    The op hands back q, k and v (the same tensors, or recomputed ones under checkpointing), so only
    they are swapped into the call; segments, scale and window stay as they were checked.
    """

    call: KernelCall
    kernel: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return kernel_forward(replace(self.call, q=q, k=k, v=v), self.kernel)

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return kernel_backward(replace(self.call, q=q, k=k, v=v), dout, out, lse, self.kernel)


def segment_attention(
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
    cu_q, cu_k = tuple(int(x) for x in cu_seqlens_q), tuple(int(x) for x in cu_seqlens_k)
    if len(cu_q) != len(cu_k) or cu_q[-1] != q.shape[0] or cu_k[-1] != k.shape[0]:
        raise ValueError(f"segments do not match the tensors: cu_seqlens_q ends at {cu_q[-1]} for {q.shape[0]} "
                         f"queries, cu_seqlens_k at {cu_k[-1]} for {k.shape[0]} keys")
    call = kernel_call(q, k, v, cu_q, cu_k, max((b - a for a, b in zip(cu_q, cu_q[1:])), default=0),
                       max((b - a for a, b in zip(cu_k, cu_k[1:])), default=0), causal=causal,
                       softmax_scale=softmax_scale, window=window)
    run = SegmentRun(call, kernel)
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))):
        return run.forward(q, k, v)[0]
    return run_core_attention(q, k, v, run)
