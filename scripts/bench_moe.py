"""Expert-parallel MoE forward+backward: local experts against allgather and all-to-all dispatch.

Runs on one GPU, on N GPUs of one node, or on CPU for a smoke run::

    python scripts/bench_moe.py                               # every visible GPU (one is fine)
    torchrun --nproc_per_node 8 scripts/bench_moe.py          # same, launched by torchrun
    python scripts/bench_moe.py --quick --gpus 2              # CPU smoke run: gloo, tiny shapes

For each layer shape (Mixtral E8 H4096 I14336 k2, Qwen3-30B-A3B E128 H2048 I768 k8, OLMoE E64 H2048
I1024 k8) and routing (``real``: the model's softmax router on random inputs; ``skewed``: router logits
offset by -skew * log(1 + e), so low-numbered experts take most pairs), one transformers MoE block
runs forward+backward with:

* ``local``: the block as transformers ships it (experts_implementation ``grouped_mm`` on GPU), every
  expert on every GPU, each GPU on its own tokens (no expert parallelism);
* ``allgather`` / ``all_to_all`` at each EP size of ``--ep`` (default 1 and the world):
  :func:`hf_longctx.moe.apply_expert_parallel`.

Per row: milliseconds (median over ``--reps`` after warm-up, CUDA events, slowest rank), expert
TFLOP/s per GPU (2 GEMMs, 6 * pairs * H * 3I fwd+bwd for this GPU's tokens), bytes this GPU sent to
other GPUs per step, peak memory, max/mean expert load over the EP group, and the ratio of the whole
step to a bare grouped GEMM (``torch._grouped_mm`` fwd+bwd of the two expert GEMMs on the same rows
per expert this GPU computed). ``--model-layers N`` also times a whole N-layer MoE model of the same
shape (attention with SDPA, loss from labels). A markdown table is printed last.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hf_longctx.benchmarking import free_port, table_header, timed_slowest_rank
from hf_longctx.comm import comm_stats, reset_comm_stats
from hf_longctx.comm.mesh import parallel_groups
from hf_longctx.moe import (
    ExpertParallelExperts,
    apply_expert_parallel,
    expert_load,
    expert_mlp_flops,
    find_experts_modules,
)

# name -> (model kind, experts, hidden, intermediate, top_k, tokens per GPU)
SHAPES = {
    "mixtral": ("mixtral", 8, 4096, 14336, 2, 8192),
    "qwen3": ("qwen3", 128, 2048, 768, 8, 16384),
    "olmoe": ("olmoe", 64, 2048, 1024, 8, 16384),
}
QUICK_SHAPES = {
    "mixtral": ("mixtral", 8, 64, 96, 2, 48),
    "qwen3": ("qwen3", 16, 32, 16, 8, 48),
    "olmoe": ("olmoe", 16, 32, 24, 4, 48),
}


def model_config(kind: str, experts: int, hidden: int, inter: int, top_k: int, layers: int, impl: str):
    from transformers import MixtralConfig, OlmoeConfig, Qwen3MoeConfig

    heads = max(1, hidden // 128)
    common = dict(hidden_size=hidden, num_experts_per_tok=top_k, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), vocab_size=32000,
                  max_position_embeddings=1 << 17, experts_implementation=impl, attn_implementation="sdpa")
    if kind == "mixtral":
        return MixtralConfig(intermediate_size=inter, num_local_experts=experts, **common)
    if kind == "qwen3":
        return Qwen3MoeConfig(moe_intermediate_size=inter, intermediate_size=4 * inter, num_experts=experts,
                              norm_topk_prob=True, head_dim=128 if hidden >= 128 else hidden // heads, **common)
    return OlmoeConfig(intermediate_size=inter, num_experts=experts, **common)


def moe_block(config):
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cls = {"mixtral": MixtralSparseMoeBlock, "qwen3_moe": Qwen3MoeSparseMoeBlock, "olmoe": OlmoeSparseMoeBlock}
    return cls[config.model_type](config)


def init_weights(module, seed: int, skew: float, std: float = 0.02):
    """Same random weights on every rank; router rows get + offset_e * u for the skewed routing."""
    device = next(module.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)  # on the GPU: billions of weights, same on every rank
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32).mul_(std))
        for block, _, _ in find_experts_modules(module):
            router = block.gate.weight
            offsets = -skew * torch.log1p(torch.arange(router.shape[0], dtype=torch.float32))
            direction = torch.zeros(router.shape[1])
            direction[0] = 1.0
            router.add_((offsets[:, None] * direction[None, :]).to(router.dtype).to(router.device))


def inputs(tokens: int, hidden: int, skew: float, seed: int, device, dtype):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, tokens, hidden, generator=gen)
    if skew:
        x[..., 0] = 1.0  # the direction the skewed router rows are offset along
    return x.to(device=device, dtype=dtype)


def bare_grouped_gemm_ms(rows_per_expert: torch.Tensor, hidden: int, inter: int, dtype, device, reps, warmup):
    """fwd+bwd of the two expert GEMMs alone (torch._grouped_mm) on rows grouped as the experts saw them.

    Every rank takes part in the timing collectives even when it has no rows or grouped GEMM cannot
    run there (then the result is nan on every rank), so no rank is left waiting.
    """
    experts = rows_per_expert.numel()
    rows = int(rows_per_expert.sum())
    offsets = torch.cumsum(rows_per_expert.to(device), 0, dtype=torch.int32)
    x = torch.randn(rows, hidden, device=device, dtype=dtype, requires_grad=True)
    w1 = torch.randn(experts, 2 * inter, hidden, device=device, dtype=dtype, requires_grad=True)
    w2 = torch.randn(experts, hidden, inter, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(rows, hidden, device=device, dtype=dtype)

    def step():
        if rows == 0:
            return
        h = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets)
        y = torch._grouped_mm(h[:, :inter].contiguous(), w2.transpose(-2, -1), offs=offsets)
        y.backward(grad)

    ok = hasattr(torch, "_grouped_mm")
    if ok:
        try:
            step()
        except RuntimeError:  # a device or dtype grouped GEMM does not serve
            ok = False
    everyone_ok = torch.tensor([1.0 if ok else 0.0], device=device)
    dist.all_reduce(everyone_ok, op=dist.ReduceOp.MIN)
    return timed_slowest_rank(step, reps, device, warmup) if everyone_ok.item() else float("nan")


def peak_gb(device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")


def bench_layer(name, shape, routing, mode, ep, args, device, dtype, rank, world) -> dict:
    kind, experts, hidden, inter, top_k, tokens = shape
    tokens = args.tokens or tokens
    skew = args.skew if routing == "skewed" else 0.0
    impl = "grouped_mm" if device.type == "cuda" else "eager"
    config = model_config(kind, experts, hidden, inter, top_k, 1, impl)
    with torch.device(device):
        block = moe_block(config).to(dtype)
    init_weights(block, seed=experts + hidden, skew=skew)
    record = {}
    if mode != "local":
        groups = parallel_groups(ep_size=ep)
        if ep == 1:  # the dispatch path without collectives, against transformers' own experts
            block.experts = ExpertParallelExperts(block.experts, groups.ep, mode)
        else:
            apply_expert_parallel(block, groups.ep, mode)
        block.experts.record = record
    x = inputs(tokens, hidden, skew, seed=1000 + rank, device=device, dtype=dtype).requires_grad_()
    grad = torch.randn_like(x)

    def step():
        block(x).backward(grad)
        x.grad = None
        for p in block.parameters():
            p.grad = None

    ids = block.gate(x.detach().view(-1, hidden))[2]
    load = expert_load(ids, experts).float()
    ep_group = parallel_groups(ep_size=ep).ep if ep > 1 else None
    if ep > 1:
        dist.all_reduce(load, group=ep_group)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step()  # first call: warm-up, and the rows each expert computes
    reset_comm_stats()
    ms = timed_slowest_rank(step, args.reps, device, args.warmup)
    steps = args.reps + args.warmup
    sent = comm_stats().get("sent_bytes", 0) / steps
    pairs = tokens * top_k
    flops = 3 * expert_mlp_flops(pairs, block.experts)
    rows_per_expert = (record["rows_per_expert"] / (steps + 1)).round().long() if record else \
        expert_load(ids, experts)
    bare = bare_grouped_gemm_ms(rows_per_expert.cpu(), hidden, inter, dtype, device, args.reps, args.warmup)
    return {"shape": name, "routing": routing, "mode": mode, "ep": ep if mode != "local" else "-",
            "tokens": tokens, "ms": ms, "tflops": flops / ms / 1e9, "sent_mb": sent / 2**20,
            "peak_gb": peak_gb(device), "load": float(load.max() / load.mean()), "bare_ms": bare}


def bench_model(name, shape, mode, ep, args, device, dtype, rank, world) -> dict:
    from transformers import AutoModelForCausalLM

    kind, experts, hidden, inter, top_k, tokens = shape
    tokens = args.tokens or tokens
    impl = "grouped_mm" if device.type == "cuda" else "eager"
    config = model_config(kind, experts, hidden, inter, top_k, args.model_layers, impl)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config).to(dtype)
    init_weights(model, seed=7, skew=0.0)
    if mode != "local":
        groups = parallel_groups(ep_size=ep)
        if ep == 1:
            for parent, attr, experts_module in find_experts_modules(model):
                setattr(parent, attr, ExpertParallelExperts(experts_module, groups.ep, mode))
        else:
            apply_expert_parallel(model, groups.ep, mode)
    ids = torch.randint(0, config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(rank)).to(device)

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        for p in model.parameters():
            p.grad = None

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step()
    ms = timed_slowest_rank(step, args.reps, device, args.warmup)
    return {"shape": f"{name} model x{args.model_layers}", "routing": "real", "mode": mode,
            "ep": ep if mode != "local" else "-", "tokens": tokens, "ms": ms, "tflops": float("nan"),
            "sent_mb": float("nan"), "peak_gb": peak_gb(device), "load": float("nan"), "bare_ms": float("nan"),
            "tokens_per_s": tokens * world / ms * 1e3}


def print_table(rows):
    print(table_header(["shape", "routing", "mode", "ep", "tokens/GPU", "ms fwd+bwd", "expert TFLOP/s/GPU",
                        "MB sent/GPU", "peak GB", "max/mean load", "step / bare grouped GEMM"]))
    for r in rows:
        ratio = r["ms"] / r["bare_ms"] if r["bare_ms"] == r["bare_ms"] and r["bare_ms"] > 0 else float("nan")
        extra = f" ({r['tokens_per_s']:.0f} tokens/s)" if "tokens_per_s" in r else ""
        print(f"| {r['shape']} | {r['routing']} | {r['mode']} | {r['ep']} | {r['tokens']} | {r['ms']:.2f}{extra} | "
              f"{r['tflops']:.1f} | {r['sent_mb']:.4g} | {r['peak_gb']:.2f} | {r['load']:.2f} | {ratio:.2f} |")
    local = {(r["shape"], r["routing"]): r["ms"] for r in rows if r["mode"] == "local"}
    for r in rows:
        if r["mode"] == "allgather" and r["ep"] == 1 and (r["shape"], r["routing"]) in local:
            print(f"allgather at ep=1 / local, {r['shape']} {r['routing']}: "
                  f"{r['ms'] / local[(r['shape'], r['routing'])]:.2f}x")


def worker(rank, world, args):
    quick = args.quick or not torch.cuda.is_available()
    device = torch.device("cpu") if quick else torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group("gloo" if device.type == "cpu" else "nccl", rank=rank, world_size=world,
                                timeout=timedelta(seconds=900), device_id=device if device.type == "cuda" else None)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    shapes = QUICK_SHAPES if args.quick else SHAPES
    eps = sorted({e for e in args.ep if e <= world and world % e == 0})
    rows = []
    for name in args.shapes:
        for routing in args.routing:
            for mode in args.modes:
                for ep in ([1] if mode == "local" else eps):
                    rows.append(bench_layer(name, shapes[name], routing, mode, ep, args, device, dtype, rank, world))
                    if rank == 0:
                        print(rows[-1], flush=True)
        if args.model_layers:
            for mode in args.modes:
                for ep in ([1] if mode == "local" else [max(eps)]):
                    rows.append(bench_model(name, shapes[name], mode, ep, args, device, dtype, rank, world))
                    if rank == 0:
                        print(rows[-1], flush=True)
    if rank == 0:
        print(f"\n{world} x {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, {dtype}, "
              f"torch {torch.__version__}\n")
        print_table(rows)
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=0, help="processes to start (default: visible GPUs; torchrun: ignored)")
    p.add_argument("--shapes", default="mixtral,qwen3,olmoe")
    p.add_argument("--routing", default="real,skewed")
    p.add_argument("--modes", default="local,allgather,all_to_all")
    p.add_argument("--ep", default="", help="EP sizes (default: 1 and the world size)")
    p.add_argument("--tokens", type=int, default=0, help="tokens per GPU (default: per shape)")
    p.add_argument("--skew", type=float, default=1.0, help="router offset -skew*log(1+e) of the skewed routing")
    p.add_argument("--model-layers", type=int, default=2, help="layers of the whole-model run (0: skip it)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="CPU smoke run with gloo and tiny shapes")
    args = p.parse_args()
    if args.quick:
        args.reps, args.warmup = 1, 1
    args.shapes = args.shapes.split(",")
    args.routing = args.routing.split(",")
    args.modes = args.modes.split(",")
    if "RANK" in os.environ:  # started by torchrun
        world = int(os.environ["WORLD_SIZE"])
        args.ep = [int(e) for e in args.ep.split(",") if e] or [1, world]
        worker(int(os.environ["RANK"]), world, args)
        return 0
    world = args.gpus or (2 if args.quick else max(1, torch.cuda.device_count()))
    args.ep = [int(e) for e in args.ep.split(",") if e] or [1, world]
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(worker, args=(world, args), nprocs=world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
