"""``auto``'s choice for a W-rank group, made on one device: priced as the product prices it, the shortlist timed by
emulation instead of on the group.

Why: ``auto`` (:mod:`hf_longctx.backends.auto`) prices every candidate on the batch, shards it for the placement of
the best, and times one forward of each candidate that could win on the real group. Where no such group exists yet
(planning a W-GPU run on one GPU), the same prices, placement and shortlist come from the product's own functions,
and each shortlisted candidate's emulated step (per-rank kernel time measured, transfers priced by link tier) stands
in for the timing; :func:`~hf_longctx.backends.auto.pick` keeps the predicted best unless another is faster by more
than the margin, as the product does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from hf_longctx.backends.auto import (
    PLACEMENTS,
    AutoOptions,
    best_candidate,
    pick,
    price,
    record_verdict,
    shortlist,
)
from hf_longctx.backends.contract import Candidate
from hf_longctx.backends.prediction import AttentionShape, KernelRates, StepPrediction, measure_kernel_rates
from hf_longctx.lab.emulation.runner import EmulatedStep, emulate_step
from hf_longctx.layout import PackedBatch, shard_plan

Emulate = Callable[[Candidate], EmulatedStep]


@dataclass(frozen=True)
class Choice:
    """``auto``'s choice: the candidate, the placement it chose, every candidate's predicted step and the emulated
    steps of those it timed, and why."""

    candidate: Candidate
    placement: str
    predictions: dict[Candidate, StepPrediction]
    timed: dict[Candidate, EmulatedStep]
    reason: str

    @property
    def backend(self) -> str:
        return self.candidate.backend


def choose(batch: PackedBatch, world: int, shape: AttentionShape, rates: KernelRates, options: AutoOptions,
           emulate: Emulate, measured: Mapping[Candidate, EmulatedStep] | None = None) -> Choice:
    """``auto``'s choice for ``batch`` on ``world`` ranks: the placement of the best-priced candidate, then the
    shortlisted candidates on it emulated (``emulate(candidate)``; a step already in ``measured`` is reused) and
    :func:`~hf_longctx.backends.auto.pick` over their predicted step seconds."""
    plans = {s: shard_plan(batch, world, s) for s in PLACEMENTS}
    predictions = price(plans, shape, rates, options)
    placement = best_candidate(predictions).strategy
    timed = {}
    for candidate in shortlist(predictions, placement, options.shortlist):
        step = (measured or {}).get(candidate)
        timed[candidate] = step if step is not None else emulate(candidate)
    order = list(timed)
    chosen = order[pick([timed[c].predicted_step_s for c in order], options.margin)]
    reason = (f"{placement} placement priced best; emulated " + ", ".join(
        f"{c.label}={timed[c].predicted_step_s * 1e3:.1f} ms" for c in order))
    return Choice(chosen, placement, predictions, timed, reason)


def decide_auto(batch: PackedBatch, world: int, tensors: tuple[torch.Tensor, ...], *, kernel: str = "auto",
                options: AutoOptions | None = None, rates: KernelRates | None = None, reps: int = 1, warmup: int = 0,
                q_local: torch.Tensor | None = None, k_local: torch.Tensor | None = None, group=None) -> Choice:
    """:func:`choose` on the global ``(q, k, v, dout)`` of ``batch``, its shortlist emulated on their device with the
    link tiers of ``options``. With ``q_local``/``k_local`` (a rank's local q/k) and the rank's ``group``, the choice
    is also recorded as ``auto``'s verdict for that problem, so a real run takes it without timing anything."""
    options = options or AutoOptions()
    q, k = tensors[0], tensors[1]
    shape = AttentionShape.of(q, k)
    rates = rates or measure_kernel_rates(kernel, q.device, shape, q.dtype)
    tiers = options.tiers(world)

    def emulate(candidate: Candidate) -> EmulatedStep:
        return emulate_step(batch, world, tensors, candidate.backend, strategy=candidate.strategy,
                            options=candidate.options, kernel=kernel, reps=reps, warmup=warmup, tiers=tiers)

    choice = choose(batch, world, shape, rates, options, emulate)
    if q_local is not None and k_local is not None:
        plan = shard_plan(batch, world, choice.placement)
        record_verdict(q_local, k_local, plan, group, choice.candidate,
                       {c.label: p.step_s for c, p in choice.predictions.items() if c.strategy == choice.placement},
                       {c.label: s.predicted_step_s for c, s in choice.timed.items()},
                       f"emulated on one device: {choice.reason}", kernel)
    return choice
