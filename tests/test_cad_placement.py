"""Where a forward call's blocks run: long blocks alone on an SM, or two to an SM at 1.6x their time.

Measured with ``scripts/profile_cad.py --placement`` on an H200 and an H100 (torch's flash forward): up to 128
blocks every block has an SM of its own; past that, long blocks mostly share one and take about 1.6x; a
segment of 320-384 long blocks takes 2.5-2.6x (a paired wave, then a wave alone). The simulation follows
those probes, and its fit to dumped calls recovers terms that priced them.
"""

from __future__ import annotations

import pytest

from hf_longctx.backends.cad.placement import fit_forward_placement
from hf_longctx.kernels.launch import LaunchGrid, forward_block_steps, paired_makespan

GRID = LaunchGrid(forward_tile=(128, 64), backward_tile=(64, 128), slots=132)


def test_up_to_one_block_per_sm_every_block_runs_alone():
    assert paired_makespan([500] * 128, 132, 1.6) == 500
    assert paired_makespan([500, 10, 3], 132, 1.6) == 500


def test_past_the_sms_blocks_share_them_and_take_the_pair_factor():
    assert paired_makespan([500] * 160, 132, 1.6) == pytest.approx(800)  # measured 1.61-1.62x
    # 320 long blocks: 264 paired, then the last 56 alone once a wave ends (measured 2.52-2.55x)
    assert paired_makespan([500] * 320, 132, 1.6) == pytest.approx(1300)
    # one long block per head among empty ones past 128 blocks: paired (measured 1.58-1.59x on most spacings)
    assert paired_makespan(([500] + [0] * 4) * 32, 132, 1.6, empty=0.3) == pytest.approx(800)
    with pytest.raises(ValueError, match="pairing >= 1"):
        paired_makespan([1], 132, 0.5)


def test_a_varlen_call_launches_empty_blocks_up_to_its_longest_segment():
    blocks = forward_block_steps([384, 128], [36068, 34607], GRID, heads=2)
    assert len(blocks) == 2 * 2 * 3 and blocks[3:6] == [541, 0, 0]  # the 128-row segment's 2 empty blocks
    assert blocks[:3] == [560, 562, 564] and blocks[:6] == blocks[6:]
    assert forward_block_steps([128], [4096], GRID, heads=1, causal=False) == [64]


def test_the_fit_recovers_terms_that_priced_the_calls():
    """Calls priced by known terms on the simulation are fitted back exactly, per call and per server."""
    calls = [([q], [k]) for q in (128, 384, 640, 1024, 2048) for k in (4096, 16384, 40000)]
    calls += [([384, 128], [36068, 34607]), ([256, 512, 300], [9000, 512, 300])]
    terms = [2e-3, 1e-5, 2e-6, 0.0, 0.02]
    reps = []
    for rank, (q, k) in enumerate(calls):
        blocks = forward_block_steps(q, k, GRID, 32)
        features = [paired_makespan(blocks, 132, 1.6, empty=0.3), sum(q), sum(k), len(blocks), 1.0]
        ms = sum(a * b for a, b in zip(terms, features))
        reps.append({"rank": rank % 4, "phase": "forward", "q_lens": q, "k_lens": k, "causal": True,
                     "seconds": ms * 1e-3})
    coef, stats = fit_forward_placement([{"reps": [reps]}], GRID, 32, empty=0.3)
    assert coef == pytest.approx(terms, rel=1e-6, abs=1e-12)
    assert stats[0]["calls"] == len(calls) and stats[0]["call_max"] < 1e-9 and stats[0]["server_std"] < 1e-9
