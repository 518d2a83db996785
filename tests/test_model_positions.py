"""Models that number their tokens themselves get, sharded, the positions they compute on the whole row.

Without ``position_ids`` OPT numbers tokens from the attention mask and RoBERTa (and its kin) from the
ids; the input hook computes those positions per row before sharding (:mod:`hf_longctx.hf.integration.positions`).
Proven in float64 at 1e-9 against transformers' own SDPA on the same inputs (loss and every parameter
gradient), in one process and over two gloo processes through ``install_input_hook`` as the callback
installs it: OPT with left and right padding; RoBERTa (and XLM-RoBERTa) as decoders with plain
fixed-length rows (what block grouping makes), left and right padding; Llama (0, 1, 2, ...) unchanged.
Two processes are compared with one process running both ranks' rows as one (2B, S) batch.
``shard_batch(..., model=)`` numbers each document as the model numbers a row of its own.

Each rule is also checked against the model itself (transformers' forward without positions equals the
forward with the rule's positions), and every causal LM of the installed transformers whose code
derives positions from the mask or the ids is named below with what happens to it.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers
from test_transformers_parity import SHAPE, assert_same, causal_lm_loss_fp64, sharded_loss_and_grads
from transformers.models.auto.configuration_auto import model_type_to_module_name
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import hf_longctx  # noqa: F401 - registers the longctx_* implementations
from hf_longctx.hf import plan_for, shard_batch
from hf_longctx.hf.integration.inputs import install_input_hook
from hf_longctx.hf.integration.positions import ARANGE, FROM_IDS, FROM_MASK, position_rule
from hf_longctx.layout import PackedBatch

from distributed import run_distributed
from trainer_runs import PaddingCollator

VOCAB = 61
PAD = 0  # PaddingCollator pads with token 0: the pad id RoBERTa's rule looks for
BERT_LIKE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                 max_position_embeddings=64, pad_token_id=PAD, hidden_dropout_prob=0.0,
                 attention_probs_dropout_prob=0.0, is_decoder=True)

# name -> (config class, model class, config keywords, the rule transformers' model follows)
MODELS = {
    "opt": ("OPTConfig", "OPTForCausalLM", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, ffn_dim=48,
                                                 num_attention_heads=4, max_position_embeddings=64,
                                                 word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
                                                 layerdrop=0.0, pad_token_id=PAD), FROM_MASK),
    "roberta": ("RobertaConfig", "RobertaForCausalLM", BERT_LIKE, FROM_IDS),
    "xlm-roberta": ("XLMRobertaConfig", "XLMRobertaForCausalLM", BERT_LIKE, FROM_IDS),
    "xlm-roberta-xl": ("XLMRobertaXLConfig", "XLMRobertaXLForCausalLM", BERT_LIKE, FROM_IDS),
    "camembert": ("CamembertConfig", "CamembertForCausalLM", BERT_LIKE, FROM_IDS),
    "data2vec-text": ("Data2VecTextConfig", "Data2VecTextForCausalLM", BERT_LIKE, FROM_IDS),
    "roberta-prelayernorm": ("RobertaPreLayerNormConfig", "RobertaPreLayerNormForCausalLM", BERT_LIKE, FROM_IDS),
    "xmod": ("XmodConfig", "XmodForCausalLM", {**BERT_LIKE, "languages": ["en_XX"], "default_language": "en_XX"},
             FROM_IDS),
    "biogpt": ("BioGptConfig", "BioGptForCausalLM", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                          num_attention_heads=4, intermediate_size=48,
                                                          max_position_embeddings=64, pad_token_id=PAD,
                                                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                                          layerdrop=0.0), ARANGE),
    "xglm": ("XGLMConfig", "XGLMForCausalLM", dict(vocab_size=VOCAB, d_model=32, ffn_dim=48, num_layers=2,
                                                    attention_heads=4, max_position_embeddings=64, pad_token_id=PAD,
                                                    dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                                                    layerdrop=0.0), ARANGE),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {**SHAPE, "vocab_size": VOCAB, "pad_token_id": PAD}, ARANGE),
}

# Every causal LM whose modeling code derives positions from the mask or the ids, and what happens to it
# under sequence parallelism (the model types the source scan below must find, no more, no fewer).
DERIVES_POSITIONS = {
    "opt": "rule 'mask': positions from the attention mask, computed per row before sharding",
    **dict.fromkeys(["roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "data2vec-text",
                     "roberta-prelayernorm", "xmod"],
                    "rule 'ids': the embeddings' own create_position_ids_from_input_ids, per row before sharding"),
    "biogpt": "rule 'arange': its model passes 0, 1, 2, ... to the mask-reading positional embedding",
    "falcon": "refused by name with alibi=True (ALiBi bias from the mask); rule 'arange' otherwise",
    "cohere_compass_text": "rule 'arange': the mask-derived positions are its multimodal model's, not the text LM's",
    **dict.fromkeys(["qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen4_exp", "qwen4_exp_text"],
                    "refused: linear-attention or indexer layers (and mask positions only in the multimodal model)"),
    **dict.fromkeys(["bloom", "prophetnet", "trocr", "whisper"], "refused: its forward takes no position_ids"),
}
_DERIVING_CODE = ("create_position_ids_from_input_ids", "cumsum(attention_mask", "attention_mask.cumsum",
                  "attention_mask.long().cumsum", "cumsum(position_attention_mask")


def build(name: str, seed: int = 0):
    config_cls, model_cls, kwargs, _ = MODELS[name]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs))
    model.loss_function = causal_lm_loss_fp64
    return model.double().train()


def batch_of(layout: str, seed: int = 1, lens=(6, 9, 3, 7)) -> dict:
    """Four rows of 9 tokens: 'plain' (fixed length, no mask, as block grouping makes) or padded on one side."""
    g = torch.Generator().manual_seed(seed)
    if layout == "plain":
        ids = torch.randint(3, VOCAB, (len(lens), max(lens)), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}
    examples = [{"input_ids": torch.randint(3, VOCAB, (n,), generator=g).tolist()} for n in lens]
    return PaddingCollator(layout)(examples)


CASES = [("opt", "left"), ("opt", "right"), ("roberta", "plain"), ("roberta", "left"), ("roberta", "right"),
         ("xlm-roberta", "plain"), ("xlm-roberta", "left"), ("llama", "left")]


def sdpa_reference(model, batch: dict):
    """transformers' SDPA on the whole batch, positions its own, loss from its labels (padding -100)."""
    model.set_attn_implementation("sdpa")
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.item(), {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}


def packed_documents(seed: int = 2, lens=(5, 1, 8, 4, 6)):
    g = torch.Generator().manual_seed(seed)
    return PackedBatch.from_doc_lens(list(lens)), torch.randint(3, VOCAB, (1, sum(lens)), generator=g)


def per_document_reference(model, packed: PackedBatch, ids: torch.Tensor):
    """SDPA on each document as a row of its own, positions the model's own: mean next-token loss, gradients."""
    model.set_attn_implementation("sdpa")
    model.zero_grad()
    count, total = sum(n - 1 for n in packed.doc_lens), 0.0
    for start, n in zip(packed.doc_starts, packed.doc_lens):
        doc = ids[:, start : start + n]
        loss = model(input_ids=doc, labels=doc).loss * (n - 1) / count if n > 1 else None
        if loss is not None:
            loss.backward()
            total += loss.item()
    return total, {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}


def check_over_ranks(rank: int, world: int):
    group = dist.group.WORLD if world > 1 else None
    for name, layout in CASES:
        model, batch = build(name), batch_of(layout)
        ref = sdpa_reference(model, batch)
        per_rank = batch["input_ids"].shape[0] // world
        rows = [{k: v[r * per_rank : (r + 1) * per_rank] for k, v in batch.items()} for r in range(world)]
        got = sharded_loss_and_grads(model, "longctx_zigzag", rank, world, rows)
        assert_same(*got, *ref, f"{name}, {layout} rows, over {world} processes")
    # the lower-level path: shard_batch(..., model=) numbers each document by the model's rule
    packed, ids = packed_documents()
    for name in ("roberta", "opt"):
        model = build(name)
        ref = per_document_reference(model, packed, ids)
        model.set_attn_implementation("longctx_zigzag")
        model.zero_grad()
        local = shard_batch({"input_ids": ids}, plan_for(packed, "zigzag", group), rank, group, model=model)
        loss = model(**local).loss
        loss.backward()
        total = loss.detach().clone()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}
        if world > 1:
            for t in (total, *grads.values()):
                dist.all_reduce(t)
        assert_same(total.item(), grads, *ref, f"{name} through shard_batch over {world} processes")


@pytest.mark.parametrize("world", [1, 2])
def test_sharded_rows_get_the_positions_the_model_computes_on_the_whole_row(world):
    if world == 1:
        check_over_ranks(0, 1)
    else:
        run_distributed(world, check_over_ranks)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_each_rule_is_the_one_the_model_follows_without_position_ids(name):
    """The model's forward without positions equals its forward with the rule's positions (left padding with the
    pad id, so the mask and the ids both matter), and the rule found from the model is the expected one."""
    model = build(name).eval()
    if name == "xglm":  # its own attention clamps with float64's minimum cast to a float32 mask
        model = model.float()
    rule = position_rule(model)
    assert rule.kind == MODELS[name][3], name
    batch = batch_of("left")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    positions = rule.row_positions(ids, mask)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        own = model(input_ids=ids, attention_mask=mask).logits
        given = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        torch.testing.assert_close(given, own, rtol=0, atol=0, equal_nan=True, msg=name)
        if not rule.is_arange:  # the default rule would be wrong for it: the comparison can fail
            arange = torch.arange(ids.shape[1]).expand_as(ids)
            assert not torch.allclose(model(input_ids=ids, attention_mask=mask, position_ids=arange).logits, own,
                                      equal_nan=True), name


def test_every_causal_lm_that_derives_positions_itself_is_named():
    """A transformers release that adds such a model fails here until it gets a rule or a refusal."""
    found = set()
    for model_type, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        package = importlib.import_module(f"transformers.models.{model_type_to_module_name(model_type)}")
        module = getattr(package, "_class_to_module", {}).get(class_name)
        if module is None:  # a class of another model type (exaone -> LlamaForCausalLM): scanned there
            continue
        source = Path(importlib.util.find_spec(f"{package.__name__}.{module}").origin).read_text()
        if any(code in source for code in _DERIVING_CODE):
            found.add(model_type)
    assert found == set(DERIVES_POSITIONS)


def test_alibi_from_the_mask_and_shard_batch_without_positions_are_refused_by_name():
    torch.manual_seed(0)
    falcon = transformers.FalconForCausalLM(transformers.FalconConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True,
        attn_implementation="longctx_zigzag"))
    with pytest.raises(ValueError, match=r"FalconForCausalLM \(alibi=True\) derives its ALiBi position bias"):
        install_input_hook(falcon, None)
    packed, ids = packed_documents()
    with pytest.raises(ValueError, match="shard_batch got no position_ids: pass .* or model="):
        shard_batch({"input_ids": ids}, plan_for(packed, "zigzag", None), 0)
