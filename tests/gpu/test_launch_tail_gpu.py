"""The tail of a kernel call on this GPU: a lone causal segment runs longer per segment than copies of it.

:mod:`hf_longctx.kernels.launch` prices it by simulating the launch (one slot per SM); CAD's profiles divide
their cells by it and servers pay it per call. Here the simulated ratio is checked against the kernel: one
8K x 8K causal segment per call against four per call (torch's flash kernel, forward+backward, 8B heads).
"""

from __future__ import annotations

import statistics

import pytest
import torch

from hf_longctx.kernels.launch import tail_factor
from hf_longctx.lab.cad.profiled import ProfileBudget, SegmentShape, launch_grid, time_segments

pytestmark = pytest.mark.gpu


def test_a_lone_causal_square_is_slower_per_segment_by_about_the_simulated_tail():
    device = torch.device("cuda")
    shape = SegmentShape()
    grid = launch_grid("torch_flash", device, shape.head_dim)
    assert grid is not None and grid.slots == torch.cuda.get_device_properties(device).multi_processor_count
    budget = ProfileBudget(warmup=2, reps=5)
    ratios = []
    for _ in range(4):  # the first pair warms the clocks up (on a freshly started H100 it read 1.076, then 1.06)
        lone = time_segments(8192, 8192, 1, "torch_flash", shape, device, budget)
        four = time_segments(8192, 8192, 4, "torch_flash", shape, device, budget)
        ratios.append(lone / four)
    measured = statistics.median(ratios[1:])
    simulated = tail_factor([8192], [8192], shape.heads, grid) / tail_factor([8192] * 4, [8192] * 4, shape.heads, grid)
    assert measured > 1.02  # the tail is real on this GPU
    assert abs(measured - simulated) < 0.03, (measured, simulated)
