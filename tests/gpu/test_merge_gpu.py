"""A key split's merge on the GPU: one Triton kernel that gives the pairwise merge's numbers, faster than torch's.

:func:`hf_longctx.kernels.merge.merge_row_parts_` merges every cut row of a forward at once. On CUDA it is one
Triton launch; the torch version (index ops, the CPU's path, ``HF_LONGCTX_MERGE_TRITON=0``) is the reference.
"""

from __future__ import annotations

import pytest
import torch

from hf_longctx.benchmarking import timed
from hf_longctx.kernels.merge import PartialAccumulator, RowParts, merge_row_parts_, triton_merges

from helpers import row_parts_problem

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("include_self", [True, False])
def test_the_triton_merge_equals_the_pairwise_merge(dtype, include_self):
    out, lse, parts, part_out, part_lse, expected = row_parts_problem(1, dtype, "cuda", heads=32, dim=128)
    lse = lse.float()  # kernels return lse in float32 whatever the inputs
    part_lse = part_lse.float()
    assert triton_merges(out, lse, part_out, part_lse)
    merge_row_parts_(out, lse, parts, part_out, part_lse, include_self=include_self)
    want_out, want_lse = expected[include_self]
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double().cpu(), want_out, **tol)
    torch.testing.assert_close(lse.double().cpu(), want_lse, atol=1e-4, rtol=1e-5)  # merged in float32
    assert not out.isnan().any() and not lse.isnan().any()


def _strided_problem(segments: int, rows: int, parts: int, heads: int = 32, dim: int = 128):
    g = torch.Generator(device="cuda").manual_seed(0)
    total_rows = segments * rows
    out = torch.randn(total_rows, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    lse = torch.randn(heads, total_rows, device="cuda", generator=g)
    blocks = [(s * rows, rows, s * rows * parts, parts) for s in range(segments)]
    part_out = torch.randn(total_rows * parts, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    part_lse = torch.randn(heads, total_rows * parts, device="cuda", generator=g)
    return out, lse, RowParts.of_blocks(blocks), part_out, part_lse


def test_one_triton_merge_is_faster_than_torchs_index_ops(monkeypatch):
    """Four cut segments of 512 rows in 8 chunks each, 32 heads of 128 in bf16 (a CAD server's cut forward)."""
    out, lse, parts, part_out, part_lse = _strided_problem(segments=4, rows=512, parts=8)
    fused = timed(lambda: merge_row_parts_(out, lse, parts, part_out, part_lse, include_self=True), 20, warmup=3)
    monkeypatch.setenv("HF_LONGCTX_MERGE_TRITON", "0")
    assert not triton_merges(out, lse, part_out, part_lse)
    plain = timed(lambda: merge_row_parts_(out, lse, parts, part_out, part_lse, include_self=True), 20, warmup=3)
    assert fused < 0.5 * plain, (fused, plain)


def _running_merge(monkeypatch, triton: bool, dtype: torch.dtype):
    """Three partial results over overlapping row blocks of a 700-row accumulator, some rows seeing no key (lse
    -inf), the lse given as column slices of a wider tensor (as the ring's returned results are)."""
    monkeypatch.setenv("HF_LONGCTX_MERGE_TRITON", "1" if triton else "0")
    g = torch.Generator(device="cuda").manual_seed(1)
    acc = PartialAccumulator(700, 6, 80, dtype, torch.device("cuda"))
    for start, rows in ((0, 700), (100, 350), (650, 50)):
        out = torch.randn(rows, 6, 80, device="cuda", dtype=dtype, generator=g)
        wide = torch.randn(6, rows + 9, device="cuda", generator=g) * 4
        wide[:, 3:40] = float("-inf")  # rows of this part that saw no key
        lse = wide[:, 5 : 5 + rows]
        assert triton_merges(acc.out, acc.lse, out, lse) == triton
        acc.add(start, out, lse)
    empty = torch.zeros(0, 6, 80, device="cuda", dtype=dtype)
    acc.add(0, empty, torch.zeros(6, 0, device="cuda"))  # nothing to merge
    return acc.result()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_running_merge_in_one_kernel_equals_torchs(monkeypatch, dtype):
    """``PartialAccumulator.add`` (every ring step's and helper's result) as one Triton kernel gives torch's
    elementwise merge, rows that saw no key included (out 0, lse -inf)."""
    out, lse = _running_merge(monkeypatch, True, dtype)
    want_out, want_lse = _running_merge(monkeypatch, False, dtype)
    tol = dict(atol=1e-2, rtol=1e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, want_out, **tol)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    assert torch.isneginf(lse).any() and not out.isnan().any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))


def test_the_running_merge_in_one_kernel_is_faster_than_torchs(monkeypatch):
    """16K rows of 32 heads of 128 (bf16 parts) into a 64K-row accumulator: a ring step's merge at 256K tokens
    over 4 ranks."""
    acc = PartialAccumulator(65536, 32, 128, torch.bfloat16, torch.device("cuda"))
    out = torch.randn(16384, 32, 128, device="cuda", dtype=torch.bfloat16)
    lse = torch.randn(32, 16384, device="cuda")
    fused = timed(lambda: acc.add(1000, out, lse), 20, warmup=3)
    monkeypatch.setenv("HF_LONGCTX_MERGE_TRITON", "0")
    plain = timed(lambda: acc.add(1000, out, lse), 20, warmup=3)
    assert fused < 0.5 * plain, (fused, plain)
