"""Causal-LM loss over the vocabulary in chunks of tokens: logits never exist for the whole sequence.

At long context the output projection dominates activation memory: T x vocab logits (bf16), their
float32 copy inside cross-entropy and its gradient are 3 x 128K x 128K x 4 bytes = 192 GiB for a
Llama-3 vocabulary at 128K tokens, more than the whole decoder keeps with layer checkpointing. Here
each chunk of hidden states is projected, scored and dropped; backward recomputes one chunk's logits
at a time (a checkpoint per chunk), so peak memory is one chunk's logits. Extra cost: one more
forward of the output projection, ~2% of an 8B model's step.

The loss is the same sum over targets divided by ``num_items_in_batch`` that transformers computes
(labels already shifted per document, ``-100`` ignored), so the sequence-parallel loss contract holds.

:class:`TiledLoss` wires it into an unmodified transformers causal LM through forward hooks: the
pre-hook takes the labels out of the call and asks the model for no logits (``logits_to_keep`` =
no position), a hook on the decoder keeps its last hidden state, and the model's forward hook puts
the tiled loss into the output. ``outputs.logits`` is then empty.

A MoE causal LM adds ``router_aux_loss_coef x aux_loss`` to the loss it computes from labels; with
the labels taken out of the call it adds nothing, so the tiled loss adds that term itself, from the
``aux_loss`` the output holds when its hook runs. Whoever fills ``aux_loss`` (transformers itself, or
the batch-exact hooks of :mod:`~hf_longctx.moe.aux_loss`, whose forward hook adds its share to the
loss when the output has one and otherwise only fills ``aux_loss``) the term is counted once,
whichever of the two hooks the model registered first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ...data.collator import IGNORE_INDEX


def _chunk_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    targets: torch.Tensor, head: torch.nn.Module | None = None) -> torch.Tensor:
    # through the module when given: ZeRO-3 gathers a partitioned weight in the module's forward hooks
    logits = head(hidden) if head is not None else F.linear(hidden, weight, bias)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> fp32, fp64 stays
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


def tiled_causal_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         num_items_in_batch: int | torch.Tensor | None = None, bias: torch.Tensor | None = None,
                         chunk_tokens: int = 8192, head: torch.nn.Module | None = None) -> torch.Tensor:
    """sum over tokens of CE(hidden @ weight.T + bias, targets) / num_items_in_batch, in token chunks.

    ``hidden`` (..., T, H) and ``targets`` (..., T) are flattened; targets are already shifted
    (``-100``: no target). Without ``num_items_in_batch`` the mean over targets is returned. With
    ``head`` (the output projection module holding ``weight`` and ``bias``) each chunk is projected
    by calling it, so hooks that gather sharded weights (DeepSpeed ZeRO-3) run.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1).to(h.device)
    if t.shape[0] != h.shape[0]:
        raise ValueError(f"{h.shape[0]} hidden states but {t.shape[0]} targets")
    total = h.new_zeros((), dtype=torch.promote_types(h.dtype, torch.float32))
    starts = range(0, h.shape[0], chunk_tokens)
    # chunks with a target, read in ONE device-to-host copy (not one sync per chunk)
    counted = torch.zeros(len(starts), dtype=torch.long, device=t.device).index_add_(
        0, torch.arange(t.shape[0], device=t.device) // chunk_tokens, (t != IGNORE_INDEX).long()).tolist()
    for start, n in zip(starts, counted):
        if not n:
            continue  # no target: contributes nothing (and no gradient)
        tc = t[start : start + chunk_tokens]
        hc = h[start : start + chunk_tokens]
        if torch.is_grad_enabled() and (hc.requires_grad or weight.requires_grad):
            part = checkpoint(_chunk_loss_sum, hc, weight, bias, tc, head, use_reentrant=False)
        else:
            part = _chunk_loss_sum(hc, weight, bias, tc, head)
        total = total + part
    if num_items_in_batch is None:
        num_items_in_batch = (t != IGNORE_INDEX).sum().clamp(min=1)
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def router_aux_coefficient(model: torch.nn.Module) -> float:
    """The weight a transformers MoE model gives its ``aux_loss`` in the loss (``router_aux_loss_coef``)."""
    coef = getattr(model, "router_aux_loss_coef", None)
    if coef is None:
        coef = getattr(getattr(model, "config", None), "router_aux_loss_coef", None)
    if coef is None:
        raise ValueError(f"{type(model).__name__} returns an aux_loss but has no router_aux_loss_coef, so the tiled "
                         "loss cannot tell what its forward adds to the loss; turn tiled_loss off for this model")
    return coef


class TiledLoss:
    """Forward hooks that make a transformers causal LM compute its loss with :func:`tiled_causal_lm_loss`."""

    def __init__(self, model: torch.nn.Module, chunk_tokens: int = 8192):
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        decoder = getattr(model, "model", None)
        if not isinstance(head, torch.nn.Linear) or decoder is None:
            raise ValueError(f"tiled loss needs a causal LM with a Linear output projection and a .model decoder; "
                             f"{type(model).__name__} has neither: turn tiled_loss off")
        if getattr(model.config, "final_logit_softcapping", None):
            raise ValueError("tiled loss does not apply final_logit_softcapping; turn tiled_loss off for this model")
        self.head = head
        self.chunk_tokens = chunk_tokens
        self._pending: tuple | None = None
        self._hidden: torch.Tensor | None = None
        self.handles = [
            model.register_forward_pre_hook(self._before, with_kwargs=True),
            decoder.register_forward_hook(self._keep_hidden),
            model.register_forward_hook(self._after),
        ]

    def _before(self, module, args, kwargs):
        labels = kwargs.pop("labels", None)
        shift = kwargs.pop("shift_labels", None)
        if labels is None and shift is None:
            self._pending = None
            return None
        if shift is None:  # unshifted labels: shift within the row, as transformers does
            shift = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
        self._pending = (shift, kwargs.get("num_items_in_batch"))
        device = shift.device
        kwargs["logits_to_keep"] = torch.empty(0, dtype=torch.long, device=device)  # no logits at all
        return args, kwargs

    def _keep_hidden(self, module, args, output):
        if self._pending is not None:
            self._hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state

    def _after(self, module, args, output):
        if self._pending is None:
            return None
        targets, num_items = self._pending
        hidden, self._hidden, self._pending = self._hidden, None, None
        loss = tiled_causal_lm_loss(hidden, self.head.weight, targets, num_items, self.head.bias, self.chunk_tokens,
                                    head=self.head)
        aux = output.get("aux_loss") if hasattr(output, "get") else None
        if aux is not None:  # what the model's forward adds to a loss from labels (module doc)
            loss = loss + router_aux_coefficient(module) * aux.to(loss.device)
        return type(output)(**{**{k: v for k, v in output.items() if k != "loss"}, "loss": loss})

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def enable_tiled_loss(model: torch.nn.Module, chunk_tokens: int = 8192) -> TiledLoss:
    """Compute ``model(...).loss`` chunk by chunk over tokens from now on; returns the hooks' owner.

    Works with the sequence-parallel input hook in either order: that hook runs first (it is
    prepended), so this one sees the sharded per-rank targets.
    """
    return TiledLoss(model, chunk_tokens)
