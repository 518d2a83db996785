"""Every causal LM of the installed transformers, tiny and random in float64, through ``longctx_zigzag``.

For each class of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (one entry per class) a tiny config is built
from its config class (2 layers, 4 heads, 2 KV heads, small vocabulary, few small experts) and:

(a) one process, no callback, no sequence-parallel context: a packed row of several documents
    (``position_ids`` restarting at 0 per document, one document of a single token) gives the logits
    of SDPA run document by document (eager where the model has no SDPA path), and the gradients of
    the summed next-token loss;
(b) two gloo processes sharing the sequence through the package's input hook (each process brings
    its own packed row, the group trains on their concatenation, zigzag placement): the loss and every
    parameter gradient summed over the group equal SDPA per document in one process.

Both within 1e-9 relative error; 1e-5 for a model that rounds weight-dependent values to float32 inside
its own float64 forward (a norm's ``x.float()``, a router in float32), where the last-bit differences of
two exact attentions grow to float32 precision (such a row says so in the report).

Each model lands in one bucket: passed; refused (a ValueError or NotImplementedError raised by
hf_longctx, or by transformers when the model is loaded with or switched to the implementation: the
message is the reason); no attention interface (``longctx_zigzag`` was never called: state-space
models, and models whose attention modules bypass transformers' attention interface, which accept the
name and ignore it; the reason says which); not buildable (no tiny config or model could
be built from the config class, or the reference forward itself cannot run on token ids alone); not
importable (a missing optional dependency); failed (numbers differ, or any other exception). The test
fails when any model failed. ``HF_LONGCTX_SWEEP_REPORT=path.md`` writes the whole table as markdown.

One spawn of 2 processes runs the whole sweep: every model is built once per process.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import hf_longctx  # noqa: F401 - registers the attention implementations
from hf_longctx.hf.inputs import install_input_hook

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
TOL = 1e-9
FLOAT32_TOL = 1e-5  # models that round to float32 inside (see _Float32Inside)
# Each process brings one packed row; the group batch is their concatenation (36 tokens, 7 documents).
ROWS = ([7, 1, 9, 4], [5, 2, 8])
BUCKETS = ("passed", "refused", "no attention interface", "not buildable", "not importable", "failed")


class Bucket(Exception):
    """Ends the checks of one model in a bucket other than passed or failed."""

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


def _refusal_or_raise(e: Exception, stage: str):
    if isinstance(e, (ValueError, NotImplementedError)) and _raised_by_package(e):
        raise Bucket("refused", f"{stage}: {_message(e)}") from e
    raise e


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


def _next_token_loss(logits, ids, lens, targets: int):
    """Summed next-token cross-entropy of every document of a packed row, over ``targets``."""
    loss, start = 0.0, 0
    for n in lens:
        if n > 1:
            loss = loss + torch.nn.functional.cross_entropy(
                logits[0, start : start + n - 1].double(), ids[0, start + 1 : start + n], reduction="sum")
        start += n
    return loss / targets


def _grads(model) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in model.parameters()])


def _rel_err(got: torch.Tensor, ref: torch.Tensor, numels: list[int] | None = None) -> float:
    """Max |got - ref| relative to the largest reference value; per parameter when ``numels`` splits them
    (a parameter whose gradient is below 1e-6 of the largest one is measured against that 1e-6)."""
    if numels is None:
        return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
    floor = 1e-6 * float(ref.abs().max())
    err = 0.0
    for g, r in zip(got.split(numels), ref.split(numels)):
        if g.numel():
            err = max(err, float((g - r).abs().max() / max(float(r.abs().max()), floor, 1e-30)))
    return err


def _training_forward(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits of one document without a cache (a model whose forward takes no ``use_cache`` runs without it)."""
    try:
        return model(input_ids=ids, use_cache=False).logits
    except TypeError as e:
        if "use_cache" not in str(e):
            raise
        return model(input_ids=ids).logits


def _check_model(rank: int, world: int, model_type: str, class_name: str, group, spy) -> dict:
    """Both checks of one model in this process; the caller combines the processes' results."""
    result = {"reference": None, "a": None, "b_ok": False}
    model, reference = _build(model_type, class_name)
    result["reference"] = reference
    all_ids = torch.randint(3, VOCAB - 16, (1, sum(map(sum, ROWS))), generator=torch.Generator().manual_seed(1))
    offset = sum(sum(r) for r in ROWS[:rank])
    lens = ROWS[rank]
    ids = all_ids[:, offset : offset + sum(lens)]
    position_ids = torch.cat([torch.arange(n) for n in lens])[None]
    targets = sum(n - 1 for row in ROWS for n in row)  # of the whole group batch

    # reference: this process's documents one by one, plain attention, as a training step runs them: without a
    # cache (a model that calls one layer twice, as looped models do, would otherwise attend to the first
    # call's keys in the second)
    model.zero_grad()
    spy.calls = 0
    ref_logits, ref_loss, start = [], 0.0, 0
    try:
        for i, n in enumerate(lens):
            doc = ids[:, start : start + n]
            if i == 0:
                float32 = _Float32Inside()
                with float32:
                    logits = _training_forward(model, doc)
                result["float32"] = sorted(float32.ops)
            else:
                logits = _training_forward(model, doc)
            if n > 1:
                loss = _next_token_loss(logits, doc, [n], targets)
                loss.backward()
                ref_loss += float(loss.detach())
            ref_logits.append(logits.detach())
            start += n
    except Exception as e:  # noqa: BLE001
        raise Bucket("not buildable", f"the {reference} reference does not run on token ids alone: "
                                      f"{_message(e)}") from e
    if spy.calls:
        raise AssertionError(f"set_attn_implementation({reference!r}) left the model on {IMPL}")
    ref_logits = torch.cat(ref_logits, dim=1)
    ref_grads = _grads(model)
    result.update(ref_grads=ref_grads, ref_loss=ref_loss, numels=[p.numel() for p in model.parameters()])

    # transformers' own attention on the packed row: some models never see the documents (their mask ignores
    # position_ids), and then longctx_* must equal that, not the per-document reference
    try:
        with torch.no_grad():
            packed_ref = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits.detach()
    except Exception:  # noqa: BLE001 - some reference paths cannot take a packed mask: the comparison is moot
        packed_ref = None

    # (a) one process: the packed row through longctx_zigzag, no context, no group
    try:
        model.set_attn_implementation(IMPL)
    except (ValueError, NotImplementedError) as e:
        raise Bucket("refused", f"set_attn_implementation: {_message(e)}") from e
    model.zero_grad()
    spy.calls = 0
    try:
        # use_cache=False: transformers itself separates packed documents only without a cache
        logits = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits
        _next_token_loss(logits, ids, lens, targets).backward()
    except Exception as e:  # noqa: BLE001
        _refusal_or_raise(e, "one process")
    if spy.calls == 0:
        modules = _attention_modules(model)
        if modules:
            raise Bucket("no attention interface", f"its attention modules ({', '.join(modules[:3])}) never call "
                                                    f"the attention interface: {IMPL} is accepted and ignored")
        raise Bucket("no attention interface", f"no attention module, {IMPL} never called")
    logits = logits.detach()
    per_doc, start = [], 0
    for n in lens:
        per_doc.append(_rel_err(logits[:, start : start + n], ref_logits[:, start : start + n]))
        start += n
    result["a"] = {"logits": _rel_err(logits, ref_logits),
                   "packed_sdpa": _rel_err(logits, packed_ref) if packed_ref is not None else float("inf"),
                   "sdpa_packed_apart": _rel_err(packed_ref, ref_logits) if packed_ref is not None else 0.0,
                   "grads": _rel_err(_grads(model), ref_grads, result["numels"]),
                   "first_doc": per_doc[0], "later_docs": max(per_doc[1:])}

    # (b) sequence parallel over the group through the input hook
    model.zero_grad()
    local = {}
    hook = None
    try:
        hook = install_input_hook(model, group)
        capture = model.register_forward_pre_hook(lambda m, a, kw: local.update(kw), with_kwargs=True)
        try:
            out = model(input_ids=ids, position_ids=position_ids, labels=ids)
        finally:
            capture.remove()
        loss = torch.nn.functional.cross_entropy(out.logits[0].double(), local["shift_labels"][0],
                                                 ignore_index=-100, reduction="sum") / local["num_items_in_batch"]
        loss.backward()
    except Exception as e:  # noqa: BLE001
        try:
            _refusal_or_raise(e, "sequence parallel")
        except Bucket as b:
            rotary = sorted({type(m).__name__ for m in model.modules() if "rotary" in type(m).__name__.lower()})
            if "rotary" in b.reason and rotary:
                b.reason += f" [the model has {', '.join(rotary)}]"
            raise
    finally:
        if hook is not None:
            hook.remove()
    result["b_ok"] = True
    result["b_loss"] = float(loss.detach())
    result["b_grads"] = _grads(model)
    return result


def _run_one(rank, world, model_type, class_name, spy) -> dict:
    """One model on every process: the bucket, the reason or errors; identical on every process."""
    started = time.perf_counter()
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
    local = {"bucket": None, "reason": ""}
    result = {}
    try:
        result = _check_model(rank, world, model_type, class_name, group, spy)
    except Bucket as b:
        local = {"bucket": b.bucket, "reason": b.reason}
    except Exception as e:  # noqa: BLE001
        local = {"bucket": "failed", "reason": _message(e), "trace": traceback.format_exc(limit=-3)}
    status = [None] * world
    dist.all_gather_object(status, {**local, "a": result.get("a"), "reference": result.get("reference"),
                                    "b_ok": result.get("b_ok", False),
                                    "float32": result.get("float32")})
    dist.destroy_process_group(group)
    row = {"model_type": model_type, "class": class_name, "reference": status[0]["reference"],
           "float32": status[0]["float32"] or [], "seconds": 0.0}
    ended = [s for s in status if s["bucket"] is not None]
    a = [s["a"] for s in status if s["a"] is not None]
    if a:
        row["a_logits"] = max(x["logits"] for x in a)
        row["a_grads"] = max(x["grads"] for x in a)
        row["a_first_doc"] = max(x["first_doc"] for x in a)
        row["a_later_docs"] = max(x["later_docs"] for x in a)
        row["a_packed_sdpa"] = max(x["packed_sdpa"] for x in a)
        row["sdpa_packed_apart"] = max(x["sdpa_packed_apart"] for x in a)
    if ended:
        first = ended[0]  # the lowest rank's; another rank's different ending is added to the reason
        others = [f"(rank {k}: {s['bucket']}: {s['reason']})" for k, s in enumerate(status)
                  if s["bucket"] is not None and (s["bucket"], s["reason"]) != (first["bucket"], first["reason"])]
        row.update(bucket=first["bucket"], reason=" ".join([first["reason"], *others]), trace=first.get("trace", ""))
    else:  # every process ran both checks: sum the group's loss and gradients, and the reference's
        n = result["ref_grads"].numel()
        summed = torch.cat([result["ref_grads"], result["b_grads"],
                            torch.tensor([result["ref_loss"], result["b_loss"]], dtype=torch.float64)])
        dist.all_reduce(summed)
        ref_loss, b_loss = summed[2 * n :]
        row["b_loss"] = abs(float(b_loss - ref_loss)) / max(abs(float(ref_loss)), 1e-30)
        row["b_grads"] = _rel_err(summed[n : 2 * n], summed[:n], result["numels"])
        tol = FLOAT32_TOL if row["float32"] else TOL
        as_transformers = row["sdpa_packed_apart"] > tol and row["a_packed_sdpa"] <= tol
        if as_transformers:  # one process: documents attended together, as the model's own sdpa attends them
            row["a_logits"], row["a_grads"] = row["a_packed_sdpa"], 0.0
        worst = max(row["a_logits"], row["a_grads"], row["b_loss"], row["b_grads"])
        row.update(bucket="passed" if worst <= tol else "failed", reason="" if worst <= tol else _diagnosis(row, tol))
        if as_transformers and worst <= tol:
            row["reason"] = ("one process: packed documents attend to each other, exactly as the model's own sdpa "
                             "(its mask ignores position_ids); sequence parallel: documents apart")
        if row["float32"] and worst > TOL:
            row["reason"] = "; ".join(x for x in (row["reason"], f"float32 inside ({', '.join(row['float32'][:3])}): "
                                                                   f"tolerance {FLOAT32_TOL:g}") if x)
    row["seconds"] = time.perf_counter() - started
    return row


def _diagnosis(row: dict, tol: float) -> str:
    """The numbers that differ, and what that pattern usually means."""
    parts = [f"{k}={row[k]:.1e}" for k in ("a_logits", "a_grads", "b_loss", "b_grads") if row.get(k) is not None]
    if row.get("a_logits", 0) > tol and row.get("a_first_doc", 1) <= tol:
        parts.append("first document exact, later ones differ: documents not kept apart in one process")
    elif row.get("a_logits", 0) <= tol and row.get("a_grads", 0) <= tol:
        parts.append("one process exact, sequence parallel differs")
    return "; ".join(parts)


def _sweep_rank(rank: int, world: int, out_path: str, only: list[str] | None) -> None:
    torch.set_num_threads(1)
    spy = _AttentionSpy()
    rows = []
    started = time.perf_counter()
    for model_type, class_name in causal_lm_classes().items():
        if only and model_type not in only:
            continue
        rows.append(_run_one(rank, world, model_type, class_name, spy))
        if rank == 0 and os.environ.get("HF_LONGCTX_SWEEP_VERBOSE"):
            r = rows[-1]
            print(f"{r['seconds']:5.2f}s {r['bucket']:<22} {model_type} {r['reason'][:160]}", flush=True)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"rows": rows, "seconds": time.perf_counter() - started}, f)


def _fmt(value) -> str:
    return "" if value is None else f"{value:.1e}"


def markdown_report(rows: list[dict], seconds: float) -> str:
    counts = {b: sum(r["bucket"] == b for r in rows) for b in BUCKETS}
    lines = [f"# longctx_zigzag over every causal LM of transformers {transformers.__version__}", "",
             f"{len(rows)} classes, {seconds:.0f} s in the 2 processes: "
             + ", ".join(f"{b}: {n}" for b, n in counts.items()), "",
             "(a) one process, packed row vs SDPA per document: logits / gradients; (b) 2 processes sequence "
             "parallel vs one process: loss / gradients. Max relative errors.", "",
             "| model_type | class | bucket | ref | (a) logits | (a) grads | (b) loss | (b) grads | reason |",
             "|---|---|---|---|---|---|---|---|---|"]
    for bucket in BUCKETS:
        for r in rows:
            if r["bucket"] == bucket:
                reason = r["reason"].replace("|", "\\|")
                lines.append(f"| {r['model_type']} | {r['class']} | {bucket} | {r.get('reference') or ''} | "
                             f"{_fmt(r.get('a_logits'))} | {_fmt(r.get('a_grads'))} | {_fmt(r.get('b_loss'))} | "
                             f"{_fmt(r.get('b_grads'))} | {reason} |")
    return "\n".join(lines) + "\n"


def test_every_causal_lm_equals_sdpa_per_document_in_one_and_two_processes(tmp_path):
    only = [m for m in os.environ.get("HF_LONGCTX_SWEEP_ONLY", "").split(",") if m] or None
    out = tmp_path / "sweep.json"
    run_distributed(2, _sweep_rank, str(out), only, timeout_s=900)
    data = json.loads(out.read_text())
    rows = data["rows"]
    report = markdown_report(rows, data["seconds"])
    if os.environ.get("HF_LONGCTX_SWEEP_REPORT"):
        with open(os.environ["HF_LONGCTX_SWEEP_REPORT"], "w") as f:
            f.write(report)
    print("\n" + report.split("\n| model_type")[0])
    failed = [r for r in rows if r["bucket"] == "failed"]
    assert not failed, "\n".join(f"{r['class']}: {r['reason']}" for r in failed)
