"""Per-rank kernel time of an emulated group: every attention kernel call charged to the rank that made it.

Why events and no synchronisation: the emulated ranks run one at a time (see
:mod:`hf_longctx.lab.emulation.group`), so between the two events recorded around a call the device stream
holds exactly that call's kernels, and its time is read once the step is over. Nothing waits on the
device during the step. The device spins before each call's start event
(:func:`~hf_longctx.benchmarking.queue_ahead`), so the call's kernels are all queued when it fires and
the events time the device's work, not the host's dispatch between launches (which a real step, its host
running layers ahead, hides; on a slow host it takes longer than the kernels of a small call).
The spin follows the host's dispatch times (:class:`~hf_longctx.benchmarking.HostAhead`); a call whose dispatch
still outran it is counted in :attr:`KernelTimer.overruns`.
Emulated ranks pause: after each timed call the device spins (idle, at little power) for as long as the call
took (:data:`EMULATED_PAUSE`) before the next call's start event. Why: a GPU running one rank's calls after
another with no gap heats up and lowers its clocks, so a rank measured late in a busy stretch took longer than the
same calls early, and the rank order (shuffled per repetition) decided which rank looked slowest (measured:
bench/results/2026-11-29_cad-fa4.md). A real group's ranks all run at
once, each as hot as the others; the emulation keeps every rank's calls at one duty cycle instead. The W = 32 and
64 steps, whose calls are short against the spins ahead of them, showed no such drift.
On the CPU a call's wall time is its kernel time (the CPU runs it synchronously).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from hf_longctx.benchmarking import HOST_AHEAD, queue_ahead
from hf_longctx.kernels import KernelCall
from hf_longctx.kernels.key_split import plan_key_split

_WARM: set[tuple] = set()  # kernel configurations already run in this process
EMULATED_PAUSE = 1.0  # seconds the device spins after a timed call of an emulated rank, per second of the call


def _configuration(name: str, args: tuple, kwargs: dict) -> tuple:
    """What a kernel compiles for: entry point, dtypes and row shapes of the tensors, flags (not lengths); and for
    a forward cut into chunks of its keys (``key_split``), its segments too: each such call allocates buffers of
    its own shapes (the chunks' rows, their merge), and the first allocation of a size can stall the device for
    milliseconds, more than the call itself (bench/results/2026-11-29_cad-fa4.md), which a training step pays once."""
    split = kwargs.get("key_split")
    if split is not None and kwargs.get("window") is None:
        q_lens, k_lens = segment_lengths(name, args, kwargs)
        if plan_key_split(q_lens, k_lens, args[0].shape[1], split, bool(kwargs.get("causal", True))) is not None:
            return name, "key split", q_lens, k_lens, bool(kwargs.get("causal", True))
    calls = [a for a in args if isinstance(a, KernelCall)]
    if calls:  # kernel_forward / kernel_backward take one typed call
        kernel = kwargs.get("kernel", next((a for a in args if isinstance(a, str)), None))
        return name, calls[0].configuration(), kernel
    tensors = tuple((a.dtype, tuple(a.shape[1:])) for a in args if isinstance(a, torch.Tensor) and a.dim() == 3)
    flags = tuple(a for a in args if isinstance(a, bool) or a is None)
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k in ("causal", "kernel", "window")))
    return name, tensors, flags, options


def segment_lengths(name: str, args: tuple, kwargs: dict) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(query rows, keys) of every segment of one observed kernel call, from its ``cu_seqlens``."""
    call = next((a for a in args if isinstance(a, KernelCall)), None)
    if call is not None:
        cu_q, cu_k = call.cu_seqlens_q, call.cu_seqlens_k
    else:
        # attention_forward(q, k, v, cu_q, ...), attention_backward(dout, q, k, v, out, lse, cu_q, ...)
        first = 3 if name == "forward" else 6
        rest = list(args[first:first + 2])
        cu_q = rest[0] if len(rest) > 0 else kwargs["cu_seqlens_q"]
        cu_k = rest[1] if len(rest) > 1 else kwargs["cu_seqlens_k"]
    cu_q, cu_k = (c.tolist() if isinstance(c, torch.Tensor) else list(c) for c in (cu_q, cu_k))
    return (tuple(b - a for a, b in zip(cu_q, cu_q[1:])), tuple(b - a for a, b in zip(cu_k, cu_k[1:])))


def is_causal(args: tuple, kwargs: dict) -> bool:
    """Whether one observed kernel call is causal (a CAD key cut's rectangles run in non-causal calls)."""
    call = next((a for a in args if isinstance(a, KernelCall)), None)
    return bool(call.causal) if call is not None else bool(kwargs.get("causal", True))


def pause_seconds(elapsed_s: float, host_s: float, spun_s: float, pause: float) -> float:
    """How long the device spins after a timed call (see the module): ``pause`` times the seconds it worked. A call
    whose dispatch outran the spin ahead of it (``host_s`` over ``spun_s``; a kernel compiling inside it took 2 s
    once) left the device waiting on the host for the difference: that part of its ``elapsed_s`` was no work."""
    return pause * max(elapsed_s - max(host_s - spun_s, 0.0), 0.0)


class RankSource(Protocol):
    """Who is computing now: the rank a kernel call is charged to (None: nobody's, the call is not timed)."""

    def current_rank(self) -> int | None: ...


class ThisProcess:
    """The :class:`RankSource` of a real run (one process per device): every call is this process's rank's."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def current_rank(self) -> int:
        return self.rank


class KernelTimer:
    """A kernel observer (:func:`hf_longctx.kernels.observe_kernels`) summing kernel seconds per (rank, phase).

    Calls made outside an emulated rank's thread (no current rank) pass through untimed. On a GPU, the
    first call of each kernel configuration in this process runs once untimed before the timed call:
    kernels compile per configuration (FA4: a fraction of a second each), which would otherwise land in one rank's
    time. The configuration (:func:`_configuration`) does not name every variant FA4 compiles for: in a W = 64 CAD
    step one backward call still compiled inside its timed run (bench/results/2026-11-29_cad-fa4.md); the emulation's
    lower median over repetitions (:func:`~hf_longctx.lab.emulation.runner.median_rep`) leaves such a repetition out.

    ``keep_calls``: also keep every timed call's segment lengths and seconds (:meth:`call_log`), so that a cost
    model can be checked call by call against what the kernel took. ``hub``: who computes now, an emulation's
    hub (:class:`~hf_longctx.lab.emulation.group.EmulationHub`) or :class:`ThisProcess` in a real run (the same
    per-rank kernel time, measured where the ranks really run). ``pause``: seconds the device spins after a timed
    call per second of it, before the next call's start event (see the module); default :data:`EMULATED_PAUSE` for
    an emulation, 0 in a real run (its ranks run at once: pausing would only slow its step)."""

    def __init__(self, hub: RankSource, device: torch.device, keep_calls: bool = False,
                 pause: float | None = None) -> None:
        self.hub = hub
        self.cuda = device.type == "cuda"
        self.keep_calls = keep_calls
        self.pause = (0.0 if isinstance(hub, ThisProcess) else EMULATED_PAUSE) if pause is None else pause
        if self.pause < 0:
            raise ValueError(f"KernelTimer needs pause >= 0, got {self.pause}")
        self._pause_s = 0.0  # the spin the next timed call waits behind at least (its predecessor's pause)
        self._events: dict[tuple[int, str], list[tuple[torch.cuda.Event, torch.cuda.Event]]] = defaultdict(list)
        self._seconds: dict[tuple[int, str], float] = defaultdict(float)
        # rank, phase, lens, causal, events (or seconds), the host's seconds to enqueue it, the spin ahead of it
        self._log: list[tuple[int, str, tuple, tuple, bool, Any, float, float]] = []
        self.calls: dict[tuple[int, str], int] = defaultdict(int)
        self.overruns = 0  # timed calls whose host dispatch outran the spin ahead of them (see HostAhead)

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
            spun = queue_ahead(self._pause_s)  # the call's kernels are queued before its start event: device time
            enqueue = time.perf_counter()
            start.record()
            result = fn(*args, **kwargs)
            end.record()
            host_s = time.perf_counter() - enqueue
            if self.pause > 0:  # the call's length sets the next one's pause (the host waits for it here)
                end.synchronize()
                self._pause_s = pause_seconds(start.elapsed_time(end) / 1e3, host_s, spun, self.pause)
            if HOST_AHEAD.record(host_s, spun):
                self.overruns += 1
            self._events[rank, name].append((start, end))
            if self.keep_calls:
                self._log.append((rank, name, *segment_lengths(name, args, kwargs), is_causal(args, kwargs),
                                  (start, end), host_s, spun))
            return result
        t0 = time.perf_counter()
        result = fn(*args, **kwargs)
        took = time.perf_counter() - t0
        self._seconds[rank, name] += took
        if self.keep_calls:
            self._log.append((rank, name, *segment_lengths(name, args, kwargs), is_causal(args, kwargs), took, took,
                              0.0))
        return result

    def call_log(self) -> list[dict]:
        """Every timed call in order (with ``keep_calls``): rank, phase, segment lengths, causal, seconds, the
        host's seconds to enqueue it and the device's spin ahead of it (0 on the CPU)."""
        if self.cuda and self._log:
            torch.cuda.synchronize()
        return [{"rank": rank, "phase": name, "q_lens": list(ql), "k_lens": list(kl), "causal": causal,
                 "seconds": t if isinstance(t, float) else t[0].elapsed_time(t[1]) / 1e3,
                 "host_seconds": host_s, "spin_seconds": spun}
                for rank, name, ql, kl, causal, t, host_s, spun in self._log]

    def rank_totals(self, ranks: Sequence[int]) -> list[tuple[float, float, int]]:
        """Per rank of ``ranks``: (forward seconds, backward seconds, kernel calls); synchronises the device once."""
        seconds = self.seconds()
        return [(seconds.get((r, "forward"), 0.0), seconds.get((r, "backward"), 0.0),
                 self.calls.get((r, "forward"), 0) + self.calls.get((r, "backward"), 0)) for r in ranks]

    def seconds(self) -> dict[tuple[int, str], float]:
        """Kernel seconds per (rank, ``forward``/``backward``); synchronises the device once."""
        out = defaultdict(float, self._seconds)
        if self._events:
            torch.cuda.synchronize()
            for key, pairs in self._events.items():
                out[key] += sum(s.elapsed_time(e) for s, e in pairs) / 1e3
        return dict(out)
