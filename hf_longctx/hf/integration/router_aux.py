"""A MoE model's router aux loss under sequence parallelism: batch-exact, or refused.

transformers adds ``router_aux_loss_coef * aux`` to the loss of a MoE model asked for its router logits
(``output_router_logits``, a call keyword or the config's default). Computed on one rank's shard of
the batch that loss is a different number from the batch's (it is a product of means), so a forward
sharded over several ranks must either run :func:`hf_longctx.moe.enable_distributed_aux_loss`'s
batch-exact version or not compute it at all; anything else trains on another objective.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


def has_router_aux_loss(config) -> bool:
    """Whether the model of ``config`` has a router aux loss (a MoE model's) at all."""
    return getattr(config, "router_aux_loss_coef", None) is not None


def router_aux_loss_requested(config, keywords: Sequence[dict]) -> bool:
    """Whether a call with ``keywords`` (the model calls on the stack, innermost first) asks for the aux loss."""
    if not has_router_aux_loss(config):
        return False
    asked = [kw["output_router_logits"] for kw in keywords if kw.get("output_router_logits") is not None]
    return bool(asked[0]) if asked else bool(getattr(config, "output_router_logits", False))


def refuse_local_router_aux_loss(models: Sequence[nn.Module], keywords: Sequence[dict], config, world: int,
                                 padded: bool = False) -> None:
    """Raise if a forward sharded over ``world`` ranks would add transformers' own per-shard router aux loss.

    ``models``: the model calls the forward runs in (the model, its wrappers); the batch-exact loss may be
    installed on any of them. ``keywords``: their call keywords. A shard of one rank is the whole batch,
    so one rank is refused only when its batch is ``padded``: the sharded forward gets no attention mask,
    and transformers' aux loss would count the padding tokens it leaves out with one.
    """
    if (world <= 1 and not padded) or not router_aux_loss_requested(config, keywords):
        return
    from ...moe.aux_loss import installed_aux_loss

    if any(installed_aux_loss(model) is not None for model in models):
        return
    name = next((type(m).__name__ for m in reversed(models) if hasattr(m, "config")), "the model")
    where = (f"a forward sharded over {world} ranks, but transformers computes it on each rank's shard alone"
             if world > 1 else "a padded batch flattened for sequence parallelism, where transformers would count "
             "the padding tokens")
    raise ValueError(f"{name} is asked for its router aux loss (output_router_logits) in {where}, which is not "
                     "the batch's loss; call hf_longctx.moe.enable_distributed_aux_loss(model) before training (the "
                     "batch-exact loss), or pass output_router_logits=False")
