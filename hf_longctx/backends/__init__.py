"""Distributed core attention backends over the kernels, layouts and comm layers."""

from .api import sequence_parallel_attention
from .local import varlen_attention
from .registry import BackendSpec, backend_names, default_strategy, get_backend, register_backend
from .schedule import BlockTask, distflash_schedule, rotation_schedule

__all__ = [
    "BackendSpec",
    "BlockTask",
    "backend_names",
    "default_strategy",
    "distflash_schedule",
    "get_backend",
    "register_backend",
    "rotation_schedule",
    "sequence_parallel_attention",
    "varlen_attention",
]
