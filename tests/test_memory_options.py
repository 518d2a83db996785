"""enable_memory_options: the callback's and the benchmarks' one call for checkpointing, tiled loss and
tiled MLP. Same loss and gradients as the plain model, the options really on, and undone by remove()."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_longctx  # noqa: F401 - registers the attention implementations
from hf_longctx.hf import plan_for, shard_batch
from hf_longctx.hf.memory.enable import enable_memory_options
from hf_longctx.hf.memory.tiled_mlp import TiledMLP
from hf_longctx.kernels import reset_stats, stats
from hf_longctx.layout import PackedBatch


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        attn_implementation="longctx_local")).double()


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    reset_stats()
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, stats()


def test_all_options_at_once_train_like_the_plain_model():
    packed = PackedBatch.from_doc_lens([20, 7, 13])
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(1))
    batch = shard_batch({"input_ids": ids, "position_ids": packed.position_ids[None]},
                        plan_for(packed, "local", None), 0)
    model = _model()
    model.train()
    want_loss, want_grads, _ = _step(model, batch)
    options = enable_memory_options(model, "recompute_aware", tiled_loss=8, tiled_mlp=6)
    assert all(isinstance(layer.mlp, TiledMLP) for layer in model.model.layers)
    assert options.tiled_loss is not None and model.is_gradient_checkpointing
    loss, grads, calls = _step(model, batch)
    # transformers' own loss upcasts the logits to float32 only; the tiled loss keeps float64
    torch.testing.assert_close(loss, want_loss, check_dtype=False, rtol=1e-6, atol=0)
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert calls["core_attention.forward"] == 2  # recompute-aware: attention is not re-run in backward
    options.remove()
    assert not any(isinstance(layer.mlp, TiledMLP) for layer in model.model.layers)


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="unknown checkpointing 'layers'"):
        enable_memory_options(_model(), "layers")
    with pytest.raises(ValueError, match="needs checkpointing 'layer' or 'recompute_aware'"):
        enable_memory_options(_model(), "none", offload=True)
