"""``scripts/bench_emulated.py`` runs end to end on the CPU with tiny sizes (so it cannot rot)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_emulated.py"


def test_bench_emulated_quick_writes_its_tables(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_LONGCTX_CACHE", str(tmp_path / "cache"))
    spec = importlib.util.spec_from_file_location("bench_emulated", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "emulated.md"
    assert module.main(["--quick", "--out", str(out), "--worlds", "4", "--mixes", "prolong,sft",
                        "--eps-sweep", "prolong:4"]) == 0
    text = out.read_text()
    assert "emulated on one GPU" in text and "design document section 7" in text
    for label in ("ring", "zigzag", "distfa", "tasp", "cad flops eps0.1", "cad profiled eps auto", "ulysses"):
        assert f"| {label} |" in text, label
    assert "auto (emulated) ->" in text and "CAD eps sweep" in text and "rule's choice" in text
    assert "Error" not in text
