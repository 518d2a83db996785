"""Rounding of kernel shapes onto a coarse grid, so shape-keyed kernels build few plans.

cuDNN builds (and caches) one execution graph per (segment count, max segment length[, total
tokens]) and a build takes 0.1-3 s. Packed long-document batches make every one of those numbers
different on every step, so a run over random batches would rebuild graphs forever. Rounding each
number up onto a grid with a few steps per octave bounds the number of graphs by the log of the
range, at the price of at most 1/steps more padding.
"""

from __future__ import annotations


def bucket(n: int, steps_per_octave: int = 2, exact_below: int = 8) -> int:
    """Smallest grid value >= n; values below ``exact_below`` are kept as they are.

    The grid holds 2^e * (1 + i / steps_per_octave) for i in 0..steps_per_octave-1, so rounding
    up never adds more than 1/steps_per_octave of n.
    """
    if n < 0:
        raise ValueError(f"cannot bucket a negative size {n}")
    if n <= exact_below:
        return n
    octave = 1 << (n.bit_length() - 1)  # largest power of two <= n
    for i in range(steps_per_octave + 1):
        value = octave + (octave * i + steps_per_octave - 1) // steps_per_octave
        if value >= n:
            return value
    raise AssertionError("unreachable: the next octave is >= n")


def padded_segments(cu: list[int], count: int) -> list[int]:
    """``cu`` extended with empty segments at the end to ``count`` segments (a bucketed count)."""
    if count < len(cu) - 1:
        raise ValueError(f"cannot pad {len(cu) - 1} segments down to {count}")
    return list(cu) + [cu[-1]] * (count - (len(cu) - 1))


def lse_runs(cu_q: list[int], heads: int, budget_bytes: int, steps_per_octave: int = 2) -> list[tuple[int, int]]:
    """Split segments into contiguous runs whose padded (segments, heads, max_len) fp32 LSE fits a budget.

    A backward that takes its LSE padded to (B, H, max_seqlen) needs B * H * max_seqlen * 4 bytes
    for it; one long document among many short ones would make that quadratic-looking buffer huge.
    Runs are contiguous so their q/k/v stay views of the packed tensors (no copy); a run of one
    segment is always allowed, whatever its size. Returns [(first_segment, end_segment), ...].
    """
    n = len(cu_q) - 1
    runs: list[tuple[int, int]] = []
    start, longest = 0, 0
    for i in range(n):
        length = cu_q[i + 1] - cu_q[i]
        grown = max(longest, length)
        cost = bucket(i + 1 - start, steps_per_octave) * heads * bucket(grown, steps_per_octave) * 4
        if i > start and cost > budget_bytes:
            runs.append((start, i))
            start, grown = i, length
        longest = grown
    if n:
        runs.append((start, n))
    return runs
