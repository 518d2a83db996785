"""One rank's training batch, whatever its collator, as one packed sequence with its targets.

The sequence-parallel input hook takes what transformers, TRL and this package's collators hand the
model and turns it into the only thing the backends know: one packed sequence of documents. Every
kind of batch keeps the meaning transformers gives it:

* **rows** (``input_ids`` of shape (B, S)): each row is its own sequence, so a row boundary is always
  a document boundary (several unpacked rows need no packing of their own);
* **packed documents** in a row without padding: ``doc_lens`` when given, else a new document
  wherever ``position_ids`` is not the previous position + 1 (transformers' rule); positions travel
  with the tokens unchanged, so rows whose documents start at any value stay apart;
* **padding** (a 2-D ``attention_mask`` with zeros): the real tokens of a row are one document, as
  transformers' sdpa and flash paths treat them (no packed-document split when a mask is given); the
  padding tokens of a row form a document of their own whose attention output is zero, what
  flash_attention_2 gives them and what SDPA gives a padding token that sees no real token (left
  padding). They stay in the sequence, so every position keeps the logits and the target transformers
  gives it, and Trainer's token count stays right. Within a row the real tokens are moved ahead of
  the padding (positions and targets move with them), so interior padding works too;
* **targets**: ``shift_labels`` when the collator gives them; else ``labels`` shifted by one inside
  each row, as transformers' loss does, and cut at every packed document's end (a document's last
  token predicts nothing); none when the call has no labels (the caller computes the loss);
* **positions**: ``position_ids`` as given; without them, the positions the model computes itself on
  each whole row (``positions_of``, the model's :class:`~hf_longctx.hf.integration.positions.PositionRule`:
  0, 1, 2, ... for most models, from the mask for OPT, from the ids for RoBERTa), computed here
  before the group's batch is sharded. Without given positions a row's documents come from the row
  and its mask only, never from the computed positions.

Nothing here communicates: the group concatenates these flat batches afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...data.collator import IGNORE_INDEX
from ...layout import PackedBatch, document_starts


def shift_labels_per_document(labels: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
    """(T,) targets: labels[i + 1] inside a document, IGNORE_INDEX at every document's last token."""
    labels = labels.reshape(-1)
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:-1] = labels[1:]
    last = torch.tensor([s + n - 1 for s, n in zip(packed.doc_starts, packed.doc_lens)], device=labels.device)
    shifted[last] = IGNORE_INDEX
    return shifted


@dataclass
class FlatBatch:
    """One packed sequence of ``T`` tokens, in the order the group will concatenate them.

    ``order[i]`` is the index in the flattened (B * S) rows of flat token ``i`` (None: the same order);
    ``padding`` marks padding tokens (None: there are none).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor | None
    doc_lens: list[int]
    padding: torch.Tensor | None
    order: torch.Tensor | None
    rows: tuple[int, int]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


def _as_rows(name: str, value, shape: tuple[int, int]) -> torch.Tensor | None:
    """``value`` as a (B, S) tensor (a (1, S) or (S,) one is broadcast over the rows), or None."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value)
    if value.dim() == 1:
        value = value.unsqueeze(0)
    if value.dim() != 2 or value.shape[-1] != shape[1] or value.shape[0] not in (1, shape[0]):
        hint = ""
        if name in ("labels", "shift_labels") and value.numel() == shape[0] * shape[1] + 1:
            hint = (" (transformers' DataCollatorWithFlattening gives an empty example one label and no token: drop "
                    "empty examples from the dataset)")
        raise ValueError(f"{name} has shape {tuple(value.shape)} but input_ids has {shape}{hint}")
    return value.expand(shape)


PositionsOf = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


def flatten_batch(input_ids, *, attention_mask=None, position_ids=None, labels=None, shift_labels=None,
                  doc_lens=None, positions_of: PositionsOf | None = None) -> FlatBatch:
    """This rank's batch as one packed sequence (module docstring); raises ValueError naming a bad input.

    ``positions_of(input_ids, attention_mask)`` gives the (B, S) positions the model computes itself when
    ``position_ids`` is None (default: 0, 1, 2, ... in every row, transformers' default).
    """
    if input_ids is None:
        raise ValueError("sequence-parallel training needs input_ids (inputs_embeds alone cannot be sharded "
                         "with their positions); pass input_ids")
    ids = input_ids.unsqueeze(0) if input_ids.dim() == 1 else input_ids
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, tokens), got shape {tuple(input_ids.shape)}")
    rows, length = ids.shape
    if ids.numel() == 0:
        raise ValueError(f"the batch has no tokens (input_ids of shape {tuple(ids.shape)}): drop empty examples "
                         "from the dataset")
    mask = _as_rows("attention_mask", attention_mask, (rows, length))
    if mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"a {attention_mask.dim()}-D attention_mask cannot be sharded; pass the 2-D padding mask "
                         "or none (documents come from position_ids or doc_lens)")
    positions = _as_rows("position_ids", position_ids, (rows, length))
    given_positions = positions is not None
    if not given_positions:  # the model's own rule on each whole row, before any shard cuts it
        positions = (positions_of(ids, mask) if positions_of is not None
                     else torch.arange(length, device=ids.device).expand(rows, length))
    labels = _as_rows("labels", labels, (rows, length))
    shifted = _as_rows("shift_labels", shift_labels, (rows, length))
    if doc_lens is not None:
        if rows != 1 or (mask is not None and not bool(mask.all())):
            raise ValueError("doc_lens describes one packed row without padding; got "
                             f"{rows} rows{' with padding' if mask is not None else ''}")
        mask = None  # an all-ones mask beside explicit documents says nothing more

    order, lens, pad_flags, targets = [], [], [], []
    any_padding = False
    for b in range(rows):
        real = mask[b].bool() if mask is not None else None
        start = b * length
        if mask is not None:  # one sequence per row: real tokens first, then the row's padding
            kept = torch.nonzero(real).flatten()
            pads = torch.nonzero(~real).flatten()
            row_order = torch.cat([kept, pads])
            row_lens = [n for n in (kept.numel(), pads.numel()) if n]
            row_pad = [False] * (kept.numel() > 0) + [True] * (pads.numel() > 0)
            any_padding = any_padding or pads.numel() > 0
            target_docs = [length]  # transformers shifts the labels inside the row, padding included
        else:
            row_order = torch.arange(length, device=ids.device)
            if doc_lens is not None:
                row_lens = [int(n) for n in torch.as_tensor(doc_lens).reshape(-1).tolist() if int(n) > 0]
                if sum(row_lens) != length:
                    raise ValueError(f"doc_lens add up to {sum(row_lens)} tokens but the row has {length}")
            elif given_positions:
                bounds = document_starts(positions[b]) + [length]
                row_lens = [z - a for a, z in zip(bounds, bounds[1:])]
            else:  # without position_ids a row is one sequence (computed positions may jump at padding ids)
                row_lens = [length]
            row_pad = [False] * len(row_lens)
            target_docs = row_lens  # a document's last token predicts nothing
        row_targets = None
        if shifted is not None:
            row_targets = shifted[b]
        elif labels is not None:
            row_targets = shift_labels_per_document(labels[b], PackedBatch.from_doc_lens(target_docs))
        order.append(row_order + start)
        lens.extend(row_lens)
        pad_flags.extend(row_pad)
        if row_targets is not None:
            targets.append(row_targets[row_order.to(row_targets.device)])
    flat_order = torch.cat(order)
    identity = not any_padding  # real tokens already come first in every row
    flat = lambda t: t.reshape(-1) if identity else t.reshape(-1)[flat_order.to(t.device)]  # noqa: E731
    padding = None
    if any_padding:
        padding = torch.repeat_interleave(torch.tensor(pad_flags), torch.tensor(lens)).to(ids.device)
    return FlatBatch(
        input_ids=flat(ids), position_ids=flat(positions),
        targets=torch.cat(targets) if targets else None, doc_lens=lens, padding=padding,
        order=None if identity else flat_order, rows=(rows, length),
    )


def unflatten_rows(flat_values: torch.Tensor, batch: FlatBatch) -> torch.Tensor:
    """(T, ...) values in flat order -> (B, S, ...) in the rows' own order (inverse of :func:`flatten_batch`)."""
    rows, length = batch.rows
    if batch.order is None:
        return flat_values.reshape(rows, length, *flat_values.shape[1:])
    out = torch.empty_like(flat_values)
    out = out.index_copy(0, batch.order.to(flat_values.device), flat_values)
    return out.reshape(rows, length, *flat_values.shape[1:])
