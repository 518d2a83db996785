"""Head-parallel (tensor-parallel) attention through transformers' own tensor-parallel plan.

Attention heads are independent, so tensor parallelism over heads is exact: q/k/v projections are
split by columns (each rank computes its heads), the output projection by rows (each rank's partial
product, all-reduced). Core attention then sees only this rank's heads, so any ``longctx_*`` backend
composes with it unchanged: the sequence-parallel group of a (dp, sp, tp) mesh runs its schedule on
fewer heads, and the KV that travels between sequence-parallel ranks shrinks by tp.

transformers already ships this: every Llama-family config carries a ``base_model_tp_plan`` naming
the style of each projection (``colwise``/``rowwise``, and for Qwen3's per-head q/k norms a
replicated weight whose gradient is all-reduced), and
``transformers.distributed.tensor_parallel.apply_tensor_parallelism`` applies such a plan on a
DeviceMesh with DTensor parameters. It runs on gloo/CPU as on NCCL. We take the model's own plan,
keep only its attention entries (experts, MLPs and embeddings stay unsharded: experts go through
expert parallelism, see :mod:`hf_longctx.moe`), expand it to every layer and apply it on the mesh's
"tp" dimension. Gradients of the sharded projections are DTensors (``.full_tensor()`` gathers one).
"""

from __future__ import annotations

import re

from torch import nn

_LAYER_NUMBER = re.compile(r"\.(\d+)\.")


def _generic(name: str) -> str:
    return _LAYER_NUMBER.sub(".*.", name)


def head_parallel_plan(model: nn.Module) -> dict[str, str]:
    """Attention entries of the model's own tensor-parallel plan, one per module and parameter name."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    plan = {k: v for k, v in (getattr(config, "base_model_tp_plan", None) or {}).items() if ".self_attn." in k}
    if not plan:
        raise ValueError(f"{type(model).__name__}'s config has no tensor-parallel plan for its attention "
                         "(base_model_tp_plan with layers.*.self_attn.* entries)")
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    strip = f"{prefix}." if isinstance(base, nn.Module) and base is not model else ""
    expanded = {}
    for name, module in model.named_modules():
        style = plan.get(_generic(name[len(strip):] if name.startswith(strip) else name))
        if style is None:
            continue
        for param_name, _ in module.named_parameters(recurse=False):
            expanded[f"{name}.{param_name}"] = style
        expanded[name] = style
    return expanded


def apply_head_parallel_attention(model: nn.Module, tp_mesh) -> int:
    """Split every attention layer's heads over ``tp_mesh`` (1-D DeviceMesh); returns the modules sharded.

    Call it on every rank of the mesh with identical weights, before creating the optimizer. A mesh of
    one rank changes nothing.
    """
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    tp = tp_mesh.size()
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for what, heads in (("attention heads", config.num_attention_heads),
                        ("key/value heads", getattr(config, "num_key_value_heads", None))):
        if heads is not None and heads % tp:
            raise ValueError(f"{heads} {what} do not split over {tp} tensor-parallel ranks; tp_size must divide them")
    if tp == 1:
        return 0
    plan = head_parallel_plan(model)
    modules = dict(model.named_modules())
    apply_tensor_parallelism(model, tp_mesh, plan)
    return sum(1 for name in plan if name in modules)
