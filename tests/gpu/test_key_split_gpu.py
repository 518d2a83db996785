"""A forward call of few long blocks, run by torch_flash as chunks of its keys, gives the whole call's result, faster.

:mod:`hf_longctx.kernels.key_split`: one 128-row segment over 112K keys launches 32 forward blocks (one per head)
on an H200's 132 SMs; cut into chunks of its keys it fills them. Measured on an H200 in a W = 64 ProLong step:
3.2 ms whole, 1.0 ms cut (``scripts/bench_key_split.sh``). The backward takes the merged output and log-sum-exp,
so its gradients are those of the whole call.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hf_longctx.backends.cad.call_profile import segment_batch, time_call_phases
from hf_longctx.kernels import attention_backward, attention_forward, torch_flash
from hf_longctx.kernels.key_split import KeySplit, plan_key_split

pytestmark = pytest.mark.gpu

HEADS, KV_HEADS, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16
DEVICE = torch.device("cuda")


def _split() -> KeySplit:
    grid = torch_flash.launch_grid(HEAD_DIM)
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    return KeySplit.for_grid(replace(grid, slots=sms))


@pytest.mark.parametrize("causal", [True, False])
def test_a_split_forward_gives_the_whole_calls_output_and_gradients(causal):
    shapes = [(128, 90000), (384, 70000), (200, 3000)]
    split = _split()
    assert plan_key_split([q for q, _ in shapes], [k for _, k in shapes], HEADS, split, causal) is not None
    cu_q, cu_k, max_q, max_k, q, k, v = segment_batch(shapes, HEADS, KV_HEADS, HEAD_DIM, DTYPE, DEVICE, seed=3)
    whole = attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, kernel="torch_flash")
    cut = attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, kernel="torch_flash", key_split=split)
    assert cut[0].dtype == whole[0].dtype and cut[1].dtype == whole[1].dtype
    torch.testing.assert_close(cut[0], whole[0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(cut[1], whole[1], atol=1e-3, rtol=1e-4)
    dout = torch.randn_like(q)
    grads = [attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal=causal,
                                kernel="torch_flash") for out, lse in (whole, cut)]
    for a, b in zip(*grads):
        torch.testing.assert_close(b.float(), a.float(), atol=5e-2, rtol=5e-2)


def test_few_rows_over_a_long_prefix_run_faster_split():
    args = ([(128, 112000)], "torch_flash", HEADS, KV_HEADS, HEAD_DIM, DTYPE, DEVICE)
    whole, _ = time_call_phases(*args, warmup=1, reps=5)
    cut, _ = time_call_phases(*args, warmup=1, reps=5, key_split=_split())
    assert cut < 0.5 * whole, (whole, cut)
