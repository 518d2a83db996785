"""CAD's schedule made again on what a run of it measured (:mod:`hf_longctx.lab.cad.calibrate`).

A cost model misprices some servers' calls by a few percent, the same every time those calls run: the busiest
server then runs above its price, whatever the schedule predicted. Given each server's measured kernel time, the
schedule is refined with every task priced at its server's measured over predicted time. It must lower the busiest
server's true time where the model alone cannot see it, keep every (query row, key) pair computed once, and leave
outputs and gradients those of one device.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from hf_longctx.backends.cad.cost_model import ProfiledCostModel
from hf_longctx.backends.cad.options import CadOptions
from hf_longctx.backends.cad.runtime import _server_time, cad_schedule, call_terms_for
from hf_longctx.backends.cad.scheduler import verify_schedule, with_tasks
from hf_longctx.backends.cad.tasks import CadTask, all_pieces, docs_per_rank, rows_cost
from hf_longctx.lab.cad.calibrate import TaskScales, recalibrate, server_scales
from hf_longctx.lab.emulation.workloads import doc_lengths
from hf_longctx.layout import PackedBatch, shard_plan

H200 = ProfiledCostModel.load(Path(__file__).with_name("h200_torch_flash_launch_profile.json"), interpolate="rate")


def test_scales_are_measured_over_predicted_with_mean_one_and_servers_without_work_take_the_median():
    scales = server_scales([2.0, 3.3, 0.0, 4.0], [1.0, 1.5, 0.0, 2.0])  # ratios 2.0, 2.2, (none), 2.0
    assert scales == pytest.approx(np.array([2.0, 2.2, 2.0, 2.0]) / 2.05)
    assert server_scales([0.0, 0.0], [1.0, 2.0]) == pytest.approx([1.0, 1.0])  # nothing measured: unscaled
    with pytest.raises(ValueError, match="3 measured times for 4 servers"):
        server_scales([1.0, 1.0, 1.0], [1.0] * 4)
    with pytest.raises(ValueError, match="finite and >= 0"):
        server_scales([1.0, float("nan")], [1.0, 1.0])


def true_times(plan, tasks, options, slow: dict[int, float]) -> np.ndarray:
    """What each server's calls take on a 'device' that runs the segments of the documents in ``slow`` that much
    slower than the model prices them (the model's error, a property of those calls)."""
    terms = call_terms_for(options, H200)
    out = []
    for s in range(plan.world_size):
        ts = [t for t in tasks if t.server == s and t.q_end > t.q_start]
        over = sum((slow.get(all_pieces(plan)[t.owner][t.piece][0].doc, 1.0) - 1.0)
                   * rows_cost(plan, t, t.q_start, t.q_end, H200) for t in ts)
        out.append(_server_time(plan, ts, options, H200, terms) + over if ts else 0.0)
    return np.array(out)


@pytest.mark.parametrize("mix,tokens,world,seed", [("pretrain", 128 << 10, 5, 2), ("sft", 64 << 10, 4, 1)])
def test_servers_the_model_underprices_are_lowered_once_their_times_are_measured(mix, tokens, world, seed):
    batch = PackedBatch.from_doc_lens(doc_lengths(mix, tokens, seed=seed))
    plan = shard_plan(batch, world, "cad")
    options = CadOptions(eps=0.01, cost_model=H200)
    tasks = cad_schedule(plan, options).tasks
    longest = np.argsort(batch.doc_lens)[::-1]
    slow = {int(longest[0]): 1.08, int(longest[2]): 1.05}  # two documents' segments run 8% and 5% over their price
    measured = true_times(plan, tasks, options, slow)
    imbalance = measured.max() / measured.mean()
    assert imbalance > 1.02, "the model's schedule is not off: the test tests nothing"

    rec = recalibrate(plan, options, measured)
    assert rec.scales.mean() == pytest.approx(1.0) and rec.scales.max() > 1.01
    assert rec.before / rec.before.mean() == pytest.approx(measured / measured.mean())  # the scaled price is the time
    after = true_times(plan, rec.tasks, options, slow)
    assert after.max() / after.mean() < min(1.008, imbalance - 0.01), (imbalance, after.max() / after.mean())
    assert after.max() / after.mean() == pytest.approx(rec.after.max() / rec.after.mean(), abs=0.002)  # as predicted
    assert after.sum() == pytest.approx(measured.sum(), rel=0.03)  # work moved, not dropped
    docs = docs_per_rank(plan)
    verify_schedule(docs, with_tasks(docs, cad_schedule(plan, options), rec.tasks, H200), H200)  # every row once

    # measured as priced: nothing to correct, the schedule stays (the refinement found no move before)
    unchanged = recalibrate(plan, options, true_times(plan, tasks, options, {}))
    assert sorted(map(repr, unchanged.tasks)) == sorted(map(repr, tasks))
    # a second round starts from the first's tasks (options["tasks"]) and its own measurement
    again = recalibrate(plan, replace(options, tasks=rec.tasks), after)
    final = true_times(plan, again.tasks, options, slow)
    assert final.max() <= after.max() * (1 + 1e-9)


def test_a_task_cut_from_or_merged_of_measured_tasks_takes_their_scales_by_the_rows_they_share():
    measured = [CadTask(0, 0, 0, 100, 0), CadTask(0, 0, 100, 200, 1), CadTask(0, 0, 200, 300, 1, key_lo=0, key_hi=50),
                CadTask(0, 0, 200, 300, 2, key_lo=50)]
    scales = TaskScales(measured, np.array([1.0, 1.1, 0.9]))
    assert scales.of(CadTask(0, 0, 20, 60, 3)) == pytest.approx(1.0)  # a cut of a task of server 0
    assert scales.of(CadTask(0, 0, 50, 150, 3)) == pytest.approx(1.05)  # half of server 0's rows, half of 1's
    assert scales.of(CadTask(0, 0, 200, 300, 3, key_lo=0, key_hi=20)) == pytest.approx(1.1)  # the rectangle's keys
    assert scales.of(CadTask(0, 0, 250, 300, 3, key_lo=60)) == pytest.approx(0.9)  # past it
    assert scales.of(CadTask(1, 0, 0, 10, 3)) == 1.0  # a piece nothing measured


def test_a_recalibrated_schedule_still_computes_what_one_device_does():
    """A slow server gives work away on the measured times: every rank's outputs and q/k/v gradients equal the
    fp64 reference over the whole batch."""
    from test_cad_call_split import DOC_LENS, assert_ranks_equal_one_device, make_tensors, single_device
    from test_cad_refine import tailed_grid_model

    from hf_longctx.lab.emulation import emulate_step

    world = 3
    batch = PackedBatch.from_doc_lens(DOC_LENS)
    q, k, v, dout = make_tensors(batch, seed=5)
    want = single_device(batch, q, k, v, dout)
    model = tailed_grid_model()
    options = CadOptions(eps=0.0, min_shard=16, cost_model=model)
    plan = shard_plan(batch, world, "cad")
    first = cad_schedule(plan, options).tasks
    terms = call_terms_for(options, model)
    priced = [_server_time(plan, [t for t in first if t.server == s], options, model, terms) for s in range(world)]
    measured = np.array(priced) * np.array([1.0, 1.0, 1.5])  # server 2's calls run half again as long
    tasks = recalibrate(plan, options, measured).tasks
    assert {t.server for t in tasks if t not in first} and len(tasks) >= len(first), "nothing moved"
    step = emulate_step(batch, world, (q, k, v, dout), "cad", options=replace(options, tasks=tasks),
                        kernel="reference", keep_results=True)
    assert_ranks_equal_one_device(step, plan, want)


def test_bad_options_or_measurements_are_refused_before_any_pricing():
    plan = shard_plan(PackedBatch.from_doc_lens([64, 32, 32]), 2, "cad")
    with pytest.raises(ValueError, match="eps must be a number"):
        recalibrate(plan, {"eps": -1.0}, [1.0, 1.0])
    with pytest.raises(ValueError, match="1 measured times for 2 servers"):
        recalibrate(plan, {"cost_model": H200}, [1.0])
