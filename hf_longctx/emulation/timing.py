"""Per-rank kernel time of an emulated group: every attention kernel call charged to the rank that made it.

Why events and no synchronisation: the emulated ranks run one at a time (see
:mod:`hf_longctx.comm.emulated`), so between the two events recorded around a call the device stream
holds exactly that call's kernels, and its time is read once the step is over. Nothing waits on the
device during the step. The device spins before each call's start event
(:func:`~hf_longctx.benchmarking.queue_ahead`), so the call's kernels are all queued when it fires and
the events time the device's work, not the host's dispatch between launches (which a real step, its host
running layers ahead, hides; on an H100's host it was 1 ms per call, more than the kernels of a small one).
On the CPU a call's wall time is its kernel time (the CPU runs it synchronously).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from ..benchmarking import queue_ahead
from ..comm.emulated import EmulationHub
from ..kernels import KernelCall

_WARM: set[tuple] = set()  # kernel configurations already run in this process


def _configuration(name: str, args: tuple, kwargs: dict) -> tuple:
    """What a kernel compiles for: entry point, dtypes and row shapes of the tensors, flags (not lengths)."""
    calls = [a for a in args if isinstance(a, KernelCall)]
    if calls:  # kernel_forward / kernel_backward take one typed call
        kernel = kwargs.get("kernel", next((a for a in args if isinstance(a, str)), None))
        return name, calls[0].configuration(), kernel
    tensors = tuple((a.dtype, tuple(a.shape[1:])) for a in args if isinstance(a, torch.Tensor) and a.dim() == 3)
    flags = tuple(a for a in args if isinstance(a, bool) or a is None)
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k in ("causal", "kernel", "window")))
    return name, tensors, flags, options


class KernelTimer:
    """A kernel observer (:func:`hf_longctx.kernels.observe_kernels`) summing kernel seconds per (rank, phase).

    Calls made outside an emulated rank's thread (no current rank) pass through untimed. On a GPU, the
    first call of each kernel configuration in this process runs once untimed before the timed call:
    kernels compile per configuration (FA4: 0.1-0.7 s), which would otherwise land in one rank's time.
    """

    def __init__(self, hub: EmulationHub, device: torch.device) -> None:
        self.hub = hub
        self.cuda = device.type == "cuda"
        self._events: dict[tuple[int, str], list[tuple[torch.cuda.Event, torch.cuda.Event]]] = defaultdict(list)
        self._seconds: dict[tuple[int, str], float] = defaultdict(float)
        self.calls: dict[tuple[int, str], int] = defaultdict(int)

    def __call__(self, name: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        rank = self.hub.current_rank()
        if rank is None:
            return fn(*args, **kwargs)
        self.calls[rank, name] += 1
        if self.cuda:
            key = _configuration(name, args, kwargs)
            if key not in _WARM:
                fn(*args, **kwargs)
                _WARM.add(key)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            queue_ahead()  # the call's kernels are queued before its start event fires: device time only
            start.record()
            result = fn(*args, **kwargs)
            end.record()
            self._events[rank, name].append((start, end))
            return result
        t0 = time.perf_counter()
        result = fn(*args, **kwargs)
        self._seconds[rank, name] += time.perf_counter() - t0
        return result

    def seconds(self) -> dict[tuple[int, str], float]:
        """Kernel seconds per (rank, ``forward``/``backward``); synchronises the device once."""
        out = defaultdict(float, self._seconds)
        if self._events:
            torch.cuda.synchronize()
            for key, pairs in self._events.items():
                out[key] += sum(s.elapsed_time(e) for s, e in pairs) / 1e3
        return dict(out)
