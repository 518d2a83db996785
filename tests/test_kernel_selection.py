"""How kernels are chosen, bucketed and fallen back from: the parts that need no GPU.

The fast kernels (FlashAttention-4, cuDNN on packed documents) are optional extras and GPU-only;
their numerics are checked in tests/gpu. What is checked here: shapes round onto a grid that
bounds cuDNN's graph count, the padded-LSE budget splits a call into contiguous runs, an explicit
kernel without its wheel says how to install it, and ``auto`` falls back from a kernel that fails
for one configuration without giving up on it for others.
"""

from __future__ import annotations

import random

import pytest
import torch

from hf_longctx.kernels import (
    attention_backward,
    attention_forward,
    dispatch,
    fa4,
    kernel_call,
    reference,
    torch_flash,
)
from hf_longctx.kernels.buckets import bucket, lse_runs, padded_segments

from helpers import cumulative


@pytest.mark.parametrize("steps", [1, 2, 4, 8])
def test_bucket_rounds_up_by_at_most_one_step(steps):
    for n in list(range(0, 300)) + [4095, 4096, 4097, 65535, 131073, 10**6]:
        b = bucket(n, steps)
        assert b >= n
        assert b <= max(n, 8) * (1 + 1 / steps)
        assert bucket(b, steps) == b  # grid values are fixed points


def test_bucket_bounds_the_number_of_distinct_shapes():
    """200 random ProLong-like batches: segment counts and max lengths fall on a few grid values."""
    rng = random.Random(0)
    counts, lengths = set(), set()
    for _ in range(200):
        docs = [min(int(rng.lognormvariate(8, 2)) + 1, 131072) for _ in range(rng.randint(1, 120))]
        counts.add(bucket(len(docs)))
        lengths.add(bucket(max(docs)))
    assert len(counts) <= 14 and len(lengths) <= 36
    assert len(counts) * len(lengths) < 200


def test_padded_segments_appends_empty_segments():
    assert padded_segments([0, 3, 7], 4) == [0, 3, 7, 7, 7]
    assert padded_segments([0, 3, 7], 2) == [0, 3, 7]
    with pytest.raises(ValueError, match="cannot pad"):
        padded_segments([0, 3, 7], 1)


def test_lse_runs_cover_every_segment_once_within_budget():
    rng = random.Random(1)
    for _ in range(100):
        lens = [rng.choice([1, rng.randint(1, 500), rng.randint(1, 70000)]) for _ in range(rng.randint(1, 60))]
        cu = cumulative(lens)
        heads, budget = 32, rng.choice([2**20, 2**24, 2**28])
        runs = lse_runs(cu, heads, budget)
        assert runs[0][0] == 0 and runs[-1][1] == len(lens)
        assert all(a < b for a, b in runs) and all(r[1] == s[0] for r, s in zip(runs, runs[1:]))
        for a, b in runs:
            padded = bucket(b - a) * heads * bucket(max(lens[a:b])) * 4
            assert padded <= budget or b - a == 1, "a run over budget must be a single segment"


def test_lse_runs_keep_one_run_when_it_fits():
    assert lse_runs(cumulative([100] * 20), 32, 2**30) == [(0, 20)]


def test_explicit_kernel_without_its_extra_names_the_install_command():
    if fa4.is_installed():
        pytest.skip("flash-attn-4 is installed here")
    q = torch.randn(4, 2, 8)
    with pytest.raises(ValueError, match=r"flash-attn-4 is not installed.*pip install \"hf-longctx\[fa4\]\""):
        attention_forward(q, q, q, [0, 4], [0, 4], 4, 4, kernel="fa4")


def test_unknown_kernel_lists_the_choices():
    q = torch.randn(4, 2, 8)
    with pytest.raises(ValueError, match="unknown kernel 'fa5'.*fa4, cudnn_varlen, cudnn, torch_flash, reference"):
        attention_forward(q, q, q, [0, 4], [0, 4], 4, 4, kernel="fa5")


def test_auto_falls_back_for_the_failing_configuration_only(monkeypatch, caplog):
    """A kernel whose compile fails for one configuration keeps serving the others."""
    calls = []

    def flaky_forward(call):
        calls.append(call.q.shape[-1])
        if call.q.shape[-1] == 16:
            raise RuntimeError("compile failed for head_dim 16")
        return reference.forward(call)

    monkeypatch.setattr(torch_flash, "supports", lambda call: None)
    monkeypatch.setattr(torch_flash, "forward", flaky_forward)
    for name in ("fa4", "cudnn_varlen", "cudnn"):  # out of the way: torch_flash is auto's first choice here
        monkeypatch.setattr(dispatch.get_kernel(name), "supports", lambda call: "not here")
    monkeypatch.setattr(dispatch, "_broken", {})
    dispatch.reset_stats()
    for d in (16, 16, 8):
        q = torch.randn(6, 2, d, dtype=torch.float64)
        out, _ = attention_forward(q, q, q, [0, 6], [0, 6], 6, 6)
        ref, _ = attention_forward(q, q, q, [0, 6], [0, 6], 6, 6, kernel="reference")
        torch.testing.assert_close(out, ref)
    assert calls == [16, 8], "head_dim 16 was tried once, then skipped; head_dim 8 still used the kernel"
    assert "compile failed for head_dim 16" in caplog.text
    assert dispatch.stats()["forward.torch_flash"] == 2  # the failed try and head_dim 8
    assert dispatch.stats()["forward.reference"] == 5  # 2 for head_dim 16 under auto + 3 explicit


def test_running_out_of_memory_is_raised_not_fallen_back_from(monkeypatch):
    """Out of memory in the first kernel: the error reaches the caller and the kernel is not marked broken (the
    next ones, the reference last, need more memory)."""
    def out_of_memory(call):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(torch_flash, "supports", lambda call: None)
    monkeypatch.setattr(torch_flash, "forward", out_of_memory)
    for name in ("fa4", "cudnn_varlen", "cudnn"):
        monkeypatch.setattr(dispatch.get_kernel(name), "supports", lambda call: "not here")
    monkeypatch.setattr(dispatch, "_broken", {})
    dispatch.reset_stats()
    q = torch.randn(6, 2, 8, dtype=torch.float64)
    with pytest.raises(torch.OutOfMemoryError):
        attention_forward(q, q, q, [0, 6], [0, 6], 6, 6)
    assert dispatch._broken == {} and dispatch.stats().get("forward.reference", 0) == 0


def test_auto_backward_uses_the_final_out_and_lse_whatever_kernel_ran_forward():
    """Backward may run on another kernel than forward: only out and lse travel between them."""
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(9, 2, 8, generator=g, dtype=torch.float64) for _ in range(4))
    out, lse = attention_forward(q, k, v, [0, 4, 9], [0, 4, 9], 5, 5, kernel="reference")
    a = attention_backward(dout, q, k, v, out, lse, [0, 4, 9], [0, 4, 9], 5, 5)
    b = attention_backward(dout, q, k, v, out, lse, [0, 4, 9], [0, 4, 9], 5, 5, kernel="reference")
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y)


def test_padded_lse_places_every_row_at_its_segment_and_offset():
    """cuDNN's packed backward reads lse as (segments, heads, max_len): row j of segment i at [i, :, j]."""
    from hf_longctx.kernels.cudnn_varlen import padded_lse

    cu = [0, 3, 3, 7]  # the middle segment is empty
    lse = torch.randn(2, 7)
    padded = padded_lse(lse, cu, segments=4, max_len=5)
    assert padded.shape == (4, 2, 5, 1) and padded.dtype == torch.float32
    for i in range(3):
        for j in range(cu[i + 1] - cu[i]):
            torch.testing.assert_close(padded[i, :, j, 0], lse[:, cu[i] + j])
    assert padded[1].abs().sum() == 0 and padded[3].abs().sum() == 0


def test_a_missing_extra_is_named_once_where_it_would_help(monkeypatch, caplog):
    """auto logs the install command of a faster kernel once per process, and only for a device it serves."""
    from hf_longctx.kernels import cudnn_varlen

    monkeypatch.setattr(dispatch, "_hinted", set())
    monkeypatch.setattr(fa4, "is_installed", lambda: False)
    monkeypatch.setattr(cudnn_varlen, "is_installed", lambda: False)
    monkeypatch.setattr(cudnn_varlen, "worth_installing", lambda device: False)
    q = torch.randn(4, 2, 8)
    call = kernel_call(q, q, q, [0, 4], [0, 4], 4, 4)
    dispatch.select_kernel("auto", call)
    assert "not installed" not in caplog.text, "fa4 is no help on a CPU: no hint"
    monkeypatch.setattr(fa4, "worth_installing", lambda device: True)
    for _ in range(3):
        assert dispatch.select_kernel("auto", call) == "reference"
    assert caplog.text.count('pip install "hf-longctx[fa4]"') == 1
    assert "cudnn_varlen" not in caplog.text
