"""PackedCollator: packed rows -> the one packed sequence the sequence-parallel backends take.

It follows transformers' ``DataCollatorWithFlattening`` (checked against transformers 5.23): the
batch becomes ONE sequence of shape (1, T); ``position_ids`` restart at 0 in every document
(``return_position_ids``); ``labels`` are the input ids, unshifted, with ``separator_id`` (-100) at
the first token of every document. That -100 is what transformers does, and it is right: the model
shifts labels by one, so the first token of a document would otherwise be the target of the previous
document's last token; it also makes Trainer's count of target tokens (``num_items_in_batch``) equal
the number of real next-token targets, ``T - number of documents``. A row that carries ``labels`` has
them used instead of its input ids (with the same -100 at document starts), as transformers does.

Where transformers treats every example as one sequence, a row here may hold several documents
(``doc_lens``); a row without ``doc_lens`` is one document, so plain tokenized examples collate
exactly as with ``DataCollatorWithFlattening``. Pieces of a document split across rows are separate
documents (positions restart), matching what attention sees. The output adds ``doc_lens``, a 1-D
int64 tensor of every document in the sequence, so the sequence-parallel layer builds its plan
without re-deriving it. ``pad_to_multiple_of`` appends one padding document of ``pad_token_id`` with
-100 labels (positions 0, 1, ...), so shapes divide the sequence-parallel size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# The label that no loss counts (PyTorch's cross_entropy default); the one definition in the package.
IGNORE_INDEX = -100


def _ints(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.int64).reshape(-1)


@dataclass
class PackedCollator:
    """Concatenate rows (``input_ids`` + ``doc_lens``) into one (1, T) packed sequence (see the module docstring).

    Returns int64 tensors ``input_ids``, ``position_ids`` (if ``return_position_ids``), ``labels`` of shape
    (1, T) and ``doc_lens`` of shape (num_docs,); with ``return_flash_attn_kwargs`` also ``cu_seq_lens_q/k``
    (int32) and ``max_length_q/k`` (ints), with ``return_seq_idx`` a (1, T) int32 document index, named
    and typed as transformers' ``DataCollatorWithFlattening`` returns them.
    """

    pad_to_multiple_of: int | None = None
    pad_token_id: int = 0
    return_position_ids: bool = True
    separator_id: int = IGNORE_INDEX
    return_flash_attn_kwargs: bool = False
    return_seq_idx: bool = False

    def __call__(self, rows: list[dict], return_tensors: str | None = None) -> dict[str, torch.Tensor]:
        if return_tensors not in (None, "pt"):
            raise ValueError(f"PackedCollator returns torch tensors only, got return_tensors={return_tensors!r}")
        if not rows:
            raise ValueError("PackedCollator got an empty batch")
        ids, labels, lens = [], [], []
        for row in rows:
            row_ids = _ints(row["input_ids"])
            row_lens = row.get("doc_lens")
            row_lens = _ints(row_lens) if row_lens is not None else np.array([len(row_ids)], dtype=np.int64)
            if int(row_lens.sum()) != len(row_ids) or (row_lens < 0).any():
                raise ValueError(f"doc_lens {row_lens.tolist()} do not add up to the row's {len(row_ids)} tokens")
            ids.append(row_ids)
            labels.append(_ints(row["labels"]) if row.get("labels") is not None else row_ids)
            lens.append(row_lens[row_lens > 0])
        input_ids, labels, doc_lens = np.concatenate(ids), np.concatenate(labels).copy(), np.concatenate(lens)
        if len(labels) != len(input_ids):
            raise ValueError("labels and input_ids of a row differ in length")
        if not len(input_ids):
            raise ValueError("PackedCollator got rows without any token")
        multiple = self.pad_to_multiple_of
        pad = (-len(input_ids)) % multiple if multiple else 0
        if pad:
            input_ids = np.concatenate([input_ids, np.full(pad, self.pad_token_id, dtype=np.int64)])
            labels = np.concatenate([labels, np.full(pad, IGNORE_INDEX, dtype=np.int64)])
            doc_lens = np.concatenate([doc_lens, [pad]])
        starts = np.cumsum(doc_lens) - doc_lens
        labels[starts] = self.separator_id
        batch = {"input_ids": torch.from_numpy(input_ids)[None], "labels": torch.from_numpy(labels)[None]}
        if self.return_position_ids:
            positions = np.arange(len(input_ids), dtype=np.int64) - np.repeat(starts, doc_lens)
            batch["position_ids"] = torch.from_numpy(positions)[None]
        if self.return_seq_idx:
            seq_idx = np.repeat(np.arange(len(doc_lens), dtype=np.int32), doc_lens)
            batch["seq_idx"] = torch.from_numpy(seq_idx)[None]
        if self.return_flash_attn_kwargs:
            cu = torch.from_numpy(np.concatenate([[0], np.cumsum(doc_lens)]).astype(np.int32))
            batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = cu
            batch["max_length_q"] = batch["max_length_k"] = int(doc_lens.max())
        batch["doc_lens"] = torch.from_numpy(doc_lens.astype(np.int64))
        return batch
