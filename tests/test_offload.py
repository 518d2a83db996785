"""Checkpoint offload: what a layer keeps for backward waits on the host, and gradients stay exact.

Under layer checkpointing a layer keeps its input; under recompute-aware checkpointing also its
core-attention output and lse. With offload all of these move off the device after the layer's
forward and come back for its recompute. On CPU the "host copy" is a clone, so these tests pin the
mechanism (what moves, that backward reads the moved bytes, exactness); the device-memory effect is
measured on GPUs by ``scripts/check_offload_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
from test_hf import assert_group_sum_equal, loss_sum_fp64, packed_example, reference_loss_and_grads, tiny_llama

from hf_longctx.backends.op import ATTENTION_OUTPUTS
from hf_longctx.hf import implementation_name, plan_for, shard_batch
from hf_longctx.hf.memory.checkpointing import enable_layer_checkpointing, enable_recompute_aware_checkpointing
from hf_longctx.kernels import reset_stats, stats

from distributed import run_distributed

ENABLE = {"layer": enable_layer_checkpointing, "recompute_aware": enable_recompute_aware_checkpointing}


def _sharded(model, backend: str, seed: int = 3, total: int = 96, rank: int = 0):
    packed, ids = packed_example(seed, total=total)
    model.set_attn_implementation(implementation_name(backend))
    return shard_batch({"input_ids": ids, "position_ids": packed.position_ids[None]},
                       plan_for(packed, backend, None), rank)


def _grads(model, local) -> dict[str, torch.Tensor]:
    model.zero_grad()
    model(**local).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["layer", "recompute_aware"])
def test_offloaded_checkpoints_give_the_same_gradients(mode):
    model = tiny_llama(11, impl="longctx_local")
    model.train()
    local = _sharded(model, "local")
    ENABLE[mode](model)
    expected = _grads(model, local)
    ENABLE[mode](model, offload=True)
    offloader = model._hf_longctx_offloader
    offloader.min_bytes = 0  # the tiny model's tensors are below the default threshold
    reset_stats()
    got = _grads(model, local)
    layers = model.config.num_hidden_layers
    assert offloader.layers_offloaded == layers
    tokens, hidden, heads = local["input_ids"].shape[1], model.config.hidden_size, model.config.num_attention_heads
    per_layer = tokens * hidden * 8  # the layer input, float64
    if mode == "recompute_aware":
        per_layer += tokens * hidden * 8 + heads * tokens * 8  # attention output and lse
        assert stats()["core_attention.forward"] == layers  # attention still never re-runs
    else:
        assert stats()["core_attention.forward"] == 2 * layers
    assert offloader.bytes_offloaded == layers * per_layer
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0)


def test_kept_attention_outputs_leave_the_device_and_backward_reads_them_back():
    """The cached attention output's storage is emptied after forward; backward uses the host bytes."""
    model = tiny_llama(12, impl="longctx_local")
    model.train()
    local = _sharded(model, "local")
    enable_recompute_aware_checkpointing(model, offload=True)
    offloader = model._hf_longctx_offloader
    offloader.min_bytes = 0
    outputs = []
    model.zero_grad()
    with ATTENTION_OUTPUTS.watch(outputs.append):  # sees the same tensors the offloader keeps
        loss = model(**local).loss
    assert outputs and all(t.untyped_storage().nbytes() == 0 for t in outputs)
    loss.backward()
    clean = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in outputs)

    # corrupt the host copies between the passes: the q/k/v-projection gradients must change
    model.zero_grad()
    with ATTENTION_OUTPUTS.watch(outputs.append):
        loss = model(**local).loss
    slot = offloader._last()
    while slot is not None:
        for kept in slot.kept:
            kept.host.mul_(2.0)
        slot = slot.previous() if slot.previous is not None else None
    loss.backward()
    changed = [n for n, p in model.named_parameters() if not torch.equal(p.grad, clean[n])]
    assert any("q_proj" in n for n in changed), changed


def test_offload_refuses_the_reentrant_checkpoint():
    model = tiny_llama(13, impl="longctx_local")
    model.train()
    local = _sharded(model, "local")
    enable_layer_checkpointing(model, {"use_reentrant": True}, offload=True)
    with pytest.raises(ValueError, match="use_reentrant=False"):
        model(**local)


def test_offload_is_inert_without_grad():
    model = tiny_llama(14, impl="longctx_local")
    model.train()
    local = _sharded(model, "local")
    enable_recompute_aware_checkpointing(model, offload=True)
    model._hf_longctx_offloader.min_bytes = 0
    with torch.no_grad():
        logits = model(**local).logits
    assert torch.isfinite(logits).all() and model._hf_longctx_offloader.layers_offloaded == 0


def check_offload_sequence_parallel(rank, world, backends):
    for backend in backends:
        packed, ids = packed_example(21, total=20 * world + 1)
        model = tiny_llama(21)
        ref_loss, ref_grads = reference_loss_and_grads(model, packed, ids)
        model.set_attn_implementation(implementation_name(backend))
        model.train()
        enable_recompute_aware_checkpointing(model, offload=True)
        model._hf_longctx_offloader.min_bytes = 0
        model.zero_grad()
        local = shard_batch({"input_ids": ids, "position_ids": packed.position_ids[None]},
                            plan_for(packed, backend, None), rank)
        loss = loss_sum_fp64(model(**local).logits, local["shift_labels"]) / local["num_items_in_batch"]
        loss.backward()
        assert model._hf_longctx_offloader.bytes_offloaded > 0
        assert_group_sum_equal(loss, model, ref_loss, ref_grads, f"offload {backend} rank={rank}")


@pytest.mark.parametrize("world", [2, 3])
def test_offload_with_sequence_parallel_backends_equals_one_device(world):
    run_distributed(world, check_offload_sequence_parallel, ["zigzag", "cad"])


def test_offload_setting_is_validated(monkeypatch):
    from hf_longctx.hf import LongContextConfig, load_config

    with pytest.raises(ValueError, match="offload_checkpoints must be true or false"):
        LongContextConfig(offload_checkpoints="yes")
    with pytest.raises(ValueError, match="needs checkpointing 'layer' or 'recompute_aware'"):
        LongContextConfig(checkpointing="none", offload_checkpoints=True)
    monkeypatch.delenv("HF_LONGCTX_RECIPE", raising=False)
    monkeypatch.setenv("HF_LONGCTX_OFFLOAD_CHECKPOINTS", "1")
    assert load_config().offload_checkpoints is True
    monkeypatch.setenv("HF_LONGCTX_OFFLOAD_CHECKPOINTS", "maybe")
    with pytest.raises(ValueError, match="HF_LONGCTX_OFFLOAD_CHECKPOINTS='maybe': not a boolean"):
        load_config()
