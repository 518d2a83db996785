"""Train a Llama-3-8B-shaped model (random weights) for a few steps and report throughput and memory.

One command per measurement, on the GPU machine (NCCL; one process per GPU)::

    python scripts/bench_train.py --gpus 2 --backend zigzag --seq 131072 --layers 4
    python scripts/bench_train.py --gpus 1 --backend local --seq 65536 --layers 4 --search   # largest that fits
    python scripts/bench_train.py --quick --gpus 2 --backend zigzag                          # smoke run

``--seq`` is tokens per GPU; the sequence-parallel group (all GPUs) trains on ``gpus x seq`` tokens of
packed documents from a ProLong-style length mix. Prints tokens/s, MFU (6 x parameters per token plus
causal attention FLOPs, over the GPUs' dense bf16 peak), peak memory per GPU, and the share of the
step spent in core attention (core attention timed alone on the same shapes, times the layers).
Memory options are each optional: ``--checkpointing``, ``--tiled-loss``, ``--tiled-mlp``.
``--zero N`` (DeepSpeed) or ``--fsdp`` (FSDP2) shard the weights over the GPUs. ``--optimizer host`` keeps
AdamW's states in host memory with torchao (one process), ``--optimizer deepspeed`` with DeepSpeed's
ZeRO-Offload (the two compared in bench/RESULTS.md); ``--memory auto`` lets the planner choose.
``--search`` doubles ``--seq`` until a step runs out of memory, then bisects; each try runs in a
fresh process so an out-of-memory error leaves nothing behind.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

# long contexts allocate and free many large blocks: growable segments keep the caching allocator from
# fragmenting (the memory planner budgets for the rest); set before CUDA starts, a user's value wins
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hf_longctx.benchmarking import (
    FORWARD_BACKWARD_FACTOR,
    free_port,
    host_peak_gib,
    model_flops_per_token,
    peak_flops,
    table_header,
    table_row,
    timed_slowest_rank,
    training_mfu,
)
from hf_longctx.hf.memory.adam_states import AdamStates
from hf_longctx.hf.settings.schema import checked_backend_options
from hf_longctx.hf.settings.sources import parse_backend_options


def build_model(args, impl: str, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    if args.model == "tiny":
        cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=args.layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1 << 22,
                          attn_implementation=impl)
    elif args.model == "small":
        cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=1024, intermediate_size=2816,
                          num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=4,
                          max_position_embeddings=1 << 24, rope_theta=500000.0, attn_implementation=impl)
    else:
        cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=4096, intermediate_size=14336,
                          num_hidden_layers=args.layers, num_attention_heads=32, num_key_value_heads=8,
                          max_position_embeddings=1 << 24, rope_theta=500000.0, attn_implementation=impl)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return model.to(torch.bfloat16 if device.type == "cuda" else torch.float32)


def learnable_tokens(total: int, vocab: int, seed: int) -> torch.Tensor:
    """A noisy affine chain (next = 7 * prev + 3 mod V, one token in eight random): a loss curve that falls."""
    g = torch.Generator().manual_seed(seed)
    ids = [int(torch.randint(0, vocab, (1,), generator=g))]
    noise = torch.randint(0, vocab, (total,), generator=g).tolist()
    jump = (torch.rand(total, generator=g) < 0.125).tolist()
    for i in range(1, total):  # plain ints: ~0.5 s per million tokens
        ids.append(noise[i] if jump[i] else (7 * ids[-1] + 3) % vocab)
    return torch.tensor(ids)[None]


def packed_batch(total: int, vocab: int, mix: str, seed: int, device, learnable: bool = False):
    from hf_longctx.data.synthetic_lengths import synthetic_doc_lengths
    from hf_longctx.layout import PackedBatch

    lens = synthetic_doc_lengths(mix, total, seed=seed, max_doc_len=total) if mix != "one" else [total]
    packed = PackedBatch.from_doc_lens(lens)
    ids = (learnable_tokens(total, vocab, seed) if learnable
           else torch.randint(0, vocab, (1, total), generator=torch.Generator().manual_seed(seed))).to(device)
    return packed, {"input_ids": ids, "position_ids": packed.position_ids[None].to(device)}


def attention_ms(plan, backend, rank, group, cfg, device, dtype, reps=3, kernel="auto", options=None) -> float:
    """Core attention forward+backward of one layer on this plan, alone (ms, slowest rank)."""
    from hf_longctx.backends import sequence_parallel_attention

    n = plan.num_local_tokens(rank)
    hd = cfg.hidden_size // cfg.num_attention_heads
    q = torch.randn(n, cfg.num_attention_heads, hd, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(n, cfg.num_key_value_heads, hd, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)

    def step():
        out = sequence_parallel_attention(q, k, v, plan=plan, backend=backend, group=group, kernel=kernel,
                                          options=options)
        out.backward(torch.ones_like(out))

    return timed_slowest_rank(step, reps, device)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def worker(rank, world, args):
    from hf_longctx.hf import implementation_name, plan_for, shard_batch
    from hf_longctx.hf.memory.enable import enable_memory_options

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))  # what DeepSpeed reads
    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=900), device_id=device if device.type == "cuda" else None)
    if world == 1 and args.backend != "local":
        raise SystemExit("one GPU runs the 'local' backend; name --backend local")
    peer = args.backend == "torch_cp"
    if peer:
        from hf_longctx.lab.torch_cp_peer import register_peer_attention

        impl = register_peer_attention()
    else:
        impl = implementation_name(args.backend)
    model = build_model(args, impl, device)
    phase_peaks: dict[str, float] = {}

    def phase_peak(name: str) -> None:
        """The GPU peak of the phase that just ended (GiB), for the memory model's calibration; then a new phase.
        The allocator counts at allocation, on the host: no device synchronisation inside the timed step."""
        if device.type == "cuda":
            phase_peaks[name] = max(phase_peaks.get(name, 0.0), torch.cuda.max_memory_allocated(device) / 2**30)
            torch.cuda.reset_peak_memory_stats(device)
    memory_plan = None
    if args.memory == "auto":  # the planner picks checkpointing, offload and tiling from the memory it sees
        from hf_longctx.hf import LongContextConfig
        from hf_longctx.hf.memory.training import plan_for_training

        memory_plan = plan_for_training(model, LongContextConfig(memory="auto", kernel=args.kernel),
                                        tokens_per_gpu=args.seq,
                                        world=world, sp_size=world, processes_per_host=world, zero_stage=args.zero,
                                        fused_ops=None if args.fused_ops == "auto" else args.fused_ops == "liger",
                                        adam_states=None if args.zero else AdamStates(args.optimizer_state_bits))
        if rank == 0:
            print(memory_plan, flush=True)
        memory_plan.apply(model)
        # what the result reports: the plan's choices (its most common checkpointing mode)
        args.checkpointing, args.tiled_loss, args.tiled_mlp = (memory_plan.checkpointing, memory_plan.tiled_loss,
                                                               memory_plan.tiled_mlp)
        args.offload = memory_plan.offloaded_layers > 0
        args.fused_ops = "liger" if memory_plan.fused_ops else "off"
    else:
        args.fused_ops = "liger" if args.fused_ops == "liger" else "off"  # manual options: only when asked
        if args.fused_ops == "liger":
            from hf_longctx.hf.memory.fused_ops import enable_fused_ops

            enable_fused_ops(model, swiglu=not args.tiled_mlp)
        enable_memory_options(model, args.checkpointing, args.offload, args.tiled_loss, args.tiled_mlp)
    model.train()
    flops_per_token = model_flops_per_token(model)  # before ZeRO-3 partitions the parameters away
    params = [p for p in model.parameters() if p.requires_grad]
    states = AdamStates(args.optimizer_state_bits)
    if memory_plan is not None and (memory_plan.optimizer_on_host or states.low_bit):  # where and how it planned
        opt = memory_plan.make_optimizer(params, lr=args.lr)
    elif args.optimizer == "host":  # the same by hand
        from hf_longctx.hf.memory.optimizer_offload import HostOffloadAdamW

        opt = HostOffloadAdamW(params, lr=args.lr, optimizer_class=states.optimizer_class(),
                               **states.optimizer_kwargs())
    elif states.low_bit and args.optimizer == "gpu":
        opt = states.optimizer_class()(params, lr=args.lr, **states.optimizer_kwargs())
    elif args.optimizer == "deepspeed":  # DeepSpeed builds its own CPU Adam from the config below
        opt = None
    else:
        opt = torch.optim.AdamW(params, lr=args.lr, fused=device.type == "cuda" and not args.zero and not peer)
    if not args.zero and not args.fsdp and not peer and opt is not None:
        from hf_longctx.hf.memory.optimizer_states import allocate_optimizer_states

        allocate_optimizer_states(opt)  # a timed first step then holds AdamW's states, as every later step does
    total = args.seq * world
    packed, batch = packed_batch(total, model.config.vocab_size, args.mix, args.seed, device,
                                 learnable=bool(args.curve))
    plan = plan_for(packed, args.backend if not peer else "local", None)
    local = shard_batch(batch, plan, rank, None, kernel=args.kernel, options=args.backend_options) if not peer else None

    if peer:  # torch's native context parallelism through accelerate (FSDP2 + cp_size)
        from hf_longctx.lab.torch_cp_peer import TorchCPTrainer, one_sequence_batch

        trainer = TorchCPTrainer(model, opt, world, device)
        whole = one_sequence_batch(batch["input_ids"], device)

        def step():
            return trainer.step(**whole)
    elif args.fsdp:  # FSDP2: every decoder layer and the root sharded over all GPUs (dp x sp share the weights)
        from hf_longctx.hf.parallel.fsdp import fully_shard_model

        fully_shard_model(model)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,  # the shards
                                fused=device.type == "cuda")

        def step():
            loss = model(**local).loss
            (loss * world).backward()  # FSDP averages over the ranks; each rank's loss is its share: the sum
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
    elif args.zero:  # DeepSpeed ZeRO shards gradients / optimizer states (and parameters at stage 3)
        import deepspeed

        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                  "bf16": {"enabled": device.type == "cuda"}, "zero_optimization": {"stage": args.zero}}
        if opt is None:  # ZeRO-Offload: fp32 master weights, gradients and Adam's states in pinned host memory
            config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
            config["optimizer"] = {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0}}
        engine, opt, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config,
                                               model_parameters=params if opt is None else None)

        def step():
            # each rank's loss is its share and ZeRO averages over the ranks: scale to get the sum
            loss = engine(**local).loss
            engine.backward(loss * world)
            engine.step()
            return loss
    else:
        def step():
            loss = model(**local).loss
            phase_peak("forward and loss")
            loss.backward()
            for p in params:  # each rank holds its share of the loss: the gradient is the group's sum
                if world > 1:
                    dist.all_reduce(p.grad)
            phase_peak("backward")
            opt.step()
            opt.zero_grad(set_to_none=True)
            phase_peak("optimizer step")
            return loss

    if args.curve:  # the loss of every step, summed over the group (each rank's loss is its share)
        curve = []
        for _ in range(args.curve):
            loss = step().detach().float().reshape(1)
            dist.all_reduce(loss)
            curve.append(loss.item() / (world if peer else 1))  # the peer's ranks each hold a local mean
        if rank == 0:
            print("CURVE " + json.dumps({"backend": args.backend, "mix": args.mix, "losses": curve}), flush=True)
            if args.json_out:
                Path(args.json_out).write_text(json.dumps(curve))
        dist.destroy_process_group()
        return
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    probe = None
    if args.layer_peaks and device.type == "cuda":
        from hf_longctx.hf.memory.layer_peaks import LayerPeakProbe

        probe = LayerPeakProbe(model, device)
    with probe or contextlib.nullcontext():
        ms = timed_slowest_rank(step, args.steps, device, warmup=args.warmup)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    layer_peaks = None
    if probe is not None:  # the probe's windows split the phases: a phase's peak is also its layers' peak
        layer_peaks = probe.peaks.gib()
        phase_peaks["forward and loss"] = max(phase_peaks.get("forward and loss", 0.0), *layer_peaks["forward"])
        phase_peaks["backward"] = max(phase_peaks.get("backward", 0.0), *layer_peaks["backward"])
    if phase_peaks:
        peak = max(peak, *phase_peaks.values())
    peak_t = torch.tensor([peak], device=device)
    dist.all_reduce(peak_t, op=dist.ReduceOp.MAX)
    attn = float("nan") if peer else attention_ms(plan, args.backend, rank, None, model.config, device,
                                                   next(model.parameters()).dtype, kernel=args.kernel,
                                                   options=args.backend_options)
    # layer checkpointing runs attention forward again in backward: ~1/3.5 of a forward+backward
    attn_runs = model.config.num_hidden_layers * (1 + (args.checkpointing == "layer") / FORWARD_BACKWARD_FACTOR)
    result = {
        "backend": args.backend, "backend_options": args.backend_options, "kernel": args.kernel, "gpus": world,
        "tokens_per_gpu": args.seq, "context": total,
        "layers": model.config.num_hidden_layers, "checkpointing": args.checkpointing,
        "tiled_loss": args.tiled_loss, "tiled_mlp": args.tiled_mlp, "zero": args.zero, "fsdp": args.fsdp,
        "offload": args.offload, "fused_ops": args.fused_ops,
        "optimizer_on_host": bool(memory_plan is not None and memory_plan.optimizer_on_host) or args.optimizer != "gpu",
        "optimizer": "host" if memory_plan is not None and memory_plan.optimizer_on_host else args.optimizer,
        "optimizer_state_bits": args.optimizer_state_bits,
        "docs": packed.num_docs,
        "longest_doc": max(packed.doc_lens), "step_s": ms / 1e3, "tokens_per_s": total / (ms / 1e3),
        "mfu": training_mfu(model.config, flops_per_token, total, packed.causal_pairs(), ms / 1e3, world,
                            peak_flops(device)),
        "peak_gib": peak_t.item(),
        "host_peak_gib": host_peak_gib() or float("nan"),
        "phase_peak_gib": {k: round(v, 1) for k, v in phase_peaks.items()},
        "attention_share": None if peer else min(1.0, attn * attn_runs / ms),
    }
    if memory_plan is not None:
        result.update(memory="auto", predicted_gib=memory_plan.gpu_peak / 2**30,
                      predicted_host_gib=memory_plan.host_peak / 2**30, plan=memory_plan.summary(),
                      predicted_phase=memory_plan.gpu_phase)
    if layer_peaks is not None:
        result["layer_peak_gib"] = layer_peaks
        if memory_plan is not None:
            result["predicted_layer_gib"] = {
                "forward": [round(b / 2**30, 2) for b in memory_plan.layer_forward_peak],
                "backward": [round(b / 2**30, 2) for b in memory_plan.layer_backward_peak]}
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(result))
    dist.destroy_process_group()


def row(r: dict) -> str:
    mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else None
    share = f"{100 * r['attention_share']:.0f}%" if r.get("attention_share") is not None else None
    return table_row([f"{r['backend']} ({r.get('kernel', 'auto')})", r["gpus"], f"{r['tokens_per_gpu'] // 1024}K",
                      f"{r['context'] // 1024}K", r["layers"], r["checkpointing"], r["tiled_loss"] or None,
                      r["tiled_mlp"] or None, sharding(r), "yes" if r.get("offload") else None,
                      f"{r['step_s']:.2f}", f"{r['tokens_per_s']:.0f}", mfu, f"{r['peak_gib']:.1f}", share])


def sharding(r: dict) -> str | None:
    """How the weights were held: None (replicated, gradients all-reduced), FSDP2 or a ZeRO stage."""
    return "FSDP2" if r.get("fsdp") else (f"ZeRO-{r['zero']}" if r.get("zero") else None)


HEADER = table_header(["backend", "GPUs", "tokens/GPU", "context", "layers", "checkpointing", "tiled loss",
                       "tiled MLP", "sharding", "offload", "step s", "tokens/s", "MFU", "peak GiB/GPU",
                       "attention share"])


def try_seq(args, seq: int) -> dict | None:
    """One measurement in a fresh process; None when it ran out of memory."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"bench_train_{seq}.json"
        cmd = [sys.executable, __file__, *[a for a in sys.argv[1:] if a != "--search"], "--seq", str(seq),
               "--json-out", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode == 0 and out.exists():
            return json.loads(out.read_text())
    text = proc.stdout + proc.stderr
    if "out of memory" in text.lower() or "OutOfMemoryError" in text:
        print(f"{seq // 1024}K tokens/GPU: out of memory", flush=True)
        return None
    raise RuntimeError(f"bench_train at {seq} tokens failed (not out of memory):\n{text[-3000:]}")


def search(args) -> int:
    good, bad, results = None, None, []
    seq = args.seq
    while seq <= args.max_seq:
        r = try_seq(args, seq)
        if r is None:
            bad = seq
            break
        good = seq
        results.append(r)
        print(row(r), flush=True)
        seq *= 2
    for _ in range(args.bisect if good and bad else 0):
        mid = (good + bad) // 2 // args.granularity * args.granularity
        if mid in (good, bad):
            break
        r = try_seq(args, mid)
        if r is None:
            bad = mid
        else:
            good = mid
            results.append(r)
            print(row(r), flush=True)
    print("\n" + HEADER)
    print("\n".join(row(r) for r in sorted(results, key=lambda r: r["tokens_per_gpu"])))
    fits = f"{good // 1024}K tokens/GPU ({good * args.gpus // 1024}K context)" if good else "nothing"
    print(f"\nlargest that fits: {fits}" + (f"; {bad // 1024}K/GPU ran out of memory" if bad else ""))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count() or 2)
    p.add_argument("--backend", default="zigzag",
                   help="an hf_longctx backend, or torch_cp (the peer: torch native CP via accelerate, --mix one)")
    p.add_argument("--backend-options", default="", metavar="NAME=VALUE,...",
                   help="the backend's options, as the recipes' backend_options (CAD: eps=0.01,cost_model=FILE)")
    p.add_argument("--seq", type=int, default=65536, help="tokens per GPU")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--kernel", default="auto", help="single-device attention kernel (auto, fa4, cudnn_varlen, "
                   "torch_flash, ...)")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--mix", default="prolong", help="document-length mix: prolong, pretrain, or one (one document)")
    p.add_argument("--checkpointing", default="recompute_aware", choices=["none", "layer", "recompute_aware"])
    p.add_argument("--tiled-loss", type=int, default=0, help="tokens per loss chunk (0: off)")
    p.add_argument("--tiled-mlp", type=int, default=0, help="tokens per MLP chunk (0: off)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (0: the first step is timed too, for "
                                                          "sizes whose step takes minutes)")
    p.add_argument("--fused-ops", default="auto", choices=["auto", "liger", "off"],
                   help="Liger-Kernel's RMSNorm/RoPE/SwiGLU: with --memory auto, auto lets the planner use them where "
                        "they run; with manual options only liger turns them on")
    p.add_argument("--offload", action="store_true", help="keep layer checkpoints in pinned host memory")
    p.add_argument("--memory", default="manual", choices=["manual", "auto"],
                   help="auto: the memory planner picks checkpointing, offload and tiling (the options above are "
                        "ignored) and the result shows its predicted peaks beside the measured ones")
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="DeepSpeed ZeRO stage (0: plain)")
    p.add_argument("--optimizer", default="gpu", choices=["gpu", "host", "deepspeed"],
                   help="where AdamW's states live: gpu (torch AdamW), host (torchao's offload optimizer, one "
                        "process), deepspeed (ZeRO-Offload: DeepSpeed's CPU Adam; ZeRO-2 unless --zero names a stage)")
    p.add_argument("--optimizer-state-bits", type=int, default=None, choices=[8, 4],
                   help="AdamW's moments in torchao's 8- or 4-bit blocks (AdamW8bit / AdamW4bit) wherever AdamW is; "
                        "default: in the parameters' dtype")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard per decoder layer and root) over all GPUs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layer-peaks", action="store_true",
                   help="report each decoder layer's GPU peak in forward and in backward (the memory model's check, "
                        "layer by layer; with --memory auto beside the plan's prediction)")
    p.add_argument("--search", action="store_true", help="find the largest --seq that fits")
    p.add_argument("--max-seq", type=int, default=1 << 23)
    p.add_argument("--bisect", type=int, default=2, help="bisection rounds after the first failure")
    p.add_argument("--granularity", type=int, default=16384)
    p.add_argument("--json-out", default=None)
    p.add_argument("--model", default="8b", choices=["8b", "small", "tiny"],
                   help="Llama-3-8B shape (hidden 4096), small (hidden 1024) or tiny (hidden 64)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--curve", type=int, default=0, help="train this many steps on learnable tokens, print the losses")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: the tiny model, 2K tokens per rank (CPU and gloo when there is no GPU)")
    args = p.parse_args()
    if args.quick:
        args.model = "tiny"
        if "--seq" not in sys.argv:
            args.seq = 2048
    try:  # checked before any process starts, as a recipe's are
        args.backend_options = parse_backend_options(args.backend_options)
        if args.backend_options and args.backend == "torch_cp":
            raise ValueError("torch_cp is torch's own context parallelism: it takes no backend options")
        if args.backend != "torch_cp":  # checked here; kept as the mapping the summary prints
            checked_backend_options(args.backend, args.backend_options, f"options of --backend {args.backend}")
    except ValueError as err:  # the settings' check names backend_options itself
        p.error(f"--backend-options: {str(err).removeprefix('backend_options: ')}")
    if args.backend == "torch_cp":
        if args.mix != "one":
            p.error("torch_cp (torch native context parallelism) has no document masking: use --mix one")
        if args.checkpointing == "recompute_aware":
            args.checkpointing = "layer"  # recompute-aware needs our attention op; the peer gets plain layers
        if args.zero or args.tiled_mlp:
            p.error("torch_cp shards with FSDP2 itself; --zero and --tiled-mlp do not apply")
    if args.fsdp and (args.zero or args.backend == "torch_cp"):
        p.error("--fsdp shards the weights itself: not with --zero or torch_cp")
    if args.optimizer != "gpu" and (args.memory == "auto" or args.fsdp or args.backend == "torch_cp"):
        p.error("--optimizer names where AdamW lives by hand: not with --memory auto (the plan decides), "
                "--fsdp or torch_cp")
    if args.optimizer == "host" and (args.zero or args.gpus > 1):
        p.error("--optimizer host serves one process without ZeRO; with several GPUs or ZeRO name deepspeed")
    if args.optimizer_state_bits and (args.zero or args.optimizer == "deepspeed" or args.fsdp):
        p.error("--optimizer-state-bits runs torchao's AdamW: not with DeepSpeed, whose optimizer keeps its own "
                "states, nor with --fsdp here")
    if args.optimizer == "deepspeed" and not args.zero:
        args.zero = 2  # ZeRO-Offload needs a ZeRO stage; 2 keeps the bf16 weights whole on the GPU
    if args.search:
        return search(args)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
