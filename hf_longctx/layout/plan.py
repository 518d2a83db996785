"""Shard plans: which global tokens each sequence-parallel rank holds, and in which order.

A rank's local tensor is a sequence of *slots*; a slot is a run of *pieces* (contiguous global token
ranges), at most one piece per document, documents ascending. Every backend reasons about
(query slot, key slot) pairs, so a strategy is nothing more than a way to cut the token range into
slots:

- ``contiguous``: P equal chunks; rank r holds chunk r (one slot).
- ``zigzag``: 2P equal chunks; rank r holds chunks r and 2P-1-r (two slots). Balances causal work
  of one long document.
- ``doc_zigzag``: every document cut into 2P near-equal pieces; rank r holds pieces r and 2P-1-r
  of every document (two slots: all "front" pieces, then all "back" pieces). Balances causal work
  of packed batches whatever the document lengths.
- ``cad``: documents whole on a rank, cut only where equal token counts require it (the contiguous
  cut); the CAD backend then moves core-attention work, not tokens.

A sliding window does not move tokens: :meth:`ShardPlan.with_window` gives the same placement seen
by attention with a window, with caches of its own (pairs, exchanges, schedules depend on it).

Token counts that do not divide: chunks differ by at most one token (no padding, nothing reaches
the loss that should not). For ``doc_zigzag`` the spare tokens of each document are dealt to the
pieces round-robin across documents, so ranks end up within a couple of tokens of each other.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from functools import cached_property
from typing import TypeVar

import torch

from .packed import PackedBatch

T = TypeVar("T")

SHARD_STRATEGIES = ("contiguous", "zigzag", "doc_zigzag", "cad")


@dataclass(frozen=True)
class Piece:
    """Global tokens [start, end) of document ``doc``."""

    doc: int
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Slot:
    """Pieces stored back to back at ``offset`` in a rank's local tensor."""

    pieces: tuple[Piece, ...]
    offset: int

    @property
    def length(self) -> int:
        return sum(p.length for p in self.pieces)

    @property
    def end(self) -> int:
        return self.offset + self.length


def _even_bounds(total: int, parts: int) -> list[int]:
    """parts+1 boundaries splitting [0, total) into parts differing by at most one."""
    base, extra = divmod(total, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


def _pieces_of_range(batch: PackedBatch, start: int, end: int) -> list[Piece]:
    """Split the global range [start, end) at document boundaries."""
    pieces = []
    for d, (s, n) in enumerate(zip(batch.doc_starts, batch.doc_lens)):
        lo, hi = max(s, start), min(s + n, end)
        if lo < hi:
            pieces.append(Piece(d, lo, hi))
        if s >= end:
            break
    return pieces


def _build_slots(slot_pieces: list[list[Piece]]) -> tuple[Slot, ...]:
    slots, offset = [], 0
    for pieces in slot_pieces:
        slot = Slot(tuple(pieces), offset)
        slots.append(slot)
        offset = slot.end
    return tuple(slots)


class ShardPlan:
    """Placement of a packed batch's tokens over ``world_size`` sequence-parallel ranks.

    ``window``: the sliding window of the attention this plan serves (transformers' ``sliding_window``:
    position p sees positions p - window + 1 .. p), or None for plain causal attention.

    No reference cycle runs through a plan (a window view reaches its unwindowed plan through a weak
    reference), so a plan and everything cached on it, device tensors included, are freed as soon as
    the last user drops it, not at the garbage collector's next full pass.
    """

    def __init__(self, batch: PackedBatch, world_size: int, strategy: str, slots: tuple[tuple[Slot, ...], ...]):
        self.batch = batch
        self.world_size = world_size
        self.strategy = strategy
        self.slots = slots
        self.window: int | None = None  # set on the views of :meth:`with_window`
        self._cache: dict = {}
        self._base: weakref.ReferenceType[ShardPlan] | None = None  # a window view's unwindowed plan

    @property
    def _unwindowed(self) -> ShardPlan:
        if self._base is None:
            return self
        base = self._base()
        if base is None:  # the unwindowed plan was dropped while this view lives on: an equal one that holds it
            base = ShardPlan(self.batch, self.world_size, self.strategy, self.slots)
            base._cache[("window", self.window)] = self
            self._base = weakref.ref(base)
        return base

    def with_window(self, window: int | None) -> ShardPlan:
        """This placement under a sliding window of ``window`` positions (None: no window).

        Layers with different windows (e.g. alternating full and sliding layers) each get their own
        view, built once per window and cached on the unwindowed plan, so everything derived and
        cached per plan (exchanges, routes, CAD tasks) is never shared across windows. A window no
        shorter than the longest document hides nothing and gives the unwindowed plan itself.
        """
        base = self._unwindowed
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"sliding window must be a positive int (positions seen, the query's own included) "
                             f"or None, got {window!r}")
        if window is None or window >= base.batch.max_seqlen:
            return base

        def build() -> ShardPlan:
            view = ShardPlan(base.batch, base.world_size, base.strategy, base.slots)
            view.window, view._base = window, weakref.ref(base)
            return view

        return base.cached(("window", window), build)

    def rank_slots(self, rank: int) -> tuple[Slot, ...]:
        return self.slots[rank]

    def num_local_tokens(self, rank: int) -> int:
        return sum(s.length for s in self.slots[rank])

    def local_indices(self, rank: int) -> torch.Tensor:
        """Global token indices that ``rank`` holds, in its local order (int64)."""
        ranges = [torch.arange(p.start, p.end) for s in self.slots[rank] for p in s.pieces]
        return torch.cat(ranges) if ranges else torch.empty(0, dtype=torch.int64)

    @cached_property
    def token_counts(self) -> list[int]:
        return [self.num_local_tokens(r) for r in range(self.world_size)]

    def has_cached(self, key: Hashable) -> bool:
        """Whether :meth:`cached` already holds ``key`` (a check done once per plan, e.g. the group's agreement)."""
        return key in self._cache

    def cached(self, key: Hashable, build: Callable[[], T]) -> T:
        """Memoise derived per-plan data (exchange plans, schedules) on the plan itself."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def __repr__(self) -> str:
        window = f", window={self.window}" if self.window is not None else ""
        return (f"ShardPlan(strategy={self.strategy!r}, world_size={self.world_size}, "
                f"tokens={self.batch.num_tokens}, docs={self.batch.num_docs}, per_rank={self.token_counts}{window})")


def _contiguous(batch: PackedBatch, p: int):
    b = _even_bounds(batch.num_tokens, p)
    return tuple(_build_slots([_pieces_of_range(batch, b[r], b[r + 1])]) for r in range(p))


def _zigzag(batch: PackedBatch, p: int):
    b = _even_bounds(batch.num_tokens, 2 * p)
    return tuple(
        _build_slots([_pieces_of_range(batch, b[r], b[r + 1]), _pieces_of_range(batch, b[2 * p - 1 - r], b[2 * p - r])])
        for r in range(p)
    )


def _doc_zigzag(batch: PackedBatch, p: int):
    chunks = 2 * p
    front: list[list[Piece]] = [[] for _ in range(p)]
    back: list[list[Piece]] = [[] for _ in range(p)]
    cursor = 0  # round-robin start for the spare tokens of the next document
    for d, (s, n) in enumerate(zip(batch.doc_starts, batch.doc_lens)):
        base, extra = divmod(n, chunks)
        sizes = [base] * chunks
        for j in range(extra):
            sizes[(cursor + j) % chunks] += 1
        cursor = (cursor + extra) % chunks
        pos = s
        for c, size in enumerate(sizes):
            piece = Piece(d, pos, pos + size)
            pos += size
            if size == 0:
                continue
            if c < p:
                front[c].append(piece)
            else:
                back[chunks - 1 - c].append(piece)
    return tuple(_build_slots([front[r], back[r]]) for r in range(p))


# "cad": documents stay whole on a rank except where equal token counts force a cut, which is
# exactly the contiguous cut in document order; core attention is then rebalanced by the CAD scheduler.
_BUILDERS = {"contiguous": _contiguous, "zigzag": _zigzag, "doc_zigzag": _doc_zigzag, "cad": _contiguous}


def shard_plan(batch: PackedBatch, world_size: int, strategy: str = "zigzag") -> ShardPlan:
    """Place ``batch`` over ``world_size`` ranks with ``strategy`` (see the module docstring)."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    builder = _BUILDERS.get(strategy)
    if builder is None:
        raise ValueError(f"unknown shard strategy {strategy!r}; choose one of {', '.join(_BUILDERS)}")
    return ShardPlan(batch, world_size, strategy, builder(batch, world_size))
