"""``scripts/bench_backend_table.py``: one command gives every backend's emulated step and auto's choice per mix and
group size, as JSON and as the README's table (a CPU smoke run; the figures come from a GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from hf_longctx.lab.backend_table import JsonLines, read_json

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_backend_table.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT, timeout=600)


def test_a_quick_run_writes_every_backend_and_autos_choice(tmp_path):
    out = tmp_path / "table.jsonl"
    readme = tmp_path / "README.md"
    readme.write_text("before\n<!-- backend-table:start -->\nold\n<!-- backend-table:end -->\nafter\n")
    done = run("--quick", "--mixes", "prolong,sft", "--worlds", "4", "--within", "100", "--out-json", str(out),
               "--readme", str(readme))
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    meta, cells, end = rows[0]["meta"], rows[1:-1], rows[-1]["end"]
    assert end["left_out"] == [] and end["seconds"] > 0
    assert [c["mix"] for c in cells] == ["prolong", "sft"] and meta["kernel"] == "reference"
    for cell in cells:
        labels = {b["label"] for b in cell["backends"]}
        assert {"ring", "zigzag", "distfa", "tasp", "ulysses", "cad"} <= labels
        assert cell["auto"] in labels and cell["auto_ratio"] >= 1.0 and cell["one_gpu_ms"] > 0
        emulated = [b["emulated_ms"] for b in cell["backends"] if b["emulated_ms"] is not None]
        auto_ms = min(emulated) * cell["auto_ratio"]  # auto's step is one of the emulated ones
        assert any(abs(auto_ms - e) <= 1e-9 * e for e in emulated), (auto_ms, emulated)
    text = readme.read_text()
    assert text.startswith("before\n<!-- backend-table:start -->\nEmulated on one CPU") and text.endswith(
        "<!-- backend-table:end -->\nafter\n") and "| prolong | 4 |" in text and "\nold\n" not in text
    # the same table again from the JSON alone, no run
    again = run("--from-json", str(out), "--within", "100")
    assert again.returncode == 0 and "| sft | 4 |" in again.stdout


def test_auto_far_from_the_best_fails_the_run(tmp_path):  # the file of a run cut short: meta and cells, no end
    out = tmp_path / "table.jsonl"
    cell = {"mix": "sft", "world": 8, "tokens": 8192, "docs": 3, "one_gpu_ms": 1.0, "auto": "ring",
            "auto_placement": "contiguous", "auto_ratio": 1.2, "auto_reason": "", "best": "zigzag",
            "backends": [{"label": "ring", "placement": "contiguous", "predicted_ms": 1.0, "emulated_ms": 1.2},
                         {"label": "zigzag", "placement": "zigzag", "predicted_ms": 1.1, "emulated_ms": 1.0}]}
    out.write_text(json.dumps({"meta": {"marks": "m", "command": "c"}}) + "\n" + json.dumps(cell) + "\n")
    done = run("--from-json", str(out))
    assert done.returncode == 1 and "| sft | 8 | 8K | 1.0 | 1.2 | **1.0** | ring (contiguous) | 1.200 |" in done.stdout


def test_a_table_measured_in_parts_reads_by_mix_then_w(tmp_path):
    def cell(mix, world):
        backends = [{"label": "ring", "placement": "contiguous", "predicted_ms": 1.0, "emulated_ms": 1.0}]
        if world < 64:  # Ulysses is a candidate only where the heads split over the ranks
            backends.append({"label": "ulysses", "placement": "zigzag", "predicted_ms": 2.0, "emulated_ms": 2.0})
        return {"mix": mix, "world": world, "tokens": 1024 * world, "docs": 1, "one_gpu_ms": 1.0, "auto": "ring",
                "auto_placement": "contiguous", "auto_ratio": 1.0, "auto_reason": "", "best": "ring",
                "backends": backends}

    first, second = tmp_path / "small.jsonl", tmp_path / "large.jsonl"
    meta = json.dumps({"meta": {"marks": "m", "command": "c"}})
    first.write_text("\n".join([meta] + [json.dumps(cell(m, w)) for m in ("prolong", "sft") for w in (8, 16)]))
    second.write_text("\n".join([meta] + [json.dumps(cell(m, 64)) for m in ("prolong", "sft")]))
    done = run("--from-json", str(first), str(second))
    rows = [line.split(" | ")[:2] for line in done.stdout.splitlines() if line.startswith("| prolong") or
            line.startswith("| sft")]
    assert rows == [["| prolong", "8"], ["| prolong", "16"], ["| prolong", "64"], ["| sft", "8"], ["| sft", "16"],
                    ["| sft", "64"]], done.stdout
    assert "| prolong | 8 | 8K | 1.0 | **1.0** | 2.0 |" in done.stdout
    assert "| prolong | 64 | 64K | 1.0 | **1.0** | n/a |" in done.stdout and "n/a: not a candidate" in done.stdout


def test_each_cell_is_on_disk_as_soon_as_it_is_finished(tmp_path):
    """A run stopped by a time limit mid-table keeps every cell it finished: each line is flushed when written."""
    path = tmp_path / "cut.jsonl"
    lines = JsonLines(path, {"marks": "m", "command": "c"})
    lines.cell({"mix": "sft", "world": 8})
    cells, metas = read_json([str(path)])  # before close, as after a kill
    assert cells == [{"mix": "sft", "world": 8}] and metas == [{"marks": "m", "command": "c"}]
    lines.close({"seconds": 1.0, "left_out": ["sft W=16"]})
    assert read_json([str(path)])[0] == cells  # the end line is no cell
