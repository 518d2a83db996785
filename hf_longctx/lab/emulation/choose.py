"""Choosing a backend from emulated steps: the one predicted fastest on a real group, and why.

Why: ``auto`` (:mod:`hf_longctx.backends.auto`) times one forward of every candidate on the real group
at the first call. Where no such group exists yet (planning a W-GPU run on one GPU), the emulation's
per-rank kernel times and bytes predict the step time of each candidate instead, from the same
backend code; :func:`choose_from_steps` applies the same rule (the first candidate, the plain ring,
is kept unless another is faster by ``margin``) and states its reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from hf_longctx.backends.auto import candidates_for, record_verdict
from hf_longctx.lab.emulation.runner import EmulatedStep, emulate_step
from hf_longctx.layout import PackedBatch, shard_plan


@dataclass(frozen=True)
class Choice:
    backend: str
    reason: str
    predicted_s: dict[str, float]


def choose_from_steps(steps: Mapping[str, EmulatedStep], margin: float = 0.03) -> Choice:
    """The label of ``steps`` (insertion order: the first is the default) with the smallest predicted step
    time (slowest rank's kernels + slowest rank's transfers), unless it beats the first by less than
    ``margin``."""
    if not steps:
        raise ValueError("no emulated step to choose from")
    names = list(steps)
    seconds = {n: steps[n].predicted_step_s for n in names}
    best = min(names, key=lambda n: (seconds[n], names.index(n)))
    first = names[0]
    if best != first and seconds[best] >= (1.0 - margin) * seconds[first]:
        best = first
    s = steps[best]
    runner_up = min((n for n in names if n != best), key=lambda n: seconds[n], default=None)
    reason = (f"{best}: predicted {seconds[best] * 1e3:.1f} ms/step (slowest rank kernels "
              f"{max(s.kernel_s) * 1e3:.1f} ms, max/mean {s.imbalance:.3f}, transfers "
              f"{max(r.transfer_s for r in s.ranks) * 1e3:.1f} ms)")
    if runner_up is not None:
        reason += f"; next {runner_up} {seconds[runner_up] * 1e3:.1f} ms"
    return Choice(best, reason, seconds)


def decide_auto(batch: PackedBatch, world: int, tensors: tuple[torch.Tensor, ...], *, strategy: str = "zigzag",
                kernel: str = "auto", q_local: torch.Tensor | None = None, k_local: torch.Tensor | None = None,
                group=None, margin: float = 0.03) -> Choice:
    """Emulate ``auto``'s candidates for ``strategy`` (W ranks on one device) and choose by predicted step time.

    With ``q_local``/``k_local`` (a rank's local q/k: shapes, dtype and device decide the verdict's key) and
    the rank's ``group``, the choice is also recorded as ``auto``'s verdict for that problem
    (:func:`~hf_longctx.backends.auto.record_verdict`), so a real run takes it without timing the candidates.
    """
    plan = shard_plan(batch, world, strategy)
    steps = {name: emulate_step(batch, world, tensors, name, strategy=strategy, kernel=kernel)
             for name in candidates_for(plan)}
    choice = choose_from_steps(steps, margin)
    if q_local is not None and k_local is not None:
        record_verdict(q_local, k_local, plan, group, choice.backend, choice.predicted_s,
                       f"emulated on one device: {choice.reason}")
    return choice
