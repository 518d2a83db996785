"""Text documents -> token documents, with one explicit rule for every awkward input.

Rules (the same in ``pack_documents`` and the CLI):

* a document whose text is ``None``, empty or whitespace-only is dropped (it carries no token, and an
  EOS alone would teach the model to end documents that never started);
* ``add_eos=True`` appends the EOS id (``eos_token_id`` if given, else the tokenizer's) to every
  document, so the model learns where documents end; a tokenizer without an EOS token is an error
  that names the fixes, never a silent fallback to some other id;
* ``add_bos=True`` prepends the BOS id the same way (Llama-3 style data);
* a document that still has no token after this (a tokenizer that maps the text to nothing) is dropped.

Batches travel as Arrow tables (``with_format("arrow")``) so token lists never become Python objects
twice; ``datasets.map`` gives caching, progress bars and ``num_proc``.
"""

from __future__ import annotations

import itertools

import datasets
import numpy as np
import pyarrow as pa

INPUT_IDS = "input_ids"


def special_token_id(tokenizer, which: str, explicit: int | None) -> int:
    """The id of ``which`` ("eos" or "bos"): ``explicit`` if given, else the tokenizer's, else a clear error."""
    if explicit is not None:
        return int(explicit)
    token_id = getattr(tokenizer, f"{which}_token_id", None) if tokenizer is not None else None
    if token_id is None:
        flag = "add_eos" if which == "eos" else "add_bos"
        raise ValueError(
            f"the tokenizer has no {which.upper()} token: set tokenizer.{which}_token, pass {which}_token_id=..., "
            f"or pack with {flag}=False"
        )
    return int(token_id)


def encode_texts(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids without special tokens, from a transformers tokenizer or a raw ``tokenizers.Tokenizer``."""
    if not texts:
        return []
    import tokenizers

    if isinstance(tokenizer, tokenizers.Tokenizer):
        return [enc.ids for enc in tokenizer.encode_batch(texts, add_special_tokens=False)]
    return tokenizer(texts, add_special_tokens=False, return_attention_mask=False, return_token_type_ids=False,
                     verbose=False)["input_ids"]


def list_array(lists: list[list[int]] | None = None, *, values: np.ndarray | None = None,
               offsets: np.ndarray | None = None) -> pa.ListArray:
    """An Arrow ``list<int32>`` from Python lists, or from flat ``values`` and ``offsets``."""
    if lists is not None:
        lengths = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
        offsets = np.zeros(len(lists) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=int(offsets[-1]))
    if offsets[-1] >= 2**31:
        raise ValueError("more than 2**31 tokens in one batch; use a smaller batch_size")
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values).cast(pa.int32()))


def _tokenize_batch(batch: pa.Table, tokenizer, text_column: str, bos: int | None, eos: int | None,
                    keep_columns: list[str]) -> pa.Table:
    texts = batch.column(text_column).to_pylist()
    keep = [i for i, t in enumerate(texts) if isinstance(t, str) and t.strip()]
    ids = encode_texts(tokenizer, [texts[i] for i in keep])
    if bos is not None or eos is not None:
        head, tail = ([bos] if bos is not None else []), ([eos] if eos is not None else [])
        ids = [head + list(x) + tail for x in ids]
    nonempty = [j for j, x in enumerate(ids) if len(x)]
    if len(nonempty) < len(ids):
        keep, ids = [keep[j] for j in nonempty], [ids[j] for j in nonempty]
    columns = {INPUT_IDS: list_array(ids)}
    take = pa.array(keep, pa.int64())
    for name in keep_columns:
        columns[name] = batch.column(name).take(take)
    return pa.table(columns)


def column_names(dataset) -> list[str]:
    """Column names of a Dataset or IterableDataset (peeking at the first row when features are unknown)."""
    names = dataset.column_names
    if names is None:
        first = next(iter(dataset), None)
        names = list(first) if first is not None else []
    return list(names)


def tokenize_documents(
    dataset: datasets.Dataset | datasets.IterableDataset,
    tokenizer,
    text_column: str = "text",
    add_eos: bool = True,
    add_bos: bool = False,
    eos_token_id: int | None = None,
    bos_token_id: int | None = None,
    keep_columns: list[str] | tuple[str, ...] = (),
    num_proc: int | None = None,
    batch_size: int = 1000,
) -> datasets.Dataset | datasets.IterableDataset:
    """One row per non-empty document: ``input_ids`` (plus ``keep_columns``, e.g. a source column for
    :func:`length_mix`), following the rules of the module docstring."""
    names = column_names(dataset)
    if text_column not in names:
        raise ValueError(f"text column {text_column!r} not in the dataset (columns: {names})")
    missing = [c for c in keep_columns if c not in names]
    if missing:
        raise ValueError(f"keep_columns {missing} not in the dataset (columns: {names})")
    if tokenizer is None:
        raise ValueError(f"the dataset has no {INPUT_IDS} column (columns: {names}); pass a tokenizer")
    eos = special_token_id(tokenizer, "eos", eos_token_id) if add_eos else None
    bos = special_token_id(tokenizer, "bos", bos_token_id) if add_bos else None
    kwargs = {"text_column": text_column, "bos": bos, "eos": eos, "keep_columns": list(keep_columns)}
    fmt = dataset.with_format("arrow")
    if isinstance(dataset, datasets.IterableDataset):  # an Arrow-formatted IterableDataset.map keeps only
        out = fmt.map(_tokenize_batch, batched=True, batch_size=batch_size,  # what the function returns
                      fn_kwargs={"tokenizer": tokenizer, **kwargs})
    else:
        out = fmt.map(_tokenize_batch, batched=True, batch_size=batch_size, remove_columns=names,
                      fn_kwargs={"tokenizer": tokenizer, **kwargs}, num_proc=num_proc, desc="tokenizing")
    return out.with_format(None)
