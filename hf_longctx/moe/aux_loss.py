"""The router's load-balancing loss of the whole batch, when its tokens are spread over ranks.

transformers' MoE models add ``router_aux_loss_coef * aux`` to the loss, with (Switch Transformer)
``aux = E * sum_e f_e * P_e``: f_e the fraction of (token, slot) assignments that went to expert e and
P_e the mean router probability of e, both over every token of every layer. Computed on a rank's own
tokens it is a different number (a product of means is not the mean of products), so a sharded run
would train on a different objective.

Exact version. The assignment counts (no gradient) and the token count are all-reduced over every
rank that shares the batch, so f is the batch's. P is linear in the probabilities, so each rank keeps
``share = E * sum_e f_e * (sum of ITS tokens' probabilities of e) / N``, with N the batch's rows. The
shares add up to the single-process aux loss, and their gradients add up to its gradient, exactly
as the language-model loss shares do (each rank's loss is its part of the global mean, and DDP or a
sum over the group puts them together). One all-reduce of E + 1 numbers per forward.

:func:`enable_distributed_aux_loss` makes a transformers MoE model compute it with hooks (no class
is patched): when the model is asked for router logits (``output_router_logits``, or the config's
default), the model runs with them off, so transformers adds nothing of its own; hooks on the
routers record their logits, and a forward hook on the model adds ``coef x share`` to ``loss`` and
fills ``aux_loss`` (this rank's share) and ``router_logits``.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..comm.groups import group_rank_and_size
from .layer import find_experts_modules

_ROUTER_NAMES = ("gate", "router")

_INSTALLED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> DistributedAuxLoss


def load_balancing_loss_share(router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int,
                              group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's share of the load-balancing loss of the batch spread over ``group`` (None: the world).

    ``router_logits``: one (tokens, num_experts) tensor per MoE layer, this rank's tokens (possibly
    none). Summed over the group, the shares equal transformers' ``load_balancing_loss_func`` on all
    the group's tokens (no attention mask: packed batches carry no padding).
    """
    if not router_logits:
        raise ValueError("no router logits: the model ran no MoE layer")
    device = router_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = 0
    for logits in router_logits:
        probs = torch.softmax(logits.to(device), dim=-1)
        selected = torch.topk(probs, top_k, dim=-1).indices
        counts += torch.bincount(selected.reshape(-1), minlength=num_experts).float()
        prob_sum = prob_sum + probs.float().sum(dim=0)
        rows += logits.shape[0]
    totals = torch.cat([counts, torch.tensor([float(rows)], device=device)])
    if group_rank_and_size(group)[1] > 1:
        dist.all_reduce(totals, group=group)
    global_rows = totals[num_experts].clamp(min=1.0)
    tokens_per_expert = totals[:num_experts] / global_rows
    return num_experts * torch.sum(tokens_per_expert * (prob_sum / global_rows))


def _routers(model: nn.Module) -> list[nn.Module]:
    routers = []
    for block, _, _ in find_experts_modules(model):
        router = next((getattr(block, n) for n in _ROUTER_NAMES if isinstance(getattr(block, n, None), nn.Module)),
                      None)
        if router is None:
            raise ValueError(f"{type(block).__name__} has no router module named one of {_ROUTER_NAMES}")
        routers.append(router)
    return routers


class DistributedAuxLoss:
    """Hooks computing the batch-exact load-balancing loss of a transformers MoE causal LM (see module doc)."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None = None):
        config = model.config
        self.num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
        self.top_k = config.num_experts_per_tok
        self.coef = config.router_aux_loss_coef
        self.config, self.group = config, group
        self._recorded: list[torch.Tensor] | None = None
        routers = _routers(model)
        if not routers:
            raise ValueError(f"{type(model).__name__} has no MoE block")
        self.handles = [r.register_forward_hook(self._record) for r in routers]
        self.handles.append(model.register_forward_pre_hook(self._before, with_kwargs=True))
        self.handles.append(model.register_forward_hook(self._after, with_kwargs=True))
        _INSTALLED[model] = self

    def _record(self, module, args, output):
        if self._recorded is not None:  # only inside a forward of the model (never in a checkpoint recompute)
            self._recorded.append(output[0])

    def _before(self, module, args, kwargs):
        wanted = kwargs.get("output_router_logits")
        if wanted is None:
            wanted = getattr(self.config, "output_router_logits", False)
        if wanted:
            kwargs["output_router_logits"] = False  # transformers then adds no aux loss of its own
            self._recorded = []
        return args, kwargs

    def _after(self, module, args, kwargs, output):
        if self._recorded is None:
            return None
        logits, self._recorded = tuple(self._recorded), None
        if not hasattr(output, "loss"):
            raise TypeError("the distributed aux loss needs the model's dict output; call the model with "
                            "return_dict=True")
        share = load_balancing_loss_share(logits, self.num_experts, self.top_k, self.group)
        output.aux_loss = share
        output.router_logits = logits
        if output.loss is not None:
            output.loss = output.loss + self.coef * share.to(output.loss.device)
        return output

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        for model in [m for m, aux in _INSTALLED.items() if aux is self]:
            _INSTALLED.pop(model)


def installed_aux_loss(model: nn.Module) -> DistributedAuxLoss | None:
    """The batch-exact aux-loss hooks installed on ``model`` (None: transformers computes its own)."""
    return _INSTALLED.get(model)


def enable_distributed_aux_loss(model: nn.Module, group: dist.ProcessGroup | None = None) -> DistributedAuxLoss:
    """Make ``model`` add the batch-exact load-balancing loss share of ``group`` (None: the world).

    ``group`` is every rank whose tokens form the batch of one optimizer step: the whole world, or,
    with tensor parallelism, the ranks of one tensor-parallel position (``ParallelGroups.batch``).
    Returns the hooks (``.remove()`` undoes it).
    """
    return DistributedAuxLoss(model, group)
