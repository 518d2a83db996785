"""Packed-document attention kernels on one GPU: fwd and fwd+bwd TFLOP/s on long-document mixes.

    python scripts/bench_kernels.py                     # the whole comparison, one call
    python scripts/bench_kernels.py --quick             # tiny sizes, any device (smoke run)

Workloads: the ProLong and Pretrain length mixes (hf_longctx.data.synthetic_lengths) at 64K..512K
tokens and single documents of 64K and 256K; H=32 query heads, 8 KV heads, D=128, bf16, causal per
document. Columns: every kernel that serves the input (fa4, cudnn_varlen, cudnn, torch_flash) and
``auto``; each cell is forward / forward+backward TFLOP/s (causal FLOPs 2*L^2*H*D per document,
x3.5 for forward+backward), the backward run from the forward's out and lse. First-call seconds
(compile or graph build) are printed per kernel, and FlashAttention-4's compile count.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from hf_longctx.benchmarking import attention_tflops, causal_attention_flops, first_call_seconds, table_header, timed
from hf_longctx.data.synthetic_lengths import synthetic_doc_lengths
from hf_longctx.kernels import (
    attention_backward,
    attention_forward,
    available_kernels,
    fa4,
    kernel_call,
    select_kernel,
)

KERNELS = ("fa4", "cudnn_varlen", "cudnn", "torch_flash", "auto")


def workloads(sizes: list[int], single: list[int]) -> list[tuple[str, list[int]]]:
    out = []
    for mix in ("prolong", "pretrain"):
        for total in sizes:
            out.append((f"{mix} {total // 1024}K", synthetic_doc_lengths(mix, total, seed=0, max_doc_len=total)))
    out += [(f"1 doc {n // 1024}K", [n]) for n in single]
    return out


def bench_one(lens, kernel, hq, hkv, d, reps, device):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    total, longest = cu[-1], max(lens)
    g = torch.Generator(device="cpu").manual_seed(total)
    q = torch.randn(total, hq, d, generator=g).to(device, torch.bfloat16)
    k, v = (torch.randn(total, hkv, d, generator=g).to(device, torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    # ValueError when the kernel declines
    chosen = select_kernel(kernel, kernel_call(q, k, v, cu, cu, longest, longest))

    def fwd():
        return attention_forward(q, k, v, cu, cu, longest, longest, kernel=kernel)

    def fwd_bwd():
        out, lse = fwd()
        attention_backward(dout, q, k, v, out, lse, cu, cu, longest, longest, kernel=kernel)

    first = first_call_seconds(fwd_bwd)
    flops = causal_attention_flops(lens, hq, d)
    fwd_tflops, fwd_bwd_tflops = attention_tflops(flops, timed(fwd, reps), timed(fwd_bwd, reps))
    return {"kernel": kernel, "ran": chosen, "fwd": fwd_tflops, "fwd_bwd": fwd_bwd_tflops, "first_s": first}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="65536,131072,262144,524288")
    p.add_argument("--single", default="65536,262144")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--kernels", default=",".join(KERNELS))
    p.add_argument("--quick", action="store_true", help="tiny sizes, any device")
    p.add_argument("--json-out", default=os.environ.get("OUT") and os.path.join(os.environ["OUT"], "kernels.json"))
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hq, hkv, d = (4, 2, 16) if args.quick else (32, 8, 128)
    sizes = [2048] if args.quick else [int(s) for s in args.sizes.split(",")]
    single = [1024] if args.quick else [int(s) for s in args.single.split(",") if s]
    kernels = args.kernels.split(",") if device == "cuda" else ["reference", "auto"]
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"device {name}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"kernels available: {available_kernels(device)}", flush=True)
    rows = []
    for label, lens in workloads(sizes, single):
        cells = {}
        for kernel in kernels:
            try:
                r = bench_one(lens, kernel, hq, hkv, d, 2 if args.quick else args.reps, device)
            except ValueError as exc:
                print(f"{label}: {kernel} declines: {str(exc)[:160]}", flush=True)
                continue
            cells[kernel] = r
            print(f"{label} ({len(lens)} docs): {kernel} -> {r['ran']}: fwd {r['fwd']:.0f}, fwd+bwd "
                  f"{r['fwd_bwd']:.0f} TFLOP/s, first call {r['first_s']:.2f} s", flush=True)
        rows.append({"workload": label, "docs": len(lens), "longest": max(lens), "cells": cells})
    header = ["workload", "docs"] + kernels + ["auto / torch_flash"]
    print("\n" + table_header(header))
    for r in rows:
        c = r["cells"]
        ratio = (f"{c['auto']['fwd_bwd'] / c['torch_flash']['fwd_bwd']:.2f}x"
                 if "auto" in c and "torch_flash" in c else "-")
        vals = [f"{c[k]['fwd']:.0f} / {c[k]['fwd_bwd']:.0f}" if k in c else "-" for k in kernels]
        print(f"| {r['workload']} | {r['docs']} | " + " | ".join(vals) + f" | {ratio} |")
    print("cells: forward / forward+backward TFLOP/s; auto ran: "
          + ", ".join(sorted({c["auto"]["ran"] for c in (r["cells"] for r in rows) if "auto" in c})))
    if fa4.is_installed():
        print(f"fa4 compiles: {fa4.compile_stats()}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
