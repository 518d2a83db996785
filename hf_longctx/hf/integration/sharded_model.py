"""Whether a model can take sharded, position-carrying inputs, asked on every path that shards a batch.

:func:`check_model` holds the refusals: a model loaded without a ``longctx_*`` implementation, layers
that cannot take packed documents (:func:`~.model_support.unsupported_layers`), a forward without
``position_ids``, positions that cannot be handed over (:func:`~.positions.position_rule`). The input
hook runs it when it is installed. ``shard_batch(..., model=)`` runs it too, and so does the first
attention call of every sharded forward (:func:`check_sharded_forward`): ``shard_batch`` +
``model(**local)`` is refused exactly as the hook would refuse that model, also when the caller did not
name the model.

The verdict is a pure function of the model (its class, config and forward), the same on every rank of
a group that runs it, so every rank raises at the same attention call, before that call's first
collective: no rank is left waiting for a peer.

Cost: one walk over the stack per sharded forward (the first attention call under its context), one
:func:`check_model` per model and attention implementation; every later attention call of the forward
reads a dictionary.
"""

from __future__ import annotations

import inspect
import weakref

import torch

from .context import SequenceParallelContext, calls_under
from .dynamic_rope import refuse_unfollowed_rope
from .model_support import packed_sequence_refusal, unsupported_layers
from .positions import PositionRule, position_rule


def check_model(model) -> PositionRule:
    """Raise before any collective if the model cannot take sharded, position-carrying inputs; else the rule
    the model numbers its tokens by when it gets no ``position_ids`` (:func:`~.positions.position_rule`).

    Positions travel with the tokens as ``position_ids``; a model whose forward does not take them
    would number each shard's tokens from 0, and one whose positions cannot be handed over as
    ``position_ids`` (ALiBi from the mask) is refused by :func:`~.positions.position_rule`. (That the
    model's attention runs through the ``longctx_*`` function at all is checked by the input hook after
    its first sharded forward: see ``SequenceParallelInputs.restore_outputs``.)
    """
    impl = getattr(model.config, "_attn_implementation", None) or ""
    if not impl.startswith("longctx_"):
        raise ValueError(f"the model uses attn_implementation={impl!r}; load it with "
                         "attn_implementation='longctx_<backend>' (e.g. 'longctx_distfa', 'longctx_zigzag')")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT wrapper
    name = type(base).__name__
    reason = unsupported_layers(base.config)
    if reason is not None:
        raise ValueError(packed_sequence_refusal(name, reason))
    if "position_ids" not in inspect.signature(base.forward).parameters:
        raise ValueError(f"{name}.forward takes no position_ids; sequence parallelism needs positions to travel with "
                         "the tokens of each shard, so this model cannot be sharded (train it in one process)")
    return position_rule(base)


# model -> (its attention implementation when checked, its PositionRule or the refusal's message)
_MODEL_VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# context -> None (its model passed, or no transformers model runs it) or the refusal's message
_CONTEXT_VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_UNSEEN = object()


def checked_model(model) -> PositionRule:
    """:func:`check_model` for a model about to run a batch sharded by ``shard_batch``, remembered per model
    (asked again when its attention implementation changes). The refusal names the path it came from: its
    reasons speak of the callback, whose packed sequence ``shard_batch`` shards the same way."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    seen = _MODEL_VERDICTS.get(model)
    if seen is None or seen[0] != impl:
        try:
            verdict: PositionRule | str = check_model(model)
        except ValueError as exc:
            verdict = (f"{type(model).__name__} cannot run a sharded forward (hf_longctx.hf.shard_batch + "
                       "model(**local) shards the packed sequence LongContextCallback makes, in one process too): "
                       + str(exc))
        seen = _MODEL_VERDICTS[model] = (impl, verdict)
    if isinstance(seen[1], str):
        raise ValueError(seen[1])
    return seen[1]


def _sharded_model(ctx: SequenceParallelContext) -> torch.nn.Module | None:
    """The transformers model whose sharded forward ``ctx`` belongs to: the outermost model call on the stack
    whose keywords hold ``ctx``; None when no transformers model runs it (attention called by hand).

    Outermost, because a causal LM calls its base model with the same keywords and the refusals are about the
    whole model (its forward takes the positions); a transformers model, because the wrappers around it (DDP,
    FSDP, DeepSpeed's engine, PEFT) carry the keywords too but are no model to check (PEFT's is looked
    through by :func:`check_model`, so the model inside it gets the same verdict).
    """
    from transformers import PreTrainedModel

    models = [module for module, _ in calls_under(ctx) if isinstance(module, PreTrainedModel)]
    return models[-1] if models else None


def check_sharded_forward(ctx: SequenceParallelContext) -> None:
    """Raise, at an attention call under ``ctx``, what the input hook raises for this forward's model when it
    is installed (:func:`checked_model`), and a rotary embedding that read a shard's longest position where it
    needs the whole sequence's (:func:`~.dynamic_rope.refuse_unfollowed_rope`); called by every ``longctx_*``
    attention call before its first collective. The model is found once per context (:func:`_sharded_model`); a
    recompute in backward reads the verdict of its forward."""
    verdict = _CONTEXT_VERDICTS.get(ctx, _UNSEEN)
    if verdict is _UNSEEN:
        model = _sharded_model(ctx)
        verdict = None
        if model is not None:
            try:
                checked_model(model)
            except ValueError as exc:
                verdict = str(exc)
            if verdict is None:
                verdict = refuse_unfollowed_rope(model, ctx)
        _CONTEXT_VERDICTS[ctx] = verdict
    if verdict is not None:
        raise ValueError(verdict)
