"""datasets pipelines for packed long-context training.

tokenize (:func:`tokenize_documents`) -> mix by length and source (:func:`length_mix`) -> pack into rows
with document boundaries (:func:`pack_documents`) -> collate rows into one packed sequence
(:class:`PackedCollator`). Sample data that needs no network: :func:`sample_corpus_path`,
:func:`load_sample_tokenizer`. Synthetic benchmark data: :func:`packed_synthetic_dataset` and the CAD
paper's length distributions (:func:`synthetic_doc_lengths`).
"""

from .collator import IGNORE_INDEX, PackedCollator
from .mixing import bucket_of, document_token_lengths, length_mix, token_shares
from .packing import STRATEGIES, best_fit_layout, concat_layout, pack_arrow, pack_documents
from .sources import data_dir, load_sample_tokenizer, load_text_dataset, load_tokenizer, sample_corpus_path
from .stats import PackingSummary, save_histogram_png, summarize_packed
from .synthetic import document_lengths, packed_synthetic_dataset
from .tokenization import tokenize_documents

__all__ = [
    "IGNORE_INDEX",
    "STRATEGIES",
    "PackedCollator",
    "PackingSummary",
    "best_fit_layout",
    "bucket_of",
    "concat_layout",
    "data_dir",
    "document_lengths",
    "document_token_lengths",
    "length_mix",
    "load_sample_tokenizer",
    "load_text_dataset",
    "load_tokenizer",
    "pack_arrow",
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
    if name == "synthetic_doc_lengths":  # written separately; imported only when asked for
        from .synthetic_lengths import synthetic_doc_lengths

        return synthetic_doc_lengths
    raise AttributeError(f"module 'hf_longctx.data' has no attribute {name!r}")
