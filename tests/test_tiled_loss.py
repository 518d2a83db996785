"""Tiled vocabulary loss: the same loss and gradients as full logits, without ever holding them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_hf import (
    assert_group_sum_equal,
    packed_example,
    reference_loss_and_grads,
    tiny_llama,
)

from hf_longctx.hf import implementation_name, plan_for, shard_batch
from hf_longctx.hf.integration.inputs import install_input_hook
from hf_longctx.hf.memory.tiled_loss import enable_tiled_loss, tiled_causal_lm_loss

from distributed import run_distributed


def problem(t=37, h=12, v=29, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, v, (t,), generator=g)
    targets[torch.rand(t, generator=g) < 0.3] = -100
    return hidden, weight, targets


@pytest.mark.parametrize("chunk", [1, 5, 37, 100])
def test_equals_full_cross_entropy_and_its_gradients(chunk):
    hidden, weight, targets = problem()
    n = (targets != -100).sum()
    want = F.cross_entropy(hidden @ weight.T, targets, ignore_index=-100, reduction="sum") / n
    gh, gw = torch.autograd.grad(want, (hidden, weight))
    got = tiled_causal_lm_loss(hidden, weight, targets, n, chunk_tokens=chunk)
    dh, dw = torch.autograd.grad(got, (hidden, weight))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dh, gh, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dw, gw, rtol=1e-12, atol=1e-12)
    # without num_items_in_batch: the mean over targets
    torch.testing.assert_close(tiled_causal_lm_loss(hidden, weight, targets, chunk_tokens=chunk), want)


def saved_shapes(fn) -> list[tuple[int, ...]]:
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return shapes


def test_no_logits_are_kept_for_backward():
    hidden, weight, targets = problem(t=64, v=50)
    full = saved_shapes(lambda: F.cross_entropy(hidden @ weight.T, targets, ignore_index=-100))
    tiled = saved_shapes(lambda: tiled_causal_lm_loss(hidden, weight, targets, chunk_tokens=16))
    assert (64, 50) in full  # the untiled loss keeps the whole logits
    assert max(torch.Size(s).numel() for s in tiled) < 64 * 50, tiled  # at most one chunk's worth


def test_bad_chunk_and_shapes_are_named():
    hidden, weight, targets = problem()
    with pytest.raises(ValueError, match="chunk_tokens must be positive"):
        tiled_causal_lm_loss(hidden, weight, targets, chunk_tokens=0)
    with pytest.raises(ValueError, match="37 hidden states but 36 targets"):
        tiled_causal_lm_loss(hidden, weight, targets[1:])


def check_tiled_model_loss(rank, world, backends):
    packed, ids = packed_example(11, total=20 * world + 3)
    for backend in backends:
        model = tiny_llama(3)
        ref_loss, ref_grads = reference_loss_and_grads(model, packed, ids)
        model.zero_grad()
        model.set_attn_implementation(implementation_name(backend))
        enable_tiled_loss(model, chunk_tokens=4)
        local = shard_batch({"input_ids": ids, "position_ids": packed.position_ids[None]},
                            plan_for(packed, backend, None), rank)
        out = model(**local)
        assert out.logits.shape[1] == 0  # no logits were computed
        out.loss.backward()
        assert_group_sum_equal(out.loss, model, ref_loss, ref_grads, f"tiled {backend} rank={rank}", tol=1e-10)


def test_tiled_loss_with_sequence_parallel_shards_equals_the_reference():
    run_distributed(2, check_tiled_model_loss, ["zigzag", "cad"])


@pytest.mark.parametrize("tiled_first", [True, False])
def test_tiled_loss_behind_the_input_hook_in_either_order(tiled_first):
    """The input hook is prepended, so the tiled loss sees the sharded targets whichever came first."""
    packed, ids = packed_example(5, total=41)
    model = tiny_llama(2)
    ref_loss, ref_grads = reference_loss_and_grads(model, packed, ids)
    model.zero_grad()
    model.set_attn_implementation(implementation_name("local"))
    if tiled_first:
        enable_tiled_loss(model, chunk_tokens=6)
    install_input_hook(model, group=None)
    if not tiled_first:
        enable_tiled_loss(model, chunk_tokens=6)
    out = model(input_ids=ids, position_ids=packed.position_ids[None], labels=ids)
    assert out.logits.shape[1] == 0
    out.loss.backward()
    torch.testing.assert_close(out.loss.detach(), torch.as_tensor(ref_loss, dtype=out.loss.dtype),
                               rtol=1e-10, atol=1e-10)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-10, atol=1e-10, msg=name)
