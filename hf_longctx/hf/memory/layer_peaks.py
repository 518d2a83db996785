"""The GPU peak of each decoder layer's forward and backward, for checking the memory model layer by layer.

A step's peak says how much memory a plan needed, not which layer's term of the model is wrong. This probe
reads the allocator's peak at every decoder layer's boundary, in both passes, and starts a new window there:

- forward: from the layer's input to its output (a layer's forward window);
- backward: from the gradient of the layer's output to the gradient of its input, i.e. the layer's own
  backward (its recompute included). The last layer's window also holds the loss's backward.

The allocator's counters live on the host, so no device synchronisation is added: the peaks are those of
the allocations the host issued, which is what the allocator can satisfy or not. Recomputed forwards inside
backward are not forward windows (they belong to the backward window of their layer). Under group
checkpointing a group's layers run forward and back-propagate inside its first layer's windows (the group's
input is the tensor whose gradient closes them): the windows of the others stay (nearly) empty.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

GIB = 2**30


def _in_backward() -> bool:
    """True while the autograd engine runs a backward pass (a checkpoint's recompute included)."""
    return torch._C._current_graph_task_id() != -1


@dataclass
class LayerPeaks:
    """Per-layer GPU peaks in bytes (index = layer), filled by :class:`LayerPeakProbe`."""

    forward: list[int] = field(default_factory=list)
    backward: list[int] = field(default_factory=list)

    def gib(self) -> dict[str, list[float]]:
        return {"forward": [round(b / GIB, 2) for b in self.forward],
                "backward": [round(b / GIB, 2) for b in self.backward]}


class LayerPeakProbe:
    """Hooks on the decoder layers of ``model`` that record :class:`LayerPeaks` on ``device``.

    Use as a context manager around one training step; :attr:`peaks` holds the result (the last step's).
    """

    def __init__(self, model: torch.nn.Module, device: torch.device):
        from .decoder_layers import checkpointed_layers as _decoder_layers

        self.layers = _decoder_layers(model)
        if not self.layers:
            raise ValueError(f"{type(model).__name__}: no decoder layers to probe")
        self.device = device
        self.peaks = LayerPeaks()
        self._handles: list = []

    def _mark(self) -> int:
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return peak

    def __enter__(self) -> LayerPeakProbe:
        n = len(self.layers)
        self.peaks = LayerPeaks(forward=[0] * n, backward=[0] * n)
        for i, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_pre_hook(self._before(i), with_kwargs=True))
            self._handles.append(layer.register_forward_hook(self._after(i)))
        torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _before(self, i: int):
        def hook(module, args, kwargs):
            if _in_backward():
                return None
            self._mark()  # what ran before this layer is no layer's window
            hidden = args[0] if args else kwargs.get("hidden_states")
            if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
                def at_input_grad(grad):
                    self.peaks.backward[i] = max(self.peaks.backward[i], self._mark())
                hidden.register_hook(at_input_grad)
            return None
        return hook

    def _after(self, i: int):
        def hook(module, args, output):
            if not _in_backward():
                self.peaks.forward[i] = max(self.peaks.forward[i], self._mark())
        return hook
