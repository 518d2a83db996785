"""Input checks shared by every kernel.

Wrong shapes in attention kernels tend to surface as an opaque CUDA error or, worse, as plausible but
wrong numbers. Every public entry point runs these checks first so the user gets a ValueError that
names the problem and the fix.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_attention_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
) -> None:
    """Raise ValueError unless q/k/v and the cumulative lengths describe a valid packed problem."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(
                f"{name} must be packed token-major (tokens, heads, head_dim), got shape {tuple(t.shape)}; "
                "reshape (batch, heads, seq, dim) inputs with .transpose(1, 2).reshape(-1, heads, dim)"
            )
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; use one of float16, bfloat16, float32, float64")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them first")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q head_dim {q.shape[2]} differs from k head_dim {k.shape[2]}")
    hq, hkv = q.shape[1], k.shape[1]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"query heads ({hq}) must be a multiple of key/value heads ({hkv}) for grouped-query attention"
        )
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(f"{name} must be a 1-D tensor [0, ..., total] with at least two entries")
        if cu.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be an integer tensor (int32), got {cu.dtype}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q has {cu_seqlens_q.numel() - 1} segments but cu_seqlens_k has "
            f"{cu_seqlens_k.numel() - 1}; both must list the same documents"
        )
    for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, q.shape[0]), ("cu_seqlens_k", cu_seqlens_k, k.shape[0])):
        host = cu.tolist() if cu.device.type == "cpu" else None
        if host is None:
            continue  # device tensors are checked by the caller that built them; avoid a sync here
        if host[0] != 0 or host[-1] != total:
            raise ValueError(
                f"{name} must start at 0 and end at the number of tokens ({total}), got {host[0]}..{host[-1]}"
            )
        if any(b < a for a, b in zip(host, host[1:])):
            raise ValueError(f"{name} must be non-decreasing")


def check_window(window) -> None:
    """Raise ValueError unless ``window`` is None or a whole number of keys >= 1."""
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int):
        raise ValueError(f"window must be an int (keys in the band) or None, got {window!r}")
    if window < 1:
        raise ValueError(f"window must be >= 1 (a window of w keys ends at the diagonal), got {window}")


def gpu_input_problem(kernel: str, q: torch.Tensor, dtypes: tuple[torch.dtype, ...], max_head_dim: int | None = None,
                      dtype_hint: str = "") -> str | None:
    """What every GPU kernel asks of its input (CUDA tensors, a half dtype, a head dim it can tile),
    worded the same for each kernel: a sentence naming the problem, or None."""
    if q.device.type != "cuda":
        return f"{kernel} needs CUDA tensors"
    if q.dtype not in dtypes:
        return f"{kernel} takes float16/bfloat16, not {q.dtype}{dtype_hint}"
    d = q.shape[-1]
    if max_head_dim is not None and (d % 8 != 0 or d > max_head_dim):
        return f"{kernel} needs head_dim a multiple of 8 and <= {max_head_dim}, got {d}"
    return None
