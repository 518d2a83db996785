"""torch's built-in FlashAttention-2 varlen kernels (aten._flash_attention_forward/backward).

Public-enough ops that ship with every CUDA build of torch: packed (T, H, D) input, cu_seqlens,
native GQA, bottom-right causal alignment and a log-sum-exp output. FlashAttention marks rows that
see no key with lse = +inf (so its backward yields zero); our contract uses -inf, so the sign is
flipped on the way out and back in.

Sliding windows use the ops' ``window_size_left``/``window_size_right`` keywords (torch >= 2.5),
which follow the same bottom-right convention: our ``window=w`` is ``(w - 1, 0)`` when causal and
``(w - 1, -1)`` (open to the right) when not.
"""

from __future__ import annotations

import torch

from .contract import KernelCall
from .key_split import RULE
from .launch import LaunchGrid
from .validate import gpu_input_problem

name = "torch_flash"
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


FORWARD_PAIRING = 1.6  # two forward blocks on one SM each take this times their time alone (see launch_grid)
EMPTY_HOLD = 0.0  # tile steps an empty forward block holds its slot past a one-wave launch (see launch_grid)


def launch_grid(head_dim: int) -> LaunchGrid | None:
    """FlashAttention-2's blocks at head dim 128 (forward: 128 query rows over 64-key tiles, 4 warps; backward:
    128 keys over 64-row query tiles, 8 warps, one block per SM), launched tile-fastest, then segment, then head.
    The forward's weight, 0.15 (below its share of a forward+backward's time), is fitted to every kernel call of
    CAD steps of 8-64 emulated ranks on three document mixes; it priced servers closer than the forward's time
    share or no tail. Forward blocks run two to an SM past one per SM, each :data:`FORWARD_PAIRING` times slower
    (``scripts/lab/profile_cad.py --placement``). An empty block takes its place in a one-wave launch (the blocks
    after it pair as if it ran) and no time past that: with the forward's key split and its one-kernel merge, that
    priced dumped CAD steps of W = 64 closer per server than empty blocks holding their slot for 0.3 tile steps
    (0.3 had fitted best before the key split). A forward call whose few long blocks leave SMs idle runs as chunks
    of its keys (:data:`.key_split.RULE`), which made the forward of ProLong servers at W = 64 faster (measured:
    bench/results/2026-12-04_from-modules.md). Other head dims use other tiles: not modelled."""
    if head_dim != 128:
        return None
    return LaunchGrid(forward_tile=(128, 64), backward_tile=(64, 128), forward_weight=0.15,
                      forward_pairing=FORWARD_PAIRING, empty_hold=EMPTY_HOLD, forward_key_split=RULE)


def backward_keys_limit(heads: int, kv_heads: int, head_dim: int, itemsize: int) -> int | None:
    """Keys per backward call past which the call runs slower per key (None: no such limit).

    Why: with grouped-query attention the backward computes every query head's dK and dV (``heads`` of them, in
    the input dtype) and sums each group into its KV head with a torch reduction. Once that buffer passes 2 GiB
    the reduction leaves 32-bit indexing and slows down per key, in one call or in several
    (``scripts/lab/profile_cad.py``; measured: bench/results/2026-12-04_from-modules.md). A CAD server cuts its batch
    into calls under this limit
    (:func:`~hf_longctx.kernels.calls.cut_into_calls`), and the launch cost model prices what a longer single segment
    pays (:class:`~hf_longctx.backends.cad.launch_cost.PhaseTerms`' ``k_spill``)."""
    if heads == kv_heads:
        return None  # no expanded gradients: the kernel writes dK and dV directly
    return (1 << 31) // (heads * head_dim * itemsize)


def supports(call: KernelCall) -> str | None:
    """Why this kernel cannot take the call, or None when it can."""
    problem = gpu_input_problem("torch_flash", call.q, SUPPORTED_DTYPES, MAX_HEAD_DIM,
                                "; use kernel='reference' for fp32/fp64")
    if problem:
        return problem
    if not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return "this torch build has no aten._flash_attention_forward"
    return None


def _window_kwargs(causal: bool, window: int | None) -> dict:
    if window is None:
        return {}
    return {"window_size_left": window - 1, "window_size_right": 0 if causal else -1}


def forward(call: KernelCall) -> tuple[torch.Tensor, torch.Tensor]:
    q = call.q
    out, lse, _rng, _unused, _ = torch.ops.aten._flash_attention_forward(
        q, call.k, call.v, call.cu_seqlens_q_device, call.cu_seqlens_k_device, call.max_seqlen_q, call.max_seqlen_k,
        0.0, call.causal, False, scale=call.softmax_scale, **_window_kwargs(call.causal, call.window),
    )
    lse = lse[:, : q.shape[0]]
    lse = lse.masked_fill(lse == float("inf"), float("-inf"))
    return out, lse


def backward(call: KernelCall, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = call.q
    lse = lse.float().masked_fill(lse == float("-inf"), float("inf")).contiguous()
    empty = torch.empty(0, dtype=torch.uint64 if hasattr(torch, "uint64") else torch.int64, device=q.device)
    rng_state = torch.zeros(2, dtype=torch.uint64 if hasattr(torch, "uint64") else torch.int64, device=q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout.contiguous(), q, call.k, call.v, out.contiguous(), lse, call.cu_seqlens_q_device,
        call.cu_seqlens_k_device, call.max_seqlen_q, call.max_seqlen_k, 0.0, call.causal, rng_state, empty,
        scale=call.softmax_scale, **_window_kwargs(call.causal, call.window),
    )
    return dq, dk, dv
