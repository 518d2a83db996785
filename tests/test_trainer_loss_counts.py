"""A model the Trainer passes no ``num_items_in_batch`` to trains on the same loss sharded as in one process.

Several causal LMs set ``accepts_loss_kwargs = False``: the Trainer then hands them no target count,
scales their loss by nothing (but the accumulation steps), and DDP averages the gradients over the
processes. Each rank's loss must then be its group's loss sum over the group's count / group size, or
the step trains on the group's mean divided by the group size. A float64 Llama whose class says so,
through a real Trainer with ``LongContextCallback`` on two gloo processes (one sequence-parallel
group), must give the losses and every parameter gradient of one process on the same documents with
transformers' sdpa (1e-9), with and without gradient accumulation. The input hook installed by hand
keeps its contract: without a count the shares of a group add up to its mean.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_transformers_parity import causal_lm_loss_fp64
from transformers import (
    DataCollatorWithFlattening,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import hf_longctx
from hf_longctx.hf.integration.callback import trainer_averages_processes, trainer_passes_counts
from hf_longctx.hf.integration.inputs import install_input_hook

from distributed import run_distributed
from trainer_runs import VOCAB, join_world, token_rows

ROWS_PER_STEP = 4
STEPS = 2


class LlamaWithoutLossKwargs(LlamaForCausalLM):
    """A causal LM the Trainer passes no target count to, as it does to Gemma4ForConditionalGeneration."""

    accepts_loss_kwargs = False


def tiny_model(impl: str) -> LlamaWithoutLossKwargs:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
                      attn_implementation=impl, pad_token_id=0, eos_token_id=2, bos_token_id=1)
    model = LlamaWithoutLossKwargs(cfg).to(torch.float64)
    model.loss_function = causal_lm_loss_fp64
    return model


class FirstStepGradients(TrainerCallback):
    """The gradients the optimizer gets at the first step (after DDP's average and every micro-batch)."""

    def __init__(self):
        self.grads: dict[str, list] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if state.global_step == 0:
            self.grads = {n: p.grad.reshape(-1).tolist() for n, p in model.named_parameters()}


def trainer_run(output_dir: str, impl: str, gradient_accumulation_steps: int) -> dict:
    world = join_world()
    args = TrainingArguments(
        output_dir=output_dir, max_steps=STEPS, learning_rate=1e-2, logging_steps=1, report_to=[], use_cpu=True,
        per_device_train_batch_size=ROWS_PER_STEP // world // gradient_accumulation_steps,
        gradient_accumulation_steps=gradient_accumulation_steps, max_grad_norm=0.0, save_strategy="no",
        train_sampling_strategy="sequential", disable_tqdm=True, seed=0, dataloader_drop_last=True)
    model = tiny_model(impl)
    grads = FirstStepGradients()
    callbacks = [grads] + ([hf_longctx.LongContextCallback()] if impl.startswith("longctx_") else [])
    trainer = Trainer(model=model, args=args, train_dataset=token_rows(ROWS_PER_STEP * STEPS, seed=1),
                      data_collator=DataCollatorWithFlattening(), callbacks=callbacks)
    assert not trainer.model_accepts_loss_kwargs  # the case under test: the Trainer passes no count
    trainer.train()
    return {"losses": [e["loss"] for e in trainer.state.log_history if "loss" in e], "grads": grads.grads}


def hand_hook_loss(impl: str) -> float:
    """The loss summed over the group's processes with the hook installed by hand, no count passed."""
    model = tiny_model(impl)
    rows = token_rows(ROWS_PER_STEP, seed=3)
    world = join_world()
    rank = dist.get_rank() if world > 1 else 0
    mine = [rows[i] for i in range(rank, ROWS_PER_STEP, world)]
    batch = DataCollatorWithFlattening(return_tensors="pt")(mine)
    if world > 1:
        install_input_hook(model, None)
    # use_cache=False: with a cache transformers' sdpa does not look for the packed documents in position_ids
    loss = model(**batch, use_cache=False).loss.detach()
    if world > 1:
        dist.all_reduce(loss)
    return float(loss)


def _two_processes(rank, world, out_dir):
    runs = {f"ga{ga}": trainer_run(os.path.join(out_dir, f"ga{ga}-{rank}"), "longctx_zigzag", ga) for ga in (1, 2)}
    runs["hand_hook"] = hand_hook_loss("longctx_zigzag")
    if rank == 0:
        Path(out_dir, "two.json").write_text(json.dumps(runs))


def test_trainer_rule_for_passing_counts():
    """The callback reads the Trainer's rule: the attribute where there is one, else ``**kwargs``."""
    assert trainer_passes_counts(LlamaForCausalLM(LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8,
                                                              num_hidden_layers=1, num_attention_heads=2)))
    assert not trainer_passes_counts(tiny_model("sdpa"))
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(tiny_model("sdpa"), LoraConfig(target_modules=["q_proj"]))
    assert not trainer_passes_counts(lora)  # judged by the base model, as the Trainer judges it
    args = TrainingArguments(output_dir="unused", report_to=[], use_cpu=True)
    assert trainer_averages_processes(tiny_model("sdpa"), args)


def test_model_without_loss_kwargs_trains_on_the_one_process_loss_and_gradients(tmp_path):
    one = {f"ga{ga}": trainer_run(str(tmp_path / f"one-ga{ga}"), "sdpa", ga) for ga in (1, 2)}
    one["hand_hook"] = hand_hook_loss("sdpa")
    run_distributed(2, _two_processes, str(tmp_path), timeout_s=300)
    two = json.loads((tmp_path / "two.json").read_text())
    for name in ("ga1", "ga2"):
        assert len(two[name]["losses"]) == STEPS, name
        # the Trainer sums the logged loss in float32; the gradients below are the float64 comparison
        assert two[name]["losses"] == pytest.approx(one[name]["losses"], rel=1e-6), name
        assert two[name]["grads"].keys() == one[name]["grads"].keys()
        for param, grad in one[name]["grads"].items():
            assert two[name]["grads"][param] == pytest.approx(grad, rel=1e-9, abs=1e-12), (name, param)
    assert two["hand_hook"] == pytest.approx(one["hand_hook"], rel=1e-9)
