"""Allocating AdamW's states before the first step: the step a benchmark times then holds them, and the
training it starts is the training a fresh optimizer would do, bit for bit."""

from __future__ import annotations

import pytest
import torch

from hf_longctx.hf.memory.optimizer_states import allocate_optimizer_states


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def _train(model, opt, steps: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(5, 8, generator=g)
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, amsgrad=True),
    lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False),
])
def test_allocated_states_leave_training_bitwise_unchanged(make):
    fresh_model, early_model = _model(), _model()
    fresh, early = make(fresh_model.parameters()), make(early_model.parameters())
    before = [p.detach().clone() for p in early_model.parameters()]
    allocate_optimizer_states(early)
    assert all(torch.equal(a, b) for a, b in zip(before, early_model.parameters())), "the weights moved"
    for p in early_model.parameters():
        state = early.state[p]
        assert torch.count_nonzero(state["exp_avg"]) == 0 and state["exp_avg"].shape == p.shape
        assert float(state["step"]) == 0 and p.grad is None
    for want, got in zip(_train(fresh_model, fresh), _train(early_model, early)):
        assert torch.equal(want, got)


def test_states_already_there_are_left_alone():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, steps=1)
    moments = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    allocate_optimizer_states(opt)
    assert all(torch.equal(m, opt.state[p]["exp_avg"]) for m, p in zip(moments, model.parameters()))


def test_an_optimizer_that_is_not_adam_is_refused():
    opt = torch.optim.SGD(_model().parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="Adam"):
        allocate_optimizer_states(opt)
