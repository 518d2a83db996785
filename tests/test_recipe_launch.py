"""The TASP and CAD recipes launch as a user would and train exactly like another backend.

``accelerate launch --config_file recipes/<recipe>.yaml scripts/train.py`` on CPU processes (gloo),
3 steps each. All backends are exact, so the same recipe with another backend (through the
``HF_LONGCTX_BACKEND`` override) must log the same losses and gradient norms at every step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def train(tmp_path: Path, recipe: str, backend: str | None = None) -> tuple[list[dict], str]:
    name = f"{recipe}-{backend or 'recipe'}"
    log = tmp_path / f"{name}.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HF_LONGCTX_RECIPE", None)
    if backend:
        env["HF_LONGCTX_BACKEND"] = backend
    config = str(ROOT / "recipes" / f"{recipe}.yaml")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config,
           str(ROOT / "scripts" / "train.py"), "--max-steps", "3", "--logging-steps", "1",
           "--output-dir", str(tmp_path / name), "--log-json", str(log)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [e for e in json.loads(log.read_text()) if "loss" in e], proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("recipe,backend,other", [("cpu-2proc-cad", "cad", "zigzag"),
                                                  ("cpu-3proc-tasp", "tasp", "zigzag")])
def test_recipe_trains_with_its_backend_like_another_backend(tmp_path, recipe, backend, other):
    ours, output = train(tmp_path, recipe)
    assert f'"backend": "{backend}"' in output, "the recipe's backend must be the one that trained"
    theirs, output = train(tmp_path, recipe, other)
    assert f'"backend": "{other}"' in output, "the override must train another backend, or the comparison is void"
    assert len(ours) == len(theirs) == 3
    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), step
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), step
