"""Each installed kernel's buffers on this GPU against the memory planner's model of them
(:mod:`hf_longctx.hf.memory.kernel_buffers`): never less than measured, and close where the model is exact."""

from __future__ import annotations

import pytest
import torch

from hf_longctx.data.synthetic import document_lengths
from hf_longctx.kernels import available_kernels
from hf_longctx.lab.kernel_memory import measure_kernel_buffers

# the kernels whose allocations the model states; cudnn_varlen and cudnn are bounded from above only
EXACT = {"torch_flash": 1.02, "fa4": 1.02, "reference": 1.06}


@pytest.mark.parametrize("mix", ["prolong", "uniform"])
@pytest.mark.parametrize("kernel", ["fa4", "cudnn_varlen", "torch_flash", "reference"])
def test_the_planned_buffers_cover_what_the_kernel_allocates(kernel, mix):
    device = torch.device("cuda")
    if kernel not in available_kernels(device):
        pytest.skip(f"{kernel} is not installed here")
    tokens = 8192 if kernel == "reference" else 65536  # the reference walks its tiles from Python
    row = measure_kernel_buffers(kernel, document_lengths(mix, tokens, seed=0), device)
    assert "error" not in row, row
    for name in ("forward", "backward"):
        measured, planned = row[f"{name}_extra"], row[f"planned_{name}"]
        assert measured <= planned, (name, row)
        if kernel in EXACT:
            assert planned <= max(EXACT[kernel] * measured, measured + (1 << 20)), (name, row)
