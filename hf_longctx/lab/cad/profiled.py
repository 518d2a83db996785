"""CAD's cost model measured on the kernel it will run: profiled once per device kind and kernel, cached.

Why: the scheduler balances what its cost model prices. FLOPs miss that a kernel's throughput depends
on segment shape (several times lower on short documents than on long ones; bench/results/2026-12-04_from-modules.md),
so a schedule balanced in FLOPs is not balanced in time. :func:`measured_cost_model` returns the cost model measured
on this device's kernel, whichever kind it is: the launch cost model (below) or the profiled grid, a
:class:`~.cost_model.ProfiledCostModel` of forward+backward milliseconds per (q_len, kv_len) segment,
timed as CA-tasks run on a server (many segments fused in one varlen call), read from
``~/.cache/hf_longctx/cad_cost/`` (``HF_LONGCTX_CACHE`` moves the root) or profiled and written
there on first use. Where profiling cannot run, the FLOPs model stands in (and says so).

Besides the grid, the profile holds what a segment costs in a fused batch whatever its size
(``segment_cost``, see :class:`~.cost_model.ProfiledCostModel`), measured by :func:`time_cut`: a
batch of equal segments timed whole and with every segment cut in two (the same query rows, keys
and visible pairs, one more segment per cut, as the scheduler's splits make them), the difference
per cut. On a GPU the profile also records the kernel tile (:data:`GPU_TILE`) that partial tiles
are rounded up to, and what a kernel call costs beyond its segments (:func:`measure_call_terms`), by which
the runtime cuts a server's batch into calls. A cached profile from before these terms existed is measured
again.

Where the kernel declares a launch grid (on a GPU), :func:`measured_cost_model` returns the launch cost model
instead (:mod:`.launch_cost`, fitted by :mod:`.call_profile` and cached beside the grid as ``...-launch.json``):
it prices short documents and partial tiles that the grid's interpolation misses.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from hf_longctx.backends.cad.cost_model import PAIRS, CostModel, FlopsCostModel, ProfiledCostModel
from hf_longctx.backends.cad.launch_cost import KIND as LAUNCH_KIND
from hf_longctx.backends.cad.launch_cost import PHASES, TERM_NAMES, LaunchCostModel
from hf_longctx.benchmarking import one_run_ms
from hf_longctx.kernels import attention_backward, attention_forward, get_kernel, kernel_call, select_kernel
from hf_longctx.kernels.calls import CallTerms
from hf_longctx.kernels.launch import LaunchGrid, tail_factor
from hf_longctx.kernels.merge import merge_implementation
from hf_longctx.lab.cad.call_profile import CALL_SET, profile_launch_cost, segment_batch

log = logging.getLogger(__name__)

DEFAULT_Q_LENS = (128, 512, 2048, 8192, 32768, 131072)
DEFAULT_KV_LENS = (128, 512, 2048, 8192, 32768, 131072, 524288)
# Query rows and keys a GPU attention kernel computes as one tile (FlashAttention 2-4 and cuDNN at head dim
# 128: 128-row query tiles, 64-128-key tiles): a partial tile costs about what a full one does.
GPU_TILE = 128
# Key lengths (in multiples of the cut segment's rows) at which the per-segment cost is measured.
CUT_KV_FACTORS = (1, 2, 8)
MODES = ("fwd", "fwd+bwd")
# how cells are timed (kept in a profile's metadata; a profile timed otherwise is measured again)
TIMING = "device events, stream queued ahead"
PROFILE_L2 = ("evicted", "warm")  # the L2 state the launch profile times calls in (see profile_l2)


@dataclass(frozen=True)
class SegmentShape:
    """Heads, head dim and dtype of the attention being priced (default: Llama-3-8B in bf16)."""

    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16


@dataclass(frozen=True)
class ProfileBudget:
    """How much one grid cell may cost to measure: larger cells are extrapolated at the FLOP rate of the
    largest measured cell of their row (they are compute bound)."""

    min_tokens: int = 32768  # query rows per timed batch (at least)
    max_kv_tokens: int = 1 << 21  # keys per timed batch (at most)
    max_pairs: float = float(1 << 31)  # visible (query, key) pairs of a measured segment
    max_batch_pairs: float = float(1 << 31)  # visible pairs of one timed batch (bounds the copies)
    warmup: int = 1
    reps: int = 3
    cut_batch_factor: int = 4  # the per-segment measurement's batches hold this many times min_tokens query rows


def cache_dir() -> Path:
    return Path(os.environ.get("HF_LONGCTX_CACHE", Path.home() / ".cache" / "hf_longctx")) / "cad_cost"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def cache_path(device: torch.device, kernel: str, shape: SegmentShape) -> Path:
    """Where the profile of ``kernel`` (a resolved kernel name) on this device kind is kept."""
    dtype = str(shape.dtype).removeprefix("torch.")
    return cache_dir() / (f"{_slug(device_name(device))}-{kernel}-h{shape.heads}-kv{shape.kv_heads}-"
                          f"d{shape.head_dim}-{dtype}.json")


def launch_cache_path(device: torch.device, kernel: str, shape: SegmentShape) -> Path:
    """Where the fitted launch cost model (:mod:`.launch_cost`) of ``kernel`` on this device kind is kept."""
    path = cache_path(device, kernel, shape)
    return path.with_name(f"{path.stem}-{LAUNCH_KIND}.json")


def _segment_step(shapes: Sequence[tuple[int, int]], kernel: str, shape: SegmentShape, device: torch.device,
                  seed: int, mode: str = "fwd+bwd") -> Callable[[], None]:
    """One fused varlen call (forward, and backward for ``fwd+bwd``) over segments of the given (q_len, kv_len)
    (:func:`~.call_profile.segment_batch`)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    cu_q, cu_k, max_q, max_k, q, k, v = segment_batch(shapes, shape.heads, shape.kv_heads, shape.head_dim,
                                                      shape.dtype, device, seed)
    dout = torch.randn_like(q) if mode == "fwd+bwd" else None

    def step() -> None:
        out, lse = attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, kernel=kernel)
        if dout is not None:
            attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal=True, kernel=kernel)

    step.shapes = list(shapes)  # what the call computes, for whoever reads the timings
    return step


def _release(device: torch.device) -> None:
    """Give a measured cell's blocks back to the device, so that the next, larger one finds them."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _run_ms(step: Callable[[], None], device: torch.device) -> float:
    """Milliseconds of ``step``: its device time on a GPU (the stream kept busy while the host enqueues, as the
    emulation times kernel calls: see :func:`~hf_longctx.benchmarking.queue_ahead`), wall time on the CPU."""
    return one_run_ms(step, device.type == "cuda", ahead=True)


def _time_call(shapes: Sequence[tuple[int, int]], kernel: str, shape: SegmentShape, device: torch.device,
               mode: str, seed: int, warmup: int, reps: int) -> float:
    """Milliseconds of one varlen call over ``shapes``: the median of ``reps`` after ``warmup`` untimed calls."""
    step = _segment_step(shapes, kernel, shape, device, seed, mode)
    for _ in range(warmup):
        step()
    return statistics.median(_run_ms(step, device) for _ in range(reps))


def cell_copies(q_len: int, kv_len: int, budget: ProfileBudget) -> int:
    """Segments per timed call of a cell: enough for ``budget.min_tokens`` query rows, within its key and pair
    bounds (at least one)."""
    return max(1, min(budget.min_tokens // q_len, budget.max_kv_tokens // kv_len,
                      int(budget.max_batch_pairs // max(PAIRS.cost(q_len, kv_len), 1.0))))


def time_segments(q_len: int, kv_len: int, copies: int, kernel: str, shape: SegmentShape, device: torch.device,
                  budget: ProfileBudget, mode: str = "fwd+bwd") -> float:
    """Milliseconds of ``copies`` identical segments in one varlen call (forward+backward, or ``mode``), per
    segment: the median over ``budget.reps`` after ``budget.warmup`` untimed calls."""
    return _time_call([(q_len, kv_len)] * copies, kernel, shape, device, mode, q_len * 7 + kv_len, budget.warmup,
                      budget.reps) / copies


def time_cut(q_len: int, kv_len: int, copies: int, kernel: str, shape: SegmentShape, device: torch.device,
             budget: ProfileBudget, mode: str = "fwd+bwd") -> float:
    """Milliseconds one more segment adds to a fused batch that computes the same rows: ``copies`` segments of
    ``q_len`` rows over ``kv_len`` keys, timed whole and with every segment cut into its first and last
    ``q_len / 2`` query rows (over ``kv_len - q_len / 2`` and ``kv_len`` keys, bottom-right causal: the same
    visible pairs), the difference of the two medians per cut. Each batch is one call, so a call's own overhead
    cancels in the difference; the two are timed alternately, so drifts of the clock hit both alike. May come
    out negative by noise where the term is small."""
    half = q_len // 2
    if half < 1 or kv_len < q_len:
        raise ValueError(f"a cut needs q_len >= 2 rows and kv_len >= q_len, got ({q_len}, {kv_len})")
    seed = q_len * 7 + kv_len
    whole = _segment_step([(q_len, kv_len)] * copies, kernel, shape, device, seed, mode)
    cut = _segment_step([(half, kv_len - (q_len - half)), (q_len - half, kv_len)] * copies, kernel, shape, device,
                        seed + 1, mode)
    for _ in range(max(budget.warmup, 1)):  # the cut batch's shapes are new to the kernel: always warm them
        whole()
        cut()
    t_whole, t_cut = [], []
    for _ in range(max(budget.reps, 3)):
        t_whole.append(_run_ms(whole, device))
        t_cut.append(_run_ms(cut, device))
    return (statistics.median(t_cut) - statistics.median(t_whole)) / copies


def measure_segment_cost(kernel: str, shape: SegmentShape, device: torch.device, budget: ProfileBudget, unit: int,
                         mode: str = "fwd+bwd") -> tuple[float, list[list[float]]]:
    """(per-segment cost in ms, samples ``[q_len, kv_len, copies, ms]``): :func:`time_cut` on segments of
    ``2 * unit`` rows (``unit``: the kernel tile, so both halves are whole tiles and the cut adds no tile
    rounding) over ``CUT_KV_FACTORS`` times as many keys; the median of the samples, at least 0."""
    q_len = 2 * unit
    samples = []
    for factor in CUT_KV_FACTORS:
        kv_len = q_len * factor
        copies = max(1, min(budget.cut_batch_factor * budget.min_tokens // q_len,
                            budget.max_kv_tokens // (2 * kv_len)))
        samples.append([q_len, kv_len, copies, time_cut(q_len, kv_len, copies, kernel, shape, device, budget, mode)])
    return max(0.0, statistics.median(ms for *_, ms in samples)), samples


# shapes of the call-term measurement: short segments of one tile fused beside one long segment
CALL_SHORT_SEGMENTS = 64
CALL_LONG_KEYS = 32768  # a (tile, 32K) segment: surplus key tiles for its short neighbours, few query tiles
CALL_LONG_SQUARE = 8192  # an (8K, 8K) segment: surplus query tiles (and key tiles, priced by the first)


def measure_call_terms(kernel: str, shape: SegmentShape, device: torch.device, budget: ProfileBudget, tile: int,
                       mode: str = "fwd+bwd") -> tuple[CallTerms, dict]:
    """What a varlen call costs beyond its segments (:class:`~hf_longctx.kernels.calls.CallTerms`), in ms.

    With ``n`` short segments ``s`` (one tile square): a call of one ``s`` and a call of ``n`` give the fixed
    cost per call and the cost of ``s`` inside a batch. ``n`` of them beside one ``(tile, 32K)`` segment cost
    more than the two alone by the surplus key tiles, ``n * (32K / tile - 1)`` of them; beside an ``(8K, 8K)``
    segment by as many surplus query and key tiles, the key tiles priced by the first. Each term is at least 0.
    """
    n, unit = CALL_SHORT_SEGMENTS, tile
    small = (unit, unit)

    def timed_call(shapes: list[tuple[int, int]], seed: int) -> float:  # at least 5 reps: differences of calls
        return _time_call(shapes, kernel, shape, device, mode, seed, max(budget.warmup, 1), max(budget.reps, 5))

    t_one = timed_call([small], 11)
    t_many = timed_call([small] * n, 12)
    call = max(0.0, (n * t_one - t_many) / (n - 1))
    per_small = max(0.0, t_one - call)
    long_k = (unit, CALL_LONG_KEYS)
    t_lk = timed_call([long_k], 13)
    t_mix_k = timed_call([long_k] + [small] * n, 14)
    surplus_k = n * (CALL_LONG_KEYS // unit - 1)
    k_tile = max(0.0, (t_mix_k - t_lk - n * per_small) / surplus_k)
    long_q = (CALL_LONG_SQUARE, CALL_LONG_SQUARE)
    t_lq = timed_call([long_q], 15)
    t_mix_q = timed_call([long_q] + [small] * n, 16)
    surplus_q = n * (CALL_LONG_SQUARE // unit - 1)
    q_tile = max(0.0, (t_mix_q - t_lq - n * per_small - surplus_q * k_tile) / surplus_q)
    samples = {"one_short_ms": t_one, f"{n}_short_ms": t_many, "long_keys_ms": t_lk, "long_keys_beside_ms": t_mix_k,
               "long_square_ms": t_lq, "long_square_beside_ms": t_mix_q}
    return CallTerms(call, q_tile, k_tile, unit, "ms"), samples


def check_shapes(model: ProfiledCostModel, shapes: Sequence[tuple[int, int]], kernel: str, shape: SegmentShape,
                 device: torch.device, budget: ProfileBudget, mode: str = "fwd+bwd"
                 ) -> list[tuple[int, int, float, float]]:
    """How faithfully ``model`` prices segments it was not measured on: each (q_len, kv_len) of ``shapes`` timed
    as a profile cell is (copies in one fused call, per segment) beside the model's price; returns
    ``(q_len, kv_len, measured ms, predicted ms)`` per shape. A grid too coarse for where a kernel's throughput
    bends (short segments) shows here as errors of several percent off the grid points."""
    out = []
    for ql, kl in shapes:
        measured = time_segments(ql, kl, cell_copies(ql, kl, budget), kernel, shape, device, budget, mode)
        _release(device)
        out.append((ql, kl, measured, model.cost(ql, kl)))
    return out


def random_shapes(count: int, seed: int = 0, max_q: int = 8192, max_kv: int = 65536) -> list[tuple[int, int]]:
    """``count`` segment shapes as CAD servers see them: query rows log-uniform in [16, ``max_q``], keys
    log-uniform between the rows and ``max_kv`` (a shard over its causal prefix) or equal to them (a whole
    document), one in three."""
    rng = random.Random(seed)
    shapes = []
    for _ in range(count):
        q = int(round(2 ** rng.uniform(4, math.log2(max(max_q, 16)))))
        kv = q if rng.random() < 1 / 3 else int(round(2 ** rng.uniform(math.log2(q), math.log2(max(q, max_kv)))))
        shapes.append((q, kv))
    return shapes


def launch_grid(kernel: str, device: torch.device, head_dim: int, mode: str = "fwd+bwd",
                shape: SegmentShape | None = None) -> LaunchGrid | None:
    """The launch grid of ``kernel`` on ``device`` (its blocks' tiles, one slot per SM), when the kernel declares
    one for ``head_dim`` (``launch_grid(head_dim)`` on the registered kernel: a non-persistent kernel whose launch
    order leaves a tail); None otherwise, and on the CPU. A forward-only profile weighs the forward alone. With
    the attention ``shape`` priced, the grid also holds the kernel's ``backward_keys_limit`` for it (keys per
    backward call past which it slows down; the kernel declares it or has none) and its
    ``backward_accumulator_keys`` for the device's L2 (where its backward's dK/dV accumulators leave the cache)."""
    module = get_kernel(kernel)
    declare = getattr(module, "launch_grid", None)
    declared = declare(head_dim) if declare is not None else None
    if declared is None or torch.device(device).type != "cuda":
        return None
    properties = torch.cuda.get_device_properties(device)
    slots = properties.multi_processor_count
    limit = accumulators = None
    if shape is not None and hasattr(module, "backward_keys_limit"):
        limit = module.backward_keys_limit(shape.heads, shape.kv_heads, shape.head_dim, shape.dtype.itemsize)
    if shape is not None and hasattr(module, "backward_accumulator_keys"):
        accumulators = module.backward_accumulator_keys(shape.heads, shape.kv_heads, shape.head_dim,
                                                        int(getattr(properties, "L2_cache_size", 0)))
    if shape is not None and hasattr(module, "packs_query_heads"):  # a forward tile's rows shared by query heads
        pack = module.packs_query_heads(shape.heads, shape.kv_heads)
        rows, keys = declared.forward_tile
        declared = replace(declared, forward_tile=(rows // pack, keys), forward_head_pack=pack)
    return replace(declared, slots=slots, forward_weight=1.0 if mode == "fwd" else declared.forward_weight,
                   backward_keys_limit=limit, backward_accumulator_keys=accumulators)


def resolved_kernel(kernel: str, shape: SegmentShape, device: torch.device) -> str:
    """The kernel ``kernel`` ('auto' or a name) runs for a server's fused batch of causal segments."""
    # a server's batch holds task segments whose queries are fewer than their keys (a query shard and its causal
    # prefix): the kernel must serve those, not only square segments
    q = torch.empty(128, shape.heads, shape.head_dim, device=device, dtype=shape.dtype)
    kv = torch.empty(384, shape.kv_heads, shape.head_dim, device=device, dtype=shape.dtype)
    return select_kernel(kernel, kernel_call(q, kv, kv, [0, 64, 128], [0, 128, 384], 64, 256, causal=True))


def default_tile(device: torch.device) -> int:
    """The tile partial tiles are rounded up to: :data:`GPU_TILE` on a GPU, none on the CPU (the reference
    kernel computes only the rows and keys it is given)."""
    return GPU_TILE if torch.device(device).type == "cuda" else 0


def profile_segment_costs(kernel: str = "auto", device: torch.device | str = "cuda",
                          shape: SegmentShape = SegmentShape(), q_lens=DEFAULT_Q_LENS, kv_lens=DEFAULT_KV_LENS,
                          budget: ProfileBudget = ProfileBudget(), *, mode: str = "fwd+bwd", tile: int | None = None,
                          segment_cost: bool = True, call_terms: bool = True,
                          report: Callable[[str], None] | None = None) -> tuple[ProfiledCostModel, dict]:
    """Measure the (q_len, kv_len) grid on ``device``; (model in ms, metadata). Cells with q_len > kv_len
    and cells over ``budget.max_pairs`` are priced at a measured cell's rate per visible pair.

    ``segment_cost`` (default on): also measure what one more segment costs (:func:`measure_segment_cost`, on
    segments of two tiles, or of twice the smallest grid length without a tile), kept no larger than the
    cheapest grid cell (the grid then holds what the rows cost; see :class:`~.cost_model.ProfiledCostModel`).
    ``tile``: partial tiles priced as full ones (None: :func:`default_tile`; grid lengths must be multiples).
    ``call_terms`` (default on, on a GPU): also measure what a call costs beyond its segments
    (:func:`measure_call_terms`), which the runtime uses to cut a server's batch into calls.
    ``report`` receives one line per measured cell.
    """
    device = torch.device(device)
    tile = default_tile(device) if tile is None else int(tile)
    if tile and any(int(x) % tile for x in (*q_lens, *kv_lens)):
        raise ValueError(f"with tile {tile} every grid length must be a multiple of it (or pass tile=0)")
    name = resolved_kernel(kernel, shape, device)
    t0 = time.perf_counter()
    factor = 3.5 if mode == "fwd+bwd" else 1.0
    table = [[float("nan")] * len(kv_lens) for _ in q_lens]
    copies_of: dict[tuple[int, int], int] = {}  # measured cells: segments per timed call
    for i, ql in enumerate(q_lens):
        for j, kl in enumerate(kv_lens):
            if ql <= kl and PAIRS.cost(ql, kl) <= budget.max_pairs:
                copies = copies_of[i, j] = cell_copies(ql, kl, budget)
                try:
                    table[i][j] = time_segments(ql, kl, copies, name, shape, device, budget, mode)
                except torch.cuda.OutOfMemoryError:  # a smaller device (an H100 beside the global tensors of a
                    _release(device)  # benchmark): the cell is priced like those too large to measure
                    if report is not None:
                        report(f"q {ql:>7} kv {kl:>7} x{copies:<4} out of memory: extrapolated")
                    continue
                _release(device)
                if report is not None:
                    work = 4 * shape.heads * shape.head_dim * PAIRS.cost(ql, kl) * factor
                    report(f"q {ql:>7} kv {kl:>7} x{copies:<4} {table[i][j]:10.4f} ms/segment  "
                           f"{work / table[i][j] / 1e9:8.1f} TFLOP/s")
    measured = [(i, j) for i in range(len(q_lens)) for j in range(len(kv_lens)) if table[i][j] == table[i][j]]
    if not measured:
        raise ValueError("no grid cell fits the profiling budget; raise max_pairs or add smaller lengths")
    per_segment, samples = 0.0, []
    if segment_cost:
        unit = tile or int(min(q_lens))
        per_segment, samples = measure_segment_cost(name, shape, device, budget, unit, mode)
        # the grid keeps what the rows cost: no measured cell may cost less than the term it pays on top
        per_segment = min(per_segment, min(table[i][j] for i, j in measured))
        if report is not None:
            report(f"per segment {per_segment:.5f} ms (cuts: " + ", ".join(
                f"q {q} kv {k} x{c}: {ms:.5f}" for q, k, c, ms in samples) + ")")
    launch = launch_grid(name, device, shape.head_dim, mode)
    tail_factors = []
    if launch is not None:  # the grid keeps each cell's work at full throughput (see cost_model.ProfiledCostModel)
        for (i, j), copies in copies_of.items():
            if table[i][j] == table[i][j]:
                ql, kl = int(q_lens[i]), int(kv_lens[j])
                factor = tail_factor([ql] * copies, [kl] * copies, shape.heads, launch)
                table[i][j] = per_segment + (table[i][j] - per_segment) / factor
                tail_factors.append([ql, kl, copies, round(factor, 4)])
    extrapolated = []
    for i, ql in enumerate(q_lens):
        row = [j for j in range(len(kv_lens)) if table[i][j] == table[i][j]]
        ref_i, ref_j = ((i, max(row, key=lambda j: kv_lens[j])) if row else
                        min(measured, key=lambda c: (abs(c[0] - i), -kv_lens[c[1]])))
        # the rows' cost scales with their pairs; the per-segment term does not
        rate = (table[ref_i][ref_j] - per_segment) / PAIRS.cost(q_lens[ref_i], kv_lens[ref_j])
        for j, kl in enumerate(kv_lens):
            if table[i][j] != table[i][j]:
                table[i][j] = per_segment + rate * PAIRS.cost(ql, kl)
                extrapolated.append([ql, kl])
    terms, call_samples = CallTerms(), {}
    if call_terms and device.type == "cuda":
        terms, call_samples = measure_call_terms(name, shape, device, budget, tile or GPU_TILE, mode)
        if report is not None:
            report(f"per call {terms.call:.5f} ms, per surplus query tile {terms.q_tile * 1e3:.3f} us, per surplus "
                   f"key tile {terms.k_tile * 1e3:.3f} us ({call_samples})")
    model = ProfiledCostModel.from_grid(q_lens, kv_lens, table, units="ms", interpolate="rate",
                                        segment_cost=per_segment, tile=tile, call_cost=terms.call,
                                        q_tile_cost=terms.q_tile, k_tile_cost=terms.k_tile, launch=launch,
                                        launch_heads=shape.heads if launch else 0)
    meta = {"device": device_name(device), "kernel": name, "torch": torch.__version__, "heads": shape.heads,
            "kv_heads": shape.kv_heads, "head_dim": shape.head_dim, "dtype": str(shape.dtype),
            "mode": mode, "extrapolated": extrapolated, "segment_cost_samples": samples,
            "call_term_samples": call_samples, "tail_factors": tail_factors, "timing": TIMING,
            "seconds": round(time.perf_counter() - t0, 1)}
    return model, meta


COST_MODELS = ("auto", "grid", "launch")


def measured_cost_model(kernel: str = "auto", device: torch.device | str | None = None,
                        shape: SegmentShape = SegmentShape(), *, profile_if_missing: bool = True,
                        q_lens=DEFAULT_Q_LENS, kv_lens=DEFAULT_KV_LENS, budget: ProfileBudget = ProfileBudget(),
                        model: str = "auto") -> tuple[CostModel, str]:
    """(cost model, where it came from): the cached measured model of ``kernel`` on this device kind, measured now
    when missing (``profile_if_missing``), else :class:`~.cost_model.FlopsCostModel`.

    ``model``: ``"launch"``, the :class:`~.launch_cost.LaunchCostModel` fitted to timed calls (kernels that declare
    a launch grid, on a GPU; see :mod:`.call_profile`); ``"grid"``, the interpolated
    :class:`~.cost_model.ProfiledCostModel`; ``"auto"`` (default), the first where the kernel declares a launch
    grid on this device (it prices short documents within 1% per server where the grid errs by 2%), else the
    grid.

    ``device`` None means the current CUDA device, or the CPU without one (where FLOPs stand in unless a
    profile is asked for with an explicit ``device="cpu"``).
    """
    if model not in COST_MODELS:
        raise ValueError(f"measured_cost_model's model must be one of {COST_MODELS}, got {model!r}")
    l2 = profile_l2()  # here: a misspelled setting is refused, not lost to the FLOPs fallback below
    if device is None:
        if not torch.cuda.is_available():
            return FlopsCostModel(4.0 * shape.heads * shape.head_dim), "FLOPs (no GPU to profile)"
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    try:
        name = resolved_kernel(kernel, shape, device)
        grid = launch_grid(name, device, shape.head_dim, shape=shape) if model != "grid" else None
        if model == "launch" and grid is None:
            raise ValueError(f"kernel {name} declares no launch grid at head dim {shape.head_dim} on {device}; "
                             "use the grid profile (model='grid')")
        if grid is not None:
            return _launch_model(name, device, shape, grid, profile_if_missing, l2)
        path = cache_path(device, name, shape)
        if path.exists():
            data = json.loads(path.read_text())
            # a profile from before the segment term, the call terms, the launch grid or device timing: measured again
            if (list(data["q_lens"]) == list(q_lens) and list(data["kv_lens"]) == list(kv_lens)
                    and all(key in data for key in ("segment_cost", "call_cost", "launch"))
                    and data.get("meta", {}).get("timing") == TIMING):
                return ProfiledCostModel.load(path, interpolate="rate"), f"profiled {name} ({path})"
        if not profile_if_missing:
            return FlopsCostModel(4.0 * shape.heads * shape.head_dim), f"FLOPs (no profile at {path})"
        grid_model, meta = profile_segment_costs(name, device, shape, q_lens, kv_lens, budget)
        _write_atomically(path, grid_model, meta)
        log.info("hf_longctx cad: profiled %s on %s in %.1f s -> %s", name, meta["device"], meta["seconds"], path)
        return grid_model, f"profiled {name} now ({path})"
    except Exception as exc:  # noqa: BLE001 - any failure to profile leaves the FLOPs model, said why
        log.warning("hf_longctx cad: no profiled cost model (%s: %s); balancing FLOPs", type(exc).__name__, exc)
        return FlopsCostModel(4.0 * shape.heads * shape.head_dim), f"FLOPs (profiling failed: {exc})"


def _write_atomically(path: Path, model, meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # ranks of one machine may profile at once
    model.save(tmp, **meta)
    os.replace(tmp, path)


def _same_launch(cached: LaunchGrid, grid: LaunchGrid) -> bool:
    """Whether a cached launch model was fitted on this grid (its terms mean something else on another)."""
    fields = ("forward_tile", "backward_tile", "slots", "forward_pairing", "empty_hold", "backward_keys_limit",
              "forward_key_split", "launch_order", "forward_head_pack", "backward_min_steps",
              "backward_accumulator_keys", "backward_accumulator_steps")
    return all(getattr(cached, f) == getattr(grid, f) for f in fields)


def profile_l2() -> str:
    """The L2 state the launch profile times its calls in: ``HF_LONGCTX_PROFILE_L2``, one of :data:`PROFILE_L2`
    (default ``warm``). ``evicted`` writes a buffer twice the L2 before each timed run
    (:func:`~hf_longctx.benchmarking.flush_l2`); ``warm`` times a call again over the buffers it just used. A
    cached model timed in the other state is fitted again."""
    value = os.environ.get("HF_LONGCTX_PROFILE_L2", "warm")
    if value not in PROFILE_L2:
        raise ValueError(f"HF_LONGCTX_PROFILE_L2={value!r}: choose one of {', '.join(PROFILE_L2)}")
    return value


def _every_term(data: dict, grid: LaunchGrid) -> bool:
    """Whether a cached launch model was fitted with every term the model prices now on ``grid`` (one saved before
    a term existed loads with it at 0, which would price what the term measures as free). A term the grid never
    measures (the short backward blocks' where it declares no minimum, the accumulators' where it declares no keys
    for them) is 0 either way: its absence keeps the model."""
    unmeasured = ({"short_step"} if grid.backward_min_steps is None else set()) | \
        ({"accumulator_key", "accumulator_short_step"} if grid.backward_accumulator_keys is None else set())
    needed = set(TERM_NAMES) - unmeasured
    return all(needed <= set(data.get(phase, {})) for phase in PHASES)


def _launch_model(name: str, device: torch.device, shape: SegmentShape, grid: LaunchGrid, profile_if_missing: bool,
                  l2: str) -> tuple[CostModel, str]:
    """The cached launch cost model of ``name`` here (fitted again when its grid, terms, timing, the L2 state it was
    timed in (:func:`profile_l2`), the set of calls it timed (:data:`~.call_profile.CALL_SET`) or the merge of cut
    forwards differ), or fitted now."""
    path = launch_cache_path(device, name, shape)
    if path.exists():
        data = json.loads(path.read_text())
        cached = LaunchGrid.from_dict(data["launch"]) if data.get("kind") == LAUNCH_KIND else None
        meta = data.get("meta", {})
        if cached is not None and meta.get("timing") == TIMING and _same_launch(cached, grid) \
                and _every_term(data, grid) and meta.get("merge") == merge_implementation(device, shape.dtype) \
                and meta.get("l2", "warm") == l2 and meta.get("call_set") == CALL_SET:
            return LaunchCostModel.from_dict(data), f"launch-fitted {name} ({path})"
    if not profile_if_missing:
        return FlopsCostModel(4.0 * shape.heads * shape.head_dim), f"FLOPs (no launch cost model at {path})"
    model, meta = profile_launch_cost(name, device, grid, shape.heads, shape.kv_heads, shape.head_dim, shape.dtype,
                                      cold=l2 == "evicted")
    meta.update(device=device_name(device), torch=torch.__version__, timing=TIMING,
                merge=merge_implementation(device, shape.dtype))
    _write_atomically(path, model, meta)
    log.info("hf_longctx cad: fitted %s's launch cost on %s in %.1f s (held-out error %s) -> %s", name,
             meta["device"], meta["seconds"], meta["held_out_relative_error_std"], path)
    return model, f"launch-fitted {name} now ({path})"
