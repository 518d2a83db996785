"""What each single-device attention kernel allocates beyond its inputs and outputs, measured on a GPU.

The measurement behind :mod:`hf_longctx.hf.memory.kernel_buffers` (``scripts/bench_kernel_memory.py`` prints it;
``tests/gpu/test_kernel_buffers_gpu.py`` holds the model to it).
"""

from __future__ import annotations

import torch

from hf_longctx.hf.memory.kernel_buffers import kernel_buffer_bytes
from hf_longctx.kernels import get_kernel
from hf_longctx.kernels.dispatch import kernel_call
from hf_longctx.layout import PackedBatch

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def measure_kernel_buffers(kernel: str, lens: list[int], device: torch.device) -> dict:
    """One forward and one backward of ``kernel`` on documents ``lens``: each pass's memory beyond its outputs."""
    packed = PackedBatch.from_doc_lens(lens)
    total, cu = packed.num_tokens, packed.cu_seqlens
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(heads: int) -> torch.Tensor:
        return torch.randn(total, heads, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)

    q, k, v = rand(HEADS), rand(KV_HEADS), rand(KV_HEADS)
    call = kernel_call(q, k, v, cu, cu, packed.max_seqlen, packed.max_seqlen, causal=True)
    impl = get_kernel(kernel)
    problem = impl.supports(call)
    if problem:
        return {"kernel": kernel, "error": problem}
    impl.forward(call)  # first-call costs (compiles, workspaces cached by the library) out of the window
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out, lse = impl.forward(call)
    torch.cuda.synchronize(device)
    forward_extra = torch.cuda.max_memory_allocated(device) - base - out.nbytes - lse.nbytes
    dout = rand(HEADS)
    impl.backward(call, dout, out, lse)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    dq, dk, dv = impl.backward(call, dout, out, lse)
    torch.cuda.synchronize(device)
    backward_extra = torch.cuda.max_memory_allocated(device) - base - dq.nbytes - dk.nbytes - dv.nbytes
    try:
        planned = tuple(kernel_buffer_bytes(kernel, lens, HEADS, KV_HEADS, HEAD_DIM, q.element_size()))
    except ValueError:  # a kernel the planner has no model of: its measurement is what one needs
        planned = (None, None)
    return {"kernel": kernel, "tokens": total, "documents": len(lens), "forward_extra": forward_extra,
            "backward_extra": backward_extra, "forward_extra_per_token": round(forward_extra / total, 1),
            "backward_extra_per_token": round(backward_extra / total, 1),
            "planned_forward": planned[0], "planned_backward": planned[1],
            "device": torch.cuda.get_device_name(device)}
