"""The config-driven MoE path: ``apply_model_parallelism`` + Trainer + callback equals one process.

A tiny Qwen3-MoE with ``longctx_zigzag`` trains three clipped steps at DP2 x SP2 x EP2 (4 gloo
processes, experts over the two ranks of each sequence, their gradients averaged over the DP
replicas by the hook, the batch-exact aux loss on), at DP2 x SP2 without EP, and in one process
with transformers' own aux loss; logged losses and gradient norms must agree. The data are read in
order, so 4 processes with 1 row each read the rows one process reads 4 at a time.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import DataCollatorWithFlattening, Qwen3MoeConfig, Qwen3MoeForCausalLM, Trainer, TrainingArguments

import hf_longctx
from hf_longctx.hf import LongContextConfig, apply_model_parallelism, model_parallelism
from hf_longctx.moe import ExpertParallelExperts

from distributed import run_distributed
from trainer_runs import VOCAB, join_world, token_rows

ROWS_PER_STEP, STEPS = 4, 3


def tiny_moe() -> Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                         num_experts_per_tok=2, router_aux_loss_coef=0.5, output_router_logits=True,
                         initializer_range=0.2, max_position_embeddings=512, attn_implementation="longctx_zigzag",
                         experts_implementation="eager", pad_token_id=0, eos_token_id=2, bos_token_id=1)
    return Qwen3MoeForCausalLM(cfg)


def moe_run(output_dir: str, config: LongContextConfig) -> dict:
    world = join_world()
    model = tiny_moe()
    done = apply_model_parallelism(model, config)  # what scripts/train.py does right after building the model
    args = TrainingArguments(
        output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=ROWS_PER_STEP // world,
        learning_rate=2e-2, max_grad_norm=0.5, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
        train_sampling_strategy="sequential", disable_tqdm=True, seed=0, dataloader_drop_last=True,
        ddp_find_unused_parameters=False,
    )
    trainer = Trainer(model=model, args=args, train_dataset=token_rows(ROWS_PER_STEP * STEPS, seed=1),
                      data_collator=DataCollatorWithFlattening(),
                      callbacks=[hf_longctx.LongContextCallback(config)])
    trainer.train()
    logs = trainer.state.log_history
    return {"losses": [e["loss"] for e in logs if "loss" in e],
            "grad_norms": [e["grad_norm"] for e in logs if "grad_norm" in e],
            "syncs": done.grad_sync.syncs if done and done.grad_sync else 0, "max_grad_norm": args.max_grad_norm,
            "sharded": sum(isinstance(m, ExpertParallelExperts) for m in model.modules())}


def _four_process_runs(rank, world, out_dir):
    ep = moe_run(f"{out_dir}/ep{rank}", LongContextConfig(backend="zigzag", sp_size=2, ep_size=2))
    no_ep = moe_run(f"{out_dir}/dp{rank}", LongContextConfig(backend="zigzag", sp_size=2))
    if rank == 0:
        Path(out_dir, "four.json").write_text(json.dumps({"ep": ep, "no_ep": no_ep}))


def test_trainer_sp2_ep2_from_the_config_equals_one_process(tmp_path):
    one = moe_run(str(tmp_path / "one"), LongContextConfig(backend="zigzag"))
    assert one["sharded"] == 0 and one["syncs"] == 0
    run_distributed(4, _four_process_runs, str(tmp_path), timeout_s=400)
    runs = json.loads((tmp_path / "four.json").read_text())
    four, no_ep = runs["ep"], runs["no_ep"]
    assert four["sharded"] == 2 and four["syncs"] == STEPS  # both MoE blocks sharded; one reduction per step
    assert four["max_grad_norm"] == 0.5  # handed back to the Trainer's arguments at the end
    assert len(four["losses"]) == STEPS
    assert max(one["grad_norms"]) > 0.5  # clipping was active, so its factor matters
    assert four["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert four["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-4)
    # DP2 x SP2 without expert parallelism: still the batch's aux loss, not the sum of four ranks' own
    assert no_ep["sharded"] == 0
    assert no_ep["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert no_ep["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-4)


def test_model_parallelism_is_refused_where_it_cannot_run():
    assert apply_model_parallelism(tiny_moe(), LongContextConfig()) is None  # nothing asked: nothing done
    with pytest.raises(RuntimeError, match="several processes"):
        apply_model_parallelism(tiny_moe(), LongContextConfig(ep_size=2))
    with pytest.raises(ValueError, match="expert_tp_size 2 needs moe_dispatch 'allgather'"):
        LongContextConfig(expert_tp_size=2, moe_dispatch="all_to_all")
    with pytest.raises(ValueError, match="expert_tp_size 3 does not divide the experts' intermediate size 16"):
        LongContextConfig(expert_tp_size=3).resolved_sizes(3, tiny_moe().config)
    with pytest.raises(ValueError, match="ep_size x expert_tp_size = 2 x 2 must divide the 2 ranks"):
        LongContextConfig(ep_size=2, expert_tp_size=2).resolved_sizes(2)
    from hf_longctx.hf.integration.callback import check_moe_layout

    with pytest.raises(ValueError, match="tp_size: 1 for Trainer runs"):
        check_moe_layout(tiny_moe(), LongContextConfig(tp_size=2), world=2)
    assert model_parallelism(tiny_moe()) is None
