"""Packing token documents into rows of at most ``seq_len`` tokens that remember their boundaries.

Every output row has ``input_ids`` and ``doc_lens`` (lengths of the documents, or document pieces,
in the row; they sum to the row length, none is 0). Two layouts:

* ``"concat"`` (default, the ProLong layout): all documents are concatenated in order and cut every
  ``seq_len`` tokens; a document crossing a cut continues in the next row as a new piece. Every row
  is full except the very last one. Pieces are separate documents for attention and positions
  restart in each (the price of fixed-size rows that ProLong also pays). The layout is global, not
  per ``datasets.map`` batch: each batch knows the token offsets of all documents and emits the rows
  that start in it (reading the next few documents for its last row), so the rows do not depend on
  ``batch_size`` or ``num_proc``, and a batch of short documents never leaves a half-empty 512K row.
  Streaming input gets the same rows from a generator that carries the partial row over.
* ``"best_fit"``: only documents longer than ``seq_len`` are split (into full rows plus a
  remainder); remainders and short documents are placed whole by best-fit decreasing ("Fewer
  Truncations Improve Language Modeling"), so fewer documents are cut, at some cost in fill ratio.
  It packs a window of ``batch_size`` documents at a time, in one process.

Either way every input token appears exactly once in the output (with ``"concat"`` even in the same
order), so with ``add_eos=False`` the output holds exactly the input tokens. Layouts are computed
with numpy on the Arrow buffers: packing costs little next to tokenizing.
"""

from __future__ import annotations

import bisect

import datasets
import numpy as np
import pyarrow as pa

from .tokenization import INPUT_IDS, column_names, list_array, tokenize_documents

DOC_LENS = "doc_lens"
PACKING_STRATEGIES = ("concat", "best_fit")


def _offsets(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def concat_layout(doc_lens: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pieces of the "concat" layout: (piece source starts, piece lengths, row offsets into the pieces).

    Pieces come in output order; the source start of a piece indexes the concatenated documents.
    """
    doc_lens = np.asarray(doc_lens, dtype=np.int64)
    doc_lens = doc_lens[doc_lens > 0]
    total = int(doc_lens.sum())
    if total == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(1, np.int64)
    cuts = np.union1d(np.cumsum(doc_lens), np.arange(seq_len, total, seq_len, dtype=np.int64))
    starts = np.concatenate(([0], cuts[:-1]))
    rows = -(-total // seq_len)
    row_offsets = np.searchsorted(starts, np.arange(rows + 1, dtype=np.int64) * seq_len)
    return starts, cuts - starts, row_offsets


def best_fit_layout(doc_lens: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pieces of the "best_fit" layout, in the same form as :func:`concat_layout`.

    Documents longer than ``seq_len`` give ``len // seq_len`` full rows of their first tokens; their
    remainder and all shorter documents are placed, longest first (ties by position), in the open row
    with the least room that fits them, or a new row. Rows are ordered by the first document they hold;
    pieces inside a row keep document order.
    """
    doc_lens = np.asarray(doc_lens, dtype=np.int64)
    starts = _offsets(doc_lens)[:-1]
    rows: list[list[tuple[int, int, int]]] = []  # per row: (document index, source start, length)
    items = []
    for d, (start, n) in enumerate(zip(starts.tolist(), doc_lens.tolist())):
        full, rest = divmod(n, seq_len) if n > seq_len else (0, n)
        rows.extend([(d, start + k * seq_len, seq_len)] for k in range(full))
        if rest:
            items.append((-rest, d, start + full * seq_len))
    items.sort()
    room: list[tuple[int, int]] = []  # (free tokens, row index), sorted
    for neg, d, start in items:
        n = -neg
        i = bisect.bisect_left(room, (n, -1))
        if i < len(room):
            free, r = room.pop(i)
            rows[r].append((d, start, n))
            if free > n:
                bisect.insort(room, (free - n, r))
        else:
            rows.append([(d, start, n)])
            if seq_len > n:
                bisect.insort(room, (seq_len - n, len(rows) - 1))
    for row in rows:
        row.sort()
    rows.sort(key=lambda row: (row[0][0], row[0][1]))
    flat = [piece for row in rows for piece in row]
    piece_starts = np.array([p[1] for p in flat], dtype=np.int64)
    piece_lens = np.array([p[2] for p in flat], dtype=np.int64)
    return piece_starts, piece_lens, _offsets(np.array([len(r) for r in rows], dtype=np.int64))


def _gather(values: pa.Array, piece_starts: np.ndarray, piece_lens: np.ndarray) -> pa.Array:
    """The tokens of the pieces in output order (no copy when the pieces are already in order)."""
    out_starts = _offsets(piece_lens)[:-1]
    if np.array_equal(out_starts, piece_starts):
        return values.slice(0, int(piece_lens.sum()))
    index = np.arange(int(piece_lens.sum()), dtype=np.int64) + np.repeat(piece_starts - out_starts, piece_lens)
    return values.take(pa.array(index))


def pack_arrow(documents: pa.ChunkedArray | pa.Array, seq_len: int, strategy: str = "concat") -> pa.Table:
    """Pack one batch of token documents (an Arrow list array) into a table of ``input_ids``/``doc_lens``."""
    if isinstance(documents, pa.ChunkedArray):
        documents = documents.combine_chunks() if documents.num_chunks else pa.array([], pa.list_(pa.int32()))
    doc_lens = np.asarray(documents.value_lengths().fill_null(0).to_numpy(zero_copy_only=False), dtype=np.int64)
    values = documents.flatten()  # respects slicing; null lists contribute nothing
    layout = concat_layout if strategy == "concat" else best_fit_layout
    piece_starts, piece_lens, row_pieces = layout(doc_lens[doc_lens > 0], seq_len)
    tokens = _gather(values, piece_starts, piece_lens)
    row_tokens = _offsets(np.add.reduceat(piece_lens, row_pieces[:-1]) if len(piece_lens) else np.zeros(0, np.int64))
    return pa.table({
        INPUT_IDS: list_array(values=tokens.to_numpy(zero_copy_only=False), offsets=row_tokens),
        DOC_LENS: list_array(values=piece_lens, offsets=row_pieces),
    })


def _pack_batch(batch: pa.Table, seq_len: int, strategy: str) -> pa.Table:
    """Batch-local packing (``best_fit``): the documents of one map batch fill their own rows."""
    return pack_arrow(batch.column(INPUT_IDS), seq_len, strategy)


def _empty_rows() -> pa.Table:
    empty = list_array(values=np.zeros(0, np.int64), offsets=np.zeros(1, np.int64))
    return pa.table({INPUT_IDS: empty, DOC_LENS: empty})


def _rows_from_stream(doc_lens: np.ndarray, values: np.ndarray, seq_len: int) -> pa.Table:
    """Rows of the concat layout over a token stream that starts at a row boundary."""
    piece_starts, piece_lens, row_pieces = concat_layout(doc_lens, seq_len)
    row_tokens = _offsets(np.add.reduceat(piece_lens, row_pieces[:-1]) if len(piece_lens) else np.zeros(0, np.int64))
    return pa.table({INPUT_IDS: list_array(values=values[: row_tokens[-1]], offsets=row_tokens),
                     DOC_LENS: list_array(values=piece_lens, offsets=row_pieces)})


def _lens_and_values(documents: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(documents, pa.ChunkedArray):
        documents = documents.combine_chunks() if documents.num_chunks else pa.array([], pa.list_(pa.int32()))
    lens = np.asarray(documents.value_lengths().fill_null(0).to_numpy(zero_copy_only=False), dtype=np.int64)
    return lens, documents.flatten().to_numpy(zero_copy_only=False)


def _pack_owned_rows(batch: pa.Table, indices: list[int], seq_len: int, offsets: np.ndarray,
                     documents: datasets.Dataset) -> pa.Table:
    """Concat layout over the WHOLE dataset: this batch emits the rows that START in its tokens, reading the
    few documents after it that the last such row spills into. So every row but the very last is full, and
    the rows do not depend on batch_size or num_proc (each batch knows the global token offsets)."""
    if not indices:
        return _empty_rows()
    i0, i1 = indices[0], indices[-1] + 1
    lo, hi, total = int(offsets[i0]), int(offsets[i1]), int(offsets[-1])
    first_row, end_row = -(-lo // seq_len), -(-hi // seq_len)
    if first_row >= end_row:
        return _empty_rows()
    lens, values = _lens_and_values(batch.column(INPUT_IDS))
    need = min(end_row * seq_len, total)
    if need > hi:  # the last row continues into the next documents
        j = int(np.searchsorted(offsets, need, side="left"))
        more_lens, more_values = _lens_and_values(documents.with_format("arrow")[i1:j].column(INPUT_IDS))
        lens, values = np.concatenate([lens, more_lens]), np.concatenate([values, more_values])
    skip = first_row * seq_len - lo  # tokens of this batch that belong to the previous batch's last row
    ends = np.cumsum(lens)
    k = int(np.searchsorted(ends, skip, side="right"))  # first document not wholly skipped
    lens = lens[k:].copy()
    if len(lens):
        lens[0] = ends[k] - skip
    lens_end = np.cumsum(lens)
    stop = int(np.searchsorted(lens_end, need - first_row * seq_len, side="left")) + 1
    lens = lens[:stop]
    if len(lens):
        lens[-1] -= lens_end[stop - 1] - (need - first_row * seq_len)
    return _rows_from_stream(lens, values[skip : skip + need - first_row * seq_len], seq_len)


def _concat_stream_rows(documents: datasets.IterableDataset, seq_len: int, batch_size: int):
    """Concat layout over a stream: full rows as soon as they fill, the partial last row carried over."""
    carry_lens, carry_values = np.zeros(0, np.int64), np.zeros(0, np.int64)
    for table in documents.with_format("arrow").iter(batch_size=batch_size):
        lens, values = _lens_and_values(table.column(INPUT_IDS))
        lens = np.concatenate([carry_lens, lens[lens > 0]])
        values = np.concatenate([carry_values, values])
        full = len(values) // seq_len * seq_len
        if full:
            ends = np.cumsum(lens)
            k = int(np.searchsorted(ends, full, side="left"))  # the document holding token full-1
            head = lens[: k + 1].copy()
            head[-1] -= ends[k] - full
            yield from _rows_from_stream(head, values[:full], seq_len).to_pylist()
            carry_lens = np.concatenate([[ends[k] - full], lens[k + 1 :]]) if ends[k] > full else lens[k + 1 :]
            carry_values = values[full:]
        else:
            carry_lens, carry_values = lens, values
    if len(carry_values):
        yield from _rows_from_stream(carry_lens, carry_values, seq_len).to_pylist()


ROW_FEATURES = datasets.Features({INPUT_IDS: datasets.List(datasets.Value("int32")),
                                  DOC_LENS: datasets.List(datasets.Value("int32"))})


def pack_documents(
    dataset: datasets.Dataset | datasets.IterableDataset,
    tokenizer=None,
    seq_len: int = 4096,
    text_column: str = "text",
    add_eos: bool = True,
    num_proc: int | None = None,
    seed: int | None = None,
    batch_size: int | None = None,
    strategy: str = "concat",
    add_bos: bool = False,
    eos_token_id: int | None = None,
    bos_token_id: int | None = None,
    shuffle_buffer_size: int = 1000,
) -> datasets.Dataset | datasets.IterableDataset:
    """Rows of at most ``seq_len`` tokens with ``input_ids`` and ``doc_lens`` (see the module docstring).

    ``dataset``: a ``datasets.Dataset`` or ``IterableDataset`` (streaming) with a ``text_column``
    (tokenized here by ``tokenizer`` under the rules of :mod:`~hf_longctx.data.tokenization`), or with
    ``input_ids`` already (no tokenizer needed; tokens are taken as they are, no EOS is added; empty
    documents are dropped). ``seed`` shuffles the documents (after tokenizing, so the tokenized cache
    is shared across seeds); ``None`` keeps their order. ``num_proc`` parallelises tokenization and
    the concat packing. ``batch_size`` (documents per map batch) only bounds memory for ``"concat"``;
    for ``"best_fit"`` it is the packing window (default: enough documents for ~64 rows).
    Streaming input gives streaming output; with ``"concat"`` its rows equal the eager path's.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    if strategy not in PACKING_STRATEGIES:
        raise ValueError(f"unknown packing strategy {strategy!r}; use one of {PACKING_STRATEGIES}")
    streaming = isinstance(dataset, datasets.IterableDataset)
    names = column_names(dataset)
    if INPUT_IDS in names:
        if names != [INPUT_IDS]:
            dataset = dataset.select_columns([INPUT_IDS])
    else:
        dataset = tokenize_documents(dataset, tokenizer, text_column=text_column, add_eos=add_eos, add_bos=add_bos,
                                     eos_token_id=eos_token_id, bos_token_id=bos_token_id, num_proc=num_proc)
    if seed is not None:
        dataset = (dataset.shuffle(seed=seed, buffer_size=shuffle_buffer_size) if streaming
                   else dataset.shuffle(seed=seed))
    if streaming:
        if strategy == "concat":
            return datasets.IterableDataset.from_generator(
                _concat_stream_rows, features=ROW_FEATURES,
                gen_kwargs={"documents": dataset, "seq_len": seq_len, "batch_size": batch_size or 1000})
        # an Arrow-formatted IterableDataset.map keeps only what the function returns: no remove_columns
        return dataset.with_format("arrow").map(_pack_batch, batched=True, batch_size=batch_size or 1000,
                                                fn_kwargs={"seq_len": seq_len, "strategy": strategy}
                                                ).with_format(None)
    from .mixing import document_token_lengths

    lengths = document_token_lengths(dataset)
    desc = f"packing into {seq_len}-token rows"
    if strategy == "concat":
        return dataset.with_format("arrow").map(
            _pack_owned_rows, batched=True, with_indices=True, batch_size=batch_size or 1000, num_proc=num_proc,
            remove_columns=[INPUT_IDS], desc=desc, features=ROW_FEATURES,
            fn_kwargs={"seq_len": seq_len, "offsets": _offsets(lengths), "documents": dataset},
        ).with_format(None)
    if batch_size is None:
        mean = max(1.0, float(lengths.mean())) if len(lengths) else 1.0
        batch_size = max(1000, int(64 * seq_len / mean))
    return dataset.with_format("arrow").map(
        _pack_batch, batched=True, batch_size=batch_size, remove_columns=[INPUT_IDS], desc=desc,
        features=ROW_FEATURES, fn_kwargs={"seq_len": seq_len, "strategy": strategy},
    ).with_format(None)
