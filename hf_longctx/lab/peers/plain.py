"""Plain transformers: ``Trainer`` with its own long-context switches and nothing else.

As transformers' documentation sets them (``TrainingArguments``, transformers 5.17): ``attn_implementation``
``flash_attention_2`` where installed, else ``sdpa`` (:func:`~.common.choose_attention`);
``gradient_checkpointing=True`` (every decoder layer); ``use_liger_kernel=True`` on a GPU with Liger-Kernel (its
RMSNorm, RoPE, SwiGLU and fused linear cross-entropy); ``bf16=True``; the default optimizer (``adamw_torch_fused``
on a GPU). The model is built in bf16 on the device, as every system's, and the process runs as ``python train.py``
would: no process group, so the Trainer wraps nothing in DDP.
"""

from __future__ import annotations

import tempfile

import torch

from .common import OneBatch, choose_attention, liger_available, stack_rows, step_callback, trainer_arguments
from .workload import Workload, build_model, packed_batch


class PlainTrainerRun:
    name = "transformers"
    process_group = False  # as `python train.py`: no group, no DDP

    def __init__(self, work: Workload, device: torch.device) -> None:
        from transformers import Trainer, TrainingArguments

        attention, masked = choose_attention(work.sdpa_mask)
        liger = liger_available(device)
        self.model = build_model(work, attention, device)
        self.batch = packed_batch(work, self.model.config.vocab_size)
        self.work, self.device = work, device
        self.output_dir = tempfile.mkdtemp(prefix="bench_peers_trainer_")
        self.args = trainer_arguments(TrainingArguments, self.output_dir, work.warmup + work.steps, work.lr, device,
                                      gradient_checkpointing=True, use_liger_kernel=liger)
        self.trainer_cls = Trainer
        self.settings = {"attention": attention, "document_masking": masked, "gradient_checkpointing": "every layer",
                         "liger": liger, "optimizer": self.args.optim.value if hasattr(self.args.optim, "value")
                         else str(self.args.optim), "precision": "bf16 weights, bf16 autocast"
                         if device.type == "cuda" else "fp32 (CPU)"}

    def train(self, steps: int, clock) -> None:
        trainer = self.trainer_cls(model=self.model, args=self.args, train_dataset=OneBatch(self.batch, steps),
                                   data_collator=stack_rows, callbacks=[step_callback(clock)])
        trainer.train()
