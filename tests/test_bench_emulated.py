"""``scripts/lab/bench_emulated.py`` runs end to end on the CPU with tiny sizes (so it cannot rot)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "lab" / "bench_emulated.py"


def load_script():
    """scripts/lab/bench_emulated.py as a module (its main and helpers callable, with monkeypatched runners)."""
    spec = importlib.util.spec_from_file_location("bench_emulated", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_emulated_quick_writes_its_tables(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_LONGCTX_CACHE", str(tmp_path / "cache"))
    module = load_script()
    out = tmp_path / "emulated.md"
    calls = tmp_path / "calls"
    assert module.main(["--quick", "--out", str(out), "--worlds", "4", "--mixes", "prolong,sft",
                        "--eps-sweep", "prolong:4", "--dump-calls", str(calls)]) == 0
    text = out.read_text()
    assert "emulated on one GPU" in text and "design document section 7" in text
    for label in ("ring", "zigzag", "distfa", "tasp", "cad flops eps0.1", "cad profiled eps auto", "ulysses"):
        assert f"| {label} |" in text, label
    assert "fastest emulated ->" in text and "CAD eps sweep" in text and "rule's choice" in text
    assert "Error" not in text
    assert "noise alone max/mean 1." in text  # two repetitions: every row says what timing noise alone gives

    # every kernel call of the profiled CAD runs, with the profile they were scheduled on
    assert (calls / "profile.json").exists()
    dump = json.loads((calls / "sft_w4_cad_profiled_eps0_01.json").read_text())
    assert dump["world"] == 4 and len(dump["predicted_ms"]) == 4 and len(dump["reps"]) == 2
    for rank, kernel_s in enumerate(dump["kernel_s"]):  # a rank's time is one repetition's calls, summed
        sums = [sum(c["seconds"] for c in rep if c["rank"] == rank) for rep in dump["reps"]]
        assert any(abs(s - kernel_s) <= 1e-9 + 1e-9 * kernel_s for s in sums)
    for c in dump["reps"][0]:
        assert c["phase"] in ("forward", "backward") and len(c["q_lens"]) == len(c["k_lens"]) > 0


def test_cad_runs_choose_the_cad_variants_and_a_misspelt_one_is_refused_first(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_LONGCTX_CACHE", str(tmp_path / "cache"))
    module = load_script()
    profiled = []
    monkeypatch.setattr(module, "measured_cost_model", lambda *a, **k: profiled.append(1))
    out = tmp_path / "emulated.md"
    assert module.main(["--quick", "--out", str(out), "--cad-runs", "cad profiled eps0.001"]) == 2
    assert "unknown run(s) ['cad profiled eps0.001']" in capsys.readouterr().err and not profiled  # before profiling
    monkeypatch.undo()
    monkeypatch.setenv("HF_LONGCTX_CACHE", str(tmp_path / "cache"))
    assert module.main(["--quick", "--out", str(out), "--worlds", "2", "--mixes", "sft", "--backends", "cad",
                        "--eps-sweep", "none:0", "--cad-runs", "cad flops eps0.1,cad profiled eps0.01",
                        "--calibrate", "1"]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| sft |")]
    # --calibrate: the run on a measured model is scheduled again on its measured times and emulated again
    assert [r.split(" | ")[4] for r in rows] == ["cad flops eps0.1", "cad profiled eps0.01",
                                                "cad profiled eps0.01 calibrated 1"]
    assert "calibrated prediction max/mean" in rows[-1] and "servers' tasks changed" in rows[-1]

    # --seed picks another batch of the mix's documents (the table's docs column counts them)
    from hf_longctx.lab.emulation.workloads import doc_lengths

    counts = {seed: len(doc_lengths("sft", 512, seed=seed)) for seed in range(6)}
    seed = next(s for s in range(1, 6) if counts[s] != counts[0])
    assert module.main(["--quick", "--out", str(out), "--worlds", "2", "--mixes", "sft", "--backends", "cad",
                        "--eps-sweep", "none:0", "--cad-runs", "cad flops eps0.1", "--seed", str(seed)]) == 0
    row = next(line for line in out.read_text().splitlines() if line.startswith("| sft |"))
    assert row.split(" | ")[2] == str(counts[seed])


def test_a_configuration_out_of_device_memory_runs_again_staged_on_the_host(tmp_path, monkeypatch):
    """One large configuration (64 ranks' buffers on one device) must not leave a hole in the table: it runs again
    with its all_to_all buffers on the host, and its row says so. Other errors still fill their row."""
    import torch

    monkeypatch.setenv("HF_LONGCTX_CACHE", str(tmp_path / "cache"))
    module = load_script()
    from hf_longctx.lab.emulation import runner

    real = runner.emulate_step
    staged = []

    def short_of_memory(batch, world, *args, stage_on_host=False, **kwargs):
        staged.append(stage_on_host)
        if world == 2 and not stage_on_host:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
        if world == 3:
            raise RuntimeError("not a memory error")
        return real(batch, world, *args, stage_on_host=stage_on_host, **kwargs)

    monkeypatch.setattr(runner, "emulate_step", short_of_memory)
    out = tmp_path / "emulated.md"
    assert module.main(["--quick", "--out", str(out), "--worlds", "2,3", "--mixes", "sft", "--backends", "ring",
                        "--eps-sweep", "none:0"]) == 0
    rows = {line.split(" | ")[3]: line for line in out.read_text().splitlines() if line.startswith("| sft |")}
    assert "staged on the host: the device ran out of memory" in rows["2"] and "OutOfMemoryError" not in rows["2"]
    assert "RuntimeError: not a memory error" in rows["3"]
    assert True in staged


def test_each_mix_shares_the_budget_the_set_up_left_and_none_starts_past_the_budget(tmp_path, monkeypatch):
    """A cost profile made at the start (minutes on a GPU) or a long warm-up must not eat the first mix's share of
    ``--budget-s``: the shares are cut from what the set-up left. On a clock that moves only while the profile is
    made (100 s), a budget of 150 s runs both mixes (the first's share used to end at 75 s); one of 90 s runs
    none, and says so."""
    import types

    monkeypatch.setenv("HF_LONGCTX_CACHE", str(tmp_path / "cache"))
    module = load_script()
    clock = [0.0]
    real_profile = module.measured_cost_model

    def slow_profile(*args, **kwargs):
        clock[0] += 100.0
        return real_profile(*args, **kwargs)

    monkeypatch.setattr(module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(module, "measured_cost_model", slow_profile)
    out = tmp_path / "emulated.md"
    common = ["--quick", "--out", str(out), "--worlds", "2", "--mixes", "prolong,sft", "--backends", "ring",
              "--eps-sweep", "none:0"]
    assert module.main(common + ["--budget-s", "150"]) == 0
    text = out.read_text()
    assert "| prolong |" in text and "| sft |" in text and "Not run" not in text
    clock[0] = 0.0
    assert module.main(common + ["--budget-s", "90"]) == 0
    text = out.read_text()
    assert "| prolong |" not in text and "| sft |" not in text
    assert "Not run" in text and "prolong W=2 ring" in text and "sft W=2 ring" in text


def test_bench_emulated_prices_nodes_and_runs_two_dimensional_backends(tmp_path, monkeypatch, capsys):
    """--node-size / --inter-node-gbps price every step on two link tiers, and the rows give the bytes inside a node
    and between nodes; --backends takes ulysses_<outer> with --ulysses-size, and refuses it without."""
    monkeypatch.setenv("HF_LONGCTX_CACHE", str(tmp_path / "cache"))
    module = load_script()
    from hf_longctx.comm.links import LinkTiers
    from hf_longctx.lab.emulation import runner

    real = runner.emulate_step
    asked = []

    def spy(*args, tiers=None, **kwargs):
        asked.append((args[3], kwargs.get("options"), tiers))
        return real(*args, tiers=tiers, **kwargs)

    monkeypatch.setattr(runner, "emulate_step", spy)
    out = tmp_path / "emulated.md"
    common = ["--quick", "--out", str(out), "--worlds", "4", "--mixes", "sft", "--eps-sweep", "none:0"]
    assert module.main(common + ["--backends", "ulysses_ring"]) == 2
    assert "give its --ulysses-size" in capsys.readouterr().err and not asked
    assert module.main(common + ["--backends", "ring,ulysses_ring,ulysses_cad", "--ulysses-size", "2",
                                 "--node-size", "2", "--inter-node-gbps", "25"]) == 0
    tiers = LinkTiers(node_size=2, inter_node_bytes_per_s=25e9)
    assert {b for b, _, _ in asked} == {"ring", "ulysses_ring", "ulysses_cad"}
    assert all(t == tiers for _, _, t in asked)
    assert all(o == {"ulysses_size": 2} for b, o, _ in asked if b.startswith("ulysses_"))
    text = out.read_text()
    assert "nodes of 2 GPUs" in text and "25 GB/s per GPU between nodes" in text and "Error" not in text
    header = next(line for line in text.splitlines() if line.startswith("| mix |")).split(" | ")
    intra, inter = header.index("max MiB intra-node/rank"), header.index("max MiB inter-node/rank")
    rows = {line.split(" | ")[4]: line.split(" | ") for line in text.splitlines() if line.startswith("| sft |")}
    assert set(rows) == {"ring", "ulysses_ring U=2", "ulysses_cad U=2"}
    for label, cells in rows.items():
        assert len(cells) == len(header), label
        assert float(cells[intra]) > 0 and float(cells[inter]) > 0, label  # W = 4 in nodes of 2: both tiers

    asked.clear()
    assert module.main(common + ["--backends", "ring"]) == 0  # no tiers asked: one node, no node columns
    assert [t for _, _, t in asked] == [None, None] and "intra-node" not in out.read_text()
