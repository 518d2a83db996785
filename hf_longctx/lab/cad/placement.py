"""Where a forward call's blocks run: a launch simulation in which blocks that share an SM run slower.

Why: the launch cost model used to simulate a call's blocks on one slot per SM, each at full speed. A call of a
few rows over a long prefix is a chain of long blocks, and its time is how fast those blocks run. Torch's flash
forward (``scripts/lab/profile_cad.py --placement``) runs up to one block per SM alone; past that, long blocks
mostly end up two to an SM and each takes longer (an SM gives two blocks more throughput than one, not twice),
even when short blocks separate them in the launch order. One slot per SM priced such calls far low or high
(measured: bench/results/2026-11-24_cad-kernel-time.md, bench/results/2026-12-04_from-modules.md).

:func:`~hf_longctx.kernels.launch.paired_makespan` is the simplest rule that follows those probes: blocks start
in launch order on two slots per SM, and a block that starts while more than ``sms`` blocks run takes
``pairing`` times its tile steps. :func:`fit_forward_placement` fits per-token and per-call terms on top of it
to dumped calls (``bench_emulated.py --dump-calls``) and reports how well each dump is priced, call by call and
server by server; :class:`~hf_longctx.kernels.launch.LaunchGrid`'s ``forward_pairing`` and ``empty_hold`` put
the rule into the launch cost model.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hf_longctx.backends.cad.launch_cost import fit_relative
from hf_longctx.kernels.launch import LaunchGrid, forward_block_steps, paired_makespan
from hf_longctx.kernels.torch_flash import FORWARD_PAIRING
from hf_longctx.lab.cad.call_profile import dumped_calls

__all__ = ["fit_forward_placement"]


def fit_forward_placement(dumps: Sequence[dict], grid: LaunchGrid, heads: int, pair_factor: float = FORWARD_PAIRING,
                          empty: float = 0.0) -> tuple[np.ndarray, list[dict]]:
    """Fit ``time = a * makespan + b * query rows + c * keys + d * blocks + e`` (non-negative, in relative error)
    to the forward calls of ``dumps`` (``bench_emulated.py --dump-calls`` files, loaded), the makespan from
    :func:`~hf_longctx.kernels.launch.paired_makespan` on ``grid.slots`` SMs: (the five coefficients, per dump its
    ``calls``, the relative error's standard deviation and largest size per call, ``call_std`` and ``call_max``,
    and per server, ``server_std``)."""
    per_dump = []
    for dump in dumps:
        calls = [(call, ms) for call, ms in dumped_calls(dump) if call["phase"] == "forward"]
        rows = []
        for call, _ in calls:
            q, k = call["q_lens"], call["k_lens"]
            per_head = forward_block_steps(q, k, grid, 1, call.get("causal", True))
            rows.append([paired_makespan(per_head, grid.slots, pair_factor, empty, repeats=heads), sum(q), sum(k),
                         len(per_head) * heads, 1.0])
        per_dump.append(([call["rank"] for call, _ in calls], np.array(rows), np.array([ms for _, ms in calls])))
    x = np.vstack([f for _, f, _ in per_dump])
    y = np.concatenate([t for _, _, t in per_dump])
    coef, _ = fit_relative(x, y)
    stats = []
    for ranks, features, seconds in per_dump:
        predicted = features @ coef
        err = seconds / predicted - 1.0
        servers: dict[int, list[float]] = {}
        for rank, p, t in zip(ranks, predicted, seconds):
            servers.setdefault(rank, [0.0, 0.0])
            servers[rank][0] += t
            servers[rank][1] += p
        ratio = np.array([t / p for t, p in servers.values()])
        stats.append({"calls": len(ranks), "call_std": float(err.std()), "call_max": float(np.abs(err).max()),
                      "server_std": float(ratio.std())})
    return coef, stats
