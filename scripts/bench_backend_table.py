"""Which backend when: every backend and ``auto`` on the ProLong, Pretrain and SFT mixes at W = 8, 16, 32, 64.

One command writes the table the README shows. Each W-rank group is emulated on this GPU with two link tiers
(NVLink inside nodes of ``--node-size`` GPUs, ``--inter-node-gbps`` per GPU between them); ``auto`` decides as the
product does, its shortlist's emulated steps standing in for the timing on a real group; the whole batch on this one
GPU is timed for real beside it (see :mod:`hf_longctx.lab.backend_table`). Rows on several real GPUs come from
``scripts/bench_attention.py --gpus N``.

    python scripts/bench_backend_table.py --out-md TABLE_MD --out-json T.jsonl  # GPU
    python scripts/bench_backend_table.py --quick                     # CPU smoke run: tiny sizes, reference kernel
    python scripts/bench_backend_table.py ... --readme README.md      # also replace the README's table
    python scripts/bench_backend_table.py --from-json A.jsonl B.jsonl --readme README.md  # the table of earlier runs

Cells run in order (mix, then W); none starts after ``--budget-s`` seconds, and those left out are named. Each
cell is written to ``--out-json`` as it finishes (a run stopped by a time limit keeps its cells), so one table can
be measured in parts (``--mixes``, ``--worlds``) and put together with ``--from-json``, by mix, then W.

Exit status: 0 when ``auto``'s choice is within ``--within`` of the best backend in every cell, 1 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
import time
from pathlib import Path

import torch

from hf_longctx.backends.auto import AutoOptions
from hf_longctx.backends.prediction import AttentionShape, measure_kernel_rates
from hf_longctx.benchmarking import portable_command, token_counts
from hf_longctx.lab.backend_table import MAX_CALLS, JsonLines, markdown, read_json, run_cell
from hf_longctx.lab.emulation import device_memory

README_START, README_END = "<!-- backend-table:start -->", "<!-- backend-table:end -->"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mixes", default="prolong,pretrain,sft")
    p.add_argument("--worlds", default="8,16,32,64")
    p.add_argument("--tokens-per-gpu", default="4k", help="tokens per rank: a cell of W ranks has W times as many")
    p.add_argument("--node-size", type=int, default=8, help="GPUs per node of the link model")
    p.add_argument("--inter-node-gbps", type=float, default=50.0, help="GB/s per GPU between nodes")
    p.add_argument("--kernel", default="auto")
    p.add_argument("--reps", type=int, default=1, help="timed emulated steps per backend (lower median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed emulated steps per backend")
    p.add_argument("--seed", type=int, default=0, help="which batch of each mix")
    p.add_argument("--max-calls", type=int, default=MAX_CALLS,
                   help="kernel calls per rank above which a backend auto does not shortlist is priced, not emulated")
    p.add_argument("--within", type=float, default=0.03, help="the exit status checks auto / best <= 1 + this")
    p.add_argument("--out-md", default=None, help="markdown file of the table")
    p.add_argument("--out-json", default=None, help="JSON lines: every cell with every backend's numbers (and the "
                   "run's meta line)")
    p.add_argument("--readme", default=None, help="replace the table between the README's backend-table markers")
    p.add_argument("--budget-s", type=float, default=float("inf"), help="start no cell after this many seconds")
    p.add_argument("--from-json", nargs="+", default=None, metavar="FILE",
                   help="no run: the table of cells earlier runs wrote with --out-json")
    p.add_argument("--quick", action="store_true", help="CPU smoke run: tiny sizes, reference kernel")
    args = p.parse_args(argv)
    if args.from_json:
        cells, metas = read_json(args.from_json)
        marks = metas[0]["marks"] + "".join(f" Also: `{m['command']}`." for m in metas[1:])
        return finish(args, cells, marks)

    if args.quick:
        device, dtype, shape = torch.device("cpu"), torch.float32, AttentionShape.of_dtype(4, 2, 16, torch.float32)
        args.kernel = "reference" if args.kernel == "auto" else args.kernel
        defaults = {"worlds": "4,8", "tokens_per_gpu": "64", "node_size": 4}
        for key, value in defaults.items():
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
    elif torch.cuda.is_available():
        device, dtype = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
        shape = AttentionShape.of_dtype(32, 8, 128, dtype)  # Llama-3-8B's attention
    else:
        print("bench_backend_table.py needs a CUDA device (or --quick for the CPU smoke run)", file=sys.stderr)
        return 2
    options = AutoOptions(node_size=args.node_size, inter_node_gbps=args.inter_node_gbps)
    per_gpu = token_counts(args.tokens_per_gpu)[0]
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    start = time.perf_counter()
    rates = measure_kernel_rates(args.kernel, device, shape, dtype)
    print(f"kernel rates ({args.kernel}, {gpu}): {rates.tile_head_s * 1e6:.3f} us per 128x128 tile and head, "
          f"{rates.call_s * 1e6:.1f} us per call", flush=True)
    date = datetime.date.today().isoformat()
    command = portable_command("scripts/bench_backend_table.py", sys.argv[1:] if argv is None else argv)
    marks = (f"Emulated on one {gpu} ({date}, kernel {args.kernel}, {per_gpu} tokens per GPU, two link tiers: "
             f"{options.tiers(64).describe()}); one GPU: the whole batch on that GPU, real. Forward+backward ms of "
             f"the step (slowest rank's kernels + slowest rank's transfers); bold: the best; `(p)`: priced, not "
             f"emulated. Command: `{command}`.")
    meta = {"date": date, "gpu": gpu, "kernel": args.kernel, "command": command, "tokens_per_gpu": per_gpu,
            "node_size": args.node_size, "inter_node_gbps": args.inter_node_gbps, "rates": vars(rates),
            "marks": marks}
    out = JsonLines(args.out_json, meta) if args.out_json else None
    cells, left_out = [], []
    for mix in args.mixes.split(","):
        for world in token_counts(args.worlds):
            if time.perf_counter() - start > args.budget_s:
                left_out.append(f"{mix} W={world}")
                continue
            began = time.perf_counter()
            cell = run_cell(mix, world, per_gpu * world, shape, dtype, device, rates, options, kernel=args.kernel,
                            reps=args.reps, warmup=args.warmup, seed=args.seed, max_calls=args.max_calls,
                            log=lambda line: print(line, flush=True))
            cells.append(cell.as_json())
            if out:
                out.cell(cells[-1])
            print(f"{mix} W={world}: auto -> {cell.auto.label} ({cell.auto_placement}), {cell.auto_ratio:.3f} of the "
                  f"best ({cell.best.candidate.label}); {time.perf_counter() - began:.0f} s; {device_memory(device)}",
                  flush=True)
    if left_out:
        print(f"left out (budget): {', '.join(left_out)}", flush=True)
    if out:
        out.close({"seconds": time.perf_counter() - start, "left_out": left_out})
    return finish(args, cells, marks)


def finish(args: argparse.Namespace, cells: list[dict], marks: str) -> int:
    """Print and write the table of ``cells``; the exit status says whether auto met ``--within`` everywhere."""
    table = markdown(cells, marks)
    print("\n" + table)
    if args.out_md:
        Path(args.out_md).write_text(table + "\n")
    if args.readme:
        readme = Path(args.readme)
        text = readme.read_text()
        if README_START not in text:
            print(f"{args.readme} has no {README_START} ... {README_END} block to replace", file=sys.stderr)
            return 2
        block = f"{README_START}\n{table}\n{README_END}"
        readme.write_text(re.sub(re.escape(README_START) + ".*?" + re.escape(README_END), lambda _: block, text,
                                 flags=re.S))
    if not cells:
        return 1
    worst = max(c["auto_ratio"] for c in cells)
    print(f"auto within {worst - 1:.1%} of the best in every cell ({len(cells)} cells)")
    return 0 if worst <= 1 + args.within else 1


if __name__ == "__main__":
    sys.exit(main())
