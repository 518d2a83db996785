"""A sharded Llama trains exactly like one process with SDPA on the same packed batch.

Every rank builds the same tiny random Llama (2 layers, GQA) in float64 and the same packed batch;
the loss and parameter gradients summed over the sequence-parallel group must equal single-process
SDPA run document by document.
"""

from __future__ import annotations

import random
import types

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import hf_longctx  # noqa: F401 - registers the attention implementations
from hf_longctx.hf import LongContextConfig, implementation_name, plan_for, shard_batch
from hf_longctx.hf.integration.inputs import install_input_hook
from hf_longctx.hf.memory.checkpointing import enable_layer_checkpointing, enable_recompute_aware_checkpointing
from hf_longctx.kernels import reset_stats, stats
from hf_longctx.layout import PackedBatch

from distributed import run_distributed
from helpers import matrix_backends, random_doc_lens

BACKENDS = matrix_backends()  # the package's backends (and any registered before this module is imported)
VOCAB = 61


def tiny_llama(seed=0, impl="sdpa") -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
                      attn_implementation=impl)
    return LlamaForCausalLM(cfg).double()


def packed_example(seed: int, total: int):
    rng = random.Random(seed)
    lens = random_doc_lens(rng, total, max_len=total // 2)
    ids = torch.randint(0, VOCAB, (1, total), generator=torch.Generator().manual_seed(seed))
    return PackedBatch.from_doc_lens(lens), ids


def loss_sum_fp64(logits, targets):
    """Sum of token cross-entropies in float64 (transformers' own loss upcasts only to float32)."""
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB).double(), targets.reshape(-1),
                                             ignore_index=-100, reduction="sum")


def reference_loss_and_grads(model, packed: PackedBatch, ids):
    """Single process, SDPA, one forward per document; loss = sum of token losses / all targets."""
    model.zero_grad()
    model.set_attn_implementation("sdpa")
    targets = sum(n - 1 for n in packed.doc_lens)
    total = 0.0
    for s, n in zip(packed.doc_starts, packed.doc_lens):
        if n < 2:
            continue
        doc = ids[:, s : s + n]
        loss = loss_sum_fp64(model(input_ids=doc).logits[:, :-1], doc[:, 1:]) / targets
        loss.backward()
        total += loss.detach()
    return total, {name: p.grad.clone() for name, p in model.named_parameters()}


def assert_group_sum_equal(loss, model, ref_loss, ref_grads, where, tol=1e-8):
    summed = loss.detach().clone()
    dist.all_reduce(summed)
    torch.testing.assert_close(summed, torch.as_tensor(ref_loss, dtype=summed.dtype), rtol=tol, atol=tol,
                               msg=lambda m: f"loss {where} {m}")
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad)
        torch.testing.assert_close(grad, ref_grads[name], rtol=tol, atol=tol,
                                   msg=lambda m, n=name: f"grad {n} {where} {m}")


def check_sharded_llama(rank, world, backends, seeds):
    for seed in seeds:
        packed, ids = packed_example(seed, total=24 * world + seed % world)
        model = tiny_llama(seed)
        ref_loss, ref_grads = reference_loss_and_grads(model, packed, ids)
        for backend in backends:
            model.zero_grad()
            model.set_attn_implementation(implementation_name(backend))
            plan = plan_for(packed, backend, None)
            batch = {"input_ids": ids, "position_ids": packed.position_ids[None]}
            local = shard_batch(batch, plan, rank)
            out = model(**local)
            loss = loss_sum_fp64(out.logits, local["shift_labels"]) / local["num_items_in_batch"]
            loss.backward()
            where = f"{backend} world={world} rank={rank} seed={seed} docs={packed.doc_lens}"
            assert_group_sum_equal(loss, model, ref_loss, ref_grads, where)
            # transformers' own loss (float32 inside) is the same share of the single-device loss
            hf_loss = out.loss.detach().clone()
            dist.all_reduce(hf_loss)
            torch.testing.assert_close(hf_loss, torch.as_tensor(ref_loss, dtype=hf_loss.dtype), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_llama_loss_and_grads_equal_sdpa(world):
    run_distributed(world, check_sharded_llama, BACKENDS, range(2))


def check_input_hook(rank, world, backends):
    """Each rank passes its own packed rows; the group trains on their concatenation, for every backend."""
    rows = [packed_example(100 + r, total=20 + 3 * r) for r in range(world)]
    group_ids = torch.cat([ids for _, ids in rows], dim=1)
    group_packed = PackedBatch.from_doc_lens([n for p, _ in rows for n in p.doc_lens])
    for backend in backends:
        model = tiny_llama(5)
        ref_loss, ref_grads = reference_loss_and_grads(model, group_packed, group_ids)
        model.zero_grad()
        model.set_attn_implementation(implementation_name(backend))
        hook = install_input_hook(model, group=None)
        packed, ids = rows[rank]
        labels = ids.clone()
        labels[0, list(packed.doc_starts)] = -100  # DataCollatorWithFlattening's convention
        loss = model(input_ids=ids, position_ids=packed.position_ids[None], labels=labels).loss
        loss.backward()
        # transformers computes the loss in float32: equal to that precision
        assert_group_sum_equal(loss, model, ref_loss, ref_grads, f"hook {backend} rank={rank}", tol=1e-6)
        # the logged attention load covers every visible pair of the group batch exactly once
        assert hook.work_mean * world == pytest.approx(group_packed.causal_pairs()), backend
        assert hook.work_max >= hook.work_mean


def test_input_hook_trains_on_the_concatenated_group_batch():
    run_distributed(2, check_input_hook, BACKENDS + ["auto"])


def check_backend_options_reach_every_attention_call(rank, world, options):
    """The settings' backend_options, given to the input hook, reach every attention call of the sharded forward,
    and the run they tune is exact (each rank brings its own packed rows, as in :func:`check_input_hook`)."""
    import hf_longctx.hf.integration.attention as attention

    seen = []
    run = attention.sequence_parallel_attention

    def spy(*args, **kwargs):
        seen.append(kwargs.get("options"))
        return run(*args, **kwargs)

    attention.sequence_parallel_attention = spy
    rows = [packed_example(200 + r, total=40 + 5 * r) for r in range(world)]
    group_ids = torch.cat([ids for _, ids in rows], dim=1)
    group_packed = PackedBatch.from_doc_lens([n for p, _ in rows for n in p.doc_lens])
    model = tiny_llama(3)
    ref_loss, ref_grads = reference_loss_and_grads(model, group_packed, group_ids)
    model.zero_grad()
    model.set_attn_implementation(implementation_name("cad"))
    install_input_hook(model, group=None, options=options)
    packed, ids = rows[rank]
    labels = ids.clone()
    labels[0, list(packed.doc_starts)] = -100
    loss = model(input_ids=ids, position_ids=packed.position_ids[None], labels=labels).loss
    loss.backward()
    from hf_longctx.backends.cad.options import CadOptions

    # parsed once by the input hook: every layer gets the same frozen object
    assert seen == [CadOptions(**options)] * model.config.num_hidden_layers, seen
    assert all(s is seen[0] for s in seen)
    assert_group_sum_equal(loss, model, ref_loss, ref_grads, f"cad {options} rank={rank}", tol=1e-6)


def test_backend_options_of_the_settings_reach_every_attention_call_and_stay_exact():
    run_distributed(3, check_backend_options_reach_every_attention_call,
                    {"eps": 0.01, "pingpong": False, "min_shard": 4, "key_cuts": True})


def test_shard_batch_hands_its_options_to_every_attention_call(monkeypatch):
    """``shard_batch(..., options=...)``, the path of a caller that shards batches itself (the benchmarks)."""
    import hf_longctx.hf.integration.attention as attention

    seen = []
    run = attention.sequence_parallel_attention
    monkeypatch.setattr(attention, "sequence_parallel_attention",
                        lambda *a, **kw: seen.append(kw.get("options")) or run(*a, **kw))
    packed, ids = packed_example(3, total=40)
    model = tiny_llama(1, impl=implementation_name("cad"))
    plan = plan_for(packed, "cad", None)
    local = shard_batch({"input_ids": ids, "position_ids": packed.position_ids[None]}, plan, 0,
                        options={"eps": 0.01, "pingpong": False})
    model(**local)
    from hf_longctx.backends.cad.options import CadOptions

    # without model=, parsed at the forward's first attention call, then the same object for every layer
    assert seen == [CadOptions(eps=0.01, pingpong=False)] * model.config.num_hidden_layers
    assert all(s is seen[0] for s in seen)


def test_backend_options_for_another_backend_than_the_model_runs_are_refused():
    model = tiny_llama(0, impl=implementation_name("zigzag"))
    with pytest.raises(ValueError, match=r"backend_options: backend 'zigzag' has no option 'eps'; it takes none "
                                         r"\(the model runs attn_implementation='longctx_zigzag'\)"):
        install_input_hook(model, group=None, options={"eps": 0.01})
    with pytest.raises(ValueError, match="backend 'cad': pingpong must be true or false"):
        install_input_hook(tiny_llama(0, impl=implementation_name("cad")), group=None, options={"pingpong": "no"})


def _step(model, local):
    reset_stats()
    model.zero_grad()
    model(**local).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, dict(stats())


def test_recompute_aware_checkpointing_keeps_attention_and_equal_grads():
    packed, ids = packed_example(7, total=64)
    model = tiny_llama(7, impl="longctx_ring")
    model.train()
    local = shard_batch({"input_ids": ids, "position_ids": packed.position_ids[None]},
                        plan_for(packed, "ring", None), 0)
    plain_grads, plain_calls = _step(model, local)
    enable_layer_checkpointing(model)
    layer_grads, layer_calls = _step(model, local)
    enable_recompute_aware_checkpointing(model)
    aware_grads, aware_calls = _step(model, local)
    layers = model.config.num_hidden_layers
    assert plain_calls["core_attention.forward"] == layers
    assert layer_calls["core_attention.forward"] == 2 * layers  # attention re-run in backward
    assert aware_calls["core_attention.forward"] == layers  # never re-run
    for name in plain_grads:
        torch.testing.assert_close(aware_grads[name], layer_grads[name], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(aware_grads[name], plain_grads[name], rtol=1e-10, atol=1e-12)
    assert aware_calls["core_attention.backward"] == layers


def test_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="unknown backend 'distflsh'"):
        LongContextConfig(backend="distflsh")
    with pytest.raises(ValueError, match="did you mean 'sp_size'"):
        LongContextConfig.from_dict({"sp_sise": 2})
    with pytest.raises(ValueError, match="does not divide the 6 processes"):
        LongContextConfig(sp_size=4).resolved_sp_size(6)
    with pytest.raises(ValueError, match="checkpointing"):
        LongContextConfig(checkpointing="selective")


def _attention_of_its_own(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
    """Causal attention computed in the layer itself, as models written before transformers' AttentionInterface do."""
    b, s, _ = hidden_states.shape
    q, k, v = (proj(hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2)
               for proj in (self.q_proj, self.k_proj, self.v_proj))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return self.o_proj(out.transpose(1, 2).reshape(b, s, -1)), None


def test_model_and_batch_errors_name_the_fix():
    from transformers import BloomConfig, BloomForCausalLM

    with pytest.raises(ValueError, match="attn_implementation='longctx_<backend>'"):
        install_input_hook(tiny_llama(0), None)
    bloom = BloomForCausalLM(BloomConfig(n_layer=1, hidden_size=16, n_head=2, vocab_size=VOCAB))
    bloom.config._attn_implementation = "longctx_ring"
    with pytest.raises(ValueError, match="BloomForCausalLM.forward takes no position_ids"):
        install_input_hook(bloom, None)
    bypassing = tiny_llama(0, impl="longctx_ring")
    for layer in bypassing.model.layers:  # attention of its own, which never asks transformers' interface
        layer.self_attn.forward = types.MethodType(_attention_of_its_own, layer.self_attn)
    install_input_hook(bypassing, None)
    with pytest.raises(ValueError, match=r"ran a sharded forward without calling its longctx_\* attention"):
        bypassing(input_ids=torch.randint(0, VOCAB, (1, 8)))
    model = tiny_llama(0, impl="longctx_ring")
    install_input_hook(model, None)
    ids = torch.randint(0, VOCAB, (1, 8))
    with pytest.raises(ValueError, match=r"labels has shape \(1, 9\) but input_ids has \(1, 8\).*drop empty examples"):
        model(input_ids=ids, labels=torch.randint(0, VOCAB, (1, 9)))
    with pytest.raises(ValueError, match="needs input_ids"):
        model(inputs_embeds=torch.randn(1, 8, 48))
    with pytest.raises(ValueError, match="the batch has no tokens"):
        model(input_ids=ids[:, :0])


# ----------------------------------------------------------------------------- sliding window


def tiny_windowed(family: str, window: int | None, seed=0, impl="sdpa"):
    """Mistral (every layer sliding) or Qwen2 (layer 0 full, layer 1 sliding, like alternating models)."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    shape = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
                 num_key_value_heads=2, max_position_embeddings=512, attn_implementation=impl)
    if family == "mistral":
        return MistralForCausalLM(MistralConfig(sliding_window=window, **shape)).double()
    cfg = Qwen2Config(use_sliding_window=window is not None, sliding_window=window, max_window_layers=1, **shape)
    assert cfg.layer_types == ["full_attention", "sliding_attention"] or window is None
    return Qwen2ForCausalLM(cfg).double()


def check_sliding_window_models(rank, world, backends, seed, window):
    packed, ids = packed_example(seed, total=24 * world + seed % world)
    assert packed.max_seqlen > window + 2, "the window must bind somewhere"
    for family in ("mistral", "qwen2"):
        model = tiny_windowed(family, window, seed)
        ref_loss, ref_grads = reference_loss_and_grads(model, packed, ids)
        full_loss, _ = reference_loss_and_grads(tiny_windowed(family, None, seed), packed, ids)
        assert abs(full_loss - ref_loss) > 1e-6, "SDPA ignored the sliding window: the reference proves nothing"
        for backend in backends:
            model.zero_grad()
            model.set_attn_implementation(implementation_name(backend))
            local = shard_batch({"input_ids": ids, "position_ids": packed.position_ids[None]},
                                plan_for(packed, backend, None), rank)
            loss = loss_sum_fp64(model(**local).logits, local["shift_labels"]) / local["num_items_in_batch"]
            loss.backward()
            where = f"{family} window={window} {backend} world={world} rank={rank} seed={seed} docs={packed.doc_lens}"
            assert_group_sum_equal(loss, model, ref_loss, ref_grads, where)


@pytest.mark.parametrize("world,window,backends", [
    (1, 5, ["local", "zigzag"]),
    (2, 7, BACKENDS + ["auto"]),
    (3, 11, ["distfa", "tasp", "cad"]),
])
def test_sliding_window_models_equal_sdpa_per_document(world, window, backends):
    """Mistral and Qwen2 with sliding_window train exactly like SDPA with the same window, document by
    document: loss and every parameter gradient, on 1, 2 and 3 processes."""
    run_distributed(world, check_sliding_window_models, backends, world, window)


def test_unsupported_attention_features_are_refused_by_name():
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2,
                       num_experts_per_tok=1, attn_implementation="longctx_local")
    model = GptOssForCausalLM(cfg)
    packed = PackedBatch.from_doc_lens([5, 3])
    local = shard_batch({"input_ids": torch.randint(0, VOCAB, (1, 8)), "position_ids": packed.position_ids[None]},
                        plan_for(packed, "local", None), 0)
    with pytest.raises(ValueError, match=r"attention sinks \(s_aux\)"):
        model(**local)


def test_an_additive_position_bias_is_refused_by_name():
    """A model that hands attention a bias to add to the scores (Inkling's relative logits, T5's position_bias) is
    refused: no backend adds it, so computing without it would be another model."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attention = ALL_ATTENTION_FUNCTIONS["longctx_local"]
    q = k = v = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"position_bias"):
        attention(torch.nn.Module(), q, k, v, None, position_bias=torch.zeros(1, 2, 4, 4))
