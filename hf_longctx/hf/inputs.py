"""A forward pre-hook that turns each rank's packed batch into its sequence-parallel shard.

Installed on the model (``register_forward_pre_hook``, no patching of transformers classes), it
concatenates the batches of the sequence-parallel group, builds the shard plan of the backend the
model was loaded with, and replaces the model's keyword inputs by this rank's shard
(:func:`~hf_longctx.hf.sharding.shard_batch`). ``num_items_in_batch`` from Trainer (the targets of the
whole world) is kept, so the loss scaling Trainer applies stays right.

In evaluation (``model.eval()``) a forward hook gives every rank what one process would have computed
for its own rows: the logits come back from the ranks that computed them, in document order (one
all_to_all of this rank's rows only, so no rank holds more logits than a single process would). The
loss stays this rank's share, as in training: Trainer's evaluation passes ``num_items_in_batch`` and
scales it the same way. Calls with a KV cache (``generate()``) are left alone: they run in this
process through the local attention path.
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
        self.handles: list = []
        self._eval: tuple | None = None

    def __call__(self, module, args, kwargs):
        self._eval = None
        if "longctx" in kwargs:  # already sharded by the caller
            return None
        if kwargs.get("past_key_values") is not None:  # decoding with a cache: local attention, not a packed batch
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
        if not module.training:
            self._eval = (plan, rank, world, group_batch["rank_tokens"])
        return args, kwargs

    def restore_outputs(self, module, args, kwargs, output):
        """Forward hook: in evaluation, the logits of this rank's own rows, in order."""
        if self._eval is None:
            return None
        plan, rank, world, rank_tokens = self._eval
        self._eval = None
        logits = getattr(output, "logits", None)
        if logits is not None and logits.numel():
            output["logits"] = own_rows(logits[0], plan, rank, world, rank_tokens, self.group).unsqueeze(0)
        return output

    def remove(self) -> None:
        """Take the hooks off the model: it then runs like any ``longctx_*`` model without sharding."""
        for handle in self.handles:
            handle.remove()
        self.handles = []


def own_rows(local: torch.Tensor, plan, rank: int, world: int, rank_tokens: list[int],
             group: dist.ProcessGroup | None) -> torch.Tensor:
    """Rows of the group batch that ``rank`` brought, in order, from every rank's ``local`` shard rows.

    ``local`` holds this rank's rows in ``plan.local_indices(rank)`` order; the result has
    ``rank_tokens[rank]`` rows. One all_to_all moves each row straight to the rank that owns it.
    """
    offsets = torch.tensor([0] + rank_tokens).cumsum(0)
    start, end = int(offsets[rank]), int(offsets[rank + 1])
    mine = plan.local_indices(rank)
    owner = torch.bucketize(mine, offsets[1:], right=True)
    order = torch.argsort(owner, stable=True)
    send = local[order.to(local.device)].contiguous()
    send_counts = torch.bincount(owner, minlength=world).tolist()
    received_at = []
    for source in range(world):
        theirs = plan.local_indices(source)
        received_at.append(theirs[(theirs >= start) & (theirs < end)] - start)
    positions = torch.cat(received_at)
    if world == 1:
        received = send
    else:
        received = local.new_empty((positions.numel(), *local.shape[1:]))
        dist.all_to_all_single(received, send, [len(p) for p in received_at], send_counts, group=group)
    out = local.new_empty((end - start, *local.shape[1:]))
    out[positions.to(local.device)] = received
    return out


def install_input_hook(model, group: dist.ProcessGroup | None, kernel: str = "auto") -> SequenceParallelInputs:
    check_model(model)
    hook = SequenceParallelInputs(group, kernel)
    # prepended: every other pre-hook (tiled loss, user hooks) must see the sharded inputs
    hook.handles = [model.register_forward_pre_hook(hook, with_kwargs=True, prepend=True),
                    model.register_forward_hook(hook.restore_outputs, with_kwargs=True)]
    return hook
