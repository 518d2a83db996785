"""A varlen batch cut into several kernel calls: the cheapest cut, and the same numbers as one call.

:func:`~hf_longctx.kernels.calls.cut_into_calls` cuts segments (sorted longest keys first by
:func:`~hf_longctx.kernels.calls.call_order`) into contiguous runs, one kernel call each. It must find the
cheapest contiguous cut under :func:`~hf_longctx.kernels.calls.calls_overhead` (checked against a brute
force over every cut), keep one call when cutting cannot pay, and never leave surplus tiles when calls are
free. :func:`~hf_longctx.kernels.calls.forward_in_calls` and :func:`~hf_longctx.kernels.calls.backward_in_calls`
run one call per run on contiguous slices: out, lse, dq, dk and dv must equal one call over the whole batch.
"""

from __future__ import annotations

import itertools
import math
import random
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_longctx.kernels import attention_backward, attention_forward, reset_stats, stats
from hf_longctx.kernels.calls import (
    CallTerms,
    backward_in_calls,
    call_order,
    calls_overhead,
    cut_into_calls,
    forward_in_calls,
)

FP64 = dict(rtol=1e-10, atol=1e-10)


def all_cuts(n: int):
    """Every split of segments [0, n) into contiguous non-empty runs (2 ** (n - 1) of them)."""
    for mask in range(1 << (n - 1)):
        bounds = [0] + [i + 1 for i in range(n - 1) if mask >> i & 1] + [n]
        yield list(zip(bounds, bounds[1:]))


def check_runs_cover(runs, n: int) -> None:
    """Runs cover segments [0, n) in order, contiguous and non-empty."""
    assert runs, "a non-empty batch has at least one run"
    assert runs[0][0] == 0 and runs[-1][1] == n, runs
    assert all(b > a for a, b in runs), runs
    assert all(b == a2 for (_, b), (a2, _) in zip(runs, runs[1:])), runs


def tiles(n: int, tile: int) -> int:
    return -(-n // tile)


@st.composite
def sorted_segments(draw, max_segments: int = 8, max_len: int = 2000):
    """(q_lens, k_lens) of up to ``max_segments`` segments with keys >= queries, in :func:`call_order`."""
    n = draw(st.integers(1, max_segments))
    # lengths drawn from few values too, so that blocks of equal tile counts occur
    length = st.one_of(st.integers(1, max_len), st.sampled_from([1, 16, 17, 128, 129, 256, 1000]))
    k_lens = [draw(length) for _ in range(n)]
    q_lens = [draw(st.integers(1, k)) for k in k_lens]
    order = call_order(q_lens, k_lens)
    return [q_lens[i] for i in order], [k_lens[i] for i in order]


price = st.one_of(st.just(0.0), st.floats(1e-4, 2.0, allow_nan=False, allow_infinity=False))
terms_strategy = st.builds(CallTerms, call=price, q_tile=price, k_tile=price, tile=st.sampled_from([1, 16, 64, 128]))


# ----------------------------------------------------------------------------- the plan


@given(segments=sorted_segments(), terms=terms_strategy)
@settings(max_examples=300, deadline=None)
def test_plan_calls_is_the_cheapest_contiguous_cut(segments, terms):
    q_lens, k_lens = segments
    runs = cut_into_calls(q_lens, k_lens, terms)
    check_runs_cover(runs, len(q_lens))
    best = min(calls_overhead(q_lens, k_lens, cut, terms) for cut in all_cuts(len(q_lens)))
    assert calls_overhead(q_lens, k_lens, runs, terms) == pytest.approx(best, rel=1e-9, abs=1e-12)


def test_plan_calls_is_the_cheapest_cut_on_seeded_batches():
    """The same check on a fixed set of batches (no hypothesis database or shrinking involved)."""
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 8)
        k_lens = [rng.choice([rng.randint(1, 2000), rng.choice([128, 256, 300])]) for _ in range(n)]
        q_lens = [rng.randint(1, k) for k in k_lens]
        order = call_order(q_lens, k_lens)
        q_lens, k_lens = [q_lens[i] for i in order], [k_lens[i] for i in order]
        terms = CallTerms(call=rng.choice([0.0, 0.01, 0.3]), q_tile=rng.choice([0.0, 1e-3, 0.05]),
                          k_tile=rng.choice([0.0, 1e-3, 0.05]), tile=rng.choice([16, 128]))
        runs = cut_into_calls(q_lens, k_lens, terms)
        check_runs_cover(runs, n)
        best = min(calls_overhead(q_lens, k_lens, cut, terms) for cut in all_cuts(n))
        assert calls_overhead(q_lens, k_lens, runs, terms) == pytest.approx(best, rel=1e-9, abs=1e-12), \
            (q_lens, k_lens, terms, runs)


def limit_respected(cut, k_lens, limit: int) -> bool:
    """No run of more than one segment holds more than ``limit`` keys."""
    return all(b - a == 1 or sum(k_lens[a:b]) <= limit for a, b in cut)


def test_plan_calls_is_the_cheapest_cut_under_a_keys_limit():
    """With ``max_keys`` (a kernel that slows down past so many keys per call), the plan is the cheapest of the
    cuts whose runs stay under the limit (a segment over it alone is a run of its own), and of cuts that cost the
    same, the one with the fewest calls."""
    rng = random.Random(1)
    binding = 0
    for _ in range(600):
        n = rng.randint(1, 8)
        k_lens = [rng.choice([rng.randint(1, 2000), rng.choice([128, 129, 256, 300])]) for _ in range(n)]
        q_lens = [rng.randint(1, k) for k in k_lens]
        order = call_order(q_lens, k_lens)
        q_lens, k_lens = [q_lens[i] for i in order], [k_lens[i] for i in order]
        terms = CallTerms(call=rng.choice([0.0, 0.01, 0.3]), q_tile=rng.choice([0.0, 1e-3, 0.05]),
                          k_tile=rng.choice([0.0, 1e-3, 0.05]), tile=rng.choice([16, 128]),
                          max_keys=rng.choice([300, 600, 1000, 2500, 5000]))
        runs = cut_into_calls(q_lens, k_lens, terms)
        check_runs_cover(runs, n)
        assert limit_respected(runs, k_lens, terms.max_keys), (k_lens, terms, runs)
        allowed = [cut for cut in all_cuts(n) if limit_respected(cut, k_lens, terms.max_keys)]
        binding += len(allowed) < 1 << (n - 1)
        best = min(calls_overhead(q_lens, k_lens, cut, terms) for cut in allowed)
        got = calls_overhead(q_lens, k_lens, runs, terms)
        assert got == pytest.approx(best, rel=1e-9, abs=1e-12), (q_lens, k_lens, terms, runs)
        fewest = min(len(cut) for cut in allowed
                     if calls_overhead(q_lens, k_lens, cut, terms) == pytest.approx(best, rel=1e-9, abs=1e-12))
        assert len(runs) == fewest, (q_lens, k_lens, terms, runs)
    assert binding > 200, "the limit seldom bound: the test tests little"


def test_a_keys_limit_alone_cuts_a_batch_into_the_fewest_calls_under_it():
    """Free calls and no tile prices: without a limit one call; with one, as few calls as keep each under it,
    and a segment longer than the limit alone."""
    q_lens, k_lens = [100, 90, 80, 70, 60, 50], [900, 500, 400, 300, 200, 100]
    free = CallTerms()
    assert cut_into_calls(q_lens, k_lens, free) == [(0, 6)]
    runs = cut_into_calls(q_lens, k_lens, CallTerms(max_keys=800))
    # 900 keys alone; the other 1500 in runs of at most 800 contiguous keys need three
    assert limit_respected(runs, k_lens, 800) and len(runs) == 4 and runs[0] == (0, 1), runs
    assert cut_into_calls(q_lens, k_lens, CallTerms(max_keys=2400)) == [(0, 6)]


def test_a_large_batch_over_the_keys_limit_is_cut_under_it_quickly():
    """Thousands of short documents over the limit: planned by blocks cut greedily (not segment by segment),
    every run under the limit."""
    rng = random.Random(2)
    k_lens = sorted((rng.randint(16, 400) for _ in range(3000)), reverse=True)
    q_lens = list(k_lens)
    terms = CallTerms(call=0.02, q_tile=1e-4, k_tile=1e-4, tile=128, max_keys=100_000)
    started = time.perf_counter()
    runs = cut_into_calls(q_lens, k_lens, terms)
    assert time.perf_counter() - started < 2.0
    check_runs_cover(runs, len(k_lens))
    assert limit_respected(runs, k_lens, terms.max_keys)
    assert len(runs) >= -(-sum(k_lens) // terms.max_keys)


def test_call_order_puts_longest_keys_first_then_longest_queries_stably():
    q_lens = [5, 7, 3, 7, 1]
    k_lens = [10, 30, 30, 30, 2]
    assert call_order(q_lens, k_lens) == [1, 3, 2, 0, 4]


def test_empty_batch_has_no_runs():
    assert cut_into_calls([], [], CallTerms(call=1.0, k_tile=1.0)) == []


@given(segments=sorted_segments(), call=price, tile=st.sampled_from([1, 16, 128]))
@settings(max_examples=60, deadline=None)
def test_one_call_when_surplus_tiles_cost_nothing(segments, call, tile):
    q_lens, k_lens = segments
    assert cut_into_calls(q_lens, k_lens, None) == [(0, len(q_lens))]
    assert cut_into_calls(q_lens, k_lens, CallTerms(call=call, tile=tile)) == [(0, len(q_lens))]


@given(segments=sorted_segments(), terms=terms_strategy)
@settings(max_examples=60, deadline=None)
def test_one_call_when_a_call_costs_more_than_any_surplus(segments, terms):
    q_lens, k_lens = segments
    huge = CallTerms(call=1e9, q_tile=terms.q_tile, k_tile=terms.k_tile, tile=terms.tile)
    assert cut_into_calls(q_lens, k_lens, huge) == [(0, len(q_lens))]


@given(segments=sorted_segments(), q_tile=st.floats(1e-4, 1.0), k_tile=st.floats(1e-4, 1.0),
       tile=st.sampled_from([1, 16, 128]))
@settings(max_examples=100, deadline=None)
def test_free_calls_leave_no_surplus_tiles(segments, q_tile, k_tile, tile):
    """Calls cost nothing, tiles something: every run holds segments of equal tile counts."""
    q_lens, k_lens = segments
    terms = CallTerms(call=0.0, q_tile=q_tile, k_tile=k_tile, tile=tile)
    runs = cut_into_calls(q_lens, k_lens, terms)
    check_runs_cover(runs, len(q_lens))
    for a, b in runs:
        assert len({(tiles(q, tile), tiles(k, tile)) for q, k in zip(q_lens[a:b], k_lens[a:b])}) == 1, runs
    assert calls_overhead(q_lens, k_lens, runs, terms) == 0.0


def test_a_long_segment_gets_its_own_call_beside_many_short_ones():
    """One 32K-key segment and 64 of 128 rows: fused, each short one pays 255 surplus key tiles (3.26 units,
    far above a call's 0.25), so the long one is cut off into its own call and nothing else is paid."""
    terms = CallTerms(call=0.25, k_tile=2e-4, tile=128)
    q_lens, k_lens = [32768] + [128] * 64, [32768] + [128] * 64
    assert call_order(q_lens, k_lens) == list(range(65))
    runs = cut_into_calls(q_lens, k_lens, terms)
    assert runs == [(0, 1), (1, 65)]
    assert calls_overhead(q_lens, k_lens, runs, terms) == pytest.approx(2 * terms.call)
    assert calls_overhead(q_lens, k_lens, [(0, 65)], terms) == pytest.approx(0.25 + 2e-4 * 64 * 255)


def test_calls_overhead_prices_calls_and_surplus_tiles():
    terms = CallTerms(call=1.0, q_tile=0.5, k_tile=0.25, tile=10)
    q_lens, k_lens = [30, 10, 1], [40, 20, 5]  # query tiles 3, 1, 1; key tiles 4, 2, 1
    assert calls_overhead(q_lens, k_lens, [(0, 3)], terms) == pytest.approx(1.0 + 0.5 * (2 + 2) + 0.25 * (2 + 3))
    assert calls_overhead(q_lens, k_lens, [(0, 1), (1, 3)], terms) == pytest.approx(2.0 + 0.25 * 1)
    assert calls_overhead(q_lens, k_lens, [(0, 1), (1, 2), (2, 3)], terms) == pytest.approx(3.0)
    assert calls_overhead(q_lens, k_lens, [(0, 1), (1, 1), (1, 3)], terms) == pytest.approx(2.25)  # empty run free


@pytest.mark.parametrize("field", ["call", "q_tile", "k_tile"])
@pytest.mark.parametrize("value", [-1e-9, -1.0, math.nan, math.inf, -math.inf])
def test_call_terms_reject_negative_or_non_finite_prices(field, value):
    with pytest.raises(ValueError, match=field):
        CallTerms(**{field: value})


@pytest.mark.parametrize("max_keys", [0, -5, 2.5, True])
def test_call_terms_reject_a_keys_limit_that_is_not_a_positive_int(max_keys):
    with pytest.raises(ValueError, match="max_keys"):
        CallTerms(max_keys=max_keys)


@pytest.mark.parametrize("tile", [0, -128, 1.5, True, "128"])
def test_call_terms_reject_a_tile_that_is_not_a_positive_int(tile):
    with pytest.raises(ValueError, match="tile"):
        CallTerms(tile=tile)


def test_call_terms_accept_zero_prices_and_say_when_tiles_cost():
    assert not CallTerms().active
    assert not CallTerms(call=3.0).active
    assert CallTerms(q_tile=1e-6).active and CallTerms(k_tile=1e-6, tile=1).active


# ----------------------------------------------------------------------------- the calls


def make_segments(seed: int, n: int, hq: int = 4, hkv: int = 2, d: int = 16):
    """``n`` packed segments with keys >= queries (bottom-right causal), fp64 q, k, v, dout and offsets."""
    rng = random.Random(seed)
    k_lens = [rng.choice([1, rng.randint(1, 12), rng.randint(12, 60)]) for _ in range(n)]
    q_lens = [rng.randint(1, k) for k in k_lens]
    cu_q, cu_k = [0], [0]
    for nq, nk in zip(q_lens, k_lens):
        cu_q.append(cu_q[-1] + nq)
        cu_k.append(cu_k[-1] + nk)
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(cu_q[-1], hq, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(cu_k[-1], hkv, d, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v, dout, cu_q, cu_k


def one_call(q, k, v, dout, cu_q, cu_k, window):
    max_q = max(b - a for a, b in zip(cu_q, cu_q[1:]))
    max_k = max(b - a for a, b in zip(cu_k, cu_k[1:]))
    out, lse = attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, kernel="reference", window=window)
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, kernel="reference",
                                    window=window)
    return out, lse, dq, dk, dv


RUNS = [
    [(0, 5)],
    [(0, 2), (2, 3), (3, 5)],
    [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)],
    [(0, 4), (4, 5)],
]


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("runs", RUNS, ids=lambda r: "-".join(f"{a}:{b}" for a, b in r))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_calls_give_the_numbers_of_one_call(seed, runs, window):
    q, k, v, dout, cu_q, cu_k = make_segments(seed, 5)
    want = one_call(q, k, v, dout, cu_q, cu_k, window)
    reset_stats()
    out, lse = forward_in_calls(q, k, v, cu_q, cu_k, runs, kernel="reference", window=window)
    dq, dk, dv = backward_in_calls(dout, q, k, v, out, lse, cu_q, cu_k, runs, kernel="reference", window=window)
    assert stats().get("forward") == len(runs) and stats().get("backward") == len(runs), stats()
    for name, got, ref in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), want):
        assert got.shape == ref.shape and got.dtype == ref.dtype, (name, got.shape, ref.shape)
        assert torch.allclose(got, ref, **FP64), (name, (got - ref).abs().max().item())
    assert lse.shape == (q.shape[1], q.shape[0])


def test_calls_planned_with_tile_prices_give_the_numbers_of_one_call():
    """The whole path: segments sorted by :func:`call_order`, cut by :func:`cut_into_calls` into several runs."""
    q, k, v, dout, cu_q, cu_k = make_segments(7, 12)
    q_lens = [b - a for a, b in zip(cu_q, cu_q[1:])]
    k_lens = [b - a for a, b in zip(cu_k, cu_k[1:])]
    order = call_order(q_lens, k_lens)
    q_rows = torch.cat([torch.arange(cu_q[i], cu_q[i + 1]) for i in order])
    k_rows = torch.cat([torch.arange(cu_k[i], cu_k[i + 1]) for i in order])
    q, dout, k, v = q[q_rows], dout[q_rows], k[k_rows], v[k_rows]
    q_lens, k_lens = [q_lens[i] for i in order], [k_lens[i] for i in order]
    cu_q, cu_k = list(itertools.accumulate(q_lens, initial=0)), list(itertools.accumulate(k_lens, initial=0))
    runs = cut_into_calls(q_lens, k_lens, CallTerms(call=0.0, q_tile=1.0, k_tile=1.0, tile=8))
    assert len(runs) > 2, runs
    for window in (None, 7):
        want = one_call(q, k, v, dout, cu_q, cu_k, window)
        out, lse = forward_in_calls(q, k, v, cu_q, cu_k, runs, kernel="reference", window=window)
        grads = backward_in_calls(dout, q, k, v, out, lse, cu_q, cu_k, runs, kernel="reference", window=window)
        for name, got, ref in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), want):
            assert torch.allclose(got, ref, **FP64), (name, window, (got - ref).abs().max().item())
