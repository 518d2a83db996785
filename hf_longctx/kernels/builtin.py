"""Registers the package's own kernels, in ``auto``'s order: the fastest that serves an input wins.

FlashAttention-4 (extra ``fa4``), cuDNN through its frontend on packed documents (extra ``cudnn``),
cuDNN's dense op for a few equal-shape document groups (no extra), torch's FlashAttention-2, and the
reference, which serves every input and so ends the order.
"""

from __future__ import annotations

from . import cudnn, cudnn_varlen, fa4, reference, torch_flash
from .registry import register_kernel

for _kernel in (fa4, cudnn_varlen, cudnn, torch_flash, reference):
    register_kernel(_kernel)
