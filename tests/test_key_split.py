"""A forward call of few long blocks runs as chunks of its keys, merged by log-sum-exp: the whole call's numbers.

:mod:`hf_longctx.kernels.key_split`: a non-persistent forward kernel launches one block per query tile and head, so
a few rows over a long prefix leave most SMs idle. :func:`plan_key_split` cuts the keys every row of a segment sees
into chunks when the call's blocks, placed as they launch, would take :attr:`KeySplit.gain` times their even spread;
:func:`split_forward` runs the chunks as one non-causal call and the rest as one causal call, and merges. The launch
cost model prices such a forward as the two calls it makes.
"""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
import torch

from hf_longctx.backends.cad.launch_cost import (
    MERGE,
    LaunchCostModel,
    PhaseTerms,
    _one_call_features,
    call_features,
)
from hf_longctx.kernels import attention_forward, reset_stats, stats, torch_flash
from hf_longctx.kernels.key_split import RULE, KeySplit, merged_rows, plan_key_split, row_parts, split_calls
from hf_longctx.kernels.launch import LaunchGrid

H200 = KeySplit(sms=132, tile=(128, 64), pairing=1.6)  # what torch_flash's grid declares on an H200
TINY = KeySplit(sms=64, tile=(16, 8), min_keys=16, min_shared=64)  # the same rule at CPU sizes
TOL = dict(rtol=1e-9, atol=1e-9)  # fp64 (the CPU's first fp64 products of a process can differ by ~1e-9)


def _packed(segments, seed, heads=4, kv_heads=2, dim=16):
    cu_q, cu_k = [0], [0]
    for q, k in segments:
        cu_q.append(cu_q[-1] + q)
        cu_k.append(cu_k[-1] + k)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(cu_q[-1], heads, dim, generator=g, dtype=torch.float64)
    k, v = (torch.randn(cu_k[-1], kv_heads, dim, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v, cu_q, cu_k, max(a for a, _ in segments), max(b for _, b in segments)


@pytest.mark.parametrize("causal", [True, False])
def test_a_split_forward_gives_the_whole_calls_output_and_log_sum_exp(causal):
    cut = 0
    for trial in range(60):
        rng = random.Random(trial)
        # few rows over long prefixes, beside short documents, rows without keys and segments without rows
        segments = [(q, q + rng.randint(0, 500)) for q in (rng.randint(1, 40) for _ in range(rng.randint(1, 4)))]
        segments += [(rng.randint(1, 30), rng.randint(0, 12)) for _ in range(rng.random() < 0.3)]
        segments += [(0, rng.randint(0, 20)) for _ in range(rng.random() < 0.3)]
        rng.shuffle(segments)
        q, k, v, cu_q, cu_k, max_q, max_k = _packed(segments, trial)
        split = replace(TINY, waves=rng.choice([2.0, 4.0, 8.0]))
        cuts = plan_key_split([a for a, _ in segments], [b for _, b in segments], q.shape[1], split, causal)
        cut += cuts is not None
        whole = attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, kernel="reference")
        got = attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, kernel="reference", key_split=split)
        torch.testing.assert_close(got[0], whole[0], **TOL)
        torch.testing.assert_close(got[1], whole[1], **TOL)
    assert cut >= 30, f"only {cut} of 60 calls were cut: the test tests little"


def test_the_chunks_cover_each_segments_shared_keys_once_and_the_calls_cover_the_batch():
    segments = [(128, 112000), (384, 70000), (200, 3000), (0, 500), (4096, 4096)]
    q_lens, k_lens = [q for q, _ in segments], [k for _, k in segments]
    cuts = plan_key_split(q_lens, k_lens, 32, H200, causal=True)
    assert cuts is not None
    for (q, k), c in zip(segments, cuts):
        if not c:
            continue
        assert c[0] == 0 and c[-1] == k - q and list(c) == sorted(set(c))
        assert all(x % 64 == 0 for x in c[1:-1]) and min(b - a for a, b in zip(c, c[1:])) >= H200.min_keys
    assert cuts[2] == cuts[3] == cuts[4] == ()  # short, rowless and square segments stay whole
    cu_q, cu_k = [0], [0]
    for q, k in segments:
        cu_q.append(cu_q[-1] + q)
        cu_k.append(cu_k[-1] + k)
    calls = split_calls(cu_q, cu_k, cuts, causal=True)
    # the causal call reads every row once and every key once, in order: views, no copies
    assert sum(b - a for a, b, _, _ in calls.causal) == cu_q[-1]
    assert [(c, d) for _, _, c, d in calls.causal] == list(zip([0, *[d for _, _, _, d in calls.causal][:-1]],
                                                               [d for _, _, _, d in calls.causal]))
    assert calls.causal[-1][3] == cu_k[-1]
    # the rect call's keys are contiguous too, and each chunk holds all its segment's rows
    ends = [d for _, _, _, d in calls.rect]
    assert [c for _, _, c, _ in calls.rect][1:] == ends[:-1]
    for a, b, c, d in calls.rect:  # a chunk: all rows of a cut segment over some of the keys they all see
        if b > a:
            i = cu_q.index(a)
            assert cuts[i] and b == cu_q[i + 1] and cu_k[i] <= c < d <= cu_k[i] + cuts[i][-1]
    chunks = sorted((c, d) for a, b, c, d in calls.rect if b > a)
    assert sum(d - c for c, d in chunks) == sum(c[-1] for c in cuts if c)


def test_a_call_that_fills_the_device_or_shares_few_keys_runs_whole():
    assert plan_key_split([128], [112000], 32, H200) is not None  # 32 blocks on 132 SMs
    assert plan_key_split([16384], [16384 + 65536], 32, H200) is None  # 4096 blocks: the device is full
    assert plan_key_split([128], [20000], 32, H200) is not None  # 20K shared keys: cut
    assert plan_key_split([128], [16000], 32, H200) is None  # under min_shared keys: not worth a merge
    assert plan_key_split([1024, 1024], [120000, 118000], 32, H200) is None  # 512 blocks, two even waves
    assert plan_key_split([128], [112000], 32, None) is None
    # a rectangle's rows share all its keys
    assert plan_key_split([128], [40000], 32, H200, causal=False) is not None
    assert plan_key_split([128], [40000], 32, H200, causal=True) is not None
    assert plan_key_split([30000], [40000], 32, H200, causal=True) is None


FA4_H200 = KeySplit(sms=132, tile=(32, 128), launch_order="segment", head_pack=4)  # what FA4's grid declares


def test_a_kernel_that_launches_segment_by_segment_is_cut_where_its_blocks_leave_the_device_idle():
    """FlashAttention-4 on Hopper: one forward block to an SM, a KV head's 4 query heads packed into a 32-row-per-head
    tile, segment after segment. A server's call of 249 rows over a 72K prefix beside whole documents is 64 blocks
    of 568 key tiles: cut, into chunks that launch about ``waves`` waves of 132 blocks. A call whose blocks fill the
    device runs whole, as does one under ``min_shared`` keys."""
    q_lens, k_lens = [249, 1979, 1694, 1326], [72613, 1979, 1694, 1326]
    cuts = plan_key_split(q_lens, k_lens, 32, FA4_H200)
    assert cuts is not None and cuts[1:] == [(), (), ()]  # the whole documents share too few keys to cut
    chunks = len(cuts[0]) - 1
    blocks = 8 * -(-249 // 32) * chunks  # 8 KV heads launched, 8 packed tiles, per chunk
    assert 0.5 * 4 * 132 <= blocks <= 2 * 4 * 132
    assert cuts[0][-1] == 72613 - 249 and all(b - a >= 4096 for a, b in zip(cuts[0], cuts[0][1:]))
    assert plan_key_split([16384], [16384 + 65536], 32, FA4_H200) is None  # 4096 blocks: the device is full
    assert plan_key_split([249], [16000], 32, FA4_H200) is None  # under min_shared keys
    # the rule's launch order comes from the grid, and a grid may now both launch by segment and cut keys
    grid = LaunchGrid(forward_tile=(32, 128), backward_tile=(64, 128), launch_order="segment", forward_head_pack=4,
                      forward_key_split=RULE)
    assert KeySplit.for_grid(grid) == FA4_H200
    terms = PhaseTerms(step=1e-3, q_token=1e-5, call=0.02)
    assert LaunchCostModel(grid, 32, terms, terms).call_terms.key_split == FA4_H200  # the servers' calls cut too
    with pytest.raises(ValueError, match="pairing"):
        replace(grid, forward_pairing=1.6)
    with pytest.raises(ValueError, match="launch_order"):
        KeySplit(sms=132, launch_order="wave")
    # priced as the two calls it makes, beside the merge
    calls = split_calls([0, *np.cumsum(q_lens).tolist()], [0, *np.cumsum(k_lens).tolist()], cuts, causal=True)
    want = _one_call_features("forward", [b - a for a, b, _, _ in calls.causal], [d - c for _, _, c, d in calls.causal],
                              grid, 32, True)
    want += _one_call_features("forward", [b - a for a, b, _, _ in calls.rect], [d - c for _, _, c, d in calls.rect],
                               grid, 32, False)
    want[MERGE] = merged_rows(q_lens, cuts, causal=True)
    np.testing.assert_allclose(call_features("forward", q_lens, k_lens, grid, 32), want)


def test_a_sliding_window_never_splits():
    segments = [(30, 400), (20, 300)]
    q, k, v, cu_q, cu_k, max_q, max_k = _packed(segments, 0)
    assert plan_key_split([30, 20], [400, 300], 4, TINY) is not None
    reset_stats()
    attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, kernel="reference", key_split=TINY)
    assert stats().get("forward.key_split") == 1
    reset_stats()
    windowed = attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, kernel="reference", key_split=TINY, window=50)
    assert "forward.key_split" not in stats()
    torch.testing.assert_close(windowed[0], attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, kernel="reference",
                                                              window=50)[0])


def test_key_split_rules_are_checked_and_travel_with_the_launch_grid():
    with pytest.raises(ValueError, match="KeySplit"):
        KeySplit(sms=0)
    with pytest.raises(ValueError, match="KeySplit"):
        KeySplit(sms=132, gain=0.9)
    with pytest.raises(ValueError, match="forward_key_split"):
        LaunchGrid(forward_key_split=(1.2, 4.0))
    grid = torch_flash.launch_grid(128)
    assert KeySplit.for_grid(grid).rule == grid.forward_key_split == RULE
    assert LaunchGrid.from_dict(grid.to_dict()) == grid
    old = {k: v for k, v in grid.to_dict().items() if k != "forward_key_split"}
    assert LaunchGrid.from_dict(old).forward_key_split is None  # an older model: fitted again, never guessed
    assert KeySplit.for_grid(LaunchGrid()) is None and KeySplit.for_grid(None) is None


def test_the_launch_model_prices_a_split_forward_as_the_two_calls_it_makes():
    grid = replace(LaunchGrid(forward_pairing=1.6, empty_hold=0.3), forward_key_split=H200.rule)
    q_lens, k_lens = [128, 384], [112000, 70000]
    cuts = plan_key_split(q_lens, k_lens, 32, KeySplit.for_grid(grid))
    calls = split_calls([0, 128, 512], [0, 112000, 182000], cuts, causal=True)
    want = _one_call_features("forward", [b - a for a, b, _, _ in calls.causal],
                              [d - c for _, _, c, d in calls.causal], grid, 32, True)
    want += _one_call_features("forward", [b - a for a, b, _, _ in calls.rect], [d - c for _, _, c, d in calls.rect],
                               grid, 32, False)
    parts = [len(c) - 1 for c in cuts]
    assert min(parts) >= 2  # both segments are cut: the merge reads each row once per chunk and once more
    assert merged_rows(q_lens, cuts, causal=True) == 128 * (parts[0] + 1) + 384 * (parts[1] + 1)
    want[MERGE] = merged_rows(q_lens, cuts, causal=True)
    got = call_features("forward", q_lens, k_lens, grid, 32)
    np.testing.assert_allclose(got, want)
    assert got[5] == 2  # two calls
    whole = replace(grid, forward_key_split=None)
    np.testing.assert_allclose(call_features("backward", q_lens, k_lens, grid, 32),
                               call_features("backward", q_lens, k_lens, whole, 32))  # the backward runs whole
    # the tail is what the calls as run cost beyond the whole call at full throughput: here less than whole
    terms = PhaseTerms(step=1e-3, q_token=1e-5, call=0.02)
    split_model, whole_model = (LaunchCostModel(g, 32, terms, PhaseTerms()) for g in (grid, whole))
    assert split_model.tail_cost(q_lens, k_lens) < whole_model.tail_cost(q_lens, k_lens)
    assert split_model.call_cost(q_lens, k_lens) == pytest.approx(
        split_model.phase_cost("forward", q_lens, k_lens) + split_model.phase_cost("backward", q_lens, k_lens))
    # the merge is priced per row it reads, in the call and in the tail the scheduler adds to a server
    merging = LaunchCostModel(grid, 32, replace(terms, merge_row=1e-6), PhaseTerms())
    read = merged_rows(q_lens, cuts, causal=True)
    assert merging.phase_cost("forward", q_lens, k_lens) == pytest.approx(
        split_model.phase_cost("forward", q_lens, k_lens) + read * 1e-6)
    assert merging.tail_cost(q_lens, k_lens) == pytest.approx(split_model.tail_cost(q_lens, k_lens) + read * 1e-6)
    assert merging.call_cost([128, 384], [1000, 900]) == whole_model.call_cost([128, 384], [1000, 900])  # not cut


def test_the_merge_reads_each_rows_parts_where_the_rect_call_wrote_them():
    """A causal segment is merged when it is cut (its chunks with its diagonal block); under no mask every segment
    with rows goes through the merge (a rectangle left whole is its one part); a segment without rows never does.
    Each row's parts lie one block of the segment's rows apart in the rect call's output."""
    assert merged_rows([4, 4, 0], [(0, 8, 16), (), (0, 8, 16)], causal=True) == 4 * 3
    assert merged_rows([4, 4, 4], [(0, 8, 16), (), (0, 8)], causal=False) == 4 * 2 + 4 + 4
    parts = row_parts([0, 4, 7, 7, 9], [(0, 8, 16, 24), (), (0, 8), (0, 8, 16)], causal=True)
    assert parts.rows.tolist() == [0, 1, 2, 3, 7, 8]
    assert parts.first.tolist() == [0, 1, 2, 3, 12, 13] and parts.stride.tolist() == [4, 4, 4, 4, 2, 2]
    assert parts.count.tolist() == [3, 3, 3, 3, 2, 2]
    index, owner = parts.owners()
    assert index.tolist() == [0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11, 12, 14, 13, 15]
    assert owner.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 5, 5]
    whole = row_parts([0, 4, 7], [(0, 8, 16), ()], causal=False)
    assert whole.rows.tolist() == [0, 1, 2, 3, 4, 5, 6] and whole.count.tolist() == [2] * 4 + [1] * 3
    assert whole.first.tolist() == [0, 1, 2, 3, 8, 9, 10] and whole.stride.tolist() == [4] * 4 + [3] * 3


def test_the_emulations_timer_warms_each_split_call_apart():
    """A cut forward allocates buffers of its own shapes; the emulation's timer runs each such call once untimed
    first (as it does each kernel configuration), so a first allocation never lands in a rank's time."""
    from hf_longctx.lab.emulation.timing import _configuration

    def key(segments, split, **kwargs):
        q, k, v, cu_q, cu_k, max_q, max_k = _packed(segments, 0)
        return _configuration("forward", (q, k, v, cu_q, cu_k, max_q, max_k), {"key_split": split, **kwargs})

    cut_a, cut_b = [(30, 400), (20, 300)], [(30, 420), (20, 300)]
    assert key(cut_a, TINY) != key(cut_b, TINY)
    assert key(cut_a, None) == key(cut_b, None)  # whole calls of one configuration warm once
    assert key(cut_a, TINY, window=50) == key(cut_b, TINY, window=50)  # never split under a window
