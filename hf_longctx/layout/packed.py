"""PackedBatch: the document structure of one packed sequence.

A packed sequence concatenates documents; attention never crosses a document boundary and RoPE
positions restart in every document (at 0, as collators write them; transformers starts a new
document wherever a position does not follow the previous one). Everything downstream (shard plans, backends, loss)
derives from the document lengths alone, so that is all this class stores.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate

import torch


def document_starts(positions: torch.Tensor) -> list[int]:
    """Indices where a document starts in a 1-D run of positions: 0, and wherever a position is not the
    previous one + 1 (transformers' rule for packed sequences)."""
    if positions.numel() == 0:
        return []
    breaks = torch.nonzero(positions[1:] - positions[:-1] != 1).flatten() + 1
    return [0] + breaks.tolist()


@dataclass(frozen=True)
class PackedBatch:
    """Document lengths of one packed sequence, in order. Every length is >= 1."""

    doc_lens: tuple[int, ...]

    @classmethod
    def from_doc_lens(cls, doc_lens) -> PackedBatch:
        lens = tuple(int(n) for n in (doc_lens.tolist() if isinstance(doc_lens, torch.Tensor) else doc_lens))
        if not lens:
            raise ValueError("a packed batch needs at least one document")
        if any(n <= 0 for n in lens):
            bad = [n for n in lens if n <= 0][:5]
            raise ValueError(f"document lengths must be positive, got {bad}; drop empty documents")
        return cls(lens)

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor) -> PackedBatch:
        """Recover documents from positions: a new document starts wherever a position is not the previous + 1.

        This is transformers' own rule (``masking_utils.find_packed_sequence_indices``): positions
        0, 1, 2, 0, 1 are two documents, and so are 5, 6, 7, 3, 4 or 0, 1, 2, 7, 8. Positions need not
        start at 0; they travel with the tokens unchanged.
        """
        starts = document_starts(position_ids.reshape(-1))
        if not starts:
            raise ValueError("position_ids is empty")
        bounds = starts + [position_ids.numel()]
        return cls(tuple(b - a for a, b in zip(bounds, bounds[1:])))

    @property
    def num_tokens(self) -> int:
        return self.doc_starts[-1] + self.doc_lens[-1]

    @property
    def num_docs(self) -> int:
        return len(self.doc_lens)

    @cached_property
    def doc_starts(self) -> tuple[int, ...]:
        return (0,) + tuple(accumulate(self.doc_lens))[:-1]

    @property
    def max_seqlen(self) -> int:
        return max(self.doc_lens)

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """int32 [0, len_0, len_0 + len_1, ..., num_tokens]."""
        return torch.tensor((0,) + tuple(accumulate(self.doc_lens)), dtype=torch.int32)

    @property
    def position_ids(self) -> torch.Tensor:
        """int64 positions restarting at 0 in every document, shape (num_tokens,)."""
        return torch.cat([torch.arange(n) for n in self.doc_lens])

    @property
    def doc_ids(self) -> torch.Tensor:
        """int64 document index of every token, shape (num_tokens,)."""
        return torch.repeat_interleave(torch.arange(self.num_docs), torch.tensor(self.doc_lens))

    def causal_pairs(self, window: int | None = None) -> int:
        """Number of visible (query, key) pairs under per-document causal masking, with a sliding
        window of ``window`` positions when given (position p sees p - window + 1 .. p)."""
        if window is None:
            return sum(n * (n + 1) // 2 for n in self.doc_lens)
        # position p sees min(window, p + 1) keys
        return sum(n * (n + 1) // 2 if n <= window else window * (window + 1) // 2 + (n - window) * window
                   for n in self.doc_lens)
