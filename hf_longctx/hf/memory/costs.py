"""The cost model of the memory planner: which choice of memory options makes the fastest step.

In FLOPs per token: a layer's forward is its matmuls (``2 x its parameters``) plus causal attention
(``4 q x keys per query``), its backward twice the matmuls plus :data:`ATTENTION_BACKWARD_FACTOR` times the
attention. Layer checkpointing adds a layer's forward; recompute-aware only its matmuls (as measured against layer
checkpointing, bench/results/2026-11-22_checkpointing.md); the tiled MLP one MLP forward per layer; the tiled loss
one output-projection forward; an offloaded checkpoint :data:`OFFLOAD_OVERHEAD` of the layer's step or the copy
time that the layer's compute does not hide, whichever is more; AdamW on the host its host step (seconds), turned
into FLOPs. So spare memory buys speed: first untiled loss and MLP, then fewer checkpointed layers, recompute-aware
before layer checkpointing, and checkpoints on the host while host memory lasts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..settings.schema import GROUP_MODE
from .model import LayerChoice, ModelShape, Precision

ATTENTION_BACKWARD_FACTOR = 2.5
"""Attention backward / forward FLOPs: FlashAttention's backward runs 5 matmuls to the forward's 2."""

OFFLOAD_OVERHEAD = 0.01
"""Share of an offloaded layer's step spent on its copies: well under it on one GPU with side streams (measured:
bench/results/2026-11-22_checkpointing.md), counted as 1% for copies that share PCIe with NCCL traffic and for the
pinned host memory they take, so a plan offloads only where that buys a whole non-checkpointed layer or a fit."""

HOST_LINK_BYTES_PER_S = 25e9
"""Pinned host <-> GPU copy bandwidth assumed (PCIe Gen4 x16 measures ~25 GB/s, Gen5 ~50)."""

GPU_FLOPS = 400e12
"""Achieved bf16 FLOP/s assumed when a copy's time is turned into FLOPs (~40% of an H100/H200)."""

SMALL_CHUNK_PENALTY = 0.05
"""Extra cost of each halving of a tiled chunk below its default (smaller GEMMs run slower)."""

HOST_ADAM_PARAMS_PER_S = 1e9
"""Parameters per second one process's host AdamW updates (DeepSpeed CPU Adam)."""

LOSS_CHUNKS = (8192, 4096, 2048, 1024)
"""Tiled-loss chunk sizes the planner tries, preferred first (8192 is the recipes' default)."""

MLP_CHUNKS = (16384, 8192, 4096, 2048)
"""Tiled-MLP chunk sizes the planner tries, preferred first (16384: full-speed GEMMs on H100/H200)."""


class StepCosts:
    """FLOPs per token of a step and of each option's extra work (see the module docstring)."""

    def __init__(self, shape: ModelShape, tokens: int, sp_size: int, attention_context: float | None,
                 precision: Precision, zero_stage: int, world: int):
        s = shape
        keys = attention_context if attention_context is not None else tokens * sp_size / 2
        self.matmul = 2 * s.layer_matmul_params
        self.attention = 4 * s.q_dim * keys
        self.layer_forward = self.matmul + self.attention
        self.layer_step = 3 * self.matmul + (1 + ATTENTION_BACKWARD_FACTOR) * self.attention
        self.head_forward = 2 * s.vocab * s.hidden
        self.base = s.layers * self.layer_step + 3 * self.head_forward
        self.mlp_forward = 2 * 3 * s.hidden * s.intermediate
        self.tokens = tokens
        a = precision.activation
        self._copy_flops = {m: b * a / HOST_LINK_BYTES_PER_S * GPU_FLOPS for m, b in
                            (("layer", s.hidden), ("recompute_aware", s.hidden + s.q_dim))}
        shard = world if zero_stage >= 1 else 1
        per_rank = s.params / shard
        seconds = (per_rank * (precision.grad + precision.weight) / HOST_LINK_BYTES_PER_S
                   + per_rank / HOST_ADAM_PARAMS_PER_S)
        self.optimizer_host = seconds * GPU_FLOPS / max(1, tokens)

    def checkpointing(self, mode: str) -> float:
        return {"none": 0.0, "layer": self.layer_forward, "recompute_aware": self.matmul,
                GROUP_MODE: self.layer_forward}[mode]

    def offload(self, mode: str) -> float:
        exposed = max(0.0, 2 * self._copy_flops[mode] - self.layer_forward)  # copies out and back, hidden by compute
        return max(OFFLOAD_OVERHEAD * self.layer_step, exposed)

    @staticmethod
    def _halvings(chunk: int, default: int) -> float:
        return max(0.0, math.log2(default / chunk)) if chunk else 0.0

    def tiling(self, tiled_loss: int, tiled_mlp: int, layers: int) -> float:
        cost = 0.0
        if tiled_loss:
            cost += self.head_forward * (1 + SMALL_CHUNK_PENALTY * self._halvings(tiled_loss, LOSS_CHUNKS[0]))
        if tiled_mlp:
            cost += layers * self.mlp_forward * (1 + SMALL_CHUNK_PENALTY * self._halvings(tiled_mlp, MLP_CHUNKS[0]))
        return cost

    def plan(self, layers: Sequence[LayerChoice], tiled_loss: int, tiled_mlp: int, optimizer_on_host: bool) -> float:
        cost = self.tiling(tiled_loss, tiled_mlp, len(layers)) + (self.optimizer_host if optimizer_on_host else 0.0)
        for c in layers:
            cost += self.checkpointing(c.checkpointing) + (self.offload(c.checkpointing) if c.offload else 0.0)
        return cost

