"""Compare how the weights are held beside sequence parallelism: DDP, FSDP2 and DeepSpeed ZeRO-3.

On the GPU machine (NCCL, one process per GPU), the Llama-3-8B shape at 128K-512K tokens of context::

    python scripts/bench_sharding.py                                   # 2, 4, 8 GPUs (those present), 128K-512K
    python scripts/bench_sharding.py --gpus 2 4 --contexts 131072 --layers 8
    python scripts/bench_sharding.py --quick                           # smoke run: tiny model, CPU/gloo when no GPU

Every cell is one ``scripts/bench_train.py`` measurement in a fresh process (so an out-of-memory
error leaves nothing behind and is reported as such): the whole context is one sequence-parallel
group over all GPUs (``--seq`` = context / GPUs), packed ProLong-mix documents, recompute-aware
checkpointing, the tiled loss; ``ddp`` keeps the weights, gradients and AdamW states on every GPU
(gradients all-reduced), ``fsdp2`` shards all three with ``fully_shard`` per decoder layer
(``--fsdp``), ``zero3`` with DeepSpeed (``--zero 3``, needs the ``deepspeed`` extra). Prints tokens/s
and peak memory per GPU per cell, and a table; ``--json-out`` keeps every result. Any further option
(``--offload``, ``--tiled-mlp 16384``, ``--backend cad``, ``--kernel fa4``) goes to every measurement.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from hf_longctx.benchmarking import table_header, table_row

BENCH_TRAIN = Path(__file__).with_name("bench_train.py")
SHARDINGS = {"ddp": [], "fsdp2": ["--fsdp"], "zero3": ["--zero", "3"]}


def measure(gpus: int, context: int, sharding: str, args, extra: list[str], out: Path) -> dict:
    """One bench_train.py run; {"error": ...} when it ran out of memory or failed."""
    cmd = [sys.executable, str(BENCH_TRAIN), "--gpus", str(gpus), "--seq", str(context // gpus),
           "--layers", str(args.layers), "--steps", str(args.steps), "--backend", args.backend,
           "--tiled-loss", str(args.tiled_loss), "--json-out", str(out), *SHARDINGS[sharding], *extra]
    if args.quick:
        cmd.append("--quick")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode == 0 and out.exists():
        return json.loads(out.read_text())
    text = proc.stdout + proc.stderr
    oom = "out of memory" in text.lower() or "OutOfMemoryError" in text
    return {"error": "out of memory" if oom else text.strip().splitlines()[-1][:200] if text.strip() else "failed"}


def row(gpus: int, context: int, sharding: str, r: dict) -> str:
    if "error" in r:
        return table_row([sharding, gpus, f"{context // 1024}K", None, None, None, r["error"]])
    mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else None
    return table_row([sharding, gpus, f"{context // 1024}K", f"{r['tokens_per_s']:.0f}", mfu,
                      f"{r['peak_gib']:.1f}", f"{r['step_s']:.2f} s/step"])


HEADER = table_header(["weights", "GPUs", "context", "tokens/s", "MFU", "peak GiB/GPU", "note"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    present = torch.cuda.device_count()
    p.add_argument("--gpus", type=int, nargs="+", default=[g for g in (2, 4, 8) if g <= max(present, 2)],
                   help="GPU counts to compare (default: 2, 4, 8 where present)")
    p.add_argument("--contexts", type=int, nargs="+", default=[131072, 262144, 524288],
                   help="tokens of context per sequence-parallel group (all GPUs)")
    p.add_argument("--shardings", nargs="+", default=list(SHARDINGS), choices=list(SHARDINGS))
    p.add_argument("--layers", type=int, default=32, help="decoder layers of the 8B shape (32: the whole model)")
    p.add_argument("--backend", default="zigzag")
    p.add_argument("--tiled-loss", type=int, default=8192, help="tokens per loss chunk (a 128K vocabulary)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json-out", default=None)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model, 2 processes, 4K and 8K tokens")
    args, extra = p.parse_known_args()
    if args.quick:
        args.gpus, args.contexts, args.layers, args.steps = [2], [4096, 8192], 2, 2
        args.shardings = [s for s in args.shardings if s != "zero3" or _has_deepspeed()]
    results = []
    print(HEADER, flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        for gpus in args.gpus:
            for context in args.contexts:
                for sharding in args.shardings:
                    cell = Path(scratch) / f"{sharding}-{gpus}-{context}.json"
                    r = measure(gpus, context, sharding, args, extra, cell)
                    results.append({"sharding": sharding, "gpus": gpus, "context": context, **r})
                    print(row(gpus, context, sharding, r), flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    return 0


def _has_deepspeed() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


if __name__ == "__main__":
    sys.exit(main())
