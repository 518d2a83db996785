"""``auto``'s cost model counts what the backends really do: every rank's sends, to the byte, and its kernel segments,
which cover every visible (query, key) pair of every head exactly once."""

from __future__ import annotations

import pytest
import torch
from test_backends import make_problem

from hf_longctx.backends import get_backend, sequence_parallel_attention
from hf_longctx.backends.api import check_options
from hf_longctx.backends.prediction import AttentionShape, RankWork, fixed_rates, predict, segment_tiles
from hf_longctx.comm.links import LinkTiers
from hf_longctx.comm.p2p import comm_stats, reset_comm_stats
from hf_longctx.layout import shard_plan
from hf_longctx.layout.pairs import band_work

from distributed import run_distributed

# (backend, placement, options) of every backend auto may price, at every world size tried
CASES = {
    2: [("ring", "contiguous", None), ("zigzag", "zigzag", None), ("distfa", "contiguous", None),
        ("tasp", "zigzag", None), ("ulysses", "zigzag", None), ("cad", "contiguous", None)],
    3: [("ring", "contiguous", None), ("zigzag", "zigzag", None), ("distfa", "contiguous", None),
        ("tasp", "contiguous", None), ("cad", "contiguous", None)],
    4: [("distfa", "contiguous", None), ("tasp", "zigzag", None), ("ulysses", "contiguous", None),
        ("cad", "contiguous", {"eps": 0.0, "pingpong": False}),
        ("ulysses_zigzag", "zigzag", {"ulysses_size": 2}), ("ulysses_cad", "contiguous", {"ulysses_size": 2}),
        ("ulysses_distfa", "contiguous", {"ulysses_size": 2})],
}


def _covered_pairs(work: list[RankWork], window) -> int:
    return sum(w.heads * band_work(q, k, c, win) for w in work for q, k, c, win in w.segments)


def check_counts(rank, world, dtype, window):
    for seed, (backend, strategy, options) in enumerate(CASES[world]):
        batch, q, k, v, dout = make_problem(40 + seed * 7 + world, world, dtype)
        plan = shard_plan(batch, world, strategy)
        run_plan = plan if window is None else plan.with_window(window)
        shape = AttentionShape.of(q, k)
        parsed = check_options(backend, options)
        work = get_backend(backend).rank_work(run_plan, shape, parsed)
        where = f"{backend}/{strategy} world={world} {dtype} window={window} docs={batch.doc_lens}"
        assert work is not None and len(work) == world, where
        # every visible pair of every query head computed once, over all ranks
        assert _covered_pairs(work, window) == shape.heads * batch.causal_pairs(window), where
        idx = plan.local_indices(rank)
        ql, kl, vl = (t[idx].clone().requires_grad_() for t in (q, k, v))
        reset_comm_stats()
        out = sequence_parallel_attention(ql, kl, vl, plan=plan, backend=backend, options=options, window=window)
        out.backward(dout[idx])
        assert comm_stats().get("sent_bytes", 0) == work[rank].sent_bytes, where
        assert work[rank].calls > 0 and all(b > 0 for _, sent in work[rank].transfers for b in sent.values())


@pytest.mark.parametrize("world", [2, 3, 4])
def test_predicted_sends_are_what_every_backend_sends(world):
    run_distributed(world, check_counts, torch.float64, None)


def test_predicted_sends_in_float32_and_under_a_sliding_window():
    run_distributed(2, check_counts, torch.float32, 5)


def test_tiles_count_what_a_flash_kernel_visits():
    assert segment_tiles(128, 128, True) == 1
    assert segment_tiles(256, 256, True) == 3  # the diagonal tiles and the one below
    assert segment_tiles(129, 129, True) == 3  # a row of 129 spills into a second tile row and column
    assert segment_tiles(128, 1024, True) == 8  # the last rows of a long document see all its keys
    assert segment_tiles(256, 256, False) == 4
    assert segment_tiles(1024, 1024, True, window=128) == 15  # a band of two tiles per tile row, one at the top
    assert segment_tiles(0, 5, True) == 0


def test_a_prediction_is_the_slowest_ranks_kernels_plus_the_slowest_ranks_sends():
    rates = fixed_rates(100.0, call_s=1e-3)
    busy = RankWork([(256, 256, True, None)], calls=2, heads=4)
    idle = RankWork([], calls=0, heads=4, transfers=[("p2p", {0: 64 << 20})])
    p = predict("x", "zigzag", [busy, idle], rates, LinkTiers(node_size=1, inter_node_bytes_per_s=64e9))
    assert p.kernel_s[0] == pytest.approx(3 * 4 * rates.tile_head_s + 2e-3)
    assert p.transfer_s == (0.0, pytest.approx((64 << 20) / 64e9))  # rank 1 sends to another node
    assert p.step_s == pytest.approx(p.kernel_s[0] + p.transfer_s[1])


def test_predicted_sends_in_bfloat16_where_gradients_travel_wider():
    """Half-precision rows travel in 2 bytes, log-sum-exps and gradients summed across ranks in 4."""
    run_distributed(2, check_counts, torch.bfloat16, None)
