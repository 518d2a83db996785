"""Step time and peak memory of layer checkpointing vs recompute-aware checkpointing on one GPU.

    python scripts/bench_checkpointing.py --seqs 32768,65536 --layers 4
    python scripts/bench_checkpointing.py --layers 16 --tiled-loss 8192 \\
        --modes layer,layer+offload,recompute_aware,recompute_aware+offload     # checkpoint offload

A Llama-3-8B-shaped model (hidden 4096, 32 heads, 8 KV heads, MLP 14336; fewer layers so it fits,
vocab 32000 so the logits stay small) runs forward+backward on one packed sequence through the
``longctx_local`` attention (the same custom op every backend uses). Ratios are taken in one run.
With offload the gradients are compared with the same mode without it (relative difference; bf16
kernels are not bitwise reproducible, so expect ~1e-2 at most, not 0).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_longctx  # noqa: F401 - registers the attention implementations
from hf_longctx.benchmarking import table_header
from hf_longctx.hf import plan_for, shard_batch
from hf_longctx.hf.memory.enable import enable_memory_options
from hf_longctx.kernels import reset_stats, stats
from hf_longctx.layout import PackedBatch


def step_time(model, local, reps: int) -> tuple[float, float, int, dict]:
    """Median ms of forward+backward, peak GiB, attention forward calls per step, and the last gradients."""
    for _ in range(2):
        model(**local).loss.backward()
        model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times, grads = [], {}
    for _ in range(reps):
        reset_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        model(**local).loss.backward()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        # on the host: gradients kept on the GPU would count against the next mode's peak
        grads = {n: p.grad.to("cpu", torch.float32) for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
    calls = stats().get("core_attention.forward", 0)
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30, calls, grads


def relative_difference(a: dict, b: dict) -> float:
    """Largest |a - b| over largest |b|, across all parameters (bf16 kernels are not bitwise reproducible)."""
    return max(((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-30)).item() for n in b)


MODES = {  # name: (checkpointing, offload)
    "layer": ("layer", False),
    "layer+offload": ("layer", True),
    "recompute_aware": ("recompute_aware", False),
    "recompute_aware+offload": ("recompute_aware", True),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", default="32768,65536")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--modes", default="layer,recompute_aware", help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--tiled-loss", type=int, default=0, help="tokens per loss chunk (0: whole-shard logits)")
    args = p.parse_args()
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    cfg = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=args.layers,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=1 << 20,
                      attn_implementation="longctx_local")
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.train()
    enable_memory_options(model, tiled_loss=args.tiled_loss)
    rows = []
    for seq in (int(s) for s in args.seqs.split(",")):
        packed = PackedBatch.from_doc_lens([seq])
        ids = torch.randint(0, cfg.vocab_size, (1, seq), device="cuda")
        local = shard_batch({"input_ids": ids, "position_ids": packed.position_ids[None].cuda()},
                            plan_for(packed, "local", None), 0)
        result = {}
        for mode in modes:
            checkpointing, offload = MODES[mode]
            enable_memory_options(model, checkpointing, offload)
            result[mode] = step_time(model, local, args.reps)
        base_ms = result[modes[0]][0]
        for mode, (ms, gib, calls, grads) in result.items():
            twin = mode.removesuffix("+offload")
            diff = (f"{relative_difference(grads, result[twin][3]):.1e}" if mode != twin and twin in result else "-")
            rows.append(f"| {seq // 1024}K | {mode} | {ms:.0f} | {gib:.1f} | {calls} | {base_ms / ms:.2f} | {diff} |")
            print(rows[-1], flush=True)
    gpu = torch.cuda.get_device_name()
    print(f"\n{gpu}, Llama-3-8B shape with {args.layers} layers, bf16, torch {torch.__version__}, "
          f"tiled loss {args.tiled_loss or 'off'}")
    print(table_header(["tokens", "checkpointing", "fwd+bwd ms", "peak GiB", "attention forward calls",
                        f"speed vs {modes[0]}", "grad rel. diff vs no offload"]))
    print("\n".join(rows))


if __name__ == "__main__":
    main()
