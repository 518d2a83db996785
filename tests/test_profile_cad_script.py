"""``scripts/profile_cad.py`` profiles, saves, and checks a profile against shapes off its grid (CPU smoke run)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from hf_longctx.backends.cad.cost_model import ProfiledCostModel
from hf_longctx.backends.cad.profiled import random_shapes

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "profile_cad.py"
TINY = ["--device", "cpu", "--heads", "2", "--kv-heads", "1", "--head-dim", "8", "--dtype", "fp32",
        "--q-lens", "16,64", "--kv-lens", "16,64,256", "--min-tokens", "64", "--max-kv-tokens", "1024",
        "--warmup", "0", "--reps", "1"]


def _script():
    spec = importlib.util.spec_from_file_location("profile_cad", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_profile_then_check_it_off_the_grid(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert _script().main([*TINY, "--out", str(out), "--check", "3"]) == 0
    model = ProfiledCostModel.load(out)
    assert model.q_lens == (16.0, 64.0) and model.launch is None  # the CPU kernel declares no launch grid
    printed = capsys.readouterr().out
    assert printed.count("check q") == 3 and "check: 3 shapes" in printed
    assert _script().main([*TINY, "--load", str(out), "--check", "2"]) == 0
    assert "check: 2 shapes" in capsys.readouterr().out


def test_random_shapes_look_like_server_segments():
    shapes = random_shapes(200, seed=3, max_q=512, max_kv=4096)
    assert all(16 <= q <= 512 and q <= k <= 4096 for q, k in shapes)
    assert any(q == k for q, k in shapes) and any(q < k for q, k in shapes)
    assert shapes == random_shapes(200, seed=3, max_q=512, max_kv=4096)
