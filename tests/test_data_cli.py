"""``hf-longctx pack``: dataset, summary (rows, fill ratio, histogram) and PNG; loading local files offline;
the shipped sample data is what its generator writes."""

from __future__ import annotations

import json
import sys

import datasets
import pytest

from hf_longctx.cli import main
from hf_longctx.data import (
    data_dir,
    load_sample_tokenizer,
    load_text_dataset,
    load_tokenizer,
    sample_corpus_path,
)

pytestmark = pytest.mark.usefixtures("tmp_datasets_cache")  # tests/conftest.py


def corpus_tokens():
    tok = load_sample_tokenizer()
    texts = [t for t in load_text_dataset("sample")["text"] if t.strip()]
    return [ids + [tok.eos_token_id] for ids in tok(texts, add_special_tokens=False)["input_ids"]]


def test_pack_sample_corpus_to_folder(tmp_path, capsys):
    out = tmp_path / "packed"
    code = main(["pack", "--input", str(sample_corpus_path()), "--tokenizer", "sample", "--seq-len", "1024",
                 "--output", str(out), "--cache-dir", str(tmp_path / "cache")])
    assert code == 0
    text = capsys.readouterr().out
    assert "fill ratio" in text and "document-length histogram" in text and "rows: " in text
    packed = datasets.load_from_disk(str(out))
    docs = corpus_tokens()
    assert [t for row in packed["input_ids"] for t in row] == [t for d in docs for t in d]
    assert all(len(r) <= 1024 for r in packed["input_ids"])
    summary = json.loads((out / "summary.json").read_text())
    tokens = sum(len(d) for d in docs)
    assert summary["rows"] == len(packed) and summary["tokens"] == tokens
    assert summary["fill_ratio"] == pytest.approx(tokens / (len(packed) * 1024))
    assert summary["documents"] == len(docs) and summary["dropped_documents"] == 3
    assert summary["pieces"] == sum(len(d) for d in packed["doc_lens"])
    hist = summary["histogram"]
    assert sum(b["documents"] for b in hist) == len(docs) and sum(b["piece_tokens"] for b in hist) == tokens
    pieces = [n for lens in packed["doc_lens"] for n in lens]
    for b in hist:  # power-of-two bins, counted exactly
        assert b["hi"] == 2 * b["lo"] - 1
        assert b["documents"] == sum(b["lo"] <= len(d) <= b["hi"] for d in docs)
        assert b["pieces"] == sum(b["lo"] <= n <= b["hi"] for n in pieces)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "PNG skipped: matplotlib is not installed" in text
    else:
        assert (out / "doc_lengths.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pack_to_parquet_without_matplotlib(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if it were not installed
    out = tmp_path / "rows.parquet"
    assert main(["pack", "--input", "sample", "--seq-len", "4096", "--output", str(out), "--strategy", "best_fit",
                 "--seed", "1", "--cache-dir", str(tmp_path / "cache")]) == 0
    text = capsys.readouterr().out
    assert "histogram PNG skipped: matplotlib is not installed (pip install 'hf-longctx[plot]')" in text
    packed = load_text_dataset(str(out), cache_dir=str(tmp_path / "cache2"))
    assert sorted(t for row in packed["input_ids"] for t in row) == sorted(t for d in corpus_tokens() for t in d)
    assert json.loads((tmp_path / "rows.summary.json").read_text())["rows"] == len(packed)
    assert not (tmp_path / "rows.doc_lengths.png").exists()


def test_pack_pretokenized_jsonl_needs_no_tokenizer(tmp_path, capsys):
    src = tmp_path / "tokens.jsonl"
    src.write_text("".join(json.dumps({"input_ids": list(range(i, i + n))}) + "\n"
                           for i, n in ((0, 5), (5, 0), (5, 30), (35, 2))))
    out = tmp_path / "out"
    assert main(["pack", "--input", str(src), "--tokenizer", "does-not-exist", "--seq-len", "16", "--output",
                 str(out), "--no-png", "--cache-dir", str(tmp_path / "cache")]) == 0
    packed = datasets.load_from_disk(str(out))
    assert [t for r in packed["input_ids"] for t in r] == list(range(37))
    assert packed["doc_lens"] == [[5, 11], [16], [3, 2]]


def test_local_formats_and_tokenizer_files(tmp_path):
    rows = datasets.Dataset.from_dict({"text": ["a b", "c"]})
    rows.to_parquet(str(tmp_path / "x.parquet"))
    rows.save_to_disk(str(tmp_path / "saved"))
    cache = str(tmp_path / "cache")
    assert load_text_dataset(str(tmp_path / "x.parquet"), cache_dir=cache)["text"] == ["a b", "c"]
    assert load_text_dataset(str(tmp_path / "saved"))["text"] == ["a b", "c"]
    assert list(load_text_dataset(str(tmp_path / "saved"), streaming=True)) == [{"text": "a b"}, {"text": "c"}]
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    assert load_text_dataset(str(arrow), cache_dir=cache)["text"] == ["a b", "c"]
    with pytest.raises(ValueError, match="unknown file type"):
        (tmp_path / "x.xml").write_text("<a/>")
        load_text_dataset(str(tmp_path / "x.xml"))
    from_file = load_tokenizer(str(data_dir() / "tokenizer" / "tokenizer.json"))
    sample = load_tokenizer("sample")
    assert from_file("one two")["input_ids"] == sample("one two")["input_ids"]
    assert sample.eos_token == "</s>" and 1024 <= len(sample) <= 4096


def test_data_dir_override_and_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_LONGCTX_DATA_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="pip install -e"):
        sample_corpus_path()
    monkeypatch.delenv("HF_LONGCTX_DATA_DIR")
    assert (data_dir() / "tokenizer" / "tokenizer.json").is_file()
    size = sum(p.stat().st_size for p in data_dir().rglob("*") if p.is_file())
    assert size < 2 * 1024 * 1024


def test_shipped_sample_data_is_what_the_generator_writes(tmp_path, capsys):
    assert main(["sample-data", "--output", str(tmp_path)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["vocab_size"] == len(load_sample_tokenizer())
    for name in ("sample_corpus.jsonl", "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (data_dir() / name).read_bytes(), name
