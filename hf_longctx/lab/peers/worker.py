"""One system's measurement in a process of its own: ``python -m hf_longctx.lab.peers.worker``.

``--system NAME --workload JSON --out FILE``: builds the system (:data:`SYSTEMS`), trains ``warmup + steps``
steps of the workload's packed row and writes one JSON object to ``FILE``: the step time (median of the timed
steps), tokens/s, MFU without and with recomputation, GPU peaks, this process's host peak, the losses, the
system's settings and the versions of what it ran. A failure writes the same object with ``error`` (its type,
message and last traceback lines) and exits 1; a process killed outright (the host's out-of-memory killer) writes
nothing, and the parent reports that.

The process is a one-rank group (``RANK=0``, ``WORLD_SIZE=1``; the parent gives ``MASTER_PORT``) where the
system's class asks for one (``process_group``): DeepSpeed, FSDP2 and accelerate's parallelism config need one
even on one GPU, as ``accelerate launch`` would make; plain transformers runs as ``python train.py`` does, without
one (its Trainer would otherwise wrap the model in DDP, whose gradient buckets cost memory one GPU has no use for).
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

# set before CUDA starts, as scripts/bench_train.py does; a user's value wins
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402 - after the allocator setting

from hf_longctx.benchmarking import host_peak_gib, peak_flops  # noqa: E402

from .measure import StepClock, error_record, gpu_peaks_gib  # noqa: E402
from .workload import StepFlops, Workload, mfu  # noqa: E402

SYSTEMS = ("hf_longctx", "alst", "trl_cp", "transformers")
PACKAGES = ("torch", "transformers", "accelerate", "deepspeed", "trl", "liger-kernel", "torchao", "flash-attn")


def system_class(name: str):
    """The class that builds and trains system ``name`` (imported here: each system's packages load only in its
    own process)."""
    if name == "hf_longctx":
        from .longctx import LongCtxRun
        return LongCtxRun
    if name == "alst":
        from .alst import AlstRun
        return AlstRun
    if name == "trl_cp":
        from .torch_cp import TrlContextParallelRun
        return TrlContextParallelRun
    if name == "transformers":
        from .plain import PlainTrainerRun
        return PlainTrainerRun
    raise ValueError(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)}")


def versions() -> dict[str, str | None]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def one_rank_group(device: torch.device) -> None:
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29577")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                                         timeout=timedelta(seconds=1800))


def measure(system: str, work: Workload, result: dict) -> None:
    """Build ``system``, train the workload, fill ``result`` as it goes (so that a failure keeps what was known
    before it: the device, the versions, the settings); raises what the system raises."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    result.update(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", versions=versions())
    cls = system_class(system)
    if cls.process_group:
        one_rank_group(device)
    clock = StepClock(device, work.warmup)
    run = cls(work, device)
    result["settings"] = run.settings
    gc.collect()  # what building left behind (a float32 copy of the weights) is not the steps' to hold
    if device.type == "cuda":
        torch.cuda.empty_cache()
    run.train(work.warmup + work.steps, clock)
    if clock.steps_done != work.warmup + work.steps:
        raise RuntimeError(f"{system} ran {clock.steps_done} steps, not {work.warmup + work.steps}")
    seconds = clock.step_seconds()
    flops = StepFlops.of(work)
    peak = peak_flops(device)
    allocated, reserved = gpu_peaks_gib(device)
    result.update(step_s=seconds, steps_timed=len(clock.seconds), tokens_per_s=work.seq / seconds,
                  mfu=mfu(flops.model, seconds, peak), mfu_with_recompute=mfu(flops.with_recompute, seconds, peak),
                  flops_per_step=flops.model, flops_per_step_with_recompute=flops.with_recompute,
                  gpu_peak_allocated_gib=allocated, gpu_peak_reserved_gib=reserved,
                  worker_host_peak_gib=host_peak_gib(), losses=clock.losses)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--system", required=True, choices=SYSTEMS)
    p.add_argument("--workload", required=True, help="the Workload's fields as JSON")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    work = Workload(**json.loads(args.workload))
    result: dict = {"system": args.system, "tokens_per_step": work.seq, "layers": work.layers, "tiny": work.tiny,
                    "mix": work.mix, "error": None}
    try:
        measure(args.system, work, result)
        code = 0
    except BaseException as err:  # noqa: BLE001 - every failure is the result of this measurement
        result.update(error=error_record(err), worker_host_peak_gib=host_peak_gib())
        code = 1
    Path(args.out).write_text(json.dumps(result))
    if torch.distributed.is_initialized():
        try:
            torch.distributed.destroy_process_group()
        except Exception:  # noqa: BLE001 - the result is written; a group that cannot close changes nothing
            pass
    return code


if __name__ == "__main__":
    sys.exit(main())
