"""The merges of partial attention results on one GPU: one Triton kernel against torch, alone and inside steps.

    python scripts/bench_merge.py [--reps 20] [--calls DUMP.json,...] [--steps sft:256k:4,...]

Part 1 times ``merge_row_parts_`` alone on a server's cut rows (segments x rows x chunks, 32 heads of 128, bf16).
Part 2 times whole forward calls that torch_flash runs cut into chunks of their keys (the shapes of CAD servers'
calls at 64 ranks), with each merge. Medians of device time (CUDA events, the stream queued ahead); the ratio is
torch over Triton. Part 2 also times the first cut call of the launch model's profile five times in a row.
Part 3 (``--calls``: calls dumped by ``bench_emulated.py --dump-calls``) times every distinct forward call that the
key split's rule would cut with a lower ``min_shared`` than the one in force, whole and cut (Triton merge), binned
by the keys its segments' rows all share: where cutting starts to pay now that the merge is one kernel.
Part 4 times the running merge of the ring-style backends (``PartialAccumulator.add``: a step's or a helper's
partial result into a block of the accumulator) alone, and with ``--steps MIX:TOKENS:W`` whole emulated
forward+backward steps of ring, zigzag, distfa, tasp and cad (``--step-backends``; every rank's work on the one GPU,
wall time), with the Triton row kernels (the merges, CAD's segment gather and return) and with torch's, alternating
run by run.
Part 5 (``--returns-only`` for it alone) times CAD's return of key gradients alone (``GatherPlan.fill_returns``: bf16
segment rows summed into fp32 local rows and the send buffer of 4 emulated ranks' rows, read with repeats): the
fixed-order Triton kernel against torch's row ops.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import time
from dataclasses import replace

import torch

from hf_longctx.benchmarking import timed, token_counts
from hf_longctx.comm import GatherPlan
from hf_longctx.kernels import attention_forward, torch_flash
from hf_longctx.kernels.key_split import KeySplit, plan_key_split
from hf_longctx.kernels.merge import PartialAccumulator, RowParts, merge_row_parts_
from hf_longctx.lab.cad.call_profile import segment_batch, time_call_phases
from hf_longctx.lab.emulation import emulate_step
from hf_longctx.lab.emulation.workloads import doc_lengths
from hf_longctx.layout import PackedBatch

HEADS, KV_HEADS, HEAD_DIM, DTYPE, DEVICE = 32, 8, 128, torch.bfloat16, torch.device("cuda")
MERGES = (("triton", "1"), ("torch", "0"))  # HF_LONGCTX_MERGE_TRITON (and, in part 4, HF_LONGCTX_GATHER_TRITON)
ALONE = [(1, 128, 8), (1, 512, 4), (3, 256, 8), (4, 512, 8), (8, 1024, 4)]  # (segments, rows, chunks)
CALLS = [[(128, 112000)], [(256, 129718)], [(1088, 110145)], [(506, 90000), (506, 84000), (320, 107000)],
         [(384, 60000), (200, 45000), (640, 3000)]]  # (rows, keys) of cut forward calls


def _ms(fn, reps: int, ahead: bool = True) -> float:
    """Median ms of ``fn``: device time with the stream queued ahead (what a step that runs ahead of its device
    pays, and what the emulation times), or with ``ahead`` False as launched alone (the host's work between
    launches included)."""
    return timed(fn, reps, warmup=3, ahead=ahead)


def merge_alone(segments: int, rows: int, chunks: int, reps: int) -> dict[str, float]:
    g = torch.Generator(device="cuda").manual_seed(0)
    total = segments * rows
    out = torch.randn(total, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g)
    lse = torch.randn(HEADS, total, device="cuda", generator=g)
    part_out = torch.randn(total * chunks, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g)
    part_lse = torch.randn(HEADS, total * chunks, device="cuda", generator=g)
    parts = RowParts.of_blocks([(s * rows, rows, s * rows * chunks, chunks) for s in range(segments)])
    times = {}
    for name, flag in MERGES:
        os.environ["HF_LONGCTX_MERGE_TRITON"] = flag
        times[name] = _ms(lambda: merge_row_parts_(out, lse, parts, part_out, part_lse, include_self=True), reps)
    return times


SHARED_BINS = (4096, 8192, 16384, 24576, 32768)  # part 3's bins of shared keys (the longest of a call's segments)


def _shared(call: dict) -> int:
    return max(k - (q if call["causal"] else 0) for q, k in zip(call["q_lens"], call["k_lens"]) if q > 0)


def cut_sweep(paths: list[str], split: KeySplit, reps: int) -> None:
    """Part 3: dumped forward calls cut under ``min_shared`` of the lowest bin and not under that of the highest."""
    calls = {}
    for path in paths:
        for call in json.loads(open(path).read())["reps"][0]:
            if call["phase"] == "forward" and any(q > 0 for q in call["q_lens"]):
                calls[(tuple(call["q_lens"]), tuple(call["k_lens"]), call["causal"])] = call
    low, split = replace(split, min_shared=SHARED_BINS[0]), replace(split, min_shared=SHARED_BINS[-1])
    rows = []
    for (q_lens, k_lens, causal), call in sorted(calls.items()):
        if plan_key_split(q_lens, k_lens, HEADS, split, causal) is not None \
                or plan_key_split(q_lens, k_lens, HEADS, low, causal) is None:
            continue
        cu_q, cu_k, max_q, max_k, q, k, v = segment_batch(list(zip(q_lens, k_lens)), HEADS, KV_HEADS, HEAD_DIM,
                                                          DTYPE, DEVICE, 0)
        args = (q, k, v, cu_q, cu_k, max_q, max_k)
        whole, cut = (functools.partial(attention_forward, *args, causal=causal, kernel="torch_flash", key_split=s)
                      for s in (None, low))
        rows.append((_shared(call), _ms(whole, reps), _ms(cut, reps), _ms(whole, reps, False), _ms(cut, reps, False)))
    print(f"\n| shared keys (calls cut at min_shared {SHARED_BINS[0]}, whole under {split.min_shared}) | calls | "
          "whole ms | cut ms | cut / whole, all | median | worst | as launched alone: cut / whole, all |")
    print("|---|---|---|---|---|---|---|---|")
    for lo, hi in zip(SHARED_BINS, SHARED_BINS[1:] + (1 << 40,)):
        got = [r for r in rows if lo <= r[0] < hi]
        if got:
            ratios = sorted(r[2] / r[1] for r in got)
            whole, cut = (sum(r[i] for r in got) for i in (1, 2))
            alone = sum(r[4] for r in got) / sum(r[3] for r in got)
            print(f"| {lo}-{hi if hi < 1 << 40 else ''} | {len(got)} | {whole:.2f} | {cut:.2f} | {cut / whole:.3f} | "
                  f"{statistics.median(ratios):.3f} | {ratios[-1]:.3f} | {alone:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--calls", default=None, help="comma-separated call dumps of bench_emulated.py for part 3")
    parser.add_argument("--steps", default=None, metavar="MIX:TOKENS:W,...",
                        help="part 4: emulated steps of every backend, e.g. sft:256k:4,prolong:256k:4")
    parser.add_argument("--steps-only", action="store_true", help="only the emulated steps of --steps")
    parser.add_argument("--as-is", action="store_true",
                        help="time the steps with the environment as it is (no toggling), one JSON line per step: "
                             "what scripts/bench_step_versions.sh compares between two versions of the package")
    parser.add_argument("--returns-only", action="store_true", help="only part 5: CAD's return of key gradients")
    parser.add_argument("--step-backends", default=",".join(STEP_BACKENDS),
                        help="the backends of the emulated steps (default: %(default)s)")
    args = parser.parse_args()
    backends = tuple(b for b in args.step_backends.split(",") if b)
    unknown = sorted(set(backends) - set(STEP_BACKENDS))
    if unknown:
        parser.error(f"--step-backends: {', '.join(unknown)} not among {', '.join(STEP_BACKENDS)}")
    if args.returns_only:
        returns_alone(args.reps)
        return
    if args.steps_only:
        for mix, tokens, world in step_specs(args.steps):
            emulated_steps(mix, tokens, world, as_is=args.as_is, backends=backends)
        return
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, {HEADS} heads of {HEAD_DIM}\n")
    print("| merge alone: segments x rows x chunks | triton ms | torch ms | torch / triton |\n|---|---|---|---|")
    for segments, rows, chunks in ALONE:
        t = merge_alone(segments, rows, chunks, args.reps)
        print(f"| {segments} x {rows} x {chunks} | {t['triton']:.4f} | {t['torch']:.4f} | "
              f"{t['torch'] / t['triton']:.2f} |")
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    split = KeySplit.for_grid(replace(torch_flash.launch_grid(HEAD_DIM), slots=sms))
    print("\n| cut forward: (rows, keys) | cut segments | triton ms | torch ms | torch / triton |")
    print("|---|---|---|---|---|")
    for shapes in CALLS:
        cuts = plan_key_split([q for q, _ in shapes], [k for _, k in shapes], HEADS, split)
        times = {}
        for name, flag in MERGES:
            os.environ["HF_LONGCTX_MERGE_TRITON"] = flag
            times[name], _ = time_call_phases(shapes, "torch_flash", HEADS, KV_HEADS, HEAD_DIM, DTYPE, DEVICE,
                                              warmup=2, reps=args.reps, key_split=split)
        cut = "whole" if cuts is None else sum(bool(c) for c in cuts)
        print(f"| {shapes} | {cut} | {times['triton']:.3f} | {times['torch']:.3f} | "
              f"{times['torch'] / times['triton']:.3f} |")
    os.environ.pop("HF_LONGCTX_MERGE_TRITON")
    first = [(128, 36000)]  # the first cut call of the profile, which once took the whole call's time there
    runs = [time_call_phases(first, "torch_flash", HEADS, KV_HEADS, HEAD_DIM, DTYPE, DEVICE, warmup=1, reps=5,
                             key_split=key)[0] for key in (None, split, split, split)]
    print(f"\n{first} forward ms: whole {runs[0]:.3f}, cut " + ", ".join(f"{t:.3f}" for t in runs[1:]))
    if args.calls:
        cut_sweep(args.calls.split(","), split, max(5, args.reps // 2))
    accumulate_alone(args.reps)
    returns_alone(args.reps)
    for mix, tokens, world in step_specs(args.steps):
        emulated_steps(mix, tokens, world, backends=backends)


def step_specs(text: str | None) -> list[tuple[str, int, int]]:
    """``"sft:256k:4,pretrain:256k:4"`` -> [(mix, tokens, W), ...]."""
    specs = []
    for spec in (text.split(",") if text else []):
        mix, tokens, world = spec.split(":")
        specs.append((mix, token_counts(tokens)[0], int(world)))
    return specs


ACCUMULATE = [(65536, 4096), (65536, 16384), (65536, 65536)]  # (accumulator rows, rows merged into it)
STEP_BACKENDS = ("ring", "zigzag", "distfa", "tasp", "cad")


def _triton_then_torch(fn) -> dict[str, float]:
    """``fn()`` with the Triton merges, gather and return, then with torch's: {implementation: its result}."""
    times = {}
    for name, flag in MERGES:
        os.environ["HF_LONGCTX_MERGE_TRITON"] = os.environ["HF_LONGCTX_GATHER_TRITON"] = flag
        times[name] = fn()
    os.environ.pop("HF_LONGCTX_MERGE_TRITON")
    os.environ.pop("HF_LONGCTX_GATHER_TRITON")
    return times


def accumulate_alone(reps: int) -> None:
    print("\n| running merge: accumulator rows, merged rows | triton ms | torch ms | torch / triton |")
    print("|---|---|---|---|")
    for total, rows in ACCUMULATE:
        acc = PartialAccumulator(total, HEADS, HEAD_DIM, DTYPE, DEVICE)
        out = torch.randn(rows, HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
        lse = torch.randn(HEADS, rows, device=DEVICE)
        add = functools.partial(acc.add, total - rows, out, lse)
        t = _triton_then_torch(lambda add=add: timed(add, reps, warmup=3, ahead=True))
        print(f"| {total}, {rows} | {t['triton']:.3f} | {t['torch']:.3f} | {t['torch'] / t['triton']:.2f} |")


# (rows per rank, runs per reader, longest run, KV heads): readers of 4 ranks read runs of rows, overlapping
RETURNS = [(65536, 40, 8192, 8), (65536, 400, 1024, 8), (16384, 40, 4096, 32)]


def returns_alone(reps: int) -> None:
    """Part 5: one rank's return of k and v gradients (bf16 segment rows into fp32), Triton against torch."""
    print("\n| return of dk, dv: rows per rank, runs, longest run, KV heads | segment rows (per distinct row) "
          "| triton ms | torch ms | torch / triton |\n|---|---|---|---|---|")
    rng = random.Random(0)
    for rows_per_rank, runs_per_reader, longest, kv_heads in RETURNS:
        rows = [rows_per_rank] * 4
        runs = [[] for _ in rows]
        for reader in runs:
            for _ in range(runs_per_reader):
                holder = rng.randrange(len(rows))
                start = rng.randrange(rows[holder] - 1)
                reader.append((holder, start, min(rows[holder], start + rng.randint(1, longest))))
        plan = GatherPlan(runs, 0, rows).to(DEVICE)
        g = torch.Generator(device=DEVICE).manual_seed(0)
        grads = [torch.randn(plan.segment_rows, kv_heads, HEAD_DIM, generator=g, device=DEVICE, dtype=DTYPE)
                 for _ in range(2)]
        held = [torch.zeros(rows[0], kv_heads, HEAD_DIM, device=DEVICE) for _ in range(2)]
        fill = functools.partial(plan.fill_returns, grads, held, True)
        t = _triton_then_torch(lambda fill=fill: timed(fill, reps, warmup=3, ahead=True))
        per_row = plan.segment_rows / plan.return_sums[0].shape[0]
        print(f"| {rows_per_rank}, {runs_per_reader}, {longest}, {kv_heads} | {plan.segment_rows} ({per_row:.2f}) | "
              f"{t['triton']:.3f} | {t['torch']:.3f} | {t['torch'] / t['triton']:.2f} |", flush=True)


def emulated_steps(mix: str, tokens: int, world: int, runs: int = 5, as_is: bool = False,
                   backends: tuple[str, ...] = STEP_BACKENDS) -> None:
    """Wall ms of whole emulated steps (all ``world`` ranks' forward+backward, one after another on the one GPU),
    the median of ``runs``, the Triton row kernels and torch's alternating so that the device's state drifts alike
    for both; ``as_is``:
    with the environment's kernels only, one JSON line per backend."""
    batch = PackedBatch.from_doc_lens(doc_lengths(mix, tokens, seed=0))
    g = torch.Generator(device=DEVICE).manual_seed(0)
    tensors = tuple(torch.randn(tokens, h, HEAD_DIM, generator=g, device=DEVICE, dtype=DTYPE)
                    for h in (HEADS, KV_HEADS, KV_HEADS, HEADS))
    if not as_is:
        print(f"\n| {mix} {tokens // 1024}K, W = {world}: emulated step | triton ms | torch ms | torch / triton |")
        print("|---|---|---|---|")

    def step_ms(backend: str) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        emulate_step(batch, world, tensors, backend, kernel="torch_flash")
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3

    for backend in backends:
        if as_is:
            step_ms(backend)  # warm: kernels compiled, plans cached
            ms = statistics.median(step_ms(backend) for _ in range(runs))
            print(json.dumps({"mix": mix, "tokens": tokens, "world": world, "backend": backend, "ms": ms}), flush=True)
            continue
        _triton_then_torch(lambda b=backend: step_ms(b))  # warm: kernels compiled, plans cached
        samples: dict[str, list[float]] = {name: [] for name, _ in MERGES}
        for _ in range(runs):
            for name, value in _triton_then_torch(lambda b=backend: step_ms(b)).items():
                samples[name].append(value)
        t = {name: statistics.median(v) for name, v in samples.items()}
        print(f"| {backend} | {t['triton']:.1f} | {t['torch']:.1f} | {t['torch'] / t['triton']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
