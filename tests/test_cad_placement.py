"""Where a forward call's blocks run: long blocks alone on an SM, or two to an SM at 1.6x their time.

Measured with ``scripts/lab/profile_cad.py --placement`` on an H200 and an H100 (torch's flash forward): up to 128
blocks every block has an SM of its own; past that, long blocks mostly share one and take about 1.6x; a
segment of 320-384 long blocks takes 2.5-2.6x (a paired wave, then a wave alone). The simulation follows
those probes, and its fit to dumped calls recovers terms that priced them.
"""

from __future__ import annotations

import pytest

from hf_longctx.kernels.launch import LaunchGrid, forward_block_steps, paired_makespan
from hf_longctx.lab.cad.placement import fit_forward_placement

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
    # ... also where empty blocks take no time: in one wave, a block's place in the launch order decides
    assert paired_makespan(([500] + [0] * 4) * 32, 132, 1.6, empty=0.0) == pytest.approx(800)
    assert paired_makespan(([500] + [0] * 4) * 26, 132, 1.6, empty=0.0) == pytest.approx(500)  # all in the first 132
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


def _launch_block_by_block(steps, sms, pairing, empty):
    """The rule of ``paired_makespan``, written out over the whole launch: blocks before the last EXACT_WAVES
    waves spread evenly two to an SM, then every block started in launch order on the slot that frees first."""
    import heapq

    from hf_longctx.kernels.launch import EXACT_WAVES

    works = [w if w > 0 else empty for w in steps]
    exact = EXACT_WAVES * 2 * sms
    now = sum(works[:-exact]) * pairing / (2 * sms) if len(works) > exact else 0.0
    running, finish = [], now
    for work in works[-exact:]:
        if len(running) >= 2 * sms:
            now = max(now, heapq.heappop(running))
        while running and running[0] <= now:
            heapq.heappop(running)
        end = now + work * (pairing if len(running) + 1 > sms else 1.0)
        heapq.heappush(running, end)
        finish = max(finish, end)
    return finish


def test_a_call_is_priced_from_one_head_as_if_every_head_were_launched():
    """The launch model simulates a call from one head's blocks repeated (a 32-head call launches tens of
    thousands of blocks); it must give what the whole launch, block by block, gives."""
    import random

    from hf_longctx.kernels.launch import paired_forward_steps

    grid = LaunchGrid(slots=132, forward_pairing=1.6, empty_hold=0.3)
    rng = random.Random(3)
    for _ in range(60):
        q = [rng.choice([rng.randint(1, 2048), rng.randint(1, 30000)]) for _ in range(rng.randint(1, 12))]
        k = [x + rng.randint(0, 60000) for x in q]
        heads = rng.choice([1, 3, 32])
        whole = _launch_block_by_block(forward_block_steps(q, k, grid, heads), 132, 1.6, 0.3)
        assert paired_forward_steps(q, k, grid, heads) == pytest.approx(whole * 2 * 132 / 1.6 / heads, rel=1e-9)
        flat = [rng.choice([0, rng.randint(1, 900)]) for _ in range(rng.randint(1, 3000))]
        assert paired_makespan(flat, 132, 1.6, 0.3) == pytest.approx(_launch_block_by_block(flat, 132, 1.6, 0.3))
    # every block starts at once when they fit on two slots per SM: the first 132 that take time run alone
    assert paired_makespan([0, 0] + [10] * 132 + [20], 132, 1.6) == pytest.approx(32)
    assert paired_makespan([20] + [10] * 200, 132, 1.6) == pytest.approx(20)
