"""The steps' row kernels on the GPU: the running merge of the ring-style backends, CAD's segment gather and its
return of results run as Triton kernels there, and every backend's step stays as close to an fp32 reference as with
torch's versions.

``HF_LONGCTX_MERGE_TRITON=0`` and ``HF_LONGCTX_GATHER_TRITON=0`` switch them to torch (the CPU's path).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from hf_longctx.comm import GatherPlan
from hf_longctx.comm.gather import triton_gathers, triton_returns
from hf_longctx.kernels import attention_backward, attention_forward
from hf_longctx.lab.emulation import emulate_step
from hf_longctx.lab.emulation.group import EmulationHub
from hf_longctx.layout import PackedBatch, shard_plan

pytestmark = pytest.mark.gpu

DOC_LENS = [700, 40, 333, 90, 12, 264, 25, 1100, 7]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_gather_from_two_sources_equals_gathering_their_concatenation(dtype):
    """Rows of [local ; received] by index, repeats included; received is a column block of a packed buffer (its
    rows contiguous, its row stride wider), as an all_to_all of k and v side by side delivers it."""
    from hf_longctx.comm.triton_gather import gather_two

    g = torch.Generator(device="cuda").manual_seed(0)
    local = torch.randn(300, 4, 48, device="cuda", dtype=dtype, generator=g)
    packed = torch.randn(120, 2 * 4 * 48, device="cuda", dtype=dtype, generator=g)
    received = packed[:, 4 * 48:].view(120, 4, 48)
    index = torch.randint(0, 420, (1000,), device="cuda", generator=g)
    assert triton_gathers(local, received)
    torch.testing.assert_close(gather_two(local, received, index),
                               torch.cat([local, received]).index_select(0, index), rtol=0, atol=0)


def _returned(runs, rows, add: bool) -> list[list[torch.Tensor]]:
    """Every rank's local tensors after :meth:`GatherPlan.return_rows` of bf16 segments and the reverse all_to_all:
    with ``add``, two tensors of one dtype (packed side by side, as key gradients are) added into fp32; else a
    bf16 tensor and an fp32 one (outputs and their log-sum-exps) copied."""
    def rank_fn(group):
        plan = GatherPlan(runs, group.rank, rows).to("cuda")
        g = torch.Generator(device="cuda").manual_seed(group.rank)
        widths = [(4, 48), (4, 48)] if add else [(4, 48), (4,)]
        segments = [torch.randn(plan.segment_rows, *w, generator=g, device="cuda", dtype=torch.bfloat16)
                    for w in widths]
        dtypes = [torch.float32, torch.float32] if add else [torch.bfloat16, torch.float32]
        # what the holder holds already (the other nano-batch's gradients): added to, or replaced
        locals_ = [torch.randn(rows[group.rank], *w, generator=g, device="cuda").to(d) for w, d in zip(widths, dtypes)]
        assert triton_returns(segments, locals_, add) == (os.environ["HF_LONGCTX_GATHER_TRITON"] == "1")
        plan.finish_return(plan.return_rows(segments, locals_, add, group), locals_, add)
        return locals_
    return EmulationHub(len(rows)).run(rank_fn)


@pytest.mark.parametrize("add", [True, False])
def test_returning_rows_in_one_kernel_equals_torchs_row_ops(add, monkeypatch):
    """Rows read by several segments (with ``add``: repeats within a reader and across readers) add up at their
    holder, onto what it held; copied rows (each read once) replace what it held, converted to its dtype. The
    kernel's sums come out the same run after run."""
    rows = [300, 200, 250]
    rng = random.Random(0)
    if add:
        runs = [[(h, a, rng.randint(a, rows[h])) for h, a in
                 ((h, rng.randrange(rows[h])) for h in (rng.randrange(3) for _ in range(8)))] for _ in rows]
    else:  # reader r reads the r-th third of every holder's rows, once
        runs = [[(h, r * rows[h] // 3, (r + 1) * rows[h] // 3) for h in (2, 0, 1)] for r in range(3)]
    results = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("HF_LONGCTX_GATHER_TRITON", flag)
        results[flag] = _returned(runs, rows, add)
    monkeypatch.setenv("HF_LONGCTX_GATHER_TRITON", "1")
    for again, first in zip(_returned(runs, rows, add), results["1"]):  # sums in a fixed order: the same bits
        for a, b in zip(again, first):
            assert torch.equal(a, b)
    for fused, plain in zip(results["1"], results["0"]):
        for a, b in zip(fused, plain):
            if add:  # fp32 sums in another order
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            else:
                torch.testing.assert_close(a, b, rtol=0, atol=0)


def _reference(batch, tensors):
    cu = batch.cu_seqlens.tolist()
    q, k, v, dout = (t.float() for t in tensors)
    out, lse = attention_forward(q, k, v, cu, cu, batch.max_seqlen, batch.max_seqlen, kernel="reference")
    return (out, *attention_backward(dout, q, k, v, out, lse, cu, cu, batch.max_seqlen, batch.max_seqlen,
                                     kernel="reference"))


def _worst_errors(batch, tensors, backend, want):
    step = emulate_step(batch, 3, tensors, backend, kernel="torch_flash", keep_results=True)
    plan = shard_plan(batch, 3, step.strategy)
    worst = [0.0] * 4  # largest error relative to the largest reference value: out, dq, dk, dv
    for r in step.ranks:
        idx = plan.local_indices(r.rank).to("cuda")
        for i, (got, ref) in enumerate(zip(r.results, want)):
            worst[i] = max(worst[i], ((got.float() - ref[idx]).abs().max() / ref.abs().max()).item())
    return worst


@pytest.mark.parametrize("backend", ["ring", "zigzag", "distfa", "tasp", "cad"])
def test_every_backend_is_as_close_to_fp32_with_the_triton_row_kernels_as_with_torchs(backend, monkeypatch):
    batch = PackedBatch.from_doc_lens(DOC_LENS)
    g = torch.Generator(device="cuda").manual_seed(1)
    tensors = tuple(torch.randn(batch.num_tokens, h, 64, generator=g, device="cuda", dtype=torch.bfloat16)
                    for h in (8, 2, 2, 8))
    want = _reference(batch, tensors)
    errors = {}
    for triton in ("1", "0"):
        monkeypatch.setenv("HF_LONGCTX_MERGE_TRITON", triton)
        monkeypatch.setenv("HF_LONGCTX_GATHER_TRITON", triton)
        errors[triton] = _worst_errors(batch, tensors, backend, want)
    for name, fused, plain in zip(("out", "dq", "dk", "dv"), errors["1"], errors["0"]):
        assert fused < 0.02, (name, errors)  # bf16 rounding; a wrong merge or gather is off by the values' order
        assert fused <= 2 * plain + 5e-3, (name, errors)
