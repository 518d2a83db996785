"""Which sequence-parallel groups the package gives high-priority NCCL streams (the GPU side is
``tests/gpu/test_comm_priority_gpu.py``): a sub-group of the world on CUDA does; a group that spans the world
(the default group serves it) or a CPU group does not."""

from __future__ import annotations

import pytest

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


def test_sub_groups_are_made_by_every_rank_of_the_world_in_one_order_and_kept(monkeypatch):
    """A world of 8 ranks in two replicas of a sequence-parallel group ({0..3}, {4..7}), seen from a rank of the
    second: one all_gather over the world tells it the other replica's groups, it makes every replica's groups in
    one sorted order (as every rank does) and takes those of its own lists; a second ask makes nothing, until the
    groups are released; ranks of a group that disagree on the setting are refused before any group is made."""
    import torch.distributed as dist

    from hf_longctx.comm.subgroups import SubGroupMismatch, make_sub_groups

    gathered, made = [], []
    other_setting = [None]  # what ranks 2 and 3 of the first replica give (None: the same as this rank)

    def all_gather_object(out, obj):
        ranks, setting, wanted = obj
        first = ((0, 1, 2, 3), setting, [tuple(r - 4 for r in m) for m in wanted])
        odd = first if other_setting[0] is None else ((0, 1, 2, 3), other_setting[0], [])
        gathered.append(obj)
        out[:] = [first, first, odd, odd] + [obj] * 4

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 8)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(dist, "new_group", lambda ranks: made.append(tuple(ranks)) or f"pg{tuple(ranks)}")
    parent = object()
    mesh = [(0, 1), (2, 3), (0, 2), (1, 3)]  # group ranks: inner groups, then outer groups
    groups.release_groups()
    assert make_sub_groups(parent, [4, 5, 6, 7], mesh, 2) == ["pg(4, 5)", "pg(6, 7)", "pg(4, 6)", "pg(5, 7)"]
    assert gathered == [((4, 5, 6, 7), 2, [(4, 5), (6, 7), (4, 6), (5, 7)])]
    assert made == [(0, 1), (0, 2), (1, 3), (2, 3), (4, 5), (4, 6), (5, 7), (6, 7)]
    assert make_sub_groups(parent, [4, 5, 6, 7], mesh, 2) == ["pg(4, 5)", "pg(6, 7)", "pg(4, 6)", "pg(5, 7)"]
    assert len(gathered) == 1 and len(made) == 8  # kept: no collective, no group made
    make_sub_groups(object(), [4, 5, 6, 7], mesh, 2)  # another parent group object: asked anew
    assert len(gathered) == 2
    groups.release_groups()  # forgets them with the meshes' groups
    make_sub_groups(parent, [4, 5, 6, 7], mesh, 2)
    assert len(gathered) == 3

    groups.release_groups()
    made.clear()
    other_setting[0] = 4
    with pytest.raises(SubGroupMismatch) as refused:
        make_sub_groups(parent, [4, 5, 6, 7], mesh, 2)
    assert refused.value.settings == {(0, 1, 2, 3): [2, 4]} and not made
    with pytest.raises(SubGroupMismatch):  # nothing kept of a refused ask: refused again
        make_sub_groups(parent, [4, 5, 6, 7], mesh, 2)
