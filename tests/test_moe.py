"""Expert parallelism equals the unsharded model: blocks, a DP x EP optimizer step, SP x EP and TP x SP x EP training.

Every rank builds the same tiny float64 model (eager experts: grouped GEMM takes no float64) and the
same inputs; the reference is the unsharded model on the tokens of all ranks. Every multi-process
check runs in ONE spawned world of 4 processes (EP groups of 2 and 3 are subgroups of it): starting
processes that import transformers costs more than the checks themselves on two cores.
"""

from __future__ import annotations

import copy
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import GptOssConfig, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

import hf_longctx  # noqa: F401 - registers the attention implementations
from hf_longctx.backends import default_strategy
from hf_longctx.comm.mesh import check_parallel_sizes, parallel_groups
from hf_longctx.hf import LongContextConfig, enable_tiled_mlp, implementation_name, shard_batch
from hf_longctx.hf.memory.checkpointing import enable_recompute_aware_checkpointing
from hf_longctx.hf.parallel.heads import apply_head_parallel_attention
from hf_longctx.layout import PackedBatch, shard_plan
from hf_longctx.moe import (
    ExpertParallelExperts,
    all_reduce_expert_grads,
    apply_expert_parallel,
    clip_grad_norm_,
    enable_distributed_aux_loss,
    expert_shards,
    gather_full_state_dict,
    gather_pieces,
    ignore_expert_params_in_ddp,
    merge_expert_shards,
    merge_shard,
    shard_state_dict,
)
from hf_longctx.moe.routing import expert_load

from distributed import run_distributed
from helpers import random_doc_lens

HIDDEN, EXPERTS, VOCAB = 16, 12, 61
BLOCK_KINDS = ["qwen3", "qwen2", "mixtral", "olmoe", "gpt_oss"]
EXACT = dict(rtol=1e-10, atol=1e-12)
ROUTER = dict(rtol=1e-6, atol=1e-9)  # routers take softmax in float32: their gradients are float32-exact
FP32_LOSS = dict(rtol=1e-6, atol=1e-7)  # transformers' cross-entropy runs in float32


def block_of(kind: str, top_k: int) -> torch.nn.Module:
    """A transformers MoE block with random float64 weights (the same on every rank)."""
    common = dict(hidden_size=HIDDEN, num_experts_per_tok=top_k, experts_implementation="eager")
    if kind == "qwen3":
        block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(moe_intermediate_size=8, num_experts=EXPERTS,
                                                      norm_topk_prob=top_k > 1, **common))
    elif kind == "qwen2":
        block = Qwen2MoeSparseMoeBlock(Qwen2MoeConfig(moe_intermediate_size=8, shared_expert_intermediate_size=12,
                                                      num_experts=EXPERTS, **common))
    elif kind == "mixtral":
        block = MixtralSparseMoeBlock(MixtralConfig(intermediate_size=8, num_local_experts=EXPERTS, **common))
    elif kind == "olmoe":
        block = OlmoeSparseMoeBlock(OlmoeConfig(intermediate_size=8, num_experts=EXPERTS, **common))
    else:
        block = GptOssMLP(GptOssConfig(intermediate_size=8, num_local_experts=EXPERTS, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=4, **common))
    block = block.double()
    gen = torch.Generator().manual_seed(10 * BLOCK_KINDS.index(kind) + top_k)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    return block


def run_block(block, x):
    out = block(x)
    return out[0] if isinstance(out, tuple) else out  # GPT-OSS also returns its router scores


def router_of(block):
    return block.router if hasattr(block, "router") else block.gate


def gathered_expert_grads(model) -> dict[str, torch.Tensor]:
    """Full gradients of the sharded expert parameters, all-gathered over their expert groups and put together.

    A piece kept whole by every expert-TP rank (``down_proj_bias``) is taken from expert-TP rank 0, the
    one that adds it: the others' gradient must be zero, which is checked.
    """
    out = {}
    shards = expert_shards(model)
    for prefix, module in ((n, m) for n, m in model.named_modules() if isinstance(m, ExpertParallelExperts)):
        for name, p in module.named_parameters(recurse=False):
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            key = f"{prefix}.{name}"
            pieces = gather_pieces(grad, module)
            if module.expert_tp_size > 1 and name in module.expert_tp_replicated():
                assert all(float(piece.abs().max()) == 0 for i, piece in enumerate(pieces) if i % module.expert_tp_size)
            out[key] = merge_shard(pieces, shards[key], key)
    return out


def check_block_case(group, kind, top_k, dispatch, chunk, counts, expert_tp=1, tp_groups=None) -> bool:
    """One block, one routing: output and every gradient equal the unsharded block; True if an expert got no token.

    ``group`` (None: a single process) is the expert group (EP x ``expert_tp`` ranks); its rank r holds
    tokens of ``counts[r]``. ``tp_groups`` (expert-TP group, a group of this rank alone): the gradient
    reduction and the clipping norm of the whole block are checked too.
    """
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    where = f"{kind} k={top_k} {dispatch} chunk={chunk} counts={counts} rank={rank}/{world} expert_tp={expert_tp}"
    ref = block_of(kind, top_k)
    block = copy.deepcopy(ref)
    if world > 1:
        assert apply_expert_parallel(block, group, dispatch, chunk_tokens=chunk, expert_tp_size=expert_tp) == 1, where
        if expert_tp > 1:  # the slices really are 1/t of the intermediate dimension
            experts = block.experts
            inter = experts.down_proj.shape[1] if experts.is_transposed else experts.down_proj.shape[2]
            assert inter == 8 // expert_tp and experts.num_local_experts == EXPERTS * expert_tp // world, where
    else:  # apply_expert_parallel leaves one rank's block to transformers; run the dispatch path anyway
        assert apply_expert_parallel(block, None, dispatch) == 0
        block.experts = ExpertParallelExperts(block.experts, None, dispatch, chunk_tokens=chunk)
    gen = torch.Generator().manual_seed(sum(counts) + top_k)
    x_all = torch.randn(1, sum(counts), HIDDEN, generator=gen, dtype=torch.float64)
    probe = torch.randn(1, sum(counts), HIDDEN, generator=gen, dtype=torch.float64)
    start = sum(counts[:rank])
    mine = slice(start, start + counts[rank])

    x_ref = x_all.clone().requires_grad_()
    out_ref = run_block(ref, x_ref)
    (out_ref * probe).sum().backward()
    ids = router_of(ref)(x_all.view(-1, HIDDEN))[2]

    x = x_all[:, mine].clone().requires_grad_()
    out = run_block(block, x)
    (out * probe[:, mine]).sum().backward()
    torch.testing.assert_close(out, out_ref[:, mine], **EXACT, msg=lambda m: f"output {where}: {m}")
    torch.testing.assert_close(x.grad, x_ref.grad[:, mine], **EXACT, msg=lambda m: f"input grad {where}: {m}")
    expert_grads = gathered_expert_grads(block) if world > 1 else {}
    for name, p in block.named_parameters():
        want = ref.get_parameter(name).grad
        if name in expert_grads:
            got = expert_grads[name]
        else:
            got = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            if world > 1:
                dist.all_reduce(got, group=group)
        tol = ROUTER if name.startswith(("gate.", "router.")) else EXACT
        torch.testing.assert_close(got, want, **tol, msg=lambda m, n=name: f"grad {n} {where}: {m}")
        if name not in expert_grads and tp_groups is not None:
            p.grad = got  # replicated, as DDP leaves dense gradients
    if tp_groups is not None:  # the one down_proj bias reaches every expert-TP rank; the norm counts it once
        expert_tp_group, alone = tp_groups
        all_reduce_expert_grads(block, alone, divide_by=1, expert_tp_group=expert_tp_group)
        for name in block.experts.expert_tp_replicated():
            torch.testing.assert_close(block.experts.get_parameter(name).grad,
                                       ref.experts.get_parameter(name).grad[block.experts.expert_start:][
                                           : block.experts.num_local_experts], **EXACT)
        norm = clip_grad_norm_(block, float("inf"))
        want = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters() if p.grad is not None]))
        torch.testing.assert_close(norm, want, **ROUTER, msg=lambda m: f"grad norm {where}: {m}")
    return bool((expert_load(ids, EXPERTS) == 0).any())


def check_blocks(group, top_ks=(1, 3), chunks=(None, 2), expert_tp=1, tp_groups=None):
    """Block output, input, router and expert gradients equal the unsharded block, for every model class."""
    world = dist.get_world_size(group) if group is not None else 1
    empty_expert_seen = False
    patterns = [[7, 0, 5, 9], [4, 6, 3, 8]]  # per-rank token counts; rank 1 holds none in the first
    variants = [("allgather", c) for c in chunks] + ([("all_to_all", None)] if expert_tp == 1 else [])
    for kind in BLOCK_KINDS:
        for top_k in top_ks:
            for dispatch, chunk in variants:
                for counts in patterns:
                    empty_expert_seen |= check_block_case(group, kind, top_k, dispatch, chunk, counts[:world],
                                                          expert_tp, tp_groups)
    assert empty_expert_seen, "no case routed zero tokens to some expert; the edge case went untested"


def test_expert_parallel_block_equals_unsharded_on_one_rank():
    check_blocks(None)


@pytest.mark.parametrize("kind", ["qwen3", "gpt_oss"])  # plain SwiGLU; transposed weights with biases
def test_grouped_gemm_path_equals_per_expert_loop(kind):
    """The grouped-GEMM expert path GPUs take (``torch._grouped_mm``, float32 on CPU) equals the loop."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no grouped GEMM")
    results = []
    for grouped in (True, False):
        block = block_of(kind, 3).float()
        block.experts = ExpertParallelExperts(block.experts, None, "allgather", grouped_mm=grouped)
        x = torch.randn(1, 40, HIDDEN, generator=torch.Generator().manual_seed(1)).requires_grad_()
        out = run_block(block, x)
        out.square().sum().backward()
        results.append([out, x.grad] + [p.grad for p in block.parameters()])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ---- whole models (world 4) ------------------------------------------------------------------------------


def tiny_qwen3_moe(impl: str = "sdpa") -> Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=24, moe_intermediate_size=8,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                         num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.5, output_router_logits=True,
                         initializer_range=0.2, max_position_embeddings=256, attn_implementation=impl,
                         experts_implementation="eager")
    return Qwen3MoeForCausalLM(cfg).double()


def packed_example(seed: int, total: int):
    lens = random_doc_lens(random.Random(seed), total, max_len=total // 2)
    ids = torch.randint(0, VOCAB, (1, total), generator=torch.Generator().manual_seed(seed))
    return PackedBatch.from_doc_lens(lens), ids


def assert_dense_and_expert_grads(model, ref, where, dense_group, tol=FP32_LOSS):
    """Dense grads summed over ``dense_group`` (DTensors gathered first) and gathered expert grads equal ``ref``'s."""
    expert = gathered_expert_grads(model)
    for name, p in model.named_parameters():
        want = ref.get_parameter(name).grad
        if name in expert:
            got = expert[name]
        else:
            got = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
            dist.all_reduce(got, group=dense_group)
        torch.testing.assert_close(got, want, **tol, msg=lambda m, n=name: f"grad {n} {where}: {m}")


def check_dp_ep_step_and_state_dict(rank, world, alone, ep=2, expert_tp=1):
    """DP x EP (x expert-TP): DDP ignores the expert slices, expert grads are averaged over their replicas only,
    and one clipped SGD step with the batch-exact aux loss equals one process on the whole batch. Shards merge
    back.

    Each rank's row goes through ``shard_batch`` on a group of its own (what the input hook does at
    sp_size 1): the batch-exact aux loss runs only in a sharded forward, since a plain forward may be
    one rank's alone (its all_reduce would wait forever); with the whole world as its explicit group,
    the ranks' shares add up to the aux loss of one process on every row."""
    groups = parallel_groups(sp_size=1, tp_size=1, ep_size=ep, expert_tp_size=expert_tp)
    seq = 9
    ids = torch.randint(0, VOCAB, (world, seq), generator=torch.Generator().manual_seed(3))
    ref = tiny_qwen3_moe()
    original = {k: v.clone() for k, v in ref.state_dict().items()}
    out_ref = ref(input_ids=ids, labels=ids)  # transformers: mean token loss + coef x aux over all 4 sequences
    out_ref.loss.backward()
    max_norm = 0.5 * float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]))
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    torch.optim.SGD(ref.parameters(), lr=1.0).step()

    model = tiny_qwen3_moe(implementation_name("zigzag"))
    assert apply_expert_parallel(model, groups.moe, expert_tp_size=expert_tp) == 2
    shards = expert_shards(model)
    # state dict: keys unchanged, shards of the EP group merge to the original, a full dict cuts back
    mine = model.state_dict()
    assert mine.keys() == original.keys()
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    group_ranks = dist.get_process_group_ranks(groups.moe)
    merged = merge_expert_shards([everyone[r] for r in group_ranks], shards)
    gathered = gather_full_state_dict(model)
    for key, value in original.items():
        torch.testing.assert_close(merged[key], value, rtol=0, atol=0, msg=lambda m, k=key: f"merged {k}: {m}")
        torch.testing.assert_close(gathered[key], value, rtol=0, atol=0, msg=lambda m, k=key: f"gathered {k}: {m}")
    fresh = tiny_qwen3_moe()
    apply_expert_parallel(fresh, groups.moe, expert_tp_size=expert_tp)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh.load_state_dict(shard_state_dict(original, fresh))
    for key, value in fresh.state_dict().items():
        torch.testing.assert_close(value, mine[key], rtol=0, atol=0)

    ignored = ignore_expert_params_in_ddp(model)
    assert len(ignored) == 4 and all(".mlp.experts." in n for n in ignored)
    enable_distributed_aux_loss(model, group=None)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    local = shard_batch({"input_ids": ids[rank : rank + 1], "position_ids": torch.arange(seq)[None]},
                        shard_plan(PackedBatch.from_doc_lens([seq]), 1, default_strategy("zigzag")), 0, alone)
    local["num_items_in_batch"] = torch.tensor(world * (seq - 1))  # Trainer's count: every rank's targets
    out = ddp(**local)
    (out.loss * world).backward()  # DDP averages over the world; each rank's loss is its share (Trainer's scaling)
    all_reduce_expert_grads(model, groups.expert_dp, expert_tp_group=groups.expert_tp)
    norm = clip_grad_norm_(model, max_norm)  # every rank the same factor: expert slices of the EP group counted
    torch.testing.assert_close(norm, ref_norm.to(norm.dtype), **FP32_LOSS)
    total = out.loss.detach().clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total, out_ref.loss.detach().to(total.dtype), **FP32_LOSS)
    aux = out.aux_loss.detach().clone()
    dist.all_reduce(aux)
    torch.testing.assert_close(aux, out_ref.aux_loss.detach().to(aux.dtype), **FP32_LOSS)
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    stepped = gather_full_state_dict(model)
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(stepped[key], value, **FP32_LOSS, msg=lambda m, k=key: f"after step {k}: {m}")


def one_rank_groups(world):
    """A process group of each rank alone (every rank creates all of them, in the same order)."""
    groups = [dist.new_group([r]) for r in range(world)]
    return groups[dist.get_rank()]


def sharded_reference(packed, ids, alone):
    """One process on the whole packed batch: zig-zag on a group of one rank, transformers' own aux loss."""
    ref = tiny_qwen3_moe(implementation_name("zigzag"))
    local = shard_batch({"input_ids": ids, "position_ids": packed.position_ids[None]},
                        shard_plan(packed, 1, default_strategy("zigzag")), 0, alone)
    out = ref(**local)
    out.loss.backward()
    return ref, out


def check_sp_ep_zigzag(rank, world, alone):
    """DP2 x SP2 x EP2: zig-zag attention over the sequence shards, experts over the same ranks, aux loss on,
    recompute-aware checkpointing."""
    groups = parallel_groups(sp_size=2, tp_size=1, ep_size=2)
    batches = [packed_example(seed, total=22 + 5 * seed) for seed in range(groups.dp_size)]
    packed = PackedBatch.from_doc_lens([n for p, _ in batches for n in p.doc_lens])
    ids = torch.cat([i for _, i in batches], dim=1)
    ref, out_ref = sharded_reference(packed, ids, alone)

    model = tiny_qwen3_moe(implementation_name("zigzag"))
    apply_expert_parallel(model, groups.ep)
    enable_distributed_aux_loss(model, group=None)
    model.train()
    enable_recompute_aware_checkpointing(model)  # the recipes' default: MoE blocks re-run (with collectives)
    with pytest.raises(ValueError, match="chunk_tokens"):
        enable_tiled_mlp(model, chunk_tokens=4)  # per-rank chunk counts would leave collectives unmatched
    my_packed, my_ids = batches[rank // 2]
    sp_rank = dist.get_rank(groups.sp)
    local = shard_batch({"input_ids": my_ids, "position_ids": my_packed.position_ids[None]},
                        shard_plan(my_packed, 2, default_strategy("zigzag")), sp_rank, groups.sp)
    local["num_items_in_batch"] = torch.tensor(sum(n - 1 for n in packed.doc_lens))  # targets of the world
    out = model(**local)
    out.loss.backward()
    all_reduce_expert_grads(model, groups.expert_dp, divide_by=1)
    total = out.loss.detach().clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total, out_ref.loss.detach().to(total.dtype), **FP32_LOSS)
    assert_dense_and_expert_grads(model, ref, f"sp2 ep2 rank={rank}", dense_group=None)


def check_tp_sp_ep_zigzag(rank, world, alone):
    """SP2 x TP2 x EP2: heads split by transformers' own TP plan under zig-zag attention, experts over EP."""
    groups = parallel_groups(sp_size=2, tp_size=2, ep_size=2)
    packed, ids = packed_example(11, total=30)
    ref, out_ref = sharded_reference(packed, ids, alone)

    model = tiny_qwen3_moe(implementation_name("zigzag"))
    assert apply_head_parallel_attention(model, groups.tp_mesh) == 12  # q, k, v, o, q_norm, k_norm x 2 layers
    assert model.model.layers[0].self_attn.q_proj.weight.to_local().shape[0] == 8  # 2 of 4 heads of width 4
    apply_expert_parallel(model, groups.ep)
    enable_distributed_aux_loss(model, group=groups.batch)
    sp_rank = dist.get_rank(groups.sp)
    local = shard_batch({"input_ids": ids, "position_ids": packed.position_ids[None]},
                        shard_plan(packed, 2, default_strategy("zigzag")), sp_rank, groups.sp)
    out = model(**local)
    out.loss.backward()
    total = out.loss.detach().clone()
    dist.all_reduce(total, group=groups.batch)
    torch.testing.assert_close(total, out_ref.loss.detach().to(total.dtype), **FP32_LOSS)
    assert_dense_and_expert_grads(model, ref, f"sp2 tp2 ep2 rank={rank}", dense_group=groups.batch)


def check_grad_sync_with_accumulation(rank, world):
    """ExpertGradSync: no reduction on accumulating backwards, one on the synchronising one, equal to reducing by
    hand after both; the all-reduce runs once per backward even with recompute-aware checkpointing."""
    from hf_longctx.hf.parallel.model_parallelism import ExpertGradSync

    groups = parallel_groups(ep_size=2)
    ids = torch.randint(0, VOCAB, (2, world, 7), generator=torch.Generator().manual_seed(5))[:, rank : rank + 1]
    by_hand, hooked = tiny_qwen3_moe(), tiny_qwen3_moe()
    for model in (by_hand, hooked):
        apply_expert_parallel(model, groups.ep)
        model.train()
        enable_recompute_aware_checkpointing(model)
    syncing = [False]
    sync = ExpertGradSync(hooked, groups.expert_dp, should_sync=lambda: syncing[0])
    for micro, batch in enumerate(ids):
        syncing[0] = micro == len(ids) - 1
        hooked(input_ids=batch, labels=batch).loss.backward()
        assert sync.syncs == micro  # nothing reduced while accumulating, once at the end
        by_hand(input_ids=batch, labels=batch).loss.backward()
    assert sync.syncs == 1
    all_reduce_expert_grads(by_hand, groups.expert_dp)
    for (name, p), q in zip(hooked.named_parameters(), by_hand.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=lambda m, n=name: f"grad {n}: {m}")
    sync.remove()


def check_world4(rank, world):
    """Everything that needs processes, in one spawned world (starting one costs more than its checks)."""
    alone = one_rank_groups(world)
    # blocks at EP sizes 2, 3, 4 (ranks outside a smaller group wait); every size covers both dispatches;
    # then expert-TP: EP1 x TP2 and EP2 x TP2
    for size, top_ks, chunks, expert_tp in ((2, (1, 3), (None, 2), 1), (3, (3,), (None, 2), 1), (4, (1,), (None,), 1),
                                            (2, (2,), (None,), 2), (4, (1, 3), (None, 2), 2)):
        group = dist.new_group(list(range(size)))  # every rank creates every group
        tp_groups = [dist.new_group(list(range(r, r + expert_tp))) for r in range(0, size, expert_tp)]
        if rank < size:
            mine = tp_groups[rank // expert_tp] if expert_tp > 1 else None
            check_blocks(group, top_ks, chunks, expert_tp, (mine, alone) if mine is not None else None)
        dist.barrier()
    check_dp_ep_step_and_state_dict(rank, world, alone)
    check_dp_ep_step_and_state_dict(rank, world, alone, ep=2, expert_tp=2)  # the whole world one expert group
    check_dp_ep_step_and_state_dict(rank, world, alone, ep=1, expert_tp=2)  # expert-TP pairs, replicas over DP
    check_grad_sync_with_accumulation(rank, world)
    check_sp_ep_zigzag(rank, world, alone)
    check_tp_sp_ep_zigzag(rank, world, alone)
    dist.barrier()  # every rank done with its collectives before the groups are torn down


def test_moe_blocks_ep2_to_ep4_dp_ep_step_sp_ep_and_tp_sp_ep_training():
    run_distributed(4, check_world4, timeout_s=300)


def test_parallel_sizes_are_validated_with_the_fix():
    assert check_parallel_sizes(8, sp_size=2, tp_size=2, ep_size=2, num_experts=4, num_heads=4, num_kv_heads=2) == 2
    with pytest.raises(ValueError, match="does not divide the 6 processes"):
        check_parallel_sizes(6, sp_size=4)
    with pytest.raises(ValueError, match="must divide the 4 ranks with different tokens"):
        check_parallel_sizes(8, tp_size=2, ep_size=3)
    with pytest.raises(ValueError, match="does not divide the model's 6 experts"):
        check_parallel_sizes(8, ep_size=4, num_experts=6)
    with pytest.raises(ValueError, match="does not split the model's 2 key/value heads"):
        check_parallel_sizes(8, tp_size=4, num_heads=8, num_kv_heads=2)
    with pytest.raises(ValueError, match="moe_dispatch"):
        LongContextConfig(moe_dispatch="alltoall")
    cfg = LongContextConfig(sp_size=2, tp_size=2, ep_size=2, moe_dispatch="all_to_all")
    assert cfg.resolved_sizes(8) == (2, 2, 2, 2)
    with pytest.raises(ValueError, match="ep_size 3"):
        LongContextConfig(ep_size=3).resolved_sizes(8)
    with pytest.raises(ValueError, match="unknown dispatch"):
        apply_expert_parallel(block_of("qwen3", 2), None, "alltoall")
    from hf_longctx.hf.integration.callback import check_moe_layout

    with pytest.raises(ValueError, match="experts are not sharded"):  # a recipe's ep_size is never ignored
        check_moe_layout(tiny_qwen3_moe(), LongContextConfig(ep_size=2), world=2)
    with pytest.raises(ValueError, match="ep_size 3 does not divide the model's 4 experts"):
        check_moe_layout(tiny_qwen3_moe(), LongContextConfig(ep_size=3), world=3)


def test_expert_tp_slices_follow_each_layout():
    """Concatenated [gate; up] keeps both halves' slices; GPT-OSS's interleaved, transposed layout a contiguous run."""
    from hf_longctx.moe import expert_tp_slices

    qwen = expert_tp_slices(block_of("qwen3", 2).experts, 2)
    assert (qwen["gate_up_proj"].dim, qwen["down_proj"].dim) == (1, 2)
    assert qwen["gate_up_proj"].positions(1).tolist() == [4, 5, 6, 7, 12, 13, 14, 15]  # I = 8: gate 4..7, up 12..15
    gpt = expert_tp_slices(block_of("gpt_oss", 2).experts, 2)
    assert (gpt["gate_up_proj"].dim, gpt["gate_up_proj_bias"].dim, gpt["down_proj"].dim) == (2, 1, 1)
    assert gpt["gate_up_proj"].positions(1).tolist() == list(range(8, 16)) and gpt["down_proj_bias"] is None
    full = block_of("gpt_oss", 2).experts.gate_up_proj.detach()
    piece = gpt["gate_up_proj"]
    assert torch.equal(piece.join([piece.cut(full, r) for r in range(2)]), full)
    with pytest.raises(ValueError, match="expert_tp_size 3 does not divide the experts' intermediate size 8"):
        expert_tp_slices(block_of("mixtral", 2).experts, 3)
    with pytest.raises(ValueError, match="dispatch='allgather' only"):
        apply_expert_parallel(block_of("qwen3", 2), None, "all_to_all", expert_tp_size=2)
    with pytest.raises(ValueError, match="expert_tp_size 2 does not divide the 1 ranks"):
        apply_expert_parallel(block_of("qwen3", 2), None, expert_tp_size=2)


def test_bench_moe_quick_runs_end_to_end():
    """The GPU benchmark's command line runs every mode, EP size 1 and 2, and the whole-model rows on CPU."""
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, str(root / "scripts" / "bench_moe.py"), "--quick", "--gpus", "2", "--shapes", "qwen3",
           "--routing", "skewed", "--model-layers", "1"]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for row in ("| qwen3 | skewed | local | - |", "| qwen3 | skewed | allgather | 2 |",
                "| qwen3 | skewed | all_to_all | 2 |", "| qwen3 model x1 | real | allgather | 2 |",
                "allgather at ep=1 / local, qwen3 skewed"):
        assert row in proc.stdout, row
