"""What one forward+backward of a backend will cost on a batch, before it runs: the cost model of ``auto``.

Why: the fastest exact backend depends on the batch (long documents favour Ulysses and CAD, short ones the
ring family), on the group (heads that split, nodes crossed) and on the kernel, by up to 1.6x. The placement of
tokens must be chosen before the batch is sharded, when nothing can be timed yet, so ``auto`` prices every
candidate on the batch first and times only the few that could win.

A prediction has two parts per rank, added for the slowest rank of each (:attr:`StepPrediction.step_s`, the
same no-overlap bound an emulated step reports):

- **kernels**: every backend lists the kernel segments each rank computes (:class:`RankWork`: query rows, key
  rows, causal, window, and the query heads they run for) and its kernel calls. A segment costs the 128 x 128
  tiles its mask touches (:func:`segment_tiles`: short documents and thin shards waste tile area) times a
  per-tile time, and a call costs a fixed time beyond its tiles; both are measured once per process on the
  device with the run's kernel and head shape (:func:`measure_kernel_rates`).
- **transfers**: every backend lists what each rank sends in each call to each peer
  (:data:`~hf_longctx.comm.links.Transfer`), counted the way the backend's own code sends it, and
  :class:`~hf_longctx.comm.links.LinkTiers` prices them: NVLink curves inside a node, the network between nodes.

A backend that cannot say (``Backend.rank_work`` returns None) is never an ``auto`` candidate.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..comm.collectives import all_reduce_max, collective_device, is_distributed
from ..comm.links import LinkTiers, Transfer
from ..kernels import accumulation_dtype, kernel_backward, kernel_call, kernel_forward
from ..layout import Pair

TILE = 128  # rows and keys of one block of the flash-attention kernels (FA2, FA4, cuDNN all tile by 128 here)

Segment = tuple[int, int, bool, "int | None"]  # (query rows, key rows, causal, window; None: no window)


@dataclass(frozen=True)
class AttentionShape:
    """The attention problem per token: query heads, key/value heads, head dim, and bytes per element.

    ``dtype_bytes`` is the element size of q, k, v and outputs; ``accum_bytes`` that of the log-sum-exp and of
    gradients accumulated across ranks (float32, or float64 for float64 inputs)."""

    heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    accum_bytes: int = 4

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor) -> AttentionShape:
        """The shape of local ``(tokens, heads, head_dim)`` q and k."""
        return cls(q.shape[1], k.shape[1], q.shape[2], q.element_size(),
                   torch.empty(0, dtype=accumulation_dtype(q.dtype)).element_size())

    @classmethod
    def of_dtype(cls, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> AttentionShape:
        item = torch.empty(0, dtype=dtype).element_size()
        return cls(heads, kv_heads, head_dim, item, torch.empty(0, dtype=accumulation_dtype(dtype)).element_size())

    def split_heads(self, parts: int, kv_repeat: int = 1) -> AttentionShape:
        """The shape one of ``parts`` head groups sees: heads / parts, KV heads repeated ``kv_repeat`` times then
        split (Ulysses)."""
        return AttentionShape(self.heads // parts, self.kv_heads * kv_repeat // parts, self.head_dim,
                              self.dtype_bytes, self.accum_bytes)

    # bytes of one token's row of each tensor that travels
    @property
    def q_row(self) -> int:
        return self.heads * self.head_dim * self.dtype_bytes

    @property
    def kv_row(self) -> int:
        """One of k or v."""
        return self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def lse_row(self) -> int:
        return self.heads * self.accum_bytes

    @property
    def q_grad_row(self) -> int:
        """dq accumulated across ranks."""
        return self.heads * self.head_dim * self.accum_bytes

    @property
    def kv_grad_row(self) -> int:
        """One of dk or dv accumulated across ranks."""
        return self.kv_heads * self.head_dim * self.accum_bytes


@dataclass
class RankWork:
    """One rank's share of a forward+backward: its kernel segments (each run forward and backward, for
    ``heads`` query heads), its kernel calls (forward and backward together), and its transfers."""

    segments: list[Segment] = field(default_factory=list)
    calls: int = 0
    transfers: list[Transfer] = field(default_factory=list)
    heads: int = 0

    def sent(self, kind: str, bytes_to: dict[int, int]) -> None:
        """Record one call that sends ``bytes_to`` (peer -> bytes); nothing when it sends nothing."""
        bytes_to = {p: b for p, b in bytes_to.items() if b}
        if bytes_to:
            self.transfers.append((kind, bytes_to))

    @property
    def sent_bytes(self) -> int:
        return sum(sum(b.values()) for _, b in self.transfers)


def pair_segments(pair: Pair) -> list[Segment]:
    """The kernel segments of one kernel call of a schedule (:class:`~hf_longctx.layout.Pair`)."""
    return [(qb - qa, kb - ka, pair.causal, pair.window)
            for qa, qb, ka, kb in zip(pair.cu_q, pair.cu_q[1:], pair.cu_k, pair.cu_k[1:]) if qb > qa and kb > ka]


def segment_tiles(q_rows: int, k_rows: int, causal: bool, window: int | None = None, tile: int = TILE) -> int:
    """Tiles of ``tile`` x ``tile`` (query rows x keys) a flash kernel visits for one segment: every tile row
    visits the key tiles between its first row's first visible key and its last row's last visible key
    (bottom-right causal masks, windows as transformers' ``sliding_window``)."""
    if q_rows <= 0 or k_rows <= 0:
        return 0
    if not causal and window is None:
        return -(-q_rows // tile) * -(-k_rows // tile)
    offset = k_rows - q_rows  # query i sees keys up to i + offset (causal)
    total = 0
    for start in range(0, q_rows, tile):
        last = min(q_rows, start + tile) - 1
        hi = min(k_rows, last + offset + 1) if causal else k_rows
        lo = max(0, start + offset - window + 1) if window is not None else 0
        if hi > lo:
            total += (hi - 1) // tile - lo // tile + 1
    return total


@dataclass(frozen=True)
class KernelRates:
    """What the run's kernel costs on this device: seconds per tile per query head (forward + backward), and per
    kernel call beyond its tiles. Measured by :func:`measure_kernel_rates`; every rank of a group holds the same."""

    tile_head_s: float
    call_s: float
    kernel: str = "auto"
    device: str = "cpu"

    def seconds(self, work: RankWork) -> float:
        tiles = sum(segment_tiles(q, k, c, w) for q, k, c, w in work.segments)
        return tiles * work.heads * self.tile_head_s + work.calls * self.call_s


@dataclass(frozen=True)
class StepPrediction:
    """Predicted seconds of every rank's kernels and transfers for one forward+backward of ``backend``."""

    backend: str
    strategy: str
    kernel_s: tuple[float, ...]
    transfer_s: tuple[float, ...]

    @property
    def step_s(self) -> float:
        """The slowest rank's kernels plus the slowest rank's transfers (no overlap: an upper bound)."""
        return max(self.kernel_s, default=0.0) + max(self.transfer_s, default=0.0)


def predict(backend: str, strategy: str, work: Sequence[RankWork], rates: KernelRates,
            tiers: LinkTiers) -> StepPrediction:
    """``work`` (one :class:`RankWork` per rank) priced under ``rates`` and ``tiers``."""
    return StepPrediction(backend, strategy, tuple(rates.seconds(w) for w in work),
                          tuple(tiers.seconds(r, w.transfers) for r, w in enumerate(work)))


# ----------------------------------------------------------------------------- measuring the kernel

# Segment lengths of the two calls timed: one long enough that its tiles dwarf the call's own cost, one of a
# single tile. The CPU's reference kernel is slow, so its long segment is shorter.
MEASURE_LONG = {"cuda": 8192, "cpu": 512}
MEASURE_REPS = 3

_RATES: dict[tuple, KernelRates] = {}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_forward(run: Callable[[], object], device: torch.device, reps: int = 2) -> float:
    """Median wall seconds of ``run()`` after one warm-up call (device synchronised): how ``auto`` times a kernel at
    launch and a candidate's forward on the group."""
    run()
    times = []
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _time_forward_backward(length: int, shape: AttentionShape, dtype: torch.dtype, device: torch.device,
                           kernel: str) -> float:
    """Median seconds of one forward and one backward kernel call on one causal segment of ``length`` tokens."""
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(length, shape.heads, shape.head_dim, dtype=dtype, device=device, generator=g)
    k = torch.randn(length, shape.kv_heads, shape.head_dim, dtype=dtype, device=device, generator=g)
    v = torch.randn_like(k)
    dout = torch.randn_like(q)
    call = kernel_call(q, k, v, (0, length), (0, length), length, length, causal=True)

    def once() -> None:
        out, lse = kernel_forward(call, kernel)
        kernel_backward(call, dout, out, lse, kernel)

    with torch.no_grad():
        return time_forward(once, device, reps=MEASURE_REPS)  # its warm-up call compiles, plans, allocates


def measure_kernel_rates(kernel: str, device: torch.device | str, shape: AttentionShape, dtype: torch.dtype,
                         group: dist.ProcessGroup | None = None) -> KernelRates:
    """Time the kernel on this device (one long causal segment, one of a single tile, forward + backward) and
    solve for its per-tile and per-call seconds; measured once per process and (kernel, device, shape).

    With a ``group``, every rank measures and all take the slowest rank's figures (one all_reduce): the ranks
    must price candidates alike to reach the same choice. Every rank of the group must call this together."""
    device = torch.device(device)
    key = (kernel, str(device), shape, dtype)
    rates = _RATES.get(key)
    if rates is None:
        long = MEASURE_LONG["cuda" if device.type == "cuda" else "cpu"]
        t_long = _time_forward_backward(long, shape, dtype, device, kernel)
        t_short = _time_forward_backward(TILE, shape, dtype, device, kernel)
        tiles = segment_tiles(long, long, True) - 1
        tile_head_s = max(t_long - t_short, 1e-12) / (tiles * shape.heads)
        call_s = max(t_short - shape.heads * tile_head_s, 0.0) / 2  # a forward and a backward call
        rates = KernelRates(tile_head_s, call_s, kernel, str(device))
    if is_distributed(group):
        agreed = torch.tensor([rates.tile_head_s, rates.call_s], dtype=torch.float64, device=collective_device(group))
        all_reduce_max(agreed, group)
        rates = KernelRates(float(agreed[0]), float(agreed[1]), kernel, str(device))
    _RATES[key] = rates
    return rates


def fixed_rates(tflops: float, call_s: float = 0.0, kernel: str = "auto", device: str = "cpu",
                head_dim: int = 128) -> KernelRates:
    """Rates of a kernel that runs ``tflops`` TFLOP/s forward + backward on full tiles (3.5 x the forward's
    4 * head_dim FLOPs per visible pair): for tests and for pricing a device that is not at hand."""
    flops_per_tile_head = 3.5 * 4.0 * head_dim * TILE * TILE
    return KernelRates(flops_per_tile_head / (tflops * 1e12), call_s, kernel, device)

