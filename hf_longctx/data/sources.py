"""Where text comes from: the shipped sample corpus and tokenizer, local files, or hub datasets."""

from __future__ import annotations

from pathlib import Path

import datasets

_LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv",
                  ".txt": "text"}


def data_dir() -> Path:
    """The repository's ``data/`` folder (the package is installed from a checkout)."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        candidate = parent / "data" / "sample_corpus.jsonl"
        if candidate.is_file():
            return candidate.parent
    raise FileNotFoundError(
        "the sample data folder (data/sample_corpus.jsonl) was not found next to the package; install hf_longctx "
        "from a checkout with `pip install -e .`, or pass your own dataset and tokenizer"
    )


def sample_corpus_path() -> Path:
    return data_dir() / "sample_corpus.jsonl"


def load_sample_tokenizer():
    """The byte-level BPE tokenizer trained on the sample corpus (512 tokens, ``</s>`` as EOS)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(data_dir() / "tokenizer"))


def load_text_dataset(path_or_name: str, split: str = "train", streaming: bool = False, **kwargs):
    """A local json/jsonl/parquet/arrow/csv/txt file or folder, a saved dataset, or a hub dataset name."""
    path = Path(path_or_name)
    if path.is_dir() and (path / "dataset_info.json").is_file():
        return datasets.load_from_disk(str(path))
    if path.is_file():
        fmt = _LOCAL_FORMATS.get(path.suffix)
        if fmt is None:
            raise ValueError(f"unknown file type {path.suffix!r}; use one of {', '.join(_LOCAL_FORMATS)}")
        return datasets.load_dataset(fmt, data_files=str(path), split=split, streaming=streaming, **kwargs)
    return datasets.load_dataset(path_or_name, split=split, streaming=streaming, **kwargs)
