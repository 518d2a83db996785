"""Step time and peak memory of layer checkpointing vs recompute-aware checkpointing on one GPU.

    python scripts/bench_checkpointing.py --seqs 32768,65536 --layers 4

A Llama-3-8B-shaped model (hidden 4096, 32 heads, 8 KV heads, MLP 14336; fewer layers so it fits,
vocab 32000 so the logits stay small) runs forward+backward on one packed sequence through the
``longctx_local`` attention (the same custom op every backend uses). Ratios are taken in one run.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_longctx  # noqa: F401 - registers the attention implementations
from hf_longctx.hf import plan_for, shard_batch
from hf_longctx.hf.checkpointing import enable_layer_checkpointing, enable_recompute_aware_checkpointing
from hf_longctx.kernels import reset_stats, stats
from hf_longctx.layout import PackedBatch


def step_time(model, local, reps: int) -> tuple[float, float, int]:
    """Median ms of forward+backward, peak GiB, attention forward calls per step."""
    for _ in range(2):
        model(**local).loss.backward()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        reset_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        model(**local).loss.backward()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        model.zero_grad(set_to_none=True)
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30, stats().get("core_attention.forward", 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", default="32768,65536")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    cfg = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=args.layers,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=1 << 20,
                      attn_implementation="longctx_local")
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.train()
    rows = []
    for seq in (int(s) for s in args.seqs.split(",")):
        packed = PackedBatch.from_doc_lens([seq])
        ids = torch.randint(0, cfg.vocab_size, (1, seq), device="cuda")
        local = shard_batch({"input_ids": ids, "position_ids": packed.position_ids[None].cuda()},
                            plan_for(packed, "local", None), 0)
        result = {}
        for mode in ("layer", "recompute_aware"):
            if mode == "layer":
                enable_layer_checkpointing(model)
            else:
                enable_recompute_aware_checkpointing(model)
            result[mode] = step_time(model, local, args.reps)
        speedup = result["layer"][0] / result["recompute_aware"][0]
        for mode, (ms, gib, calls) in result.items():
            rows.append(f"| {seq // 1024}K | {mode} | {ms:.0f} | {gib:.1f} | {calls} | "
                        f"{speedup if mode == 'recompute_aware' else 1.0:.2f} |")
            print(rows[-1], flush=True)
    gpu = torch.cuda.get_device_name()
    print(f"\n{gpu}, Llama-3-8B shape with {args.layers} layers, bf16, torch {torch.__version__}")
    print("| tokens | checkpointing | fwd+bwd ms | peak GiB | attention forward calls | speedup vs layer |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
