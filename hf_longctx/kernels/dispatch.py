"""One entry point for single-device core attention, choosing among the available kernels.

Every backend calls :func:`attention_forward` / :func:`attention_backward` and never a kernel
directly, so kernels can be added or preferred without touching the distributed code. ``"auto"``
takes the fastest kernel that serves the input and logs its choice at debug level; an explicit
kernel that cannot serve the input raises a ValueError that says why.

``"auto"`` order: FlashAttention-4 (extra ``fa4``), cuDNN through its frontend on packed documents
(extra ``cudnn``), cuDNN's dense op for a few equal-shape document groups (no extra), torch's
FlashAttention-2, the reference. A missing extra is logged once with the command that installs
it; a kernel that fails at run time (a compile or graph build) is skipped for that configuration
from then on, with a warning.
"""

from __future__ import annotations

import logging
import math
from collections import Counter

import torch

from . import cudnn, cudnn_varlen, fa4, reference, torch_flash
from .buckets import bucket
from .validate import check_attention_inputs, check_window

logger = logging.getLogger("hf_longctx.kernels")

KERNELS = ("fa4", "cudnn_varlen", "cudnn", "torch_flash", "reference")
# Not a kernel: returns zeros at once, so a benchmark can time what surrounds the kernels (transfers,
# bookkeeping). Accepted by kernel= here, never by a recipe; results are garbage, only times are read.
SKIP_KERNEL = "skip"
_AUTO_ORDER = KERNELS
# Kernels shipped as optional extras: module, install hint.
_EXTRAS = {"fa4": fa4, "cudnn_varlen": cudnn_varlen}

_calls: Counter = Counter()
# (kernel, configuration) pairs that raised a runtime error under "auto" on this process; auto skips
# that kernel for that configuration from then on.
_broken: dict[tuple, str] = {}
_hinted: set[str] = set()


def stats() -> dict[str, int]:
    """Kernel call counters since the last :func:`reset_stats`, e.g. {'forward': 4, 'forward.reference': 4}."""
    return dict(_calls)


def reset_stats() -> None:
    _calls.clear()


def count(event: str) -> None:
    """Add one to a named counter of :func:`stats` (used by the layers above the kernels)."""
    _calls[event] += 1


def available_kernels(device: torch.device | str | None = None) -> list[str]:
    """Kernels usable on ``device`` (default: CUDA when present), fastest first."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    names = []
    if device.type == "cuda":
        probe = torch.empty(1, 1, 128, dtype=torch.bfloat16, device=device)
        names += [name for name, module in _EXTRAS.items()
                  if module.is_installed() and _reason(name, probe, probe, [0, 1], [0, 1], True) is None]
        if torch.backends.cudnn.is_available() and hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
            names.append("cudnn")
        if hasattr(torch.ops.aten, "_flash_attention_forward"):
            names.append("torch_flash")
    names.append("reference")
    return names


def _host_list(cu: torch.Tensor | list[int] | tuple[int, ...]) -> list[int]:
    return cu.tolist() if isinstance(cu, torch.Tensor) else list(cu)


def _device_int32(cu: torch.Tensor | list[int], device: torch.device) -> torch.Tensor:
    if isinstance(cu, list):
        return torch.tensor(cu, dtype=torch.int32).to(device, non_blocking=True)
    return cu.to(device=device, dtype=torch.int32, non_blocking=True)


def _reason(name: str, q, k, cu_q: list[int], cu_k: list[int], causal: bool, window: int | None = None) -> str | None:
    if name == "fa4":
        return fa4.unsupported_reason(q, k)
    if name == "cudnn_varlen":
        return cudnn_varlen.unsupported_reason(q, cu_q, cu_k, causal, window)
    if name == "cudnn":
        return cudnn.unsupported_reason(q, k, cu_q, cu_k, causal, window)
    if name == "torch_flash":
        return torch_flash.unsupported_reason(q)
    if name == "reference":
        return None
    raise ValueError(f"unknown kernel {name!r}; choose one of {', '.join(('auto',) + KERNELS)}")


def select_kernel(kernel: str, q, k, cu_q: list[int], cu_k: list[int], causal: bool,
                  window: int | None = None) -> str:
    """Resolve ``kernel`` ('auto' or a name) to a kernel that serves these inputs, or raise ValueError."""
    if kernel == SKIP_KERNEL:
        return kernel
    if kernel != "auto":
        reason = _reason(kernel, q, k, cu_q, cu_k, causal, window)
        if reason:
            raise ValueError(f"kernel {kernel!r} cannot run this input: {reason}")
        return kernel
    for name in _AUTO_ORDER:
        if _broken and _config_key(name, q, k, cu_q, cu_k, causal, window) in _broken:  # key only after a failure
            continue
        if _reason(name, q, k, cu_q, cu_k, causal, window) is None:
            logger.debug("auto kernel: %s for q %s %s causal=%s window=%s", name, tuple(q.shape), q.dtype, causal,
                         window)
            return name
        _hint_missing_extra(name, q)
    raise AssertionError("the reference kernel serves every input")


def _hint_missing_extra(name: str, q: torch.Tensor) -> None:
    """Say once per process that a faster kernel exists for this GPU and how to install it."""
    module = _EXTRAS.get(name)
    if module is None or name in _hinted or module.is_installed() or not module.worth_installing(q.device):
        return
    _hinted.add(name)
    logger.warning("kernel %s is not installed, 'auto' uses a slower one; %s", name, module.INSTALL_HINT)


def _config_key(name: str, q, k, cu_q: list[int], cu_k: list[int], causal: bool, window: int | None) -> tuple:
    """What a kernel compiles or plans for: dtype, heads, head dim, masks, bucketed segment shape."""
    lengths = [b - a for a, b in zip(cu_q, cu_q[1:])] or [0]
    return (name, q.dtype, q.shape[1], k.shape[1], q.shape[2], causal, window is not None, bucket(len(cu_q) - 1),
            bucket(max(lengths)))


def _prepare(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, window):
    cu_q = _host_list(cu_seqlens_q)
    cu_k = _host_list(cu_seqlens_k)
    check_attention_inputs(
        q, k, v, torch.tensor(cu_q, dtype=torch.int64), torch.tensor(cu_k, dtype=torch.int64)
    )
    check_window(window)
    # A window at least as long as every key segment hides nothing: drop it, so kernels without
    # sliding-window support still serve the call.
    if window is not None and window >= max((b - a for a, b in zip(cu_k, cu_k[1:])), default=0):
        window = None
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return cu_q, cu_k, scale, window


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | list[int],
    cu_seqlens_k: torch.Tensor | list[int],
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = True,
    softmax_scale: float | None = None,
    kernel: str = "auto",
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Core attention over packed segments: (out (Tq, Hq, D), lse (Hq, Tq)).

    Segment i pairs queries cu_seqlens_q[i]:cu_seqlens_q[i+1] with keys cu_seqlens_k[i]:cu_seqlens_k[i+1].
    Masks are bottom-right aligned: with Sq queries and Sk keys in a segment and o = Sk - Sq, query i
    lies on the diagonal of key i + o. Query i sees key j iff

    - ``causal=True``: ``j <= i + o``, and with ``window=w`` also ``j > i + o - w``: the w keys ending
      at the diagonal (flash-attn's ``window_size=(w - 1, 0)``). On a square segment of one document
      this is exactly transformers' ``sliding_window=w``: position p sees positions p - w + 1 .. p.
    - ``causal=False``: every key, and with ``window=w`` only ``j > i + o - w``: the band is bounded on
      the left and open to the right (flash-attn's ``window_size=(w - 1, -1)``). This is what an
      off-diagonal block needs, where every key precedes every query: a backend that holds keys
      ending ``g`` positions before the last query of a segment passes ``w = W - g`` for a sliding
      window of W (see :mod:`hf_longctx.layout.pairs`).

    ``window`` is an int >= 1 or None (no window); one window applies to every segment of the call.
    Rows without a visible key give out 0, lse -inf (never NaN). lse is float32 (float64 for
    float64 inputs).
    """
    cu_q, cu_k, scale, window = _prepare(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, window)
    return _first_kernel_that_runs(
        kernel, q, k, cu_q, cu_k, causal, window,
        lambda name: _forward(name, q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, causal, scale, window))


def _first_kernel_that_runs(kernel: str, q, k, cu_q, cu_k, causal: bool, window: int | None, call):
    """``call(name)`` with the selected kernel. Under ``auto``, a kernel that fails (a compile, graph build or
    launch) is marked broken for this configuration and the next one in the order runs; ``reference``
    is last and its errors, like those of a kernel named explicitly, are raised."""
    while True:
        name = select_kernel(kernel, q, k, cu_q, cu_k, causal, window)
        try:
            return call(name)
        except Exception as exc:  # noqa: BLE001 - any failure of a kernel falls back to the next one
            if kernel != "auto" or name == "reference":
                raise
            _mark_broken(_config_key(name, q, k, cu_q, cu_k, causal, window), exc)


def _mark_broken(key: tuple, exc: Exception) -> None:
    _broken[key] = str(exc)
    logger.warning("kernel %s failed (%s); 'auto' uses the next kernel for this configuration from now on",
                   key[0], exc)


def _forward(name, q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, causal, scale, window=None):
    if name == SKIP_KERNEL:
        return torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    _calls["forward"] += 1
    _calls[f"forward.{name}"] += 1
    if name == "reference":
        return reference.reference_forward(q, k, v, cu_q, cu_k, causal, scale, window)
    if name == "cudnn":
        return cudnn.forward(q, k, v, cu_q, cu_k, causal, scale)
    if name == "cudnn_varlen":
        return cudnn_varlen.forward(q, k, v, cu_q, cu_k, causal, scale, window)
    if name == "fa4":
        return fa4.forward(q, k, v, _device_int32(cu_q, q.device), _device_int32(cu_k, q.device), max_seqlen_q,
                           max_seqlen_k, causal, scale, window)
    return torch_flash.forward(
        q, k, v, _device_int32(cu_q, q.device), _device_int32(cu_k, q.device), max_seqlen_q, max_seqlen_k,
        causal, scale, window,
    )


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor | list[int],
    cu_seqlens_k: torch.Tensor | list[int],
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = True,
    softmax_scale: float | None = None,
    kernel: str = "auto",
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) given the FINAL out and lse of the query rows.

    Passing the final (merged) out/lse rather than this call's partial ones is what lets the
    gradients of attention split over several key blocks add up exactly. ``causal`` and ``window``
    mean what they mean in :func:`attention_forward` and must be the forward call's.
    """
    cu_q, cu_k, scale, window = _prepare(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, window)
    if dout.shape != q.shape or out.shape != q.shape:
        raise ValueError(f"dout {tuple(dout.shape)} and out {tuple(out.shape)} must match q {tuple(q.shape)}")
    if lse.shape != (q.shape[1], q.shape[0]):
        raise ValueError(f"lse must have shape (heads, tokens) = {(q.shape[1], q.shape[0])}, got {tuple(lse.shape)}")
    return _first_kernel_that_runs(
        kernel, q, k, cu_q, cu_k, causal, window,
        lambda name: _backward(name, dout, q, k, v, out, lse, cu_q, cu_k, max_seqlen_q, max_seqlen_k, causal, scale,
                               window))


def _backward(name, dout, q, k, v, out, lse, cu_q, cu_k, max_seqlen_q, max_seqlen_k, causal, scale, window=None):
    if name == SKIP_KERNEL:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    _calls["backward"] += 1
    _calls[f"backward.{name}"] += 1
    if name == "reference":
        return reference.reference_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale, window)
    if name == "cudnn":
        return cudnn.backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale)
    if name == "cudnn_varlen":
        return cudnn_varlen.backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale, window)
    if name == "fa4":
        return fa4.backward(dout, q, k, v, out, lse, _device_int32(cu_q, q.device), _device_int32(cu_k, q.device),
                            max_seqlen_q, max_seqlen_k, causal, scale, window)
    return torch_flash.backward(
        dout, q, k, v, out, lse, _device_int32(cu_q, q.device), _device_int32(cu_k, q.device),
        max_seqlen_q, max_seqlen_k, causal, scale, window,
    )
