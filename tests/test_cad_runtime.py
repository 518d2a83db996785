"""The CAD runtime is exact for ANY split of documents into tasks and ANY assignment to servers.

This isolates the runtime (transfers, one varlen call per server, ping-pong, gradient returns) from the
scheduler: random schedules must reproduce single-device attention, outputs and gradients.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from test_backends import make_problem, reference

from hf_longctx.backends.cad import runtime
from hf_longctx.backends.engine import RunContext
from hf_longctx.backends.op import core_attention, register_context
from hf_longctx.comm import group_rank_and_size
from hf_longctx.layout import PackedBatch, shard_plan

from distributed import run_distributed


def random_tasks(plan, seed: int) -> list[runtime.CadTask]:
    rng = random.Random(seed)
    tasks = []
    for r in range(plan.world_size):
        for i, (p, _) in enumerate(runtime.pieces_of(plan, r)):
            cuts = sorted({0, p.length, *(rng.randint(1, p.length) for _ in range(rng.randint(0, 2)))})
            for a, b in zip(cuts, cuts[1:]):
                if b > a:
                    tasks.append(runtime.CadTask(r, i, a, b, rng.randrange(plan.world_size)))
    rng.shuffle(tasks)
    return tasks


def check_random_schedules(rank, world, seeds, pingpong):
    for seed in seeds:
        for dtype, tol in ((torch.float64, 1e-9), (torch.float32, 2e-5)):
            batch, q, k, v, dout = make_problem(seed * 13 + world, world, dtype)
            ref_out, ref_dq, ref_dk, ref_dv = reference(batch, q, k, v, dout)
            plan = shard_plan(batch, world, "contiguous")
            tasks = random_tasks(plan, seed)
            r, _ = group_rank_and_size(None)
            run = RunContext(plan, (), None, r, 1 / math.sqrt(q.shape[-1]), "auto", runtime.run_forward,
                             runtime.run_backward, {"tasks": tasks, "pingpong": pingpong})
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


def test_docs_per_rank_gives_pieces_with_their_prefix_offset():
    plan = shard_plan(PackedBatch.from_doc_lens([5, 10, 1]), 2, "contiguous")  # shards [0, 8), [8, 16)
    assert runtime.docs_per_rank(plan) == [[(5, 0), (3, 0)], [(7, 3), (1, 0)]]
