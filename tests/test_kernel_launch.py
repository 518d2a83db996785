"""The tail of a kernel call: blocks launched in order on a fixed number of slots, the longest last.

A lone large causal segment's longest blocks run at the end with most of the GPU idle, so the call takes
longer than its work at full throughput; many segments, or blocks of equal work that fill whole waves,
leave no tail. The block counts are checked against a brute-force count of visible tiles, and the model is
checked against kernel calls measured on an H200 (``h200_cad_w16_calls.json``: every call of a 16-rank CAD
step with torch's flash kernel, timed per call, beside the profile it was scheduled on).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hf_longctx.backends.cad.cost_model import ProfiledCostModel
from hf_longctx.kernels.calls import calls_overhead
from hf_longctx.kernels.launch import (
    LaunchGrid,
    backward_step_total,
    backward_steps,
    forward_step_total,
    forward_steps,
    tail_factor,
)

HERE = Path(__file__).parent
GRID = LaunchGrid(forward_tile=(128, 64), backward_tile=(64, 128), forward_weight=0.15, slots=132)


def _visible_tiles(q_len, k_len, rows, keys, by_query):
    """Brute force: per query tile (or key tile), how many tiles of the other axis hold a visible pair."""
    offset = k_len - q_len  # bottom-right causal: row i sees keys < offset + i + 1
    n_q, n_k = -(-q_len // rows), -(-k_len // keys)
    seen = np.zeros((n_q, n_k), dtype=bool)
    for i in range(q_len):
        last = min(k_len, offset + i + 1)
        if last > 0:
            seen[i // rows, : (last - 1) // keys + 1] = True
    return seen.sum(axis=1).tolist() if by_query else seen.sum(axis=0).tolist()


@pytest.mark.parametrize("q_len,k_len", [(128, 128), (300, 300), (100, 900), (513, 2000), (64, 64), (1, 257)])
def test_block_steps_count_the_tiles_each_block_sweeps(q_len, k_len):
    forward = forward_steps(q_len, k_len, (128, 64))
    assert forward == _visible_tiles(q_len, k_len, 128, 64, by_query=True)
    backward = backward_steps(q_len, k_len, (64, 128))
    assert backward == _visible_tiles(q_len, k_len, 64, 128, by_query=False)


@pytest.mark.parametrize("q_len,k_len", [(128, 128), (300, 1000), (1, 257), (513, 64)])
def test_a_rectangle_sweeps_every_key_tile_from_every_block(q_len, k_len):
    """A key cut's rectangle (every row sees every key) runs ceil(q / rows) forward blocks of all key tiles and
    ceil(k / keys) backward blocks of all query tiles; the closed forms agree, for ints and arrays."""
    forward = forward_steps(q_len, k_len, (128, 64), causal=False)
    assert forward == [-(-k_len // 64)] * -(-q_len // 128)
    backward = backward_steps(q_len, k_len, (64, 128), causal=False)
    assert backward == [-(-q_len // 64)] * -(-k_len // 128)
    assert forward_step_total(q_len, k_len, (128, 64), causal=False) == sum(forward)
    assert backward_step_total(q_len, k_len, (64, 128), causal=False) == sum(backward)
    assert forward_step_total(np.array([q_len, 0]), np.array([k_len, 5]), (128, 64), causal=False).tolist() == \
        [sum(forward), 0]


def test_blocks_of_equal_work_that_fill_whole_waves_leave_no_tail():
    grid = LaunchGrid(forward_tile=(128, 128), backward_tile=(128, 128), forward_weight=0.5, slots=4)
    # a 128 x 256-key segment: one forward block of 2 key tiles; two backward blocks of one query tile each
    assert tail_factor([128] * 8, [256] * 8, heads=1, grid=grid) == pytest.approx(1.0)
    # 3 equal forward blocks on 4 slots: one slot idles the whole call
    assert tail_factor([128] * 3, [256] * 3, heads=1, grid=replace_share(grid, 1.0)) == pytest.approx(4 / 3)


def replace_share(grid: LaunchGrid, share: float) -> LaunchGrid:
    return LaunchGrid(grid.forward_tile, grid.backward_tile, share, grid.slots)


def test_a_lone_causal_square_has_a_tail_that_copies_fill():
    lone = tail_factor([8192], [8192], 32, GRID)
    four = tail_factor([8192] * 4, [8192] * 4, 32, GRID)
    assert lone > 1.05 and four < 1.02 and four >= 1.0
    # short documents beside it fill part of the tail
    assert 1.0 <= tail_factor([8192] + [1024] * 16, [8192] + [1024] * 16, 32, GRID) < lone
    assert tail_factor([], [], 32, GRID) == 1.0


def test_launch_grid_checks_and_round_trips():
    assert LaunchGrid.from_dict(GRID.to_dict()) == GRID
    limited = LaunchGrid(backward_keys_limit=262_144)
    assert LaunchGrid.from_dict(limited.to_dict()) == limited
    with pytest.raises(ValueError, match="forward_weight"):
        LaunchGrid(forward_weight=1.5)
    with pytest.raises(ValueError, match="slots"):
        LaunchGrid(slots=0)
    with pytest.raises(ValueError, match="backward_keys_limit"):
        LaunchGrid(backward_keys_limit=0)


def test_torch_flash_declares_where_its_gqa_backward_slows_down():
    """Its grouped-query backward sums per-head dK and dV that pass 2 GiB at this many keys (bf16: 32 heads of 128
    at 262,144 keys); without grouped heads it writes dK and dV directly and has no limit."""
    from hf_longctx.kernels import torch_flash

    assert torch_flash.backward_keys_limit(32, 8, 128, 2) == 262_144
    assert torch_flash.backward_keys_limit(64, 8, 128, 2) == 131_072
    assert torch_flash.backward_keys_limit(32, 8, 128, 4) == 131_072
    assert torch_flash.backward_keys_limit(32, 32, 128, 2) is None


def test_a_profile_keeps_its_launch_grid_and_prices_a_call_by_it(tmp_path):
    model = ProfiledCostModel.from_grid([128, 1024], [128, 1024], [[0.1, 0.5], [0.0, 2.0]], launch=GRID,
                                        launch_heads=32)
    model.save(tmp_path / "p.json")
    loaded = ProfiledCostModel.load(tmp_path / "p.json")
    assert loaded.launch == GRID and loaded.launch_heads == 32
    assert loaded.call_factor([8192], [8192]) == pytest.approx(tail_factor([8192], [8192], 32, GRID))
    plain = ProfiledCostModel.from_grid([128, 1024], [128, 1024], [[0.1, 0.5], [0.0, 2.0]])
    assert plain.call_factor([8192], [8192]) == 1.0
    with pytest.raises(ValueError, match="launch_heads"):
        ProfiledCostModel.from_grid([128], [128], [[0.1]], launch=GRID)


def _rank_errors(model: ProfiledCostModel, calls: dict, with_tail: bool) -> np.ndarray:
    """Predicted / measured - 1 of every rank's kernel time, its calls priced as the runtime prices them."""
    world = calls["world"]
    predicted, measured = np.zeros(world), np.zeros(world)
    forward = [c for c in calls["reps"][0] if c["phase"] == "forward"]
    backward = [c for c in calls["reps"][0] if c["phase"] == "backward"]
    by_rank: dict[int, list] = {}
    for c in backward:
        by_rank.setdefault(c["rank"], []).append(c)
    seen: dict[int, int] = {}
    for f in forward:  # a call's forward and backward are the same segments, in the same order per rank
        b = by_rank[f["rank"]][seen.get(f["rank"], 0)]
        seen[f["rank"]] = seen.get(f["rank"], 0) + 1
        q, k = f["q_lens"], f["k_lens"]
        work = sum(model.cost(x, y) - model.segment_cost for x, y in zip(q, k))
        factor = model.call_factor(q, k) if with_tail else 1.0
        predicted[f["rank"]] += (work * factor + model.segment_cost * len(q)
                                 + calls_overhead(q, k, [(0, len(q))], model.call_terms))
        measured[f["rank"]] += (f["seconds"] + b["seconds"]) * 1e3
    return predicted / measured - 1.0


def test_the_tail_explains_what_an_h200_measured_per_server():
    """Priced with the tail, the 16 servers' predicted kernel times spread about half as much around what they
    took as the same measurements priced as the profile timed its cells (several copies per call, their own
    tail). This step is one of those the forward's weight was fitted on (:func:`~hf_longctx.kernels.torch_flash.
    launch_grid`); the others are in ``bench/RESULTS.md``."""
    profile = json.loads((HERE / "h200_torch_flash_launch_profile.json").read_text())
    calls = json.loads((HERE / "h200_cad_w16_calls.json").read_text())
    with_tail = ProfiledCostModel.load(HERE / "h200_torch_flash_launch_profile.json", interpolate="rate")
    # the cells as timed: each one's work times the factor of the call it was timed in
    factors = {(q, k): f for q, k, _copies, f in profile["meta"]["tail_factors"]}
    seg = profile["segment_cost"]
    as_timed = [[seg + (v - seg) * factors.get((int(q), int(k)), 1.0) for k, v in zip(profile["kv_lens"], row)]
                for q, row in zip(profile["q_lens"], profile["cost"])]
    without = ProfiledCostModel.from_grid(profile["q_lens"], profile["kv_lens"], as_timed, "ms", "rate", seg,
                                          profile["tile"], profile["call_cost"], profile["q_tile_cost"],
                                          profile["k_tile_cost"])
    spread_with = _rank_errors(with_tail, calls, with_tail=True).std()
    spread_without = _rank_errors(without, calls, with_tail=False).std()
    assert spread_with < 0.015
    assert spread_with < 0.7 * spread_without
