"""CAD's server calls timed inside emulated steps, and the launch model fitted on them beside the calls timed alone."""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from test_cad_launch_cost import _fake_call_clock

from hf_longctx.backends.cad.launch_cost import PHASES, LaunchCostModel, PhaseTerms, fit_relative
from hf_longctx.backends.cad.runtime import cad_schedule, server_calls
from hf_longctx.kernels.launch import LaunchGrid
from hf_longctx.lab.cad import call_profile
from hf_longctx.lab.cad.call_profile import fit_timed_calls, profile_launch_cost, random_calls
from hf_longctx.lab.emulation import step_calls
from hf_longctx.lab.emulation.step_calls import StepCall, calls_of_logs, time_step_calls
from hf_longctx.lab.emulation.workloads import doc_lengths
from hf_longctx.layout import PackedBatch, shard_plan

GRID = LaunchGrid(forward_tile=(16, 8), backward_tile=(8, 16), slots=6)
TRUTH = {"forward": PhaseTerms(2e-3, 1e-4, 2e-4, 1e-3, 0.0, 0.05),
         "backward": PhaseTerms(5e-3, 3e-4, 2e-4, 2e-3, 1e-2, 0.08)}
BATCHES = (("sft", 4096, 4), ("prolong", 4096, 3))


def planned_step_calls(batches, seed: int, options: dict) -> Counter:
    """Every causal call, forward and backward, that CAD's servers plan for ``batches`` drawn with ``seed``
    (:func:`~hf_longctx.backends.cad.runtime.server_calls` of each server's tasks), counted."""
    planned = Counter()
    for mix, tokens, world in batches:
        plan = shard_plan(PackedBatch.from_doc_lens(doc_lengths(mix, tokens, seed=seed)), world, "cad")
        tasks = cad_schedule(plan, options).tasks
        for server in range(world):
            for q, k, causal in server_calls(plan, [t for t in tasks if t.server == server], options, None):
                if causal:
                    planned.update((phase, tuple(q), tuple(k)) for phase in PHASES)
    return planned


def test_an_emulated_steps_calls_are_the_causal_calls_cads_servers_make():
    """Each server's calls, forward and backward, as the runtime plans them for the schedule: none missing, none
    added, each with a time of its own (here the CPU's clock)."""
    options = {"cost_model": "flops", "eps": 0.1}
    timed = time_step_calls(options, "reference", torch.device("cpu"), BATCHES, heads=2, kv_heads=1, head_dim=8,
                            dtype=torch.float32, seeds=(5,), reps=2)
    assert Counter((c.phase, c.q_lens, c.k_lens) for c in timed) == planned_step_calls(BATCHES, 5, options)
    assert all(c.ms > 0 for c in timed)


def test_a_steps_calls_take_their_median_over_the_repetitions_and_leave_rectangles_out():
    """Repetitions log the same calls in another order (ranks run in threads); a key cut's rectangle is no call
    of the kind the causal launch model prices."""
    call = {"rank": 1, "phase": "backward", "q_lens": [64], "k_lens": [640], "causal": True}
    rect = {"rank": 1, "phase": "forward", "q_lens": [64], "k_lens": [256], "causal": False}
    logs = [[{**call, "seconds": s}, {**rect, "seconds": 1.0}] for s in (0.002, 0.004, 0.003)]
    logs[1].reverse()
    assert calls_of_logs(logs) == [StepCall("backward", (64,), (640,), 3.0)]


def _alone_and_in_step(in_step_factor: float) -> tuple[list, list[StepCall]]:
    """Random calls timed alone at the truth, and calls of steps that took ``in_step_factor`` times the truth."""
    model = LaunchCostModel(GRID, 2, TRUTH["forward"], TRUTH["backward"])
    alone = [(c, model.phase_cost("forward", [q for q, _ in c], [k for _, k in c]),
              model.phase_cost("backward", [q for q, _ in c], [k for _, k in c]))
             for c in random_calls(48, seed=1, scale=1 / 64)]
    steps = [StepCall(p, tuple(q for q, _ in c), tuple(k for _, k in c),
                      in_step_factor * model.phase_cost(p, [q for q, _ in c], [k for _, k in c]))
             for c in random_calls(48, seed=2, scale=1 / 64) for p in PHASES]
    return alone, steps


def test_a_call_timed_in_a_step_weighs_as_many_calls_timed_alone_as_the_step_weight_says():
    """Where the steps' calls take 10% more than the same calls alone, the fit follows the side that weighs more;
    the held-out check is kept per set."""
    alone, steps = _alone_and_in_step(1.1)
    shapes = [([q for q, _ in c], [k for _, k in c]) for c, _, _ in alone]
    truth = LaunchCostModel(GRID, 2, TRUTH["forward"], TRUTH["backward"])

    def priced_over_truth(model: LaunchCostModel) -> float:
        return sum(model.phase_cost("backward", q, k) for q, k in shapes) / \
            sum(truth.phase_cost("backward", q, k) for q, k in shapes)

    heavy, fit = fit_timed_calls(alone, GRID, 2, steps, step_weight=1e4)
    light, _ = fit_timed_calls(alone, GRID, 2, steps, step_weight=1e-4)
    assert priced_over_truth(heavy) == pytest.approx(1.1, rel=2e-3)
    assert priced_over_truth(light) == pytest.approx(1.0, rel=2e-3)
    assert set(fit["held_out_step_error_std"]) == set(PHASES)
    exact, fit = fit_timed_calls(alone, GRID, 2, _alone_and_in_step(1.0)[1])
    np.testing.assert_allclose(exact.backward.as_vector(), TRUTH["backward"].as_vector(), rtol=1e-6, atol=1e-12)
    assert max(fit["held_out_step_error_std"].values()) < 1e-9
    _, fit = fit_timed_calls(alone, GRID, 2)
    assert "held_out_step_error_std" not in fit  # no steps, no check of them


def test_the_relative_fit_weighs_rows_and_refuses_weights_it_cannot_use():
    x = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    y = np.array([1.0, 1.0, 3.0])  # the third row disagrees with the first two
    even, _ = fit_relative(x, y)
    leaning, _ = fit_relative(x, y, np.array([1.0, 1.0, 1e6]))
    assert leaning.sum() == pytest.approx(3.0, rel=1e-4) and even.sum() < 2.9
    np.testing.assert_allclose(fit_relative(x, y, np.full(3, 5.0))[0], even)  # only the ratios count
    for bad in (np.array([1.0, 0.0, 1.0]), np.ones(2)):
        with pytest.raises(ValueError, match="weight"):
            fit_relative(x, y, bad)


def test_the_profile_emulates_steps_on_its_fit_and_fits_again_on_their_calls(monkeypatch):
    """After the calls timed alone, the profile emulates CAD's steps scheduled on that fit and prices up toward
    what their calls took; every step's call is kept beside the fit."""
    monkeypatch.setattr(call_profile, "_run_ms", _fake_call_clock(TRUTH, GRID, heads=2))
    asked = []

    def slower_steps(options, kernel, device, batches, heads, kv_heads, head_dim, dtype, seeds, scale, reps):
        asked.append((options, kernel, batches, seeds, scale))
        return _alone_and_in_step(1.2)[1]

    monkeypatch.setattr(step_calls, "time_step_calls", slower_steps)
    model, meta = profile_launch_cost("reference", torch.device("cpu"), GRID, heads=2, kv_heads=1, head_dim=8,
                                      dtype=torch.float32, count=32, warmup=0, reps=1, scale=1 / 256,
                                      server_calls=0, step_seeds=(7, 8), step_batches=BATCHES)
    (options, kernel, batches, seeds, scale), = asked
    # scheduled on the fit of the calls timed alone (the truth here), as the benchmarks schedule CAD
    np.testing.assert_allclose(options["cost_model"].backward.as_vector(), TRUTH["backward"].as_vector(), rtol=1e-6)
    assert options["eps"] == 0.01 and kernel == "reference" and batches == BATCHES and seeds == (7, 8)
    assert scale == 1 / 256
    truth = LaunchCostModel(GRID, 2, TRUTH["forward"], TRUTH["backward"])
    for phase in PHASES:
        calls = [c for c in meta["step_calls"] if c["phase"] == phase]
        assert len(calls) == 48
        ratio = sum(model.phase_cost(phase, c["q_lens"], c["k_lens"]) for c in calls) / \
            sum(truth.phase_cost(phase, c["q_lens"], c["k_lens"]) for c in calls)
        assert 1.1 < ratio < 1.2, phase  # priced up toward the 20% the steps' calls took more


def test_profile_script_refits_a_saved_model_on_dumped_steps(tmp_path, capsys):
    """``--refit`` with ``--step-dumps``: the calls of emulated steps dumped by the benchmark are fitted beside the
    profile's, and kept in the refitted model."""
    spec = importlib.util.spec_from_file_location("profile_cad", Path(__file__).resolve().parents[1] / "scripts"
                                                  / "lab" / "profile_cad.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    alone, steps = _alone_and_in_step(1.1)
    saved = tmp_path / "model.json"
    model, fit = fit_timed_calls(alone, GRID, 2)
    model.save(saved, **fit, timed=[{"shapes": [list(s) for s in c], "forward": f, "backward": b}
                                    for c, f, b in alone])
    dump = tmp_path / "step.json"
    dump.write_text(json.dumps({"reps": [[{"rank": 0, "phase": c.phase, "q_lens": list(c.q_lens),
                                           "k_lens": list(c.k_lens), "causal": True, "seconds": c.ms / 1e3}
                                          for c in steps]]}))
    again = tmp_path / "again.json"
    assert script.main(["--load", str(saved), "--refit", str(again), "--step-dumps", str(dump)]) == 0
    assert f"{len(alone)} timed calls and {len(steps)} calls of steps fitted again" in capsys.readouterr().out
    meta = json.loads(again.read_text())["meta"]
    assert len(meta["step_calls"]) == len(steps) and meta["step_dumps"] == ["step.json"]
    refitted = LaunchCostModel.load(again)
    q, k = list(steps[0].q_lens), list(steps[0].k_lens)
    assert refitted.phase_cost(steps[0].phase, q, k) > 1.05 * model.phase_cost(steps[0].phase, q, k)
