"""A forward call of few long blocks, run as chunks of its keys, gives the whole call's result, faster.

:mod:`hf_longctx.kernels.key_split`: one 128-row segment over 112K keys launches 32 forward blocks (one per head)
on an H200's 132 SMs under torch_flash, 32 under FlashAttention-4 (a KV head's 4 query heads packed, 32 rows each);
cut into chunks of its keys it fills them. Measured on an H200 in a W = 64 ProLong step with torch_flash: 3.2 ms
whole, 1.0 ms cut (``scripts/lab/bench_key_split.sh``). FlashAttention-4 has no split-KV forward on Hopper: the package
cuts it the same way, by the rule its launch grid declares. The backward takes the merged output and log-sum-exp,
so its gradients are those of the whole call.
"""

from __future__ import annotations

import pytest
import torch

from hf_longctx.kernels import attention_backward, attention_forward, fa4
from hf_longctx.kernels.key_split import KeySplit, plan_key_split
from hf_longctx.lab.cad.call_profile import segment_batch, time_call_phases
from hf_longctx.lab.cad.profiled import SegmentShape, launch_grid

pytestmark = pytest.mark.gpu

HEADS, KV_HEADS, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16
DEVICE = torch.device("cuda")


def _split(kernel: str) -> KeySplit:
    if kernel == "fa4" and not (fa4.is_installed() and fa4.launch_grid(HEAD_DIM) is not None):
        pytest.skip("FlashAttention-4 is not installed, or this GPU runs another of its kernels than Hopper's")
    grid = launch_grid(kernel, DEVICE, HEAD_DIM, shape=SegmentShape(HEADS, KV_HEADS, HEAD_DIM, DTYPE))
    return KeySplit.for_grid(grid)


@pytest.mark.parametrize("kernel", ["torch_flash", "fa4"])
@pytest.mark.parametrize("causal", [True, False])
def test_a_split_forward_gives_the_whole_calls_output_and_gradients(causal, kernel):
    shapes = [(128, 90000), (384, 70000), (200, 3000)]
    split = _split(kernel)
    assert plan_key_split([q for q, _ in shapes], [k for _, k in shapes], HEADS, split, causal) is not None
    cu_q, cu_k, max_q, max_k, q, k, v = segment_batch(shapes, HEADS, KV_HEADS, HEAD_DIM, DTYPE, DEVICE, seed=3)
    whole = attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, kernel=kernel)
    cut = attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, kernel=kernel, key_split=split)
    assert cut[0].dtype == whole[0].dtype and cut[1].dtype == whole[1].dtype
    torch.testing.assert_close(cut[0], whole[0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(cut[1], whole[1], atol=1e-3, rtol=1e-4)
    dout = torch.randn_like(q)
    grads = [attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal=causal,
                                kernel=kernel) for out, lse in (whole, cut)]
    for a, b in zip(*grads):
        torch.testing.assert_close(b.float(), a.float(), atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("kernel", ["torch_flash", "fa4"])
def test_few_rows_over_a_long_prefix_run_faster_split(kernel):
    split = _split(kernel)
    args = ([(128, 112000)], kernel, HEADS, KV_HEADS, HEAD_DIM, DTYPE, DEVICE)
    whole, _ = time_call_phases(*args, warmup=1, reps=5)
    cut, _ = time_call_phases(*args, warmup=1, reps=5, key_split=split)
    print(f"{kernel}: 128 rows over 112K keys, forward {whole:.3f} ms whole, {cut:.3f} ms cut")
    assert cut < 0.5 * whole, (whole, cut)
