"""A rotary embedding that sizes its frequencies by the batch's longest position (``longrope``, dynamic NTK) reads
the whole sequence's under sequence parallelism, as one process running the whole batch does.

The case: ``original_max_position_embeddings`` 16, two ranks, each bringing one row of 12 tokens; the second row's
positions run from 9 to 20, so the batch's longest position (20) is past 16 while rank 1's shard (zigzag: the first
half of the second row, positions 9-14) stays under it. transformers then switches longrope to its long factors
and rescales dynamic NTK's base for the whole batch; a rank reading its own shard would not. Proven in float64 at
1e-9 against transformers' SDPA on both rows as one batch (loss and every parameter gradient), through the input
hook and through ``shard_batch(..., model=)``, for Llama with each rope type and Phi-3 with longrope;
``shard_batch`` without the model is refused by name.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_transformers_parity import SHAPE, assert_same, causal_lm_loss_fp64, sharded_loss_and_grads
from transformers import LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM

from hf_longctx.hf import plan_for, shard_batch
from hf_longctx.hf.integration.dynamic_rope import batch_maximum_rope_modules
from hf_longctx.layout import PackedBatch

from distributed import run_distributed

ORIGINAL = 16
HEAD_DIM = SHAPE["hidden_size"] // SHAPE["num_attention_heads"]
ROPE = {
    "longrope": {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": ORIGINAL,
                 "factor": 4.0, "long_factor": [2.0 + i for i in range(HEAD_DIM // 2)],
                 "short_factor": [1.0] * (HEAD_DIM // 2)},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
}


def build(rope: str):
    """Llama with each rope type; ``phi3``: Phi-3 with longrope, as its long-context checkpoints ship it."""
    torch.manual_seed(0)
    if rope == "phi3":
        model = Phi3ForCausalLM(Phi3Config(**{**SHAPE, "max_position_embeddings": 4 * ORIGINAL},
                                           original_max_position_embeddings=ORIGINAL, rope_parameters=ROPE["longrope"],
                                           resid_pdrop=0.0, embd_pdrop=0.0))
    else:
        config = LlamaConfig(**{**SHAPE, "max_position_embeddings": ORIGINAL})
        config.rope_parameters = ROPE[rope]
        model = LlamaForCausalLM(config)
    model.loss_function = causal_lm_loss_fp64
    return model.double().train()


def rows() -> list[dict]:
    g = torch.Generator().manual_seed(3)
    out = []
    for positions in (torch.arange(12), torch.arange(9, 21)):
        ids = torch.randint(3, SHAPE["vocab_size"], (1, 12), generator=g)
        out.append({"input_ids": ids, "position_ids": positions[None], "labels": ids})
    return out


def reference(rope: str):
    """SDPA on both rows as one (2, 12) batch, on a fresh model (dynamic NTK keeps state between forwards)."""
    model = build(rope)
    model.set_attn_implementation("sdpa")
    batch = {k: torch.cat([r[k] for r in rows()]) for k in rows()[0]}
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    return loss.item(), {k: p.grad.clone() for k, p in model.named_parameters()}


def through_shard_batch(model, rank: int, world: int):
    group = dist.group.WORLD if world > 1 else None
    both = rows()
    ids = torch.cat([r["input_ids"] for r in both], dim=1)
    positions = torch.cat([r["position_ids"] for r in both], dim=1)
    plan = plan_for(PackedBatch.from_doc_lens([12, 12]), "zigzag", group)
    model.set_attn_implementation("longctx_zigzag")
    local = shard_batch({"input_ids": ids, "position_ids": positions}, plan, rank, group, model=model)
    loss = model(**local).loss
    loss.backward()
    total, grads = loss.detach().clone(), {k: p.grad.clone() for k, p in model.named_parameters()}
    if world > 1:
        for t in (total, *grads.values()):
            dist.all_reduce(t)
    return total.item(), grads


def check(rank: int, world: int):
    for rope in (*ROPE, "phi3"):
        ref = reference(rope)
        got = sharded_loss_and_grads(build(rope), "longctx_zigzag", rank, world, rows() if world > 1 else
                                     [{k: torch.cat([r[k] for r in rows()]) for k in rows()[0]}])
        assert_same(*got, *ref, f"{rope} through the input hook over {world} processes")
        assert_same(*through_shard_batch(build(rope), rank, world), *ref,
                    f"{rope} through shard_batch(model=) over {world} processes")
    if world > 1:  # without the model, shard_batch cannot make the rotary embedding read the whole sequence
        model = build("longrope")
        group = dist.group.WORLD
        plan = plan_for(PackedBatch.from_doc_lens([12, 12]), "zigzag", group)
        model.set_attn_implementation("longctx_zigzag")
        both = rows()
        local = shard_batch({"input_ids": torch.cat([r["input_ids"] for r in both], dim=1),
                             "position_ids": torch.cat([r["position_ids"] for r in both], dim=1)}, plan, rank, group)
        with pytest.raises(ValueError, match=r"rope_type 'longrope'\) sizes its frequencies by the batch's longest "
                                             r"position.*pass model=<the model> to hf_longctx.hf.shard_batch"):
            model(**local)


@pytest.mark.parametrize("world", [1, 2])
def test_rope_sized_by_the_longest_position_reads_the_whole_sequences(world):
    if world == 1:
        check(0, 1)
    else:
        run_distributed(world, check, timeout_s=300)


def test_the_case_needs_the_whole_sequence():
    """Rank 1's shard alone would pick longrope's short factors: the case above can fail."""
    model = build("longrope")
    rope = model.model.rotary_emb
    shard = torch.arange(9, 15)[None]
    whole = torch.cat([shard, torch.tensor([[20]])], dim=1)
    x = torch.zeros(1, 1, dtype=torch.float64)
    cos_shard, _ = rope(x, shard)
    cos_whole, _ = rope(x, whole)
    assert not torch.allclose(cos_shard[0], cos_whole[0, :-1])


def test_only_rotary_embeddings_sized_by_the_batch_get_hooks():
    assert [type(m).__name__ for m in batch_maximum_rope_modules(build("longrope"))] == ["LlamaRotaryEmbedding"]
    torch.manual_seed(0)
    assert batch_maximum_rope_modules(LlamaForCausalLM(LlamaConfig(**SHAPE))) == []
