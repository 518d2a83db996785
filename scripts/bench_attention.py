"""Per-GPU attention throughput of the sequence-parallel backends against torch native CP.

One command does the whole comparison (the numbers in bench/RESULTS.md come from it)::

    python scripts/bench_attention.py --gpus 4            # on the GPU machine (NCCL)
    python scripts/bench_attention.py --quick --gpus 2    # CPU smoke run (gloo, reference kernel)
    python scripts/bench_attention.py --emulate 8         # 8 ranks emulated on one GPU (per-rank kernel time)

Workloads: causal one-document sequences (64K..512K tokens, H=32, KV heads 8 and 32, D=128) and
packed batches drawn from a long-tailed document-length mix. For each: forward and forward+backward
TFLOP/s per GPU (causal FLOPs: 4*D*H per visible (query, key) pair forward, x3.5 forward+backward),
for our backends, torch native context parallel (flash and cuDNN SDPA) and the best single-GPU
kernel on the whole sequence. Prints a markdown table last.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hf_longctx.backends import default_strategy, sequence_parallel_attention
from hf_longctx.backends.api import check_options
from hf_longctx.backends.auto import auto_decisions
from hf_longctx.benchmarking import (
    attention_tflops,
    free_port,
    host_and_device_ms,
    table_header,
    timed,
    timed_slowest_rank,
    write_op_profile,
)
from hf_longctx.comm import comm_stats, reset_comm_stats
from hf_longctx.comm.groups import high_priority_options
from hf_longctx.hf.settings.sources import parse_backend_options
from hf_longctx.kernels import SKIP_KERNEL, attention_backward, attention_forward
from hf_longctx.lab.emulation import real_rank_kernel_times
from hf_longctx.lab.emulation.workloads import WORKLOAD_MIXES, doc_lengths, global_tensors
from hf_longctx.layout import PackedBatch, shard_plan


def packed_workloads(args) -> list[tuple[str, int, int, list[int]]]:
    """(name, tokens, kv heads, document lengths) of every packed workload: each ``--mix`` at each
    ``--packed-seqs`` (the lengths seeded by the token count, the same in a real and an emulated run)."""
    return [(f"{mix} mix", s, hkv, doc_lengths(mix, s, seed=s)) for mix in args.mix for s in args.packed_seqs
            for hkv in args.kv_heads]


# label -> (backend, options): CAD without ping-pong, and CAD on the kernel's profiled launch cost at eps 0.01
VARIANTS = {"cad-nopp": ("cad", {"pingpong": False}), "cad-profiled": ("cad", {"cost_model": "profiled", "eps": 0.01})}


def _measured_cost_model():
    """CAD's measured cost model of this device's kernel, made by the lab now (or read from its cache): a benchmark
    may profile, training never does (it names a file made by ``hf-longctx-lab profile-cad``)."""
    import torch

    from hf_longctx.lab.cad.profiled import SegmentShape, measured_cost_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kernel = "auto" if device.type == "cuda" else "reference"
    return measured_cost_model(kernel, device, SegmentShape())[0]


def backend_and_options(label: str) -> tuple[str, dict | None]:
    """A backend label's backend and options: a named variant (:data:`VARIANTS`), or ``backend:key=value:...``
    (values read as a recipe's ``--backend-options`` are), e.g. ``cad:eps=0.01:pingpong=false``."""
    if label in VARIANTS:
        backend, options = VARIANTS[label]
        if options.get("cost_model") == "profiled":
            options = {**options, "cost_model": _measured_cost_model()}
        return backend, options
    backend, *pairs = label.split(":")
    if not pairs:
        return backend, None
    for pair in pairs:
        if "=" not in pair:
            raise SystemExit(f"backend option {pair!r} of {label!r} is not key=value")
    return backend, parse_backend_options(",".join(pairs))


class _DoneWork:
    def wait(self):
        return True


@contextlib.contextmanager
def communication_skipped():
    """The backends' all_to_all and P2P calls return at once, so only kernels and bookkeeping remain
    to be timed. Results are garbage; only the time is read. (Kernels are skipped through the public
    ``kernel=SKIP_KERNEL`` instead.)"""
    saved = {"all_to_all_single": dist.all_to_all_single, "batch_isend_irecv": dist.batch_isend_irecv}

    def a2a(*args, async_op=False, **kwargs):
        return _DoneWork() if async_op else None

    dist.all_to_all_single = a2a
    dist.batch_isend_irecv = lambda ops: [_DoneWork() for _ in ops]
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def run_ours(backend, batch, tensors, world, rank, reps, device, strategy=None, breakdown=False, reference=None,
             kernel_times=False, trace_path=None, group=None):
    q, k, v, dout = tensors
    backend, options = backend_and_options(backend)
    plan = shard_plan(batch, world, strategy or default_strategy(backend))
    idx = plan.local_indices(rank).to(device)
    ql, kl, vl, dl = (t.index_select(0, idx) for t in (q, k, v, dout))
    ql.requires_grad_()
    kl.requires_grad_()
    vl.requires_grad_()

    def attend(kernel="auto"):
        return sequence_parallel_attention(ql, kl, vl, plan=plan, backend=backend, options=options, kernel=kernel,
                                           group=group)

    def fwd():
        with torch.no_grad():
            return attend()

    def fwd_bwd(kernel="auto"):
        torch.autograd.backward(attend(kernel), dl)

    errors = {}
    if reference is not None:  # one fwd+bwd against the single-GPU kernel on the whole sequence
        for t in (ql, kl, vl):
            t.grad = None
        out = attend()
        torch.autograd.backward(out, dl)
        for name, got, want in zip(("out", "dq", "dk", "dv"), (out, ql.grad, kl.grad, vl.grad), reference):
            want = want.index_select(0, idx).float()
            err = torch.tensor([(got.float() - want).norm().item() ** 2, want.norm().item() ** 2], device=device,
                               dtype=torch.float64)
            dist.all_reduce(err)
            errors[name] = math.sqrt(err[0].item() / max(err[1].item(), 1e-300))
    t_f = timed_slowest_rank(fwd, reps, device)
    reset_comm_stats()
    t_fb = timed_slowest_rank(fwd_bwd, reps, device)
    sent = comm_stats().get("sent_bytes", 0) / (reps + 1)
    parts = {}
    if breakdown:  # each part timed with the other one skipped
        parts["kernels"] = timed_slowest_rank(lambda: fwd_bwd(SKIP_KERNEL), reps, device)
        with communication_skipped():
            parts["comm"] = timed_slowest_rank(fwd_bwd, reps, device)
    if kernel_times:  # every rank's kernel time, as the emulation measures it
        parts["rank_kernel_s"] = [f + b for f, b, _ in real_rank_kernel_times(fwd_bwd, device, reps=3)]
    if trace_path is not None:  # where the step's time goes: host per phase, and an op profile per rank
        parts["host_ms"] = host_ms_per_rank(attend, dl, device)
        write_op_profile(fwd_bwd, device, f"{trace_path}_rank{rank}.txt")
    return t_f, t_fb, sent, parts, errors


def host_ms_per_rank(forward, dout, device, reps=3) -> list[tuple[float, float, float]]:
    """Every rank's median (forward host ms, backward host ms, step ms) over ``reps`` steps of ``forward()`` and its
    backward from ``dout``, gathered: a rank whose host ms are about its step ms is host-bound; one far below waits
    on the device. The caller has run the step before (nothing first-use is timed)."""
    held = {}
    phases = [lambda: held.__setitem__("out", forward()), lambda: torch.autograd.backward(held.pop("out"), dout)]
    samples = []
    for _ in range(reps):
        dist.barrier()
        (host_f, host_b), total = host_and_device_ms(phases, device)
        samples.append((host_f, host_b, total))
    mine = tuple(sorted(column)[len(column) // 2] for column in zip(*samples))
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def run_torch_cp(sdpa_backend, tensors, world, reps, device):
    """torch.distributed.tensor.experimental.context_parallel over SDPA (one causal document only)."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, dout = tensors
    hq, hkv = q.shape[1], k.shape[1]
    mesh = init_device_mesh(device.type, (world,))
    # torch CP's ring has no GQA path: repeat KV heads, as its users must.
    dense = [t.unsqueeze(0).transpose(1, 2).contiguous() for t in (q, k.repeat_interleave(hq // hkv, 1),
                                                                       v.repeat_interleave(hq // hkv, 1), dout)]
    kernel = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[sdpa_backend]
    with context_parallel(mesh, buffers=dense, buffer_seq_dims=[2, 2, 2, 2]):
        ql, kl, vl = (t.detach().requires_grad_() for t in dense[:3])
        dl = dense[3]

        def fwd():
            with torch.no_grad(), sdpa_kernel(kernel):
                return F.scaled_dot_product_attention(ql, kl, vl, is_causal=True)

        def fwd_bwd():
            with sdpa_kernel(kernel):
                out = F.scaled_dot_product_attention(ql, kl, vl, is_causal=True)
            torch.autograd.backward(out, dl)

        return timed_slowest_rank(fwd, reps, device), timed_slowest_rank(fwd_bwd, reps, device), math.nan, {}, {}


def run_single_gpu(batch, tensors, reps, device, kernel="auto"):
    """The whole sequence on one GPU (rank 0 computes; the others wait at the barrier)."""
    q, k, v, dout = tensors
    cu = batch.cu_seqlens.tolist()

    def fwd():
        return attention_forward(q, k, v, cu, cu, batch.max_seqlen, batch.max_seqlen, kernel=kernel)

    def fwd_bwd():
        out, lse = fwd()
        attention_backward(dout, q, k, v, out, lse, cu, cu, batch.max_seqlen, batch.max_seqlen, kernel=kernel)

    return timed(fwd, reps), timed(fwd_bwd, reps), 0.0, {}, {}


def worker(rank, world, args):
    quick = args.quick
    device = torch.device("cpu") if quick else torch.device("cuda", rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo" if quick else "nccl", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600), device_id=device if device.type == "cuda" else None)
    dtype = torch.float32 if quick else torch.bfloat16
    hq, d = (4, 16) if quick else (32, 128)
    rows, checks = [], []
    # every backend runs once per communication stream priority, on a group of all ranks whose NCCL streams have it
    groups = {"normal": None}
    if "high" in args.comm_priority:
        groups["high"] = dist.new_group(list(range(world)), pg_options=high_priority_options())
    groups = {p: groups[p] for p in args.comm_priority}
    workloads = [("1 doc", s, hkv, [s]) for s in args.seqs for hkv in args.kv_heads] + packed_workloads(args)
    for name, total, hkv, lens in workloads:
        hkv = min(hkv, hq)
        batch = PackedBatch.from_doc_lens(lens)
        flops = 4 * d * hq * batch.causal_pairs()
        tensors = global_tensors(total, hq, hkv, d, dtype, device, seed=total + hkv)
        reference = None
        if total <= args.check_max:
            cu = batch.cu_seqlens.tolist()
            q, k, v, dout = tensors
            out, lse = attention_forward(q, k, v, cu, cu, batch.max_seqlen, batch.max_seqlen)
            reference = (out, *attention_backward(dout, q, k, v, out, lse, cu, cu, batch.max_seqlen,
                                                  batch.max_seqlen))
        candidates = [(b, None) for b in args.backends if not b.startswith("cp_")]
        if len(lens) > 1 and "zigzag" in args.backends:
            candidates.append(("zigzag", "doc_zigzag"))
        if len(lens) == 1 and not quick:
            candidates += [(b, None) for b in args.backends if b.startswith("cp_")]
        result = {}
        for (backend, strategy), priority in ((c, p) for c in candidates for p in groups):
            label = backend if strategy is None else f"{backend}+{strategy}"
            if len(groups) > 1:
                label += f"@{priority}"
            try:
                if backend.startswith("cp_"):
                    t_f, t_fb, sent, parts, _ = run_torch_cp(backend[3:], tensors, world, args.reps, device)
                else:
                    trace_path = None
                    if args.trace:
                        os.makedirs(args.trace, exist_ok=True)
                        trace_path = os.path.join(args.trace, f"{name.replace(' ', '_')}_{total // 1024}K_kv{hkv}_"
                                                  f"{label.replace(':', '_')}")
                    t_f, t_fb, sent, parts, errors = run_ours(backend, batch, tensors, world, rank, args.reps,
                                                              device, strategy, args.breakdown, reference,
                                                              args.kernel_times, trace_path, groups[priority])
                    if rank == 0 and "host_ms" in parts:
                        print(f"{name} {total // 1024}K kv{hkv} {label}: host ms forward, backward / step ms per "
                              "rank: " + "; ".join(f"{f:.1f}, {b:.1f} / {t:.1f}" for f, b, t in parts["host_ms"]),
                              flush=True)
                    if errors and rank == 0:
                        worst = max(errors.values())
                        checks.append(f"{name} {total // 1024}K kv{hkv} {label}: relative error vs 1 GPU "
                                      + ", ".join(f"{k} {e:.1e}" for k, e in errors.items())
                                      + ("  OK" if worst < 1e-2 else "  FAILED (>= 1e-2)"))
                        print(checks[-1], flush=True)
                if backend == "auto":
                    label = f"auto -> {auto_decisions()[-1]['backend']}"
                result[label] = (*attention_tflops(flops / world, t_f, t_fb), sent, t_fb, parts)
            except Exception as exc:  # noqa: BLE001 - one call measures everything; report and go on
                if rank == 0:
                    print(f"{name} {total} kv{hkv} {label}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                    traceback.print_exc()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if total <= args.single_max:
            single = None
            if rank == 0:
                try:
                    t_f, t_fb, _, _, _ = run_single_gpu(batch, tensors, max(2, args.reps // 2), device)
                    single = (*attention_tflops(flops, t_f, t_fb), 0.0, t_fb, {})
                except Exception as exc:  # noqa: BLE001
                    print(f"single-GPU {total}: {type(exc).__name__}: {exc}", flush=True)
            dist.barrier()
            if single:
                result["1 GPU"] = single
        if rank == 0:
            best_single = result.get("1 GPU", (math.nan, math.nan))[1]
            for label, (tf, tfb, sent, ms, parts) in result.items():
                ratio = tfb / best_single if best_single == best_single else math.nan
                comm, comp = parts.get("kernels", math.nan), parts.get("comm", math.nan)
                kernel_s = parts.get("rank_kernel_s") or [math.nan]
                row = (f"| {name} | {total // 1024}K | {hkv} | {label} | {tf:.0f} | {tfb:.0f} | {ratio:.2f} | "
                       f"{sent / 2**20:.0f} | {ms:.1f} | {comm:.1f} | {comp:.1f} | {comp / comm:.2f} | "
                       f"{max(kernel_s) / (sum(kernel_s) / len(kernel_s)):.3f} | {max(kernel_s) * 1e3:.2f} |")
                rows.append(row)
                print(row, flush=True)
        del tensors, reference
    if rank == 0:
        gpu = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
        print(f"\n{world} x {gpu}, torch {torch.__version__}")
        print(table_header(["workload", "tokens", "kv heads", "backend", "fwd TFLOP/s/GPU", "fwd+bwd TFLOP/s/GPU",
                            "vs 1 GPU (fwd+bwd)", "MiB sent/rank/iter", "fwd+bwd ms", "comm-only ms",
                            "compute-only ms", "compute/comm", "max/mean kernel (real)", "max kernel ms"]))
        print("\n".join(rows))
        if checks:
            print("\n" + "\n".join(checks))
    dist.destroy_process_group()


def emulated(args) -> int:
    """``--emulate W``: every workload and backend with W ranks emulated on one device, one row each."""
    from hf_longctx.lab.emulation import emulate_step, link_sources

    device = torch.device("cpu") if args.quick else torch.device("cuda", torch.cuda.current_device())
    dtype = torch.float32 if args.quick else torch.bfloat16
    hq, d = (4, 16) if args.quick else (32, 128)
    world = args.emulate
    workloads = [("1 doc", s, hkv, [s]) for s in args.seqs for hkv in args.kv_heads] + packed_workloads(args)
    rows = []
    for name, total, hkv, lens in workloads:
        hkv = min(hkv, hq)
        batch = PackedBatch.from_doc_lens(lens)
        tensors = global_tensors(total, hq, hkv, d, dtype, device, seed=total + hkv)
        for label in (b for b in args.backends if not b.startswith("cp_")):
            backend, options = backend_and_options(label)
            try:
                step = emulate_step(batch, world, tensors, backend, options=options,
                                    kernel="reference" if args.quick else "auto", warmup=1, reps=args.reps)
            except Exception as exc:  # noqa: BLE001 - one call measures everything; report and go on
                print(f"{name} {total} kv{hkv} {backend}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            ms = [t * 1e3 for t in step.kernel_s]
            rows.append(f"| {name} | {total // 1024}K | {hkv} | {label} | {step.imbalance:.3f} | {max(ms):.2f} | "
                        f"{min(ms):.2f} | {max(step.sent_bytes) / 2**20:.0f} | {step.predicted_step_s * 1e3:.2f} | "
                        f"{step.tflops_per_device:.0f} |")
            print(rows[-1], flush=True)
        del tensors
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"\n{world} ranks emulated on one {gpu}, torch {torch.__version__}; links: " + "; ".join(link_sources()))
    print(table_header(["workload", "tokens", "kv heads", "backend", "max/mean kernel (emulated)", "max kernel ms",
                        "min kernel ms", "max MiB sent/rank", "predicted step ms", "predicted TFLOP/s/GPU"]))
    print("\n".join(rows))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count() or 2)
    p.add_argument("--seqs", default="65536,131072,262144,524288")
    p.add_argument("--packed-seqs", default="262144")
    p.add_argument("--kv-heads", default="8,32")
    p.add_argument("--backends", default="ring,zigzag,distfa,cp_flash,cp_cudnn")
    p.add_argument("--mix", default="prolong", help="packed workloads' length mixes, comma-separated: prolong, "
                   "pretrain, sft")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--single-max", type=int, default=262144, help="largest sequence timed on one GPU")
    p.add_argument("--quick", action="store_true", help="CPU smoke run with gloo and tiny sizes")
    p.add_argument("--check-max", type=int, default=0,
                   help="check outputs and gradients against one GPU for workloads up to this many tokens")
    p.add_argument("--emulate", type=int, default=0, metavar="W",
                   help="run W ranks emulated on one device (hf_longctx.lab.emulation): per-rank kernel time, bytes, "
                        "predicted step time; no process group")
    p.add_argument("--kernel-times", action="store_true",
                   help="real runs: also every rank's kernel time, as --emulate measures it (max/mean and max ms)")
    p.add_argument("--breakdown", action="store_true",
                   help="also time fwd+bwd with kernels stubbed (communication) and collectives stubbed (compute)")
    p.add_argument("--comm-priority", default="normal", help="real runs: normal, high or both (normal,high): the "
                   "NCCL streams' priority of the group the backends communicate on; with both, each backend runs on "
                   "each, labelled @normal and @high")
    p.add_argument("--trace", metavar="DIR", help="real runs: also every rank's host ms per phase (printed) and an op "
                   "profile of one step per rank and backend (DIR/<workload>_<backend>_rank<r>.txt)")
    args = p.parse_args()
    if args.quick:
        args.seqs, args.packed_seqs, args.reps, args.check_max = "512", "512", 1, 512
    args.seqs = [int(s) for s in args.seqs.split(",") if s]
    args.packed_seqs = [int(s) for s in args.packed_seqs.split(",") if s]
    args.kv_heads = [int(s) for s in args.kv_heads.split(",")]
    args.backends = args.backends.split(",")
    args.mix = args.mix.split(",")
    args.comm_priority = args.comm_priority.split(",")
    if not set(args.comm_priority) <= {"normal", "high"}:
        p.error(f"--comm-priority takes normal, high or normal,high, got {','.join(args.comm_priority)}")
    if "high" in args.comm_priority and (args.quick or args.emulate or high_priority_options() is None):
        p.error("--comm-priority high sets the priority of NCCL's streams: a real run on GPUs (not --quick or "
                "--emulate, and a torch with NCCL)")
    unknown = [m for m in args.mix if m not in WORKLOAD_MIXES]
    if unknown:
        p.error(f"unknown --mix {', '.join(unknown)}; choose from {', '.join(WORKLOAD_MIXES)}")
    for label in args.backends:  # a misspelt backend option, said once, before any process starts
        backend, options = backend_and_options(label)
        if options:
            try:
                check_options(backend, options)
            except ValueError as exc:
                p.error(f"--backends {label}: {exc}")
    if args.emulate:
        return emulated(args)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
