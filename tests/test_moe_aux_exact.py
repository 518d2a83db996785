"""The MoE router's load-balancing loss under ``LongContextCallback`` equals transformers' on the same rows.

Tiny float64 Qwen3-MoE, Mixtral and OLMoE (4 experts, top-2, ``router_aux_loss_coef=0.5``,
``output_router_logits=True``) run through the callback (its ``on_train_begin`` installs the input
hook and whatever else it installs) on packed rows and on right- and left-padded rows, in one process
and on 2 gloo processes. The reference is transformers' sdpa model on all ranks' rows as one batch
(with its ``attention_mask`` where rows are padded). Loss and every parameter gradient (routers
included) must agree at 1e-9.

transformers sums the router probabilities in float32 (``load_balancing_loss_func``), and its
causal-LM loss upcasts to float32; the reference therefore adds transformers' cross-entropy and its
masked aux formula written in float64 (:func:`aux_loss_fp64`, checked against transformers' own
``aux_loss`` to float32 precision), so the comparison resolves 1e-9.

With the tiled loss on (labels taken out of the call), the aux loss is still in the loss and the router
gradients, whether the callback installs it (its hooks after the tiled loss's, recompute-aware
checkpointing on) or ``apply_model_parallelism`` did before (its hooks first); without sharding the
tiled loss adds transformers' own aux. With ``average_tokens_across_devices=False`` on 2 processes of
one sequence-parallel group, DDP's average of the ranks' losses and gradients is the single-process
reference (the aux multiplied by the group size, as the LM loss's count is divided by it); so it is for a
model that sets ``accepts_loss_kwargs = False``, to which Trainer passes no count and scales nothing.

After ``apply_model_parallelism`` installed the aux loss for good, rank 0 alone runs an evaluation
forward and ``generate()``: they must run no collective (a spy raises at once; the gloo timeout is
short as well) and give transformers' own aux loss of those rows.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    TrainerControl,
    TrainerState,
)

import hf_longctx
from hf_longctx.hf import LongContextConfig, apply_model_parallelism, implementation_name
from hf_longctx.moe import enable_distributed_aux_loss, installed_aux_loss

from distributed import run_distributed
from trainer_runs import causal_lm_loss_fp64

VOCAB, COEF, EXPERTS, TOP_K = 61, 0.5, 4, 2
KINDS = ("qwen3_moe", "mixtral", "olmoe")
TOL = 1e-9


def tiny_moe(kind: str, impl: str):
    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 num_experts_per_tok=TOP_K, router_aux_loss_coef=COEF, output_router_logits=True,
                 initializer_range=0.2, max_position_embeddings=128, attn_implementation=impl, pad_token_id=0,
                 bos_token_id=1, eos_token_id=2)
    if kind == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape, intermediate_size=24, moe_intermediate_size=8, head_dim=4,
                                                   num_experts=EXPERTS))
    elif kind == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(**shape, intermediate_size=8, head_dim=4, num_local_experts=EXPERTS))
    else:
        model = OlmoeForCausalLM(OlmoeConfig(**shape, intermediate_size=8, num_experts=EXPERTS))
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # grouped GEMM takes no float64
    model.loss_function = causal_lm_loss_fp64
    return model.double().train()


def aux_loss_fp64(router_logits, attention_mask=None) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` (masked form) in float64 instead of its float32 sums."""
    keep = None if attention_mask is None else attention_mask.reshape(-1).double()
    counts = torch.zeros(EXPERTS, dtype=torch.float64)
    prob_sum = torch.zeros(EXPERTS, dtype=torch.float64)
    rows = 0.0
    for logits in router_logits:
        probs = torch.softmax(logits, dim=-1)
        selected = torch.topk(probs, TOP_K, dim=-1).indices
        weight = torch.ones(len(probs), dtype=torch.float64) if keep is None else keep
        counts = counts + torch.zeros(EXPERTS, dtype=torch.float64).scatter_add_(
            0, selected.reshape(-1), weight.repeat_interleave(TOP_K))
        prob_sum = prob_sum + (probs * weight[:, None]).sum(dim=0)
        rows = rows + weight.sum()
    return EXPERTS * torch.sum(counts / rows * (prob_sum / rows))


def reference(kind: str, batch: dict):
    """transformers' sdpa on ``batch`` (all ranks' rows): loss (float64 CE + coef x float64 aux) and gradients."""
    model = tiny_moe(kind, "sdpa")
    labels = batch["labels"]
    out = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False)
    aux = aux_loss_fp64(out.router_logits, batch.get("attention_mask"))
    torch.testing.assert_close(aux, out.aux_loss.double(), rtol=1e-6, atol=0)  # transformers' own, float32
    loss = causal_lm_loss_fp64(out.logits, labels, VOCAB) + COEF * aux
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def train_args(average_tokens_across_devices: bool = True, checkpointing: bool = False):
    return SimpleNamespace(device=torch.device("cpu"), max_grad_norm=1.0, gradient_accumulation_steps=1,
                           average_tokens_across_devices=average_tokens_across_devices,
                           activation_checkpointing=checkpointing, gradient_checkpointing=False, fsdp=None)


def callback_step(kind: str, backend: str, rows: dict, world: int, sp_size: int = 0, tiled_loss: int = 0,
                  checkpointing: bool = False, aux_before: bool = False, average_tokens_across_devices: bool = True,
                  accepts_loss_kwargs: bool = True):
    """One forward and backward of this rank's ``rows`` under LongContextCallback, the loss scaled as Trainer
    scales it; the loss and gradients the ``world`` ranks' DDP step trains on.

    ``average_tokens_across_devices`` True: Trainer's count covers the world and it multiplies each loss by
    the world size, DDP averages, so the step's loss is the SUM of the ranks' losses (each rank's count is
    left to the hook: the group's, the same when the group is the world). False: each rank's forward gets
    its own rows' count, nothing is multiplied, and the step's loss is the MEAN of the ranks' losses.
    ``accepts_loss_kwargs`` False: the model says so (as several transformers classes do), Trainer passes
    no count and multiplies nothing: the step's loss is the MEAN of the ranks' losses as well.
    ``aux_before``: the aux loss is installed before the callback (apply_model_parallelism on several
    processes; its hooks directly in one), so its model hooks come before the tiled loss's.
    """
    model = tiny_moe(kind, implementation_name(backend))
    if not accepts_loss_kwargs:
        model.accepts_loss_kwargs = False
    averaged = not average_tokens_across_devices or not accepts_loss_kwargs
    if aux_before:
        before = (apply_model_parallelism(model, LongContextConfig()).aux_loss if world > 1
                  else enable_distributed_aux_loss(model, group=None))
    callback = hf_longctx.LongContextCallback(LongContextConfig(backend=backend, sp_size=sp_size,
                                                                tiled_loss=tiled_loss))
    args = train_args(average_tokens_across_devices, checkpointing)
    state, control = TrainerState(), TrainerControl()
    if not average_tokens_across_devices and accepts_loss_kwargs:
        rows = {**rows, "num_items_in_batch": (rows["labels"][..., 1:] != -100).sum()}  # Trainer's, per process
    callback.on_train_begin(args, state, control, model=model)
    try:
        assert installed_aux_loss(model) is not None
        loss = model(**rows).loss
        loss.backward()
    finally:
        callback.on_train_end(args, state, control, model=model)
    if aux_before:  # kept, with the averaging it had before the run
        assert installed_aux_loss(model) is before and not before.averaged_over_processes
        before.remove()
    assert installed_aux_loss(model) is None  # taken off again: transformers' own aux after training
    total = loss.detach().clone()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    if world > 1:
        dist.all_reduce(total)
        for g in grads.values():
            dist.all_reduce(g)
        if averaged:  # DDP's average, nothing scaled up before it
            total /= world
            for g in grads.values():
                g /= world
    return total, grads


def assert_same(loss, grads, ref_loss, ref_grads, where: str) -> None:
    assert float(loss) == pytest.approx(float(ref_loss), rel=TOL, abs=0), where
    assert grads.keys() == ref_grads.keys()
    for name, want in ref_grads.items():
        torch.testing.assert_close(grads[name], want, rtol=TOL, atol=TOL * 1e-2,
                                   msg=lambda m, n=name: f"{where} {n}: {m}")
    assert any("gate" in n or "router" in n for n in grads)


# ---- batches ------------------------------------------------------------------------------------------------


def packed_rows(world: int, seed: int = 1) -> tuple[list[dict], dict]:
    """One packed row of several documents per rank; the reference is all of them as one packed row."""
    g = torch.Generator().manual_seed(seed)
    per_rank = [[5, 1, 9, 3], [7, 4, 6, 1]][:world] if world > 1 else [[5, 1, 9, 3, 7, 4, 6, 1]]
    rows = []
    for lens in per_rank:
        ids = torch.randint(3, VOCAB, (1, sum(lens)), generator=g)
        pos = torch.cat([torch.arange(n) for n in lens])[None]
        labels = ids.clone()
        labels[pos == 0] = -100  # a document's first token is no target of the previous one
        rows.append({"input_ids": ids, "position_ids": pos, "labels": labels})
    ref = {k: torch.cat([r[k] for r in rows], dim=1) for k in rows[0]}
    return rows, ref


def padded_rows(world: int, side: str, seed: int = 2) -> tuple[list[dict], dict]:
    """Two rows per rank padded to one length (rows of every rank alike long); the reference is (2 world, S)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [[11, 6], [4, 11]][:world] if world > 1 else [[11, 6, 4, 9]]
    width = 11
    rows = []
    for lens in lengths:
        ids = torch.zeros(len(lens), width, dtype=torch.long)
        mask = torch.zeros(len(lens), width, dtype=torch.long)
        for r, n in enumerate(lens):
            cols = slice(width - n, width) if side == "left" else slice(0, n)
            ids[r, cols] = torch.randint(3, VOCAB, (n,), generator=g)
            mask[r, cols] = 1
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    ref = {k: torch.cat([r[k] for r in rows]) for k in rows[0]}
    return rows, ref


BATCHES = {"packed": lambda world: packed_rows(world), "right": lambda world: padded_rows(world, "right"),
           "left": lambda world: padded_rows(world, "left")}
CASES = [(kind, "zigzag", batch) for kind in KINDS for batch in BATCHES] + [("qwen3_moe", "cad", "packed"),
                                                                            ("mixtral", "cad", "left")]


def check_cases(rank: int, world: int) -> None:
    for kind, backend, name in CASES:
        rows, ref_batch = BATCHES[name](world)
        ref_loss, ref_grads = reference(kind, ref_batch)
        loss, grads = callback_step(kind, backend, rows[rank], world)
        assert_same(loss, grads, ref_loss, ref_grads, f"{kind} {backend} {name} world={world}")


# (aux installed before the callback, recompute-aware checkpointing, batch): the aux's model hooks come after the
# tiled loss's when the callback installs it, before them when installed earlier
TILED_CASES = [(False, True, "packed"), (True, False, "left")]
TILE = 5  # tokens per chunk: several chunks per shard


def check_tiled_loss(rank: int, world: int) -> None:
    """With the tiled loss on, the aux loss is in the loss (and the router gradients) in either hook order."""
    for aux_before, checkpointing, name in TILED_CASES:
        rows, ref_batch = BATCHES[name](world)
        ref_loss, ref_grads = reference("qwen3_moe", ref_batch)
        loss, grads = callback_step("qwen3_moe", "zigzag", rows[rank], world, tiled_loss=TILE,
                                    checkpointing=checkpointing, aux_before=aux_before)
        assert_same(loss, grads, ref_loss, ref_grads, f"tiled loss, aux before={aux_before}, {name} world={world}")


def check_average_per_device(rank: int, world: int) -> None:
    """average_tokens_across_devices=False: DDP's average over the group's processes is what one process trains on
    (the group's token mean and its aux), as for the language-model loss; also when installed beforehand."""
    for aux_before, name in ((False, "right"), (True, "packed")):
        rows, ref_batch = BATCHES[name](world)
        ref_loss, ref_grads = reference("mixtral", ref_batch)
        loss, grads = callback_step("mixtral", "zigzag", rows[rank], world, aux_before=aux_before,
                                    average_tokens_across_devices=False)
        assert_same(loss, grads, ref_loss, ref_grads, f"average per device, aux before={aux_before}, {name}")
    # a model the Trainer passes no count to: the same averaging, the Trainer's argument left True
    rows, ref_batch = BATCHES["packed"](world)
    ref_loss, ref_grads = reference("qwen3_moe", ref_batch)
    loss, grads = callback_step("qwen3_moe", "zigzag", rows[rank], world, accepts_loss_kwargs=False)
    assert_same(loss, grads, ref_loss, ref_grads, "model without loss keywords, packed")


def test_callback_aux_loss_equals_transformers_in_one_process():
    check_cases(0, 1)
    check_tiled_loss(0, 1)


def test_tiled_loss_adds_transformers_own_aux_loss():
    """No sharding: transformers computes the aux, the tiled loss (labels taken out of the call) adds it."""
    _, batch = padded_rows(1, "right")
    model = tiny_moe("olmoe", "sdpa")
    with torch.no_grad():
        want = model(**batch)
        hf_longctx.hf.enable_tiled_loss(model, chunk_tokens=TILE)
        out = model(**batch)
    assert out.logits.numel() == 0
    assert float(out.loss) == pytest.approx(float(want.loss), rel=TOL, abs=0)
    torch.testing.assert_close(out.aux_loss, want.aux_loss, rtol=0, atol=0)


def test_callback_aux_loss_equals_transformers_on_two_processes():
    run_distributed(2, _two_processes, timeout_s=30)


def _two_processes(rank: int, world: int) -> None:
    check_cases(rank, world)
    check_tiled_loss(rank, world)
    check_average_per_device(rank, world)
    check_data_parallel_groups(rank)
    check_rank_zero_alone(rank, world)


def check_data_parallel_groups(rank: int) -> None:
    """sp_size 1 on 2 processes: each rank is its own sequence-parallel group, so its aux loss is the one
    transformers computes on its rows alone (what each device of plain DDP trains on), not the world's."""
    rows, _ = padded_rows(2, "right")
    mine = rows[rank]
    ref_loss, ref_grads = reference("olmoe", mine)
    loss, grads = callback_step("olmoe", "zigzag", mine, world=1, sp_size=1)
    assert_same(loss, grads, ref_loss, ref_grads, f"olmoe sp_size=1 rank={rank}")


# ---- a forward of one rank alone ------------------------------------------------------------------------------

_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast", "barrier",
                "reduce_scatter_tensor", "all_to_all_single")


def no_collectives() -> dict:
    """Replace torch.distributed's collectives by ones that raise; returns the originals to put back."""
    saved = {name: getattr(dist, name) for name in _COLLECTIVES}

    def refuse(name):
        def call(*args, **kwargs):
            raise AssertionError(f"dist.{name} ran in a forward of rank 0 alone: its peers would wait forever")
        return call

    for name in _COLLECTIVES:
        setattr(dist, name, refuse(name))
    return saved


def check_rank_zero_alone(rank: int, world: int) -> None:
    """After apply_model_parallelism (aux loss on for good), rank 0 alone evaluates and generates."""
    model = tiny_moe("qwen3_moe", "sdpa")
    done = apply_model_parallelism(model, LongContextConfig())
    assert done is not None and installed_aux_loss(model) is done.aux_loss
    if rank == 0:
        g = torch.Generator().manual_seed(3)
        ids = torch.randint(3, VOCAB, (2, 7), generator=g)
        mask = torch.ones_like(ids)
        mask[1, :3] = 0  # left padding: transformers' own aux leaves it out
        plain = tiny_moe("qwen3_moe", "sdpa").eval()
        model.eval()
        saved = no_collectives()
        try:
            with torch.no_grad():
                out = model(input_ids=ids, attention_mask=mask, labels=ids)
                want = plain(input_ids=ids, attention_mask=mask, labels=ids)
                generated = model.generate(ids[:1], max_new_tokens=3, do_sample=False)
        finally:
            for name, fn in saved.items():
                setattr(dist, name, fn)
        torch.testing.assert_close(out.aux_loss, want.aux_loss, rtol=0, atol=0)
        torch.testing.assert_close(out.loss, want.loss, rtol=0, atol=0)
        assert generated.shape == (1, 10)
    dist.barrier()
    done.aux_loss.remove()
    assert installed_aux_loss(model) is None
