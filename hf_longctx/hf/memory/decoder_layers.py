"""The decoder layers of a transformers model, as checkpointing, fused ops and the memory probe walk them."""

from __future__ import annotations


def checkpointed_layers(model) -> list:
    """The layers transformers checkpoints (its GradientCheckpointingLayer modules), in model order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
