"""Layer checkpoints in pinned host memory, copied off and back on side streams.

With every decoder layer checkpointed, what stays on the GPU between forward and backward is each
layer's input (tokens x hidden) and, under recompute-aware checkpointing, each layer's kept
core-attention output (the same size again). At 32 layers and 512K tokens that is 128-256 GiB: it,
not the weights, is what caps the context of one GPU. :class:`CheckpointOffloader` moves both to
pinned host memory:

* the layer input is saved by ``torch.utils.checkpoint`` through autograd's saved-tensor mechanism,
  so an outer ``saved_tensors_hooks`` pair copies it to the host in forward and back in backward;
* the kept attention outputs live in the selective-checkpoint cache, out of the hooks' reach, so the
  offloader copies them to the host after the layer's forward and releases their device storage
  (the cache's own tensors share that storage); the backward writes the bytes back into the same
  storage before the layer is recomputed, without touching any tensor's version counter.

Copies to the host run on their own stream and never stall the forward. In backward, restoring layer
``i`` also starts copying layer ``i-1`` back on a second stream, so the transfer of the next layer
to recompute overlaps this layer's recompute and backward. On a CPU-only machine the same code runs
synchronously (the "host copy" is a clone), which keeps the mechanism testable without a GPU.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils.checkpoint import checkpoint

from ...backends.op import ATTENTION_OUTPUTS

MIN_OFFLOAD_BYTES = 1 << 20  # small tensors (masks, scalars) are not worth a transfer


def _owns_its_storage(t: torch.Tensor) -> bool:
    """True when ``t`` is the whole of its storage, so releasing the storage frees nothing else."""
    return (t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


class _Streams:
    """Side streams for the copies (None on CPU, where copies are synchronous)."""

    def __init__(self, device: torch.device):
        cuda = device.type == "cuda"
        self.d2h = torch.cuda.Stream(device) if cuda else None
        self.h2d = torch.cuda.Stream(device) if cuda else None


class _Saved:
    """One tensor saved by autograd for a layer's backward: its host copy and, once back, its device copy."""

    __slots__ = ("device", "host", "copied", "value")

    def __init__(self, device: torch.device, host: torch.Tensor, copied):
        self.device, self.host, self.copied, self.value = device, host, copied, None


class _Kept:
    """One selective-checkpoint output whose device storage is released between the passes."""

    __slots__ = ("tensor", "nbytes", "host", "copied")

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.nbytes, self.host, self.copied = tensor, tensor.untyped_storage().nbytes(), None, None

    def write_back(self) -> None:
        t, storage = self.tensor, self.tensor.untyped_storage()
        storage.resize_(self.nbytes)
        # a fresh tensor on the same storage: the copy leaves the cached tensor's version counter alone
        alias = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, t.shape, t.stride())
        alias.copy_(self.host, non_blocking=self.host.is_pinned())


class _Slot:
    """Everything one checkpointed layer keeps for its backward, on the host between the passes."""

    def __init__(self, offloader: CheckpointOffloader, previous: _Slot | None):
        self.offloader = offloader
        self.previous = weakref.ref(previous) if previous is not None else None
        self.saved: list[_Saved] = []
        self.kept: list[_Kept] = []
        self.prefetched = None  # a CUDA event once the copy back was started on the side stream
        self.restored = False

    # forward --------------------------------------------------------------------------------
    def _to_host(self, t: torch.Tensor):
        streams = self.offloader.streams_for(t.device)
        if streams.d2h is None:
            return t.detach().clone(), None
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        streams.d2h.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(streams.d2h):
            host.copy_(t, non_blocking=True)
            t.record_stream(streams.d2h)  # the allocator reuses t's memory only after the copy
            copied = torch.cuda.Event()
            copied.record(streams.d2h)
        return host, copied

    def pack(self, t: torch.Tensor):
        """saved_tensors_hooks pack: large floating-point tensors go to the host, the rest stay."""
        nbytes = t.numel() * t.element_size()
        if nbytes < self.offloader.min_bytes or not t.is_floating_point():
            return t
        self.saved.append(_Saved(t.device, *self._to_host(t)))
        self.offloader.bytes_offloaded += nbytes
        return (self, len(self.saved) - 1)

    def keep(self, t: torch.Tensor) -> None:
        """Remember a selective-checkpoint output whose storage can move to the host after the forward."""
        if t.numel() * t.element_size() >= self.offloader.min_bytes and _owns_its_storage(t):
            self.kept.append(_Kept(t))

    def release_kept(self) -> None:
        """Copy the kept outputs to the host and free their device storage (after the layer's forward)."""
        for kept in self.kept:
            kept.host, kept.copied = self._to_host(kept.tensor)
            kept.tensor.untyped_storage().resize_(0)
            self.offloader.bytes_offloaded += kept.nbytes

    # backward -------------------------------------------------------------------------------
    def _device(self) -> torch.device | None:
        if self.saved:
            return self.saved[0].device
        return self.kept[0].tensor.device if self.kept else None

    def prefetch(self) -> None:
        """Start copying this slot back on the side stream (no-op on CPU, or when already started)."""
        if self.restored or self.prefetched is not None or self._device() is None:
            return
        h2d = self.offloader.streams_for(self._device()).h2d
        if h2d is None:
            return
        with torch.cuda.stream(h2d):
            for item in (*self.saved, *self.kept):
                if item.copied is not None:
                    h2d.wait_event(item.copied)
            for saved in self.saved:
                saved.value = saved.host.to(saved.device, non_blocking=True)
            for kept in self.kept:
                kept.write_back()
            self.prefetched = torch.cuda.Event()
            self.prefetched.record(h2d)

    def restore(self) -> None:
        """Make every tensor of this slot usable on the current stream again."""
        if self.restored:
            return
        self.prefetch()
        if self.prefetched is not None:
            main = torch.cuda.current_stream(self._device())
            main.wait_event(self.prefetched)
            for saved in self.saved:
                saved.value.record_stream(main)
            for kept in self.kept:
                kept.tensor.record_stream(main)
        else:  # CPU: synchronous copies
            for saved in self.saved:
                saved.value = saved.host.to(saved.device)
            for kept in self.kept:
                kept.write_back()
        for item in (*self.saved, *self.kept):
            item.host = item.copied = None
        self.restored = True

    def unpack(self, index: int) -> torch.Tensor:
        self.restore()
        previous = self.previous() if self.previous is not None else None
        if previous is not None:
            previous.prefetch()  # the next layer to recompute comes back while this one runs
        return self.saved[index].value


class CheckpointOffloader:
    """A ``torch.utils.checkpoint`` drop-in that keeps each layer's checkpoint in pinned host memory.

    Use it as transformers' per-layer checkpoint function (see
    :func:`~hf_longctx.hf.memory.checkpointing.enable_layer_checkpointing` with ``offload=True``). The
    checkpoint keyword arguments (``use_reentrant=False``, a selective ``context_fn``) pass through.
    """

    def __init__(self, keep_attention_outputs: bool | None, min_bytes: int = MIN_OFFLOAD_BYTES):
        # True under recompute-aware checkpointing, whose cache holds the core-attention outputs; None:
        # decided per call, by whether the call passes a selective-checkpoint context_fn (layers may differ)
        self.keep_attention_outputs = keep_attention_outputs
        self.min_bytes = min_bytes
        self._streams: dict[torch.device, _Streams] = {}
        self._last: weakref.ref | None = None
        self.layers_offloaded = 0  # counters for tests and reports
        self.bytes_offloaded = 0

    def streams_for(self, device: torch.device) -> _Streams:
        if device not in self._streams:
            self._streams[device] = _Streams(device)
        return self._streams[device]

    def __call__(self, function, *args, **checkpoint_kwargs):
        if not torch.is_grad_enabled():
            return function(*args)
        if checkpoint_kwargs.get("use_reentrant", False):
            raise ValueError("checkpoint offload needs use_reentrant=False (the reentrant variant keeps no "
                             "selective-checkpoint cache and recomputes attention)")
        previous = self._last() if self._last is not None else None
        slot = _Slot(self, previous)
        self._last = weakref.ref(slot)
        calls = [0]
        keep = self.keep_attention_outputs
        if keep is None:
            keep = checkpoint_kwargs.get("context_fn") is not None

        def run(*inner_args):
            calls[0] += 1
            if calls[0] > 1 or not keep:  # recompute, or nothing cached to move
                return function(*inner_args)
            with ATTENTION_OUTPUTS.watch(slot.keep):
                return function(*inner_args)

        def unpack(handle):
            if isinstance(handle, torch.Tensor):
                return handle
            owner, index = handle
            return owner.unpack(index)

        with torch.autograd.graph.saved_tensors_hooks(slot.pack, unpack):
            out = checkpoint(run, *args, **checkpoint_kwargs)
        slot.release_kept()
        self.layers_offloaded += 1
        return out
