"""The pair layout and the row steps of the expert path, against plain per-pair loops (CPU, float64).

A layout lists the (token, slot) pairs of a rank's experts in expert order and maps every
(token, slot) back to its pair; ``pair_sum`` adds each token's pair rows slot by slot and
``pair_grads`` is its backward. The GPU runs Triton kernels for the same functions
(tests/gpu/test_moe_gpu.py checks them against these torch versions).
"""

from __future__ import annotations

import pytest
import torch

from hf_longctx.moe.routing import pair_layout
from hf_longctx.moe.row_ops import pair_grads, pair_sum


def routing(tokens: int, top_k: int, experts: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])


@pytest.mark.parametrize("start,local", [(0, 9), (3, 4), (8, 1)])
def test_layout_lists_local_pairs_in_expert_order_and_maps_back(start, local):
    ids = routing(tokens=25, top_k=3, experts=9, seed=local)
    layout = pair_layout(ids, start, local, all_local=local == 9)
    expected = [(t, j) for e in range(start, start + local) for t in range(25) for j in range(3) if ids[t, j] == e]
    assert list(zip(layout.token_index.tolist(), layout.slot_index.tolist())) == expected
    assert layout.expert_counts.tolist() == [int((ids == e).sum()) for e in range(start, start + local)]
    for t in range(25):
        for j in range(3):
            p = int(layout.pair_table[t, j])
            if start <= ids[t, j] < start + local:
                assert (int(layout.token_index[p]), int(layout.slot_index[p])) == (t, j)
            else:
                assert p == -1


def test_layout_drops_padding_ids_and_refuses_an_out_of_range_promise():
    ids = torch.tensor([[0, 2], [-1, -1], [1, 3]])
    layout = pair_layout(ids, 0, 4)
    assert layout.num_pairs == 4 and layout.pair_table[1].tolist() == [-1, -1]
    with pytest.raises(RuntimeError, match="outside"):
        pair_layout(ids, 0, 4, all_local=True)  # a -1 cannot hide behind the all-local shortcut


def naive_pair_sum(rows, layout, weights):
    out = torch.zeros(layout.num_tokens, rows.shape[1], dtype=rows.dtype)
    for p, t in enumerate(layout.token_index.tolist()):
        out[t] += rows[p] * (1.0 if weights is None else weights[p])
    return out


@pytest.mark.parametrize("weighted", [True, False])
def test_pair_sum_and_its_gradients_equal_per_pair_loops(weighted):
    ids = routing(tokens=30, top_k=4, experts=10, seed=2)
    layout = pair_layout(ids, 2, 5)
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(layout.num_pairs, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(layout.num_pairs, generator=gen, dtype=torch.float64, requires_grad=True)
    got = pair_sum(rows.detach(), layout.pair_table, weights.detach() if weighted else None)
    want = naive_pair_sum(rows, layout, weights if weighted else None)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if weighted:
        probe = torch.randn(30, 7, generator=gen, dtype=torch.float64)
        (want * probe).sum().backward()
        grad_rows, grad_weights = pair_grads(probe, layout.token_index, weights.detach(), rows.detach())
        torch.testing.assert_close(grad_rows, rows.grad, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad_weights, weights.grad, rtol=1e-12, atol=1e-12)


def test_pair_sum_rounds_once_and_writes_into_a_wider_buffer():
    layout = pair_layout(torch.tensor([[0, 1], [1, 0]]), 0, 2, all_local=True)
    rows = torch.tensor([[1.0], [2.0 ** -9], [2.0 ** -9], [1.0]], dtype=torch.bfloat16)
    # bf16 addition would round 1 + 2^-9 back to 1 at every step; the float32 sum keeps it
    assert pair_sum(rows, layout.pair_table).dtype == torch.float32
    torch.testing.assert_close(pair_sum(rows, layout.pair_table).squeeze(1), torch.tensor([1.0 + 2 ** -9] * 2))
    full = torch.full((2, 3), 5.0)
    pair_sum(rows, layout.pair_table, out=full[:, :1])
    assert full[:, 1:].eq(5.0).all() and full[:, 0].tolist() == [1.0 + 2 ** -9] * 2
