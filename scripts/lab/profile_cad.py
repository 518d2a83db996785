"""Profile core-attention segment cost on a GPU for the CAD scheduler's ProfiledCostModel.

Each grid cell is one CA-task shape: ``q_len`` query rows attending, bottom-right causally, to
``kv_len`` keys. Attention servers run many tasks in one fused varlen call, so a cell is timed as a
packed batch of identical segments (enough copies to reach ``--min-tokens`` query rows, bounded by
``--max-kv-tokens`` keys in memory) and divided by the number of copies: the cost a task adds to a
fused batch, without the launch overhead of a lone small call. Cells whose causal work exceeds
``--max-pairs`` visible (query, key) pairs are not run; they are filled from the measured cell of
the same row with the most work, scaled by FLOPs (such cells are compute bound), and listed in
``meta.extrapolated``.

What a segment costs whatever its size (``segment_cost`` in the JSON): a batch of equal segments is
timed whole and with every segment cut in two (same query rows, keys and visible pairs; one more
segment per cut, as CAD's splits make them), and the difference per cut is the term (median over a
few key lengths; ``meta.segment_cost_samples`` lists them). The grid then holds what the rows cost and
every segment pays the term on top. ``tile`` (``--tile``, 128 on a GPU) prices partial kernel tiles as
full ones. See :class:`hf_longctx.backends.cad.cost_model.ProfiledCostModel`.

Kernel: ``auto`` (default) resolves to the kernel an attention server's fused batch runs: segments
with fewer queries than keys, which rules out cuDNN's dense path (it takes only q_len == kv_len
causal segments of a few distinct shapes), so without FlashAttention-4 it is ``torch_flash``. The
kernel that ran is recorded in ``meta.kernel``.

Run on the GPU machine:

    python scripts/lab/profile_cad.py --out cad_profile.json

then ``ProfiledCostModel.load("cad_profile.json")`` and pass it to
``hf_longctx.backends.cad.scheduler.assign_servers(..., cost_model=...)``. ``--mode fwd`` times the
forward only; the default ``fwd+bwd`` is what a training step pays. ``--device cpu`` runs the same
measurements on the CPU (reference kernel, tiny sizes: a smoke run, not a profile to schedule on).

``--launch N`` fits the launch cost model instead (:mod:`hf_longctx.lab.cad.call_profile`): N random kernel
calls, forward and backward timed apart, six terms per phase by non-negative least squares, and the error on every
fourth call held out of the fit. It needs a kernel that declares a launch grid (torch_flash at head dim 128).
``--sweep prefix,waves,square`` (with ``--launch N``, or ``--load`` of a saved launch model) then times single-segment
calls along those lines (:func:`~hf_longctx.lab.cad.call_profile.sweep_shapes`) and prints each phase's
measured and predicted time: where the model follows the kernel and where it does not. ``--mix`` (likewise) times
a long causal prefix beside short documents as one call and as two (:func:`~hf_longctx.lab.cad.call_profile.
mix_pairs`): what one call costs more than two, measured and as the model prices it. ``--calls DUMP.json`` (with
``--load`` of a launch model) prices the kernel calls that ``bench_emulated.py --dump-calls`` wrote for one emulated
step and prints every server's forward and backward, measured against predicted, then which phase makes the
servers' spread and how the calls' error runs with their size in waves of blocks; no device is needed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from hf_longctx.backends.cad.cost_model import ProfiledCostModel
from hf_longctx.backends.cad.launch_cost import KIND as LAUNCH_KIND
from hf_longctx.backends.cad.launch_cost import PHASES, LaunchCostModel, clear_pricing_caches
from hf_longctx.backends.cad.runtime import prepare, server_costs
from hf_longctx.benchmarking import token_counts
from hf_longctx.kernels.key_split import RULE, KeySplit, plan_key_split
from hf_longctx.lab.cad.call_profile import (
    SERVER_CALLS,
    STEP_CALL_SEEDS,
    SWEEPS,
    check_call_mix,
    check_keys_limit,
    check_launch_cost,
    errors_by_waves,
    fit_timed_calls,
    mix_pairs,
    phase_spreads,
    placement_probes,
    profile_launch_cost,
    replay_dumped_calls,
    server_phase_errors,
    sweep_shapes,
    time_placement,
)
from hf_longctx.lab.cad.placement import fit_forward_placement
from hf_longctx.lab.cad.profiled import (
    ProfileBudget,
    SegmentShape,
    check_shapes,
    default_tile,
    device_name,
    launch_grid,
    profile_segment_costs,
    random_shapes,
    resolved_kernel,
)
from hf_longctx.lab.emulation.step_calls import StepCall, calls_of_logs
from hf_longctx.lab.emulation.workloads import doc_lengths
from hf_longctx.layout import PackedBatch, shard_plan

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def sizes(text: str) -> list[int]:
    return sorted(set(token_counts(text)))


def seed_list(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def sweeps(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in SWEEPS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown sweep {','.join(unknown) or text!r}; choose from {','.join(SWEEPS)}")
    return names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--q-lens", type=sizes, default=sizes("128,512,2k,8k,32k,128k,512k"))
    p.add_argument("--kv-lens", type=sizes, default=sizes("128,512,2k,8k,32k,128k,512k"))
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--kernel", default="auto",
                   help="kernel for attention_forward/backward; 'auto' profiles the kernel a server's batch runs")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke run of the measurements)")
    p.add_argument("--mode", choices=["fwd", "fwd+bwd"], default="fwd+bwd")
    p.add_argument("--min-tokens", type=int, default=65536, help="query rows per timed batch (at least)")
    p.add_argument("--max-kv-tokens", type=int, default=1 << 21, help="keys per timed batch (at most)")
    p.add_argument("--max-pairs", type=float, default=float(1 << 36),
                   help="largest visible (query, key) pairs of a measured cell; larger cells are extrapolated")
    p.add_argument("--tile", type=int, default=None,
                   help="kernel tile that partial tiles are rounded up to (default: 128 on a GPU, 0 on the CPU)")
    p.add_argument("--no-segment-cost", action="store_true", help="do not measure the per-segment term")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default="cad_profile.json")
    p.add_argument("--launch", type=int, default=0, metavar="N",
                   help="fit the launch cost model on N random calls instead of measuring the grid")
    p.add_argument("--server-calls", type=int, default=SERVER_CALLS, metavar="N",
                   help="--launch: then time up to N calls of CAD's servers scheduled on that fit, and fit again on "
                        f"all (default {SERVER_CALLS}, what the backend's profile times; 0: random calls only)")
    p.add_argument("--step-seeds", type=seed_list, default=STEP_CALL_SEEDS, metavar="S,...",
                   help="--launch: then emulate CAD's steps (call_profile.STEP_CALL_BATCHES) drawn with these seeds, "
                        "time their calls where they run, and fit again on all (default "
                        f"{','.join(map(str, STEP_CALL_SEEDS))}, what the backend's profile runs; '': none)")
    p.add_argument("--step-dumps", default=None, metavar="DUMP,...",
                   help="--refit: also fit the calls of these dumped emulated steps (bench_emulated.py --dump-calls), "
                        "each weighing as a call the profile timed in its own steps")
    p.add_argument("--load", default=None, metavar="PATH", help="check this profile instead of measuring one")
    p.add_argument("--check", type=int, default=0, metavar="N",
                   help="then time N random off-grid segment shapes and report the profile's error on them")
    p.add_argument("--sweep", type=sweeps, default=[], metavar="LINES",
                   help=f"with a launch model: time single-segment calls along these lines ({','.join(SWEEPS)})")
    p.add_argument("--mix", action="store_true",
                   help="with a launch model: time a long prefix beside short documents as one call and as two")
    p.add_argument("--placement", action="store_true",
                   help="with a launch model: time calls whose long forward blocks sit at chosen launch positions")
    p.add_argument("--keys-limit", action="store_true",
                   help="with a launch model: time the backward of one segment on both sides of the kernel's keys "
                        "limit, and three segments over it as one call and as the calls a server cuts them into")
    p.add_argument("--calls", default=None, metavar="DUMP",
                   help="with --load of a launch model: price an emulated step's dumped kernel calls per server")
    p.add_argument("--key-split", action="store_true",
                   help="--replay: also time every forward call cut into chunks of its keys, against it whole")
    p.add_argument("--replay", action="store_true",
                   help="with --calls: also time every dumped call again alone on the device, beside its time in the "
                        "step and the model's price")
    p.add_argument("--cold", action="store_true",
                   help="--launch and --replay: evict the L2 cache before every timed run (as HF_LONGCTX_PROFILE_L2="
                        "evicted fits the backend's model), where calls are otherwise timed again over warm buffers")
    p.add_argument("--predict", default=None, metavar="MIX:TOKENS:W,...",
                   help="with --load of a launch model: CAD's predicted per-server max/mean at eps 0.01 with and "
                        "without key cuts on these emulation mixes (e.g. prolong:128k:64), on the CPU")
    p.add_argument("--seeds", default="0,1,2", help="--predict: which batches of each mix")
    p.add_argument("--refine-screen", type=int, default=None, metavar="N",
                   help="--predict: the refinement's screen (0: every move priced; default: the runtime's)")
    p.add_argument("--fit-placement", default=None, metavar="DUMP,...",
                   help="with --load of a launch model: fit the paired-block forward simulation "
                        "(hf_longctx.lab.cad.placement) to these dumped steps' forward calls, on the CPU")
    p.add_argument("--empty", default="0,0.3", help="--fit-placement: how long an empty block holds its slot "
                   "(tile steps), each value fitted apart")
    p.add_argument("--refit", default=None, metavar="OUT",
                   help="with --load of a launch model that holds its timed calls: fit them again (on the CPU) and "
                        "write the model to OUT, e.g. on a grid with another --backward-min-steps")
    p.add_argument("--backward-min-steps", type=int, default=None, metavar="N",
                   help="--refit: the grid's backward_min_steps (0: none; default: the loaded model's)")
    p.add_argument("--scale", type=float, default=1.0, help=argparse.SUPPRESS)  # small sweep shapes, CPU tests
    args = p.parse_args(argv)
    if args.refit:
        return refit_saved_model(args)
    if args.calls and args.replay:
        return report_replayed_calls(args)
    if args.calls:
        return report_dumped_calls(args)
    if args.predict:
        return report_predicted_balance(args)
    if args.fit_placement:
        return report_placement_fit(args)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("profile_cad.py needs a CUDA device (or --device cpu for a smoke run)", file=sys.stderr)
        return 2
    kernel = "reference" if device.type == "cpu" and args.kernel == "auto" else args.kernel
    shape = SegmentShape(args.heads, args.kv_heads, args.head_dim, DTYPES[args.dtype])
    budget = ProfileBudget(min_tokens=args.min_tokens, max_kv_tokens=args.max_kv_tokens, max_pairs=args.max_pairs,
                           max_batch_pairs=float(1 << 62), warmup=args.warmup, reps=args.reps)
    tile = default_tile(device) if args.tile is None else args.tile
    if args.launch:
        kernel = resolved_kernel(kernel, shape, device)
        grid = launch_grid(kernel, device, shape.head_dim, shape=shape)
        if grid is None:
            print(f"kernel {kernel} declares no launch grid at head dim {shape.head_dim} on {device}: no launch "
                  "cost model (profile the grid without --launch)", file=sys.stderr)
            return 2
        model, meta = profile_launch_cost(kernel, device, grid, shape.heads, shape.kv_heads, shape.head_dim,
                                          shape.dtype, count=args.launch, warmup=args.warmup, reps=args.reps,
                                          report=lambda line: print(line, flush=True), cold=args.cold,
                                          server_calls=args.server_calls, step_seeds=args.step_seeds)
        meta["device"] = device_name(device)  # what a run's cost_model=FILE is checked against
        model.save(args.out, **meta)
        print(f"wrote {args.out}: launch cost model of {kernel}, held-out error std "
              f"{meta['held_out_relative_error_std']}")
        run_sweeps(model, args, kernel, shape, device)
        run_mix(model, args, kernel, shape, device)
        run_placement(model, args, kernel, shape, device)
        run_keys_limit(model, args, kernel, shape, device)
        return 0
    loaded = json.loads(Path(args.load).read_text()) if args.load else None
    if loaded is not None and loaded.get("kind") == LAUNCH_KIND:
        if not (args.sweep or args.mix or args.placement or args.keys_limit):
            print("--load of a launch cost model checks it along --sweep lines, --mix, --placement or --keys-limit; "
                  "give one", file=sys.stderr)
            return 2
        kernel = loaded.get("meta", {}).get("kernel") or resolved_kernel(kernel, shape, device)
        launch_model = LaunchCostModel.from_dict(loaded)
        run_sweeps(launch_model, args, kernel, shape, device)
        run_mix(launch_model, args, kernel, shape, device)
        run_placement(launch_model, args, kernel, shape, device)
        run_keys_limit(launch_model, args, kernel, shape, device)
        return 0
    if args.sweep or args.mix or args.placement or args.keys_limit:
        flag = "sweep" if args.sweep else "mix" if args.mix else "placement" if args.placement else "keys-limit"
        print(f"--{flag} checks a launch cost model: give --launch N or --load a launch model", file=sys.stderr)
        return 2
    if loaded is not None:
        model = ProfiledCostModel.load(args.load, interpolate="rate")
        kernel = loaded.get("meta", {}).get("kernel", kernel)
    else:
        model, meta = profile_segment_costs(kernel, device, shape, args.q_lens, args.kv_lens, budget,
                                            mode=args.mode, tile=tile, segment_cost=not args.no_segment_cost,
                                            report=lambda line: print(line, flush=True))
        model.save(args.out, **meta)
        kernel = meta["kernel"]
        print(f"wrote {args.out}: {len(args.q_lens)} x {len(args.kv_lens)} grid, {len(meta['extrapolated'])} cells "
              f"extrapolated, {model.segment_cost:.5f} ms per segment, tile {model.tile}, kernel {kernel}")
    if args.check:
        shapes = random_shapes(args.check, seed=1, max_q=min(8192, int(max(model.q_lens))),
                               max_kv=min(65536, int(max(model.kv_lens))))
        report_check(check_shapes(model, shapes, kernel, shape, device, budget, args.mode))
    return 0


def run_sweeps(model: LaunchCostModel, args: argparse.Namespace, kernel: str, shape: SegmentShape,
               device: torch.device) -> None:
    """Time and price every ``--sweep`` line; one line per call and phase, then each line's error spread."""
    for name in args.sweep:
        shapes = sweep_shapes(name, model.launch, args.scale)
        rows = check_launch_cost(model, shapes, kernel, shape.kv_heads, shape.head_dim, shape.dtype, device,
                                 args.warmup, args.reps)
        errors = {p: [] for p in PHASES}
        for row in rows:
            parts = []
            for phase in PHASES:
                measured, predicted = row[phase]["measured"], row[phase]["predicted"]
                errors[phase].append(predicted / measured - 1.0)
                parts.append(f"{phase} {measured:8.4f} ms, predicted {predicted:8.4f} "
                             f"({errors[phase][-1] * 100:+.1f}%)")
            print(f"sweep {name} q {row['q_len']:>6} kv {row['kv_len']:>6}: " + "; ".join(parts), flush=True)
        print(f"sweep {name}: {len(rows)} calls, " + ", ".join(
            f"{p} error std {np.std(e) * 100:.1f}%, max |error| {np.max(np.abs(e)) * 100:.1f}%"
            for p, e in errors.items()), flush=True)


def run_placement(model: LaunchCostModel, args: argparse.Namespace, kernel: str, shape: SegmentShape,
                  device: torch.device) -> None:
    """Time and price every probe of :func:`placement_probes`: one line per probe with its forward time, that time
    over the lone long blocks' and the forward the model predicts."""
    if not args.placement:
        return
    rows = time_placement(model, placement_probes(model.launch, model.heads, args.scale), kernel, shape.kv_heads,
                          shape.head_dim, shape.dtype, device, args.warmup, args.reps)
    lone = rows[0]["forward"]["measured"]
    for row in rows:
        forward = row["forward"]
        print(f"placement {row['label']}: forward {forward['measured']:.4f} ms, {forward['measured'] / lone:.2f} x "
              f"lone, predicted {forward['predicted']:.4f} ms", flush=True)


def run_mix(model: LaunchCostModel, args: argparse.Namespace, kernel: str, shape: SegmentShape,
            device: torch.device) -> None:
    """Time and price every pair of :func:`mix_pairs` one call and two; one line per pair (forward+backward ms),
    then what one call costs more than two, measured and predicted, by the long segment's keys."""
    if not args.mix:
        return
    rows = check_call_mix(model, mix_pairs(model.launch, args.scale), kernel, shape.kv_heads, shape.head_dim,
                          shape.dtype, device, args.warmup, args.reps)
    by_keys: dict[int, list[tuple[float, float]]] = {}
    for row in rows:
        total = {way: {kind: sum(row[way][p][kind] for p in PHASES) for kind in ("measured", "predicted")}
                 for way in ("long", "shorts", "one call")}
        extra = {kind: total["one call"][kind] - total["long"][kind] - total["shorts"][kind]
                 for kind in ("measured", "predicted")}
        by_keys.setdefault(row["prefix"][1], []).append((extra["measured"], extra["predicted"]))
        print(f"mix q {row['prefix'][0]:>5} kv {row['prefix'][1]:>6} beside {len(row['beside']):>2} short: long "
              f"{total['long']['measured']:.4f}, short {total['shorts']['measured']:.4f}, one call "
              f"{total['one call']['measured']:.4f} ms (predicted {total['one call']['predicted']:.4f}); one call "
              f"minus two {extra['measured']:+.4f} ms, predicted {extra['predicted']:+.4f}", flush=True)
    for keys, extras in sorted(by_keys.items()):
        measured, predicted = [m for m, _ in extras], [p for _, p in extras]
        print(f"mix kv {keys:>6}: one call minus two, forward+backward, measured {min(measured):+.4f} to "
              f"{max(measured):+.4f} ms, predicted {min(predicted):+.4f} to {max(predicted):+.4f} ms", flush=True)


def run_keys_limit(model: LaunchCostModel, args: argparse.Namespace, kernel: str, shape: SegmentShape,
                   device: torch.device) -> None:
    """``--keys-limit``: one line per timed segment (backward ms, per 1K keys, priced with and without the spill),
    then the batch over the limit as one call and cut under it."""
    if not args.keys_limit:
        return
    if model.launch.backward_keys_limit is None:
        print(f"--keys-limit: {kernel} declares no backward keys limit for this shape", flush=True)
        return
    out = check_keys_limit(model, kernel, shape.kv_heads, shape.head_dim, shape.dtype, device, args.warmup, args.reps)
    limit = model.launch.backward_keys_limit
    for row in out["sweep"]:
        measured = row["measured"]
        print(f"keys limit {limit}: one segment over {row['keys']:>7} keys ({row['keys'] / limit:.2f}x): backward "
              f"{measured:8.3f} ms, {measured / row['keys'] * 1e3:.4f} ms per 1K keys; priced {row['priced']:8.3f} "
              f"({(measured / row['priced'] - 1) * 100:+.1f}% off), without the spill "
              f"{row['priced_without_spill']:8.3f} ({(measured / row['priced_without_spill'] - 1) * 100:+.1f}% off)",
              flush=True)
    batch = out["batch"]
    print(f"keys limit {limit}: {len(batch['segments'])} segments of {batch['segments'][0]} (q, keys): backward as one "
          f"call {batch['one_call']:.3f} ms, as {len(batch['runs'])} calls under the limit {batch['cut_calls']:.3f} ms "
          f"({(batch['cut_calls'] / batch['one_call'] - 1) * 100:+.1f}%)", flush=True)


def loaded_launch_model(args: argparse.Namespace, need: str) -> LaunchCostModel | None:
    """The launch cost model given with ``--load``; None, having said ``need`` and what to give, without one."""
    loaded = json.loads(Path(args.load).read_text()) if args.load else None
    if loaded is None or loaded.get("kind") != LAUNCH_KIND:
        print(f"{need}: give --load LAUNCH_MODEL.json", file=sys.stderr)
        return None
    return LaunchCostModel.from_dict(loaded)


def refit_saved_model(args: argparse.Namespace) -> int:
    """``--load PROFILE --refit OUT``: the loaded launch model's timed calls fitted again, on its grid or with
    ``--backward-min-steps``, written to OUT with the new fit's held-out and own errors (no device needed)."""
    data = json.loads(Path(args.load).read_text()) if args.load else None
    if data is None or data.get("kind") != LAUNCH_KIND or not data.get("meta", {}).get("timed"):
        print("--refit fits a launch model's timed calls again: give --load LAUNCH_MODEL.json that holds them "
              "(its meta's 'timed', as the profile saves them)", file=sys.stderr)
        return 2
    loaded = LaunchCostModel.from_dict(data)
    grid = loaded.launch if args.backward_min_steps is None else \
        replace(loaded.launch, backward_min_steps=args.backward_min_steps or None)
    timed = [([tuple(x) for x in c["shapes"]], c["forward"], c["backward"]) for c in data["meta"]["timed"]]
    steps = [StepCall(c["phase"], tuple(c["q_lens"]), tuple(c["k_lens"]), c["ms"])
             for c in data["meta"].get("step_calls", [])]
    dumps = [p for p in (args.step_dumps or "").split(",") if p]
    for path in dumps:
        steps += calls_of_logs(json.loads(Path(path).read_text())["reps"])
    model, fit = fit_timed_calls(timed, grid, loaded.heads, steps)
    model.save(args.refit, **{**data["meta"], **fit, "refitted_from": Path(args.load).name,
                              "step_calls": [c._asdict() for c in steps],
                              **({"step_dumps": [Path(p).name for p in dumps]} if dumps else {})})
    errors = ", ".join(f"{p} {v * 100:.2f}%" for p, v in fit["held_out_relative_error_std"].items())
    print(f"wrote {args.refit}: {len(timed)} timed calls and {len(steps)} calls of steps fitted again "
          f"(backward_min_steps {grid.backward_min_steps}); held-out error std {errors}")
    return 0


def report_dumped_calls(args: argparse.Namespace) -> int:
    """``--calls``: each server's forward and backward of a dumped emulated step, measured against the loaded
    launch model, then each phase's per-server error spread and the step's max/mean both ways, how much of the
    servers' spread each phase makes (:func:`~hf_longctx.lab.cad.call_profile.phase_spreads`) and the calls'
    error by size (:func:`~hf_longctx.lab.cad.call_profile.errors_by_waves`)."""
    model = loaded_launch_model(args, "--calls prices dumped kernel calls with a launch cost model")
    if model is None:
        return 2
    dump = json.loads(Path(args.calls).read_text())
    rows = server_phase_errors(model, dump)
    errors: dict[str, list[float]] = {p: [] for p in PHASES}
    for row in rows:
        parts = []
        for phase in PHASES:
            measured, predicted = row[phase]["measured"], row[phase]["predicted"]
            errors[phase].append(measured / predicted - 1.0)
            parts.append(f"{phase} {measured:8.3f} ms, predicted {predicted:8.3f} (measured "
                         f"{errors[phase][-1] * 100:+.1f}% over)")
        print(f"server {row['rank']:>3}: " + "; ".join(parts), flush=True)
    totals = {kind: np.array([sum(r[p][kind] for p in PHASES) for r in rows]) for kind in ("measured", "predicted")}
    print(f"calls: {len(rows)} servers, " + ", ".join(
        f"{p} measured over predicted: mean {np.mean(e) * 100:+.1f}%, std {np.std(e) * 100:.1f}%, max "
        f"{np.max(e) * 100:+.1f}%" for p, e in errors.items())
        + f"; max/mean measured {totals['measured'].max() / totals['measured'].mean():.3f}, predicted "
        f"{totals['predicted'].max() / totals['predicted'].mean():.3f}", flush=True)
    spreads = phase_spreads(rows)
    print("spread of the servers' errors (of their predicted time) by phase: "
          + ", ".join(f"{p} {v:.3f}" for p, v in spreads.items()), flush=True)
    for group in errors_by_waves(model, [dump]):
        low, high = group["waves"]
        print(f"{group['phase']:>8} calls of {low:g}-{high:g} waves: {group['calls']:4d}, measured over predicted "
              f"mean {group['mean'] * 100:+.1f}%, std {group['std'] * 100:.1f}%", flush=True)
    return 0


def report_replayed_calls(args: argparse.Namespace) -> int:
    """``--calls DUMP --replay``: each dumped call timed again alone; per server and phase its time in the step,
    alone and priced, then the spreads of step over alone (what the step adds to the kernels) and alone over price
    (the model's own error), the calls where either is large, and the step's max/mean all three ways."""
    model = loaded_launch_model(args, "--replay prices dumped kernel calls with a launch cost model")
    if model is None:
        return 2
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--replay times the dumped calls again: it needs a CUDA device (or --device cpu for a smoke run)",
              file=sys.stderr)
        return 2
    dump = json.loads(Path(args.calls).read_text())
    kernel = dump.get("kernel") or (None if args.kernel == "auto" else args.kernel)
    if kernel is None:
        print("--replay: the dump names no kernel; give --kernel", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    rows = replay_dumped_calls(dump, kernel, model.heads, args.kv_heads, args.head_dim, DTYPES[args.dtype], device,
                               args.warmup, args.reps, cold=args.cold)
    kinds = ("step", "alone", "priced")
    servers: dict[int, dict] = {}
    ratios: dict[str, dict[str, list[float]]] = {p: {"step/alone": [], "alone/priced": []} for p in PHASES}
    for call, in_step, alone in rows:
        phase = call["phase"]
        priced = model.phase_cost(phase, call["q_lens"], call["k_lens"], causal=call.get("causal", True))
        row = servers.setdefault(call["rank"], {p: dict.fromkeys(kinds, 0.0) for p in PHASES})
        for kind, ms in zip(kinds, (in_step, alone, priced)):
            row[phase][kind] += ms
        ratios[phase]["step/alone"].append(in_step / alone - 1.0)
        ratios[phase]["alone/priced"].append(alone / priced - 1.0)
        if in_step >= 0.5 and (abs(in_step / alone - 1.0) > 0.02 or abs(alone / priced - 1.0) > 0.04):
            print(f"call: server {call['rank']:>3} {phase:8s} step {in_step:7.3f} ms, alone {alone:7.3f}, priced "
                  f"{priced:7.3f} (step {(in_step / alone - 1) * 100:+.1f}% over alone, alone "
                  f"{(alone / priced - 1) * 100:+.1f}% over priced); q {call['q_lens']} k {call['k_lens']}"
                  + ("" if call.get("causal", True) else " rectangles"), flush=True)
    for rank in sorted(servers):
        print(f"server {rank:>3}: " + "; ".join(
            f"{p} step {servers[rank][p]['step']:8.3f} ms, alone {servers[rank][p]['alone']:8.3f}, priced "
            f"{servers[rank][p]['priced']:8.3f}" for p in PHASES), flush=True)
    if args.key_split:
        report_split_forward(args, model, dump, kernel, device, servers, rows)
    for phase in PHASES:
        for name, errs in ratios[phase].items():
            e = np.array(errs)
            print(f"{phase} calls, {name}: mean {e.mean() * 100:+.2f}%, std {e.std() * 100:.2f}%, "
                  f"max {e.max() * 100:+.1f}%, min {e.min() * 100:+.1f}%", flush=True)
    totals = {kind: np.array([sum(servers[r][p][kind] for p in PHASES) for r in servers]) for kind in kinds}
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU"
    print(f"replayed {len(rows)} calls of {len(servers)} servers in {time.perf_counter() - t0:.0f} s on "
          f"{where} (L2 {'evicted' if args.cold else 'warm'} before each run); per-server max/mean: " + ", ".join(
              f"{kind} {t.max() / t.mean():.3f}" for kind, t in totals.items()), flush=True)
    return 0


def report_split_forward(args: argparse.Namespace, model, dump: dict, kernel: str, device: torch.device,
                         servers: dict[int, dict], whole_rows: list[tuple[dict, float, float]]) -> None:
    """``--replay --key-split``: the dump's forward calls timed again as chunks of their keys (the grid's
    :class:`~hf_longctx.kernels.key_split.KeySplit` on this device), beside the whole calls just timed: per server
    the forward whole and split, the split's price (the model's terms on a grid that splits), and the step's
    max/mean with either forward (the backward as timed alone)."""
    grid = replace(model.launch, forward_key_split=model.launch.forward_key_split or RULE)
    if device.type == "cuda":
        grid = replace(grid, slots=torch.cuda.get_device_properties(device).multi_processor_count)
    split_model = replace(model, launch=grid)
    forward_only = {**dump, "reps": [[c for c in rep if c["phase"] == "forward"] for rep in dump["reps"]]}
    rows = replay_dumped_calls(forward_only, kernel, model.heads, args.kv_heads, args.head_dim, DTYPES[args.dtype],
                               device, args.warmup, args.reps, key_split=KeySplit.for_grid(grid))
    split = {r: {"alone": 0.0, "priced": 0.0} for r in servers}
    errors = []
    key_split = KeySplit.for_grid(grid)
    whole_ms = {(c["rank"], tuple(c["q_lens"]), tuple(c["k_lens"]), c.get("causal", True)): alone
                for c, _, alone in whole_rows if c["phase"] == "forward"}
    for call, _, alone in rows:
        causal = call.get("causal", True)
        priced = split_model.phase_cost("forward", call["q_lens"], call["k_lens"], causal=causal)
        split[call["rank"]]["alone"] += alone
        split[call["rank"]]["priced"] += priced
        errors.append(alone / priced - 1.0)
        if plan_key_split(call["q_lens"], call["k_lens"], model.heads, key_split, causal) is not None:
            whole = whole_ms[call["rank"], tuple(call["q_lens"]), tuple(call["k_lens"]), causal]
            print(f"split call: server {call['rank']:>3} whole {whole:7.3f} ms, split {alone:7.3f} "
                  f"({(alone / whole - 1) * 100:+.1f}%), priced {priced:7.3f} ({(alone / priced - 1) * 100:+.1f}% "
                  f"over); q {call['q_lens']} k {call['k_lens']}" + ("" if causal else " rectangles"), flush=True)
    for rank in sorted(servers):
        whole = servers[rank]["forward"]["alone"]
        print(f"server {rank:>3}: forward whole {whole:8.3f} ms, split {split[rank]['alone']:8.3f} "
              f"({(split[rank]['alone'] / whole - 1) * 100:+.1f}%), split priced {split[rank]['priced']:8.3f}",
              flush=True)
    e = np.array(errors)
    per_server = np.array([split[r]["alone"] / split[r]["priced"] - 1.0 for r in sorted(servers)])
    whole_total = sum(servers[r]["forward"]["alone"] for r in servers)
    split_total = sum(split[r]["alone"] for r in servers)
    backward = np.array([servers[r]["backward"]["alone"] for r in sorted(servers)])
    with_whole = backward + np.array([servers[r]["forward"]["alone"] for r in sorted(servers)])
    with_split = backward + np.array([split[r]["alone"] for r in sorted(servers)])
    print(f"split forward calls, alone/priced: mean {e.mean() * 100:+.2f}%, std {e.std() * 100:.2f}%, max "
          f"{e.max() * 100:+.1f}%, min {e.min() * 100:+.1f}%; per server: mean {per_server.mean() * 100:+.2f}%, std "
          f"{per_server.std() * 100:.2f}%, max {per_server.max() * 100:+.1f}%", flush=True)
    print(f"forward over all servers: whole {whole_total:.1f} ms, split {split_total:.1f} ms "
          f"({(split_total / whole_total - 1) * 100:+.1f}%); per-server max/mean alone with the forward whole "
          f"{with_whole.max() / with_whole.mean():.3f}, split {with_split.max() / with_split.mean():.3f}", flush=True)


def report_predicted_balance(args: argparse.Namespace) -> int:
    """``--predict``: the runtime's predicted per-server kernel time (``server_costs``) of CAD at eps 0.01 on the
    loaded launch model, with and without key cuts, per mix, tokens, W and seed: max/mean, rectangles made, and
    the seconds the schedule took on this host (in brackets; from cleared pricing caches, as a process's first)."""
    model = loaded_launch_model(args, "--predict prices CAD schedules with a launch cost model")
    if model is None:
        return 2
    seeds = [int(x) for x in args.seeds.split(",")]
    for item in args.predict.split(","):
        mix, tokens, world = item.split(":")
        total = sizes(tokens)[0]
        parts = []
        for key_cuts in (False, True):
            cells = []
            for seed in seeds:
                plan = shard_plan(PackedBatch.from_doc_lens(doc_lengths(mix, total, seed=seed)), int(world), "cad")
                options = {"cost_model": model, "eps": 0.01, "key_cuts": key_cuts}
                if args.refine_screen is not None:
                    options["refine_screen"] = args.refine_screen
                clear_pricing_caches()  # timed as a process's first schedule, not after the same batch's others
                start = time.perf_counter()
                tasks = prepare(plan, options).tasks
                took = time.perf_counter() - start
                costs = server_costs(plan, options)
                rects = sum(t.is_rect for t in tasks)
                cells.append(f"{costs.max() / costs.mean():.3f}" + (f" ({rects} rect.)" if key_cuts else "")
                             + f" [{took:.1f} s]")
            parts.append(("with key cuts " if key_cuts else "without ") + ", ".join(cells))
        print(f"predict {mix} {tokens} W={world} seeds {args.seeds}: " + "; ".join(parts), flush=True)
    return 0


def report_placement_fit(args: argparse.Namespace) -> int:
    """``--fit-placement``: per dumped step, the launch model's per-server forward error, then the paired-block
    simulation's, fitted to all the dumps' forward calls at once, for each ``--empty``."""
    model = loaded_launch_model(args, "--fit-placement needs a launch cost model's grid and heads")
    if model is None:
        return 2
    paths = args.fit_placement.split(",")
    dumps = [json.loads(Path(path).read_text()) for path in paths]
    for path, dump in zip(paths, dumps):
        rows = server_phase_errors(model, dump)
        ratio = [r["forward"]["measured"] / r["forward"]["predicted"] for r in rows]
        print(f"launch model on {Path(path).name}: per-server forward error std {np.std(ratio) * 100:.1f}%",
              flush=True)
    for empty in (float(x) for x in args.empty.split(",")):
        coef, stats = fit_forward_placement(dumps, model.launch, model.heads, empty=empty)
        print(f"paired blocks, empty {empty:g}: coefficients {np.array2string(coef, precision=6)}", flush=True)
        for path, st in zip(paths, stats):
            print(f"  {Path(path).name}: {st['calls']} calls, error std {st['call_std'] * 100:.1f}% (max "
                  f"{st['call_max'] * 100:.1f}%), per-server std {st['server_std'] * 100:.1f}%", flush=True)
    return 0


def report_check(rows: list[tuple[int, int, float, float]]) -> None:
    """One line per checked shape, then the error's spread (predicted / measured - 1)."""
    errors = []
    for q, kv, measured, predicted in rows:
        errors.append(predicted / measured - 1.0)
        print(f"check q {q:>6} kv {kv:>6}: measured {measured:9.5f} ms, predicted {predicted:9.5f} ms "
              f"({errors[-1] * 100:+.1f}%)", flush=True)
    errors.sort()
    absolute = sorted(abs(e) for e in errors)
    print(f"check: {len(errors)} shapes, error median {errors[len(errors) // 2] * 100:+.1f}%, "
          f"|error| median {absolute[len(absolute) // 2] * 100:.1f}%, 90th percentile "
          f"{absolute[int(0.9 * (len(absolute) - 1))] * 100:.1f}%, max {absolute[-1] * 100:.1f}%", flush=True)


if __name__ == "__main__":
    sys.exit(main())
