"""Short Trainer and TRL runs of a tiny random Llama, the same in one process and on a gloo world.

Each function trains a few steps and returns what a user would compare: the logged losses and
gradient norms, and (Trainer) what ``compute_metrics`` received. The data is fixed and read in order
(``train_sampling_strategy="sequential"``), so ``world`` processes with ``per_device`` rows each read
the same rows per step as one process with ``world * per_device`` rows: equal results are the test.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM

import hf_longctx
from hf_longctx.hf.memory.checkpointing import checkpointing_training_args

VOCAB = 61


def tiny_llama(impl: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
                      attn_implementation=impl, pad_token_id=0, eos_token_id=2, bos_token_id=1)
    return LlamaForCausalLM(cfg).to(dtype)


def token_rows(count: int, seed: int, low: int = 5, high: int = 40, fixed: int | None = None) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    lens = [fixed] * count if fixed else torch.randint(low, high, (count,), generator=g).tolist()
    return Dataset.from_list([{"input_ids": torch.randint(3, VOCAB, (n,), generator=g).tolist()} for n in lens])


def join_world() -> int:
    """Process count; inside a gloo world also the environment accelerate reads to join it."""
    if not dist.is_initialized():
        return 1
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29500"))
    return world


def _history(trainer) -> dict:
    logs = trainer.state.log_history
    return {"losses": [e["loss"] for e in logs if "loss" in e],
            "grad_norms": [e["grad_norm"] for e in logs if "grad_norm" in e],
            "eval_loss": [e["eval_loss"] for e in logs if "eval_loss" in e]}


def shifted_sum_loss(outputs, labels, num_items_in_batch=None):
    """A user's ``compute_loss_func``: next-token cross-entropy of each row, summed, over Trainer's count."""
    logits = outputs.logits[..., :-1, :].float()
    targets = labels[..., 1:].to(logits.device)
    total = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                              ignore_index=-100, reduction="sum")
    return total / (num_items_in_batch if num_items_in_batch is not None else (targets != -100).sum())


class PaddingCollator:
    """Rows padded to the longest of the batch (token 0, attention_mask 0, label -100), on one side."""

    def __init__(self, side: str = "right"):
        self.side = side

    def __call__(self, rows):
        longest = max(len(r["input_ids"]) for r in rows)
        ids, mask, labels = [], [], []
        for r in rows:
            row, pad = list(r["input_ids"]), longest - len(r["input_ids"])
            parts = [(row, 1, row), ([0] * pad, 0, [-100] * pad)]
            if self.side == "left":
                parts.reverse()
            ids.append(parts[0][0] + parts[1][0])
            mask.append([parts[0][1]] * len(parts[0][0]) + [parts[1][1]] * len(parts[1][0]))
            labels.append(parts[0][2] + parts[1][2])
        return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask), "labels": torch.tensor(labels)}


def flattening_run(output_dir: str, rows_per_step: int = 4, steps: int = 3, bf16: bool = False,
                   impl: str = "longctx_zigzag", callback: bool = True, evaluate: bool = True,
                   gradient_checkpointing: bool = False, config=None, collator=None, compute_loss_func=None,
                   resume_from_checkpoint: str | None = None, extra_callbacks=(), **training_args) -> dict:
    """transformers Trainer + DataCollatorWithFlattening, no recipe: the model's backend, the whole world SP.

    ``collator`` replaces the flattening collator, ``compute_loss_func`` goes to the Trainer,
    ``resume_from_checkpoint`` to ``train()``, ``extra_callbacks`` to the Trainer after the LongContextCallback,
    and any other keyword to ``TrainingArguments``.
    """
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    world = join_world()
    per_device = rows_per_step // world
    predictions: list = []

    def compute_metrics(pred):
        """Keep the logits at every position with a label, row by row, as one process would see them."""
        logits, labels = pred.predictions, pred.label_ids
        for row_logits, row_labels in zip(logits, labels):
            keep = row_labels != -100
            predictions.append(np.asarray(row_logits[keep], dtype=np.float64).tolist())
        return {"rows": float(len(labels))}

    args = TrainingArguments(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=per_device,
        per_device_eval_batch_size=per_device, learning_rate=1e-2, logging_steps=1, report_to=[], use_cpu=True,
        bf16=bf16, save_strategy=training_args.pop("save_strategy", "no"), train_sampling_strategy="sequential",
        disable_tqdm=True, seed=0,
        eval_strategy="steps" if evaluate else "no", eval_steps=steps, dataloader_drop_last=True,
        **checkpointing_training_args(gradient_checkpointing), **training_args,
    )
    model = tiny_llama(impl)
    cb = hf_longctx.LongContextCallback(config)
    trainer = Trainer(model=model, args=args, train_dataset=token_rows(rows_per_step * steps, seed=1),
                      eval_dataset=token_rows(rows_per_step, seed=2, fixed=16) if evaluate else None,
                      data_collator=collator or DataCollatorWithFlattening(), compute_metrics=compute_metrics,
                      compute_loss_func=compute_loss_func,
                      callbacks=([cb] if callback else []) + list(extra_callbacks))
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    return {**_history(trainer), "predictions": predictions, "model": model, "summary": cb.summary,
            "trainer": trainer}


def trl_run(output_dir: str, rows_per_step: int = 2, steps: int = 3, bf16: bool = False,
            impl: str = "longctx_zigzag") -> dict:
    """TRL SFTTrainer with packing and padding_free on the shipped sample corpus and tokenizer."""
    from trl import SFTConfig, SFTTrainer

    from hf_longctx.data import load_sample_tokenizer, load_text_dataset, sample_corpus_path

    world = join_world()
    tokenizer = load_sample_tokenizer()
    texts = load_text_dataset(str(sample_corpus_path())).select(range(40))
    args = SFTConfig(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=rows_per_step // world,
        learning_rate=1e-2, logging_steps=1, report_to=[], use_cpu=True, bf16=bf16, save_strategy="no",
        train_sampling_strategy="sequential", disable_tqdm=True, seed=0, packing=True, padding_free=True,
        max_length=96, dataloader_drop_last=True, **checkpointing_training_args(False),
    )
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
                      attn_implementation=impl, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    trainer = SFTTrainer(model=model, args=args, train_dataset=texts, processing_class=tokenizer,
                         callbacks=[hf_longctx.LongContextCallback()] if impl.startswith("longctx_") else [])
    trainer.train()
    return _history(trainer)


def causal_lm_loss_fp64(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
                        **kwargs):
    """transformers' causal-LM loss without its cast to float32, so float64 runs compare at 1e-9."""
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.reshape(-1).to(logits.device)
    total = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab_size), targets, ignore_index=ignore_index,
                                              reduction="sum")
    count = num_items_in_batch if num_items_in_batch is not None else (shift_labels != ignore_index).sum()
    return total / count


def summed_loss_and_grads(loss: torch.Tensor, model, world: int) -> tuple[float, dict]:
    """This rank's loss and parameter gradients, summed over the world (the shares of one sharded batch)."""
    total = loss.detach().clone()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}
    if world > 1:
        dist.all_reduce(total)
        for g in grads.values():
            dist.all_reduce(g)
    return total.item(), grads
