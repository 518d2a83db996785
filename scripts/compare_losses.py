"""Train the same model on the same data with every backend and compare the loss curves.

    python scripts/compare_losses.py --steps 50 --out bench/loss_curves.png        # CPU, 2 processes

Each backend runs the README's training command (``accelerate launch --config_file RECIPE
scripts/train.py --backend NAME``); the curves must agree to the precision of the
run (float32 on CPU, bf16 on GPU), since every backend computes the same attention exactly. Prints
the largest difference of each curve from the first backend's, and draws the curves when
matplotlib is installed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def losses(backend: str, args, tmp: Path) -> list[float]:
    log = tmp / f"{backend}.json"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", args.recipe,
           str(ROOT / "scripts" / "train.py"), "--backend", backend, "--max-steps", str(args.steps),
           "--logging-steps", "1",
           "--output-dir", str(tmp / backend), "--log-json", str(log), *args.train_args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{backend} failed:\n{proc.stderr[-3000:]}")
    return [e["loss"] for e in json.loads(log.read_text()) if "loss" in e]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default=str(ROOT / "recipes" / "cpu-2proc.yaml"))
    p.add_argument("--backends", default="ring,zigzag,distfa,ulysses,tasp,cad,auto")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--out", default=None, help="PNG of the curves")
    p.add_argument("train_args", nargs="*", help="extra arguments for scripts/train.py (after --)")
    args = p.parse_args()
    backends = args.backends.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        curves = {b: losses(b, args, Path(tmp)) for b in backends}
    first = curves[backends[0]]
    print(f"| backend | first loss | last loss | max abs difference from {backends[0]} |\n|---|---|---|---|")
    for b, c in curves.items():
        diff = max(abs(x - y) for x, y in zip(c, first))
        print(f"| {b} | {c[0]:.6f} | {c[-1]:.6f} | {diff:.2e} |")
    if args.out:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for b, c in curves.items():
            ax.plot(range(1, len(c) + 1), c, label=b, linewidth=1)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.set_title("Same model and data, every backend")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out, dpi=120)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
