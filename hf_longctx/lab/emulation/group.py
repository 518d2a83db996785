"""An in-process process group: W ranks as W threads of one process, every transfer a local copy.

Why: whether the work of W sequence-parallel ranks is balanced in *kernel time* needs no W GPUs, only
the W ranks' kernel calls on one device, with the same plans, schedules, kernels and merges as a real
run. The backends talk to their peers only through the package's ``comm`` layer, which asks every group for its
comm ops (:func:`hf_longctx.comm.mode.ops_for`): an :class:`EmulatedGroup` carries its own, so point-to-point
batches, ``all_to_all_single``, ``all_gather``, ``all_reduce`` and ``barrier`` become copies through the shared
:class:`EmulationHub`, and the comm layer never learns that the group is emulated.

Threads run one at a time (cooperative scheduling): a thread holds the hub's lock whenever it runs
and gives it up only while it waits for a peer. So one rank's device work is never interleaved with
another's on the device stream (events around a kernel call time exactly that call), package state
needs no locks, and a run is deterministic. The hub records what each rank sends in each call, by
collective kind and peer (:class:`Traffic`), for a communication model (:mod:`hf_longctx.comm.links`: which
bytes stay inside a node and which cross the network depends on the peer).

Sub-groups. A rank's group makes sub-groups of its hub (:meth:`EmulatedGroup.sub_groups`, e.g. a
two-dimensional mesh's inner and outer groups): each is a :class:`Channel` of the same hub, which matches
point-to-point messages and collectives per channel, as a process group does per group, while the lock, the
threads, the waits and a failing rank's stop stay the hub's. Their traffic is recorded on the hub's ranks.

Rank threads are kept and reused (:mod:`.threads`: rank ``r`` of every hub runs on the same long-lived
thread). Nothing of a run stays referenced once it returns (or raises): no reference cycle runs through
the hub, so a run's tensors are freed as soon as the caller drops them, without waiting for the garbage
collector.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_longctx.comm.links import Transfer
from hf_longctx.comm.subgroups import SubGroupMismatch
from hf_longctx.lab.emulation.threads import acquire_workers, rank_threads, release_workers

__all__ = ["Channel", "EmulatedGroup", "EmulationError", "EmulationHub", "Traffic", "rank_threads"]


class EmulationError(RuntimeError):
    """A rank of an emulated group failed or a transfer was never matched (a deadlock)."""


@dataclass
class Traffic:
    """Bytes one rank sent to other ranks: one :data:`~hf_longctx.comm.links.Transfer` per call that sent any,
    ``(kind, {peer: bytes})``, kind ``p2p`` (a batch of point-to-point sends) or ``a2a`` (an all_to_all); peers
    are ranks of the hub's world, whatever group the call was made on, and never the rank itself."""

    calls: list[Transfer] = field(default_factory=list)

    @property
    def sent_bytes(self) -> int:
        return sum(sum(bytes_to.values()) for _, bytes_to in self.calls)

    def record(self, kind: str, bytes_to: dict[int, int]) -> None:
        """One call's bytes per peer; nothing for a call that sent nothing to another rank."""
        sent = {peer: b for peer, b in bytes_to.items() if b}
        if sent:
            self.calls.append((kind, sent))


@dataclass(frozen=True)
class Channel:
    """The ranks of one emulated group: ``members[g]`` is the hub rank of group rank ``g``. A hub matches
    point-to-point messages and collectives per channel (``id``), as torch.distributed does per process group; a
    hub's root channel (id 0) holds all its ranks in order. A channel refers to no hub (a hub keeps the channels
    made of it)."""

    id: int
    members: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.members)


class _Work:
    """What an async call returns: ``wait()`` blocks (giving up the hub) until ``done()`` holds."""

    def __init__(self, hub: EmulationHub, done: Callable[[], bool], what: str) -> None:
        self._hub, self._done, self._what = hub, done, what

    def wait(self) -> bool:
        self._hub.wait_for(self._done, self._what)
        return True

    def is_completed(self) -> bool:
        return self._done()


@dataclass
class _Message:
    tensor: torch.Tensor | None = None  # a posted send
    buffer: torch.Tensor | None = None  # a posted receive
    done: bool = False


@dataclass
class _Collective:
    kind: str
    parts: dict[int, tuple] = field(default_factory=dict)
    done: bool = False


def _copy_into(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.numel() != src.numel():
        raise EmulationError(f"{what}: {src.numel()} elements sent into a buffer of {dst.numel()}")
    dst.view(-1).copy_(src.reshape(-1))


class EmulationHub:
    """Shared state of one emulated group of ``world`` ranks and of the groups made of it (:class:`Channel`s: the
    root, every rank, and the sub-groups its ranks make); :meth:`run` runs a function on every rank. Transfers are
    matched per channel; traffic counts on the hub's ranks.

    ``cache``: state the package keeps per group for the hub's lifetime, per rank (:meth:`EmulatedGroup.state`;
    freed with the hub, unlike a module-level dict keyed by ``id(group)``, whose keys a later group may reuse).

    ``stage_on_host``: an all_to_all's send and receive buffers live in host memory (see
    :class:`~hf_longctx.comm.gather.GatherPlan`, which allocates the receive buffers where
    :meth:`EmulatedGroup.stages_on_host` says). A real device holds its own
    rank's buffers; one device emulating W ranks holds all of them, since every rank posts before any
    collective completes, and CAD's backward returns fp32 key gradients for every gathered row.
    :attr:`largest_all_to_all` (bytes) is about what staging then holds on the host at once; the price is a copy
    to the host and back per transfer, outside the timed kernel calls. :attr:`largest_all_to_all_on_device`: the
    most one all_to_all's buffers held on a device (0 when every one was staged).
    """

    def __init__(self, world: int, timeout_s: float = 600.0, stage_on_host: bool = False) -> None:
        if world < 1:
            raise ValueError("an emulated group needs at least one rank")
        self.world = world
        self.timeout_s = timeout_s
        self.stage_on_host = stage_on_host
        self.largest_all_to_all = 0  # bytes: the most one all_to_all moved between ranks, all senders together
        # bytes: the most one all_to_all's send and receive buffers held on a device (0 when staged on the host)
        self.largest_all_to_all_on_device = 0
        self.lock = threading.Lock()  # held by the one rank that runs
        self._wakeup = [threading.Condition(self.lock) for _ in range(world)]
        self._waiting: dict[int, Callable[[], bool]] = {}  # rank -> what it waits for
        self.failed: BaseException | None = None
        self.traffic = [Traffic() for _ in range(world)]
        self.root = Channel(0, tuple(range(world)))  # the group of every rank
        self._p2p: dict[tuple[int, int, int, int], deque[_Message]] = {}  # (channel, source, destination, tag)
        self._seq: dict[tuple[int, int], int] = {}  # (channel, group rank) -> collectives the rank issued on it
        self._collectives: dict[tuple[int, int], _Collective] = {}  # (channel, sequence number)
        self._sub_channels: dict[tuple, list[Channel]] = {}  # (channel, setting, member lists) -> channels made
        self._next_channel = 1
        self.local = threading.local()  # ``rank`` of the running thread, for observers (kernel timers)
        self.cache: dict = {}

    # ------------------------------------------------------------------ running the ranks

    def run(self, fn: Callable[[EmulatedGroup], Any]) -> list[Any]:
        """``fn(group)`` on every rank (one thread each, one running at a time); their results by rank.

        The first exception of any rank is raised here once every rank has stopped (the others stop at
        their next wait with an :class:`EmulationError`). Ranks run on reused threads (see the module
        docstring); when this returns or raises, the hub holds nothing of the run but its traffic.
        """
        results: list[Any] = [None] * self.world
        errors: list[BaseException | None] = [None] * self.world

        def body(rank: int) -> None:
            with self.lock:
                self.local.rank = rank
                try:
                    results[rank] = fn(EmulatedGroup(self, rank))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller below
                    errors[rank] = exc
                    if self.failed is None:
                        self.failed = exc
                    for cond in self._wakeup:
                        cond.notify()
                finally:
                    self.local.rank = None

        workers = acquire_workers(self.world)
        try:
            done = [w.submit(lambda r=r: body(r)) for r, w in enumerate(workers)]
            for d in done:
                d.wait()
        finally:
            release_workers(workers)
        first = next((e for e in errors if e is not None and not isinstance(e, EmulationError)), None)
        first = first or next((e for e in errors if e is not None), None)
        # an exception's traceback holds the ranks' frames (their tensors): nothing here may point back at it,
        # or frames, exception and hub form a cycle that only the garbage collector frees
        errors.clear()
        self.failed = None
        self._p2p.clear()  # sends nobody received, collectives some rank never joined: their tensors
        self._collectives.clear()
        if first is not None:
            try:
                raise first
            finally:
                first = None
        return results

    def current_rank(self) -> int | None:
        return getattr(self.local, "rank", None)

    def wait_for(self, predicate: Callable[[], bool], what: str) -> None:
        """Give up the hub until ``predicate()`` holds (called with the hub held, as every rank runs).

        Only a rank whose condition a change made true is woken (:meth:`_changed`), so W waiting ranks
        cost no stampede of wake-ups per transfer.
        """
        rank = self.current_rank()
        self._waiting[rank] = predicate
        try:
            while not predicate():
                if self.failed is not None:
                    raise EmulationError(f"emulated {what}: another rank failed ({type(self.failed).__name__}: "
                                         f"{self.failed})")
                if not self._wakeup[rank].wait(self.timeout_s):
                    raise EmulationError(f"emulated {what}: no peer answered in {self.timeout_s:.0f} s (a rank "
                                         "waits for a transfer no rank posts)")
        finally:
            del self._waiting[rank]

    def _changed(self) -> None:
        """Wake the waiting ranks whose condition now holds."""
        for rank, predicate in self._waiting.items():
            if predicate():
                self._wakeup[rank].notify()

    # ------------------------------------------------------------------ point to point

    def post(self, channel: Channel, rank: int, sends: Sequence[tuple[int, torch.Tensor, int]],
             recvs: Sequence[tuple[int, torch.Tensor, int]], what: str) -> list[_Work]:
        """Post sends ``(dst, tensor, tag)`` and receives ``(src, buffer, tag)`` of group rank ``rank`` of
        ``channel``; matched FIFO per (channel, source, destination, tag), as gloo matches them per group. Sends are
        copied when their receive is posted, so a sender must not change a tensor before its work completes (as with
        NCCL)."""
        mine: list[_Message] = []
        sent: dict[int, int] = {}  # hub rank -> bytes
        for dst, t, tag in sends:
            q = self._p2p.setdefault((channel.id, rank, dst, tag), deque())
            if q and q[0].buffer is not None:
                m = q.popleft()
                _copy_into(m.buffer, t, what)
                m.done = True
            else:
                m = _Message(tensor=t)
                q.append(m)
            mine.append(m)
            if dst != rank:
                peer = channel.members[dst]
                sent[peer] = sent.get(peer, 0) + t.numel() * t.element_size()
        for src, buf, tag in recvs:
            q = self._p2p.setdefault((channel.id, src, rank, tag), deque())
            if q and q[0].tensor is not None:
                m = q.popleft()
                _copy_into(buf, m.tensor, what)
                m.done = True
            else:
                m = _Message(buffer=buf)
                q.append(m)
            mine.append(m)
        self.traffic[channel.members[rank]].record("p2p", sent)
        self._changed()
        return [_Work(self, lambda m=m: m.done, what) for m in mine]

    # ------------------------------------------------------------------ collectives

    def _join(self, channel: Channel, rank: int, kind: str, part: tuple,
              complete: Callable[[dict[int, tuple]], None]) -> _Work:
        """Group rank ``rank``'s part of the next collective on ``channel``; the last rank to join runs
        ``complete(parts)`` (parts by group rank) and wakes the others."""
        seq = self._seq.get((channel.id, rank), 0)
        self._seq[channel.id, rank] = seq + 1
        coll = self._collectives.setdefault((channel.id, seq), _Collective(kind))
        if coll.kind != kind:
            raise EmulationError(f"emulated collective {seq} of the group of hub ranks {channel.members}: rank {rank} "
                                 f"calls {kind}, another rank {coll.kind}; every rank must issue the same collectives "
                                 "in the same order")
        coll.parts[rank] = part
        if len(coll.parts) == channel.size:
            complete(coll.parts)
            coll.done = True
            # every rank's work handle keeps ``coll``: drop the ranks' buffers now, or the send buffers of all W
            # ranks stay alive until the last rank lets go of its handle (W times what one device would hold)
            coll.parts.clear()
            del self._collectives[channel.id, seq]
            self._changed()
        return _Work(self, lambda: coll.done, kind)

    def all_to_all_single(self, channel: Channel, rank: int, recv: torch.Tensor, send: torch.Tensor,
                          in_split: list[int] | None, out_split: list[int] | None,
                          async_op: bool = False) -> _Work | None:
        """``torch.distributed.all_to_all_single`` semantics on rows, over ``channel``: ``out_split[d]`` rows of
        ``send`` go to group rank ``d``, ``in_split[s]`` rows of ``recv`` come from group rank ``s`` (None: equal
        splits)."""
        world = channel.size
        out_split = list(out_split) if out_split is not None else [send.shape[0] // world] * world
        in_split = list(in_split) if in_split is not None else [recv.shape[0] // world] * world
        row = send.element_size() * math.prod(send.shape[1:])
        sent = {channel.members[d]: row * c for d, c in enumerate(out_split) if d != rank}
        self.traffic[channel.members[rank]].record("a2a", sent)
        if self.stage_on_host and send.device.type != "cpu" and any(sent.values()):
            send = send.to("cpu")  # the caller's device buffer is freed once it lets go of it

        def complete(parts: dict[int, tuple]) -> None:
            for r in range(world):
                for s in range(world):
                    if parts[r][2][s] != parts[s][3][r]:
                        raise EmulationError(f"emulated all_to_all: rank {s} sends {parts[s][3][r]} rows to rank "
                                             f"{r}, which expects {parts[r][2][s]}")
            # sender by sender, each one's buffer let go of once its rows are copied out: staged on the host, the
            # host then holds about one copy of the collective's rows, not two
            filled = [0] * world  # rows of each receiver filled so far
            moved = 0  # bytes sent to other ranks, all senders together
            on_device = sum(t.numel() * t.element_size() for p in parts.values() for t in p[:2]
                            if t is not None and t.device.type != "cpu")
            self.largest_all_to_all_on_device = max(self.largest_all_to_all_on_device, on_device)
            for s in range(world):
                s_recv, s_send, s_in, s_out = parts[s]
                at = 0
                for r, n in enumerate(s_out):
                    if n:
                        rows = parts[r][0].view(-1, *s_send.shape[1:])
                        rows[filled[r]:filled[r] + n].copy_(s_send[at:at + n])
                        filled[r] += n
                        at += n
                moved += (s_send.shape[0] - s_out[s]) * s_send[:1].numel() * s_send.element_size()
                parts[s] = (s_recv, None, s_in, s_out)
                del s_send
            self.largest_all_to_all = max(self.largest_all_to_all, moved)

        work = self._join(channel, rank, "all_to_all", (recv, send, in_split, out_split), complete)
        return work if async_op else work.wait() and None

    def all_gather(self, channel: Channel, rank: int, tensors: list[torch.Tensor], tensor: torch.Tensor) -> None:
        def complete(parts: dict[int, tuple]) -> None:
            for r in range(channel.size):
                for s in range(channel.size):
                    parts[r][0][s].copy_(parts[s][1])

        self._join(channel, rank, "all_gather", (tensors, tensor), complete).wait()

    def all_reduce(self, channel: Channel, rank: int, tensor: torch.Tensor, op: str = "sum") -> None:
        """In-place reduction over the ranks of ``channel``; ``op`` is ``sum``, ``max`` or ``min``."""
        def complete(parts: dict[int, tuple]) -> None:
            stacked = torch.stack([parts[s][0] for s in range(channel.size)])
            reduced = {"sum": stacked.sum(0), "max": stacked.amax(0), "min": stacked.amin(0)}[op]
            for s in range(channel.size):
                parts[s][0].copy_(reduced)

        self._join(channel, rank, f"all_reduce_{op}", (tensor,), complete).wait()

    def barrier(self, channel: Channel, rank: int) -> None:
        self._join(channel, rank, "barrier", (), lambda parts: None).wait()

    # ------------------------------------------------------------------ sub-groups

    def sub_channels(self, channel: Channel, rank: int, members: tuple[tuple[int, ...], ...], setting: Hashable
                     ) -> list[Channel]:
        """The channels of ``members`` (lists of group ranks of ``channel``), in their order: made by a collective
        of ``channel`` at the first ask for these lists and ``setting``, the same ones returned after, with no
        collective (the contract of :meth:`~hf_longctx.comm.mode.CommOps.sub_groups`). Ranks that give different
        settings all raise :class:`~hf_longctx.comm.subgroups.SubGroupMismatch` when the last of them asks."""
        for m in members:
            if not m or len(set(m)) != len(m) or not all(0 <= r < channel.size for r in m):
                raise ValueError(f"a sub-group's ranks must be distinct ranks of its group of {channel.size}, got {m}")
        key = (channel.id, setting, members)
        if key in self._sub_channels:
            return self._sub_channels[key]
        answer: list = []  # what this rank is told: the channels, or the settings its peers disagree on

        def complete(parts: dict[int, tuple]) -> None:
            settings = {part[0] for part in parts.values()}
            if len(settings) > 1:
                told: object = {channel.members: sorted(settings)}
            else:
                made: dict[tuple[int, ...], Channel] = {}
                for m in sorted(set(members)):
                    made[m] = Channel(self._next_channel, tuple(channel.members[r] for r in m))
                    self._next_channel += 1
                told = self._sub_channels[key] = [made[m] for m in members]
            for part in parts.values():
                part[1].append(told)

        self._join(channel, rank, "sub_groups", (setting, answer), complete).wait()
        (told,) = answer
        if isinstance(told, dict):
            raise SubGroupMismatch(told)
        return told


class EmulatedGroup:
    """One rank's handle on a group of an :class:`EmulationHub` (``channel``: the hub's root channel, every rank,
    unless given): what ``comm`` functions receive as ``group``, and its own comm ops
    (:class:`hf_longctx.comm.mode.CommOps`): transfers are copies through the hub, every rank is in this process,
    collectives take CPU tensors, and all_to_all buffers are staged on the host where the hub says. ``rank`` is the
    rank inside the group; :meth:`global_rank` names the hub's rank."""

    def __init__(self, hub: EmulationHub, rank: int, channel: Channel | None = None) -> None:
        self.hub = hub
        self.channel = hub.root if channel is None else channel
        if not 0 <= rank < self.channel.size:
            raise ValueError(f"rank {rank} is not in an emulated group of {self.channel.size}")
        self.rank = rank

    @property
    def comm_ops(self) -> EmulatedGroup:
        return self

    @property
    def world(self) -> int:
        return self.channel.size

    def size(self) -> int:
        return self.channel.size

    # ------------------------------------------------------------------ comm ops

    def is_distributed(self) -> bool:
        return True

    def rank_and_size(self) -> tuple[int, int]:
        return self.rank, self.world

    def global_rank(self, group_rank: int) -> int:
        return self.channel.members[group_rank]

    def post(self, sends, recvs, what: str) -> list[_Work]:
        return self.hub.post(self.channel, self.rank, sends, recvs, what)

    def all_to_all_single(self, recv, send, in_split=None, out_split=None, async_op: bool = False):
        return self.hub.all_to_all_single(self.channel, self.rank, recv, send, in_split, out_split, async_op)

    def all_gather(self, tensors: list[torch.Tensor], tensor: torch.Tensor) -> None:
        self.hub.all_gather(self.channel, self.rank, tensors, tensor)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        self.hub.all_reduce(self.channel, self.rank, tensor, op)

    def collective_device(self) -> torch.device:
        """The CPU: the ranks share one process, and a collective's tensors are copied between them."""
        return torch.device("cpu")

    def stages_on_host(self) -> bool:
        return self.hub.stage_on_host

    def in_one_process(self) -> bool:
        return True

    def state(self) -> dict:
        """This rank's part of the hub's ``cache`` for this group: freed with the hub."""
        return self.hub.cache.setdefault(("rank state", self.channel.id, self.rank), {})

    def sub_groups(self, members: Sequence[Sequence[int]], setting: Hashable) -> list[EmulatedGroup | None]:
        """Groups of this hub over ``members`` (lists of ranks of this group), in their order: this rank's handle
        on each group it is in (a group of one rank too: a handle, whose collectives complete at once), None for
        the others. Made at the first ask for these lists and ``setting`` (a collective of this group), the same
        groups after (:meth:`~hf_longctx.comm.mode.CommOps.sub_groups`); their traffic counts on the hub's ranks.
        Each call gives new handles: nothing the hub keeps refers back to it (see the module docstring)."""
        lists = tuple(tuple(int(r) for r in m) for m in members)
        made = self.hub.sub_channels(self.channel, self.rank, lists, setting)
        me = self.global_rank(self.rank)
        return [EmulatedGroup(self.hub, c.members.index(me), c) if me in c.members else None for c in made]

    def barrier(self) -> None:
        self.hub.barrier(self.channel, self.rank)

    def __repr__(self) -> str:
        where = "" if self.channel.id == 0 else f" (hub ranks {list(self.channel.members)})"
        return f"<EmulatedGroup rank {self.rank} of {self.world}{where}>"
