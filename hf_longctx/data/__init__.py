"""datasets pipelines: load text, tokenize and pack documents with boundaries, collate packed batches."""

from .collator import PackedCollator
from .packing import pack_documents
from .sources import data_dir, load_sample_tokenizer, load_text_dataset, sample_corpus_path
from .synthetic import document_lengths, packed_synthetic_dataset

__all__ = [
    "PackedCollator",
    "data_dir",
    "document_lengths",
    "load_sample_tokenizer",
    "load_text_dataset",
    "pack_documents",
    "packed_synthetic_dataset",
    "sample_corpus_path",
]
