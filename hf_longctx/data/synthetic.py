"""Random-token packed datasets with a document-length mix, for tests and benchmarks."""

from __future__ import annotations

import random

import datasets


def _lognormal_lengths(total: int, rng: random.Random, mu: float = 6.5, sigma: float = 1.5) -> list[int]:
    lens, left = [], total
    while left:
        n = min(left, max(1, int(rng.lognormvariate(mu, sigma))))
        lens.append(n)
        left -= n
    return lens


def document_lengths(mix: str, total: int, seed: int = 0) -> list[int]:
    """Lengths summing to ``total``: 'uniform' (one document), 'lognormal', or a synthetic mix name."""
    if mix == "uniform":
        return [total]
    if mix == "lognormal":
        return _lognormal_lengths(total, random.Random(seed))
    from .synthetic_lengths import synthetic_doc_lengths

    return synthetic_doc_lengths(mix, total, seed=seed, max_doc_len=total)


def packed_synthetic_dataset(num_rows: int, seq_len: int, mix: str = "lognormal", vocab_size: int = 512,
                             seed: int = 0) -> datasets.Dataset:
    """``num_rows`` rows of ``seq_len`` random tokens with ``doc_lens`` drawn from ``mix``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    rows = {"input_ids": [], "doc_lens": []}
    for i in range(num_rows):
        rows["doc_lens"].append(document_lengths(mix, seq_len, seed=seed * 100003 + i))
        rows["input_ids"].append(torch.randint(0, vocab_size, (seq_len,), generator=gen).tolist())
    return datasets.Dataset.from_dict(rows)
