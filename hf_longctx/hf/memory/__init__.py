"""What one long-context training step keeps in memory, and everything that makes it keep less.

The features: recompute-aware, layer and group checkpointing (:mod:`.checkpointing`), checkpoints in host memory
(:mod:`.checkpoint_offload`), the tiled loss and MLP (:mod:`.tiled_loss`, :mod:`.tiled_mlp`), Liger's fused ops
(:mod:`.fused_ops`), AdamW on the host (:mod:`.optimizer_offload`, :mod:`.optimizer_states`), switched on together
by :func:`~.enable.enable_memory_options`. The planner that picks them: the memory model (:mod:`.model`), the cost
model (:mod:`.costs`), the machine's memory (:mod:`.machine`), the search (:mod:`.search`), its result
(:mod:`.plan`) and a training run's plan (:mod:`.training`); :mod:`.layer_peaks` measures a step layer by layer
against the model.

Of ``hf_longctx.hf`` it imports ``settings`` only. ``enable_memory_options`` and ``MemoryOptions`` are
importable from here as well, where ``hf_longctx.hf.memory`` was their own module.
"""

from .enable import MemoryOptions, enable_memory_options

__all__ = ["MemoryOptions", "enable_memory_options"]
