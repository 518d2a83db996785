"""Packing keeps every token exactly once with its document boundaries; the collator marks them."""

from __future__ import annotations

import datasets
import pytest
import torch
from transformers import DataCollatorWithFlattening

from hf_longctx.data import (
    PackedCollator,
    load_sample_tokenizer,
    load_text_dataset,
    pack_documents,
    packed_synthetic_dataset,
    sample_corpus_path,
)


def _docs(lengths, start=0):
    out, tok = [], start
    for n in lengths:
        out.append(list(range(tok, tok + n)))
        tok += n
    return out


@pytest.mark.parametrize("seq_len", [1, 7, 64, 1000])
def test_every_token_once_rows_bounded_boundaries_kept(seq_len):
    docs = _docs([3, 150, 1, 64, 65, 9, 400])
    packed = pack_documents(datasets.Dataset.from_dict({"input_ids": docs}), seq_len=seq_len, batch_size=3)
    flat = [t for row in packed["input_ids"] for t in row]
    assert flat == [t for d in docs for t in d]  # exactly the input tokens, in order
    for row, lens in zip(packed["input_ids"], packed["doc_lens"]):
        assert 0 < len(row) <= seq_len and sum(lens) == len(row) and all(n > 0 for n in lens)
    # every document boundary of the input is a boundary in the output, and pieces never exceed a row
    bounds_out, pos = set(), 0
    for lens in packed["doc_lens"]:
        for n in lens:
            pos += n
            bounds_out.add(pos)
    pos = 0
    for d in docs:
        pos += len(d)
        assert pos in bounds_out


def test_long_documents_are_split_into_pieces():
    packed = pack_documents(datasets.Dataset.from_dict({"input_ids": _docs([250])}), seq_len=100)
    assert packed["doc_lens"] == [[100], [100], [50]]


def test_text_rules_empty_documents_dropped_and_eos_appended():
    tok = load_sample_tokenizer()
    ds = datasets.Dataset.from_dict({"text": ["one two", "", "   \n", "three"]})
    packed = pack_documents(ds, tok, seq_len=10_000)
    expected = [tok("one two", add_special_tokens=False)["input_ids"] + [tok.eos_token_id],
                tok("three", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
    assert packed["input_ids"] == [expected[0] + expected[1]]
    assert packed["doc_lens"] == [[len(expected[0]), len(expected[1])]]


def test_tokenizer_without_eos_needs_a_decision():
    tok = load_sample_tokenizer()
    tok.eos_token = None
    ds = datasets.Dataset.from_dict({"text": ["a b"]})
    with pytest.raises(ValueError, match="no EOS token"):
        pack_documents(ds, tok, seq_len=16)
    assert pack_documents(ds, tok, seq_len=16, add_eos=False)["doc_lens"] == [[len(tok("a b")["input_ids"])]]


def test_streaming_gives_the_same_rows():
    docs = _docs([30, 5, 70, 12])
    eager = pack_documents(datasets.Dataset.from_dict({"input_ids": docs}), seq_len=32)
    stream = pack_documents(datasets.Dataset.from_dict({"input_ids": docs}).to_iterable_dataset(), seq_len=32)
    assert [r["input_ids"] for r in stream] == eager["input_ids"]


def test_shuffle_is_deterministic_for_a_seed():
    ds = datasets.Dataset.from_dict({"input_ids": _docs([5] * 20)})
    a = pack_documents(ds, seq_len=16, seed=3)["input_ids"]
    assert a == pack_documents(ds, seq_len=16, seed=3)["input_ids"]
    assert a != pack_documents(ds, seq_len=16, seed=4)["input_ids"]


def test_collator_matches_transformers_flattening_conventions():
    rows = [{"input_ids": [5, 6, 7, 8, 9], "doc_lens": [2, 3]}, {"input_ids": [1, 2, 3], "doc_lens": [3]}]
    ours = PackedCollator()(rows)
    # DataCollatorWithFlattening sees one example per document
    per_doc = [{"input_ids": [5, 6]}, {"input_ids": [7, 8, 9]}, {"input_ids": [1, 2, 3]}]
    theirs = DataCollatorWithFlattening(return_tensors="pt")(per_doc)
    assert torch.equal(ours["input_ids"], theirs["input_ids"])
    assert torch.equal(ours["labels"], theirs["labels"])
    assert torch.equal(ours["position_ids"], theirs["position_ids"])
    assert ours["doc_lens"].tolist() == [2, 3, 3]


def test_collator_padding_is_an_ignored_document():
    out = PackedCollator(pad_to_multiple_of=4)([{"input_ids": [1, 2, 3, 4, 5], "doc_lens": [5]}])
    assert out["input_ids"].shape == (1, 8) and out["doc_lens"].tolist() == [5, 3]
    assert out["labels"][0, 5:].tolist() == [-100] * 3 and out["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]


def test_sample_corpus_and_synthetic_rows():
    ds = load_text_dataset(str(sample_corpus_path()))
    assert len(ds) > 100 and "text" in ds.column_names
    syn = packed_synthetic_dataset(3, 512, mix="lognormal", seed=1)
    assert all(sum(lens) == 512 == len(ids) for ids, lens in zip(syn["input_ids"], syn["doc_lens"]))
