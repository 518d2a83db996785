"""Group checkpointing: one checkpoint for k consecutive decoder layers (exact gradients, one saved hidden state per
group, the memory model's terms and the planner's use of groups where nothing fits without them)."""

from __future__ import annotations

import pytest
import torch
from test_memory_plan import HOST, LLAMA3_8B, K, _batch, _SavedPerLayer, _tiny

from hf_longctx.hf.memory.checkpointing import enable_per_layer_checkpointing
from hf_longctx.hf.memory.enable import enable_memory_options
from hf_longctx.hf.memory.model import GiB, LayerChoice, MemoryModel, ModelShape
from hf_longctx.hf.memory.search import MemoryPlanError, plan_memory

MIXES = [
    # groups of 2 and 3 with single layers of every mode
    [("layer", False), "group", ("recompute_aware", False), ("layer", False), "group", "group", "none"],
    [("layer", True), "group", "group", ("recompute_aware", True), ("layer", True), "group", ("layer", False)],
    [("layer", True), "group", ("layer", False), "group", "group", ("recompute_aware", False), "none"],
]


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("choices", MIXES)
def test_groups_give_the_loss_and_gradients_of_no_checkpointing_bitwise(choices):
    model = _tiny(layers=len(choices), dtype=torch.float64, seed=5)
    model.train()
    batch = _batch(96, seed=2, docs=[40, 7, 49])
    want_loss, want = _loss_and_grads(model, batch)
    enable_per_layer_checkpointing(model, choices)
    offloader = model.__dict__.get("_hf_longctx_offloader")
    if offloader is not None:
        offloader.min_bytes = 0  # the tiny model's tensors are below the default threshold
    for _ in range(2):  # a second step: nothing of the first one's group hand-over is left behind
        loss, got = _loss_and_grads(model, batch)
        assert torch.equal(loss, want_loss)
        for name in want:
            assert torch.equal(got[name], want[name]), name
    if offloader is not None:  # one checkpoint per offloaded group or layer, each step
        offloaded = sum(1 for c in choices if not isinstance(c, str) and c[1])
        assert offloader.layers_offloaded == 2 * offloaded


@pytest.mark.parametrize("size", [2, 3])
def test_a_group_keeps_one_hidden_state_between_the_passes(size):
    """Saved for backward inside the group's layers: the group's input only (as the model's checkpoint terms say)."""
    tokens, layers = 64, 6
    model = _tiny(layers)
    model.train()
    choices = ([("layer", False)] + ["group"] * (size - 1)) * (layers // size)
    enable_per_layer_checkpointing(model, choices)
    probe = _SavedPerLayer(model)
    counts = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: counts.append(t.is_floating_point()) or t, lambda t: t):
        loss = model(**_batch(tokens)).loss
    predicted = MemoryModel(ModelShape.from_config(model.config), tokens, precision="bf16")
    saved = [sum(s.values()) for s in probe.layers]  # per layer window (the groups' windows: their first layer's)
    assert saved == [predicted.checkpoint[c if isinstance(c, str) else c[0]] for c in choices]
    assert saved[0] == tokens * model.config.hidden_size * 2
    assert [len(s) for s in probe.layers] == [1 if c != "group" else 0 for c in choices]
    loss.backward()


def test_group_members_out_of_order_or_misplaced_are_refused():
    model = _tiny(layers=3, dtype=torch.float64)
    model.train()
    with pytest.raises(ValueError, match="no 'layer' layer starts its group"):
        enable_per_layer_checkpointing(model, ["group", "layer", "layer"])
    with pytest.raises(ValueError, match="no 'layer' layer starts its group"):
        enable_per_layer_checkpointing(model, ["recompute_aware", "group", "none"])
    with pytest.raises(ValueError, match="offload its group's first layer"):
        enable_per_layer_checkpointing(model, ["layer", ("group", True), "none"])
    enable_per_layer_checkpointing(model, ["layer", "group", "none"])
    hidden = torch.zeros(1, 4, model.config.hidden_size, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="model order"):  # a member called without its group's output pending
        model.model.layers[1](hidden, position_embeddings=(hidden, hidden))


def test_the_model_prices_a_group_by_its_one_checkpoint_and_held_layers():
    shape = ModelShape.from_config(LLAMA3_8B)
    model = MemoryModel(shape, 512 * K, tiled_loss=8192, tiled_mlp=16384, fused_ops=True)
    group = [LayerChoice("layer", True), LayerChoice("group"), LayerChoice("group")]
    layers = group + [LayerChoice("layer")] * 29
    assert model.host_items(layers)["pinned checkpoints"] == 4 * GiB  # one 4 GiB checkpoint for three layers
    forward, backward = model.layer_items(layers)
    work = [b["layer working set"] for b in backward[:3]]
    base = model.backward_work["layer"] + model.checkpoint["layer"]
    assert work == [base, base + model.group_held, base + 2 * model.group_held]
    assert model.group_held == model.saved_layer  # a recomputed layer holds what a layer without checkpointing keeps
    assert all(b["checkpoints"] == 0 for b in backward[:3])  # the group's checkpoint is in its working set
    assert backward[3]["checkpoints"] == 0 and backward[4]["checkpoints"] == model.checkpoint["layer"]


def test_one_h200_trains_528k_only_with_groups():
    """Llama-3-8B shape, 528K tokens with FlashAttention-4, one H200 (139.8 GiB) and 125 GiB of host memory with AdamW's
    states there: 32 layer checkpoints (4.1 GiB each) fit neither the host nor the GPU, 2-layer groups halve them."""
    kwargs = dict(gpu_bytes=int(139.8 * GiB), host_bytes=125 * GiB, fused_ops=True, allow_optimizer_on_host=True,
                  kernel="fa4")
    with pytest.raises(MemoryPlanError, match="do not fit"):
        plan_memory(LLAMA3_8B, 528 * K, allow_groups=False, **kwargs)
    plan = plan_memory(LLAMA3_8B, 528 * K, **kwargs)
    assert plan.gpu_peak <= plan.gpu_usable and plan.host_peak <= plan.host_total
    assert "group" in {c.checkpointing for c in plan.layers}
    assert "groups of 2" in str(plan) and len(str(plan).splitlines()) <= 10
    assert plan.checkpoint_runs()[0][3] == 2
    assert 1.2 < plan.step_factor < 1.4  # a group recomputes each layer once, as layer checkpointing


def test_the_shortfall_message_counts_what_groups_fit():
    """Past the longest plan, the hint's shorter context is the longest one group checkpointing fits (to 1K
    tokens), not the layer-by-layer bound, and the length it names does fit."""
    kwargs = dict(gpu_bytes=int(139.8 * GiB), host_bytes=125 * GiB, fused_ops=True, allow_optimizer_on_host=True)
    with pytest.raises(MemoryPlanError) as err:
        plan_memory(LLAMA3_8B, 576 * K, **kwargs)
    text = str(err.value)
    assert "with group checkpointing" in text
    longest = int(text.split("at most ", 1)[1].split(" ", 1)[0])
    assert 512 * K <= longest < 576 * K
    plan_memory(LLAMA3_8B, longest, **kwargs)
    with pytest.raises(MemoryPlanError):
        plan_memory(LLAMA3_8B, longest + 1024, **kwargs)


def test_groups_only_where_nothing_fits_without_them():
    plan = plan_memory(LLAMA3_8B, 128 * K, gpu_bytes=int(139.8 * GiB), host_bytes=HOST, fused_ops=True)
    assert "group" not in {c.checkpointing for c in plan.layers}
    with pytest.raises(MemoryPlanError):  # ZeRO-3 gathers each layer's weights in its hooks: no groups there
        plan_memory(LLAMA3_8B, 4096 * K, gpu_bytes=int(139.8 * GiB), host_bytes=HOST, zero_stage=3, world=8)


def test_a_plan_with_groups_switches_them_on():
    """A tiny model with many layers, long for its size, on the smallest GPU any plan fits: only groups fit it."""
    layers, tokens = 24, 1024
    kwargs = dict(host_bytes=0, host_overhead_bytes=0, precision="fp64", fused_ops=False, tiled_loss=0, tiled_mlp=32)
    plan = _smallest_plan(_tiny(layers).config, tokens, kwargs)
    assert "group" in {c.checkpointing for c in plan.layers}, plan
    plan.tiled_mlp = 512  # fewer chunks: a faster test, the same checkpointing
    batch = _batch(tokens, seed=4, docs=[600, 424])
    reference = _tiny(layers, dtype=torch.float64, seed=3)
    reference.train()
    enable_memory_options(reference, tiled_mlp=plan.tiled_mlp)  # the plan's tiling, no checkpointing
    model = _tiny(layers, dtype=torch.float64, seed=3)
    model.train()
    options = plan.apply(model)
    assert options.layers == tuple(plan.layers)
    assert [m.gradient_checkpointing for m in model.model.layers] == [c.checkpointing != "none" for c in plan.layers]
    want_loss, want = _loss_and_grads(reference, batch)
    loss, got = _loss_and_grads(model, batch)
    assert torch.equal(loss, want_loss)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def _smallest_plan(config, tokens, kwargs):
    """The plan for the smallest GPU (to 1 KiB) that some plan fits."""
    def plan(gpu):
        try:
            return plan_memory(config, tokens, gpu_bytes=gpu, **kwargs)
        except MemoryPlanError:
            return None

    lo, hi = 0, 64 * GiB
    while hi - lo > 1 << 10:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if plan(mid) is not None else (mid, hi)
    return plan(hi)
