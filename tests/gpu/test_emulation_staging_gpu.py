"""Emulated all_to_all send buffers staged on the host: the same results and bytes, less device memory.

One device emulating W ranks holds every rank's collective buffers at once, since every rank posts before any
all_to_all completes (CAD's backward returns fp32 key gradients for every gathered row). With
``stage_on_host`` the send buffers wait on the host, and a step must give bit for bit what it gives without.
"""

from __future__ import annotations

import pytest
import torch

from hf_longctx.emulation import emulate_step
from hf_longctx.layout import PackedBatch

pytestmark = pytest.mark.gpu


def test_staged_sends_change_nothing_but_the_device_peak():
    device = torch.device("cuda")
    batch = PackedBatch.from_doc_lens([24000, 3000, 700, 5000, 1200, 9000, 300])
    g = torch.Generator(device=device).manual_seed(0)
    tensors = tuple(torch.randn(batch.num_tokens, h, 128, generator=g, device=device, dtype=torch.bfloat16)
                    for h in (32, 8, 8, 32))
    steps, peaks = {}, {}
    for staged in (False, True):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        steps[staged] = emulate_step(batch, 8, tensors, "cad", options={"eps": 0.01}, kernel="torch_flash",
                                     keep_results=True, stage_on_host=staged)
        peaks[staged] = torch.cuda.max_memory_allocated(device) - base
    for plain, staged in zip(steps[False].ranks, steps[True].ranks):
        assert plain.traffic == staged.traffic
        for a, b in zip(plain.results, staged.results):
            assert torch.equal(a, b)
    assert peaks[True] < 0.8 * peaks[False], peaks
