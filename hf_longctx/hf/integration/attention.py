"""transformers integration: one AttentionInterface entry per backend, and a mask that is never built.

``import hf_longctx`` registers ``longctx_<backend>`` for every backend of the registry, so users write
``AutoModelForCausalLM.from_pretrained(path, attn_implementation="longctx_zigzag")`` (DistFlashAttn:
``longctx_distfa``). A backend another package registers later gets its name at that moment: this
module listens to the registry (:func:`~hf_longctx.backends.registry.on_backend_registered`), because
the backends layer knows nothing of transformers.

The functions replace only core attention (softmax(QK^T)V); projections, RoPE and everything else
stay transformers' own. Document masking comes from the shard plan (or, without one,
from the packed positions, see :mod:`.unsharded`), so no (T x T) mask is ever materialised: the matching
mask function passes on at most the 2-D padding mask.

With a ``longctx`` context (a batch sharded by :func:`~hf_longctx.hf.shard_batch` or the callback's
input hook) attention is sequence parallel; without one the model runs in this process alone, so
evaluation, ``generate()`` and padded batches work anywhere. A layer whose module says
``is_causal = False`` (bidirectional attention) is computed without the causal mask in one process, and
under sequence parallelism by a backend that computes it (``ulysses``) or refused by the others.
"""

from __future__ import annotations

import torch

from ...backends import Backend, segment_attention, sequence_parallel_attention
from ...backends.registry import on_backend_registered
from ..settings.backend_names import PREFIX, implementation_name
from .context import calls_under, context_of, count_attention_call
from .model_support import unsupported_layers
from .router_aux import has_router_aux_loss, refuse_local_router_aux_loss
from .sharded_model import check_sharded_forward
from .unsharded import match_dtypes, padding_mask, unsharded_attention, without_autocast


def _is_causal(module: torch.nn.Module, kwargs: dict) -> bool:
    """Causal unless the call or the attention module says otherwise, as transformers' sdpa path decides."""
    causal = kwargs.get("is_causal")
    return bool(getattr(module, "is_causal", True) if causal is None else causal)


def _context(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, kwargs: dict):
    """The sequence-parallel context of this call: its keyword, else the sharded forward it runs in.

    A decoder layer that does not pass its keywords to attention still runs on this rank's shard of a
    sharded batch; :func:`~.context.context_of` finds the forward's context on the call stack. Everything
    here is decided before the call's first collective, the same on every rank: first the model of the
    forward gets the input hook's refusals (:func:`~.sharded_model.check_sharded_forward`), whatever path
    sharded its batch.
    """
    ctx = kwargs.get("longctx")
    if ctx is None:
        ctx = context_of(module)
    if ctx is None:
        return None
    check_sharded_forward(ctx)
    local = ctx.plan.num_local_tokens(ctx.rank)
    if query.shape[0] != 1 or query.shape[2] != local or key.shape[2] != local:
        raise ValueError(
            f"{type(module).__name__} ran attention on q of shape {tuple(query.shape)} and k of "
            f"{tuple(key.shape)} during a sharded forward whose shard has {local} tokens: only self-attention over "
            "the shard can be sequence parallel (cross-attention and extra attention inputs cannot); train this "
            "model without sequence parallelism"
        )
    config = getattr(module, "config", None)
    # refused before any collective of the forward; a recompute in backward was checked in its forward
    if ctx.plan.world_size > 1 and has_router_aux_loss(config) and torch._C._current_graph_task_id() == -1:
        calls = calls_under(ctx)
        refuse_local_router_aux_loss([m for m, _ in calls], [kw for _, kw in calls], config, ctx.plan.world_size)
    count_attention_call(ctx)
    return ctx


def _make_attention(backend: str):
    def attention(module: torch.nn.Module, query, key, value, attention_mask, dropout: float = 0.0,
                  scaling: float | None = None, **kwargs):
        if dropout:
            raise ValueError("attention dropout is not supported by hf_longctx backends; set attention_dropout=0")
        for feature, what in (("softcap", "attention logit soft-capping"), ("s_aux", "attention sinks (s_aux)"),
                              ("position_bias", "an additive position bias on the scores (position_bias)")):
            if kwargs.get(feature) is not None:
                raise ValueError(f"this model uses {what} (attention argument {feature!r}), which hf_longctx "
                                 "backends do not compute; use attn_implementation='sdpa' or 'eager' for it")
        # sliding_window: transformers' attention classes pass it per layer (None on full-attention layers)
        window = kwargs.get("sliding_window")
        causal = _is_causal(module, kwargs)
        if window is not None and not causal:
            raise ValueError(f"{type(module).__name__} attends bidirectionally inside a sliding window (|i - j| < "
                             f"{window}), which hf_longctx kernels do not compute; use attn_implementation='sdpa' "
                             "for this model")
        query, key, value = match_dtypes(query, key, value)
        with without_autocast(query):  # the kernels accumulate in float32 themselves
            ctx = _context(module, query, key, kwargs)
            if ctx is None:  # no sequence-parallel batch: exact attention in this process (evaluation, generate)
                out = unsharded_attention(query, key, value, attention_mask, scaling=scaling,
                                      position_ids=kwargs.get("position_ids"),
                                      cu_seq_lens_q=kwargs.get("cu_seq_lens_q"),
                                      cu_seq_lens_k=kwargs.get("cu_seq_lens_k"), window=window, causal=causal,
                                      one_document_only=unsupported_layers(getattr(module, "config", None)))
                return out, None
            # (1, H, S, D) -> packed token-major (S, H, D)
            q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
            if not causal and ctx.plan.world_size == 1:  # one rank holds every document: any mask works locally
                cu = ctx.plan.batch.cu_seqlens.tolist()
                order = ctx.plan.local_indices(ctx.rank).to(q.device)
                inverse = torch.empty_like(order)
                inverse[order] = torch.arange(order.numel(), device=q.device)
                out = segment_attention(q[inverse], k[inverse], v[inverse], cu, cu, softmax_scale=scaling,
                                        kernel=ctx.kernel, causal=False)[order]
            else:
                out = sequence_parallel_attention(q, k, v, plan=ctx.plan, backend=backend, group=ctx.group,
                                                  rank=ctx.rank, softmax_scale=scaling, kernel=ctx.kernel,
                                                  window=window, causal=causal, options=ctx.options_for(backend))
            if ctx.padding is not None:  # padding tokens attend to nothing (see hf_longctx.hf.integration.rows)
                out = out.masked_fill(ctx.padding.to(out.device)[:, None, None], 0)
            return out.unsqueeze(0), None

    attention.__name__ = f"{PREFIX}{backend}_attention"
    attention.__doc__ = f"Core attention through the hf_longctx {backend!r} backend."
    return attention


_REGISTERED: list[str] = []  # attention names registered so far, in backend registration order


def _register_with_transformers(backend: Backend) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name = implementation_name(backend.name)
    AttentionInterface.register(name, _make_attention(backend.name))
    AttentionMaskInterface.register(name, padding_mask)
    if name not in _REGISTERED:
        _REGISTERED.append(name)


def register_attention_implementations() -> list[str]:
    """Register ``longctx_<backend>`` attention (and mask) functions with transformers for every backend
    registered now or later; returns the names, a list that grows with later registrations.

    Calling it again registers nothing twice. Raises ImportError without transformers.
    """
    import transformers  # noqa: F401 - fail here, before the registry holds a listener that cannot work

    on_backend_registered(_register_with_transformers)
    return _REGISTERED
