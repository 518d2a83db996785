"""How a worker times its steps and reads its peaks, the same way for every system.

Steps are timed on the host clock between device synchronisations (a step is seconds long: the synchronisation
costs nothing beside it, and it includes whatever the system does on the host, such as an optimizer on the CPU).
The first ``warmup`` steps are not timed (allocator growth, kernel selection, a CPU optimizer's first call); the
result is the median of the timed steps. GPU peaks (``max_memory_allocated`` and ``max_memory_reserved``) are reset
when the first timed step begins, so they are those of steady steps. The host peak of the worker is its own
``VmHWM``; the parent also samples the resident memory of the worker's whole process tree (``runner``).
"""

from __future__ import annotations

import statistics
import time
import traceback
from dataclasses import dataclass, field

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class StepClock:
    """Receives each step's begin and end from a system (``begin(i)`` / ``end(i, loss)``): times the steps from
    ``warmup`` on and resets the GPU peaks when the first of them begins."""

    device: torch.device
    warmup: int
    seconds: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    _start: float | None = None
    _step: int = 0

    def begin(self) -> None:
        synchronize(self.device)
        if self._step == self.warmup and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._start = time.perf_counter()

    def end(self, loss: float | None = None) -> None:
        synchronize(self.device)
        if self._start is None:
            raise RuntimeError("a step ended that never began")
        if self._step >= self.warmup:
            self.seconds.append(time.perf_counter() - self._start)
        if loss is not None:
            self.losses.append(float(loss))
        self._start = None
        self._step += 1

    @property
    def steps_done(self) -> int:
        return self._step

    def step_seconds(self) -> float:
        """Median seconds of the timed steps; nan when none was timed."""
        return statistics.median(self.seconds) if self.seconds else float("nan")


def gpu_peaks_gib(device: torch.device) -> tuple[float | None, float | None]:
    """(max allocated, max reserved) since the last reset, GiB; None off CUDA."""
    if device.type != "cuda":
        return None, None
    return torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.max_memory_reserved(device) / 2**30


def error_record(err: BaseException, lines: int = 12) -> dict:
    """An exception as the result reports it: its type, message (first 500 characters) and the traceback's last
    lines."""
    tail = "".join(traceback.format_exception(type(err), err, err.__traceback__)).rstrip().splitlines()[-lines:]
    return {"type": type(err).__name__, "message": str(err)[:500], "last_lines": tail,
            "out_of_memory": is_out_of_memory(f"{type(err).__name__}: {err}")}


def is_out_of_memory(text: str) -> bool:
    """Whether an error text says the GPU (or the host, for a pinned allocation) ran out of memory."""
    lowered = text.lower()
    return "out of memory" in lowered or "outofmemoryerror" in lowered or "cuda error: out of memory" in lowered
