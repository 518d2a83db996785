"""The key split's merge on one GPU: one Triton kernel against torch's index ops, alone and inside cut forwards.

    python scripts/bench_merge.py [--reps 20]

Part 1 times ``merge_row_parts_`` alone on a server's cut rows (segments x rows x chunks, 32 heads of 128, bf16).
Part 2 times whole forward calls that torch_flash runs cut into chunks of their keys (the shapes of CAD servers'
calls at 64 ranks), with each merge. Medians of CUDA-event timings; the ratio is torch over Triton.
"""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import replace

import torch

from hf_longctx.backends.cad.call_profile import time_call_phases
from hf_longctx.kernels import torch_flash
from hf_longctx.kernels.key_split import KeySplit, plan_key_split
from hf_longctx.kernels.merge import RowParts, merge_row_parts_

HEADS, KV_HEADS, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16
MERGES = (("triton", "1"), ("torch", "0"))  # HF_LONGCTX_MERGE_TRITON
ALONE = [(1, 128, 8), (1, 512, 4), (3, 256, 8), (4, 512, 8), (8, 1024, 4)]  # (segments, rows, chunks)
CALLS = [[(128, 112000)], [(256, 129718)], [(1088, 110145)], [(506, 90000), (506, 84000), (320, 107000)],
         [(384, 60000), (200, 45000), (640, 3000)]]  # (rows, keys) of cut forward calls


def _ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, {HEADS} heads of {HEAD_DIM}\n")
    print("| merge alone: segments x rows x chunks | triton ms | torch ms | torch / triton |\n|---|---|---|---|")
    for segments, rows, chunks in ALONE:
        t = merge_alone(segments, rows, chunks, args.reps)
        print(f"| {segments} x {rows} x {chunks} | {t['triton']:.4f} | {t['torch']:.4f} | "
              f"{t['torch'] / t['triton']:.2f} |")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    split = KeySplit.for_grid(replace(torch_flash.launch_grid(HEAD_DIM), slots=sms))
    print("\n| cut forward: (rows, keys) | cut segments | triton ms | torch ms | torch / triton |\n|---|---|---|---|---|")
    for shapes in CALLS:
        cuts = plan_key_split([q for q, _ in shapes], [k for _, k in shapes], HEADS, split)
        times = {}
        for name, flag in MERGES:
            os.environ["HF_LONGCTX_MERGE_TRITON"] = flag
            times[name], _ = time_call_phases(shapes, "torch_flash", HEADS, KV_HEADS, HEAD_DIM, DTYPE, device,
                                              warmup=2, reps=args.reps, key_split=split)
        cut = "whole" if cuts is None else sum(bool(c) for c in cuts)
        print(f"| {shapes} | {cut} | {times['triton']:.3f} | {times['torch']:.3f} | "
              f"{times['torch'] / times['triton']:.3f} |")
    os.environ.pop("HF_LONGCTX_MERGE_TRITON")


if __name__ == "__main__":
    main()
