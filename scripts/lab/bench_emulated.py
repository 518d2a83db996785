"""Per-rank kernel balance of every backend at W = 4..64 ranks, emulated on one GPU, in one call.

Each configuration runs the W ranks' shares of one forward+backward step on one device (same plans,
schedules, kernels and merges as a real run; transfers as local copies; see
:mod:`hf_longctx.lab.emulation`), measures each rank's kernel time and counts its bytes, and predicts the
step time of a real group from the measured link bandwidths of the design document's section 7
(reference numbers: NCCL sendrecv and all_to_all per rank on 4x H200). CAD runs five ways: balanced
on FLOPs at eps 0.1 (the default), on the kernel's profiled cost at eps 0.1 and 0.01 (also with every
server's batch in one kernel call, as before batches were cut into calls of similar segments), and on
the profiled cost with eps chosen by predicted step time; for the profiled runs the predicted
per-server cost (``server_costs``: segments plus what the calls add) is compared with the emulated
per-server kernel time. One CAD
eps sweep is measured end to end. Every number is marked "emulated on one GPU".

    python scripts/lab/bench_emulated.py --out <file>.md         # GPU, about 8 minutes
    python scripts/lab/bench_emulated.py --quick --out <file>.md # CPU smoke run, tiny sizes
    python scripts/lab/bench_emulated.py --kernel torch_flash --mixes pretrain --out <file>.md  # one mix per process

Without FlashAttention-4, name ``--kernel torch_flash``: ``auto`` then picks the dense cuDNN kernel for
equal-length groups, which builds a graph per shape inside the timed calls.

Repetitions: every configuration runs ``--warmup`` untimed steps, then ``--reps`` timed ones (default
2), and each rank's kernel time is the lower median of its timed steps (with 2: the smaller), so a
first-call outlier (one run showed distfa at W=16 with max/mean 8.3 where its neighbours had 1.7-2.2)
does not reach the tables. With two or more, each row's notes give the timing noise of one repetition
(from how each rank's repetitions differ) and the max/mean that this noise alone gives W equal ranks:
the part of the measured imbalance that no schedule can remove.

GPU memory: on an H200 one process that ran ProLong at W = 4..64 and then started the next mix once ran
out of GPU memory. Every shard plan referred to itself (a reference cycle), so a configuration's plan,
with the device index tensors its backends cache on it, outlived the configuration until the garbage
collector's next full pass; and every emulated step started one new thread per rank, in which torch's
cuDNN attention builds graphs that it leaks at thread exit. Plans now free with their last user, rank
threads are reused, and memory is released between configurations; the output lists the device's
memory after every W (allocated, reserved and free), so growth would show. (On an H200 with
torch_flash it stayed at the 5 GiB of the global tensors from ProLong W=4 through Pretrain W=64.)
One configuration alone can still exceed the device: CAD on ProLong at W=64 holds the gathered key
rows of all 64 ranks at once and ran out of memory on an H200 in four of its five variants; such a
configuration runs again with its all_to_all buffers on the host (as ``--stage-on-host`` does for every
one; its kernels are timed as before). Each such row gives the largest all_to_all's bytes (about what the host
holds at once), and the memory lines the process's peak resident host memory.

Nodes: by default every transfer is priced on the NVLink curves of one node, whatever W. ``--node-size N`` (and
``--inter-node-gbps X``, GB/s per GPU between nodes) prices them on two tiers
(:class:`~hf_longctx.comm.links.LinkTiers`): ranks ``r // N`` share a node, the bytes a rank sends to another node
cross the network, and each row gives the most a rank sent inside its node and to other nodes.

Two-dimensional backends: ``--backends`` takes ``ulysses_<outer>`` names (Ulysses inside groups of
``--ulysses-size`` consecutive ranks, ``<outer>`` across them; a comma-separated list of sizes runs each), e.g.
``--backends ring,ulysses_ring --ulysses-size 8 --node-size 8``.

``--calibrate N``: after each CAD run on a measured model, N rounds of the schedule made again with every task priced
at its server's measured over predicted kernel time (:mod:`hf_longctx.lab.cad.calibrate`) and emulated again;
each round's row gives the scales, its calibrated prediction and how many servers' tasks changed.

Configurations run in order (mix, then W, then backend); each mix gets its share of what ``--budget-s`` leaves
after the set-up (a cost profile made now, the warm-up; time a mix leaves unused carries over), and the
configurations left out are listed in the output.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from hf_longctx.backends.cad.cost_model import ProfiledCostModel
from hf_longctx.backends.cad.eps import EPS_CANDIDATES, a2a_bandwidth, candidate, choose_eps
from hf_longctx.backends.cad.launch_cost import TERM_NAMES, LaunchCostModel
from hf_longctx.backends.cad.runtime import cad_schedule, prepare, server_costs
from hf_longctx.backends.ulysses_mesh import OPTION as ULYSSES_SIZE
from hf_longctx.benchmarking import HOST_AHEAD, table_header, table_row, token_counts
from hf_longctx.comm.links import INTER_NODE_BYTES_PER_S, LinkTiers
from hf_longctx.lab.cad.calibrate import recalibrate
from hf_longctx.lab.cad.profiled import ProfileBudget, SegmentShape, measured_cost_model
from hf_longctx.lab.emulation import (
    EmulatedStep,
    device_memory,
    emulate_step_or_stage,
    host_peak_memory,
    link_sources,
    release_memory,
)
from hf_longctx.lab.emulation.timing import KernelTimer
from hf_longctx.lab.emulation.workloads import doc_lengths, global_tensors
from hf_longctx.layout import PackedBatch, shard_plan

MiB = float(1 << 20)


MEASURED_MODELS = (ProfiledCostModel, LaunchCostModel)


def is_mesh(backend: str) -> bool:
    """Whether ``backend`` is a two-dimensional ``ulysses_<outer>`` (it needs ``--ulysses-size``)."""
    return backend.startswith("ulysses_")


def variants(backends: list[str], profiled, grid=None, ulysses_sizes: list[int] = ()
             ) -> list[tuple[str, str, dict | None]]:
    """(label, backend, options) of every run of one configuration; the first is ``auto``'s default. ``grid``: a
    second measured model (the interpolated grid beside the launch model) run at eps 0.01 too. A two-dimensional
    backend runs once per size of ``ulysses_sizes`` (labelled ``<name> U=<size>``), with its outer backend's default
    options."""
    out = []
    for b in backends:
        if is_mesh(b):
            out += [(f"{b} U={u}", b, {ULYSSES_SIZE: u}) for u in ulysses_sizes]
            continue
        if b == "cad":
            out.append(("cad flops eps0.1", "cad", {"cost_model": "flops", "eps": 0.1}))
            out.append(("cad profiled eps0.1", "cad", {"cost_model": profiled, "eps": 0.1}))
            out.append(("cad profiled eps0.01", "cad", {"cost_model": profiled, "eps": 0.01}))
            # what key cuts buy (a task's first keys given away as a rectangle, see hf_longctx.backends.cad.tasks)
            out.append(("cad profiled eps0.01 no key cuts", "cad", {"cost_model": profiled, "eps": 0.01,
                                                                    "key_cuts": False}))
            # what cutting a server's batch into calls of similar segments buys (hf_longctx.kernels.calls)
            out.append(("cad profiled eps0.01 one call", "cad", {"cost_model": profiled, "eps": 0.01,
                                                                  "call_terms": None}))
            # what ejection chains buy where no single move lowers the busiest (hf_longctx.backends.cad.refine)
            out.append(("cad profiled eps0.01 no chains", "cad", {"cost_model": profiled, "eps": 0.01,
                                                                   "refine_chains": False}))
            out.append(("cad profiled eps auto", "cad", {"cost_model": profiled, "eps": "auto"}))
            # the refinement pricing every move in full, not the screened few (hf_longctx.backends.cad.refine)
            out.append(("cad profiled eps0.01 every move", "cad", {"cost_model": profiled, "eps": 0.01,
                                                                    "refine_screen": 0}))
            if grid is not None:
                out.append(("cad grid-profiled eps0.01", "cad", {"cost_model": grid, "eps": 0.01}))
        else:
            out.append((b, b, None))
    return out


def predicted_vs_emulated(step: EmulatedStep, batch: PackedBatch, options: dict
                          ) -> tuple[float, float, float, list[float]]:
    """For a CAD run on a profiled model (milliseconds): (largest |predicted - emulated| / emulated over servers,
    eps used, max/mean of the predicted per-server times, the predicted times). Predicted: what the runtime's
    kernel calls on each server cost (``server_costs``)."""
    plan = shard_plan(batch, step.world, "cad")
    predicted = server_costs(plan, options).tolist()
    errs = [abs(p * 1e-3 - m) / m for p, m in zip(predicted, step.kernel_s) if m > 0]
    mean = statistics.fmean(predicted)
    return ((max(errs) if errs else math.nan), cad_schedule(plan, options).eps,
            (max(predicted) / mean if mean else 1.0), predicted)


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text)


def dump_calls(path: Path, step: EmulatedStep, batch: PackedBatch, options: dict, predicted_ms: list[float],
               reps: list[list[dict]]) -> None:
    """One CAD configuration's kernel calls per timed repetition, with the per-server prediction (ms)."""
    path.write_text(json.dumps({
        "world": step.world, "doc_lens": [int(x) for x in batch.doc_lens], "eps": options.get("eps"),
        "kernel_s": step.kernel_s, "predicted_ms": predicted_ms, "reps": reps}))


def segment_terms(model) -> str:
    """What the measured model charges beyond a segment's rows (see ProfiledCostModel, LaunchCostModel), for the
    header."""
    if isinstance(model, LaunchCostModel):
        terms = "; ".join(f"{p}: " + ", ".join(f"{k} {v:.3g}" for k, v in zip(
            TERM_NAMES, model.terms(p).as_vector())) + f" {model.units}" for p in ("forward", "backward"))
        names = "tile step, row, key, launched block, segment, call, spilled key and merged row"
        return f"; fitted terms per {names} ({terms})"
    if not isinstance(model, ProfiledCostModel):
        return ""
    tile = f", partial tiles of {model.tile} priced whole" if model.tile else ""
    return f"; {model.segment_cost:.4f} {model.units} per segment on top of its rows{tile}"


def tokens_label(total: int) -> str:
    return f"{total // 1024}K" if total >= 1024 else str(total)


def row(mix, total, batch, world, label, step: EmulatedStep, extra: str) -> str:
    """One table row (:func:`columns`): with tiers, the most one rank sent inside its node and to other nodes."""
    sent = step.sent_bytes
    nodes = [f"{max(step.intra_node_bytes) / MiB:.1f}", f"{max(step.inter_node_bytes) / MiB:.1f}"] \
        if step.tiers is not None else []
    return table_row([mix, tokens_label(total), batch.num_docs, world, label, f"{step.imbalance:.3f}",
                      f"{max(step.kernel_s) * 1e3:.2f}", f"{statistics.fmean(step.kernel_s) * 1e3:.2f}",
                      f"{max(sent) / MiB:.1f}", f"{statistics.fmean(sent) / MiB:.1f}", *nodes,
                      f"{step.predicted_step_s * 1e3:.2f}", f"{step.predicted_overlapped_s * 1e3:.2f}",
                      f"{step.tflops_per_device:.0f}", extra])


COLUMNS = ["mix", "tokens", "docs", "W", "backend", "max/mean kernel", "max kernel ms", "mean kernel ms",
           "max MiB sent/rank", "mean MiB sent/rank", "pred. step ms (no overlap)", "pred. step ms (overlap)",
           "pred. TFLOP/s/GPU", "notes"]
NODE_COLUMNS = ["max MiB intra-node/rank", "max MiB inter-node/rank"]


def columns(tiers: LinkTiers | None) -> list[str]:
    """The table's columns: with tiers, the bytes inside a node and between nodes after the bytes sent."""
    if tiers is None:
        return COLUMNS
    at = COLUMNS.index("pred. step ms (no overlap)")
    return COLUMNS[:at] + NODE_COLUMNS + COLUMNS[at:]


def link_tiers(node_size: int | None, inter_node_gbps: float | None) -> LinkTiers | None:
    """The tiers ``--node-size`` and ``--inter-node-gbps`` ask for (either alone: the other's default); None for
    neither (one NVLink node)."""
    if node_size is None and inter_node_gbps is None:
        return None
    return LinkTiers(node_size=node_size or LinkTiers.node_size,
                     inter_node_bytes_per_s=INTER_NODE_BYTES_PER_S if inter_node_gbps is None
                     else inter_node_gbps * 1e9)


FASTEST_HEADING = "## The fastest on emulated times (auto's own choice: scripts/bench_backend_table.py)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="markdown file the tables are written to")
    p.add_argument("--worlds", default="4,8,16,64")
    p.add_argument("--mixes", default="prolong,pretrain,sft")
    p.add_argument("--tokens", default="prolong:256k,pretrain:256k,sft:128k",
                   help="tokens per rank-group for each mix (mix:tokens, comma separated)")
    p.add_argument("--backends", default="ring,zigzag,distfa,tasp,cad,ulysses")
    p.add_argument("--kernel", default="auto")
    p.add_argument("--warmup", type=int, default=0, help="untimed steps per configuration (a warm-up pass of "
                   "every backend at the smallest W runs first anyway)")
    p.add_argument("--reps", type=int, default=2, help="timed steps per configuration; each rank's kernel time is "
                   "the lower median over them (with 2: the smaller)")
    p.add_argument("--eps-sweep", default="prolong:16", help="mix:W at which CAD's eps sweep is measured")
    p.add_argument("--skip", default="tasp:64",
                   help="backend:W pairs not run (tasp at W=64 makes ~3000 kernel calls per rank and step: 63 rings x "
                        "63 hops; alone it needs minutes: run it with --worlds 64 --backends tasp --skip ''")
    p.add_argument("--budget-s", type=float, default=420.0, help="start no configuration after this many seconds")
    p.add_argument("--also-grid", action="store_true", help="beside the launch cost model, run CAD at eps 0.01 on "
                   "the interpolated grid profile too (when the kernel declares a launch grid)")
    p.add_argument("--cad-runs", default="", help="comma-separated labels of the CAD runs to make (default: all), "
                   "e.g. 'cad flops eps0.1,cad profiled eps0.01'")
    p.add_argument("--stage-on-host", action="store_true", help="all_to_all buffers live on the host "
                   "(EmulationHub's stage_on_host): for steps whose ranks' buffers do not fit on the device together")
    p.add_argument("--host-ahead", choices=("adaptive", "fixed"), default="adaptive",
                   help="the device's spin before each timed call: as long as the host's dispatch needs (adaptive), "
                        "or the fixed ~2 ms of HOST_AHEAD_CYCLES (to compare with runs made so)")
    p.add_argument("--seed", type=int, default=0, help="which batch of each mix's documents (the lengths' seed)")
    p.add_argument("--quick", action="store_true", help="CPU smoke run: tiny sizes, reference kernel")
    p.add_argument("--calibrate", type=int, default=0, metavar="N",
                   help="after each CAD run on a measured model, N rounds of: the schedule made again with every "
                        "task priced at its server's measured over predicted kernel time (hf_longctx.backends.cad."
                        "calibrate), and emulated again (rows labelled 'calibrated K')")
    p.add_argument("--node-size", type=int, default=None, metavar="N",
                   help="price transfers on two link tiers: N GPUs per node share NVLink (the measured curves), bytes "
                        "to other nodes cross the network (default: every rank in one node)")
    p.add_argument("--inter-node-gbps", type=float, default=None, metavar="X",
                   help=f"GB/s (1e9 bytes/s) per GPU between nodes, with --node-size (default "
                        f"{INTER_NODE_BYTES_PER_S / 1e9:.0f}: one 400 Gb/s NIC per GPU); alone, nodes of "
                        f"{LinkTiers.node_size}")
    p.add_argument("--ulysses-size", default="", metavar="U[,U...]",
                   help="ranks per Ulysses group of the ulysses_<outer> backends in --backends (each size a run)")
    p.add_argument("--dump-calls", default=None, metavar="DIR",
                   help="write every kernel call (segment lengths, seconds) of the profiled CAD runs and the profile "
                        "they were scheduled on as JSON into DIR, to check the cost model call by call")
    args = p.parse_args(argv)
    HOST_AHEAD.adaptive = args.host_ahead == "adaptive"
    t_start = time.perf_counter()
    wanted_cad = [x.strip() for x in args.cad_runs.split(",") if x.strip()]
    labels = [label for label, _, _ in variants(["cad"], None, grid=object())]
    if set(wanted_cad) - set(labels):  # a misspelt label is caught before anything is profiled
        print(f"--cad-runs: unknown run(s) {sorted(set(wanted_cad) - set(labels))}; the CAD runs are {labels}",
              file=sys.stderr)
        return 2
    ulysses_sizes = token_counts(args.ulysses_size) if args.ulysses_size else []
    if any(is_mesh(b) for b in args.backends.split(",")) and not ulysses_sizes:
        print("--backends names a two-dimensional ulysses_<outer> backend: give its --ulysses-size (ranks per "
              "Ulysses group, e.g. the GPUs of one node)", file=sys.stderr)
        return 2
    try:
        tiers = link_tiers(args.node_size, args.inter_node_gbps)
    except ValueError as err:
        print(f"--node-size / --inter-node-gbps: {err}", file=sys.stderr)
        return 2
    if args.quick:
        device = torch.device("cpu")
        shape = SegmentShape(heads=4, kv_heads=2, head_dim=16, dtype=torch.float32)
        args.kernel = "reference" if args.kernel == "auto" else args.kernel
        if args.tokens == p.get_default("tokens"):
            args.tokens = "prolong:512,pretrain:512,sft:512"
        if args.worlds == p.get_default("worlds"):
            args.worlds = "2,4"
        if args.eps_sweep == p.get_default("eps_sweep"):
            args.eps_sweep = "prolong:4"
        grid = dict(q_lens=(16, 64, 256), kv_lens=(16, 64, 256, 1024),
                    budget=ProfileBudget(min_tokens=256, max_kv_tokens=4096, max_pairs=65536, warmup=0, reps=1))
        profiled, source = measured_cost_model(args.kernel, device, shape, **grid)
    else:
        if not torch.cuda.is_available():
            print("bench_emulated.py needs a CUDA device (or --quick for the CPU smoke run)", file=sys.stderr)
            return 2
        device = torch.device("cuda", torch.cuda.current_device())
        shape = SegmentShape()
        profiled, source = measured_cost_model(args.kernel, device, shape)
    grid_model = None
    if args.also_grid and isinstance(profiled, LaunchCostModel):
        grid_model, grid_source = measured_cost_model(args.kernel, device, shape, model="grid")
        source += f"; beside it the grid profile: {grid_source}"
    print(f"cost model: {source}", flush=True)
    worlds = token_counts(args.worlds)
    mixes = args.mixes.split(",")
    tokens = {m: token_counts(t)[0] for m, t in (x.split(":") for x in args.tokens.split(","))}
    backends = args.backends.split(",")
    runs = variants(backends, profiled, grid_model, ulysses_sizes)
    if wanted_cad:
        runs = [r for r in runs if r[1] != "cad" or r[0] in wanted_cad]
    skip = set(filter(None, args.skip.split(",")))
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"

    timers: list[KernelTimer] = []

    def keep_calls(hub, dev) -> KernelTimer:
        timers.append(KernelTimer(hub, dev, keep_calls=True))
        return timers[-1]

    def emulate(batch, w, tensors, backend, options) -> tuple[EmulatedStep, bool]:
        """The step, and whether its all_to_all buffers were staged on the host (:func:`emulate_step_or_stage`:
        one large configuration does not leave a hole in the table)."""
        timers.clear()
        dump = args.dump_calls and backend == "cad" and options and options.get("cost_model") is profiled \
            and isinstance(profiled, MEASURED_MODELS)
        return emulate_step_or_stage(batch, w, tensors, backend, options=options, kernel=args.kernel,
                                     warmup=args.warmup, reps=args.reps, stage_on_host=args.stage_on_host,
                                     make_timer=keep_calls if dump else KernelTimer, tiers=tiers)

    if args.dump_calls and isinstance(profiled, MEASURED_MODELS):
        Path(args.dump_calls).mkdir(parents=True, exist_ok=True)
        profiled.save(Path(args.dump_calls) / "profile.json", source=source)

    # warm-up: every backend once at the smallest W (kernels compile per configuration, not per shape)
    warm = PackedBatch.from_doc_lens(doc_lengths(mixes[0], min(tokens[mixes[0]], 32768), seed=1))
    warm_tensors = global_tensors(warm.num_tokens, shape.heads, shape.kv_heads, shape.head_dim, shape.dtype, device,
                                  seed=1)
    for _, backend, options in runs:
        if f"{backend}:{min(worlds)}" in skip:
            continue
        try:
            emulate(warm, min(worlds), warm_tensors, backend, options)
        except Exception as exc:  # noqa: BLE001 - reported in its row later
            print(f"warm-up {backend}: {type(exc).__name__}: {exc}", flush=True)
    del warm_tensors

    release_memory(device)
    rows, skipped, choices, sweep_rows, memory = [], [], [], [], []
    sweep_mix, sweep_w = args.eps_sweep.split(":")
    set_up_s = time.perf_counter() - t_start  # a profile made now and the warm-up come before any mix's share
    for i_mix, mix in enumerate(mixes):
        # each mix gets its share of what the set-up left; unused time carries over
        deadline = set_up_s + (args.budget_s - set_up_s) * (i_mix + 1) / len(mixes)
        total = tokens[mix]
        batch = PackedBatch.from_doc_lens(doc_lengths(mix, total, seed=args.seed))
        tensors = global_tensors(total, shape.heads, shape.kv_heads, shape.head_dim, shape.dtype, device, seed=total)
        for w in worlds:
            steps: dict[str, EmulatedStep] = {}
            for label, backend, options in runs:
                if f"{backend}:{w}" in skip:
                    skipped.append(f"{mix} W={w} {label} (--skip)")
                    continue
                if time.perf_counter() - t_start > deadline:
                    skipped.append(f"{mix} W={w} {label}")
                    continue
                t0 = time.perf_counter()
                try:
                    step, staged = emulate(batch, w, tensors, backend, options)
                except Exception as exc:  # noqa: BLE001 - one call measures everything; report and go on
                    rows.append(table_row([mix, tokens_label(total), batch.num_docs, w, label]
                                          + ["-"] * (len(columns(tiers)) - 6)
                                          + [f"{type(exc).__name__}: {str(exc)[:120]}"]))
                    print(rows[-1], flush=True)
                    continue
                steps[label] = step
                notes = []
                if backend == "cad" and options and isinstance(options.get("cost_model"), MEASURED_MODELS):
                    err, eps, pred_imb, predicted = predicted_vs_emulated(step, batch, options)
                    notes += [f"eps {eps:g}", f"predicted max/mean {pred_imb:.3f}",
                              f"predicted vs emulated per-server time: max err {err * 100:.1f}%"]
                    if timers:
                        dump_calls(Path(args.dump_calls) / f"{mix}_w{w}_{_slug(label)}.json", step, batch, options,
                                   predicted, [t.call_log() for t in timers[-args.reps:]])
                if staged:
                    notes.append(f"largest all_to_all {step.largest_all_to_all / float(1 << 30):.1f} GiB (staged on "
                                 "the host" + ("" if args.stage_on_host else ": the device ran out of memory") + ")")
                if step.noise_floor is not None:
                    notes.append(noise_note(step))
                if step.host_overruns:
                    notes.append(f"{step.host_overruns} of {step.timed_calls} timed calls' dispatch outran the "
                                 "device's spin (their time holds host time)")
                extra = "; ".join(notes) + f" ({time.perf_counter() - t0:.1f} s)"
                rows.append(row(mix, total, batch, w, label, step, extra.strip()))
                print(rows[-1], flush=True)
                if args.calibrate and backend == "cad" and options \
                        and isinstance(options.get("cost_model"), MEASURED_MODELS):
                    for name, cal_options, cal_step, cal_notes in calibrated_runs(
                            batch, w, tensors, step, options, args.calibrate, emulate):
                        if timers:
                            dump_calls(Path(args.dump_calls) / f"{mix}_w{w}_{_slug(label + ' ' + name)}.json",
                                       cal_step, batch, cal_options,
                                       server_costs(shard_plan(batch, w, "cad"), cal_options).tolist(),
                                       [t.call_log() for t in timers[-args.reps:]])
                        rows.append(row(mix, total, batch, w, f"{label} {name}", cal_step, cal_notes))
                        print(rows[-1], flush=True)
            if steps:
                seconds = {n: s.predicted_step_s for n, s in steps.items()}
                order = sorted(seconds, key=seconds.get)
                choices.append(f"- {mix} {tokens_label(total)}, W={w}: fastest emulated -> " + ", ".join(
                    f"{n} {seconds[n] * 1e3:.1f} ms" for n in order[:3]))
                print(choices[-1], flush=True)
            if mix == sweep_mix and str(w) == sweep_w and "cad" in backends \
                    and time.perf_counter() - t_start <= args.budget_s:
                sweep_rows += eps_sweep(batch, w, tensors, profiled, emulate, mix, total)
            del steps
            release_memory(device)
            memory.append(f"- after {mix} W={w}: {device_memory(device)}; {host_peak_memory()}")
            print(memory[-1], flush=True)
        del tensors
        release_memory(device)

    elapsed = time.perf_counter() - t_start
    lines = [f"# Sequence-parallel backends, emulated on one GPU ({device_name})", "",
             f"Every number below is **emulated on one GPU**: the W ranks of one forward+backward step run on one "
             f"{device_name} with the real plans, schedules, kernels ({args.kernel}) and merges; transfers are local "
             "copies. Kernel times are measured per rank (CUDA events around each kernel call, ranks never "
             f"interleaved), {args.warmup} untimed and {args.reps} timed steps per configuration, each rank's kernel "
             "time the lower median over the timed steps (of 2: the smaller); 'noise alone max/mean' is what the "
             "repetitions' spread alone gives W ranks of equal work; bytes are counted per rank. "
             "Predicted step = slowest rank's kernels + slowest rank's transfers (no overlap; 'overlap' = the larger "
             "of the two per rank). Predicted TFLOP/s/GPU = causal "
             f"attention FLOPs (fwd+bwd, x3.5) / W / predicted step. Heads {shape.heads}, KV heads "
             f"{shape.kv_heads}, head dim {shape.head_dim}, {str(shape.dtype).removeprefix('torch.')}.", "",
             f"CAD cost model: {source}{segment_terms(profiled)}.", "",
             *link_intro(tiers), ""]
    lines += [f"- {s}" for s in link_sources(tiers)]
    lines += ["", table_header(columns(tiers)), *rows, "", FASTEST_HEADING, "", *choices]
    if sweep_rows:
        lines += ["", f"## CAD eps sweep ({sweep_mix}, W={sweep_w}, profiled cost), emulated on one GPU", "",
                  table_header(["eps", "max/mean kernel", "max kernel ms", "max MiB sent/rank", "pred. step ms",
                                "schedule's own prediction ms", "notes"]), *sweep_rows]
    lines += ["", "## Device memory between configurations", "", *memory]
    if device.type == "cuda":
        lines += ["", f"The device spun ahead of each timed call ({args.host_ahead}; the longest spin "
                  f"{HOST_AHEAD.longest_spin_s * 1e3:.1f} ms); {HOST_AHEAD.overruns} of {HOST_AHEAD.regions} timed "
                  "regions (warm-ups and profiling included) took the host longer to enqueue than their spin lasted."]
    if skipped:
        lines += ["", f"Not run (--skip, or the time budget of {args.budget_s:.0f} s spent): " + ", ".join(skipped)]
    lines += ["", f"Total {elapsed:.0f} s; torch {torch.__version__}; command: python scripts/lab/bench_emulated.py "
              + " ".join(sys.argv[1:] if argv is None else argv)]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def link_intro(tiers: LinkTiers | None) -> list[str]:
    """The sentence before the link sources: one node, or the tiers the transfers are priced on."""
    if tiers is None:
        return ["Link bandwidths of the communication model (within one NVLink node; W > 8 assumes the same "
                "per-rank bandwidth, which a multi-node group does not have):"]
    return [f"Link bandwidths of the communication model, over nodes of {tiers.node_size} GPUs (ranks r // "
            f"{tiers.node_size} share one); a call lasts as long as the slower of its bytes inside its node and its "
            "bytes to other nodes ('intra-node' and 'inter-node' columns: the most one rank sent each way):"]


def noise_note(step: EmulatedStep) -> str:
    return f"timing noise {step.timing_noise * 100:.2f}% per repetition, noise alone max/mean {step.noise_floor:.3f}"


def _by_server(tasks) -> dict[int, frozenset]:
    out: dict[int, set] = {}
    for t in tasks:
        out.setdefault(t.server, set()).add(t)
    return {server: frozenset(ts) for server, ts in out.items()}


def calibrated_runs(batch: PackedBatch, world: int, tensors, step: EmulatedStep, options: dict, rounds: int,
                    emulate):
    """``rounds`` times: CAD's schedule made again on the last run's measured per-server kernel times
    (:func:`~hf_longctx.lab.cad.calibrate.recalibrate`) and emulated. Yields (name, the options run, the step,
    its notes) per round; ``emulate(batch, world, tensors, backend, options)`` returns (step, staged)."""
    plan = shard_plan(batch, world, "cad")
    current = {**options, "tasks": prepare(plan, options).tasks}  # the run's schedule, made once here
    for k in range(1, rounds + 1):
        t0 = time.perf_counter()
        rec = recalibrate(plan, current, step.kernel_s)
        host_s = time.perf_counter() - t0
        old, new = _by_server(current["tasks"]), _by_server(rec.tasks)
        changed = sum(old.get(s) != new.get(s) for s in range(world))
        current = {**options, "tasks": rec.tasks}
        step, staged = emulate(batch, world, tensors, "cad", current)
        predicted = rec.after / rec.after.mean()
        measured = np.asarray(step.kernel_s) / statistics.fmean(step.kernel_s)
        err = max(abs(p - m) / m for p, m in zip(predicted, measured) if m > 0)
        notes = [f"scales {rec.scales.min():.3f}-{rec.scales.max():.3f}",
                 f"calibrated prediction max/mean {predicted.max():.3f} (the run before measured "
                 f"{rec.before.max() / rec.before.mean():.3f})",
                 f"per-server time vs calibrated prediction, each over its mean: max err {err * 100:.1f}%",
                 f"{changed} servers' tasks changed", f"recalibrated in {host_s:.1f} s on the host"]
        if staged:
            notes.append("staged on the host")
        if step.noise_floor is not None:
            notes.append(noise_note(step))
        yield f"calibrated {k}", current, step, "; ".join(notes) + f" ({time.perf_counter() - t0:.1f} s)"


def eps_sweep(batch, w, tensors, profiled, emulate, mix, total) -> list[str]:
    """CAD at every candidate eps on the profiled model: measured step vs the schedule's own prediction,
    and which eps the rule picks (from the schedules) against which the emulation finds fastest."""
    plan = shard_plan(batch, w, "cad")
    measured, cands = {}, []
    for eps in EPS_CANDIDATES:
        options = {"cost_model": profiled, "eps": eps}
        measured[eps] = emulate(batch, w, tensors, "cad", options)[0]
        cands.append(candidate(cad_schedule(plan, options), profiled))
    bandwidth = a2a_bandwidth(max(c.max_bytes for c in cands))
    rule = choose_eps(cands, bandwidth).eps
    best = min(measured, key=lambda e: (measured[e].predicted_step_s, -e))
    out = []
    for c in cands:
        s = measured[c.eps]
        notes = "; ".join(x for x in ("rule's choice" if c.eps == rule else "",
                                      "fastest emulated" if c.eps == best else "") if x)
        out.append(table_row([f"{c.eps:g}", f"{s.imbalance:.3f}", f"{max(s.kernel_s) * 1e3:.2f}",
                              f"{max(s.sent_bytes) / MiB:.1f}", f"{s.predicted_step_s * 1e3:.2f}",
                              f"{c.step_seconds(bandwidth) * 1e3:.2f}", notes]))
        print(out[-1], flush=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
