"""The run's long-context settings: what they are and how they are checked (:mod:`.schema`), where they come from
(:mod:`.sources`: a recipe's sidecar, the environment, the command line), what ``accelerate launch`` was asked for
(:mod:`.launcher`) and how a backend is named (:mod:`.backend_names`).

The lowest room of ``hf_longctx.hf``: it imports no other part of it. The schema's public names are importable from
here as well, where ``hf_longctx.hf.settings`` was the schema's own module.
"""

from .schema import (
    CHECKPOINTING_MODES,
    FUSED_OPS_MODES,
    GROUP_MODE,
    MEMORY_MODES,
    MOE_DISPATCHES,
    PER_LAYER_MODES,
    WHOLE_NUMBER_RANGES,
    ConfigError,
    LongContextConfig,
    checked_backend_options,
    group_heads,
)

__all__ = [
    "CHECKPOINTING_MODES",
    "FUSED_OPS_MODES",
    "GROUP_MODE",
    "MEMORY_MODES",
    "MOE_DISPATCHES",
    "PER_LAYER_MODES",
    "WHOLE_NUMBER_RANGES",
    "ConfigError",
    "LongContextConfig",
    "checked_backend_options",
    "group_heads",
]
