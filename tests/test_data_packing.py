"""pack_documents: every token exactly once, rows within seq_len, doc_lens consistent, long documents split,
the tokenization rules, streaming, determinism, caching and num_proc independence."""

from __future__ import annotations

import json

import datasets
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_longctx.data import (
    best_fit_layout,
    concat_layout,
    load_sample_tokenizer,
    load_text_dataset,
    pack_documents,
    sample_corpus_path,
    tokenize_documents,
)
from hf_longctx.data.tokenization import TextColumnError

pytestmark = pytest.mark.usefixtures("tmp_datasets_cache")  # tests/conftest.py


def unique_docs(lengths):
    """Documents whose tokens are all distinct (token t is the t-th token overall)."""
    out, start = [], 0
    for n in lengths:
        out.append(list(range(start, start + n)))
        start += n
    return out


def check_rows(packed, seq_len):
    """Rows within seq_len, doc_lens positive and summing to the row; returns the pieces as token lists."""
    pieces = []
    for row, lens in zip(packed["input_ids"], packed["doc_lens"]):
        assert 1 <= len(row) <= seq_len
        assert sum(lens) == len(row) and all(n > 0 for n in lens)
        pos = 0
        for n in lens:
            pieces.append(row[pos : pos + n])
            pos += n
    return pieces


def check_pieces_of_documents(pieces, docs, seq_len, strategy):
    """Every piece is a contiguous run of one document; each document is covered exactly once by its pieces."""
    owner = {t: d for d, doc in enumerate(docs) for t in doc}
    by_doc: dict[int, list[list[int]]] = {}
    for piece in pieces:
        d = owner[piece[0]]
        assert piece == list(range(piece[0], piece[0] + len(piece))) and owner[piece[-1]] == d
        by_doc.setdefault(d, []).append(piece)
    for d, doc in enumerate(docs):
        if not doc:
            assert d not in by_doc
            continue
        got = sorted(by_doc[d], key=lambda p: p[0])
        assert [t for p in got for t in p] == doc  # no token lost or repeated
        if strategy == "best_fit":  # only documents longer than a row are cut, into as few pieces as possible
            assert len(got) == -(-len(doc) // seq_len)
            assert all(len(p) == seq_len for p in got[:-1])


lengths_st = st.lists(st.integers(0, 300), min_size=0, max_size=40)


@settings(max_examples=150, deadline=None)
@given(lengths=lengths_st, seq_len=st.integers(1, 257))
def test_layouts_keep_every_token_once(lengths, seq_len):
    for strategy, layout in (("concat", concat_layout), ("best_fit", best_fit_layout)):
        lens = np.array([n for n in lengths if n > 0], dtype=np.int64)
        starts, piece_lens, row_offsets = layout(lens, seq_len)
        row_tokens = [int(piece_lens[a:b].sum()) for a, b in zip(row_offsets[:-1], row_offsets[1:])]
        assert all(1 <= n <= seq_len for n in row_tokens) and sum(row_tokens) == lens.sum()
        covered = np.zeros(int(lens.sum()), dtype=np.int64)
        for s, n in zip(starts, piece_lens):
            covered[s : s + n] += 1
        assert (covered == 1).all()
        if strategy == "concat":  # in order, and every row but the last is full
            assert (starts == np.concatenate([[0], np.cumsum(piece_lens)[:-1]])).all()
            assert all(n == seq_len for n in row_tokens[:-1])


@pytest.mark.parametrize("strategy", ["concat", "best_fit"])
@pytest.mark.parametrize("seq_len,batch_size", [(1, 1000), (7, 3), (64, 1000), (100, 2), (5000, 1000)])
def test_pretokenized_documents_every_token_once(strategy, seq_len, batch_size):
    docs = unique_docs([3, 150, 1, 64, 65, 0, 9, 400, 100, 99, 1, 250])
    ds = datasets.Dataset.from_dict({"input_ids": docs, "other": list(range(len(docs)))})
    packed = pack_documents(ds, seq_len=seq_len, batch_size=batch_size, strategy=strategy)
    assert packed.column_names == ["input_ids", "doc_lens"]
    pieces = check_rows(packed, seq_len)
    check_pieces_of_documents(pieces, docs, seq_len, strategy)
    flat = [t for row in packed["input_ids"] for t in row]
    everything = [t for d in docs for t in d]
    assert sorted(flat) == everything
    if strategy == "concat":
        assert flat == everything  # same order too
        assert all(len(r) == seq_len for r in packed["input_ids"][:-1])  # only the very last row may be short
        # the layout is global: the same rows for any batch size and for a stream
        assert packed["input_ids"] == pack_documents(ds, seq_len=seq_len, batch_size=1)["input_ids"]
        stream = list(pack_documents(ds.to_iterable_dataset(), seq_len=seq_len, batch_size=batch_size))
        assert [r["input_ids"] for r in stream] == packed["input_ids"]
        assert [r["doc_lens"] for r in stream] == packed["doc_lens"]


def test_long_document_split_into_pieces():
    ds = datasets.Dataset.from_dict({"input_ids": unique_docs([250])})
    for strategy in ("concat", "best_fit"):
        assert pack_documents(ds, seq_len=100, strategy=strategy)["doc_lens"] == [[100], [100], [50]]
    ds = datasets.Dataset.from_dict({"input_ids": unique_docs([60, 60, 30])})
    assert pack_documents(ds, seq_len=100)["doc_lens"] == [[60, 40], [20, 30]]  # concat cuts the second document
    assert pack_documents(ds, seq_len=100, strategy="best_fit")["doc_lens"] == [[60, 30], [60]]  # nothing cut


def test_text_rules_empty_whitespace_eos():
    tok = load_sample_tokenizer()
    texts = ["one two", "", "   \n\t", None, "three four five", "six"]
    ds = datasets.Dataset.from_dict({"text": texts})
    enc = [tok(t, add_special_tokens=False)["input_ids"] for t in ("one two", "three four five", "six")]
    eos = tok.eos_token_id
    packed = pack_documents(ds, tok, seq_len=10_000)  # rule: empty and whitespace-only documents are dropped
    assert packed["input_ids"] == [[t for e in enc for t in e + [eos]]]
    assert packed["doc_lens"] == [[len(e) + 1 for e in enc]]  # rule: every document ends with EOS
    plain = pack_documents(ds, tok, seq_len=10_000, add_eos=False)  # exactly the input tokens
    assert plain["input_ids"] == [[t for e in enc for t in e]] and plain["doc_lens"] == [[len(e) for e in enc]]
    bos = pack_documents(ds, tok, seq_len=10_000, add_bos=True)
    assert bos["doc_lens"] == [[len(e) + 2 for e in enc]] and bos["input_ids"][0][0] == tok.bos_token_id


def test_a_text_that_is_not_a_string_is_refused_by_file_and_line_before_tokenizing(tmp_path):
    """One ``42`` in a JSON-lines file makes datasets type the whole column as JSON: every document would be
    tokenized as its JSON text (quotes, ``\\n`` escapes). It is refused by file and 1-based line, eager and
    streaming; a null text keeps its rule (the document is dropped)."""
    lines = [{"text": "one\ntwo"}, {"text": None}, {"text": 42}, {"text": "three"}]
    src = tmp_path / "mixed.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    for streaming in (False, True):
        with pytest.raises(TextColumnError) as err:
            load_text_dataset(str(src), streaming=streaming, cache_dir=str(tmp_path / "cache"))
        message = str(err.value)
        assert message.startswith(f"{src}:3: 'text' is 42 (a number), not a string"), message
        assert "typed the whole column as JSON" in message and 'as a string ("42", not 42)' in message, message
    with pytest.raises(TextColumnError, match=r"mixed\.jsonl:3: .text. is 42"):  # a glob names the file too
        load_text_dataset(str(tmp_path / "*.jsonl"), cache_dir=str(tmp_path / "cache"))
    nulls = tmp_path / "nulls.jsonl"
    nulls.write_text('{"text": "one\\ntwo"}\n{"text": null}\n{"text": "three"}\n')
    tok = load_sample_tokenizer()
    packed = pack_documents(load_text_dataset(str(nulls), cache_dir=str(tmp_path / "cache")), tok, seq_len=1000,
                            add_eos=False)
    assert packed["input_ids"] == [tok("one\ntwo", add_special_tokens=False)["input_ids"]
                                   + tok("three", add_special_tokens=False)["input_ids"]]


def test_a_text_column_of_other_values_is_refused_wherever_the_dataset_comes_from(tmp_path):
    """Parquet and csv columns of numbers, a Dataset passed in with a JSON column, and a stream whose features
    were never declared: each is refused before tokenizing, naming the column (and the row when one is off)."""
    tok = load_sample_tokenizer()
    numbers = datasets.Dataset.from_dict({"text": [1, 2], "body": ["a b", "c"]})
    numbers.to_parquet(str(tmp_path / "x.parquet"))
    numbers.to_csv(str(tmp_path / "x.csv"), index=False)
    for name in ("x.parquet", "x.csv"):
        with pytest.raises(TextColumnError, match="text column 'text' of .* holds int64 values, not strings; pass "
                           "text_column= the column that holds the text"):
            load_text_dataset(str(tmp_path / name), cache_dir=str(tmp_path / "cache"))
    assert load_text_dataset(str(tmp_path / "x.parquet"), text_column="body", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(TextColumnError, match="'text' of the dataset holds int64 values"):
        pack_documents(numbers, tok, seq_len=16)
    mixed = datasets.Dataset.from_dict({"text": ["a", None, 42]}, features=datasets.Features({"text": datasets.Json()}))
    with pytest.raises(TextColumnError, match=r"mixes strings with other JSON values.*: row 3 holds 42 \(a number\)"):
        pack_documents(mixed, tok, seq_len=16)

    def undeclared():
        yield from ({"text": n} for n in (3, 4))

    with pytest.raises(TextColumnError, match="'text' holds int64 values, not strings"):
        list(pack_documents(datasets.IterableDataset.from_generator(undeclared), tok, seq_len=16))


def test_tokenizer_without_eos_is_an_error_naming_the_fixes():
    tok = load_sample_tokenizer()
    tok.eos_token = None
    ds = datasets.Dataset.from_dict({"text": ["a b", "c"]})
    with pytest.raises(ValueError, match="no EOS token.*eos_token_id=.*add_eos=False"):
        pack_documents(ds, tok, seq_len=16)
    assert pack_documents(ds, tok, seq_len=16, add_eos=False)["doc_lens"] == [[len(tok("a b")["input_ids"]),
                                                                                len(tok("c")["input_ids"])]]
    with_id = pack_documents(ds, tok, seq_len=16, eos_token_id=7)
    assert [row[-1] for row in with_id["input_ids"]] == [7]
    assert with_id["input_ids"][0][with_id["doc_lens"][0][0] - 1] == 7


def test_raw_tokenizers_tokenizer_and_missing_inputs():
    tok = load_sample_tokenizer()
    raw = tok.backend_tokenizer
    ds = datasets.Dataset.from_dict({"text": ["one two", "three"]})
    assert pack_documents(ds, raw, seq_len=64, eos_token_id=tok.eos_token_id)["input_ids"] == \
        pack_documents(ds, tok, seq_len=64)["input_ids"]
    with pytest.raises(ValueError, match="no EOS token"):
        pack_documents(ds, raw, seq_len=64)
    with pytest.raises(ValueError, match="pass a tokenizer"):
        pack_documents(ds, seq_len=64)
    with pytest.raises(ValueError, match="text column 'body'"):
        pack_documents(ds, tok, seq_len=64, text_column="body")
    with pytest.raises(ValueError, match="seq_len"):
        pack_documents(ds, tok, seq_len=0)


def test_sample_corpus_packs_with_every_token_once(tmp_path):
    tok = load_sample_tokenizer()
    raw = load_text_dataset(str(sample_corpus_path()), cache_dir=str(tmp_path))
    docs = tokenize_documents(raw, tok)
    texts = [t for t in raw["text"] if t.strip()]
    assert len(docs) == len(texts) == len(raw) - 3  # the corpus ships one empty and two whitespace-only documents
    expected = [ids + [tok.eos_token_id] for ids in tok(texts, add_special_tokens=False)["input_ids"]]
    assert docs["input_ids"] == expected
    packed = pack_documents(raw, tok, seq_len=1024)
    assert [t for row in packed["input_ids"] for t in row] == [t for d in expected for t in d]
    pieces = check_rows(packed, 1024)
    assert len(pieces) > len(expected)  # documents longer than a row exist and were split
    assert max(map(len, expected)) > 1024


def test_num_proc_does_not_change_rows_and_map_cache_is_reused(tmp_path):
    tok = load_sample_tokenizer()
    def raw(cache):  # separate caches, so the num_proc=2 run computes instead of loading the first run's result
        return load_text_dataset(str(sample_corpus_path()), cache_dir=str(tmp_path / cache)).select(range(300))

    one = pack_documents(raw("a"), tok, seq_len=512, num_proc=1, batch_size=64, seed=5)
    two = pack_documents(raw("b"), tok, seq_len=512, num_proc=2, batch_size=64, seed=5)
    assert one["input_ids"] == two["input_ids"] and one["doc_lens"] == two["doc_lens"]
    assert len(one.cache_files) == 1 and len(two.cache_files) == 2  # two processes packed too, to the same rows
    again = pack_documents(raw("a"), tok, seq_len=512, num_proc=1, batch_size=64, seed=5)
    assert again.cache_files == one.cache_files and one.cache_files  # datasets' cache: same fingerprint, same file


def test_seed_shuffles_deterministically():
    ds = datasets.Dataset.from_dict({"input_ids": unique_docs([5] * 40)})
    a = pack_documents(ds, seq_len=16, seed=3)["input_ids"]
    assert a == pack_documents(ds, seq_len=16, seed=3)["input_ids"]
    assert a != pack_documents(ds, seq_len=16, seed=4)["input_ids"]
    assert sorted(t for r in a for t in r) == list(range(200))
    assert [t for r in pack_documents(ds, seq_len=16)["input_ids"] for t in r] == list(range(200))


def test_streaming_matches_eager_and_resumes_from_state_dict(tmp_path):
    tok = load_sample_tokenizer()
    path = tmp_path / "docs.jsonl"
    texts = [f"document {i} " + "word " * (i * 7 % 90) for i in range(120)] + ["", "  "]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    eager = pack_documents(load_text_dataset(str(path), cache_dir=str(tmp_path)), tok, seq_len=128, batch_size=50)

    def stream():
        return pack_documents(load_text_dataset(str(path), streaming=True), tok, seq_len=128, batch_size=50)

    rows = list(stream())
    assert [r["input_ids"] for r in rows] == eager["input_ids"] and [r["doc_lens"] for r in rows] == eager["doc_lens"]
    first, it = [], stream()
    for i, row in enumerate(it):
        first.append(row["input_ids"])
        if i == 9:
            state = it.state_dict()
            break
    resumed = stream()
    resumed.load_state_dict(state)
    assert first + [r["input_ids"] for r in resumed] == eager["input_ids"]  # nothing lost, nothing repeated
    shuffled = [r["input_ids"] for r in pack_documents(load_text_dataset(str(path), streaming=True), tok,
                                                       seq_len=128, seed=1, shuffle_buffer_size=30)]
    again = [r["input_ids"] for r in pack_documents(load_text_dataset(str(path), streaming=True), tok,
                                                    seq_len=128, seed=1, shuffle_buffer_size=30)]
    assert shuffled == again and shuffled != eager["input_ids"]
    assert sorted(t for r in shuffled for t in r) == sorted(t for r in eager["input_ids"] for t in r)
