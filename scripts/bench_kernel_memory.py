"""The GPU memory each single-device attention kernel takes beyond its inputs and outputs, per token.

The memory planner counts a layer's backward working set; the kernel's own buffers (float32 accumulators,
GQA-expanded gradients, padding rows per document) differ from kernel to kernel. This measures them on one
packed row of the Llama-3-8B attention shape (32 query heads, 8 KV heads, head dim 128, bf16) and prints one
JSON line per kernel and length mix::

    python scripts/bench_kernel_memory.py --tokens 131072 --kernels fa4,torch_flash,cudnn_varlen

Each line: ``forward_extra`` / ``backward_extra``, the allocator's peak above what was allocated before the call
less the call's own outputs (out and lse; dq, dk and dv), in bytes; ``*_per_token`` the same over the row's tokens;
``documents``, the row's document count (kernels pad per document). ``planned_*`` are
:func:`hf_longctx.hf.memory.kernel_buffers.kernel_buffer_bytes`'s figures for the same call.
"""

from __future__ import annotations

import argparse
import json

import torch

from hf_longctx.data.synthetic import document_lengths
from hf_longctx.lab.kernel_memory import measure_kernel_buffers


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=131072)
    p.add_argument("--kernels", default="fa4,torch_flash,cudnn_varlen")
    p.add_argument("--mixes", default="prolong,uniform", help="document-length mixes (uniform: one document)")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    for mix in args.mixes.split(","):
        lens = document_lengths(mix, args.tokens, seed=0)
        for kernel in args.kernels.split(","):
            try:
                row = measure_kernel_buffers(kernel, lens, device)
            except Exception as err:  # noqa: BLE001 - one kernel's failure is a result, the others still run
                row = {"kernel": kernel, "error": f"{type(err).__name__}: {err}"}
            print(json.dumps({"mix": mix, **row}), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
