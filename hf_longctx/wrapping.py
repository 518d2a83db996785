"""A module that wraps another in place without renaming its parameters.

Why. Replacing ``layer.mlp`` by a wrapper that holds the MLP as a child renames every parameter
(``layers.0.mlp.gate_proj.weight`` becomes ``layers.0.mlp.mlp.gate_proj.weight``): checkpoints stop
loading and everything that names parameters (optimizer groups, weight-decay lists, DDP's ignore
list, tensor-parallel plans, PEFT targets) breaks. :class:`InPlaceWrapper` shares the wrapped
module's parameter, buffer and child registries instead, so ``named_parameters()``,
``state_dict()``, ``load_state_dict()`` and ``get_submodule()`` are exactly the wrapped module's,
and attribute reads it does not know itself (``config``, ``act_fn``, ``num_experts``, ...) fall
through to the wrapped module. ``.to()`` or ``load_state_dict(assign=True)`` replacing a parameter
go through the shared registries, so the wrapped module always sees the current tensors.

Not carried over: state-dict hooks or a custom ``_load_from_state_dict`` registered on the wrapped
module itself (transformers' MLP and experts modules have none).

Used by :class:`hf_longctx.hf.TiledMLP` and :class:`hf_longctx.moe.ExpertParallelExperts`; it sits
below both so neither imports the other.
"""

from __future__ import annotations

from torch import nn


class InPlaceWrapper(nn.Module):
    """Base of wrappers that replace a module in its parent while keeping its parameter names.

    Subclasses call ``super().__init__(wrapped)`` and reach the wrapped module as ``self._wrapped``
    (it is not a registered child: registering it would add its name to every key).
    """

    def __init__(self, wrapped: nn.Module):
        super().__init__()
        object.__setattr__(self, "_wrapped", wrapped)
        object.__setattr__(self, "_parameters", wrapped._parameters)
        object.__setattr__(self, "_buffers", wrapped._buffers)
        object.__setattr__(self, "_non_persistent_buffers_set", wrapped._non_persistent_buffers_set)
        object.__setattr__(self, "_modules", wrapped._modules)
        self.training = wrapped.training

    def train(self, mode: bool = True):
        super().train(mode)
        self._wrapped.training = mode  # children are shared and already set
        return self

    def __getattr__(self, name: str):
        # parameters, buffers and children first (nn.Module), then the wrapped module's plain attributes
        try:
            return super().__getattr__(name)
        except AttributeError:
            wrapped = self.__dict__.get("_wrapped")
            if wrapped is None:
                raise
            return getattr(wrapped, name)
