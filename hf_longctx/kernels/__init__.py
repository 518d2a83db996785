"""Single-device core attention with log-sum-exp for packed documents, forward and backward."""

from . import dispatch as _dispatch
from .dispatch import (
    KERNELS,
    SKIP_KERNEL,
    available_kernels,
    count,
    reset_stats,
    select_kernel,
    stats,
)
from .merge import PartialAccumulator, accumulation_dtype, merge_partials
from .observe import observe_kernels, observed

# the entry points every backend calls, visible to kernel observers (e.g. per-rank timers)
attention_forward = observed(_dispatch.attention_forward, "forward")
attention_backward = observed(_dispatch.attention_backward, "backward")

__all__ = [
    "KERNELS",
    "SKIP_KERNEL",
    "PartialAccumulator",
    "accumulation_dtype",
    "attention_backward",
    "attention_forward",
    "available_kernels",
    "count",
    "merge_partials",
    "observe_kernels",
    "reset_stats",
    "select_kernel",
    "stats",
]
