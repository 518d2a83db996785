"""Shared test utilities: random packed problems and the naive fp64 attention they are checked against."""

from __future__ import annotations

import math
import random

import torch

from hf_longctx.backends import ScheduleBackend, registered_backends


def random_doc_lens(rng: random.Random, total: int, max_len: int | None = None) -> list[int]:
    """Random document lengths summing to ``total``; includes length-1 documents often."""
    lens, left = [], total
    while left:
        n = rng.choice([1, rng.randint(1, 8), rng.randint(1, max_len or total)])
        n = min(n, left)
        lens.append(n)
        left -= n
    return lens


def naive_attention(q, k, v, cu_q, cu_k, causal=True, scale=None, window=None):
    """Dense fp64 attention per segment with explicit masks: out (Tq, Hq, D), lse (Hq, Tq).

    Query i of a segment (Sq queries, Sk keys, o = Sk - Sq) sees key j iff j <= i + o (causal) and
    j > i + o - window (window).
    """
    q, k, v = q.double(), k.double(), v.double()
    tq, hq, d = q.shape
    g = hq // k.shape[1]
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    out = torch.zeros_like(q)
    lse = torch.full((hq, tq), float("-inf"), dtype=torch.float64)
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        if q1 == q0 or k1 == k0:
            continue
        s = torch.einsum("qhd,khd->hqk", q[q0:q1], k[k0:k1]) * scale
        sq, sk = q1 - q0, k1 - k0
        diag = torch.arange(sq)[:, None] + (sk - sq)  # the key on each query's diagonal
        keys = torch.arange(sk)[None, :]
        mask = torch.ones(sq, sk, dtype=torch.bool)
        if causal:
            mask &= keys <= diag
        if window is not None:
            mask &= keys > diag - window
        s = s.masked_fill(~mask, float("-inf"))
        row_lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - torch.where(torch.isfinite(row_lse), row_lse, torch.zeros_like(row_lse))[..., None])
        p = torch.where(torch.isfinite(row_lse)[..., None], p, torch.zeros_like(p))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", p, v[k0:k1])
        lse[:, q0:q1] = row_lse
    return out, lse


def cumulative(lens: list[int]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def matrix_backends() -> list[str]:
    """Registered backends that run a sequence-parallel group themselves (not ``local``, not ``auto``).

    Read from the registry when called, so a backend another package registers is tested like ours. The
    Ulysses x outer compositions need a mesh size and have tests of their own (tests/test_ulysses_mesh.py).
    """
    from hf_longctx.backends.ulysses_mesh import UlyssesMeshBackend

    return [b.name for b in registered_backends()
            if b.sequence_parallel and not b.chooses_backend and not isinstance(b, UlyssesMeshBackend)]


def schedule_backends() -> list[str]:
    """Backends of :func:`matrix_backends` that the engine runs from a schedule."""
    return [b.name for b in registered_backends()
            if b.name in matrix_backends() and isinstance(b, ScheduleBackend)]


def row_parts_problem(seed: int, dtype: torch.dtype, device: str | torch.device, heads: int = 6, dim: int = 40):
    """A merge of rows from strided parts (:class:`~hf_longctx.kernels.merge.RowParts`), with what it must give.

    Returns (out, lse, parts, part_out, part_lse, expected): ``out``/``lse`` a running result of 40 rows (those no
    block touches keep theirs), parts laid out as a key split lays its chunks, parts and rows that saw no key; and
    ``expected[include_self]`` = (out, lse) by folding each row's parts pairwise with ``merge_partials`` in fp64."""
    from hf_longctx.kernels import merge_partials
    from hf_longctx.kernels.merge import RowParts

    g = torch.Generator().manual_seed(seed)
    rows = 40
    blocks = [(0, 5, 0, 3), (9, 2, 15, 1), (12, 7, 17, 4), (30, 3, 45, 2)]  # (first row, rows, first part, parts)
    total = blocks[-1][2] + blocks[-1][1] * blocks[-1][3]
    out = torch.randn(rows, heads, dim, generator=g, dtype=torch.float64)
    lse = torch.randn(heads, rows, generator=g, dtype=torch.float64)
    part_out = torch.randn(total, heads, dim, generator=g, dtype=torch.float64)
    part_lse = torch.randn(heads, total, generator=g, dtype=torch.float64) * 3
    part_lse[1, 17 + 2] = float("-inf")  # a part that saw no key of one head of row 14
    part_lse[:, [17 + 6 + 7 * j for j in range(4)]] = float("-inf")  # row 18 sees no key in any part...
    lse[2, 18] = float("-inf")  # ...and one head of it none of its own either
    lse[:, 31] = float("-inf")  # row 31 only through its parts
    out, lse, part_out, part_lse = (t.to(dtype) for t in (out, lse, part_out, part_lse))
    expected = {}
    for include_self in (True, False):
        want_out, want_lse = out.double().clone(), lse.double().clone()
        for a, n, first, count in blocks:
            for r in range(n):
                o = want_out[a + r] if include_self else torch.zeros(heads, dim, dtype=torch.float64)
                s = want_lse[:, a + r] if include_self else torch.full((heads,), float("-inf"), dtype=torch.float64)
                for j in range(count):
                    p = first + j * n + r
                    o, s = merge_partials(o[None], s[:, None], part_out[p].double()[None],
                                          part_lse[:, p].double()[:, None])
                    o, s = o[0], s[:, 0]
                want_out[a + r], want_lse[:, a + r] = o, s
        expected[include_self] = (want_out, want_lse)
    dev = torch.device(device)
    return (out.to(dev), lse.to(dev), RowParts.of_blocks(blocks), part_out.to(dev), part_lse.to(dev), expected)
