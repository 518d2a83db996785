"""``scripts/lab/bench_cad_schedule.py`` times CAD's schedule alone and priced by the group, on gloo processes (CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "bench" / "logs" / "launch_model_placement_1xH200_2026-11-28.json"  # a launch model fitted on an H200


def test_two_ranks_time_the_schedule_both_ways_and_make_the_same_tasks():
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    script = ROOT / "scripts" / "lab" / "bench_cad_schedule.py"
    run = subprocess.run([sys.executable, str(script), "--model", str(MODEL),
                          "--worlds", "2", "--mixes", "sft:16k"], capture_output=True, text=True, env=env,
                         timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("| sft ")]
    assert len(rows) == 1, run.stdout
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[3] == "2" and cells[8] == "yes"  # W, and the same tasks alone and together
    assert float(cells[5]) > 0 and float(cells[6]) > 0
