"""What a packing run produced: rows, fill ratio, and the document-length histogram (text and PNG).

Lengths are binned by powers of two and weighted by tokens as well as counted, because in
long-context training the share of TOKENS in long documents is what a mix is judged by; a handful
of 64K documents can hold more tokens than thousands of short ones.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import datasets
import numpy as np
import pyarrow.compute as pc

from .mixing import document_token_lengths
from .packing import DOC_LENS


@dataclass
class LengthBin:
    lo: int
    hi: int  # inclusive
    documents: int
    document_tokens: int
    pieces: int
    piece_tokens: int


@dataclass
class PackingSummary:
    seq_len: int
    rows: int
    tokens: int
    full_rows: int
    pieces: int
    documents: int | None = None
    dropped_documents: int | None = None
    seconds: float | None = None
    histogram: list[LengthBin] = field(default_factory=list)

    @property
    def fill_ratio(self) -> float:
        return self.tokens / (self.rows * self.seq_len) if self.rows else 0.0

    @property
    def split_documents(self) -> int | None:
        """Extra pieces made by cutting documents (pieces - documents)."""
        return None if self.documents is None else self.pieces - self.documents

    def as_dict(self) -> dict:
        return {**asdict(self), "fill_ratio": self.fill_ratio, "split_documents": self.split_documents}

    def text(self) -> str:
        head = f"rows: {self.rows} of <= {self.seq_len} tokens ({self.full_rows} full)"
        lines = [head, f"tokens: {self.tokens}", f"fill ratio: {self.fill_ratio:.4f}",
                 f"document pieces: {self.pieces}"]
        if self.documents is not None:
            lines.append(f"documents: {self.documents} ({self.split_documents} extra pieces from cuts"
                         + (f", {self.dropped_documents} empty or whitespace-only dropped)"
                            if self.dropped_documents is not None else ")"))
        if self.seconds is not None:
            rate = self.tokens / self.seconds if self.seconds > 0 else float("inf")
            lines.append(f"time: {self.seconds:.2f} s ({rate:,.0f} tokens/s)")
        lines.append(histogram_text(self.histogram))
        return "\n".join(lines)


def _bins(lengths: np.ndarray) -> np.ndarray:
    return np.floor(np.log2(np.maximum(lengths, 1))).astype(np.int64)


def length_histogram(doc_lengths: np.ndarray | None, piece_lengths: np.ndarray) -> list[LengthBin]:
    """Power-of-two bins [2^k, 2^(k+1)-1] of document and piece lengths (counts and tokens)."""
    doc_lengths = np.zeros(0, np.int64) if doc_lengths is None else np.asarray(doc_lengths, np.int64)
    piece_lengths = np.asarray(piece_lengths, np.int64)
    both = np.concatenate([doc_lengths, piece_lengths])
    if not len(both):
        return []
    top = int(_bins(both).max()) + 1
    db, pb = _bins(doc_lengths), _bins(piece_lengths)
    counts = [np.bincount(b, weights=w, minlength=top) for b, w in
              ((db, None), (db, doc_lengths), (pb, None), (pb, piece_lengths))]
    return [LengthBin(1 << k, (1 << (k + 1)) - 1, *(int(c[k]) for c in counts))
            for k in range(top) if counts[0][k] or counts[2][k]]


def histogram_text(bins: list[LengthBin], width: int = 20) -> str:
    """The histogram as a text table: count, share of tokens and a bar, for documents before packing and
    for the pieces rows hold after packing."""
    doc_total = sum(b.document_tokens for b in bins) or 1
    piece_total = sum(b.piece_tokens for b in bins) or 1
    lines = ["document-length histogram (tok % = share of tokens):",
             f"{'length (tokens)':>17} | {'documents':>9} {'tok %':>6} {'':<{width}} | {'pieces':>8} {'tok %':>6}"]
    for b in bins:
        ds, ps = b.document_tokens / doc_total, b.piece_tokens / piece_total
        lines.append(f"{b.lo:>8}-{b.hi:<8} | {b.documents:>9} {100 * ds:>6.1f} {'#' * round(width * ds):<{width}} | "
                     f"{b.pieces:>8} {100 * ps:>6.1f} {'#' * round(width * ps)}".rstrip())
    return "\n".join(lines)


def summarize_packed(packed: datasets.Dataset, seq_len: int, documents: datasets.Dataset | None = None,
                     dropped_documents: int | None = None, seconds: float | None = None) -> PackingSummary:
    """Summary of a packed dataset; ``documents`` (the tokenized documents it was packed from) adds their
    count and length histogram."""
    pieces = [pc.list_flatten(t.column(DOC_LENS)).to_numpy(zero_copy_only=False)
              for t in packed.select_columns([DOC_LENS]).with_format("arrow").iter(batch_size=65536)]
    piece_lengths = np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, np.int64)
    rows = len(packed)
    token_per_row = _row_tokens(packed)
    doc_lengths = document_token_lengths(documents) if documents is not None else None
    return PackingSummary(
        seq_len=seq_len, rows=rows, tokens=int(piece_lengths.sum()), full_rows=int((token_per_row == seq_len).sum()),
        pieces=len(piece_lengths), documents=None if doc_lengths is None else len(doc_lengths),
        dropped_documents=dropped_documents, seconds=seconds, histogram=length_histogram(doc_lengths, piece_lengths),
    )


def _row_tokens(packed: datasets.Dataset) -> np.ndarray:
    parts = [pc.list_value_length(t.column("input_ids")).to_numpy(zero_copy_only=False)
             for t in packed.select_columns(["input_ids"]).with_format("arrow").iter(batch_size=65536)]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def save_histogram_png(summary: PackingSummary, path: str) -> str:
    """Write the token-share histogram as a PNG; returns a line saying where, or why it was skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "histogram PNG skipped: matplotlib is not installed (pip install 'hf-longctx[plot]')"
    bins = summary.histogram
    labels = [f"{b.lo}-{b.hi}" for b in bins]
    x = np.arange(len(bins))
    doc_total = sum(b.document_tokens for b in bins) or 1
    piece_total = sum(b.piece_tokens for b in bins) or 1
    fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * len(bins) + 2), 3.8))
    if summary.documents is not None:
        ax.bar(x - 0.2, [100 * b.document_tokens / doc_total for b in bins], 0.4, label="documents (before packing)")
    ax.bar(x + 0.2, [100 * b.piece_tokens / piece_total for b in bins], 0.4, label="pieces (after packing)")
    ax.set_xticks(x, labels, rotation=45, ha="right", fontsize=7)
    ax.set_xlabel("length (tokens)")
    ax.set_ylabel("share of tokens (%)")
    ax.set_title(f"{summary.rows} rows of <= {summary.seq_len} tokens, fill ratio {summary.fill_ratio:.3f}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"histogram PNG written to {path}"
