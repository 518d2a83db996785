"""hf_longctx itself, as ``scripts/bench_train.py --gpus 1 --backend local --memory auto`` trains it.

``attn_implementation="longctx_local"`` with the best installed kernel (``kernel="auto"``); the memory planner
(:func:`hf_longctx.hf.plan_for_training`, ``memory: auto``) picks checkpointing, offload, tiling,
Liger's fused ops where they run, and where AdamW lives, for the GPU and host it sees; its optimizer
(:meth:`~hf_longctx.hf.memory.plan.MemoryPlan.make_optimizer`) with its states allocated before the first step,
as bench_train does. The packed row is sharded (one shard: the whole row) with per-document shifted targets.
"""

from __future__ import annotations

import torch

from .workload import Workload, build_model, doc_lengths, packed_batch


class LongCtxRun:
    """One process training the workload with hf_longctx's ``local`` backend and ``memory: auto``."""

    name = "hf_longctx"
    process_group = True  # as scripts/bench_train.py, accelerate launch: a one-rank group

    def __init__(self, work: Workload, device: torch.device) -> None:
        from hf_longctx.hf import (
            LongContextConfig,
            allocate_optimizer_states,
            implementation_name,
            plan_for,
            plan_for_training,
            shard_batch,
        )
        from hf_longctx.layout import PackedBatch

        self.model = build_model(work, implementation_name("local"), device)
        plan = plan_for_training(self.model, LongContextConfig(memory="auto"), tokens_per_gpu=work.seq, world=1,
                                 sp_size=1, processes_per_host=1, zero_stage=0, fused_ops=None)
        plan.apply(self.model)
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = plan.make_optimizer(params, lr=work.lr)
        allocate_optimizer_states(self.optimizer)
        batch = packed_batch(work, self.model.config.vocab_size)
        shard_plan = plan_for(PackedBatch.from_doc_lens(doc_lengths(work)), "local", None)
        whole = {"input_ids": batch["input_ids"].to(device), "position_ids": batch["position_ids"].to(device)}
        self.local = shard_batch(whole, shard_plan, 0, None, kernel="auto")
        self.settings = {"attention": "longctx_local (kernel auto)", "memory": "auto", "plan": plan.summary(),
                         "checkpointing": plan.checkpointing, "offloaded_layers": plan.offloaded_layers,
                         "tiled_loss": plan.tiled_loss, "tiled_mlp": plan.tiled_mlp,
                         "fused_ops": "liger" if plan.fused_ops else "off",
                         "optimizer": "AdamW on the host (torchao)" if plan.optimizer_on_host else "AdamW on the GPU",
                         "predicted_gpu_gib": round(plan.gpu_peak / 2**30, 2),
                         "predicted_host_gib": round(plan.host_peak / 2**30, 2), "document_masking": True}

    def train(self, steps: int, clock) -> None:
        for _ in range(steps):
            clock.begin()
            loss = self.model(**self.local).loss
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            clock.end(loss.detach().float().item())
