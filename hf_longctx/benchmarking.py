"""Timing for benchmarks: device events around the region, warm-up first, median of repeats.

Device work is asynchronous, so host clocks around a launch measure the launch; CUDA events
measure the work. Warm-up keeps compilation, graph builds and handle creation out of the numbers.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist


def _one_run_ms(fn: Callable[[], object], cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def timed(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` runs after ``warmup`` runs (CUDA events; host clock on CPU)."""
    for _ in range(warmup):
        fn()
    cuda = torch.cuda.is_available()
    return statistics.median(_one_run_ms(fn, cuda) for _ in range(reps))


def timed_slowest_rank(fn: Callable[[], object], reps: int, device: torch.device, warmup: int = 1,
                       group: dist.ProcessGroup | None = None) -> float:
    """Median over ``reps`` of the slowest rank's milliseconds for ``fn()``, every rank starting together.

    A distributed step is as fast as its slowest rank; each run starts after a barrier and its time
    is the all-reduced maximum, so every rank returns the same number.
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        dist.barrier(group=group)
        t = torch.tensor([_one_run_ms(fn, device.type == "cuda")], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        times.append(t.item())
    return statistics.median(times)


def first_call_seconds(fn: Callable[[], object]) -> float:
    """Wall seconds of one call including everything it builds or compiles on first use."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def causal_attention_flops(doc_lens: list[int], heads: int, head_dim: int) -> float:
    """Forward FLOPs of causal attention per document, 2 * L^2 * H * D (QK^T and PV, half the square)."""
    return 2.0 * sum(n * n for n in doc_lens) * heads * head_dim
