"""A varlen batch run as several kernel calls, so that short segments do not pay for the longest one's grid.

Why: GPU varlen attention kernels size their launch grid by the batch's longest segment. FlashAttention's
forward launches ``ceil(max_q / tile)`` query tiles for every segment and head, its backward
``ceil(max_k / tile)`` key tiles; a short segment's surplus tiles find no rows and exit, but each costs a
launch slot, and the more the longer the segment beside it. A CAD server that computes one long document's
last rows beside dozens of short documents pays that per short segment, so its kernel time is no longer the sum
of its tasks' costs, and a schedule balanced on per-task costs was far off in kernel time at 64 ranks (measured:
bench/results/2026-12-04_from-modules.md).

The cure is cheap: sort a batch's segments by key length (longest first) and cut it into runs, one kernel
call each, so that each run's grid fits its own longest segment. A call has a fixed cost of its own, so a
run is cut only where the surplus tiles it saves cost more than one more call, or where the kernel slows down
past a number of keys per call. :class:`CallTerms` holds the three measured prices and that limit, and
:func:`cut_into_calls` finds the cheapest cuts (an exact dynamic program over the
sorted segments). The forward and backward of a cut batch (:func:`forward_in_calls`,
:func:`backward_in_calls`) are the plain calls on contiguous slices, concatenated: the same numbers as one
call, since segments never see each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .key_split import KeySplit

__all__ = ["CallTerms", "backward_in_calls", "call_order", "calls_overhead", "forward_in_calls", "cut_into_calls"]

CallRange = tuple[int, int]  # segments [first, end) of one kernel call
TIE = 1e-12  # costs this close (relative) are equal: the cut with fewer calls wins


@dataclass(frozen=True)
class CallTerms:
    """What a varlen kernel call costs beyond the work of its segments (in ``units``, e.g. ms of fwd+bwd).

    - ``call``: once per call (launches and the fixed passes of forward and backward).
    - ``q_tile``: per segment and per query tile by which the call's longest segment exceeds it.
    - ``k_tile``: the same per key tile (the backward's grid runs over key tiles).

    ``tile`` is the kernel's tile in rows. All zero: cutting never pays, a batch stays one call.
    ``max_keys``: keys one call may hold (the kernel's ``backward_keys_limit``: past it the backward slows down
    per key); a segment over it alone is a call of its own. None: no limit.
    ``key_split``: how a forward call of few long blocks is run as chunks of its keys (:mod:`.key_split`); None:
    every forward call whole.
    """

    call: float = 0.0
    q_tile: float = 0.0
    k_tile: float = 0.0
    tile: int = 128
    units: str = "ms"
    max_keys: int | None = None
    key_split: KeySplit | None = None

    def __post_init__(self) -> None:
        for name in ("call", "q_tile", "k_tile"):
            value = getattr(self, name)
            if not (value == value and value >= 0 and value != float("inf")):
                raise ValueError(f"CallTerms.{name} must be finite and >= 0, got {value!r}")
        if isinstance(self.tile, bool) or not isinstance(self.tile, int) or self.tile < 1:
            raise ValueError(f"CallTerms.tile must be an int >= 1, got {self.tile!r}")
        if self.max_keys is not None and (isinstance(self.max_keys, bool) or not isinstance(self.max_keys, int)
                                          or self.max_keys < 1):
            raise ValueError(f"CallTerms.max_keys must be None or an int >= 1, got {self.max_keys!r}")

    @property
    def active(self) -> bool:
        """Whether a batch may be cut: surplus tiles cost something, or calls have a keys limit (else one call is
        always cheapest)."""
        return self.q_tile > 0 or self.k_tile > 0 or self.max_keys is not None


def _tiles(n: int, tile: int) -> int:
    return -(-int(n) // tile)


def _run_overhead(qt: Sequence[int], kt: Sequence[int], a: int, b: int, terms: CallTerms) -> float:
    """Cost of one call over segments [a, b) given their query and key tile counts."""
    mq, mk = max(qt[a:b]), max(kt[a:b])
    return terms.call + terms.q_tile * sum(mq - x for x in qt[a:b]) + terms.k_tile * sum(mk - x for x in kt[a:b])


def calls_overhead(q_lens: Sequence[int], k_lens: Sequence[int], runs: Sequence[CallRange], terms: CallTerms) -> float:
    """What ``runs`` cost beyond their segments' own work: per call, ``terms.call`` plus every segment's surplus
    tiles under the call's longest segment."""
    qt = [_tiles(n, terms.tile) for n in q_lens]
    kt = [_tiles(n, terms.tile) for n in k_lens]
    return sum(_run_overhead(qt, kt, a, b, terms) for a, b in runs if b > a)


def call_order(q_lens: Sequence[int], k_lens: Sequence[int]) -> list[int]:
    """The order :func:`cut_into_calls` expects segments in: longest keys first, then longest queries (stable)."""
    return sorted(range(len(k_lens)), key=lambda i: (-int(k_lens[i]), -int(q_lens[i])))


def cut_into_calls(q_lens: Sequence[int], k_lens: Sequence[int], terms: CallTerms | None) -> list[CallRange]:
    """The cheapest cut of segments, given in :func:`call_order`, into contiguous runs (one kernel call each),
    none holding more than ``terms.max_keys`` keys unless it is one segment.

    A dynamic program over blocks of segments with equal tile counts (which one call always serves without
    surplus), so a batch of thousands of short documents plans in milliseconds; where the keys limit binds, over
    single segments (up to :data:`SPLIT_EXACTLY` of them). Exact over contiguous cuts (of equal cost, the one
    with fewer calls), except a batch of more segments over the limit: its blocks are cut under the limit
    greedily first, which can cost a call more than the cheapest cut. ``terms`` None, or without a tile price
    or keys limit: one call.
    """
    n = len(q_lens)
    if n == 0:
        return []
    if terms is None or not terms.active or n == 1:
        return [(0, n)]
    qt = [_tiles(x, terms.tile) for x in q_lens]
    kt = [_tiles(x, terms.tile) for x in k_lens]
    limit = terms.max_keys
    keys_before = [0]
    for x in k_lens:
        keys_before.append(keys_before[-1] + int(x))
    if limit is not None and keys_before[n] > limit and n <= SPLIT_EXACTLY:
        starts = list(range(n))  # the limit binds: any cut may be the cheapest, so every segment is a block
    else:  # blocks of consecutive segments with the same (query tiles, key tiles), cut under the limit
        starts = [0] + [i for i in range(1, n) if (qt[i], kt[i]) != (qt[i - 1], kt[i - 1])]
        if limit is not None:
            starts = _under_limit(starts, keys_before, limit)
    ends = starts[1:] + [n]
    m = len(starts)
    best = [(0.0, 0)] * (m + 1)  # (cost, calls) of the segments from each block on; fewer calls break ties
    cut = [m] * (m + 1)
    for a in range(m - 1, -1, -1):
        mk = kt[starts[a]]  # keys are sorted longest first: the run's first block has the most key tiles
        mq, sum_q, sum_k, count = 0, 0, 0, 0
        best[a] = (float("inf"), 0)
        for b in range(a, m):
            if b > a and limit is not None and keys_before[ends[b]] - keys_before[starts[a]] > limit:
                break  # every longer run holds more keys still
            c = ends[b] - starts[b]
            mq = max(mq, qt[starts[b]])
            sum_q += qt[starts[b]] * c
            sum_k += kt[starts[b]] * c
            count += c
            cost = (terms.call + terms.q_tile * (mq * count - sum_q) + terms.k_tile * (mk * count - sum_k)
                    + best[b + 1][0], best[b + 1][1] + 1)
            if _cheaper(cost, best[a]):
                best[a], cut[a] = cost, b + 1
    runs, a = [], 0
    while a < m:
        runs.append((starts[a], ends[cut[a] - 1]))
        a = cut[a]
    return runs


SPLIT_EXACTLY = 256  # segments up to which a batch over the keys limit is planned segment by segment (exact)


def _under_limit(starts: list[int], keys_before: list[int], limit: int) -> list[int]:
    """Block starts with every block over ``limit`` keys cut greedily into the fewest blocks under it (a block of
    one segment stays whole). For batches of more than :data:`SPLIT_EXACTLY` segments, where a program over
    single segments would take seconds."""
    n = len(keys_before) - 1
    out = []
    for a, b in zip(starts, starts[1:] + [n]):
        out.append(a)
        if keys_before[b] - keys_before[a] > limit:
            for i in range(a + 1, b):
                if keys_before[i + 1] - keys_before[out[-1]] > limit:
                    out.append(i)
    return out


def _cheaper(cost: tuple[float, int], than: tuple[float, int]) -> bool:
    """Whether (cost, calls) beats ``than``: a lower cost, or one equal within :data:`TIE` with fewer calls."""
    if than[0] == float("inf"):
        return True
    slack = TIE * abs(than[0])
    return cost[0] < than[0] - slack or (cost[0] <= than[0] + slack and cost[1] < than[1])


def _rebased(cu: Sequence[int], a: int, b: int) -> list[int]:
    return [x - cu[a] for x in cu[a:b + 1]]


def _longest(cu: Sequence[int], a: int, b: int) -> int:
    return max(cu[i + 1] - cu[i] for i in range(a, b))


def forward_in_calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: Sequence[int], cu_k: Sequence[int],
                     runs: Sequence[CallRange], **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the packed segments, one :func:`~hf_longctx.kernels.attention_forward` call per run.

    ``runs`` must cover the segments in order (as :func:`cut_into_calls` returns them); ``kwargs`` go to every call
    (``key_split`` among them: a call of few long blocks runs as chunks of its keys).
    """
    from . import attention_forward  # the observed entry point, so per-call observers see every call

    outs, lses = [], []
    for a, b in runs:
        qs, ks = slice(cu_q[a], cu_q[b]), slice(cu_k[a], cu_k[b])
        o, lse = attention_forward(q[qs], k[ks], v[ks], _rebased(cu_q, a, b), _rebased(cu_k, a, b),
                                   _longest(cu_q, a, b), _longest(cu_k, a, b), **kwargs)
        outs.append(o)
        lses.append(lse)
    if len(runs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs), torch.cat(lses, dim=1)


def backward_in_calls(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      lse: torch.Tensor, cu_q: Sequence[int], cu_k: Sequence[int], runs: Sequence[CallRange], **kwargs
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of the packed segments, one :func:`~hf_longctx.kernels.attention_backward` call per run."""
    from . import attention_backward

    grads = []
    for a, b in runs:
        qs, ks = slice(cu_q[a], cu_q[b]), slice(cu_k[a], cu_k[b])
        grads.append(attention_backward(dout[qs], q[qs], k[ks], v[ks], out[qs], lse[:, qs].contiguous(),
                                        _rebased(cu_q, a, b), _rebased(cu_k, a, b), _longest(cu_q, a, b),
                                        _longest(cu_k, a, b), **kwargs))
    if len(runs) == 1:
        return grads[0]
    return tuple(torch.cat([g[i] for g in grads]) for i in range(3))
