"""A CAD schedule made again on what one run of it measured: each task priced with its server's measured error.

Why: a launch cost model (:mod:`.launch_cost`) prices each server's kernel calls to about a percent, and that
error is a property of each server's calls, not of the timing: the same schedules measured again on other machines
of the same kind differ by less run to run, and their errors against the price correlate strongly (measured:
bench/results/2026-11-29_cad-fa4.md). Over W servers the busiest then runs about ``sqrt(2 ln W)`` errors above its price
(2.9 at 64), so schedules predicted within 1% of the mean measure a few percent above it
(bench/results/2026-12-01_cad-calibrated.md). Corrections of the model by a call's rows, keys and segments, fitted on
other steps, did not carry over to held-out batches. A batch's own calls can be timed, though: every layer of a step
runs the same schedule, and an
emulation runs it as often as asked.

Here each server's measured over predicted time (its *scale*) is given to the tasks it ran, and the refinement
(:func:`~.refine.refine_in_time`) moves work off the busiest with every server priced at its tasks' scales
(weighted by their prices): the error travels with the work that makes it, as a moved task or a part cut from one.
That is what one device emulating every rank sees, and a group of GPUs of one kind at one clock; a GPU slower than
its peers would need its error to stay with the server, which is not done here. A second measurement of the new
schedule scales its servers again (:func:`recalibrate` takes a schedule's tasks in ``options.tasks``). Every
(query row, key) pair is still computed once: only the refinement's moves change the tasks, so outputs and
gradients are those of any schedule.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from hf_longctx.backends.cad.cost_model import CostModel
from hf_longctx.backends.cad.options import CadOptions, cad_options
from hf_longctx.backends.cad.refine import refine_in_time
from hf_longctx.backends.cad.runtime import (
    _server_time,
    call_terms_for,
    cost_model_for,
    prepare,
    refine_options,
)
from hf_longctx.backends.cad.tasks import CadTask, rows_cost
from hf_longctx.layout import ShardPlan


class Recalibration(NamedTuple):
    """What :func:`recalibrate` made of one measured run."""

    tasks: list[CadTask]  # the new schedule's tasks (pass them as the options' tasks)
    scales: np.ndarray  # per server: measured over predicted time, the mean over servers 1
    before: np.ndarray  # the run's predicted per-server times, scaled (the measured times, in the model's units)
    after: np.ndarray  # the new tasks' predicted per-server times, scaled


def _checked(measured: Sequence[float], servers: int) -> np.ndarray:
    measured = np.asarray(measured, dtype=float).reshape(-1)
    if measured.size != servers:
        raise ValueError(f"recalibrate: {measured.size} measured times for {servers} servers; measure every "
                         "server of the schedule (one time per rank, in rank order)")
    if not np.isfinite(measured).all() or (measured < 0).any():
        raise ValueError("recalibrate: measured times must be finite and >= 0 (kernel time per server)")
    return measured


def server_scales(measured: Sequence[float], predicted: Sequence[float]) -> np.ndarray:
    """Each server's measured over predicted time, divided by the mean of those ratios (so that scaled prices stay in
    the model's units). A server with no predicted or no measured time has nothing to scale: it takes the median of
    the others' (1 where none has both)."""
    measured, predicted = _checked(measured, len(predicted)), np.asarray(predicted, dtype=float)
    known = (measured > 0) & (predicted > 0)
    if not known.any():
        return np.ones_like(measured)
    ratio = np.where(known, measured / np.where(known, predicted, 1.0), 0.0)
    ratio[~known] = np.median(ratio[known])
    return ratio / ratio.mean()


class TaskScales:
    """The scale of any task cut from, or merged of, the measured schedule's tasks: the scales of the measured tasks
    whose (rows, keys) it overlaps, weighted by the rows they share (1 where it overlaps none)."""

    def __init__(self, tasks: Sequence[CadTask], scales: np.ndarray) -> None:
        self.by_piece: dict[tuple[int, int], list[tuple[CadTask, float]]] = defaultdict(list)
        for t in tasks:
            self.by_piece[t.owner, t.piece].append((t, float(scales[t.server])))

    def of(self, task: CadTask) -> float:
        weight = total = 0.0
        for t, scale in self.by_piece.get((task.owner, task.piece), ()):
            rows = min(t.q_end, task.q_end) - max(t.q_start, task.q_start)
            keys_meet = (t.key_hi < 0 or t.key_hi > task.key_lo) and (task.key_hi < 0 or task.key_hi > t.key_lo)
            if rows > 0 and keys_meet:
                weight, total = weight + rows, total + rows * scale
        return total / weight if weight else 1.0


def scaled_server_cost(plan: ShardPlan, options: CadOptions | dict, model: CostModel, scales: TaskScales):
    """A server's time as the refinement prices it (:func:`~.runtime._server_time`), times the mean scale of its
    tasks weighted by their prices."""
    options = cad_options(options)
    terms = call_terms_for(options, model)

    def cost(tasks: Sequence[CadTask]) -> float:
        if not tasks:
            return 0.0
        weights = [rows_cost(plan, t, t.q_start, t.q_end, model) for t in tasks]
        scale = float(np.average([scales.of(t) for t in tasks], weights=weights)) if sum(weights) > 0 else 1.0
        return scale * _server_time(plan, tasks, options, model, terms)

    return cost


def recalibrate(plan: ShardPlan, options: CadOptions | dict, measured: Sequence[float]) -> Recalibration:
    """The schedule of ``plan`` under ``options`` (its ``tasks`` when given, else :func:`~.runtime.cad_schedule`'s)
    refined with every task priced at its server's measured (one kernel time per server, any unit) over predicted
    time (:func:`server_scales`, :class:`TaskScales`). The refinement takes the schedule's own options
    (``key_cuts``, ``refine_chains``, ``refine_screen``). Meant for a measured cost model (``cost_model``
    a model file or object); on FLOPs the scales carry the whole of the kernel's shape effects."""
    options = cad_options(options)
    measured = _checked(measured, plan.world_size)  # before the schedule is made or priced
    model = cost_model_for(plan, options)
    tasks = [t for t in prepare(plan, options).tasks if t.q_end > t.q_start]
    terms = call_terms_for(options, model)
    raw = np.array([_server_time(plan, ts, options, model, terms) if ts else 0.0
                    for ts in _per_server(tasks, plan.world_size)])
    scales = server_scales(measured, raw)
    cost = scaled_server_cost(plan, options, model, TaskScales(tasks, scales))
    moved = refine_in_time(plan, tasks, model, cost, **refine_options(options))
    after = np.array([cost(ts) for ts in _per_server(moved, plan.world_size)])
    return Recalibration(moved, scales, raw * scales, after)


def _per_server(tasks: Sequence[CadTask], world: int) -> list[list[CadTask]]:
    out: list[list[CadTask]] = [[] for _ in range(world)]
    for t in tasks:
        out[t.server].append(t)
    return out
