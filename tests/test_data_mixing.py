"""length_mix hits its token-share targets within the stated tolerance: every (source, bucket) group is within
half its longest document of its quota; the synthetic Pretrain/ProLong mixes when they are installed."""

from __future__ import annotations

import datasets
import numpy as np
import pytest

from hf_longctx.data import (
    length_mix,
    load_sample_tokenizer,
    load_text_dataset,
    packed_synthetic_dataset,
    token_shares,
    tokenize_documents,
)

LONG = 65536


pytestmark = pytest.mark.usefixtures("tmp_datasets_cache")  # tests/conftest.py


@pytest.fixture(scope="module")
def corpus():
    """20,000 documents from two sources with a long tail: lengths 1..300K tokens."""
    rng = np.random.default_rng(0)
    lengths = np.minimum(np.exp(rng.normal(7.5, 2.0, 20000)).astype(np.int64) + 1, 300_000)
    sources = np.where(rng.random(20000) < 0.5, "web", "books")
    return datasets.Dataset.from_dict({"length": lengths.tolist(), "source": sources.tolist(),
                                       "id": list(range(20000))})


def group_tokens(picked, bounds, source=None):
    lengths = np.array(picked["length"])
    mask = np.ones(len(lengths), bool) if source is None else np.array(picked["source"]) == source
    idx = np.searchsorted(np.array(sorted(bounds)), lengths, side="right") - 1
    return {b: int(lengths[mask & (idx == i)].sum()) for i, b in enumerate(sorted(bounds))}


def test_share_of_long_documents_hits_target(corpus):
    total = 20_000_000
    picked = length_mix(corpus, {0: 0.6, LONG: 0.4}, total, seed=1, length_column="length")
    got = group_tokens(picked, [0, LONG])
    lengths = np.array(corpus["length"])
    for bound, share, longest in ((0, 0.6, lengths[lengths < LONG].max()), (LONG, 0.4, lengths.max())):
        assert abs(got[bound] - share * total) <= longest / 2  # the stated tolerance: half a document
    shares = token_shares(picked["length"], [0, LONG])
    assert abs(shares[LONG] - 0.4) < 0.01
    assert len(set(picked["id"])) == len(picked)  # no document twice


def test_source_times_bucket_shares(corpus):
    total = 10_000_000
    picked = length_mix(corpus, {0: 0.5, 4096: 0.2, LONG: 0.3}, total, seed=2, source_column="source",
                        source_shares={"web": 0.7, "books": 0.3}, length_column="length")
    for source, source_share in (("web", 0.7), ("books", 0.3)):
        got = group_tokens(picked, [0, 4096, LONG], source)
        for bound, share in ((0, 0.5), (4096, 0.2), (LONG, 0.3)):
            assert abs(got[bound] - source_share * share * total) <= 300_000 / 2


def test_joint_source_bucket_targets_and_default_total(corpus):
    targets = {("books", LONG): 0.5, ("web", 0): 0.5}  # books only long, web only short
    picked = length_mix(corpus, targets, seed=3, source_column="source", length_column="length")
    lengths, sources = np.array(picked["length"]), np.array(picked["source"])
    assert (lengths[sources == "books"] >= LONG).all() and (lengths[sources == "web"] < LONG).all()
    books_long = sum(n for n, s in zip(corpus["length"], corpus["source"]) if s == "books" and n >= LONG)
    # total_tokens=None: the largest total that needs no document twice; the scarce group is used up
    assert abs(lengths[sources == "books"].sum() - books_long) <= 300_000 / 2
    assert abs(lengths[sources == "web"].sum() - books_long) <= LONG / 2
    assert len(set(picked["id"])) == len(picked)


def test_deterministic_for_a_seed_and_interleaved(corpus):
    a = length_mix(corpus, {0: 0.7, LONG: 0.3}, 5_000_000, seed=7, length_column="length")["id"]
    assert a == length_mix(corpus, {0: 0.7, LONG: 0.3}, 5_000_000, seed=7, length_column="length")["id"]
    assert a != length_mix(corpus, {0: 0.7, LONG: 0.3}, 5_000_000, seed=8, length_column="length")["id"]
    long_positions = [i for i, n in enumerate(corpus.select(a)["length"]) if n >= LONG]
    assert long_positions[0] < len(a) // 2 < long_positions[-1]  # shuffled together, not bucket after bucket


def test_scarce_group_errors_or_repeats(corpus):
    total = 250_000_000  # the corpus holds 219M tokens, 107M of them in documents >= 64K
    with pytest.raises(ValueError, match="not enough documents of length >= 65536"):
        length_mix(corpus, {0: 0.2, LONG: 0.8}, total, length_column="length")
    picked = length_mix(corpus, {0: 0.2, LONG: 0.8}, total, length_column="length", replace=True, seed=4)
    got = group_tokens(picked, [0, LONG])
    assert abs(got[LONG] - 0.8 * total) <= 300_000 / 2 and abs(got[0] - 0.2 * total) <= LONG / 2
    assert len(set(picked["id"])) < len(picked)  # documents were repeated, in whole passes
    with pytest.raises(ValueError, match="sum to 1"):
        length_mix(corpus, {0: 0.5, LONG: 0.4}, 1000, length_column="length")
    with pytest.raises(ValueError, match="source_column"):
        length_mix(corpus, {("web", 0): 1.0}, 1000, length_column="length")
    with pytest.raises(TypeError, match="up front"):
        length_mix(corpus.to_iterable_dataset(), {0: 1.0}, 1000, length_column="length")


def test_tokenized_sample_corpus_mix(tmp_path):
    raw = load_text_dataset("sample", cache_dir=str(tmp_path))
    raw = raw.add_column("source", ["even" if i % 2 == 0 else "odd" for i in range(len(raw))])
    docs = tokenize_documents(raw, load_sample_tokenizer(), keep_columns=["source"])
    assert docs.column_names == ["input_ids", "source"] and len(docs) == len(raw) - 3
    picked = length_mix(docs, {0: 0.5, 1024: 0.5}, 60_000, seed=0, source_column="source",
                        source_shares={"even": 0.5, "odd": 0.5})
    lengths = [len(x) for x in picked["input_ids"]]
    longest = max(len(x) for x in docs["input_ids"])
    assert abs(sum(n for n in lengths if n >= 1024) - 30_000) <= longest  # two groups of >= 1024 tokens
    assert abs(sum(n for n in lengths if n < 1024) - 30_000) <= 1024


@pytest.mark.parametrize("mix", ["pretrain", "prolong"])
def test_synthetic_paper_mixes(mix):
    pytest.importorskip("hf_longctx.data.synthetic_lengths")
    from hf_longctx.data import synthetic_doc_lengths

    lens = synthetic_doc_lengths(mix, 2_000_000, seed=2)
    assert sum(lens) == 2_000_000 and min(lens) >= 1 and lens == synthetic_doc_lengths(mix, 2_000_000, seed=2)
    rows = packed_synthetic_dataset(3, 65536, mix=mix, seed=1)
    assert all(sum(d) == 65536 == len(r) for r, d in zip(rows["input_ids"], rows["doc_lens"]))


def test_paper_mixes_fall_back_to_lognormal_without_their_module(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "hf_longctx.data.synthetic_lengths", None)  # import fails as if absent
    with pytest.warns(UserWarning, match="falls back to lognormal"):
        rows = packed_synthetic_dataset(2, 4096, mix="prolong", seed=1)
    lognormal = packed_synthetic_dataset(2, 4096, mix="lognormal", seed=1)
    assert rows["doc_lens"] == lognormal["doc_lens"] and rows["input_ids"] == lognormal["input_ids"]
