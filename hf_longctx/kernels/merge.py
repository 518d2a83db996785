"""Merging partial attention results computed over disjoint key sets.

Every distributed backend splits the keys of a query row over several kernel calls (ring steps,
helper ranks, TASP cycles, CAD servers). The partial outputs combine exactly through their
log-sum-exp: lse = logaddexp(lse_a, lse_b), out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b.
The merge runs in at least float32 so long rings do not drift from the single-device result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..optional_triton import TRITON_DTYPES, switched_on, triton_module
from .contract import host_to_device


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every lower precision accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def merge_partials(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial results over disjoint key sets into the result over their union.

    out_*: (T, H, D); lse_*: (H, T). Rows that saw no key on either side (lse -inf) stay out 0 and
    lse -inf. The returned lse is in the accumulation dtype, out in ``out_dtype`` (default: out_a's).
    """
    acc = accumulation_dtype(out_a.dtype)
    lse_a = lse_a.to(acc)
    lse_b = lse_b.to(acc)
    lse = torch.logaddexp(lse_a, lse_b)
    finite = torch.isfinite(lse)
    safe = torch.where(finite, lse, torch.zeros_like(lse))
    w_a = torch.where(finite, torch.exp(lse_a - safe), torch.zeros_like(lse)).transpose(0, 1).unsqueeze(-1)
    w_b = torch.where(finite, torch.exp(lse_b - safe), torch.zeros_like(lse)).transpose(0, 1).unsqueeze(-1)
    out = w_a * out_a.to(acc) + w_b * out_b.to(acc)
    return out.to(out_dtype or out_a.dtype), lse


class PartialAccumulator:
    """Running (out, lse) of a block of query rows, merged in the accumulation dtype.

    Backends create one per local query tensor, call :meth:`add` with the partial result of every
    (query rows, key block) piece, and read :meth:`result` at the end.
    """

    def __init__(self, num_tokens: int, num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.dtype = dtype
        acc = accumulation_dtype(dtype)
        # not yet initialized: a first result over every row is copied in (most ranks' first, their own keys'),
        # which spares filling the accumulator and merging into it; anything else fills it first
        self.out = torch.empty(num_tokens, num_heads, head_dim, dtype=acc, device=device)
        self.lse = torch.empty((num_heads, num_tokens), dtype=acc, device=device)
        self._empty = True

    def _fill(self) -> None:
        if self._empty:
            self.out.zero_()
            self.lse.fill_(float("-inf"))
            self._empty = False

    def add(self, start: int, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Merge the partial result of rows [start, start + len(out)) into the running result: on CUDA one Triton
        kernel (:func:`merge_implementation`; a dozen elementwise passes in torch), elsewhere :func:`merge_partials`.
        The first result, when it covers every row, is copied in (a row that saw no key holds out 0, lse -inf, as
        every kernel gives it)."""
        if out.shape[0] == 0:
            return
        if self._empty and start == 0 and out.shape[0] == self.out.shape[0]:
            self.out.copy_(out)
            self.lse.copy_(lse)
            self._empty = False
            return
        self._fill()
        if triton_merges(self.out, self.lse, out, lse):
            _triton_merge().merge_block(self.out, self.lse, start, out, lse)
            return
        end = start + out.shape[0]
        merged_out, merged_lse = merge_partials(
            self.out[start:end], self.lse[:, start:end], out, lse, out_dtype=self.out.dtype
        )
        self.out[start:end] = merged_out
        self.lse[:, start:end] = merged_lse

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Final (out in the input dtype, lse in the accumulation dtype)."""
        self._fill()
        return self.out.to(self.dtype), self.lse


def merge_rows_(
    out: torch.Tensor,
    lse_rows: torch.Tensor,
    rows: torch.Tensor,
    inverse: torch.Tensor,
    part_out: torch.Tensor,
    part_lse_rows: torch.Tensor,
) -> None:
    """Merge partial results into rows of a running result, in place; several parts may land on one row.

    ``out``: (T, H, D) and ``lse_rows``: (T, H), the running result (rows that have none yet hold lse -inf).
    Part ``i`` (``part_out[i]``: (H, D), ``part_lse_rows[i]``: (H,)) belongs to row ``rows[inverse[i]]``;
    ``rows`` are the distinct rows touched, so only they are read and written. All parts of a row are
    combined at once through their log-sum-exp (a shared maximum keeps the exponentials in range), in the
    accumulation dtype; ``out`` keeps its dtype (keep it in the accumulation dtype while parts arrive).
    """
    acc = accumulation_dtype(out.dtype)
    sub_out = out.index_select(0, rows).to(acc)
    sub_lse = lse_rows.index_select(0, rows).to(acc)
    part_lse = part_lse_rows.to(acc)
    peak = sub_lse.scatter_reduce(0, inverse.unsqueeze(-1).expand_as(part_lse), part_lse, "amax", include_self=True)
    safe = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    w_old = torch.exp(sub_lse - safe)
    w_new = torch.exp(part_lse - safe.index_select(0, inverse))
    total = w_old.index_add(0, inverse, w_new)
    numer = (sub_out * w_old.unsqueeze(-1)).index_add_(0, inverse, part_out.to(acc) * w_new.unsqueeze(-1))
    seen = total > 0
    denom = torch.where(seen, total, torch.ones_like(total))
    merged = torch.where(seen.unsqueeze(-1), numer / denom.unsqueeze(-1), torch.zeros_like(numer))
    merged_lse = torch.where(seen, safe + torch.log(denom), torch.full_like(safe, float("-inf")))
    out.index_copy_(0, rows, merged.to(out.dtype))
    lse_rows.index_copy_(0, rows, merged_lse.to(lse_rows.dtype))


def _within(counts: torch.Tensor) -> torch.Tensor:
    """Each item's position inside its group, for groups of ``counts`` items laid one after another."""
    return torch.arange(int(counts.sum())) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)


@dataclass(frozen=True)
class RowParts:
    """Where the parts of merged rows lie: result row ``rows[m]`` merges parts ``first[m] + j * stride[m]`` for
    ``j < count[m]``. ``table`` holds the four as rows of one (4, M) int64 CPU tensor: planned on the host, where
    the split is decided, it reaches the device in one copy."""

    table: torch.Tensor

    rows = property(lambda self: self.table[0])
    first = property(lambda self: self.table[1])
    stride = property(lambda self: self.table[2])
    count = property(lambda self: self.table[3])

    @classmethod
    def of_blocks(cls, blocks: list[tuple[int, int, int, int]]) -> RowParts:
        """Rows ``[a, a + n)`` each merging ``count`` parts laid out one block of ``n`` rows after another from
        part ``first``: ``blocks`` of (a, n, first, count), the layout of a key split's chunks."""
        per_block = torch.tensor([b for b in blocks if b[1] > 0], dtype=torch.int64).reshape(-1, 4)
        per_row = torch.repeat_interleave(per_block, per_block[:, 1], dim=0).t().contiguous()
        offset = _within(per_block[:, 1])
        per_row[0] += offset  # each row its own
        per_row[2] += offset  # and its first part
        return cls(per_row[[0, 2, 1, 3]])  # (a, n, first, count) -> (rows, first, stride, count)

    def owners(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(part indices, the index in :attr:`rows` of the row each part belongs to), one entry per part."""
        owner = torch.repeat_interleave(torch.arange(len(self.count)), self.count)
        return self.first[owner] + _within(self.count) * self.stride[owner], owner


def _triton_merge():
    return triton_module("hf_longctx.kernels.triton_merge")


def merge_implementation(device: torch.device | str, dtype: torch.dtype) -> str:
    """Which merge :func:`merge_row_parts_` runs for tensors of ``dtype`` on ``device``: "triton" (CUDA, bf16, fp16
    or fp32, Triton importable, ``HF_LONGCTX_MERGE_TRITON`` not 0) or "torch". A cost model fitted with one prices
    cut forwards wrongly under the other."""
    if (torch.device(device).type == "cuda" and dtype in TRITON_DTYPES and switched_on("HF_LONGCTX_MERGE_TRITON")
            and _triton_merge() is not None):
        return "triton"
    return "torch"


def triton_merges(*tensors: torch.Tensor) -> bool:
    """Whether :func:`merge_row_parts_` runs as one Triton kernel on these tensors (:func:`merge_implementation`,
    and unit stride along the head dimension)."""
    return (all(merge_implementation(t.device, t.dtype) == "triton" for t in tensors)
            and all(t.stride(-1) == 1 for t in tensors if t.dim() == 3))


def merge_row_parts_(out: torch.Tensor, lse: torch.Tensor, parts: RowParts, part_out: torch.Tensor,
                     part_lse: torch.Tensor, include_self: bool) -> None:
    """Merge each row of ``parts`` from its partial results, in place, in the accumulation dtype.

    ``out`` (T, H, D), ``lse`` (H, T); ``part_out`` (P, H, D), ``part_lse`` (H, P). With ``include_self`` a row's
    own (out, lse) is one more part (a causal call's diagonal block), else it is overwritten. A row that saw no
    key anywhere gets out 0, lse -inf. Why one call: merging segment by segment costs a dozen small kernels per
    segment; on CUDA this is one Triton kernel whatever the rows and parts, elsewhere one pass of index ops
    (:func:`merge_rows_`)."""
    if len(parts.rows) == 0:
        return
    if triton_merges(out, lse, part_out, part_lse):
        table = host_to_device(parts.table, out.device)
        _triton_merge().merge_row_parts(out, lse, table, part_out, part_lse, include_self)
        return
    rows = parts.rows.to(out.device)
    if not include_self:
        out.index_fill_(0, rows, 0.0)
        lse.index_fill_(1, rows, float("-inf"))
    index, owner = (t.to(out.device) for t in parts.owners())
    merge_rows_(out, lse.t(), rows, owner, part_out.index_select(0, index), part_lse.t().index_select(0, index))
