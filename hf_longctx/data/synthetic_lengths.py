"""Synthetic document-length distributions for benchmarks and scheduler simulations.

The CAD (DistCA) paper evaluates on two synthetic length distributions: *Pretrain*, a pretraining
corpus where most documents are short and a few are very long, and *ProLong*, which upsamples long
documents the way long-context continued training does (ProLong's mix takes about half of its tokens
from long books and code repositories). Attention cost grows with the square of the length, so the
long tail, not the typical document, decides the load imbalance. The parameters below are explicit so
simulations can be reproduced and varied:

- ``pretrain``: lognormal lengths, ``mu = 7.0``, ``sigma = 1.4`` (median e^7 ~ 1.1K tokens, mean
  ~2.9K; about 15% of the tokens are in documents of 32K tokens or more).
- ``prolong``: ``long_token_share = 0.5`` of the tokens from long documents, log-uniform between
  ``32K`` and the cap; the rest from the ``pretrain`` lognormal.

Every document is capped at ``max_doc_len`` (default 512K tokens). Lengths sum exactly to
``total_tokens``: each stream's last document is truncated to fit, and the streams are then shuffled.
Deterministic for a (mix, seed) pair: numpy's PCG64 seeded with both.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["MIXES", "LengthMix", "PARAMS", "synthetic_doc_lengths"]

MIXES = ("pretrain", "prolong")
DEFAULT_MAX_DOC_LEN = 524288


@dataclass(frozen=True)
class LengthMix:
    """Lognormal body (``mu``, ``sigma`` of the natural log of the length) plus a share of tokens from
    log-uniform long documents in ``[long_min, cap]``."""

    mu: float = 7.0
    sigma: float = 1.4
    long_token_share: float = 0.0
    long_min: int = 32768


PARAMS = {
    "pretrain": LengthMix(),
    "prolong": LengthMix(long_token_share=0.5),
}


def _fill(budget: int, draw, mean: float, rng: np.random.Generator) -> np.ndarray:
    """Draw lengths until their sum reaches ``budget``; truncate the last one to hit it exactly."""
    parts, got = [], 0
    while got < budget:
        batch = draw(rng, int((budget - got) / mean * 1.1) + 16)
        parts.append(batch)
        got += int(batch.sum())
    if not parts:
        return np.zeros(0, dtype=np.int64)
    lens = np.concatenate(parts)
    csum = np.cumsum(lens)
    last = int(np.searchsorted(csum, budget))  # first index where the running sum reaches budget
    lens = lens[: last + 1].copy()
    lens[-1] -= int(csum[last]) - budget
    return lens


def synthetic_doc_lengths(mix: str, total_tokens: int, seed: int = 0, max_doc_len: int | None = None) -> list[int]:
    """Document lengths of the named mix (``"pretrain"`` or ``"prolong"``) summing to ``total_tokens``.

    Every length is in ``[1, max_doc_len]`` (default 512K); same arguments give the same list.
    """
    if mix not in MIXES:
        raise ValueError(f"unknown length mix {mix!r}; choose one of {', '.join(MIXES)}")
    if total_tokens < 1:
        raise ValueError("total_tokens must be positive")
    cap = int(max_doc_len or DEFAULT_MAX_DOC_LEN)
    if cap < 1:
        raise ValueError("max_doc_len must be positive")
    p = PARAMS[mix]
    rng = np.random.default_rng(np.random.SeedSequence([MIXES.index(mix), int(seed) % (1 << 63)]))

    def body(g: np.random.Generator, size: int) -> np.ndarray:
        return np.clip(g.lognormal(p.mu, p.sigma, size).astype(np.int64), 1, cap)

    lo = min(p.long_min, cap)
    hi = max(cap, lo + 1)

    def tail(g: np.random.Generator, size: int) -> np.ndarray:
        return np.clip(np.exp(g.uniform(np.log(lo), np.log(hi), size)).astype(np.int64), 1, cap)

    long_budget = int(round(total_tokens * p.long_token_share))
    body_mean = min(float(np.exp(p.mu + p.sigma**2 / 2)), cap)
    long_mean = (hi - lo) / max(np.log(hi / lo), 1e-9)
    lens = np.concatenate([_fill(total_tokens - long_budget, body, body_mean, rng),
                           _fill(long_budget, tail, long_mean, rng)])
    lens = lens[rng.permutation(len(lens))]
    return lens.tolist()
