"""Throughput of the data pipeline on this machine: tokenize + pack (num_proc 1 and 2), pack alone,
streaming, and the collator.

    python scripts/bench_packing.py --repeat 40 --write bench/packing.md

The corpus is the shipped sample corpus repeated ``--repeat`` times, written as JSON lines and loaded
with ``datasets`` (the load is not timed). Every configuration runs in a fresh process (so the
tokenizer's own thread pool starts unused) and never reads a cached result of the step it times;
each is repeated ``--trials`` times and the best time is reported. Throughput is output tokens
(document tokens plus one EOS each) per second of wall time, map + cache writing included.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def make_corpus(path: Path, repeat: int) -> dict:
    from hf_longctx.data import sample_corpus_path

    lines = sample_corpus_path().read_text().splitlines()
    with open(path, "w") as f:
        for _ in range(repeat):
            f.write("\n".join(lines) + "\n")
    return {"documents": len(lines) * repeat, "bytes": path.stat().st_size}


def _cpu() -> float:
    """CPU seconds of this process and its finished children (datasets' worker processes)."""
    import resource

    return sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))


def one(config: dict) -> dict:
    """Run one configuration in this process; returns wall and CPU seconds of the timed step."""
    import datasets

    from hf_longctx.data import PackedCollator, load_sample_tokenizer, pack_documents, tokenize_documents

    datasets.disable_progress_bars()
    cache = tempfile.mkdtemp(prefix="bench_cache_")
    tok = load_sample_tokenizer()
    kind, seq_len = config["kind"], config["seq_len"]
    if kind == "streaming":
        stream = datasets.load_dataset("json", data_files=config["corpus"], split="train", streaming=True)
        start, cpu0 = time.perf_counter(), _cpu()
        tokens = sum(len(r["input_ids"]) for r in pack_documents(stream, tok, seq_len=seq_len))
        return {"seconds": time.perf_counter() - start, "cpu_seconds": _cpu() - cpu0, "tokens": tokens}
    if kind == "tokenize+pack":
        raw = datasets.load_dataset("json", data_files=config["corpus"], split="train", cache_dir=cache)
        start, cpu0 = time.perf_counter(), _cpu()
        docs = tokenize_documents(raw, tok, num_proc=config["num_proc"])
        mid = time.perf_counter()
        packed = pack_documents(docs, seq_len=seq_len, strategy=config["strategy"])
        end, cpu1 = time.perf_counter(), _cpu()
        tokens = sum(len(x) for x in packed["input_ids"]) if len(packed) < 10_000 else None
        return {"seconds": end - start, "cpu_seconds": cpu1 - cpu0, "tokenize_seconds": mid - start,
                "pack_seconds": end - mid, "tokens": tokens, "rows": len(packed)}
    shared = datasets.load_dataset("json", data_files=config["corpus"], split="train", cache_dir=config["shared_cache"])
    docs = tokenize_documents(shared, tok)  # tokenized once for all pack-only runs (not timed)
    datasets.disable_caching()  # the timed step below never reuses an earlier run's result
    if kind == "pack":
        start, cpu0 = time.perf_counter(), _cpu()
        packed = pack_documents(docs, seq_len=seq_len, strategy=config["strategy"])
        seconds, cpu_seconds = time.perf_counter() - start, _cpu() - cpu0
        filled = sum(len(x) for x in packed["input_ids"])
        return {"seconds": seconds, "cpu_seconds": cpu_seconds, "rows": len(packed),
                "fill_ratio": filled / (len(packed) * seq_len)}
    if kind == "collate":
        packed = pack_documents(docs, seq_len=seq_len)
        rows = [packed[i] for i in range(len(packed))]
        collate = PackedCollator()
        start, cpu0 = time.perf_counter(), _cpu()
        tokens = 0
        for i in range(0, len(rows) - 1, 2):
            tokens += collate(rows[i : i + 2])["input_ids"].shape[1]
        return {"seconds": time.perf_counter() - start, "cpu_seconds": _cpu() - cpu0, "tokens": tokens}
    raise ValueError(kind)


def run_isolated(config: dict, trials: int) -> dict:
    best = None
    for _ in range(trials):
        env = {**os.environ, **config.get("env", {})}
        out = subprocess.run([sys.executable, __file__, "--one", json.dumps(config)], check=True,
                             capture_output=True, text=True, env=env)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        if best is None or result["seconds"] < best["seconds"]:
            best = result
    return best


def machine() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()}-core CPU ({model or platform.processor() or 'unknown'}), no GPU"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=40, help="copies of the sample corpus")
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--write", default=None, help="markdown file to write (e.g. bench/packing.md)")
    p.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(json.loads(args.one))))
        return
    import datasets
    import tokenizers
    import torch
    import transformers

    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    work = Path(tempfile.mkdtemp(prefix="bench_packing_"))
    corpus = work / "corpus.jsonl"
    info = make_corpus(corpus, args.repeat)
    base = {"corpus": str(corpus), "strategy": "concat", "num_proc": None, "seq_len": 65536,
            "shared_cache": str(work / "shared_cache")}
    from hf_longctx.data import load_sample_tokenizer

    tok = load_sample_tokenizer()
    texts = [json.loads(x)["text"] for x in corpus.read_text().splitlines()[: info["documents"] // args.repeat]]
    total_tokens = args.repeat * sum(len(x) + 1 for x in tok([t for t in texts if t.strip()],
                                                               add_special_tokens=False)["input_ids"])
    rows = []

    def add(label, config, tokens=total_tokens):
        r = run_isolated({**base, **config}, args.trials)
        rows.append((label, config, r, tokens / r["seconds"]))
        print(f"{label}: {tokens / r['seconds'] / 1e6:.2f} M tokens/s  {r}", flush=True)

    for num_proc in (1, 2):
        add(f"tokenize + pack, num_proc={num_proc}", {"kind": "tokenize+pack", "num_proc": num_proc})
    for num_proc in (1, 2):
        add(f"tokenize + pack, num_proc={num_proc}, TOKENIZERS_PARALLELISM=false",
            {"kind": "tokenize+pack", "num_proc": num_proc, "env": {"TOKENIZERS_PARALLELISM": "false"}})
    add("streaming tokenize + pack (IterableDataset)", {"kind": "streaming"})
    for strategy in ("concat", "best_fit"):
        for seq_len in (4096, 65536):
            add(f"pack only ({strategy}, seq_len={seq_len})", {"kind": "pack", "strategy": strategy,
                                                              "seq_len": seq_len})
    add("PackedCollator, 2 rows of 8192 -> one 16K sequence", {"kind": "collate", "seq_len": 8192})

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    cmd = f"python scripts/bench_packing.py --repeat {args.repeat} --trials {args.trials}"
    lines = [
        "## Data pipeline: packing throughput",
        "",
        f"Date: {args.date}. Machine: {machine()}; load average {load0:.1f} before and {load:.1f} after the runs "
        f"(other work shared the machine). Command: `{cmd}`.",
        f"Versions: torch {torch.__version__}, transformers {transformers.__version__}, datasets "
        f"{datasets.__version__}, tokenizers {tokenizers.__version__}.",
        f"Corpus: the shipped sample corpus x {args.repeat} = {info['documents']:,} documents, "
        f"{info['bytes'] / 1e6:.1f} MB of JSON lines, {total_tokens:,} tokens with the {len(tok)}-token sample BPE "
        "(one EOS per document). Each row: best of "
        f"{args.trials} runs, each in a fresh process, never reading a cached result of the timed step "
        "(its cache writes included).",
        "",
        "| what | time (s) | M tokens/s | CPU use | notes |",
        "|---|---|---|---|---|",
    ]
    for label, _config, r, rate in rows:
        notes = []
        if "tokenize_seconds" in r:
            notes.append(f"tokenize {r['tokenize_seconds']:.2f} s + pack {r['pack_seconds']:.2f} s")
        if "fill_ratio" in r:
            notes.append(f"{r['rows']:,} rows, fill ratio {r['fill_ratio']:.4f}")
        use = r["cpu_seconds"] / r["seconds"] if r.get("cpu_seconds") is not None else float("nan")
        lines.append(f"| {label} | {r['seconds']:.2f} | {rate / 1e6:.2f} | {use:.2f} cores | {'; '.join(notes)} |")
    lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.write:
        Path(args.write).write_text(text)


if __name__ == "__main__":
    main()
