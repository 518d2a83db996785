"""How tightly CAD balances: the ``eps`` whose schedule is predicted fastest, compute against bytes.

Why: a smaller ``eps`` moves more work off the busiest server (less compute time on the critical path)
but sends more query and key rows (more transfer time). A fixed ``eps = 0.1`` ignores both. Here every
candidate schedule is priced as ``max server compute seconds + max bytes of a rank / bandwidth`` (no
overlap assumed: the bytes that ping-pong cannot hide) and the cheapest wins; ties keep the larger
eps (fewer bytes). The rule (:func:`choose_eps`) is a pure function of the candidates; the sweep
(:func:`sweep_eps`) schedules the candidates for a plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...comm.links import LINKS
from .cost_model import CostModel, FlopsCostModel, TokenBytes
from .scheduler import CadSchedule, assign_servers

EPS_CANDIDATES = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2)
ASSUMED_TFLOPS = 500.0  # fwd+bwd TFLOP/s that converts a FLOPs schedule to seconds (design document section 7: 480-600)


@dataclass(frozen=True)
class EpsCandidate:
    """One schedule of the sweep: its eps, slowest server's compute seconds and largest bytes of a rank."""

    eps: float
    compute_s: float
    max_bytes: float

    def step_seconds(self, bandwidth: float) -> float:
        """Predicted step: the slowest server's compute plus the largest rank's bytes at ``bandwidth`` B/s."""
        return self.compute_s + self.max_bytes / bandwidth


def choose_eps(candidates: Sequence[EpsCandidate], bandwidth: float) -> EpsCandidate:
    """The candidate with the smallest predicted step time; on a tie (within 1e-12 s) the larger eps."""
    if not candidates:
        raise ValueError("choose_eps needs at least one candidate")
    return min(candidates, key=lambda c: (round(c.step_seconds(bandwidth), 12), -c.eps))


def seconds_per_cost(model: CostModel) -> float:
    """Seconds per unit of ``model``'s cost: profiled models are in milliseconds of forward+backward; FLOPs
    models count forward FLOPs, run at :data:`ASSUMED_TFLOPS` forward+backward (x3.5)."""
    if isinstance(model, FlopsCostModel):
        return 3.5 / (ASSUMED_TFLOPS * 1e12)
    return 1e-3 if getattr(model, "units", "ms") == "ms" else 1.0


def candidate(sched: CadSchedule, model: CostModel) -> EpsCandidate:
    max_bytes = max(float(sched.bytes_per_rank.max(initial=0)), float(sched.bytes_per_server.max(initial=0)))
    return EpsCandidate(sched.eps, float(sched.loads.max(initial=0)) * seconds_per_cost(model), max_bytes)


def a2a_bandwidth(max_bytes: float) -> float:
    """All-to-all bandwidth for a rank's bytes, sent as two nano-batches (ping-pong)."""
    return LINKS["a2a"].at(max_bytes / 2)


def sweep_eps(docs_per_rank, world: int, model: CostModel, token_bytes: TokenBytes | None = None,
              eps_values: Sequence[float] = EPS_CANDIDATES, **knobs: int) -> tuple[CadSchedule, list[EpsCandidate]]:
    """Schedule every ``eps_values`` and keep the one :func:`choose_eps` picks; (schedule, all candidates).
    ``knobs`` (``min_shard``, ``search_width``) go to :func:`~.scheduler.assign_servers`."""
    scheds = {e: assign_servers(docs_per_rank, world, eps=e, cost_model=model, token_bytes=token_bytes, **knobs)
              for e in eps_values}
    cands = [candidate(s, model) for s in scheds.values()]
    bandwidth = a2a_bandwidth(max(c.max_bytes for c in cands))
    best = choose_eps(cands, bandwidth)
    return scheds[best.eps], cands
