"""A forward pre-hook that turns each rank's packed batch into its sequence-parallel shard.

Installed on the model (``register_forward_pre_hook``, no patching of transformers classes), it
concatenates the batches of the sequence-parallel group, builds the shard plan of the backend the
model was loaded with, and replaces the model's keyword inputs by this rank's shard
(:func:`~hf_longctx.hf.sharding.shard_batch`). ``num_items_in_batch`` from Trainer (the targets of the
whole world) is kept, so the loss scaling Trainer applies stays right.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..backends.load import attention_load
from ..comm.groups import group_rank_and_size
from .attention import backend_of
from .sharding import gather_group_batch, packed_batch_of, plan_for, shard_batch


def check_model(model) -> None:
    """Raise before any collective if the model cannot take sharded, position-carrying inputs."""
    impl = getattr(model.config, "_attn_implementation", None) or ""
    if not impl.startswith("longctx_"):
        raise ValueError(f"the model uses attn_implementation={impl!r}; load it with "
                         "attn_implementation='longctx_<backend>' (e.g. 'longctx_distfa', 'longctx_zigzag')")
    inner = getattr(model, "model", model)
    if getattr(inner, "rotary_emb", None) is None:
        raise ValueError(f"{type(model).__name__} has no rotary position embedding; sequence parallelism "
                         "needs position_ids to travel with the tokens (Llama-family RoPE models)")


class SequenceParallelInputs:
    """Callable forward pre-hook; also counts tokens and attention load for logging."""

    def __init__(self, group: dist.ProcessGroup | None, kernel: str = "auto"):
        self.group = group
        self.kernel = kernel
        self.tokens = 0
        self.causal_pairs = 0
        self.work_max = 0
        self.work_mean = 0.0
        self.started = time.perf_counter()

    def __call__(self, module, args, kwargs):
        if "longctx" in kwargs:  # already sharded by the caller
            return None
        if args:
            raise ValueError("call the model with keyword inputs (input_ids=..., position_ids=...)")
        backend = backend_of(module.config._attn_implementation)
        batch = {k: kwargs.pop(k, None) for k in ("input_ids", "labels", "position_ids", "doc_lens")}
        kwargs.pop("attention_mask", None)  # padding-free packed batch: document structure replaces it
        kwargs.pop("shift_labels", None)
        packed_batch_of(batch)  # validates locally, before any collective
        group_batch = gather_group_batch(batch, self.group)
        packed = packed_batch_of(group_batch)
        plan = plan_for(packed, backend, self.group)
        rank, world = group_rank_and_size(self.group)
        local = shard_batch(group_batch, plan, rank, self.group, self.kernel)
        if kwargs.get("num_items_in_batch") is not None:
            local.pop("num_items_in_batch")
        kwargs.update(local)
        self.tokens += packed.num_tokens
        self.causal_pairs += packed.causal_pairs()
        work = attention_load(plan, backend)
        self.work_max, self.work_mean = max(work), sum(work) / len(work)
        return args, kwargs


def install_input_hook(model, group: dist.ProcessGroup | None, kernel: str = "auto") -> SequenceParallelInputs:
    check_model(model)
    hook = SequenceParallelInputs(group, kernel)
    # prepended: every other pre-hook (tiled loss, user hooks) must see the sharded inputs
    handle = model.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
    hook.handle = handle
    return hook


def model_flops_per_token(model) -> float:
    """6 x the parameters that do matmul work per token (forward + backward).

    The input embedding is a table lookup, not a matmul: it is left out unless it is tied to the
    output projection (then the projection's matmul counts it once). Counting it would overstate MFU
    by a quarter for a 4-layer model with a 128K vocabulary.
    """
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    skip = set()
    if embedding is not None and (output is None or output.weight is not embedding.weight):
        skip = {id(p) for p in embedding.parameters()}
    return 6.0 * sum(p.numel() for p in model.parameters() if id(p) not in skip)


def attention_flops(model, causal_pairs: int) -> float:
    """Forward + backward core-attention FLOPs: 4 D H per visible pair per layer forward, x3.5."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 3.5 * 4 * head_dim * cfg.num_attention_heads * cfg.num_hidden_layers * causal_pairs


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of the accelerator, for MFU; None where unknown (CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in (("H200", 989e12), ("H100", 989e12), ("A100", 312e12)):
        if key in name:
            return value
    return None
