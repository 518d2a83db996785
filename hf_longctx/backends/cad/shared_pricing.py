"""The ranks of a group price a schedule's candidates together: each prices its share, one all_reduce gives all.

Why: every rank of a CAD group makes the same schedule from the same documents, so that no rank waits for another's
decision. On a measured cost model most of that host time is the refinement's pricing of candidate moves
(:mod:`.refine`): a second or more per batch at 8-64 servers, the same on every rank. A step's candidates are
independent of each other, so the ranks price disjoint shares (round robin) and sum their tables in one all_reduce.
Every rank then takes the same decisions from the same numbers: the schedule is the one a single rank makes, bit for
bit (each value is one rank's float64, summed with zeros), in about 1/W of the pricing time.

A rank whose pricing raises still joins the all_reduce, with a flag set: every rank then raises together (the one that
failed with its own error), so no peer waits in the next collective for a rank that left.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ...comm.collectives import collective_device

T = TypeVar("T")


@dataclass
class PricingShare:
    """This process's part in pricing for a group: ``rank`` of ``world`` processes of ``group`` (a torch.distributed
    process group, not one whose ranks share this process, :func:`~hf_longctx.comm.collectives.in_one_process`: they
    would gain nothing).

    ``dealt``: items dealt so far (the same count on every rank). The deal goes on round robin from call to call, so
    that calls of fewer items than ranks (a step of few moves) do not all land on rank 0."""

    group: Any
    rank: int
    world: int
    dealt: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"PricingShare needs 0 <= rank < world, got rank {self.rank} of {self.world}")


def priced_together(price: Callable[[T], float], items: Sequence[T], share: PricingShare | None) -> list[float]:
    """``[price(x) for x in items]`` as floats; with ``share``, each item is priced by one rank (dealt round robin,
    on from where the last call stopped) and every rank gets every value (one all_reduce). Every rank of the group
    must call this with the same number of items, in the same order of calls."""
    if share is None or share.world == 1:
        return [float(price(x)) for x in items]
    if not items:
        return []
    mine = range((share.rank - share.dealt) % share.world, len(items), share.world)
    share.dealt += len(items)
    values = torch.zeros(len(items) + 1, dtype=torch.float64)  # the last entry: how many ranks failed
    error: Exception | None = None
    try:
        values[list(mine)] = torch.tensor([float(price(items[i])) for i in mine], dtype=torch.float64)
    except Exception as exc:  # noqa: BLE001 - raised below, after the peers have heard of it
        error = exc
        values.zero_()
        values[-1] = 1.0
    summed = values.to(collective_device(share.group))
    dist.all_reduce(summed, group=share.group)
    result = summed.tolist()
    if error is not None:
        raise error
    if result[-1] > 0:
        raise RuntimeError(f"cad: pricing the schedule failed on {int(result[-1])} other rank(s) of the group; their "
                           "error says why (this rank stopped with them instead of waiting in a later collective)")
    return result[:-1]
