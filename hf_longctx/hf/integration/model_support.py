"""Which decoders a ``longctx_*`` implementation can compute exactly, read from their configs.

The backends replace softmax(QK^T)V and know documents, causality and sliding windows. Three kinds of
layer need more than that, and a model that has one is refused by name instead of training wrong:

* **sequence mixers that are not attention** (Mamba and other state-space layers, linear attention,
  gated delta nets, short convolutions, hybrid blocks): they carry state from one token to the next
  outside the attention function, so packed documents leak into each other and a shard of the
  sequence starts from an empty state. One process with one document per row stays exact;
* **chunked attention** (Llama 4's local layers): attention inside fixed chunks, which no backend
  computes under sequence parallelism;
* **indexed (sparse-selection) attention** (DeepSeek-style indexers) and **dynamic mask attention**
  (Doge): the model reads transformers' dense 4-D mask itself, which a ``longctx_*`` implementation
  never builds (:func:`reads_dense_mask`: refused whenever the mask is built). So does a model whose
  causality lives in that mask alone (BigBirdPegasus: its decoder's self-attention modules say
  ``is_causal = False``, and only the dense causal mask of eager attention, its one implementation in
  transformers, makes them causal; the attention function reads ``is_causal`` as transformers' sdpa
  and flash paths do, so it would attend to future tokens). And so does a model that adds a dense
  (q x kv) bias of its own to the scores (Inkling's learned relative position logits, handed to the
  attention function as ``position_bias``, which transformers' sdpa and eager add): no backend adds
  it, so the bias and the weights that make it would drop out.

The configs of transformers 5 say which layers a model has (``layer_types``, ``layers_block_type``) or
that it has Mamba blocks (``mamba_*`` settings); the model sweep test keeps this list honest for
every causal LM of the installed transformers.
"""

from __future__ import annotations

ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "attention", "global", "local"})
_LAYER_TYPE_KEYS = ("layer_types", "layers_block_type", "block_types")
# model types whose causal self-attention modules say is_causal = False: the dense mask alone is causal
_CAUSAL_ONLY_IN_MASK = {"bigbird_pegasus": "BigBirdPegasusDecoderAttention"}


def _layer_types(config) -> set[str]:
    types: set[str] = set()
    for key in _LAYER_TYPE_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, (list, tuple)):
            types.update(str(t) for t in value)
    return types


def _text_config(config):
    return getattr(config, "get_text_config", lambda: config)() or config


def reads_dense_mask(config) -> str | None:
    """Why a model of this config needs a dense (q x kv) tensor in its attention, or None: transformers'
    dense mask, which it reads itself or which alone makes it causal, or a score bias of its own.

    Such a model cannot run a ``longctx_*`` implementation at all: the mask function never builds the
    mask, and no backend adds a bias.
    """
    if config is None:
        return None
    config = _text_config(config)
    if "indexed_attention" in _layer_types(config) or getattr(config, "index_topk", None):
        return ("its sparse indexer reads transformers' dense attention mask, which longctx_* attention never "
                "builds")
    if getattr(config, "keep_window_size", None) is not None:  # Doge's dynamic mask attention
        return ("its dynamic mask attention adds a learned bias to the dense attention mask, which no backend "
                "computes")
    if getattr(config, "d_rel", None) and getattr(config, "rel_extent", None):  # Inkling's relative logits
        return ("its attention adds learned relative position logits (position_bias, a dense q x kv bias made by "
                "r_proj and rel_logits_proj) to the scores, which no backend adds")
    module = _CAUSAL_ONLY_IN_MASK.get(getattr(config, "model_type", None))
    if module is not None:
        return (f"its causal self-attention ({module}) says is_causal=False and is causal only through "
                "transformers' dense causal mask (eager attention, its one implementation in transformers), which "
                "longctx_* attention never builds, so it would attend to future tokens")
    return None


def unsupported_layers(config) -> str | None:
    """Why a model of this config cannot take packed documents or sequence parallelism, or None."""
    if config is None:
        return None
    dense = reads_dense_mask(config)
    if dense is not None:
        return dense
    config = _text_config(config)
    types = _layer_types(config)
    if "chunked_attention" in types:
        return "it has chunked-attention layers (attention inside fixed chunks), which no backend computes"
    other = sorted(t for t in types - ATTENTION_LAYER_TYPES if "attention" not in t or t == "linear_attention")
    if other:
        return (f"it has {', '.join(repr(t) for t in other)} layers: sequence mixers outside the attention "
                "function, which carry state across document and shard boundaries")
    if any(k.startswith("mamba") or k.endswith("_mamba_heads") or k == "n_mamba_heads"
           for k in vars(config)):
        return "it has Mamba (state-space) blocks, which carry state across document and shard boundaries"
    return None


def packed_sequence_refusal(name: str, reason: str) -> str:
    """The error for a model whose layers cannot take the packed sequence ``LongContextCallback`` makes.

    The callback flattens every batch into one packed sequence in one process too (several processes then
    shard it), so the refusal is about packing, not only about sequence parallelism; ``reason`` comes from
    :func:`unsupported_layers`.
    """
    return (f"{name} cannot train with LongContextCallback: the callback flattens every batch into one packed "
            f"sequence (in one process too; several processes then shard it), and {reason}. Train it without "
            "LongContextCallback, one document per row, with attn_implementation='sdpa'")
