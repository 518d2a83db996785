"""One sequence-parallel step of W ranks emulated on one device, every rank's kernel time measured.

Why: whether the work of W ranks is balanced in kernel time (and what a schedule costs in bytes) needs
the W ranks' kernel calls, not W devices. :func:`emulate_step` runs every rank's share of one
forward+backward, as one thread per rank over an :class:`~hf_longctx.lab.emulation.group.EmulatedGroup`:
the same plan, checks, schedule, kernels and merges as a real run, with transfers replaced by local
copies. Each rank's kernel calls are timed (:class:`~.timing.KernelTimer`) and its bytes counted per call and
peer, and a communication model (:mod:`hf_longctx.comm.links`) predicts the step time of a real group: inside one
NVLink node by default, or over nodes (:class:`~hf_longctx.comm.links.LinkTiers`), where the bytes a rank sends
to another node cross the network.

A rank's forward and backward are the backend's ``forward``/``backward`` called as the core-attention
op calls them (not through autograd: on a GPU, autograd runs every rank's backward on one device
thread, where ranks waiting for each other would deadlock).

Repetitions. A single measurement lets first-call costs through (an allocator growing, a graph built
for a new shape: host work that leaves the device idle between a call's events), so a configuration
runs ``warmup`` untimed steps and then ``reps`` timed ones, and each rank's kernel time is the lower
median over the timed steps of its forward+backward seconds: the middle one of an odd count, the
smaller of two, so that one outlier among two repetitions is dropped rather than averaged in.

Timing noise. Even a perfectly balanced step measures above max/mean 1.0: each rank's time carries
noise, and the maximum of W noisy times grows with W. :attr:`EmulatedStep.timing_noise` estimates a
repetition's relative noise from how each rank's repetitions differ, and
:attr:`EmulatedStep.noise_floor` the max/mean that noise alone would give W identical ranks under the
same lower-median rule: the part of a measured imbalance no schedule can remove.

Memory. Nothing of a step outlives :func:`emulate_step` but what it returns (per-rank seconds,
traffic, and the results when kept): the plan with its cached schedules and device index tensors, the
ranks' tensors and the hub are freed when it returns or raises. :func:`release_memory` returns the
allocator's cached blocks to the device between configurations.
"""

from __future__ import annotations

import gc
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hf_longctx.backends import default_strategy
from hf_longctx.backends.api import (
    AttentionRequest,
    check_group_agrees,
    check_options,
    make_run_context,
    resolve_backend,
)
from hf_longctx.backends.options import BackendOptions
from hf_longctx.benchmarking import FORWARD_BACKWARD_FACTOR, host_peak_gib
from hf_longctx.comm.links import LINKS, ONE_NODE, LinkTiers, Transfer
from hf_longctx.kernels import observe_kernels
from hf_longctx.lab.emulation.group import EmulatedGroup, EmulationHub
from hf_longctx.lab.emulation.timing import KernelTimer, ThisProcess
from hf_longctx.layout import PackedBatch, ShardPlan, shard_plan

HALF_NORMAL_MEDIAN = 0.6744897501960817  # median of |x| for x standard normal (its 75th percentile)


@dataclass
class RankStep:
    """One emulated rank: kernel seconds (the lower median over the timed repetitions, see the module
    docstring), calls, bytes sent per call and peer (``traffic``: ranks of the emulated world), and the links
    they are priced on (``tiers``; None: one NVLink node)."""

    rank: int
    forward_s: float
    backward_s: float
    kernel_calls: int
    traffic: list[Transfer]
    results: tuple[torch.Tensor, ...] | None = None  # (out, dq, dk, dv) of the local rows, when kept
    repetitions: tuple[float, ...] = ()  # forward+backward seconds of every timed repetition, in order
    tiers: LinkTiers | None = None

    @property
    def kernel_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def sent_bytes(self) -> int:
        return sum(sum(bytes_to.values()) for _, bytes_to in self.traffic)

    @property
    def node_bytes(self) -> tuple[int, int]:
        """(bytes sent to ranks of this rank's node, bytes sent to other nodes); all in one node without tiers."""
        splits = [(self.tiers or ONE_NODE).split(self.rank, bytes_to) for _, bytes_to in self.traffic]
        return sum(a for a, _ in splits), sum(b for _, b in splits)

    @property
    def transfer_s(self) -> float:
        """Seconds this rank's sends take back to back: on the measured NVLink curves
        (:data:`~hf_longctx.comm.links.LINKS`, every peer in one node) without tiers, else on the tiers (each call
        as long as the slower of its intra-node and inter-node bytes)."""
        return (self.tiers or ONE_NODE).seconds(self.rank, self.traffic)


@dataclass
class EmulatedStep:
    """Every rank of one emulated step, and what it predicts for a real group of ``world`` devices."""

    backend: str
    world: int
    strategy: str
    flops: float  # forward+backward attention FLOPs of the whole batch
    device: str
    ranks: list[RankStep] = field(default_factory=list)
    largest_all_to_all: int = 0  # bytes one all_to_all moved between ranks, at most (what staging holds at once)
    largest_all_to_all_on_device: int = 0  # bytes one all_to_all's buffers held on the device, at most (0: staged)
    host_overruns: int = 0  # timed kernel calls whose host dispatch outran the device's spin (their time holds some)
    timed_calls: int = 0  # kernel calls timed over every timed repetition
    tiers: LinkTiers | None = None  # the links the transfers are priced on (None: one NVLink node)

    @property
    def kernel_s(self) -> list[float]:
        return [r.kernel_s for r in self.ranks]

    @property
    def imbalance(self) -> float:
        """max / mean of the ranks' kernel seconds (1.0: perfectly balanced)."""
        mean = statistics.fmean(self.kernel_s)
        return max(self.kernel_s) / mean if mean > 0 else 1.0

    @property
    def sent_bytes(self) -> list[int]:
        return [r.sent_bytes for r in self.ranks]

    @property
    def intra_node_bytes(self) -> list[int]:
        """Per rank, the bytes it sent to ranks of its own node (all it sent, without tiers)."""
        return [r.node_bytes[0] for r in self.ranks]

    @property
    def inter_node_bytes(self) -> list[int]:
        """Per rank, the bytes it sent to ranks of other nodes (none without tiers)."""
        return [r.node_bytes[1] for r in self.ranks]

    @property
    def timing_noise(self) -> float | None:
        """Relative noise of one repetition of a rank's kernel time (None with fewer than two repetitions).

        From the differences between a rank's repetitions, relative to the rank's mean, over every pair of
        repetitions of every rank: a difference of two repetitions of normal noise ``s`` is normal with twice the
        variance, whose absolute value has the median ``0.6745 * sqrt(2) * s``; the median of them is taken, not
        their mean square. Why: a rank's time is the lower median of its repetitions, which one outlying
        repetition does not move, and the noise must be read the same way. With their mean square, one rank's repetition
        whose backward call compiled a kernel variant inside it made a W = 64 step read tens of percent of noise
        where the median reads a fraction of one (measured: bench/results/2026-11-29_cad-fa4.md).
        """
        diffs = []
        for r in self.ranks:
            reps = r.repetitions
            mean = statistics.fmean(reps) if reps else 0.0
            if len(reps) < 2 or mean <= 0:
                continue
            diffs += [abs(a - b) / mean for i, a in enumerate(reps) for b in reps[i + 1:]]
        return statistics.median(diffs) / (HALF_NORMAL_MEDIAN * math.sqrt(2)) if diffs else None

    @property
    def noise_floor(self) -> float | None:
        """max/mean that :attr:`timing_noise` alone gives ``world`` identical ranks timed like these ones."""
        noise = self.timing_noise
        reps = min((len(r.repetitions) for r in self.ranks), default=0)
        return None if noise is None else noise_only_imbalance(noise, self.world, reps)

    @property
    def predicted_step_s(self) -> float:
        """Slowest rank's kernels plus the slowest rank's transfers (no overlap: an upper bound), the transfers
        priced on :attr:`tiers` (:attr:`RankStep.transfer_s`)."""
        return max(self.kernel_s) + max(r.transfer_s for r in self.ranks)

    @property
    def predicted_overlapped_s(self) -> float:
        """The slowest rank if its transfers hid perfectly behind its kernels (a lower bound)."""
        return max(max(r.kernel_s, r.transfer_s) for r in self.ranks)

    @property
    def tflops_per_device(self) -> float:
        """Predicted per-device TFLOP/s of a real group: FLOPs / world / :attr:`predicted_step_s`."""
        t = self.predicted_step_s
        return self.flops / self.world / t / 1e12 if t > 0 else math.nan


def step_flops(batch: PackedBatch, heads: int, head_dim: int) -> float:
    """Forward+backward FLOPs of causal attention over ``batch`` (4 * D * H per visible pair, x3.5)."""
    return FORWARD_BACKWARD_FACTOR * 4.0 * head_dim * heads * batch.causal_pairs()


def _rank_step(group: EmulatedGroup, plan: ShardPlan, backend: str, tensors, options, kernel: str, keep: bool):
    rank, world = group.rank, group.world
    q, k, v, dout = tensors
    if q.device.type == "cuda":
        torch.cuda.set_device(q.device)  # the device is per thread
    idx = plan.local_indices(rank).to(q.device)
    ql, kl, vl, dl = (t.index_select(0, idx) for t in (q, k, v, dout))
    scale = 1.0 / math.sqrt(q.shape[-1])
    with torch.no_grad():
        request = AttentionRequest(ql, kl, vl, plan, backend, group, rank, world, causal=True, scale=scale,
                                   kernel=kernel, options=options)
        check_group_agrees(request)
        run = make_run_context(request, resolve_backend(request))
        out, lse = run.forward_fn(run, ql, kl, vl)
        dq, dk, dv = run.backward_fn(run, dl, ql, kl, vl, out, lse)
    return (out, dq, dk, dv) if keep else None


def noise_only_imbalance(noise: float, world: int, reps: int, draws: int = 4000, seed: int = 0) -> float:
    """Expected max/mean of ``world`` ranks of equal work whose every repetition's time is off by normal noise
    of relative size ``noise``, each rank's time being the lower median of ``reps`` repetitions (as measured
    here). Monte Carlo with a fixed seed, so equal arguments give equal answers."""
    if noise < 0 or world < 1 or reps < 1:
        raise ValueError(f"need noise >= 0, world >= 1 and reps >= 1, got {noise}, {world}, {reps}")
    g = torch.Generator().manual_seed(seed)
    times = 1.0 + noise * torch.randn(draws, world, reps, generator=g, dtype=torch.float64)
    chosen = times.sort(dim=2).values[:, :, (reps - 1) // 2]
    return float((chosen.max(dim=1).values / chosen.mean(dim=1)).mean())


def median_rep(samples: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """The (forward, backward) seconds of the repetition whose sum is the lower median (ties: the earlier)."""
    if not samples:
        return 0.0, 0.0
    order = sorted(range(len(samples)), key=lambda i: (samples[i][0] + samples[i][1], i))
    return samples[order[(len(samples) - 1) // 2]]


def emulate_step(batch: PackedBatch, world: int, tensors: tuple[torch.Tensor, ...], backend: str, *,
                 strategy: str | None = None, options: BackendOptions | dict | None = None, kernel: str = "auto",
                 warmup: int = 0, reps: int = 1, keep_results: bool = False, timeout_s: float = 600.0,
                 stage_on_host: bool = False,
                 make_timer: Callable[[EmulationHub, torch.device], KernelTimer] = KernelTimer,
                 tiers: LinkTiers | None = None) -> EmulatedStep:
    """Run ``world`` ranks of ``backend`` on ``batch`` (forward + backward) on the device of ``tensors``.

    ``tensors`` are the GLOBAL packed ``(q, k, v, dout)``; every rank takes its rows from them as a real
    rank would. ``warmup`` untimed steps come first (kernels compile, plans fill their caches), then
    ``reps`` timed ones; each rank's kernel seconds are those of the repetition whose forward+backward is
    the lower median over them (:func:`median_rep`). ``keep_results`` keeps every rank's ``(out, dq, dk, dv)``
    of the last step (in ``RankStep.results``, local row order). Traffic and kernel calls are those of the
    last step. ``make_timer(hub, device)`` builds each step's kernel timer (:class:`~.timing.KernelTimer`).
    ``stage_on_host``: all_to_all buffers live on the host (see :class:`~hf_longctx.lab.emulation.group.EmulationHub`),
    for steps whose W ranks' buffers do not fit on the one device together. ``tiers``: the links the ranks'
    transfers are priced on (:attr:`EmulatedStep.predicted_step_s`): ranks ``r // tiers.node_size`` share a node;
    None prices them as one NVLink node, whatever ``world``.
    """
    if reps < 1 or warmup < 0:
        raise ValueError(f"need reps >= 1 and warmup >= 0, got reps={reps}, warmup={warmup}")
    options = check_options(backend, options)  # parsed once: every rank's every step gets the same object
    q = tensors[0]
    strategy = strategy or default_strategy(backend)
    plan = shard_plan(batch, world, strategy)
    per_rank: list[list[tuple[float, float]]] = [[] for _ in range(world)]
    calls = [0] * world
    results: list = [None] * world
    traffic: list[list[Transfer]] = [[] for _ in range(world)]
    largest, on_device, overruns, timed_calls = 0, 0, 0, 0
    for i in range(warmup + reps):
        hub = EmulationHub(world, timeout_s, stage_on_host)
        timer = make_timer(hub, q.device)
        last = i == warmup + reps - 1
        with observe_kernels(timer):
            results = hub.run(lambda g, keep=keep_results and last: _rank_step(g, plan, backend, tensors, options,
                                                                               kernel, keep))
        if i < warmup:
            continue
        largest = max(largest, hub.largest_all_to_all)
        on_device = max(on_device, hub.largest_all_to_all_on_device)
        overruns += timer.overruns
        timed_calls += sum(timer.calls.values())
        for r, (forward_s, backward_s, rank_calls) in enumerate(timer.rank_totals(range(world))):
            per_rank[r].append((forward_s, backward_s))
            calls[r] = rank_calls
            traffic[r] = list(hub.traffic[r].calls)
    step = EmulatedStep(backend, world, strategy, step_flops(batch, q.shape[1], q.shape[2]), str(q.device),
                        largest_all_to_all=largest, largest_all_to_all_on_device=on_device,
                        host_overruns=overruns, timed_calls=timed_calls, tiers=tiers)
    for r in range(world):
        forward_s, backward_s = median_rep(per_rank[r])
        step.ranks.append(RankStep(r, forward_s, backward_s, calls[r], traffic[r], results[r],
                                   tuple(f + b for f, b in per_rank[r]), tiers))
    return step


def emulate_step_or_stage(batch: PackedBatch, world: int, tensors: tuple[torch.Tensor, ...], backend: str,
                          **kwargs) -> tuple[EmulatedStep, bool]:
    """:func:`emulate_step` (``kwargs`` as it takes them), and whether the step's all_to_all buffers were staged on
    the host: a step whose W ranks' buffers do not fit on the device together runs again with them on the host (its
    kernels run and are timed alike; only the emulated transfers go through host memory), so one large step still
    measures. With ``stage_on_host`` they are staged from the start. A ``make_timer`` that keeps its timers sees
    the failed attempt's too: a step's timed ones are the last ``reps``."""
    if kwargs.get("stage_on_host"):
        return emulate_step(batch, world, tensors, backend, **kwargs), True
    try:
        return emulate_step(batch, world, tensors, backend, **kwargs), False
    except torch.cuda.OutOfMemoryError:
        pass  # out of the handler first: its traceback holds the failed attempt's buffers
    release_memory(tensors[0].device)
    return emulate_step(batch, world, tensors, backend, **{**kwargs, "stage_on_host": True}), True


def real_rank_kernel_times(step: Callable[[], object], device: torch.device, reps: int = 3,
                           group: dist.ProcessGroup | None = None) -> list[tuple[float, float, int]]:
    """Every rank's (forward seconds, backward seconds, kernel calls) of ``step`` in a real run, one process per
    device, gathered on every rank: what :func:`emulate_step` measures per emulated rank, taken where the ranks
    really run. Each kernel call is timed as the emulation times it (:class:`~.timing.KernelTimer`: device
    events, the stream queued ahead), and a rank's seconds are the lower-median repetition of ``reps``
    (:func:`median_rep`), so an emulated max/mean and a real one compare.

    ``step`` runs one forward+backward of this rank; it is called ``reps`` times (collectives and all)."""
    if reps < 1:
        raise ValueError(f"need reps >= 1, got {reps}")
    rank = dist.get_rank(group)
    samples, calls = [], 0
    for _ in range(reps):
        timer = KernelTimer(ThisProcess(rank), device)
        with observe_kernels(timer):
            step()
        forward_s, backward_s, calls = timer.rank_totals([rank])[0]
        samples.append((forward_s, backward_s))
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (*median_rep(samples), calls), group=group)
    return [tuple(x) for x in gathered]


def release_memory(device: torch.device | str | None = None) -> None:
    """Free what finished configurations left: collect garbage (objects only a cycle keeps, e.g. an exception
    caught with its traceback's frames), then return the CUDA allocator's cached blocks to the device."""
    gc.collect()
    if (device is None or torch.device(device).type == "cuda") and torch.cuda.is_available():
        torch.cuda.empty_cache()


def host_peak_memory() -> str:
    """This process's peak resident host memory so far (with staged collectives, most of it is theirs)."""
    gib = host_peak_gib()
    return "host peak resident unknown" if gib is None else f"host peak resident {gib:.1f} GiB"


def device_memory(device: torch.device) -> str:
    """One line on ``device``'s memory: allocated and reserved by torch's allocator, and free on the device
    (memory taken outside the allocator, e.g. by libraries' own caches, shows as free shrinking alone)."""
    if device.type != "cuda":
        return "CPU (no device memory)"
    free, total = torch.cuda.mem_get_info(device)
    gib = float(1 << 30)
    return (f"allocated {torch.cuda.memory_allocated(device) / gib:.2f} GiB, reserved "
            f"{torch.cuda.memory_reserved(device) / gib:.2f} GiB, free {free / gib:.2f} of {total / gib:.2f} GiB")


def link_sources(tiers: LinkTiers | None = None) -> list[str]:
    """Where the bandwidths of the communication model come from, one line per collective kind, and with
    ``tiers`` a line on the nodes and the network between them."""
    lines = [f"{kind}: {curve.source}" for kind, curve in LINKS.items()]
    return lines + ([f"between nodes: {tiers.describe()} (a formula, not measured here)"] if tiers else [])
