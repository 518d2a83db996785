"""Sequence-parallel groups the package builds on GPUs communicate on high-priority NCCL streams.

Why: a backend posts its next transfer, then launches a kernel that fills every SM; the block scheduler serves a
higher-priority stream's NCCL blocks first as SMs free up, so the transfer is not held behind the kernel. A
sequence-parallel group that spans the world stays the default group (no second communicator over every rank).
Needs 4 GPUs (sp 2 inside a world of 4); skipped on fewer.
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")


def _high_priority(group) -> bool:
    return group._get_backend(torch.device("cuda")).options.is_high_priority_stream


def _check(rank: int, world: int, init_file: str) -> None:
    from hf_longctx.comm.groups import release_groups, sequence_parallel_group
    from hf_longctx.comm.mesh import parallel_groups

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120), device_id=torch.device("cuda", rank))
    try:
        sp = sequence_parallel_group(2)
        assert _high_priority(sp), "the sp sub-group's NCCL streams are not high priority"
        assert not _high_priority(dist.group.WORLD)
        assert sequence_parallel_group(world) is None  # the world's own group serves a world-wide sp
        moe_sp = parallel_groups(sp_size=2).sp
        assert _high_priority(moe_sp)
        for group in (sp, moe_sp):  # and they work: each pair sums its ranks
            x = torch.full((4,), float(rank), device="cuda")
            dist.all_reduce(x, group=group)
            members = [r for r in range(world) if r // 2 == rank // 2]
            assert x.tolist() == [float(sum(members))] * 4
        release_groups()
    finally:
        dist.destroy_process_group()


def test_sequence_parallel_sub_groups_use_high_priority_streams():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_check, args=(4, os.path.join(tmp, "init")), nprocs=4, join=True)
