"""The steps' row kernels on the GPU: the running merge of the ring-style backends and CAD's segment gather run as
Triton kernels there, and every backend's step stays as close to an fp32 reference as with torch's versions.

``HF_LONGCTX_MERGE_TRITON=0`` and ``HF_LONGCTX_GATHER_TRITON=0`` switch them to torch (the CPU's path).
"""

from __future__ import annotations

import pytest
import torch

from hf_longctx.comm.gather import triton_gathers
from hf_longctx.emulation import emulate_step
from hf_longctx.kernels import attention_backward, attention_forward
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
