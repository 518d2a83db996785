"""The row gather collective: every rank assembles exactly the rows its runs name, and the reverse
direction adds every segment row back at the row it was read from."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from hf_longctx.comm import GatherPlan
from hf_longctx.comm.gather import row_sums

from distributed import run_distributed

ROWS = [5, 7, 4]


def random_runs(seed: int, world: int, local_only: bool) -> list[list[tuple[int, int, int]]]:
    rng = random.Random(seed)
    runs = []
    for reader in range(world):
        mine = []
        for _ in range(rng.randint(0, 5)):
            holder = reader if local_only else rng.randrange(world)
            a = rng.randrange(ROWS[holder] + 1)
            mine.append((holder, a, rng.randint(a, ROWS[holder])))  # empty runs and repeats allowed
        runs.append(mine)
    return runs


def global_rows(holder: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows that name their holder and local row, so a misplaced row is visible."""
    r = torch.arange(ROWS[holder], dtype=dtype)
    return torch.stack([torch.full_like(r, holder), r, r * 10 + holder], dim=1).reshape(-1, 3, 1)


def check_gather(rank: int, world: int) -> None:
    for seed in range(3):
        for local_only in (False, True):  # local_only: nothing moves, so no collective is issued
            check_one_gather(rank, world, seed, local_only)


def check_one_gather(rank: int, world: int, seed: int, local_only: bool) -> None:
    runs = random_runs(seed, world, local_only)
    plan = GatherPlan(runs, rank, ROWS)
    assert plan.moves == any(h != s and b > a for s, rs in enumerate(runs) for h, a, b in rs)
    x, y = global_rows(rank, torch.float64), global_rows(rank, torch.float32)[:, :2]  # two dtypes, two widths
    gx, gy = plan.gather(plan.start([x, y], dist.group.WORLD), [x, y])
    want = [(h, i) for h, a, b in runs[rank] for i in range(a, b)]
    assert gx.shape == (len(want), 3, 1) and gy.shape == (len(want), 2, 1)
    for j, (h, i) in enumerate(want):
        assert torch.equal(gx[j], global_rows(h, torch.float64)[i])
        assert torch.equal(gy[j], global_rows(h, torch.float32)[i, :2])

    # reverse: every segment row adds (reader + 1) at the row it read, summed over all readers
    grads = [torch.full((len(want), 3, 1), float(rank + 1), dtype=torch.float64)]
    total = torch.zeros(ROWS[rank], 3, 1, dtype=torch.float64)
    plan.scatter_local(grads, [total], add=True)
    plan.finish_return(plan.start_return(grads, dist.group.WORLD), [total], add=True)
    expect = torch.zeros(ROWS[rank], dtype=torch.float64)
    for reader, rs in enumerate(runs):
        for h, a, b in rs:
            if h == rank:
                expect[a:b] += reader + 1
    assert torch.equal(total[:, 0, 0], expect)

    # the same through return_rows, from segments in another dtype: converted to the local tensor's
    again = torch.zeros(ROWS[rank], 3, 1, dtype=torch.float64)
    plan.finish_return(plan.return_rows([grads[0].float()], [again], True, dist.group.WORLD), [again], add=True)
    assert again.dtype == torch.float64 and torch.equal(again[:, 0, 0], expect)
    # the rows sent back are summed and travel in the holder's dtype (bf16 gradients sum in fp32), not the segments'
    scratch = torch.zeros(ROWS[rank], 3, 1, dtype=torch.float64)
    assert all(buf.dtype == torch.float64 for buf, _ in plan.fill_returns([grads[0].float()], [scratch], True))


def test_gather_and_return_rows() -> None:
    run_distributed(3, check_gather)


def test_runs_for_every_rank_are_required() -> None:
    with pytest.raises(ValueError, match="give every rank its runs"):
        GatherPlan([[(0, 0, 1)]], 0, ROWS)


def test_row_sums_name_each_targets_entries_in_their_order() -> None:
    """What the return kernel sums per destination row: every entry once, grouped by target, in entry order."""
    rows, starts, order = row_sums(torch.tensor([3, 1, 3, 0, 1, 3]))
    assert rows.tolist() == [0, 1, 3] and starts.tolist() == [0, 1, 3, 6] and order.tolist() == [3, 1, 4, 0, 2, 5]
    rows, starts, order = row_sums(torch.zeros(0, dtype=torch.int64))
    assert rows.numel() == 0 and starts.tolist() == [0] and order.numel() == 0
