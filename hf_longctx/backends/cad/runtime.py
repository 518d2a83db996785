"""CAD runtime: every rank is an in-place attention server for core-attention tasks of any rank.

A task (:class:`~.tasks.CadTask`) is "query rows [q_start, q_end) of one document piece held by
``owner``, computed on ``server``"; its keys are the causal prefix of those rows in the document,
which may span the pieces of several ranks. This module builds each rank's nano-batches (its tasks as
kernel segments, and the row gathers that feed them) and runs them forward and backward. Per
nano-batch, each server runs all its tasks in ONE varlen kernel call (one bottom-right causal segment
per task), and every query row belongs to exactly one task, so no merge is needed.

What travels (see :mod:`hf_longctx.comm.gather`): only rows a server does not hold, each at most
once per nano-batch. Tasks of one document on one server read overlapping key prefixes; their union
travels once (not one prefix per task), rows the server holds itself are read in place (never copied
through the collective), and queries, outputs and log-sum-exps of tasks served by their owner never
move.
(Sending every task its whole prefix instead moves a long document's shared prefix once per task.)
Backward trades the same rows plus output gradients and returns dQ to owners and dK/dV, summed over
the tasks that read each row, to every holder.

Ping-pong: each server's tasks are split into two nano-batches of about equal attention cost,
keeping a document's tasks together where that costs little balance (see :mod:`.pingpong`).
The fetches of both are posted at once and land before the first kernel (a transfer that reaches the
device behind a kernel filling every SM waits for all of it, and its peers wait with it); the first
nano-batch's returns then run beside the second's kernels (on GPU the collectives run on NCCL's stream).

Sliding window (the plan's ``window``, see :meth:`~hf_longctx.layout.ShardPlan.with_window`): a task
reads only the keys its rows reach, from ``window - 1`` positions before its first query row to its
last; every segment stays bottom-right aligned, so one kernel window serves the whole call. The
scheduler and the nano-batch split price tasks on the pairs the window leaves visible.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist

from ...comm.collectives import all_reduce_max, collective_device, group_state, in_one_process, is_distributed
from ...comm.gather import GatherPlan, Run
from ...kernels import accumulation_dtype
from ...kernels.calls import CallTerms, backward_in_calls, call_order, calls_overhead, cut_into_calls, forward_in_calls
from ...kernels.key_split import KeySplit
from ...layout import ShardPlan
from ..contract import Backend
from ..engine import RunContext
from .cost_model import (
    CostModel,
    FlopsCostModel,
    ProfiledCostModel,
    WindowedCostModel,
)
from .eps import sweep_eps
from .launch_cost import LaunchCostModel, PhaseTerms
from .model_file import is_model_path, load_model_file
from .options import COST_MODELS_TERMS, CadOptions, CadRun, cad_options
from .pingpong import pingpong_split
from .refine import refine_in_time
from .scheduler import CadSchedule, assign_servers, with_tasks
from .shared_pricing import PricingShare, priced_together
from .tasks import (
    CadTask,
    all_pieces,
    check_key_range,
    doc_holders,
    docs_per_rank,
    has_key_cuts,
    rows_cost,
    segment_shape,
    task_cost,
    task_key,
    task_runs,
)
from .work import rank_work


@dataclass
class NanoBatch:
    """One nano-batch as seen by one rank: its own tasks (in kernel segment order) and the gathers."""

    tasks: list[CadTask]
    q: GatherPlan
    kv: GatherPlan
    cu_q: list[int]
    cu_k: list[int]
    calls: list[tuple[int, int]]  # segment ranges, one kernel call each (see hf_longctx.kernels.calls)
    causal: list[bool]  # per call: bottom-right causal segments, or rectangles (key cuts, see .tasks)
    partial: bool = False  # some row's keys are cut over several tasks: results merge by log-sum-exp
    key_split: KeySplit | None = None  # forward calls of few long blocks run as chunks of their keys


def _segment_order(plan: ShardPlan, t: CadTask) -> tuple:
    """Where task ``t``'s segment goes in its server's batch: by server, causal segments before rectangles
    (each kind its own calls), then longest keys first, then longest queries
    (:func:`~hf_longctx.kernels.calls.call_order`: runs of similar segments become kernel calls)."""
    rows, keys = segment_shape(plan, t)
    return t.server, t.is_rect, -keys, -rows, *task_key(plan, t)


def _check_key_cuts(plan: ShardPlan, tasks: Sequence[CadTask]) -> None:
    """Raise unless every task's keys are a valid range (:func:`~.tasks.check_key_range`) and every server computes
    each query row at most once per nano-batch: with key cuts, a server returns its part of a row summed with any
    other part it holds (see ``GatherPlan.finish_merge``)."""
    seen: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
    for t in tasks:
        check_key_range(plan, t)
        spans = seen.setdefault((t.server, t.owner, t.piece), [])
        if any(a < t.q_end and t.q_start < b for a, b in spans):
            raise ValueError(f"server {t.server} computes rows of {t} twice in one nano-batch: a key cut's parts "
                             "must be computed on different servers or in different nano-batches")
        spans.append((t.q_start, t.q_end))


def build_nano_batch(plan: ShardPlan, tasks: Sequence[CadTask], rank: int, terms: CallTerms | None = None
                     ) -> NanoBatch:
    """Gathers of one nano-batch (``tasks`` of all servers) for ``rank``.

    Per server and task: the query rows (one run at the owner) and the key rows, the document's prefix
    up to the task's last query row (one run per holder piece). :class:`GatherPlan` turns these into
    unique-row transfers; the varlen kernel sees one segment per task (bottom-right causal), longest keys
    first, cut into kernel calls by ``terms`` (:func:`~hf_longctx.kernels.calls.cut_into_calls`; None: one call).
    """
    world = plan.world_size
    pieces = all_pieces(plan)
    holders = doc_holders(plan)
    q_runs: list[list[Run]] = [[] for _ in range(world)]
    kv_runs: list[list[Run]] = [[] for _ in range(world)]
    mine = []
    cu_q, cu_k = [0], [0]
    work = [t for t in tasks if t.q_end > t.q_start]
    partial = has_key_cuts(work)
    if partial:
        _check_key_cuts(plan, work)
    for t in sorted(work, key=lambda t: _segment_order(plan, t)):
        q_run, key_runs = task_runs(plan, t, pieces, holders)
        q_runs[t.server].append(q_run)
        kv_runs[t.server] += key_runs
        n_k = sum(b - a for _, a, b in key_runs)
        if t.server == rank:
            n_q = t.q_end - t.q_start
            mine.append(t)
            cu_q.append(cu_q[-1] + n_q)
            cu_k.append(cu_k[-1] + n_k)
    rows = plan.token_counts
    q_lens = [b - a for a, b in zip(cu_q, cu_q[1:])]
    k_lens = [b - a for a, b in zip(cu_k, cu_k[1:])]
    n_causal = sum(not t.is_rect for t in mine)  # rectangles come last, in calls of their own
    causal_calls = cut_into_calls(q_lens[:n_causal], k_lens[:n_causal], terms)
    rect_calls = [(a + n_causal, b + n_causal) for a, b in cut_into_calls(q_lens[n_causal:], k_lens[n_causal:], terms)]
    return NanoBatch(mine, GatherPlan(q_runs, rank, rows), GatherPlan(kv_runs, rank, rows), cu_q, cu_k,
                     causal_calls + rect_calls, [True] * len(causal_calls) + [False] * len(rect_calls), partial,
                     terms.key_split if terms is not None else None)


def nano_batches(plan: ShardPlan, tasks: Sequence[CadTask], rank: int, pingpong: bool, device: torch.device,
                 terms: CallTerms | None = None) -> list[NanoBatch]:
    """The nano-batches of ``rank`` (two balanced halves with ping-pong, else one), cached on the plan."""
    key = tuple(tasks)

    def build():
        groups = plan.cached(("cad_pingpong", key), lambda: pingpong_split(plan, tasks)) if pingpong else [list(tasks)]
        out = []
        for g in groups:
            nb = build_nano_batch(plan, g, rank, terms)
            nb.q.to(device)
            nb.kv.to(device)
            out.append(nb)
        return out

    return plan.cached(("cad_nano", key, rank, pingpong, str(device), terms), build)


def call_terms_for(options: CadOptions | dict, model: CostModel) -> CallTerms | None:
    """How a server cuts its batch into kernel calls: ``options.call_terms`` when given (a
    :class:`~hf_longctx.kernels.calls.CallTerms`, or None / ``"none"``: always one call), else the profiled
    cost model's measured terms, else one call. No default guesses the terms: what a call costs on its own is
    mostly the host's dispatch, which differs from host to host (bench/results/2026-12-04_from-modules.md),
    so cutting on a guess can cost more than the surplus tiles it saves (and the CPU kernels compute only the
    rows they are given)."""
    spec = cad_options(options).call_terms
    if spec is not COST_MODELS_TERMS:
        return None if spec is None or spec == "none" else spec
    base = _base(model)
    return base.call_terms if isinstance(base, (ProfiledCostModel, LaunchCostModel)) else None


def _base(model: CostModel) -> CostModel:
    return model.base if isinstance(model, WindowedCostModel) else model


def _batches(ctx: RunContext, device: torch.device) -> list[NanoBatch]:
    """This rank's nano-batches of the run's tasks (``ctx.state``, a :class:`~.options.CadRun`)."""
    terms = call_terms_for(ctx.options, cost_model_for(ctx.plan, ctx.options))
    return nano_batches(ctx.plan, ctx.state.tasks, ctx.rank, ctx.options.pingpong, device, terms)


def agreed_cost_model(model: CostModel, group) -> CostModel:
    """``model`` made identical on every rank of ``group``: every cell (the per-segment term, the tile, the call
    terms, a launch model's terms and slots) takes the largest rank's value (one all_reduce), because ranks that
    schedule on different costs would disagree on who serves what (each rank reads its own copy of the model file,
    which another host may hold in another version). Kept per model and group (the group object, not its ``id``,
    which a later group may reuse and then skip the all_reduce its peers make), in the group's state
    (:func:`~hf_longctx.comm.collectives.group_state`: a group that keeps its own frees it with itself)."""
    store, key = group_state(group), ("cad_agreed_cost_model", id(model))
    kept = store.get(key)  # (model, agreed): the model kept alive with it, so that its id names it alone
    if kept is None:
        agreed_model = model
        if isinstance(model, ProfiledCostModel) and is_distributed(group):
            values = [*(v for row in model.table for v in row), model.segment_cost, float(model.tile),
                      model.call_cost, model.q_tile_cost, model.k_tile_cost,
                      float(model.launch.slots if model.launch else 0)]
            agreed = torch.tensor(values, dtype=torch.float64, device=collective_device(group))
            all_reduce_max(agreed, group)
            *cells, segment_cost, tile, call_cost, q_tile_cost, k_tile_cost, slots = agreed.tolist()
            width = len(model.kv_lens)
            table = [cells[i:i + width] for i in range(0, len(cells), width)]
            launch = replace(model.launch, slots=int(slots)) if model.launch else None
            agreed_model = ProfiledCostModel.from_grid(model.q_lens, model.kv_lens, table, model.units,
                                                       model.interpolate, segment_cost, int(tile), call_cost,
                                                       q_tile_cost, k_tile_cost, launch, model.launch_heads)
        elif isinstance(model, LaunchCostModel) and is_distributed(group):
            values = [*model.forward.as_vector(), *model.backward.as_vector(), float(model.launch.slots)]
            agreed = torch.tensor(values, dtype=torch.float64, device=collective_device(group))
            all_reduce_max(agreed, group)
            *terms, slots = agreed.tolist()
            half = len(terms) // 2
            agreed_model = replace(model, launch=replace(model.launch, slots=int(slots)),
                                   forward=PhaseTerms.from_vector(terms[:half]),
                                   backward=PhaseTerms.from_vector(terms[half:]))
        kept = store[key] = (model, agreed_model)
    return kept[1]


def cost_model_for(plan: ShardPlan, options: CadOptions | dict) -> CostModel:
    """The cost model the scheduler balances: ``options.cost_model`` is ``"flops"`` (default), the path of a
    fitted cost model file (made ahead by ``hf-longctx-lab profile-cad --out FILE``, see :mod:`.model_file`) or a
    cost model object; priced under the plan's sliding window."""
    options = cad_options(options)
    spec = options.cost_model
    if spec is None or (isinstance(spec, str) and spec == "flops"):
        base: CostModel = FlopsCostModel()
    elif is_model_path(spec):
        base = load_model_file(spec, options.cost_kernel)
    else:
        base = spec
    return base if plan.window is None else WindowedCostModel(base, plan.window)


def cad_schedule(plan: ShardPlan, options: CadOptions | dict, share: PricingShare | None = None) -> CadSchedule:
    """The plan's schedule under ``options`` (``eps``: a float, default 0.1, or ``"auto"`` for the eps whose
    schedule is predicted fastest, see :mod:`.eps`; ``cost_model``; ``min_shard`` and ``search_width`` of
    :func:`~.scheduler.assign_servers`), cached on the plan.

    On a measured cost model (not additive over rows), what the runtime adds to a server beyond its tasks'
    prices is balanced too: ping-pong cuts some tasks in two (two thinner segments, which run slower) and a
    server's calls cost something of their own, and a call whose last blocks run alone has a tail
    (:mod:`hf_longctx.kernels.launch`). The schedule is made again with those costs as per-server offsets
    (:func:`~.scheduler.assign_servers`'s ``server_offsets``), twice, and the one whose predicted busiest server
    (:func:`server_costs`) is least is kept. On measured profiles at 64 servers this brought the predicted
    max/mean most of the way to what the tasks alone were balanced to (bench/results/2026-11-24_cad-kernel-time.md).
    Last, the busiest server gives tasks away while that lowers the predicted maximum (:mod:`.refine`), also as key
    cuts (``options.key_cuts``, default True; see :mod:`.tasks`), and by ejection chains where no single move
    helps (``options.refine_chains``, default True; see :func:`~.refine.refine_in_time`). A step of many moves
    prices them in the order of an additive estimate until ``options.refine_screen`` in a row found nothing
    better (default :data:`REFINE_SCREEN`; 0 or None: every move is priced).

    ``share``: this rank's part when every rank of a group makes this schedule (the backend's run does): the
    refinement's pricing is then split over the group (:mod:`.shared_pricing`), the schedule the same, and the
    ranks check that it is (:func:`check_same_schedule`). A schedule made without ``share`` (``auto`` pricing CAD on
    the plan) is cached apart from the run's: the run still makes its own, checked.
    """
    options = cad_options(options)  # a mapping from a direct caller gets the check a recipe's options get
    eps = options.eps
    model = cost_model_for(plan, options)
    knobs = options.scheduler_knobs()
    refinement = refine_options(options)

    def build() -> CadSchedule:
        docs = docs_per_rank(plan)
        # "auto": the eps whose schedule is predicted fastest; the runtime's costs are balanced under it as below
        first = sweep_eps(docs, plan.world_size, model, **knobs)[0] if eps == "auto" else \
            assign_servers(docs, plan.world_size, eps=eps, cost_model=model, **knobs)
        if isinstance(_base(model), FlopsCostModel):
            return first  # FLOPs: ping-pong's cuts cost what the rows cost, and no call term is priced
        best, best_peak = first, float(_predicted_costs(plan, first.tasks, options, model, share).max(initial=0.0))
        # offsets from the full prediction, and (with call tails) from the prediction without them: the tails
        # depend on what a server's calls hold, so offsets chasing them can land worse than offsets that leave
        # them out; every schedule is judged by the full prediction
        views = [model]
        if isinstance(model, ProfiledCostModel) and model.launch is not None:
            views.append(replace(model, launch=None, launch_heads=0))
        elif isinstance(model, LaunchCostModel) and model.tails:
            views.append(model.without_tails())
        for view in views:
            sched = first
            for _ in range(RUNTIME_OFFSET_ROUNDS):
                own = sched.loads - (sched.offsets if sched.offsets is not None else 0.0)
                extra = _predicted_costs(plan, sched.tasks, options, view, share) - own
                sched = assign_servers(docs, plan.world_size, eps=first.eps, cost_model=model, **knobs,
                                       server_offsets=np.maximum(extra, 0.0))
                peak = float(_predicted_costs(plan, sched.tasks, options, model, share).max(initial=0.0))
                if peak < best_peak:
                    best, best_peak = sched, peak
        terms = call_terms_for(options, model)
        moved = refine_in_time(plan, best.tasks, model,
                               lambda tasks: _server_time(plan, tasks, options, model, terms),
                               share=share, **refinement)
        return with_tasks(docs, best, moved, model)

    def timed_build() -> CadSchedule:
        start = time.perf_counter()
        sched = build()
        _say_if_slow(time.perf_counter() - start, plan, eps, model)
        if share is not None:  # once per schedule made, not per layer that runs it
            check_same_schedule(sched.tasks, share.group)
        return sched

    return plan.cached(("cad_schedule", eps, model, tuple(sorted(knobs.items())), tuple(sorted(refinement.items())),
                        share is not None), timed_build)


log = logging.getLogger(__name__)
SLOW_SCHEDULE_S = 0.5  # a schedule that took longer on the host is said once per process (its first rank's)
_said_slow = False


def refine_options(options: CadOptions | dict) -> dict:
    """The keyword arguments of :func:`~.refine.refine_in_time` that CAD's ``options`` set (``key_cuts``,
    ``refine_screen``, ``refine_chains``), defaults filled in: every refinement of a schedule takes the same."""
    options = cad_options(options)
    return {"key_cuts": options.key_cuts, "screen": options.refine_screen or None, "chains": options.refine_chains}


def _say_if_slow(seconds: float, plan: ShardPlan, eps, model: CostModel) -> None:
    """Warn once when a schedule took :data:`SLOW_SCHEDULE_S` or more. Why: a schedule is made when a batch's first
    attention layer needs it, on every rank of the group, so in training each new batch waits for it; on a measured
    cost model at a small eps that can be seconds on a small host (bench/results/2026-11-22_backends-multi-gpu.md),
    which the user should hear of rather than find as a slow step."""
    global _said_slow
    if seconds < SLOW_SCHEDULE_S or _said_slow or (dist.is_initialized() and dist.get_rank() != 0):
        return
    _said_slow = True
    log.warning("hf_longctx cad: this batch's schedule took %.1f s on the host (%d servers, eps %s, cost model %s); "
                "every new batch waits for its schedule before its first attention layer. A larger eps, a smaller "
                "refine_screen, or cost_model='flops' (milliseconds) schedule faster (the recipe's backend_options, "
                "or a call's options).", seconds, plan.world_size,
                eps, type(_base(model)).__name__)


RUNTIME_OFFSET_ROUNDS = 2  # schedules made again with the runtime's per-server extra costs (see cad_schedule)


def _server_batches(plan: ShardPlan, tasks: Sequence[CadTask], options: CadOptions, model: CostModel, split: bool):
    """One server's ``tasks`` as the runtime batches them: per ping-pong half (with ``split``, those of these tasks
    alone), causal segments and rectangles (key cuts) apart, each batch's (rows, keys, price) in launch order."""
    groups = pingpong_split(plan, tasks) if split and options.pingpong else [list(tasks)]
    for group in groups:
        for causal in (True, False):  # rectangles (key cuts) run in calls of their own
            seg = [(*segment_shape(plan, t), rows_cost(plan, t, t.q_start, t.q_end, model))
                   for t in group if t.q_end > t.q_start and t.is_rect != causal]
            if seg:
                yield causal, [seg[i] for i in call_order([q for q, _, _ in seg], [k for _, k, _ in seg])]


def server_calls(plan: ShardPlan, tasks: Sequence[CadTask], options: CadOptions | dict, model: CostModel,
                 split: bool = True) -> list[tuple[list[int], list[int], bool]]:
    """The kernel calls one server's ``tasks`` make, as the runtime cuts its batches
    (:func:`~hf_longctx.kernels.calls.cut_into_calls` under :func:`call_terms_for`): (query rows, keys, causal) per
    call, in order. What :mod:`.call_profile` times to fit a kernel's cost on calls shaped like CAD's own."""
    options = cad_options(options)
    terms = call_terms_for(options, model)
    calls = []
    for causal, seg in _server_batches(plan, tasks, options, model, split):
        q_lens, k_lens = [q for q, _, _ in seg], [k for _, k, _ in seg]
        calls += [(q_lens[a:b], k_lens[a:b], causal) for a, b in cut_into_calls(q_lens, k_lens, terms)]
    return calls


def _server_time(plan: ShardPlan, tasks: Sequence[CadTask], options: CadOptions, model: CostModel,
                 terms: CallTerms | None, split: bool = True) -> float:
    """Predicted cost of one server's ``tasks`` as the runtime computes them (see :func:`server_costs`); with
    ``split``, ping-pong's halves are those of these tasks alone (every server's are made on its own)."""
    # the tail of each call (a measured model's ``tail_cost``, 0 where it has none; not under a sliding window)
    tails = model if isinstance(model, (ProfiledCostModel, LaunchCostModel)) else None
    total = 0.0
    for causal, seg in _server_batches(plan, tasks, options, model, split):
        total += sum(c for _, _, c in seg)
        if terms is None and tails is None:
            continue
        q_lens, k_lens = [q for q, _, _ in seg], [k for _, k, _ in seg]
        runs = cut_into_calls(q_lens, k_lens, terms)
        if terms is not None:
            total += calls_overhead(q_lens, k_lens, runs, terms)
        if tails is not None:
            total += sum(tails.tail_cost(q_lens[a:b], k_lens[a:b], causal) for a, b in runs)
    return total


def _predicted_costs(plan: ShardPlan, tasks: Sequence[CadTask], options: CadOptions, model: CostModel,
                     share: PricingShare | None = None) -> np.ndarray:
    """Per-server cost of ``tasks`` as the runtime computes them (see :func:`server_costs`); with ``share``, the
    servers are priced by the ranks of a group together (:mod:`.shared_pricing`)."""
    terms = call_terms_for(options, model)
    groups = plan.cached(("cad_pingpong", tuple(tasks)), lambda: pingpong_split(plan, tasks)) \
        if options.pingpong else [list(tasks)]
    by_server: dict[int, list[list[CadTask]]] = {}
    for h, group in enumerate(groups):
        for t in group:
            halves = by_server.setdefault(t.server, [[] for _ in groups])
            halves[h].append(t)
    costs = np.zeros(plan.world_size)
    servers = sorted(by_server)
    costs[servers] = priced_together(
        lambda server: sum(_server_time(plan, half, options, model, terms, split=False) for half in by_server[server]),
        servers, share)
    return costs


def server_costs(plan: ShardPlan, options: CadOptions | dict) -> np.ndarray:
    """Predicted cost of each server's kernel calls under ``options`` (the cost model's units): every segment it
    computes priced alone (ping-pong's halves as the runtime cuts them), plus what its calls add beyond their
    segments (:func:`~hf_longctx.kernels.calls.calls_overhead`, under the call terms the runtime uses, see
    :func:`call_terms_for`). The schedule's own loads price whole tasks and no call term."""
    options = cad_options(options)
    model = cost_model_for(plan, options)
    return _predicted_costs(plan, prepare(plan, options).tasks, options, model)


def prepare(plan: ShardPlan, options: CadOptions | dict, share: PricingShare | None = None) -> CadRun:
    """Runner hook: the run's tasks, ``options.tasks`` when given, else the plan's documents scheduled onto servers
    (cached per plan, so per sliding window, eps and cost model); ``share``: see :func:`cad_schedule`. The options
    are read, never written: the schedule belongs to this run, not to the next batch's."""
    options = cad_options(options)
    if options.tasks is not None:
        return CadRun(options.tasks)
    sched = cad_schedule(plan, options, share)
    return CadRun(tuple(sched.tasks), sched.eps)


def attention_load(plan: ShardPlan) -> list[int]:
    """Visible (query, key) pairs each server computes under the scheduled tasks."""
    work = [0] * plan.world_size
    for t in prepare(plan, CadOptions()).tasks:
        work[t.server] += round(task_cost(plan, t))
    return work


def _lse_rows(lse: torch.Tensor) -> torch.Tensor:
    """(H, T) -> (T, H): log-sum-exps as rows, so they travel with their query rows."""
    return lse.t().contiguous()


def _no_rows(like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.empty(0, *like.shape[1:], dtype=dtype or like.dtype, device=like.device)


def _land_fetches(posted: Sequence[tuple]) -> None:
    """Order the compute stream after every nano-batch's fetches, before its first kernel.

    Why: a transfer kernel that reaches the device after a long attention kernel has filled every SM waits for
    that kernel to finish, however early it was queued, and its peers wait in the same collective. On 4 GPUs one rank's
    second fetch waited behind its first nano-batch, the others idled for it, and the step took a fifth longer
    than with the fetches landed first (measured: bench/results/2026-11-24_emulation-vs-real.md). The fetches are short
    against the nano-batches; what ping-pong must overlap is the returns, which still run beside the next nano-batch's
    kernels."""
    if len(posted) < 2:
        return  # one nano-batch: its gather waits for its fetches anyway
    for pending_q, pending_kv in posted:
        GatherPlan.wait(pending_q)
        GatherPlan.wait(pending_kv)


def run_forward(ctx: RunContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of this rank's query rows; this rank also serves its tasks of every nano-batch.

    All fetches are posted first and land before the first kernel (:func:`_land_fetches`); results of local
    tasks are written in place, the others return with one all_to_all per nano-batch (nano-batch 0's while
    nano-batch 1 computes).
    """
    nbs = _batches(ctx, q.device)
    acc = accumulation_dtype(q.dtype)
    partial = any(nb.partial for nb in nbs)  # the same on every rank: all see every server's tasks
    # parts of a row merge in the accumulation dtype; whole rows are copied
    out = torch.zeros(q.shape, dtype=acc if partial else q.dtype, device=q.device)
    lse_rows = torch.full((q.shape[0], q.shape[1]), float("-inf"), dtype=acc, device=q.device)
    posted = [(nb.q.start([q], ctx.group), nb.kv.start([k, v], ctx.group)) for nb in nbs]
    _land_fetches(posted)
    returns = []
    for nb, (pq, pkv) in zip(nbs, posted):
        (qb,) = nb.q.gather(pq, [q])
        kb, vb = nb.kv.gather(pkv, [k, v])
        if nb.tasks:
            ob, lb = _forward_segments(ctx, nb, qb, kb, vb)
            lb = _lse_rows(lb.to(acc))
        else:
            ob, lb = _no_rows(q), _no_rows(lse_rows)
        if partial:
            nb.q.merge_local(ob, lb, out, lse_rows)
            returns.append((nb, nb.q.start_return([ob, lb], ctx.group)))
        else:
            returns.append((nb, nb.q.return_rows([ob, lb], [out, lse_rows], False, ctx.group)))
    for nb, pending in returns:
        if partial:
            nb.q.finish_merge(pending, out, lse_rows)
        else:
            nb.q.finish_return(pending, [out, lse_rows], add=False)
    return out.to(q.dtype), lse_rows.t().contiguous()


def _calls_of_kind(nb: NanoBatch, causal: bool):
    """The calls of one kind (causal, or rectangles; contiguous, causal first) as the kernel wants them: their
    segment ranges rebased to the kind's first segment, the rows and keys they span, and cumulative lengths."""
    runs = [r for r, c in zip(nb.calls, nb.causal) if c == causal]
    if not runs:
        return None
    a, b = runs[0][0], runs[-1][1]
    cu_q = [x - nb.cu_q[a] for x in nb.cu_q[a:b + 1]]
    cu_k = [x - nb.cu_k[a] for x in nb.cu_k[a:b + 1]]
    return ([(x - a, y - a) for x, y in runs], slice(nb.cu_q[a], nb.cu_q[b]), slice(nb.cu_k[a], nb.cu_k[b]),
            cu_q, cu_k)


def _forward_segments(ctx: RunContext, nb: NanoBatch, qb, kb, vb) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a nano-batch's segments: its causal calls, then its rectangles' non-causal calls."""
    outs, lses = [], []
    for causal in (True, False):
        kind = _calls_of_kind(nb, causal)
        if kind is not None:
            runs, qs, ks, cu_q, cu_k = kind
            o, lse = forward_in_calls(qb[qs], kb[ks], vb[ks], cu_q, cu_k, runs, causal=causal,
                                      softmax_scale=ctx.scale, kernel=ctx.kernel, window=ctx.plan.window,
                                      key_split=nb.key_split)
            outs.append(o)
            lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs), torch.cat(lses, dim=1)


def _backward_segments(ctx: RunContext, nb: NanoBatch, db, qb, kb, vb, ob, lb):
    """(dq, dk, dv) of a nano-batch's segments, in the calls :func:`_forward_segments` made."""
    grads = []
    for causal in (True, False):
        kind = _calls_of_kind(nb, causal)
        if kind is not None:
            runs, qs, ks, cu_q, cu_k = kind
            grads.append(backward_in_calls(db[qs], qb[qs], kb[ks], vb[ks], ob[qs], lb[:, qs].contiguous(), cu_q,
                                           cu_k, runs, causal=causal, softmax_scale=ctx.scale, kernel=ctx.kernel,
                                           window=ctx.plan.window))
    if len(grads) == 1:
        return grads[0]
    return tuple(torch.cat([g[i] for g in grads]) for i in range(3))


def run_backward(ctx: RunContext, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of this rank's rows: the forward's gathers again, gradients returned and summed in fp32.

    Key gradients of tasks that read the same rows add up: in the server's unique-row buffer for
    remote rows (then once more at the holder, across servers), directly in dk/dv for local rows.
    A query row's gradient comes from the one task that holds the row, unless its keys are cut over
    several tasks: then its parts add up in fp32 too; otherwise it is copied into place in the input
    dtype (the same values, without an fp32 buffer and two conversions of every query row).
    """
    acc = accumulation_dtype(q.dtype)
    nbs = _batches(ctx, q.device)
    partial = any(nb.partial for nb in nbs)  # the same on every rank: all see every server's tasks
    dq_dtype = acc if partial else q.dtype
    dq = torch.zeros(q.shape, dtype=dq_dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    q_side = [q, out, dout.contiguous(), _lse_rows(lse)]
    posted = [(nb.q.start(q_side, ctx.group), nb.kv.start([k, v], ctx.group)) for nb in nbs]
    _land_fetches(posted)
    returns = []
    for nb, (pq, pkv) in zip(nbs, posted):
        qb, ob, db, lb = nb.q.gather(pq, q_side)
        kb, vb = nb.kv.gather(pkv, [k, v])
        if nb.tasks:
            gq, gk, gv = _backward_segments(ctx, nb, db, qb, kb, vb, ob, lb.t().contiguous())
        else:
            gq, gk, gv = _no_rows(q, dq_dtype), _no_rows(k, acc), _no_rows(v, acc)
        # in the kernel's dtype: converted to the accumulation dtype where they land
        returns.append((nb, nb.q.return_rows([gq], [dq], partial, ctx.group),
                        nb.kv.return_rows([gk, gv], [dk, dv], True, ctx.group)))
    for nb, pq, pkv in returns:
        nb.q.finish_return(pq, [dq], add=partial)
        nb.kv.finish_return(pkv, [dk, dv], add=True)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def check_same_schedule(tasks: Sequence[CadTask], group) -> None:
    """Raise on every rank of ``group`` unless all hold the same ``tasks`` (one all_reduce of a digest).

    Why: each rank makes the schedule itself (its refinement's prices shared, :mod:`.shared_pricing`, but the
    greedy pass and every comparison its own). Ranks whose floating point differs (another BLAS build or thread
    count on one host) can tip a near tie one way on one rank and the other way on another: their all_to_all would
    then disagree on sizes and hang, or exchange the wrong rows: better every rank stops with a message."""
    digest = int.from_bytes(hashlib.blake2b(repr(list(tasks)).encode(), digest_size=7).digest(), "little")
    both = torch.tensor([digest, -digest], dtype=torch.int64, device=collective_device(group))
    all_reduce_max(both, group)
    if int(both[0]) != digest or int(both[1]) != -digest:
        raise RuntimeError("cad: the ranks made different schedules of this batch (their floating point differs, "
                           "or their options or cost models do); give every rank the same cost model and options "
                           "(a cost model file's values are agreed over the group), or pass a schedule's tasks in "
                           "the options' tasks")


class CadBackend(Backend):
    """Backend ``cad``: the runtime above behind the backend contract. Its options are :class:`~.options.CadOptions`
    (the scheduler's in :func:`cad_schedule`, ``pingpong``, ``call_terms`` in :func:`call_terms_for`, and ``tasks``:
    a schedule's tasks to run instead of scheduling); its run's state a :class:`~.options.CadRun`."""

    name = "cad"
    summary = "CAD: documents stay whole; a scheduler balances core-attention tasks over all ranks as servers"
    default_strategy = "cad"
    strategies = ("cad", "contiguous")
    options_type = CadOptions

    def run_context(self, plan, group, rank, world, scale, kernel, options=None, causal=True):
        options = cad_options(options)
        if is_model_path(options.cost_model):  # the file's model, the same on every rank (a copy: options stay)
            agreed = agreed_cost_model(load_model_file(options.cost_model, options.cost_kernel), group)
            options = replace(options, cost_model=agreed)
        # every rank makes the same schedule here: ranks in processes of their own price it together
        share = PricingShare(group, rank, world) if world > 1 and is_distributed(group) \
            and not in_one_process(group) else None
        return RunContext(plan, self.schedule(world), group, rank, scale, kernel, self.forward, self.backward,
                          options=options, state=prepare(plan, options, share), causal=causal)

    auto_candidate_for = ("contiguous",)  # its own placement keeps documents whole as contiguous cuts do

    def rank_work(self, plan, shape, options):
        options = cad_options(options)
        return rank_work(plan, shape, prepare(plan, options).tasks, options.pingpong)

    # the runner's module functions are the contract's methods
    prepare = staticmethod(prepare)
    forward = staticmethod(run_forward)
    backward = staticmethod(run_backward)
    attention_load = staticmethod(attention_load)
