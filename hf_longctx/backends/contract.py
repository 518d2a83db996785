"""What a sequence-parallel backend is: its options type and the five things every backend answers.

A backend is an object of a :class:`Backend` subclass, registered by name (:mod:`.registry`). The entry
point (:func:`~hf_longctx.backends.sequence_parallel_attention`) parses a call's options into the backend's
:attr:`Backend.options_type` (a frozen dataclass, :mod:`.options`; a recipe's ``backend_options`` are parsed the
same way when it is read), then asks it, in order:

1. :meth:`Backend.validate`: problems with this rank's inputs that only this backend has (checked on
   every rank before the first collective, so a bad input stops the whole group with one error);
2. :meth:`Backend.resolve`: which backend actually runs, with which options (itself; ``auto`` prices and times
   its candidates and names one);
3. :meth:`Backend.prepare`: per-plan state of the run, kept in the run's ``state`` (CAD: its scheduled tasks
   and the eps it used), never in the options, which serve every call unchanged;
4. :meth:`Backend.forward` and :meth:`Backend.backward`: this rank's (out, lse), then (dq, dk, dv),
   run inside the one ``hf_longctx::core_attention`` op;

and the training logs ask it for :meth:`Backend.attention_load`, the (query, key) pairs each rank
computes under a plan; ``auto`` asks :meth:`Backend.auto_candidate_options` whether it may run the backend on a
group, and :meth:`Backend.rank_work` what a run would cost (:mod:`.prediction`).

Two kinds implement it. A :class:`ScheduleBackend` is data: a function from the number of ranks to a
:class:`~hf_longctx.backends.schedule.Schedule`, which the one engine (:mod:`.engine`) runs forward and
backward (local, ring, zigzag, distfa). A runner backend brings its own ``forward``/``backward``
(ulysses, tasp, cad). Outside packages subclass either and call
:func:`~hf_longctx.backends.register_backend`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..comm.groups import group_rank_and_size
from ..layout import PackedBatch, ShardPlan, exchange_plan, shard_plan
from .engine import RunContext, run_backward, run_forward, schedule_rank_work
from .options import BackendOptions, NoOptions
from .prediction import AttentionShape, RankWork
from .schedule import Schedule


@dataclass(frozen=True)
class Candidate:
    """A backend as it would run: its name, the placement of the tokens it runs on (a shard-plan strategy) and its
    options. What :meth:`Backend.resolve` names, and what ``auto`` prices and times."""

    backend: str
    strategy: str
    options: BackendOptions = field(default_factory=NoOptions)

    @property
    def label(self) -> str:
        """The backend's name, with the options that differ from its defaults (how logs and tables show it)."""
        given = self.options.given()
        return self.backend + (f"({', '.join(f'{k}={v}' for k, v in given.items())})" if given else "")


ForwardProbe = Callable[[Candidate], object]  # runs one forward of a candidate on the problem being resolved


def own_query_load(plan: ShardPlan) -> list[int]:
    """Pairs of each rank's own queries against every key: the load when nobody computes for others."""
    world = plan.world_size
    return [sum(exchange_plan(plan, r, s).work for s in range(world)) for r in range(world)]


class Backend:
    """Base class of every backend; subclasses set the class attributes and implement forward/backward.

    ``strategies`` are the shard-plan placements the backend is exact for, ``default_strategy`` the one
    it expects when the user names none. ``auto_candidate_for`` lists the placements on which ``auto``
    measures this backend (registration order is the order ``auto`` tries them; the first is the plain
    ring it keeps on a tie). ``sequence_parallel`` is False for a backend that runs on one rank only
    (``local``); ``chooses_backend`` is True for one that never runs itself but names another per
    problem in :meth:`resolve` (``auto``). ``bidirectional`` is True for a backend that also computes
    non-causal attention (every query sees every key of its document): it then finds ``causal=False`` in the
    run (:attr:`~.engine.RunContext.causal`); the others refuse such a layer before any collective.
    ``options_type`` is the frozen dataclass of the backend's options (:class:`~.options.BackendOptions`; its
    fields are the keys a mapping of options may name, :attr:`option_names`); any other key is refused where the
    options are given (a misspelt one would otherwise be ignored, and the run would silently be another than the
    one asked for), and so is a value the type's :meth:`~.options.BackendOptions.problem` names.
    """

    name: str = ""
    summary: str = ""
    default_strategy: str = "contiguous"
    strategies: tuple[str, ...] = ("contiguous", "zigzag", "doc_zigzag")
    auto_candidate_for: tuple[str, ...] = ()
    sequence_parallel: bool = True
    chooses_backend: bool = False
    makes_groups: bool = False  # makes process groups at its first call, with every rank of the world taking part
    bidirectional: bool = False
    options_type: type[BackendOptions] = NoOptions

    @property
    def option_names(self) -> tuple[str, ...]:
        """The keys of a call's ``options`` the backend reads: its :attr:`options_type`'s fields."""
        return self.options_type.names()

    def validate(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: ShardPlan, world: int) -> str | None:
        """A problem (one sentence naming the fix) with these inputs for this backend, or None.

        Runs after the checks every backend shares (causal, group size, plan size, placement, shapes, GQA,
        dtype).
        """
        return None

    def plan_batch(self, batch: PackedBatch, group: dist.ProcessGroup | None, shape: AttentionShape | None,
                   dtype: torch.dtype, device: torch.device, kernel: str, options: BackendOptions) -> ShardPlan:
        """Where the tokens of ``batch`` go over the ranks of ``group``, decided before the batch is sharded: the
        :attr:`default_strategy` (``auto`` prices its candidates here). ``shape`` is the model's attention shape, None
        for a model whose layers differ in shape. Every rank of the group calls it together with the same arguments
        and gets the same plan."""
        return shard_plan(batch, group_rank_and_size(group)[1], self.default_strategy)

    def resolve(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: ShardPlan,
                group: dist.ProcessGroup | None, probe: ForwardProbe, options: BackendOptions,
                kernel: str = "auto") -> Candidate:
        """The backend that runs this problem, with its options: this one, unless it chooses among others (on the
        run's ``kernel``)."""
        return Candidate(self.name, plan.strategy, options)

    def schedule(self, world: int) -> Schedule:
        """The steps the engine walks; a runner backend walks none."""
        return ()

    def prepare(self, plan: ShardPlan, options: BackendOptions) -> object:
        """The per-plan state a run of this backend needs (cache it on the plan), or None; it becomes the run's
        ``state``. ``options`` are read, never written."""
        return None

    def forward(self, run: RunContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, lse) of this rank's queries: out like ``q``, lse (heads, tokens) in float32/float64."""
        raise NotImplementedError(f"backend {self.name!r} does not implement forward")

    def backward(self, run: RunContext, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dq, dk, dv) of this rank's q/k/v rows, from the FINAL out and lse of the forward."""
        raise NotImplementedError(f"backend {self.name!r} does not implement backward")

    def attention_load(self, plan: ShardPlan) -> list[int]:
        """Visible (query, key) pairs each rank computes under ``plan`` (from the plan alone, no collective)."""
        return own_query_load(plan)

    def auto_candidate_options(self, world: int, shape: AttentionShape, node_size: int) -> BackendOptions | None:
        """The options ``auto`` runs this backend with on a group of ``world`` ranks in nodes of ``node_size``, for
        this attention shape; None when it is no candidate there (not in :attr:`auto_candidate_for`, or unable to
        run this shape). A backend with required options says here what ``auto`` should give it."""
        return self.options_type() if self.auto_candidate_for else None

    def rank_work(self, plan: ShardPlan, shape: AttentionShape, options: BackendOptions) -> list[RankWork] | None:
        """Each rank's kernel segments, kernel calls and sends of one forward+backward under ``plan`` (see
        :mod:`.prediction`), or None for a backend that cannot say (it is then no ``auto`` candidate)."""
        return None

    def run_context(self, plan: ShardPlan, group: dist.ProcessGroup | None, rank: int, world: int, scale: float,
                    kernel: str, options: BackendOptions | None = None, causal: bool = True) -> RunContext:
        """Everything :meth:`forward` and :meth:`backward` read, for this rank and plan; ``options`` are an
        :attr:`options_type` object (None: the defaults)."""
        options = self.options_type() if options is None else options
        return RunContext(plan, self.schedule(world), group, rank, scale, kernel, self.forward, self.backward,
                          options=options, state=self.prepare(plan, options), causal=causal)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


class ScheduleBackend(Backend):
    """A backend that is a schedule builder: the engine runs the schedule forward and backward."""

    def __init__(self, name: str, schedule: Callable[[int], Schedule], summary: str, *,
                 default_strategy: str = "contiguous", strategies: tuple[str, ...] | None = None,
                 auto_candidate_for: tuple[str, ...] = ()):
        self.name, self.summary, self._schedule = name, summary, schedule
        self.default_strategy = default_strategy
        self.strategies = strategies if strategies is not None else Backend.strategies
        self.auto_candidate_for = auto_candidate_for

    def schedule(self, world: int) -> Schedule:
        return self._schedule(world)

    def forward(self, run: RunContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        return run_forward(run, q, k, v)

    def backward(self, run: RunContext, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor):
        return run_backward(run, dout, q, k, v, out, lse)

    def rank_work(self, plan: ShardPlan, shape: AttentionShape, options: BackendOptions) -> list[RankWork]:
        return schedule_rank_work(plan, self.schedule(plan.world_size), shape)

    def attention_load(self, plan: ShardPlan) -> list[int]:
        """Pairs of every task of the schedule, charged to the rank that computes it."""
        work = [0] * plan.world_size
        for step in self.schedule(plan.world_size):
            for task in step:
                work[task.computed_by()] += exchange_plan(plan, task.q_rank, task.kv_rank, task.part,
                                                          task.parts).work
        return work
