"""Measured link bandwidths, per collective kind and message size, for communication models.

Why: an emulated run (W ranks on one device) and CAD's choice of ``eps`` both need the seconds a
rank's bytes take on a real fabric. The figures are the design document's section 7 ("Reference
numbers measured here": 4x H200, all pairs NV18, NCCL, torch 2.11 cu130; :data:`_SOURCE`), per rank, at
16/64/256 MB:

- ``p2p``: "NCCL ring sendrecv per rank": 71 / 114 / 246 GB/s (the ring, zigzag, distfa engine);
- ``a2a``: "NCCL all_to_all per rank out": 87 / 123 / 148 GB/s (tasp, ulysses, cad).

Between the measured sizes the bandwidth is interpolated linearly in log(message size); outside them
it is held at the nearest figure (smaller messages are slower still: this model is optimistic there).
They hold within one NVLink/NVSwitch node. Past one node, :class:`LinkTiers` prices the bytes that cross the
network apart from those that stay inside a node.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

MB = 1 << 20


@dataclass(frozen=True)
class LinkCurve:
    """Bandwidth (bytes/s) of one collective kind as a function of the message size a rank sends."""

    sizes: tuple[float, ...]  # bytes, increasing
    bandwidth: tuple[float, ...]  # bytes per second at those sizes
    source: str

    def at(self, nbytes: float) -> float:
        if nbytes <= self.sizes[0]:
            return self.bandwidth[0]
        if nbytes >= self.sizes[-1]:
            return self.bandwidth[-1]
        i = bisect.bisect_right(self.sizes, nbytes) - 1
        x = (math.log(nbytes) - math.log(self.sizes[i])) / (math.log(self.sizes[i + 1]) - math.log(self.sizes[i]))
        return self.bandwidth[i] + x * (self.bandwidth[i + 1] - self.bandwidth[i])

    def seconds(self, nbytes: float) -> float:
        """Seconds one message of ``nbytes`` takes (0 for nothing sent)."""
        return nbytes / self.at(nbytes) if nbytes > 0 else 0.0


_SIZES = (16.0 * MB, 64.0 * MB, 256.0 * MB)
_SOURCE = "design document section 7 (reference numbers), measured 2026-11-22 on 4x H200 (NV18), NCCL"
LINKS: dict[str, LinkCurve] = {
    "p2p": LinkCurve(_SIZES, (71e9, 114e9, 246e9), f"{_SOURCE}: ring sendrecv per rank 71/114/246 GB/s"),
    "a2a": LinkCurve(_SIZES, (87e9, 123e9, 148e9), f"{_SOURCE}: all_to_all per rank out 87/123/148 GB/s"),
}


# A rank's transfer in one call: its kind and the bytes it sends to each peer (group ranks of the world the tiers
# number; the rank itself never appears).
Transfer = tuple[str, Mapping[int, int]]

INTER_NODE_BYTES_PER_S = 50e9  # per GPU between nodes: one 400 Gb/s NIC per GPU, as on H100/H200 clusters


@dataclass(frozen=True)
class LinkTiers:
    """Two link tiers: ranks ``r // node_size`` share a node (NVLink: the measured :data:`LINKS` curves), and
    bytes to another node cross the network at ``inter_node_bytes_per_s`` per GPU.

    Why a formula: a group beyond one node cannot be measured on one node, yet which backend is fastest there
    turns on what crosses the network (Ulysses' all_to_all spans its whole group; a ring across nodes sends one
    neighbour's block). A rank's call sends its intra-node and inter-node bytes at the same time over different
    links, so the call lasts the longer of the two. :data:`ONE_NODE` keeps every rank in one node: each call on
    its kind's NVLink curve at its total bytes.
    """

    node_size: int = 8
    inter_node_bytes_per_s: float = INTER_NODE_BYTES_PER_S

    def __post_init__(self) -> None:
        if self.node_size < 1:
            raise ValueError(f"node_size must be >= 1 (GPUs per node), got {self.node_size}")
        if not self.inter_node_bytes_per_s > 0:
            raise ValueError(f"inter_node_bytes_per_s must be > 0, got {self.inter_node_bytes_per_s}")

    def same_node(self, a: int, b: int) -> bool:
        return a // self.node_size == b // self.node_size

    def split(self, rank: int, bytes_to: Mapping[int, int]) -> tuple[int, int]:
        """(bytes ``rank`` sends inside its node, bytes it sends to other nodes)."""
        intra = sum(b for peer, b in bytes_to.items() if peer != rank and self.same_node(rank, peer))
        inter = sum(b for peer, b in bytes_to.items() if peer != rank and not self.same_node(rank, peer))
        return intra, inter

    def call_seconds(self, kind: str, rank: int, bytes_to: Mapping[int, int]) -> float:
        """Seconds one call of ``kind`` takes for ``rank`` sending ``bytes_to`` (peer -> bytes)."""
        intra, inter = self.split(rank, bytes_to)
        return max(LINKS[kind].seconds(intra), inter / self.inter_node_bytes_per_s)

    def seconds(self, rank: int, calls: Sequence[Transfer]) -> float:
        """Seconds ``rank``'s calls take back to back."""
        return sum(self.call_seconds(kind, rank, bytes_to) for kind, bytes_to in calls)

    def describe(self) -> str:
        return (f"nodes of {self.node_size} GPUs (NVLink curves inside), "
                f"{self.inter_node_bytes_per_s / 1e9:.0f} GB/s per GPU between nodes")


ONE_NODE = LinkTiers(node_size=1 << 30)  # every rank of any group in one NVLink node
