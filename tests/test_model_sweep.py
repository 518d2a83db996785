"""Every causal LM of the installed transformers, tiny and random in float64, through ``longctx_zigzag``,
crossed with the input forms a collator hands the model and the paths that shard them.

For each class of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (one entry per class) a tiny config is built
from its config class (2 layers, 4 heads, 2 KV heads, small vocabulary, few small experts); the model
is built once per process and every form runs on it.

Forms (each rank brings its own rows; the group trains on all of them):

* ``packed``: one row of several documents with ``position_ids`` restarting at 0 per document (one
  document of a single token); the reference is SDPA document by document, each given its slice of
  the row's ``position_ids`` (the same inputs: RoBERTa's embeddings number a row from
  ``padding_idx + 1`` when given none, but use given positions as they are);
* ``right_padded`` / ``left_padded``: (B, S) rows with a 2-D ``attention_mask`` and no ``position_ids``
  (the model derives positions its own way); labels are -100 at padding, and a padding position
  predicts nothing (left padding: the first real token is no target), since what a query that sees no
  key gives is each attention's own convention;
* ``rows``: (B, S) rows of equal length, no positions, no mask;
* ``<form>+aux`` for MoE models (the config has ``router_aux_loss_coef`` and ``output_router_logits``,
  and the model's own forward returns an ``aux_loss``): the same forms with
  ``output_router_logits=True`` and ``router_aux_loss_coef=0.5``; the objective is the LM loss plus
  0.5 x the output's ``aux_loss``.

Paths, each against transformers' own sdpa (eager where the model has none) on the group's batch run
as ONE batch in one process (the aux loss is not a sum over tokens, so its reference must be one batch;
the LM loss is a sum over targets / the group's target count, so the ranks' shares add up):

* ``plain``: ``longctx_zigzag`` in one process on the group's batch, no hook, no context;
* ``hook/1``, ``hook/2``: what LongContextCallback installs (:func:`_install_like_callback`), over a
  group of one process (the group's batch) and of the 2 gloo processes (each its own rows);
* ``shard_batch/1``, ``shard_batch/2`` (packed forms): ``hf_longctx.hf.shard_batch`` of the group's
  packed row + ``model(**local)``, as scripts/bench_train.py calls it.

The loss and every parameter gradient (summed over the processes) must equal the reference within 1e-9
relative error (the logits too in one process); 1e-5 for a model that rounds weight-dependent values to
float32 inside its own float64 forward (a norm's ``x.float()``, a router in float32), where the
last-bit differences of two exact attentions grow to float32 precision (the reason says so).

A model that cannot be checked at all lands in one bucket: refused (a ValueError or NotImplementedError
raised by transformers when the model is loaded with or switched to the implementation); no attention
interface (``longctx_zigzag`` was never called in the plain packed run: state-space models, and models
whose attention modules bypass transformers' attention interface); not buildable (no tiny config or
model, or the reference cannot run on token ids alone); not importable (a missing optional dependency).
Otherwise every (form, path) cell lands in its own bucket: passed; refused (a ValueError or
NotImplementedError raised by hf_longctx: the message is the reason); not buildable (that form's
reference cannot run); failed (numbers differ, or any other exception: the reason names the numbers).
A model refused for one form may pass others. The test fails when any cell failed.

``HF_LONGCTX_SWEEP_REPORT=path.md`` writes the table (models x forms, counts per form and path, every
cell that did not pass with its reason); ``HF_LONGCTX_SWEEP_ONLY=opt,roberta`` selects model types.
One spawn of 2 processes runs the whole sweep.
"""

from __future__ import annotations

import inspect
import json
import os
import time
import traceback
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import hf_longctx  # noqa: F401 - registers the attention implementations
from hf_longctx.hf import plan_for, shard_batch
from hf_longctx.hf.integration.callback import install_aux_loss
from hf_longctx.hf.integration.inputs import install_input_hook
from hf_longctx.layout import PackedBatch

from distributed import run_distributed

VOCAB = 96
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 32, 2, 4, 2, 8
FFN, EXPERT_FFN, EXPERTS, TOP_K = 48, 16, 4, 2

# Generic shrinking: every key a config has (in its to_dict()) gets this value. Values of None in the
# default config stay None (a feature that is off stays off), except for the keys of ALWAYS.
SHRINK = {
    **dict.fromkeys(["vocab_size", "decoder_vocab_size", "audio_vocab_size"], VOCAB),
    **dict.fromkeys(["hidden_size", "d_model", "n_embd", "embed_dim", "emb_dim", "dim", "n_embed",
                     "word_embed_proj_dim", "input_embedding_size", "output_embedding_size",
                     "attention_hidden_size", "lru_width", "embedding_dim"], HIDDEN),
    **dict.fromkeys(["num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers",
                     "encoder_layers", "num_decoder_layers", "num_encoder_layers"], LAYERS),
    **dict.fromkeys(["num_attention_heads", "n_head", "num_heads", "decoder_attention_heads",
                     "encoder_attention_heads", "attention_heads", "n_heads", "num_decoder_attention_heads",
                     "num_encoder_attention_heads"], HEADS),
    **dict.fromkeys(["num_key_value_heads", "num_kv_heads", "num_query_groups"], KV_HEADS),
    **dict.fromkeys(["head_dim", "attention_head_dim", "d_head", "dim_head", "kv_channels",
                     "attention_head_size"], HEAD_DIM),
    **dict.fromkeys(["intermediate_size", "ffn_dim", "decoder_ffn_dim", "encoder_ffn_dim", "n_inner", "dff",
                     "ffn_hidden_size", "feed_forward_size", "dim_ff", "d_inner", "intermediate_size_mlp",
                     "dense_intermediate_size", "prefix_dense_intermediate_size"], FFN),
    **dict.fromkeys(["moe_intermediate_size", "shared_expert_intermediate_size", "expert_ffn_hidden_size",
                     "moe_shared_expert_intermediate_size", "shared_intermediate_size",
                     "shared_experts_intermediate_size"], EXPERT_FFN),
    **dict.fromkeys(["num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"], EXPERTS),
    **dict.fromkeys(["num_experts_per_tok", "moe_topk", "top_k_experts", "moe_k", "num_experts_per_token"], TOP_K),
    **dict.fromkeys(["n_group", "topk_group", "num_expert_group"], 1),
    **dict.fromkeys(["n_shared_experts", "num_shared_experts", "moe_num_shared_experts"], 1),
    "first_k_dense_replace": 1,
    **dict.fromkeys(["q_lora_rank", "kv_lora_rank", "o_lora_rank"], 16),
    **dict.fromkeys(["qk_rope_head_dim", "qk_nope_head_dim"], HEAD_DIM // 2),  # multi-head latent attention
    "v_head_dim": HEAD_DIM,
    "qk_head_dim": HEAD_DIM,
    "rotary_dim": HEAD_DIM // 2,
    # linear-attention / state-space parts of hybrid models
    **dict.fromkeys(["linear_num_key_heads", "linear_num_heads"], 2),
    "linear_num_value_heads": 4,
    **dict.fromkeys(["linear_key_head_dim", "linear_value_head_dim", "linear_head_dim"], 8),
    **dict.fromkeys(["mamba_d_state", "state_size", "ssm_state_size"], 8),
    **dict.fromkeys(["mamba_n_heads", "mamba_num_heads"], 4),
    **dict.fromkeys(["mamba_d_head", "mamba_head_dim", "mamba_headdim"], 16),
    **dict.fromkeys(["mamba_n_groups", "mamba_ngroups", "n_groups"], 1),
    **dict.fromkeys(["index_n_heads", "indexer_n_heads"], 2),
    **dict.fromkeys(["index_head_dim", "indexer_head_dim"], 8),
    # vision / audio towers are built but never run: as small as they go
    **dict.fromkeys(["image_size"], 32),
    **dict.fromkeys(["patch_size"], 8),
    "num_channels": 3,
    "mamba_d_ssm": 2 * HIDDEN,
    # per-layer / hashed / auxiliary embedding tables
    **dict.fromkeys(["vocab_size_per_layer_input", "pronunciation_vocab_size", "shape_vocab_size",
                     "encoder_hash_byte_group_vocab", "ngram_vocab_size_base"], VOCAB),
    **dict.fromkeys(["pronunciation_embed_dim", "shape_embed_dim"], 8),
}
# Where the generic shrinking is not enough (a value the config derives from another, a feature that
# is None by default but required by the model code, a shape constraint of a recurrent part).
OVERRIDES = {
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "dbrx": {"attn_config": {"kv_n_heads": KV_HEADS, "rope_theta": 10000.0, "clip_qkv": 1e6},
             "ffn_config": {"hidden_size": HIDDEN, "ffn_hidden_size": EXPERT_FFN, "moe_num_experts": EXPERTS,
                            "moe_top_k": TOP_K}},
    "dots1": {"n_routed_experts": EXPERTS, "num_experts_per_tok": TOP_K, "n_shared_experts": 1},
    "deepseek_v2": {"n_routed_experts": EXPERTS, "num_experts_per_tok": TOP_K, "n_shared_experts": 1},
    "dots3_note_text": {"num_key_value_heads": HEADS},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["mamba", "attention"]},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    "gemma3n_text": {"num_kv_shared_layers": 0, "hidden_size_per_layer_input": 8, "laurel_rank": 8},
    "gemma4_assistant": {"hidden_size_per_layer_input": 0},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "mamba2": {"head_dim": 16},
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": HEAD_DIM, "indexer_budget": 8,
                  "indexer_compress_ratio": 2},
    "zamba": {"num_hidden_layers": 3, "attn_layer_period": 2, "attn_layer_offset": 1,
              "layers_block_type": ["linear_attention", "hybrid", "hybrid"]},
    "reformer": {"is_decoder": True, "axial_pos_embds_dim": [16, 16], "axial_pos_shape": [4, 16],
                 "max_position_embeddings": 64},
    "zaya": {"num_experts_per_tok": 1},
}
ZERO_FLOAT = ("router_jitter_noise", "input_jitter_noise")


def _is_dropout(key: str) -> bool:
    return "dropout" in key or "pdrop" in key or key in ("layerdrop", "decoder_layerdrop", "encoder_layerdrop",
                                                          "dropout_p")


ALWAYS = ("head_dim", "num_key_value_heads")  # set even where the default is None (derived)
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")


def _representative_layers(values: list) -> list:
    """LAYERS entries of a per-layer list keeping its variety: the first entry, then the first that differs."""
    out = [values[0]]
    for v in values[1:]:
        if len(out) == LAYERS:
            break
        if v not in out or len(set(map(repr, values))) <= len(out):
            out.append(v)
    return out + [values[-1]] * (LAYERS - len(out))


def _shrunk_kwargs(default) -> dict:
    kwargs = {}
    items = default.to_dict()
    layers = next((items[k] for k in LAYER_COUNT_KEYS if isinstance(items.get(k), int)), None)
    for key, value in items.items():
        if key == "head_dim" and "qk_rope_head_dim" in items:
            kwargs[key] = SHRINK["qk_rope_head_dim"]  # multi-head latent attention rotates head_dim channels
        elif key in SHRINK and (value is not None or key in ALWAYS) and not isinstance(value, (list, dict, bool)):
            kwargs[key] = SHRINK[key]
        elif (_is_dropout(key) or key in ZERO_FLOAT) and isinstance(value, float):
            kwargs[key] = 0.0
        elif isinstance(value, list) and value and layers and len(value) == layers:
            kwargs[key] = _representative_layers(value)  # layer_types, attention_layers, mlp_layer_types, ...
        elif (key.endswith("_token_id") or key.endswith("_token_index")) and isinstance(value, int) and value >= VOCAB:
            kwargs[key] = VOCAB - 1 - sum(k.endswith(("_token_id", "_token_index")) for k in kwargs)
    for key, value in vars(default).items():
        if isinstance(value, transformers.PretrainedConfig):
            kwargs[key] = tiny_config_of(type(value), value)
    return kwargs


def tiny_config_of(config_class, default=None, overrides: dict | None = None):
    default = config_class() if default is None else default
    kwargs = _shrunk_kwargs(default)
    kwargs.update(overrides or {})
    return config_class(**kwargs)


def causal_lm_classes() -> dict[str, str]:
    """model_type -> class name, one entry per class: the model_type of the class's own config when it is
    one of those naming the class, else the first."""
    by_class: dict[str, list[str]] = {}
    for model_type, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        by_class.setdefault(class_name, []).append(model_type)
    out = {}
    for class_name, types in by_class.items():
        own = getattr(getattr(getattr(transformers, class_name, None), "config_class", None), "model_type", None)
        out[own if own in types else types[0]] = class_name
    return out



IMPL = "longctx_zigzag"
BACKEND = "zigzag"
TOL = 1e-9
FLOAT32_TOL = 1e-5  # models that round to float32 inside (see _Float32Inside)
AUX_COEF = 0.5
IGNORE = -100
WORLD = 2
# packed: the documents of each rank's row (the group's row is their concatenation: 36 tokens, 7 documents)
PACKED = ([7, 1, 9, 4], [5, 2, 8])
# padded: the real tokens of each rank's rows of PADDED_LEN; rows: ROWS rows of ROW_LEN per rank
PADDED, PADDED_LEN = ([8, 5], [3, 7]), 8
ROWS, ROW_LEN = 2, 7
FORMS = ("packed", "right_padded", "left_padded", "rows")
PATHS = ("plain", "hook/1", "hook/2", "shard_batch/1", "shard_batch/2")
BUCKETS = ("passed", "refused", "no attention interface", "not buildable", "not importable", "failed")
CELL_BUCKETS = ("passed", "refused", "not buildable", "failed")


class Bucket(Exception):
    """Ends the checks of one model (or one cell) in a bucket other than passed or failed."""

    def __init__(self, bucket: str, reason: str):
        super().__init__(reason)
        self.bucket, self.reason = bucket, reason


def _message(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:400]}"


def _raised_by_package(e: BaseException) -> bool:
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and f"{os.sep}hf_longctx{os.sep}" in tb.tb_frame.f_code.co_filename


def _cell_error(e: BaseException) -> dict:
    """A cell's ending from its exception: refused when hf_longctx refused by name, else failed."""
    if isinstance(e, Bucket):
        return {"bucket": e.bucket, "reason": e.reason}
    if isinstance(e, (ValueError, NotImplementedError)) and _raised_by_package(e):
        return {"bucket": "refused", "reason": _message(e)}
    return {"bucket": "failed", "reason": _message(e), "trace": traceback.format_exc(limit=-3)}


class _AttentionSpy:
    """Counts the calls of the ``longctx_zigzag`` attention function (wrapped in transformers' registry)."""

    def __init__(self):
        from transformers import AttentionInterface
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self.calls = 0
        inner = ALL_ATTENTION_FUNCTIONS[IMPL]

        def counted(*args, **kwargs):
            self.calls += 1
            return inner(*args, **kwargs)

        AttentionInterface.register(IMPL, counted)


def _build(model_type: str, class_name: str):
    """The tiny float64 model loaded with ``attn_implementation="longctx_zigzag"`` (same weights in every
    process), and the attention implementation of its reference (sdpa, else eager)."""
    try:
        model_class = getattr(transformers, class_name)
    except Exception as e:  # noqa: BLE001 - anything that stops the import
        raise Bucket("not importable", _message(e)) from e
    try:
        config = tiny_config_of(model_class.config_class, overrides=OVERRIDES.get(model_type))
    except Exception as e:  # noqa: BLE001
        raise Bucket("not buildable", f"config: {_message(e)}") from e
    if _has_router_aux(config):  # off unless a form asks for it (output_router_logits=True)
        config.router_aux_loss_coef, config.output_router_logits = AUX_COEF, False

    def build(impl):
        torch.manual_seed(0)
        config._attn_implementation = impl  # what from_pretrained(..., attn_implementation=impl) sets
        return model_class(config)

    try:
        model = build(IMPL)
    except Exception as e:  # noqa: BLE001 - does the model build with its own attention?
        for impl in ("sdpa", "eager"):
            try:
                build(impl)
                break
            except Exception:  # noqa: BLE001, S112
                continue
        else:
            if isinstance(e, ImportError):
                raise Bucket("not importable", _message(e)) from e
            raise Bucket("not buildable", _message(e)) from e
        if isinstance(e, (ValueError, NotImplementedError)):
            raise Bucket("refused", f"loading with attn_implementation={IMPL!r}: {_message(e)}") from e
        if isinstance(e, KeyError) and e.args == (IMPL,):  # transformers refuses the name at construction
            raise Bucket("refused", f"by transformers at construction (KeyError {IMPL!r}): the model picks its "
                                    "attention class from a fixed table of names") from e
        raise AssertionError(f"loading with attn_implementation={IMPL!r} (the model builds with "
                             f"{impl!r}): {_message(e)}") from e
    model = model.double().train()  # every dropout is 0: training mode is deterministic
    if hasattr(model, "set_experts_implementation"):
        try:  # grouped_mm experts take no float64 on CPU
            model.set_experts_implementation("eager")
        except (ValueError, NotImplementedError, AttributeError):
            pass
    for reference in ("sdpa", "eager"):
        try:
            model.set_attn_implementation(reference)
            return model, reference
        except (ValueError, NotImplementedError):
            continue
    raise Bucket("not buildable", "neither sdpa nor eager attention can be set")


def _attention_modules(model) -> list[str]:
    return sorted({type(m).__name__ for m in model.modules()
                   if "attention" in type(m).__name__.lower() or "attn" in type(m).__name__.lower()})


class _Float32Inside(torch.overrides.TorchFunctionMode):
    """Names the float32 results that depend on the weights in a float64 forward (e.g. a norm's ``x.float()``).

    Such a model rounds to float32 inside, so two exact attentions that differ in the last bit of float64
    give results that differ at float32 precision; positions-only float32 (RoPE's cos/sin) does not count.
    """

    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.requires_grad:
            self.ops.add(getattr(func, "__name__", str(func)))
        return out




def _has_router_aux(config) -> bool:
    return hasattr(config, "router_aux_loss_coef") and hasattr(config, "output_router_logits")


def _install_like_callback(model, group) -> list:
    """What LongContextCallback puts on a model to shard its batches over ``group``; ``.remove()`` each to undo:
    the input hook, and for a MoE model the batch-exact aux loss (the callback's own ``install_aux_loss``)."""
    installed = [install_input_hook(model, group)]
    try:
        aux = install_aux_loss(model)
    except Exception:
        installed[0].remove()
        raise
    if aux is not None:
        installed.append(aux)
    return installed


@dataclass
class Batch:
    """One form's inputs: each rank's model keywords (labels included, as a collator gives them) and the
    group's batch (every rank's rows: what one process runs), with the next-token target of every position
    of the group's batch (IGNORE where there is none)."""

    form: str
    aux: bool
    ranks: list[dict]
    group: dict
    targets: torch.Tensor
    doc_lens: list[int] | None = None  # packed: the group's documents

    @property
    def name(self) -> str:
        return self.form + ("+aux" if self.aux else "")

    @property
    def count(self) -> int:
        return int((self.targets != IGNORE).sum())

    def unlabelled(self) -> dict:
        return {k: v for k, v in self.group.items() if k != "labels"}


def _batch(form: str, aux: bool, pad_id: int) -> Batch:
    gen = torch.Generator().manual_seed(1)

    def tokens(*shape):
        return torch.randint(3, VOCAB - 16, shape, generator=gen)

    if form == "packed":
        lens = [n for row in PACKED for n in row]
        ids = tokens(1, sum(lens))
        positions = torch.cat([torch.arange(n) for n in lens])[None]
        targets, start = torch.full_like(ids, IGNORE), 0
        for n in lens:
            targets[0, start : start + n - 1] = ids[0, start + 1 : start + n]
            start += n
        ranks, start = [], 0
        for row in PACKED:
            end = start + sum(row)
            ranks.append({"input_ids": ids[:, start:end], "position_ids": positions[:, start:end],
                          "labels": ids[:, start:end]})
            start = end
        group = {"input_ids": ids, "position_ids": positions, "labels": ids}
        return Batch(form, aux, ranks, group, targets, lens)
    if form == "rows":
        ids = tokens(ROWS * WORLD, ROW_LEN)
        group = {"input_ids": ids, "labels": ids}
        labels = ids
    else:
        real = torch.tensor([n for row in PADDED for n in row])
        cols = torch.arange(PADDED_LEN)[None]
        mask = (cols < real[:, None]) if form == "right_padded" else (cols >= PADDED_LEN - real[:, None])
        mask = mask.long()
        ids = tokens(len(real), PADDED_LEN).masked_fill(mask == 0, pad_id)
        labels = ids.masked_fill(mask == 0, IGNORE)
        if form == "left_padded":  # the last padding position would predict the first real token
            labels[torch.arange(len(real)), PADDED_LEN - real] = IGNORE
        group = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    targets = torch.full_like(ids, IGNORE)
    targets[:, :-1] = labels[:, 1:]
    per = ids.shape[0] // WORLD
    ranks = [{k: v[r * per : (r + 1) * per] for k, v in group.items()} for r in range(WORLD)]
    return Batch(form, aux, ranks, group, targets)


def _pad_id(config) -> int:
    pad = getattr(config, "pad_token_id", None)
    return pad if isinstance(pad, int) and 0 <= pad < VOCAB else 0


def _lm_loss(logits: torch.Tensor, targets, count) -> torch.Tensor:
    """Summed next-token cross-entropy over ``count`` targets (each position's target given)."""
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(),
                                             targets.reshape(-1).to(logits.device), ignore_index=IGNORE,
                                             reduction="sum") / count


def _objective(out, targets, count, aux: bool) -> tuple[torch.Tensor, float | None]:
    """LM loss (+ AUX_COEF x the output's aux_loss in an aux form), and the aux loss's value."""
    loss = _lm_loss(out.logits, targets, count)
    value = getattr(out, "aux_loss", None) if aux else None
    if value is not None:
        loss = loss + AUX_COEF * value.double()
        value = float(value.detach())
    return loss, value


def _call(model, kwargs: dict, aux: bool, use_cache: bool | None = False):
    """``model(**kwargs)`` (without a cache unless told; a forward that takes no ``use_cache`` runs without it)."""
    kwargs = dict(kwargs)
    if aux:
        kwargs["output_router_logits"] = True
    if use_cache is not None:
        kwargs["use_cache"] = use_cache
    try:
        return model(**kwargs)
    except TypeError as e:
        if "use_cache" not in str(e) or use_cache is None:
            raise
        kwargs.pop("use_cache")
        return model(**kwargs)


def _grads(model) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in model.parameters()])


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Max |got - ref| relative to the largest reference value."""
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _grad_err(got: torch.Tensor, ref: torch.Tensor, names: list[str], numels: list[int]) -> tuple[float, str]:
    """Worst per-parameter relative error and that parameter's name (a parameter whose gradient is below 1e-6
    of the largest one is measured against that 1e-6)."""
    floor = 1e-6 * float(ref.abs().max())
    err, worst = 0.0, ""
    for name, g, r in zip(names, got.split(numels), ref.split(numels)):
        if g.numel():
            e = float((g - r).abs().max() / max(float(r.abs().max()), floor, 1e-30))
            if e > err:
                err, worst = e, name
    return err, worst


def _takes_position_ids(model) -> bool:
    """Whether ``model.forward`` names ``position_ids`` (a forward taking only ``**kwargs`` passes them on
    to places of its own, so the per-document reference gives them only to a forward that names them)."""
    return "position_ids" in inspect.signature(model.forward).parameters


def _reference(model, batch: Batch, spy, packed_ref: dict | None) -> dict:
    """transformers' own attention on the group's batch in one process: loss, gradients, logits, aux, and the
    float32 ops of its forward. Packed: documents one by one (their LM loss adds up); packed+aux: the aux loss of
    the packed row run as one batch, when the model's own attention keeps its documents apart."""
    model.zero_grad()
    spy.calls = 0
    float32 = _Float32Inside()
    ref = {}
    try:
        if batch.form == "packed" and not batch.aux:
            ids, logits, loss_sum, start = batch.group["input_ids"], [], 0.0, 0
            positions = batch.group["position_ids"] if _takes_position_ids(model) else None
            for i, n in enumerate(batch.doc_lens):
                doc = {"input_ids": ids[:, start : start + n]}
                if positions is not None:  # the packed row's own positions: not every model's default
                    doc["position_ids"] = positions[:, start : start + n]
                with float32 if i == 0 else nullcontext():
                    out = _call(model, doc, False)
                loss = _lm_loss(out.logits, batch.targets[:, start : start + n], batch.count)
                loss.backward()
                loss_sum += float(loss.detach())
                logits.append(out.logits.detach())
                start += n
            ref.update(loss=loss_sum, aux=None, grads=_grads(model), logits=torch.cat(logits, dim=1))
            try:  # some models' masks ignore position_ids: their own packed run attends across documents
                with torch.no_grad():
                    ref["packed_logits"] = _call(model, batch.unlabelled(), False).logits.detach()
            except Exception:  # noqa: BLE001 - some reference paths cannot take a packed row
                ref["packed_logits"] = None
        elif batch.form == "packed":
            if packed_ref is None:
                raise Bucket("not buildable", "no reference of the packed form")
            with float32:
                out = _call(model, batch.unlabelled(), True)
            apart = _rel_err(out.logits.detach(), packed_ref["logits"])
            if apart > FLOAT32_TOL:
                raise Bucket("not buildable", f"the model's own {model.config._attn_implementation} attends across the "
                                              f"packed documents (logits {apart:.1e} from per document): no one-batch "
                                              "reference of the aux loss")
            if out.aux_loss is None:
                return {"no_aux": True}
            (AUX_COEF * out.aux_loss.double()).backward()
            ref.update(loss=packed_ref["loss"] + AUX_COEF * float(out.aux_loss.detach()),
                       aux=float(out.aux_loss.detach()), grads=packed_ref["grads"] + _grads(model),
                       logits=packed_ref["logits"])
        else:
            with float32:
                out = _call(model, batch.unlabelled(), batch.aux)
            if batch.aux and out.aux_loss is None:
                return {"no_aux": True}
            loss, aux = _objective(out, batch.targets, batch.count, batch.aux)
            loss.backward()
            ref.update(loss=float(loss.detach()), aux=aux, grads=_grads(model), logits=out.logits.detach())
    except Bucket:
        raise
    except Exception as e:  # noqa: BLE001
        raise Bucket("not buildable", f"the {model.config._attn_implementation} reference does not run on this "
                                      f"form: {_message(e)}") from e
    if spy.calls:
        raise AssertionError(f"set_attn_implementation({model.config._attn_implementation!r}) left the model on {IMPL}")
    ref["float32"] = sorted(float32.ops)
    return ref


def _run_path(model, batch: Batch, path: str, rank: int, group, spy) -> dict:
    """One path of one form in this process: this process's loss share, aux, gradients (and logits: plain)."""
    model.zero_grad()
    spy.calls = 0
    one = path.endswith("/1")
    if path == "plain":
        out = _call(model, batch.unlabelled(), batch.aux)
        loss, aux = _objective(out, batch.targets, batch.count, batch.aux)
        loss.backward()
        if spy.calls == 0:
            modules = _attention_modules(model)
            raise Bucket("no attention interface",
                         f"its attention modules ({', '.join(modules[:3])}) never call the attention interface: {IMPL} "
                         "is accepted and ignored" if modules else f"no attention module, {IMPL} never called")
        return {"loss": float(loss.detach()), "aux": aux, "grads": _grads(model), "logits": out.logits.detach()}
    if path.startswith("hook"):
        kwargs = batch.group if one else batch.ranks[rank]
        local = {}
        installed = _install_like_callback(model, group)
        try:
            capture = model.register_forward_pre_hook(lambda m, a, kw: local.update(kw), with_kwargs=True)
            try:
                out = _call(model, kwargs, batch.aux, use_cache=None)
            finally:
                capture.remove()
            loss, aux = _objective(out, local["shift_labels"], local["num_items_in_batch"], batch.aux)
            loss.backward()
        finally:
            for handle in installed:
                handle.remove()
    else:  # shard_batch of the group's packed row, then model(**local), as scripts/bench_train.py runs it
        plan = plan_for(PackedBatch.from_doc_lens(batch.doc_lens), BACKEND, group)
        local = shard_batch({k: batch.group[k] for k in ("input_ids", "position_ids")}, plan, 0 if one else rank,
                            group)
        out = _call(model, local, batch.aux, use_cache=None)
        loss, aux = _objective(out, local["shift_labels"], local["num_items_in_batch"], batch.aux)
        loss.backward()
    return {"loss": float(loss.detach()), "aux": aux, "grads": _grads(model)}


def _paths(batch: Batch) -> tuple[str, ...]:
    return PATHS if batch.form == "packed" else tuple(p for p in PATHS if not p.startswith("shard_batch"))


def _owner(batch: Batch) -> int:
    """The process that computes a form's reference and its one-process paths: packed (whose aux form reuses its
    reference) and rows on the first, padded rows on the second, about as many runs each."""
    return 0 if batch.form in ("packed", "rows") else 1


def _compare(got: dict, ref: dict, names: list[str], numels: list[int], path: str, batch: Batch) -> dict:
    """The errors of one cell against its reference, and the numbers behind them."""
    cell = {"loss": abs(got["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-30),
            "got_loss": got["loss"], "ref_loss": ref["loss"], "got_aux": got["aux"], "ref_aux": ref["aux"]}
    cell["grads"], cell["worst_grad"] = _grad_err(got["grads"], ref["grads"], names, numels)
    if path == "plain":  # the other paths' logits are shards in their plan's order
        logits, want = got["logits"], ref["logits"]
        real = batch.group.get("attention_mask")
        if real is not None:  # what a padding query that sees no key gives is each attention's own convention
            logits, want = logits[real.bool()], want[real.bool()]
        cell["logits"] = _rel_err(logits, want) if logits.shape == want.shape else float("inf")
        if batch.form == "packed" and logits.shape == want.shape:
            first = batch.doc_lens[0]
            cell["first_doc"] = _rel_err(logits[:, :first], want[:, :first])
            if ref.get("packed_logits") is not None:
                cell["packed_sdpa"] = _rel_err(logits, ref["packed_logits"])
                cell["sdpa_apart"] = _rel_err(ref["packed_logits"], want)
    return cell


def _classify(cell: dict, tol: float) -> dict:
    """passed, or failed with the numbers that differ."""
    if "bucket" in cell:
        return cell
    if cell.get("sdpa_apart", 0.0) > tol and cell.get("packed_sdpa", float("inf")) <= tol:
        # the model's own attention never sees the packed documents: plain longctx equals that
        return {**cell, "bucket": "passed", "reason": "packed documents attend to each other, exactly as the model's "
                                                      "own attention (its mask ignores position_ids)"}
    bad = [k for k in ("loss", "grads", "logits") if cell.get(k, 0.0) > tol]
    if (cell["got_aux"] is None) != (cell["ref_aux"] is None):
        bad.append("aux")
    if not bad:
        return {**cell, "bucket": "passed", "reason": ""}
    parts = [f"loss {cell['loss']:.1e} (got {cell['got_loss']:.10g}, want {cell['ref_loss']:.10g})"]
    if cell["got_aux"] is not None or cell["ref_aux"] is not None:
        parts.append(f"aux_loss got {cell['got_aux']}, want {cell['ref_aux']}")
    parts.append(f"grads {cell['grads']:.1e} (worst {cell['worst_grad']})")
    if "logits" in cell:
        parts.append(f"logits {cell['logits']:.1e}")
        if cell["logits"] > tol and cell.get("first_doc", 1.0) <= tol:
            parts.append("first document exact, later ones differ: documents not kept apart")
    return {**cell, "bucket": "failed", "reason": "; ".join(parts)}


def _one_process_cells(model, reference: str, batch: Batch, rank: int, spy, single, refs: dict, float32: set,
                       names: list[str], numels: list[int], summed: dict | None = None) -> dict:
    """A form's reference (kept in ``refs``) and its cells: the one-process paths run here, the 2-process sums
    (``summed``) compared. ``"model"`` names an ending of the whole model (its packed reference or its plain
    packed run)."""
    out: dict[str, dict] = {}
    model.set_attn_implementation(reference)
    try:
        ref = refs[batch.name] = _reference(model, batch, spy, refs.get("packed"))
    except Bucket as b:
        if batch.name == "packed" and b.bucket == "not buildable":
            out["model"] = {"bucket": b.bucket, "reason": b.reason}
        return out | {f"{batch.name} {p}": {"bucket": b.bucket, "reason": f"reference: {b.reason}"}
                      for p in _paths(batch)}
    finally:
        model.set_attn_implementation(IMPL)
    if ref.get("no_aux"):
        return {f"{batch.name} -": {"no_aux": True}}
    float32.update(ref["float32"])
    for path in _paths(batch):
        key = f"{batch.name} {path}"
        if path.endswith("/2"):
            if key in summed:
                out[key] = _compare(summed[key], ref, names, numels, path, batch)
            continue
        try:
            got = _run_path(model, batch, path, rank, single, spy)
        except Exception as e:  # noqa: BLE001
            if isinstance(e, Bucket) and e.bucket == "no attention interface" and key == "packed plain":
                out["model"] = {"bucket": e.bucket, "reason": e.reason}
            out[key] = _cell_error(e)
            continue
        out[key] = _compare(got, ref, names, numels, path, batch)
    return out


def _check_model(rank: int, world: int, model_type: str, class_name: str, spy, singles: list) -> dict:
    """Every (form, path) cell of one model; the same dict on every process."""
    model, reference = _build(model_type, class_name)
    names = [n for n, _ in model.named_parameters()]
    numels = [p.numel() for p in model.parameters()]
    try:
        model.set_attn_implementation(IMPL)
    except (ValueError, NotImplementedError) as e:
        raise Bucket("refused", f"set_attn_implementation: {_message(e)}") from e
    pad = _pad_id(model.config)
    batches = [_batch(form, aux, pad) for aux in ((False, True) if _has_router_aux(model.config) else (False,))
               for form in FORMS]
    cells: dict[str, dict] = {}
    summed: dict[str, dict] = {}

    # the 2-process paths: every process runs its rows, the group's sums compare with one process's reference
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
    for batch in batches:
        for path in (p for p in _paths(batch) if p.endswith("/2")):
            key = f"{batch.name} {path}"
            try:
                got, status = _run_path(model, batch, path, rank, group, spy), None
            except Exception as e:  # noqa: BLE001
                got, status = None, _cell_error(e)
            statuses = [None] * world
            dist.all_gather_object(statuses, status)  # the default group: a broken model group cannot hang it
            if all(s is None for s in statuses):
                vec = torch.cat([got["grads"], torch.tensor([got["loss"], got["aux"] or 0.0], dtype=torch.float64)])
                dist.all_reduce(vec, group=group)
                summed[key] = {"grads": vec[:-2], "loss": float(vec[-2]),
                               "aux": float(vec[-1]) if got["aux"] is not None else None}
                continue
            ended = [(k, s) for k, s in enumerate(statuses) if s is not None]
            first = ended[0][1]
            others = [f"(rank {k}: {s['bucket']}: {s['reason']})" for k, s in ended[1:]
                      if (s["bucket"], s["reason"]) != (first["bucket"], first["reason"])]
            cells[key] = {**first, "reason": " ".join([first["reason"], *others])}
            dist.destroy_process_group(group)  # a rank may have left a collective behind: a fresh group
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
    dist.destroy_process_group(group)

    # each form's reference and one-process paths, on the process that owns the form
    mine: dict[str, dict] = {}
    refs: dict[str, dict] = {}
    float32: set[str] = set()
    for batch in batches:
        if _owner(batch) % world != rank:
            continue
        try:
            mine.update(_one_process_cells(model, reference, batch, rank, spy, singles[rank], refs, float32,
                                           names, numels, summed))
        except Exception as e:  # noqa: BLE001 - no peer waits on this process here: the cells end, the sweep goes on
            for path in _paths(batch):
                mine.setdefault(f"{batch.name} {path}", _cell_error(e))
    everyone = [None] * world
    dist.all_gather_object(everyone, {"cells": mine, "float32": sorted(float32)})
    for part in everyone:
        cells.update(part["cells"])
        float32.update(part["float32"])
    model_end = cells.pop("model", None)
    no_aux = {k.split(" ")[0] for k, v in cells.items() if v.get("no_aux")}
    if model_end is not None:
        raise Bucket(model_end["bucket"], model_end["reason"])
    tol = FLOAT32_TOL if float32 else TOL
    by_form: dict[str, dict] = {}
    for batch in batches:
        if batch.name in no_aux:
            continue
        for path in _paths(batch):
            cell = _classify(cells.get(f"{batch.name} {path}", {"bucket": "failed", "reason": "no result"}), tol)
            if float32 and cell["bucket"] == "failed" and "reason" in cell and "got_loss" in cell:
                cell["reason"] += f"; float32 inside ({', '.join(sorted(float32)[:3])}): tolerance {FLOAT32_TOL:g}"
            by_form.setdefault(batch.name, {})[path] = {k: cell[k] for k in ("bucket", "reason", "trace") if k in cell}
    return {"reference": reference, "float32": sorted(float32), "cells": by_form}


def _model_bucket(cells: dict) -> str:
    found = {c["bucket"] for paths in cells.values() for c in paths.values()}
    return next(b for b in ("failed", "refused", "not buildable", "passed") if b in found or b == "passed")


def _run_one(rank, world, model_type, class_name, spy, singles) -> dict:
    """One model on every process: its cells, or the one bucket of a model that cannot be checked."""
    started = time.perf_counter()
    row = {"model_type": model_type, "class": class_name, "reference": None, "float32": [], "cells": {},
           "reason": ""}
    try:
        row.update(_check_model(rank, world, model_type, class_name, spy, singles))
        row["bucket"] = _model_bucket(row["cells"])
    except Bucket as b:
        row.update(bucket=b.bucket, reason=b.reason)
    except Exception as e:  # noqa: BLE001 - identical on every process: the model failed before its cells
        row.update(bucket="failed", reason=_message(e), trace=traceback.format_exc(limit=-3))
    row["seconds"] = time.perf_counter() - started
    return row


def _sweep_rank(rank: int, world: int, out_path: str, only: list[str] | None) -> None:
    torch.set_num_threads(1)
    spy = _AttentionSpy()
    singles = [dist.new_group([r], backend="gloo") for r in range(world)]  # the one-process groups
    rows = []
    started = time.perf_counter()
    for model_type, class_name in causal_lm_classes().items():
        if only and model_type not in only:
            continue
        rows.append(_run_one(rank, world, model_type, class_name, spy, singles))
        if rank == 0 and os.environ.get("HF_LONGCTX_SWEEP_VERBOSE"):
            r = rows[-1]
            bad = [f"{f} {p}" for f, paths in r["cells"].items() for p, c in paths.items() if c["bucket"] != "passed"]
            print(f"{r['seconds']:5.2f}s {r['bucket']:<22} {model_type} {r['reason'][:120]} {' | '.join(bad)[:200]}",
                  flush=True)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"rows": rows, "seconds": time.perf_counter() - started}, f)


def form_names(rows: list[dict]) -> list[str]:
    seen = {f for r in rows for f in r["cells"]}
    return [f + aux for aux in ("", "+aux") for f in FORMS if f + aux in seen]


def failing_cells(rows: list[dict]) -> list[tuple[str, str, str, str]]:
    """(model_type, form, path, reason) of every failed cell, and of every failed model (form and path '-')."""
    out = []
    for r in rows:
        if r["bucket"] == "failed" and not r["cells"]:
            out.append((r["model_type"], "-", "-", r["reason"]))
        for form, paths in r["cells"].items():
            out.extend((r["model_type"], form, p, c["reason"]) for p, c in paths.items() if c["bucket"] == "failed")
    return out


def markdown_report(rows: list[dict], seconds: float) -> str:
    counts = {b: sum(r["bucket"] == b for r in rows) for b in BUCKETS}
    forms = form_names(rows)
    lines = [f"# longctx_zigzag over every causal LM of transformers {transformers.__version__}, forms x paths", "",
             f"{len(rows)} classes, {seconds:.0f} s in the 2 processes; models (worst cell): "
             + ", ".join(f"{b}: {n}" for b, n in counts.items()), "",
             "Cells per form and path (passed / refused / not buildable / failed):", "",
             "| form | " + " | ".join(PATHS) + " |", "|---" * (len(PATHS) + 1) + "|"]
    for form in forms:
        tallies = []
        for path in PATHS:
            c = Counter(r["cells"][form][path]["bucket"] for r in rows if path in r["cells"].get(form, {}))
            tallies.append(" / ".join(str(c[b]) for b in CELL_BUCKETS) if c else "")
        lines.append(f"| {form} | " + " | ".join(tallies) + " |")
    lines += ["", "Each cell: passed, or the paths that did not pass (P passed, R refused, N not buildable, F failed).",
              "", "| model_type | class | bucket | ref | " + " | ".join(forms) + " | reason |",
              "|---" * (len(forms) + 5) + "|"]
    letter = {"passed": "P", "refused": "R", "not buildable": "N", "failed": "F"}
    for bucket in BUCKETS:
        for r in rows:
            if r["bucket"] != bucket:
                continue
            shown = []
            for form in forms:
                paths = r["cells"].get(form, {})
                if not paths:
                    shown.append("")
                elif all(c["bucket"] == "passed" for c in paths.values()):
                    shown.append("passed")
                else:
                    shown.append(" ".join(f"{p}:{letter[c['bucket']]}" for p, c in paths.items()))
            reason = r["reason"].replace("|", "\\|")
            lines.append(f"| {r['model_type']} | {r['class']} | {bucket} | {r.get('reference') or ''} | "
                         + " | ".join(shown) + f" | {reason} |")
    lines += ["", "## Cells that did not pass", ""]
    for r in rows:
        for form, paths in r["cells"].items():
            for p, c in paths.items():
                if c["bucket"] != "passed" or c["reason"]:
                    lines.append(f"- {r['model_type']} / {form} / {p}: {c['bucket']}: {c['reason']}")
    return "\n".join(lines) + "\n"


def test_every_causal_lm_equals_sdpa_in_every_form_and_path(tmp_path):
    only = [m for m in os.environ.get("HF_LONGCTX_SWEEP_ONLY", "").split(",") if m] or None
    out = tmp_path / "sweep.json"
    run_distributed(WORLD, _sweep_rank, str(out), only, timeout_s=900)
    data = json.loads(out.read_text())
    rows = data["rows"]
    report = markdown_report(rows, data["seconds"])
    if os.environ.get("HF_LONGCTX_SWEEP_REPORT"):
        with open(os.environ["HF_LONGCTX_SWEEP_REPORT"], "w") as f:
            f.write(report)
    print("\n" + report.split("\nEach cell:")[0])
    failed = failing_cells(rows)
    assert not failed, "\n".join(f"{m} / {form} / {path}: {reason}" for m, form, path, reason in failed)
