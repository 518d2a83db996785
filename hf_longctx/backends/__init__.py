"""Distributed core attention backends over the kernels, layouts and comm layers.

A backend is a :class:`Backend` object in the registry; ``import hf_longctx.backends`` registers the
package's own (:mod:`.builtin`), and :func:`register_backend` adds another from any package.
"""

from . import builtin  # noqa: F401 - registers the package's backends
from .api import sequence_parallel_attention
from .contract import Backend, ScheduleBackend
from .engine import RunContext
from .options import BackendOptions, NoOptions
from .registry import (
    backend_names,
    default_strategy,
    get_backend,
    on_backend_registered,
    register_backend,
    registered_backends,
)
from .schedule import distfa_schedule
from .segments import segment_attention

one_process_attention = segment_attention  # the former name of segment_attention, importable for existing callers

__all__ = [
    "Backend",
    "BackendOptions",
    "NoOptions",
    "RunContext",
    "ScheduleBackend",
    "backend_names",
    "default_strategy",
    "distfa_schedule",
    "get_backend",
    "on_backend_registered",
    "register_backend",
    "registered_backends",
    "segment_attention",
    "sequence_parallel_attention",
]
