"""Text documents -> token documents, with one explicit rule for every awkward input.

Rules (the same in ``pack_documents`` and the CLI):

* a document whose text is ``None``, empty or whitespace-only is dropped (it carries no token, and an
  EOS alone would teach the model to end documents that never started);
* a text that is neither a string nor ``None`` (a number, a list, an object) is an error
  (:class:`TextColumnError`) naming the row, raised before anything is tokenized: one such value in a
  JSON-lines file makes ``datasets`` type the whole column as JSON, and every document would otherwise
  be tokenized as its JSON text (quotes, ``\\n`` escapes), silently;
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
_TEXT_DTYPES = ("string", "large_string", "string_view", "null")  # null: a column of missing texts only


class TextColumnError(ValueError):
    """A text column that holds values other than strings (or missing texts), found before tokenizing."""


def describe_value(value) -> str:
    """``42`` -> ``42 (a number)``: how a non-text value reads in an error."""
    kind = ("a boolean" if isinstance(value, bool) else "a number" if isinstance(value, (int, float))
            else "a list" if isinstance(value, list) else "an object" if isinstance(value, dict)
            else f"a {type(value).__name__}")
    shown = repr(value)
    return f"{shown[:60] + '...' if len(shown) > 60 else shown} ({kind})"


def text_fix(text_column: str, whole_column: bool = False) -> str:
    """How to repair non-text values, the same words wherever they are found."""
    if whole_column:
        return (f"pass text_column= the column that holds the text, or cast {text_column!r} to strings "
                "(dataset.cast_column(name, datasets.Value('string')))")
    return f"write every {text_column!r} as a string (\"42\", not 42), or null or \"\" to skip that document"


def text_feature_problem(features, text_column: str) -> str | None:
    """Why the declared type of ``text_column`` is not text (None when it is, or when nothing is declared).

    A ``Json`` feature is what ``datasets`` makes of a JSON-lines column that mixes strings with other
    values; ``Value("int64")`` and the like come from parquet, csv or a column of numbers.
    """
    feature = (features or {}).get(text_column)
    if feature is None:
        return None
    if isinstance(feature, datasets.Value):
        return None if feature.dtype in _TEXT_DTYPES else f"holds {feature.dtype} values, not strings"
    if type(feature).__name__ == "Json":
        return ("mixes strings with other JSON values, so datasets typed the whole column as JSON and every "
                "document would be tokenized as its JSON text (quotes, escaped newlines)")
    return f"is of type {feature}, not strings"


def first_non_text_row(dataset: datasets.Dataset, text_column: str,
                       batch_size: int = 1000) -> tuple[int, object] | None:
    """(0-based row, value) of the first value of ``text_column`` that is neither a string nor None."""
    row = 0
    for batch in dataset.select_columns([text_column]).iter(batch_size=batch_size):
        for value in batch[text_column]:
            if value is not None and not isinstance(value, str):
                return row, value
            row += 1
    return None


def check_text_column(dataset, text_column: str, where: str = "the dataset") -> None:
    """Raise :class:`TextColumnError` when ``text_column`` is declared as something other than text.

    Cheap when it is text (the features are read, no row); when it is not, a ``datasets.Dataset`` is
    scanned for the first offending row so that the error can name it. ``where`` names the data in the error.
    """
    problem = text_feature_problem(getattr(dataset, "features", None), text_column)
    if problem is None:
        return
    whole = type(dataset.features[text_column]).__name__ != "Json"  # one type for the column, not a stray row
    found = first_non_text_row(dataset, text_column) if isinstance(dataset, datasets.Dataset) and not whole else None
    at = f": row {found[0] + 1} holds {describe_value(found[1])}" if found else ""
    raise TextColumnError(f"text column {text_column!r} of {where} {problem}{at}; {text_fix(text_column, whole)}")


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
    column = batch.column(text_column)
    if str(column.type) not in _TEXT_DTYPES:  # a stream whose features were not declared: checked per batch
        raise TextColumnError(f"text column {text_column!r} holds {column.type} values, not strings; "
                              f"{text_fix(text_column, not str(column.type).startswith('extension'))}")
    texts = column.to_pylist()
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
    check_text_column(dataset, text_column)
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
