"""The expert path on the GPU: its Triton row kernels equal the torch versions, and a bf16 MoE block
run through expert-parallel dispatch equals transformers' own grouped-GEMM experts.

The torch versions of :mod:`hf_longctx.moe.row_ops` are checked exactly against the unsharded
model on CPU (tests/test_moe.py); here the Triton kernels must give the same numbers (bitwise where
the order of float32 additions is the same, to bf16 rounding for the fused gate), the same numbers
on every run (no atomics), and a whole block must land within bf16 noise of transformers.
"""

from __future__ import annotations

import pytest
import torch

from hf_longctx.moe import ExpertParallelExperts, pair_layout, row_ops

DEVICE = "cuda"


def _layout(tokens: int, top_k: int, experts: int, start: int, local: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(DEVICE)
    return pair_layout(ids, start, local, all_local=local == experts)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("start,local", [(0, 16), (4, 5)])  # every expert here; a slice of them
def test_triton_pair_sum_and_grads_equal_torch(monkeypatch, dtype, start, local):
    layout = _layout(tokens=300, top_k=4, experts=16, start=start, local=local, seed=local)
    hidden = 200  # not a power of two: masked columns
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    rows = torch.randn(layout.num_pairs, hidden, device=DEVICE, dtype=dtype, generator=gen)
    weights = torch.rand(layout.num_pairs, device=DEVICE, generator=gen)
    grad = torch.randn(layout.num_tokens, hidden, device=DEVICE, dtype=dtype, generator=gen)
    assert row_ops.triton_serves(rows)
    got = [row_ops.pair_sum(rows, layout.pair_table, weights, out_dtype=dtype),
           row_ops.pair_sum(rows, layout.pair_table), *row_ops.pair_grads(grad, layout.token_index, weights, rows)]
    again = row_ops.pair_sum(rows, layout.pair_table, weights, out_dtype=dtype)
    monkeypatch.setenv("HF_LONGCTX_MOE_TRITON", "0")
    assert not row_ops.triton_serves(rows)
    want = [row_ops.pair_sum(rows, layout.pair_table, weights, out_dtype=dtype),
            row_ops.pair_sum(rows, layout.pair_table), *row_ops.pair_grads(grad, layout.token_index, weights, rows)]
    assert torch.equal(got[0], again), "pair_sum is not deterministic"
    for name, g, w in zip(("weighted sum", "sum", "row grads", "weight grads"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_pair_sum_writes_into_a_wider_buffer():
    """The allgather backward writes token gradients into the first columns of one float32 buffer."""
    layout = _layout(tokens=64, top_k=2, experts=8, start=2, local=3, seed=1)
    rows = torch.randn(layout.num_pairs, 96, device=DEVICE, dtype=torch.bfloat16)
    full = torch.full((64, 96 + 2), 7.0, device=DEVICE)
    row_ops.pair_sum(rows, layout.pair_table, out=full[:, :96])
    torch.testing.assert_close(full[:, :96], row_ops.pair_sum(rows, layout.pair_table))
    assert (full[:, 96:] == 7.0).all(), "pair_sum wrote outside its columns"


def test_fused_swiglu_matches_eager_gate():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    experts = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=300, num_experts=4))
    h = torch.randn(1000, 600, device=DEVICE, dtype=torch.bfloat16)
    h_fused, h_eager = h.clone().requires_grad_(), h.clone().requires_grad_()
    out_fused, out_eager = row_ops.swiglu(experts, h_fused), experts._apply_gate(h_eager)
    assert out_fused.grad_fn is not None and type(out_fused.grad_fn).__name__ != type(out_eager.grad_fn).__name__
    grad = torch.randn_like(out_eager)
    out_fused.backward(grad)
    out_eager.backward(grad)
    for name, got, want in (("output", out_fused, out_eager), ("gate/up grad", h_fused.grad, h_eager.grad)):
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert err < 4e-3, f"fused SwiGLU {name}: relative error {err:.2e}"  # bf16 rounding differences only


@pytest.mark.parametrize("dispatch", ["allgather", "all_to_all"])
def test_bf16_block_through_dispatch_equals_transformers_grouped_mm(dispatch):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(0)
    config = Qwen3MoeConfig(hidden_size=256, moe_intermediate_size=128, num_experts=32, num_experts_per_tok=8,
                            norm_topk_prob=True, experts_implementation="grouped_mm")
    ref = Qwen3MoeSparseMoeBlock(config).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.05)
    block = Qwen3MoeSparseMoeBlock(config).to(DEVICE, torch.bfloat16)
    block.load_state_dict(ref.state_dict())
    block.experts = ExpertParallelExperts(block.experts, None, dispatch)
    x = torch.randn(1, 2048, 256, device=DEVICE, dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    results = []
    for module in (ref, block):
        xi = x.clone().requires_grad_()
        out = module(xi)
        out.backward(grad)
        results.append([out, xi.grad] + [p.grad for p in module.parameters()])
    names = ["output", "input grad"] + [n for n, _ in ref.named_parameters()]
    for name, got, want in zip(names, results[1], results[0]):
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert err < 1e-2, f"{dispatch} {name}: relative error {err:.2e} against transformers' grouped_mm"
