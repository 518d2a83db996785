"""CAD's busiest server lowered in predicted kernel time, one task move (or cut) at a time.

Why: the scheduler balances task prices, which add up over a server's tasks. What a server's kernels take does
not: ping-pong cuts some tasks in two, every call costs something of its own, and a call's last blocks can run
alone (its tail, :mod:`hf_longctx.kernels.launch`), all depending on what else the server computes. The
runtime feeds those costs back to the scheduler as per-server offsets (:func:`~.runtime.cad_schedule`), but a
server's offset changes with what it is given, so offsets chase their own tail: at 64 servers of 8K rows the
schedules so made stayed 4-5% above the mean in predicted time. Here the prediction itself is the objective:
the busiest server gives one of its tasks, whole or its first rows, to one of the least busy servers, when both
then end below the busiest's old time; repeated a bounded number of times.

Only tasks' servers change, and a task may be cut in two at a row, or at a key (a *key cut*, see :mod:`.tasks`):
its first keys, which all its rows see, go to another server as a rectangle. Every (query row, key) pair is
still computed once, so outputs and gradients are those of any other schedule. Key cuts matter where rows can
no longer be cut finer: a long document's last rows over its whole prefix (ProLong at 64 servers of 8K rows:
the smallest row cut of its longest document was 3-5% of a server's time). A moved task's rows and keys travel
to its new server; the schedule's bytes are counted again from the final tasks
(:func:`~.scheduler.task_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from ...layout import ShardPlan
from .cost_model import CostModel
from .shared_pricing import PricingShare, priced_together
from .tasks import CadTask, first_row_in_doc, rows_cost

REFINE_MOVES = 64  # moves (or cuts) at most per schedule (it stops sooner when no move helps)
# least busy servers tried as receivers per move: a receiver whose forward calls would pass one block per SM runs
# its long blocks two to an SM (LaunchGrid.forward_pairing), so the least busy one is often not the best. With 8
# instead of 3, ProLong 128K at 64 servers was predicted 1.013 instead of 1.063 max/mean on an H200's model (the
# worst of 24 batches of the emulation's mixes 1.016 instead of 1.063), for twice the refinement's time.
REFINE_TARGETS = 8
# when none of the least busy servers takes a part of the busiest's work, the next ones are tried, twice as many each
# time, up to this many in all. On an H200's FlashAttention-4 launch model at 64 servers, Pretrain 512K's schedules
# stopped at 1.024 and 1.025 predicted max/mean with 16 and reached 1.016 and 1.020 with 64; the others stayed as
# they were, in the same host time (a step widens only where the least busy take nothing; Pretrain seed 0 took
# 1.5 s instead of 0.9 on a 2-core host). Emulated on the H200 (then with cuts
# of 64 rows, which moved FA4's predictions by under 0.001), the measured max/mean did not change beyond the model's
# own error (1.025, 1.057, 1.035 against 1.023, 1.043, 1.053 for seeds 0-2). On ProLong 128K (seed 1) 16 had
# reached 1.017 where 8 stopped at 1.024
REFINE_WIDEST = 64
# a step with more moves than this is screened (see refine_in_time's ``screen``): below it, the additive estimate
# ranks too many of the moves that win low (ProLong 128K at 64 servers, about 130 moves per step: 6 batches'
# predicted max/mean 1.0103 on average pricing every move, 1.0142 screened to 32 in a row)
SCREEN_ABOVE = 256
CUT_ROWS = 128  # a cut leaves whole kernel tiles of rows on both sides
CUT_KEYS = 128  # a key cut leaves whole kernel tiles of keys on both sides


ServerCost = Callable[[Sequence[CadTask]], float]


def _first_rows_for(plan: ShardPlan, model: CostModel, t: CadTask, amount: float) -> int | None:
    """The row ``r`` (a multiple of :data:`CUT_ROWS` past ``t.q_start``) whose rows ``[q_start, r)`` cost about
    ``amount``; None when no cut leaves rows on both sides."""
    lo, hi = 1, (t.q_end - t.q_start - 1) // CUT_ROWS  # tiles of rows that may move
    if hi < lo:
        return None
    while lo < hi:  # the first tile count whose rows cost at least the amount
        mid = (lo + hi) // 2
        if rows_cost(plan, t, t.q_start, t.q_start + mid * CUT_ROWS, model) < amount:
            lo = mid + 1
        else:
            hi = mid
    return t.q_start + lo * CUT_ROWS


def _first_keys_for(plan: ShardPlan, model: CostModel, t: CadTask, amount: float) -> int | None:
    """The key count ``c`` (a multiple of :data:`CUT_KEYS`) whose rectangle of ``t``'s rows over its first ``c``
    keys costs about ``amount``; None when ``t`` has no such keys to give (a rectangle, under a sliding window,
    on a model that cannot price rectangles, or fewer keys before its first row than a cut leaves)."""
    if t.is_rect or plan.window is not None or not hasattr(model, "rect_cost"):
        return None
    before = first_row_in_doc(plan, t) - t.key_lo  # keys every row sees
    lo, hi = 1, before // CUT_KEYS
    if hi < lo:
        return None
    rows = t.q_end - t.q_start
    while lo < hi:
        mid = (lo + hi) // 2
        if model.rect_cost(rows, mid * CUT_KEYS) < amount:
            lo = mid + 1
        else:
            hi = mid
    return lo * CUT_KEYS


def _shares_rows(tasks: Sequence[CadTask], part: CadTask) -> bool:
    """Whether ``tasks`` compute any of ``part``'s rows (over other keys): a server computes a row once."""
    return any((t.owner, t.piece) == (part.owner, part.piece) and t.q_start < part.q_end and part.q_start < t.q_end
               for t in tasks)


def _place(tasks: list[CadTask], part: CadTask) -> list[CadTask]:
    """``tasks`` with ``part`` added, merged with a task of the same piece and keys whose rows it continues."""
    for i, t in enumerate(tasks):
        if (t.owner, t.piece, t.key_lo, t.key_hi) == (part.owner, part.piece, part.key_lo, part.key_hi) \
                and (t.q_end == part.q_start or part.q_end == t.q_start):
            return tasks[:i] + [replace(t, q_start=min(t.q_start, part.q_start), q_end=max(t.q_end, part.q_end))] \
                + tasks[i + 1:]
    return tasks + [part]


def refine_in_time(plan: ShardPlan, tasks: Sequence[CadTask], model: CostModel, server_cost: ServerCost,
                   moves: int = REFINE_MOVES, targets: int = REFINE_TARGETS, key_cuts: bool = True,
                   widest: int = REFINE_WIDEST, screen: int | None = None,
                   share: PricingShare | None = None) -> list[CadTask]:
    """``tasks`` with the busiest server (by ``server_cost`` of its tasks) lowered while a move helps.

    Each step tries, for every task of the busiest server and each of the ``targets`` least busy servers that
    compute none of its rows, moving the whole task, its first rows, or (with ``key_cuts``, on a model that
    prices rectangles) its first keys, the part priced (by ``model``) at half the two servers' gap; the move
    that leaves the lower of the two new times' maximum wins, when that maximum is below the busiest's time. When
    no move to those servers helps, the next least busy are tried, twice as many each time, up to ``widest``.

    ``screen``: price moves in full in the order of their additive estimate (the two servers' times less and plus
    the moved part's price alone), lowest maximum first, and end the step once ``screen`` moves in a row found
    nothing better, on steps of more than :data:`SCREEN_ABOVE` moves; None prices every move. Why: pricing a
    server in full runs ping-pong's split, the call planner and the launch simulation of every call, and a busiest
    server of a hundred short documents offers hundreds of moves per step (SFT 256K at 4 servers: 10 s per
    schedule on a 2-core host, 1.0 s screened to 32, the predicted balance within 0.002).

    ``share``: the ranks of a group price each step's moves together (:mod:`.shared_pricing`), a batch of them at
    a time (all of a step's, or ``max(world, screen)`` in estimate order on a screened step), and walk the priced
    batch in order as one rank walks its moves: the same tasks as without, in about 1/W of the pricing time (a
    batch may price moves a lone rank would have skipped once a better one was found).
    """
    world = plan.world_size
    by_server: list[list[CadTask]] = [[] for _ in range(world)]
    for t in tasks:
        if t.q_end > t.q_start:
            by_server[t.server].append(t)
    memo: dict[tuple[CadTask, ...], float] = {}

    def priced(lists: list[list[CadTask]]) -> list[float]:
        """``server_cost`` of each task list, remembered: the same lists come back across receivers and moves.
        With ``share`` the lists not yet known are priced by the group together (every rank knows the same)."""
        keys = [tuple(ts) for ts in lists]
        todo = list(dict.fromkeys(key for key in keys if key and key not in memo))
        memo.update(zip(todo, priced_together(lambda key: server_cost(list(key)), todo, share)))
        return [memo[key] if key else 0.0 for key in keys]

    cost = np.array(priced(by_server))

    def candidates(top: int, receivers: list[int]):
        """Every move of one of the busiest server's tasks (whole, its first rows or its first keys) to one of
        ``receivers``: (task, receiver, what the busiest keeps of it, the part given)."""
        out = []
        for t in by_server[top]:
            for dst in receivers:
                if _shares_rows(by_server[dst], t):
                    continue
                half = (cost[top] - cost[dst]) / 2
                out.append((t, dst, [], replace(t, server=dst)))  # the whole task
                row = _first_rows_for(plan, model, t, half)
                if row is not None and row < t.q_end:  # its first rows
                    out.append((t, dst, [replace(t, q_start=row)], replace(t, q_end=row, server=dst)))
                keys = _first_keys_for(plan, model, t, half) if key_cuts else None
                if keys is not None:  # its first keys, as a rectangle
                    out.append((t, dst, [replace(t, key_lo=t.key_lo + keys)],
                                replace(t, key_hi=t.key_lo + keys, server=dst)))
        return out

    def estimate(top: int, move) -> float:
        """A move's peak, additive: the two servers' times less and plus the moved part's price alone (no call
        terms, no tails)."""
        t, dst, left, part = move
        kept = sum(rows_cost(plan, x, x.q_start, x.q_end, model) for x in left)
        return max(cost[top] - rows_cost(plan, t, t.q_start, t.q_end, model) + kept,
                   cost[dst] + rows_cost(plan, part, part.q_start, part.q_end, model))

    def best_move(top: int, receivers: list[int]):
        """The move of one of the busiest server's tasks (or a part of it) to one of ``receivers`` that leaves the
        lowest maximum of the two, below the busiest's time: (peak, kept, receiver, given, their times), or None.
        With ``screen``, moves are priced in the order of their additive estimate, until ``screen`` in a row
        found nothing better."""
        found = candidates(top, receivers)
        screened = screen is not None and len(found) > SCREEN_ABOVE
        if screened:
            found.sort(key=lambda move: estimate(top, move))
        # one move at a time alone; with a share, a batch priced by the group at once
        batch = 1 if share is None or share.world == 1 else max(share.world, screen) if screened else max(len(found), 1)
        best: tuple[float, list[CadTask], int, list[CadTask], float, float] | None = None
        since_best = 0  # moves priced since the best so far was found
        for first in range(0, len(found), batch):
            if screened and since_best >= screen:
                return best
            moves_now = found[first:first + batch]
            bound = cost[top] * (1 - 1e-6) if best is None else min(cost[top] * (1 - 1e-6), best[0])
            kept = [[x for x in by_server[top] if x is not t] + left for t, _, left, _ in moves_now]
            after_top = priced(kept)
            # a receiver is priced only where the busiest would end below what wins now
            given = [_place(by_server[dst], part) if a < bound else None
                     for (_, dst, _, part), a in zip(moves_now, after_top)]
            receiver_prices = iter(priced([g for g in given if g is not None]))
            after_dst = [next(receiver_prices) if g is not None else float("inf") for g in given]
            for i, (_, dst, _, _) in enumerate(moves_now):  # in order, as one rank walks them
                if screened and since_best >= screen:
                    return best
                since_best += 1
                bound = cost[top] * (1 - 1e-6) if best is None else min(cost[top] * (1 - 1e-6), best[0])
                if after_top[i] >= bound:  # the busiest would stay above what wins
                    continue
                peak = max(after_top[i], after_dst[i])
                if peak < bound:
                    best = (peak, kept[i], dst, given[i], after_top[i], after_dst[i])
                    since_best = 0
        return best

    for _ in range(moves):
        top = int(np.argmax(cost))
        order = [int(s) for s in np.argsort(cost, kind="stable") if s != top]
        # the least busy servers first; when none of them takes a part, twice as many (up to ``widest``)
        tried, width, best = 0, min(targets, len(order)), None
        while best is None and tried < width:
            best = best_move(top, order[tried:width])
            tried, width = width, min(2 * width, widest, len(order))
        if best is None:
            break
        _, kept, dst, given, after_top, after_dst = best
        by_server[top], by_server[dst] = kept, given
        cost[top], cost[dst] = after_top, after_dst
    return [t for ts in by_server for t in ts]
