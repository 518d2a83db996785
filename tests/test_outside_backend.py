"""A backend defined outside the package is registered here and runs wherever a built-in one runs.

``AllGatherBackend`` is the simplest exact sequence-parallel attention: every rank gathers the keys
and values of the whole sequence, attends its own queries over the keys they see (one kernel call,
one bottom-right aligned segment per run of consecutive own queries of a document), and in backward
sums the key/value gradients of all ranks (one all_reduce) and keeps its own rows. It uses only the
public contract (:class:`~hf_longctx.backends.Backend`, :func:`~hf_longctx.backends.register_backend`)
and the kernels; nothing inside ``hf_longctx`` names it.

Registering it at import makes it part of the backend test matrix of every test module collected
with this one (``tests/distributed.py`` registers it in spawned ranks too), gives it the attention
name ``longctx_allgather``, and the tests below run it in the matrix and in a Llama model.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hf_longctx
from hf_longctx.backends import Backend, get_backend, register_backend, registered_backends
from hf_longctx.backends.auto import AutoOptions, candidates
from hf_longctx.backends.prediction import AttentionShape
from hf_longctx.hf import backend_of, implementation_name
from hf_longctx.kernels import accumulation_dtype, attention_backward, attention_forward
from hf_longctx.layout import PackedBatch, ShardPlan, shard_plan

from distributed import run_distributed
from helpers import matrix_backends


class AllGatherBackend(Backend):
    name = "allgather"
    summary = "every rank gathers all keys and values and attends its own queries; gradients by all_reduce"

    def forward(self, run, q, k, v):
        segments = _segments(run.plan, run.rank, q.device)
        k_all, v_all = _gather(run, k), _gather(run, v)
        if not q.shape[0]:
            return torch.empty_like(q), torch.empty(q.shape[1], 0, dtype=accumulation_dtype(q.dtype), device=q.device)
        return attention_forward(q, k_all[segments.keys], v_all[segments.keys], *segments.kernel_args,
                                 causal=True, softmax_scale=run.scale, kernel=run.kernel, window=run.plan.window)

    def backward(self, run, dout, q, k, v, out, lse):
        segments = _segments(run.plan, run.rank, q.device)
        k_all, v_all = _gather(run, k), _gather(run, v)
        acc = accumulation_dtype(q.dtype)
        dk_all = torch.zeros(k_all.shape, dtype=acc, device=k.device)
        dv_all = torch.zeros(v_all.shape, dtype=acc, device=v.device)
        dq = torch.zeros_like(q)
        if q.shape[0]:
            dq, dks, dvs = attention_backward(dout.contiguous(), q, k_all[segments.keys], v_all[segments.keys], out,
                                              lse, *segments.kernel_args, causal=True, softmax_scale=run.scale,
                                              kernel=run.kernel, window=run.plan.window)
            dk_all.index_add_(0, segments.keys, dks.to(acc))
            dv_all.index_add_(0, segments.keys, dvs.to(acc))
        if run.plan.world_size > 1:
            dist.all_reduce(dk_all, group=run.group)
            dist.all_reduce(dv_all, group=run.group)
        own = run.plan.local_indices(run.rank).to(k.device)
        return dq, dk_all[own].to(k.dtype), dv_all[own].to(v.dtype)


class _Segments:
    """This rank's queries as kernel segments: each run of consecutive own rows of one document is a
    segment whose keys are the document's prefix up to the run's last row (bottom-right causal)."""

    def __init__(self, plan: ShardPlan, rank: int, device):
        own = plan.local_indices(rank).tolist()
        doc_of = [d for d, n in enumerate(plan.batch.doc_lens) for _ in range(n)]
        cu_q, cu_k, keys, start = [0], [0], [], 0
        for i in range(1, len(own) + 1):
            if i < len(own) and own[i] == own[i - 1] + 1 and doc_of[own[i]] == doc_of[own[start]]:
                continue
            doc_start, last = plan.batch.doc_starts[doc_of[own[start]]], own[i - 1]
            keys.extend(range(doc_start, last + 1))
            cu_q.append(i)
            cu_k.append(len(keys))
            start = i
        self.keys = torch.tensor(keys, dtype=torch.long, device=device)
        max_q = max((b - a for a, b in zip(cu_q, cu_q[1:])), default=0)
        max_k = max((b - a for a, b in zip(cu_k, cu_k[1:])), default=0)
        self.kernel_args = (cu_q, cu_k, max_q, max_k)


def _segments(plan: ShardPlan, rank: int, device) -> _Segments:
    return plan.cached(("allgather_segments", rank, str(device)), lambda: _Segments(plan, rank, device))


def _gather(run, x: torch.Tensor) -> torch.Tensor:
    """The whole sequence's rows of ``x`` in global order, from every rank's local rows."""
    plan = run.plan
    if plan.world_size == 1:
        return x[torch.argsort(plan.local_indices(0).to(x.device))]
    rows = max(plan.token_counts)
    padded = torch.zeros(rows, *x.shape[1:], dtype=x.dtype, device=x.device)
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in range(plan.world_size)]
    dist.all_gather(parts, padded, group=run.group)
    full = torch.empty(plan.batch.num_tokens, *x.shape[1:], dtype=x.dtype, device=x.device)
    for r, part in enumerate(parts):
        full[plan.local_indices(r).to(x.device)] = part[: plan.token_counts[r]]
    return full


ALLGATHER = register_backend(AllGatherBackend())


def test_registration_gives_an_attention_name_and_a_place_in_the_matrix():
    from transformers import AttentionInterface

    assert get_backend("allgather") is ALLGATHER and registered_backends()[-1] is ALLGATHER
    assert implementation_name("allgather") == "longctx_allgather"
    assert "longctx_allgather" in AttentionInterface._global_mapping
    assert "longctx_allgather" in hf_longctx.ATTENTION_IMPLEMENTATIONS
    assert backend_of("longctx_allgather") == "allgather"
    assert "allgather" in matrix_backends()
    # it did not ask to be an auto candidate, so auto's choices stay those of the package
    assert "allgather" not in {c.backend for c in candidates(2, AttentionShape(4, 2, 16), AutoOptions())}


def test_a_name_is_registered_once_and_an_object_is_required():
    with pytest.raises(ValueError, match="already registered"):
        register_backend(AllGatherBackend())
    with pytest.raises(TypeError, match="subclass Backend"):
        register_backend("allgather")
    assert register_backend(ALLGATHER, replace=True) is ALLGATHER


def test_the_segments_cover_exactly_the_causal_keys_of_own_queries():
    batch = PackedBatch.from_doc_lens([5, 9, 2, 8])
    plan = shard_plan(batch, 2, "zigzag")
    for rank in range(2):
        seg = _Segments(plan, rank, "cpu")
        cu_q, cu_k = seg.kernel_args[0], seg.kernel_args[1]
        own = plan.local_indices(rank).tolist()
        for i in range(len(cu_q) - 1):
            rows = own[cu_q[i] : cu_q[i + 1]]
            keys = seg.keys[cu_k[i] : cu_k[i + 1]].tolist()
            doc = max(d for d, s in enumerate(batch.doc_starts) if s <= rows[0])
            assert keys == list(range(batch.doc_starts[doc], rows[-1] + 1))
        assert sum(cu_q[i + 1] - cu_q[i] for i in range(len(cu_q) - 1)) == len(own)


@pytest.mark.parametrize("world", [2, 3])
def test_the_backend_matrix_runs_it(world):
    """The checks of ``test_backends`` (outputs and gradients, with and without sliding windows, every
    placement) on the matrix as the registry gives it, which now includes this backend."""
    from test_backends import check_backends, check_backends_with_and_without_window

    assert "allgather" in matrix_backends()
    run_distributed(world, check_backends_with_and_without_window, ["allgather"])
    run_distributed(world, check_backends, ["allgather"], [torch.float64], range(2),
                    ["contiguous", "zigzag", "doc_zigzag"])


def test_a_llama_model_trains_with_it_like_sdpa():
    """Loss and every parameter gradient of a tiny Llama on 2 gloo ranks equal single-device sdpa."""
    from test_hf import check_sharded_llama

    run_distributed(2, check_sharded_llama, ["allgather", "zigzag"], range(2))
