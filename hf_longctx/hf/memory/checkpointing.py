"""Recompute-aware gradient checkpointing (DistFlashAttn).

Plain checkpointing at the decoder-layer boundary re-runs the whole layer in backward, attention and
its communication included. Core attention is the most expensive part of a long-context layer and
its output is only (T, H, D) plus an fp32 log-sum-exp, so it is worth keeping: a selective
checkpointing policy marks the single ``hf_longctx::core_attention`` op MUST_SAVE and lets
everything else be recomputed (norms, projections, RoPE, MLP).

Both modes take ``offload=True``: what each layer keeps between forward and backward (its input and,
recompute-aware, its attention output) waits in pinned host memory instead (see :mod:`.offload`).
"""

from __future__ import annotations

import weakref
from functools import partial

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ...backends.op import core_attention  # noqa: F401 - registers torch.ops.hf_longctx.core_attention
from .decoder_layers import checkpointed_layers as _decoder_layers


def recompute_aware_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Keep distributed core attention, recompute the rest."""
    if op is torch.ops.hf_longctx.core_attention.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def recompute_aware_checkpointing_kwargs() -> dict:
    """``activation_checkpointing_kwargs`` for ``model.activation_checkpointing_enable`` / TrainingArguments
    (``gradient_checkpointing_*`` in transformers releases before the rename)."""
    return {"use_reentrant": False, "context_fn": partial(create_selective_checkpoint_contexts, recompute_aware_policy)}


def enable_recompute_aware_checkpointing(model, offload: bool = False) -> None:
    """Checkpoint every decoder layer but keep the core-attention output (and lse) of each.

    ``offload=True`` keeps those outputs and the layer inputs in pinned host memory between the passes.
    """
    enable_layer_checkpointing(model, recompute_aware_checkpointing_kwargs(), offload=offload)


def enable_layer_checkpointing(model, kwargs: dict | None = None, offload: bool = False) -> None:
    """Checkpoint every decoder layer through whichever entry point this transformers version has.

    ``offload=True`` swaps in :class:`~hf_longctx.hf.memory.checkpoint_offload.CheckpointOffloader` as each layer's
    checkpoint function (transformers' own ``offload`` flag copies synchronously on the compute
    stream and cannot reach the selective-checkpoint cache).
    """
    kwargs = kwargs or {"use_reentrant": False}
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support gradient checkpointing")
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if not offload:
        model.__dict__.pop("_hf_longctx_offloader", None)
        return
    from .checkpoint_offload import CheckpointOffloader

    offloader = CheckpointOffloader(keep_attention_outputs=kwargs.get("context_fn") is not None)
    function = partial(offloader, **kwargs)
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)
              and hasattr(m, "_gradient_checkpointing_func")]
    if not layers:
        raise RuntimeError(f"{type(model).__name__}: no checkpointed layer found to offload")
    for module in layers:
        module._gradient_checkpointing_func = function
    model._hf_longctx_offloader = offloader


def _plain_forward(module):
    """``module``'s forward without transformers' checkpointing wrapper (hooks stay outside, as transformers has it)."""
    forward = type(module).forward
    return partial(getattr(forward, "__wrapped__", forward), module)


class _GroupOutput:
    """The output of a group's checkpoint, waiting for the calls of the group's other layers to pass it on."""

    def __init__(self):
        self.output = None
        self.expected: list = []  # the members still to be called, in order

    def hand_over(self, output, members) -> None:
        self.output, self.expected = output, list(members)

    def take(self, member, hidden):
        """What ``member``'s call returns: the group's output, handed on unchanged, once per member and in order."""
        if not self.expected or self.expected[0] is not member or hidden is not self.output:
            raise RuntimeError(
                "group checkpointing: a decoder layer inside a checkpointed group was called, but not right after "
                "the layers before it in its group with their output; the decoder must call its layers in "
                "model order, once each per forward")
        self.expected.pop(0)
        if not self.expected:
            self.output = None  # the last member's call: nothing stays referenced here
        return hidden


class _GroupCheckpoint:
    """The checkpoint function of a group's first layer: its own forward and those of the group's other layers run
    as ONE checkpoint segment, so the group's input is all that waits for backward.

    Backward recomputes the whole group and then back-propagates it, holding the recomputed tensors of the
    group's lower layers while the upper ones are differentiated: memory traded for ``k`` times fewer checkpoints.
    The decoder loop is untouched: it then calls the other layers, which return the group's output (see
    :class:`_GroupMember`).
    """

    def __init__(self, checkpoint_function, members, handover: _GroupOutput):
        self.checkpoint_function, self.members, self.handover = checkpoint_function, list(members), handover

    def __call__(self, function, *args):
        keywords = function.keywords  # what the decoder passed to the first layer: the same for every layer

        def run(*inputs):
            hidden = function(*inputs)
            for member in self.members:
                hidden = _plain_forward(member)(hidden, **keywords)
            return hidden

        output = self.checkpoint_function(run, *args)
        self.handover.hand_over(output, self.members)
        return output


class _GroupMember:
    """The checkpoint function of a layer inside a group: its forward ran in the group's checkpoint already."""

    def __init__(self, member, handover: _GroupOutput):
        self.member, self.handover = weakref.ref(member), handover

    def __call__(self, function, hidden, *args):
        return self.handover.take(self.member(), hidden)


def _parse_choices(layers) -> list[tuple[str, bool]]:
    """``(mode, offload)`` per layer from strings or pairs, checked (groups: :func:`.settings.group_heads`)."""
    from ..settings.schema import GROUP_MODE, PER_LAYER_MODES, group_heads

    choices = [(c, False) if isinstance(c, str) else (c[0], bool(c[1])) for c in layers]
    for mode, offload in choices:
        if mode not in PER_LAYER_MODES:
            raise ValueError(f"unknown checkpointing {mode!r}; choose one of {PER_LAYER_MODES}")
        if offload and mode == "none":
            raise ValueError("a layer without checkpointing has no checkpoint to offload")
        if offload and mode == GROUP_MODE:
            raise ValueError("a 'group' layer has no checkpoint of its own: offload its group's first layer")
    group_heads([mode for mode, _ in choices])
    return choices


def enable_per_layer_checkpointing(model, layers) -> None:
    """Checkpoint each decoder layer its own way: ``layers[i]`` is ``(mode, offload)`` for layer ``i``.

    ``mode``: ``none`` (the layer keeps its activations), ``layer``, ``recompute_aware``, or ``group``: the
    layer joins the checkpoint of the ``layer`` layer below it (``layer``, ``group``, ``group``: one checkpoint
    for three layers, k times fewer checkpoints for a larger backward working set);
    ``offload``: that layer's checkpoint waits in pinned host memory (one
    :class:`~hf_longctx.hf.memory.checkpoint_offload.CheckpointOffloader` serves every offloaded layer, so the copies
    of those layers keep their side streams and the next offloaded layer is prefetched in backward).
    The layers that stay on the device use ``torch.utils.checkpoint`` as usual. Gradients are those
    of any other choice (the same operations run; only where tensors wait differs).
    """
    from torch.utils.checkpoint import checkpoint

    from ..settings.schema import GROUP_MODE, group_heads

    choices = _parse_choices(layers)
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support gradient checkpointing")
    decoder = _decoder_layers(model)
    if len(decoder) != len(choices):
        raise ValueError(f"{len(choices)} per-layer choices for the {len(decoder)} checkpointable layers of "
                         f"{type(model).__name__}")
    if any(mode != "none" for mode, _ in choices):
        enable_layer_checkpointing(model)  # transformers' own set-up (flags, PEFT input gradients)
    model.__dict__.pop("_hf_longctx_offloader", None)
    offloader = None
    if any(offload for _, offload in choices):
        from .checkpoint_offload import CheckpointOffloader

        offloader = model._hf_longctx_offloader = CheckpointOffloader(keep_attention_outputs=None)
    heads = group_heads([mode for mode, _ in choices])
    handover = _GroupOutput()
    for i, (module, (mode, offload)) in enumerate(zip(decoder, choices)):
        kwargs = recompute_aware_checkpointing_kwargs() if mode == "recompute_aware" else {"use_reentrant": False}
        module.gradient_checkpointing = mode != "none"
        function = partial(offloader if offload else checkpoint, **kwargs)
        members = [decoder[j] for j in range(i + 1, len(decoder)) if heads[j] == i]
        if mode == GROUP_MODE:
            function = _GroupMember(module, handover)
        elif members:
            function = _GroupCheckpoint(function, members, handover)
        module._gradient_checkpointing_func = function


def checkpointing_argument() -> str:
    """Name of the ``TrainingArguments`` field that turns activation checkpointing on in this transformers.

    transformers 5.x renamed ``gradient_checkpointing`` to ``activation_checkpointing``; the old name is
    a deprecated alias that warns (``FutureWarning``, to be removed in v6), so it is used only where
    the new one does not exist yet.
    """
    from transformers import TrainingArguments

    fields = getattr(TrainingArguments, "__dataclass_fields__", {})
    return "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"


def checkpointing_training_args(enabled: bool) -> dict:
    """``TrainingArguments`` keyword that turns activation checkpointing on or off, by its current name
    (:func:`checkpointing_argument`); :class:`~hf_longctx.hf.integration.callback.LongContextCallback` makes it
    recompute-aware."""
    return {checkpointing_argument(): enabled}
