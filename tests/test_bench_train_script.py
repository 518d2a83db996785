"""``scripts/bench_train.py`` takes the backend's options as the recipes do (``--backend-options NAME=VALUE,...``)
and refuses a wrong one before any process starts, naming it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_train.py"


@pytest.mark.parametrize("backend,options,message", [
    ("cad", "epss=0.01", "backend 'cad' has no option 'epss' (did you mean 'eps'?)"),
    ("cad", "eps=-1", "backend 'cad': eps must be a number >= 0"),
    ("zigzag", "eps=0.01", "backend 'zigzag' has no option 'eps'; it takes none"),
    ("cad", "eps", "'eps' is not NAME=VALUE"),
])
def test_a_wrong_backend_option_is_refused_before_any_process_starts(backend, options, message):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--backend", backend, "--backend-options", options],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.count(message) == 1, done.stderr[-2000:]
    assert "RESULT" not in done.stdout  # nothing ran
