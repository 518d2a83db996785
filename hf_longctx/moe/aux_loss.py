"""The router's load-balancing loss of the whole batch, when its tokens are spread over ranks.

transformers' MoE models add ``router_aux_loss_coef * aux`` to the loss, with (Switch Transformer)
``aux = E * sum_e f_e * P_e``: f_e the fraction of (token, slot) assignments that went to expert e and
P_e the mean router probability of e, both over every real token of every layer (the
``attention_mask`` leaves padding out). Computed on a rank's own tokens it is a different number (a
product of means is not the mean of products), so a sharded run would train on a different objective.

Exact version. The assignment counts (no gradient) and the token count are all-reduced over every
rank that shares the batch, so f is the batch's. P is linear in the probabilities, so each rank keeps
``share = E * sum_e f_e * (sum of ITS tokens' probabilities of e) / N``, with N the batch's real
tokens (times layers). The shares add up to the single-process aux loss, and their gradients add up
to its gradient, exactly as the language-model loss shares do (each rank's loss is its part of the
global mean, and DDP or a sum over the group puts them together). Padding tokens (the shard's
padding flags) count for nothing, as transformers' masked formula leaves them out. One all-reduce of
E + 1 numbers per forward.

:func:`enable_distributed_aux_loss` makes a transformers MoE model compute it with hooks (no class
is patched), in every forward that is part of a sharded batch: the forward's keywords carry the
shard's ``longctx`` context (the input hook puts it there, ``shard_batch`` makes it). There the model
runs with router logits off, so transformers adds nothing of its own; hooks on the routers record
their logits, and a forward hook on the model fills ``aux_loss`` (this rank's share) and
``router_logits`` and adds ``coef x share`` to ``loss`` when the model computed one. A loss computed
from the output afterwards (the tiled loss of :mod:`~hf_longctx.hf.memory.tiled_loss`, which takes the labels
out of the call) adds ``coef x aux_loss`` itself, as transformers' forward does; so the share is
counted once whichever of the two hooks was registered first.

Any other forward (``generate()``, an evaluation on one rank, a plain ``model(**batch)``) is left to
transformers: its own aux loss of the rows it was given, with its own ``attention_mask``, and no
collective. A hook cannot tell a forward that every rank runs in step from one that a single rank
runs (``if trainer.is_world_process_zero(): model.generate(...)``), and a collective in the latter
waits for peers that never come; without sharding, each process's rows are what one device of plain
data parallelism sees, and transformers' aux of them is that device's aux.

Which ranks share the batch: by default the sharded batch's own group (the context's, the
sequence-parallel group). A group's concatenated batch is what one device of plain data parallelism
sees, so each group's aux is that device's aux. An explicit group (``ParallelGroups.batch``, as
:func:`~hf_longctx.hf.parallel.model_parallelism.apply_model_parallelism` gives) makes it the aux of every rank of
that group together (the whole world: one process on every rank's rows).

How the shares meet the Trainer's scaling (``Trainer.compute_loss`` / ``training_step``). W processes
in groups of s (the sequence-parallel group, or the explicit group), DDP averages the gradients over
all W. With ``average_tokens_across_devices=True`` Trainer passes the world's target count as
``num_items_in_batch`` and multiplies each process's loss by W: the step's gradient is that of the
sum over processes of their losses, i.e. the language-model loss of the world's tokens plus ``coef x``
the sum over groups of each group's aux, what plain DDP over one device per group trains on
(transformers' DDP sums its devices' aux losses the same way). The shares go in as they are. With
``average_tokens_across_devices=False`` Trainer passes each process's own target count and multiplies
by nothing, and for a model it passes no count to (``accepts_loss_kwargs = False``) it multiplies by
nothing either, so DDP's average divides by W: the input hook divides each shard's loss sum by its
group's target count / s (``SequenceParallelInputs.average_in_group``), making the processes' average
the mean over groups of each group's token mean, as plain DDP averages its devices' means. The aux must
then be multiplied by s as well, or each group's aux arrives divided by s: with
:attr:`DistributedAuxLoss.averaged_over_processes` (set by ``LongContextCallback`` with the Trainer's
rule, ``hf_longctx.hf.integration.callback.trainer_averages_processes``) each share is multiplied by its group's
size, so the average over processes is the mean over groups of each group's aux, plain DDP's
per-device aux (for the whole-world group: the world's aux, what one process on all rows trains on,
as with the argument True).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from ..comm.groups import group_rank_and_size
from .layer import find_experts_modules

_ROUTER_NAMES = ("gate", "router")

SHARD_GROUP: Literal["shard"] = "shard"  # the group of the sharded batch (its SequenceParallelContext's)


def load_balancing_loss_share(router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int,
                              group: dist.ProcessGroup | None = None,
                              padding: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's share of the load-balancing loss of the batch spread over ``group`` (None: the world).

    ``router_logits``: one (tokens, num_experts) tensor per MoE layer, this rank's tokens (possibly
    none). ``padding``: (tokens,) flags of this rank's padding tokens (None: none); they count for
    nothing. Summed over the group, the shares equal transformers' ``load_balancing_loss_func`` on all
    the group's tokens with the ``attention_mask`` that marks the padding. Computed in the logits'
    precision, at least float32 (transformers sums in float32); counts are exact (float64).
    """
    if not router_logits:
        raise ValueError("no router logits: the model ran no MoE layer")
    device = router_logits[0].device
    dtype = torch.promote_types(router_logits[0].dtype, torch.float32)
    real = None
    if padding is not None:
        padding = padding.reshape(-1).to(device=device, dtype=torch.bool)
        real = ~padding
    counts = torch.zeros(num_experts, dtype=torch.float64, device=device)
    prob_sum = torch.zeros(num_experts, dtype=dtype, device=device)
    rows = 0
    for logits in router_logits:
        logits = logits.to(device)
        if real is not None:
            if real.numel() != logits.shape[0]:
                raise ValueError(f"padding flags for {real.numel()} tokens, but a router saw {logits.shape[0]}: "
                                 "pass the flags of the tokens this forward ran")
            logits = logits[real]
        probs = torch.softmax(logits, dim=-1)
        selected = torch.topk(probs, top_k, dim=-1).indices
        counts += torch.bincount(selected.reshape(-1), minlength=num_experts).to(torch.float64)
        prob_sum = prob_sum + probs.to(dtype).sum(dim=0)
        rows += logits.shape[0]
    totals = torch.cat([counts, torch.tensor([float(rows)], dtype=torch.float64, device=device)])
    if group_rank_and_size(group)[1] > 1:
        dist.all_reduce(totals, group=group)
    global_rows = totals[num_experts].clamp(min=1.0)  # no real token anywhere: no loss (transformers: nan)
    tokens_per_expert = (totals[:num_experts] / global_rows).to(dtype)
    return num_experts * torch.sum(tokens_per_expert * (prob_sum / global_rows.to(dtype)))


def _routers(model: nn.Module) -> list[nn.Module]:
    routers = []
    for block, _, _ in find_experts_modules(model):
        router = next((getattr(block, n) for n in _ROUTER_NAMES if isinstance(getattr(block, n, None), nn.Module)),
                      None)
        if router is None:
            raise ValueError(f"{type(block).__name__} has no router module named one of {_ROUTER_NAMES}")
        routers.append(router)
    return routers


_INSTALLED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> DistributedAuxLoss


def installed_aux_loss(model: nn.Module) -> DistributedAuxLoss | None:
    """The batch-exact aux-loss hooks installed on ``model`` (None: transformers computes its own)."""
    return _INSTALLED.get(model)


class DistributedAuxLoss:
    """Hooks computing the batch-exact load-balancing loss of a transformers MoE causal LM (see module doc).

    ``group``: :data:`SHARD_GROUP` (the sharded batch's own group), or the ranks whose shares add up
    to one aux loss (None: the world). Registers itself (:func:`installed_aux_loss`); one per model.

    ``averaged_over_processes``: False (default), the shares of a group add up to its aux loss (the
    processes' losses are summed, as Trainer's ``average_tokens_across_devices=True`` makes DDP do);
    True, each share is multiplied by its group's size, so the AVERAGE over the processes is the mean
    over groups of their aux losses (DDP's plain average: ``average_tokens_across_devices=False``, see
    the module doc). ``aux_loss`` in the output is the share as added to the loss.
    """

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None | Literal["shard"] = SHARD_GROUP):
        if model in _INSTALLED:
            raise ValueError(f"{type(model).__name__} already computes the batch-exact aux loss; remove() those "
                             "hooks first (hf_longctx.moe.aux_loss.installed_aux_loss(model))")
        if isinstance(group, str) and group != SHARD_GROUP:
            raise ValueError(f"group={group!r}: pass a process group, None (the world) or {SHARD_GROUP!r} (the "
                             "sharded batch's own group)")
        config = model.config
        self.num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
        self.top_k = config.num_experts_per_tok
        self.coef = config.router_aux_loss_coef
        self.config, self.group = config, group
        self.averaged_over_processes = False
        self._recorded: list[torch.Tensor] | None = None
        self._context = None
        routers = _routers(model)
        if not routers:
            raise ValueError(f"{type(model).__name__} has no MoE block")
        self.handles = [r.register_forward_hook(self._record) for r in routers]
        self.handles.append(model.register_forward_pre_hook(self._before, with_kwargs=True))
        self.handles.append(model.register_forward_hook(self._after, with_kwargs=True))
        self._model = weakref.ref(model)
        _INSTALLED[model] = self

    def _record(self, module, args, output):
        if self._recorded is not None:  # only inside a forward of the model (never in a checkpoint recompute)
            self._recorded.append(output[0])

    def _before(self, module, args, kwargs):
        self._recorded, self._context = None, None
        context = kwargs.get("longctx")
        if context is None:  # not part of a sharded batch: transformers' own aux, no collective (module doc)
            return None
        wanted = kwargs.get("output_router_logits")
        if wanted is None:
            wanted = getattr(self.config, "output_router_logits", False)
        if not wanted:
            return None
        kwargs["output_router_logits"] = False  # transformers then adds no aux loss of its own
        self._recorded, self._context = [], context
        return args, kwargs

    def _after(self, module, args, kwargs, output):
        if self._recorded is None:
            return None
        logits, context = tuple(self._recorded), self._context
        self._recorded, self._context = None, None
        if not hasattr(output, "loss"):
            raise TypeError("the distributed aux loss needs the model's dict output; call the model with "
                            "return_dict=True")
        group = context.group if isinstance(self.group, str) else self.group
        share = load_balancing_loss_share(logits, self.num_experts, self.top_k, group, context.padding)
        if self.averaged_over_processes:
            share = share * group_rank_and_size(group)[1]
        output.aux_loss = share
        output.router_logits = logits
        if output.loss is not None:
            output.loss = output.loss + self.coef * share.to(output.loss.device)
        return output

    def remove(self) -> None:
        """Take the hooks off: transformers computes its own aux loss again."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        model = self._model()
        if model is not None and _INSTALLED.get(model) is self:
            del _INSTALLED[model]


def enable_distributed_aux_loss(model: nn.Module,
                                group: dist.ProcessGroup | None | Literal["shard"] = SHARD_GROUP
                                ) -> DistributedAuxLoss:
    """Make ``model`` add its share of the batch-exact load-balancing loss in every sharded forward.

    ``group``: by default (:data:`SHARD_GROUP`) the ranks of the sharded batch (its sequence-parallel
    group: each group's aux is what one device of plain data parallelism computes). An explicit group
    is every rank whose tokens form the batch of one optimizer step: the whole world (None), or, with
    tensor parallelism, the ranks of one tensor-parallel position (``ParallelGroups.batch``); the run
    then trains on the aux of one process holding all of them. Forwards without a ``longctx`` context
    are left to transformers (module doc). Returns the hooks (``.remove()`` undoes it).
    """
    return DistributedAuxLoss(model, group)
