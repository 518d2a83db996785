"""Random-token packed datasets with a document-length mix, for tests and benchmarks.

Each row is a full ``seq_len`` budget whose ``doc_lens`` are drawn from a mix, as the CAD/DistCA
benchmarks fill a fixed token budget with documents of the Pretrain or ProLong distribution
(documents longer than the row are capped at the row). Tokens are uniform random ids: attention
cost depends on the document structure only. Built with numpy and Arrow, so 512K-token rows are cheap.

The "pretrain" / "prolong" mixes come from :mod:`hf_longctx.data.synthetic_lengths`, imported only
when asked for. Where that module is absent (a trimmed install), they fall back to the "lognormal"
mix below, with a warning: lognormal lengths with mu 6.5 and sigma 1.5 (median ~660 tokens, mean
~2K), drawn until the row is full (the last document is cut to fit).
"""

from __future__ import annotations

import random
import warnings

import datasets
import numpy as np
import pyarrow as pa

from .tokenization import list_array

MIXES = ("uniform", "lognormal", "pretrain", "prolong")


def _lognormal_lengths(total: int, rng: random.Random, mu: float = 6.5, sigma: float = 1.5) -> list[int]:
    lens, left = [], total
    while left:
        n = min(left, max(1, int(rng.lognormvariate(mu, sigma))))
        lens.append(n)
        left -= n
    return lens


def document_lengths(mix: str, total: int, seed: int = 0) -> list[int]:
    """Lengths summing to ``total``: 'uniform' (one document), 'lognormal' (median ~660 tokens), or the CAD
    paper's synthetic 'pretrain' / 'prolong' mixes (capped at ``total``)."""
    if mix == "uniform":
        return [total]
    if mix == "lognormal":
        return _lognormal_lengths(total, random.Random(seed))
    if mix not in MIXES:
        raise ValueError(f"unknown length mix {mix!r}; use one of {MIXES}")
    try:
        from .synthetic_lengths import synthetic_doc_lengths
    except ImportError:
        warnings.warn(f"hf_longctx.data.synthetic_lengths is not available: the {mix!r} mix falls back to "
                      "lognormal lengths (mu 6.5, sigma 1.5)", stacklevel=2)
        return _lognormal_lengths(total, random.Random(seed))
    return synthetic_doc_lengths(mix, total, seed=seed, max_doc_len=total)


def packed_synthetic_dataset(num_rows: int, seq_len: int, mix: str = "prolong", vocab_size: int = 512,
                             seed: int = 0) -> datasets.Dataset:
    """``num_rows`` rows of ``seq_len`` random tokens (ids < ``vocab_size``) with ``doc_lens`` drawn from ``mix``.

    Deterministic for a seed: row ``i`` takes its lengths from seed ``seed * 100003 + i``.
    """
    lens = [document_lengths(mix, seq_len, seed=seed * 100003 + i) for i in range(num_rows)]
    tokens = np.random.default_rng(seed).integers(0, vocab_size, size=num_rows * seq_len, dtype=np.int64)
    counts = np.array([len(x) for x in lens], dtype=np.int64)
    table = pa.table({
        "input_ids": list_array(values=tokens, offsets=np.arange(num_rows + 1, dtype=np.int64) * seq_len),
        "doc_lens": list_array(values=np.fromiter((n for x in lens for n in x), np.int64, int(counts.sum())),
                               offsets=np.concatenate([[0], np.cumsum(counts)])),
    })
    return datasets.Dataset(table)
