"""``apply_expert_parallel``: each MoE block keeps only its local experts and dispatches tokens to them.

What changes. The experts module of every MoE block (``block.experts`` of transformers' Qwen3-MoE,
Qwen2-MoE, Mixtral, OLMoE and GPT-OSS: fused ``gate_up_proj`` / ``down_proj`` tensors with the
experts on dim 0) is replaced by an :class:`ExpertParallelExperts` around it. Rank r of an EP group
of size ep keeps experts ``[r E/ep, (r + 1) E/ep)``: its expert parameters are replaced by copies of
those slices. The router, shared experts, router-logit outputs and everything else in the block stay
transformers' own: the block calls ``self.experts(hidden, top_k_index, top_k_weights)`` as before
and gets the same (tokens, hidden) result, computed through
:func:`~hf_longctx.moe.dispatch.dispatch_experts`.

Expert tensor parallelism (optional, ``expert_tp_size`` t > 1): the group then holds ep x t ranks
and the t ranks of one EP rank each keep a 1/t slice of their experts' intermediate dimension
(:mod:`~hf_longctx.moe.expert_tp`); the allgather dispatch over the whole group already sums their
partial outputs. The t ranks of one EP rank run the same (token, expert) pairs, each on a t times
smaller GEMM, so however the router skews its load they share it evenly.

State-dict keys do not change. The wrapper is an :class:`~hf_longctx.wrapping.InPlaceWrapper`: it
shares the wrapped module's parameter, buffer and child registries instead of holding it as a child, so
``model.layers.0.mlp.experts.gate_up_proj`` keeps its name (with E/ep rows on dim 0, and 2I/t on its
intermediate dimension). A rank's state
dict is its shard; :mod:`~hf_longctx.moe.checkpoint` merges shards into the full tensors and cuts a
full state dict into the shard a rank loads. Parameter names that optimizers, weight-decay lists or
DDP's ignore list use stay valid.

An EP group of one rank leaves the model unchanged: the unsharded block is transformers' own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..comm.groups import group_rank_and_size
from ..wrapping import InPlaceWrapper
from .dispatch import DISPATCHES, dispatch_experts
from .expert_tp import expert_tp_slices


def is_experts_module(module: nn.Module) -> bool:
    """A transformers fused-experts module: 3-D ``gate_up_proj`` and ``down_proj`` with the experts on dim 0."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3
            and down.dim() == 3 and isinstance(getattr(module, "num_experts", None), int)
            and gate_up.shape[0] == down.shape[0])


def find_experts_modules(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, experts module) of every fused experts module, wrapped or not, in model order."""
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, ExpertParallelExperts) or is_experts_module(child):
                found.append((parent, name, child))
    return found


class ExpertParallelExperts(InPlaceWrapper):
    """This rank's slice of a transformers experts module, run through expert-parallel dispatch.

    ``group`` holds ``ep x expert_tp_size`` ranks, expert-TP fastest: group rank g is EP rank
    ``g // expert_tp_size`` and expert-TP rank ``g % expert_tp_size``. ``experts`` is modified in
    place: its expert parameters become copies of this rank's slices (EP rank r keeps experts
    ``[r E/ep, (r + 1) E/ep)``; expert-TP rank j keeps slice j of their intermediate dimension, see
    :mod:`~hf_longctx.moe.expert_tp`). Its registries are shared, so parameter names are the wrapped
    module's. ``dispatch`` is ``"allgather"`` or ``"all_to_all"`` (allgather only with expert-TP);
    ``grouped_mm`` forces (True) or forbids (False) ``torch._grouped_mm`` (None: bf16/fp16 on CUDA);
    ``chunk_tokens`` dispatches long shards in chunks of that many tokens per rank.
    """

    def __init__(self, experts: nn.Module, group: dist.ProcessGroup | None, dispatch: str = "allgather",
                 grouped_mm: bool | None = None, chunk_tokens: int | None = None, expert_tp_size: int = 1):
        if isinstance(experts, ExpertParallelExperts):
            raise TypeError("these experts are already expert-parallel")
        if not is_experts_module(experts):
            raise TypeError(f"{type(experts).__name__} is not a fused experts module (gate_up_proj/down_proj "
                            "with the experts on dim 0)")
        if dispatch not in DISPATCHES:
            raise ValueError(f"unknown dispatch {dispatch!r}; choose one of {DISPATCHES}")
        if chunk_tokens is not None and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int)
                                         or chunk_tokens < 1):
            raise ValueError(f"chunk_tokens must be a positive int or None, got {chunk_tokens!r}")
        group_rank, group_size = group_rank_and_size(group)
        ep_rank, ep_size, tp_rank = _split_group(group_size, expert_tp_size, dispatch, group_rank)
        num_experts = experts.num_experts
        if num_experts % ep_size:
            raise ValueError(f"{num_experts} experts do not split over an expert-parallel group of {ep_size} ranks; "
                             f"ep_size must divide the number of experts")
        slices = expert_tp_slices(experts, expert_tp_size) if expert_tp_size > 1 else {}
        per_rank = num_experts // ep_size
        start = ep_rank * per_rank
        for name, param in list(experts._parameters.items()):
            if param is None:
                continue
            if type(param) is not nn.Parameter:
                raise TypeError(f"experts parameter {name} is a {type(param).__name__}; shard a plain model "
                                "(not one already sharded by transformers' distributed_config or FSDP)")
            if param.shape[0] != num_experts:
                raise ValueError(f"experts parameter {name} has {param.shape[0]} rows on dim 0, expected one per "
                                 f"expert ({num_experts})")
            local = param.detach()[start : start + per_rank]
            # a cut is already a copy (index_select); a plain slice is cloned so the full tensor can be freed
            local = slices[name].cut(local, tp_rank) if slices.get(name) is not None else local.clone()
            experts._parameters[name] = nn.Parameter(local, requires_grad=param.requires_grad)
        super().__init__(experts)  # shares the registries: names stay those of the wrapped module
        self.group, self.group_rank, self.group_size = group, group_rank, group_size
        self.ep_rank, self.ep_size = ep_rank, ep_size
        self.expert_tp_rank, self.expert_tp_size, self.expert_tp_slices = tp_rank, expert_tp_size, slices
        self.expert_start, self.num_local_experts, self.num_experts_total = start, per_rank, num_experts
        self.dispatch, self.grouped_mm, self.chunk_tokens = dispatch, grouped_mm, chunk_tokens
        self.record: dict | None = None  # set to a dict to receive rows_per_expert of each call (benchmarks)

    @property
    def experts(self) -> nn.Module:
        """The wrapped transformers experts module (holding this rank's slices)."""
        return self._wrapped

    def expert_tp_replicated(self) -> list[str]:
        """Names of parameters every expert-TP rank keeps whole (added by expert-TP rank 0 only)."""
        return [name for name, piece in self.expert_tp_slices.items() if piece is None]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        if hidden_states.dim() != 2 or top_k_index.shape != top_k_weights.shape:
            raise ValueError(f"experts take (tokens, hidden) states and (tokens, k) routing, got "
                             f"{tuple(hidden_states.shape)}, {tuple(top_k_index.shape)}, {tuple(top_k_weights.shape)}")
        return dispatch_experts(hidden_states, top_k_index, top_k_weights, self._wrapped, group=self.group,
                                rank=self.group_rank, world=self.group_size, expert_start=self.expert_start,
                                num_local_experts=self.num_local_experts, dispatch=self.dispatch,
                                grouped_mm=self.grouped_mm, chunk_tokens=self.chunk_tokens, record=self.record,
                                add_down_bias=self.expert_tp_rank == 0)

    def extra_repr(self) -> str:
        stop = self.expert_start + self.num_local_experts
        tp = f", expert_tp_rank={self.expert_tp_rank}/{self.expert_tp_size}" if self.expert_tp_size > 1 else ""
        return (f"experts [{self.expert_start}, {stop}) of {self.num_experts_total}, ep_rank={self.ep_rank}/"
                f"{self.ep_size}{tp}, dispatch={self.dispatch}, wraps={type(self._wrapped).__name__}")


def _split_group(group_size: int, expert_tp_size: int, dispatch: str, group_rank: int) -> tuple[int, int, int]:
    """(EP rank, EP size, expert-TP rank) of a group rank; raises if the sizes do not fit."""
    if isinstance(expert_tp_size, bool) or not isinstance(expert_tp_size, int) or expert_tp_size < 1:
        raise ValueError(f"expert_tp_size must be a positive int, got {expert_tp_size!r}")
    if expert_tp_size > 1 and dispatch != "allgather":
        raise ValueError(f"expert tensor parallelism runs with dispatch='allgather' only (every rank of the group "
                         f"needs every token routed to its experts), got {dispatch!r}")
    if group_size % expert_tp_size:
        raise ValueError(f"expert_tp_size {expert_tp_size} does not divide the {group_size} ranks of the expert "
                         f"group; the group must hold ep_size x expert_tp_size ranks")
    return group_rank // expert_tp_size, group_size // expert_tp_size, group_rank % expert_tp_size


def apply_expert_parallel(model: nn.Module, group: dist.ProcessGroup | None, dispatch: str = "allgather", *,
                          expert_tp_size: int = 1, grouped_mm: bool | None = None,
                          chunk_tokens: int | None = None) -> int:
    """Shard every MoE block's experts over ``group``; returns how many blocks changed.

    ``group`` holds ``ep_size x expert_tp_size`` ranks with different tokens, expert-TP fastest
    (``ParallelGroups.moe``; with ``expert_tp_size`` 1 it is the EP group, ``ParallelGroups.ep``).
    Experts are split over the EP ranks, and with ``expert_tp_size`` t > 1 each expert's
    intermediate dimension over the t ranks of an EP rank (Megatron's MoE TP x EP): tokens are
    gathered over the whole group, each rank computes its experts' pairs with its intermediate
    slice, and the reduce-scatter back sums the slices. Call it on every rank, after loading
    weights and before creating the optimizer or wrapping the model in DDP (see
    :func:`~hf_longctx.moe.ignore_expert_params_in_ddp`). None means the whole world. A group of
    one rank changes nothing (returns 0). ``dispatch``, ``grouped_mm`` and ``chunk_tokens``: see
    :class:`ExpertParallelExperts`.
    """
    if dispatch not in DISPATCHES:
        raise ValueError(f"unknown dispatch {dispatch!r}; choose one of {DISPATCHES}")
    found = find_experts_modules(model)
    if not found:
        raise ValueError(f"{type(model).__name__} has no fused MoE experts module (block.experts with 3-D "
                         "gate_up_proj/down_proj): expert parallelism covers Qwen2/3-MoE, Mixtral, OLMoE, GPT-OSS")
    if any(isinstance(experts, ExpertParallelExperts) for _, _, experts in found):
        raise ValueError("the model is already expert-parallel")
    group_rank, world = group_rank_and_size(group)
    _, ep_size, _ = _split_group(world, expert_tp_size, dispatch, group_rank)
    for _, name, experts in found:
        if experts.num_experts % ep_size:
            raise ValueError(f"ep_size {ep_size} does not divide the {experts.num_experts} experts of {name}; pick "
                             f"one of {[d for d in range(1, experts.num_experts + 1) if experts.num_experts % d == 0]}")
        if expert_tp_size > 1:
            expert_tp_slices(experts, expert_tp_size)  # raises before any block changed
    if world == 1:
        return 0
    for parent, name, experts in found:
        setattr(parent, name, ExpertParallelExperts(experts, group, dispatch, grouped_mm, chunk_tokens,
                                                    expert_tp_size))
    return len(found)


def expert_parallel_modules(model: nn.Module) -> list[tuple[str, ExpertParallelExperts]]:
    """(qualified name, module) of every expert-parallel experts module of ``model``."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, ExpertParallelExperts)]
