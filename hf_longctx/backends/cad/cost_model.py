"""Cost of core-attention tasks for the CAD scheduler.

Every CA-task the scheduler forms is one *segment*: ``q_len`` consecutive query rows of a document
that attend, bottom-right causally, to ``kv_len`` keys (the causal prefix ending at the last query
row). A cost model prices such a segment; the scheduler never needs anything else, so FLOP counts and
measured kernel times are interchangeable.

- :class:`FlopsCostModel` counts attention FLOPs exactly. Query row ``i`` of the segment sees
  ``kv_len - q_len + i + 1`` keys, so the segment has ``q_len * kv_len - q_len * (q_len - 1) / 2``
  visible (query, key) pairs; forward FLOPs are ``4 * heads * head_dim`` per pair (QK^T and PV).
- :class:`ProfiledCostModel` interpolates measured kernel times on a (q_len, kv_len) grid
  bilinearly (written by ``scripts/lab/profile_cad.py``), which captures what FLOPs miss: short
  segments run below peak throughput. Optionally it also charges what a segment costs inside a
  fused batch whatever its size (``segment_cost``) and prices partial kernel tiles like full ones
  (``tile``): the two terms that make a measured cost non-additive over rows.
- :class:`~.launch_cost.LaunchCostModel` (its own module) prices a call from the kernel's launch grid: exact tile
  steps, tokens and launched blocks, with terms fitted to timed calls; it offers the same ``cost`` and
  ``cost_array``.

Additivity. FLOPs (and visible pairs, also under a sliding window) are additive over query rows: a
segment cut in two costs what it cost whole. The scheduler's splits use that (a ring's cost from
its rows alone). A per-segment term breaks it on purpose: a cut adds one segment and costs one
``segment_cost`` more; :func:`segment_overhead` gives the term so that callers that cut segments
charge it once per segment they create, and nothing else.

Both offer a scalar ``cost(q_len, kv_len)`` in plain Python (the scheduler's inner loop prices a
few candidates per move, where numpy's per-call overhead would dominate) and a vectorised
``cost_array`` for pricing whole batches at once.

:class:`TokenBytes` holds the wire sizes per token of what a remote task moves, so that bytes can be
weighed against cost.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from ...kernels.calls import CallTerms
from ...kernels.launch import LaunchGrid, tail_factor

__all__ = [
    "CostModel",
    "FlopsCostModel",
    "ProfiledCostModel",
    "TokenBytes",
    "WindowedCostModel",
    "query_rows_cost",
    "segment_overhead",
]


@runtime_checkable
class CostModel(Protocol):
    """Prices a segment of ``q_len`` query rows over ``kv_len`` keys (bottom-right causal)."""

    def cost(self, q_len: int, kv_len: int) -> float: ...

    def cost_array(self, q_len: np.ndarray, kv_len: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class FlopsCostModel:
    """Exact forward attention FLOPs of a bottom-right causal segment.

    ``flops_per_pair`` defaults to ``4 * 32 * 128`` (Llama-3-8B: 32 query heads of dim 128). Use 1.0
    to count visible (query, key) pairs. Rows that would see no key (``q_len > kv_len``) cost 0.
    """

    flops_per_pair: float = 4.0 * 32 * 128

    def cost(self, q_len: int, kv_len: int) -> float:
        if q_len <= 0:
            return 0.0
        if q_len > kv_len:  # the first q_len - kv_len rows see nothing
            q_len = kv_len
        return self.flops_per_pair * (q_len * kv_len - q_len * (q_len - 1) / 2)

    def cost_array(self, q_len: np.ndarray, kv_len: np.ndarray) -> np.ndarray:
        kv = np.asarray(kv_len, dtype=np.float64)
        q = np.clip(np.asarray(q_len, dtype=np.float64), 0.0, kv)
        return self.flops_per_pair * (q * kv - q * (q - 1) / 2)

    def rect_cost(self, q_len: int, kv_len: int) -> float:
        """``q_len`` rows that all see ``kv_len`` keys (a key cut's part before its rows, see :mod:`.tasks`)."""
        return self.flops_per_pair * max(int(q_len), 0) * max(int(kv_len), 0)


PAIRS = FlopsCostModel(flops_per_pair=1.0)  # cost = visible (query, key) pairs


def _window_sum(n: np.ndarray | int, window: int):
    """sum_{x=1..n} min(window, x): keys seen by the first n positions of a document."""
    return np.where(n <= window, n * (n + 1) / 2, window * (window + 1) / 2 + (n - window) * window)


@dataclass(frozen=True)
class WindowedCostModel:
    """``base`` priced on what a sliding window of ``window`` positions leaves visible.

    Row ``i`` of a bottom-right causal segment sees ``min(window, kv_len - q_len + i + 1)`` keys. The
    kernel reads at most ``q_len + window - 1`` keys of the segment, so the base model prices that
    shape, scaled by the share of its pairs the window leaves visible (exact for FLOPs). The base
    model's per-segment term (:func:`segment_overhead`) is paid whole, not scaled: a segment costs it
    whatever the window hides. Costs stay additive over rows apart from that term (none for FLOPs),
    which the scheduler's splits charge per segment they create.
    """

    base: CostModel
    window: int

    def _visible(self, q, kv):
        q = np.minimum(q, kv)  # rows beyond the keys see nothing
        return _window_sum(kv, self.window) - _window_sum(kv - q, self.window)

    def cost(self, q_len: int, kv_len: int) -> float:
        if q_len <= 0:
            return 0.0
        kv_read = min(kv_len, q_len + self.window - 1)
        full = PAIRS.cost(q_len, kv_read)
        fixed = segment_overhead(self.base)
        if fixed:
            share = float(self._visible(q_len, kv_len)) / full if full else 0.0
            return fixed + (self.base.cost(q_len, kv_read) - fixed) * share
        return self.base.cost(q_len, kv_read) * float(self._visible(q_len, kv_len)) / full if full else 0.0

    def cost_array(self, q_len: np.ndarray, kv_len: np.ndarray) -> np.ndarray:
        q = np.asarray(q_len, dtype=np.float64)
        kv = np.asarray(kv_len, dtype=np.float64)
        kv_read = np.minimum(kv, q + self.window - 1)
        full = PAIRS.cost_array(q, kv_read)
        share = np.divide(self._visible(np.clip(q, 0, None), kv), full, out=np.zeros_like(full), where=full > 0)
        fixed = segment_overhead(self.base)
        if fixed:
            return np.where(q > 0, fixed + (self.base.cost_array(q, kv_read) - fixed) * share, 0.0)
        return np.where(q > 0, self.base.cost_array(q, kv_read) * share, 0.0)


def segment_overhead(model: CostModel) -> float:
    """What ``model`` charges every non-empty segment whatever its rows (``ProfiledCostModel.segment_cost``;
    0 for FLOPs and pairs). Cutting a segment in two leaves the rows' cost and adds this once."""
    if isinstance(model, WindowedCostModel):
        return segment_overhead(model.base)
    return float(getattr(model, "segment_cost", 0.0))


def check_query_rows(length: int, q_start: int, q_end: int) -> None:
    """Raise unless query rows ``[q_start, q_end)`` lie in a piece of ``length`` rows."""
    if not 0 <= q_start <= q_end <= length:
        raise ValueError(f"query rows [{q_start}, {q_end}) outside a piece of {length} rows")


def query_rows_cost(model: CostModel, length: int, offset: int, q_start: int, q_end: int, key_lo: int = 0) -> float:
    """Cost of query rows ``[q_start, q_end)`` of a piece of ``length`` rows preceded by ``offset`` tokens.

    The rows see the causal prefix from document key ``key_lo`` on: ``offset + q_end - key_lo`` keys for the
    last row.
    """
    check_query_rows(length, q_start, q_end)
    return model.cost(q_end - q_start, offset + q_end - key_lo)


def _axis_weights(grid: list[float], x: float) -> tuple[int, float]:
    """Cell index and fractional position of ``x`` on a sorted axis; beyond the ends the edge cell
    is extended linearly (costs keep growing past the largest profiled size)."""
    if len(grid) == 1:
        return 0, 0.0
    i = bisect.bisect_right(grid, x) - 1
    i = min(max(i, 0), len(grid) - 2)
    return i, (x - grid[i]) / (grid[i + 1] - grid[i])


@dataclass(frozen=True)
class ProfiledCostModel:
    """Measured segment cost on a (q_len, kv_len) grid, bilinearly interpolated.

    ``table[i][j]`` is the cost (e.g. milliseconds of forward + backward) of ``q_lens[i]`` query rows
    over ``kv_lens[j]`` keys. Exact on grid points; outside the grid the edge cells are extended
    linearly and the result clamped at 0. A segment with no rows costs 0.

    ``interpolate="time"`` (default) interpolates the cost itself: linear along each axis between grid
    points. Attention cost is quadratic in length, so on a coarse grid (factor-4 steps) this overstates
    the cost of mid-cell shapes, and a split segment can seem dearer than the whole.
    ``interpolate="rate"`` interpolates cost per visible (query, key) pair instead and multiplies by the
    exact pair count: still exact on grid points, and faithful between them wherever throughput varies
    slowly (the compute-bound regime long documents live in).

    What a segment costs beyond its rows' work. A server runs its tasks as segments of one fused
    varlen call, and the grid interpolates work, which is additive over rows; two effects are not:

    - ``segment_cost``: paid once by every non-empty segment, whatever its size (its tiles' set-up
      and write-out, per-segment bookkeeping of the call). Interpolating per pair spreads it over the
      pairs of the grid shapes, so a segment much smaller than the smallest grid shape, or a segment
      cut into many small ones, is priced far too cheap. Here the grid holds ``table - segment_cost``
      (what the rows cost) and every segment pays ``segment_cost`` on top: grid points stay exact, and
      cutting a segment in two adds exactly one ``segment_cost`` (see :func:`segment_overhead`).
    - ``tile``: the kernel computes whole tiles of ``tile`` query rows by ``tile`` keys, so a partial
      tile costs like a full one. With ``tile > 0`` a segment is priced at its query rows and keys
      rounded up to multiples of ``tile`` (the shape the kernel effectively computes); grid lengths
      must then be multiples of ``tile``, so that grid points stay exact.

    Not in a segment's price: what it costs depending on the *other* segments of its call. Varlen kernels
    size their grid by the call's longest segment, so a short segment fused with a long one costs more than
    alone, the more the longer that segment, mostly in the backward (measured:
    bench/results/2026-11-24_emulation-vs-real.md). That is a property of a call, not of a segment; the runtime avoids
    most of it by cutting a server's batch into calls of similar segments (the call terms below).

    The tail of a call (``launch``, a :class:`~hf_longctx.kernels.launch.LaunchGrid`, with ``launch_heads``):
    a kernel that launches one block per tile runs a lone large causal segment's longest blocks at the end,
    alone, so a call takes longer than its segments' work at full throughput
    (:func:`~hf_longctx.kernels.launch.tail_factor`). A profile that records its kernel's launch grid holds
    in ``table`` each cell's time divided by the factor of the call it was timed in (its copies), i.e. the
    work at full throughput; :meth:`call_factor` gives the factor of a call, which the runtime multiplies its
    segments' work by (:func:`~.runtime.server_costs`). Without it (``launch`` None) a call is its segments'
    sum, as the grid was timed.

    Both default to 0 ("no extra term"): the model then prices exactly as before they existed, and a
    JSON file without them loads as such. ``scripts/lab/profile_cad.py`` (and
    :func:`hf_longctx.lab.cad.profiled.profile_segment_costs`) measure ``segment_cost`` as the time one more segment
    adds to a fused batch of the same rows.

    What a *call* costs beyond its segments (``call_cost``, ``q_tile_cost``, ``k_tile_cost``; see
    :class:`~hf_longctx.kernels.calls.CallTerms`, :attr:`call_terms`): the batch-level effect above, priced
    so that the runtime can cut a server's batch into calls that avoid it (:func:`~.runtime.server_costs`
    adds what the calls still cost to a server's predicted time).
    """

    q_lens: tuple[float, ...]
    kv_lens: tuple[float, ...]
    table: tuple[tuple[float, ...], ...]
    units: str = "ms"
    interpolate: str = "time"
    segment_cost: float = 0.0
    tile: int = 0
    call_cost: float = 0.0
    q_tile_cost: float = 0.0
    k_tile_cost: float = 0.0
    launch: LaunchGrid | None = None
    launch_heads: int = 0

    def __post_init__(self) -> None:
        if self.launch is not None and self.launch_heads < 1:
            raise ValueError("a launch grid needs launch_heads >= 1 (the query heads the profile timed)")
        for name, axis in (("q_lens", self.q_lens), ("kv_lens", self.kv_lens)):
            if not axis or any(b <= a for a, b in zip(axis, axis[1:])):
                raise ValueError(f"{name} must be non-empty and strictly increasing")
        if len(self.table) != len(self.q_lens) or any(len(row) != len(self.kv_lens) for row in self.table):
            raise ValueError(f"table must be {len(self.q_lens)} x {len(self.kv_lens)}")
        if not all(math.isfinite(v) for row in self.table for v in row):
            raise ValueError("table holds a non-finite cost")
        if self.interpolate not in ("time", "rate"):
            raise ValueError("interpolate must be 'time' or 'rate'")
        if not (math.isfinite(self.segment_cost) and self.segment_cost >= 0):
            raise ValueError(f"segment_cost must be finite and >= 0, got {self.segment_cost!r}")
        for name in ("call_cost", "q_tile_cost", "k_tile_cost"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
        if isinstance(self.tile, bool) or not isinstance(self.tile, int) or self.tile < 0:
            raise ValueError(f"tile must be an int >= 0 (0: no rounding), got {self.tile!r}")
        if self.tile and any(x % self.tile for x in (*self.q_lens, *self.kv_lens)):
            raise ValueError(f"with tile {self.tile}, every grid length must be a multiple of it")
        grid = self.table
        if self.segment_cost:
            grid = tuple(tuple(v - self.segment_cost for v in row) for row in grid)
        if self.interpolate == "rate":
            grid = tuple(tuple(v / PAIRS.cost(int(q), int(k)) for k, v in zip(self.kv_lens, row))
                         for q, row in zip(self.q_lens, grid))
        object.__setattr__(self, "_grid", grid)

    @classmethod
    def from_grid(cls, q_lens, kv_lens, table, units: str = "ms", interpolate: str = "time",
                  segment_cost: float = 0.0, tile: int = 0, call_cost: float = 0.0, q_tile_cost: float = 0.0,
                  k_tile_cost: float = 0.0, launch: LaunchGrid | None = None, launch_heads: int = 0
                  ) -> ProfiledCostModel:
        return cls(tuple(float(x) for x in q_lens), tuple(float(x) for x in kv_lens),
                   tuple(tuple(float(v) for v in row) for row in table), units, interpolate, float(segment_cost),
                   int(tile), float(call_cost), float(q_tile_cost), float(k_tile_cost), launch, int(launch_heads))

    @classmethod
    def load(cls, path: str | Path, interpolate: str = "time") -> ProfiledCostModel:
        """Read the JSON written by ``scripts/lab/profile_cad.py``: ``{"q_lens", "kv_lens", "cost", "units"}`` and,
        from profiles that measured them, ``"segment_cost"``, ``"tile"``, the call terms (absent: 0, no
        extra term) and the launch grid (absent: none)."""
        data = json.loads(Path(path).read_text())
        launch = LaunchGrid.from_dict(data["launch"]) if data.get("launch") else None
        return cls.from_grid(data["q_lens"], data["kv_lens"], data["cost"], data.get("units", "ms"), interpolate,
                             data.get("segment_cost", 0.0), data.get("tile", 0), data.get("call_cost", 0.0),
                             data.get("q_tile_cost", 0.0), data.get("k_tile_cost", 0.0), launch,
                             data.get("launch_heads", 0))

    def save(self, path: str | Path, **meta) -> None:
        doc = {"q_lens": list(self.q_lens), "kv_lens": list(self.kv_lens), "cost": [list(r) for r in self.table],
               "units": self.units, "segment_cost": self.segment_cost, "tile": self.tile,
               "call_cost": self.call_cost, "q_tile_cost": self.q_tile_cost, "k_tile_cost": self.k_tile_cost,
               "launch": self.launch.to_dict() if self.launch else None, "launch_heads": self.launch_heads,
               "meta": meta}
        Path(path).write_text(json.dumps(doc, indent=1))

    @property
    def call_terms(self) -> CallTerms | None:
        """The call terms (:class:`~hf_longctx.kernels.calls.CallTerms`) this profile measured; None if none."""
        if not (self.call_cost or self.q_tile_cost or self.k_tile_cost):
            return None
        return CallTerms(self.call_cost, self.q_tile_cost, self.k_tile_cost, self.tile or 128, self.units)

    def call_factor(self, q_lens: Sequence[int], k_lens: Sequence[int]) -> float:
        """How much longer one kernel call over these segments (in launch order) takes than their work at full
        throughput (:func:`~hf_longctx.kernels.launch.tail_factor`); 1.0 without a launch grid."""
        if self.launch is None:
            return 1.0
        return tail_factor(q_lens, k_lens, self.launch_heads, self.launch)

    def tail_cost(self, q_lens: Sequence[int], k_lens: Sequence[int], causal: bool = True) -> float:
        """What one call over these segments (in launch order) takes beyond their work at full throughput: the
        work (their costs less the per-segment term) times the call factor less one; 0 without a launch grid.
        The grid is of causal segments: a call of rectangles (``causal`` False) has no price here."""
        if not causal:
            raise ValueError("a grid profile prices causal segments only; key cuts need a launch cost model")
        if self.launch is None:
            return 0.0
        work = sum(self.cost(q, k) - self.segment_cost for q, k in zip(q_lens, k_lens) if q > 0)
        return (self.call_factor(q_lens, k_lens) - 1.0) * work

    def cost(self, q_len: int, kv_len: int) -> float:
        if q_len <= 0:
            return 0.0
        if self.tile:
            q_len, kv_len = _round_up(q_len, self.tile), _round_up(kv_len, self.tile)
        i, u = _axis_weights(self.q_lens, float(q_len))
        j, w = _axis_weights(self.kv_lens, float(kv_len))
        t = self._grid
        i1 = min(i + 1, len(self.q_lens) - 1)
        j1 = min(j + 1, len(self.kv_lens) - 1)
        v = ((1 - u) * ((1 - w) * t[i][j] + w * t[i][j1])
             + u * ((1 - w) * t[i1][j] + w * t[i1][j1]))
        if self.interpolate == "rate":
            v *= PAIRS.cost(q_len, kv_len)
        if self.segment_cost:
            return self.segment_cost + max(v, 0.0)
        return max(v, 0.0)

    def cost_array(self, q_len: np.ndarray, kv_len: np.ndarray) -> np.ndarray:
        q = np.asarray(q_len, dtype=np.float64)
        kv = np.asarray(kv_len, dtype=np.float64)
        t = np.asarray(self._grid, dtype=np.float64)
        if self.tile:
            q, kv = np.ceil(q / self.tile) * self.tile, np.ceil(kv / self.tile) * self.tile

        def weights(grid: tuple[float, ...], x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            g = np.asarray(grid)
            if len(g) == 1:
                z = np.zeros(x.shape, dtype=np.int64)
                return z, z, np.zeros(x.shape)
            i = np.clip(np.searchsorted(g, x, side="right") - 1, 0, len(g) - 2)
            return i, i + 1, (x - g[i]) / (g[i + 1] - g[i])

        i, i1, u = weights(self.q_lens, q)
        j, j1, w = weights(self.kv_lens, kv)
        v = (1 - u) * ((1 - w) * t[i, j] + w * t[i, j1]) + u * ((1 - w) * t[i1, j] + w * t[i1, j1])
        if self.interpolate == "rate":
            v = v * PAIRS.cost_array(q, kv)
        if self.segment_cost:
            return np.where(q > 0, self.segment_cost + np.maximum(v, 0.0), 0.0)
        return np.where(q > 0, np.maximum(v, 0.0), 0.0)


def _round_up(n: int, tile: int) -> int:
    return -(-int(n) // tile) * tile


@dataclass(frozen=True)
class TokenBytes:
    """Bytes per token that a task sent to another rank's server moves.

    Defaults: Llama-3-8B attention in bf16 (32 query heads, 8 KV heads, head dim 128): a query row
    is 32*128*2 B, a key+value row 2*8*128*2 B, and an output row comes back with its fp32
    log-sum-exp per head (32*128*2 + 32*4 B).
    """

    q: float = 32 * 128 * 2
    kv: float = 2 * 8 * 128 * 2
    out: float = 32 * 128 * 2 + 32 * 4

    @classmethod
    def for_model(cls, heads: int, kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> TokenBytes:
        return cls(heads * head_dim * dtype_bytes, 2 * kv_heads * head_dim * dtype_bytes,
                   heads * head_dim * dtype_bytes + heads * 4)
