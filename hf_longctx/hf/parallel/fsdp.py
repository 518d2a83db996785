"""FSDP2 (``torch.distributed.fsdp.fully_shard``) through accelerate, beside sequence parallelism.

What runs. ``accelerate launch`` with ``distributed_type: FSDP`` and ``fsdp_config: {fsdp_version: 2}``
makes the Trainer's ``accelerator.prepare(model, optimizer)`` call ``fully_shard`` on every decoder
layer (``TRANSFORMER_BASED_WRAP``: the model's ``_no_split_modules``), on the embedding, on the tail
(final norm + output head) and on the root, in place: the model the Trainer and
:class:`~hf_longctx.LongContextCallback` see is the same object, now an ``FSDPModule``. Its
parameters are ``DTensor`` shards; each unit all-gathers them in its pre-forward hook and
reduce-scatters their gradients after its backward. The callback's input hook is prepended to the
root's pre-forward hooks (it shards the batch before FSDP touches it); the decoder layers stay
transformers' ``GradientCheckpointingLayer``, so recompute-aware checkpointing (a selective
checkpoint context that keeps ``hf_longctx::core_attention``) runs inside each FSDP unit, and FSDP's
pre-forward hook skips the all-gather during the recompute (its pre-backward hook already did it).

Mesh. Every rank of a sequence-parallel group holds the same weights and computes gradients of the
same parameters from different tokens, exactly like data-parallel ranks: the gradient of a step is
the sum over all dp x sp ranks. So parameters shard over ONE dimension spanning the whole world
(``dp_shard`` = dp x sp), and the gradients are reduced once, by FSDP's reduce-scatter over that
dimension, which averages over the world as DDP's all-reduce does (the loss contract of
:mod:`hf_longctx.hf.integration.inputs` makes that average exact). That is FSDP's default mesh (the default
process group), so nothing of ours is passed to ``fully_shard``. In accelerate's
``ParallelismConfig`` terms: ``dp_shard_size`` = world (= dp x sp here), ``dp_replicate_size`` 1
(HSDP, replicate x shard = world, is equally exact), ``tp_size`` 1, and ``cp_size`` / ``sp_size`` 1:
accelerate's cp is torch's own context parallelism and its sp DeepSpeed's Ulysses, both replaced by
the ``longctx_*`` backend, so they are refused beside it.

CPU. accelerate (1.15) turns FSDP on only for accelerator devices: on CPU its state becomes
``MULTI_CPU`` and the FSDP plugin is dropped, the model silently wrapped in DDP. torch's
``fully_shard`` itself runs on a CPU mesh with gloo, so :func:`enable_fsdp_on_cpu` sets accelerate's
state to FSDP (what accelerate does itself on GPUs) before the Trainer creates its accelerator; from
there accelerate's own FSDP2 path runs unchanged (``fsdp2_prepare_model``, gradient clipping over
DTensors, sharded checkpoints through ``torch.distributed.checkpoint``).

Refused by name, before any model is built (:func:`check_fsdp_launch`) and again at train begin
(:func:`check_fsdp_model`): FSDP version 1; ``fsdp_activation_checkpointing`` (plain layer
checkpointing that re-runs attention and its communication in backward: use the Trainer's
``activation_checkpointing``, which the callback makes recompute-aware); expert parallelism
(``ep_size`` / ``expert_tp_size`` > 1: the expert slices would need ``ignored_params`` and a norm
over DTensors and local slices together, which is not built); ``tiled_loss`` (accelerate shards the
final norm and output head as one group of two modules, and the loss's per-chunk recompute of the head
crashes inside autograd in backward; with the head in the root unit, :func:`fully_shard_model`, it runs);
accelerate's own cp / sp / tp axes; and an
FSDP launch whose model reached the callback unsharded. Tiled MLP and checkpoint offload work, and
``memory: auto`` plans FSDP2's memory as ZeRO-3's in the model's own dtype, without the tiled loss.
"""

from __future__ import annotations

import os

import torch

from ..settings.launcher import TRUE_TEXTS, launcher_fsdp_version, requested_fsdp_version
from ..settings.schema import ConfigError


def unsupported_with_fsdp(cfg) -> str | None:
    """What in the long-context settings cannot run under FSDP2 (a sentence naming the key), or None."""
    if cfg is None:
        return None
    if cfg.ep_size * cfg.expert_tp_size > 1:
        return (f"ep_size={cfg.ep_size}, expert_tp_size={cfg.expert_tp_size} under FSDP: expert parallelism runs under "
                "DDP only (FSDP would shard each rank's own expert slices as one tensor); use a DDP recipe, or "
                "ep_size: 1 and expert_tp_size: 1 with FSDP")
    if cfg.tiled_loss:
        return (f"tiled_loss={cfg.tiled_loss} under FSDP: accelerate shards the final norm and output head as one "
                "FSDP group of two modules, and the tiled loss's per-chunk recompute of the head crashes inside "
                "autograd in backward; set tiled_loss: 0 with FSDP, or use a DDP or DeepSpeed recipe for it")
    return None


def check_fsdp_launch(cfg, environ=None) -> None:
    """Raise a ConfigError naming the setting when an FSDP launch combines with something that cannot work."""
    env = os.environ if environ is None else environ
    version = launcher_fsdp_version(env)
    if version is None:
        return
    if version != 2:
        raise ConfigError(f"accelerate config: fsdp_version {version}: sequence parallelism composes with FSDP2 "
                          "(fully_shard) only; set fsdp_config: {fsdp_version: 2}")
    if env.get("FSDP_ACTIVATION_CHECKPOINTING", "false").strip().lower() in TRUE_TEXTS:
        raise ConfigError("accelerate config: fsdp_activation_checkpointing: true wraps every decoder layer in plain "
                          "checkpointing, which re-runs core attention and its communication in backward; set it to "
                          "false and keep the recipe's checkpointing (TrainingArguments(activation_checkpointing=True)"
                          ", made recompute-aware by LongContextCallback)")
    problem = unsupported_with_fsdp(cfg)
    if problem is not None:
        raise ConfigError(problem)


def enable_fsdp_on_cpu(args=None) -> bool:
    """On a CPU-only run launched for FSDP2, make accelerate's state FSDP before the Trainer builds its accelerator.

    Call with the run's ``TrainingArguments`` and before ``Trainer(...)``: their device set-up resets
    accelerate's state, so it runs first (or build the arguments afterwards with
    ``accelerator_config={"use_configured_state": True}``). Does nothing (returns False) unless the
    launcher asked for FSDP version 2, no GPU is present and several processes run; returns True
    when accelerate's state is FSDP afterwards.
    """
    if launcher_fsdp_version() != 2 or torch.cuda.is_available() or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return False
    if args is not None:
        args.device  # noqa: B018 - TrainingArguments' device set-up, which resets accelerate's state, first
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = AcceleratorState._shared_state
    if state and state.get("distributed_type") == DistributedType.FSDP:
        return True
    if state:
        raise RuntimeError("accelerate's state already exists (an Accelerator or Trainer was created first); call "
                           "enable_fsdp_on_cpu() before creating the Trainer")
    plugin = FullyShardedDataParallelPlugin()  # the launcher's FSDP_* settings
    Accelerator(cpu=True, fsdp_plugin=plugin)  # accelerate's own set-up on CPU: MULTI_CPU, plugin dropped
    AcceleratorState._shared_state.update(distributed_type=DistributedType.FSDP, fsdp_plugin=plugin)
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # as accelerate does on GPUs
    return True


def is_fsdp_model(model) -> bool:
    """Whether ``fully_shard`` was applied to ``model`` (FSDP2)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def fsdp_shard_size(model) -> int | None:
    """Ranks each parameter is sharded over (the product of its mesh's Shard dimensions); None if not FSDP2."""
    from torch.distributed.tensor import DTensor, Shard

    for p in model.parameters():
        if isinstance(p, DTensor):
            size = 1
            for dim, placement in enumerate(p.placements):
                if isinstance(placement, Shard):
                    size *= p.device_mesh.size(dim)
            return size
    return None


def check_fsdp_model(model, args, cfg) -> int | None:
    """At train begin: the FSDP layout the callback can serve, or a ValueError naming what to change.

    Returns the number of ranks the parameters are sharded over (None without FSDP).
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    version = requested_fsdp_version(args)
    sharded = is_fsdp_model(model)
    if version is None and not sharded:
        return None
    if version not in (None, 2) or (not sharded and any(type(m).__name__ == "FullyShardedDataParallel"
                                                         for m in model.modules())):
        raise ValueError(f"FSDP version {version}: sequence parallelism composes with FSDP2 (fully_shard) only; set "
                         "fsdp_config: {fsdp_version: 2} (accelerate) or fsdp_config={'version': 2} "
                         "(TrainingArguments)")
    if not sharded:
        raise ValueError("FSDP was asked for, but the model reached the Trainer unsharded: accelerate (1.15) runs FSDP "
                         "only on accelerators and falls back to DDP on CPU. On CPU call "
                         "hf_longctx.hf.enable_fsdp_on_cpu() after TrainingArguments and before Trainer(...)")
    if any(isinstance(m, CheckpointWrapper) for m in model.modules()):
        raise ValueError("fsdp_activation_checkpointing wrapped the decoder layers in plain checkpointing, which "
                         "re-runs core attention and its communication in backward; turn it off and set "
                         "TrainingArguments(activation_checkpointing=True): the callback makes it recompute-aware")
    problem = unsupported_with_fsdp(cfg)
    if problem is not None:
        raise ValueError(problem)
    return fsdp_shard_size(model)


def fully_shard_model(model, **kwargs):
    """FSDP2 without accelerate: ``fully_shard`` on every decoder layer, then on the root (embedding, final norm
    and output head stay in the root unit, where the tiled loss runs). ``kwargs`` go to ``fully_shard``
    (``mesh``: default the whole world, dp x sp). Returns the model, sharded in place."""
    from torch.distributed.fsdp import fully_shard
    from transformers.modeling_layers import GradientCheckpointingLayer

    for layer in [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model
