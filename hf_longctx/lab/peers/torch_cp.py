"""accelerate / TRL context parallelism: TRL's ``SFTTrainer`` on FSDP2 with torch's context parallelism.

Configured as TRL's guide sets it ("Distributing Training", section "Ring Attention Implementation (FSDP2)", TRL
1.16, with its ``examples/accelerate_configs/context_parallel_2gpu.yaml``), its settings given to the Trainer
directly rather than through an accelerate YAML:

- ``parallelism_config=ParallelismConfig(cp_size=N, dp_shard_size=1)`` (accelerate's ``cp_backend="torch"``); at
  one GPU ``N = 1``, so torch's ring attention has nothing to exchange and the FSDP2 mesh is one rank;
- FSDP2 (``fsdp_config``: ``version: 2``, ``activation_checkpointing: true``, transformer-based wrap of every
  ``LlamaDecoderLayer``, ``reshard_after_forward: true``, ``state_dict_type: FULL_STATE_DICT``), ``bf16``
  mixed precision (accelerate then keeps the weights in float32, as FSDP2's mixed precision does);
- SDPA attention (the guide: "Flash Attention is currently not supported"; :func:`~.common.choose_attention`);
- ``use_liger_kernel=True`` (Liger's layer kernels; TRL 1.16 keeps its own fused LM head, so the loss is TRL's
  chunked negative log-likelihood, ``loss_type="nll"``, with or without Liger);
- ``activation_offloading=True`` (TRL's "Reducing memory usage": checkpointed activations wait in pinned host
  memory; on a GPU only: TRL's offloading needs an accelerator), ``gradient_checkpointing=False`` (FSDP's
  activation checkpointing instead, as the guide says);
- ``pad_to_multiple_of = 2 x cp_size``, ``per_device_train_batch_size=1``. The row arrives packed already
  (``skip_prepare_dataset``); TRL refuses packing with ``cp_size > 1``, where torch's ring drops the document mask.
"""

from __future__ import annotations

import tempfile

import torch

from .common import choose_attention, liger_available, row_dataset, stack_rows, step_callback, trainer_arguments
from .workload import Workload, build_model, packed_batch

CP_SIZE = 1  # one GPU


class TrlContextParallelRun:
    name = "trl_cp"
    process_group = True  # as scripts/bench_train.py, accelerate launch: a one-rank group

    def __init__(self, work: Workload, device: torch.device) -> None:
        from accelerate.parallelism_config import ParallelismConfig
        from trl import SFTConfig

        attention, masked = choose_attention(work.sdpa_mask)
        liger = liger_available(device)
        self.model = build_model(work, attention, device)
        self.batch = packed_batch(work, self.model.config.vocab_size)
        layer = type(self.model.model.layers[0]).__name__
        self.args = trainer_arguments(
            SFTConfig, tempfile.mkdtemp(prefix="bench_peers_trl_"), work.warmup + work.steps, work.lr, device,
            parallelism_config=ParallelismConfig(cp_size=CP_SIZE, dp_shard_size=1, dp_replicate_size=1, tp_size=1),
            fsdp="full_shard auto_wrap",
            fsdp_config={"version": 2, "activation_checkpointing": True, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                         "transformer_layer_cls_to_wrap": [layer], "reshard_after_forward": True,
                         "state_dict_type": "FULL_STATE_DICT"},
            use_liger_kernel=liger, activation_offloading=device.type == "cuda", gradient_checkpointing=False,
            pad_to_multiple_of=2 * CP_SIZE, max_length=None, dataset_kwargs={"skip_prepare_dataset": True})
        self.settings = {"attention": attention, "document_masking": masked, "cp_size": CP_SIZE,
                         "sharding": "FSDP2 (one rank)", "checkpointing": "FSDP activation checkpointing",
                         "activation_offloading": device.type == "cuda", "liger": liger,
                         "loss": "TRL chunked nll (fused LM head)", "optimizer": str(getattr(self.args.optim, "value",
                                                                                            self.args.optim)),
                         "precision": "bf16 mixed precision, fp32 weights" if device.type == "cuda" else "fp32 (CPU)"}

    def train(self, steps: int, clock) -> None:
        from trl import SFTTrainer

        from hf_longctx.data import load_sample_tokenizer

        tokenizer = load_sample_tokenizer()  # only its pad token is read: the rows arrive as token ids
        trainer = SFTTrainer(model=self.model, args=self.args, train_dataset=row_dataset(self.batch, steps),
                             data_collator=stack_rows, processing_class=tokenizer, callbacks=[step_callback(clock)])
        trainer.train()
