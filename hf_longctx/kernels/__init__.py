"""Single-device core attention with log-sum-exp for packed documents, forward and backward."""

from .dispatch import (
    KERNELS,
    SKIP_KERNEL,
    attention_backward,
    attention_forward,
    available_kernels,
    count,
    reset_stats,
    select_kernel,
    stats,
)
from .merge import PartialAccumulator, accumulation_dtype, merge_partials

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
    "reset_stats",
    "select_kernel",
    "stats",
]
