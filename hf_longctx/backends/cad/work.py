"""What one forward+backward of CAD costs each rank, from its schedule (see :mod:`hf_longctx.backends.prediction`).

Kernels: each server runs its tasks' segments (query rows over their keys; rectangles of key cuts without a
causal mask), one call per kind of segment and nano-batch. Transfers, per nano-batch, as the runtime makes them
(:func:`~.runtime.run_forward`, :func:`~.runtime.run_backward`): every server gathers the unique query and key
rows its tasks read from their holders (:func:`~hf_longctx.comm.gather.unique_rows_between`), one all_to_all per
dtype; results go back to the query holders (out and log-sum-exp; backward dq), key gradients to the key holders
in the accumulation dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...comm.gather import Run, unique_rows_between
from ...layout import ShardPlan
from ..prediction import AttentionShape, RankWork
from .pingpong import pingpong_split
from .tasks import CadTask, all_pieces, doc_holders, has_key_cuts, segment_shape, task_runs


def _sends(world: int, rows: dict[tuple[int, int], int], width: int, back: bool) -> list[dict[int, int]]:
    """Per rank, bytes to each peer of one all_to_all moving ``rows[(holder, reader)]`` rows of ``width`` bytes:
    holder to reader, or with ``back`` reader to holder."""
    sends: list[dict[int, int]] = [{} for _ in range(world)]
    for (holder, reader), n in rows.items():
        src, dst = (reader, holder) if back else (holder, reader)
        sends[src][dst] = sends[src].get(dst, 0) + n * width
    return sends


def rank_work(plan: ShardPlan, shape: AttentionShape, tasks: Sequence[CadTask], pingpong: bool) -> list[RankWork]:
    """Every rank's segments (as a server), kernel calls and sends when it runs ``tasks`` of ``plan`` (two
    nano-batches per server with ``pingpong``, as the runtime splits them)."""
    world = plan.world_size
    tasks = tuple(tasks)
    groups = plan.cached(("cad_pingpong", tasks), lambda: pingpong_split(plan, tasks)) if pingpong else [list(tasks)]
    partial = has_key_cuts(tasks)
    same_dtype = shape.dtype_bytes == shape.accum_bytes  # out and lse (dq and dk) travel packed in one message
    out_row = shape.q_grad_row if partial else shape.q_row
    dq_row = shape.q_grad_row if partial else shape.q_row
    work = [RankWork(heads=shape.heads) for _ in range(world)]
    pieces, holders = all_pieces(plan), doc_holders(plan)
    for group in groups:
        q_runs: list[list[Run]] = [[] for _ in range(world)]
        kv_runs: list[list[Run]] = [[] for _ in range(world)]
        kinds: list[set[bool]] = [set() for _ in range(world)]
        for t in group:
            if t.q_end <= t.q_start:
                continue
            q_run, key_runs = task_runs(plan, t, pieces, holders)
            q_runs[t.server].append(q_run)
            kv_runs[t.server] += key_runs
            rows, keys = segment_shape(plan, t)
            work[t.server].segments.append((rows, keys, not t.is_rect, plan.window))
            kinds[t.server].add(t.is_rect)
        for r in range(world):
            work[r].calls += 2 * len(kinds[r])
        uq, ukv = unique_rows_between(q_runs), unique_rows_between(kv_runs)
        if not any(uq.values()) and not any(ukv.values()):
            continue  # no rank moves a row: no collective at all
        forward = [(uq, shape.q_row, False), (ukv, 2 * shape.kv_row, False)]
        forward += [(uq, out_row + shape.lse_row, True)] if same_dtype or partial else \
            [(uq, out_row, True), (uq, shape.lse_row, True)]
        backward = [(uq, 3 * shape.q_row + shape.lse_row, False)] if same_dtype else \
            [(uq, 3 * shape.q_row, False), (uq, shape.lse_row, False)]
        backward += [(ukv, 2 * shape.kv_row, False), (uq, dq_row, True), (ukv, 2 * shape.kv_grad_row, True)]
        for rows, width, back in forward + backward:
            for r, sends in enumerate(_sends(world, rows, width, back)):
                work[r].sent("a2a", sends)
    return work
