"""Side by side with the peers on one GPU: the same model, the same packed batch, the same tokens per GPU.

One command trains a Llama-3-8B-shaped model (random bf16 weights, AdamW) for a few steps on one packed row of
``--seq`` tokens from a ProLong-style length mix with each system, each in a process of its own, and prints one
JSON line per system and a markdown table::

    python scripts/bench_peers.py --seq 131072                      # all systems, 128K tokens, 32 layers
    python scripts/bench_peers.py --seq 131072 --search             # and the longest context each one trains
    python scripts/bench_peers.py --tiny --seq 256 --steps 2        # plumbing on a CPU, seconds

How each system is configured, and from which public source (details in ``hf_longctx/lab/peers/``):

- ``hf_longctx``: this package as ``scripts/bench_train.py --gpus 1 --backend local --memory auto`` trains it:
  ``longctx_local`` attention with the best installed kernel, the memory planner's checkpointing, offload,
  tiling, Liger ops and optimizer placement (``lab/peers/longctx.py``).
- ``alst``: ALST as Snowflake's ArcticTraining one-GPU recipes set it
  (``projects/sequence-parallelism/run-h100-sp1-llama-8b.yml``, ``run-h200-sp1-llama-8b-liger-offload-tiled-mlp.yml``,
  April 2026; the ALST paper, arXiv 2506.13996): accelerate 1.15's ``ParallelismConfig(sp_size=1,
  sp_backend="deepspeed")`` (DeepSpeed's ``UlyssesSPAttentionHF`` is registered only for ``sp_size > 1``), DeepSpeed
  0.19.8 ZeRO-3 with optimizer and parameter offload to the CPU and its CPU Adam, ``TiledMLP``, activation
  checkpoints offloaded to the host, Liger (RMSNorm, RoPE, fused linear cross-entropy) or else DeepSpeed's
  ``TiledFusedLogitsLoss`` (``lab/peers/alst.py``).
- ``trl_cp``: accelerate / TRL context parallelism as TRL 1.16's guide sets it ("Distributing Training", Ring
  Attention (FSDP2), and ``examples/accelerate_configs/context_parallel_2gpu.yaml``): ``SFTTrainer`` with
  ``ParallelismConfig(cp_size=1)`` (one GPU), FSDP2 with activation checkpointing, SDPA, Liger's layer kernels,
  TRL's chunked loss, ``activation_offloading=True`` (``lab/peers/torch_cp.py``).
- ``transformers``: transformers 5.17's ``Trainer`` with ``flash_attention_2`` if installed else SDPA,
  ``gradient_checkpointing=True`` and ``use_liger_kernel=True`` (``lab/peers/plain.py``).

Peers on SDPA get one causal row without transformers' dense document mask (``--sdpa-mask causal``, as
ArcticTraining does for SDPA; ``packed`` keeps the mask): their documents see each other, and their results say
``document_masking: false``. MFU is one formula for all: 6 x matmul parameters per token plus the attention of
the pairs inside documents, over the GPU's dense bf16 peak (``hf_longctx.benchmarking``), and the same with one
more forward of every decoder layer (``mfu_with_recompute``). Step time: the median of ``--steps`` timed steps
after ``--warmup`` untimed ones. Peaks: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` over the
timed steps, and the host's resident high-water mark of the system's process tree; ``--warmup`` is at least 1
for a real model, since a first step may run before the optimizer's states exist. ``--search`` finds, for each
system, the longest context that trains a second step (doubling from ``--search-start``, then bisection to
``--granularity``; each attempt a process with ``--timeout``). The peers' packages: ``pip install -e ".[peers]"``,
or ``make wheels-peers`` for a machine without network.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from hf_longctx.benchmarking import token_counts
from hf_longctx.lab.peers.runner import markdown_table, run_system, search_longest, search_workload
from hf_longctx.lab.peers.worker import SYSTEMS
from hf_longctx.lab.peers.workload import LLAMA3_8B_LAYERS, Workload


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    p.add_argument("--seq", default="131072", help="tokens per GPU (one packed row), e.g. 131072 or 128K")
    p.add_argument("--steps", type=int, default=3, help="timed steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--layers", type=int, default=None, help=f"decoder layers (default {LLAMA3_8B_LAYERS}; fewer for "
                                                            "smoke runs)")
    p.add_argument("--tiny", action="store_true", help="a tiny random config (hidden 64) that runs on a CPU")
    p.add_argument("--mix", default="prolong", help="document-length mix: prolong, pretrain, or one")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sdpa-mask", default="causal", choices=["causal", "packed"],
                   help="peers on SDPA: one causal row (documents not masked) or transformers' dense document mask")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for one system's process")
    p.add_argument("--search", action="store_true",
                   help="also find each system's longest context (the longest where a second step trains)")
    p.add_argument("--search-start", default=None, help="first length of the search (default --seq)")
    p.add_argument("--search-max", default="4194304", help="longest length the search tries")
    p.add_argument("--granularity", default="16384", help="the search stops when it knows the answer this closely")
    p.add_argument("--out", default=None, help="append every JSON line (results, then searches) to this file")
    args = p.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown or not systems:
        p.error(f"--systems: unknown {unknown}; choose from {', '.join(SYSTEMS)}")
    args.systems = systems
    (args.seq,), (args.search_max,), (args.granularity,) = (token_counts(args.seq), token_counts(args.search_max),
                                                            token_counts(args.granularity))
    args.search_start = token_counts(args.search_start)[0] if args.search_start else args.seq
    if args.steps < 1 or args.warmup < 0 or args.seq < 2:
        p.error("need --steps >= 1, --warmup >= 0 and --seq >= 2")
    if args.warmup < 1 and not args.tiny:
        p.error("--warmup must be at least 1 for a real model: a system's first step can run before its optimizer "
                "states exist (the Trainer's AdamW allocates them in its first step), so that step's memory and "
                "time are not a training step's")
    if args.layers is None:
        args.layers = 2 if args.tiny else LLAMA3_8B_LAYERS
    return args


def emit(record: dict, out: Path | None) -> None:
    """One JSON line on stdout, and appended to ``out``."""
    line = json.dumps(record)
    print(line, flush=True)
    if out is not None:
        with out.open("a") as f:
            f.write(line + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out) if args.out else None
    work = Workload(seq=args.seq, layers=args.layers, tiny=args.tiny, mix=args.mix, seed=args.seed, steps=args.steps,
                    warmup=args.warmup, sdpa_mask=args.sdpa_mask)
    results = []
    for system in args.systems:
        result = run_system(system, work, args.timeout)
        emit(result, out)
        results.append(result)
    longest: dict[str, int] = {}
    if args.search:
        for system in args.systems:
            found = search_longest(system, lambda seq, s=system: run_system(s, search_workload(work, seq),
                                                                            args.timeout),
                                   args.search_start, args.search_max, args.granularity)
            longest[system] = found.longest
            emit({"search": system, "longest": found.longest, "failed_at": found.failed_at,
                  "attempts": [{"seq": a["seq"], "ok": a["ok"], "error": a["error"] and
                                {k: a["error"].get(k) for k in ("type", "message", "out_of_memory")}}
                               for a in found.attempts]}, out)
    command = " ".join(["python", "scripts/bench_peers.py", *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
    print(f"\n{command}\n")
    print(markdown_table(results, longest))
    for r in results:
        if r.get("error"):
            e = r["error"]
            print(f"\n{r['system']} failed: {e['type']}: {e['message']}")
            print("\n".join("    " + line for line in e.get("last_lines", [])[-6:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
