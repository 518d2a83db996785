"""Single-device core attention with log-sum-exp for packed documents, forward and backward.

A kernel is a :class:`Kernel` (``supports``, ``forward``, ``backward`` of one :class:`KernelCall`) in
the registry; importing this package registers the package's own (:mod:`.builtin`), and
:func:`register_kernel` adds another from any package.
"""

from . import builtin  # noqa: F401 - registers the package's kernels
from . import dispatch as _dispatch
from .contract import Kernel, KernelCall
from .dispatch import (
    SKIP_KERNEL,
    available_kernels,
    count,
    kernel_call,
    reset_stats,
    select_kernel,
    stats,
)
from .merge import PartialAccumulator, accumulation_dtype, merge_partials, merge_rows_
from .observe import observe_kernels, observed
from .registry import auto_order, get_kernel, kernel_names, register_kernel, unregister_kernel

# the entry points every backend calls, visible to kernel observers (e.g. per-rank timers)
attention_forward = observed(_dispatch.attention_forward, "forward")
attention_backward = observed(_dispatch.attention_backward, "backward")
kernel_forward = observed(_dispatch.kernel_forward, "forward")
kernel_backward = observed(_dispatch.kernel_backward, "backward")

__all__ = [
    "SKIP_KERNEL",
    "Kernel",
    "KernelCall",
    "PartialAccumulator",
    "accumulation_dtype",
    "attention_backward",
    "attention_forward",
    "auto_order",
    "available_kernels",
    "count",
    "get_kernel",
    "kernel_backward",
    "kernel_call",
    "kernel_forward",
    "kernel_names",
    "merge_partials",
    "merge_rows_",
    "observe_kernels",
    "register_kernel",
    "reset_stats",
    "select_kernel",
    "stats",
    "unregister_kernel",
]
