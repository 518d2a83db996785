"""CAD with key cuts on the GPU: rectangles in non-causal calls of torch's flash kernel, merged by log-sum-exp.

A key cut gives a task's first keys to another server as a rectangle (:mod:`hf_longctx.backends.cad.tasks`).
On the GPU the rectangles run in non-causal varlen calls of the same kernel, and the parts of a row meet in the
fp32 merge at its owner. Emulated over four ranks in bf16, every rank's outputs and q/k/v gradients stay as close
to an fp32 reference as the same batch scheduled without key cuts.
"""

from __future__ import annotations

import pytest
import torch

from hf_longctx.backends.cad.launch_cost import LaunchCostModel, PhaseTerms
from hf_longctx.backends.cad.runtime import prepare
from hf_longctx.kernels import attention_backward, attention_forward
from hf_longctx.kernels.launch import LaunchGrid
from hf_longctx.lab.emulation import emulate_step
from hf_longctx.layout import PackedBatch, shard_plan

pytestmark = pytest.mark.gpu

SMALL = LaunchCostModel(LaunchGrid(forward_tile=(16, 8), backward_tile=(8, 16), slots=4), 4,
                        PhaseTerms(1e-3, 1e-4, 2e-4, 1e-3, 0.0, 0.05), PhaseTerms(3e-3, 3e-4, 2e-4, 2e-3, 1e-2, 0.08))
DOC_LENS = [2400, 40, 33, 90, 12, 64, 25]  # the last rows of the first document see 2K keys


def test_key_cuts_on_torch_flash_are_as_close_to_fp32_as_whole_tasks():
    device = torch.device("cuda")
    batch = PackedBatch.from_doc_lens(DOC_LENS)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(batch.num_tokens, h, 64, generator=g, device=device, dtype=torch.bfloat16)
                     for h in (8, 2, 2, 8))
    cu = batch.cu_seqlens.tolist()
    f32 = [t.float() for t in (q, k, v, dout)]
    out, lse = attention_forward(*f32[:3], cu, cu, batch.max_seqlen, batch.max_seqlen, kernel="reference")
    want = (out, *attention_backward(f32[3], *f32[:3], out, lse, cu, cu, batch.max_seqlen, batch.max_seqlen,
                                     kernel="reference"))
    plan = shard_plan(batch, 4, "cad")
    errors = {}
    for cuts in (True, False):
        options = {"cost_model": SMALL, "eps": 0.01, "key_cuts": cuts}
        assert any(t.is_rect for t in prepare(plan, options).tasks) == cuts
        step = emulate_step(batch, 4, (q, k, v, dout), "cad", options=options, kernel="torch_flash",
                            keep_results=True)
        worst = [0.0] * 4  # largest error relative to the largest reference value, per tensor
        for r in step.ranks:
            idx = plan.local_indices(r.rank).to(device)
            for i, (got, ref) in enumerate(zip(r.results, want)):
                err = (got.float() - ref[idx]).abs().max() / ref.abs().max()
                worst[i] = max(worst[i], err.item())
        errors[cuts] = worst
    for name, with_cuts, whole in zip(("out", "dq", "dk", "dv"), errors[True], errors[False]):
        assert with_cuts < 0.02, (name, errors)  # bf16 rounding; a wrong merge is off by the order of the values
        assert with_cuts <= 2 * whole + 5e-3, (name, errors)
