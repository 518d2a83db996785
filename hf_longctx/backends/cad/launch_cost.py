"""A kernel's cost priced from what it launches, fitted to timed calls: exact in tile steps, not interpolated.

Why: :class:`~.cost_model.ProfiledCostModel` interpolates a (q_len, kv_len) grid of timed cells per visible pair
and rounds partial tiles up. Short documents fall between its points in two ways it cannot see: a kernel's
per-token passes (loading the queries, writing the output and log-sum-exp, the backward's dot(dO, O), its fp32
dq accumulator and dK/dV write-out) scale with tokens, not pairs, and a segment of 644 rows does 36 of the 42
backward tile steps that the 768 rows it is rounded to do. Both error by several percent per kernel call on
calls of a dozen 200-2000-token documents, and CAD's servers then differ in time by what their calls hold
(so the busiest of 16-64 servers ran several percent over the mean on a prediction balanced well under one;
measured: bench/results/2026-11-24_cad-kernel-time.md).

:class:`LaunchCostModel` prices one kernel call per phase (forward, backward) as a sum of what its launch grid
(:class:`~hf_longctx.kernels.launch.LaunchGrid`) makes it do::

    step * tile_steps * tail + q_token * query_rows + k_token * keys + block * launched_blocks
        + segment * segments + call + k_spill * keys_over_limit + merge_row * merged_rows
        + short_step * steps_short_of_the_minimum + accumulator_key * keys_past_l2
        + accumulator_short_step * steps_waiting_on_accumulators

``tile_steps`` are the exact causal tile steps of the blocks (:func:`~hf_longctx.kernels.launch.forward_step_total`),
``tail`` the launch simulation's factor for the call (:func:`~hf_longctx.kernels.launch.phase_factor`),
``launched_blocks`` every segment's blocks up to the call's longest segment (a varlen grid is sized by it),
``keys_over_limit`` a backward call's keys when they pass the grid's ``backward_keys_limit`` (0 under it: see
:func:`~hf_longctx.kernels.torch_flash.backward_keys_limit`; a server's calls stay under it where they can),
``merged_rows`` the rows the merge of a forward cut into chunks of its keys reads (0 for a call run whole: see
:mod:`~hf_longctx.kernels.key_split`; the merge is one kernel over them), ``steps_short_of_the_minimum`` the tile
steps by which the backward's blocks fall short of the grid's ``backward_min_steps`` (0 without one: see
:func:`~hf_longctx.kernels.launch.backward_short_steps`), ``keys_past_l2`` and ``steps_waiting_on_accumulators`` a
backward segment's keys and its blocks' steps short of ``backward_accumulator_steps``, each times the share of its
dK/dV accumulators out of the L2 (0 without ``backward_accumulator_keys``: see
:func:`~hf_longctx.kernels.launch.accumulator_share`). The coefficients per phase are fitted by
:func:`fit_phase_terms` to calls timed on the device (see :mod:`.call_profile`); fitted on two mixes and checked
on a third, it prices servers several times closer (bench/results/2026-12-04_from-modules.md).

The scheduler prices a task alone, at full throughput (:meth:`LaunchCostModel.cost`); what a call adds beyond
its segments (its constant and the surplus blocks) is :attr:`LaunchCostModel.call_terms`, and its tail
:meth:`LaunchCostModel.tail_cost`, both priced by the runtime per call.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields
from itertools import accumulate
from pathlib import Path

import numpy as np

from ...kernels import key_split, launch
from ...kernels.calls import CallTerms, calls_overhead
from ...kernels.key_split import KeySplit, merged_rows, plan_key_split, split_calls
from ...kernels.launch import (
    LaunchGrid,
    accumulator_share,
    backward_short_steps,
    backward_step_total,
    backward_steps,
    forward_step_total,
    forward_steps,
    paired_forward_steps,
    phase_factor,
    segment_launch_steps,
)

__all__ = ["MERGE", "PHASES", "TERM_NAMES", "LaunchCostModel", "PhaseTerms", "accumulator_terms", "call_features",
           "call_waves", "fit_phase_terms", "segment_accumulator_terms", "spilled_keys"]

PHASES = ("forward", "backward")
KIND = "launch"  # a saved model's "kind", beside the grid profile's files


@dataclass(frozen=True)
class PhaseTerms:
    """One phase's price (``units`` per item): per tile step at full throughput, per query row, per key, per
    launched block (per head set: every block is launched once per head), per segment, per call, per key of a
    call past the kernel's keys limit (:attr:`~hf_longctx.kernels.launch.LaunchGrid.backward_keys_limit`), and per
    row the merge of a forward cut into chunks of its keys reads
    (:func:`~hf_longctx.kernels.key_split.merged_rows`), per tile step by which a backward block falls short
    of the grid's ``backward_min_steps`` (:func:`~hf_longctx.kernels.launch.backward_short_steps`), and per key
    and per tile step short of ``backward_accumulator_steps`` of a backward segment whose dK/dV accumulators leave
    the L2, times the share that does (:func:`~hf_longctx.kernels.launch.accumulator_share`). A model saved
    before a term existed loads with it at 0."""

    step: float = 0.0
    q_token: float = 0.0
    k_token: float = 0.0
    block: float = 0.0
    segment: float = 0.0
    call: float = 0.0
    k_spill: float = 0.0
    merge_row: float = 0.0
    short_step: float = 0.0
    accumulator_key: float = 0.0
    accumulator_short_step: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not (value == value and 0.0 <= value < float("inf")):
                raise ValueError(f"PhaseTerms.{f.name} must be finite and >= 0, got {value!r}")

    def as_vector(self) -> np.ndarray:
        return np.array([getattr(self, f.name) for f in fields(self)], dtype=np.float64)

    @classmethod
    def from_vector(cls, values: Sequence[float]) -> PhaseTerms:
        return cls(*(float(v) for v in values))


TERM_NAMES = tuple(f.name for f in fields(PhaseTerms))
MERGE = TERM_NAMES.index("merge_row")  # where call_features puts the rows a cut forward's merge reads


def _steps(phase: str, q_len, k_len, grid: LaunchGrid, causal: bool = True):
    if phase == "forward":
        return forward_step_total(q_len, k_len, grid.forward_tile, causal)
    return backward_step_total(q_len, k_len, grid.backward_tile, causal)


def _own_blocks(phase: str, q_len, k_len, grid: LaunchGrid):
    """Blocks a segment launches for itself: one per query tile (forward) or key tile (backward)."""
    if phase == "forward":
        return -(-np.asarray(q_len) // grid.forward_tile[0])
    return -(-np.asarray(k_len) // grid.backward_tile[1])


def call_waves(phase: str, q_lens: Sequence[int], k_lens: Sequence[int], grid: LaunchGrid, heads: int) -> float:
    """How many waves of blocks one call's ``phase`` launches for its segments: their own blocks (not the empty
    ones a tile-order launch adds for shorter segments) times the heads each is launched for, over the grid's
    slots. A size of call that says how much its tail and its fixed costs weigh against its tile steps."""
    launched = max(1, heads // grid.forward_head_pack) if phase == "forward" else heads
    blocks = sum(int(_own_blocks(phase, int(q), int(k), grid)) for q, k in zip(q_lens, k_lens) if q > 0)
    return blocks * launched / grid.slots


def _block_steps(phase: str, pairs: Sequence[tuple[int, int]], grid: LaunchGrid, causal: bool = True
                 ) -> list[int]:
    """Tile steps of every block the call's ``phase`` launches for its segments (in launch order, one head)."""
    steps: list[int] = []
    for q, k in pairs:
        steps += forward_steps(q, k, grid.forward_tile, causal) if phase == "forward" else \
            backward_steps(q, k, grid.backward_tile, causal)
    return steps


def _phase_steps(phase: str, pairs: Sequence[tuple[int, int]], grid: LaunchGrid, heads: int, causal: bool
                 ) -> tuple[float, int]:
    """One call's ``phase`` in tile steps of one head: (with the call's tail, at full throughput). The forward's
    tail is :func:`~hf_longctx.kernels.launch.paired_forward_steps` where its blocks share SMs
    (``grid.forward_pairing``), else the launch simulation's factor
    (:func:`~hf_longctx.kernels.launch.phase_factor`)."""
    if phase == "forward" and grid.forward_pairing > 1.0:
        full = sum(forward_step_total(q, k, grid.forward_tile, causal) for q, k in pairs)
        return paired_forward_steps([q for q, _ in pairs], [k for _, k in pairs], grid, heads, causal), full
    if grid.launch_order == "segment":
        return segment_launch_steps(phase, pairs, grid, heads, causal)
    per_block = _block_steps(phase, pairs, grid, causal)
    full = sum(per_block)
    return full * phase_factor(per_block, heads, grid.slots), full


def spilled_keys(phase: str, keys, grid: LaunchGrid):
    """A call's keys when its ``phase`` pays the kernel's keys limit (the backward past
    ``grid.backward_keys_limit``), else 0; for an int or a numpy array of key counts."""
    limit = grid.backward_keys_limit
    if phase != "backward" or limit is None:
        return 0 if isinstance(keys, int) else np.zeros_like(keys)
    if isinstance(keys, int):
        return keys if keys > limit else 0
    return np.where(keys > limit, keys, 0)


def call_features(phase: str, q_lens: Sequence[int], k_lens: Sequence[int], grid: LaunchGrid, heads: int,
                  causal: bool = True) -> np.ndarray:
    """The quantities of one call's ``phase`` that :class:`PhaseTerms` prices (in its field order), the segments in
    launch order: tile steps times the call's tail factor, query rows, keys, launched blocks (every segment up to
    the longest), segments, calls, keys past the kernel's limit (:func:`spilled_keys`), merged rows, the backward's
    steps short of the grid's minimum (:func:`~hf_longctx.kernels.launch.backward_short_steps`), and its keys and
    steps waiting on accumulators out of the L2 (:func:`accumulator_terms`).
    ``causal`` False: a call of rectangles (every row of a segment sees all its keys), which runs the same blocks
    over more tile steps. A forward the kernel runs as chunks of its keys (the grid's ``forward_key_split``, see
    :mod:`~hf_longctx.kernels.key_split`) is priced as the two calls it makes and the rows its merge reads."""
    if phase == "forward":
        cuts = plan_key_split(q_lens, k_lens, heads, KeySplit.for_grid(grid), causal)
        if cuts is not None:
            calls = split_calls([0, *accumulate(int(q) for q in q_lens)], [0, *accumulate(int(k) for k in k_lens)],
                                cuts, causal)
            total = np.zeros(len(TERM_NAMES))
            for segments, kind in ((calls.causal, True), (calls.rect, False)):
                if segments:
                    total += _one_call_features(phase, [b - a for a, b, _, _ in segments],
                                                [d - c for _, _, c, d in segments], grid, heads, kind)
            total[MERGE] = merged_rows(q_lens, cuts, causal)
            return total
    return _one_call_features(phase, q_lens, k_lens, grid, heads, causal)


def _one_call_features(phase: str, q_lens: Sequence[int], k_lens: Sequence[int], grid: LaunchGrid, heads: int,
                       causal: bool, tails: bool = True) -> np.ndarray:
    """:func:`call_features` of one kernel call (its steps at full throughput with ``tails`` off). Segments of no
    rows launch empty blocks like any shorter segment, and are not priced as segments."""
    pairs = [(int(q), int(k)) for q, k in zip(q_lens, k_lens) if q > 0]
    if not pairs:
        return np.zeros(len(TERM_NAMES))
    steps, full = _phase_steps(phase, pairs, grid, heads, causal)
    if grid.launch_order == "segment":  # each segment launches its own blocks only
        launched = int(sum(_own_blocks(phase, q, k, grid) for q, k in pairs))
    elif phase == "forward":
        launched = len(q_lens) * -(-max(q for q, _ in pairs) // grid.forward_tile[0])
    else:
        launched = len(pairs) * -(-max(k for _, k in pairs) // grid.backward_tile[1])
    keys = sum(k for _, k in pairs)
    short = sum(backward_short_steps(q, k, grid.backward_tile, grid.backward_min_steps, causal) for q, k in pairs) \
        if phase == "backward" else 0
    past_l2, waiting = accumulator_terms(phase, pairs, grid, causal)
    return np.array([steps if tails else full, sum(q for q, _ in pairs), keys, launched, len(pairs), 1.0,
                     spilled_keys(phase, keys, grid), 0.0, short, past_l2, waiting])


def accumulator_terms(phase: str, pairs: Sequence[tuple[int, int]], grid: LaunchGrid, causal: bool = True
                      ) -> tuple[float, float]:
    """The backward's keys and its blocks' tile steps short of ``grid.backward_accumulator_steps``, each segment's
    times the share of its dK/dV accumulators out of the L2 (:func:`segment_accumulator_terms`, summed); (0, 0)
    for the forward or where the grid declares no such keys. Per segment: a segment's heads run one after another
    over its own keys, so its own length decides whether its accumulators stay in the L2."""
    if phase != "backward" or grid.backward_accumulator_keys is None:
        return 0.0, 0.0
    past_l2 = waiting = 0.0
    for q, k in pairs:
        keys, steps = segment_accumulator_terms(int(q), int(k), grid, causal)
        past_l2 += keys
        waiting += steps
    return past_l2, waiting


def segment_accumulator_terms(q_len, k_len, grid: LaunchGrid, causal: bool = True):
    """One backward segment's (keys, tile steps short of ``grid.backward_accumulator_steps``), each times the share
    of its accumulators out of the L2 (:func:`~hf_longctx.kernels.launch.accumulator_share`); for ints or numpy
    arrays of segments of rows (0 where the grid declares no accumulator keys)."""
    share = accumulator_share(k_len, grid.backward_accumulator_keys)
    if np.ndim(share) == 0 and share == 0.0:  # under the L2's keys: no short steps to count
        return 0.0, 0.0
    short = backward_short_steps(q_len, k_len, grid.backward_tile, grid.backward_accumulator_steps, causal)
    return share * k_len, share * short


def fit_phase_terms(features: np.ndarray, seconds: np.ndarray, weights: np.ndarray | None = None
                    ) -> tuple[PhaseTerms, float]:
    """Non-negative least squares of timed calls in relative error (each call weighs alike, whatever its length,
    or as ``weights`` say): (terms, standard deviation of the fitted calls' relative error). ``features``: one
    :func:`call_features` row per call; ``seconds``: their times in the units wanted. A negative coefficient is
    dropped and the rest refitted (a term a kernel does not pay would otherwise absorb noise with the wrong
    sign)."""
    x, y = np.asarray(features, dtype=np.float64), np.asarray(seconds, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] != len(TERM_NAMES) or len(y) != len(x) or len(y) < len(TERM_NAMES):
        raise ValueError(f"fit_phase_terms needs >= {len(TERM_NAMES)} calls of {len(TERM_NAMES)} features")
    if not np.all(y > 0):
        raise ValueError("fit_phase_terms needs positive times")
    coef, err = fit_relative(x, y, weights)
    return PhaseTerms.from_vector(coef), err


def fit_relative(x: np.ndarray, y: np.ndarray, weights: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """Non-negative least squares of ``x @ coef ~ y`` in relative error, each row's squared error times its
    weight (default 1): (coef, standard deviation of the relative error, unweighted). A negative coefficient is
    dropped and the rest refitted."""
    w = np.ones(len(y)) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != (len(y),) or not np.all(w > 0):
        raise ValueError(f"fit_relative needs one positive weight per row, got shape {w.shape}")
    root = np.sqrt(w)
    scale = np.maximum(np.abs(x).max(axis=0), 1e-30)  # columns of like size: the solve stays well conditioned
    a = x / scale / y[:, None] * root[:, None]
    active = [j for j in range(x.shape[1]) if np.any(x[:, j])]
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], root, rcond=None)
        if np.all(sol >= 0):
            coef[active] = sol
            break
        active = [j for j, c in zip(active, sol) if c > 0]  # drop the negative ones, fit the rest again
    coef = coef / scale
    err = x @ coef / y - 1.0
    return coef, float(err.std())


@dataclass(frozen=True)
class LaunchCostModel:
    """Forward+backward cost of segments and calls from a kernel's launch grid and fitted :class:`PhaseTerms`
    (see the module). ``heads``: query heads the terms were timed with (the tail simulation launches every block
    once per head). ``tails`` False prices calls without their tail (a view the scheduler also balances on)."""

    launch: LaunchGrid
    heads: int
    forward: PhaseTerms
    backward: PhaseTerms
    units: str = "ms"
    tails: bool = True

    def __post_init__(self) -> None:
        if self.heads < 1:
            raise ValueError(f"LaunchCostModel.heads must be >= 1, got {self.heads}")

    def terms(self, phase: str) -> PhaseTerms:
        return self.forward if phase == "forward" else self.backward

    @property
    def segment_cost(self) -> float:
        """What every segment pays whatever its rows (a cut adds one; see :func:`~.cost_model.segment_overhead`)."""
        return self.forward.segment + self.backward.segment

    @property
    def call_terms(self) -> CallTerms:
        """What a call costs beyond its segments' own blocks, as :func:`~hf_longctx.kernels.calls.cut_into_calls`
        cuts a batch by: the calls' constants, and each segment's surplus query tiles (forward blocks) and key
        tiles (backward blocks) under the call's longest segment."""
        if self.launch.launch_order == "segment":  # no segment launches blocks for another: no surplus to cut away
            return CallTerms(self.forward.call + self.backward.call, 0.0, 0.0, self.launch.backward_tile[1],
                             self.units, self.launch.backward_keys_limit, KeySplit.for_grid(self.launch))
        tile = self.launch.forward_tile[0]
        if self.launch.backward_tile[1] != tile:
            raise ValueError(f"call terms need the forward's query tile and the backward's key tile alike, got "
                             f"{self.launch}")
        return CallTerms(self.forward.call + self.backward.call, self.forward.block, self.backward.block, tile,
                         self.units, self.launch.backward_keys_limit, KeySplit.for_grid(self.launch))

    def cost(self, q_len: int, kv_len: int, causal: bool = True) -> float:
        """One segment alone at full throughput (no call constant, no tail): both phases' steps, tokens, own
        blocks and segment term, and its keys' spill past the kernel's limit (a segment over the limit is a call
        of its own). Plain Python: the scheduler's inner loop prices a few candidates per move."""
        q, kv = int(q_len), int(kv_len)
        if q <= 0:
            return 0.0
        f, b, grid = self.forward, self.backward, self.launch
        return (f.step * forward_step_total(q, kv, grid.forward_tile, causal)
                + b.step * backward_step_total(q, kv, grid.backward_tile, causal)
                + (f.q_token + b.q_token) * q + (f.k_token + b.k_token) * kv
                + f.block * -(-q // grid.forward_tile[0]) + b.block * -(-kv // grid.backward_tile[1])
                + f.segment + b.segment + b.k_spill * spilled_keys("backward", kv, grid)
                + b.short_step * backward_short_steps(q, kv, grid.backward_tile, grid.backward_min_steps, causal)
                + self._accumulator_cost(q, kv, causal))

    def _accumulator_cost(self, q, kv, causal: bool = True):
        """What a segment (ints, or numpy arrays of segments) pays for accumulators out of the L2."""
        b = self.backward
        if not (b.accumulator_key or b.accumulator_short_step):
            return 0.0
        past_l2, waiting = segment_accumulator_terms(q, kv, self.launch, causal)
        return b.accumulator_key * past_l2 + b.accumulator_short_step * waiting

    def rect_cost(self, q_len: int, kv_len: int) -> float:
        """A rectangle alone at full throughput: ``q_len`` rows that all see ``kv_len`` keys (a key cut's part
        before its rows, see :mod:`.tasks`), run in a non-causal call."""
        return self.cost(q_len, kv_len, causal=False)

    def cost_array(self, q_len: np.ndarray, kv_len: np.ndarray) -> np.ndarray:
        q = np.asarray(q_len, dtype=np.int64)
        kv = np.asarray(kv_len, dtype=np.int64)
        grid = self.launch
        total = np.zeros(q.shape, dtype=np.float64)
        for phase in PHASES:
            t = self.terms(phase)
            total += (t.step * _steps(phase, q, kv, grid) + t.q_token * q + t.k_token * kv
                      + t.block * _own_blocks(phase, q, kv, grid) + t.segment)
        total += self.backward.k_spill * spilled_keys("backward", kv, grid)
        total += self.backward.short_step * backward_short_steps(q, kv, grid.backward_tile, grid.backward_min_steps)
        total += self._accumulator_cost(q, kv)
        return np.where(q > 0, total, 0.0)

    def tail_cost(self, q_lens: Sequence[int], k_lens: Sequence[int], causal: bool = True) -> float:
        """What one call over these segments (in launch order) takes beyond their steps at full throughput: each
        phase's steps times its tail factor less one (0 with ``tails`` off)."""
        if not self.tails:
            return 0.0
        return _tail_cost(tuple(int(q) for q in q_lens), tuple(int(k) for k in k_lens), self, causal)

    def phase_cost(self, phase: str, q_lens: Sequence[int], k_lens: Sequence[int], causal: bool = True) -> float:
        """One call's ``phase`` (forward or backward) alone: :func:`call_features` times that phase's terms, with
        its tail (what a timed phase of the call is compared with)."""
        features = call_features(phase, q_lens, k_lens, self.launch, self.heads, causal)
        return float(features @ self.terms(phase).as_vector())

    def call_cost(self, q_lens: Sequence[int], k_lens: Sequence[int]) -> float:
        """One call over these segments (in launch order): their costs, the call's constants, its surplus blocks
        and its tail (what :func:`call_features` times the terms give, summed over the phases)."""
        if not any(q > 0 for q in q_lens):
            return 0.0
        pairs = [(int(q), int(k)) for q, k in zip(q_lens, k_lens) if q > 0]
        q, k = [a for a, _ in pairs], [b for _, b in pairs]
        return (sum(self.cost(a, b) for a, b in pairs) + calls_overhead(q, k, [(0, len(pairs))], self.call_terms)
                + self.tail_cost(q, k))

    def without_tails(self) -> LaunchCostModel:
        return LaunchCostModel(self.launch, self.heads, self.forward, self.backward, self.units, tails=False)

    def to_dict(self) -> dict:
        return {"kind": KIND, "launch": self.launch.to_dict(), "heads": self.heads, "units": self.units,
                **{p: dict(zip(TERM_NAMES, self.terms(p).as_vector().tolist())) for p in PHASES}}

    @classmethod
    def from_dict(cls, data: dict) -> LaunchCostModel:
        if data.get("kind") != KIND:
            raise ValueError(f"not a launch cost model (kind {data.get('kind')!r})")
        return cls(LaunchGrid.from_dict(data["launch"]), int(data["heads"]),
                   PhaseTerms(**data["forward"]), PhaseTerms(**data["backward"]), data.get("units", "ms"))

    def save(self, path: str | Path, **meta) -> None:
        Path(path).write_text(json.dumps({**self.to_dict(), "meta": meta}, indent=1))

    @classmethod
    def load(cls, path: str | Path) -> LaunchCostModel:
        return cls.from_dict(json.loads(Path(path).read_text()))


@functools.lru_cache(maxsize=65536)
def _tail_cost(q_lens: tuple[int, ...], k_lens: tuple[int, ...], model: LaunchCostModel, causal: bool) -> float:
    """Both phases of the call as the kernel runs it (:func:`call_features`: tails, and a forward cut into chunks of
    its keys) less the same call whole at full throughput (what its segments' costs and the call terms price)."""
    if not any(q > 0 for q in q_lens):
        return 0.0
    total = 0.0
    for phase in PHASES:
        run = call_features(phase, q_lens, k_lens, model.launch, model.heads, causal)
        whole = _one_call_features(phase, q_lens, k_lens, model.launch, model.heads, causal, tails=False)
        total += float((run - whole) @ model.terms(phase).as_vector())
    return total


def clear_pricing_caches() -> None:
    """Forget every call this process has priced (the launch simulation's, the key split's and the tails'
    caches). Why: a schedule reuses the prices of calls priced before, so the time a schedule takes depends on
    what the process scheduled earlier; timing one from cleared caches gives what a process's first batch pays."""
    for module in (launch, key_split, sys.modules[__name__]):
        for value in vars(module).values():
            if callable(getattr(value, "cache_clear", None)):
                value.cache_clear()
