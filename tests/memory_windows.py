"""The measured windows of tests/memory_measurements.json and the memory model's prediction of each window
:mod:`hf_longctx.hf.memory.layer_peaks` measures."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import LlamaConfig

from hf_longctx.hf.memory.model import GiB, LayerChoice, MemoryModel, ModelShape

MEASUREMENTS = Path(__file__).parent / "memory_measurements.json"
LLAMA3_8B_LAYER = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                       num_key_value_heads=8)
"""The Llama-3-8B shape every measured run has, less its layer count."""


def measured_runs(key: str) -> list[dict]:
    """One list of runs of tests/memory_measurements.json ("runs", "kernel_runs", "superseded_runs")."""
    return json.loads(MEASUREMENTS.read_text())[key]


def model_of_run(run: dict, kernel: str | None = None) -> tuple[MemoryModel, list[LayerChoice]]:
    """The memory model of a measured run (its layer count, tokens and options; ``kernel``, else the run's) and the
    run's per-layer choices."""
    layers = [LayerChoice(mode, offload) for count, mode, offload in run["layers"] for _ in range(count)]
    shape = ModelShape.from_config(LlamaConfig(**LLAMA3_8B_LAYER, num_hidden_layers=len(layers)))
    model = MemoryModel(shape, run["tokens"], tiled_loss=run["tiled_loss"], tiled_mlp=run["tiled_mlp"],
                        fused_ops=run["fused_ops"], optimizer_on_host=run["optimizer_on_host"],
                        kernel=kernel or run["kernel"])
    return model, layers


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
