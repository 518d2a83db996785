"""PackedCollator: packed rows -> the one packed sequence the sequence-parallel backends take."""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


@dataclass
class PackedCollator:
    """Concatenate rows (``input_ids`` + ``doc_lens``) into one (1, T) packed sequence.

    Returns ``input_ids``, ``position_ids`` restarting at 0 in every document, ``labels`` (the input ids,
    with -100 at the first token of every document, as transformers' DataCollatorWithFlattening does,
    so no target crosses a boundary), and ``doc_lens`` (1-D) of all documents in the sequence.
    ``pad_to_multiple_of`` appends a padding document of ignored tokens.
    """

    pad_to_multiple_of: int | None = None
    pad_token_id: int = 0

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        ids, lens = [], []
        for row in rows:
            row_ids = list(row["input_ids"])
            row_lens = list(row.get("doc_lens") or [len(row_ids)])
            if sum(row_lens) != len(row_ids):
                raise ValueError(f"doc_lens sum to {sum(row_lens)} but the row has {len(row_ids)} tokens")
            ids.extend(row_ids)
            lens.extend(n for n in row_lens if n > 0)
        labels = list(ids)
        pad = 0
        if self.pad_to_multiple_of and len(ids) % self.pad_to_multiple_of:
            pad = self.pad_to_multiple_of - len(ids) % self.pad_to_multiple_of
            ids.extend([self.pad_token_id] * pad)
            labels.extend([IGNORE_INDEX] * pad)
            lens.append(pad)
        positions, start = [], 0
        for n in lens:
            positions.extend(range(n))
            labels[start] = IGNORE_INDEX
            start += n
        return {
            "input_ids": torch.tensor([ids], dtype=torch.long),
            "position_ids": torch.tensor([positions], dtype=torch.long),
            "labels": torch.tensor([labels], dtype=torch.long),
            "doc_lens": torch.tensor(lens, dtype=torch.long),
        }
