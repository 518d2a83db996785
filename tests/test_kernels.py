"""The single-device kernels compute exact softmax attention over packed documents.

Every kernel available on this machine is checked against a naive fp64 implementation with explicit
masks, forward (out and lse) and backward (dq, dk, dv through autograd of the naive version).
"""

from __future__ import annotations

import random

import pytest
import torch

from hf_longctx.kernels import (
    PartialAccumulator,
    attention_backward,
    attention_forward,
    available_kernels,
    merge_partials,
    merge_rows_,
    reset_stats,
    stats,
)

from helpers import cumulative, naive_attention, random_doc_lens, row_parts_problem

KERNELS = available_kernels("cpu")


def _problem(seed, hq, hkv, d, dtype, causal_shapes=True):
    rng = random.Random(seed)
    lens_q = random_doc_lens(rng, rng.randint(1, 300), max_len=120)
    if causal_shapes:
        lens_k = [n + rng.choice([0, 0, rng.randint(0, 50)]) for n in lens_q]  # Sk >= Sq and Sk == Sq
    else:
        lens_k = [rng.randint(0, 90) for _ in lens_q]  # includes empty key segments
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), hq, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(sum(lens_k), hkv, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(sum(lens_k), hkv, d, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v, cumulative(lens_q), cumulative(lens_k)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("d", [8, 32, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_forward_backward_match_naive_fp64(kernel, seed, hq, hkv, d, causal):
    q, k, v, cu_q, cu_k = _problem(seed * 7 + d, hq, hkv, d, torch.float64, causal_shapes=causal)
    out, lse = attention_forward(q, k, v, torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32),
                                 0, 0, causal=causal, kernel=kernel)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = naive_attention(qr, kr, vr, cu_q, cu_k, causal=causal)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)
    dout = torch.randn_like(out)
    ref_out.backward(dout)
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, 0, 0, causal=causal, kernel=kernel)
    torch.testing.assert_close(dq, qr.grad, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(dk, kr.grad, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(dv, vr.grad, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_low_precision_inputs_stay_close(dtype, tol):
    q, k, v, cu_q, cu_k = _problem(11, 8, 2, 64, dtype)
    out, lse = attention_forward(q, k, v, cu_q, cu_k, 0, 0, kernel="reference")
    ref_out, ref_lse = naive_attention(q, k, v, cu_q, cu_k)
    assert lse.dtype == torch.float32 and out.dtype == dtype
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=tol, atol=tol)


def test_rows_without_visible_keys_give_zero_and_minus_inf():
    # Segment 0: 5 queries, 2 keys, causal bottom-right: rows 0..2 see nothing. Segment 1: no keys at all.
    q = torch.randn(8, 2, 16, dtype=torch.float64)
    k = torch.randn(2, 2, 16, dtype=torch.float64)
    v = torch.randn(2, 2, 16, dtype=torch.float64)
    out, lse = attention_forward(q, k, v, [0, 5, 8], [0, 2, 2], 5, 2, causal=True)
    assert torch.isneginf(lse[:, :3]).all() and torch.isneginf(lse[:, 5:]).all()
    assert torch.isfinite(lse[:, 3:5]).all()
    assert (out[:3] == 0).all() and (out[5:] == 0).all()
    dq, dk, dv = attention_backward(torch.randn_like(out), q, k, v, out, lse, [0, 5, 8], [0, 2, 2], 5, 2)
    assert torch.isfinite(dq).all() and (dq[:3] == 0).all() and (dq[5:] == 0).all()
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()


def test_gradcheck_reference_in_fp64():
    g = torch.Generator().manual_seed(3)
    cu_q, cu_k = [0, 3, 8, 10], [0, 1, 6, 10]  # rows with no visible key, an aligned and a shifted segment
    q = torch.randn(10, 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(10, 2, 8, generator=g, dtype=torch.float64)
    v = torch.randn(10, 2, 8, generator=g, dtype=torch.float64)

    class Attn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse = attention_forward(q, k, v, cu_q, cu_k, 0, 0, kernel="reference")
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse = ctx.saved_tensors
            return attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, 0, 0, kernel="reference")

    inputs = tuple(t.clone().requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(Attn.apply, inputs, eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_merge_of_two_key_halves_equals_attention_over_union(seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(20, 4, 16, generator=g, dtype=torch.float64)
    k = torch.randn(30, 2, 16, generator=g, dtype=torch.float64)
    v = torch.randn(30, 2, 16, generator=g, dtype=torch.float64)
    split = 13
    out_a, lse_a = attention_forward(q, k[:split], v[:split], [0, 20], [0, split], 20, split, causal=False)
    out_b, lse_b = attention_forward(q, k[split:], v[split:], [0, 20], [0, 30 - split], 20, 30 - split, causal=False)
    out, lse = merge_partials(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = naive_attention(q, k, v, [0, 20], [0, 30], causal=False)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)
    # Gradients of the pieces, each computed with the FINAL out/lse, add up to the full gradient.
    dout = torch.randn_like(out)
    dq_a, dk_a, dv_a = attention_backward(dout, q, k[:split], v[:split], out, lse, [0, 20], [0, split], 20, split,
                                          causal=False)
    dq_b, dk_b, dv_b = attention_backward(dout, q, k[split:], v[split:], out, lse, [0, 20], [0, 30 - split], 20,
                                          30 - split, causal=False)
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, [0, 20], [0, 30], 20, 30, causal=False)
    torch.testing.assert_close(dq_a + dq_b, dq, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat([dk_a, dk_b]), dk, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat([dv_a, dv_b]), dv, rtol=1e-12, atol=1e-12)


def test_merge_with_empty_side_and_accumulator():
    out = torch.randn(6, 2, 4, dtype=torch.float64)
    lse = torch.randn(2, 6, dtype=torch.float64)
    empty_out = torch.zeros_like(out)
    empty_lse = torch.full_like(lse, float("-inf"))
    m_out, m_lse = merge_partials(out, lse, empty_out, empty_lse)
    torch.testing.assert_close(m_out, out)
    torch.testing.assert_close(m_lse, lse)
    both_out, both_lse = merge_partials(empty_out, empty_lse, empty_out, empty_lse)
    assert (both_out == 0).all() and torch.isneginf(both_lse).all()
    acc = PartialAccumulator(10, 2, 4, torch.float64, torch.device("cpu"))
    acc.add(2, out, lse)
    r_out, r_lse = acc.result()
    torch.testing.assert_close(r_out[2:8], out)
    assert (r_out[:2] == 0).all() and torch.isneginf(r_lse[:, 8:]).all()


def test_the_accumulator_equals_pairwise_merges_whatever_its_first_result_covers():
    """A first result over every row is taken as it is (no fill, no merge); a first result over some rows, later
    results, and no result at all give what pairwise merges from an empty result give."""
    g = torch.Generator().manual_seed(3)
    parts = [(0, 6), (1, 3), (4, 2)]  # (start, rows)
    results = [(torch.randn(n, 2, 4, dtype=torch.float64, generator=g),
                torch.randn(2, n, dtype=torch.float64, generator=g)) for _, n in parts]
    results[0][1][:, 5] = float("-inf")  # a row that saw no key (its out is 0, as every kernel gives)
    results[0][0][5] = 0
    for order in ([0, 1, 2], [1, 0, 2], [2, 1]):
        want_out = torch.zeros(6, 2, 4, dtype=torch.float64)
        want_lse = torch.full((2, 6), float("-inf"), dtype=torch.float64)
        acc = PartialAccumulator(6, 2, 4, torch.float64, torch.device("cpu"))
        for i in order:
            (start, n), (out, lse) = parts[i], results[i]
            acc.add(start, out, lse)
            merged = merge_partials(want_out[start:start + n], want_lse[:, start:start + n], out, lse)
            want_out[start:start + n], want_lse[:, start:start + n] = merged
        got_out, got_lse = acc.result()
        torch.testing.assert_close(got_out, want_out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got_lse, want_lse, rtol=1e-12, atol=1e-12)
    never = PartialAccumulator(3, 2, 4, torch.float32, torch.device("cpu")).result()
    assert (never[0] == 0).all() and torch.isneginf(never[1]).all()


def test_stats_count_calls_per_kernel():
    reset_stats()
    q = torch.randn(4, 2, 8)
    attention_forward(q, q, q, [0, 4], [0, 4], 4, 4)
    attention_forward(q, q, q, [0, 4], [0, 4], 4, 4)
    assert stats()["forward"] == 2 and stats()["forward.reference"] == 2


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(q=torch.randn(4, 3, 8), k=torch.randn(4, 2, 8)), "multiple of key/value heads"),
        (dict(q=torch.randn(4, 2, 8), k=torch.randn(4, 2, 16)), "head_dim"),
        (dict(q=torch.randn(4, 2, 8).long()), "dtype"),
        (dict(q=torch.randn(4, 2, 8).half()), "share a dtype"),
        (dict(cu_q=[0, 3]), "end at the number of tokens"),
        (dict(cu_q=[0, 2, 4], cu_k=[0, 4]), "same documents"),
        (dict(q=torch.randn(1, 4, 2, 8)), "token-major"),
        (dict(kernel="flashy"), "unknown kernel"),
        (dict(kernel="torch_flash"), "torch_flash needs CUDA"),
        (dict(kernel="cudnn"), "cudnn needs CUDA"),
    ],
)
def test_bad_input_raises_clear_value_error(kwargs, match):
    args = dict(q=torch.randn(4, 2, 8), k=torch.randn(4, 2, 8), cu_q=[0, 4], cu_k=[0, 4], kernel="auto")
    args.update(kwargs)
    k = args["k"]
    with pytest.raises(ValueError, match=match):
        attention_forward(args["q"], k, k.clone(), args["cu_q"], args["cu_k"], 4, 4, kernel=args["kernel"])


# ----------------------------------------------------------------------------- sliding window


def _window_problem(seed, causal):
    """Varlen segments with q shorter and longer than k, empty key segments, and one long segment."""
    rng = random.Random(seed)
    lens_q = random_doc_lens(rng, rng.randint(20, 150), max_len=60) + [rng.randint(100, 200)]
    lens_k = [max(0, n + rng.choice([0, 0, rng.randint(-20, 40)])) for n in lens_q[:-1]] + [lens_q[-1] + 40]
    if not causal:
        lens_k[0] = 0
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), 8, 16, generator=g, dtype=torch.float64)
    k = torch.randn(sum(lens_k), 2, 16, generator=g, dtype=torch.float64)
    v = torch.randn(sum(lens_k), 2, 16, generator=g, dtype=torch.float64)
    return q, k, v, cumulative(lens_q), cumulative(lens_k)


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [1, 3, 16, 100, 10_000])
def test_sliding_window_matches_naive_masked_softmax_fp64(seed, causal, window, monkeypatch):
    """window=w: query i sees keys i + o - w < j (<= i + o when causal), o = Sk - Sq, per segment.

    Small reference tiles, so long segments span many tiles and those wholly outside the band are skipped.
    """
    from hf_longctx.kernels import reference

    monkeypatch.setattr(reference, "BLOCK", 32)
    q, k, v, cu_q, cu_k = _window_problem(seed * 5 + window, causal)
    out, lse = attention_forward(q, k, v, cu_q, cu_k, 0, 0, causal=causal, window=window, kernel="reference")
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = naive_attention(qr, kr, vr, cu_q, cu_k, causal=causal, window=window)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)
    dout = torch.randn_like(out)
    ref_out.backward(dout)
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, 0, 0, causal=causal, window=window,
                                    kernel="reference")
    torch.testing.assert_close(dq, qr.grad, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(dk, kr.grad, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(dv, vr.grad, rtol=1e-9, atol=1e-9)
    if window < 100:  # the window binds: the result is not plain attention
        plain, _ = attention_forward(q, k, v, cu_q, cu_k, 0, 0, causal=causal, kernel="reference")
        assert not torch.allclose(out, plain)


def test_window_of_one_sees_only_the_diagonal_key_and_empty_rows_stay_zero():
    # 5 queries, 2 keys, causal, window 1: query i sees only key i - 3, so rows 0..2 see nothing.
    q = torch.randn(5, 2, 8, dtype=torch.float64)
    k = torch.randn(2, 2, 8, dtype=torch.float64)
    v = torch.randn(2, 2, 8, dtype=torch.float64)
    out, lse = attention_forward(q, k, v, [0, 5], [0, 2], 5, 2, causal=True, window=1, kernel="reference")
    assert torch.isneginf(lse[:, :3]).all() and (out[:3] == 0).all()
    torch.testing.assert_close(out[3:], v)  # one visible key: its value, exactly
    dq, dk, dv = attention_backward(torch.randn_like(out), q, k, v, out, lse, [0, 5], [0, 2], 5, 2, causal=True,
                                    window=1, kernel="reference")
    assert all(torch.isfinite(t).all() for t in (dq, dk, dv)) and (dq[:3] == 0).all()
    # softmax over a single key has no gradient with respect to the query
    torch.testing.assert_close(dq[3:], torch.zeros_like(dq[3:]), rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
def test_gradcheck_windowed_reference_in_fp64(causal):
    g = torch.Generator().manual_seed(5)
    cu_q, cu_k = [0, 3, 8, 10], [0, 1, 6, 10]  # q longer than k, q equal to k, q shorter than k
    q = torch.randn(10, 2, 4, generator=g, dtype=torch.float64)
    k = torch.randn(10, 1, 4, generator=g, dtype=torch.float64)
    v = torch.randn(10, 1, 4, generator=g, dtype=torch.float64)

    class Attn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse = attention_forward(q, k, v, cu_q, cu_k, 0, 0, causal=causal, window=2, kernel="reference")
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse = ctx.saved_tensors
            return attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, 0, 0, causal=causal, window=2,
                                      kernel="reference")

    inputs = tuple(t.clone().requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(Attn.apply, inputs, eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("window", [0, -3, 2.5, True, "16"])
def test_window_must_be_a_positive_int(window):
    q = torch.randn(4, 2, 8)
    with pytest.raises(ValueError, match="window"):
        attention_forward(q, q, q, [0, 4], [0, 4], 4, 4, window=window)


def test_cudnn_declines_single_token_segments():
    """cuDNN's dense backward crashes the process on a rerun of a single-token graph: such calls never reach it."""
    from hf_longctx.kernels import cudnn, kernel_call

    q = torch.randn(9, 2, 8)
    assert "single-token" in cudnn.supports(kernel_call(q, q, q, [0, 1, 9], [0, 1, 9], 8, 8))
    assert "single-token" in cudnn.supports(kernel_call(q[:1], q, q, [0, 1], [0, 9], 1, 9, causal=False))


def test_cudnn_declines_a_window_and_torch_flash_takes_it():
    from hf_longctx.kernels import cudnn, kernel_call, torch_flash

    q = torch.randn(8, 2, 8)
    assert "sliding window" in cudnn.supports(kernel_call(q, q, q, [0, 8], [0, 8], 8, 8, window=4))
    # torch's FlashAttention ops take flash-attn's (left, right) window sizes in this torch build
    schema = str(torch.ops.aten._flash_attention_forward.default._schema)
    assert "window_size_left" in schema and "window_size_right" in schema
    assert torch_flash._window_kwargs(True, 5) == {"window_size_left": 4, "window_size_right": 0}
    assert torch_flash._window_kwargs(False, 5) == {"window_size_left": 4, "window_size_right": -1}


def test_rows_merge_in_place_from_parts_in_any_order_several_per_row():
    """A CAD row's key parts come back from several servers in one message: ``merge_rows_`` folds any number of
    parts per row into the running result, equal to merging them pairwise, and leaves other rows alone."""
    g = torch.Generator().manual_seed(0)
    rows, heads, dim = 7, 2, 4
    parts = [(torch.randn(rows, heads, dim, generator=g, dtype=torch.float64),
              torch.randn(heads, rows, generator=g, dtype=torch.float64)) for _ in range(3)]
    parts[2][1][:, 4] = float("-inf")  # a part that saw no key of row 4
    want_out, want_lse = merge_partials(*parts[0], *parts[1])
    want_out, want_lse = merge_partials(want_out, want_lse, *parts[2])
    out = torch.full((rows + 2, heads, dim), 5.0, dtype=torch.float64)  # two rows no part touches
    lse = torch.full((rows + 2, heads), 3.0, dtype=torch.float64)
    out[:rows], lse[:rows] = 0.0, float("-inf")
    touched = torch.arange(rows)
    merge_rows_(out, lse, touched, touched, parts[1][0], parts[1][1].t())
    both = torch.cat([touched, touched]).flip(0)  # parts 0 and 2 of every row in one message, in reverse
    merge_rows_(out, lse, touched, both, torch.cat([parts[0][0], parts[2][0]]).flip(0),
                torch.cat([parts[0][1].t(), parts[2][1].t()]).flip(0))
    torch.testing.assert_close(out[:rows], want_out, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(lse[:rows], want_lse.t(), rtol=1e-13, atol=1e-13)
    assert (out[rows:] == 5.0).all() and (lse[rows:] == 3.0).all()


@pytest.mark.parametrize("include_self", [True, False])
def test_strided_row_parts_merge_in_one_pass(include_self):
    """A key split's chunks leave each cut row several parts, one block of the segment's rows apart:
    ``merge_row_parts_`` merges every row at once, with the row's own result (a causal call's diagonal block) or
    without, equal to folding the parts pairwise; rows that saw no key give out 0 and lse -inf, and rows no block
    names keep theirs."""
    from hf_longctx.kernels.merge import merge_row_parts_

    out, lse, parts, part_out, part_lse, expected = row_parts_problem(0, torch.float64, "cpu")
    before = out.clone(), lse.clone()
    merge_row_parts_(out, lse, parts, part_out, part_lse, include_self=include_self)
    want_out, want_lse = expected[include_self]
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    assert (out[18, 2] == 0).all() and lse[2, 18] == float("-inf")  # no key for that head anywhere
    untouched = [r for r in range(len(out)) if r not in set(parts.rows.tolist())]
    assert (out[untouched] == before[0][untouched]).all() and (lse[:, untouched] == before[1][:, untouched]).all()
