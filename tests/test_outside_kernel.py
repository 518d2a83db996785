"""A kernel defined outside the package is registered here and runs wherever a built-in one runs.

``TracedReference`` is the reference kernel under another name that also records the calls it serves,
so a test can tell that the engine really ran it. It uses only the public contract
(:class:`~hf_longctx.kernels.KernelCall`, :func:`~hf_longctx.kernels.register_kernel`) and nothing
inside ``hf_longctx`` names it. It registers at import outside ``auto``'s order, so the other test
modules collected with this one keep the package's own choices; the tests that want it picked by
``auto`` put it first in the order and take it out again.

The last tests show that a kernel cannot be half registered: one without a backward is refused when
it registers, and a name nobody registered is an error naming the registered ones, never another kernel.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from hf_longctx.backends import sequence_parallel_attention
from hf_longctx.kernels import (
    KernelCall,
    attention_forward,
    auto_order,
    get_kernel,
    kernel_call,
    kernel_names,
    register_kernel,
    reset_stats,
    select_kernel,
    stats,
    unregister_kernel,
)
from hf_longctx.kernels import reference as package_reference
from hf_longctx.layout import shard_plan

from distributed import run_distributed

NAME = "traced_reference"


class TracedReference:
    """The reference kernel's numbers under the name ``traced_reference``; remembers each call's directions."""

    name = NAME

    def __init__(self) -> None:
        self.served: list[str] = []

    def supports(self, call: KernelCall) -> str | None:
        return None

    def forward(self, call: KernelCall) -> tuple[torch.Tensor, torch.Tensor]:
        self.served.append("forward")
        return package_reference.forward(call)

    def backward(self, call: KernelCall, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.served.append("backward")
        return package_reference.backward(call, dout, out, lse)


TRACED = register_kernel(TracedReference(), in_auto=False)


@contextlib.contextmanager
def first_in_auto():
    """``traced_reference`` is ``auto``'s first candidate inside the block, and only there."""
    register_kernel(TRACED, auto_before=auto_order()[0], replace=True)
    try:
        yield
    finally:
        register_kernel(TRACED, in_auto=False, replace=True)


def _problem():
    q = torch.randn(9, 4, 8, dtype=torch.float64)
    k, v = torch.randn(9, 2, 8, dtype=torch.float64), torch.randn(9, 2, 8, dtype=torch.float64)
    return q, k, v, [0, 4, 9]


def test_registered_by_name_and_not_an_auto_candidate_until_placed():
    q, k, v, cu = _problem()
    assert get_kernel(NAME) is TRACED and NAME in kernel_names()
    assert NAME not in auto_order(), "registered with in_auto=False: auto keeps the package's order"
    call = kernel_call(q, k, v, cu, cu, 5, 5)
    assert select_kernel(NAME, call) == NAME
    assert select_kernel("auto", call) == "reference"


def test_picked_by_name_it_computes_the_reference_numbers():
    q, k, v, cu = _problem()
    reset_stats()
    out, lse = attention_forward(q, k, v, cu, cu, 5, 5, kernel=NAME)
    want_out, want_lse = attention_forward(q, k, v, cu, cu, 5, 5, kernel="reference")
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    assert stats()[f"forward.{NAME}"] == 1


def test_auto_order_is_data_it_picks_the_first_that_serves():
    q, k, v, cu = _problem()
    call = kernel_call(q, k, v, cu, cu, 5, 5)
    with first_in_auto():
        assert auto_order()[0] == NAME
        assert select_kernel("auto", call) == NAME
    assert NAME not in auto_order() and select_kernel("auto", call) == "reference"


def check_zigzag_on_the_outside_kernel(rank: int, world: int) -> None:
    """zigzag under ``auto`` with the outside kernel first equals the single-device reference exactly."""
    from test_backends import make_problem, reference

    with first_in_auto():
        for seed in range(2):
            batch, q, k, v, dout = make_problem(seed * 7 + world, world, torch.float64)
            ref_out, ref_dq, ref_dk, ref_dv = reference(batch, q, k, v, dout)
            plan = shard_plan(batch, world, "zigzag")
            idx = plan.local_indices(rank)
            ql, kl, vl = (t[idx].clone().requires_grad_() for t in (q, k, v))
            TRACED.served.clear()
            out = sequence_parallel_attention(ql, kl, vl, plan=plan, backend="zigzag", kernel="auto")
            out.backward(dout[idx])
            assert "forward" in TRACED.served and "backward" in TRACED.served, "the engine ran the outside kernel"
            for name, got, want in (("out", out, ref_out), ("dq", ql.grad, ref_dq), ("dk", kl.grad, ref_dk),
                                    ("dv", vl.grad, ref_dv)):
                torch.testing.assert_close(got, want[idx], rtol=1e-12, atol=1e-12,
                                           msg=lambda m, n=name, s=seed: f"{n} rank {rank} seed {s}: {m}")


@pytest.mark.parametrize("world", [2, 3])
def test_zigzag_runs_on_it_like_the_single_device_reference(world):
    run_distributed(world, check_zigzag_on_the_outside_kernel)


class ForwardOnly:
    name = "forward_only"

    def supports(self, call: KernelCall) -> str | None:
        return None

    def forward(self, call: KernelCall) -> tuple[torch.Tensor, torch.Tensor]:
        return package_reference.forward(call)


def test_a_kernel_without_backward_is_refused_at_registration():
    """No dispatch path can miss a kernel: one that lacks a path never enters the registry."""
    with pytest.raises(TypeError, match="forward_only.*lacks backward"):
        register_kernel(ForwardOnly())
    assert "forward_only" not in kernel_names()


def test_an_unknown_name_is_an_error_naming_the_registered_kernels():
    q, k, v, cu = _problem()
    with pytest.raises(ValueError, match=f"unknown kernel 'flash9'.*reference.*{NAME}"):
        attention_forward(q, k, v, cu, cu, 5, 5, kernel="flash9")
    with pytest.raises(ValueError, match="unknown kernel 'flash9'"):
        unregister_kernel("flash9")


def test_a_name_is_registered_once():
    with pytest.raises(ValueError, match="already registered"):
        register_kernel(TracedReference())
    with pytest.raises(ValueError, match="must be lower-case"):
        register_kernel(type("Auto", (TracedReference,), {"name": "auto"})())
