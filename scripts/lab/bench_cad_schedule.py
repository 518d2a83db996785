"""Host time of CAD's schedule on a measured cost model: one rank alone against the group pricing it together.

Every rank of a CAD group makes the same schedule when a batch's first attention layer needs it; on a measured cost
model most of that time is the refinement's pricing, which the ranks split (``hf_longctx.backends.cad.shared_pricing``).
This starts W gloo processes on this host's cores (one thread each, as ranks beside their GPUs would run), and per
mix times ``cad_schedule`` from cleared pricing caches twice on every rank: alone (each rank the whole schedule, what a
run did before) and together (the run's way), and checks that both give the same tasks. Prints one markdown row per
mix: the slowest rank's seconds each way and their ratio.

    python scripts/lab/bench_cad_schedule.py --model bench/logs/launch_model_placement_1xH200_2026-11-28.json \
        --worlds 8,16 --mixes sft:256k,prolong:256k,pretrain:512k

Host work: run it on the GPU machine's host (its CPU cores), not for a GPU figure. With ``--nccl`` every rank takes a
GPU and the collectives run over NCCL, as in a training run (W at most the GPUs of the machine).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hf_longctx.backends.cad.launch_cost import LaunchCostModel, clear_pricing_caches
from hf_longctx.backends.cad.runtime import cad_schedule, server_costs
from hf_longctx.backends.cad.shared_pricing import PricingShare
from hf_longctx.benchmarking import free_port, table_header, table_row, token_counts
from hf_longctx.lab.emulation.workloads import doc_lengths
from hf_longctx.layout import PackedBatch, shard_plan


def timed_schedule(batch: PackedBatch, world: int, options: dict, share: PricingShare | None):
    """(seconds, tasks) of one schedule of a fresh plan from cleared pricing caches."""
    clear_pricing_caches()
    plan = shard_plan(batch, world, "cad")
    start = time.perf_counter()
    tasks = cad_schedule(plan, options, share).tasks
    return time.perf_counter() - start, tasks, plan


def worker(rank: int, world: int, port: int, args) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    if args.nccl:  # one GPU per rank: the share's all_reduce runs on the device, as in a training run
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if args.nccl else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=1800))
    options = {"cost_model": LaunchCostModel.load(args.model), "eps": args.eps}
    mix, tokens = args.mixes[0].split(":")  # untimed: the first timed schedule should not pay for a cold process
    timed_schedule(PackedBatch.from_doc_lens(doc_lengths(mix, token_counts(tokens)[0], seed=99)), world, options,
                   PricingShare(None, rank, world))
    for spec in args.mixes:
        mix, tokens = spec.split(":")
        for seed in args.seeds:
            batch = PackedBatch.from_doc_lens(doc_lengths(mix, token_counts(tokens)[0], seed=seed))
            dist.barrier()
            alone_s, alone, _ = timed_schedule(batch, world, options, None)
            dist.barrier()
            together_s, together, plan = timed_schedule(batch, world, options, PricingShare(None, rank, world))
            device = torch.device("cuda", rank) if args.nccl else torch.device("cpu")
            times = torch.tensor([alone_s, together_s], dtype=torch.float64, device=device)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            same = torch.tensor([float(alone == together)], device=device)
            dist.all_reduce(same, op=dist.ReduceOp.MIN)
            if rank == 0:
                costs = server_costs(plan, options)  # of the schedule just made (cached on the plan)
                print(table_row([mix, tokens, seed, world, len(batch.doc_lens), f"{times[0]:.2f}", f"{times[1]:.2f}",
                                 f"**{times[0] / times[1]:.1f}**", "yes" if same.item() == 1.0 else "NO",
                                 f"{costs.max() / costs.mean():.4f}"]), flush=True)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a LaunchCostModel JSON (scripts/lab/profile_cad.py writes one)")
    p.add_argument("--worlds", type=token_counts, default=[8])
    p.add_argument("--mixes", type=lambda s: s.split(","), default=["sft:256k", "prolong:256k", "pretrain:512k"],
                   help="mix:tokens of each batch (tokens over the whole group)")
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0])
    p.add_argument("--eps", type=float, default=0.01)
    p.add_argument("--nccl", action="store_true",
                   help="one GPU per rank and NCCL for the collectives (W at most the GPUs here), as a training run")
    args = p.parse_args(argv)
    if args.nccl and (not torch.cuda.is_available() or max(args.worlds) > torch.cuda.device_count()):
        p.error(f"--nccl needs a GPU per rank: {torch.cuda.device_count()} here, W up to {max(args.worlds)} asked")
    print(f"host: {os.cpu_count()} CPUs, torch {torch.__version__}; model {args.model}; eps {args.eps}; "
          f"collectives: {'NCCL' if args.nccl else 'gloo'}")
    print(table_header(["mix", "tokens", "seed", "W", "documents", "alone s (slowest rank)",
                        "together s (slowest rank)", "alone / together", "same tasks", "predicted max/mean"]))
    for world in args.worlds:
        mp.spawn(worker, args=(world, free_port(), args), nprocs=world, join=True)


if __name__ == "__main__":
    sys.exit(main())
