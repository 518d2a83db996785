"""Measured link bandwidths, per collective kind and message size, for communication models.

Why: an emulated run (W ranks on one device) and CAD's choice of ``eps`` both need the seconds a
rank's bytes take on a real fabric. The figures are the design document's section 7 ("Reference
numbers measured here": 4x H200, all pairs NV18, NCCL, torch 2.11 cu130; :data:`_SOURCE`), per rank, at
16/64/256 MB:

- ``p2p``: "NCCL ring sendrecv per rank": 71 / 114 / 246 GB/s (the ring, zigzag, distfa engine);
- ``a2a``: "NCCL all_to_all per rank out": 87 / 123 / 148 GB/s (tasp, ulysses, cad).

Between the measured sizes the bandwidth is interpolated linearly in log(message size); outside them
it is held at the nearest figure (smaller messages are slower still: this model is optimistic there).
They hold within one NVLink/NVSwitch node; beyond 8 GPUs a real group crosses the inter-node network.
"""

from __future__ import annotations

import bisect
import math
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


def transfer_seconds(calls: list[tuple[str, int]] | tuple[tuple[str, int], ...]) -> float:
    """Seconds a rank's transfers take back to back: each ``(kind, bytes)`` call at its kind's bandwidth
    for that message size."""
    return sum(LINKS[kind].seconds(nbytes) for kind, nbytes in calls)
