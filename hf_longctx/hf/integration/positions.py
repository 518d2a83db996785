"""The positions a model gives its tokens itself, computed on the whole row before the row is sharded.

When the caller passes no ``position_ids``, transformers' models number the tokens of a row by a rule
of their own, and a shard of the row would apply that rule to its own tokens only. So the input hook
computes, per row and before sharding, the positions the model would have computed on the whole
row, and hands them to the model as ``position_ids`` (which the model then uses as given). Three
rules exist among transformers' causal LMs:

* **arange** (most models, BioGPT and XGLM included): 0, 1, 2, ... in every row, whatever the padding;
* **from the mask** (OPT): ``cumsum(attention_mask) * attention_mask - 1``, so left padding does not
  shift the real tokens and a padding token gets -1; the model adds its embedding offset to given
  positions as it does to the ones it computes, so the values handed over are these, without it;
* **from the ids** (RoBERTa and the models that copy its embeddings: XLM-RoBERTa, XLM-RoBERTa-XL,
  CamemBERT, Data2VecText, RobertaPreLayerNorm, X-MOD): ``padding_idx + 1 + (count of non-padding
  tokens before)`` for a token that is not ``padding_idx``, ``padding_idx`` for one that is; computed
  by the model's own embeddings' ``create_position_ids_from_input_ids``, so the rule stays theirs.

A model whose positions cannot be handed over as ``position_ids`` is refused by name: ALiBi models
(Falcon with ``alibi=True``) derive their position bias from the attention mask inside transformers'
dense mask, which a ``longctx_*`` implementation never builds. Positions the caller gives are never
changed: transformers uses given positions as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ARANGE, FROM_MASK, FROM_IDS = "arange", "mask", "ids"

# model types whose model numbers the tokens from the attention mask when it gets no position_ids
# (their embeddings' own code, not a helper one could call: OPTDecoder.forward)
_MASK_POSITION_MODELS = frozenset({"opt"})


@dataclass(frozen=True)
class PositionRule:
    """How a model numbers its tokens when it gets no ``position_ids`` (module docstring).

    ``embeddings`` is the module whose ``create_position_ids_from_input_ids`` computes them (rule
    ``ids`` only), ``model`` the model's class name for messages.
    """

    kind: str
    model: str
    embeddings: torch.nn.Module | None = None

    @property
    def is_arange(self) -> bool:
        return self.kind == ARANGE

    def row_positions(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, S) ``position_ids`` the model computes for the (B, S) ``input_ids`` (and 2-D mask) of a batch."""
        rows, length = input_ids.shape
        if self.kind == FROM_IDS:
            embeddings = self.embeddings
            return embeddings.create_position_ids_from_input_ids(input_ids, embeddings.padding_idx).long()
        if self.kind == FROM_MASK and attention_mask is not None:
            mask = attention_mask.to(device=input_ids.device, dtype=torch.long)
            return (mask.cumsum(dim=1) * mask - 1).long()
        return torch.arange(length, device=input_ids.device).expand(rows, length)

    def document_positions(self, input_ids: torch.Tensor, doc_lens: list[int]) -> torch.Tensor:
        """(T,) positions of a packed sequence of (T,) ids: each document numbered as its own row without padding."""
        ids = input_ids.reshape(-1)
        parts, start = [], 0
        for n in doc_lens:
            parts.append(self.row_positions(ids[start : start + n].unsqueeze(0))[0])
            start += n
        return torch.cat(parts) if parts else ids.new_zeros(0)


def _ids_position_embeddings(model: torch.nn.Module) -> torch.nn.Module | None:
    """The embeddings module that numbers tokens from their ids (RoBERTa's rule), or None."""
    for module in model.modules():
        if callable(getattr(module, "create_position_ids_from_input_ids", None)) and hasattr(module, "padding_idx"):
            return module
    return None


def position_rule(model: torch.nn.Module) -> PositionRule:
    """The rule ``model`` numbers its tokens by when it gets no ``position_ids``; ValueError when none can be
    handed over as ``position_ids`` (module docstring). A PEFT wrapper is looked through."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = type(base).__name__
    config = getattr(base, "config", None)
    text_config = getattr(config, "get_text_config", lambda: config)() or config
    if getattr(text_config, "alibi", False):
        raise ValueError(f"{name} (alibi=True) derives its ALiBi position bias from the attention mask and adds it "
                         "to transformers' dense attention mask, which longctx_* attention never builds, so its "
                         "positions cannot travel with the tokens of a shard; train it with "
                         "attn_implementation='sdpa' and no LongContextCallback")
    embeddings = _ids_position_embeddings(base)
    if embeddings is not None:
        return PositionRule(FROM_IDS, name, embeddings)
    if getattr(text_config, "model_type", None) in _MASK_POSITION_MODELS:
        return PositionRule(FROM_MASK, name)
    return PositionRule(ARANGE, name)
