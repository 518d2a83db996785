"""Every backend launches as a user would and trains exactly like the recipe's own backend.

``accelerate launch --config_file recipes/<shape>.yaml scripts/train.py [--backend NAME ...]`` on CPU
processes (gloo), 3 steps each. All backends are exact, so on one hardware shape every backend must
log the losses and gradient norms of the recipe's default backend at every step. The recipe's own
run is ``make demo``'s command on 2 processes. Launches are few (CI has 2 cores): one reference per
shape, then one launch per backend.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# backend: (hardware shape, command line after scripts/train.py, environment, the run it must equal)
LAUNCHES = {
    "ring": ("cpu-2proc", ["--backend", "ring"], {}, "cpu-2proc"),
    "ulysses": ("cpu-2proc", ["--backend", "ulysses"], {}, "cpu-2proc"),
    # with options of its own, as a user tunes it: the callback hands them to every attention call
    "cad": ("cpu-2proc", ["--backend", "cad", "--backend-options", "eps=0.01,pingpong=false"], {}, "cpu-2proc"),
    "zigzag": ("cpu-3proc", [], {"HF_LONGCTX_BACKEND": "zigzag"}, "cpu-3proc"),  # the environment's override
    # local is one process's attention: data parallel on the same shape, against distfa at sp_size 1
    "local": ("cpu-2proc", ["--backend", "local", "--sp-size", "1"], {}, "cpu-2proc --sp-size 1"),
    # two-dimensional: Ulysses over pairs of processes, the outer backend across the pairs (a 2 x 2 mesh)
    **{f"ulysses_{outer}": ("cpu-4proc", ["--backend", f"ulysses_{outer}", "--sp-size", "4", "--backend-options",
                                          "ulysses_size=2"], {}, "cpu-4proc --sp-size 4")
       for outer in ("zigzag", "distfa", "tasp", "ring", "cad")},
}
REFERENCES = {  # a run of the recipe's own backend: (shape, command line, backend it must report)
    "cpu-2proc": ("cpu-2proc", [], "distfa"),
    "cpu-3proc": ("cpu-3proc", [], "tasp"),
    "cpu-2proc --sp-size 1": ("cpu-2proc", ["--sp-size", "1"], "distfa"),
    "cpu-4proc --sp-size 4": ("cpu-4proc", ["--sp-size", "4"], "zigzag"),
}
_runs: dict[str, tuple[list[dict], dict]] = {}


def train(tmp_path: Path, shape: str, extra: list[str], env_extra: dict) -> tuple[list[dict], dict]:
    """Losses and gradient norms of each step, and the run's summary (rank 0's last line)."""
    name = "-".join([shape, *extra, *env_extra.values()]).replace("--", "")
    log = tmp_path / f"{name}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_LONGCTX_")}
    env.update(PYTHONPATH=str(ROOT), **env_extra)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "recipes" / f"{shape}.yaml"),
           str(ROOT / "scripts" / "train.py"), *extra, "--max-steps", "3", "--logging-steps", "1",
           "--output-dir", str(tmp_path / name), "--log-json", str(log)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    summary = [line for line in proc.stdout.splitlines() if line.startswith("hf_longctx training summary: ")]
    assert len(summary) == 1, proc.stdout[-3000:]
    return [e for e in json.loads(log.read_text()) if "loss" in e], json.loads(summary[0].split(": ", 1)[1])


def reference(tmp_path_factory, key: str) -> list[dict]:
    if key not in _runs:
        shape, extra, backend = REFERENCES[key]
        steps, summary = train(tmp_path_factory.mktemp("reference"), shape, extra, {})
        assert summary["backend"] == backend, "the recipe's sidecar must pick the backend that trained"
        _runs[key] = steps, summary
    return _runs[key][0]


def test_every_backend_has_a_launch():
    """Every backend the package ships (not one a test file registers from outside) is launched above."""
    from hf_longctx.backends import registered_backends
    from hf_longctx.hf import backend_from_name

    shipped = {b.name for b in registered_backends() if type(b).__module__.startswith("hf_longctx.")}
    launched = {backend_from_name(b) for b in LAUNCHES} | {backend_from_name(r[2]) for r in REFERENCES.values()}
    assert launched == shipped - {"auto"}


@pytest.mark.slow
@pytest.mark.parametrize("backend", list(LAUNCHES))
def test_every_backend_trains_like_the_recipe_backend(tmp_path, tmp_path_factory, backend):
    shape, extra, env, against = LAUNCHES[backend]
    expected = reference(tmp_path_factory, against)
    steps, summary = train(tmp_path, shape, extra, env)
    assert summary["backend"] == backend, "the override must train another backend, or the comparison is void"
    options = {"cad": {"eps": 0.01, "pingpong": False}}.get(backend, {"ulysses_size": 2})
    assert summary["backend_options"] == (options if "--backend-options" in extra else {})
    assert summary["sp_size"] == _runs[against][1]["sp_size"] == (1 if backend == "local" else int(shape[4]))
    assert len(steps) == len(expected) == 3
    for step, (a, b) in enumerate(zip(steps, expected)):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), step
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), step
