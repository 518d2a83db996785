"""TRL SFTTrainer with bf16=True on one GPU: the loss curve of each attention implementation, as JSON.

    python scripts/compare_trl_bf16.py                                   # longctx_zigzag vs sdpa, 20 steps
    python scripts/compare_trl_bf16.py --impls longctx_distfa,sdpa --steps 50
    python scripts/compare_trl_bf16.py --impls longctx_zigzag,sdpa,sdpa   # a second sdpa run: the noise

Each implementation trains the same small random Llama (hidden 512, 4 layers, float32 weights under
bf16 autocast, as TRL does by default) on the shipped sample corpus with packing and padding_free,
in a fresh process (examples/sft_trl.py). Prints {"losses": {impl: [...]}, "max_abs_diff": ...}
against the first implementation; bf16 curves agree to run-to-run noise, not to the last bit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impls", default="longctx_zigzag,sdpa")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--max-length", type=int, default=4096)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args()
    losses = {}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("HF_LONGCTX_RECIPE", None)
    with tempfile.TemporaryDirectory() as tmp:
        for run, impl in enumerate(args.impls.split(",")):
            log = Path(tmp, f"{run}-{impl}.json")
            cmd = [sys.executable, str(ROOT / "examples" / "sft_trl.py"), "--attn-implementation", impl, "--bf16",
                   "--max-steps", str(args.steps), "--max-length", str(args.max_length), "--hidden-size",
                   str(args.hidden_size), "--layers", str(args.layers), "--output-dir", str(Path(tmp, f"{run}-{impl}")),
                   "--log-json", str(log)]
            subprocess.run(cmd, check=True, env=env, stdout=sys.stderr)
            label = impl if impl not in losses else f"{impl} (run {sum(k.startswith(impl) for k in losses) + 1})"
            losses[label] = json.loads(log.read_text())["losses"]
    first = next(iter(losses.values()))
    diffs = {impl: max((abs(a - b) for a, b in zip(first, curve)), default=None) for impl, curve in losses.items()}
    print(json.dumps({"steps": args.steps, "losses": losses, "max_abs_diff": diffs}))


if __name__ == "__main__":
    main()
