"""Where a careless integration would train silently wrong, a ``longctx_*`` model computes what transformers
computes (float64, 1e-9), in one process and sharded over two, or refuses by name:

1. decoder layers that do not pass their keywords on to attention (StableLM, Nemotron) still run sequence
   parallel: the attention finds the batch's context through its model;
2. bidirectional layers (``is_causal = False``: Gemma3 with ``use_bidirectional_attention``) are computed
   without the causal mask, in one process and by ``ulysses``; the ring backends and a bidirectional
   sliding window refuse with the fix;
3. padded training rows (left, right, inside a row) keep every position's logits and targets, and the
   padding attends to nothing;
4. ``Trainer(compute_loss_func=...)`` and ``label_smoothing_factor`` see the logits of their own rows;
5. ``average_tokens_across_devices=False`` averages each sequence-parallel group's tokens, as DDP
   averages each device's;
6. a document starts wherever ``position_ids`` do not step by +1, whatever the first value.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import (
    DataCollatorWithFlattening,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    NemotronConfig,
    NemotronForCausalLM,
    StableLmConfig,
    StableLmForCausalLM,
)

import hf_longctx  # noqa: F401 - registers the longctx_* implementations
from hf_longctx.hf.integration.inputs import install_input_hook

from distributed import run_distributed
from trainer_runs import PaddingCollator, causal_lm_loss_fp64, flattening_run, shifted_sum_loss, summed_loss_and_grads

VOCAB = 61
SHAPE = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
             num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def build(name: str, seed: int = 0):
    torch.manual_seed(seed)
    if name == "llama":
        model = LlamaForCausalLM(LlamaConfig(**SHAPE))
    elif name == "stablelm":  # its decoder layer calls self_attn without **kwargs
        model = StableLmForCausalLM(StableLmConfig(**SHAPE))
    elif name == "nemotron":  # likewise
        model = NemotronForCausalLM(NemotronConfig(**SHAPE))
    elif name == "gemma3-bidirectional":
        model = Gemma3ForCausalLM(Gemma3TextConfig(**SHAPE, head_dim=8, use_bidirectional_attention=True,
                                                   layer_types=["full_attention"] * 2))
    else:
        raise KeyError(name)
    model.loss_function = causal_lm_loss_fp64
    return model.double().train()


def packed(seed: int, lens: list[int], starts: list[int] | None = None):
    """ids (1, T) and position_ids (1, T): document d counts from ``starts[d]`` (default 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (1, sum(lens)), generator=g)
    starts = starts or [0] * len(lens)
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])[None]
    return ids, pos


def per_document_reference(model, ids, pos, lens):
    """SDPA, one forward per document: the mean next-token loss of the packed batch and its gradients."""
    model.set_attn_implementation("sdpa")
    model.zero_grad()
    total, count, start = 0.0, sum(n - 1 for n in lens), 0
    for n in lens:
        out = model(input_ids=ids[:, start : start + n], position_ids=pos[:, start : start + n], use_cache=False)
        loss = torch.nn.functional.cross_entropy(out.logits[0, :-1], ids[0, start + 1 : start + n], reduction="sum")
        (loss / count).backward()
        total += loss.item() / count
        start += n
    return total, {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}


def sharded_loss_and_grads(model, impl: str, rank: int, world: int, rows: dict):
    """Each rank brings ``rows[rank]`` (model keywords); the hook shards the group's batch. Summed over ranks."""
    model.set_attn_implementation(impl)
    model.zero_grad()
    hook = install_input_hook(model, dist.group.WORLD if world > 1 else None)
    try:
        loss = model(**rows[rank]).loss
        loss.backward()
    finally:
        hook.remove()
    return summed_loss_and_grads(loss, model, world)


def assert_same(loss, grads, ref_loss, ref_grads, what, tol=1e-9):
    assert loss == pytest.approx(ref_loss, rel=tol), what
    for k, g in ref_grads.items():
        torch.testing.assert_close(grads[k], g, rtol=tol, atol=tol * 1e-2, msg=f"{what}: {k}")


def split_documents(ids, pos, lens, world):
    """The packed row cut between documents into ``world`` rows of whole documents, one per rank."""
    starts = torch.tensor([0] + lens).cumsum(0).tolist()
    rows = []
    for r in range(world):
        docs = list(range(r, len(lens), world))
        idx = torch.cat([torch.arange(starts[d], starts[d] + lens[d]) for d in docs])
        rows.append({"input_ids": ids[:, idx], "position_ids": pos[:, idx], "labels": ids[:, idx]})
    return rows


# ----------------------------------------------------------------------------- 1 and 6 (and 2)

LENS = [9, 5, 12, 1, 7, 6]
STARTS = [0, 4, 0, 2, 11, 0]  # documents need not count from 0


def check_models_over_ranks(rank, world):
    ids, pos = packed(1, LENS, STARTS)
    rows = split_documents(ids, pos, LENS, world)
    for name in ("llama", "stablelm", "nemotron"):
        model = build(name)
        ref = per_document_reference(model, ids, pos, LENS)
        got = sharded_loss_and_grads(model, "longctx_zigzag", rank, world, rows)
        assert_same(*got, *ref, f"{name} over {world} ranks")
    model = build("gemma3-bidirectional")
    ref = per_document_reference(model, ids, pos, LENS)
    got = sharded_loss_and_grads(model, "longctx_ulysses", rank, world, rows)
    # Gemma's RMSNorm computes in float32 even in a float64 model: agreement to float32 rounding, while a causal
    # mask in place of the bidirectional one changes the loss in its first digits
    assert_same(*got, *ref, f"bidirectional gemma3 on ulysses over {world} ranks", tol=1e-5)
    if world > 1:
        with pytest.raises(ValueError, match="attends bidirectionally.*'zigzag'.*use ulysses"):
            sharded_loss_and_grads(model, "longctx_zigzag", rank, world, rows)


@pytest.mark.parametrize("world", [1, 2])
def test_kwargs_dropping_layers_bidirectional_layers_and_any_position_start_are_exact_when_sharded(world):
    """Cases 1, 2 and 6 under the input hook: loss and every gradient equal SDPA per document."""
    if world == 1:
        check_models_over_ranks(0, 1)
    else:
        run_distributed(world, check_models_over_ranks)


def test_one_process_packed_batch_documents_and_bidirectional_layers_equal_sdpa():
    """Without a hook: positions that break the +1 step start a document; bidirectional layers see the future."""
    ids, pos = packed(2, LENS, STARTS)
    for name in ("llama", "gemma3-bidirectional"):
        model = build(name).eval()
        with torch.no_grad():
            model.set_attn_implementation("sdpa")
            ref = torch.cat([model(input_ids=ids[:, a:b], position_ids=pos[:, a:b], use_cache=False).logits
                             for a, b in zip([0, *torch.tensor(LENS).cumsum(0).tolist()], torch.tensor(LENS).cumsum(0)
                                             .tolist())], dim=1)
            model.set_attn_implementation("longctx_zigzag")
            out = model(input_ids=ids, position_ids=pos).logits
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10, msg=name)


def test_bidirectional_sliding_window_is_refused_by_name():
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(**SHAPE, head_dim=8, use_bidirectional_attention=True, sliding_window=4,
                           layer_types=["sliding_attention", "full_attention"], attn_implementation="longctx_ring")
    model = Gemma3ForCausalLM(cfg).double()
    with pytest.raises(ValueError, match="attends bidirectionally inside a sliding window"):
        model(input_ids=torch.randint(3, VOCAB, (1, 10)))


# ----------------------------------------------------------------------------- 3: padding


def padded_rows(seed: int, real: list[int], length: int, side: str):
    """Rows of ``length`` tokens with ``real[i]`` real ones; padding on ``side`` ('left', 'right', 'inside')."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (len(real), length), generator=g)
    mask = torch.zeros(len(real), length, dtype=torch.long)
    for i, n in enumerate(real):
        if side == "left":
            mask[i, length - n :] = 1
        elif side == "right":
            mask[i, :n] = 1
        else:  # a gap of padding after the first two tokens
            mask[i, :2] = 1
            mask[i, length - (n - 2) :] = 1
    # padding with an ordinary token (as with pad = eos): the pad_token_id row of the embedding is zero, and
    # zero values would hide what the padding attends to
    ids = ids.masked_fill(mask == 0, 7)
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def check_padding_over_ranks(rank, world):
    real = [6, 9, 3, 7]
    for side in ("left", "right", "inside"):
        ids, mask, labels = padded_rows(3, real, 9, side)
        model = build("llama")
        # the reference: for left and right padding transformers' SDPA itself; inside a row SDPA lets a padding
        # position attend to the real tokens before it, so there the reference is one process without the hook
        model.set_attn_implementation("sdpa" if side != "inside" else "longctx_zigzag")
        model.zero_grad()
        ref_loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        ref_loss.backward()
        ref = ref_loss.item(), {k: p.grad.clone() for k, p in model.named_parameters()}
        per_rank = len(real) // world
        rows = [{"input_ids": ids[r * per_rank : (r + 1) * per_rank], "attention_mask": mask[r * per_rank :
                 (r + 1) * per_rank], "labels": labels[r * per_rank : (r + 1) * per_rank]} for r in range(world)]
        got = sharded_loss_and_grads(model, "longctx_zigzag", rank, world, rows)
        assert_same(*got, *ref, f"{side} padding over {world} ranks")


@pytest.mark.parametrize("world", [1, 2])
def test_padded_training_rows_keep_their_targets_and_padding_attends_nothing(world):
    """Case 3: the mask is honoured under the hook, at one rank and at two."""
    if world == 1:
        check_padding_over_ranks(0, 1)
    else:
        run_distributed(world, check_padding_over_ranks)


def test_flattening_collator_with_an_empty_example_trains_on_the_others_or_names_the_cause():
    """transformers' DataCollatorWithFlattening gave an empty example one label and no token before 5.24 (labels one
    longer than input_ids): that batch is refused with its cause named. Since, an empty example adds nothing, and
    the batch trains."""
    model = build("llama")
    model.set_attn_implementation("longctx_ring")
    install_input_hook(model, None)
    collate = DataCollatorWithFlattening()
    batch = collate([{"input_ids": [5, 6, 7]}, {"input_ids": []}, {"input_ids": [8, 9]}])
    if batch["labels"].shape != batch["input_ids"].shape:
        with pytest.raises(ValueError, match="empty example one label and no token: drop empty examples"):
            model(**batch)
    else:  # the empty example adds nothing to the batch, which trains
        without = collate([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
        for key in ("input_ids", "labels", "position_ids"):
            assert torch.equal(batch[key], without[key]), key
        assert torch.isfinite(model(**batch).loss)


# ----------------------------------------------------------------------------- 4 and 5: Trainer options

# option -> what two sequence-parallel processes must equal: one process, or plain DDP over two processes
# where the option itself defines the loss per process (label smoothing averages each process's own rows)
TRAINER_CASES = {
    "compute_loss_func": (dict(compute_loss_func=shifted_sum_loss), "one process"),
    "average_tokens_per_device": (dict(average_tokens_across_devices=False), "one process"),
    "right_padding": (dict(collator=PaddingCollator("right")), "one process"),
    "gradient_accumulation": (dict(gradient_accumulation_steps=2), "one process"),
    "label_smoothing": (dict(label_smoothing_factor=0.1), "ddp"),
}


def _history(run: dict) -> dict:
    return {"losses": run["losses"], "grad_norms": run["grad_norms"]}


def _trainer_runs(rank, world, out_dir):
    runs = {}
    for name, (options, reference) in TRAINER_CASES.items():
        runs[name] = _history(flattening_run(os.path.join(out_dir, f"{name}{rank}"), evaluate=False, **options))
        if reference == "ddp":
            runs[name + "-ddp"] = _history(flattening_run(os.path.join(out_dir, f"{name}-ddp{rank}"), evaluate=False,
                                                          impl="sdpa", callback=False, **options))
    if rank == 0:
        Path(out_dir, "two.json").write_text(json.dumps(runs))


def test_trainer_loss_options_on_two_processes_equal_their_reference(tmp_path):
    """Cases 4 and 5 (and padded Trainer batches): the logged losses and gradient norms of the reference."""
    one = {}
    for name, (options, _) in TRAINER_CASES.items():
        one[name] = flattening_run(str(tmp_path / name), evaluate=False, **options)
        plain = flattening_run(str(tmp_path / f"{name}-sdpa"), evaluate=False, impl="sdpa", callback=False,
                               **options)
        assert one[name]["losses"] == pytest.approx(plain["losses"], rel=1e-5), name  # one process: the hook is exact
    # the user's loss function and the model's own loss agree: the function saw the right logits and labels
    assert one["compute_loss_func"]["losses"] == pytest.approx(flattening_run(
        str(tmp_path / "model-loss"), evaluate=False)["losses"], rel=1e-6)
    run_distributed(2, _trainer_runs, str(tmp_path), timeout_s=300)
    two = json.loads((tmp_path / "two.json").read_text())
    for name, (_, reference) in TRAINER_CASES.items():
        expected = one[name] if reference == "one process" else two[name + "-ddp"]
        assert len(two[name]["losses"]) == 3, name
        assert two[name]["losses"] == pytest.approx(expected["losses"], rel=1e-5), name
        assert two[name]["grad_norms"] == pytest.approx(expected["grad_norms"], rel=1e-4), name


# ----------------------------------------------------------------------------- refusals by name, and LoRA


@pytest.mark.parametrize("model_type,expected", [
    ("llama", None),
    ("qwen3_next", "'linear_attention' layers: sequence mixers outside the attention function"),
    ("bamba", "'linear_attention' layers"),
    ("falcon_h1", "'hybrid' layers"),
    ("lfm2", None),  # its default layer list in transformers is all attention
    ("llama4_text", "chunked-attention layers"),
    ("hy_v4", "sparse indexer reads transformers' dense attention mask"),
    ("bigbird_pegasus", "is causal only through transformers' dense causal mask"),
    ("inkling_text", "adds learned relative position logits (position_bias"),
])
def test_layers_no_backend_computes_are_named_from_the_config(model_type, expected):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from hf_longctx.hf.integration.model_support import unsupported_layers

    reason = unsupported_layers(CONFIG_MAPPING[model_type]())
    assert reason == expected if expected is None else expected in reason
    assert "Mamba (state-space) blocks" in unsupported_layers(LlamaConfig(mamba_d_state=16))  # no layer list


def test_hybrid_models_refuse_packed_rows_and_sharding_but_run_one_document_per_row():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3NextConfig(**{**SHAPE, "head_dim": 8}, layer_types=["linear_attention", "full_attention"],
                          linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                          linear_value_head_dim=8, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
                          shared_expert_intermediate_size=16, attn_implementation="longctx_zigzag")
    model = Qwen3NextForCausalLM(cfg)  # float32: its grouped-GEMM experts take no float64
    ids, pos = packed(4, [5, 7])
    with pytest.raises(ValueError, match="packs several documents in a row.*'linear_attention' layers"):
        model(input_ids=ids, position_ids=pos, use_cache=False)
    with torch.no_grad():
        out = model(input_ids=ids[:, :5]).logits  # one document per row runs
        model.set_attn_implementation("sdpa")
        torch.testing.assert_close(out, model(input_ids=ids[:, :5]).logits, rtol=1e-5, atol=1e-5)
    model.set_attn_implementation("longctx_zigzag")
    # in ONE process too: the callback's hook flattens the batch into one packed sequence, which these layers
    # cannot take, and the error says so and how to train the model instead
    with pytest.raises(ValueError, match=r"Qwen3NextForCausalLM cannot train with LongContextCallback: the callback "
                       r"flattens every batch into one packed sequence \(in one process too.*'linear_attention' layers"
                       r".*Train it without LongContextCallback, one document per row, with "
                       r"attn_implementation='sdpa'"):
        install_input_hook(model, None)


def test_lora_through_get_peft_model_shards_like_the_plain_model():
    """A PEFT wrapper is looked through: the LoRA model trains under the hook as the plain one does."""
    peft = pytest.importorskip("peft")
    ids, pos = packed(5, LENS)
    model = build("llama")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                                      init_lora_weights=False))
    lora.base_model.model.loss_function = causal_lm_loss_fp64
    ref = per_document_reference(lora, ids, pos, LENS)
    got = sharded_loss_and_grads(lora, "longctx_zigzag", 0, 1, [{"input_ids": ids, "position_ids": pos,
                                                                 "labels": ids}])
    assert_same(*got, *ref, "LoRA")
