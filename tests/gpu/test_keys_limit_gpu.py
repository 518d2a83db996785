"""torch_flash's grouped-query backward slows down past its declared keys limit, and cutting a batch under it pays.

:func:`hf_longctx.kernels.torch_flash.backward_keys_limit`: with 32 query heads over 8 KV heads of 128 in bf16 the
kernel's per-head dK and dV pass 2 GiB at 262,144 keys, and the torch reduction that sums them into the KV heads
slows down. Measured on an H200: a 256-row segment's backward took 5% longer per key just past the limit than just
under it, and three segments over 1.2x the limit ran faster as the two calls a CAD server cuts them into than as
one (``scripts/lab/profile_cad.py --keys-limit``). If a torch release moves or removes the cliff, these fail: the
limit (and the calls it costs) must then follow.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hf_longctx.backends.cad.launch_cost import LaunchCostModel, PhaseTerms
from hf_longctx.kernels import torch_flash
from hf_longctx.kernels.launch import LaunchGrid
from hf_longctx.lab.cad.call_profile import check_keys_limit, time_call_phases

pytestmark = pytest.mark.gpu

HEADS, KV_HEADS, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16
LIMIT = torch_flash.backward_keys_limit(HEADS, KV_HEADS, HEAD_DIM, DTYPE.itemsize)


def backward_ms_per_key(keys: int) -> float:
    _, backward = time_call_phases([(256, keys)], "torch_flash", HEADS, KV_HEADS, HEAD_DIM, DTYPE,
                                   torch.device("cuda"), warmup=1, reps=5)
    return backward / keys


def test_the_backward_runs_slower_per_key_past_the_declared_limit():
    under, over = backward_ms_per_key(int(LIMIT * 0.95)), backward_ms_per_key(int(LIMIT * 1.05))
    assert over > 1.025 * under, (under, over)
    # well under the limit the cost per key is flat: the step is at the limit, not a slow drift
    assert backward_ms_per_key(int(LIMIT * 0.8)) == pytest.approx(under, rel=0.02)


def test_a_batch_over_the_limit_runs_faster_cut_under_it():
    # prices do not matter here beyond the call terms' limit: the cut is the one a server makes
    model = LaunchCostModel(replace(LaunchGrid(), backward_keys_limit=LIMIT), HEADS, PhaseTerms(),
                            PhaseTerms(call=0.03))
    batch = check_keys_limit(model, "torch_flash", KV_HEADS, HEAD_DIM, DTYPE, torch.device("cuda"), warmup=1,
                             reps=5)["batch"]
    assert len(batch["runs"]) == 2
    assert batch["cut_calls"] < 0.985 * batch["one_call"], batch
