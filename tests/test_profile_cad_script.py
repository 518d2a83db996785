"""``scripts/lab/profile_cad.py`` profiles, saves, and checks a profile against shapes off its grid (CPU smoke run)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from hf_longctx.backends.cad.cost_model import ProfiledCostModel
from hf_longctx.lab.cad.profiled import random_shapes

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "lab" / "profile_cad.py"
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


def test_launch_fit_refuses_a_kernel_without_a_launch_grid(tmp_path, capsys):
    """``--launch N`` needs a kernel that declares its launch grid: the CPU's reference kernel does not, and the
    script says so instead of fitting anything."""
    assert _script().main([*TINY, "--out", str(tmp_path / "l.json"), "--launch", "8"]) == 2
    assert "declares no launch grid" in capsys.readouterr().err
    assert not (tmp_path / "l.json").exists()


def _script_with_a_cpu_launch_grid(monkeypatch):
    """The script, with a launch grid given to the CPU kernel and random calls shrunk to CPU sizes: (script, grid)."""
    from hf_longctx.kernels.launch import LaunchGrid
    from hf_longctx.lab.cad import call_profile

    script = _script()
    grid = LaunchGrid(forward_tile=(16, 8), backward_tile=(8, 16), slots=4)
    monkeypatch.setattr(script, "launch_grid", lambda kernel, device, head_dim, shape=None: grid)
    real = call_profile.random_calls
    monkeypatch.setattr(call_profile, "random_calls", lambda count, seed=0, **kw: real(count, seed, scale=1 / 256))
    servers = call_profile.cad_server_calls  # a few server calls of tiny batches (the CPU kernel times them)
    monkeypatch.setattr(call_profile, "cad_server_calls", lambda model, count, seed=0, scale=1.0, batches=(), **kw:
                        servers(model, min(count, 6), seed, 1 / 256, (("sft", 2048, 4),), rounds=1))
    from hf_longctx.lab.emulation import step_calls

    steps = step_calls.time_step_calls  # one tiny step (the CPU kernel runs it)
    monkeypatch.setattr(step_calls, "time_step_calls", lambda options, kernel, device, batches, *a, seeds=(), **kw:
                        steps(options, kernel, device, (("sft", 1024, 4),), *a, seeds=seeds[:1], reps=1))
    return script, grid


def test_launch_fit_writes_a_launch_cost_model(tmp_path, monkeypatch, capsys):
    """With a launch grid (here given to the CPU kernel), the script fits, saves and reports the held-out error."""
    from hf_longctx.backends.cad.launch_cost import LaunchCostModel

    script, grid = _script_with_a_cpu_launch_grid(monkeypatch)
    out = tmp_path / "l.json"
    assert script.main([*TINY, "--out", str(out), "--launch", "12"]) == 0
    model = LaunchCostModel.load(out)
    assert model.launch == grid and model.heads == 2
    assert "held-out error" in capsys.readouterr().out
    meta = json.loads(out.read_text())["meta"]
    assert 0 < meta["server_calls"] <= 6  # and calls of CAD's servers, fitted too
    assert meta["step_calls"] and set(meta["held_out_step_error_std"]) == {"forward", "backward"}  # and in a step
    assert script.main([*TINY, "--out", str(out), "--launch", "12", "--server-calls", "0", "--step-seeds", ""]) == 0
    meta = json.loads(out.read_text())["meta"]
    assert meta["server_calls"] == 0 and meta["step_calls"] == []


def test_a_saved_profile_is_fitted_again_on_another_grid_without_the_device(tmp_path, monkeypatch, capsys):
    """``--refit``: the profile's timed calls, kept in its metadata, fitted again with a backward minimum of steps:
    the same calls, the grid changed, the short-steps term now fitted; a model without its calls is refused."""
    from hf_longctx.backends.cad.launch_cost import LaunchCostModel

    script, grid = _script_with_a_cpu_launch_grid(monkeypatch)
    out, again = tmp_path / "l.json", tmp_path / "again.json"
    assert script.main([*TINY, "--out", str(out), "--launch", "12"]) == 0
    assert script.main(["--load", str(out), "--refit", str(again), "--backward-min-steps", "4"]) == 0
    refitted, saved = LaunchCostModel.load(again), json.loads(again.read_text())
    assert refitted.launch.backward_min_steps == 4 and refitted.launch.forward_tile == grid.forward_tile
    assert saved["meta"]["timed"] == json.loads(out.read_text())["meta"]["timed"]
    assert "fitted again (backward_min_steps 4)" in capsys.readouterr().out
    assert script.main(["--load", str(again), "--refit", str(tmp_path / "none.json"), "--backward-min-steps", "0"]) == 0
    assert LaunchCostModel.load(tmp_path / "none.json").launch.backward_min_steps is None
    bare = json.loads(out.read_text())
    del bare["meta"]["timed"]
    (tmp_path / "bare.json").write_text(json.dumps(bare))
    assert script.main(["--load", str(tmp_path / "bare.json"), "--refit", str(tmp_path / "x.json")]) == 2
    assert "holds them" in capsys.readouterr().err


def test_a_launch_model_is_checked_along_sweep_lines(tmp_path, monkeypatch, capsys):
    """``--sweep`` after ``--launch N`` (or on ``--load`` of a saved launch model) times single-segment calls along
    each named line and prints measured against predicted per phase, then the line's error spread."""
    script, _ = _script_with_a_cpu_launch_grid(monkeypatch)
    out = tmp_path / "l.json"
    small = ["--scale", "0.25"]
    assert script.main([*TINY, "--out", str(out), "--launch", "12", "--sweep", "waves", *small]) == 0
    printed = capsys.readouterr().out
    assert printed.count("sweep waves q ") == 32 and "sweep waves: 32 calls, forward error std" in printed
    assert script.main([*TINY, "--load", str(out), "--sweep", "prefix,square", *small]) == 0
    printed = capsys.readouterr().out
    assert "sweep prefix: 29 calls" in printed and "sweep square: 16 calls" in printed


def test_a_launch_model_is_checked_on_long_prefixes_beside_short_documents(tmp_path, monkeypatch, capsys):
    """``--mix`` times every pair one call and two and prints what one call costs more, measured and predicted,
    then its range per prefix length."""
    script, _ = _script_with_a_cpu_launch_grid(monkeypatch)
    out = tmp_path / "l.json"
    assert script.main([*TINY, "--out", str(out), "--launch", "12"]) == 0
    capsys.readouterr()
    assert script.main([*TINY, "--load", str(out), "--mix", "--scale", "0.0625"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("mix q ") == 48 and printed.count("one call minus two") == 48 + 4
    assert printed.count("mix kv ") == 4  # one range per prefix length


def test_dumped_calls_of_an_emulated_step_are_priced_per_server(tmp_path, capsys):
    """``--calls`` prices ``bench_emulated.py --dump-calls`` output with a loaded launch model, server by server
    and phase by phase, without timing anything; without a launch model it says what to give."""
    from test_cad_launch_cost import H200, _dump_with_errors

    model, dump = tmp_path / "launch.json", tmp_path / "step.json"
    H200.save(model)
    errors = {(0, "forward"): 0.10, (0, "backward"): 0.0, (1, "forward"): -0.05, (1, "backward"): 0.02}
    dump.write_text(json.dumps(_dump_with_errors(H200, errors)))
    assert _script().main(["--load", str(model), "--calls", str(dump)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("server ") == 2 and "(measured +10.0% over)" in printed and "(measured -5.0% over)" in printed
    assert "calls: 2 servers, forward measured over predicted: mean +2.5%" in printed
    assert _script().main(["--calls", str(dump)]) == 2
    assert "give --load LAUNCH_MODEL.json" in capsys.readouterr().err


def test_a_dumped_step_is_replayed_call_by_call_beside_its_step_and_price(tmp_path, capsys):
    """``--calls DUMP --replay`` times each call again alone (here the CPU's reference kernel, a smoke run) and
    prints the calls far off, each server's three times, the spreads and the step's max/mean three ways; with
    ``--key-split``, each server's forward also split, and what the split changes."""
    from test_cad_launch_cost import H200, _dump_with_errors

    model, dump = tmp_path / "launch.json", tmp_path / "step.json"
    H200.save(model)
    dump.write_text(json.dumps(_dump_with_errors(H200, dict.fromkeys([(r, p) for r in (0, 1)
                                                                      for p in ("forward", "backward")], 0.0))))
    args = ["--load", str(model), "--calls", str(dump), "--replay", "--device", "cpu", "--dtype", "fp32",
            "--warmup", "0", "--reps", "1"]
    assert _script().main(args) == 2
    assert "the dump names no kernel; give --kernel" in capsys.readouterr().err
    assert _script().main([*args, "--kernel", "reference"]) == 0
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert sum(line.startswith("server ") for line in lines) == 2 and printed.count(", alone/priced: mean") == 2
    assert "replayed 8 calls of 2 servers" in printed and "on the CPU" in printed
    assert "per-server max/mean: step" in printed
    # --key-split: the forward calls timed again as chunks of their keys, beside them whole
    assert _script().main([*args, "--kernel", "reference", "--key-split"]) == 0
    printed = capsys.readouterr().out
    assert sum(line.startswith("server ") and "forward whole" in line for line in printed.splitlines()) == 2
    assert "split forward calls, alone/priced: mean" in printed
    assert "forward over all servers: whole" in printed and "max/mean alone with the forward whole" in printed


def test_sweep_mistakes_are_refused_before_anything_is_timed(tmp_path, capsys):
    """A sweep needs a launch model, a launch model loaded needs a sweep, and a line must exist."""
    script = _script()
    assert script.main([*TINY, "--out", str(tmp_path / "p.json"), "--sweep", "waves"]) == 2
    assert "--sweep checks a launch cost model" in capsys.readouterr().err
    assert script.main([*TINY, "--out", str(tmp_path / "p.json"), "--mix"]) == 2
    assert "--mix checks a launch cost model" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()
    with pytest.raises(SystemExit):
        script.main([*TINY, "--sweep", "diagonal"])
    assert "unknown sweep 'diagonal'" in capsys.readouterr().err


def test_cad_balance_is_predicted_with_and_without_key_cuts_on_the_cpu(tmp_path, capsys):
    """``--predict`` prices CAD's schedules of the emulation mixes with a loaded launch model, with and without
    key cuts, on the CPU: a ProLong batch at 64 servers, whose longest documents' last rows only key cuts can
    split, is predicted better balanced with them, and each schedule says how long it took."""
    from test_cad_launch_cost import H200

    model = tmp_path / "launch.json"
    H200.save(model)
    assert _script().main(["--load", str(model), "--predict", "prolong:128k:64", "--seeds", "1"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("predict prolong 128k W=64 seeds 1: without ")
    without, with_cuts = line.split("without ")[1].split("; with key cuts ")
    assert float(with_cuts.split()[0]) < float(without.split()[0]) and "rect.)" in with_cuts
    assert without.endswith(" s]") and with_cuts.endswith(" s]")  # each schedule's seconds on this host
    assert _script().main(["--predict", "prolong:128k:64"]) == 2
    assert "give --load LAUNCH_MODEL.json" in capsys.readouterr().err


def test_a_launch_model_is_checked_on_blocks_at_chosen_launch_positions(tmp_path, monkeypatch, capsys):
    """``--placement`` times the probes of ``placement_probes``: each forward against the lone long blocks' one."""
    script, _ = _script_with_a_cpu_launch_grid(monkeypatch)
    out = tmp_path / "l.json"
    assert script.main([*TINY, "--out", str(out), "--launch", "12"]) == 0
    capsys.readouterr()
    assert script.main([*TINY, "--load", str(out), "--placement", "--scale", "0.0625"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 20 and printed[0].startswith("placement lone (2 blocks): forward ")
    assert " 1.00 x lone" in printed[0] and "1 long + 15 tiny per head (32 blocks)" in printed[11]


def test_the_paired_block_simulation_is_fitted_to_dumped_steps_on_the_cpu(tmp_path, capsys):
    """``--fit-placement`` prints the launch model's per-server forward error of each dump, then the paired-block
    simulation's fit for each ``--empty``; without a launch model it says what to give."""
    from test_cad_launch_cost import H200, _dump_with_errors

    model, dump = tmp_path / "launch.json", tmp_path / "step.json"
    H200.save(model)
    errors = {(0, "forward"): 0.10, (0, "backward"): 0.0, (1, "forward"): -0.05, (1, "backward"): 0.02}
    dump.write_text(json.dumps(_dump_with_errors(H200, errors)))
    assert _script().main(["--load", str(model), "--fit-placement", str(dump), "--empty", "0,0.5"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "launch model on step.json: per-server forward error std 7.5%"
    assert [line.split(":")[0] for line in printed[1::2]] == ["paired blocks, empty 0", "paired blocks, empty 0.5"]
    assert all(line.startswith("  step.json: ") and "per-server std" in line for line in printed[2::2])
    assert _script().main(["--fit-placement", str(dump)]) == 2
    assert "give --load LAUNCH_MODEL.json" in capsys.readouterr().err


def test_a_dumped_step_is_priced_per_server_phase_and_size_of_call(tmp_path, capsys):
    """``--calls DUMP`` on a saved launch model, on the CPU: every server's phases measured against predicted, the
    step's max/mean both ways, how much of the servers' spread each phase makes, and the error by call size."""
    from hf_longctx.backends.cad.launch_cost import PHASES, LaunchCostModel, PhaseTerms
    from hf_longctx.kernels.launch import LaunchGrid

    grid = LaunchGrid(forward_tile=(16, 8), backward_tile=(8, 16), slots=4)
    model = LaunchCostModel(grid, 2, PhaseTerms(2e-3, 1e-4, 2e-4, 1e-3, 0.0, 0.05),
                            PhaseTerms(5e-3, 3e-4, 2e-4, 2e-3, 1e-2, 0.08))
    model.save(tmp_path / "m.json")
    calls = [(0, [16], [16], 1.2), (0, [64], [512], 1.0), (1, [64], [512], 1.0), (1, [64], [512], 1.0)]
    reps = [[{"rank": rank, "phase": phase, "q_lens": q, "k_lens": k,
              "seconds": model.phase_cost(phase, q, k) / 1e3 * (slow if phase == "backward" else 1.0)}
             for rank, q, k, slow in calls for phase in PHASES]]
    (tmp_path / "d.json").write_text(json.dumps({"world": 2, "reps": reps}))
    assert _script().main(["--load", str(tmp_path / "m.json"), "--calls", str(tmp_path / "d.json")]) == 0
    printed = capsys.readouterr().out
    assert printed.count("server ") >= 2 and "calls: 2 servers" in printed
    assert "by phase: forward 0.000, backward 0." in printed
    assert "backward calls of 0-1 waves:    1, measured over predicted mean +20.0%" in printed
    assert "backward calls of 16-64 waves:    3, measured over predicted mean +0.0%" in printed
