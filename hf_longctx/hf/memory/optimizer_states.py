"""Allocate AdamW's states before the first step, without changing what the first step does.

torch's optimizers create their states inside the first ``step()``, after the first backward: the first
forward and backward of a run run without them. A step measured then (a benchmark that times one step, to
fit a long one into a time limit) reports a GPU peak that is lower than every later step's by the size of
the states (30 GiB for an 8B model's bf16 AdamW), and a plan that fits only without them fails at the
second step. Allocating them up front makes the first step look like every other one.

How: one ``step()`` with zero gradients and a learning rate of 0 (AdamW then leaves every parameter as it
is: the decay factor is ``1 - lr * wd = 1`` and the update is ``lr * 0``), after which the step counters are
set back to 0 and the moments are zeros, exactly the states a fresh optimizer creates. The first real step
then computes what it would have computed anyway.
"""

from __future__ import annotations

import torch

from .adam_states import adam_states_of_class, host_optimizer_of

ADAM_STATE_KEYS = {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}


def _inner_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers that own states: an accelerate wrapper's, or each of the host-offload optimizer's."""
    host = host_optimizer_of(optimizer)
    if host is not None:
        return [o for o in (host.d_opt, *host.optim_dict.values()) if o is not None]
    return [getattr(optimizer, "optimizer", optimizer)]


def _parameters(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"] if p.requires_grad]


def _make_fresh(state: torch.Tensor) -> None:
    """Zero a state as a new optimizer creates it. torchao's quantized states are tensor subclasses: a fresh one has
    zero codes and zero scales beside its quantization map (``qmap``); quantizing zeros would not give that (4-bit
    maps have no exact 0), so their inner tensors are zeroed instead."""
    if type(state) in (torch.Tensor, torch.nn.Parameter):
        state.zero_()
        return
    names, _ = state.__tensor_flatten__()
    for name in names:
        if name != "qmap":
            getattr(state, name).zero_()


def allocate_optimizer_states(optimizer) -> None:
    """Create the (zero) states of an Adam-family optimizer now, as its first ``step()`` would.

    Accepts a torch Adam/AdamW, torchao's low-bit ones, an accelerate-wrapped one, or
    :class:`~hf_longctx.hf.memory.optimizer_offload.HostOffloadAdamW` (whose states are in host memory). Raises
    ValueError for an optimizer whose states are not Adam's: its first step could not be kept unchanged.
    """
    for opt in _inner_optimizers(optimizer):
        if adam_states_of_class(type(opt)) is None:
            raise ValueError(f"allocate_optimizer_states knows Adam's states; got {type(opt).__name__}")
        params = [p for p in _parameters(opt) if not opt.state.get(p)]
        if not params:
            continue
        grads = {p: p.grad for p in params}
        learning_rates = [group["lr"] for group in opt.param_groups]
        others = [p for p in _parameters(opt) if p not in grads]
        held = {p: p.grad for p in others}  # parameters that have states already sit this step out
        try:
            for p in params:
                p.grad = torch.zeros_like(p)
            for p in others:
                p.grad = None
            for group in opt.param_groups:
                group["lr"] = 0.0 if not isinstance(group["lr"], torch.Tensor) else torch.zeros_like(group["lr"])
            opt.step()
        finally:
            for group, lr in zip(opt.param_groups, learning_rates):
                group["lr"] = lr
            for p, g in {**grads, **held}.items():
                p.grad = g
        for p in params:
            state = opt.state[p]
            unknown = set(state) - ADAM_STATE_KEYS
            if unknown:
                raise ValueError(f"unexpected optimizer state {sorted(unknown)}: not Adam's")
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    _make_fresh(value)
                else:
                    state[key] = type(value)(0)
