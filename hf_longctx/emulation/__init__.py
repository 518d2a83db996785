"""W sequence-parallel ranks emulated on one device: per-rank kernel time, bytes, predicted step time."""

from .runner import EmulatedStep, RankStep, emulate_step, link_sources, step_flops

__all__ = ["EmulatedStep", "RankStep", "emulate_step", "link_sources", "step_flops"]
