"""How much longer than its work a kernel call takes because its last thread blocks run alone (the tail).

Why: a tiled attention kernel launches one thread block (CTA) per query tile (forward) or key tile
(backward), per segment and head, and the GPU runs them in launch order on a fixed number of slots (one
per SM for FlashAttention-2's backward at head dim 128). Under a causal mask the blocks' work differs: the
forward block of a segment's last query tile sweeps every key tile, the first one sweeps one. When a
call holds one large causal segment, its longest blocks run at the end with most SMs idle, and the call
takes longer than its work at full throughput: a lone large causal segment takes longer per segment than the
copies per call a profile cell times, so a CAD server whose batch is one such segment was priced short; a server
of a dozen short documents fills the machine and was not (measured: bench/results/2026-11-24_cad-kernel-time.md).

:func:`tail_factor` simulates the launch: every block's work in tile steps, in the order the kernel's
grid launches them (tile fastest, then segment, then head), each taking the slot that frees first. The
factor is the simulated makespan over the work spread evenly on all slots; a call's time is its work
at full throughput times the factor. A profile's cells are timed with several copies per call (their
own, smaller factor), so the cost model divides each cell by its factor and a call multiplies its
segments' sum by its own (:class:`~hf_longctx.backends.cad.cost_model.ProfiledCostModel`).

The grid profile's cost model takes one factor per call (the phases weighed by ``forward_weight``); the launch
cost model (:class:`~hf_longctx.backends.cad.launch_cost.LaunchCostModel`) takes each phase's own factor
(:func:`phase_factor`) on its own tile steps (:func:`forward_step_total`, :func:`backward_step_total`).

Not every kernel launches that way. FlashAttention-4's varlen scheduler on Hopper walks the segments one after
another, each with only its own blocks, a causal forward's longest first (:attr:`LaunchGrid.launch_order`
``"segment"``, simulated by :func:`segment_phase_factor`): a lone causal segment then leaves almost no tail, and no
segment launches empty blocks for a longer one. A kernel that schedules its blocks itself in some order not
modelled here declares no :class:`LaunchGrid`.
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["LAUNCH_ORDERS", "LaunchGrid", "accumulator_share", "backward_step_total", "backward_steps",
           "forward_block_steps", "forward_step_total", "forward_steps", "paired_forward_steps", "paired_makespan",
           "phase_factor", "segment_launch_steps", "segment_phase_factor", "tail_factor"]


@dataclass(frozen=True)
class LaunchGrid:
    """What a non-persistent varlen attention kernel launches: per phase, the tile of (query rows, keys) one
    block steps through; the weight of the forward's factor against the backward's in a forward+backward;
    ``slots``: blocks that run at once (the device's SM count times blocks per SM).

    The forward's weight (used by :func:`tail_factor` alone) is fitted, not its share of the time: where two
    forward blocks share an SM, the last ones run faster alone than one slot per SM assumes, so its tail is
    smaller than the simulation's."""

    forward_tile: tuple[int, int] = (128, 64)  # a forward block: 128 query rows, stepping over 64-key tiles
    backward_tile: tuple[int, int] = (64, 128)  # a backward block: 128 keys, stepping over 64-row query tiles
    forward_weight: float = 0.15
    slots: int = 132
    # forward blocks two to an SM (see paired_makespan): how much longer each then takes (1.0: one slot per SM,
    # blocks never share), and how long an empty block (a segment shorter than the call's longest) holds its slot
    forward_pairing: float = 1.0
    empty_hold: float = 0.0
    # keys per backward call past which the kernel slows down per key (the kernel's ``backward_keys_limit`` for the
    # attention shape priced); None: no limit
    backward_keys_limit: int | None = None
    # the rule (gain, waves, min_keys, min_shared) of the key_split.KeySplit by which a forward call of few long
    # blocks runs as chunks of its keys; None: forward calls run whole
    forward_key_split: tuple[float, float, int, int] | None = None
    # the order blocks launch in: "tile" (FlashAttention-2: tile fastest, then segment, then head; the grid sized by
    # the call's longest segment, shorter ones launch empty blocks) or "segment" (a varlen scheduler that walks the
    # segments one after another, each with only its own blocks: per segment the forward's longest blocks first,
    # head innermost, and the backward head by head in key order)
    launch_order: str = "tile"
    # query heads one forward block packs (grouped-query heads of one KV head as rows of one tile; the forward then
    # launches heads / forward_head_pack times): 1 where every query head launches its own blocks
    forward_head_pack: int = 1
    # tile steps under which a backward block runs slower per step than a long one (its K/V loads, dK/dV stores
    # and pipeline fill are hidden behind too few steps); None: every step alike (see backward_short_steps)
    backward_min_steps: int | None = None
    # keys of a segment over which the backward's fp32 dK/dV accumulators of one query head (grouped-query heads add
    # into their KV head's) leave the L2 cache: from the first count on, fully at the second (see
    # accumulator_share); None: the kernel writes dK and dV directly, or its accumulators were not measured
    backward_accumulator_keys: tuple[int, int] | None = None
    # tile steps under which a backward block of such a segment waits on its accumulators
    backward_accumulator_steps: int = 8

    def __post_init__(self) -> None:
        if self.slots < 1 or min(*self.forward_tile, *self.backward_tile) < 1:
            raise ValueError(f"LaunchGrid needs slots >= 1 and positive tiles, got {self}")
        if not 0.0 <= self.forward_weight <= 1.0:
            raise ValueError(f"LaunchGrid.forward_weight must lie in [0, 1], got {self.forward_weight}")
        if not (1.0 <= self.forward_pairing <= 2.0 and self.empty_hold >= 0.0):
            raise ValueError(f"LaunchGrid needs forward_pairing in [1, 2] and empty_hold >= 0, got {self}")
        if self.backward_keys_limit is not None and self.backward_keys_limit < 1:
            raise ValueError(f"LaunchGrid.backward_keys_limit must be None or >= 1, got {self.backward_keys_limit}")
        if self.forward_key_split is not None and len(self.forward_key_split) != 4:
            raise ValueError(f"LaunchGrid.forward_key_split must be None or (gain, waves, min_keys, min_shared), got "
                             f"{self.forward_key_split}")
        if self.launch_order not in LAUNCH_ORDERS or self.forward_head_pack < 1:
            raise ValueError(f"LaunchGrid needs launch_order in {LAUNCH_ORDERS} and forward_head_pack >= 1, got {self}")
        if self.backward_min_steps is not None and self.backward_min_steps < 1:
            raise ValueError(f"LaunchGrid.backward_min_steps must be None or >= 1, got {self.backward_min_steps}")
        if self.launch_order == "segment" and self.forward_pairing != 1.0:
            raise ValueError("LaunchGrid: forward pairing is modelled for the 'tile' launch order only")
        if self.backward_accumulator_keys is not None and (
                len(self.backward_accumulator_keys) != 2
                or not 0 <= self.backward_accumulator_keys[0] < self.backward_accumulator_keys[1]):
            raise ValueError(f"LaunchGrid.backward_accumulator_keys must be None or (first, full) keys with "
                             f"0 <= first < full, got {self.backward_accumulator_keys}")
        if self.backward_accumulator_steps < 1:
            raise ValueError(f"LaunchGrid.backward_accumulator_steps must be >= 1, got "
                             f"{self.backward_accumulator_steps}")

    def to_dict(self) -> dict:
        return {"forward_tile": list(self.forward_tile), "backward_tile": list(self.backward_tile),
                "forward_weight": self.forward_weight, "slots": self.slots,
                "forward_pairing": self.forward_pairing, "empty_hold": self.empty_hold,
                "backward_keys_limit": self.backward_keys_limit,
                "forward_key_split": None if self.forward_key_split is None else list(self.forward_key_split),
                "launch_order": self.launch_order, "forward_head_pack": self.forward_head_pack,
                "backward_min_steps": self.backward_min_steps,
                "backward_accumulator_keys": None if self.backward_accumulator_keys is None
                else list(self.backward_accumulator_keys),
                "backward_accumulator_steps": self.backward_accumulator_steps}

    @classmethod
    def from_dict(cls, data: dict) -> LaunchGrid:
        return cls(tuple(data["forward_tile"]), tuple(data["backward_tile"]), float(data["forward_weight"]),
                   int(data["slots"]), float(data.get("forward_pairing", 1.0)), float(data.get("empty_hold", 0.0)),
                   data.get("backward_keys_limit"), _key_split_rule(data.get("forward_key_split")),
                   str(data.get("launch_order", "tile")), int(data.get("forward_head_pack", 1)),
                   data.get("backward_min_steps"),
                   None if data.get("backward_accumulator_keys") is None
                   else tuple(int(k) for k in data["backward_accumulator_keys"]),
                   int(data.get("backward_accumulator_steps", 8)))


LAUNCH_ORDERS = ("tile", "segment")


def _key_split_rule(value) -> tuple[float, float, int, int] | None:
    if value is None or len(value) != 4:  # None, or a rule of an older form: fitted again
        return None
    gain, waves, min_keys, min_shared = value
    return float(gain), float(waves), int(min_keys), int(min_shared)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def forward_steps(q_len: int, k_len: int, tile: tuple[int, int], causal: bool = True) -> list[int]:
    """Key tiles each forward block of a bottom-right causal segment (or with ``causal`` False, a rectangle:
    every row sees every key) sweeps, in launch order."""
    rows, keys = tile
    if not causal:
        return [_cdiv(k_len, keys)] * _cdiv(q_len, rows)
    return [max(1, _cdiv(k_len - q_len + min(q_len, (i + 1) * rows), keys)) for i in range(_cdiv(q_len, rows))]


def backward_steps(q_len: int, k_len: int, tile: tuple[int, int], causal: bool = True) -> list[int]:
    """Query tiles each backward block (one key tile) of a bottom-right causal segment sweeps, in launch order:
    the query rows that see any of its keys (with ``causal`` False, a rectangle: all of them)."""
    rows, keys = tile
    tiles = _cdiv(q_len, rows)
    if not causal:
        return [tiles] * _cdiv(k_len, keys)
    # row i sees key j * keys from row j * keys - (k_len - q_len) on; tiles are aligned at row 0
    return [max(0, tiles - max(0, j * keys - (k_len - q_len)) // rows) if j * keys - (k_len - q_len) < q_len else 0
            for j in range(_cdiv(k_len, keys))]


def accumulator_share(k_len, keys: tuple[int, int] | None):
    """How far a backward segment of ``k_len`` keys (an int or a numpy array) has its fp32 dK/dV accumulators out of
    the L2 cache, from 0 (under ``keys[0]``) to 1 (from ``keys[1]`` on), linear between; 0 everywhere with
    ``keys`` None (:attr:`LaunchGrid.backward_accumulator_keys`).

    Why: with grouped-query heads, FlashAttention-4's backward adds every query head's dK and dV into fp32
    accumulators of its KV head (1 KB per key at head dim 128), a segment's heads one after another. While one
    head's accumulators (its segment's keys times 1 KB) fit the L2, the next head of the group adds into lines the
    cache still holds; past it, every block's additions go to memory, and a block of few tile steps waits on them.
    In CAD's own calls a block of few query tiles took longer over long keys, where a block of many did not.
    Priced by the launch model per key and per tile step short of :attr:`LaunchGrid.backward_accumulator_steps`,
    times this share, held-out W = 64 steps and emulated CAD steps (with the profile's own server calls,
    :func:`~hf_longctx.lab.cad.call_profile.cad_server_calls`) were priced and balanced closer (measured:
    bench/results/2026-12-04_from-modules.md)."""
    if keys is None:
        return 0.0 if isinstance(k_len, int) else np.zeros(np.shape(k_len))
    first, full = keys
    if isinstance(k_len, int):
        return min(1.0, max(0.0, (k_len - first) / (full - first)))
    return np.clip((np.asarray(k_len, dtype=np.float64) - first) / (full - first), 0.0, 1.0)


def backward_short_steps(q_len, k_len, tile: tuple[int, int], min_steps: int | None, causal: bool = True):
    """``sum(max(0, min_steps - s))`` over the steps ``s`` of a segment's backward blocks
    (:func:`backward_steps`): how many tile steps its short blocks fall short of ``min_steps``; for ints or numpy
    arrays (0 where q_len is 0, and everywhere with ``min_steps`` None).

    Why: a backward block loads its keys and values, fills its pipeline and stores dK and dV whatever its steps;
    over enough steps that is hidden, over a few it is not: with FlashAttention-4 a key block of few rows over a
    long prefix costs a fixed time per block beyond its steps, and a CAD server running a long document's last
    rows was priced low at one price per step (measured: bench/results/2026-12-04_from-modules.md). The model prices the
    shortfall per step (fitted like the other terms).

    Closed form in the blocks: every block up to the rows' first key sweeps all ``ceil(q / rows)`` query tiles;
    after it, each block sweeps ``keys / rows`` tiles fewer than the one before, so only the last
    ``ceil(min_steps * rows / keys) + 1`` blocks can fall short (a bounded loop, not one per block)."""
    if min_steps is None:
        return 0 if isinstance(q_len, int) and isinstance(k_len, int) else np.zeros(np.broadcast(q_len, k_len).shape)
    rows, keys = tile
    if isinstance(q_len, int) and isinstance(k_len, int):
        if q_len <= 0:
            return 0
        tiles, blocks = _cdiv(q_len, rows), _cdiv(k_len, keys)
        if not causal:
            return blocks * max(0, min_steps - tiles)
        offset = k_len - q_len  # keys before the first row's diagonal
        full = min(blocks, offset // keys + 1) if offset >= 0 else 0  # blocks whose keys every row sees
        short = full * max(0, min_steps - tiles)
        for j in range(blocks - 1, max(full, blocks - _cdiv(min_steps * rows, keys) - 1) - 1, -1):
            short += max(0, min_steps - max(0, tiles - max(0, j * keys - offset) // rows))
        return short
    q = np.asarray(q_len, dtype=np.int64)
    k = np.asarray(k_len, dtype=np.int64)
    q, k = np.broadcast_arrays(q, k)
    tiles, blocks = -(-q // rows), -(-k // keys)
    if not causal:
        return np.where(q > 0, blocks * np.maximum(0, min_steps - tiles), 0)
    offset = k - q
    full = np.where(offset >= 0, np.minimum(blocks, offset // keys + 1), 0)
    short = full * np.maximum(0, min_steps - tiles)
    for back in range(_cdiv(min_steps * rows, keys) + 1):
        j = blocks - 1 - back
        steps = np.maximum(0, tiles - np.maximum(0, j * keys - offset) // rows)
        short = short + np.where(j >= full, np.maximum(0, min_steps - steps), 0)
    return np.where(q > 0, short, 0)


def forward_step_total(q_len, k_len, tile: tuple[int, int], causal: bool = True):
    """``sum(forward_steps(q_len, k_len, tile, causal))`` in closed form, for ints or numpy arrays (0 where q_len is
    0).

    Block ``i`` of ``T = ceil(q/rows)`` sweeps ``ceil((k - q + (i + 1) * rows) / keys)`` key tiles, the last one
    ``ceil(k / keys)``; with ``rows`` a multiple of ``keys`` the first ``T - 1`` form an arithmetic series."""
    rows, keys = tile
    if not causal:
        return _rect_steps(q_len, k_len, rows, keys)
    if rows % keys:
        if isinstance(q_len, int) and isinstance(k_len, int):
            return _forward_steps_floor_sum(q_len, k_len, rows, keys)
        return _summed(forward_steps, q_len, k_len, tile)
    if isinstance(q_len, int) and isinstance(k_len, int):  # the scheduler's inner loop: no numpy per call
        if q_len <= 0:
            return 0
        blocks = -(-q_len // rows)
        return (rows // keys) * blocks * (blocks - 1) // 2 + (blocks - 1) * -(-(k_len - q_len) // keys) \
            - (-k_len // keys)
    q, k = np.asarray(q_len, dtype=np.int64), np.asarray(k_len, dtype=np.int64)
    blocks = -(-q // rows)
    total = (rows // keys) * blocks * (blocks - 1) // 2 + (blocks - 1) * (-(-(k - q) // keys)) + (-(-k // keys))
    return np.where(q > 0, total, 0)


def _floor_sum(n: int, m: int, a: int, b: int) -> int:
    """``sum(floor((a * i + b) / m) for i in range(n))`` for ``a, b >= 0``, ``m >= 1``, in O(log) steps."""
    total = 0
    while n > 0:
        if a >= m:
            total += (n - 1) * n // 2 * (a // m)
            a %= m
        if b >= m:
            total += n * (b // m)
            b %= m
        last = a * n + b
        if last < m:
            break
        n, b, m, a = last // m, last % m, a, m
    return total


def _forward_steps_floor_sum(q_len: int, k_len: int, rows: int, keys: int) -> int:
    """``sum(forward_steps(q, k, (rows, keys)))`` for any tile: block ``i < T - 1`` sweeps
    ``floor((rows * i + k - q + rows + keys - 1) / keys)`` key tiles, the last one ``ceil(k / keys)``."""
    if q_len <= 0:
        return 0
    blocks = -(-q_len // rows)
    return _floor_sum(blocks - 1, keys, rows, k_len - q_len + rows + keys - 1) - (-k_len // keys)


def backward_step_total(q_len, k_len, tile: tuple[int, int], causal: bool = True):
    """``sum(backward_steps(q_len, k_len, tile, causal))`` in closed form, for ints or numpy arrays (0 where q_len
    is 0).

    With ``o = k - q`` keys before the first row: key blocks starting at or before ``o`` sweep all ``ceil(q/rows)``
    query tiles; each later one starts ``keys / rows`` tiles further down (``keys`` a multiple of ``rows``)."""
    rows, keys = tile
    if not causal:
        return _rect_steps(q_len, k_len, rows, keys)
    if keys % rows:
        return _summed(backward_steps, q_len, k_len, tile)
    if isinstance(q_len, int) and isinstance(k_len, int):
        if q_len <= 0:
            return 0
        offset = k_len - q_len
        tiles, blocks = -(-q_len // rows), -(-k_len // keys)
        first_late = offset // keys + 1
        late = max(blocks - first_late, 0)
        return (min(first_late, blocks) * tiles + late * (tiles - (first_late * keys - offset) // rows)
                - (keys // rows) * late * (late - 1) // 2)
    q, k = np.asarray(q_len, dtype=np.int64), np.asarray(k_len, dtype=np.int64)
    offset = k - q
    tiles, blocks = -(-q // rows), -(-k // keys)
    first_late = offset // keys + 1  # the first key block that starts after the offset
    full = np.minimum(first_late, blocks)
    late = np.maximum(blocks - first_late, 0)
    skipped = (first_late * keys - offset) // rows  # query tiles the first late block skips
    total = full * tiles + late * (tiles - skipped) - (keys // rows) * late * (late - 1) // 2
    return np.where(q > 0, total, 0)


def _rect_steps(q_len, k_len, rows: int, keys: int):
    """Tile steps of a rectangle (every row sees every key): query tiles times key tiles, in either phase."""
    if isinstance(q_len, int) and isinstance(k_len, int):
        return _cdiv(q_len, rows) * _cdiv(k_len, keys) if q_len > 0 else 0
    q, k = np.asarray(q_len, dtype=np.int64), np.asarray(k_len, dtype=np.int64)
    return np.where(q > 0, (-(-q // rows)) * (-(-k // keys)), 0)


def _summed(steps, q_len, k_len, tile):
    if np.ndim(q_len) == 0:
        return sum(steps(int(q_len), int(k_len), tile)) if q_len > 0 else 0
    return np.array([sum(steps(int(q), int(k), tile)) if q > 0 else 0 for q, k in zip(q_len, k_len)], dtype=np.int64)


EXACT_WAVES = 8  # the last (segment order: also the first) blocks simulated one by one, in waves of ``slots``


def phase_factor(per_head: Sequence[int], heads: int, slots: int) -> float:
    """Makespan / even spread of one phase's blocks (``per_head``: each block's tile steps, in launch order, for
    one head; launched ``heads`` times) on ``slots`` slots, >= 1. Cached: a schedule prices the same calls often."""
    return _phase_factor(tuple(int(x) for x in per_head), int(heads), int(slots))


@functools.lru_cache(maxsize=65536)
def _phase_factor(per_head: tuple[int, ...], heads: int, slots: int) -> float:
    """Makespan / even spread of ``heads`` repetitions of ``per_head`` block works on ``slots`` slots (see
    :func:`_makespan`): the last :data:`EXACT_WAVES` waves simulated, those before spread. Unlike the segment
    order's, a tile-order launch does not start with its longest blocks (every head's tiles of every segment in
    turn), and its first waves are not simulated (checked against the full simulation: within 0.3% on lone 32K-row
    segments; simulating them moved torch_flash's prices by up to 2% on a few calls, for no better fit)."""
    total = sum(per_head) * heads
    if total == 0:
        return 1.0
    exact = EXACT_WAVES * slots
    copies = min(heads, -(-exact // len(per_head)))
    tail = (list(per_head) * copies)[-exact:]  # the last blocks launched (all of them in a small call)
    return _makespan([], tail, len(per_head) * heads, total, slots, max(per_head)) * slots / total


def _makespan(head: list[int], tail: list[int], blocks: int, total: int, slots: int, longest: int) -> float:
    """When the last of ``blocks`` blocks (``total`` tile steps, in launch order) ends on ``slots`` slots, each block
    started on the slot that frees first: ``head`` (the first blocks) and ``tail`` (the last) simulated so, the
    blocks between them spread over the slots as water fills a basin (the least busy first: many blocks of one
    wave or less each land that way), and never before the ``longest`` block can end.

    Why the first waves too: a kernel that launches a segment's longest blocks first (FlashAttention-4's causal
    forward) starts a call with its longest blocks; spread evenly with the rest, a few rows over a long prefix
    vanished from the price (a CAD server's forward of a few hundred rows over a long prefix beside short
    documents ran two rounds of long blocks and was priced well short; measured: bench/results/2026-11-29_cad-fa4.md).
    Simulating every block would cost the scheduler too much: a forward of 32 heads launches tens of thousands."""
    if blocks <= len(head) + len(tail):  # the head and the tail overlap: every block is simulated, in order
        head, tail = head + tail[len(head) + len(tail) - blocks:], []
    finish = [0.0] * slots
    for work in head:
        heapq.heapreplace(finish, finish[0] + work)
    if tail:
        finish = _water_filled(sorted(finish), total - sum(head) - sum(tail))
        heapq.heapify(finish)
        for work in tail:
            heapq.heapreplace(finish, finish[0] + work)
    return max(max(finish), longest)


def _water_filled(finish: list[float], amount: float) -> list[float]:
    """``finish`` (ascending) after ``amount`` of work is added where it is least (the lowest raised to one level)."""
    level, below = finish[0], 0
    for i, f in enumerate(finish):  # raise the i lowest to f while the amount lasts
        if (f - level) * i > amount:
            break
        amount -= (f - level) * i
        level, below = f, i + 1
    level += amount / below
    return [max(f, level) for f in finish]


def segment_phase_factor(per_segment: Sequence[Sequence[int]], heads: int, slots: int, longest_first: bool) -> float:
    """Makespan / even spread of one phase's blocks launched in segment order (:attr:`LaunchGrid.launch_order`
    ``"segment"``): ``per_segment`` holds each segment's blocks' tile steps (one head, in tile order), segment after
    segment; with ``longest_first`` (a causal forward's varlen scheduler) a segment's blocks start longest first,
    each block's ``heads`` copies one after another, else a segment's blocks run head by head in tile order. As
    :func:`phase_factor`, the first and last :data:`EXACT_WAVES` waves are simulated, those between spread.
    Cached."""
    return _segment_phase_factor(tuple(tuple(int(x) for x in seg) for seg in per_segment), int(heads), int(slots),
                                 bool(longest_first))


@functools.lru_cache(maxsize=65536)
def _segment_phase_factor(per_segment: tuple[tuple[int, ...], ...], heads: int, slots: int,
                          longest_first: bool) -> float:
    total = sum(sum(seg) for seg in per_segment) * heads
    if total == 0:
        return 1.0
    exact = EXACT_WAVES * slots

    def launched(seg: tuple[int, ...]) -> list[int]:
        return [w for w in sorted(seg, reverse=True) for _ in range(heads)] if longest_first else list(seg) * heads

    head: list[int] = []  # the first blocks launched, from the call's start
    for seg in per_segment:
        head += launched(seg)[:exact - len(head)]
        if len(head) >= exact:
            break
    tail: list[int] = []  # the last ones, from its end
    for seg in reversed(per_segment):
        tail[:0] = launched(seg)[-(exact - len(tail)):]
        if len(tail) >= exact:
            break
    blocks = sum(len(seg) for seg in per_segment) * heads
    longest = max(max(seg, default=0) for seg in per_segment)
    return _makespan(head, tail, blocks, total, slots, longest) * slots / total


def segment_launch_steps(phase: str, pairs: Sequence[tuple[int, int]], grid: LaunchGrid, heads: int,
                         causal: bool = True) -> tuple[float, int]:
    """One phase of a call launched in segment order, in tile steps of one head: (with the call's tail, at full
    throughput). Each segment's blocks (forward: query tiles, launched once per ``heads / forward_head_pack``;
    backward: key tiles, once per head), the causal forward's longest first (:func:`segment_phase_factor`)."""
    if phase == "forward":
        per_segment = [forward_steps(q, k, grid.forward_tile, causal) for q, k in pairs]
        launched_heads, longest_first = max(1, heads // grid.forward_head_pack), causal
    else:
        per_segment = [backward_steps(q, k, grid.backward_tile, causal) for q, k in pairs]
        launched_heads, longest_first = heads, False
    full = sum(sum(seg) for seg in per_segment)
    return full * segment_phase_factor(per_segment, launched_heads, grid.slots, longest_first), full


def forward_block_steps(q_lens: Sequence[int], k_lens: Sequence[int], grid: LaunchGrid, heads: int,
                        causal: bool = True) -> list[int]:
    """Tile steps of every block a varlen forward call launches, in launch order: per head, per segment, its query
    tiles up to the call's longest segment's (a segment with fewer launches empty blocks: 0 steps)."""
    pairs = [(int(q), int(k)) for q, k in zip(q_lens, k_lens) if q > 0]
    if not pairs:
        return []
    tiles = max(_cdiv(q, grid.forward_tile[0]) for q, _ in pairs)
    per_head: list[int] = []
    for q, k in pairs:
        steps = forward_steps(q, k, grid.forward_tile, causal)
        per_head += steps + [0] * (tiles - len(steps))
    return per_head * heads


def paired_makespan(steps: Sequence[float], sms: int, pairing: float, empty: float = 0.0, repeats: int = 1) -> float:
    """Finish time (in a lone block's tile steps) of blocks of ``steps`` (launched ``repeats`` times over, e.g. one
    head's blocks of a call) started in launch order on ``2 * sms`` slots: a block that starts while more than
    ``sms`` blocks run shares an SM and takes ``pairing`` times its steps; an empty block (0 steps) holds its slot
    for ``empty``. Where every block starts at once (at most ``2 * sms``), blocks are placed by launch position,
    empty ones too: the blocks past the first ``sms`` share SMs (measured: one long block per head among empty
    ones pairs past 128 blocks).

    Why: torch's flash forward runs up to one block per SM alone; past that, long blocks mostly end up two to
    an SM and take longer, whatever separates them in the launch order (``scripts/lab/profile_cad.py
    --placement``; measured: bench/results/2026-11-24_cad-kernel-time.md). The blocks before the last
    :data:`EXACT_WAVES` waves of ``2 * sms`` are taken as spread evenly, two to an SM; the launch is never built whole
    (a forward call of 32 heads
    launches tens of thousands of blocks, and a schedule prices thousands of calls)."""
    if sms < 1 or pairing < 1.0 or empty < 0 or repeats < 0:
        raise ValueError(f"paired_makespan needs sms >= 1, pairing >= 1, empty >= 0 and repeats >= 0, got {sms}, "
                         f"{pairing}, {empty}, {repeats}")
    works = [w if w > 0 else empty for w in steps]
    n, slots = len(works) * repeats, 2 * sms
    if n == 0:
        return 0.0
    if n <= slots:  # every block starts at once, placed in launch order: the first ``sms`` alone, the rest paired
        alone, paired = 0.0, 0.0
        for position, work in enumerate(works * repeats):
            if position < sms:
                alone = max(alone, work)
            else:
                paired = max(paired, work)
        return max(alone, paired * pairing)
    exact = EXACT_WAVES * slots
    now = 0.0
    if n > exact:
        copies = -(-exact // len(works))
        tail = (works * copies)[-exact:]
        now = (sum(works) * repeats - sum(tail)) * pairing / slots
    else:
        tail = works * repeats
    return _simulated_finish(tail, now, sms, pairing)


def _simulated_finish(works: list[float], now: float, sms: int, pairing: float) -> float:
    """The last end of ``works`` started in order from ``now`` on ``2 * sms`` slots (see :func:`paired_makespan`)."""
    slots = 2 * sms
    running: list[float] = []  # end times of the blocks holding slots
    pop, push = heapq.heappop, heapq.heappush
    finish = now
    for work in works:
        if len(running) >= slots:
            ended = pop(running)
            if ended > now:
                now = ended
        while running and running[0] <= now:
            pop(running)
        end = now + (work * pairing if len(running) >= sms else work)
        push(running, end)
        if end > finish:
            finish = end
    return finish


def paired_forward_steps(q_lens: Sequence[int], k_lens: Sequence[int], grid: LaunchGrid, heads: int,
                         causal: bool = True) -> float:
    """A forward call's time on ``grid`` in tile steps of one head at full throughput (``2 * slots`` blocks, two to
    an SM, each ``forward_pairing`` slower): :func:`paired_makespan` of its blocks, scaled so that a call that
    keeps every SM busy with two blocks gives its steps per head. Cached: a schedule prices the same calls often."""
    return _paired_forward_steps(tuple(int(q) for q in q_lens), tuple(int(k) for k in k_lens), grid, int(heads),
                                 bool(causal))


@functools.lru_cache(maxsize=65536)
def _paired_forward_steps(q_lens: tuple[int, ...], k_lens: tuple[int, ...], grid: LaunchGrid, heads: int,
                          causal: bool) -> float:
    per_head = forward_block_steps(q_lens, k_lens, grid, 1, causal)
    if not per_head:
        return 0.0
    makespan = paired_makespan(per_head, grid.slots, grid.forward_pairing, grid.empty_hold, repeats=heads)
    return makespan * 2 * grid.slots / grid.forward_pairing / heads


def tail_factor(q_lens: Sequence[int], k_lens: Sequence[int], heads: int, grid: LaunchGrid) -> float:
    """Time of one call over these causal segments (in launch order) / its work at full throughput (>= 1)."""
    return _tail_factor(tuple(int(q) for q in q_lens), tuple(int(k) for k in k_lens), heads, grid)


@functools.lru_cache(maxsize=65536)  # a schedule's refinement prices the same calls many times over
def _tail_factor(q_lens: tuple[int, ...], k_lens: tuple[int, ...], heads: int, grid: LaunchGrid) -> float:
    pairs = [(q, k) for q, k in zip(q_lens, k_lens) if q > 0]
    if not pairs:
        return 1.0
    if grid.launch_order == "segment":  # each phase's steps with its tail over its steps alone: its factor
        factors = [steps / full if full else 1.0 for steps, full in (segment_launch_steps(phase, pairs, grid, heads)
                                                                     for phase in ("forward", "backward"))]
        return grid.forward_weight * factors[0] + (1.0 - grid.forward_weight) * factors[1]
    forward, backward = [], []
    for q, k in pairs:
        forward += forward_steps(q, k, grid.forward_tile)
        backward += backward_steps(q, k, grid.backward_tile)
    return (grid.forward_weight * _phase_factor(tuple(forward), heads, grid.slots)
            + (1.0 - grid.forward_weight) * _phase_factor(tuple(backward), heads, grid.slots))
