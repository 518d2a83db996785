"""CAD's server calls timed inside emulated steps on this GPU: every call the servers make, the
backward's near its time alone.

:func:`hf_longctx.lab.emulation.step_calls.time_step_calls` feeds the launch model's last fit; a call missing, doubled
or timed with another call's work in it would move the model by what the profile never ran.
"""

from __future__ import annotations

import statistics
from collections import Counter

import pytest
import torch
from test_cad_step_calls import planned_step_calls

from hf_longctx.lab.cad.call_profile import time_call_phases
from hf_longctx.lab.emulation.step_calls import time_step_calls

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
BATCHES = (("sft", 65536, 8), ("prolong", 65536, 4))


def test_a_steps_calls_are_every_servers_calls_each_near_its_time_alone():
    options = {"cost_model": "flops", "eps": 0.1}
    timed = time_step_calls(options, "torch_flash", DEVICE, BATCHES, seeds=(3,), reps=2)
    assert Counter((c.phase, c.q_lens, c.k_lens) for c in timed) == planned_step_calls(BATCHES, 3, options)
    ratios = []
    for c in [c for c in timed if c.phase == "backward"][::3]:  # a sample, each timed again alone
        _, alone = time_call_phases(list(zip(c.q_lens, c.k_lens)), "torch_flash", 32, 8, 128, torch.bfloat16,
                                    DEVICE, reps=3)
        ratios.append(c.ms / alone)
    assert 0.8 < statistics.median(ratios) < 1.25, sorted(ratios)
