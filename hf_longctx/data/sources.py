"""Where text and tokenizers come from: the shipped sample data, local files, or the hub.

The sample corpus and tokenizer live in the repository's ``data/`` folder (not inside the package),
so they are found relative to the checkout the package is installed from (``pip install -e .``).
Everything here works offline; a hub name is only tried when it is not a local path.
"""

from __future__ import annotations

import os
from pathlib import Path

import datasets

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


def load_text_dataset(path_or_name: str, split: str = "train", streaming: bool = False, **kwargs):
    """A local json/jsonl/parquet/arrow/csv/txt file, a glob of them, a folder of them, a folder written by
    ``save_to_disk``, ``"sample"`` (the shipped corpus), or a hub dataset name (where a network exists).

    ``kwargs`` go to ``datasets.load_dataset`` (e.g. ``cache_dir``, ``name``).
    """
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
