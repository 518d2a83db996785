"""transformers + accelerate glue: attention registration, batch sharding, checkpointing, Trainer callback."""

from .attention import backend_of, implementation_name, register_attention_implementations
from .backend_names import backend_from_name
from .checkpointing import (
    enable_layer_checkpointing,
    enable_recompute_aware_checkpointing,
)
from .config import load_config
from .parallelism import apply_model_parallelism, model_parallelism
from .preflight import ConfigError, check_attn_implementation, check_positive, check_run, report_config_errors
from .settings import LongContextConfig
from .sharding import plan_for, shard_batch
from .tiled_loss import enable_tiled_loss
from .tiled_mlp import TiledMLP, disable_tiled_mlp, enable_tiled_mlp

__all__ = [
    "ConfigError",
    "LongContextCallback",
    "LongContextConfig",
    "apply_model_parallelism",
    "backend_from_name",
    "check_attn_implementation",
    "check_positive",
    "check_run",
    "enable_layer_checkpointing",
    "enable_recompute_aware_checkpointing",
    "enable_tiled_loss",
    "model_parallelism",
    "report_config_errors",
    "load_config",
    "TiledMLP",
    "backend_of",
    "disable_tiled_mlp",
    "enable_tiled_mlp",
    "implementation_name",
    "plan_for",
    "register_attention_implementations",
    "shard_batch",
]


def __getattr__(name: str):
    if name == "LongContextCallback":  # imports transformers' Trainer machinery only when asked for
        from .callback import LongContextCallback

        return LongContextCallback
    raise AttributeError(f"module 'hf_longctx.hf' has no attribute {name!r}")
