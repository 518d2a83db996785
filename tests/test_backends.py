"""Every sequence-parallel backend equals single-device attention, outputs and gradients.

Each rank builds the same random packed batch, runs the reference kernel over the whole sequence,
runs the backend on its shard, and checks its own output rows and its own q/k/v gradient rows.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from hf_longctx.backends import default_strategy, get_backend, sequence_parallel_attention
from hf_longctx.kernels import attention_backward, attention_forward
from hf_longctx.layout import PackedBatch, shard_plan

from distributed import run_distributed
from helpers import matrix_backends, random_doc_lens, schedule_backends

PLACEMENTS = ("contiguous", "zigzag", "doc_zigzag")


def make_problem(seed: int, world: int, dtype: torch.dtype, hkv=2, d=16):
    hq = math.lcm(4, world)  # query heads split over the ranks (Ulysses), GQA ratio hq / 2
    rng = random.Random(seed)
    shard = rng.randint(8, 40)
    total = shard * world + rng.randint(0, world - 1)  # token counts that do not divide
    lens = random_doc_lens(rng, total, max_len=3 * shard)
    if seed % 3 == 0:  # one document longer than the whole shard of a rank
        first = shard + 7
        lens = [first] + random_doc_lens(rng, total - first, 3 * shard) if total > first else [total]
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(total, h, d, generator=g, dtype=torch.float64).to(dtype)
                     for h in (hq, hkv, hkv, hq))
    return PackedBatch.from_doc_lens(lens), q, k, v, dout


def reference(batch, q, k, v, dout, window=None):
    cu = batch.cu_seqlens.tolist()
    out, lse = attention_forward(q, k, v, cu, cu, batch.max_seqlen, batch.max_seqlen, kernel="reference",
                                 window=window)
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, cu, cu, 0, 0, kernel="reference", window=window)
    return out, dq, dk, dv


def check_backends(rank, world, backends, dtypes, seeds, strategies=None):
    for dtype in dtypes:
        tol = dict(rtol=1e-9, atol=1e-9) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)
        for seed in seeds:
            batch, q, k, v, dout = make_problem(seed * 31 + world, world, dtype)
            ref_out, ref_dq, ref_dk, ref_dv = reference(batch, q, k, v, dout)
            for backend in backends:
                for strategy in (strategies or [default_strategy(backend)]):
                    plan = shard_plan(batch, world, strategy)
                    idx = plan.local_indices(rank)
                    ql, kl, vl = (t[idx].clone().requires_grad_() for t in (q, k, v))
                    out = sequence_parallel_attention(ql, kl, vl, plan=plan, backend=backend)
                    out.backward(dout[idx])
                    where = f"{backend}/{strategy} world={world} rank={rank} seed={seed} {dtype} docs={batch.doc_lens}"
                    for name, got, want in (("out", out, ref_out), ("dq", ql.grad, ref_dq), ("dk", kl.grad, ref_dk),
                                            ("dv", vl.grad, ref_dv)):
                        torch.testing.assert_close(got, want[idx], **tol, msg=lambda m, n=name, w=where: f"{n} {w} {m}")


def check_backends_with_and_without_window(rank, world, backends):
    check_backends(rank, world, backends, [torch.float64, torch.float32], range(3))
    seeds, windows = WINDOW_CASES[world]
    check_windowed_backends(rank, world, backends + {1: ["local"], 2: ["auto"]}.get(world, []), seeds, windows)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_backends_match_single_device_fp64_and_fp32(world):
    """Every registered backend (:func:`~helpers.matrix_backends`): plain causal attention, then sliding
    windows (:func:`check_windowed_backends`) on the same ranks."""
    run_distributed(world, check_backends_with_and_without_window, matrix_backends())


def test_tasp_on_six_ranks_where_no_hamiltonian_decomposition_exists():
    """K_6* has no decomposition into 5 Hamiltonian cycles: TASP runs on 4 and stays exact."""
    run_distributed(6, check_backends, ["tasp"], [torch.float64], range(2), ["zigzag", "contiguous"])


def every_placement_backends() -> list[str]:
    """Backends of the matrix that are exact on every placement (not distfa, not cad)."""
    return [b for b in matrix_backends() if set(PLACEMENTS) <= set(get_backend(b).strategies)]


@pytest.mark.parametrize("world", [2, 3])
def test_ring_backends_on_every_placement(world):
    run_distributed(world, check_backends, every_placement_backends(), [torch.float64], range(2), list(PLACEMENTS))


def count_traffic(rank, world, doc_lens, expect_cross, backends):
    from hf_longctx.comm import comm_stats, reset_comm_stats
    from hf_longctx.kernels import reset_stats, stats

    batch = PackedBatch.from_doc_lens(doc_lens)
    q = torch.randn(batch.num_tokens, 2, 8, dtype=torch.float64)
    for backend in backends:  # Ulysses always trades heads: skipping applies to ring-style schedules
        plan = shard_plan(batch, world, "contiguous")
        idx = plan.local_indices(rank)
        ql, kl, vl = (q[idx].clone().requires_grad_() for _ in range(3))
        reset_comm_stats()
        reset_stats()
        sequence_parallel_attention(ql, kl, vl, plan=plan, backend=backend).sum().backward()
        traffic, calls = comm_stats(), stats()
        if not expect_cross:
            # only the local block: one forward and one backward kernel call, nothing on the wire
            assert traffic.get("sent_bytes", 0) == 0 and traffic.get("recv_bytes", 0) == 0, (backend, traffic)
            assert calls["forward"] == 1 and calls["backward"] == 1, (backend, calls)
        else:
            assert traffic["sent_bytes"] + traffic["recv_bytes"] > 0, (backend, traffic)


@pytest.mark.parametrize("world", [3, 4])
def test_documents_inside_shards_cost_no_communication(world):
    backends = schedule_backends()
    run_distributed(world, count_traffic, [5, 9, 2] * world, False, backends)  # every shard holds [5, 9, 2]
    run_distributed(world, count_traffic, [16 * world], True, backends)


def count_tasp_rows(rank, world):
    import torch.distributed as dist

    from hf_longctx.backends.tasp import cycles_for
    from hf_longctx.comm import comm_stats, reset_comm_stats

    # three shards of 16 rows; only document 1 crosses a boundary: rank 1 needs key rows 10..15 of rank 0
    batch = PackedBatch.from_doc_lens([10, 10, 12, 16])
    plan = shard_plan(batch, world, "contiguous")
    q = torch.randn(batch.num_tokens, 2, 8, dtype=torch.float64)
    idx = plan.local_indices(rank)
    reset_comm_stats()
    sequence_parallel_attention(q[idx], q[idx], q[idx], plan=plan, backend="tasp")
    sent = torch.tensor([comm_stats().get("sent_bytes", 0)], dtype=torch.float64)
    dist.all_reduce(sent)
    # rank 0's rows 8..15 form the sub-block of cycle 1; it travels until it reaches rank 1
    cycle = cycles_for(3)[1]
    hops = (cycle.index(1) - cycle.index(0)) % 3
    row_bytes = 2 * 8 * 8
    assert sent.item() == hops * 6 * 2 * row_bytes, (sent.item(), hops)


def test_tasp_sends_only_the_rows_later_ranks_read():
    run_distributed(3, count_tasp_rows)


def raise_on_one_rank(rank, world, result_dir):
    import os
    import time

    import hf_longctx.backends.engine as engine

    batch = PackedBatch.from_doc_lens([12 * world])
    plan = shard_plan(batch, world, "contiguous")
    q = torch.randn(batch.num_tokens, 2, 8, dtype=torch.float64)
    idx = plan.local_indices(rank)
    if rank == 0:  # fails in its second kernel call: the helper block rank 2 waits for
        calls = []
        real = engine.kernel_forward

        def broken(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("simulated kernel failure")
            return real(*args, **kwargs)
        engine.kernel_forward = broken
    start = time.monotonic()
    try:
        sequence_parallel_attention(q[idx], q[idx], q[idx], plan=plan, backend="distfa")
        outcome = "returned"
    except Exception as exc:  # noqa: BLE001 - the test records whatever each rank raised
        outcome = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(result_dir, f"rank{rank}"), "w") as f:
        f.write(f"{time.monotonic() - start:.1f}\n{outcome}")


def test_a_failing_rank_does_not_hang_its_peers(tmp_path):
    """Rank 0's kernel raises mid-schedule; a peer waiting for its result stops within the group timeout."""
    import torch.multiprocessing as mp

    from distributed import _worker

    world = 3
    ctx = mp.spawn(_worker, args=(world, str(tmp_path / "init"), 5.0, raise_on_one_rank, (str(tmp_path),)),
                   nprocs=world, join=False)
    deadline = 90
    import time
    start = time.monotonic()
    while not ctx.join(timeout=1):
        assert time.monotonic() - start < deadline, "ranks still blocked: a failing peer left them hanging"
    outcomes = [(tmp_path / f"rank{r}").read_text().split("\n", 1) for r in range(world)]
    assert "simulated kernel failure" in outcomes[0][1]
    # rank 2 waits for the helper result rank 0 never sends: it must fail with a message, not hang
    seconds, outcome = outcomes[2]
    assert "CommunicationError" in outcome and "peer rank" in outcome, outcome
    assert float(seconds) < 60
    assert outcomes[1][1] == "returned" or "CommunicationError" in outcomes[1][1]


def test_ulysses_rejects_heads_that_do_not_split():
    batch = PackedBatch.from_doc_lens([8])
    plan = shard_plan(batch, 1, "contiguous")
    from hf_longctx.backends.ulysses import kv_repeat

    assert kv_repeat(32, 8, 4) == 1 and kv_repeat(32, 2, 8) == 4 and kv_repeat(12, 2, 3) == 3
    with pytest.raises(ValueError, match="divisible by the sequence-parallel size"):
        kv_repeat(4, 2, 3)
    q = torch.randn(8, 4, 8)
    assert sequence_parallel_attention(q, q, q, plan=plan, backend="ulysses").shape == q.shape


# ----------------------------------------------------------------------------- sliding window


def check_windowed_backends(rank, world, backends, seeds, windows):
    """Every backend with a sliding window equals single-device windowed attention (fp64, outputs and
    gradients). ``windows`` are in shards: 0 is a window of one position (only the diagonal)."""
    for seed in seeds:
        batch, q, k, v, dout = make_problem(seed * 31 + world, world, torch.float64)
        shard = batch.num_tokens // world
        for window in (max(1, int(w * shard)) for w in windows):
            ref_out, ref_dq, ref_dk, ref_dv = reference(batch, q, k, v, dout, window)
            for backend in backends:
                spec = get_backend(backend)
                # backends that default to zig-zag placement also run its per-document variant
                per_document = spec.default_strategy == "zigzag" and not spec.chooses_backend
                strategies = [spec.default_strategy] + (["doc_zigzag"] if per_document else [])
                for strategy in strategies:
                    plan = shard_plan(batch, world, strategy)
                    idx = plan.local_indices(rank)
                    ql, kl, vl = (t[idx].clone().requires_grad_() for t in (q, k, v))
                    out = sequence_parallel_attention(ql, kl, vl, plan=plan, backend=backend, window=window)
                    out.backward(dout[idx])
                    where = (f"{backend}/{strategy} window={window} world={world} rank={rank} seed={seed} "
                             f"docs={batch.doc_lens}")
                    for name, got, want in (("out", out, ref_out), ("dq", ql.grad, ref_dq), ("dk", kl.grad, ref_dk),
                                            ("dv", vl.grad, ref_dv)):
                        torch.testing.assert_close(got, want[idx], rtol=1e-9, atol=1e-9,
                                                   msg=lambda m, n=name, w=where: f"{n} {w} {m}")


def count_windowed_work(rank, world):
    import torch.distributed as dist

    from hf_longctx.comm import comm_stats, reset_comm_stats
    from hf_longctx.kernels import reset_stats, stats

    # one document of 24 tokens, 8 per rank, sliding window 4: rank 1 reads keys 5..7 of rank 0, rank 2
    # keys 13..15 (rows 5..7 of rank 1) and nothing of rank 0, whose keys are all out of reach
    plan = shard_plan(PackedBatch.from_doc_lens([24]), world, "contiguous")
    x = torch.randn(24, 2, 8, dtype=torch.float64)[plan.local_indices(rank)]
    # ranks that disagree on the window all stop with the same error before any transfer
    with pytest.raises(ValueError, match="sliding window"):
        sequence_parallel_attention(x, x, x, plan=plan, backend="ring", window=4 if rank else 5)
    for backend in ("ring", "distfa", "tasp"):
        reset_comm_stats()
        reset_stats()
        with torch.no_grad():
            sequence_parallel_attention(x, x, x, plan=plan, backend=backend, window=4)
        # the diagonal block, plus the block of the previous rank: never the one before it
        assert stats()["forward"] == (1 if rank == 0 else 2), (backend, rank, stats())
        if backend != "tasp":  # (TASP forwards sub-blocks along its cycles)
            assert comm_stats().get("sent_bytes", 0) == (0 if rank == 2 else 3 * 2 * x[0].numel() * 8), backend
        reset_stats()
        with torch.no_grad():
            sequence_parallel_attention(x, x, x, plan=plan, backend=backend)
        calls = torch.tensor([stats()["forward"]])
        dist.all_reduce(calls)
        # without the window all 3 + 2 + 1 blocks are computed (TASP: blocks of other ranks in 2 sub-blocks)
        assert calls.item() == (9 if backend == "tasp" else 6), backend


def test_blocks_beyond_the_window_run_no_kernel_and_move_no_rows():
    run_distributed(3, count_windowed_work)


# world -> (seeds, windows in shards): seeds picked so that every world size also sees one document longer
# than a whole shard; windows of one position, and ending inside the previous shard or the one before it.
WINDOW_CASES = {
    1: ([2], [0, 0.5]),
    2: ([0, 1], [0, 0.5, 1.2]),
    3: ([0], [0, 0.3, 0.6, 1.2]),
    4: ([2], [0, 0.6]),
    5: ([1], [0.6, 1.2]),
}
