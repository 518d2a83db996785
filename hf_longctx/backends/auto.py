"""``backend="auto"``: measure the candidate backends on the real inputs and keep the fastest.

Whether TASP's multi-ring all_to_all beats a ring of point-to-point transfers depends on the fabric
(a fully connected mesh of links favours TASP, a switch that already gives one ring the whole GPU
bandwidth does not), on the message size, and on how much compute there is to hide transfers
behind (TASP's paper: it helps when compute/communication is below ~1.5). No formula captures the
fabric, so the first call for a problem shape times one forward of every candidate on the actual
q/k/v, takes each candidate's slowest rank (an all_reduce MAX, so every rank sees the same numbers
and picks the same backend), and caches the verdict per group, shape and sliding window (a window
changes what travels and what is computed, so layers with different windows get verdicts of their
own). Later calls cost nothing.

Candidates are the registered backends that name the plan's placement in their
``auto_candidate_for`` and are exact for it, in registration order: ``zigzag`` and ``tasp`` on
zig-zag placements, ``ring``, ``distfa`` and ``tasp`` on contiguous ones (ring and zigzag run the
same rotation schedule, so each placement lists only one of them). The verdict and its timings are
logged at INFO level and kept in the :class:`Verdicts` of the registered ``auto`` backend
(:func:`auto_decisions`).
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..comm.collectives import all_reduce_max
from ..layout import ShardPlan
from .contract import Backend, ForwardProbe
from .engine import RunContext
from .registry import registered_backends

log = logging.getLogger(__name__)


class Verdicts:
    """The backends ``auto`` chose in this process, by problem key, with the timings that decided."""

    def __init__(self) -> None:
        self._by_key: dict[tuple, dict] = {}

    def get(self, key: tuple) -> str | None:
        verdict = self._by_key.get(key)
        return None if verdict is None else verdict["backend"]

    def record(self, key: tuple, backend: str, seconds: dict[str, float], reason: str = "") -> None:
        self._by_key[key] = {"backend": backend, "seconds": seconds, "reason": reason}

    def rows(self) -> list[dict]:
        """Every verdict: backend chosen, candidates' seconds, why, key."""
        return [dict(v, key=k) for k, v in self._by_key.items()]

    def clear(self) -> None:
        self._by_key.clear()


class AutoBackend(Backend):
    """Backend ``auto``: never runs itself; :meth:`resolve` names the candidate measured fastest.

    Its load is each rank's own queries against every key: its candidates share the placement's
    per-rank query work.
    """

    name = "auto"
    summary = ("measures tasp against zigzag on zig-zag placements and against ring and distfa on contiguous "
               "ones, once per shape; keeps the fastest")
    default_strategy = "zigzag"
    chooses_backend = True

    def __init__(self) -> None:
        self.verdicts = Verdicts()

    def resolve(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: ShardPlan,
                group: dist.ProcessGroup | None, probe: ForwardProbe) -> str:
        return choose_backend(q, k, v, plan, group, probe, verdicts=self.verdicts)

    def forward(self, run: RunContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        raise RuntimeError("backend 'auto' runs the candidate it resolves to, never itself")

    def backward(self, run: RunContext, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor):
        raise RuntimeError("backend 'auto' runs the candidate it resolves to, never itself")


AUTO = AutoBackend()


def auto_decisions() -> list[dict]:
    """Every verdict of this process: backend chosen, candidates' forward seconds (slowest rank), key."""
    return AUTO.verdicts.rows()


def reset_auto_decisions() -> None:
    AUTO.verdicts.clear()


def record_verdict(q, k, plan: ShardPlan, group, backend: str, seconds: dict[str, float], reason: str,
                   verdicts: Verdicts | None = None) -> None:
    """Decide ``auto`` for this problem in advance, e.g. from W ranks emulated on one device
    (:func:`hf_longctx.lab.emulation.choose.decide_auto`) or a cost model: its first call then runs ``backend``
    without timing the candidates on the group. Every rank must record the same verdict."""
    verdicts = AUTO.verdicts if verdicts is None else verdicts
    verdicts.record(_decision_key(q, k, plan, group), backend, dict(seconds), reason)
    log.info("hf_longctx auto backend: %s for %d tokens on %d ranks, decided in advance: %s", backend,
             plan.batch.num_tokens, plan.world_size, reason)


def candidates_for(plan: ShardPlan) -> list[str]:
    """Registered backends that are ``auto`` candidates for ``plan``'s placement and exact for it."""
    names = [b.name for b in registered_backends()
             if plan.strategy in b.auto_candidate_for and plan.strategy in b.strategies]
    if not names:
        placements = sorted({s for b in registered_backends() for s in b.auto_candidate_for})
        raise ValueError(f"backend 'auto' has no candidate for plan strategy {plan.strategy!r}; use one of "
                         f"{placements} or name a backend")
    return names


def _size_bucket(tokens: int) -> int:
    """Verdicts are shared between plans of similar length (powers of two): packed batches vary."""
    return 1 << max(0, math.ceil(math.log2(max(1, tokens))))


def _group_key(group) -> object:
    """The group in a verdict's key: a weak reference where the group takes one (a verdict must not outlive its
    group and pass to a later group at the same address, whose ranks would then disagree on whether to time the
    candidates and deadlock in the collectives), else the group itself."""
    if group is None:
        return None
    try:
        return weakref.ref(group)
    except TypeError:
        return group


def _decision_key(q: torch.Tensor, k: torch.Tensor, plan: ShardPlan, group: dist.ProcessGroup | None) -> tuple:
    return (_group_key(group), plan.world_size, plan.strategy, _size_bucket(plan.batch.num_tokens), plan.window,
            tuple(q.shape[1:]), tuple(k.shape[1:]), q.dtype, q.device.type)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest_rank(seconds: list[float], device: torch.device, group: dist.ProcessGroup | None) -> list[float]:
    t = torch.tensor(seconds, dtype=torch.float64, device=device)
    all_reduce_max(t, group)
    return t.tolist()


def time_forward(run_forward: Callable[[str], object], device: torch.device, reps: int = 2) -> float:
    """Median wall seconds of ``run_forward()`` after one warm-up call (device synchronised)."""
    run_forward()
    times = []
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        run_forward()
        _sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _pick(names: list[str], seconds: list[float], margin: float) -> str:
    """The first candidate (the plain ring of the placement) unless another is faster by ``margin``.

    Timings of near-equal candidates are noise (at two ranks TASP IS a ring): a tie keeps the simpler
    backend, so the verdict does not flip between runs.
    """
    best = min(range(len(names)), key=lambda i: (seconds[i], i))
    return names[best] if seconds[best] < (1.0 - margin) * seconds[0] else names[0]


def choose_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: ShardPlan,
                   group: dist.ProcessGroup | None, forward: ForwardProbe,
                   timer: Callable[[Callable[[], object], torch.device], float] | None = None,
                   margin: float = 0.03, verdicts: Verdicts | None = None) -> str:
    """The fastest candidate for this problem; ``forward(backend)`` runs one forward of it.

    Every rank of ``group`` must call this at the same point (it issues collectives); all get the
    same answer. ``timer`` replaces :func:`time_forward` (tests use it to impose timings); another
    candidate replaces the first only when it is faster by more than ``margin``. ``verdicts`` caches
    the result (default: those of the registered ``auto`` backend).
    """
    verdicts = AUTO.verdicts if verdicts is None else verdicts
    key = _decision_key(q, k, plan, group)
    cached = verdicts.get(key)
    if cached is not None:
        return cached
    names = candidates_for(plan)
    if plan.world_size == 1 or len(names) == 1:
        chosen, seconds = names[0], [0.0] * len(names)
    else:
        timer = timer or time_forward
        with torch.no_grad():
            local = [timer(lambda b=b: forward(b), q.device) for b in names]
        seconds = _slowest_rank(local, q.device, group)
        chosen = _pick(names, seconds, margin)
    reason = ("only candidate" if len(names) == 1 or plan.world_size == 1 else
              f"fastest forward on the group (slowest rank), by more than {margin:.0%} or the first candidate")
    verdicts.record(key, chosen, dict(zip(names, seconds)), reason)
    log.info("hf_longctx auto backend: %s for %d tokens on %d ranks (forward seconds, slowest rank: %s)", chosen,
             plan.batch.num_tokens, plan.world_size,
             ", ".join(f"{n}={s * 1e3:.2f} ms" for n, s in zip(names, seconds)))
    return chosen
