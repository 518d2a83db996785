"""``scripts/bench_peers.py``: every system trains the same packed row in a process of its own and reports it.

On this CPU the four systems run for real on the tiny shape (ALST as DeepSpeed ZeRO-3 with its tiled MLP,
offloaded checkpoints and tiled loss; TRL's SFTTrainer on FSDP2 with ``cp_size=1``; transformers' Trainer), with
transformers' document mask for SDPA, so that all four see exactly the same problem: their first losses (same
weights, same tokens, same targets, before any update) agree to float32 rounding, which fails if any system trains
another batch, other targets or other weights. A system that fails is reported with its error, not dropped; the
longest-context search is checked on a fake predicate and once for real at tiny bounds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_longctx.lab.peers.runner import exit_error, markdown_table, run_system, search_longest
from hf_longctx.lab.peers.workload import LLAMA3_8B, StepFlops, Workload, mfu

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_peers.py"
SYSTEMS = ["hf_longctx", "alst", "trl_cp", "transformers"]
FIELDS = {"system", "tokens_per_step", "step_s", "steps_timed", "tokens_per_s", "mfu", "mfu_with_recompute",
          "flops_per_step", "flops_per_step_with_recompute", "gpu_peak_allocated_gib", "gpu_peak_reserved_gib",
          "host_peak_gib", "worker_host_peak_gib", "losses", "settings", "versions", "device", "error"}


def bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_every_system_trains_the_same_row_and_reports_one_json_line(tmp_path):
    pytest.importorskip("deepspeed")
    pytest.importorskip("trl")
    out = tmp_path / "peers.jsonl"
    args = ["--tiny", "--seq", "256", "--steps", "2", "--warmup", "1", "--sdpa-mask", "packed", "--out", str(out)]
    done = bench(*args)
    printed, written = json_lines(done.stdout), json_lines(out.read_text())
    assert printed == written
    assert [r["system"] for r in printed] == SYSTEMS
    for r in printed:
        assert r["error"] is None, (r["system"], r["error"])
        assert FIELDS <= set(r), (r["system"], FIELDS - set(r))
        assert r["tokens_per_step"] == 256 and r["steps_timed"] == 2 and len(r["losses"]) == 3
        assert r["step_s"] > 0 and r["tokens_per_s"] == pytest.approx(256 / r["step_s"])
        assert r["flops_per_step_with_recompute"] > r["flops_per_step"] > 0
        assert r["mfu"] is None and r["gpu_peak_allocated_gib"] is None  # no GPU: no peak FLOP/s, no GPU memory
        assert r["host_peak_gib"] >= r["worker_host_peak_gib"] > 0
        assert r["settings"]["document_masking"] is True
    first = [r["losses"][0] for r in printed]
    assert first == pytest.approx([first[0]] * len(first), rel=1e-6), dict(zip(SYSTEMS, first))
    assert printed[1]["settings"]["zero_stage"] == 3 and printed[2]["settings"]["cp_size"] == 1
    # the command line, then the table: a row per system and the ratio row
    assert "python scripts/bench_peers.py " + " ".join(args) in done.stdout
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert [row.split("|")[1].strip() for row in rows[1:]] == [*SYSTEMS, "hf_longctx / best peer"]


def test_a_failing_system_is_reported_with_its_error_not_dropped():
    bad = run_system("hf_longctx", Workload(seq=128, layers=1, tiny=True, mix="no such mix"), timeout_s=120)
    assert bad["error"]["type"] == "ValueError" and "no such mix" in bad["error"]["message"]
    assert bad["system"] == "hf_longctx" and bad["error"]["last_lines"]
    slow = run_system("transformers", Workload(seq=128, layers=1, tiny=True), timeout_s=0.5)
    assert slow["error"]["type"] == "Timeout" and slow["wall_s"] < 30
    killed = exit_error(-9, False, 60.0, "loading\nstep 0")  # what the host's out-of-memory killer leaves
    assert killed["type"] == "Killed" and killed["out_of_memory"] and killed["last_lines"] == ["loading", "step 0"]
    assert not exit_error(-15, False, 60.0, "")["out_of_memory"]
    good = {"system": "alst", "tokens_per_step": 128, "step_s": 2.0, "tokens_per_s": 64.0, "mfu": 0.2,
            "mfu_with_recompute": 0.3, "gpu_peak_allocated_gib": 10.0, "gpu_peak_reserved_gib": 12.0,
            "host_peak_gib": 50.0, "error": None}
    table = markdown_table([bad, good], {"hf_longctx": 0, "alst": 131072})
    assert "| hf_longctx | 128 | - | failed: ValueError |" in table
    assert "| alst | 128 | 2.00 | 64 | 20.0% | 30.0% | 10.0 / 12.0 | 50.0 | 128K |" in table
    assert table.splitlines()[-1].startswith("| hf_longctx / best peer | - | - | - |")  # nothing of ours to compare


def test_the_ratio_row_compares_with_the_best_peer_column_by_column():
    def result(system, step_s, mfu_, gpu, host):
        return {"system": system, "tokens_per_step": 1024, "step_s": step_s, "tokens_per_s": 1024 / step_s,
                "mfu": mfu_, "mfu_with_recompute": mfu_ * 1.5, "gpu_peak_allocated_gib": gpu,
                "gpu_peak_reserved_gib": gpu + 1, "host_peak_gib": host, "error": None}

    results = [result("hf_longctx", 1.0, 0.4, 30.0, 20.0), result("alst", 4.0, 0.1, 15.0, 100.0),
               result("transformers", 2.0, 0.2, 60.0, 10.0)]
    last = markdown_table(results, {"hf_longctx": 262144, "alst": 131072, "transformers": 32768}).splitlines()[-1]
    # best peer: step 2.0 s, 512 tokens/s, MFU 20%, GPU peak 15 GiB, host peak 10 GiB, context 128K
    assert last == "| hf_longctx / best peer | - | 2.00x | 2.00x | 2.00x | 2.00x | 2.00x | 2.00x | 2.00x |"


def test_the_search_doubles_then_bisects_to_the_granularity():
    tried = []

    def attempt(limit):
        def run(seq):
            tried.append(seq)
            return {"error": None} if seq <= limit else {"error": {"type": "OutOfMemoryError"}}
        return run

    found = search_longest("x", attempt(1000), start=256, limit=1 << 20, granularity=64)
    assert (found.longest, found.failed_at) == (960, 1024)
    assert tried == [256, 512, 1024, 768, 896, 960]
    assert [a["ok"] for a in found.attempts] == [True, True, False, True, True, True]
    tried.clear()
    assert search_longest("x", attempt(100), start=256, limit=4096, granularity=32).longest == 96
    assert tried == [256, 128, 64, 96]  # the start failed: halving down first, then bisecting
    tried.clear()
    found = search_longest("x", attempt(10**9), start=256, limit=1024, granularity=64)
    assert (found.longest, found.failed_at, tried) == (1024, None, [256, 512, 1024])  # the limit, nothing failed
    assert search_longest("x", attempt(10), start=256, limit=1024, granularity=64).longest == 0
    with pytest.raises(ValueError):
        search_longest("x", attempt(10), start=32, limit=1024, granularity=64)


def test_search_and_sdpa_peers_without_the_document_mask(tmp_path):
    """``--search`` at tiny bounds reports each system's longest context in its JSON line and the table; a peer on
    SDPA without transformers' document mask says so, and trains another problem (documents see each other)."""
    done = bench("--tiny", "--seq", "128", "--steps", "1", "--warmup", "0", "--systems", "hf_longctx,transformers",
                 "--search", "--search-start", "128", "--search-max", "128", "--granularity", "64")
    ours, plain, *searches = json_lines(done.stdout)
    assert ours["settings"]["document_masking"] is True and plain["settings"]["document_masking"] is False
    assert plain["settings"]["attention"] == "sdpa"
    assert plain["losses"][0] != pytest.approx(ours["losses"][0], rel=1e-6)
    assert searches == [{"search": s, "longest": 128, "failed_at": None, "attempts": [{"seq": 128, "ok": True,
                                                                                        "error": None}]}
                        for s in ("hf_longctx", "transformers")]
    rows = [line for line in done.stdout.splitlines() if line.startswith(("| hf_longctx |", "| transformers |"))]
    assert len(rows) == 2 and all(row.endswith("| 128 |") for row in rows)
    assert done.stdout.splitlines()[-1].endswith("| 1.00x |")  # the ratio row: longest context, ours over the peer's


def test_one_flops_formula_with_and_without_recomputation():
    work = Workload(seq=8192, layers=32, mix="one")
    flops = StepFlops.of(work)
    h, i, v, kv = LLAMA3_8B["hidden_size"], LLAMA3_8B["intermediate_size"], LLAMA3_8B["vocab_size"], 1024
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h  # q, o; k, v; gate, up, down; two norms
    matmul = 6 * (32 * layer + h + v * h)  # the layers, the final norm, the output projection (no embedding)
    attention = 3.5 * 4 * 128 * 32 * 32 * (8192 * 8193 // 2)
    assert flops.model == pytest.approx(8192 * matmul + attention, rel=1e-12)
    assert flops.with_recompute - flops.model == pytest.approx(8192 * 2 * 32 * layer + attention / 3.5, rel=1e-12)
    assert mfu(flops.model, 2.0, 989e12) == pytest.approx(flops.model / 2.0 / 989e12)
    assert mfu(flops.model, 2.0, None) is None


def test_a_real_model_is_measured_after_a_first_step_and_so_is_each_search_attempt():
    """A first step can run before the optimizer's states exist (the Trainer's AdamW allocates them in it): its
    memory is not a training step's, so neither the timed steps nor a search attempt may be a first step."""
    import importlib.util

    from hf_longctx.lab.peers.runner import search_workload

    spec = importlib.util.spec_from_file_location("bench_peers", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    parse_args = script.parse_args
    with pytest.raises(SystemExit):
        parse_args(["--seq", "131072", "--warmup", "0"])
    assert parse_args(["--tiny", "--seq", "128", "--warmup", "0"]).warmup == 0  # plumbing on a CPU may skip it
    attempt = search_workload(Workload(seq=4096, layers=2, tiny=True, mix="prolong", seed=0, steps=3, warmup=0), 8192)
    assert (attempt.seq, attempt.warmup, attempt.steps) == (8192, 1, 1)


def test_flashattention4s_flash_attn_package_does_not_make_peers_pick_flash_attention_2(tmp_path):
    """FlashAttention-4 installs a ``flash_attn.cute`` package; transformers' ``flash_attention_2`` cannot run on it,
    so a peer that saw the package would fail at model load instead of running SDPA. In a process of its own:
    transformers caches what it finds installed."""
    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "flash_attn" / "__init__.py").write_text("")
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text("")
    code = ("from hf_longctx.lab.peers.common import choose_attention; "
            "print(choose_attention('packed'), choose_attention('causal'))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "('sdpa', True) ('sdpa', False)"
