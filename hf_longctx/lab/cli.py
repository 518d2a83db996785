"""``hf-longctx-lab`` command line: research steps that training never runs itself.

    hf-longctx-lab profile-cad --out cad_model.json [--kernel auto] [--model auto|grid|launch]

``profile-cad`` makes CAD's measured cost model of a kernel on this machine's device kind (see
:mod:`hf_longctx.lab.cad.profiled`: the launch cost model where the kernel declares its launch grid, else the
interpolated grid; minutes on a GPU, reused from ``~/.cache/hf_longctx/cad_cost`` when made before) and writes it to
``--out`` with the device and kernel it was measured on. A training run then names the file
(``backend_options: {cost_model: cad_model.json}``); the run checks the file's device and kernel before it builds a
model. Anything that keeps the model from being measured is an error here, never a FLOPs model in the file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _lengths(text: str) -> tuple[int, ...]:
    return tuple(int(x.lower().replace("k", "")) * (1024 if x.lower().endswith("k") else 1)
                 for x in text.split(",") if x)


def cmd_profile_cad(args: argparse.Namespace) -> int:
    from hf_longctx.backends.cad.cost_model import FlopsCostModel
    from hf_longctx.lab.cad.profiled import (
        DEFAULT_KV_LENS,
        DEFAULT_Q_LENS,
        ProfileBudget,
        SegmentShape,
        device_name,
        measured_cost_model,
        resolved_kernel,
    )

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("profile-cad: no CUDA device here (--device cpu measures the CPU's reference kernel)", file=sys.stderr)
        return 2
    shape = SegmentShape(args.heads, args.kv_heads, args.head_dim, DTYPES[args.dtype])
    kernel = "reference" if device.type == "cpu" and args.kernel == "auto" else args.kernel
    grid = {"q_lens": args.q_lens or DEFAULT_Q_LENS, "kv_lens": args.kv_lens or DEFAULT_KV_LENS}
    if args.min_tokens:
        grid["budget"] = ProfileBudget(min_tokens=args.min_tokens)
    model, source = measured_cost_model(kernel, device, shape, model=args.model, **grid)
    if isinstance(model, FlopsCostModel):
        print(f"profile-cad: no measured cost model: {source}", file=sys.stderr)
        return 1
    meta = {"device": device_name(device), "kernel": resolved_kernel(kernel, shape, device), "source": source,
            "heads": shape.heads, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim,
            "dtype": str(shape.dtype).removeprefix("torch."), "torch": torch.__version__}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    model.save(out, **meta)
    print(f"wrote {out}: {type(model).__name__} of {meta['kernel']} on {meta['device']} ({source}); train with "
          f"backend_options: {{cost_model: {out}}}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-longctx-lab", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("profile-cad", help="measure CAD's cost model of a kernel here and write it to a file")
    p.add_argument("--out", required=True, help="the cost model file to write (CAD's cost_model names it)")
    p.add_argument("--kernel", default="auto", help="the kernel to time (auto: the one a CAD server runs)")
    p.add_argument("--model", choices=("auto", "grid", "launch"), default="auto",
                   help="launch cost model, interpolated grid, or auto (launch where the kernel declares its grid)")
    p.add_argument("--device", default=None, help="cuda (default where there is one) or cpu")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--q-lens", type=_lengths, default=None, help="grid query lengths, e.g. 128,512,2k")
    p.add_argument("--kv-lens", type=_lengths, default=None, help="grid key lengths")
    p.add_argument("--min-tokens", type=int, default=0, help="query rows per timed batch of the grid (at least)")
    p.set_defaults(run=cmd_profile_cad)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
