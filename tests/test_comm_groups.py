"""Which sequence-parallel groups the package gives high-priority NCCL streams (the GPU side is
``tests/gpu/test_comm_priority_gpu.py``): a sub-group of the world on CUDA does; a group that spans the world
(the default group serves it) or a CPU group does not."""

from __future__ import annotations

import hf_longctx.comm.groups as groups


def test_only_cuda_sub_groups_of_the_world_get_high_priority_streams(monkeypatch):
    nccl_options = object()  # what a torch with NCCL returns (the CPU build has no NCCL)
    monkeypatch.setattr(groups, "high_priority_options", lambda: nccl_options)
    assert groups.sequence_parallel_override("cuda", 2, 8) == {"sp": ("nccl", nccl_options)}
    assert groups.sequence_parallel_override("cuda", 8, 8) is None  # the world's own group
    assert groups.sequence_parallel_override("cpu", 2, 8) is None  # gloo
    monkeypatch.setattr(groups, "high_priority_options", lambda: None)
    assert groups.sequence_parallel_override("cuda", 2, 8) is None  # a torch without NCCL


def test_a_cpu_build_has_no_high_priority_options():
    import torch.distributed as dist

    if hasattr(dist, "ProcessGroupNCCL"):
        assert groups.high_priority_options().is_high_priority_stream
    else:
        assert groups.high_priority_options() is None
