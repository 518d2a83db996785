"""Triton kernels are optional: a module of them loads where Triton imports, and its torch twin serves elsewhere.

The package's Triton kernels (the MoE expert path's row steps, the key split's merge) each live in a module that
imports Triton at its top, so it is imported only when first needed, once; CPU machines, float64 and CUDA builds
without Triton use the torch version of the same computation. Each has an environment switch that forces the torch
version on GPUs too (for a comparison, or a Triton that misbehaves).
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

import torch

TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what the Triton kernels take


@functools.cache
def triton_module(name: str) -> ModuleType | None:
    """The module ``name`` of Triton kernels, imported on first use; None where Triton is missing or too old."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def switched_on(variable: str) -> bool:
    """Whether the environment leaves a Triton path on (anything but ``variable=0``)."""
    return os.environ.get(variable, "1") != "0"
