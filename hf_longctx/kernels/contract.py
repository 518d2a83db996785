"""What a single-device kernel is: one typed call object in, (out, lse) or (dq, dk, dv) out.

Every caller (the schedule engine per pair, the runner backends, the one-process path) builds ONE
:class:`KernelCall` for a block of packed segments with :func:`~hf_longctx.kernels.kernel_call`, which
checks the inputs once, fixes the scale and drops a window that hides nothing. A kernel then only
answers three questions about that call, so no kernel ever re-parses arguments or guesses at types:

* :meth:`Kernel.supports`: ``None`` when it can run the call, else one sentence saying why not (what
  an explicit ``kernel=`` request raises, and what ``auto`` skips past);
* :meth:`Kernel.forward`: ``(out (Tq, Hq, D), lse (Hq, Tq) float32)``;
* :meth:`Kernel.backward`: ``(dq, dk, dv)`` from the FINAL out and lse of the query rows.

Masks are bottom-right aligned and a row without a visible key gives out 0, lse -inf (see
:func:`~hf_longctx.kernels.attention_forward` for the exact rule, windows included).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Protocol, runtime_checkable

import torch

from .buckets import bucket


@dataclass(frozen=True)
class KernelCall:
    """One kernel call on packed segments: segment i pairs queries ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``
    with keys ``cu_seqlens_k[i]:cu_seqlens_k[i+1]``.

    The offsets are kept on the host (kernels that plan per segment read them without a device sync);
    :attr:`cu_seqlens_q_device` / :attr:`cu_seqlens_k_device` are the int32 device copies the varlen
    GPU kernels take, made on first use and then kept with the call.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_q: tuple[int, ...]
    cu_seqlens_k: tuple[int, ...]
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool
    softmax_scale: float
    window: int | None

    @cached_property
    def cu_seqlens_q_device(self) -> torch.Tensor:
        return int32_on(self.cu_seqlens_q, self.q.device)

    @cached_property
    def cu_seqlens_k_device(self) -> torch.Tensor:
        return int32_on(self.cu_seqlens_k, self.q.device)

    @property
    def num_segments(self) -> int:
        return len(self.cu_seqlens_q) - 1

    def configuration(self) -> tuple:
        """What a kernel compiles or plans for: dtype, heads, head dim, masks, bucketed segment shape.

        ``auto`` remembers a kernel that failed under this key and skips it for calls of the same key.
        """
        q, cu = self.q, self.cu_seqlens_q
        longest = max((b - a for a, b in zip(cu, cu[1:])), default=0)
        return (q.dtype, q.shape[1], self.k.shape[1], q.shape[2], self.causal, self.window is not None,
                bucket(self.num_segments), bucket(longest))


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor (a call's offsets or index table) on ``device``. To a GPU through pinned host memory: a
    copy from pageable memory makes the host wait for the device's stream to drain first, so every kernel call
    would stall the launch queue."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def int32_on(cu: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``cu`` as int32 on ``device`` (:func:`host_to_device`)."""
    return host_to_device(torch.tensor(cu, dtype=torch.int32), device)


@runtime_checkable
class Kernel(Protocol):
    """A single-device attention kernel, registered by name with :func:`~hf_longctx.kernels.register_kernel`.

    A kernel shipped as an optional extra may also define ``missing_extra(device) -> str | None``: the
    install command when the extra is absent and would give ``device`` a faster kernel (``auto`` logs it
    once per process). A kernel that launches one block per tile in a fixed order may define
    ``launch_grid(head_dim) -> LaunchGrid | None`` (:mod:`~hf_longctx.kernels.launch`), by which cost models
    price the tail of its calls (a grid with a ``forward_key_split`` rule also has a forward call of few long blocks
    run as chunks of its keys, :mod:`~hf_longctx.kernels.key_split`; its ``launch_order`` says how blocks are
    launched), ``packs_query_heads(heads, kv_heads) -> int``: query heads its forward packs into one tile's rows
    (the forward tile's rows are then shared by that many heads), and ``backward_keys_limit(heads, kv_heads,
    head_dim, itemsize) -> int | None``: keys per backward call past which it slows down per key (a server cuts its
    calls under it).
    """

    name: str

    def supports(self, call: KernelCall) -> str | None:
        """None when this kernel runs ``call``; otherwise why not, in one sentence."""
        ...

    def forward(self, call: KernelCall) -> tuple[torch.Tensor, torch.Tensor]:
        """(out like q, lse (Hq, Tq) float32, float64 for float64 inputs)."""
        ...

    def backward(self, call: KernelCall, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dq, dk, dv) like q, k, v, given the FINAL out and lse of the call's query rows."""
        ...
