"""CAD's task model: which query rows a task covers, which key rows it reads, and what it costs.

A task is "query rows [q_start, q_end) of one document piece held by ``owner``, computed on
``server``"; its keys are the causal prefix of those rows in the document, which may span the pieces
of several ranks.

Key cuts. A few rows over a long prefix cannot be cut finer by rows, yet their prefix can be cut by keys:
the keys before a task's first row are seen by all its rows, so a *rectangle* task (``key_hi`` set) computes
rows ``[q_start, q_end)`` over keys ``[key_lo, key_hi)`` only (a non-causal kernel segment), and the causal task
left behind starts its keys at ``key_lo`` (a bottom-right causal segment over the rest). The parts of a row
then come back as partial results, merged by their log-sum-exp (:mod:`hf_longctx.kernels.merge`); the
backward needs nothing new, as every part is given the row's final output and log-sum-exp. Key positions are
document-relative, as the scheduler's offsets are; key cuts are not made under a sliding window.

The scheduler (:mod:`.scheduler`) produces tasks from piece lengths and offsets (:func:`docs_per_rank`); the
ping-pong split (:mod:`.pingpong`) groups them into nano-batches and the runtime (:mod:`.runtime`) runs them,
both reading a task's rows, keys and cost from here so they agree on them. Everything is a pure function of
the shard plan (cached on it) and the task, identical on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...comm.gather import Run
from ...layout import Piece, ShardPlan
from .cost_model import PAIRS, CostModel, WindowedCostModel, check_query_rows, query_rows_cost


@dataclass(frozen=True, order=True)
class CadTask:
    """Query rows ``[q_start, q_end)`` of piece ``piece`` of rank ``owner`` (piece-local rows), computed on
    ``server``. Its keys are the document's causal prefix up to its last query row (within the plan's
    sliding window). The scheduler's output and the runtime's unit of work; ``piece`` indexes
    :func:`pieces_of` (owner), which is also the scheduler's ``docs_per_rank[owner]``."""

    owner: int
    piece: int  # index into the owner's pieces
    q_start: int  # piece-local query rows
    q_end: int
    server: int
    key_lo: int = 0  # document-relative first key (0: from the document's start, or the window's)
    key_hi: int = -1  # -1: keys up to each row (causal); else the end of a rectangle's keys (see the module)

    @property
    def is_rect(self) -> bool:
        """A rectangle: every row sees all its keys ``[key_lo, key_hi)``, which lie before its first row."""
        return self.key_hi >= 0


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


def _doc_holders(plan: ShardPlan) -> dict[int, list[tuple[int, Piece, int]]]:
    out: dict[int, list] = {}
    for r in range(plan.world_size):
        for p, off in pieces_of(plan, r):
            out.setdefault(p.doc, []).append((r, p, off))
    for v in out.values():
        v.sort(key=lambda x: x[1].start)
    return out


def all_pieces(plan: ShardPlan) -> list[list[tuple[Piece, int]]]:
    """:func:`pieces_of` every rank, cached on the plan (a task names its piece by index)."""
    return plan.cached("cad_pieces", lambda: [pieces_of(plan, r) for r in range(plan.world_size)])


def doc_holders(plan: ShardPlan) -> dict[int, list[tuple[int, Piece, int]]]:
    """doc -> [(rank, piece, local offset)] in global order, cached on the plan."""
    return plan.cached("cad_holders", lambda: _doc_holders(plan))


def _pairs_model(plan: ShardPlan) -> CostModel:
    """Visible (query, key) pairs as a cost model, under the plan's sliding window."""
    return PAIRS if plan.window is None else WindowedCostModel(PAIRS, plan.window)


def key_start(plan: ShardPlan, piece: Piece, q_start: int) -> int:
    """First global key position that query rows from ``q_start`` of ``piece`` read."""
    doc_start = plan.batch.doc_starts[piece.doc]
    return doc_start if plan.window is None else max(doc_start, piece.start + q_start - plan.window + 1)


def first_row_in_doc(plan: ShardPlan, task: CadTask) -> int:
    """``task``'s first query row as a position in its document: the keys before it, which all its rows see."""
    piece, _ = all_pieces(plan)[task.owner][task.piece]
    return piece.start - plan.batch.doc_starts[piece.doc] + task.q_start


def task_keys(plan: ShardPlan, task: CadTask) -> tuple[int, int]:
    """Global key positions ``[first, last)`` that ``task`` reads."""
    piece, _ = all_pieces(plan)[task.owner][task.piece]
    doc_start = plan.batch.doc_starts[piece.doc]
    if task.is_rect:
        return doc_start + task.key_lo, doc_start + task.key_hi
    return max(key_start(plan, piece, task.q_start), doc_start + task.key_lo), piece.start + task.q_end


def check_key_range(plan: ShardPlan, task: CadTask) -> None:
    """Raise ``ValueError`` unless ``task``'s keys are a causal prefix from ``key_lo`` up to its rows, or a
    rectangle before its first row (see the module); key cuts only without a sliding window."""
    if task.key_lo == 0 and not task.is_rect:
        return
    first_row = first_row_in_doc(plan, task)
    if plan.window is not None:
        raise ValueError(f"{task}: key cuts are not made under a sliding window")
    end = task.key_hi if task.is_rect else first_row
    if not (0 <= task.key_lo <= end <= first_row) or (task.is_rect and task.key_lo == task.key_hi):
        raise ValueError(f"{task}: keys [{task.key_lo}, {task.key_hi}) must lie before the task's first row "
                         f"({first_row} in its document)")


def task_cost(plan: ShardPlan, task: CadTask) -> float:
    """Visible (query, key) pairs of a task: its query rows over the causal prefix of its document
    (the part of it in the plan's sliding window)."""
    return rows_cost(plan, task, task.q_start, task.q_end)


def task_key(plan: ShardPlan, task: CadTask) -> tuple[int, int, int]:
    """Canonical order of a server's tasks: by document, then global query row (ties: owner; a server computes
    a row once, so no two of its tasks tie)."""
    piece, _ = all_pieces(plan)[task.owner][task.piece]
    return piece.doc, piece.start + task.q_start, task.owner


def rows_cost(plan: ShardPlan, task: CadTask, q_start: int, q_end: int, model: CostModel | None = None) -> float:
    """Cost of query rows ``[q_start, q_end)`` of ``task``'s piece over ``task``'s keys under ``model`` (None:
    visible (query, key) pairs under the plan's sliding window)."""
    piece, _ = all_pieces(plan)[task.owner][task.piece]
    model = model if model is not None else _pairs_model(plan)
    offset = piece.start - plan.batch.doc_starts[piece.doc]
    if task.is_rect:
        check_query_rows(piece.length, q_start, q_end)
        return model.rect_cost(q_end - q_start, task.key_hi - task.key_lo)
    return query_rows_cost(model, piece.length, offset, q_start, q_end, task.key_lo)


def server_holds_keys(plan: ShardPlan, task: CadTask) -> bool:
    """Whether ``task``'s server holds every key row the task reads. Such a task can be cut and its parts
    spread over both nano-batches for free: no key row travels for it, and query rows are never shared."""
    piece, _ = all_pieces(plan)[task.owner][task.piece]
    first, last = task_keys(plan, task)
    for h, hp, _ in doc_holders(plan)[piece.doc]:
        if hp.start >= last:
            break
        if hp.end > first and h != task.server:
            return False
    return True


def segment_shape(plan: ShardPlan, t: CadTask) -> tuple[int, int]:
    """(query rows, keys) of task ``t``'s kernel segment: its rows and the keys they read."""
    first, last = task_keys(plan, t)
    return t.q_end - t.q_start, last - first


def has_key_cuts(tasks: Sequence[CadTask]) -> bool:
    """Whether any task reads only part of its rows' keys (their results must be merged, see :mod:`.tasks`)."""
    return any(t.is_rect or t.key_lo for t in tasks)


def task_runs(plan: ShardPlan, t: CadTask, pieces: list | None = None, holders: dict | None = None
              ) -> tuple[Run, list[Run]]:
    """Where task ``t``'s rows live: its query rows (one run at the owner) and its keys, the document up to the last
    query row from where the window of the first one starts (or the task's own key range), one run per holder."""
    pieces = all_pieces(plan) if pieces is None else pieces
    holders = doc_holders(plan) if holders is None else holders
    piece, local = pieces[t.owner][t.piece]
    first, last = task_keys(plan, t)
    key_runs = []
    for h, hp, hoff in holders[piece.doc]:
        if hp.start >= last:
            break
        lo, hi = max(hp.start, first), min(hp.end, last)
        if lo < hi:
            key_runs.append((h, hoff + lo - hp.start, hoff + hi - hp.start))
    return (t.owner, local + t.q_start, local + t.q_end), key_runs
