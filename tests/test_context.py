"""Every attention call of a sharded forward finds the context of its own model's forward, on every path, and
decoding with the input hook installed runs unsharded (float64, 1e-9, one process and two):

1. StableLM and Nemotron, whose decoder layers drop the attention keywords, through ``shard_batch`` +
   ``model(**local)`` (also with layer checkpointing, recomputed in backward) and through the input hook:
   loss and every gradient equal transformers' sdpa per document;
2. another ``longctx_*`` model run from inside that forward (a teacher) is not touched by its context;
3. a MoE model asked for its router aux loss in a sharded forward without the batch-exact loss is refused by name;
4. ``generate()`` and hand-written decoding (``cache=``, ``past_key_values=``, a fresh empty cache, ``use_cache``)
   with the input hook installed equal the model without it and sdpa, also from a callback during training.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_transformers_parity import (
    LENS,
    STARTS,
    VOCAB,
    assert_same,
    build,
    packed,
    per_document_reference,
    sharded_loss_and_grads,
    split_documents,
)
from transformers import DynamicCache, Qwen3MoeConfig, Qwen3MoeForCausalLM, TrainerCallback

import hf_longctx  # noqa: F401 - registers the longctx_* implementations
from hf_longctx.hf import enable_layer_checkpointing, plan_for, shard_batch
from hf_longctx.hf.integration.inputs import install_input_hook
from hf_longctx.layout import PackedBatch
from hf_longctx.moe import enable_distributed_aux_loss

from distributed import run_distributed
from trainer_runs import flattening_run, summed_loss_and_grads, tiny_llama


def _world_group(world: int):
    return dist.group.WORLD if world > 1 else None


# ----------------------------------------------------------------------------- 1 and 2


def check_dropping_layers_on_every_path(rank, world):
    group = _world_group(world)
    ids, pos = packed(1, LENS, STARTS)
    plan = plan_for(PackedBatch.from_doc_lens(LENS), "zigzag", group)
    teacher = build("stablelm", seed=1)
    teacher.set_attn_implementation("longctx_zigzag")
    teacher_ids, teacher_pos = ids[:, :20], torch.arange(20)[None]
    with torch.no_grad():
        alone = teacher(input_ids=teacher_ids, position_ids=teacher_pos).logits
    for name in ("stablelm", "nemotron"):
        model = build(name)
        ref = per_document_reference(model, ids, pos, LENS)
        model.set_attn_implementation("longctx_zigzag")
        for checkpointing in (False, True) if name == "stablelm" else (False,):
            if checkpointing:
                enable_layer_checkpointing(model)
            seen = []

            def run_teacher(module, args, seen=seen):
                with torch.no_grad():  # inside the sharded forward of ``model``: the teacher is another model
                    seen.append(teacher(input_ids=teacher_ids, position_ids=teacher_pos).logits)

            handle = model.model.layers[0].register_forward_pre_hook(run_teacher)
            model.zero_grad()
            try:
                loss = model(**shard_batch({"input_ids": ids, "position_ids": pos}, plan, rank, group)).loss
                loss.backward()
            finally:
                handle.remove()
            what = f"{name} through shard_batch, checkpointing={checkpointing}, over {world}"
            assert_same(*summed_loss_and_grads(loss, model, world), *ref, what)
            assert len(seen) == 1
            torch.testing.assert_close(seen[0], alone, rtol=1e-12, atol=1e-12, msg=f"teacher inside {what}")
        got = sharded_loss_and_grads(model, "longctx_zigzag", rank, world, split_documents(ids, pos, LENS, world))
        assert_same(*got, *ref, f"{name} through the input hook, with checkpointing, over {world}")


def test_layers_that_drop_keywords_are_exact_on_every_path_and_leave_other_models_alone():
    check_dropping_layers_on_every_path(0, 1)


# ----------------------------------------------------------------------------- 3


def tiny_qwen3_moe(output_router_logits: bool = True) -> Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=4, num_experts=4,
                         num_experts_per_tok=2, router_aux_loss_coef=0.5, output_router_logits=output_router_logits,
                         max_position_embeddings=256, attn_implementation="longctx_zigzag",
                         experts_implementation="eager")
    return Qwen3MoeForCausalLM(cfg).double()


REFUSED = r"Qwen3MoeForCausalLM is asked for its router aux loss .* sharded over 2 ranks.*" \
          r"hf_longctx\.moe\.enable_distributed_aux_loss\(model\)"


def check_moe_aux_loss(rank, world):
    group = _world_group(world)
    ids, pos = packed(3, [7, 5, 9])
    plan = plan_for(PackedBatch.from_doc_lens([7, 5, 9]), "zigzag", group)
    local = shard_batch({"input_ids": ids, "position_ids": pos}, plan, rank, group)
    model = tiny_qwen3_moe()
    if world == 1:  # one rank holds the whole batch: transformers' own aux loss is the batch's
        assert model(**local).aux_loss is not None
        return
    with pytest.raises(ValueError, match=REFUSED):  # the config's default asks for it
        model(**local)
    assert model(**local, output_router_logits=False).aux_loss is None
    with pytest.raises(ValueError, match=REFUSED):  # the call asks for it
        tiny_qwen3_moe(output_router_logits=False)(**local, output_router_logits=True)
    hook = install_input_hook(model, group)
    with pytest.raises(ValueError, match=REFUSED):  # the input hook refuses before gathering the batch
        model(input_ids=ids[:, rank::2], position_ids=torch.arange(ids[:, rank::2].shape[1])[None])
    hook.remove()
    aux = enable_distributed_aux_loss(model)
    assert model(**local).aux_loss is not None  # the batch-exact loss
    aux.remove()
    with pytest.raises(ValueError, match=REFUSED):
        model(**local)


def test_one_rank_moe_forward_keeps_transformers_aux_loss():
    check_moe_aux_loss(0, 1)


# ----------------------------------------------------------------------------- 4

STEPS = 5


def greedy(model, prompt):
    out = model.generate(prompt, max_new_tokens=STEPS, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0)
    return out.sequences, torch.stack(out.logits)


def decode_by_hand(model, prompt, prefill: dict, spelling: str):
    """Greedy decoding with the cache handed back under ``spelling``: the prompt's last logits, then each step's."""
    out = model(input_ids=prompt, **prefill)
    logits = [out.logits[:, -1]]
    for _ in range(STEPS - 1):
        token = logits[-1].argmax(-1, keepdim=True)
        out = model(input_ids=token, **{spelling: out.cache})
        logits.append(out.logits[:, -1])
    return torch.stack(logits)


def check_decoding_with_the_hook(rank, world):
    prompt = torch.randint(3, VOCAB, (1, 6 + 3 * rank), generator=torch.Generator().manual_seed(rank))
    plain, hooked = tiny_llama("longctx_zigzag", dtype=torch.float64), tiny_llama("longctx_zigzag", dtype=torch.float64)
    sdpa = tiny_llama("sdpa", dtype=torch.float64)
    hook = install_input_hook(hooked, _world_group(world))
    for training in (True, False):  # a sampling callback during training, and evaluation
        for model in (plain, hooked, sdpa):
            model.train(training)
        want_tokens, want_logits = greedy(plain, prompt)
        for model, what in ((hooked, "hooked"), (sdpa, "sdpa")):
            tokens, logits = greedy(model, prompt)
            assert torch.equal(tokens, want_tokens), f"{what} generate, training={training}, rank {rank}"
            torch.testing.assert_close(logits, want_logits, rtol=1e-9, atol=1e-9)
    want = decode_by_hand(plain, prompt, {"use_cache": True}, "cache")
    for prefill in ("use_cache", "cache", "past_key_values"):  # a fresh, empty cache under either name
        for spelling in ("cache", "past_key_values"):
            first = {"use_cache": True} if prefill == "use_cache" else {prefill: DynamicCache()}
            got = decode_by_hand(hooked, prompt, first, spelling)
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=f"{prefill} then {spelling}=")
    assert hook.tokens == 0  # nothing was sharded
    hook.remove()


def test_decoding_with_the_input_hook_installed_is_unsharded_and_exact():
    check_decoding_with_the_hook(0, 1)


class GenerateAtEachStep(TrainerCallback):
    """Greedy generation from the model being trained, and from a copy of its weights without any hook (float32:
    the logits agree to its rounding, the tokens exactly)."""

    def __init__(self):
        self.matches = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        prompt = torch.randint(3, VOCAB, (1, 5 + state.global_step), generator=torch.Generator().manual_seed(7))
        tokens, logits = greedy(model, prompt)
        alone = type(model)(copy.deepcopy(model.config))
        alone.load_state_dict(model.state_dict())
        alone.train(model.training)
        want_tokens, want_logits = greedy(alone, prompt)
        self.matches.append(bool(torch.equal(tokens, want_tokens)
                                 and torch.allclose(logits, want_logits, rtol=1e-5, atol=1e-6)))


def _train_and_generate(rank, world, out_dir):
    sampler = GenerateAtEachStep()
    run = flattening_run(f"{out_dir}/run{rank}", steps=2, evaluate=False, extra_callbacks=[sampler])
    assert run["summary"]["sp_size"] == world
    Path(out_dir, f"matches{rank}.json").write_text(json.dumps(sampler.matches))


# ----------------------------------------------------------------------------- the same on two processes


def _two_process_checks(rank, world, out_dir):
    check_dropping_layers_on_every_path(rank, world)
    check_moe_aux_loss(rank, world)
    check_decoding_with_the_hook(rank, world)
    _train_and_generate(rank, world, out_dir)


def test_every_case_on_two_processes_and_generate_from_a_callback_during_training(tmp_path):
    """1-4 sharded over two gloo processes (one spawn for all), and a Trainer run with LongContextCallback whose
    on_step_end callback generates: equal to the same weights without any hook."""
    run_distributed(2, _two_process_checks, str(tmp_path), timeout_s=300)
    for rank in range(2):
        assert json.loads((tmp_path / f"matches{rank}.json").read_text()) == [True, True]
