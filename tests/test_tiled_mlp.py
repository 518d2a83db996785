"""Tiled MLP: the same loss and every parameter gradient as the untiled model, one gradient accumulation
per parameter per backward, and no whole-sequence MLP intermediate kept or built."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from test_hf import packed_example
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaMLP

import hf_longctx  # noqa: F401 - registers the attention implementations
from hf_longctx.hf import TiledMLP, disable_tiled_mlp, enable_tiled_mlp, plan_for, shard_batch
from hf_longctx.hf.memory.checkpointing import enable_layer_checkpointing, enable_recompute_aware_checkpointing
from hf_longctx.hf.memory.tiled_mlp import chunk_spans
from hf_longctx.kernels import reset_stats, stats

VOCAB, HIDDEN, INTER, LAYERS, T = 61, 32, 64, 2, 37
TOL = dict(rtol=1e-10, atol=1e-10)
CHUNKINGS = [  # (kwargs, rows per chunk for batch 1)
    ({"chunk_tokens": 1}, 1),
    ({"chunk_tokens": 5}, 5),  # does not divide 37: chunks of 5 and 4
    ({"chunk_tokens": 37}, 37),
    ({"chunk_tokens": 100}, 37),  # larger than the sequence: one chunk
    ({"num_chunks": 3}, 13),  # 13, 12, 12
]
CHUNK_IDS = ["chunk1", "chunk5", "chunkT", "chunk100", "num_chunks3"]


def tiny_llama(seed: int = 0, impl: str = "sdpa") -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      attn_implementation=impl)
    return LlamaForCausalLM(cfg).double()


def token_ids(batch: int = 1, length: int = T, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def fp64_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy in float64 (transformers' own loss would round to float32)."""
    return F.cross_entropy(logits.reshape(-1, VOCAB).double(), targets.reshape(-1), ignore_index=-100)


def step(model, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    model.zero_grad(set_to_none=True)
    loss = fp64_loss(model(input_ids=ids).logits[:, :-1], ids[:, 1:])
    loss.backward()
    return loss.detach(), {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def assert_same(got, want, where=""):
    (loss, grads), (ref_loss, ref_grads) = got, want
    torch.testing.assert_close(loss, ref_loss, **TOL, msg=lambda m: f"loss {where}: {m}")
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        if ref is None:
            assert grads[name] is None, name
            continue
        torch.testing.assert_close(grads[name], ref, **TOL, msg=lambda m, n=name: f"grad {n} {where}: {m}")


@contextlib.contextmanager
def record_rows(model, names=("gate_proj", "up_proj", "down_proj")):
    """Rows (tokens along the sequence dim) of every output of the MLP projections, forward and recompute."""
    rows: list[int] = []
    handles = [getattr(layer.mlp, n).register_forward_hook(lambda m, a, out: rows.append(out.shape[-2]))
               for layer in model.model.layers for n in names]
    try:
        yield rows
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("chunking,rows", CHUNKINGS, ids=CHUNK_IDS)
def test_loss_and_every_gradient_equal_untiled(chunking, rows, batch):
    model = tiny_llama(1)
    ids = token_ids(batch, seed=batch)
    want = step(model, ids)
    assert enable_tiled_mlp(model, **chunking) == LAYERS
    with record_rows(model, ["gate_proj"]) as seen:
        got = step(model, ids)
    assert_same(got, want, f"{chunking} batch={batch}")
    # chunk_tokens counts tokens over the batch: a chunk holds chunk_tokens // batch rows
    max_rows = rows if "num_chunks" in chunking else max(1, chunking["chunk_tokens"] // batch)
    spans = chunk_spans(T, max_rows)
    assert max(seen) <= max_rows and len({n for _, n in spans}) == (1 if T % len(spans) == 0 else 2)
    assert sorted(seen) == sorted([n for _, n in spans] * LAYERS * 2)  # forward + recompute in backward
    assert disable_tiled_mlp(model) == LAYERS
    assert_same(step(model, ids), want, "after disable")


@pytest.mark.parametrize("chunking,rows", CHUNKINGS[1:3], ids=CHUNK_IDS[1:3])
def test_exact_with_layer_checkpointing(chunking, rows):
    model = tiny_llama(2)
    model.train()
    ids = token_ids(seed=2)
    want = step(model, ids)
    enable_layer_checkpointing(model)  # activation_checkpointing_enable or gradient_checkpointing_enable
    enable_tiled_mlp(model, **chunking)
    with record_rows(model, ["gate_proj"]) as seen:
        got = step(model, ids)
    assert_same(got, want, f"layer checkpointing {chunking}")
    n_chunks = len(chunk_spans(T, rows))
    # forward, the layer's recompute in backward, the chunk recompute of the tiled backward
    assert len(seen) == 3 * n_chunks * LAYERS and max(seen) == rows


def test_exact_with_recompute_aware_checkpointing_on_a_packed_batch():
    packed, ids = packed_example(3, total=T)
    model = tiny_llama(3, impl="longctx_local")
    model.train()
    local = shard_batch({"input_ids": ids, "position_ids": packed.position_ids[None]},
                        plan_for(packed, "local", None), 0)

    def packed_step():
        reset_stats()
        model.zero_grad(set_to_none=True)
        out = model(**local)
        loss = F.cross_entropy(out.logits.reshape(-1, VOCAB), local["shift_labels"].reshape(-1),
                               ignore_index=-100, reduction="sum") / local["num_items_in_batch"]
        loss.backward()
        return (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}), dict(stats())

    want, _ = packed_step()
    enable_recompute_aware_checkpointing(model)
    enable_tiled_mlp(model, chunk_tokens=6)
    with record_rows(model, ["gate_proj"]) as seen:
        got, calls = packed_step()
    assert_same(got, want, "recompute-aware checkpointing + tiled MLP")
    assert calls["core_attention.forward"] == LAYERS  # attention still never re-run in backward
    assert calls["core_attention.backward"] == LAYERS
    assert max(seen) == 6 and len(seen) == 3 * len(chunk_spans(T, 6)) * LAYERS


def accumulations_per_parameter(tiled: bool, checkpointing: bool, backwards: int = 2) -> list[dict[str, int]]:
    """How often each parameter's post-accumulate-grad hook fired, after each of ``backwards`` backwards."""
    model = tiny_llama(4)
    model.train()
    if checkpointing:
        enable_layer_checkpointing(model)
    if tiled:
        enable_tiled_mlp(model, chunk_tokens=5)
    fired = {name: 0 for name, _ in model.named_parameters()}

    def hook(name):
        return lambda p: fired.__setitem__(name, fired[name] + 1)

    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(hook(name))
    ids = token_ids(seed=4)
    after = []
    for _ in range(backwards):  # gradient accumulation: several backwards into the same .grad
        fp64_loss(model(input_ids=ids).logits[:, :-1], ids[:, 1:]).backward()
        after.append(dict(fired))
    return after


@pytest.mark.parametrize("checkpointing", [False, True])
def test_each_gradient_accumulates_once_per_backward(checkpointing):
    """DDP's reducer, FSDP and DeepSpeed count one accumulation per parameter per backward."""
    tiled = accumulations_per_parameter(True, checkpointing)
    assert [set(counts.values()) for counts in tiled] == [{1}, {2}], tiled
    assert tiled == accumulations_per_parameter(False, checkpointing)


def mlp_saved_shapes_and_rows(tiled: bool) -> tuple[list[tuple[int, ...]], list[int]]:
    """Shapes saved for backward inside the MLPs, and rows of every MLP projection output (fwd + bwd)."""
    model = tiny_llama(5)
    if tiled:
        enable_tiled_mlp(model, chunk_tokens=8)
    saved, inside = [], [False]
    for layer in model.model.layers:
        layer.mlp.register_forward_pre_hook(lambda m, a: inside.__setitem__(0, True))
        layer.mlp.register_forward_hook(lambda m, a, o: inside.__setitem__(0, False))

    def pack(t):
        if inside[0]:
            saved.append(tuple(t.shape))
        return t

    ids = token_ids(seed=5)
    with record_rows(model) as rows:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = fp64_loss(model(input_ids=ids).logits[:, :-1], ids[:, 1:])
        loss.backward()
    return saved, rows


def test_no_whole_sequence_intermediate_is_saved_or_built():
    untiled_saved, untiled_rows = mlp_saved_shapes_and_rows(False)
    tiled_saved, tiled_rows = mlp_saved_shapes_and_rows(True)
    # untiled: gate, up, act(gate) and their product, (1, T, intermediate) each, are kept for backward
    assert (1, T, INTER) in untiled_saved and max(untiled_rows) == T
    # tiled: the MLP keeps only its input, and no projection ever sees more than one chunk
    assert tiled_saved == [(1, T, HIDDEN)] * LAYERS
    assert max(tiled_rows) == 8


def test_state_dict_keys_do_not_change_and_checkpoints_load_both_ways(tmp_path):
    plain, tiled = tiny_llama(6), tiny_llama(7)
    keys = list(plain.state_dict())
    enable_tiled_mlp(tiled, chunk_tokens=5)
    assert list(tiled.state_dict()) == keys
    assert [n for n, _ in tiled.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert tiled.get_submodule("model.layers.0.mlp.gate_proj") is tiled.model.layers[0].mlp.mlp.gate_proj
    assert tiled.model.layers[0].mlp.intermediate_size == INTER  # plain attributes of the wrapped MLP

    result = tiled.load_state_dict(plain.state_dict())  # untiled checkpoint -> tiled model
    assert not result.missing_keys and not result.unexpected_keys
    ids = token_ids(seed=6)
    assert_same(step(tiled, ids), step(plain, ids), "untiled weights in a tiled model")

    back = tiny_llama(8)
    result = back.load_state_dict(tiled.state_dict())  # tiled checkpoint -> untiled model
    assert not result.missing_keys and not result.unexpected_keys
    assert_same(step(back, ids), step(plain, ids), "tiled weights in an untiled model")

    # transformers' own save/load, in both directions
    tiled.save_pretrained(tmp_path / "tiled")
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "tiled", dtype=torch.float64)
    assert_same(step(loaded, ids), step(plain, ids), "from_pretrained of a tiled save")
    enable_tiled_mlp(loaded, chunk_tokens=3)
    loaded.save_pretrained(tmp_path / "tiled2")
    assert_same(step(LlamaForCausalLM.from_pretrained(tmp_path / "tiled2", dtype=torch.float64), ids),
                step(plain, ids), "second round trip")

    # load_state_dict(assign=True) REPLACES parameter objects: the wrapped MLP must use the new ones
    other = tiny_llama(9)
    tiled.load_state_dict({k: v.clone() for k, v in other.state_dict().items()}, assign=True)
    mlp = tiled.model.layers[1].mlp
    assert mlp.mlp.up_proj.weight is mlp.up_proj.weight is dict(tiled.named_parameters())[
        "model.layers.1.mlp.up_proj.weight"]
    assert_same(step(tiled, ids), step(other, ids), "after assign=True")


def test_frozen_parameters_and_inputs_without_grad():
    model = tiny_llama(10)
    model.model.layers[0].mlp.gate_proj.weight.requires_grad_(False)
    model.model.embed_tokens.weight.requires_grad_(False)
    ids = token_ids(seed=10)
    want = step(model, ids)
    enable_tiled_mlp(model, chunk_tokens=4)
    got = step(model, ids)
    assert got[1]["model.layers.0.mlp.gate_proj.weight"] is None
    assert_same(got, want, "frozen gate_proj")

    # a bare MLP whose input needs no gradient: parameter gradients only
    torch.manual_seed(0)
    mlp = LlamaMLP(tiny_llama(0).config).double()
    x = torch.randn(T, HIDDEN, dtype=torch.float64)
    ref = torch.autograd.grad(mlp(x).square().sum(), list(mlp.parameters()))
    got = torch.autograd.grad(TiledMLP(mlp, chunk_tokens=7)(x).square().sum(), list(mlp.parameters()))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **TOL)
    with torch.no_grad():  # no graph: still chunked, same output
        torch.testing.assert_close(TiledMLP(mlp, chunk_tokens=7)(x), mlp(x), **TOL)


@settings(max_examples=30, deadline=None)
@given(length=st.integers(0, 50), batch=st.integers(1, 3), chunk=st.integers(1, 60))
def test_bare_mlp_matches_for_any_shape(length, batch, chunk):
    torch.manual_seed(length)
    mlp = LlamaMLP(tiny_llama(0).config).double()
    x = torch.randn(batch, length, HIDDEN, dtype=torch.float64, requires_grad=True)
    out = mlp(x)
    tiled_out = TiledMLP(mlp, chunk_tokens=chunk)(x)
    torch.testing.assert_close(tiled_out, out, **TOL)
    if length == 0:
        return
    g = torch.randn_like(out)
    ref = torch.autograd.grad(out, [x, *mlp.parameters()], g)
    got = torch.autograd.grad(tiled_out, [x, *mlp.parameters()], g)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **TOL)
    spans = chunk_spans(length, chunk)
    assert [s for s, _ in spans] == [sum(n for _, n in spans[:i]) for i in range(len(spans))]
    assert sum(n for _, n in spans) == length and max(n for _, n in spans) <= chunk
    assert max(n for _, n in spans) - min(n for _, n in spans) <= 1


def test_reduced_precision_and_autocast():
    torch.manual_seed(0)
    mlp = LlamaMLP(tiny_llama(0).config)
    x = torch.randn(1, T, HIDDEN, requires_grad=True)
    g = torch.randn(1, T, HIDDEN)

    def grads(module, dtype_seen):
        hook = module.gate_proj.register_forward_hook(lambda m, a, o: dtype_seen.append(o.dtype))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module(x)
        result = torch.autograd.grad(out, [x, *mlp.parameters()], g)
        hook.remove()
        return out, result

    seen_ref, seen_tiled = [], []
    out_ref, ref = grads(mlp, seen_ref)
    out_tiled, got = grads(TiledMLP(mlp, chunk_tokens=5), seen_tiled)
    # the recompute in backward runs under the forward's autocast: bfloat16 too
    assert len(seen_tiled) == 2 * len(chunk_spans(T, 5)) and set(seen_tiled) == {torch.bfloat16}
    torch.testing.assert_close(out_tiled, out_ref, rtol=2e-2, atol=2e-2)
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)

    # bfloat16 parameters: gradients come back in bfloat16, close to the float64 ones
    mlp64 = LlamaMLP(tiny_llama(0).config).double()
    mlp16 = LlamaMLP(tiny_llama(0).config).to(torch.bfloat16)
    mlp16.load_state_dict({k: v.to(torch.bfloat16) for k, v in mlp64.state_dict().items()})
    mlp64.load_state_dict({k: v.double() for k, v in mlp16.state_dict().items()})
    x16 = torch.randn(T, HIDDEN).to(torch.bfloat16)
    want = torch.autograd.grad(mlp64(x16.double()).sum(), list(mlp64.parameters()))
    have = torch.autograd.grad(TiledMLP(mlp16, chunk_tokens=4)(x16).float().sum(), list(mlp16.parameters()))
    for a, b in zip(have, want):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.double(), b, rtol=5e-2, atol=5e-2)


def test_enable_is_idempotent_and_errors_name_the_fix():
    model = tiny_llama(11)
    assert enable_tiled_mlp(model, chunk_tokens=8) == LAYERS
    first = [layer.mlp for layer in model.model.layers]
    assert enable_tiled_mlp(model, chunk_tokens=8) == 0
    assert [layer.mlp for layer in model.model.layers] == first  # not wrapped twice
    assert enable_tiled_mlp(model, num_chunks=4) == LAYERS  # chunking updated in place
    assert all(layer.mlp.num_chunks == 4 and layer.mlp.chunk_tokens is None for layer in model.model.layers)
    assert "num_chunks=4, wraps=LlamaMLP" in repr(model)
    assert disable_tiled_mlp(model) == LAYERS and disable_tiled_mlp(model) == 0
    assert all(isinstance(layer.mlp, LlamaMLP) for layer in model.model.layers)

    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB))
    with pytest.raises(ValueError, match=r"model\.model\.layers.*TiledMLP\(layer\.mlp"):
        enable_tiled_mlp(gpt2)
    mlp = model.model.layers[0].mlp
    with pytest.raises(ValueError, match="not both"):
        TiledMLP(mlp, chunk_tokens=4, num_chunks=2)
    with pytest.raises(ValueError, match="positive int"):
        TiledMLP(mlp, chunk_tokens=0)
    with pytest.raises(TypeError, match="already tiled"):
        TiledMLP(TiledMLP(mlp))
    with pytest.raises(ValueError, match="dropout"):
        TiledMLP(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1)))


def test_parameters_swapped_mid_step_are_refused():
    model = tiny_llama(12)
    enable_tiled_mlp(model, chunk_tokens=8)
    ids = token_ids(seed=12)
    loss = fp64_loss(model(input_ids=ids).logits[:, :-1], ids[:, 1:])
    mlp = model.model.layers[1].mlp
    mlp.down_proj.weight = torch.nn.Parameter(mlp.down_proj.weight.detach().clone())
    with pytest.raises(RuntimeError, match="replaced between forward and backward"):
        loss.backward()


def test_zero3_partitioned_parameters_are_refused_with_the_fix():
    """ZeRO-3 frees partitioned weights after forward; the chunked backward cannot read them."""
    model = tiny_llama(1)
    enable_tiled_mlp(model, chunk_tokens=4)
    model.model.layers[0].mlp.gate_proj.weight.ds_id = 0  # what DeepSpeed ZeRO-3 marks its parameters with
    with pytest.raises(ValueError, match="ZeRO-3.*tiled_mlp: 0"):
        model(input_ids=token_ids())
