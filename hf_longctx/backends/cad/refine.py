"""CAD's busiest server lowered in predicted kernel time, one task move (or cut) at a time.

Why: the scheduler balances task prices, which add up over a server's tasks. What a server's kernels take does
not: ping-pong cuts some tasks in two, every call costs something of its own, and a call's last blocks can run
alone (its tail, :mod:`hf_longctx.kernels.launch`), all depending on what else the server computes. The
runtime feeds those costs back to the scheduler as per-server offsets (:func:`~.runtime.cad_schedule`), but a
server's offset changes with what it is given, so offsets chase their own tail: at 64 servers of 8K rows the
schedules so made stayed 4-5% above the mean in predicted time. Here the prediction itself is the objective:
the busiest server gives one of its tasks, whole or its first rows, to one of the least busy servers, when both
then end below the busiest's old time; repeated a bounded number of times. Where no such move helps, an ejection
chain may: the busiest gives a part to a server that then ends above the busiest's old time, and that server passes
some of its own tasks on to the least busy until all of them end below it.

Only tasks' servers change, and a task may be cut in two at a row, or at a key (a *key cut*, see :mod:`.tasks`):
its first keys, which all its rows see, go to another server as a rectangle. Every (query row, key) pair is
still computed once, so outputs and gradients are those of any other schedule. Key cuts matter where rows can
no longer be cut finer: a long document's last rows over its whole prefix (ProLong at 64 servers of 8K rows:
the smallest row cut of its longest document was 3-5% of a server's time). A moved task's rows and keys travel
to its new server; the schedule's bytes are counted again from the final tasks
(:func:`~.scheduler.task_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from ...layout import ShardPlan
from .cost_model import CostModel
from .shared_pricing import PricingShare, priced_together
from .tasks import CadTask, first_row_in_doc, rows_cost

REFINE_MOVES = 64  # moves (or cuts) at most per schedule (it stops sooner when no move helps)
# least busy servers tried as receivers per move: a receiver whose forward calls would pass one block per SM runs
# its long blocks two to an SM (LaunchGrid.forward_pairing), so the least busy one is often not the best. 8 instead
# of 3 balanced the worst batches far closer, for twice the refinement's time (bench/results/2026-11-29_cad-fa4.md).
REFINE_TARGETS = 8
# when none of the least busy servers takes a part of the busiest's work, the next ones are tried, twice as many each
# time, up to this many in all. On FlashAttention-4's launch model at 64 servers, 64 took schedules
# that stopped at 16 lower and left the others as they were, in the same host time (a step widens only where the least
# busy take nothing); emulated, the measured max/mean did not change beyond the model's own error
# (bench/results/2026-12-04_from-modules.md)
REFINE_WIDEST = 64
# a step with more moves than this is screened (see refine_in_time's ``screen``): below it, the additive estimate
# ranks too many of the moves that win low (ProLong 128K at 64 servers, about 130 moves per step, balanced
# worse screened; measured: bench/results/2026-11-22_backends-multi-gpu.md)
SCREEN_ABOVE = 256
# ejection chains (refine_in_time's ``chains``) are tried only while the busiest server stands this far above the
# mean. On FlashAttention-4's launch model at 64 servers chains from 1.01 took the worst batches from
# several percent to about 1% predicted max/mean for about twice the host time of those refinements; chains at any
# imbalance balanced little better for several times the time (measured: bench/results/2026-11-29_cad-fa4.md)
CHAIN_ABOVE = 1.01
# the busiest's first hops tried per chain, least time on their receiver first, the first chain found taken: 4 and 8
# found the same chains on those 18 batches. Taking the chain of the lowest peak of 4 instead ended SFT 512K (seed 4)
# at 1.015 where the first found reached 1.004 (a lower peak may leave more servers close below it)
CHAIN_FIRST = 4
# moves at most by which a chain's receiver passes its excess on: with 1 or 2, SFT 512K (seed 4) stopped at 1.015,
# where receivers of many short documents pass a thin cut's cost on in three pieces that fit where they land
CHAIN_SHEDS = 3
CUT_ROWS = 128  # a cut leaves whole kernel tiles of rows on both sides
CUT_KEYS = 128  # a key cut leaves whole kernel tiles of keys on both sides


ServerCost = Callable[[Sequence[CadTask]], float]
Changes = dict[int, tuple[list[CadTask], float]]  # server -> its new tasks and their predicted time
Move = tuple[CadTask, int, list[CadTask], CadTask]  # a task, its receiver, what its server keeps of it, the part given


class PricedMove(NamedTuple):
    """A move priced in full: a single step's, or a chain's first hop."""

    peak: float  # the higher of the two new times
    kept: list[CadTask]  # the giver's tasks after it
    receiver: int
    given: list[CadTask]  # the receiver's tasks after it
    giver_time: float
    receiver_time: float

    def changes(self, giver: int) -> Changes:
        """The move as changes of ``giver`` (whose tasks it priced) and its receiver."""
        return {giver: (self.kept, self.giver_time), self.receiver: (self.given, self.receiver_time)}


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


class _Refinement:
    """One refinement's state: every server's tasks and predicted time, and every task list's price once known."""

    def __init__(self, plan: ShardPlan, tasks: Sequence[CadTask], model: CostModel, server_cost: ServerCost,
                 targets: int, widest: int, key_cuts: bool, screen: int | None, share: PricingShare | None) -> None:
        self.plan, self.model, self.server_cost = plan, model, server_cost
        self.targets, self.widest, self.key_cuts, self.screen, self.share = targets, widest, key_cuts, screen, share
        self.by_server: list[list[CadTask]] = [[] for _ in range(plan.world_size)]
        for t in tasks:
            if t.q_end > t.q_start:
                self.by_server[t.server].append(t)
        self.memo: dict[tuple[CadTask, ...], float] = {}
        self.cost = np.array(self.priced(self.by_server))

    def priced(self, lists: list[list[CadTask]]) -> list[float]:
        """``server_cost`` of each task list, remembered: the same lists come back across receivers and moves.
        With ``share`` the lists not yet known are priced by the group together (every rank knows the same)."""
        keys = [tuple(ts) for ts in lists]
        todo = list(dict.fromkeys(key for key in keys if key and key not in self.memo))
        self.memo.update(zip(todo, priced_together(lambda key: self.server_cost(list(key)), todo, self.share)))
        return [self.memo[key] if key else 0.0 for key in keys]

    def least_busy(self, besides: Sequence[int]) -> list[int]:
        """Every server but ``besides``, the least busy first (ties in server order, the same on every rank)."""
        return [int(s) for s in np.argsort(self.cost, kind="stable") if s not in besides]

    def apply(self, changes: Changes) -> Changes:
        """Give the servers of ``changes`` their new tasks and times; what they had, as changes that undo these."""
        before = {s: (self.by_server[s], float(self.cost[s])) for s in changes}
        for s, (tasks, time) in changes.items():
            self.by_server[s], self.cost[s] = tasks, time
        return before

    def candidates(self, src: int, receivers: list[int], movable: Sequence[CadTask] | None = None,
                   cap: float | None = None) -> list[Move]:
        """Every move of one of ``src``'s tasks (of ``movable``, default all) to one of ``receivers`` that computes
        none of its rows: the whole task, its first rows, or (with ``key_cuts``) its first keys, the part priced at
        half the two servers' gap, and at most ``cap`` less the receiver's time (the room a chain leaves it)."""
        plan, model, out = self.plan, self.model, []
        for t in self.by_server[src] if movable is None else movable:
            for dst in receivers:
                if _shares_rows(self.by_server[dst], t):
                    continue
                amount = (self.cost[src] - self.cost[dst]) / 2
                if cap is not None:
                    amount = min(amount, cap - self.cost[dst])
                out.append((t, dst, [], replace(t, server=dst)))  # the whole task
                row = _first_rows_for(plan, model, t, amount)
                if row is not None and row < t.q_end:  # its first rows
                    out.append((t, dst, [replace(t, q_start=row)], replace(t, q_end=row, server=dst)))
                keys = _first_keys_for(plan, model, t, amount) if self.key_cuts else None
                if keys is not None:  # its first keys, as a rectangle
                    out.append((t, dst, [replace(t, key_lo=t.key_lo + keys)],
                                replace(t, key_hi=t.key_lo + keys, server=dst)))
        return out

    def estimate(self, src: int, move: Move) -> float:
        """A move's peak, additive: the two servers' times less and plus the moved part's price alone (no call
        terms, no tails)."""
        plan, model = self.plan, self.model
        t, dst, left, part = move
        kept = sum(rows_cost(plan, x, x.q_start, x.q_end, model) for x in left)
        return max(self.cost[src] - rows_cost(plan, t, t.q_start, t.q_end, model) + kept,
                   self.cost[dst] + rows_cost(plan, part, part.q_start, part.q_end, model))

    def best_move(self, src: int, receivers: list[int], limit: float, movable: Sequence[CadTask] | None = None,
                  cap: float | None = None) -> PricedMove | None:
        """The move (:meth:`candidates`) of one of ``src``'s tasks to one of ``receivers`` that leaves the lowest
        maximum of the two new times, below ``limit``, the receiver's also below ``cap``; None if none does. With
        ``screen``, moves are priced in the order of their additive estimate, until ``screen`` in a row found
        nothing better."""
        screen, share = self.screen, self.share
        found = self.candidates(src, receivers, movable, cap)
        screened = screen is not None and len(found) > SCREEN_ABOVE
        if screened:
            found.sort(key=lambda move: self.estimate(src, move))
        cap = float("inf") if cap is None else cap
        # one move at a time alone; with a share, a batch priced by the group at once
        batch = 1 if share is None or share.world == 1 else max(share.world, screen) if screened else max(len(found), 1)
        best: PricedMove | None = None
        since_best = 0  # moves priced since the best so far was found
        for first in range(0, len(found), batch):
            if screened and since_best >= screen:
                return best
            moves_now = found[first:first + batch]
            bound = limit if best is None else min(limit, best.peak)
            kept = [[x for x in self.by_server[src] if x is not t] + left for t, _, left, _ in moves_now]
            after_src = self.priced(kept)
            # a receiver is priced only where the giver would end below what wins now
            given = [_place(self.by_server[dst], part) if a < bound else None
                     for (_, dst, _, part), a in zip(moves_now, after_src)]
            receiver_prices = iter(self.priced([g for g in given if g is not None]))
            after_dst = [next(receiver_prices) if g is not None else float("inf") for g in given]
            for i, (_, dst, _, _) in enumerate(moves_now):  # in order, as one rank walks them
                if screened and since_best >= screen:
                    return best
                since_best += 1
                bound = limit if best is None else min(limit, best.peak)
                if after_src[i] >= bound:  # the giver would stay above what wins
                    continue
                peak = max(after_src[i], after_dst[i])
                if peak < bound and after_dst[i] < cap:
                    best = PricedMove(peak, kept[i], dst, given[i], after_src[i], after_dst[i])
                    since_best = 0
        return best

    def receiver_groups(self, besides: Sequence[int]) -> Iterator[list[int]]:
        """The ``targets`` least busy servers but ``besides``, then the next ones, twice as many each time, up to
        ``widest`` in all."""
        order = self.least_busy(besides)
        tried, width = 0, min(self.targets, len(order))
        while tried < width:
            yield order[tried:width]
            tried, width = width, min(2 * width, self.widest, len(order))

    def widening(self, src: int, besides: Sequence[int], limit: float, movable: Sequence[CadTask] | None = None,
                 cap: float | None = None) -> PricedMove | None:
        """:meth:`best_move` to each of :meth:`receiver_groups` in turn, until one takes a part."""
        for receivers in self.receiver_groups(besides):
            best = self.best_move(src, receivers, limit, movable, cap)
            if best is not None:
                return best
        return None

    def single_move(self, top: int) -> Changes | None:
        """The busiest's best move (:meth:`widening`) below its time, as changes; None if none."""
        best = self.widening(top, [top], self.cost[top] * (1 - 1e-6))
        return None if best is None else best.changes(top)

    def first_hops(self, top: int) -> list[PricedMove]:
        """The busiest's moves that leave it lower, whatever they leave on their receiver: the :data:`CHAIN_FIRST`
        that leave the least there, of the moves the step's single moves (which found none) priced in every case:
        each group of receivers' moves, or on a screened group the ``screen`` first in estimate order. Why: they are
        priced already (a screened step of a busiest of many short tasks would take seconds to price in full), and
        are the same whether the step was priced alone or by a group (which prices more)."""
        limit, found = self.cost[top] * (1 - 1e-6), []
        for receivers in self.receiver_groups([top]):
            moves = self.candidates(top, receivers)
            if self.screen is not None and len(moves) > SCREEN_ABOVE:
                moves = sorted(moves, key=lambda move: self.estimate(top, move))[:self.screen]
            found += moves
        kept = [[x for x in self.by_server[top] if x is not t] + left for t, _, left, _ in found]
        after_top = self.priced(kept)
        lower = [i for i, a in enumerate(after_top) if a < limit]
        given = [_place(self.by_server[found[i][1]], found[i][3]) for i in lower]
        hops = [PricedMove(max(after_top[i], d), kept[i], found[i][1], g, after_top[i], d)
                for i, g, d in zip(lower, given, self.priced(given))]
        return sorted(hops, key=lambda hop: hop.receiver_time)[:CHAIN_FIRST]

    def chain_from(self, top: int, hop: PricedMove, limit: float) -> Changes | None:
        """``hop``, then its receiver giving its own tasks (whole or a part, not what it was given) to the least
        busy, one move at a time (at most :data:`CHAIN_SHEDS`), each lowering it and leaving the server given to
        below ``limit``, until the receiver is below ``limit`` too: the changes, or None. Every hop is a move
        as a single step makes, so every row is still computed once and by one server. The state is left as it
        was."""
        dst = hop.receiver
        received = set(hop.given) - set(self.by_server[dst])  # what it was given, merged or not, stays with it
        undo = self.apply(hop.changes(top))
        for _ in range(CHAIN_SHEDS):
            if self.cost[dst] < limit:
                break
            own = [x for x in self.by_server[dst] if x not in received]
            move = self.widening(dst, [top, dst], self.cost[dst] * (1 - 1e-6), own, cap=limit)
            if move is None:
                break
            undo = {**self.apply(move.changes(dst)), **undo}
        done = {s: (self.by_server[s], float(self.cost[s])) for s in undo} if self.cost[dst] < limit else None
        self.apply(undo)
        return done

    def chain(self, top: int) -> Changes | None:
        """Where no single move lowers the busiest: the first ejection chain (:meth:`chain_from`) of its first
        hops, in order, that leaves every server it touches below the busiest's time; None if none does."""
        limit = self.cost[top] * (1 - 1e-6)
        for hop in self.first_hops(top):
            found = self.chain_from(top, hop, limit)
            if found is not None:
                return found
        return None


def refine_in_time(plan: ShardPlan, tasks: Sequence[CadTask], model: CostModel, server_cost: ServerCost,
                   moves: int = REFINE_MOVES, targets: int = REFINE_TARGETS, key_cuts: bool = True,
                   widest: int = REFINE_WIDEST, screen: int | None = None,
                   share: PricingShare | None = None, chains: bool = True) -> list[CadTask]:
    """``tasks`` with the busiest server (by ``server_cost`` of its tasks) lowered while a move helps.

    Each step tries, for every task of the busiest server and each of the ``targets`` least busy servers that
    compute none of its rows, moving the whole task, its first rows, or (with ``key_cuts``, on a model that
    prices rectangles) its first keys, the part priced (by ``model``) at half the two servers' gap; the move
    that leaves the lower of the two new times' maximum wins, when that maximum is below the busiest's time. When
    no move to those servers helps, the next least busy are tried, twice as many each time, up to ``widest``.

    ``chains``: where no move helps and the busiest stands more than :data:`CHAIN_ABOVE` times the mean, an
    ejection chain is tried: a move that leaves the busiest lower but its receiver above the busiest's time (of the
    moves the step priced, those whose receivers end lowest first, :data:`CHAIN_FIRST` of them; the first chain
    found is taken), after which that receiver gives its own tasks away as the busiest does (at most
    :data:`CHAIN_SHEDS` moves, each part sized to the room left on the server it goes to) until it is below the
    busiest's time too, every server given to staying below it. Why: a busiest server holding one long task can
    give away no part that costs a receiver less than it saves (a thin cut of rows over a long prefix runs slowly,
    most of all backward; a rectangle is a call of its own), while a receiver of many short tasks can pass that
    cost on in pieces that fit where they land. A chain counts as one move.

    ``screen``: price moves in full in the order of their additive estimate (the two servers' times less and plus
    the moved part's price alone), lowest maximum first, and end the step once ``screen`` moves in a row found
    nothing better, on steps of more than :data:`SCREEN_ABOVE` moves; None prices every move. Why: pricing a
    server in full runs ping-pong's split, the call planner and the launch simulation of every call, and a busiest
    server of a hundred short documents offers hundreds of moves per step (SFT 256K at 4 servers: 10 s per
    schedule on a 2-core host, 1.0 s screened to 32, the predicted balance within 0.002).

    ``share``: the ranks of a group price each step's moves together (:mod:`.shared_pricing`), a batch of them at
    a time (all of a step's, or ``max(world, screen)`` in estimate order on a screened step), and walk the priced
    batch in order as one rank walks its moves: the same tasks as without, in about 1/W of the pricing time (a
    batch may price moves a lone rank would have skipped once a better one was found). Chains are priced so too:
    every rank takes the same chain.
    """
    state = _Refinement(plan, tasks, model, server_cost, targets, widest, key_cuts, screen, share)
    for _ in range(moves):
        top = int(np.argmax(state.cost))
        changes = state.single_move(top)
        if changes is None and chains and state.cost[top] > CHAIN_ABOVE * state.cost.mean():
            changes = state.chain(top)
        if changes is None:
            break
        state.apply(changes)
    return [t for ts in state.by_server for t in ts]
