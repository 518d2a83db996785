"""A varlen scheduler that walks the segments one after another (FlashAttention-4 on Hopper), priced as it launches.

FlashAttention-2 launches tile fastest, then segment, then head, and sizes its grid by the call's longest segment:
shorter segments launch empty blocks. FlashAttention-4's varlen scheduler instead launches each segment's own
blocks, segment after segment; a causal forward starts a segment's longest blocks first (LPT) with the heads
innermost, and packs the query heads of one KV head into a tile's rows. The tests check the tile steps of any tile
shape against a brute-force count, the launch simulation against a full list-scheduling simulation, and what the
launch cost model takes from the order: no empty blocks, no surplus to cut calls for.
"""

from __future__ import annotations

import heapq
import random

import pytest

from hf_longctx.backends.cad.launch_cost import LaunchCostModel, PhaseTerms, call_features
from hf_longctx.kernels import fa4
from hf_longctx.kernels.launch import (
    LaunchGrid,
    backward_steps,
    forward_step_total,
    forward_steps,
    segment_phase_factor,
    tail_factor,
)
from hf_longctx.lab.cad.call_profile import few_rows_long_keys_calls
from hf_longctx.lab.cad.profiled import _same_launch

# FlashAttention-4's Hopper grid at head dim 128 with 4 query heads per KV head packed into a forward tile
FA4 = LaunchGrid(forward_tile=(32, 128), backward_tile=(64, 128), slots=132, launch_order="segment",
                 forward_head_pack=4)


def test_forward_tile_steps_of_any_tile_shape_have_a_closed_form():
    """Packed tiles have fewer rows than key columns (32 x 128): the closed form is a floor sum, exact for every
    shape (the scheduler prices thousands of segments per batch, so it is not a loop over blocks)."""
    rng = random.Random(0)
    for _ in range(2000):
        q = rng.randint(1, 5000)
        k = q + rng.randint(0, 9000)
        for tile in ((32, 128), (48, 80), (16, 64), (128, 64), (128, 128)):
            assert forward_step_total(q, k, tile) == sum(forward_steps(q, k, tile)), (q, k, tile)
    assert forward_step_total(0, 100, (32, 128)) == 0


def _list_scheduled(works: list[int], slots: int) -> float:
    """Brute force: every block started in order on the slot that frees first; the last end."""
    finish = [0.0] * slots
    for w in works:
        heapq.heapreplace(finish, finish[0] + w)
    return max(finish)


@pytest.mark.parametrize("longest_first", [True, False])
def test_segment_order_simulation_follows_the_launch_it_describes(longest_first):
    """Calls of up to EXACT_WAVES waves are simulated whole: the factor is the list-scheduled makespan of the launch
    order (a causal forward: each segment's blocks longest first, heads innermost; else head by head in tile order)
    over the even spread."""
    per_segment = [forward_steps(700, 900, (32, 128)), forward_steps(90, 90, (32, 128)), [3, 1, 4, 1, 5]]
    heads, slots = 2, 8  # 60 blocks: within 8 waves of 8 slots
    order = []
    for seg in per_segment:
        order += [w for w in sorted(seg, reverse=True) for _ in range(heads)] if longest_first else list(seg) * heads
    even = sum(order) / slots
    assert segment_phase_factor(per_segment, heads, slots, longest_first) == pytest.approx(
        _list_scheduled(order, slots) / even)


def test_a_lone_causal_segment_started_longest_first_has_almost_no_tail():
    """Where FlashAttention-2 runs a lone causal segment's longest blocks last (a tail of several percent), a
    scheduler that starts them first leaves the short ones to fill the end."""
    seg = forward_steps(8192, 8192, (32, 128))
    lpt, in_order = segment_phase_factor([seg], 8, 132, True), segment_phase_factor([seg], 8, 132, False)
    assert lpt < 1.005 < 1.05 < in_order


def test_segments_in_order_launch_only_their_own_blocks():
    """No segment launches blocks for another: the launched blocks are each segment's own (forward: its packed
    query tiles; backward: its key tiles), and the calls' terms have no surplus tile to cut a batch for."""
    q_lens, k_lens = [4096, 300, 64], [4096, 300, 64]
    forward = call_features("forward", q_lens, k_lens, FA4, 32)
    backward = call_features("backward", q_lens, k_lens, FA4, 32)
    assert forward[3] == sum(-(-q // 32) for q in q_lens)
    assert backward[3] == sum(-(-k // 128) for k in k_lens)
    assert forward[0] >= sum(forward_step_total(q, k, (32, 128)) for q, k in zip(q_lens, k_lens))
    assert backward[0] >= sum(sum(backward_steps(q, k, (64, 128))) for q, k in zip(q_lens, k_lens))
    model = LaunchCostModel(FA4, 32, PhaseTerms(1e-4, 1e-5, 0.0, 1e-4, 1e-3, 0.01),
                            PhaseTerms(5e-4, 1e-5, 2e-6, 2e-3, 3e-3, 0.02))
    terms = model.call_terms
    assert terms.q_tile == terms.k_tile == 0.0 and not terms.active
    assert terms.call == pytest.approx(0.03)
    assert model.tail_cost([8192], [8192]) >= 0.0


def test_a_long_block_launched_before_the_simulated_waves_still_sets_the_calls_time():
    """Only the last EXACT_WAVES waves are simulated block by block, those before spread evenly; a few rows over a
    long prefix launched first (64 blocks of 568 key tiles, then 17 waves of short ones) would vanish in that
    spread. The call ends no sooner than its longest block: here exactly what launching every block in order gives
    (FlashAttention-4's forward of such a CAD server's call ran 36% over a price that missed it)."""
    per_segment = [forward_steps(249, 72613, (32, 128)),
                   *(forward_steps(n, n, (32, 128)) for n in (1979, 1694, 1326, 1900, 1800))]
    heads, slots = 8, 132
    order = [w for seg in per_segment for w in sorted(seg, reverse=True) for _ in range(heads)]
    assert len(order) > 8 * slots  # past the simulated waves
    even = sum(order) / slots
    assert segment_phase_factor(per_segment, heads, slots, True) == pytest.approx(_list_scheduled(order, slots) / even)
    assert segment_phase_factor(per_segment, heads, slots, True) > 1.4
    # the tile order's simulation too: never under the longest block
    from hf_longctx.kernels.launch import phase_factor

    per_head = [600] + [3] * 2000
    assert phase_factor(per_head, 2, 132) >= 600 / (sum(per_head) * 2 / 132)


def test_more_long_blocks_than_slots_at_a_calls_start_run_in_two_rounds():
    """573 rows over a 52K prefix beside short documents (FlashAttention-4's forward of a CAD server): 144 blocks of
    about 410 key tiles launched first on 132 SMs, then short ones. 12 long blocks wait for the first round: the
    call takes about two long blocks' time, which only a simulation of the call's first waves sees (measured 1.15
    ms in such a call; priced 0.83 when they were spread evenly). With more blocks than the first and last
    EXACT_WAVES waves hold, those between are spread; random calls of 1-30 segments stay within a few percent of
    starting every block in order."""
    q_lens, k_lens = [573, 2152, 1096, 640, 287, 63, 2000, 2000, 2000], [52880, 2432, 1096, 640, 287, 63, 2000, 2000,
                                                                        2000]
    per_segment = [forward_steps(q, k, (32, 128)) for q, k in zip(q_lens, k_lens)]
    order = [w for seg in per_segment for w in sorted(seg, reverse=True) for _ in range(8)]
    assert len(order) > 2 * 8 * 132  # first waves, spread middle, last waves
    exact = _list_scheduled(order, 132) / (sum(order) / 132)
    assert exact > 1.3 and segment_phase_factor(per_segment, 8, 132, True) == pytest.approx(exact)
    rng = random.Random(5)
    for _ in range(60):
        segs = []
        for _ in range(rng.randint(1, 30)):
            k = rng.randint(64, 80000)
            segs.append(forward_steps(rng.randint(1, min(k, 6000)), k, (32, 128)))
        heads = rng.choice([1, 8, 32])
        order = [w for seg in segs for w in sorted(seg, reverse=True) for _ in range(heads)]
        exact = _list_scheduled(order, 132) / (sum(order) / 132)
        assert segment_phase_factor(segs, heads, 132, True) == pytest.approx(exact, rel=0.05)


def test_the_launch_order_is_part_of_a_grid_and_of_a_cached_models_identity():
    assert LaunchGrid.from_dict(FA4.to_dict()) == FA4
    assert LaunchGrid.from_dict({k: v for k, v in LaunchGrid().to_dict().items()
                                 if k not in ("launch_order", "forward_head_pack")}) == LaunchGrid()  # older files
    assert not _same_launch(LaunchGrid(), LaunchGrid(launch_order="segment"))
    assert not _same_launch(FA4, LaunchGrid(forward_tile=(32, 128), backward_tile=(64, 128), slots=132,
                                            launch_order="segment"))
    with pytest.raises(ValueError, match="launch_order"):
        LaunchGrid(launch_order="random")
    with pytest.raises(ValueError, match="'tile' launch order only"):
        LaunchGrid(launch_order="segment", forward_pairing=1.6)


def test_flash_attention_4_declares_its_hopper_launch_only(monkeypatch):
    """On Hopper at head dim 128: 128 x 128 forward tiles, 64 x 128 backward tiles, launched segment after segment.
    Blackwell runs other kernels (and no GPU, none): no grid, so the grid profile prices them."""
    monkeypatch.setattr(fa4.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(fa4.torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    grid = fa4.launch_grid(128)
    assert (grid.forward_tile, grid.backward_tile, grid.launch_order) == ((128, 128), (64, 128), "segment")
    monkeypatch.setattr(fa4.torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert fa4.launch_grid(128) is None


def test_flash_attention_4_packs_a_kv_heads_query_heads_into_a_tile():
    assert fa4.packs_query_heads(32, 8) == 4
    assert fa4.packs_query_heads(32, 32) == 1
    assert fa4.packs_query_heads(28, 4) == 1  # 7 heads do not divide a 128-row tile: modelled unpacked
    assert fa4.launch_grid(64) is None  # other head dims run other tiles: not modelled


def test_segment_order_kernels_are_also_profiled_on_few_rows_over_long_keys():
    calls = few_rows_long_keys_calls(FA4)
    assert calls and all(64 <= q <= 1024 and 16384 <= k <= 131072 for call in calls for q, k in call)
    assert few_rows_long_keys_calls(LaunchGrid()) == []


def test_the_grid_profiles_tail_follows_the_launch_order_too():
    """The interpolated grid profile divides its cells by a call's tail (``tail_factor``): on a segment-order grid that
    is the same simulation, the forward weighed against the backward."""
    grid = LaunchGrid(forward_tile=(32, 128), backward_tile=(64, 128), forward_weight=0.3, slots=132,
                      launch_order="segment", forward_head_pack=4)
    forward = segment_phase_factor([forward_steps(8192, 8192, (32, 128))], 8, 132, True)
    backward = segment_phase_factor([backward_steps(8192, 8192, (64, 128))], 32, 132, False)
    assert tail_factor([8192], [8192], 32, grid) == pytest.approx(0.3 * forward + 0.7 * backward)
    assert tail_factor([], [], 32, grid) == 1.0
