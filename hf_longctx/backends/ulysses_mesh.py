"""Two-dimensional sequence parallelism: Ulysses inside a node, a ring-family backend (or CAD) across nodes.

The sequence-parallel group of P = U x R ranks is a mesh: rank ``g = o * U + i`` is inner rank ``i`` of
outer shard ``o``. The U consecutive ranks of one outer shard (one node, when ranks are numbered node
by node) form an *inner* group; the R ranks with the same inner index form an *outer* group.

Placement. The plan is the outer backend's own placement over all P ranks (zigzag, doc_zigzag,
contiguous, cad). The tokens of the U ranks of an inner group, put together, are then that same
placement over R ranks (R chunks of a contiguous cut; the two mirrored halves of a zig-zag; the front
and back pieces of every document): :func:`outer_plan` builds that R-rank plan. So the plan is made from
the backend name and the group size alone, as for every other backend, and ``ulysses_size`` changes
which tokens an inner group holds, never which tokens a rank holds.

Run. Ulysses' all_to_all over the inner group turns (outer shard / U tokens, all heads) into (the whole
outer shard, heads / U), KV heads repeated just enough to split, as :mod:`.ulysses` does; the rows are
put in the outer plan's order; the outer backend then runs over the outer group on that shard with
heads / U (its schedule, caches and CAD tasks on the R-rank plan); the inverse all_to_all returns
outputs and lse. Backward repeats the inner exchanges (nothing head-sharded is kept), runs the outer
backend's backward, returns dq/dk/dv and adds the gradients of repeated KV heads onto their head.

Exact for everything the outer backend is exact for (packed documents, GQA, sliding windows): the outer
backend sees an ordinary R-rank problem, and the inner exchange only moves rows and heads.
"""

from __future__ import annotations

from dataclasses import MISSING, field, fields, make_dataclass

import torch
import torch.distributed as dist

from ..comm.mode import ops_for
from ..comm.subgroups import SubGroupMismatch
from ..layout import ShardPlan
from ..layout.plan import Piece, Slot
from .contract import Backend
from .engine import RunContext
from .options import BackendOptions, parse_options
from .prediction import AttentionShape, RankWork
from .registry import get_backend
from .ulysses import exchange_transfers, heads_to_tokens, kv_repeat, tokens_to_heads

OPTION = "ulysses_size"
OUTER_BACKENDS = ("zigzag", "distfa", "tasp", "ring", "cad")


def composed_name(outer: str) -> str:
    """Registry name of Ulysses over ``outer``: ``ulysses_<outer>`` (attention name ``longctx_ulysses_<outer>``)."""
    return f"ulysses_{outer}"


def mesh_sizes(world: int, ulysses_size: int) -> tuple[int, int]:
    """(inner, outer) sizes of a group of ``world`` ranks with ``ulysses_size`` ranks per Ulysses group."""
    if world % ulysses_size:
        fits = [d for d in range(1, world + 1) if world % d == 0]
        raise ValueError(f"ulysses_size {ulysses_size} does not divide the {world} ranks of the sequence-parallel "
                         f"group; set backend option ulysses_size to one of {fits} (the GPUs of one node)")
    return ulysses_size, world // ulysses_size


def mesh_problem(ulysses_size: int | None, world: int, query_heads: int, kv_heads: int) -> str | None:
    """Why a group of ``world`` ranks cannot run a model of these heads with ``ulysses_size`` ranks per Ulysses
    group (one sentence naming the fix), or None: checked before the model is built (see
    :func:`hf_longctx.hf.preflight.check_model_config`) and again by the first forward."""
    if ulysses_size is None:
        return f"needs backend option {OPTION} (ranks per Ulysses group, e.g. the GPUs of one node)"
    try:
        mesh_sizes(world, ulysses_size)
    except ValueError as err:
        return str(err)
    try:
        kv_repeat(query_heads, kv_heads, ulysses_size)
    except ValueError:
        fits = [d for d in range(1, world + 1) if world % d == 0 and query_heads % d == 0]
        return (f"Ulysses splits the model's {query_heads} query heads over the {ulysses_size} ranks of an inner "
                f"group, and {ulysses_size} does not divide {query_heads}; set backend option {OPTION} to one of "
                f"{fits}")
    return None


def _merged_slot(pieces: list[Piece], offset: int) -> Slot:
    """One slot of ``pieces`` (global order, adjacent pieces of a document joined); a document in two runs is
    refused, since a slot holds at most one piece per document."""
    merged: list[Piece] = []
    for p in sorted(pieces, key=lambda p: p.start):
        if merged and merged[-1].doc == p.doc and merged[-1].end == p.start:
            merged[-1] = Piece(p.doc, merged[-1].start, p.end)
        elif merged and merged[-1].doc == p.doc:
            raise ValueError(f"document {p.doc} falls in two runs of one slot of an outer shard; the placement "
                             "cannot be grouped by inner rank (use the outer backend's default strategy)")
        else:
            merged.append(p)
    return Slot(tuple(merged), offset)


def outer_plan(plan: ShardPlan, inner: int) -> ShardPlan:
    """The placement of ``plan`` seen by outer shards: shard ``o`` holds the tokens of ranks ``o * inner`` ..
    ``o * inner + inner - 1``, slot by slot (its s-th slot is the union of their s-th slots). Same strategy and
    sliding window as ``plan``; built once per plan and inner size."""

    def build() -> tuple[ShardPlan, ShardPlan]:
        outer = plan.world_size // inner
        slots = []
        for o in range(outer):
            members = [plan.rank_slots(o * inner + i) for i in range(inner)]
            count = max(len(m) for m in members)
            rank_slots, offset = [], 0
            for s in range(count):
                slot = _merged_slot([p for m in members if s < len(m) for p in m[s].pieces], offset)
                rank_slots.append(slot)
                offset = slot.end
            slots.append(tuple(rank_slots))
        base = ShardPlan(plan.batch, outer, plan.strategy, tuple(slots))
        return base, base.with_window(plan.window)  # the unwindowed plan kept alive beside its window view

    return plan.cached(("ulysses_outer_plan", inner), build)[1]


def _outer_order(plan: ShardPlan, outer: ShardPlan, inner: int, o: int, device: torch.device) -> torch.Tensor | None:
    """Row of the inner ranks' concatenation (rank order) that holds each row of outer shard ``o`` (None: same)."""

    def build() -> torch.Tensor | None:
        concat = torch.cat([plan.local_indices(o * inner + i) for i in range(inner)])
        where = torch.empty(plan.batch.num_tokens, dtype=torch.int64)
        where[concat] = torch.arange(concat.numel())
        order = where[outer.local_indices(o)]
        return None if torch.equal(order, torch.arange(order.numel())) else order

    order = plan.cached(("ulysses_outer_order", inner, o), build)
    return None if order is None else order.to(device)


def mesh_members(world: int, inner: int) -> list[tuple[int, ...]]:
    """Group ranks of every group of the ``inner`` x ``world / inner`` mesh, in one order: the inner groups (outer
    shard by outer shard), then the outer groups (inner index by inner index)."""
    outer = world // inner
    return [tuple(range(o * inner, (o + 1) * inner)) for o in range(outer)] + \
        [tuple(range(i, world, inner)) for i in range(inner)]


def mesh_groups(group: dist.ProcessGroup | None, rank: int, world: int, inner: int) -> tuple:
    """(inner group, outer group) of this rank in the U x R mesh of ``group``, made once per group and size.

    The group's comm mode makes them (:meth:`~hf_longctx.comm.mode.CommOps.sub_groups`), as groups of its own mode:
    under torch.distributed every rank of the world takes part, so every rank of the world calls this at the same
    attention call, as it does in training, where every data-parallel replica runs the same layers. Ranks of one
    group given different sizes all raise here, none waits. A group of one rank may be None."""
    if world == 1:
        return None, None
    try:
        made = ops_for(group).sub_groups(mesh_members(world, inner), inner)
    except SubGroupMismatch as err:
        raise ValueError(f"the ranks of a sequence-parallel group run different {OPTION}s ({err.settings}: group "
                         f"ranks -> sizes); give every rank the same backend options") from None
    o, i = divmod(rank, inner)
    return made[o], made[world // inner + i]


def _size_problem(size: object) -> str | None:
    if size is None:
        return f"needs option {OPTION} (ranks per Ulysses group, e.g. the GPUs of one node): backend_options: " \
               f"{{{OPTION}: 8}}"
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        return f"{OPTION} must be a whole number >= 1 (ranks per Ulysses group), got {size!r}"
    return None


def mesh_options_type(outer: str) -> type[BackendOptions]:
    """The options of ``ulysses_<outer>``: ``ulysses_size`` (required), then every option of ``outer`` with its
    default; :meth:`outer_options` gives the outer backend its own options object. Made once per outer backend
    and kept as a module attribute, so that the objects pickle like any other backend's options."""
    outer_type = get_backend(outer).options_type
    own = [f for f in fields(outer_type) if f.init]

    def default_of(f):
        return f.default if f.default is not MISSING else f.default_factory()

    def problem(self) -> str | None:
        size = _size_problem(self.ulysses_size)
        if size:
            return size
        try:
            self.outer_options()
        except ValueError as err:
            return str(err)
        return None

    def outer_options(self) -> BackendOptions:
        return outer_type(**{f.name: getattr(self, f.name) for f in own})

    def given(self) -> dict[str, object]:  # the defaults alone are no valid object (ulysses_size is required)
        return {OPTION: self.ulysses_size} | {f.name: getattr(self, f.name) for f in own
                                              if getattr(self, f.name) != default_of(f)}

    spec = [(OPTION, "int | None", field(default=None))]
    spec += [(f.name, f.type, field(default=f.default) if f.default is not MISSING
              else field(default_factory=f.default_factory)) for f in own]
    name = f"Ulysses{outer.title().replace('_', '')}Options"
    cls = make_dataclass(name, spec, bases=(BackendOptions,), frozen=True,
                         namespace={"problem": problem, "outer_options": outer_options, "given": given,
                                    "__module__": __name__})
    globals()[name] = cls
    return cls


class UlyssesMeshBackend(Backend):
    """Backend ``ulysses_<outer>``: Ulysses over inner groups of ``ulysses_size`` consecutive ranks, ``outer`` over
    the groups of ranks with the same inner index (module docstring). Option ``ulysses_size`` (required), then the
    outer backend's own options (:func:`mesh_options_type`)."""

    def __init__(self, outer: str):
        spec = get_backend(outer)
        self.outer = outer
        self.name = composed_name(outer)
        self.summary = f"Ulysses inside groups of ulysses_size ranks (a node), {outer} across them"
        self.default_strategy = spec.default_strategy
        self.strategies = spec.strategies
        self.bidirectional = spec.bidirectional
        self.auto_candidate_for = spec.auto_candidate_for
        self.makes_groups = True  # the inner and outer groups, made at the first call (mesh_groups)
        self.options_type = mesh_options_type(outer)

    @property
    def _outer_spec(self) -> Backend:
        return get_backend(self.outer)

    def validate(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: ShardPlan, world: int):
        return None  # the heads are checked against ulysses_size, which only the run's options know

    def run_context(self, plan: ShardPlan, group: dist.ProcessGroup | None, rank: int, world: int, scale: float,
                    kernel: str, options: BackendOptions | None = None, causal: bool = True) -> RunContext:
        # the same options on every rank: every rank refuses a missing ulysses_size before any collective
        options = parse_options(self.name, self.options_type, options)
        inner, outer = mesh_sizes(world, options.ulysses_size)
        inner_group, outer_group = mesh_groups(group, rank, world, inner)
        o, i = divmod(rank, inner)
        oplan = outer_plan(plan, inner)
        outer_run = self._outer_spec.run_context(oplan, outer_group, o, outer, scale, kernel, options.outer_options(),
                                                 causal)
        state = {"name": self.name, "inner": inner, "inner_rank": i, "inner_group": inner_group, "outer_run": outer_run,
                 "outer_index": o, "outer_plan": oplan}
        return RunContext(plan, (), group, rank, scale, kernel, self.forward, self.backward, options=options,
                          state=state, causal=causal)

    def forward(self, run: RunContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        state = run.state
        rep, order, to_outer = _exchange(run, q, k)
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        qo, ko, vo = (to_outer(t) for t in (q, k, v))
        out, lse = state["outer_run"].forward(qo, ko, vo)
        back = _from_outer(run, order)
        return back(out), back(lse.t().unsqueeze(-1).contiguous()).squeeze(-1).t().contiguous()

    def backward(self, run: RunContext, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor):
        state = run.state
        rep, order, to_outer = _exchange(run, q, k)
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        qo, ko, vo, outo, douto = (to_outer(t) for t in (q, k, v, out, dout.contiguous()))
        lseo = to_outer(lse.t().unsqueeze(-1).contiguous()).squeeze(-1).t().contiguous()
        dq, dk, dv = state["outer_run"].backward(douto, qo, ko, vo, outo, lseo)
        back = _from_outer(run, order)
        dq, dk, dv = back(dq), back(dk), back(dv)
        if rep > 1:  # repeated KV heads: their gradients add up on the original head
            dk = dk.view(dk.shape[0], -1, rep, dk.shape[2]).sum(2)
            dv = dv.view(dv.shape[0], -1, rep, dv.shape[2]).sum(2)
        return dq, dk, dv

    def attention_load(self, plan: ShardPlan) -> list[int]:
        """Without the run's ``ulysses_size`` the split is unknown: the pairs of each rank's own queries."""
        return super().attention_load(plan)

    def auto_candidate_options(self, world: int, shape: AttentionShape, node_size: int) -> BackendOptions | None:
        """A candidate past one node only (inside one, Ulysses alone or the outer backend alone serve): Ulysses over
        each node's ``node_size`` ranks, when they split the query heads, and the outer backend across nodes."""
        if not self.auto_candidate_for or world <= node_size or \
                mesh_problem(node_size, world, shape.heads, shape.kv_heads) is not None:
            return None
        rep = kv_repeat(shape.heads, shape.kv_heads, node_size)
        if self._outer_spec.auto_candidate_options(world // node_size, shape.split_heads(node_size, rep), node_size) \
                is None:
            return None
        return parse_options(self.name, self.options_type, {OPTION: node_size})

    def rank_work(self, plan: ShardPlan, shape: AttentionShape, options: BackendOptions) -> list[RankWork] | None:
        """The outer backend's work on the outer plan with a U-th of the heads, on every inner index's outer
        group, plus each rank's Ulysses exchanges inside its inner group (:func:`~.ulysses.exchange_transfers`)."""
        options = parse_options(self.name, self.options_type, options)
        world = plan.world_size
        inner, _ = mesh_sizes(world, options.ulysses_size)
        try:
            rep = kv_repeat(shape.heads, shape.kv_heads, inner)
        except ValueError:
            return None
        outer_work = self._outer_spec.rank_work(outer_plan(plan, inner), shape.split_heads(inner, rep),
                                                options.outer_options())
        if outer_work is None:
            return None
        work = []
        for g in range(world):
            o, i = divmod(g, inner)
            members = [o * inner + j for j in range(inner)]
            transfers = exchange_transfers([plan.num_local_tokens(m) for m in members], i, shape, members)
            transfers += [(kind, {p * inner + i: n for p, n in sent.items()}) for kind, sent in outer_work[o].transfers]
            work.append(RankWork(list(outer_work[o].segments), outer_work[o].calls, transfers, outer_work[o].heads))
        return work


def _inner_counts(run: RunContext) -> list[int]:
    state = run.state
    inner, o = state["inner"], state["outer_index"]
    return [run.plan.num_local_tokens(o * inner + j) for j in range(inner)]


def _exchange(run: RunContext, q: torch.Tensor, k: torch.Tensor):
    """(KV repeat, outer-order rows, function taking a (T_local, H, D) tensor to the outer shard's (T, H / U, D))."""
    state = run.state
    inner = state["inner"]
    try:
        rep = kv_repeat(q.shape[1], k.shape[1], inner)
    except ValueError:  # the same heads on every rank (agreed before the run): every rank raises here
        raise ValueError(f"hf_longctx {run.state['name']}: Ulysses splits the {q.shape[1]} query heads "
                         f"over the {inner} ranks of an inner group, and {inner} does not divide {q.shape[1]}; set "
                         f"backend option {OPTION} to a divisor of {q.shape[1]}") from None
    order = _outer_order(run.plan, state["outer_plan"], inner, state["outer_index"], q.device)
    counts = _inner_counts(run)

    def to_outer(x: torch.Tensor) -> torch.Tensor:
        rows = tokens_to_heads(x, counts, state["inner_rank"], state["inner_group"])
        return rows if order is None else rows[order]

    return rep, order, to_outer


def _from_outer(run: RunContext, order: torch.Tensor | None):
    state = run.state
    counts = _inner_counts(run)

    def back(x: torch.Tensor) -> torch.Tensor:
        if order is not None:
            rows = torch.empty_like(x)
            rows[order] = x
            x = rows
        return heads_to_tokens(x, counts, state["inner_rank"], state["inner_group"])

    return back
