"""The memory model's prediction of each window :mod:`hf_longctx.hf.memory.layer_peaks` measures."""

from __future__ import annotations

from hf_longctx.hf.memory.model import GiB, LayerChoice, MemoryModel


def predicted_windows(model: MemoryModel, layers: list[LayerChoice]) -> dict[str, list[float]]:
    """The model's GiB for each layer's forward and backward window as :mod:`~hf_longctx.hf.memory.layer_peaks` opens
    them: the last layer's backward window also holds the loss's backward, and a checkpoint group's windows are its
    first layer's (the largest of its members')."""
    forward, backward = model.layer_items(layers)
    windows = {name: [sum(items.values()) / GiB for items in phase] for name, phase in
               (("forward", forward), ("backward", backward))}
    loss = sum(model.gpu_phases(layers)["loss"].values()) / GiB
    windows["backward"][-1] = max(windows["backward"][-1], loss)
    for phase in windows.values():
        for i in range(len(layers)):
            if layers[i].checkpointing != "group":
                end = next((j for j in range(i + 1, len(layers)) if layers[j].checkpointing != "group"), len(layers))
                phase[i] = max(phase[i:end])
    return windows
