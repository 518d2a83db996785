"""Row gathers between ranks: each remote row travels at most once, local rows never travel.

Every rank assembles a *segment sequence*: rows of one or more tensors (e.g. q, or k and v) gathered
from any ranks, in an order of its choosing (for a varlen kernel: segment after segment). Segments
often read the same rows (overlapping causal prefixes of one document), and many rows are already on
the rank. Sending every segment its rows moves shared rows once per segment and copies local rows
through the collective. A :class:`GatherPlan` instead:

1. takes, per rank, its segment sequence as *runs* ``(holder rank, local row start, local row end)``,
   in segment order, repeats allowed;
2. reduces the remote runs of every (reader, holder) pair to the set of UNIQUE rows (sorted by holder
   rank, then local row: a canonical order that sender and receiver derive independently, so no
   layout has to be agreed on the wire);
3. trades only those rows with one ``all_to_all_single`` per dtype (tensors of one dtype, e.g. k and
   v, are packed side by side into one message), and skips the collective entirely when no rank
   moves a row (every rank knows the whole plan, so all agree);
4. assembles the segments from the local rows and the received unique rows (indices precomputed per plan;
   the local tensor is never copied whole): on CUDA one Triton kernel reads each row from whichever side holds
   it (:mod:`.triton_gather`; ``HF_LONGCTX_GATHER_TRITON=0`` keeps torch), elsewhere two row gathers.

Its inverse serves gradients and outputs: segment rows that read local rows are added (or copied)
into the local tensor directly; the rest are added into a buffer of the unique received rows
(several segments reading one row add their gradients there, in the caller's accumulation dtype),
which the reverse all_to_all returns to the holders, who add them at the rows they sent. On CUDA both
writes are one Triton kernel per tensor (:meth:`GatherPlan.return_rows`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..kernels.merge import merge_rows_
from ..optional_triton import TRITON_DTYPES, switched_on, triton_module
from .mode import ops_for
from .p2p import count_all_to_all

Run = tuple[int, int, int]  # (holder rank, local row start, local row end)


@dataclass
class _Pending:
    """Posted all_to_alls, one per dtype group: (work or None, receive buffer, tensor positions)."""

    parts: list[tuple[object, torch.Tensor, list[int]]]


def _dtype_groups(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Positions of ``tensors`` grouped by dtype, in order of first appearance (the same on every rank)."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return list(groups.values())


def _row_width(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:])


def _pack(parts: list[torch.Tensor]) -> torch.Tensor:
    """Rows of same-dtype tensors side by side: (rows, sum of row widths), contiguous."""
    flat = [p.reshape(p.shape[0], _row_width(p)) for p in parts]
    return flat[0].contiguous() if len(flat) == 1 else torch.cat(flat, dim=1)


def _unpack(buf: torch.Tensor, likes: list[torch.Tensor]) -> list[torch.Tensor]:
    """Inverse of :func:`_pack`: views of ``buf``'s column blocks shaped like the rows of ``likes``."""
    out, col = [], 0
    for like in likes:
        w = _row_width(like)
        out.append(buf[:, col:col + w].view(buf.shape[0], *like.shape[1:]))
        col += w
    return out


def _rows_contiguous(t: torch.Tensor) -> bool:
    """Whether every row of ``t`` is one contiguous block (its row stride may be anything)."""
    return t.shape[0] == 0 or t[0].is_contiguous()


def _triton_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a row kernel of :mod:`.triton_gather` takes this pair: one CUDA device, dtypes Triton takes, rows of
    more than one element and contiguous, Triton importable, ``HF_LONGCTX_GATHER_TRITON`` not 0."""
    return (a.device.type == "cuda" and b.device == a.device and a.dtype in TRITON_DTYPES and b.dtype in TRITON_DTYPES
            and a.dim() > 1 and b.dim() > 1 and _rows_contiguous(a) and _rows_contiguous(b)
            and switched_on("HF_LONGCTX_GATHER_TRITON") and triton_module("hf_longctx.comm.triton_gather") is not None)


def triton_gathers(local: torch.Tensor, received: torch.Tensor) -> bool:
    """Whether :meth:`GatherPlan.gather` assembles these two sources with one Triton kernel (:func:`_triton_rows`,
    one dtype)."""
    return local.dtype == received.dtype and _triton_rows(local, received)


def triton_returns(segments: Sequence[torch.Tensor], locals_: Sequence[torch.Tensor], add: bool) -> bool:
    """Whether :meth:`GatherPlan.return_rows` returns these results with one Triton kernel per tensor
    (:func:`_triton_rows`, rows alike, the local tensor contiguous), added only into float32 (the sums run in
    float32)."""
    return all(s.shape[1:] == loc.shape[1:] and loc.is_contiguous() and (not add or loc.dtype == torch.float32)
               and _triton_rows(s, loc) for s, loc in zip(segments, locals_))


def _receive_buffer(like: torch.Tensor, rows: int, width: int, group) -> torch.Tensor:
    """Where an all_to_all lands: beside ``like``, or on the host for a group whose comm ops stage all_to_alls
    there (:meth:`~.mode.CommOps.stages_on_host`: one device emulating W ranks would hold all W ranks' buffers at
    once)."""
    if like.device.type != "cpu" and ops_for(group).stages_on_host():
        return torch.empty(rows, width, dtype=like.dtype, device="cpu")
    return like.new_empty(rows, width)


def _a2a(recv: torch.Tensor, send: torch.Tensor, recv_counts: list[int], send_counts: list[int], group):
    ops = ops_for(group)
    if len(recv_counts) > 1 and ops.is_distributed():
        return ops.all_to_all_single(recv, send, recv_counts, send_counts, async_op=True)
    recv.copy_(send)
    return None


class GatherPlan:
    """What ``rank`` sends, receives and assembles, given every rank's segment sequence as runs.

    Attributes (index tensors are int64):

    - ``send_index``: local rows this rank sends, grouped by destination rank; ``send_counts[d]`` rows
      go to rank ``d`` (0 for itself: local rows never travel).
    - ``recv_counts[s]``: unique rows received from rank ``s``; they follow the local rows in
      ``[local ; received]``.
    - ``index``: this rank's segment sequence as rows of ``[local ; received]``.
    - ``local_pos``/``local_src``: segment positions that read local rows, and those rows;
      ``remote_pos``/``remote_slot``: the other positions and their rows in the received block.
    - ``moves``: whether ANY rank sends a row to another rank (else no collective is issued).
    """

    def __init__(self, runs_by_rank: Sequence[Sequence[Run]], rank: int, rows_per_rank: Sequence[int]):
        world = len(rows_per_rank)
        if len(runs_by_rank) != world:
            raise ValueError(f"runs for {len(runs_by_rank)} ranks, but rows_per_rank names {world}: give every "
                             "rank its runs (an empty list for a rank that gathers nothing)")
        self.rank = rank
        self.world = world
        self.local_rows = rows_per_rank[rank]
        self.moves = any(h != s and b > a for s, runs in enumerate(runs_by_rank) for h, a, b in runs)

        # as a holder: the unique rows every other rank needs from this rank
        send, self.send_counts = [], [0] * world
        for s, runs in enumerate(runs_by_rank):
            if s == rank:
                continue
            rows = np.flatnonzero(_mask(runs, rank, self.local_rows))
            send.append(rows)
            self.send_counts[s] = len(rows)

        # as a reader: unique rows from every other holder, then the segment index
        self.recv_counts = [0] * world
        positions: dict[int, np.ndarray] = {}  # holder -> slot in the received block of each of its rows
        base = 0
        for h in range(world):
            if h == rank:
                continue
            mask = _mask(runs_by_rank[rank], h, rows_per_rank[h])
            n = int(mask.sum())
            if n:
                positions[h] = base + np.cumsum(mask) - 1
            self.recv_counts[h] = n
            base += n
        self.recv_rows = base
        pieces = [np.arange(a, b) if h == rank else self.local_rows + positions[h][a:b]
                  for h, a, b in runs_by_rank[rank] if b > a]
        index = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
        local = index < self.local_rows
        self.local_pos = _long(np.flatnonzero(local))
        self.local_src = _long(index[local])
        self.remote_pos = _long(np.flatnonzero(~local))
        self.remote_slot = _long(index[~local] - self.local_rows)
        self.index = _long(index)
        send_np = np.concatenate(send) if send else np.zeros(0, dtype=np.int64)
        self.send_index = _long(send_np)
        # merging partial results (see merge_local): the distinct rows each side writes, and every entry's
        # place among them (several readers may return parts of one row)
        local_rows, local_inv = np.unique(index[local], return_inverse=True)
        send_rows, send_inv = np.unique(send_np, return_inverse=True)
        self.local_rows_merged, self.local_inverse = _long(local_rows), _long(local_inv.reshape(-1))
        self.send_rows_merged, self.send_inverse = _long(send_rows), _long(send_inv.reshape(-1))
        self._return_sums: tuple[torch.Tensor, ...] | None = None  # see return_sums
        self._holder_sums: tuple[torch.Tensor, ...] | None = None

    @property
    def return_sums(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Which segment rows each row of ``[local ; received]`` sums when results return (:func:`row_sums` of
        ``index``), made where ``index`` lives on first use: only the Triton return reads it."""
        if self._return_sums is None:
            self._return_sums = row_sums(self.index)
        return self._return_sums

    @property
    def holder_sums(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Which returned rows each local row sums (a row sent to several readers; :func:`row_sums` of
        ``send_index``)."""
        if self._holder_sums is None:
            self._holder_sums = row_sums(self.send_index)
        return self._holder_sums

    @property
    def segment_rows(self) -> int:
        return int(self.index.shape[0])

    def to(self, device) -> GatherPlan:
        for name in ("index", "local_pos", "local_src", "remote_pos", "remote_slot", "send_index",
                     "local_rows_merged", "local_inverse", "send_rows_merged", "send_inverse"):
            setattr(self, name, getattr(self, name).to(device))
        self._return_sums = self._holder_sums = None
        return self

    # ------------------------------------------------------------------ forward: rows to the readers

    def start(self, tensors: Sequence[torch.Tensor], group) -> _Pending:
        """Post sending the unique rows of ``tensors`` (local tensors, same rows) this rank serves to others."""
        parts = []
        if self.moves:
            for idx in _dtype_groups(tensors):
                send = _pack([tensors[i].index_select(0, self.send_index) for i in idx])
                recv = _receive_buffer(send, self.recv_rows, send.shape[1], group)
                count_all_to_all(send, self.send_counts, self.recv_counts, self.rank)
                parts.append((_a2a(recv, send, self.recv_counts, self.send_counts, group), recv, idx))
        return _Pending(parts)

    @staticmethod
    def wait(pending: _Pending) -> None:
        """Order the current stream after :meth:`start`'s transfers (on a GPU the host does not wait; on the CPU it
        does), so that work queued next runs after them. The handles are used up: :meth:`gather` waits no more."""
        for work, _, _ in pending.parts:
            if work is not None:
                work.wait()
        pending.parts = [(None, recv, idx) for _, recv, idx in pending.parts]

    def gather(self, pending: _Pending, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Wait for :meth:`start` and assemble this rank's segment sequence of each tensor."""
        received: list[torch.Tensor | None] = [None] * len(tensors)
        for work, recv, idx in pending.parts:
            if work is not None:
                work.wait()
            for i, r in zip(idx, _unpack(recv.to(tensors[idx[0]].device), [tensors[i] for i in idx])):
                received[i] = r
        pending.parts = []  # the receive buffers live on only in what is returned (a caller keeps ``pending``)
        out = []
        for t, r in zip(tensors, received):
            if r is None or r.shape[0] == 0:
                out.append(t.index_select(0, self.index))
                continue
            if triton_gathers(t, r):
                out.append(triton_module("hf_longctx.comm.triton_gather").gather_two(t, r, self.index))
                continue
            # two row gathers into the segment buffer: no copy of the whole local tensor
            seg = t.new_empty(self.segment_rows, *t.shape[1:])
            seg.index_copy_(0, self.local_pos, t.index_select(0, self.local_src))
            seg.index_copy_(0, self.remote_pos, r.index_select(0, self.remote_slot))
            out.append(seg)
        return out

    # ------------------------------------------------------------------ reverse: results to holders

    def scatter_local(self, segments: Sequence[torch.Tensor], locals_: Sequence[torch.Tensor], add: bool) -> None:
        """Put the segment rows that read local rows into the local tensors (added, or copied)."""
        if self.local_pos.shape[0] == 0:
            return
        for seg, loc in zip(segments, locals_):
            rows = seg.index_select(0, self.local_pos).to(loc.dtype)
            if add:
                loc.index_add_(0, self.local_src, rows)
            else:
                loc.index_copy_(0, self.local_src, rows)

    def return_rows(self, segments: Sequence[torch.Tensor], locals_: Sequence[torch.Tensor], add: bool, group
                    ) -> _Pending:
        """:meth:`scatter_local` and :meth:`start_return` of ``segments`` (any dtype: each is converted to its local
        tensor's, the dtype the holder accumulates in); :meth:`finish_return` with the same ``locals_`` ends it.

        On CUDA one Triton kernel per tensor writes each local row and send-buffer slot once, with the sum of the
        segment rows that read it, converted as it goes (:func:`~.triton_gather.scatter_rows`: no atomics, the same
        sums run after run); elsewhere torch's row ops."""
        return self._post_returns(self.fill_returns(segments, locals_, add), group)

    def fill_returns(self, segments: Sequence[torch.Tensor], locals_: Sequence[torch.Tensor], add: bool
                     ) -> list[tuple[torch.Tensor, list[int]]]:
        """:meth:`return_rows` up to its collective: the segment rows written into ``locals_``, and per dtype group
        of ``locals_`` the buffer of the received rows' sums to send back (none when no rank moves a row)."""
        if not triton_returns(segments, locals_, add):
            converted = [s.to(loc.dtype) for s, loc in zip(segments, locals_)]
            self.scatter_local(converted, locals_, add)
            return self._send_buffers(converted)
        scatter_rows = triton_module("hf_longctx.comm.triton_gather").scatter_rows
        buffers = []
        for idx in _dtype_groups(locals_):
            width = sum(_row_width(locals_[i]) for i in idx)
            buf = locals_[idx[0]].new_empty(self.recv_rows if self.moves else 0, width)  # every row is written
            column = 0
            for i in idx:
                scatter_rows(segments[i], locals_[i], buf, self.return_sums, column, add)
                column += _row_width(locals_[i])
            if self.moves:
                buffers.append((buf, idx))
        return buffers

    def _send_buffers(self, segments: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, list[int]]]:
        """Per dtype group of ``segments``: the remote segment rows summed per unique received row (torch)."""
        buffers = []
        if self.moves:
            for idx in _dtype_groups(segments):
                seg = [segments[i] for i in idx]
                buf = seg[0].new_zeros(self.recv_rows, sum(_row_width(s) for s in seg))
                if self.recv_rows:
                    buf.index_add_(0, self.remote_slot, _pack([s.index_select(0, self.remote_pos) for s in seg]))
                buffers.append((buf, idx))
        return buffers

    def _post_returns(self, buffers: list[tuple[torch.Tensor, list[int]]], group) -> _Pending:
        """Post the reverse all_to_all of each send buffer."""
        parts = []
        for buf, idx in buffers:
            recv = _receive_buffer(buf, self.send_index.shape[0], buf.shape[1], group)
            count_all_to_all(buf, self.recv_counts, self.send_counts, self.rank)
            parts.append((_a2a(recv, buf, self.send_counts, self.recv_counts, group), recv, idx))
        return _Pending(parts)

    def start_return(self, segments: Sequence[torch.Tensor], group) -> _Pending:
        """Post returning the remote segment rows to their holders, summed per unique row.

        Segments must already be in the dtype the holder accumulates in (sums happen here)."""
        return self._post_returns(self._send_buffers(segments), group)

    def finish_return(self, pending: _Pending, locals_: Sequence[torch.Tensor], add: bool) -> None:
        """Wait for :meth:`start_return` and add (or copy) the returned rows at the rows this rank sent (on CUDA with
        :func:`~.triton_gather.scatter_rows`: a row sent to several readers sums their parts in a fixed order)."""
        for work, recv, idx in pending.parts:
            if work is not None:
                work.wait()
            if recv.shape[0] == 0:
                continue
            recv = recv.to(locals_[idx[0]].device)  # a buffer staged on the host comes back first
            for i, r in zip(idx, _unpack(recv, [locals_[i] for i in idx])):
                if triton_returns([r], [locals_[i]], add):  # each local row sums what its readers returned
                    scatter_rows = triton_module("hf_longctx.comm.triton_gather").scatter_rows
                    scatter_rows(r, locals_[i], locals_[i], self.holder_sums, 0, add)
                    continue
                r = r.to(locals_[i].dtype)
                if add:
                    locals_[i].index_add_(0, self.send_index, r)
                else:
                    locals_[i].index_copy_(0, self.send_index, r)
        pending.parts = []

    # ------------------------------------------------------------------ reverse: partial results to holders

    def merge_local(self, out_seg: torch.Tensor, lse_seg: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
                    ) -> None:
        """Merge the partial results (``out_seg``: (rows, H, D), ``lse_seg``: (rows, H)) of segment rows that
        read local rows into the running local result (``out``, ``lse``) by their log-sum-exp, where
        :meth:`scatter_local` would copy them: for segments that see only part of their rows' keys."""
        if self.local_pos.shape[0] == 0:
            return
        merge_rows_(out, lse, self.local_rows_merged, self.local_inverse,
                    out_seg.index_select(0, self.local_pos), lse_seg.index_select(0, self.local_pos))

    def finish_merge(self, pending: _Pending, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Wait for :meth:`start_return` of ``[out_seg, lse_seg]`` and merge the returned partial results into
        ``out`` and ``lse`` (several readers may return parts of one row). A reader's segments must not return
        two parts of one row (:meth:`start_return` sums a reader's rows)."""
        received: list[torch.Tensor | None] = [None, None]
        for work, recv, idx in pending.parts:
            if work is not None:
                work.wait()
            for i, r in zip(idx, _unpack(recv.to(out.device), [(out, lse)[i] for i in idx])):
                received[i] = r
        pending.parts = []
        if received[0] is None or received[0].shape[0] == 0:
            return
        merge_rows_(out, lse, self.send_rows_merged, self.send_inverse, received[0], received[1])


def unique_rows_between(runs_by_rank: Sequence[Sequence[Run]]) -> dict[tuple[int, int], int]:
    """(holder, reader) -> the unique rows a :class:`GatherPlan` of these runs moves from holder to reader (its
    ``send_counts`` seen from every rank at once), from the runs alone: what a cost model counts without building
    every rank's plan."""
    moved: dict[tuple[int, int], int] = {}
    for reader, runs in enumerate(runs_by_rank):
        by_holder: dict[int, list[tuple[int, int]]] = {}
        for h, a, b in runs:
            if h != reader and b > a:
                by_holder.setdefault(h, []).append((a, b))
        for h, spans in by_holder.items():
            spans.sort()
            total, end = 0, -1
            for a, b in spans:
                if b > end:
                    total += b - max(a, end)
                    end = b
            moved[(h, reader)] = total
    return moved


def _mask(runs: Sequence[Run], holder: int, rows: int) -> np.ndarray:
    """Rows of ``holder`` that ``runs`` read (a boolean mask of its ``rows`` local rows)."""
    mask = np.zeros(rows, dtype=bool)
    for h, a, b in runs:
        if h == holder:
            mask[a:b] = True
    return mask


def row_sums(targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each entry ``i`` of ``targets`` (int64) adds to, as sums per target, on ``targets``' device: (the
    distinct targets; each one's first position in the order, one more at the end; the entries sorted by target,
    in their own order within one). One sort where the targets live: numpy's sort and unique on the host made
    an emulated CAD step measurably longer (bench/results/2026-12-04_from-modules.md)."""
    ordered, order = torch.sort(targets, stable=True)
    rows, counts = torch.unique_consecutive(ordered, return_counts=True)
    starts = torch.zeros(rows.shape[0] + 1, dtype=torch.int64, device=targets.device)
    torch.cumsum(counts, 0, out=starts[1:])
    return rows, starts, order


def _long(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
