"""Ping-pong: a server's CAD tasks split into two nano-batches of about equal attention cost.

The runtime fetches the rows of both nano-batches before the first computes, and returns the first's
results while the second computes, so that transfer hides behind the second's kernels; that only works
when both halves carry work, on every server. The split keeps a document's tasks together where that
costs little balance: tasks of one document on one server read overlapping key prefixes, whose union
travels once per nano-batch (see :func:`pingpong_split`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ...layout import ShardPlan
from .tasks import CadTask, rows_cost, server_holds_keys, task_cost, task_key

PINGPONG_TOLERANCE = 0.1  # halves of a server's tasks may differ by this share of the larger before docs split


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
            if rows_cost(plan, t, mid, t.q_end) <= need:
                hi = mid
            else:
                lo = mid + 1
        x = lo
        if x > t.q_start and (abs(rows_cost(plan, t, x - 1, t.q_end) - need)
                              < abs(rows_cost(plan, t, x, t.q_end) - need)):
            x -= 1
        if x >= t.q_end:
            break  # not even one row fits: as balanced as rows allow
        moved = replace(t, q_start=x)
        moved_cost = rows_cost(plan, t, x, t.q_end)
        halves[heavy].remove(u)
        if x > t.q_start:
            kept = replace(t, q_end=x)
            halves[heavy].append(_Unit(rows_cost(plan, t, t.q_start, x), task_key(plan, kept), [kept]))
        halves[1 - heavy].append(_Unit(moved_cost, task_key(plan, moved), [moved]))
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
        if server_holds_keys(plan, t):
            units.append(_Unit(task_cost(plan, t), task_key(plan, t), [t], free=True))
        else:
            docs.setdefault(task_key(plan, t)[0], []).append(t)
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
        broken += [_Unit(task_cost(plan, t), task_key(plan, t), [t]) for t in big.tasks]
        h, lo = attempt(broken)
        if _gap(lo) <= tolerance:
            halves, loads = h, lo
    return [sorted((t for u in half for t in u.tasks), key=lambda t: task_key(plan, t)) for half in halves]


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
