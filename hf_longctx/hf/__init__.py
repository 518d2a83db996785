"""transformers + accelerate glue: attention registration, batch sharding, memory features, model parallelism,
the Trainer callback; the run's settings and where they come from.

Four rooms, lowest first (``tests/test_lab_apart.py`` checks that none imports a room above it):
:mod:`.settings` (the run's settings), :mod:`.memory` and :mod:`.parallel` (neither imports the other),
:mod:`.integration` (attention functions, sharding, input hook, callback, preflight checks). Every public name is
importable from here; the names documented before the rooms existed (``hf_longctx.hf.fsdp.enable_fsdp_on_cpu``,
``hf_longctx.hf.memory_plan.plan_memory``, ...) stay importable from here under the same name.
"""

from .integration.attention import register_attention_implementations
from .integration.context import attention_calls
from .integration.preflight import (
    check_attn_implementation,
    check_model_config,
    check_positive,
    check_run,
    report_config_errors,
)
from .integration.sharding import plan_for, shard_batch
from .memory.checkpointing import (
    checkpointing_training_args,
    enable_layer_checkpointing,
    enable_recompute_aware_checkpointing,
)
from .memory.enable import MemoryOptions, enable_memory_options
from .memory.fused_ops import enable_fused_ops
from .memory.layer_peaks import LayerPeakProbe
from .memory.optimizer_offload import HostOffloadAdamW, trainer_optimizer_cls_and_kwargs
from .memory.optimizer_states import allocate_optimizer_states
from .memory.search import MemoryPlanError, plan_memory
from .memory.tiled_loss import enable_tiled_loss
from .memory.tiled_mlp import TiledMLP, disable_tiled_mlp, enable_tiled_mlp
from .memory.training import plan_for_training
from .parallel.fsdp import enable_fsdp_on_cpu, fully_shard_model
from .parallel.heads import apply_head_parallel_attention
from .parallel.model_parallelism import apply_model_parallelism, model_parallelism
from .settings.backend_names import backend_from_name, backend_of, implementation_name
from .settings.schema import ConfigError, LongContextConfig, checked_backend_options
from .settings.sources import add_config_arguments, config_overrides, load_config, parse_backend_options, recipe_source

__all__ = [
    "ConfigError",
    "HostOffloadAdamW",
    "LayerPeakProbe",
    "LongContextCallback",
    "LongContextConfig",
    "MemoryOptions",
    "MemoryPlanError",
    "TiledMLP",
    "add_config_arguments",
    "allocate_optimizer_states",
    "apply_head_parallel_attention",
    "apply_model_parallelism",
    "attention_calls",
    "backend_from_name",
    "backend_of",
    "check_attn_implementation",
    "check_model_config",
    "check_positive",
    "check_run",
    "checked_backend_options",
    "checkpointing_training_args",
    "config_overrides",
    "disable_tiled_mlp",
    "enable_fsdp_on_cpu",
    "enable_fused_ops",
    "enable_layer_checkpointing",
    "enable_memory_options",
    "enable_recompute_aware_checkpointing",
    "enable_tiled_loss",
    "enable_tiled_mlp",
    "fully_shard_model",
    "implementation_name",
    "load_config",
    "model_parallelism",
    "parse_backend_options",
    "plan_for",
    "plan_for_training",
    "plan_memory",
    "recipe_source",
    "register_attention_implementations",
    "report_config_errors",
    "shard_batch",
    "trainer_optimizer_cls_and_kwargs",
]


def __getattr__(name: str):
    if name == "LongContextCallback":  # imports transformers' Trainer machinery only when asked for
        from .integration.callback import LongContextCallback

        return LongContextCallback
    raise AttributeError(f"module 'hf_longctx.hf' has no attribute {name!r}")
