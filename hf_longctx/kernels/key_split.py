"""A forward call of few, long blocks run as chunks of its keys, merged by log-sum-exp (split-KV).

Why: a non-persistent forward kernel launches one block per query tile and head, and each block sweeps all the
keys its rows see. A call of few rows over a long prefix (a CAD server's share of a long document's last rows, or
a key cut's rectangle) launches few blocks that each run long, on a fraction of the SMs, far below the kernel's
rate. In W = 64 ProLong steps such calls held most of those servers' forward time, and their time is set by where
the GPU places the blocks, which the launch model prices poorly. Cut into chunks of keys, the same call launches
many short blocks that fill the device, and those servers' forward got faster (``scripts/lab/bench_key_split.sh``;
measured: bench/results/2026-12-04_from-modules.md).

:func:`plan_key_split` decides by :class:`KeySplit`'s rule which calls are cut and into which chunks of the keys
every row of a segment sees (all of a rectangle's; under a causal mask the prefix before the segment's first
row's diagonal). :func:`split_forward` runs the chunks as one non-causal call and what is left (each cut segment's
rows over their own diagonal block, the other segments whole) as one causal call, on views of the packed keys (a
segment of no rows spans the keys between), and merges each cut row's parts in the accumulation dtype, every row
at once (:func:`~hf_longctx.kernels.merge.merge_row_parts_`: one Triton kernel on CUDA).

The same cut serves FlashAttention-4, which has no split-KV forward on Hopper (its grid declares the rule).

Only the forward is split: the backward's blocks are key tiles, many over a long prefix, and it takes the merged
output and log-sum-exp, which are the whole row's. (Its mirror case, many rows over few keys, where few backward
blocks each sweep all the rows, is not cut.) Sliding windows are never split (a window's rows see different keys).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .launch import LAUNCH_ORDERS, LaunchGrid, forward_steps, paired_makespan, segment_phase_factor
from .merge import RowParts, merge_row_parts_

__all__ = ["GAIN", "MIN_KEYS", "MIN_SHARED", "RULE", "WAVES", "KeySplit", "SplitCall", "merged_rows",
           "plan_key_split", "row_parts", "split_calls", "split_forward"]

# a call is cut when its blocks, placed as they launch, take GAIN times what they would spread evenly; into chunks
# that launch about WAVES waves of blocks, none under MIN_KEYS keys; only segments sharing MIN_SHARED keys are cut
# (see KeySplit)
GAIN, WAVES, MIN_KEYS, MIN_SHARED = 1.2, 4.0, 4096, 16384
RULE = (GAIN, WAVES, MIN_KEYS, MIN_SHARED)  # what a kernel's launch grid declares to have its forwards cut
Segment = tuple[int, int, int, int]  # query rows [start, end) and keys [start, end) of one segment, packed offsets


@dataclass(frozen=True)
class KeySplit:
    """When and how finely a forward call's keys are cut, on a device of ``sms`` SMs running forward blocks of
    ``tile`` (query rows, keys per step) two to an SM, each then ``pairing`` times slower
    (:func:`~hf_longctx.kernels.launch.paired_makespan`).

    A call is cut when its blocks, started in launch order, would finish ``gain`` times later than spread evenly
    over the SMs: too few blocks to fill them (a long document's last rows over its whole prefix), or a last wave
    that leaves most of them idle. The chunks are as long as gives the call about ``waves`` waves of ``2 * sms``
    blocks, and no shorter than ``min_keys`` (each chunk reads its rows again and writes an output to merge); a call
    is cut only where some segment's rows all share ``min_shared`` keys, and then every segment sharing more than a
    chunk is cut (one left whole keeps the call's long blocks). The rule was chosen on the forward calls of CAD
    steps at 64 servers (``scripts/lab/bench_key_split.sh``). ``min_shared`` was 32K while each cut segment's
    merge took a dozen kernels (below it cut calls then ran no faster); with the merge one kernel, cutting pays
    down to calls sharing 8-16K keys and not below (``scripts/bench_merge.py --calls``), so the threshold is 16K
    (measured: bench/results/2026-12-04_from-modules.md).

    A kernel that launches segment by segment (``launch_order`` ``"segment"``: FlashAttention-4 on Hopper, one
    forward block to an SM, a KV head's ``head_pack`` query heads in one tile) is judged by its own launch
    simulation (:func:`~hf_longctx.kernels.launch.segment_phase_factor`, its longest blocks first), and its chunks
    make ``waves`` waves of ``sms`` blocks. It runs by torch_flash's rule (not yet swept for it), which cuts
    such a forward's time by more than half (bench/results/2026-12-04_from-modules.md).
    """

    sms: int
    tile: tuple[int, int] = (128, 64)
    pairing: float = 1.0
    gain: float = GAIN
    waves: float = WAVES
    min_keys: int = MIN_KEYS
    min_shared: int = MIN_SHARED
    # how the kernel launches its forward blocks (LaunchGrid.launch_order, forward_head_pack): "tile", two to an SM
    # as above; "segment", one to an SM, each segment's own blocks in turn (its longest first), a KV head's query
    # heads packed into one tile's rows
    launch_order: str = "tile"
    head_pack: int = 1

    def __post_init__(self) -> None:
        if min(self.sms, self.min_keys, self.min_shared, self.head_pack, *self.tile) < 1 \
                or min(self.pairing, self.gain) < 1 or self.waves <= 0:
            raise ValueError(f"KeySplit needs positive sms, min_keys, min_shared, head_pack, tile and waves, and "
                             f"pairing and gain >= 1, got {self}")
        if self.launch_order not in LAUNCH_ORDERS:
            raise ValueError(f"KeySplit.launch_order must be one of {LAUNCH_ORDERS}, got {self.launch_order!r}")

    @property
    def rule(self) -> tuple[float, float, int, int]:
        """(gain, waves, min_keys, min_shared): what a launch grid declares (``LaunchGrid.forward_key_split``)."""
        return self.gain, self.waves, self.min_keys, self.min_shared

    @classmethod
    def for_grid(cls, grid: LaunchGrid | None) -> KeySplit | None:
        """The split a kernel's launch grid declares (``grid.forward_key_split``, a :attr:`rule`), else None."""
        if grid is None or grid.forward_key_split is None:
            return None
        gain, waves, min_keys, min_shared = grid.forward_key_split
        return cls(sms=grid.slots, tile=grid.forward_tile, pairing=grid.forward_pairing, gain=float(gain),
                   waves=float(waves), min_keys=int(min_keys), min_shared=int(min_shared),
                   launch_order=grid.launch_order, head_pack=grid.forward_head_pack)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def plan_key_split(q_lens: Sequence[int], k_lens: Sequence[int], heads: int, split: KeySplit | None,
                   causal: bool = True) -> list[tuple[int, ...]] | None:
    """Per segment, the cuts of the keys all its rows see, ``(0, ..., shared)`` (multiples of the tile's keys
    inside), or ``()`` to leave it whole; None: the call is left whole (no ``split``, its blocks placed well
    enough, or no segment sharing enough keys; see :class:`KeySplit`).

    Under ``causal`` (bottom-right) a segment's rows all see its first ``k - q`` keys; a rectangle's rows see all.
    Cached: a schedule prices the same calls often."""
    if split is None:
        return None
    cuts = _plan(tuple(int(q) for q in q_lens), tuple(int(k) for k in k_lens), int(heads), split, bool(causal))
    return None if cuts is None else list(cuts)


@functools.lru_cache(maxsize=65536)
def _plan(q_lens: tuple[int, ...], k_lens: tuple[int, ...], heads: int, split: KeySplit, causal: bool
          ) -> tuple[tuple[int, ...], ...] | None:
    rows_tile, keys_tile = split.tile
    shared = [k - (q if causal else 0) if q > 0 else 0 for q, k in zip(q_lens, k_lens)]
    if max(shared, default=0) < split.min_shared:
        return None
    live = [(q, k) for q, k in zip(q_lens, k_lens) if q > 0]
    if split.launch_order == "segment":  # one block to an SM, segment after segment, a KV head's heads packed
        launched, slots = max(1, heads // split.head_pack), split.sms
        per_segment = [forward_steps(q, k, split.tile, causal) for q, k in live]
        if segment_phase_factor(per_segment, launched, slots, longest_first=causal) < split.gain:
            return None
    else:
        launched, slots = heads, 2 * split.sms
        longest = max(_cdiv(q, rows_tile) for q, _ in live)
        per_head: list[int] = []
        for q, k in live:
            steps = forward_steps(q, k, split.tile, causal)
            per_head += steps + [0] * (longest - len(steps))
        even = sum(per_head) * heads * split.pairing / (2 * split.sms)
        if paired_makespan(per_head, split.sms, split.pairing, repeats=heads) < split.gain * even:
            return None
    # chunk keys c: sum_i launched * tiles_i * shared_i / c blocks make ``waves`` waves of the slots
    tiles = [_cdiv(q, rows_tile) if q > 0 else 0 for q in q_lens]
    work = launched * sum(t * max(x, 0) for t, x in zip(tiles, shared))
    chunk = max(split.min_keys, _cdiv(_cdiv(work, round(split.waves * slots)), keys_tile) * keys_tile)
    cuts: list[tuple[int, ...]] = []
    for x in shared:
        if x <= chunk:
            cuts.append(())
            continue
        n = x // chunk  # chunks of at least ``chunk`` keys
        inner = [round(j * x / n / keys_tile) * keys_tile for j in range(1, n)]
        cuts.append((0, *inner, x))
    return tuple(cuts) if any(cuts) else None


@dataclass(frozen=True)
class SplitCall:
    """The two kernel calls of a split forward, as segments over the packed input (see :data:`Segment`).

    ``causal``: segments of the causal call over the original query rows (split segments' rows over their diagonal
    block, behind a segment of no rows spanning their chunked keys; the others whole); empty for a call of
    rectangles. ``rect``: the chunks, each over its own copy of its segment's rows (segments of no rows span the
    keys between chunks). Keys are contiguous in both: each call reads a view of the packed keys."""

    causal: tuple[Segment, ...]
    rect: tuple[Segment, ...]


def split_calls(cu_q: Sequence[int], cu_k: Sequence[int], cuts: Sequence[tuple[int, ...]], causal: bool
                ) -> SplitCall:
    """The calls that compute segments ``cu_q``/``cu_k`` cut as :func:`plan_key_split` says."""
    causal_segs: list[Segment] = []
    rect: list[Segment] = []
    k_end = None  # where the rect call's keys reach so far

    def rect_piece(qa: int, qb: int, ka: int, kb: int) -> None:
        nonlocal k_end
        if k_end is not None and ka > k_end:
            rect.append((qa, qa, k_end, ka))  # no rows: the keys between two chunks keep the view contiguous
        rect.append((qa, qb, ka, kb))
        k_end = kb

    for i, c in enumerate(cuts):
        qa, qb, ka, kb = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        if not causal:
            for lo, hi in zip(c, c[1:]) if c else [(0, kb - ka)]:
                rect_piece(qa, qb, ka + lo, ka + hi)
            continue
        if not c:
            causal_segs.append((qa, qb, ka, kb))
            continue
        for lo, hi in zip(c, c[1:]):
            rect_piece(qa, qb, ka + lo, ka + hi)
        causal_segs.append((qa, qa, ka, ka + c[-1]))
        causal_segs.append((qa, qb, ka + c[-1], kb))
    return SplitCall(tuple(causal_segs), tuple(rect))


def _parts(cut: tuple[int, ...], causal: bool) -> int:
    """A segment's parts in the rect call: its chunks (a rectangle left whole is one part, a causal segment left
    whole none)."""
    return len(cut) - 1 if cut else (0 if causal else 1)


def _merged(q_lens: Sequence[int], cuts: Sequence[tuple[int, ...]], causal: bool):
    """(segment, rows, parts) of each segment :func:`split_forward` merges: it has rows, and parts in the rect call
    (under a causal mask only a cut segment, whose chunks merge with its diagonal block)."""
    for i, (q, c) in enumerate(zip(q_lens, cuts)):
        parts = _parts(c, causal)
        if q > 0 and parts > 0:
            yield i, int(q), parts


def merged_rows(q_lens: Sequence[int], cuts: Sequence[tuple[int, ...]], causal: bool) -> int:
    """The rows :func:`split_forward`'s merge reads: each merged segment's rows once per part, and under a causal
    mask once more for its diagonal block (the merge is one kernel over these rows: what the split costs beyond its
    two calls, which the launch model prices per row)."""
    return sum(rows * (parts + causal) for _, rows, parts in _merged(q_lens, cuts, causal))


def row_parts(cu_q: Sequence[int], cuts: Sequence[tuple[int, ...]], causal: bool) -> RowParts:
    """Where each merged row's parts lie in the rect call's output: a segment's chunks follow one another, each
    over all its rows (see :func:`split_calls`). Cached: every layer of a step makes the same calls."""
    return _row_parts(tuple(int(x) for x in cu_q), tuple(tuple(c) for c in cuts), bool(causal))


@functools.lru_cache(maxsize=4096)
def _row_parts(cu_q: tuple[int, ...], cuts: tuple[tuple[int, ...], ...], causal: bool) -> RowParts:
    blocks, at = [], 0
    for i, rows, parts in _merged([b - a for a, b in zip(cu_q, cu_q[1:])], cuts, causal):
        blocks.append((cu_q[i], rows, at, parts))
        at += parts * rows
    return RowParts.of_blocks(blocks)


def _offsets(segments: Sequence[Segment]) -> tuple[list[int], list[int], int, int]:
    """(cu_q, cu_k, max rows, max keys) of ``segments`` packed one after another."""
    cu_q, cu_k = [0], [0]
    for qa, qb, ka, kb in segments:
        cu_q.append(cu_q[-1] + qb - qa)
        cu_k.append(cu_k[-1] + kb - ka)
    return (cu_q, cu_k, max((qb - qa for qa, qb, _, _ in segments), default=0),
            max((kb - ka for _, _, ka, kb in segments), default=0))


Forward = Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (q, k, v, cu_q, cu_k, max_q, max_k, causal=) -> (out, lse)


def split_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: Sequence[int], cu_k: Sequence[int],
                  cuts: Sequence[tuple[int, ...]], causal: bool, forward: Forward) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the segments, computed as :func:`split_calls` cuts them (``forward`` runs one kernel call, its
    other arguments bound): the same as one call, up to the order of the sums."""
    calls = split_calls(cu_q, cu_k, cuts, causal)
    rect = [s for s in calls.rect if s[1] > s[0]]
    r_cu_q, r_cu_k, r_max_q, r_max_k = _offsets(calls.rect)
    k0, k1 = calls.rect[0][2], calls.rect[-1][3]
    r_out, r_lse = forward(torch.cat([q[a:b] for a, b, _, _ in rect]), k[k0:k1], v[k0:k1], r_cu_q, r_cu_k, r_max_q,
                           r_max_k, causal=False)
    if causal:
        c_cu_q, c_cu_k, c_max_q, c_max_k = _offsets(calls.causal)
        out, lse = forward(q, k, v, c_cu_q, c_cu_k, c_max_q, c_max_k, causal=True)
    else:
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=r_lse.dtype, device=q.device)
    merge_row_parts_(out, lse, row_parts(cu_q, cuts, causal), r_out, r_lse, include_self=causal)
    return out, lse
