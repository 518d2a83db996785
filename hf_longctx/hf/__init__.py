"""transformers + accelerate glue: attention registration, batch sharding, checkpointing, Trainer callback."""

from .attention import backend_of, implementation_name, register_attention_implementations
from .checkpointing import (
    enable_recompute_aware_checkpointing,
    recompute_aware_checkpointing_kwargs,
    recompute_aware_policy,
)
from .config import LongContextConfig, load_config
from .context import SequenceParallelContext
from .sharding import gather_group_batch, packed_batch_of, plan_for, shard_batch, shift_labels_per_document
from .tiled_mlp import TiledMLP, disable_tiled_mlp, enable_tiled_mlp

__all__ = [
    "LongContextConfig",
    "enable_recompute_aware_checkpointing",
    "load_config",
    "recompute_aware_checkpointing_kwargs",
    "recompute_aware_policy",
    "SequenceParallelContext",
    "TiledMLP",
    "backend_of",
    "disable_tiled_mlp",
    "enable_tiled_mlp",
    "gather_group_batch",
    "implementation_name",
    "packed_batch_of",
    "plan_for",
    "register_attention_implementations",
    "shard_batch",
    "shift_labels_per_document",
]
