"""Comm modes: the comm layer reaches a group's peers only through the group's comm ops (:func:`ops_for`), its own
where it carries them (``comm_ops``), torch.distributed's otherwise; it never tests what type the group is."""

from __future__ import annotations

import torch

from hf_longctx.comm import GatherPlan, comm_stats, post_exchange, reset_comm_stats
from hf_longctx.comm.collectives import (
    all_gather,
    all_reduce_max,
    all_to_all_single,
    collective_device,
    group_state,
    in_one_process,
    is_distributed,
)
from hf_longctx.comm.groups import global_rank, group_rank_and_size
from hf_longctx.comm.mode import CommOps, SubGroupMismatch, TorchDistributedOps, ops_for


class _Done:
    def wait(self) -> bool:
        return True


class StubOps:
    """Rank 0 of 2 ranks whose peer is played by the test (``peer_rows``: what the peer sends in an all_to_all);
    every call recorded in ``calls``."""

    def __init__(self, peer_rows: torch.Tensor | None = None) -> None:
        self.calls: list[tuple] = []
        self.peer_rows = peer_rows
        self.kept: dict = {}
        self.refused: dict = {}

    def is_distributed(self) -> bool:
        return True

    def rank_and_size(self) -> tuple[int, int]:
        return 0, 2

    def global_rank(self, group_rank: int) -> int:
        return group_rank + 10

    def post(self, sends, recvs, what):
        self.calls.append(("post", [(d, t.is_contiguous(), tag) for d, t, tag in sends],
                           [(s, tag) for s, _, tag in recvs], what))
        for src, buf, _ in recvs:
            buf.fill_(src + 1)
        return [_Done()]

    def all_to_all_single(self, recv, send, in_split, out_split, async_op=False):
        self.calls.append(("all_to_all", list(in_split), list(out_split), async_op))
        recv.copy_(self.peer_rows)
        return _Done() if async_op else None

    def all_gather(self, tensors, tensor) -> None:
        self.calls.append(("all_gather",))
        tensors[0].copy_(tensor)
        tensors[1].fill_(5.0)

    def all_reduce(self, tensor, op) -> None:
        self.calls.append(("all_reduce", op))
        tensor.fill_(9.0)

    def collective_device(self) -> torch.device:
        return torch.device("meta")

    def stages_on_host(self) -> bool:
        return False

    def in_one_process(self) -> bool:
        return True

    def state(self) -> dict:
        return self.kept

    def sub_groups(self, members, setting) -> list:
        """A name per member list (``refused``: the settings the peers disagree on, raised as they would be)."""
        self.calls.append(("sub_groups", [tuple(m) for m in members], setting))
        if self.refused:
            raise SubGroupMismatch(self.refused)
        return [f"group {tuple(m)}" for m in members]


class StubGroup:
    """A group object of no torch type, carrying its own comm ops."""

    def __init__(self, ops: StubOps) -> None:
        self.comm_ops = ops


def test_a_group_carries_its_ops_and_any_other_gets_torch_distributeds():
    ops = StubOps()
    assert ops_for(StubGroup(ops)) is ops
    assert ops_for(None) == TorchDistributedOps(None)
    plain = object()  # e.g. a torch.distributed ProcessGroup: no comm_ops of its own
    assert ops_for(plain) == TorchDistributedOps(plain)
    assert isinstance(ops, CommOps) and isinstance(TorchDistributedOps(), CommOps)


def test_torch_distributeds_ops_without_an_initialised_world_are_one_process_alone():
    assert not is_distributed(None)
    assert group_rank_and_size(None) == (0, 1)
    assert global_rank(None, 3) == 3
    assert collective_device(None) == torch.device("cpu")
    assert not in_one_process(None) and not TorchDistributedOps().stages_on_host()
    t = torch.tensor([1.0, 2.0])
    all_reduce_max(t, None)  # nothing to reduce with
    assert t.tolist() == [1.0, 2.0]
    assert group_state(None) is group_state(None) and group_state(None) is not group_state(object())


def test_every_collective_of_the_comm_layer_goes_through_the_groups_own_ops():
    ops = StubOps(peer_rows=torch.tensor([[7.0], [8.0]]))
    group = StubGroup(ops)
    assert is_distributed(group)  # though torch.distributed is not initialised
    assert group_rank_and_size(group) == (0, 2) and global_rank(group, 1) == 11
    assert collective_device(group) == torch.device("meta") and in_one_process(group)
    assert group_state(group) is ops.kept

    t = torch.tensor([1.0, 2.0])
    all_reduce_max(t, group)
    assert t.tolist() == [9.0, 9.0]
    parts = [torch.zeros(2), torch.zeros(2)]
    all_gather(parts, torch.tensor([3.0, 4.0]), group)
    assert parts[0].tolist() == [3.0, 4.0] and parts[1].tolist() == [5.0, 5.0]
    recv = torch.zeros(2, 1)
    assert all_to_all_single(recv, torch.zeros(2, 1), [1, 1], [1, 1], group) is None
    assert recv.flatten().tolist() == [7.0, 8.0]

    reset_comm_stats()
    send = torch.arange(6.0).reshape(2, 3).t()  # not contiguous: the comm layer sends a contiguous copy
    buf = torch.zeros(4)
    pending = post_exchange([(1, send, 5)], [("from 1", 1, buf, 6)], group, "step 0")
    assert pending.wait()["from 1"].tolist() == [2.0] * 4
    assert comm_stats() == {"sent_messages": 1, "sent_bytes": 6 * 4, "recv_messages": 1, "recv_bytes": 4 * 4}
    reset_comm_stats()
    assert ops.calls == [("all_reduce", "max"), ("all_gather",), ("all_to_all", [1, 1], [1, 1], False),
                         ("post", [(1, True, 5)], [(1, 6)], "step 0")]


def test_a_row_gather_on_a_groups_own_ops_assembles_the_rows_its_peer_sends():
    rows = [3, 4]
    runs = [[(1, 1, 3), (0, 0, 2), (1, 2, 4)], [(0, 0, 1)]]  # rank 0 reads rows 1..3 of rank 1, rank 1 one of 0's
    peer = torch.arange(40.0, 44.0)[:, None]  # rank 1's rows
    peer_plan = GatherPlan(runs, 1, rows)
    ops = StubOps(peer_rows=peer.index_select(0, peer_plan.send_index))  # what rank 1 sends rank 0
    plan = GatherPlan(runs, 0, rows)
    mine = torch.arange(30.0, 33.0)[:, None]
    (got,) = plan.gather(plan.start([mine], StubGroup(ops)), [mine])
    assert got.flatten().tolist() == [41.0, 42.0, 30.0, 31.0, 42.0, 43.0]
    assert ops.calls == [("all_to_all", [0, 3], [0, 1], True)]  # unique rows only: three in, one out


def test_a_group_whose_ops_stage_on_the_host_receives_device_rows_there():
    """All_to_all receive buffers of device tensors (here ``meta``) land in host memory where the group's ops
    stage them, beside the tensors otherwise."""
    from hf_longctx.comm.gather import _receive_buffer

    like = torch.empty(2, 3, device="meta")
    staged = StubOps()
    staged.stages_on_host = lambda: True
    assert _receive_buffer(like, 4, 3, StubGroup(staged)).device == torch.device("cpu")
    assert _receive_buffer(like, 4, 3, StubGroup(StubOps())).device.type == "meta"
    assert _receive_buffer(like, 4, 3, None).device.type == "meta"
    assert _receive_buffer(torch.empty(2, 3), 4, 3, StubGroup(staged)).shape == (4, 3)  # host rows stay put
