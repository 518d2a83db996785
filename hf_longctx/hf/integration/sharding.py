"""Turning one packed batch into the ``model(**kwargs)`` of each sequence-parallel rank.

Targets are shifted BEFORE sharding (``shift_labels``): token i predicts token i + 1 of the same
document, the last token of a document predicts nothing, and a shard boundary loses no target.
``num_items_in_batch`` is the global number of targets, so each rank's loss is its share of the
single-device mean and the shares add up exactly. :mod:`.rows` turns whatever batch a collator made
into one flat packed sequence per rank; :func:`gather_group_batch` joins a group's flat batches.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...backends import default_strategy, get_backend
from ...backends.api import check_options
from ...backends.options import BackendOptions
from ...backends.prediction import AttentionShape
from ...comm.groups import group_rank_and_size
from ...layout import PackedBatch, ShardPlan, shard_plan
from .context import SequenceParallelContext
from .dynamic_rope import follow_whole_sequence_positions
from .rows import IGNORE_INDEX, FlatBatch, shift_labels_per_document
from .sharded_model import checked_model


def shard_batch(
    batch: dict,
    plan: ShardPlan,
    rank: int,
    group: dist.ProcessGroup | None = None,
    kernel: str = "auto",
    options: BackendOptions | Mapping | None = None,
    *,
    model: torch.nn.Module | None = None,
) -> dict:
    """kwargs of ``model(**local)`` for ``rank``: its tokens, positions, shifted targets, context.
    ``options`` go to every attention call of the forward (the backend's, e.g. CAD's ``eps``): its options
    object, or a mapping, parsed here when ``model=`` names the backend (at the forward's first attention call
    otherwise).

    ``batch`` holds one packed sequence: ``input_ids`` (1, T), ``position_ids`` (1, T), optional
    ``labels`` (1, T; default input_ids). Given positions travel with the tokens unchanged. Without
    them, pass ``model=``: each document of the plan is then numbered as the model numbers a row of its
    own (:func:`~hf_longctx.hf.integration.positions.position_rule`: 0, 1, 2, ... for most models, from
    ``padding_idx + 1`` for RoBERTa and its kin), computed before sharding; without positions and
    without the model this raises, since 0-based positions would be wrong for a model with a rule of
    its own. ``model=`` also lets a rotary embedding that sizes its frequencies by the batch's longest position
    (``longrope``, dynamic NTK) read the whole sequence's (:mod:`.dynamic_rope`); without it such a model is
    refused at its first attention call.

    The model gets the refusals of the callback's input hook (:func:`~.sharded_model.check_model`:
    not a ``longctx_*`` implementation, layers that cannot take packed documents, a forward without
    ``position_ids``, positions that cannot be handed over): here when ``model=`` is given, and in any
    case at the first attention call of ``model(**local)``, on every rank before any collective. What
    no attention call can see is a model whose attention never calls its ``longctx_*`` function (loaded
    with ``sdpa``, or attention modules that bypass transformers' AttentionInterface): it would attend
    inside each shard only, and only ``model=`` refuses the first case; the input hook refuses both
    after the forward. A caller without the hook can ask the same after ``model(**local)``:
    ``hf_longctx.hf.integration.context.attention_calls(local["longctx"])`` is 0 for such a model.
    """
    packed = plan.batch
    input_ids = batch["input_ids"].reshape(-1)
    labels = batch.get("labels")
    labels = input_ids if labels is None else labels.reshape(-1)
    rule = checked_model(model) if model is not None else None
    if model is not None:
        follow_whole_sequence_positions(model)  # RoPE sized by the longest position reads the whole sequence's
    positions = batch.get("position_ids")
    if positions is not None:
        positions = positions.reshape(-1)
    elif rule is None:
        raise ValueError("shard_batch got no position_ids: pass the batch's position_ids, or model=<the model> so "
                         "that every document is numbered by the model's own rule (0-based for most models; "
                         "RoBERTa-like models start at padding_idx + 1)")
    else:
        positions = rule.document_positions(input_ids, packed.doc_lens)
    if model is not None and isinstance(options, Mapping):
        options = _model_options(model, options)
    return _shard(input_ids, positions, shift_labels_per_document(labels, packed), None, plan, rank, group, kernel,
                  options)


def _model_options(model: torch.nn.Module, options: Mapping) -> BackendOptions | Mapping:
    """``options`` parsed for the backend ``model`` runs (a mapping as it is for a model without one)."""
    from ..settings.backend_names import PREFIX, backend_of
    from ..settings.schema import checked_backend_options

    impl = str(getattr(getattr(model, "config", None), "_attn_implementation", None))
    if not impl.startswith(PREFIX):
        return options
    return checked_backend_options(backend_of(impl), options, f"the model runs attn_implementation={impl!r}")


def _shard(input_ids: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor | None,
           padding: torch.Tensor | None, plan: ShardPlan, rank: int, group: dist.ProcessGroup | None,
           kernel: str, options: BackendOptions | Mapping | None = None) -> dict:
    """This rank's rows of a packed sequence's tokens, positions and targets, as model keywords."""
    idx = plan.local_indices(rank).to(input_ids.device)
    local_padding = padding[idx.to(padding.device)] if padding is not None else None
    if local_padding is not None and not bool(local_padding.any()):
        local_padding = None
    local = {
        "input_ids": input_ids[idx].unsqueeze(0),
        "position_ids": positions.to(input_ids.device)[idx].unsqueeze(0),
        "longctx": SequenceParallelContext(plan, group, rank, kernel, local_padding, options or None, positions),
    }
    if targets is not None:
        local_targets = targets[idx.to(targets.device)].unsqueeze(0)
        # transformers computes a loss only when labels is given; shift_labels is what it uses
        local.update(labels=local_targets, shift_labels=local_targets,
                     num_items_in_batch=(targets != IGNORE_INDEX).sum())
    return local


@dataclass
class GroupBatch:
    """The packed sequence a sequence-parallel group trains on: its members' flat batches, in rank order.

    ``rank_tokens`` lists how many tokens each rank brought; ``targets`` is None when the call had no
    labels, ``padding`` None when no rank had padding.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor | None
    padding: torch.Tensor | None
    packed: PackedBatch
    rank_tokens: list[int]

    def shard(self, plan: ShardPlan, rank: int, group: dist.ProcessGroup | None, kernel: str = "auto",
              options: BackendOptions | Mapping | None = None) -> dict:
        """kwargs of ``model(**local)`` for ``rank`` under ``plan``."""
        return _shard(self.input_ids, self.position_ids, self.targets, self.padding, plan, rank, group, kernel,
                      options)


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where this group's collectives take tensors: the current GPU under NCCL, else the CPU."""
    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def attention_shape(config, dtype: torch.dtype) -> AttentionShape | None:
    """The attention shape of a model's config (its text config): query and key/value heads, head dim, dtype; None
    for a model whose layers differ in shape (Gemma 4 refuses a global ``head_dim``): its layers are priced at their
    own first attention call."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    except (AttributeError, TypeError, ValueError, RuntimeError):
        return None
    return AttentionShape.of_dtype(heads, kv_heads, head_dim, dtype)


def plan_for(packed: PackedBatch, backend: str, group: dist.ProcessGroup | None, *,
             model: torch.nn.Module | None = None, device: torch.device | None = None, kernel: str = "auto",
             options: BackendOptions | Mapping | None = None) -> ShardPlan:
    """Where the tokens of ``packed`` go over ``group`` for ``backend``: what the backend decides for ``model``'s
    attention shape and dtype on ``device`` (:meth:`~hf_longctx.backends.contract.Backend.plan_batch`: its default
    placement; ``auto`` prices its candidates on the batch). Every rank of the group calls it together."""
    _, world = group_rank_and_size(group)
    if model is None or world == 1:
        return shard_plan(packed, world, default_strategy(backend))
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    device = device if device is not None else next((p.device for p in model.parameters()), torch.device("cpu"))
    return get_backend(backend).plan_batch(packed, group, attention_shape(model.config, dtype), dtype, device, kernel,
                                           check_options(backend, options))


def gather_group_batch(flat: FlatBatch | None, group: dist.ProcessGroup | None,
                       problem: str | None = None) -> GroupBatch:
    """Concatenate the flat batches of all ranks of ``group`` (rank order) into one packed sequence.

    Each rank's data loader yields its own rows; the sequence-parallel group trains on their
    concatenation, so every row is used exactly once and no sampler has to know about the group.
    One all_gather of the sizes, one of the tokens, targets, positions and padding flags. A rank whose
    batch was bad (``problem``, ``flat`` None) still joins the first all_gather, so every rank raises
    at once instead of waiting for it.
    """
    rank, world = group_rank_and_size(group)
    if world == 1 or not dist.is_initialized():
        if problem:
            raise ValueError(problem)
        return GroupBatch(flat.input_ids, flat.position_ids, flat.targets, flat.padding,
                          PackedBatch.from_doc_lens(flat.doc_lens), [flat.num_tokens])
    device = flat.input_ids.device if flat is not None else _collective_device(group)
    if flat is None:
        sizes = torch.tensor([0, 0, 0, 0, 1], device=device)
    else:
        sizes = torch.tensor([flat.num_tokens, len(flat.doc_lens), flat.targets is not None, flat.padding is not None,
                              0], device=device)
    all_sizes = [torch.empty_like(sizes) for _ in range(world)]
    dist.all_gather(all_sizes, sizes, group=group)
    all_sizes = [s.tolist() for s in all_sizes]
    if problem:
        raise ValueError(problem)
    failed = [r for r, s in enumerate(all_sizes) if s[4]]
    if failed:
        raise ValueError(f"rank(s) {failed} of the sequence-parallel group rejected their batch (their error says "
                         "why); this rank stops too instead of waiting for them")
    ids = flat.input_ids
    n_tok, n_doc = flat.num_tokens, len(flat.doc_lens)
    with_targets = {bool(s[2]) for s in all_sizes}
    if len(with_targets) > 1:
        raise ValueError("some ranks of the sequence-parallel group called the model with labels and some without; "
                         "every rank must pass labels (or none)")
    has_targets, has_padding = with_targets.pop(), any(s[3] for s in all_sizes)
    max_tokens = max(s[0] for s in all_sizes)
    max_docs = max(s[1] for s in all_sizes)
    payload = torch.full((4, max_tokens + max_docs), 0, dtype=torch.int64, device=device)
    payload[0, :n_tok] = ids
    if flat.targets is not None:
        payload[1, :n_tok] = flat.targets.to(device)
    payload[2, :n_tok] = flat.position_ids.to(device)
    if flat.padding is not None:
        payload[3, :n_tok] = flat.padding.to(device)
    payload[0, max_tokens : max_tokens + n_doc] = torch.tensor(flat.doc_lens, device=device)
    gathered = [torch.empty_like(payload) for _ in range(world)]
    dist.all_gather(gathered, payload, group=group)
    rows = [torch.cat([p[i, : s[0]] for s, p in zip(all_sizes, gathered)]) for i in range(4)]
    doc_lens = torch.cat([p[0, max_tokens : max_tokens + s[1]] for s, p in zip(all_sizes, gathered)]).cpu()
    return GroupBatch(rows[0], rows[2], rows[1] if has_targets else None, rows[3].bool() if has_padding else None,
                      PackedBatch.from_doc_lens(doc_lens), [s[0] for s in all_sizes])
