"""The memory options of a long-context run, switched on by one call: checkpointing, tiled loss, tiled MLP.

The Trainer callback and the benchmarks turn on the same options from the same settings
(``checkpointing``, ``offload_checkpoints``, ``tiled_loss``, ``tiled_mlp`` of a recipe), so a
benchmark measures what training runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..settings.schema import CHECKPOINTING_MODES, GROUP_MODE
from .checkpointing import (
    enable_layer_checkpointing,
    enable_per_layer_checkpointing,
    enable_recompute_aware_checkpointing,
)
from .tiled_loss import TiledLoss, enable_tiled_loss


@dataclass
class MemoryOptions:
    """What :func:`enable_memory_options` switched on; :meth:`remove` takes the tiled loss and MLP off."""

    model: torch.nn.Module
    checkpointing: str
    tiled_loss: TiledLoss | None
    tiled_mlp: bool
    layers: tuple | None = None  # per decoder layer (mode, offload) when the layers differ

    def remove(self) -> None:
        """Undo the tiling (checkpointing stays, as the Trainer would leave it)."""
        if self.tiled_loss is not None:
            self.tiled_loss.remove()
            self.tiled_loss = None
        if self.tiled_mlp:
            from .tiled_mlp import disable_tiled_mlp

            disable_tiled_mlp(self.model)
            self.tiled_mlp = False


def enable_memory_options(model: torch.nn.Module, checkpointing: str = "none", offload: bool = False,
                          tiled_loss: int = 0, tiled_mlp: int = 0, layers=None) -> MemoryOptions:
    """Turn on the memory options a run asked for.

    ``checkpointing``: ``none``, ``layer`` (every decoder layer recomputed in backward) or
    ``recompute_aware`` (the same, keeping each core-attention output); ``offload`` keeps the
    checkpoints in pinned host memory. ``tiled_loss`` / ``tiled_mlp``: tokens per chunk of the
    vocabulary loss / of every MLP (0: off). ``layers``: one ``(mode, offload)`` per decoder layer
    (as :class:`~.plan.MemoryPlan` chooses them; mode ``group`` joins the checkpoint of the
    ``layer`` layer below, see :func:`~.checkpointing.enable_per_layer_checkpointing`), which then replaces
    ``checkpointing`` and ``offload``: some layers not checkpointed, exactly the chosen layers'
    checkpoints on the host. Install the sequence-parallel input hook AFTER this call: its output hook
    must run after the tiled loss's.
    """
    if layers is not None:
        layers = tuple((c, False) if isinstance(c, str) else (c[0], bool(c[1])) for c in layers)
        enable_per_layer_checkpointing(model, layers)  # validates before anything else is switched on
    elif checkpointing not in CHECKPOINTING_MODES:
        raise ValueError(f"unknown checkpointing {checkpointing!r}; choose one of {CHECKPOINTING_MODES}")
    elif offload and checkpointing == "none":
        raise ValueError("offload keeps layer checkpoints on the host: it needs checkpointing 'layer' or "
                         "'recompute_aware', not 'none'")
    loss = enable_tiled_loss(model, chunk_tokens=tiled_loss) if tiled_loss else None
    mlp = False
    if tiled_mlp:
        from .tiled_mlp import enable_tiled_mlp

        mlp = enable_tiled_mlp(model, chunk_tokens=tiled_mlp) > 0
    if layers is not None:
        modes = {"layer" if mode == GROUP_MODE else mode for mode, _ in layers if mode != "none"}
        checkpointing = modes.pop() if len(modes) == 1 else ("per_layer" if modes else "none")
    elif checkpointing == "recompute_aware":
        enable_recompute_aware_checkpointing(model, offload=offload)
    elif checkpointing == "layer":
        enable_layer_checkpointing(model, offload=offload)
    return MemoryOptions(model, checkpointing, loss, mlp, layers)
