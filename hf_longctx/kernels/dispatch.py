"""One entry point for single-device core attention, choosing among the registered kernels.

Every backend builds one :class:`~.contract.KernelCall` per block of segments (:func:`kernel_call`) and
runs it with :func:`kernel_forward` / :func:`kernel_backward`, never a kernel directly, so kernels can be
added (:func:`~.registry.register_kernel`) or preferred without touching the distributed code.
``"auto"`` takes the first kernel of the registry's ``auto`` order that serves the call and logs its
choice at debug level; an explicit kernel that cannot serve the call raises a ValueError that says why,
and an unregistered name raises one that lists the registered kernels.

A kernel shipped as a missing extra is named once with the command that installs it; a kernel that
fails at run time (a compile or graph build) is skipped under ``auto`` for that configuration from then
on, with a warning.
"""

from __future__ import annotations

import logging
import math
from collections import Counter

import torch

from .contract import Kernel, KernelCall
from .key_split import KeySplit, plan_key_split, split_forward
from .registry import AUTO, REGISTRY, auto_order, get_kernel
from .validate import check_attention_inputs, check_window

logger = logging.getLogger("hf_longctx.kernels")

# Not a kernel: returns zeros at once, so a benchmark can time what surrounds the kernels (transfers,
# bookkeeping). Accepted by kernel= here, never by a recipe; results are garbage, only times are read.
SKIP_KERNEL = "skip"

_calls: Counter = Counter()
# (kernel, configuration) pairs that raised a runtime error under "auto" on this process; auto skips
# that kernel for that configuration from then on.
_broken: dict[tuple, str] = {}
_hinted: set[str] = set()


def stats() -> dict[str, int]:
    """Call counters since the last :func:`reset_stats`, e.g. {'forward': 4, 'forward.reference': 4}."""
    return dict(_calls)


def reset_stats() -> None:
    _calls.clear()


def count(event: str) -> None:
    """Add one to a named counter of :func:`stats` (used by the layers above the kernels)."""
    _calls[event] += 1


def available_kernels(device: torch.device | str | None = None) -> list[str]:
    """Registered kernels usable on ``device`` (default: CUDA when present), in ``auto``'s order first."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    probe_q = torch.empty(1, 1, 128, dtype=torch.bfloat16, device=torch.device(device))
    probe = KernelCall(probe_q, probe_q, probe_q, (0, 1), (0, 1), 1, 1, True, 1.0, None)
    order = auto_order()
    names = order + [k.name for k in REGISTRY if k.name not in order]
    return [name for name in names if get_kernel(name).supports(probe) is None]


def kernel_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | list[int] | tuple[int, ...],
    cu_seqlens_k: torch.Tensor | list[int] | tuple[int, ...],
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    window: int | None = None,
) -> KernelCall:
    """The checked call every kernel receives: offsets on the host, the scale fixed, a useless window dropped.

    A window at least as long as every key segment hides nothing, so it is dropped here: kernels without
    sliding-window support still serve the call.
    """
    cu_q, cu_k = _host_offsets(cu_seqlens_q), _host_offsets(cu_seqlens_k)
    check_attention_inputs(q, k, v, torch.tensor(cu_q, dtype=torch.int64), torch.tensor(cu_k, dtype=torch.int64))
    check_window(window)
    if window is not None and window >= max((b - a for a, b in zip(cu_k, cu_k[1:])), default=0):
        window = None
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return KernelCall(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, causal, scale, window)


def _host_offsets(cu: torch.Tensor | list[int] | tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(x) for x in (cu.tolist() if isinstance(cu, torch.Tensor) else cu))


class _Skip:
    """The benchmark's stand-in (:data:`SKIP_KERNEL`): zeros of the right shapes, no counting."""

    name = SKIP_KERNEL

    def supports(self, call: KernelCall) -> str | None:
        return None

    def forward(self, call: KernelCall) -> tuple[torch.Tensor, torch.Tensor]:
        q = call.q
        return torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)

    def backward(self, call: KernelCall, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return torch.zeros_like(call.q), torch.zeros_like(call.k), torch.zeros_like(call.v)


_SKIP = _Skip()


def _lookup(name: str) -> Kernel:
    return _SKIP if name == SKIP_KERNEL else get_kernel(name)


def select_kernel(kernel: str, call: KernelCall) -> str:
    """Resolve ``kernel`` ('auto' or a registered name) to a kernel that serves ``call``, or raise ValueError."""
    if kernel != AUTO:
        reason = _lookup(kernel).supports(call)
        if reason:
            raise ValueError(f"kernel {kernel!r} cannot run this input: {reason}")
        return kernel
    configuration = call.configuration() if _broken else None  # built only after a failure
    for name in auto_order():
        if configuration is not None and (name, configuration) in _broken:
            continue
        candidate = get_kernel(name)
        if candidate.supports(call) is None:
            logger.debug("auto kernel: %s for q %s %s causal=%s window=%s", name, tuple(call.q.shape),
                         call.q.dtype, call.causal, call.window)
            return name
        _hint_missing_extra(candidate, call.q.device)
    raise ValueError(f"no kernel of auto's order {auto_order()} serves this input")


def _hint_missing_extra(kernel: Kernel, device: torch.device) -> None:
    """Say once per process that a faster kernel exists for this device and how to install it."""
    missing_extra = getattr(kernel, "missing_extra", None)  # optional: only kernels shipped as extras have it
    if missing_extra is None or kernel.name in _hinted:
        return
    hint = missing_extra(device)
    if hint:
        _hinted.add(kernel.name)
        logger.warning("kernel %s is not installed, 'auto' uses a slower one; %s", kernel.name, hint)


def _first_kernel_that_runs(kernel: str, call: KernelCall, direction: str, run):
    """``run(kernel)`` with the selected kernel. Under ``auto``, a kernel that fails (a compile, graph build or
    launch) is marked broken for this configuration and the next one in the order runs; the last candidate's
    errors, like those of a kernel named explicitly, are raised. Running out of memory is not a broken kernel:
    it is raised at once (the next kernels, the reference last, need more memory, and the fast kernel would be
    marked broken for good)."""
    while True:
        name = select_kernel(kernel, call)
        chosen = _lookup(name)
        if chosen is not _SKIP:
            _calls[direction] += 1
            _calls[f"{direction}.{name}"] += 1
        try:
            return run(chosen)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - any other failure of a kernel falls back to the next one
            if kernel != AUTO or name == auto_order()[-1]:
                raise
            _broken[(name, call.configuration())] = str(exc)
            logger.warning("kernel %s failed (%s); 'auto' uses the next kernel for this configuration from now on",
                           name, exc)


def kernel_forward(call: KernelCall, kernel: str = AUTO) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (Tq, Hq, D), lse (Hq, Tq)) of ``call`` on ``kernel`` ('auto' or a registered name)."""
    return _first_kernel_that_runs(kernel, call, "forward", lambda chosen: chosen.forward(call))


def kernel_backward(call: KernelCall, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                    kernel: str = AUTO) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of ``call`` given the FINAL out and lse of its query rows.

    Passing the final (merged) out/lse rather than this block's partial ones is what lets the gradients
    of attention split over several key blocks add up exactly.
    """
    q = call.q
    if dout.shape != q.shape or out.shape != q.shape:
        raise ValueError(f"dout {tuple(dout.shape)} and out {tuple(out.shape)} must match q {tuple(q.shape)}")
    if lse.shape != (q.shape[1], q.shape[0]):
        raise ValueError(f"lse must have shape (heads, tokens) = {(q.shape[1], q.shape[0])}, got {tuple(lse.shape)}")
    return _first_kernel_that_runs(kernel, call, "backward", lambda chosen: chosen.backward(call, dout, out, lse))


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
    kernel: str = AUTO,
    window: int | None = None,
    key_split: KeySplit | None = None,
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
    float64 inputs). The same as ``kernel_forward(kernel_call(...), kernel)``, except with ``key_split``: a call
    of few long blocks then runs as chunks of its keys, merged (:mod:`.key_split`; never under a window).
    """
    call = kernel_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                       softmax_scale=softmax_scale, window=window)
    if key_split is not None and call.window is None:
        cu_q, cu_k = call.cu_seqlens_q, call.cu_seqlens_k
        cuts = plan_key_split([b - a for a, b in zip(cu_q, cu_q[1:])], [b - a for a, b in zip(cu_k, cu_k[1:])],
                              q.shape[1], key_split, causal)
        if cuts is not None:
            def one_call(q_, k_, v_, cq, ck, mq, mk, causal):
                return kernel_forward(kernel_call(q_, k_, v_, cq, ck, mq, mk, causal=causal,
                                                  softmax_scale=call.softmax_scale), kernel)

            count("forward.key_split")
            return split_forward(q, k, v, cu_q, cu_k, cuts, causal, one_call)
    return kernel_forward(call, kernel)


def attention_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor | list[int], cu_seqlens_k: torch.Tensor | list[int], max_seqlen_q: int,
    max_seqlen_k: int, causal: bool = True, softmax_scale: float | None = None, kernel: str = AUTO,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) given the FINAL out and lse of the query rows (see :func:`kernel_backward`).

    ``causal`` and ``window`` mean what they mean in :func:`attention_forward` and must be the forward call's.
    """
    call = kernel_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                       softmax_scale=softmax_scale, window=window)
    return kernel_backward(call, dout, out, lse, kernel)
