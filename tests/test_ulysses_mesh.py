"""Ulysses inside inner groups x a ring-family backend or CAD across them equals single-device attention.

Every rank builds the same random packed batch (documents of random lengths, one longer than a shard),
runs the reference kernel over the whole sequence in float64, runs the composed backend on its shard,
and checks its own output rows and its own dq/dk/dv rows at 1e-9 relative: GQA with one and two KV
heads (repeated over the inner group as Ulysses does), with and without a sliding window, on meshes
2 x 2, 2 x 3 and 3 x 2 (inner x outer), for every outer backend. One spawn per world size.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_backends import reference

from hf_longctx.backends import default_strategy, sequence_parallel_attention
from hf_longctx.backends.ulysses_mesh import OUTER_BACKENDS, composed_name, mesh_sizes, outer_plan
from hf_longctx.layout import PackedBatch, shard_plan

from distributed import run_distributed
from helpers import random_doc_lens

QUERY_HEADS = 6  # splits over inner groups of 2 and 3


def mesh_problem(seed: int, world: int, hkv: int, d: int = 8):
    rng = random.Random(seed)
    shard = rng.randint(6, 14)
    total = shard * world + rng.randint(0, world - 1)  # token counts that do not divide
    first = shard + 5  # one document longer than a rank's shard
    lens = [first] + random_doc_lens(rng, total - first, max_len=3 * shard)
    rng.shuffle(lens)
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(total, h, d, generator=g, dtype=torch.float64) for h in (QUERY_HEADS, hkv, hkv,
                                                                                          QUERY_HEADS))
    return PackedBatch.from_doc_lens(lens), q, k, v, dout


def check_meshes(rank, world, inner_sizes, backends):
    for inner in inner_sizes:
        for case, (hkv, window_shards) in enumerate([(1, None), (2, None), (2, 0.7), (1, 1.5)]):
            batch, q, k, v, dout = mesh_problem(100 * world + 10 * inner + case, world, hkv)
            window = None if window_shards is None else max(1, int(window_shards * batch.num_tokens / world))
            ref_out, ref_dq, ref_dk, ref_dv = reference(batch, q, k, v, dout, window)
            for outer in backends:
                backend = composed_name(outer)
                plan = shard_plan(batch, world, default_strategy(backend))
                idx = plan.local_indices(rank)
                ql, kl, vl = (t[idx].clone().requires_grad_() for t in (q, k, v))
                out = sequence_parallel_attention(ql, kl, vl, plan=plan, backend=backend, window=window,
                                                  options={"ulysses_size": inner})
                out.backward(dout[idx])
                where = (f"{backend} {inner}x{world // inner} hkv={hkv} window={window} rank={rank} "
                         f"docs={batch.doc_lens}")
                for name, got, want in (("out", out, ref_out), ("dq", ql.grad, ref_dq), ("dk", kl.grad, ref_dk),
                                        ("dv", vl.grad, ref_dv)):
                    torch.testing.assert_close(got, want[idx], rtol=1e-9, atol=1e-9,
                                               msg=lambda m, n=name, w=where: f"{n} {w} {m}")


def check_mixed_sizes_are_refused_by_every_rank(rank, world):
    """Ranks of one group given different ulysses_size all raise where the mesh is made, none waits in it."""
    import torch.distributed as dist

    batch, q, k, v, _ = mesh_problem(7, world, 2)
    plan = shard_plan(batch, world, "zigzag")
    idx = plan.local_indices(rank)
    group = dist.new_group(list(range(world)))  # a group whose mesh is not made yet
    with pytest.raises(ValueError, match="run different ulysses_sizes"):
        sequence_parallel_attention(q[idx], k[idx], v[idx], plan=plan, backend="ulysses_zigzag", group=group,
                                    options={"ulysses_size": 2 if rank < 2 else 4})


def check_meshes_and_refusal(rank, world, inner_sizes, backends):
    check_meshes(rank, world, inner_sizes, backends)
    if world == 4:
        check_mixed_sizes_are_refused_by_every_rank(rank, world)


@pytest.mark.parametrize("world,inner_sizes", [(4, [2]), (6, [2, 3])])
def test_ulysses_over_every_outer_backend_matches_single_device(world, inner_sizes):
    run_distributed(world, check_meshes_and_refusal, inner_sizes, list(OUTER_BACKENDS), timeout_s=300)


@pytest.mark.parametrize("strategy", ["contiguous", "zigzag", "doc_zigzag", "cad"])
@pytest.mark.parametrize("world,inner", [(4, 2), (6, 2), (6, 3)])
def test_inner_groups_together_hold_the_outer_placement(strategy, world, inner):
    """The tokens of an inner group, slot by slot, are the strategy's placement over the outer ranks: every token
    once, and the same document pieces as the strategy's own plan over outer ranks, up to rounding."""
    rng = random.Random(world * 7 + inner)
    batch = PackedBatch.from_doc_lens(random_doc_lens(rng, 61, max_len=25))
    plan = shard_plan(batch, world, strategy)
    outer = outer_plan(plan, inner)
    assert outer.world_size == world // inner and outer.strategy == strategy
    held = torch.cat([outer.local_indices(o) for o in range(outer.world_size)])
    assert sorted(held.tolist()) == list(range(batch.num_tokens))
    for o in range(outer.world_size):
        mine = sorted(torch.cat([plan.local_indices(o * inner + i) for i in range(inner)]).tolist())
        assert sorted(outer.local_indices(o).tolist()) == mine
        assert len(outer.rank_slots(o)) == len(plan.rank_slots(0))
        for slot in outer.rank_slots(o):
            assert len({p.doc for p in slot.pieces}) == len(slot.pieces)  # one piece per document


def test_a_mesh_asks_its_groups_comm_mode_for_its_groups_and_takes_its_own():
    """The inner and outer groups come from the group's own comm ops (never from a test of its type), all of the
    mesh's member lists in one order, every rank the same; a disagreement the ops report is the ulysses_size
    refusal."""
    from test_comm_mode import StubGroup, StubOps

    from hf_longctx.backends.ulysses_mesh import mesh_groups

    ops = StubOps()
    # rank 5 of 6 in a 2 x 3 mesh: inner group {4, 5} (outer shard 2), outer group {1, 3, 5} (inner index 1)
    assert mesh_groups(StubGroup(ops), 5, 6, 2) == ("group (4, 5)", "group (1, 3, 5)")
    assert ops.calls == [("sub_groups", [(0, 1), (2, 3), (4, 5), (0, 2, 4), (1, 3, 5)], 2)]
    assert mesh_groups(StubGroup(ops), 2, 6, 3) == ("group (0, 1, 2)", "group (2, 5)")  # 3 x 2: inner index 2
    assert ops.calls[-1] == ("sub_groups", [(0, 1, 2), (3, 4, 5), (0, 3), (1, 4), (2, 5)], 3)
    ops.calls.clear()
    assert mesh_groups(StubGroup(ops), 0, 1, 1) == (None, None) and not ops.calls  # one rank: nothing to make
    ops.refused = {(10, 11, 12, 13): [2, 4]}
    with pytest.raises(ValueError, match=r"run different ulysses_sizes \(\{\(10, 11, 12, 13\): \[2, 4\]\}"):
        mesh_groups(StubGroup(ops), 0, 4, 2)


def test_ulysses_size_must_be_given_and_divide_the_group():
    from hf_longctx.backends.api import check_options

    with pytest.raises(ValueError, match="needs option ulysses_size"):
        check_options("ulysses_zigzag", {})
    with pytest.raises(ValueError, match="whole number"):
        check_options("ulysses_zigzag", {"ulysses_size": 0})
    with pytest.raises(ValueError, match="has no option 'eps'"):
        check_options("ulysses_zigzag", {"ulysses_size": 2, "eps": 0.1})
    check_options("ulysses_cad", {"ulysses_size": 2, "eps": 0.1})
    with pytest.raises(ValueError, match="ulysses_size 4 does not divide the 6 ranks"):
        mesh_sizes(6, 4)


# ----------------------------------------------------------------------------- through a transformers model

MODEL_LENS = [9, 5, 12, 1, 7, 6, 10, 3]


def sharded_model_loss_and_grads(model, impl, rank, world, rows, options):
    """Like test_transformers_parity's sharded run, with the backend's options handed to every attention call."""
    import torch.distributed as dist

    from hf_longctx.hf.integration.inputs import install_input_hook

    model.set_attn_implementation(impl)
    model.zero_grad()
    hook = install_input_hook(model, dist.group.WORLD, options=options)
    try:
        loss = model(**rows[rank]).loss
        loss.backward()
    finally:
        hook.remove()
    total = loss.detach().clone()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}
    dist.all_reduce(total)
    for g in grads.values():
        dist.all_reduce(g)
    return total.item(), grads


def check_llama_on_mesh(rank, world):
    from test_transformers_parity import assert_same, build, packed, per_document_reference, split_documents

    from hf_longctx.hf.settings.backend_names import implementation_name

    ids, pos = packed(3, MODEL_LENS)
    rows = split_documents(ids, pos, MODEL_LENS, world)
    model = build("llama")  # 6 query heads, 2 KV heads: 3 and 1 per rank of an inner group of 2
    ref = per_document_reference(model, ids, pos, MODEL_LENS)
    for outer in OUTER_BACKENDS:
        impl = implementation_name(composed_name(outer))
        assert impl == f"longctx_ulysses_{outer}"
        got = sharded_model_loss_and_grads(model, impl, rank, world, rows, {"ulysses_size": 2})
        assert_same(*got, *ref, f"llama on {impl} 2 x 2")


def test_llama_loss_and_every_gradient_on_a_2x2_mesh_equal_sdpa_per_document():
    import transformers  # noqa: F401 - the model test needs transformers

    run_distributed(4, check_llama_on_mesh, timeout_s=300)


def test_preflight_names_the_ulysses_size_that_splits_the_heads():
    from transformers import LlamaConfig

    from hf_longctx.hf import ConfigError, LongContextConfig
    from hf_longctx.hf.integration.preflight import check_model_config

    model_config = LlamaConfig(num_attention_heads=6, num_key_value_heads=2, hidden_size=48)
    ok = LongContextConfig(backend="ulysses_zigzag", sp_size=4, backend_options={"ulysses_size": 2})
    check_model_config(ok, model_config, world_size=4)
    bad = LongContextConfig(backend="longctx_ulysses_distfa", sp_size=8, backend_options={"ulysses_size": 4})
    with pytest.raises(ConfigError, match=r"does not divide 6; set backend option ulysses_size to one of \[1, 2\]"):
        check_model_config(bad, model_config, world_size=8)
    with pytest.raises(ValueError, match="needs option ulysses_size"):
        LongContextConfig(backend="ulysses_tasp", sp_size=4)
