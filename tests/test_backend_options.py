"""A call's ``options`` tune its backend; a key the backend does not read is refused, naming the closest one,
before any collective: ignored, a misspelt option would run another configuration than the one asked for."""

from __future__ import annotations

import pytest
import torch

from hf_longctx.backends import get_backend, sequence_parallel_attention
from hf_longctx.emulation import emulate_step
from hf_longctx.layout import PackedBatch, shard_plan


def _call(backend: str, options: dict, world: int = 1):
    batch = PackedBatch.from_doc_lens([48, 16])
    plan = shard_plan(batch, world, get_backend(backend).default_strategy)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch.num_tokens, 4, 8, dtype=torch.float64, generator=gen) for _ in range(3))
    idx = plan.local_indices(0)
    return sequence_parallel_attention(q[idx], k[idx], v[idx], plan=plan, backend=backend, options=options, rank=0)


def test_a_misspelt_option_is_refused_with_the_name_it_resembles():
    with pytest.raises(ValueError, match=r"backend 'cad' has no option 'epss' \(did you mean 'eps'\?\); it takes eps"):
        _call("cad", {"epss": 0.01})
    with pytest.raises(ValueError, match=r"'pingpong_' \(did you mean 'pingpong'\?\)"):
        _call("cad", {"eps": 0.01, "pingpong_": False})


def test_an_option_for_another_backend_is_refused():
    with pytest.raises(ValueError, match="backend 'ring' has no option 'eps'; it takes none"):
        _call("ring", {"eps": 0.01})


def test_the_options_a_backend_declares_are_taken():
    reference = _call("cad", {})
    tuned = _call("cad", {"eps": 0.01, "pingpong": False, "key_cuts": False, "refine_screen": 0})
    torch.testing.assert_close(tuned, reference)  # exact attention whatever the schedule


def test_the_emulation_refuses_them_too():
    batch = PackedBatch.from_doc_lens([48, 16])
    tensors = tuple(torch.randn(batch.num_tokens, 4, 8, dtype=torch.float64) for _ in range(4))
    with pytest.raises(ValueError, match="backend 'cad' has no option 'eps_'"):
        emulate_step(batch, 2, tensors, "cad", options={"eps_": 0.01})

