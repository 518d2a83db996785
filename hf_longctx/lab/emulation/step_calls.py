"""CAD's server calls timed where they run: inside emulated steps, one device running every server's calls.

Why: a launch cost model (:mod:`hf_longctx.backends.cad.launch_cost`) is fitted on calls timed alone, each run
back to back over its own buffers; in a step the same call follows other servers' calls over other buffers. Priced by
a model fitted on calls alone, short backward calls took more in their steps and long ones less than the profile's
own calls of those sizes; fitted on the calls of other steps too (each step priced by a model fitted without its
batch), the per-server error fell (measured: bench/results/2026-11-29_cad-fa4.md,
bench/results/2026-12-04_from-modules.md). A profile so times a few whole CAD steps after its first fit
(:func:`time_step_calls`) and fits again.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import NamedTuple

import torch

from hf_longctx.lab.emulation.runner import emulate_step_or_stage, release_memory
from hf_longctx.lab.emulation.timing import KernelTimer
from hf_longctx.lab.emulation.workloads import doc_lengths, global_tensors
from hf_longctx.layout import PackedBatch


class StepCall(NamedTuple):
    """One causal kernel call of a server in an emulated step: its phase, segments and milliseconds (the median
    over the step's timed repetitions)."""

    phase: str
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    ms: float


def dumped_calls(dump: dict) -> list[tuple[dict, float]]:
    """Every kernel call of a dumped emulated step (``scripts/lab/bench_emulated.py --dump-calls``) once, with its
    median time over the repetitions (ms). Calls are matched across repetitions by rank, phase, causal and segments
    (ranks run in threads, so the log's order differs between repetitions); repetitions must hold the same calls."""
    def key(call: dict) -> tuple:
        return call["rank"], call["phase"], call.get("causal", True), tuple(call["q_lens"]), tuple(call["k_lens"])

    reps = [sorted(rep, key=key) for rep in dump["reps"]]
    if not reps or any([key(c) for c in rep] != [key(c) for c in reps[0]] for rep in reps):
        raise ValueError("the dump's repetitions do not hold the same kernel calls")
    return [(call, statistics.median(rep[i]["seconds"] for rep in reps) * 1e3) for i, call in enumerate(reps[0])]


def calls_of_logs(logs: Sequence[Sequence[dict]]) -> list[StepCall]:
    """The causal calls of a step's timed repetitions (:meth:`~.timing.KernelTimer.call_log` each), every call
    once with its median time: the calls a dump of the step holds
    (:func:`dumped_calls`)."""
    return [StepCall(call["phase"], tuple(call["q_lens"]), tuple(call["k_lens"]), ms)
            for call, ms in dumped_calls({"reps": [list(log) for log in logs]}) if call.get("causal", True)]


def time_step_calls(options: dict, kernel: str, device: torch.device, batches: Sequence[tuple[str, int, int]],
                    heads: int = 32, kv_heads: int = 8, head_dim: int = 128, dtype: torch.dtype = torch.bfloat16,
                    seeds: Sequence[int] = (0,), scale: float = 1.0, warmup: int = 1, reps: int = 2
                    ) -> list[StepCall]:
    """Every causal server call of CAD steps emulated on ``device`` (``options``: CAD's, e.g. its cost model and
    eps) over ``batches`` ((mix, tokens, servers) each, drawn with each of ``seeds``; ``scale`` shrinks every batch
    to no fewer than 64 tokens a server), each call's time in its step (:func:`calls_of_logs`). A step whose
    servers' transfer buffers do not fit on the device together runs again with them on the host (its kernels run
    and are timed alike)."""
    out: list[StepCall] = []
    for seed in seeds:
        for mix, tokens, world in batches:
            total = max(64 * world, int(tokens * scale))
            batch = PackedBatch.from_doc_lens(doc_lengths(mix, total, seed=seed))
            tensors = global_tensors(batch.num_tokens, heads, kv_heads, head_dim, dtype, device, seed)
            timers: list[KernelTimer] = []

            def keep_calls(hub, dev, timers=timers) -> KernelTimer:
                timers.append(KernelTimer(hub, dev, keep_calls=True))
                return timers[-1]

            emulate_step_or_stage(batch, world, tensors, "cad", options=options, kernel=kernel, warmup=warmup,
                                  reps=reps, make_timer=keep_calls)
            out += calls_of_logs([t.call_log() for t in timers[-reps:]])
            del tensors, timers
            release_memory(device)
    return out
