"""FlashAttention-4 varlen kernels (the flash-attention project's CuTe-DSL kernels), an optional extra.

``pip install "hf-longctx[fa4]"`` brings ``flash-attn-4``; on Hopper it runs packed documents at
nearly twice torch's FlashAttention-2's rate (measured: bench/results/2026-11-22_kernels.md). The package is pure Python
and compiles a kernel per configuration (dtype, head dims, GQA ratio, causal, window) on first use, not per
shape, so varying document lengths cost nothing after warm-up. Its persistent compile cache is
switched on here (unless the user set ``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED``), so a second
process of the same run loads compiled kernels from disk instead of compiling again.

Forward and backward go through the low-level entry points because the kernel contract needs a
backward from a GIVEN out and lse (the final, merged ones), which the autograd wrapper
``flash_attn_varlen_func`` cannot take. FlashAttention-4 already follows the contract: lse is
float32 (heads, tokens), causal is bottom-right aligned and rows without a visible key give out 0,
lse -inf.
"""

from __future__ import annotations

import functools
import os
import time

import torch

from .contract import KernelCall
from .key_split import RULE
from .launch import LaunchGrid
from .validate import gpu_input_problem

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
# Compute capabilities whose forward AND backward FlashAttention-4 implements (Hopper, Blackwell).
SUPPORTED_ARCHS = (9, 10, 11)
name = "fa4"
INSTALL_HINT = 'pip install "hf-longctx[fa4]" (flash-attn-4 with its CUDA 13 CuTe-DSL libraries)'

_compiles = {"count": 0, "seconds": 0.0}


@functools.lru_cache(maxsize=1)
def _interface():
    """flash_attn.cute.interface, or the ImportError text when the extra is missing."""
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    try:
        from flash_attn.cute import interface
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable", with the reason kept
        return f"{type(exc).__name__}: {exc}"
    return interface


def is_installed() -> bool:
    return not isinstance(_interface(), str)


def missing_extra(device: torch.device) -> str | None:
    """The install command when the extra is absent and would serve ``device``, else None."""
    return None if is_installed() or not worth_installing(device) else INSTALL_HINT


def worth_installing(device: torch.device) -> bool:
    """Would installing the extra give this GPU a faster kernel? Only Hopper and Blackwell run it."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] in SUPPORTED_ARCHS


def supports(call: KernelCall) -> str | None:
    """Why FlashAttention-4 cannot take this call, or None when it can."""
    q = call.q
    iface = _interface()
    if isinstance(iface, str):
        return f"flash-attn-4 is not installed ({iface}); {INSTALL_HINT}"
    problem = gpu_input_problem("fa4", q, SUPPORTED_DTYPES)
    if problem:
        return problem
    major = torch.cuda.get_device_capability(q.device)[0]
    if major not in SUPPORTED_ARCHS:
        return f"fa4 runs forward and backward on Hopper and Blackwell (sm90/sm100), this GPU is sm{major}x"
    d = q.shape[-1]
    if major == 9 and not (8 <= d <= 256 and d % 8 == 0):
        return f"fa4 on sm90 needs head_dim in 8..256 and a multiple of 8, got {d}"
    if major != 9 and not ((8 <= d <= 128 and d % 8 == 0) or d == 256):
        return f"fa4 on sm{major}x needs head_dim in 8..128 (multiple of 8) or 256, got {d}"
    return None


def compile_stats() -> dict[str, float]:
    """Kernel configurations first run by this process, and the seconds those first calls took.

    FlashAttention-4 compiles once per configuration (or loads it from its disk cache), so the
    first call of a configuration is where compile time goes.
    """
    return dict(_compiles)


_configurations: set[tuple] = set()


def _timed_compiles(key: tuple, call):
    """Run ``call``; the first call of a kernel configuration compiles it, so its time counts as compiling."""
    if key in _configurations:
        return call()
    start = time.perf_counter()
    result = call()
    torch.cuda.synchronize()
    _configurations.add(key)
    _compiles["count"] += 1
    _compiles["seconds"] += time.perf_counter() - start
    return result


def _configuration(direction: str, q, k, causal: bool, window: int | None) -> tuple:
    """What FlashAttention-4 compiles a kernel for: not the lengths, only the kind of problem."""
    return (direction, q.dtype, q.shape[1], k.shape[1], q.shape[2], causal, window is not None, q.device)


# Tile steps under which a backward block of 128 keys runs slower per step (launch.backward_short_steps): 16
# priced a W = 64 ProLong step's servers best of 8-48 and of no term, per server and per held-out call
# (measured: bench/results/2026-12-04_from-modules.md).
BACKWARD_MIN_STEPS = 16


def launch_grid(head_dim: int) -> LaunchGrid | None:
    """FlashAttention-4's varlen launch on Hopper at head dim 128 (flash-attn-4 4.0.0b36, ``flash_attn/cute``): the
    causal forward's tiles are 128 rows by 128 keys, the backward's 64 rows by 128 keys; both grids hold each
    segment's own blocks, segment after segment, the forward's longest first with the heads innermost
    (``SingleTileVarlenScheduler``); a backward block of fewer than :data:`BACKWARD_MIN_STEPS` query tiles is
    slower per tile. FA4 has no split-KV forward on Hopper, so a forward of few rows over a long prefix (a few dozen
    blocks, each sweeping thousands of keys) runs as chunks of its keys and is merged
    (:mod:`~hf_longctx.kernels.key_split`, the rule torch_flash uses: ``forward_key_split``). With grouped-query
    heads the forward packs a KV head's query heads into one tile's rows (:func:`packs_query_heads`). Other GPUs and
    head dims run other kernels: not modelled. The forward's weight (read only by the grid profile's tail,
    :func:`~.launch.tail_factor`) is its share of a forward+backward's work, 1 in 3.5, not fitted: the launch cost
    model fits each phase on its own."""
    if head_dim != 128 or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return None
    return LaunchGrid(forward_tile=(128, 128), backward_tile=(64, 128), forward_weight=0.3, launch_order="segment",
                      backward_min_steps=BACKWARD_MIN_STEPS, forward_key_split=RULE)


def backward_accumulator_keys(heads: int, kv_heads: int, head_dim: int, l2_bytes: int) -> tuple[int, int] | None:
    """Keys of a backward segment from which its fp32 dK/dV accumulators start to leave an L2 of ``l2_bytes``, and
    from which they are out of it (see :func:`~hf_longctx.kernels.launch.accumulator_share`); None without
    grouped-query heads (flash-attn-4 then writes dK and dV directly).

    One query head's accumulators take ``2 * head_dim * 4`` bytes per key (dK and dV in fp32); they start to leave
    the L2 once they fill a quarter of it and are out of it at three quarters (the block's K, V, dO and dQ lines
    share the cache). That ramp priced dumped W = 64 steps closer than a third to the whole L2 or a sixth to three
    quarters (measured: bench/results/2026-11-29_cad-fa4.md)."""
    if heads == kv_heads or l2_bytes <= 0:
        return None
    full = l2_bytes // (2 * head_dim * 4)
    return full // 4, 3 * full // 4


def packs_query_heads(heads: int, kv_heads: int) -> int:
    """Query heads the forward packs into one tile's rows: all of a KV head's (flash-attn-4's default ``pack_gqa``
    with grouped-query heads), so a 128-row tile holds 128 / (heads / kv_heads) tokens."""
    ratio = heads // kv_heads if kv_heads and heads % kv_heads == 0 else 1
    return ratio if ratio > 1 and 128 % ratio == 0 else 1


def _window_args(causal: bool, window: int | None) -> dict:
    """The contract's window of w keys is flash-attn's left bound w - 1; right: the diagonal, or open."""
    if window is None:
        return {}
    return {"window_size_left": window - 1, "window_size_right": 0 if causal else None}


def forward(call: KernelCall) -> tuple[torch.Tensor, torch.Tensor]:
    iface, q, k = _interface(), call.q, call.k
    out, lse = _timed_compiles(_configuration("fwd", q, k, call.causal, call.window), lambda: iface._flash_attn_fwd(
        q, k, call.v, cu_seqlens_q=call.cu_seqlens_q_device, cu_seqlens_k=call.cu_seqlens_k_device,
        max_seqlen_q=call.max_seqlen_q, max_seqlen_k=call.max_seqlen_k, softmax_scale=call.softmax_scale,
        causal=call.causal, return_lse=True, **_window_args(call.causal, call.window),
    )[:2])
    return out, lse


def backward(call: KernelCall, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    iface, q, k = _interface(), call.q, call.k
    lse = lse.float().contiguous()
    dq, dk, dv = _timed_compiles(_configuration("bwd", q, k, call.causal, call.window), lambda: iface._flash_attn_bwd(
        q, k, call.v, out.contiguous(), dout.contiguous(), lse, softmax_scale=call.softmax_scale, causal=call.causal,
        cu_seqlens_q=call.cu_seqlens_q_device, cu_seqlens_k=call.cu_seqlens_k_device,
        max_seqlen_q=call.max_seqlen_q, max_seqlen_k=call.max_seqlen_k, **_window_args(call.causal, call.window),
    )[:3])
    return dq, dk, dv
