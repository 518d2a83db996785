"""Document-length mixes for emulated benchmarks: ProLong, Pretrain, and a short-document SFT mix.

Why a third mix: kernel efficiency collapses on short segments (bench/results/2026-12-04_from-modules.md), so a schedule
balanced in FLOPs can be far off in time exactly where documents are short. ``sft``: lognormal lengths with median ~400
tokens (``mu = 6.0``, ``sigma = 0.9``), capped
at 8K, so most documents are under 2K tokens; lengths sum exactly to the total.
"""

from __future__ import annotations

import numpy as np
import torch

from hf_longctx.data.synthetic_lengths import MIXES, synthetic_doc_lengths

SFT_MU, SFT_SIGMA, SFT_CAP = 6.0, 0.9, 8192
WORKLOAD_MIXES = (*MIXES, "sft")


def sft_doc_lengths(total: int, seed: int = 0) -> list[int]:
    """Short-document lengths summing to ``total`` (see the module docstring)."""
    rng = np.random.default_rng(np.random.SeedSequence([7, int(seed)]))
    lens: list[int] = []
    left = total
    while left > 0:
        draw = np.clip(np.rint(rng.lognormal(SFT_MU, SFT_SIGMA, size=1024)), 1, SFT_CAP).astype(np.int64)
        for n in draw.tolist():
            n = min(n, left)
            lens.append(n)
            left -= n
            if not left:
                break
    return lens


def doc_lengths(mix: str, total: int, seed: int = 0) -> list[int]:
    """Lengths of the named mix (``prolong``, ``pretrain`` or ``sft``) summing to ``total``."""
    if mix == "sft":
        return sft_doc_lengths(total, seed)
    if mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r}; choose one of {', '.join(WORKLOAD_MIXES)}")
    return synthetic_doc_lengths(mix, total, seed=seed, max_doc_len=total)


def global_tensors(total: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                   seed: int) -> tuple[torch.Tensor, ...]:
    """A global packed batch's random ``(q, k, v, dout)`` of ``total`` tokens (seeded), as an emulated step takes
    them: every rank cuts its rows from these, as a real rank would from its input."""
    g = torch.Generator(device=device).manual_seed(seed)
    return tuple(torch.randn(total, h, head_dim, generator=g, device=device, dtype=dtype)
                 for h in (heads, kv_heads, kv_heads, heads))
