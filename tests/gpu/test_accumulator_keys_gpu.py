"""FlashAttention-4's launch grid on this GPU holds where its backward's dK/dV accumulators leave the L2.

:func:`hf_longctx.kernels.launch.accumulator_share`: with grouped-query heads, one query head's fp32 dK and dV
accumulators take 1 KB per key at head dim 128; the grid the launch cost model is fitted on declares, from the
device's own L2, the keys over which they leave it. A backward of few rows over keys past them is slower per
block than one over keys the L2 holds.
"""

from __future__ import annotations

import pytest
import torch

from hf_longctx.kernels import fa4
from hf_longctx.kernels.launch import backward_steps
from hf_longctx.lab.cad.call_profile import time_call_phases
from hf_longctx.lab.cad.profiled import SegmentShape, launch_grid

pytestmark = pytest.mark.gpu

HEADS, KV_HEADS, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16
DEVICE = torch.device("cuda")


def _fa4_grid():
    if not (fa4.is_installed() and fa4.launch_grid(HEAD_DIM) is not None):
        pytest.skip("FlashAttention-4 is not installed, or this GPU runs another of its kernels than Hopper's")
    return launch_grid("fa4", DEVICE, HEAD_DIM, shape=SegmentShape(HEADS, KV_HEADS, HEAD_DIM, DTYPE))


def test_the_grid_declares_the_accumulator_keys_from_this_devices_l2():
    grid = _fa4_grid()
    l2 = torch.cuda.get_device_properties(DEVICE).L2_cache_size
    assert grid.backward_accumulator_keys == fa4.backward_accumulator_keys(HEADS, KV_HEADS, HEAD_DIM, l2)
    first, full = grid.backward_accumulator_keys
    assert first == l2 // 1024 // 4 and full == 3 * l2 // 1024 // 4
    no_groups = launch_grid("fa4", DEVICE, HEAD_DIM, shape=SegmentShape(HEADS, HEADS, HEAD_DIM, DTYPE))
    assert no_groups.backward_accumulator_keys is None  # dK and dV written directly: nothing accumulates


def test_a_few_row_backward_block_is_slower_once_its_keys_leave_the_l2():
    """256 rows (4 query tiles) over keys the L2 holds, and over keys past it: the blocks sweep the same steps,
    and past the L2 each one takes longer. Per block as the slope between two lengths (a call's fixed passes drop
    out; measured on an H200 in CAD's calls: 15-16 us per block under the L2, 19-21 us past it)."""
    grid = _fa4_grid()
    first, full = grid.backward_accumulator_keys

    def backward_ms(keys: int) -> float:
        return time_call_phases([(256, keys)], "fa4", HEADS, KV_HEADS, HEAD_DIM, DTYPE, DEVICE, warmup=2, reps=5)[1]

    def per_block(short: int, long: int) -> float:
        tile = grid.backward_tile
        blocks = len(backward_steps(256, long, tile)) - len(backward_steps(256, short, tile))
        return (backward_ms(long) - backward_ms(short)) / blocks

    under, past = per_block(first // 4, first), per_block(2 * full, 3 * full)
    assert past > 1.1 * under, (under, past)
