"""``shard_batch`` + ``model(**local)`` refuses what the callback's input hook refuses, before any collective:

1. a hybrid model (Bamba: Mamba layers) and a model whose forward takes no ``position_ids`` (BART) are refused by
   name at the first attention call of their sharded forward, through ``model(**local)``, ``model.forward`` and a
   DDP wrapper, in one process and in two gloo processes: every rank raises, no collective ran before, and the
   group is still usable afterwards (no rank was left in a collective); ``shard_batch(..., model=)`` refuses them
   (and a model loaded with ``sdpa``) before sharding anything;
2. the model is found once per sharded forward and checked once per model and attention implementation: later
   attention calls, a checkpointed layer's recompute in backward and later forwards read the verdict.

Llama and StableLM stay exact through ``shard_batch`` (tests/test_context.py, tests/test_hf.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from transformers import BambaConfig, BambaForCausalLM, BartConfig, BartForCausalLM, LlamaConfig, LlamaForCausalLM

import hf_longctx  # noqa: F401 - registers the longctx_* implementations
from hf_longctx.hf import enable_layer_checkpointing, plan_for, shard_batch
from hf_longctx.hf.integration import sharded_model
from hf_longctx.layout import PackedBatch

from distributed import run_distributed

VOCAB, LENS = 61, [5, 7, 4]
IMPL = "longctx_zigzag"
# point-to-point transfers go through batch_isend_irecv (dist.P2POp takes only dist.isend / dist.irecv themselves)
COLLECTIVES = ("all_gather", "all_reduce", "all_to_all_single", "batch_isend_irecv", "broadcast", "send", "recv",
               "all_gather_into_tensor", "reduce_scatter_tensor")


def bamba(impl: str = IMPL) -> BambaForCausalLM:
    torch.manual_seed(0)
    return BambaForCausalLM(BambaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, attn_layer_indices=[1],
                                        mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=1,
                                        mamba_chunk_size=8, attn_implementation=impl)).double()


def bart(impl: str = IMPL) -> BartForCausalLM:
    torch.manual_seed(0)
    return BartForCausalLM(BartConfig(vocab_size=VOCAB, d_model=16, decoder_layers=2, encoder_layers=1,
                                      decoder_attention_heads=2, encoder_attention_heads=2, decoder_ffn_dim=16,
                                      encoder_ffn_dim=16, max_position_embeddings=64,
                                      attn_implementation=impl)).double()


def llama(impl: str = IMPL) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1,
                                        attn_implementation=impl)).double()


REFUSED = {
    "BambaForCausalLM": (bamba, r"BambaForCausalLM cannot run a sharded forward \(hf_longctx\.hf\.shard_batch.*"
                                r"cannot train with LongContextCallback.*layers: sequence mixers outside"),
    "BartForCausalLM": (bart, r"BartForCausalLM cannot run a sharded forward \(hf_longctx\.hf\.shard_batch.*"
                              r"BartForCausalLM\.forward takes no position_ids"),
}


def batch():
    ids = torch.randint(3, VOCAB, (1, sum(LENS)), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "position_ids": torch.cat([torch.arange(n) for n in LENS])[None]}


class CollectiveCount:
    """Counts the collectives of torch.distributed called while it is on (the backends call them by attribute)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.calls = 0
        for name in COLLECTIVES:
            original = getattr(dist, name)

            def counted(*args, original=original, **kwargs):
                self.calls += 1
                return original(*args, **kwargs)

            monkeypatch.setattr(dist, name, counted)


def check_refusals(rank: int, world: int, monkeypatch: pytest.MonkeyPatch | None = None):
    patch = monkeypatch or pytest.MonkeyPatch()
    group = dist.group.WORLD if world > 1 else None
    plan = plan_for(PackedBatch.from_doc_lens(LENS), "zigzag", group)
    try:
        for build, pattern in REFUSED.values():
            model = build()
            wrapped = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else None  # broadcasts weights
            count = CollectiveCount(patch)
            for call in (model, model.forward, wrapped):
                if call is None:
                    continue
                local = shard_batch(batch(), plan, rank, group)
                with pytest.raises(ValueError, match=pattern):
                    call(**local)
            assert count.calls == 0, f"{type(model).__name__}: {count.calls} collectives ran before the refusal"
            patch.undo()
            with pytest.raises(ValueError, match=pattern):  # named to shard_batch: refused before sharding
                shard_batch(batch(), plan, rank, group, model=model)
        # the hook's refusal of a model whose attention never calls longctx_*: shard_batch(model=) names it
        model = llama("sdpa")
        with pytest.raises(ValueError, match=r"LlamaForCausalLM cannot run a sharded forward.*"
                                             r"attn_implementation='sdpa'; load it with attn_implementation="):
            shard_batch(batch(), plan, rank, group, model=model)
        model.set_attn_implementation(IMPL)  # asked again for the implementation it runs now
        count = CollectiveCount(patch)
        loss = model(**shard_batch(batch(), plan, rank, group, model=model)).loss
        assert torch.isfinite(loss)
        assert (count.calls > 0) == (world > 1)  # the counter sees the backend's collectives
        patch.undo()
        if world > 1:  # every rank raised at the same call: the group is as usable as before
            done = torch.ones(1)
            dist.all_reduce(done, group=group)
            assert done.item() == world
    finally:
        patch.undo()


def test_hybrid_and_positionless_models_are_refused_through_shard_batch_in_one_process(monkeypatch):
    check_refusals(0, 1, monkeypatch)


def test_every_rank_refuses_them_over_two_processes_without_waiting():
    run_distributed(2, check_refusals, timeout_s=20)


def test_the_model_is_found_once_per_forward_and_checked_once_per_model(monkeypatch):
    walks, checks = [], []
    real_calls_under, real_check_model = sharded_model.calls_under, sharded_model.check_model
    monkeypatch.setattr(sharded_model, "calls_under", lambda ctx: walks.append(ctx) or real_calls_under(ctx))
    monkeypatch.setattr(sharded_model, "check_model", lambda model: checks.append(model) or real_check_model(model))
    model = llama()
    enable_layer_checkpointing(model)  # the layers' attention runs again in backward, under the same context
    plan = plan_for(PackedBatch.from_doc_lens(LENS), "zigzag", None)
    contexts = []
    for _ in range(2):
        local = shard_batch(batch(), plan, 0)
        contexts.append(local["longctx"])
        model(**local).loss.backward()
    assert walks == contexts  # one walk per forward, though 2 layers x (forward + recompute) called attention
    assert checks == [model]
    bart_model = bart()
    for _ in range(2):
        with pytest.raises(ValueError, match=REFUSED["BartForCausalLM"][1]):
            bart_model(**shard_batch(batch(), plan, 0))
    assert checks == [model, bart_model]  # a refusal is remembered too
