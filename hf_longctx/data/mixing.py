"""ProLong-style length mixing: choose documents so token shares per length bucket (and source) hit targets.

Long-context data recipes fix what share of the TOKENS comes from documents of each length range
(e.g. 40% from documents >= 64K tokens) and from each source (books, code repositories, short web
text). :func:`length_mix` samples whole documents to such a target:

* buckets are given by their lower bounds in tokens; a document belongs to the bucket
  ``[bound_i, bound_{i+1})`` (the last bucket is open; documents below the smallest bound are left out);
* ``{bound: share}`` mixes buckets over all documents; with ``source_shares`` every source gets its
  share and is split over the buckets the same way; ``{(source, bound): share}`` targets each
  (source, bucket) group directly (e.g. books only long, web only short);
* within a group documents are drawn without repetition in a seeded random order, and the group
  stops at the count of documents whose token sum is closest to its quota. So every group is within
  half its longest document of its quota: the stated tolerance the tests assert
  (``|tokens_g - share_g * total| <= max_len_g / 2``);
* ``total_tokens=None`` takes the largest total that needs no document twice; a larger total raises
  unless ``replace=True``, which repeats a group in whole passes (each a fresh permutation), as
  recipes that upsample a scarce source do.

The result is ``dataset.select(...)`` in a seeded random order (sources and lengths interleaved), ready
for :func:`pack_documents`. Deterministic for a seed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import datasets
import numpy as np
import pyarrow.compute as pc

from .tokenization import INPUT_IDS

GroupKey = tuple  # (source or None, bucket lower bound)


def token_shares(lengths: Sequence[int], bounds: Sequence[int]) -> dict[int, float]:
    """Share of all tokens (of documents >= the smallest bound) per bucket lower bound."""
    bounds = sorted(bounds)
    lengths = np.asarray(lengths, dtype=np.int64)
    idx = np.searchsorted(np.asarray(bounds), lengths, side="right") - 1
    inside = idx >= 0
    per_bucket = np.bincount(idx[inside], weights=lengths[inside], minlength=len(bounds))
    total = per_bucket.sum()
    return {b: float(per_bucket[i] / total) if total else 0.0 for i, b in enumerate(bounds)}


def document_token_lengths(dataset: datasets.Dataset, length_column: str | None = None) -> np.ndarray:
    """Token count of every row: ``length_column`` if given, else the length of ``input_ids`` (read in Arrow)."""
    column = length_column or INPUT_IDS
    if column not in dataset.column_names:
        raise ValueError(f"column {column!r} not in the dataset (columns: {dataset.column_names}); tokenize first "
                         "(tokenize_documents) or pass length_column")
    parts = []
    for table in dataset.select_columns([column]).with_format("arrow").iter(batch_size=65536):
        col = table.column(column)
        parts.append((col if length_column else pc.list_value_length(col)).to_numpy(zero_copy_only=False))
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def _targets(bucket_shares: Mapping, source_shares: Mapping | None) -> dict[GroupKey, float]:
    """Normalised share per (source, bound) group from the two ways of stating a mix."""
    joint = [k for k in bucket_shares if isinstance(k, tuple)]
    if joint and len(joint) != len(bucket_shares):
        raise ValueError("bucket_shares keys must be all bucket bounds or all (source, bound) pairs")
    if joint and source_shares is not None:
        raise ValueError("give source_shares only with bound keys; (source, bound) keys already name sources")
    if any(v < 0 for v in bucket_shares.values()) or not sum(bucket_shares.values()) > 0:
        raise ValueError(f"shares must be >= 0 with a positive sum, got {dict(bucket_shares)}")
    for name, shares in (("bucket", bucket_shares), ("source", source_shares)):
        if shares is not None and abs(sum(shares.values()) - 1) > 1e-6:
            raise ValueError(f"{name} shares must sum to 1, got {sum(shares.values())}")
    if joint:
        return {(s, int(b)): float(v) for (s, b), v in bucket_shares.items() if v > 0}
    sources = source_shares if source_shares is not None else {None: 1.0}
    return {(s, int(b)): float(sv * bv) for s, sv in sources.items() for b, bv in bucket_shares.items() if sv * bv > 0}


def _closest_prefix(lengths: np.ndarray, quota: float) -> int:
    """Number of leading documents whose token sum is closest to ``quota`` (ties: fewer)."""
    cum = np.cumsum(lengths)
    k = int(np.searchsorted(cum, quota, side="left"))  # cum[k-1] < quota <= cum[k]
    if k >= len(cum):
        return len(cum)
    below = cum[k - 1] if k else 0
    return k if quota - below <= cum[k] - quota else k + 1


def length_mix(
    dataset: datasets.Dataset,
    bucket_shares: Mapping[int, float] | Mapping[tuple[str, int], float],
    total_tokens: int | None = None,
    seed: int = 0,
    source_column: str | None = None,
    source_shares: Mapping[str, float] | None = None,
    length_column: str | None = None,
    replace: bool = False,
) -> datasets.Dataset:
    """Select documents of ``dataset`` so token shares per length bucket (and source) hit the targets.

    See the module docstring for the forms of ``bucket_shares`` and the tolerance. Lengths come from
    ``length_column`` or ``len(input_ids)``; sources from ``source_column``.
    """
    if isinstance(dataset, datasets.IterableDataset):
        raise TypeError("length_mix needs every document's length up front: use a Dataset (streaming sources can "
                        "be mixed by share with datasets.interleave_datasets(probabilities=...))")
    targets = _targets(bucket_shares, source_shares)
    if any(s is not None for s, _ in targets) and source_column is None:
        raise ValueError("source shares need source_column")
    lengths = document_token_lengths(dataset, length_column)
    bounds = sorted({b for _, b in targets})
    bucket = np.searchsorted(np.asarray(bounds), lengths, side="right") - 1
    if source_column is not None:
        sources = np.asarray(dataset.select_columns([source_column]).with_format("arrow")[:][source_column]
                             .to_numpy(zero_copy_only=False))
    members = {}
    for key in targets:
        src, bound = key
        mask = bucket == bounds.index(bound)
        if src is not None:
            mask &= sources == src
        members[key] = np.flatnonzero(mask & (lengths > 0))
    available = {key: int(lengths[idx].sum()) for key, idx in members.items()}
    if total_tokens is None:
        total_tokens = int(min(available[k] / share for k, share in targets.items()))
    rng = np.random.default_rng(seed)
    chosen = []
    for key, share in targets.items():
        quota = share * total_tokens
        src, bound = key
        if available[key] == 0 or (available[key] < quota and not replace):
            raise ValueError(
                f"not enough documents of length >= {bound}" + (f" from source {src!r}" if src is not None else "")
                + f" for {quota:.0f} tokens (they hold {available[key]}); lower its share or total_tokens, "
                "or pass replace=True to repeat them")
        idx = members[key]
        while quota > 0:
            order = idx[rng.permutation(len(idx))]
            take = _closest_prefix(lengths[order], quota)
            chosen.append(order[:take])
            quota -= lengths[order[:take]].sum()
            if take < len(order):
                break
    picked = np.concatenate(chosen) if chosen else np.zeros(0, np.int64)
    return dataset.select(picked[rng.permutation(len(picked))].tolist())
