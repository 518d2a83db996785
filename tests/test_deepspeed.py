"""DeepSpeed ZeRO-2 and ZeRO-3 through accelerate train exactly like DDP with sequence parallelism.

Each run is the real command line: ``accelerate launch --config_file recipes/<recipe>.yaml
scripts/train.py`` on 2 CPU processes (gloo) forming one sequence-parallel group. ZeRO shards
gradients (and with stage 3 parameters) over both ranks and averages gradients over them, as DDP
does; the loss contract (each rank's loss is its share, Trainer scales by the world size) must give
the same loss AND the same gradient norm at every step. A wrong averaging shows as a factor in the
gradient norm.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
ROOT = Path(__file__).resolve().parents[1]


def train(tmp_path: Path, name: str, config_file: str, recipe: str) -> list[dict]:
    log = tmp_path / f"{name}.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_LONGCTX_RECIPE": str(ROOT / "recipes" / recipe),
           "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "recipes" / config_file),
           str(ROOT / "scripts" / "train.py"), "--max-steps", "3", "--logging-steps", "1",
           "--output-dir", str(tmp_path / name), "--log-json", str(log)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [e for e in json.loads(log.read_text()) if "loss" in e]


@pytest.mark.slow
def test_zero2_and_zero3_train_like_ddp(tmp_path):
    sidecar = "cpu-2proc-zero2.yaml"  # same long-context settings for all three runs
    ddp = train(tmp_path, "ddp", "cpu-2proc.yaml", sidecar)
    assert len(ddp) == 3
    for stage in ("zero2", "zero3"):
        zero = train(tmp_path, stage, f"cpu-2proc-{stage}.yaml", sidecar)
        assert len(zero) == len(ddp)
        for step, (a, b) in enumerate(zip(ddp, zero)):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (stage, step)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), (stage, step)
