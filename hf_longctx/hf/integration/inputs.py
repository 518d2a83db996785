"""A forward pre-hook that turns each rank's packed batch into its sequence-parallel shard.

Installed on the model (``register_forward_pre_hook``, no patching of transformers classes), it
concatenates the batches of the sequence-parallel group, builds the shard plan of the backend the
model was loaded with, and replaces the model's keyword inputs by this rank's shard
(:func:`~hf_longctx.hf.integration.sharding.shard_batch`). ``num_items_in_batch`` from Trainer (the targets of the
whole world) is kept, so the loss scaling Trainer applies stays right.

Any batch a collator makes works (:mod:`.rows`): packed rows, several unpacked rows, padded rows
(left, right or inside), with labels, shift_labels or none. Without ``position_ids`` every token gets
the position the model itself computes on its whole row (:mod:`.positions`: from the mask for OPT,
from the ids for RoBERTa and its kin), found once from the model when the hook is installed.

In evaluation (``model.eval()``), and in training when the model is called without labels (the
caller computes the loss: Trainer's ``compute_loss_func``, ``label_smoothing_factor``), a forward
hook gives every rank what one process would have computed for its own rows: the logits come back
from the ranks that computed them, in the rows' own (B, S) order (one all_to_all of this rank's rows
only, so no rank holds more logits than a single process would; in training it is differentiable).
The model's own loss stays this rank's share: Trainer passes ``num_items_in_batch`` and scales it the
same way. Decoding calls are left alone and run in this process through the local attention path:
a call with a KV cache under any of transformers' names for it (``cache``, ``past_key_values``, ...),
or a ``Cache`` under any keyword, or ``use_cache=True`` (``generate()``'s prefill brings a fresh, empty
cache): a shard's keys and values are no prompt to continue from.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ...backends.attention_load import attention_load
from ...backends.options import BackendOptions
from ...comm.groups import group_rank_and_size
from ..settings.backend_names import backend_of
from ..settings.schema import checked_backend_options
from .context import attention_calls
from .dynamic_rope import follow_whole_sequence_positions
from .positions import PositionRule
from .router_aux import refuse_local_router_aux_loss
from .rows import flatten_batch, unflatten_rows
from .sharded_model import check_model
from .sharding import gather_group_batch, plan_for

# keywords that describe the unsharded batch of this rank: the shard's documents come from the plan
_UNSHARDED_ONLY = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
# transformers' keywords for a decoding cache: ``cache`` (5.x), the older ``past_key_values`` (still accepted),
# ``cache_params`` (Mamba-style state), ``layer_past``, and the state names of a few architectures
CACHE_KEYWORDS = ("cache", "past_key_values", "cache_params", "layer_past", "state", "mems", "past_buckets_states")


def is_decoding_call(kwargs: dict) -> bool:
    """Whether a model call reads or fills a KV cache: it runs in this process, unsharded.

    ``use_cache=True`` alone counts: ``generate()`` and hand-written decoding loops ask for a cache to
    continue from, and the keys and values of one rank's shard are not that.
    """
    if kwargs.get("use_cache") or any(kwargs.get(name) is not None for name in CACHE_KEYWORDS):
        return True
    from transformers.cache_utils import Cache

    return any(isinstance(value, Cache) for value in kwargs.values())


class SequenceParallelInputs:
    """Callable forward pre-hook; also counts tokens and attention load for logging.

    ``current`` is the context of the model's current sharded forward (None between them).

    ``average_in_group`` says how a group's loss is split over its processes. False (the default, for
    a caller of its own): without a count from the caller, each rank's loss is its share of the group's
    mean (the group's target count), so the shares ADD UP to it; a caller's ``num_items_in_batch`` is
    kept (Trainer's count of the world, which it then scales by the process count). True (set by
    ``LongContextCallback`` where the Trainer scales nothing, so DDP's plain average over processes
    meets the shares): the group's count, of this call or the sum of the caller's per-process counts,
    is divided by the group size, so the AVERAGE over the group's processes is the group's mean, as
    DDP averages the means of its devices.
    """

    def __init__(self, group: dist.ProcessGroup | None, kernel: str = "auto", options: BackendOptions | None = None,
                 positions: PositionRule | None = None):
        self.group = group
        self.positions = positions  # None: transformers' default, 0, 1, 2, ... in every row
        self.kernel = kernel
        self.options = options  # the backend's options object (install_input_hook parses them), or None
        self.tokens = 0
        self.causal_pairs = 0
        self.work_max = 0
        self.work_mean = 0.0
        self.started = time.perf_counter()
        self.handles: list = []
        self.model = None
        self.current = None
        self.average_in_group = False
        self._sharded = False
        self._restore: tuple | None = None

    def __call__(self, module, args, kwargs):
        self._restore = None
        self._sharded = False
        if "longctx" in kwargs:  # already sharded by the caller
            self.current = kwargs["longctx"]
            return None
        self.current = None
        if is_decoding_call(kwargs):  # generate(), decoding with a cache: local attention, not a packed batch
            return None
        if args:
            raise ValueError("call the model with keyword inputs (input_ids=..., position_ids=...)")
        if kwargs.get("logits_to_keep") not in (None, 0):
            raise ValueError("logits_to_keep selects the last positions of a row, but under sequence parallelism each "
                             "rank holds a shard of the group's sequence; call the model without it")
        backend = backend_of(module.config._attn_implementation)
        rank, world = group_rank_and_size(self.group)
        mask = kwargs.get("attention_mask")
        padded = isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.all())
        # decided before any collective, the same on every rank (padding matters only to a group of one)
        refuse_local_router_aux_loss([module], [kwargs], module.config, world, padded=padded and world == 1)
        inputs = {k: kwargs.pop(k, None) for k in ("attention_mask", "position_ids", "labels", "shift_labels",
                                                    "doc_lens")}
        try:  # checked here, but raised after the first collective so that no peer waits for this rank
            positions_of = None if self.positions is None or self.positions.is_arange else self.positions.row_positions
            flat, problem = flatten_batch(kwargs.pop("input_ids", None), **inputs, positions_of=positions_of), None
        except ValueError as exc:
            flat, problem = None, str(exc)
        for key in _UNSHARDED_ONLY:
            kwargs.pop(key, None)
        group_batch = gather_group_batch(flat, self.group, problem)
        plan = plan_for(group_batch.packed, backend, self.group, model=module, device=group_batch.input_ids.device,
                        kernel=self.kernel, options=self.options)
        local = group_batch.shard(plan, rank, self.group, self.kernel, self.options)
        group_count = local.pop("num_items_in_batch", None)  # the targets of this call's group batch
        caller_count = kwargs.get("num_items_in_batch")
        if caller_count is not None and not self.average_in_group:
            group_count = None  # Trainer's count covers the whole step (accumulation, devices): kept as it is
        elif caller_count is not None:  # each process's count of the step (average_tokens_across_devices=False)
            group_count = self._group_count(caller_count, local["input_ids"].device)
        if group_count is not None:
            kwargs["num_items_in_batch"] = group_count / world if self.average_in_group else group_count
        kwargs.update(local)
        kwargs["use_cache"] = False  # a shard's keys and values are no prompt to continue from
        self.current = local["longctx"]
        self._sharded = True
        self.tokens += group_batch.packed.num_tokens
        self.causal_pairs += group_batch.packed.causal_pairs()
        work = attention_load(plan, backend)
        self.work_max, self.work_mean = max(work), sum(work) / len(work)
        if not module.training or group_batch.targets is None:
            # evaluation, or a loss the caller computes (Trainer's compute_loss_func, label smoothing):
            # the logits go back to the rows this rank brought, in their own order
            self._restore = (_RowRoute(plan, rank, world, group_batch.rank_tokens, self.group), flat)
        return args, kwargs

    def _group_count(self, rank_count, device: torch.device) -> torch.Tensor:
        """Trainer's count of this process's targets -> the group's count (the sum over its processes)."""
        count = torch.as_tensor(rank_count).to(device=device, dtype=torch.float64)
        dist.all_reduce(count, group=self.group)
        return count

    def restore_outputs(self, module, args, kwargs, output):
        """Forward hook: where the caller reads logits, this rank's own rows of them, in its own (B, S) order.

        It also refuses a model whose forward ran no ``longctx_*`` attention on the sharded batch: its
        attention bypasses transformers' AttentionInterface (or it has none), so it attended inside each
        shard without the document boundaries.
        """
        if self._sharded and attention_calls(self.current) == 0:
            self._sharded, self._restore, self.current = False, None, None
            raise ValueError(f"{type(module).__name__} ran a sharded forward without calling its longctx_* attention: "
                             "its attention does not go through transformers' AttentionInterface (or it has none), so "
                             "it cannot be sequence parallel or see packed documents; use attn_implementation='sdpa' "
                             "and no LongContextCallback for this model")
        self.current = None  # a recompute in backward finds the context in the layer's own keywords
        if self._restore is None:
            return None
        route, flat = self._restore
        self._restore = None
        logits = getattr(output, "logits", None)
        if logits is not None and logits.numel():
            output["logits"] = unflatten_rows(route.own_rows(logits[0]), flat)
        return output

    def remove(self) -> None:
        """Take the hooks off the model: it then runs like any ``longctx_*`` model without sharding."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.model = None
        self.current = None


class _RowRoute:
    """Where each of this rank's shard rows goes so that every rank gets back the rows it brought.

    ``own_rows`` is one all_to_all, differentiable: its backward sends the gradients of the rows back
    to the ranks that computed them.
    """

    def __init__(self, plan, rank: int, world: int, rank_tokens: list[int], group: dist.ProcessGroup | None):
        offsets = torch.tensor([0] + rank_tokens).cumsum(0)
        start, end = int(offsets[rank]), int(offsets[rank + 1])
        mine = plan.local_indices(rank)
        owner = torch.bucketize(mine, offsets[1:], right=True)
        self.send_order = torch.argsort(owner, stable=True)
        self.send_counts = torch.bincount(owner, minlength=world).tolist()
        received_at = []
        for source in range(world):
            theirs = plan.local_indices(source)
            received_at.append(theirs[(theirs >= start) & (theirs < end)] - start)
        self.positions = torch.cat(received_at)
        self.recv_counts = [len(p) for p in received_at]
        self.own_tokens = end - start
        self.world, self.group = world, group

    def own_rows(self, local: torch.Tensor) -> torch.Tensor:
        """(shard rows, ...) in plan order -> (this rank's own rows, ...) in the order it brought them."""
        return _OwnRows.apply(local, self)


class _OwnRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, route: _RowRoute) -> torch.Tensor:
        ctx.route = route
        send = local[route.send_order.to(local.device)].contiguous()
        received = _exchange(send, route.recv_counts, route.send_counts, route)
        out = local.new_empty((route.own_tokens, *local.shape[1:]))
        out[route.positions.to(local.device)] = received
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        route = ctx.route
        received = grad_out[route.positions.to(grad_out.device)].contiguous()
        sent = _exchange(received, route.send_counts, route.recv_counts, route)
        grad = torch.empty_like(sent)
        grad[route.send_order.to(sent.device)] = sent
        return grad, None


def _exchange(send: torch.Tensor, recv_counts: list[int], send_counts: list[int], route: _RowRoute) -> torch.Tensor:
    if route.world == 1:
        return send
    received = send.new_empty((sum(recv_counts), *send.shape[1:]))
    dist.all_to_all_single(received, send, recv_counts, send_counts, group=route.group)
    return received


def install_input_hook(model, group: dist.ProcessGroup | None, kernel: str = "auto",
                       options: BackendOptions | dict | None = None) -> SequenceParallelInputs:
    """Shard every forward of ``model`` over ``group`` from now on; ``options`` (the backend's, the settings'
    ``backend_options``: an options object, or a mapping parsed here) go to every attention call, checked here
    against the backend the model was loaded with."""
    positions = check_model(model)
    follow_whole_sequence_positions(model)  # RoPE sized by the longest position reads the whole sequence's
    if isinstance(options, BackendOptions) and not options.given():
        options = None  # nothing was asked for (the settings' defaults may belong to another backend than the model's)
    if isinstance(options, BackendOptions) or options:
        impl = model.config._attn_implementation
        options = checked_backend_options(backend_of(impl), options, f"the model runs attn_implementation={impl!r}")
    hook = SequenceParallelInputs(group, kernel, options, positions)
    # prepended: every other pre-hook (tiled loss, user hooks) must see the sharded inputs
    hook.handles = [model.register_forward_pre_hook(hook, with_kwargs=True, prepend=True),
                    model.register_forward_hook(hook.restore_outputs, with_kwargs=True)]
    hook.model = model
    return hook
