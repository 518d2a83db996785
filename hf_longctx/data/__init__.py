"""datasets pipelines for packed long-context training.

tokenize (:func:`tokenize_documents`) -> mix by length and source (:func:`length_mix`) -> pack into rows
with document boundaries (:func:`pack_documents`) -> collate rows into one packed sequence
(:class:`PackedCollator`). Sample data that needs no network: :func:`sample_corpus_path`,
:func:`load_sample_tokenizer`. Synthetic benchmark data: :func:`packed_synthetic_dataset` and the CAD
paper's length distributions (:func:`synthetic_doc_lengths`).
"""

from importlib import import_module

# Names are imported on first use (PEP 562): the benchmarks import synthetic_lengths (numpy only) on
# machines without ``datasets``, and ``import hf_longctx.data`` stays cheap.
_WHERE = {
    "IGNORE_INDEX": "collator",
    "PackedCollator": "collator",
    "best_fit_layout": "packing",
    "concat_layout": "packing",
    "data_dir": "sources",
    "length_mix": "mixing",
    "load_sample_tokenizer": "sources",
    "load_text_dataset": "sources",
    "load_tokenizer": "sources",
    "pack_documents": "packing",
    "packed_synthetic_dataset": "synthetic",
    "sample_corpus_path": "sources",
    "save_histogram_png": "stats",
    "summarize_packed": "stats",
    "synthetic_doc_lengths": "synthetic_lengths",
    "token_shares": "mixing",
    "tokenize_documents": "tokenization",
}

__all__ = [
    "IGNORE_INDEX",
    "PackedCollator",
    "best_fit_layout",
    "concat_layout",
    "data_dir",
    "length_mix",
    "load_sample_tokenizer",
    "load_text_dataset",
    "load_tokenizer",
    "pack_documents",
    "packed_synthetic_dataset",
    "sample_corpus_path",
    "save_histogram_png",
    "summarize_packed",
    "synthetic_doc_lengths",
    "token_shares",
    "tokenize_documents",
]



def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'hf_longctx.data' has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
