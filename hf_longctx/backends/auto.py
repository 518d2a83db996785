"""``backend="auto"``: the fastest exact backend for the batch at hand, priced first, then confirmed by timing.

Which backend wins turns on the batch (long documents favour Ulysses and CAD, short ones the ring family), the
group (query heads that split over it, nodes it crosses) and the kernel, by up to 1.6x: no fixed choice serves.
``auto`` decides in two places:

1. **Before the batch is sharded** (:meth:`AutoBackend.plan_batch`, called where the placement is decided), it
   prices every candidate on the batch (:mod:`.prediction`: kernel rates measured once at launch, bytes per link
   tier) on each placement it can run on, and shards the batch for the placement of the best prediction.
   Candidates are the registered backends that name a placement in ``auto_candidate_for`` and accept the group and
   heads (:meth:`~.contract.Backend.auto_candidate_options`): ring, zigzag, distfa, tasp, Ulysses and CAD, and past
   one node the Ulysses x outer compositions with Ulysses over each node's GPUs.
2. **At the first attention call of each shape class**, it times one forward of each candidate on that placement
   whose prediction is within ``shortlist`` of the best (the slowest rank of the group decides, one all_reduce),
   keeps the fastest (the predicted best unless another is faster by more than ``margin``) and logs the verdict with
   the predicted and measured times. Later batches of the class reuse placement and verdict: they cost nothing.

A shape class is the group, its size, the batch's token count rounded up to a power of two, the attention shape,
kernel and device; a sliding window gets verdicts of its own. Every rank reaches the same verdict: the prices are
a pure function of the batch and of kernel rates all ranks agreed on, and the timings are the slowest rank's.
Each candidate is exact on its placement, so ``auto`` is exact. The verdicts are kept in the registered ``auto``
backend (:func:`auto_decisions`).

What the timing leaves out: host work that runs once per batch before the first layer (CAD makes its schedule,
TASP its routes); the forward of one layer stands for the step.
"""

from __future__ import annotations

import logging
import math
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..comm.collectives import all_reduce_max, collective_device, in_one_process
from ..comm.groups import group_rank_and_size
from ..comm.links import INTER_NODE_BYTES_PER_S, LinkTiers
from ..layout import PackedBatch, ShardPlan, shard_plan
from .contract import Backend, Candidate, ForwardProbe
from .engine import RunContext
from .options import BackendOptions
from .prediction import AttentionShape, KernelRates, StepPrediction, measure_kernel_rates, predict, time_forward
from .registry import get_backend, registered_backends

log = logging.getLogger(__name__)

PLACEMENTS = ("zigzag", "contiguous")  # the placements auto chooses between, in the order a tie keeps


@dataclass(frozen=True)
class AutoOptions(BackendOptions):
    """``auto``'s options.

    - ``node_size``: GPUs per node, ranks numbered node by node (None: the processes of this host, from
      ``LOCAL_WORLD_SIZE``, else the whole group: one node);
    - ``inter_node_gbps``: GB/s per GPU between nodes (the network tier of the link model);
    - ``shortlist``: candidates predicted within this factor of the best are timed (>= 1; 1: the prediction alone
      decides);
    - ``margin``: another candidate replaces the predicted best only when measured faster by more than this share;
    - ``candidates``: the backends ``auto`` may choose (None: every candidate).
    """

    node_size: int | None = None
    inter_node_gbps: float = INTER_NODE_BYTES_PER_S / 1e9
    shortlist: float = 1.25
    margin: float = 0.03
    candidates: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.candidates, (list, set)):  # a recipe's list; kept as one immutable copy
            object.__setattr__(self, "candidates", tuple(self.candidates))
        super().__post_init__()

    def problem(self) -> str | None:
        size = self.node_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            return f"node_size must be a whole number >= 1 (GPUs per node), got {size!r}"
        for key, least in (("inter_node_gbps", 0.0), ("shortlist", 1.0), ("margin", 0.0)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < least or (key == "inter_node_gbps" and value == 0):
                return f"{key} must be a number {'>' if key == 'inter_node_gbps' else '>='} {least:g}, got {value!r}"
        names = self.candidates
        if names is not None:
            known = {b.name for b in registered_backends() if b.auto_candidate_for}
            if isinstance(names, str) or not all(isinstance(n, str) for n in names) or not names:
                return f"candidates must be a list of backend names, got {names!r}"
            unknown = sorted(set(names) - known)
            if unknown:
                return f"candidates {unknown} are no auto candidates; choose among {sorted(known)}"
        return None

    def node_size_for(self, world: int) -> int:
        """GPUs per node for a group of ``world`` ranks."""
        if self.node_size is not None:
            return self.node_size
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        return int(local) if local.isdigit() and int(local) > 0 else world

    def tiers(self, world: int) -> LinkTiers:
        return LinkTiers(self.node_size_for(world), self.inter_node_gbps * 1e9)


# ----------------------------------------------------------------------------- pricing (pure functions)


def candidates(world: int, shape: AttentionShape, options: AutoOptions, strategies: Sequence[str] = PLACEMENTS,
               spans_world: bool = True) -> list[Candidate]:
    """The candidates on ``strategies`` for a group of ``world`` ranks, in placement then registration order.

    ``spans_world``: whether the group holds every rank of the world; backends that make process groups of their
    own at their first call (:attr:`~.contract.Backend.makes_groups`, the Ulysses x outer meshes) are candidates
    only then, since making groups needs every rank of the world, which other data-parallel groups, choosing for
    themselves, might not all bring."""
    node = options.node_size_for(world)
    out = []
    for strategy in strategies:
        for spec in registered_backends():
            if spec.chooses_backend or not spec.sequence_parallel or strategy not in spec.auto_candidate_for \
                    or strategy not in spec.strategies or (spec.makes_groups and not spans_world):
                continue
            if options.candidates is not None and spec.name not in options.candidates:
                continue
            backend_options = spec.auto_candidate_options(world, shape, node)
            if backend_options is not None:
                out.append(Candidate(spec.name, strategy, backend_options))
    return out


def price(plans: Mapping[str, ShardPlan], shape: AttentionShape, rates: KernelRates, options: AutoOptions,
          spans_world: bool = True) -> dict[Candidate, StepPrediction]:
    """Every candidate on each of ``plans`` (placement -> plan of one batch) priced: kernels under ``rates``, sends
    under ``options``' link tiers. A candidate whose backend cannot price itself is left out."""
    predictions = {}
    for strategy, plan in plans.items():
        tiers = options.tiers(plan.world_size)
        for candidate in candidates(plan.world_size, shape, options, (strategy,), spans_world):
            work = get_backend(candidate.backend).rank_work(plan, shape, candidate.options)
            if work is not None:
                predictions[candidate] = predict(candidate.backend, strategy, work, rates, tiers)
    return predictions


def best_candidate(predictions: Mapping[Candidate, StepPrediction]) -> Candidate:
    """The candidate of the fastest prediction (ties: the first)."""
    if not predictions:
        raise ValueError("backend 'auto' has no candidate to price for this group and head shape; name a backend")
    order = list(predictions)
    return min(order, key=lambda c: (predictions[c].step_s, order.index(c)))


def shortlist(predictions: Mapping[Candidate, StepPrediction], strategy: str, factor: float) -> list[Candidate]:
    """The candidates on ``strategy`` predicted within ``factor`` of the best of them, fastest prediction first."""
    mine = [c for c in predictions if c.strategy == strategy]
    if not mine:
        return []
    floor = min(predictions[c].step_s for c in mine)
    keep = [c for c in mine if predictions[c].step_s <= factor * floor]
    return sorted(keep, key=lambda c: (predictions[c].step_s, mine.index(c)))


def pick(seconds: Sequence[float], margin: float) -> int:
    """Which of the measured ``seconds`` wins: the first (the predicted best) unless another is faster by more than
    ``margin`` (measured near-ties are noise, and the prediction breaks them the same way every run)."""
    best = min(range(len(seconds)), key=lambda i: (seconds[i], i))
    return best if seconds[best] < (1.0 - margin) * seconds[0] else 0


# ----------------------------------------------------------------------------- decisions of this process


@dataclass
class Verdict:
    """``auto``'s choice for one shape class and placement: the candidate, every candidate's predicted seconds and
    the measured forward seconds of those timed (slowest rank), by label, and why."""

    candidate: Candidate
    predicted_s: dict[str, float]
    measured_s: dict[str, float]
    reason: str

    def row(self, key: tuple) -> dict:
        return {"backend": self.candidate.backend, "strategy": self.candidate.strategy,
                "options": self.candidate.options.given(), "predicted_s": dict(self.predicted_s),
                "seconds": dict(self.measured_s), "reason": self.reason, "key": key}


class AutoDecisions:
    """The placements and verdicts ``auto`` reached in this process, by shape class."""

    def __init__(self) -> None:
        self.placements: dict[tuple, str] = {}
        self.verdicts: dict[tuple, Verdict] = {}

    def rows(self) -> list[dict]:
        """Every verdict: backend chosen, its placement and options, predicted and measured seconds, why, key."""
        return [v.row(k) for k, v in self.verdicts.items()]

    def clear(self) -> None:
        self.placements.clear()
        self.verdicts.clear()


def _size_bucket(tokens: int) -> int:
    """Shape classes share verdicts between batches of similar length (powers of two): packed batches vary."""
    return 1 << max(0, math.ceil(math.log2(max(1, tokens))))


def _group_key(group) -> object:
    """The group in a key: a weak reference where the group takes one (a verdict must not outlive its group and pass
    to a later group at the same address, whose ranks would then disagree on whether to time the candidates and
    deadlock in the collectives), else the group itself."""
    if group is None:
        return None
    try:
        return weakref.ref(group)
    except TypeError:
        return group


def _class_key(group, world: int, tokens: int, shape: AttentionShape, device: torch.device, kernel: str) -> tuple:
    return _group_key(group), world, _size_bucket(tokens), shape, device.type, kernel


def _verdict_key(q: torch.Tensor, plan: ShardPlan, group, shape: AttentionShape, kernel: str) -> tuple:
    """A verdict's key: the shape class, the placement, the sliding window and the dtype."""
    return (_class_key(group, plan.world_size, plan.batch.num_tokens, shape, q.device, kernel), plan.strategy,
            plan.window, q.dtype)


def _spans_world(group, world: int) -> bool:
    if in_one_process(group) or not (dist.is_available() and dist.is_initialized()):
        return True
    return dist.get_world_size() == world


Timer = Callable[[Callable[[], object], torch.device], float]


class AutoBackend(Backend):
    """Backend ``auto``: never runs itself; it places the batch (:meth:`plan_batch`) and names the candidate that
    runs (:meth:`resolve`). Its load is each rank's own queries against every key."""

    name = "auto"
    summary = ("prices every backend on the batch (Ulysses, CAD, the ring family, Ulysses x ring past one node), "
               "times the few that could win once per shape, keeps the fastest")
    default_strategy = "zigzag"
    chooses_backend = True
    options_type = AutoOptions

    def __init__(self) -> None:
        self.decisions = AutoDecisions()
        self.timer: Timer = time_forward  # tests impose timings here

    def plan_batch(self, batch: PackedBatch, group: dist.ProcessGroup | None, shape: AttentionShape | None,
                   dtype: torch.dtype, device: torch.device, kernel: str, options: BackendOptions) -> ShardPlan:
        """The placement of the best-priced candidate for ``batch`` (the first batch of its shape class decides,
        later ones take the same placement). Every rank of ``group`` calls this together: the first batch of a
        class measures the kernel once and agrees its rates over the group. A model without one attention shape
        (``shape`` None) gets the default placement; its layers are priced at their own first call."""
        options = options if isinstance(options, AutoOptions) else AutoOptions()
        _, world = group_rank_and_size(group)
        if world == 1 or shape is None:
            return shard_plan(batch, 1, self.default_strategy)
        key = _class_key(group, world, batch.num_tokens, shape, device, kernel)
        strategy = self.decisions.placements.get(key)
        if strategy is not None:
            return shard_plan(batch, world, strategy)
        rates = measure_kernel_rates(kernel, device, shape, dtype, group)
        plans = {s: shard_plan(batch, world, s) for s in PLACEMENTS}
        predictions = price(plans, shape, rates, options, _spans_world(group, world))
        strategy = best_candidate(predictions).strategy if predictions else self.default_strategy
        self.decisions.placements[key] = strategy
        log.info("hf_longctx auto: %s placement for %d tokens on %d ranks (predicted: %s)", strategy,
                 batch.num_tokens, world, _describe(predictions))
        return plans[strategy]

    def resolve(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: ShardPlan,
                group: dist.ProcessGroup | None, probe: ForwardProbe, options: BackendOptions,
                kernel: str = "auto") -> Candidate:
        """The candidate that runs ``plan`` on ``kernel``: the verdict of its shape class, reached here on its first
        call."""
        options = options if isinstance(options, AutoOptions) else AutoOptions()
        shape = AttentionShape.of(q, k)
        key = _verdict_key(q, plan, group, shape, kernel)
        verdict = self.decisions.verdicts.get(key)
        if verdict is None:
            verdict = self._decide(q, plan, group, probe, options, shape, kernel)
            self.decisions.verdicts[key] = verdict
        return verdict.candidate

    def _decide(self, q: torch.Tensor, plan: ShardPlan, group, probe: ForwardProbe, options: AutoOptions,
                shape: AttentionShape, kernel: str) -> Verdict:
        world = plan.world_size
        if world == 1:
            first = candidates(world, shape, options, (plan.strategy,))
            if not first:
                raise ValueError(f"backend 'auto' has no candidate for plan strategy {plan.strategy!r}")
            return Verdict(first[0], {}, {}, "one rank")
        rates = measure_kernel_rates(kernel, q.device, shape, q.dtype, group)
        predictions = price({plan.strategy: plan}, shape, rates, options, _spans_world(group, world))
        if not predictions:
            raise ValueError(f"backend 'auto' has no candidate for plan strategy {plan.strategy!r} on {world} ranks "
                             f"with {shape.heads} query and {shape.kv_heads} key/value heads; shard with "
                             f"{' or '.join(PLACEMENTS)}, or name a backend")
        timed = shortlist(predictions, plan.strategy, options.shortlist)
        predicted = {c.label: predictions[c].step_s for c in predictions}
        if len(timed) == 1:
            return Verdict(timed[0], predicted, {}, "the only candidate within the shortlist of the best prediction")
        with torch.no_grad():
            local = [self.timer(lambda c=c: probe(c), q.device) for c in timed]
        slowest = torch.tensor(local, dtype=torch.float64, device=collective_device(group))
        all_reduce_max(slowest, group)
        measured = slowest.tolist()
        chosen = timed[pick(measured, options.margin)]
        verdict = Verdict(chosen, predicted, {c.label: s for c, s in zip(timed, measured)},
                          f"fastest forward of {len(timed)} timed (slowest rank; the predicted best unless another "
                          f"is faster by more than {options.margin:.0%})")
        log.info("hf_longctx auto: %s for %d tokens on %d ranks (%s placement); measured forward: %s; predicted "
                 "step: %s", chosen.label, plan.batch.num_tokens, world, plan.strategy,
                 ", ".join(f"{c.label}={s * 1e3:.2f} ms" for c, s in zip(timed, measured)), _describe(predictions))
        return verdict

    def forward(self, run: RunContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        raise RuntimeError("backend 'auto' runs the candidate it resolves to, never itself")

    def backward(self, run: RunContext, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor):
        raise RuntimeError("backend 'auto' runs the candidate it resolves to, never itself")


def _describe(predictions: Mapping[Candidate, StepPrediction]) -> str:
    order = sorted(predictions, key=lambda c: predictions[c].step_s)
    return ", ".join(f"{c.label}@{c.strategy}={predictions[c].step_s * 1e3:.2f} ms" for c in order)


AUTO = AutoBackend()


def record_verdict(q: torch.Tensor, k: torch.Tensor, plan: ShardPlan, group, candidate: Candidate,
                   predicted_s: Mapping[str, float], measured_s: Mapping[str, float], reason: str,
                   kernel: str = "auto") -> None:
    """Decide ``auto`` for this problem in advance (e.g. from W ranks emulated on one device): its first call then
    runs ``candidate`` on ``kernel`` without pricing or timing anything. Every rank of the group must record the same
    verdict."""
    verdict = Verdict(candidate, dict(predicted_s), dict(measured_s), reason)
    AUTO.decisions.verdicts[_verdict_key(q, plan, group, AttentionShape.of(q, k), kernel)] = verdict
    log.info("hf_longctx auto: %s for %d tokens on %d ranks, decided in advance: %s", candidate.label,
             plan.batch.num_tokens, plan.world_size, reason)


def auto_decisions() -> list[dict]:
    """Every verdict of this process (see :meth:`AutoDecisions.rows`)."""
    return AUTO.decisions.rows()


def reset_auto_decisions() -> None:
    AUTO.decisions.clear()
