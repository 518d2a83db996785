"""W sequence-parallel ranks emulated on one device: per-rank kernel time, bytes, predicted step time."""

from hf_longctx.lab.emulation.group import EmulatedGroup, EmulationError, EmulationHub, rank_threads
from hf_longctx.lab.emulation.runner import (
    EmulatedStep,
    RankStep,
    device_memory,
    emulate_step,
    emulate_step_or_stage,
    host_peak_memory,
    link_sources,
    median_rep,
    noise_only_imbalance,
    real_rank_kernel_times,
    release_memory,
    step_flops,
)

__all__ = ["EmulatedGroup", "EmulatedStep", "EmulationError", "EmulationHub", "RankStep", "device_memory",
           "emulate_step", "emulate_step_or_stage", "host_peak_memory", "link_sources", "median_rep",
           "noise_only_imbalance", "rank_threads", "real_rank_kernel_times", "release_memory", "step_flops"]
