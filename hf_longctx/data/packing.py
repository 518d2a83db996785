"""Packing tokenized documents into fixed token budgets that remember their document boundaries.

Documents are concatenated in order and cut into rows of ``seq_len`` tokens; a document that does
not fit is continued in the next row (its pieces are separate documents for attention: a piece
never attends to the piece before it, the price of fixed-size rows that ProLong also pays). Every
row carries ``doc_lens``, so no token is lost or repeated and boundaries survive to the backends.
Rows are built per ``datasets.map`` batch; the last row of each batch may be short (``fill ratio``
in the summary says how much).

Rules: documents whose text is empty or only whitespace are dropped; with ``add_eos`` every
document ends with the tokenizer's EOS token, and a tokenizer without one is an error.
"""

from __future__ import annotations

import datasets


def _tokenize_fn(tokenizer, text_column: str, add_eos: bool):
    eos = tokenizer.eos_token_id if add_eos else None
    if add_eos and eos is None:
        raise ValueError("the tokenizer has no EOS token: set tokenizer.eos_token, or pack with add_eos=False")

    def tokenize(batch):
        texts = [t for t in batch[text_column] if t is not None and t.strip()]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        if eos is not None:
            ids = [x + [eos] for x in ids]
        return {"input_ids": ids}

    return tokenize


def _pack_fn(seq_len: int):
    def pack(batch):
        rows, lens = [], []
        row, row_lens = [], []
        for doc in batch["input_ids"]:
            pos = 0
            while pos < len(doc):
                take = min(seq_len - len(row), len(doc) - pos)
                row.extend(doc[pos : pos + take])
                row_lens.append(take)
                pos += take
                if len(row) == seq_len:
                    rows.append(row)
                    lens.append(row_lens)
                    row, row_lens = [], []
        if row:
            rows.append(row)
            lens.append(row_lens)
        return {"input_ids": rows, "doc_lens": lens}

    return pack


def pack_documents(
    dataset,
    tokenizer=None,
    seq_len: int = 4096,
    text_column: str = "text",
    add_eos: bool = True,
    num_proc: int | None = None,
    seed: int | None = None,
    batch_size: int = 1000,
):
    """Rows of at most ``seq_len`` tokens with ``input_ids`` and ``doc_lens`` (see the module docstring).

    ``dataset`` is a ``datasets.Dataset`` or ``IterableDataset`` with a text column, or already with
    ``input_ids`` (then no tokenizer is needed). ``seed`` shuffles documents before packing.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    streaming = isinstance(dataset, datasets.IterableDataset)
    columns = dataset.column_names or []
    map_kwargs = {} if streaming else {"num_proc": num_proc}
    if "input_ids" not in columns:
        if tokenizer is None:
            raise ValueError(f"the dataset has no input_ids column (columns: {columns}); pass a tokenizer")
        if text_column not in columns:
            raise ValueError(f"text column {text_column!r} not in the dataset (columns: {columns})")
        dataset = dataset.map(_tokenize_fn(tokenizer, text_column, add_eos), batched=True, remove_columns=columns,
                              **map_kwargs, **({} if streaming else {"desc": "tokenizing"}))
    elif columns != ["input_ids"]:
        dataset = dataset.select_columns(["input_ids"])
    if seed is not None:
        dataset = dataset.shuffle(seed=seed)
    return dataset.map(_pack_fn(seq_len), batched=True, batch_size=batch_size, remove_columns=["input_ids"],
                       **map_kwargs, **({} if streaming else {"desc": f"packing into {seq_len}-token rows"}))
