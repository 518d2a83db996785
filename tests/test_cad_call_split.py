"""CAD servers that cut their batch into several kernel calls compute the same attention as one device.

A CAD server runs its tasks of a nano-batch as varlen segments sorted longest keys first; under the
``call_terms`` option (:class:`~hf_longctx.kernels.calls.CallTerms`) it cuts them into contiguous runs, one
kernel call each. With free calls and priced tiles every run holds segments of equal tile counts, so a
batch mixing one long document with many short ones really is cut; outputs and q/k/v gradients of every
emulated rank must still equal the fp64 reference kernel over the whole batch. :func:`server_costs`
predicts each server's kernel cost: the scheduler's loads plus what the calls add beyond their segments.
"""

from __future__ import annotations

import pytest
import torch

from hf_longctx.backends.cad.cost_model import FlopsCostModel, ProfiledCostModel, WindowedCostModel
from hf_longctx.backends.cad.runtime import (
    cad_schedule,
    call_terms_for,
    cost_model_for,
    nano_batches,
    prepare,
    server_costs,
)
from hf_longctx.kernels import attention_backward, attention_forward, reset_stats, stats
from hf_longctx.kernels.calls import CallTerms, calls_overhead
from hf_longctx.kernels.key_split import KeySplit
from hf_longctx.lab.emulation import emulate_step
from hf_longctx.layout import PackedBatch, shard_plan

DOC_LENS = [700, 40, 33, 90, 12, 64, 300, 25]  # one long document among short ones
CUT_EVERYWHERE = CallTerms(call=0.0, q_tile=1.0, k_tile=1.0, tile=16)  # calls free, every surplus tile priced
OPTIONS = {"call_terms": CUT_EVERYWHERE, "eps": 0.0, "min_shard": 16}
KEYS_LIMIT = 400  # keys one call may hold (a kernel that slows down past them); calls free, tiles unpriced
UNDER_A_KEYS_LIMIT = {"call_terms": CallTerms(max_keys=KEYS_LIMIT), "eps": 0.0, "min_shard": 16}
# forward calls of few long blocks run as chunks of their keys, on a device of 64 SMs (tiny tiles and chunks)
KEY_SPLIT = KeySplit(sms=64, tile=(16, 8), min_keys=16, min_shared=64)
SPLIT_FORWARDS = {"call_terms": CallTerms(key_split=KEY_SPLIT), "eps": 0.0, "min_shard": 16}
CPU = torch.device("cpu")
TOL = dict(rtol=1e-9, atol=1e-9)


def make_tensors(batch: PackedBatch, seed: int = 0, hq: int = 4, hkv: int = 2, d: int = 16):
    """Global packed fp64 (q, k, v, dout) of ``batch`` with grouped-query heads."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch.num_tokens, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq))


def single_device(batch: PackedBatch, q, k, v, dout):
    """(out, dq, dk, dv) of one reference kernel call over the whole batch, one segment per document."""
    cu = batch.cu_seqlens.tolist()
    out, lse = attention_forward(q, k, v, cu, cu, batch.max_seqlen, batch.max_seqlen, kernel="reference")
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, cu, cu, batch.max_seqlen, batch.max_seqlen,
                                    kernel="reference")
    return out, dq, dk, dv


def server_batches(plan, options):
    """Every rank's nano-batches as the runtime builds them on the CPU under ``options``."""
    tasks = prepare(plan, options).tasks
    terms = call_terms_for(options, cost_model_for(plan, options))
    return [nano_batches(plan, tasks, r, options.get("pingpong", True), CPU, terms) for r in range(plan.world_size)]


def segment_lens(nb):
    return [b - a for a, b in zip(nb.cu_q, nb.cu_q[1:])], [b - a for a, b in zip(nb.cu_k, nb.cu_k[1:])]


def assert_ranks_equal_one_device(step, plan, want):
    """Every emulated rank's out, dq, dk, dv equal one device's (``want``: :func:`single_device`) over its rows."""
    assert len(step.ranks) == plan.world_size
    for r in step.ranks:
        idx = plan.local_indices(r.rank)
        for name, got, ref in zip(("out", "dq", "dk", "dv"), r.results, want):
            torch.testing.assert_close(got, ref[idx], **TOL,
                                       msg=lambda m, w=f"W={plan.world_size} rank {r.rank} {name}": f"{w}: {m}")


def assert_every_rank_is_one_device(step, plan, want, batches):
    """:func:`assert_ranks_equal_one_device`, with one forward and one backward kernel call per run of every
    nano-batch that has tasks (``batches``: :func:`server_batches`)."""
    assert_ranks_equal_one_device(step, plan, want)
    for r in step.ranks:
        assert r.kernel_calls == 2 * sum(len(nb.calls) for nb in batches[r.rank] if nb.tasks), r.rank


@pytest.mark.parametrize("world,options", [(3, OPTIONS), (4, OPTIONS), (3, UNDER_A_KEYS_LIMIT)])
def test_cad_with_batches_cut_into_calls_matches_one_device(world, options):
    batch = PackedBatch.from_doc_lens(DOC_LENS)
    q, k, v, dout = make_tensors(batch, seed=world)
    want = single_device(batch, q, k, v, dout)
    plan = shard_plan(batch, world, "cad")

    batches = server_batches(plan, options)
    assert any(len(nb.calls) > 1 for nbs in batches for nb in nbs), "no server cut its batch: the test tests nothing"

    step = emulate_step(batch, world, (q, k, v, dout), "cad", options=options, kernel="reference",
                        keep_results=True)
    assert_every_rank_is_one_device(step, plan, want, batches)


@pytest.mark.parametrize("world", [3, 5])
def test_cad_with_forwards_cut_into_chunks_of_their_keys_matches_one_device(world):
    """A server whose forward call launches few long blocks runs it as chunks of its keys merged by log-sum-exp
    (:mod:`hf_longctx.kernels.key_split`), and its backward on the merged results: still one device's numbers, and
    still one observed forward per call."""
    batch = PackedBatch.from_doc_lens(DOC_LENS)
    q, k, v, dout = make_tensors(batch, seed=world)
    want = single_device(batch, q, k, v, dout)
    plan = shard_plan(batch, world, "cad")
    reset_stats()
    step = emulate_step(batch, world, (q, k, v, dout), "cad", options=SPLIT_FORWARDS, kernel="reference",
                        keep_results=True)
    assert stats().get("forward.key_split", 0) > 0, "no forward was cut: the test tests nothing"
    assert_every_rank_is_one_device(step, plan, want, server_batches(plan, SPLIT_FORWARDS))


@pytest.mark.parametrize("world", [3, 4])
def test_free_calls_leave_every_run_without_surplus_tiles(world):
    plan = shard_plan(PackedBatch.from_doc_lens(DOC_LENS), world, "cad")
    tile = CUT_EVERYWHERE.tile
    for nbs in server_batches(plan, OPTIONS):
        for nb in nbs:
            q_lens, k_lens = segment_lens(nb)
            assert [s for run in nb.calls for s in range(*run)] == list(range(len(q_lens)))
            assert k_lens == sorted(k_lens, reverse=True)  # longest keys first
            for a, b in nb.calls:
                assert len({(-(-nq // tile), -(-nk // tile)) for nq, nk in zip(q_lens[a:b], k_lens[a:b])}) == 1


@pytest.mark.parametrize("world", [2, 3])
def test_a_server_keeps_each_call_under_the_kernels_keys_limit(world):
    """Under a keys limit a server cuts its batch into as few calls as keep each under it (calls are free here);
    only a segment longer than the limit is a call of its own over it."""
    plan = shard_plan(PackedBatch.from_doc_lens(DOC_LENS), world, "cad")
    cut = 0
    for nbs in server_batches(plan, UNDER_A_KEYS_LIMIT):
        for nb in nbs:
            q_lens, k_lens = segment_lens(nb)
            for a, b in nb.calls:
                assert b - a == 1 or sum(k_lens[a:b]) <= KEYS_LIMIT, (k_lens, nb.calls)
            if sum(k_lens) <= KEYS_LIMIT:
                assert len(nb.calls) <= 1, (k_lens, nb.calls)
            cut += len(nb.calls) > 1
    assert cut, "no batch passed the limit: the test tests nothing"


def test_a_cpu_server_runs_one_call_per_batch_by_default():
    plan = shard_plan(PackedBatch.from_doc_lens(DOC_LENS), 3, "cad")
    for options in ({"eps": 0.0, "min_shard": 16}, {**OPTIONS, "call_terms": None},
                    {**OPTIONS, "call_terms": "none"}):
        for nbs in server_batches(plan, options):
            for nb in nbs:
                assert nb.calls == ([(0, len(nb.tasks))] if nb.tasks else []), options


def test_call_terms_come_from_the_option_then_the_profile():
    model = FlopsCostModel()
    assert call_terms_for({"call_terms": CUT_EVERYWHERE}, model) is CUT_EVERYWHERE
    assert call_terms_for({"call_terms": None}, model) is None
    assert call_terms_for({"call_terms": "none"}, model) is None
    # without a profile's measured terms nothing is guessed: one call
    assert call_terms_for({}, model) is None
    profiled = ProfiledCostModel.from_grid([128, 1024], [128, 1024], [[0.01, 0.05], [0.05, 0.2]], tile=128,
                                           call_cost=0.25, k_tile_cost=2e-4)
    assert call_terms_for({}, profiled) == profiled.call_terms
    assert call_terms_for({}, WindowedCostModel(profiled, 64)) == profiled.call_terms
    with pytest.raises(ValueError, match="call_terms"):
        call_terms_for({"call_terms": "fast"}, model)


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("pingpong", [True, False])
def test_server_costs_are_the_schedule_loads_plus_what_calls_add(world, pingpong):
    plan = shard_plan(PackedBatch.from_doc_lens(DOC_LENS), world, "cad")
    base = {"eps": 0.0, "min_shard": 16, "pingpong": pingpong}
    plain = server_costs(plan, {**base, "call_terms": None})
    assert plain.shape == (world,) and (plain >= 0).all()
    # FLOPs add up over row cuts: without call terms, ping-pong's halves cost what the scheduler balanced
    assert plain == pytest.approx(cad_schedule(plan, base).loads, rel=1e-9)
    # free calls cut where surplus tiles would cost: nothing added
    assert server_costs(plan, {**base, "call_terms": CUT_EVERYWHERE}) == pytest.approx(plain, rel=1e-9)

    # a call price alone: one call per nano-batch that has tasks, each adding its price
    fixed = {**base, "call_terms": CallTerms(call=5.0)}
    extra = server_costs(plan, fixed) - plain
    calls = [sum(1 for nb in nbs if nb.tasks) for nbs in server_batches(plan, fixed)]
    assert extra == pytest.approx([5.0 * n for n in calls], abs=1e-4)
    assert all(n > 0 for n in calls) and (extra > 0).all()

    # call and tile prices: what the runtime's own cuts add, nano-batch by nano-batch
    terms = CallTerms(call=0.5, q_tile=0.01, k_tile=0.02, tile=16)
    priced = {**base, "call_terms": terms}
    added = [sum(calls_overhead(*segment_lens(nb), nb.calls, terms) for nb in nbs if nb.tasks)
             for nbs in server_batches(plan, priced)]
    assert server_costs(plan, priced) - plain == pytest.approx(added, abs=1e-4)
    assert all(a >= 0.5 for a in added)


@pytest.mark.parametrize("pingpong", [True, False])
def test_server_costs_add_each_calls_tail_on_a_profile_with_a_launch_grid(pingpong):
    """A profile that knows its kernel's launch grid prices each call's tail (:mod:`hf_longctx.kernels.launch`):
    a server pays, per call, its segments' work times the call's factor minus one, on top of the plain sum."""
    from hf_longctx.kernels.launch import LaunchGrid, tail_factor

    grid = LaunchGrid(forward_tile=(16, 16), backward_tile=(16, 16), forward_weight=0.3, slots=3)
    cells = dict(q_lens=[16, 64, 256, 1024], kv_lens=[16, 64, 256, 1024],
                 table=[[0.2, 0.5, 1.5, 5.0], [0.0, 1.5, 5.0, 18.0], [0.0, 0.0, 20.0, 70.0], [0.0, 0.0, 0.0, 300.0]],
                 interpolate="rate", tile=16)
    plain = ProfiledCostModel.from_grid(**cells)
    tailed = ProfiledCostModel.from_grid(**cells, launch=grid, launch_heads=2)
    plan = shard_plan(PackedBatch.from_doc_lens(DOC_LENS), 3, "cad")
    base = {"eps": 0.0, "min_shard": 16, "pingpong": pingpong, "call_terms": None}
    tasks = prepare(plan, {**base, "cost_model": plain}).tasks  # one schedule, priced both ways
    without = server_costs(plan, {**base, "cost_model": plain, "tasks": tasks})
    added = server_costs(plan, {**base, "cost_model": tailed, "tasks": tasks}) - without
    want = []
    for nbs in server_batches(plan, {**base, "cost_model": plain, "tasks": tasks}):
        tail = 0.0
        for nb in nbs:
            q_lens, k_lens = segment_lens(nb)
            if q_lens:
                work = sum(plain.cost(q, k) for q, k in zip(q_lens, k_lens))
                tail += (tail_factor(q_lens, k_lens, 2, grid) - 1.0) * work
        want.append(tail)
    assert added == pytest.approx(want, rel=1e-9, abs=1e-9)
    assert max(want) > 0  # three slots leave a tail somewhere
