"""Every CUDA kernel keeps the kernel contract on the GPU, checked against fp64 attention.

Cases: one document, equal documents, mixed lengths 1..4096 with length-1 documents, queries
longer and shorter than keys (bottom-right causal; rows without keys give out 0 and lse -inf),
GQA groups 1/4/8, head dims 64 and 128, full (non-causal) blocks. Outputs, lse and all three
gradients are compared in relative norm; bf16 kernels land near 4e-3, so 1e-2 fails a real bug.
A kernel that declines an input must say why; FlashAttention-4 and cuDNN on packed documents must
serve every case they are installed for (cuDNN before 9.26 declines rows without keys).
"""

from __future__ import annotations

import random

import pytest
import torch

from hf_longctx.backends import default_strategy, sequence_parallel_attention
from hf_longctx.backends.registry import backend_names, get_backend
from hf_longctx.kernels import (
    attention_backward,
    attention_forward,
    available_kernels,
    cudnn_varlen,
    fa4,
    kernel_call,
    merge_partials,
    select_kernel,
)
from hf_longctx.layout import PackedBatch, shard_plan

from helpers import cumulative

DEVICE = "cuda"
GPU_KERNELS = [k for k in ("fa4", "cudnn_varlen", "cudnn", "torch_flash")]
TOL = 1e-2


def _mixed(seed: int, total: int) -> list[int]:
    rng = random.Random(seed)
    lens = []
    while sum(lens) < total:
        lens.append(rng.choice([1, 1, rng.randint(1, 64), rng.randint(1, 4096)]))
    return lens


CASES = {  # name: (q lens, k lens, causal, hq, hkv, d)
    "one doc": ([4096], [4096], True, 16, 4, 128),
    "equal docs": ([1024] * 6, [1024] * 6, True, 8, 8, 64),
    "mixed 1..4096": (_mixed(1, 12000), _mixed(1, 12000), True, 32, 4, 128),
    "mixed d64 gqa8": (_mixed(2, 6000), _mixed(2, 6000), True, 16, 2, 64),
    "kv longer than q": ([300, 50, 7, 1000], [900, 50, 20, 1000], True, 8, 2, 128),
    "q longer than kv: empty rows": ([600, 40], [200, 40], True, 8, 8, 128),
    "full blocks": ([1500, 3, 700], [2500, 9, 64], False, 32, 8, 128),
}


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(x)), "infinite entries (lse of rows without keys) must match"
    x, ref = torch.where(finite, x, 0), torch.where(finite, ref, 0)
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _problem(case: str, dtype=torch.bfloat16):
    lq, lk, causal, hq, hkv, d = CASES[case]
    if case.startswith("mixed"):  # self-attention over the same documents
        lk = lq
    g = torch.Generator(device="cpu").manual_seed(len(case))
    q = torch.randn(sum(lq), hq, d, generator=g).to(DEVICE, dtype)
    k = torch.randn(sum(lk), hkv, d, generator=g).to(DEVICE, dtype)
    v = torch.randn(sum(lk), hkv, d, generator=g).to(DEVICE, dtype)
    dout = torch.randn(sum(lq), hq, d, generator=g).to(DEVICE, dtype)
    return q, k, v, dout, cumulative(lq), cumulative(lk), causal


def _reference(q, k, v, dout, cu_q, cu_k, causal, **kw):
    q64, k64, v64, d64 = (t.double() for t in (q, k, v, dout))
    mq, mk = max(b - a for a, b in zip(cu_q, cu_q[1:])), max(b - a for a, b in zip(cu_k, cu_k[1:]))
    out, lse = attention_forward(q64, k64, v64, cu_q, cu_k, mq, mk, causal=causal, kernel="reference", **kw)
    grads = attention_backward(d64, q64, k64, v64, out, lse, cu_q, cu_k, mq, mk, causal=causal, kernel="reference",
                               **kw)
    return out, lse, grads


def _installed_or_skip(kernel: str) -> None:
    module = {"fa4": fa4, "cudnn_varlen": cudnn_varlen}.get(kernel)
    if module is not None and not module.is_installed():
        pytest.skip(f"{kernel} is not installed: {module.INSTALL_HINT}")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kernel", GPU_KERNELS)
def test_kernel_matches_fp64_reference(kernel, case):
    _installed_or_skip(kernel)
    q, k, v, dout, cu_q, cu_k, causal = _problem(case)
    mq, mk = max(b - a for a, b in zip(cu_q, cu_q[1:])), max(b - a for a, b in zip(cu_k, cu_k[1:]))
    try:
        select_kernel(kernel, kernel_call(q, k, v, cu_q, cu_k, mq, mk, causal=causal))
    except ValueError as exc:
        must_serve = kernel == "fa4" or (kernel == "cudnn_varlen" and "without a visible key" not in str(exc))
        assert not must_serve, f"{kernel} must serve {case!r}: {exc}"
        assert str(exc).strip(), "a declined input needs a reason"
        pytest.skip(f"{kernel} declines {case!r}: {exc}")
    out, lse = attention_forward(q, k, v, cu_q, cu_k, mq, mk, causal=causal, kernel=kernel)
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and lse.shape == (q.shape[1], q.shape[0])
    grads = attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, mq, mk, causal=causal, kernel=kernel)
    ref_out, ref_lse, ref_grads = _reference(q, k, v, dout, cu_q, cu_k, causal)
    errors = {"out": rel_err(out, ref_out), "lse": rel_err(lse, ref_lse)}
    errors.update({n: rel_err(g, r) for n, g, r in zip(("dq", "dk", "dv"), grads, ref_grads)})
    assert all(not torch.isnan(t).any() for t in (out, lse, *grads)), "NaN in a kernel result"
    assert max(errors.values()) < TOL, f"{kernel} {case}: {errors}"


@pytest.mark.parametrize("kernel", ["fa4", "cudnn_varlen", "torch_flash"])
def test_partial_blocks_merge_to_one_call(kernel):
    """Keys split in two halves: merged partial results and their gradients equal one call."""
    _installed_or_skip(kernel)
    g = torch.Generator(device="cpu").manual_seed(5)
    sq, sk, hq, hkv, d = 1500, 4000, 16, 4, 128
    q = torch.randn(sq, hq, d, generator=g).to(DEVICE, torch.bfloat16)
    k, v = (torch.randn(sk, hkv, d, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
    dout = torch.randn(sq, hq, d, generator=g).to(DEVICE, torch.bfloat16)
    cut = 1700  # keys [0, cut) are all visible (a full block), [cut, sk) hold the causal diagonal
    whole = attention_forward(q, k, v, [0, sq], [0, sk], sq, sk, causal=True, kernel=kernel)
    a = attention_forward(q, k[:cut], v[:cut], [0, sq], [0, cut], sq, cut, causal=False, kernel=kernel)
    b = attention_forward(q, k[cut:], v[cut:], [0, sq], [0, sk - cut], sq, sk - cut, causal=True, kernel=kernel)
    out, lse = merge_partials(a[0], a[1], b[0], b[1])
    assert rel_err(out, whole[0]) < TOL and rel_err(lse, whole[1]) < 1e-4
    ref = attention_backward(dout, q, k, v, *whole, [0, sq], [0, sk], sq, sk, causal=True, kernel=kernel)
    ga = attention_backward(dout, q, k[:cut], v[:cut], out, lse, [0, sq], [0, cut], sq, cut, causal=False,
                            kernel=kernel)
    gb = attention_backward(dout, q, k[cut:], v[cut:], out, lse, [0, sq], [0, sk - cut], sq, sk - cut, causal=True,
                            kernel=kernel)
    assert rel_err(ga[0].float() + gb[0].float(), ref[0]) < TOL
    assert rel_err(torch.cat([ga[1], gb[1]]), ref[1]) < TOL
    assert rel_err(torch.cat([ga[2], gb[2]]), ref[2]) < TOL


def test_auto_prefers_the_fastest_installed_kernel():
    q = torch.randn(64, 8, 128, device=DEVICE, dtype=torch.bfloat16)
    expected = next(k for k in ("fa4", "cudnn_varlen") if k in available_kernels(DEVICE)) \
        if {"fa4", "cudnn_varlen"} & set(available_kernels(DEVICE)) else "cudnn"
    assert select_kernel("auto", kernel_call(q, q, q, [0, 10, 64], [0, 10, 64], 54, 54)) == expected


def test_cudnn_varlen_builds_a_bounded_number_of_graphs():
    """200 random packed batches: bucketing keeps cuDNN's graph cache small."""
    _installed_or_skip("cudnn_varlen")
    from cudnn.sdpa.fwd import torch_op

    rng = random.Random(0)
    torch_op._graph_cache.clear()
    for step in range(200):
        lens = [min(int(rng.lognormvariate(6, 1.5)) + 1, 4096) for _ in range(rng.randint(1, 40))]
        cu = cumulative(lens)
        q = torch.randn(cu[-1], 8, 64, device=DEVICE, dtype=torch.bfloat16)
        out, lse = attention_forward(q, q[:, :2], q[:, :2], cu, cu, max(lens), max(lens), kernel="cudnn_varlen")
        if step % 4 == 0:
            attention_backward(q, q, q[:, :2], q[:, :2], out, lse, cu, cu, max(lens), max(lens), kernel="cudnn_varlen")
    built = len(torch_op._graph_cache)
    assert built <= 100, f"{built} graphs for 200 batches"


@pytest.mark.parametrize("hkv", [8, 2])
def test_cudnn_short_segments_are_exact_on_every_call(hkv):
    """The dense cuDNN kernel serves runs of short documents (two tokens and up) exactly, also when the same
    graph runs again; single-token segments go to another kernel (cuDNN's graph for them crashes the
    process when it runs a second time)."""
    for length in (2, 3, 4, 5, 7, 8, 16, 33):
        lens = [length] * 3 + [64]
        cu = cumulative(lens)
        g = torch.Generator(device="cpu").manual_seed(length)
        q, dout = (torch.randn(sum(lens), 8, 128, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(sum(lens), hkv, 128, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
        ref_out, _, ref_grads = _reference(q, k, v, dout, cu, cu, True)
        for _ in range(2):
            out, lse = attention_forward(q, k, v, cu, cu, 64, 64, kernel="cudnn")
            grads = attention_backward(dout, q, k, v, out, lse, cu, cu, 64, 64, kernel="cudnn")
            torch.cuda.synchronize()
            assert rel_err(out, ref_out) < TOL, length
            for got, want in zip(grads, ref_grads):
                assert rel_err(got, want) < TOL, length
    one = cumulative([1, 1, 64])
    q = torch.randn(66, 8, 128, device=DEVICE, dtype=torch.bfloat16)
    call = kernel_call(q, q[:, :hkv], q[:, :hkv], one, one, 64, 64)
    with pytest.raises(ValueError, match="single-token"):
        select_kernel("cudnn", call)
    assert select_kernel("auto", call) != "cudnn"


@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("backend", sorted(set(backend_names()) - {"auto"}))
def test_every_backend_at_world_size_one_on_the_gpu(backend, window):
    """Without a process group every backend runs its pieces on the GPU kernels, exactly, with or
    without a sliding window."""
    lens = _mixed(7, 8000)
    batch = PackedBatch.from_doc_lens(lens)
    g = torch.Generator(device="cpu").manual_seed(7)
    q, dout = (torch.randn(batch.num_tokens, 8, 128, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(batch.num_tokens, 2, 128, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
    plan = shard_plan(batch, 1, default_strategy(backend))
    idx = plan.local_indices(0).to(DEVICE)
    ql, kl, vl = (t[idx].clone().requires_grad_() for t in (q, k, v))
    # the two-dimensional backends need their Ulysses group size: one rank is a 1 x 1 mesh
    options = {"ulysses_size": 1} if "ulysses_size" in get_backend(backend).option_names else None
    out = sequence_parallel_attention(ql, kl, vl, plan=plan, backend=backend, window=window, options=options)
    out.backward(dout[idx])
    cu = cumulative(lens)
    ref_out, _, ref_grads = _reference(q, k, v, dout, cu, cu, True, window=window)
    assert rel_err(out, ref_out[idx]) < TOL
    for got, want in zip((ql.grad, kl.grad, vl.grad), ref_grads):
        assert rel_err(got, want[idx]) < TOL


WINDOW_CASES = {  # name: (q lens, k lens, causal, window)
    "mixed docs, window 256": (_mixed(3, 9000), None, True, 256),
    "kv longer than q, window 100": ([300, 50, 1000], [900, 50, 1000], True, 100),
    "full block, band of 700": ([1500, 40], [2500, 90], False, 700),
    "window 1: each query sees itself": ([777, 5], None, True, 1),
}


@pytest.mark.parametrize("case", list(WINDOW_CASES))
@pytest.mark.parametrize("kernel", ["fa4", "cudnn_varlen", "torch_flash"])
def test_kernel_sliding_window_matches_fp64_reference(kernel, case):
    """Sliding windows run inside the fast kernels, exactly as the reference masks them."""
    _installed_or_skip(kernel)
    lq, lk, causal, window = WINDOW_CASES[case]
    lk = lk or lq
    g = torch.Generator(device="cpu").manual_seed(len(case) + window)
    q = torch.randn(sum(lq), 16, 128, generator=g).to(DEVICE, torch.bfloat16)
    k, v = (torch.randn(sum(lk), 4, 128, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    cu_q, cu_k = cumulative(lq), cumulative(lk)
    mq, mk = max(lq), max(lk)
    try:
        select_kernel(kernel, kernel_call(q, k, v, cu_q, cu_k, mq, mk, causal=causal, window=window))
    except ValueError as exc:
        assert kernel != "fa4" and kernel != "torch_flash", f"{kernel} must serve windows: {exc}"
        pytest.skip(f"{kernel} declines {case!r}: {exc}")
    out, lse = attention_forward(q, k, v, cu_q, cu_k, mq, mk, causal=causal, kernel=kernel, window=window)
    grads = attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, mq, mk, causal=causal, kernel=kernel,
                               window=window)
    ref_out, ref_lse, ref_grads = _reference(q, k, v, dout, cu_q, cu_k, causal, window=window)
    errors = {"out": rel_err(out, ref_out), "lse": rel_err(lse, ref_lse)}
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        if want.norm() == 0:  # window 1: softmax over one key, so dq and dk are exactly 0
            assert got.abs().max() < 1e-2, f"{kernel} {case}: {name} should be 0, max {got.abs().max()}"
        else:
            errors[name] = rel_err(got, want)
    assert max(errors.values()) < TOL, f"{kernel} {case}: {errors}"
