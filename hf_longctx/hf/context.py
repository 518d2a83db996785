"""What the attention layers of a sharded forward need: the shard plan, the group and the kernel.

It travels as the ``longctx`` keyword of ``model(**inputs)``; transformers hands model keywords down
to every attention function, so no global state is involved. ``rank`` is this process's index in
``group``, found once when the batch is sharded and handed to every attention call (which then does
not ask the group again).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ..layout import ShardPlan


@dataclass(frozen=True)
class SequenceParallelContext:
    plan: ShardPlan
    group: dist.ProcessGroup | None
    rank: int
    kernel: str = "auto"
