"""The key split's merge on one GPU: one Triton kernel against torch's index ops, alone and inside cut forwards.

    python scripts/bench_merge.py [--reps 20] [--calls DUMP.json,...]

Part 1 times ``merge_row_parts_`` alone on a server's cut rows (segments x rows x chunks, 32 heads of 128, bf16).
Part 2 times whole forward calls that torch_flash runs cut into chunks of their keys (the shapes of CAD servers'
calls at 64 ranks), with each merge. Medians of device time (CUDA events, the stream queued ahead); the ratio is
torch over Triton. Part 2 also times the first cut call of the launch model's profile five times in a row.
Part 3 (``--calls``: calls dumped by ``bench_emulated.py --dump-calls``) times every distinct forward call that the
key split's rule would cut with a lower ``min_shared`` than the one in force, whole and cut (Triton merge), binned
by the keys its segments' rows all share: where cutting starts to pay now that the merge is one kernel.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
from dataclasses import replace

import torch

from hf_longctx.backends.cad.call_profile import segment_batch, time_call_phases
from hf_longctx.benchmarking import timed
from hf_longctx.kernels import attention_forward, torch_flash
from hf_longctx.kernels.key_split import KeySplit, plan_key_split
from hf_longctx.kernels.merge import RowParts, merge_row_parts_

HEADS, KV_HEADS, HEAD_DIM, DTYPE, DEVICE = 32, 8, 128, torch.bfloat16, torch.device("cuda")
MERGES = (("triton", "1"), ("torch", "0"))  # HF_LONGCTX_MERGE_TRITON
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
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
