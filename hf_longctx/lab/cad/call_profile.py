"""Fit a :class:`~.launch_cost.LaunchCostModel` on the device: time random kernel calls as CAD servers make them.

Why calls and not a grid: what a short segment costs depends on its call (the launch grid is sized by the
call's longest segment, the last blocks run alone), and the per-token and per-block terms are only told apart
from the tile steps by calls that mix them differently. So the profile times whole calls of the kinds a server's
batch is cut into: a dozen short documents; a few shards over their causal prefixes; one long shard beside short
documents; one large segment. Each call's forward and backward are timed apart (the device's events, the stream
queued ahead, as the emulation times a server's calls), the median of ``reps`` after ``warmup``.

Two further kinds were tried and dropped: a few tiny documents and few rows over long keys. With them the held-out error
rose and ProLong servers, whose time is one long document's tile steps, were priced further off
(bench/results/2026-12-04_from-modules.md). Where the kernel's forward runs few rows over long keys as chunks of them
(:mod:`~hf_longctx.kernels.key_split`), their time is no longer where the GPU puts a few long blocks, and
:func:`split_forward_calls` adds a fixed set of them.

Random calls span the kernel's shapes but do not weigh them as CAD's servers do; so, fitted on them, the profile
then schedules CAD on that fit over a few batches of the benchmarks' mixes and times the servers' own calls
(:func:`cad_server_calls`), and fits again on all. Last, it emulates a few such steps and times their calls where
they run, one device running every server's calls (:mod:`hf_longctx.lab.emulation.step_calls`): alone, a call runs back
to back over its own buffers, and its time in a step differs by its size. It fits again on all, a step's call
weighing :data:`STEP_CALL_WEIGHT` calls timed alone.

The fit is checked before it is kept: the terms are fitted on three calls in four and priced on the fourth
(:func:`profile_launch_cost`'s metadata holds that held-out error), then fitted on all.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np
import torch

from hf_longctx.backends.cad.cost_model import PAIRS
from hf_longctx.backends.cad.launch_cost import (
    PHASES,
    TERM_NAMES,
    LaunchCostModel,
    PhaseTerms,
    call_features,
    call_waves,
    fit_phase_terms,
)
from hf_longctx.benchmarking import HOST_AHEAD, one_run_ms
from hf_longctx.kernels import attention_backward, attention_forward
from hf_longctx.kernels.calls import call_order, cut_into_calls
from hf_longctx.kernels.key_split import KeySplit
from hf_longctx.kernels.launch import LaunchGrid
from hf_longctx.lab.emulation.step_calls import dumped_calls

__all__ = ["CALL_KINDS", "CALL_SET", "SERVER_CALLS", "SERVER_CALL_BATCHES", "STEP_CALL_BATCHES", "STEP_CALL_SEEDS",
           "STEP_CALL_WEIGHT", "SWEEPS", "WAVE_BINS", "cad_server_calls", "check_call_mix", "check_keys_limit",
           "check_launch_cost", "dumped_calls", "errors_by_waves", "few_rows_long_keys_calls", "fit_timed_calls",
           "keys_limit_calls", "mix_pairs", "phase_spreads", "placement_probes", "profile_launch_cost", "random_calls",
           "replay_dumped_calls", "segment_batch", "server_phase_errors", "short_document_calls", "split_forward_calls",
           "sweep_shapes", "time_call_phases", "time_placement"]

# sizes of call (waves of launched blocks, see :func:`~.launch_cost.call_waves`) that :func:`errors_by_waves` groups
WAVE_BINS = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 64.0, math.inf)
CALL_KINDS = ("short documents", "shards", "long shard beside short documents", "one large segment")
SWEEPS = ("prefix", "waves", "square")  # the lines of :func:`sweep_shapes`
# Which calls :func:`profile_launch_cost` times, by version: a cached model fitted on another set is fitted again
# (3: random calls, the keys limit's, split forwards' and short-document batches; 4: and CAD's own server calls; 5: and
# those calls timed inside emulated CAD steps; 6: and those steps at W = 8 and 32 too)
CALL_SET = 6
MAX_CALL_PAIRS = float(1 << 30)  # visible pairs of one timed call (a fraction of a second of an 8B layer's fwd+bwd)


def _log_uniform(rng: random.Random, low: float, high: float) -> int:
    return int(round(2 ** rng.uniform(math.log2(low), math.log2(max(low, high)))))


def _one_call(rng: random.Random, kind: str) -> list[tuple[int, int]]:
    if kind == "short documents":
        return [(n, n) for n in (_log_uniform(rng, 16, 4096) for _ in range(rng.randint(1, 40)))]
    if kind == "shards":
        out = []
        for _ in range(rng.randint(1, 6)):
            q = _log_uniform(rng, 64, 16384)
            out.append((q, q if rng.random() < 1 / 3 else _log_uniform(rng, q, 131072)))
        return out
    if kind == "long shard beside short documents":
        q = _log_uniform(rng, 1024, 16384)
        return [(q, _log_uniform(rng, q, 131072))] + [(n, n) for n in (_log_uniform(rng, 16, 2048)
                                                                       for _ in range(rng.randint(1, 20)))]
    q = _log_uniform(rng, 4096, 32768)
    return [(q, _log_uniform(rng, q, 262144))]


def random_calls(count: int, seed: int = 0, max_pairs: float = MAX_CALL_PAIRS, scale: float = 1.0
                 ) -> list[list[tuple[int, int]]]:
    """``count`` calls, the kinds of :data:`CALL_KINDS` in turn, each a list of (q_len, kv_len) segments in launch
    order (:func:`~hf_longctx.kernels.calls.call_order`), drawn again while over ``max_pairs`` visible pairs.
    ``scale`` shrinks every length (a CPU run prices small shapes)."""
    rng = random.Random(seed)
    calls = []
    for i in range(count):
        while True:
            kind = CALL_KINDS[i % len(CALL_KINDS)]
            shapes = [(max(1, int(q * scale)), max(1, int(k * scale))) for q, k in _one_call(rng, kind)]
            if sum(PAIRS.cost(q, k) for q, k in shapes) <= max_pairs:
                break
        order = call_order([q for q, _ in shapes], [k for _, k in shapes])
        calls.append([shapes[j] for j in order])
    return calls


def few_rows_long_keys_calls(grid: LaunchGrid, count: int = 24, seed: int = 0, scale: float = 1.0
                             ) -> list[list[tuple[int, int]]]:
    """Calls of one to three segments of few rows (64-1024) over long causal prefixes (16K-128K keys), for a kernel
    that launches in segment order (none for the ``tile`` order, where this kind raised torch_flash's held-out
    error; see the module). Why: CAD's servers at 64 ranks of ProLong run a long document's last rows as such
    calls, and FlashAttention-4's backward of them, whose key blocks all add into the same few query rows, was
    priced low by a model fitted without them, the forward high (bench/results/2026-12-04_from-modules.md)."""
    if grid.launch_order != "segment":
        return []
    rng = random.Random(seed + 1)
    calls = []
    for _ in range(count):
        shapes = []
        for _ in range(rng.randint(1, 3)):
            q = _log_uniform(rng, 64, 1024)
            shapes.append((max(1, int(q * scale)), max(1, int(_log_uniform(rng, 16384, 131072) * scale))))
        order = call_order([q for q, _ in shapes], [k for _, k in shapes])
        calls.append([shapes[j] for j in order])
    return calls


def keys_limit_calls(grid: LaunchGrid, scale: float = 1.0) -> list[list[tuple[int, int]]]:
    """Single segments of a few rows over keys below and past the kernel's backward keys limit (none without one):
    what a server still runs past the limit is one long segment (its calls are cut under the limit otherwise),
    and random calls hold few of those, so the fit sees the spill's price on them. ``scale`` shrinks the rows (the
    limit is the grid's own)."""
    limit = grid.backward_keys_limit
    if limit is None:
        return []
    return [[(max(1, int(q * scale)), int(limit * f))] for q in (256, 1024) for f in (0.75, 1.25, 1.75)]


def split_forward_calls(grid: LaunchGrid, scale: float = 1.0) -> list[list[tuple[int, int]]]:
    """Calls of few rows over long keys (none unless the grid's forward runs them as chunks of their keys): a key
    cut's rows, a long document's last rows on a server, several of them together. Random calls hold few of these,
    which are most of a CAD server's forward at 64 ranks (whole, such calls were priced off and left out, see
    the module). ``scale`` shrinks every length."""
    if grid.forward_key_split is None:
        return []
    shapes = [[(q, k)] for q in (128, 512, 2048) for k in (36000, 65536, 131072)]
    shapes += [[(q, k)] for q, k in ((256, 34000), (320, 49000), (384, 42000), (192, 56000), (640, 40000))]
    shapes += [[(506, 107000), (506, 95000), (320, 84000)], [(1088, 91000)], [(128, 112000), (128, 90000)],
               [(3904, 44000)], [(634, 90000), (128, 71000)], [(2572, 60871), (1172, 3584)],
               [(256, 36000), (128, 30000)], [(128, 36000), (102, 102)], [(448, 38000), (256, 20000), (64, 9000)],
               [(256, 20000)], [(128, 24000), (192, 18000)], [(512, 28000)], [(320, 17500), (1536, 9000)]]
    return [[(max(1, int(q * scale)), max(1, int(k * scale))) for q, k in call] for call in shapes]


def short_document_calls(count: int = 32, seed: int = 0, scale: float = 1.0) -> list[list[tuple[int, int]]]:
    """``count`` calls of short documents only, as a CAD server batches an SFT-like mix: 2-16 segments of lengths
    drawn lognormal (median about 400 rows, 32 to 4096), one in five a document's last rows over its prefix, in
    launch order. ``scale`` shrinks every length.

    Why: random calls draw short documents log-uniform up to 4K rows beside longer ones, so few of them hold only
    documents of a few hundred rows, whose blocks sweep a few key tiles each. Fitted without such calls, the
    forward of SFT servers at W = 64 (torch's flash kernel) ran over its price, more on the servers whose calls
    held the shortest documents (bench/results/2026-12-04_from-modules.md)."""
    rng = random.Random(seed + 7919)
    calls = []
    for _ in range(count):
        shapes = []
        for _ in range(rng.randint(2, 16)):
            n = int(min(4096, max(32, rng.lognormvariate(6.0, 0.9))))
            shapes.append((rng.randint(16, n - 1), n) if rng.random() < 0.2 else (n, n))
        shapes = [(max(1, int(q * scale)), max(1, int(k * scale))) for q, k in shapes]
        order = call_order([q for q, _ in shapes], [k for _, k in shapes])
        calls.append([shapes[j] for j in order])
    return calls


# batches whose CAD schedules :func:`cad_server_calls` takes calls from: (length mix, tokens, servers), the mixes of
# :mod:`hf_longctx.lab.emulation.workloads` at the world sizes where a server's calls are smallest and most varied
SERVER_CALL_BATCHES = (("prolong", 131072, 64), ("pretrain", 524288, 64), ("sft", 524288, 64),
                       ("prolong", 262144, 16), ("pretrain", 524288, 16), ("sft", 262144, 16))
SERVER_CALL_SEED = 1000  # the batches' seeds start here, away from the benchmarks' (0, 1, 2, ...)
# each batch drawn this many times (other seeds): more calls of more steps price CAD's servers closer (checked on
# FlashAttention-4 by fitting the profile with more calls of other W = 64 steps and pricing held-out steps;
# bench/results/2026-12-04_from-modules.md)
SERVER_CALL_ROUNDS = 2
SERVER_CALL_REPS = 3  # timed runs of each server call (their median): they are many, and as steady as the rest
SERVER_CALLS = 960  # server calls the profile times at most (two rounds of the batches hold a little fewer)
# CAD steps the profile emulates after its fits, one per batch of STEP_CALL_BATCHES and seed, their calls timed
# where they run (:mod:`hf_longctx.lab.emulation.step_calls`); the seeds are away from the benchmarks' and the server
# calls'. Checked on FlashAttention-4 on the CPU, pricing each dumped W = 64 step by a fit without its batch: the
# per-server error falls with more other steps (bench/results/2026-12-04_from-modules.md)
STEP_CALL_SEEDS = (2000, 2001)
# the batches of those steps: SERVER_CALL_BATCHES, and each mix at W = 32 and 8, whose servers' calls are larger
# and of other shapes than W = 16's and 64's. The same check on held-out steps at W = 8-32 (each seed priced by a fit
# with the others' W = 8 and 32 steps added) lowered the per-server error at every W
# (bench/results/2026-12-04_from-modules.md)
STEP_CALL_BATCHES = SERVER_CALL_BATCHES + (("prolong", 131072, 32), ("pretrain", 524288, 32), ("sft", 524288, 32),
                                           ("prolong", 131072, 8), ("pretrain", 524288, 8), ("sft", 524288, 8))
# what one call timed in a step weighs in the fit against one timed alone: the steps' calls are what is priced, the
# random calls span shapes the steps do not hold. The same check priced best at weight 3 of 1, 3 and 10
# (bench/results/2026-12-04_from-modules.md)
STEP_CALL_WEIGHT = 3.0
STEP_CALL_REPS = 2  # timed repetitions of each step (a warm-up first): a call's time is its median over them


def cad_server_calls(model: LaunchCostModel, count: int, seed: int = 0, scale: float = 1.0,
                     batches: Sequence[tuple[str, int, int]] = SERVER_CALL_BATCHES,
                     max_pairs: float = MAX_CALL_PAIRS, rounds: int = SERVER_CALL_ROUNDS
                     ) -> list[list[tuple[int, int]]]:
    """``count`` causal calls drawn from what CAD's servers run (:func:`~.runtime.server_calls`) when ``model``
    schedules ``batches`` (eps 0.01; each ``rounds`` times, of other documents), in launch order, none over
    ``max_pairs`` visible pairs. ``scale`` shrinks every batch (to no fewer than 64 tokens a server).

    Why: random calls are drawn to span the kernel's shapes, not to weigh them as CAD's servers do, and a
    server's time is a few such calls. Fitted on random calls alone, FlashAttention-4's model priced the servers
    of held-out W = 64 steps further off than with calls of such batches; with CAD's calls of other steps, the more
    the better (see :data:`SERVER_CALL_ROUNDS`; bench/results/2026-12-04_from-modules.md)."""
    from hf_longctx.backends.cad.options import CadOptions
    from hf_longctx.backends.cad.runtime import cad_schedule, server_calls
    from hf_longctx.lab.emulation.workloads import doc_lengths
    from hf_longctx.layout import PackedBatch, shard_plan

    rng = random.Random(seed + 4099)
    pool: list[list[tuple[int, int]]] = []
    for i, (mix, tokens, world) in enumerate(list(batches) * rounds):
        total = max(64 * world, int(tokens * scale))
        plan = shard_plan(PackedBatch.from_doc_lens(doc_lengths(mix, total, seed=SERVER_CALL_SEED + seed + i)),
                          world, "cad")
        options = CadOptions(cost_model=model, eps=0.01)
        tasks = cad_schedule(plan, options).tasks
        for server in range(world):
            mine = [t for t in tasks if t.server == server]
            pool += [list(zip(q, k)) for q, k, causal in server_calls(plan, mine, options, model)
                     if causal and sum(PAIRS.cost(a, b) for a, b in zip(q, k)) <= max_pairs]
    return rng.sample(pool, min(count, len(pool)))


KEYS_LIMIT_SWEEP = (0.85, 0.95, 0.99, 1.01, 1.05, 1.25, 1.5)  # keys of :func:`check_keys_limit`'s segments / limit


def check_keys_limit(model: LaunchCostModel, kernel: str, kv_heads: int, head_dim: int, dtype: torch.dtype,
                     device: torch.device, warmup: int = 1, reps: int = 5, rows: int = 256) -> dict:
    """What the kernel's backward keys limit (``model.launch.backward_keys_limit``) is worth, timed: one segment
    of ``rows`` rows over keys on both sides of it (:data:`KEYS_LIMIT_SWEEP`), each backward timed and priced with
    and without the spill; and three such segments over 1.2x the limit together, as one call and as the calls a
    server cuts them into (:func:`~hf_longctx.kernels.calls.cut_into_calls` under the model's call terms).
    ``{"sweep": [{keys, measured, priced, priced_without_spill}], "batch": {segments, one_call, cut_calls, runs}}``
    (ms)."""
    limit = model.launch.backward_keys_limit
    if limit is None:
        raise ValueError("check_keys_limit needs a model whose launch grid has a backward keys limit")
    plain = replace(model, backward=replace(model.backward, k_spill=0.0))
    sweep = []
    for f in KEYS_LIMIT_SWEEP:
        keys = int(limit * f)
        _, measured = time_call_phases([(rows, keys)], kernel, model.heads, kv_heads, head_dim, dtype, device, warmup,
                                       reps)
        sweep.append({"keys": keys, "measured": measured, "priced": model.phase_cost("backward", [rows], [keys]),
                      "priced_without_spill": plain.phase_cost("backward", [rows], [keys])})
    segments = [(rows, int(limit * 0.4))] * 3
    q_lens, k_lens = [q for q, _ in segments], [k for _, k in segments]
    runs = cut_into_calls(q_lens, k_lens, model.call_terms)
    _, one_call = time_call_phases(segments, kernel, model.heads, kv_heads, head_dim, dtype, device, warmup, reps)
    cut = sum(time_call_phases(segments[a:b], kernel, model.heads, kv_heads, head_dim, dtype, device, warmup,
                               reps)[1] for a, b in runs)
    return {"sweep": sweep, "batch": {"segments": segments, "one_call": one_call, "cut_calls": cut, "runs": runs}}


def _run_ms(step: Callable[[], None], device: torch.device, cold: bool = False) -> float:
    """Milliseconds of ``step`` (device events with the stream queued ahead on a GPU, after evicting the L2 cache
    where ``cold``; the host clock on the CPU)."""
    return one_run_ms(step, device.type == "cuda", ahead=True, cold=cold)


def segment_batch(shapes: Sequence[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                  device: torch.device, seed: int) -> tuple[list[int], list[int], int, int, torch.Tensor, torch.Tensor,
                                                            torch.Tensor]:
    """(cu_q, cu_k, max_q, max_k, q, k, v) of a varlen batch of segments of the given (q_len, kv_len), laid out
    back to back, each with keys of its own (as a server's gathered batch holds them); random, seeded."""
    cu_q, cu_k = [0], [0]
    for q_len, k_len in shapes:
        cu_q.append(cu_q[-1] + q_len)
        cu_k.append(cu_k[-1] + k_len)
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(cu_q[-1], heads, head_dim, device=device, dtype=dtype, generator=g)
    k = torch.randn(cu_k[-1], kv_heads, head_dim, device=device, dtype=dtype, generator=g)
    return cu_q, cu_k, max(q for q, _ in shapes), max(k for _, k in shapes), q, k, torch.randn_like(k)


def time_call_phases(shapes: Sequence[tuple[int, int]], kernel: str, heads: int, kv_heads: int, head_dim: int,
                     dtype: torch.dtype, device: torch.device, warmup: int = 1, reps: int = 5, seed: int = 0,
                     causal: bool = True, key_split: KeySplit | None = None, cold: bool = False
                     ) -> tuple[float, float]:
    """(forward ms, backward ms) of one varlen call over ``shapes`` (in the order given), each the median of
    ``reps`` after ``warmup`` untimed runs; every segment has keys of its own, as a server's gathered batch.
    ``causal`` False: rectangles (every row sees all its segment's keys), as a key cut's part before its rows.
    ``key_split``: the forward as a server runs it (a call of few long blocks as chunks of its keys). ``cold``:
    the L2 cache evicted before every timed run (:func:`~hf_longctx.benchmarking.flush_l2`)."""
    cu_q, cu_k, max_q, max_k, q, k, v = segment_batch(shapes, heads, kv_heads, head_dim, dtype, device, seed)
    dout = torch.randn_like(q)
    out, lse = attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, kernel=kernel, key_split=key_split)

    def forward() -> None:
        attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, kernel=kernel, key_split=key_split)

    def backward() -> None:
        attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal=causal, kernel=kernel)

    times = []
    for phase, step in (("forward", forward), ("backward", backward)):
        step.shapes, step.phase = list(shapes), phase  # what the call computes, for whoever reads the timings
        for _ in range(warmup):
            step()
        times.append(statistics.median(_run_ms(step, device, cold) for _ in range(reps)))
    return times[0], times[1]


def profile_launch_cost(kernel: str, device: torch.device, grid: LaunchGrid, heads: int = 32, kv_heads: int = 8,
                        head_dim: int = 128, dtype: torch.dtype = torch.bfloat16, count: int = 160, seed: int = 0,
                        warmup: int = 1, reps: int = 5, scale: float = 1.0,
                        report: Callable[[str], None] | None = None, cold: bool = False,
                        server_calls: int = SERVER_CALLS,
                        server_batches: Sequence[tuple[str, int, int]] = SERVER_CALL_BATCHES,
                        step_seeds: Sequence[int] = STEP_CALL_SEEDS,
                        step_batches: Sequence[tuple[str, int, int]] = STEP_CALL_BATCHES
                        ) -> tuple[LaunchCostModel, dict]:
    """Time ``count`` random calls (:func:`random_calls`, :func:`keys_limit_calls` where the grid has a keys
    limit, :func:`split_forward_calls` where its forward splits keys, and :func:`short_document_calls`) of
    ``kernel`` and fit both phases' terms (ms); then time ``server_calls`` calls of CAD's servers scheduled on
    that fit (:func:`cad_server_calls` over ``server_batches``) and fit again on all; then emulate CAD's steps of
    ``step_batches`` drawn with each of ``step_seeds``, scheduled on that fit, time their calls where they run
    (:func:`~hf_longctx.lab.emulation.step_calls.time_step_calls`) and fit again on all (:func:`fit_timed_calls`):
    (model, metadata with the held-out check, the fit's own error and every timed call). ``grid``: the kernel's
    launch grid on this device (its slots the SM count). ``cold``: every run with the L2 cache evicted first
    (:func:`time_call_phases`; the steps run as steps do)."""
    t0 = time.perf_counter()
    overruns, regions = HOST_AHEAD.overruns, HOST_AHEAD.regions
    calls = (random_calls(count, seed, scale=scale) + keys_limit_calls(grid, scale) + split_forward_calls(grid, scale)
             + short_document_calls(seed=seed, scale=scale) + few_rows_long_keys_calls(grid, seed=seed, scale=scale))
    key_split = KeySplit.for_grid(grid)  # the forward as the kernel's servers run it

    def timed_calls(shapes_list: list[list[tuple[int, int]]], first: int, reps: int) -> list:
        out = []
        for i, shapes in enumerate(shapes_list):
            fwd, bwd = time_call_phases(shapes, kernel, heads, kv_heads, head_dim, dtype, device, warmup, reps,
                                        seed + first + i, key_split=key_split, cold=cold)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            out.append((shapes, fwd, bwd))
            if report is not None and i % 20 == 0:
                report(f"call {first + i}: {len(shapes)} segments, forward {fwd:.4f} ms, backward {bwd:.4f} ms")
        return out

    timed = timed_calls(calls, 0, reps)
    model, fit = fit_timed_calls(timed, grid, heads)
    servers = cad_server_calls(model, server_calls, seed, scale, server_batches) if server_calls > 0 else []
    if servers:
        timed += timed_calls(servers, len(calls), min(reps, SERVER_CALL_REPS))
        model, fit = fit_timed_calls(timed, grid, heads)
    steps: list = []
    if step_seeds:
        from hf_longctx.lab.emulation.step_calls import time_step_calls

        steps = time_step_calls({"cost_model": model, "eps": 0.01}, kernel, device, step_batches, heads, kv_heads,
                                head_dim, dtype, seeds=step_seeds, scale=scale, reps=STEP_CALL_REPS)
        model, fit = fit_timed_calls(timed, grid, heads, steps)
        if report is not None:
            report(f"{len(steps)} calls timed in {len(step_seeds) * len(step_batches)} emulated CAD steps")
    meta = {"kernel": kernel, "calls": len(timed), "server_calls": len(servers), "call_set": CALL_SET, "seed": seed,
            "reps": reps, "l2": "evicted" if cold else "warm", **fit,
            "seconds": round(time.perf_counter() - t0, 1),
            # timed runs whose host dispatch outran the device's spin (see HostAhead): their times hold host time
            "host_overruns": HOST_AHEAD.overruns - overruns, "timed_regions": HOST_AHEAD.regions - regions,
            "timed": [{"shapes": [list(x) for x in shapes], "forward": fwd, "backward": bwd}
                      for shapes, fwd, bwd in timed],  # every call's time: the fit can be checked again anywhere
            "step_calls": [c._asdict() for c in steps]}  # the calls timed in steps, kept alike
    if report is not None:
        report("held-out calls, relative error std: " + ", ".join(
            f"{p} {v * 100:.2f}%" for p, v in fit["held_out_relative_error_std"].items()))
    return model, meta


def fit_timed_calls(timed: Sequence[tuple[Sequence[tuple[int, int]], float, float]], grid: LaunchGrid, heads: int,
                    step_calls: Sequence[tuple[str, Sequence[int], Sequence[int], float]] = (),
                    step_weight: float = STEP_CALL_WEIGHT) -> tuple[LaunchCostModel, dict]:
    """Both phases' terms fitted to timed calls ``(segments, forward ms, backward ms)`` on ``grid``, and to
    ``step_calls`` ``(phase, q_lens, k_lens, ms)`` timed inside emulated steps
    (:func:`~hf_longctx.lab.emulation.step_calls.time_step_calls`), each weighing ``step_weight`` calls timed alone:
    (model, {the held-out check, the fit's own error}). The held-out check fits on three calls in four (of each
    set) and prices the fourth: ``held_out_relative_error_std`` over the calls timed alone,
    ``held_out_step_error_std`` over the step's. A profile's saved calls (its metadata's ``timed`` and
    ``step_calls``) can so be fitted again away from the device, on a grid that models the kernel differently
    (``scripts/lab/profile_cad.py --load PROFILE --refit OUT``)."""
    features = {p: np.array([call_features(p, [q for q, _ in s], [k for _, k in s], grid, heads)
                             for s, _, _ in timed]) for p in PHASES}
    seconds = {"forward": np.array([f for _, f, _ in timed]), "backward": np.array([b for _, _, b in timed])}
    in_step = {p: [c for c in step_calls if c[0] == p] for p in PHASES}
    step_features = {p: np.array([call_features(p, list(q), list(k), grid, heads) for _, q, k, _ in in_step[p]],
                                 dtype=np.float64).reshape(-1, len(TERM_NAMES)) for p in PHASES}
    step_ms = {p: np.array([ms for *_, ms in in_step[p]], dtype=np.float64) for p in PHASES}

    def fit(p: str, alone: np.ndarray, steps: np.ndarray) -> tuple[PhaseTerms, float]:
        x = np.vstack([features[p][alone], step_features[p][steps]])
        y = np.concatenate([seconds[p][alone], step_ms[p][steps]])
        w = np.concatenate([np.ones(int(alone.sum())), np.full(int(steps.sum()), step_weight)])
        return fit_phase_terms(x, y, w)

    held = np.arange(len(timed)) % 4 == 3
    held_step = {p: np.arange(len(step_ms[p])) % 4 == 3 for p in PHASES}
    check, step_check = {}, {}
    both_pred, both_meas = np.zeros(int(held.sum())), np.zeros(int(held.sum()))
    for p in PHASES:
        terms, _ = fit(p, ~held, ~held_step[p])
        pred = features[p][held] @ terms.as_vector()
        check[p] = float((pred / seconds[p][held] - 1.0).std())
        both_pred += pred
        both_meas += seconds[p][held]
        if held_step[p].any():
            priced = step_features[p][held_step[p]] @ terms.as_vector()
            step_check[p] = float((priced / step_ms[p][held_step[p]] - 1.0).std())
    check["forward+backward"] = float((both_pred / both_meas - 1.0).std())
    fitted = {p: fit(p, np.ones(len(timed), bool), np.ones(len(step_ms[p]), bool)) for p in PHASES}
    model = LaunchCostModel(grid, heads, fitted["forward"][0], fitted["backward"][0], "ms")
    out = {"held_out_relative_error_std": check, "fit_relative_error_std": {p: fitted[p][1] for p in PHASES}}
    if step_check:
        out["held_out_step_error_std"] = step_check
    return model, out


def sweep_shapes(sweep: str, grid: LaunchGrid, scale: float = 1.0) -> list[tuple[int, int]]:
    """Single-segment calls (q_len, kv_len) along one line, to see how a kernel's time follows its launch where
    random calls mix the effects:

    - ``prefix``: a shard of 16 forward query tiles over ever longer causal prefixes (the same blocks, longer);
    - ``waves``: one more forward query tile at a time over a fixed 64-tile prefix (more blocks, one launch wave
      of the grid's slots after another);
    - ``square``: whole documents of 8 to 128 query tiles.

    ``scale`` shrinks every length (a CPU run times small shapes)."""
    rows = grid.forward_tile[0]
    lines = {
        "prefix": [(16 * rows, 16 * rows + 4 * rows * i) for i in range(0, 29)],
        "waves": [(rows * i, rows * (i + 64)) for i in range(1, 33)],
        "square": [(8 * rows * i, 8 * rows * i) for i in range(1, 17)],
    }
    if sweep not in lines:
        raise ValueError(f"unknown sweep {sweep!r}; choose one of {', '.join(SWEEPS)}")
    return [(max(1, int(q * scale)), max(1, int(k * scale))) for q, k in lines[sweep]]


def placement_probes(grid: LaunchGrid, heads: int, scale: float = 1.0) -> list[tuple[str, list[tuple[int, int]]]]:
    """Calls that show how the GPU places a call's blocks on its SMs: (label, segments), each timed on its own.

    A long forward block (one query tile over 512 key tiles) runs as fast alone on an SM as the kernel lets it;
    two on one SM share it. Which blocks share depends on where they sit in the launch order, so:

    - ``lone``: one long block per head (``heads`` blocks, fewer than the SMs);
    - ``1 long + n tiny``: per head one long block and ``n`` one-tile documents after it, so the long blocks sit
      ``n + 1`` apart in the launch order; whether they end up paired (about 1.6x the lone time) tells which
      launch positions share an SM;
    - ``t long tiles``: one segment of ``t`` query tiles over the same prefix, every block long (how the time
      steps up with the block count).

    ``scale`` shrinks every length (a CPU run times small shapes)."""
    rows, keys = grid.forward_tile

    def scaled(n: int) -> int:
        return max(1, int(n * scale))

    long, tiny = (scaled(rows), scaled(512 * keys)), (scaled(rows), scaled(rows))
    probes = [(f"lone ({heads} blocks)", [long])]
    for n in (1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 15):
        probes.append((f"1 long + {n} tiny per head ({heads * (n + 1)} blocks)", [long] + [tiny] * n))
    for t in (2, 3, 4, 5, 6, 8, 10, 12):
        segment = (scaled(t * rows), scaled(512 * keys + (t - 1) * rows))
        probes.append((f"{t} long tiles ({heads * t} blocks)", [segment]))
    return probes


# short documents beside a long segment in :func:`mix_pairs` (rows; each a whole causal document)
MIX_SHORTS = ((512, 384, 256, 128), (924, 448, 278, 222, 116), (1123, 924, 708, 705, 516, 302, 279, 260, 153),
              (1920, 1536, 1024, 1024, 768, 512, 512, 256, 256, 128, 128))


def mix_pairs(grid: LaunchGrid, scale: float = 1.0) -> list[tuple[tuple[int, int], list[tuple[int, int]]]]:
    """(long segment, short documents) pairs, each to be timed as one call and as two: a shard of 1, 2 or 4 forward
    query tiles over a causal prefix of 32, 64, 128 or 256 key tiles, beside each set of :data:`MIX_SHORTS`. A
    long prefix is the critical path of its call; whether the blocks beside it slow it is what the pairs show
    (a CAD server computes such calls: a long document's last rows beside short documents).

    ``scale`` shrinks every length (a CPU run times small shapes)."""
    rows, keys = grid.forward_tile

    def scaled(n: int) -> int:
        return max(1, int(n * scale))

    out = []
    for q_tiles in (1, 2, 4):
        for k_tiles in (32, 64, 128, 256):
            long = (scaled(q_tiles * rows), scaled(k_tiles * keys))
            out += [(long, [(scaled(n), scaled(n)) for n in shorts]) for shorts in MIX_SHORTS]
    return out


def check_call_mix(model: LaunchCostModel, pairs: Sequence[tuple[tuple[int, int], Sequence[tuple[int, int]]]],
                   kernel: str, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                   warmup: int = 1, reps: int = 5) -> list[dict]:
    """Time each (long segment, short documents) pair of :func:`mix_pairs` as the long segment alone, the short
    documents alone and both in one call (long first, in launch order), and price each with ``model``: one row per
    pair with its ``prefix`` (the long segment) and the documents ``beside`` it and, per way (``long``, ``shorts``,
    ``one call``) and phase, ``measured`` and ``predicted`` ms. Two calls cost what their parts cost; ``one call``
    is what a server's batch pays when the call planner keeps them together."""
    out = []
    for long, shorts in pairs:
        row: dict = {"prefix": tuple(long), "beside": [tuple(s) for s in shorts]}
        for way, segments in (("long", [long]), ("shorts", list(shorts)), ("one call", [long, *shorts])):
            row[way] = _timed_and_priced(model, segments, kernel, kv_heads, head_dim, dtype, device, warmup, reps)
        out.append(row)
    return out


def _timed_and_priced(model: LaunchCostModel, segments: Sequence[tuple[int, int]], kernel: str, kv_heads: int,
                      head_dim: int, dtype: torch.dtype, device: torch.device, warmup: int, reps: int) -> dict:
    """One call over ``segments`` timed per phase (:func:`time_call_phases`, the model's heads) and priced by
    ``model``: {phase: {"measured": ms, "predicted": ms}}."""
    times = time_call_phases(segments, kernel, model.heads, kv_heads, head_dim, dtype, device, warmup, reps,
                             key_split=KeySplit.for_grid(model.launch))
    q_lens, k_lens = [q for q, _ in segments], [k for _, k in segments]
    return {phase: {"measured": measured, "predicted": model.phase_cost(phase, q_lens, k_lens)}
            for phase, measured in zip(PHASES, times)}


def time_placement(model: LaunchCostModel, probes: Sequence[tuple[str, Sequence[tuple[int, int]]]], kernel: str,
                   kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, warmup: int = 1,
                   reps: int = 5) -> list[dict]:
    """Each probe of :func:`placement_probes` timed and priced (:func:`_timed_and_priced`): one row per probe with
    its ``label`` and, per phase, ``measured`` and ``predicted`` ms."""
    return [{"label": label, **_timed_and_priced(model, segments, kernel, kv_heads, head_dim, dtype, device, warmup,
                                                 reps)} for label, segments in probes]


def check_launch_cost(model: LaunchCostModel, shapes: Sequence[tuple[int, int]], kernel: str, kv_heads: int,
                      head_dim: int, dtype: torch.dtype, device: torch.device, warmup: int = 1, reps: int = 5
                      ) -> list[dict]:
    """Time each single-segment call of ``shapes`` (forward and backward apart, as the profile times them) and
    price it with ``model``: one row per shape with ``q_len``, ``kv_len`` and, per phase, ``measured`` and
    ``predicted`` ms. The model's own ``heads`` are timed."""
    return [{"q_len": q_len, "kv_len": kv_len,
             **_timed_and_priced(model, [(q_len, kv_len)], kernel, kv_heads, head_dim, dtype, device, warmup, reps)}
            for q_len, kv_len in shapes]


def replay_dumped_calls(dump: dict, kernel: str, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                        device: torch.device, warmup: int = 1, reps: int = 5, key_split: KeySplit | None = None,
                        cold: bool = False) -> list[tuple[dict, float, float]]:
    """Every call of a dumped emulated step (:func:`dumped_calls`) timed again alone: (call, ms in the step, ms
    alone), each distinct call's phases timed once (:func:`time_call_phases`, fresh tensors; the forward under
    ``key_split``, which need not be the step's, so that a split can be timed against the calls a step made whole;
    ``cold``: each run after evicting the L2 cache).

    Why: a cost model is fitted to calls timed alone, and checked against calls timed inside an emulated step, where
    one device runs every rank's calls back to back and holds every rank's buffers. Where a call's time in the step
    and alone differ, the step measured something besides the kernel (the allocator, the device's state); where
    they agree and the model is off, the model is."""
    timed: dict[tuple, tuple[float, float]] = {}
    out = []
    for call, in_step in dumped_calls(dump):
        causal = call.get("causal", True)
        key = (tuple(call["q_lens"]), tuple(call["k_lens"]), causal)
        if key not in timed:
            shapes = [(q, k) for q, k in zip(call["q_lens"], call["k_lens"]) if q > 0]
            timed[key] = time_call_phases(shapes, kernel, heads, kv_heads, head_dim, dtype, device, warmup, reps,
                                          causal=causal, key_split=key_split, cold=cold)
        out.append((call, in_step, timed[key][PHASES.index(call["phase"])]))
    return out


def server_phase_errors(model: LaunchCostModel, dump: dict) -> list[dict]:
    """Per rank of an emulated step's dumped kernel calls (``bench_emulated.py --dump-calls``: ``reps``, a list per
    timed repetition of calls with ``rank``, ``phase``, ``q_lens``, ``k_lens``, ``causal`` (default True) and
    ``seconds``), per phase: the ``measured`` ms (each call the median over the repetitions) and what ``model``
    ``predicted`` (ms).

    Where a server's time goes wrong, phase by phase: a step's total hides a forward priced high on one server
    behind a backward priced low. Calls are matched across repetitions as :func:`dumped_calls` matches them."""
    ranks: dict[int, dict] = {}
    for call, measured in dumped_calls(dump):
        row = ranks.setdefault(call["rank"], {"rank": call["rank"], **{
            p: {"measured": 0.0, "predicted": 0.0} for p in PHASES}})
        row[call["phase"]]["measured"] += measured
        row[call["phase"]]["predicted"] += model.phase_cost(call["phase"], call["q_lens"], call["k_lens"],
                                                            causal=call.get("causal", True))
    return [ranks[r] for r in sorted(ranks)]


def errors_by_waves(model: LaunchCostModel, dumps: Sequence[dict]) -> list[dict]:
    """The calls of dumped emulated steps (``bench_emulated.py --dump-calls``) grouped by phase and size
    (:data:`WAVE_BINS` of :func:`~.launch_cost.call_waves`): per group its ``phase``, ``waves`` (low, high),
    ``calls`` and the ``mean`` and ``std`` of measured / predicted - 1 (each call its median over the repetitions).
    Groups without calls are left out.

    Why: a model fitted on the profile's calls is right on average over them, and may be off by call size where
    the calls a schedule makes are sized differently. On dumped steps of CAD at 64 servers on FlashAttention-4,
    backward calls of under one wave ran over their price and those of 16-64 waves under, where the profile held
    few calls of under 8 waves (bench/results/2026-12-04_from-modules.md; ``scripts/lab/profile_cad.py --calls``
    prints the table for a dumped step)."""
    groups: dict[tuple[str, int], list[float]] = {}
    for dump in dumps:
        for call, measured in dumped_calls(dump):
            phase = call["phase"]
            waves = call_waves(phase, call["q_lens"], call["k_lens"], model.launch, model.heads)
            predicted = model.phase_cost(phase, call["q_lens"], call["k_lens"], causal=call.get("causal", True))
            if predicted <= 0:
                continue
            low = max(i for i, edge in enumerate(WAVE_BINS[:-1]) if waves >= edge)
            groups.setdefault((phase, low), []).append(measured / predicted - 1.0)
    return [{"phase": phase, "waves": (WAVE_BINS[low], WAVE_BINS[low + 1]), "calls": len(errors),
             "mean": float(np.mean(errors)), "std": float(np.std(errors))}
            for (phase, low), errors in sorted(groups.items(), key=lambda kv: (PHASES.index(kv[0][0]), kv[0][1]))]


def phase_spreads(rows: Sequence[dict]) -> dict[str, float]:
    """How much of the spread of servers' errors each phase makes, from :func:`server_phase_errors`' rows: per
    phase, the standard deviation over servers of that phase's measured time less its predicted time scaled by the
    phase's measured / predicted over all servers, over the server's predicted total. A phase whose error is the
    same on every server adds nothing (a uniform error does not unbalance a schedule); the phase with the larger
    spread is the one to model better. On dumped CAD steps at 64 servers on FlashAttention-4 the backward made
    most of it (bench/results/2026-12-04_from-modules.md)."""
    if not rows:
        return dict.fromkeys(PHASES, 0.0)
    total = np.array([sum(r[p]["predicted"] for p in PHASES) for r in rows])
    out = {}
    for phase in PHASES:
        measured = np.array([r[phase]["measured"] for r in rows])
        predicted = np.array([r[phase]["predicted"] for r in rows])
        scale = measured.sum() / predicted.sum() if predicted.sum() > 0 else 1.0
        out[phase] = float(np.std((measured - predicted * scale) / np.where(total > 0, total, 1.0)))
    return out
