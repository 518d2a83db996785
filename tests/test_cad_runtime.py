"""The CAD runtime is exact for ANY split of documents into tasks and ANY assignment to servers.

This isolates the runtime (transfers, one varlen call per server, ping-pong, gradient returns) from the
scheduler: random schedules must reproduce single-device attention, outputs and gradients.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch
from test_backends import make_problem, reference

from hf_longctx.backends.cad import runtime
from hf_longctx.backends.cad.options import CadOptions, CadRun
from hf_longctx.backends.cad.pingpong import PINGPONG_TOLERANCE, pingpong_split
from hf_longctx.backends.cad.tasks import CadTask, docs_per_rank, pieces_of, server_holds_keys, task_cost
from hf_longctx.backends.engine import RunContext
from hf_longctx.backends.op import core_attention, register_context
from hf_longctx.comm import group_rank_and_size
from hf_longctx.layout import PackedBatch, shard_plan

from distributed import run_distributed


def random_tasks(plan, seed: int) -> list[CadTask]:
    rng = random.Random(seed)
    tasks = []
    for r in range(plan.world_size):
        for i, (p, _) in enumerate(pieces_of(plan, r)):
            cuts = sorted({0, p.length, *(rng.randint(1, p.length) for _ in range(rng.randint(0, 2)))})
            for a, b in zip(cuts, cuts[1:]):
                if b > a:
                    tasks.append(CadTask(r, i, a, b, rng.randrange(plan.world_size)))
    rng.shuffle(tasks)
    return tasks


def random_key_cut_tasks(plan, seed: int) -> list[CadTask]:
    """:func:`random_tasks`, each with the keys before its first row cut at random points: rectangles of the
    first keys and a causal rest, every part of a row on a different server (a server computes a row once)."""
    rng = random.Random(seed)
    tasks = []
    for t in random_tasks(plan, seed):
        piece, _ = pieces_of(plan, t.owner)[t.piece]
        before = piece.start - plan.batch.doc_starts[piece.doc] + t.q_start  # keys all of its rows see
        cuts = sorted({rng.randint(0, before) for _ in range(rng.randint(0, min(2, plan.world_size - 1)))} - {0})
        servers = rng.sample(range(plan.world_size), len(cuts) + 1)
        lo = 0
        for hi, server in zip(cuts, servers):
            tasks.append(replace(t, server=server, key_lo=lo, key_hi=hi))
            lo = hi
        tasks.append(replace(t, server=servers[-1], key_lo=lo))
    rng.shuffle(tasks)
    return tasks


def check_random_schedules(rank, world, seeds, pingpong, key_cuts=False):
    for seed in seeds:
        for dtype, tol in ((torch.float64, 1e-9), (torch.float32, 2e-5)):
            batch, q, k, v, dout = make_problem(seed * 13 + world, world, dtype)
            ref_out, ref_dq, ref_dk, ref_dv = reference(batch, q, k, v, dout)
            plan = shard_plan(batch, world, "contiguous")
            tasks = random_key_cut_tasks(plan, seed) if key_cuts else random_tasks(plan, seed)
            if key_cuts:
                assert any(t.is_rect for t in tasks), "no key was cut: the test tests nothing"
            r, _ = group_rank_and_size(None)
            run = RunContext(plan, (), None, r, 1 / math.sqrt(q.shape[-1]), "auto", runtime.run_forward,
                             runtime.run_backward, CadOptions(pingpong=pingpong), CadRun(tuple(tasks)))
            idx = plan.local_indices(rank)
            ql, kl, vl = (t[idx].clone().requires_grad_() for t in (q, k, v))
            out, _ = core_attention(ql, kl, vl, register_context(run))
            out.backward(dout[idx])
            where = f"world={world} rank={rank} seed={seed} {dtype} pingpong={pingpong}"
            for name, got, want in (("out", out, ref_out), ("dq", ql.grad, ref_dq), ("dk", kl.grad, ref_dk),
                                    ("dv", vl.grad, ref_dv)):
                torch.testing.assert_close(got, want[idx], rtol=tol, atol=tol,
                                           msg=lambda m, n=name, w=where: f"{n} {w} {m}")


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_cad_runtime_exact_for_random_schedules(world):
    run_distributed(world, check_random_schedules, range(3), True)


def test_cad_runtime_exact_without_pingpong():
    run_distributed(3, check_random_schedules, range(2), False)


@pytest.mark.parametrize("world,pingpong", [(2, True), (3, False), (5, True)])
def test_cad_runtime_exact_when_keys_are_cut_over_servers(world, pingpong):
    """Rows whose keys are cut into rectangles and a causal rest, each on its own server: the partial results
    merge at the rows' owner by their log-sum-exp, and every part's backward adds its dq."""
    run_distributed(world, check_random_schedules, range(3), pingpong, True)


def test_a_server_may_not_compute_two_parts_of_a_row_in_one_nano_batch():
    batch = PackedBatch.from_doc_lens([300, 100])
    plan = shard_plan(batch, 2, "contiguous")
    rest = CadTask(1, 0, 0, 50, 0, key_lo=128)  # rank 1's first rows (from 200) continue the 300-token document
    with pytest.raises(ValueError, match="computes rows of .* twice in one nano-batch"):
        runtime.build_nano_batch(plan, [replace(rest, key_lo=0, key_hi=128), rest], 0)


@pytest.mark.parametrize("task,problem", [
    (CadTask(1, 0, 0, 50, 0, key_lo=0, key_hi=201), "must lie before the task's first row"),
    (CadTask(1, 0, 0, 50, 0, key_lo=201), "must lie before the task's first row"),
    (CadTask(0, 0, 0, 50, 0, key_lo=0, key_hi=0), "must lie before the task's first row"),
])
def test_a_key_range_outside_the_visible_prefix_is_refused(task, problem):
    plan = shard_plan(PackedBatch.from_doc_lens([300, 100]), 2, "contiguous")  # rank 1 starts at row 200
    with pytest.raises(ValueError, match=problem):
        runtime.build_nano_batch(plan, [task, CadTask(1, 0, 0, 50, 1)], 0)


def test_key_cuts_are_refused_under_a_sliding_window():
    plan = shard_plan(PackedBatch.from_doc_lens([300, 100]), 2, "contiguous").with_window(64)
    with pytest.raises(ValueError, match="sliding window"):
        runtime.build_nano_batch(plan, [CadTask(1, 0, 0, 50, 0, key_lo=0, key_hi=64), CadTask(1, 0, 0, 50, 1,
                                                                                              key_lo=64)], 0)


def test_docs_per_rank_gives_pieces_with_their_prefix_offset():
    plan = shard_plan(PackedBatch.from_doc_lens([5, 10, 1]), 2, "contiguous")  # shards [0, 8), [8, 16)
    assert docs_per_rank(plan) == [[(5, 0), (3, 0)], [(7, 3), (1, 0)]]


def check_fetches_land_before_kernels(rank, world, seeds):
    """Run random ping-pong schedules, recording every fetch's transfer and every kernel call; at each kernel
    call, every fetch posted so far must have been waited for (its stream ordered before the kernel)."""
    import torch.distributed as dist

    from hf_longctx.comm.gather import GatherPlan

    fetches, waited, early = [], set(), []

    class Recorded:
        def __init__(self, work):
            self.work = work

        def wait(self):
            waited.add(id(self))
            return self.work.wait()

    real_a2a, real_start = dist.all_to_all_single, GatherPlan.start
    real_fwd, real_bwd = runtime.forward_in_calls, runtime.backward_in_calls

    def a2a(*args, **kwargs):
        work = real_a2a(*args, **kwargs)
        return Recorded(work) if work is not None else None

    def start(self, tensors, group):
        pending = real_start(self, tensors, group)
        fetches.extend(w for w, _, _ in pending.parts if w is not None)
        return pending

    def kernel(fn):
        def call(*args, **kwargs):
            early.extend(w for w in fetches if id(w) not in waited)
            return fn(*args, **kwargs)
        return call

    dist.all_to_all_single, GatherPlan.start = a2a, start
    runtime.forward_in_calls, runtime.backward_in_calls = kernel(real_fwd), kernel(real_bwd)
    try:
        check_random_schedules(rank, world, seeds, True)
    finally:
        dist.all_to_all_single, GatherPlan.start = real_a2a, real_start
        runtime.forward_in_calls, runtime.backward_in_calls = real_fwd, real_bwd
    assert fetches, "no row was fetched: the test tests nothing"
    assert not early, f"rank {rank}: {len(early)} of {len(fetches)} fetches not waited for before a kernel call"


def test_every_fetch_lands_before_the_first_kernel():
    """With ping-pong, the second nano-batch's fetch must not reach the device behind the first's kernel: a
    transfer queued after a kernel that fills every SM waits for all of it, and its peers wait in the same
    collective. So the compute stream waits for every fetch before its first kernel (results stay exact)."""
    run_distributed(3, check_fetches_land_before_kernels, range(2))


def check_query_gradient_buffers(rank, world):
    """bf16 inputs: without key cuts every query row's gradient is copied into place in bf16; with key cuts its
    parts add up in fp32. Key gradients add up in fp32 either way."""
    from hf_longctx.comm.gather import GatherPlan

    targets, real = [], GatherPlan.scatter_local

    def scatter_local(self, segments, locals_, add):
        targets.append((len(locals_), locals_[0].dtype, add))
        return real(self, segments, locals_, add)

    GatherPlan.scatter_local = scatter_local
    try:
        for key_cuts in (False, True):
            batch, q, k, v, dout = make_problem(5, world, torch.bfloat16)
            plan = shard_plan(batch, world, "contiguous")
            tasks = random_key_cut_tasks(plan, 1) if key_cuts else random_tasks(plan, 1)
            run = RunContext(plan, (), None, rank, 1 / math.sqrt(q.shape[-1]), "auto", runtime.run_forward,
                             runtime.run_backward, CadOptions(pingpong=True), CadRun(tuple(tasks)))
            idx = plan.local_indices(rank)
            ql, kl, vl = (t[idx].clone().requires_grad_() for t in (q, k, v))
            out, _ = core_attention(ql, kl, vl, register_context(run))
            targets.clear()
            out.backward(dout[idx])
            query = {(dtype, add) for n, dtype, add in targets if n == 1}
            keys = {(dtype, add) for n, dtype, add in targets if n == 2}
            assert query == ({(torch.float32, True)} if key_cuts else {(torch.bfloat16, False)}), (key_cuts, query)
            assert keys == {(torch.float32, True)}, keys
            assert ql.grad.dtype == torch.bfloat16 and torch.isfinite(ql.grad.float()).all()
    finally:
        GatherPlan.scatter_local = real


def test_query_gradients_skip_the_fp32_buffer_unless_keys_are_cut():
    run_distributed(2, check_query_gradient_buffers)


# ----------------------------------------------------------------------------- traffic: only rows a server lacks


def run_schedule(rank, world, batch, tensors, tasks, pingpong):
    """Run the CAD runtime on ``tasks``; returns this rank's (out, dq, dk, dv), its traffic counters and the
    number of all_to_all collectives it issued."""
    import torch.distributed as dist

    from hf_longctx.comm import comm_stats, reset_comm_stats

    q, k, v, dout = tensors
    plan = shard_plan(batch, world, "contiguous")
    run = RunContext(plan, (), None, rank, 1 / math.sqrt(q.shape[-1]), "auto", runtime.run_forward,
                     runtime.run_backward, CadOptions(pingpong=pingpong), CadRun(tuple(tasks)))
    idx = plan.local_indices(rank)
    ql, kl, vl = (t[idx].clone().requires_grad_() for t in (q, k, v))
    calls, real = [], dist.all_to_all_single

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    reset_comm_stats()
    dist.all_to_all_single = counting
    try:
        out, _ = core_attention(ql, kl, vl, register_context(run))
        out.backward(dout[idx])
    finally:
        dist.all_to_all_single = real
    return (out, ql.grad, kl.grad, vl.grad), comm_stats(), len(calls)


def expected_traffic(plan, tasks, pingpong, rank, hq, hkv, d, itemsize=8):
    """(sent, received) bytes of ``rank``, forward + backward, counted from first principles (fp64: every
    row element 8 bytes): query rows of a task served away from its owner travel there (q; in backward q,
    out, dout, lse) and back (out, lse; in backward dq); per nano-batch, server and document, the key rows
    of the UNION of the tasks' prefixes that the server does not hold travel once each way and a half
    (k, v forward and backward; dk, dv back)."""
    q_row, lse_row, kv_row = hq * d * itemsize, hq * itemsize, 2 * hkv * d * itemsize
    owner_of = {int(g): r for r in range(plan.world_size) for g in plan.local_indices(r)}
    pieces = [pieces_of(plan, r) for r in range(plan.world_size)]
    sent = recv = 0
    for nb in (pingpong_split(plan, tasks) if pingpong else [tasks]):
        prefix = {}  # (server, doc) -> end of the union of key prefixes
        for t in nb:
            piece, _ = pieces[t.owner][t.piece]
            n = t.q_end - t.q_start
            if n and t.server != t.owner:
                fetched, returned = n * (q_row + 3 * q_row + lse_row), n * (q_row + lse_row + q_row)
                sent += fetched * (rank == t.owner) + returned * (rank == t.server)
                recv += fetched * (rank == t.server) + returned * (rank == t.owner)
            if n:
                key = (t.server, piece.doc)
                prefix[key] = max(prefix.get(key, 0), piece.start + t.q_end)
        for (server, doc), end in prefix.items():
            for g in range(plan.batch.doc_starts[doc], end):
                holder = owner_of[g]
                if holder != server:
                    sent += 2 * kv_row * (rank == holder) + kv_row * (rank == server)
                    recv += 2 * kv_row * (rank == server) + kv_row * (rank == holder)
    return sent, recv


def check_traffic(rank, world, doc_lens, schedules, pingpong, expect_no_collective):
    """Every schedule: exact results, and traffic equal to :func:`expected_traffic` (unique rows only)."""
    batch = PackedBatch.from_doc_lens(doc_lens)
    g = torch.Generator().manual_seed(7)
    tensors = [torch.randn(batch.num_tokens, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4)]
    ref = reference(batch, *tensors)
    plan = shard_plan(batch, world, "contiguous")
    idx = plan.local_indices(rank)
    traffic = []
    for tasks in schedules:
        got, stats, collectives = run_schedule(rank, world, batch, tensors, tasks, pingpong)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
            torch.testing.assert_close(a, b[idx], rtol=1e-9, atol=1e-9, msg=lambda m, n=name: f"{n} {m}")
        sent, received = expected_traffic(plan, tasks, pingpong, rank, 4, 2, 8)
        assert (stats.get("sent_bytes", 0), stats.get("recv_bytes", 0)) == (sent, received), (rank, stats, sent,
                                                                                               received)
        if expect_no_collective:
            assert sent == received == 0 and collectives == 0, (rank, stats, collectives)
        traffic.append((sent, received))
    return traffic


def local_tasks(plan, seed):
    """Random cuts of every piece, each task served by its owner."""
    return [CadTask(t.owner, t.piece, t.q_start, t.q_end, t.owner) for t in random_tasks(plan, seed)]


@pytest.mark.parametrize("pingpong", [True, False])
def test_servers_holding_their_rows_send_nothing(pingpong):
    """Documents inside shards, every task on its owner: zero bytes and not even a collective, both ways."""
    world = 3
    plan = shard_plan(PackedBatch.from_doc_lens([5, 9, 2] * world), world, "contiguous")
    run_distributed(world, check_traffic, [5, 9, 2] * world, [local_tasks(plan, s) for s in range(2)], pingpong,
                    True)


def check_union_not_sum(rank, world):
    # rank 0 holds document 0 ([0, 16)), rank 1 document 1; everything is computed on server 1
    doc_lens = [16, 16]
    whole = [CadTask(0, 0, 0, 16, 1), CadTask(1, 0, 0, 16, 1)]
    split = [CadTask(0, 0, a, a + 4, 1) for a in (12, 0, 8, 4)] + whole[1:]
    for pingpong in (False, True):
        t_whole, t_split = check_traffic(rank, world, doc_lens, [whole, split], pingpong, False)
        # four tasks reading prefixes of 4, 8, 12 and 16 rows move the 16 rows once, not 40: the same as one task
        assert t_split == t_whole, (rank, t_split, t_whole)
        kv, qs = 16 * 2 * 2 * 8 * 8, 16 * (4 * 4 * 8 * 8 + 4 * 8)  # key rows (k+v), query-side rows (q,out,dout,lse)
        assert t_whole[0] == (2 * kv + qs if rank == 0 else 16 * (2 * 4 * 8 + 4) * 8 + kv), (rank, t_whole)


def test_tasks_of_one_document_on_one_server_fetch_the_union_of_their_prefixes():
    run_distributed(2, check_union_not_sum)


@pytest.mark.parametrize("world,pingpong", [(3, True), (4, False)])
def test_traffic_is_the_unique_rows_each_server_lacks(world, pingpong):
    """Random schedules over documents crossing shard boundaries: counted bytes equal the first-principles count."""
    rng = random.Random(world)
    doc_lens = [rng.randint(1, 30) for _ in range(4 * world)]
    plan = shard_plan(PackedBatch.from_doc_lens(doc_lens), world, "contiguous")
    run_distributed(world, check_traffic, doc_lens, [random_tasks(plan, s) for s in range(3)], pingpong, False)


# ----------------------------------------------------------------------------- ping-pong split


def doc_of(plan, t):
    return pieces_of(plan, t.owner)[t.piece][0].doc


def check_split(plan, tasks, halves):
    """Both halves together compute exactly the query rows of ``tasks`` on the same servers; returns per
    server the halves' costs and the documents of the tasks whose server lacks some of their keys."""
    def rows(ts):
        return sorted((t.owner, t.piece, r, t.server) for t in ts for r in range(t.q_start, t.q_end))

    assert rows(t for h in halves for t in h) == rows(tasks)
    cost = {s: [sum(task_cost(plan, t) for t in h if t.server == s) for h in halves]
            for s in {t.server for t in tasks}}
    docs = [{doc_of(plan, t) for t in h if not server_holds_keys(plan, t)} for h in halves]
    shuffled = list(tasks)
    random.Random(0).shuffle(shuffled)
    assert pingpong_split(plan, shuffled) == halves  # a function of the task set, whatever its order
    return cost, docs


def test_pingpong_keeps_documents_whole_when_that_balances():
    # rank 0 holds four documents of 32 rows, cut into uneven tasks, all computed on server 1: two whole
    # documents per half (splitting one would send its shared prefix twice)
    plan = shard_plan(PackedBatch.from_doc_lens([32, 32, 32, 32, 128]), 2, "contiguous")
    tasks = [CadTask(0, d, a, b, 1) for d in range(4) for a, b in ((0, 5), (5, 20), (20, 32))]
    halves = pingpong_split(plan, tasks)
    cost, docs = check_split(plan, tasks, halves)
    assert cost[1][0] == cost[1][1] and len(docs[0]) == len(docs[1]) == 2 and not docs[0] & docs[1]


def test_pingpong_breaks_a_document_only_when_that_reaches_the_tolerance():
    # a document of 64 rows in 8 tasks and one of 8 rows, all remote on server 1: whole documents give
    # 2080 vs 36 pairs; breaking the long one balances within 10%
    plan = shard_plan(PackedBatch.from_doc_lens([64, 8, 72]), 2, "contiguous")
    tasks = [CadTask(0, 0, a, a + 8, 1) for a in range(0, 64, 8)] + [CadTask(0, 1, 0, 8, 1)]
    cost, docs = check_split(plan, tasks, pingpong_split(plan, tasks))
    assert abs(cost[1][0] - cost[1][1]) <= PINGPONG_TOLERANCE * max(cost[1]), cost
    assert 0 in docs[0] & docs[1]
    # head and tail of one document, remote: no split of the two reaches 10%, so they stay together
    tasks = [CadTask(0, 0, 0, 8, 1), CadTask(0, 0, 48, 64, 1)]
    halves = pingpong_split(plan, tasks)
    assert len(halves) == 1 and sorted(halves[0]) == sorted(tasks)


def test_pingpong_cuts_a_task_whose_keys_the_server_holds():
    # one local document, one task: cut in two parts of (nearly) equal cost, at no byte of cost
    plan = shard_plan(PackedBatch.from_doc_lens([64, 64]), 2, "contiguous")
    tasks = [CadTask(0, 0, 0, 64, 0), CadTask(1, 0, 0, 64, 1)]
    halves = pingpong_split(plan, tasks)
    cost, _ = check_split(plan, tasks, halves)
    for s in (0, 1):
        assert abs(cost[s][0] - cost[s][1]) <= PINGPONG_TOLERANCE * max(cost[s]), cost


def test_pingpong_on_random_schedules_covers_every_row():
    for seed in range(20):
        rng = random.Random(seed)
        world = rng.randint(1, 4)
        plan = shard_plan(PackedBatch.from_doc_lens([rng.randint(1, 40) for _ in range(6)]), world, "contiguous")
        tasks = random_tasks(plan, seed) + [CadTask(0, 0, 0, 0, 0)]  # an empty task is dropped
        check_split(plan, tasks, pingpong_split(plan, tasks))


def check_schedule_agreement(rank, world):
    from hf_longctx.backends import get_backend
    from hf_longctx.backends.cad.shared_pricing import PricingShare

    plan = shard_plan(PackedBatch.from_doc_lens([700, 90, 300, 33, 500, 211]), world, "cad")
    share = PricingShare(None, rank, world)
    runtime.cad_schedule(plan, {"cost_model": "flops", "eps": 0.1}, share)  # the same options: the same tasks
    apart = {"cost_model": "flops", "eps": 0.0 if rank == 0 else 0.5}  # rank 0 schedules otherwise
    with pytest.raises(RuntimeError, match="the ranks made different schedules"):
        runtime.cad_schedule(plan, apart, share)  # every rank raises, none waits on the others
    # a schedule made before the run without the group (auto pricing CAD) does not let the run skip the check
    other = shard_plan(PackedBatch.from_doc_lens([700, 90, 300, 33, 500, 211]), world, "cad")
    runtime.cad_schedule(other, apart)
    with pytest.raises(RuntimeError, match="the ranks made different schedules"):
        get_backend("cad").run_context(other, None, rank, world, 0.25, "reference", apart)


def test_ranks_that_made_different_schedules_all_stop_with_a_message():
    """A rank whose schedule differs would size its all_to_all differently from its peers (a hang, or rows sent to
    the wrong server): once a schedule is made, the ranks compare a digest of its tasks, and all raise."""
    run_distributed(3, check_schedule_agreement)
