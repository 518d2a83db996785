"""Profile core-attention segment cost on a GPU for the CAD scheduler's ProfiledCostModel.

Each grid cell is one CA-task shape: ``q_len`` query rows attending, bottom-right causally, to
``kv_len`` keys. Attention servers run many tasks in one fused varlen call, so a cell is timed as a
packed batch of identical segments (enough copies to reach ``--min-tokens`` query rows, bounded by
``--max-kv-tokens`` keys in memory) and divided by the number of copies: the cost a task adds to a
fused batch, without the launch overhead of a lone small call. Cells whose causal work exceeds
``--max-pairs`` visible (query, key) pairs are not run; they are filled from the measured cell of
the same row with the most work, scaled by FLOPs (such cells are compute bound), and listed in
``meta.extrapolated``.

Kernel: ``torch_flash`` by default, because that is what an attention server's fused batch runs:
``auto`` takes cuDNN only for causal segments with q_len == kv_len and at most a few distinct shapes,
which a batch of CA-tasks never is. Profiling a lone shape with ``auto`` would time q_len == kv_len
cells on cuDNN (about 1.7x faster) and all others on torch_flash, a jump on the diagonal that no
interpolation between grid points represents.

Run on the GPU machine:

    python scripts/profile_cad.py --out cad_profile.json

then ``ProfiledCostModel.load("cad_profile.json")`` and pass it to
``hf_longctx.backends.cad.scheduler.schedule(..., cost_model=...)``. ``--mode fwd`` times the
forward only; the default ``fwd+bwd`` is what a training step pays.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from hf_longctx.backends.cad.cost_model import FlopsCostModel, ProfiledCostModel
from hf_longctx.benchmarking import timed
from hf_longctx.kernels import attention_backward, attention_forward, kernel_call, select_kernel

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def sizes(text: str) -> list[int]:
    out = []
    for x in text.split(","):
        x = x.strip().lower()
        out.append(int(x[:-1]) * 1024 if x.endswith("k") else int(x))
    return sorted(set(out))


def time_cell(q_len, kv_len, args, dtype) -> tuple[float, int]:
    """Milliseconds per segment of a packed batch of identical (q_len, kv_len) segments, and the copies."""
    copies = max(1, min(args.min_tokens // q_len, args.max_kv_tokens // kv_len))
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(q_len * 7 + kv_len)
    q = torch.randn(copies * q_len, args.heads, args.head_dim, device=dev, dtype=dtype, generator=g)
    k = torch.randn(copies * kv_len, args.kv_heads, args.head_dim, device=dev, dtype=dtype, generator=g)
    v = torch.randn_like(k)
    cu_q = torch.arange(copies + 1, device=dev, dtype=torch.int32) * q_len
    cu_k = torch.arange(copies + 1, device=dev, dtype=torch.int32) * kv_len
    dout = torch.randn_like(q) if args.mode == "fwd+bwd" else None

    def step():
        out, lse = attention_forward(q, k, v, cu_q, cu_k, q_len, kv_len, causal=True, kernel=args.kernel)
        if dout is not None:
            attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, q_len, kv_len, causal=True, kernel=args.kernel)

    return timed(step, args.reps, warmup=args.warmup) / copies, copies


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--q-lens", type=sizes, default=sizes("128,512,2k,8k,32k,128k,512k"))
    p.add_argument("--kv-lens", type=sizes, default=sizes("128,512,2k,8k,32k,128k,512k"))
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--kernel", default="auto",
                   help="kernel for attention_forward/backward; 'auto' profiles the kernel training will run")
    p.add_argument("--mode", choices=["fwd", "fwd+bwd"], default="fwd+bwd")
    p.add_argument("--min-tokens", type=int, default=65536, help="query rows per timed batch (at least)")
    p.add_argument("--max-kv-tokens", type=int, default=1 << 21, help="keys per timed batch (at most)")
    p.add_argument("--max-pairs", type=float, default=float(1 << 36),
                   help="largest visible (query, key) pairs of a measured cell; larger cells are extrapolated")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default="cad_profile.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_cad.py needs a CUDA device", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype]
    pairs = FlopsCostModel(flops_per_pair=1.0)
    table = [[float("nan")] * len(args.kv_lens) for _ in args.q_lens]
    t0 = time.perf_counter()
    for i, ql in enumerate(args.q_lens):
        for j, kl in enumerate(args.kv_lens):
            if pairs.cost(ql, kl) > args.max_pairs:
                continue
            ms, copies = time_cell(ql, kl, args, dtype)
            table[i][j] = ms
            work = 4 * args.heads * args.head_dim * pairs.cost(ql, kl) * (3.5 if args.mode == "fwd+bwd" else 1.0)
            print(f"q {ql:>7} kv {kl:>7} x{copies:<4} {ms:10.4f} ms/segment  {work / ms / 1e9:8.1f} TFLOP/s",
                  flush=True)
    extrapolated = []
    for i, ql in enumerate(args.q_lens):
        done = [j for j in range(len(args.kv_lens)) if table[i][j] == table[i][j]]
        src_i = i
        if not done:  # borrow the rate of the nearest row with a measurement
            rows = [r for r in range(len(args.q_lens)) if any(x == x for x in table[r])]
            src_i = min(rows, key=lambda r: abs(r - i))
            done = [j for j in range(len(args.kv_lens)) if table[src_i][j] == table[src_i][j]]
        ref = max(done, key=lambda j: pairs.cost(args.q_lens[src_i], args.kv_lens[j]))
        rate = table[src_i][ref] / max(pairs.cost(args.q_lens[src_i], args.kv_lens[ref]), 1.0)
        for j, kl in enumerate(args.kv_lens):
            if table[i][j] != table[i][j]:
                table[i][j] = rate * pairs.cost(ql, kl)
                extrapolated.append([ql, kl])
    probe = torch.empty(args.q_lens[-1], args.heads, args.head_dim, device="cuda", dtype=DTYPES[args.dtype])
    kv, n = probe[:, : args.kv_heads], len(probe)
    ran = select_kernel(args.kernel, kernel_call(probe, kv, kv, [0, n], [0, n], n, n))
    model = ProfiledCostModel.from_grid(args.q_lens, args.kv_lens, table, units="ms")
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "heads": args.heads,
            "kv_heads": args.kv_heads, "head_dim": args.head_dim, "dtype": args.dtype, "kernel": ran,
            "mode": args.mode, "extrapolated": extrapolated, "seconds": round(time.perf_counter() - t0, 1)}
    model.save(args.out, **meta)
    print(f"wrote {args.out}: {len(args.q_lens)} x {len(args.kv_lens)} grid, {len(extrapolated)} cells extrapolated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
