"""CAD's cost model measured on the kernel it will run: profiled once per device kind and kernel, cached.

Why: the scheduler balances what its cost model prices. FLOPs miss that a kernel's throughput depends
on segment shape (FA4 on one H200: ~620 TFLOP/s on one 128K document, ~100 on 256-token ones), so a
schedule balanced in FLOPs is not balanced in time. :func:`profiled_cost_model` returns a
:class:`~.cost_model.ProfiledCostModel` of forward+backward milliseconds per (q_len, kv_len) segment,
timed as CA-tasks run on a server (many segments fused in one varlen call), read from
``~/.cache/hf_longctx/cad_cost/`` (``HF_LONGCTX_CACHE`` moves the root) or profiled and written
there on first use. Where profiling cannot run, the FLOPs model stands in (and says so).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ...kernels import attention_backward, attention_forward, kernel_call, select_kernel
from .cost_model import PAIRS, CostModel, FlopsCostModel, ProfiledCostModel

log = logging.getLogger(__name__)

DEFAULT_Q_LENS = (128, 512, 2048, 8192, 32768, 131072)
DEFAULT_KV_LENS = (128, 512, 2048, 8192, 32768, 131072, 524288)


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_segments(q_len: int, kv_len: int, copies: int, kernel: str, shape: SegmentShape, device: torch.device,
                  budget: ProfileBudget) -> float:
    """Milliseconds of forward+backward of ``copies`` identical segments in one varlen call, per segment."""
    g = torch.Generator(device=device).manual_seed(q_len * 7 + kv_len)
    q = torch.randn(copies * q_len, shape.heads, shape.head_dim, device=device, dtype=shape.dtype, generator=g)
    k = torch.randn(copies * kv_len, shape.kv_heads, shape.head_dim, device=device, dtype=shape.dtype, generator=g)
    v, dout = torch.randn_like(k), torch.randn_like(q)
    cu_q = [i * q_len for i in range(copies + 1)]
    cu_k = [i * kv_len for i in range(copies + 1)]

    def step() -> None:
        out, lse = attention_forward(q, k, v, cu_q, cu_k, q_len, kv_len, causal=True, kernel=kernel)
        attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, q_len, kv_len, causal=True, kernel=kernel)

    for _ in range(budget.warmup):
        step()
    times = []
    for _ in range(budget.reps):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3 / copies


def resolved_kernel(kernel: str, shape: SegmentShape, device: torch.device) -> str:
    """The kernel ``kernel`` ('auto' or a name) runs for a server's fused batch of causal segments."""
    # a server's batch holds task segments whose queries are fewer than their keys (a query shard and its causal
    # prefix): the kernel must serve those, not only square segments
    q = torch.empty(128, shape.heads, shape.head_dim, device=device, dtype=shape.dtype)
    kv = torch.empty(384, shape.kv_heads, shape.head_dim, device=device, dtype=shape.dtype)
    return select_kernel(kernel, kernel_call(q, kv, kv, [0, 64, 128], [0, 128, 384], 64, 256, causal=True))


def profile_segment_costs(kernel: str = "auto", device: torch.device | str = "cuda",
                          shape: SegmentShape = SegmentShape(), q_lens=DEFAULT_Q_LENS, kv_lens=DEFAULT_KV_LENS,
                          budget: ProfileBudget = ProfileBudget()) -> tuple[ProfiledCostModel, dict]:
    """Measure the (q_len, kv_len) grid on ``device``; (model in ms, metadata). Cells with q_len > kv_len
    and cells over ``budget.max_pairs`` are priced at a measured cell's rate per visible pair."""
    device = torch.device(device)
    name = resolved_kernel(kernel, shape, device)
    t0 = time.perf_counter()
    table = [[float("nan")] * len(kv_lens) for _ in q_lens]
    for i, ql in enumerate(q_lens):
        for j, kl in enumerate(kv_lens):
            if ql <= kl and PAIRS.cost(ql, kl) <= budget.max_pairs:
                copies = max(1, min(budget.min_tokens // ql, budget.max_kv_tokens // kl,
                                    int(budget.max_batch_pairs // PAIRS.cost(ql, kl))))
                table[i][j] = time_segments(ql, kl, copies, name, shape, device, budget)
    extrapolated = []
    measured = [(i, j) for i in range(len(q_lens)) for j in range(len(kv_lens)) if table[i][j] == table[i][j]]
    if not measured:
        raise ValueError("no grid cell fits the profiling budget; raise max_pairs or add smaller lengths")
    for i, ql in enumerate(q_lens):
        row = [j for j in range(len(kv_lens)) if table[i][j] == table[i][j]]
        ref_i, ref_j = ((i, max(row, key=lambda j: kv_lens[j])) if row else
                        min(measured, key=lambda c: (abs(c[0] - i), -kv_lens[c[1]])))
        rate = table[ref_i][ref_j] / PAIRS.cost(q_lens[ref_i], kv_lens[ref_j])
        for j, kl in enumerate(kv_lens):
            if table[i][j] != table[i][j]:
                table[i][j] = rate * PAIRS.cost(ql, kl)
                extrapolated.append([ql, kl])
    model = ProfiledCostModel.from_grid(q_lens, kv_lens, table, units="ms", interpolate="rate")
    meta = {"device": device_name(device), "kernel": name, "torch": torch.__version__, "heads": shape.heads,
            "kv_heads": shape.kv_heads, "head_dim": shape.head_dim, "dtype": str(shape.dtype),
            "mode": "fwd+bwd", "extrapolated": extrapolated, "seconds": round(time.perf_counter() - t0, 1)}
    return model, meta


def profiled_cost_model(kernel: str = "auto", device: torch.device | str | None = None,
                        shape: SegmentShape = SegmentShape(), *, profile_if_missing: bool = True,
                        q_lens=DEFAULT_Q_LENS, kv_lens=DEFAULT_KV_LENS, budget: ProfileBudget = ProfileBudget(),
                        ) -> tuple[CostModel, str]:
    """(cost model, where it came from): the cached profile of ``kernel`` on this device kind, profiled now
    when missing (``profile_if_missing``), else :class:`~.cost_model.FlopsCostModel`.

    ``device`` None means the current CUDA device, or the CPU without one (where FLOPs stand in unless a
    profile is asked for with an explicit ``device="cpu"``).
    """
    if device is None:
        if not torch.cuda.is_available():
            return FlopsCostModel(4.0 * shape.heads * shape.head_dim), "FLOPs (no GPU to profile)"
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    try:
        name = resolved_kernel(kernel, shape, device)
        path = cache_path(device, name, shape)
        if path.exists():
            data = json.loads(path.read_text())
            if list(data["q_lens"]) == list(q_lens) and list(data["kv_lens"]) == list(kv_lens):
                return ProfiledCostModel.load(path, interpolate="rate"), f"profiled {name} ({path})"
        if not profile_if_missing:
            return FlopsCostModel(4.0 * shape.heads * shape.head_dim), f"FLOPs (no profile at {path})"
        model, meta = profile_segment_costs(name, device, shape, q_lens, kv_lens, budget)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # ranks of one machine may profile at once
        model.save(tmp, **meta)
        os.replace(tmp, path)
        log.info("hf_longctx cad: profiled %s on %s in %.1f s -> %s", name, meta["device"], meta["seconds"], path)
        return model, f"profiled {name} now ({path})"
    except Exception as exc:  # noqa: BLE001 - any failure to profile leaves the FLOPs model, said why
        log.warning("hf_longctx cad: no profiled cost model (%s: %s); balancing FLOPs", type(exc).__name__, exc)
        return FlopsCostModel(4.0 * shape.heads * shape.head_dim), f"FLOPs (profiling failed: {exc})"
