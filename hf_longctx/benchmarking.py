"""What benchmarks and training logs measure with: timing, FLOPs and MFU, result tables.

Timing: device events around the region, warm-up first, median of repeats. Device work is
asynchronous, so host clocks around a launch measure the launch; CUDA events measure the work.
Warm-up keeps compilation, graph builds and handle creation out of the numbers.

FLOPs and MFU: one formula for the training callback's logs and every benchmark, so the numbers
of a training run and of a benchmark compare: 6 x the matmul parameters per token plus the causal
attention of the visible (query, key) pairs, over the devices' dense bf16 peak.
"""

from __future__ import annotations

import collections
import os
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

# Cycles the device spins at least before a timed region (``torch.cuda._sleep``), ~2 ms at Hopper's clocks: longer than
# the host takes to enqueue one call of torch's flash kernel (measured: bench/results/2026-12-04_from-modules.md).
# :class:`HostAhead` spins longer where the host takes longer.
HOST_AHEAD_CYCLES = 4_000_000


def free_port() -> int:
    """A TCP port no process listens on now, for a benchmark's process group rendezvous. Why: a port derived from
    the process id collides with a port another run (or anything else on the host) already holds, and the
    benchmark then fails to start its group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HostAhead:
    """How long the device spins before a timed region: long enough for the host to enqueue the whole region.

    Why: events around a region time the stream, and a stream that ran dry waits for the host between
    launches, so a small region's events measure Python dispatch as much as kernels. A real step keeps its
    stream full (the host runs layers ahead), so a kernel's cost is its device time; spinning the device first
    (before the start event) measures that, if the spin lasts until the region's last launch. A fixed spin does
    not always: in CAD's W = 64 steps the host's time per kernel call has a long tail, and calls past the spin
    count host time in their events, differently from run to run (measured: bench/results/2026-11-29_cad-fa4.md).

    So the spin follows the host: ``margin`` times the longest host time of the last ``history`` regions
    (:meth:`record`), at least ``minimum_cycles`` and at most ``maximum_s`` seconds. A host time over
    ``outlier`` times the history's median (a first call that compiles, a page fault) does not stretch the
    spin; every region whose host time passed the spin before it is counted in :attr:`overruns` (its time
    holds some host time: the benchmarks report the count). ``adaptive`` False: always ``minimum_cycles``.
    """

    def __init__(self, minimum_cycles: int = HOST_AHEAD_CYCLES, margin: float = 1.5, history: int = 64,
                 maximum_s: float = 0.05, outlier: float = 10.0, adaptive: bool = True) -> None:
        if minimum_cycles < 1 or margin < 1.0 or history < 1 or maximum_s <= 0 or outlier <= 1.0:
            raise ValueError(f"HostAhead needs minimum_cycles >= 1, margin >= 1, history >= 1, maximum_s > 0 and "
                             f"outlier > 1, got {minimum_cycles}, {margin}, {history}, {maximum_s}, {outlier}")
        self.minimum_cycles, self.margin, self.maximum_s, self.outlier = minimum_cycles, margin, maximum_s, outlier
        self.adaptive = adaptive
        self.host_s: collections.deque[float] = collections.deque(maxlen=history)
        self.regions = 0
        self.overruns = 0
        self.longest_spin_s = 0.0
        self._cycles_per_s: dict[int, float] = {}

    def cycles_per_second(self) -> float:
        """The current device's spin rate, measured once per device (events around spins; the fastest of three)."""
        index = torch.cuda.current_device()
        if index not in self._cycles_per_s:
            torch.cuda._sleep(self.minimum_cycles)  # the clock up from idle
            best = float("inf")
            for _ in range(3):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                torch.cuda._sleep(self.minimum_cycles)
                end.record()
                end.synchronize()
                best = min(best, start.elapsed_time(end) / 1e3)
            self._cycles_per_s[index] = self.minimum_cycles / max(best, 1e-9)
        return self._cycles_per_s[index]

    def spin_seconds(self) -> float:
        """The spin the next region gets, in seconds of device time."""
        return self.target_seconds(self.minimum_cycles / self.cycles_per_second())

    def target_seconds(self, least_s: float) -> float:
        """The spin after the recorded host times, given the shortest spin ``least_s`` (see the class)."""
        if not self.adaptive or not self.host_s:
            return least_s
        usual = statistics.median(self.host_s)
        longest = max((t for t in self.host_s if t <= self.outlier * usual), default=usual)
        return min(max(least_s, self.margin * longest), max(self.maximum_s, least_s))

    def spin(self, at_least_s: float = 0.0) -> float:
        """Enqueue the spin on the current stream, ``at_least_s`` seconds or more; its length in seconds (what
        :meth:`record` compares with)."""
        seconds = max(self.spin_seconds(), at_least_s)
        torch.cuda._sleep(max(self.minimum_cycles, int(seconds * self.cycles_per_second())))
        self.longest_spin_s = max(self.longest_spin_s, seconds)
        return seconds

    def record(self, host_s: float, spun_s: float) -> bool:
        """The host took ``host_s`` to enqueue a region that had ``spun_s`` of spin ahead: whether it outran it."""
        self.regions += 1
        self.host_s.append(host_s)
        if host_s > spun_s:
            self.overruns += 1
            return True
        return False


HOST_AHEAD = HostAhead()  # the process's spin: what every timed region here (emulation, profiles) uses


def queue_ahead(at_least_s: float = 0.0) -> float:
    """Keep the current CUDA stream busy while the host enqueues what comes next (see :class:`HostAhead`), for
    ``at_least_s`` seconds or more: the spin's seconds, which the caller hands with the region's host time to
    ``HOST_AHEAD.record``. Costs the spin in device time per region, not counted in it."""
    return HOST_AHEAD.spin(at_least_s)


_L2_SCRATCH: dict[int, torch.Tensor] = {}  # per device index: a buffer twice its L2, written to evict it
L2_FALLBACK_BYTES = 128 << 20  # where torch does not report the L2 size (H100 and H200 have 50 MiB)


def flush_l2() -> None:
    """Evict the current CUDA device's L2 cache: write a buffer twice its size (queued on the current stream).

    Why: a kernel timed again and again over the same buffers finds its inputs, and the output it wrote last
    time, in L2; a training step's call reads inputs the step wrote elsewhere since. Short calls (a CAD server's
    batch of short documents: 0.1-0.3 ms) are priced low by a profile timed warm."""
    index = torch.cuda.current_device()
    scratch = _L2_SCRATCH.get(index)
    if scratch is None:
        size = getattr(torch.cuda.get_device_properties(index), "L2_cache_size", 0) or L2_FALLBACK_BYTES
        scratch = _L2_SCRATCH[index] = torch.empty(2 * size, dtype=torch.uint8, device=torch.device("cuda", index))
    scratch.fill_(1)


def one_run_ms(fn: Callable[[], object], cuda: bool, ahead: bool = False, cold: bool = False) -> float:
    """Milliseconds of one ``fn()``: CUDA events around it (``ahead``: after :func:`queue_ahead`, so they time
    the device's work alone; ``cold``: with the L2 cache evicted first, see :func:`flush_l2`), the host clock on
    the CPU (where ``cold`` does nothing)."""
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        spun = queue_ahead() if ahead else 0.0
        enqueue = time.perf_counter()
        if cold:
            flush_l2()
        start.record()
        fn()
        end.record()
        if ahead:
            HOST_AHEAD.record(time.perf_counter() - enqueue, spun)
        torch.cuda.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def timed(fn: Callable[[], object], reps: int, warmup: int = 1, ahead: bool = False, cold: bool = False) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` runs after ``warmup`` runs (CUDA events; host clock on CPU;
    ``ahead``: device time alone; ``cold``: L2 evicted before each run; see :func:`one_run_ms`)."""
    for _ in range(warmup):
        fn()
    cuda = torch.cuda.is_available()
    return statistics.median(one_run_ms(fn, cuda, ahead, cold) for _ in range(reps))


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
        t = torch.tensor([one_run_ms(fn, device.type == "cuda")], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        times.append(t.item())
    return statistics.median(times)


def host_and_device_ms(phases: Sequence[Callable[[], object]], device: torch.device) -> tuple[list[float], float]:
    """Host milliseconds of each of ``phases`` run in order (until it returns: what the host spends launching it)
    and the milliseconds until the device finished them all.

    Why: a step whose host time is about its total time is host-bound, and kernel or transfer tuning does not
    shorten it; one whose host time is far below its total waits on the device (kernels, transfers, or a
    synchronisation the host made inside it)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    host, last = [], start
    for phase in phases:
        phase()
        now = time.perf_counter()
        host.append((now - last) * 1e3)
        last = now
    if cuda:
        torch.cuda.synchronize(device)
    return host, (time.perf_counter() - start) * 1e3


def write_op_profile(fn: Callable[[], object], device: torch.device, path: str | os.PathLike, rows: int = 25) -> None:
    """Profile one ``fn()`` with ``torch.profiler`` and write its op tables to ``path``: the ops ranked by host
    time and by device time (and where they were called from), to find what a step spends outside its
    kernels."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=False, with_stack=True) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    events = prof.key_averages()
    device_key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    stacks = prof.key_averages(group_by_stack_n=4)
    text = ["# ops by host time (self)", events.table(sort_by="self_cpu_time_total", row_limit=rows),
            "# ops by device time (self)", events.table(sort_by=device_key, row_limit=rows),
            "# call sites by host time (self, 4 frames)",
            stacks.table(sort_by="self_cpu_time_total", row_limit=rows)]
    if device.type == "cuda":
        text += ["# device timeline: kernels of 0.1 ms or more (start ms, duration ms, stream, name)",
                 *device_timeline(prof)]
    Path(path).write_text("\n".join(text))


def device_timeline(prof, min_ms: float = 0.1) -> list[str]:
    """The profiled device kernels of ``min_ms`` or more, in start order: when each ran, on which stream (a
    communication kernel waiting for its peers shows as a long one beside the compute stream's)."""
    kernels = [e for e in prof.profiler.kineto_results.events()
               if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() >= min_ms * 1e6]
    if not kernels:
        return []
    origin = min(e.start_ns() for e in kernels)
    return [f"{(e.start_ns() - origin) / 1e6:9.2f} {e.duration_ns() / 1e6:8.2f}  s{e.device_resource_id():<3} "
            f"{e.name()[:90]}" for e in sorted(kernels, key=lambda e: e.start_ns())]


def first_call_seconds(fn: Callable[[], object]) -> float:
    """Wall seconds of one call including everything it builds or compiles on first use."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


# Attention's backward does 2.5 times the matmul work of its forward (dQ, dK, dV, and P again).
FORWARD_BACKWARD_FACTOR = 3.5


def attention_tflops(forward_flops: float, forward_ms: float, forward_backward_ms: float) -> tuple[float, float]:
    """TFLOP/s of a forward and of a forward+backward, from the forward's FLOPs and the two times in ms."""
    return forward_flops / forward_ms / 1e9, FORWARD_BACKWARD_FACTOR * forward_flops / forward_backward_ms / 1e9


def causal_attention_flops(doc_lens: list[int], heads: int, head_dim: int) -> float:
    """Forward FLOPs of causal attention per document, 2 * L^2 * H * D (QK^T and PV, half the square)."""
    return 2.0 * sum(n * n for n in doc_lens) * heads * head_dim


def model_flops_per_token(model) -> float:
    """6 x the parameters that do matmul work per token (forward + backward).

    The input embedding is a table lookup, not a matmul: it is left out unless it is tied to the
    output projection (then the projection's matmul counts it once). Counting it would overstate MFU
    by a quarter for a 4-layer model with a 128K vocabulary. Count before ZeRO-3 or FSDP partition
    the parameters away.
    """
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    skip = set()
    if embedding is not None and (output is None or output.weight is not embedding.weight):
        skip = {id(p) for p in embedding.parameters()}
    return 6.0 * sum(p.numel() for p in model.parameters() if id(p) not in skip)


def attention_flops(model_config, causal_pairs: int) -> float:
    """Forward + backward core-attention FLOPs of a model: 4 D H per visible pair per layer forward, x3.5."""
    cfg = model_config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return FORWARD_BACKWARD_FACTOR * 4 * head_dim * cfg.num_attention_heads * cfg.num_hidden_layers * causal_pairs


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of the accelerator, for MFU; None where unknown (CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in (("H200", 989e12), ("H100", 989e12), ("A100", 312e12)):
        if key in name:
            return value
    return None


def training_mfu(model_config, flops_per_token: float, tokens: int, causal_pairs: int, seconds: float,
                 devices: int, peak: float | None) -> float | None:
    """Model FLOPs utilization of ``tokens`` trained in ``seconds`` on ``devices`` (None without a known peak).

    FLOPs: ``tokens x flops_per_token`` (:func:`model_flops_per_token`) plus the attention of
    ``causal_pairs`` visible (query, key) pairs (:func:`attention_flops`).
    """
    if not peak:
        return None
    flops = tokens * flops_per_token + attention_flops(model_config, causal_pairs)
    return flops / max(seconds, 1e-9) / (devices * peak)


def host_peak_gib() -> float | None:
    """This process's resident high-water mark (``VmHWM``: pinned buffers included), GiB; None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def token_counts(text: str) -> list[int]:
    """``"128,2k,512K"`` -> ``[128, 2048, 524288]``: the benchmarks' sizes as written on their command lines."""
    out = []
    for x in text.split(","):
        x = x.strip().lower()
        out.append(int(x[:-1]) * 1024 if x.endswith("k") else int(x))
    return out


def table_header(columns: Sequence[str]) -> str:
    """A markdown table's header and rule line."""
    return "| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|"


def table_row(cells: Sequence[object]) -> str:
    """A markdown table row; None prints as ``-``."""
    return "| " + " | ".join("-" if c is None else str(c) for c in cells) + " |"


def portable_command(script: str, argv: Sequence[str], root: str | os.PathLike = ".") -> str:
    """``python <script> <argv>`` as a reader elsewhere can re-run it, for a result file to record.

    Absolute paths inside ``root`` (the repository) become relative to it; other absolute paths (a
    temporary folder of the machine that ran it) become their file names, which the result file
    then says how to produce.
    """
    base = Path(root).resolve()

    def portable(arg: str) -> str:
        option, eq, value = arg.rpartition("=") if arg.startswith("--") and "=" in arg else ("", "", arg)
        if os.path.isabs(value):
            path = Path(value).resolve()
            value = str(path.relative_to(base)) if path.is_relative_to(base) else path.name
        return option + eq + value

    return " ".join(["python", script, *(portable(a) for a in argv)])
