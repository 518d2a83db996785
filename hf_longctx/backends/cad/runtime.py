"""CAD runtime: every rank is an in-place attention server for core-attention tasks of any rank.

A task is "query rows [q_start, q_end) of one document piece held by ``owner``, computed on
``server``"; its keys are the causal prefix of those rows in the document, which may span the pieces
of several ranks. Per nano-batch, each server runs all its tasks in ONE varlen kernel call (one
bottom-right causal segment per task), and every query row belongs to exactly one task, so no merge
is needed.

What travels (see :mod:`.transfer`): only rows a server does not hold, each at most once per
nano-batch. Tasks of one document on one server read overlapping key prefixes; their union travels
once (not one prefix per task), rows the server holds itself are read in place (never copied through
the collective), and queries, outputs and log-sum-exps of tasks served by their owner never move.
(Sending every task its whole prefix instead moves a long document's shared prefix once per task.)
Backward trades the same rows plus output gradients and returns dQ to owners and dK/dV, summed over
the tasks that read each row, to every holder.

Ping-pong: each server's tasks are split into two nano-batches of about equal attention cost,
keeping a document's tasks together where that costs little balance (see :func:`pingpong_split`);
the transfers of both are posted before the first computes, so communication hides behind compute
(on GPU the collectives run on NCCL's stream).

Sliding window (the plan's ``window``, see :meth:`~hf_longctx.layout.ShardPlan.with_window`): a task
reads only the keys its rows reach, from ``window - 1`` positions before its first query row to its
last; every segment stays bottom-right aligned, so one kernel window serves the whole call. The
scheduler and the nano-batch split price tasks on the pairs the window leaves visible.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...kernels import accumulation_dtype, attention_backward, attention_forward
from ...layout import Piece, ShardPlan
from ..contract import Backend
from .cost_model import PAIRS, CostModel, FlopsCostModel, WindowedCostModel, query_rows_cost
from .transfer import GatherPlan, Run

PINGPONG_TOLERANCE = 0.1  # halves of a server's tasks may differ by this share of the larger before docs split


@dataclass(frozen=True, order=True)
class CadTask:
    """Query rows ``[q_start, q_end)`` of piece ``piece`` of rank ``owner`` (piece-local rows), computed on
    ``server``. Its keys are the document's causal prefix up to its last query row."""

    owner: int
    piece: int  # index into the owner's pieces
    q_start: int  # piece-local query rows
    q_end: int
    server: int


def pieces_of(plan: ShardPlan, rank: int) -> list[tuple[Piece, int]]:
    """(piece, local row offset) of a rank, in local order."""
    out, pos = [], 0
    for slot in plan.rank_slots(rank):
        for p in slot.pieces:
            out.append((p, pos))
            pos += p.length
    return out


def docs_per_rank(plan: ShardPlan) -> list[list[tuple[int, int]]]:
    """What the scheduler takes: per rank, (piece length, tokens of its document before the piece)."""
    starts = plan.batch.doc_starts
    return [[(p.length, p.start - starts[p.doc]) for p, _ in pieces_of(plan, r)] for r in range(plan.world_size)]


def _holders(plan: ShardPlan) -> dict[int, list[tuple[int, Piece, int]]]:
    """doc -> [(rank, piece, local offset)] in global order."""
    out: dict[int, list] = {}
    for r in range(plan.world_size):
        for p, off in pieces_of(plan, r):
            out.setdefault(p.doc, []).append((r, p, off))
    for v in out.values():
        v.sort(key=lambda x: x[1].start)
    return out


def _all_pieces(plan: ShardPlan) -> list[list[tuple[Piece, int]]]:
    return plan.cached("cad_pieces", lambda: [pieces_of(plan, r) for r in range(plan.world_size)])


def _pairs_model(plan: ShardPlan) -> CostModel:
    """Visible (query, key) pairs as a cost model, under the plan's sliding window."""
    return PAIRS if plan.window is None else WindowedCostModel(PAIRS, plan.window)


def _key_start(plan: ShardPlan, piece: Piece, q_start: int) -> int:
    """First global key position that query rows from ``q_start`` of ``piece`` read."""
    doc_start = plan.batch.doc_starts[piece.doc]
    return doc_start if plan.window is None else max(doc_start, piece.start + q_start - plan.window + 1)


def task_cost(plan: ShardPlan, task: CadTask) -> float:
    """Visible (query, key) pairs of a task: its query rows over the causal prefix of its document
    (the part of it in the plan's sliding window)."""
    return _rows_cost(plan, task, task.q_start, task.q_end)


def _task_key(plan: ShardPlan, task: CadTask) -> tuple[int, int, int]:
    """Canonical order of a server's tasks: by document, then global query row (ties: owner)."""
    piece, _ = _all_pieces(plan)[task.owner][task.piece]
    return piece.doc, piece.start + task.q_start, task.owner


def _rows_cost(plan: ShardPlan, task: CadTask, q_start: int, q_end: int) -> float:
    """Visible (query, key) pairs of query rows ``[q_start, q_end)`` of ``task``'s piece."""
    piece, _ = _all_pieces(plan)[task.owner][task.piece]
    return query_rows_cost(_pairs_model(plan), piece.length, piece.start - plan.batch.doc_starts[piece.doc], q_start,
                           q_end)


def _server_holds_keys(plan: ShardPlan, task: CadTask) -> bool:
    """Whether ``task``'s server holds every key row the task reads. Such a task can be cut and its parts
    spread over both nano-batches for free: no key row travels for it, and query rows are never shared."""
    piece, _ = _all_pieces(plan)[task.owner][task.piece]
    first, last = _key_start(plan, piece, task.q_start), piece.start + task.q_end
    for h, hp, _ in plan.cached("cad_holders", lambda: _holders(plan))[piece.doc]:
        if hp.start >= last:
            break
        if hp.end > first and h != task.server:
            return False
    return True


@dataclass
class _Unit:
    """Tasks of one server that go to the same nano-batch; ``free``: one task that may be cut for free."""

    cost: float
    key: tuple
    tasks: list[CadTask]
    free: bool = False


def _lpt(units: list[_Unit]) -> tuple[list[list[_Unit]], list[float]]:
    """Greedy two-way partition (largest first onto the lighter half; ties go to half 0): deterministic."""
    halves: list[list[_Unit]] = [[], []]
    loads = [0.0, 0.0]
    for u in sorted(units, key=lambda u: (-u.cost, u.key)):
        h = 0 if loads[0] <= loads[1] else 1
        halves[h].append(u)
        loads[h] += u.cost
    return halves, loads


def _gap(loads: list[float]) -> float:
    top = max(loads)
    return abs(loads[0] - loads[1]) / top if top > 0 else 0.0


def _cut_free(plan: ShardPlan, halves: list[list[_Unit]], loads: list[float], tolerance: float
              ) -> tuple[list[list[_Unit]], list[float]]:
    """Balance the halves by moving the last query rows of free tasks from the heavier half to the lighter.

    The rows moved are chosen to carry half the difference (to the nearest row), so one cut usually
    balances a server whose work is dominated by one task it holds the keys of.
    """
    halves, loads = [list(h) for h in halves], list(loads)
    for _ in range(2 * sum(len(h) for h in halves) + 2):  # every pass cuts one unit; bounded for safety
        if _gap(loads) <= tolerance:
            break
        heavy = 0 if loads[0] > loads[1] else 1
        free = [u for u in halves[heavy] if u.free]
        if not free:
            break
        u = max(free, key=lambda u: (u.cost, u.key))
        t = u.tasks[0]
        need = (loads[heavy] - loads[1 - heavy]) / 2
        lo, hi = t.q_start, t.q_end  # smallest x whose rows [x, q_end) cost at most ``need``
        while lo < hi:
            mid = (lo + hi) // 2
            if _rows_cost(plan, t, mid, t.q_end) <= need:
                hi = mid
            else:
                lo = mid + 1
        x = lo
        if x > t.q_start and (abs(_rows_cost(plan, t, x - 1, t.q_end) - need)
                              < abs(_rows_cost(plan, t, x, t.q_end) - need)):
            x -= 1
        if x >= t.q_end:
            break  # not even one row fits: as balanced as rows allow
        moved = CadTask(t.owner, t.piece, x, t.q_end, t.server)
        moved_cost = _rows_cost(plan, t, x, t.q_end)
        halves[heavy].remove(u)
        if x > t.q_start:
            kept = CadTask(t.owner, t.piece, t.q_start, x, t.server)
            halves[heavy].append(_Unit(_rows_cost(plan, t, t.q_start, x), _task_key(plan, kept), [kept]))
        halves[1 - heavy].append(_Unit(moved_cost, _task_key(plan, moved), [moved]))
        loads[heavy] -= moved_cost
        loads[1 - heavy] += moved_cost
    return halves, loads


def _split_server(plan: ShardPlan, tasks: list[CadTask], tolerance: float) -> list[list[CadTask]]:
    """Two halves of one server's tasks of about equal cost, sharing as few key rows as possible.

    Tasks of one document read overlapping key prefixes: in one nano-batch the union travels once,
    across two nano-batches the shared remote rows travel twice. So:

    1. units are whole documents (their tasks whose keys the server lacks), plus every task whose keys
       the server holds on its own (separating it from its document costs no bytes);
    2. largest-first greedy partition, then tasks of the second kind are cut to even the halves
       (:func:`_cut_free`);
    3. only if the halves still differ by more than ``tolerance`` (relative to the larger) are documents
       broken into their tasks, costliest first, and the first split within the tolerance is taken; if
       none reaches it, documents stay whole: bytes are not paid for a balance that misses anyway.
    """
    docs: dict[int, list[CadTask]] = {}
    units = []
    for t in tasks:
        if _server_holds_keys(plan, t):
            units.append(_Unit(task_cost(plan, t), _task_key(plan, t), [t], free=True))
        else:
            docs.setdefault(_task_key(plan, t)[0], []).append(t)
    units += [_Unit(sum(task_cost(plan, t) for t in ts), (d, -1, -1), ts) for d, ts in sorted(docs.items())]

    def attempt(units):
        return _cut_free(plan, *_lpt(units), tolerance)

    halves, loads = attempt(units)
    broken = list(units)
    while _gap(loads) > tolerance:
        whole = [u for u in broken if len(u.tasks) > 1]
        if not whole:
            break
        big = max(whole, key=lambda u: (u.cost, u.key))
        broken.remove(big)
        broken += [_Unit(task_cost(plan, t), _task_key(plan, t), [t]) for t in big.tasks]
        h, lo = attempt(broken)
        if _gap(lo) <= tolerance:
            halves, loads = h, lo
    return [sorted((t for u in half for t in u.tasks), key=lambda t: _task_key(plan, t)) for half in halves]


def pingpong_split(plan: ShardPlan, tasks: Sequence[CadTask], tolerance: float = PINGPONG_TOLERANCE
                   ) -> list[list[CadTask]]:
    """The two nano-batches of ping-pong: every server's tasks split into halves of about equal cost.

    Balanced per server, because a server computes its two halves back to back while the other
    half's transfers run: an empty or tiny half leaves nothing to hide them behind. Cost is visible
    (query, key) pairs (:func:`task_cost`). A pure function of the plan and the task list (sorted
    units, deterministic tie-breaks, no hashing of floats across processes), so every rank derives
    the same nano-batches and agrees on who sends what to whom. See :func:`_split_server` for how
    documents are kept together. A task whose server holds all its keys may come back cut in two (one
    part per nano-batch): the rows covered are the same. Nano-batches with no task on any server and
    tasks without query rows are dropped.
    """
    by_server: dict[int, list[CadTask]] = {}
    for t in tasks:
        if t.q_end > t.q_start:
            by_server.setdefault(t.server, []).append(t)
    halves: list[list[CadTask]] = [[], []]
    for s in sorted(by_server):
        for h, part in enumerate(_split_server(plan, by_server[s], tolerance)):
            halves[h] += part
    return [h for h in halves if h]


@dataclass
class NanoBatch:
    """One nano-batch as seen by one rank: its own tasks (in kernel segment order) and the gathers."""

    tasks: list[CadTask]
    q: GatherPlan
    kv: GatherPlan
    cu_q: list[int]
    cu_k: list[int]
    max_q: int
    max_k: int


def build_nano_batch(plan: ShardPlan, tasks: Sequence[CadTask], rank: int) -> NanoBatch:
    """Gathers of one nano-batch (``tasks`` of all servers) for ``rank``.

    Per server and task: the query rows (one run at the owner) and the key rows, the document's prefix
    up to the task's last query row (one run per holder piece). :class:`GatherPlan` turns these into
    unique-row transfers; the varlen kernel sees one segment per task (bottom-right causal).
    """
    world = plan.world_size
    pieces = _all_pieces(plan)
    holders = plan.cached("cad_holders", lambda: _holders(plan))
    q_runs: list[list[Run]] = [[] for _ in range(world)]
    kv_runs: list[list[Run]] = [[] for _ in range(world)]
    mine = []
    cu_q, cu_k, max_q, max_k = [0], [0], 1, 1
    for t in sorted((t for t in tasks if t.q_end > t.q_start), key=lambda t: (t.server, *_task_key(plan, t))):
        piece, local = pieces[t.owner][t.piece]
        q_runs[t.server].append((t.owner, local + t.q_start, local + t.q_end))
        # keys: the document up to the last query row, from where the window of the first one starts
        first, last = _key_start(plan, piece, t.q_start), piece.start + t.q_end
        n_k = 0
        for h, hp, hoff in holders[piece.doc]:
            if hp.start >= last:
                break
            lo, hi = max(hp.start, first), min(hp.end, last)
            if lo >= hi:
                continue
            kv_runs[t.server].append((h, hoff + lo - hp.start, hoff + hi - hp.start))
            n_k += hi - lo
        if t.server == rank:
            n_q = t.q_end - t.q_start
            mine.append(t)
            cu_q.append(cu_q[-1] + n_q)
            cu_k.append(cu_k[-1] + n_k)
            max_q, max_k = max(max_q, n_q), max(max_k, n_k)
    rows = plan.token_counts
    return NanoBatch(mine, GatherPlan(q_runs, rank, rows), GatherPlan(kv_runs, rank, rows), cu_q, cu_k, max_q, max_k)


def nano_batches(plan: ShardPlan, tasks: Sequence[CadTask], rank: int, pingpong: bool, device) -> list[NanoBatch]:
    """The nano-batches of ``rank`` (two balanced halves with ping-pong, else one), cached on the plan."""
    key = tuple(tasks)

    def build():
        groups = plan.cached(("cad_pingpong", key), lambda: pingpong_split(plan, tasks)) if pingpong else [list(tasks)]
        out = []
        for g in groups:
            nb = build_nano_batch(plan, g, rank)
            nb.q.to(device)
            nb.kv.to(device)
            out.append(nb)
        return out

    return plan.cached(("cad_nano", key, rank, pingpong, str(device)), build)


def prepare(plan: ShardPlan, options: dict) -> dict:
    """Runner hook: schedule the plan's documents onto servers (cached per plan, so per sliding window,
    and eps)."""
    if "tasks" in options:
        return options
    eps = options.get("eps", 0.1)

    def build():
        from .scheduler import schedule

        model = FlopsCostModel() if plan.window is None else WindowedCostModel(FlopsCostModel(), plan.window)
        sched = schedule(docs_per_rank(plan), plan.world_size, eps=eps, cost_model=model)
        return [CadTask(t.rank, t.doc, t.q_start, t.q_end, t.server) for t in sched.tasks]

    return {**options, "tasks": plan.cached(("cad_tasks", eps), build)}


def attention_load(plan: ShardPlan) -> list[int]:
    """Visible (query, key) pairs each server computes under the scheduled tasks."""
    work = [0] * plan.world_size
    for t in prepare(plan, {})["tasks"]:
        work[t.server] += round(task_cost(plan, t))
    return work


def _lse_rows(lse: torch.Tensor) -> torch.Tensor:
    """(H, T) -> (T, H): log-sum-exps as rows, so they travel with their query rows."""
    return lse.t().contiguous()


def _no_rows(like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.empty(0, *like.shape[1:], dtype=dtype or like.dtype, device=like.device)


def run_forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of this rank's query rows; this rank also serves its tasks of every nano-batch.

    All fetches are posted first (nano-batch 1's transfers run while nano-batch 0 computes); results of
    local tasks are written in place, the others return with one all_to_all per nano-batch.
    """
    nbs = nano_batches(ctx.plan, ctx.options["tasks"], ctx.rank, ctx.options.get("pingpong", True), q.device)
    acc = accumulation_dtype(q.dtype)
    out = torch.zeros_like(q)
    lse_rows = torch.full((q.shape[0], q.shape[1]), float("-inf"), dtype=acc, device=q.device)
    posted = [(nb.q.start([q], ctx.group), nb.kv.start([k, v], ctx.group)) for nb in nbs]
    returns = []
    for nb, (pq, pkv) in zip(nbs, posted):
        (qb,) = nb.q.gather(pq, [q])
        kb, vb = nb.kv.gather(pkv, [k, v])
        if nb.tasks:
            ob, lb = attention_forward(qb, kb, vb, nb.cu_q, nb.cu_k, nb.max_q, nb.max_k, causal=True,
                                       softmax_scale=ctx.scale, kernel=ctx.kernel, window=ctx.plan.window)
            lb = _lse_rows(lb.to(acc))
        else:
            ob, lb = _no_rows(q), _no_rows(lse_rows)
        nb.q.scatter_local([ob, lb], [out, lse_rows], add=False)
        returns.append((nb, nb.q.start_return([ob, lb], ctx.group)))
    for nb, pending in returns:
        nb.q.finish_return(pending, [out, lse_rows], add=False)
    return out, lse_rows.t().contiguous()


def run_backward(ctx, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of this rank's rows: the forward's gathers again, gradients returned and summed in fp32.

    Key gradients of tasks that read the same rows add up: in the server's unique-row buffer for
    remote rows (then once more at the holder, across servers), directly in dk/dv for local rows.
    """
    acc = accumulation_dtype(q.dtype)
    nbs = nano_batches(ctx.plan, ctx.options["tasks"], ctx.rank, ctx.options.get("pingpong", True), q.device)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    q_side = [q, out, dout.contiguous(), _lse_rows(lse)]
    posted = [(nb.q.start(q_side, ctx.group), nb.kv.start([k, v], ctx.group)) for nb in nbs]
    returns = []
    for nb, (pq, pkv) in zip(nbs, posted):
        qb, ob, db, lb = nb.q.gather(pq, q_side)
        kb, vb = nb.kv.gather(pkv, [k, v])
        if nb.tasks:
            gq, gk, gv = attention_backward(db, qb, kb, vb, ob, lb.t().contiguous(), nb.cu_q, nb.cu_k, nb.max_q,
                                            nb.max_k, causal=True, softmax_scale=ctx.scale, kernel=ctx.kernel,
                                            window=ctx.plan.window)
            gq, gk, gv = gq.to(acc), gk.to(acc), gv.to(acc)
        else:
            gq, gk, gv = _no_rows(q, acc), _no_rows(k, acc), _no_rows(v, acc)
        nb.q.scatter_local([gq], [dq], add=True)
        nb.kv.scatter_local([gk, gv], [dk, dv], add=True)
        returns.append((nb, nb.q.start_return([gq], ctx.group), nb.kv.start_return([gk, gv], ctx.group)))
    for nb, pq, pkv in returns:
        nb.q.finish_return(pq, [dq], add=True)
        nb.kv.finish_return(pkv, [dk, dv], add=True)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class CadBackend(Backend):
    """Backend ``cad``: the runtime above behind the backend contract (options: ``eps``, ``pingpong``)."""

    name = "cad"
    summary = "CAD: documents stay whole; a scheduler balances core-attention tasks over all ranks as servers"
    default_strategy = "cad"
    strategies = ("cad", "contiguous")

    def prepare(self, plan, options):
        return prepare(plan, options)

    def forward(self, run, q, k, v):
        return run_forward(run, q, k, v)

    def backward(self, run, dout, q, k, v, out, lse):
        return run_backward(run, dout, q, k, v, out, lse)

    def attention_load(self, plan):
        return attention_load(plan)
