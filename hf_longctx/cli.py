"""``hf-longctx`` command line.

    hf-longctx pack --input corpus.jsonl --tokenizer sample --seq-len 65536 --output packed/
    hf-longctx sample-data --output data/

``pack`` loads any local json/jsonl/parquet/arrow/csv/txt file (or a saved dataset, or a hub name
where a network exists), tokenizes it under the rules of :mod:`hf_longctx.data.tokenization`, packs
it with :func:`hf_longctx.data.pack_documents`, saves it, and prints a summary: rows, fill ratio
and the document-length histogram (also written as ``summary.json`` and a PNG when matplotlib is
installed). The output folder is a ``datasets.save_to_disk`` folder unless it ends in ``.parquet``
or ``.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _side_paths(output: Path) -> tuple[Path, Path]:
    """Where the summary JSON and the PNG go: inside a dataset folder, or next to a single file."""
    if output.suffix in (".parquet", ".jsonl", ".json"):
        stem = output.with_suffix("")
        return stem.with_name(stem.name + ".summary.json"), stem.with_name(stem.name + ".doc_lengths.png")
    return output / "summary.json", output / "doc_lengths.png"


def cmd_pack(args: argparse.Namespace) -> int:
    from .data import load_text_dataset, load_tokenizer, pack_documents, tokenize_documents
    from .data.stats import save_histogram_png, summarize_packed

    load_kwargs = {"cache_dir": args.cache_dir} if args.cache_dir else {}
    raw = load_text_dataset(args.input, split=args.split, text_column=args.text_column, **load_kwargs)
    start = time.perf_counter()
    if "input_ids" in raw.column_names:
        docs, dropped = raw.select_columns(["input_ids"]), None
    else:
        tokenizer = load_tokenizer(args.tokenizer)
        docs = tokenize_documents(raw, tokenizer, text_column=args.text_column, add_eos=not args.no_eos,
                                  add_bos=args.bos, eos_token_id=args.eos_token_id, num_proc=args.num_proc,
                                  batch_size=args.batch_size)
        dropped = len(raw) - len(docs)
    packed = pack_documents(docs, seq_len=args.seq_len, seed=args.seed, batch_size=args.batch_size,
                            strategy=args.strategy, num_proc=args.num_proc)
    output = Path(args.output)
    if output.suffix == ".parquet":
        packed.to_parquet(str(output))
    elif output.suffix in (".jsonl", ".json"):
        packed.to_json(str(output), lines=True)
    else:
        packed.save_to_disk(str(output))
    seconds = time.perf_counter() - start
    summary = summarize_packed(packed, args.seq_len, documents=docs, dropped_documents=dropped, seconds=seconds)
    summary_path, png_path = _side_paths(output)
    summary_path.write_text(json.dumps(summary.as_dict(), indent=1) + "\n")
    print(summary.text())
    print(save_histogram_png(summary, str(png_path)) if not args.no_png else "histogram PNG not requested")
    print(f"packed dataset saved to {output}; summary in {summary_path}")
    return 0


def cmd_sample_data(args: argparse.Namespace) -> int:
    from .data.sample_data import write_sample_data

    info = write_sample_data(args.output)
    print(json.dumps(info))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-longctx", description="hf_longctx data tools")
    sub = parser.add_subparsers(dest="command", required=True)
    pack = sub.add_parser("pack", help="tokenize and pack a text dataset into rows with document boundaries")
    pack.add_argument("--input", required=True,
                      help="json/jsonl/parquet/arrow/csv/txt file or glob, saved dataset, 'sample', or hub name")
    pack.add_argument("--tokenizer", default="sample",
                      help="tokenizer folder, tokenizer.json, hub name, or 'sample' (the shipped one; default)")
    pack.add_argument("--seq-len", type=int, required=True, help="tokens per row (upper bound)")
    pack.add_argument("--output", required=True, help="folder for save_to_disk, or a .parquet / .jsonl file")
    pack.add_argument("--text-column", default="text")
    pack.add_argument("--split", default="train")
    pack.add_argument("--strategy", choices=["concat", "best_fit"], default="concat",
                      help="concat: cut the concatenation every seq-len tokens (ProLong); best_fit: split only "
                           "documents longer than a row, place the rest whole")
    pack.add_argument("--num-proc", type=int, default=None, help="processes for tokenizing and packing")
    pack.add_argument("--batch-size", type=int, default=1000, help="documents per map batch")
    pack.add_argument("--seed", type=int, default=None, help="shuffle documents with this seed before packing")
    pack.add_argument("--no-eos", action="store_true", help="do not append EOS to every document")
    pack.add_argument("--eos-token-id", type=int, default=None, help="EOS id for a tokenizer that has none")
    pack.add_argument("--bos", action="store_true", help="prepend the tokenizer's BOS to every document")
    pack.add_argument("--cache-dir", default=None, help="datasets cache folder for the loaded input")
    pack.add_argument("--no-png", action="store_true", help="skip the histogram PNG")
    pack.set_defaults(func=cmd_pack)
    sample = sub.add_parser("sample-data", help="regenerate the sample corpus and tokenizer (deterministic)")
    sample.add_argument("--output", default="data", help="folder to write (default: data)")
    sample.set_defaults(func=cmd_sample_data)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
