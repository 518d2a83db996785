"""``sequence_parallel_attention``: the one entry point of every distributed backend.

Inputs are this rank's rows of the global packed q/k/v, in ``plan.local_indices(rank)`` order.
Before the first collective of a plan, every rank checks its inputs and all ranks exchange a short
signature (plan and sliding window, shapes, dtype, backend, status) in one all_gather: a rank with
bad input makes every rank raise the same clear error at once instead of leaving its peers waiting
in a receive.

A sliding window (``window``, transformers' ``sliding_window``) runs on the plan's window view
(:meth:`~hf_longctx.layout.ShardPlan.with_window`), so every backend's pairs, transfers, schedules
and caches follow from it.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..comm.collectives import all_gather, is_distributed
from ..comm.groups import DTYPE_CODES, group_rank_and_size
from ..layout import ShardPlan
from .contract import Candidate
from .engine import RunContext
from .op import run_core_attention
from .options import BackendOptions, NoOptions, parse_options
from .registry import get_backend, registered_backends


def windowed_plan(plan: ShardPlan, window: int | None) -> ShardPlan:
    """``plan`` under a sliding window of ``window`` positions; ``window=None`` keeps the plan's own."""
    if window is None or plan.window == window:
        return plan
    if plan.window is not None:
        raise ValueError(f"the shard plan already has sliding window {plan.window}, the call asks for {window}; "
                         "pass the unwindowed plan (or the same window)")
    return plan.with_window(window)


@dataclass(frozen=True)
class AttentionRequest:
    """What one rank asked :func:`sequence_parallel_attention` for, as every step from checks to run sees it.

    A request, not a call: in this package a call is one kernel call (:class:`~hf_longctx.kernels.KernelCall`).

    ``plan`` is the plan the backend runs (its window view under a sliding window), ``window_problem``
    why the request's window could not be applied (every rank hears of it before any raises). ``causal`` is
    False for a bidirectional layer; ``options`` are ``backend``'s, already parsed (:func:`check_options`).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    plan: ShardPlan
    backend: str
    group: dist.ProcessGroup | None
    rank: int
    world: int
    causal: bool
    scale: float
    kernel: str
    options: BackendOptions = field(default_factory=NoOptions)
    window_problem: str | None = None


def _local_problem(request: AttentionRequest) -> str | None:
    """The checks every backend shares, then the backend's own :meth:`~.contract.Backend.validate`."""
    q, k, v, plan = request.q, request.k, request.v, request.plan
    backend, rank, world = request.backend, request.rank, request.world
    spec = get_backend(backend)
    if request.window_problem:
        return request.window_problem
    if not request.causal and not spec.bidirectional:
        able = [b.name for b in registered_backends() if b.bidirectional and b.sequence_parallel]
        return (f"this layer attends bidirectionally (is_causal=False) but backend {backend!r} computes causal "
                f"attention only; use {', '.join(able) or 'one process'} for sequence parallelism of bidirectional "
                "layers, or train without sequence parallelism")
    if not spec.sequence_parallel and world != 1:
        return (f"backend {backend!r} runs without sequence parallelism but the group has {world} ranks; "
                "use a distributed backend (ring, zigzag, distfa, ...) or a sequence-parallel size of 1")
    if plan.world_size != world:
        return (f"the shard plan is for {plan.world_size} ranks but the sequence-parallel group has {world}; "
                f"build it with shard_plan(batch, {world}, ...)")
    if plan.strategy not in spec.strategies:
        return (f"backend {backend!r} is exact only for strategies {spec.strategies}, got plan strategy "
                f"{plan.strategy!r}; use shard_plan(batch, world, {spec.default_strategy!r})")
    expected = plan.num_local_tokens(rank)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            return f"{name}_local must be (local_tokens, heads, head_dim), got shape {tuple(t.shape)}"
        if t.shape[0] != expected:
            return (f"{name}_local has {t.shape[0]} tokens but the plan gives rank {rank} {expected}; "
                    "index the global tensors with plan.local_indices(rank)")
    if q.shape[1] % k.shape[1]:
        return f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})"
    if q.dtype not in DTYPE_CODES or not (q.dtype == k.dtype == v.dtype):
        return f"q, k, v must share one float dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    return spec.validate(q, k, v, plan, world)


def _plan_fingerprint(plan: ShardPlan) -> int:
    digest = hashlib.blake2b(repr((plan.batch.doc_lens, plan.world_size, plan.strategy, plan.window)).encode(),
                             digest_size=7)
    return int.from_bytes(digest.digest(), "little")


def check_group_agrees(request: AttentionRequest) -> None:
    """Validate locally, then make sure every rank of the group runs the same problem (one all_gather).

    ``request.plan`` is the plan the backend will run (its window view under a sliding window), so ranks
    that disagree on the window stop here too. A plan that passed once for a group is not checked again.
    The plan remembers the group object itself, not its ``id``: a group created after another was freed may
    get the same ``id``, and a rank that took the old group's pass for its own would skip the all_gather its
    peers make (emulated groups come and go with every emulated step).
    """
    q, k, plan = request.q, request.k, request.plan
    backend, rank, world = request.backend, request.rank, request.world
    problem = _local_problem(request)
    if world == 1 or not is_distributed(request.group):
        if problem:
            raise ValueError(f"hf_longctx {backend}: {problem}")
        return
    key = ("validated", backend, request.group, q.shape[1:], k.shape[1:], q.dtype, plan.window)
    if problem is None and plan.has_cached(key):
        return
    backend_code = int.from_bytes(hashlib.blake2b(backend.encode(), digest_size=4).digest(), "little")
    sig = torch.tensor(
        [0 if problem is None else 1, _plan_fingerprint(plan), q.shape[1], k.shape[1], q.shape[2],
         DTYPE_CODES.get(q.dtype, 0), backend_code],
        dtype=torch.int64, device=q.device,
    )
    gathered = [torch.empty_like(sig) for _ in range(world)]
    all_gather(gathered, sig, request.group)
    rows = [g.tolist() for g in gathered]
    if problem:
        raise ValueError(f"hf_longctx {backend} on rank {rank}: {problem}")
    failed = [r for r, row in enumerate(rows) if row[0]]
    if failed:
        raise ValueError(f"hf_longctx {backend}: rank(s) {failed} of the sequence-parallel group rejected their "
                         "input (their error says why); this rank stops too instead of waiting for them")
    mismatch = [r for r, row in enumerate(rows) if row[1:] != rows[rank][1:]]
    if mismatch:
        raise ValueError(f"hf_longctx {backend}: rank(s) {mismatch} run a different plan, sliding window, head "
                         f"layout, dtype or backend than rank {rank}; every rank of a sequence-parallel group must "
                         "build the same shard plan from the same document lengths and use the same window")
    plan.cached(key, lambda: True)


def check_options(backend: str, options: BackendOptions | dict | None) -> BackendOptions:
    """``options`` as ``backend``'s options object (its :attr:`~.contract.Backend.options_type`): a mapping (or
    None) is parsed once, refusing a key the backend does not read (naming the closest one) and then a value it
    cannot run, since an ignored option would run another configuration than the one asked for, silently; an
    object of the type is taken as it is (it was checked when it was made). Every rank gets the same options, so
    every rank refuses them together, before any collective."""
    return parse_options(backend, get_backend(backend).options_type, options)


def make_run_context(request: AttentionRequest, backend: str | Candidate) -> RunContext:
    """The run of ``backend`` for this rank: its schedule, prepared state, forward and backward.

    A name runs with ``request.options`` when it is ``request.backend``, else with its own defaults; a
    :class:`~.contract.Candidate` (what :meth:`~.contract.Backend.resolve` names, e.g. ``auto``'s choice) runs with
    the candidate's options."""
    if isinstance(backend, Candidate):
        name, options = backend.backend, backend.options
    else:
        name = backend
        options = request.options if backend == request.backend else get_backend(backend).options_type()
    return get_backend(name).run_context(request.plan, request.group, request.rank, request.world, request.scale,
                                         request.kernel, options, request.causal)


def _rank_and_world(group: dist.ProcessGroup | None, rank: int | None) -> tuple[int, int]:
    """(rank in ``group``, group size): the caller's rank when it already knows it, else the group's."""
    if rank is None:
        return group_rank_and_size(group)
    return rank, group_rank_and_size(group)[1]


def sequence_parallel_attention(
    q_local: torch.Tensor,
    k_local: torch.Tensor,
    v_local: torch.Tensor,
    *,
    plan: ShardPlan,
    backend: str = "distfa",
    group: dist.ProcessGroup | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    kernel: str = "auto",
    options: BackendOptions | dict | None = None,
    window: int | None = None,
    rank: int | None = None,
) -> torch.Tensor:
    """Exact attention of this rank's queries over the whole packed sequence (causal unless ``causal=False``).

    ``q_local = q_global[plan.local_indices(rank)]`` (token-major (T, H, D), GQA allowed), likewise
    k/v. Returns this rank's output rows in the same order; autograd gives exact gradients to the
    three local inputs. ``backend`` is one of :func:`~hf_longctx.backends.registry.backend_names`
    (``"auto"`` times the candidates once per problem shape and keeps the fastest, see :mod:`.auto`);
    ``kernel`` is ``"auto"`` or a registered kernel name (:func:`~hf_longctx.kernels.kernel_names`);
    ``options`` tune a backend: its options object (CAD: :class:`~.cad.options.CadOptions`) or a mapping
    parsed into one here (``{"eps": 0.01}``); a key the backend does not read (its ``option_names``) is
    refused before any collective. ``window``: sliding window in positions,
    transformers' ``sliding_window`` (a query at document position p sees keys p - window + 1 .. p);
    None for plain causal attention (or the window of a plan from ``plan.with_window``). Every backend
    honours it exactly and skips blocks and key rows beyond it. ``rank``: this rank's index in
    ``group`` when the caller already has it (the transformers layer's context carries it); None asks
    the group.
    """
    options = check_options(backend, options)
    rank, world = _rank_and_world(group, rank)
    try:
        run_plan, window_problem = windowed_plan(plan, window), None
    except ValueError as exc:
        run_plan, window_problem = plan, str(exc)
    request = AttentionRequest(q_local, k_local, v_local, run_plan, backend, group, rank, world, causal,
                               softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q_local.shape[-1]),
                               kernel, options, window_problem)
    check_group_agrees(request)
    run = make_run_context(request, resolve_backend(request))
    return run_core_attention(q_local, k_local, v_local, run)


def resolve_backend(request: AttentionRequest) -> Candidate:
    """The backend that runs, with its options: ``request.backend`` itself, or the one it chooses (``auto``: priced,
    then the candidates that could win timed on these inputs, cached)."""

    def probe(candidate: Candidate) -> tuple[torch.Tensor, torch.Tensor]:
        return make_run_context(request, candidate).forward(request.q, request.k, request.v)

    return get_backend(request.backend).resolve(request.q, request.k, request.v, request.plan, request.group, probe,
                                                request.options, request.kernel)

