"""Turning one packed batch into the ``model(**kwargs)`` of each sequence-parallel rank.

Targets are shifted BEFORE sharding (``shift_labels``): token i predicts token i + 1 of the same
document, the last token of a document predicts nothing, and a shard boundary loses no target.
``num_items_in_batch`` is the global number of targets, so each rank's loss is its share of the
single-device mean and the shares add up exactly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..backends import default_strategy
from ..comm.groups import group_rank_and_size
from ..layout import PackedBatch, ShardPlan, shard_plan
from .context import SequenceParallelContext

IGNORE_INDEX = -100


def packed_batch_of(batch: dict) -> PackedBatch:
    """Document structure of a batch: from ``doc_lens`` if given, else from per-document ``position_ids``."""
    ids = batch.get("input_ids")
    if ids is not None and ids.dim() == 2 and ids.shape[0] != 1:
        raise ValueError(
            f"sequence-parallel training takes ONE packed sequence per step (batch size 1), got input_ids of shape "
            f"{tuple(ids.shape)}; pack documents with hf_longctx.data.PackedCollator"
        )
    if batch.get("doc_lens") is not None:
        packed = PackedBatch.from_doc_lens(batch["doc_lens"].reshape(-1))
    elif batch.get("position_ids") is not None:
        packed = PackedBatch.from_position_ids(batch["position_ids"])
    else:
        raise ValueError(
            "the batch is not packed: it needs position_ids restarting at 0 per document (or doc_lens); "
            "use hf_longctx.data.PackedCollator or transformers' DataCollatorWithFlattening"
        )
    if ids is not None and packed.num_tokens != ids.numel():
        raise ValueError(f"documents cover {packed.num_tokens} tokens but input_ids has {ids.numel()}")
    return packed


def shift_labels_per_document(labels: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
    """(T,) targets: labels[i + 1] inside a document, IGNORE_INDEX at every document's last token."""
    labels = labels.reshape(-1)
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:-1] = labels[1:]
    last = torch.tensor([s + n - 1 for s, n in zip(packed.doc_starts, packed.doc_lens)], device=labels.device)
    shifted[last] = IGNORE_INDEX
    return shifted


def shard_batch(
    batch: dict,
    plan: ShardPlan,
    rank: int,
    group: dist.ProcessGroup | None = None,
    kernel: str = "auto",
) -> dict:
    """kwargs of ``model(**local)`` for ``rank``: its tokens, global positions, shifted targets, context.

    ``batch`` holds one packed sequence: ``input_ids`` (1, T), ``position_ids`` (1, T) restarting per
    document (or ``doc_lens``), optional ``labels`` (1, T; default input_ids).
    """
    packed = plan.batch
    idx = plan.local_indices(rank).to(batch["input_ids"].device)
    input_ids = batch["input_ids"].reshape(-1)
    labels = batch.get("labels")
    labels = input_ids if labels is None else labels.reshape(-1)
    shifted = shift_labels_per_document(labels, packed)
    position_ids = packed.position_ids.to(input_ids.device)
    local_targets = shifted[idx].unsqueeze(0)
    return {
        "input_ids": input_ids[idx].unsqueeze(0),
        "position_ids": position_ids[idx].unsqueeze(0),
        # transformers computes a loss only when labels is given; shift_labels is what it uses
        "labels": local_targets,
        "shift_labels": local_targets,
        "num_items_in_batch": (shifted != IGNORE_INDEX).sum(),
        "longctx": SequenceParallelContext(plan, group, rank, kernel),
    }


def plan_for(packed: PackedBatch, backend: str, group: dist.ProcessGroup | None) -> ShardPlan:
    _, world = group_rank_and_size(group)
    return shard_plan(packed, world, default_strategy(backend))


def gather_group_batch(batch: dict, group: dist.ProcessGroup | None) -> dict:
    """Concatenate the packed batches of all ranks of ``group`` (rank order) into one packed sequence.

    Each rank's data loader yields its own rows; the sequence-parallel group trains on their
    concatenation, so every row is used exactly once and no sampler has to know about the group.
    ``rank_tokens`` lists how many of the tokens each rank brought, in rank order.
    """
    rank, world = group_rank_and_size(group)
    packed = packed_batch_of(batch)
    ids = batch["input_ids"].reshape(-1)
    labels = batch.get("labels")
    labels = ids if labels is None else labels.reshape(-1)
    if world == 1:
        return {"input_ids": ids.unsqueeze(0), "labels": labels.unsqueeze(0),
                "doc_lens": torch.tensor(packed.doc_lens), "rank_tokens": [packed.num_tokens]}
    device = ids.device
    sizes = torch.tensor([packed.num_tokens, packed.num_docs], device=device)
    all_sizes = [torch.empty_like(sizes) for _ in range(world)]
    dist.all_gather(all_sizes, sizes, group=group)
    max_tokens = max(int(s[0]) for s in all_sizes)
    max_docs = max(int(s[1]) for s in all_sizes)
    payload = torch.full((2, max_tokens + max_docs), 0, dtype=torch.int64, device=device)
    payload[0, : packed.num_tokens] = ids
    payload[1, : packed.num_tokens] = labels
    payload[0, max_tokens : max_tokens + packed.num_docs] = torch.tensor(packed.doc_lens, device=device)
    gathered = [torch.empty_like(payload) for _ in range(world)]
    dist.all_gather(gathered, payload, group=group)
    out_ids, out_labels, out_docs = [], [], []
    for (n_tok, n_doc), p in zip((s.tolist() for s in all_sizes), gathered):
        out_ids.append(p[0, :n_tok])
        out_labels.append(p[1, :n_tok])
        out_docs.append(p[0, max_tokens : max_tokens + n_doc])
    return {"input_ids": torch.cat(out_ids).unsqueeze(0), "labels": torch.cat(out_labels).unsqueeze(0),
            "doc_lens": torch.cat(out_docs).cpu(), "rank_tokens": [int(s[0]) for s in all_sizes]}
