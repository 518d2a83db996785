"""Where text and tokenizers come from: the shipped sample data, local files, or the hub.

The sample corpus and tokenizer live in the repository's ``data/`` folder (not inside the package),
so they are found relative to the checkout the package is installed from (``pip install -e .``).
Everything here works offline; a hub name is only tried when it is not a local path.
"""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import datasets

from .tokenization import TextColumnError, check_text_column, describe_value, text_feature_problem, text_fix

LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv",
                 ".txt": "text"}
_ENV_DATA_DIR = "HF_LONGCTX_DATA_DIR"


def data_dir() -> Path:
    """The ``data/`` folder holding ``sample_corpus.jsonl`` and ``tokenizer/``.

    ``$HF_LONGCTX_DATA_DIR`` overrides the search; otherwise the parents of this file are searched,
    which finds the checkout of an editable install.
    """
    override = os.environ.get(_ENV_DATA_DIR)
    candidates = [Path(override)] if override else [parent / "data" for parent in Path(__file__).resolve().parents]
    for candidate in candidates:
        if (candidate / "sample_corpus.jsonl").is_file() and (candidate / "tokenizer").is_dir():
            return candidate
    raise FileNotFoundError(
        "the sample data folder (data/sample_corpus.jsonl and data/tokenizer/) was not found"
        + (f" in ${_ENV_DATA_DIR}={override}" if override else " next to the package")
        + "; install hf_longctx from a checkout with `pip install -e .`, set $HF_LONGCTX_DATA_DIR, "
        "regenerate it with `hf-longctx sample-data --output DIR`, or pass your own dataset and tokenizer"
    )


def sample_corpus_path() -> Path:
    """The shipped corpus: JSON lines with a ``text`` field (generated text, CC0 1.0)."""
    return data_dir() / "sample_corpus.jsonl"


def load_sample_tokenizer():
    """The byte-level BPE tokenizer trained on the sample corpus (2000 tokens, ``</s>`` as EOS)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(data_dir() / "tokenizer"))


def load_tokenizer(name_or_path: str):
    """``"sample"``, a tokenizer folder, a ``tokenizer.json`` file, or a hub name (where a network exists)."""
    if name_or_path == "sample":
        return load_sample_tokenizer()
    path = Path(name_or_path)
    if path.is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(tokenizer_file=str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path)


def _json_files(path_or_name: str) -> list[Path]:
    """The local JSON / JSON-lines files that ``path_or_name`` (a file, a glob or a folder) reads."""
    path = Path(path_or_name)
    if any(c in path_or_name for c in "*?["):
        files = [Path(f) for f in sorted(glob.glob(path_or_name, recursive=True))]
    elif path.is_dir():
        files = sorted(path.rglob("*"))
    else:
        files = [path] if path.is_file() else []
    return [f for f in files if f.is_file() and f.suffix in (".json", ".jsonl")]


def first_non_text_line(files: list[Path], text_column: str) -> tuple[Path, int, object] | None:
    """(file, 1-based line, value) of the first JSON-lines record whose ``text_column`` is neither a string
    nor null; None when every record's is, or when a file is one JSON document rather than JSON lines."""
    for file in files:
        with open(file, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    break  # not JSON lines (an array over several lines): no line to name
                value = record.get(text_column) if isinstance(record, dict) else None
                if value is not None and not isinstance(value, str):
                    return file, number, value
    return None


def check_text_files(dataset, path_or_name: str, text_column: str) -> None:
    """Raise :class:`~hf_longctx.data.tokenization.TextColumnError` naming the file and line of the first
    non-text value when ``text_column`` of the loaded ``dataset`` is not text (see the tokenization rules)."""
    problem = text_feature_problem(getattr(dataset, "features", None), text_column)
    if problem is None:
        return
    found = first_non_text_line(_json_files(path_or_name), text_column)
    if found is None:
        check_text_column(dataset, text_column, where=repr(path_or_name))
        return
    file, line, value = found
    raise TextColumnError(f"{file}:{line}: {text_column!r} is {describe_value(value)}, not a string: the column "
                          f"{problem}; {text_fix(text_column)}")


def load_text_dataset(path_or_name: str, split: str = "train", streaming: bool = False, text_column: str = "text",
                      **kwargs):
    """A local json/jsonl/parquet/arrow/csv/txt file, a glob of them, a folder of them, a folder written by
    ``save_to_disk``, ``"sample"`` (the shipped corpus), or a hub dataset name (where a network exists).

    ``text_column`` (when the data has it) must hold strings or nulls: anything else raises
    :class:`~hf_longctx.data.tokenization.TextColumnError` here, naming the file and the 1-based line of
    the first such value in JSON lines, before anything is tokenized. ``kwargs`` go to
    ``datasets.load_dataset`` (e.g. ``cache_dir``, ``name``).
    """
    loaded = _load(path_or_name, split, streaming, **kwargs)
    check_text_files(loaded, str(sample_corpus_path()) if path_or_name == "sample" else path_or_name, text_column)
    return loaded


def _load(path_or_name: str, split: str, streaming: bool, **kwargs):
    if path_or_name == "sample":
        path_or_name = str(sample_corpus_path())
    path = Path(path_or_name)
    if path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()):
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            loaded = loaded[split]
        return loaded.to_iterable_dataset() if streaming else loaded
    is_glob = any(c in path_or_name for c in "*?[")
    if path.is_file() or is_glob:
        fmt = LOCAL_FORMATS.get(path.suffix)
        if fmt is None:
            raise ValueError(f"unknown file type {path.suffix!r}; use one of {', '.join(LOCAL_FORMATS)}")
        return datasets.load_dataset(fmt, data_files=path_or_name, split=split, streaming=streaming, **kwargs)
    return datasets.load_dataset(path_or_name, split=split, streaming=streaming, **kwargs)
