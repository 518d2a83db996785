"""The memory planner: the fastest memory options that fit the GPU and the host.

Six knobs decide whether a long context fits a GPU: per decoder layer, no checkpointing,
recompute-aware or layer checkpointing, and whether the checkpoint waits on the host; the tiled
loss's and the tiled MLP's chunk sizes; where the optimizer states live. :func:`plan_memory` picks
them from a transformers config, the tokens per GPU and the GPU's and host's sizes: for every global
choice (tiles, optimizer place) it searches the per-layer layouts (:class:`_Search`) that fit the
memory model (:mod:`.model`) and keeps the one the cost model (:mod:`.costs`) prices lowest, and
returns a :class:`~.plan.MemoryPlan`. The optimizer goes to the host only where it is allowed and
nothing fits with it on the GPU (its host AdamW step costs seconds). When nothing fits,
:class:`MemoryPlanError` names the shortfall and what would fit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ..settings.schema import GROUP_MODE, ConfigError
from .adam_states import AdamStates
from .costs import LOSS_CHUNKS, MLP_CHUNKS, StepCosts
from .kernel_buffers import CALIBRATION_KERNEL
from .machine import gpu_memory_bytes, host_memory_bytes
from .model import CHECKPOINTING_CHOICES, PRECISIONS, LayerChoice, MemoryModel, ModelShape, format_gib, usable_gpu_bytes
from .plan import MemoryPlan


class MemoryPlanError(ConfigError):
    """No plan fits: the message names the shortfall and what would make the run fit."""



class Grouping(NamedTuple):
    """``count`` checkpoints of ``size`` consecutive layers each (``size`` 1: no groups)."""

    size: int = 1
    count: int = 0

    @property
    def layers(self) -> int:
        return self.size * self.count if self.size > 1 else 0


NO_GROUPS = Grouping()

GROUP_SIZES = (2, 3, 4)
"""Layers per group the planner tries, smallest first, and only where nothing fits without groups: a group's
backward holds the recomputed tensors of its lower layers (more memory in flight, no fewer FLOPs)."""


def _layout(L: int, n_none: int, n_layer: int, n_off: int, grouping: Grouping = NO_GROUPS) -> list[LayerChoice]:
    """Per-layer choices from counts: offloaded checkpoints first (their copies have the most time to hide),
    groups (``n_layer`` counts their layers) before recompute-aware before layer checkpointing, non-checkpointed
    layers last (their activations are used, and freed, first in backward)."""
    n_ckpt = L - n_none
    units = [["layer"] + [GROUP_MODE] * (grouping.size - 1)] * grouping.count if grouping.layers else []
    units += [["recompute_aware"]] * (n_ckpt - n_layer) + [["layer"]] * (n_layer - grouping.layers)
    return ([LayerChoice(m, i < n_off and m != GROUP_MODE) for i, unit in enumerate(units) for m in unit]
            + [LayerChoice("none")] * n_none)


@dataclass
class _Budget:
    gpu: int
    host: int


class _Search:
    """Finds the cheapest per-layer layout for one global choice (tiles, optimizer place)."""

    def __init__(self, model: MemoryModel, costs: StepCosts, budget: _Budget, modes: tuple[str, ...],
                 allow_offload: bool, grouping: Grouping = NO_GROUPS):
        self.model, self.costs, self.budget, self.modes, self.allow_offload = model, costs, budget, modes, allow_offload
        self.L = model.shape.layers
        self.grouping = grouping

    def _layout(self, n_none: int, n_layer: int, n_off: int) -> list[LayerChoice]:
        return _layout(self.L, n_none, n_layer, n_off, self.grouping)

    def fits(self, layers) -> bool:
        return (self.model.gpu_peak(layers)[0] <= self.budget.gpu
                and sum(self.model.host_items(layers).values()) <= self.budget.host)

    def min_offload(self, n_none: int, n_layer: int) -> int | None:
        """Fewest offloaded layers that fit (None: nothing fits with these counts)."""
        n_ckpt = self.L - n_none
        top = n_ckpt - self.grouping.layers + self.grouping.count if self.allow_offload else 0  # checkpoints

        def gpu_ok(k):
            return self.model.gpu_peak(self._layout(n_none, n_layer, k))[0] <= self.budget.gpu

        if not gpu_ok(top):
            return None
        lo, hi = 0, top  # gpu_ok(hi) holds
        while lo < hi:
            mid = (lo + hi) // 2
            if gpu_ok(mid):
                hi = mid
            else:
                lo = mid + 1
        layers = self._layout(n_none, n_layer, lo)
        return lo if sum(self.model.host_items(layers).values()) <= self.budget.host else None

    def best(self, bound: float, fixed: float) -> tuple[float, list[LayerChoice]] | None:
        """The cheapest layout costing less than ``bound`` (or None); ``fixed``: the global choice's own cost."""
        best = None
        none_ok = "none" in self.modes
        ra_ok, layer_ok = "recompute_aware" in self.modes, "layer" in self.modes
        ckpt_cost = self.costs.checkpointing("recompute_aware" if ra_ok else "layer")
        if (ra_ok or layer_ok) and self.min_offload(0, self.L if layer_ok else 0) is None:
            return None  # not even the layout needing the least memory fits
        for n_ckpt in range(0 if none_ok else self.L, self.L + 1):
            if fixed + n_ckpt * ckpt_cost >= (best[0] if best else bound):
                break
            n_none = self.L - n_ckpt
            grouped = self.grouping.layers
            if grouped > n_ckpt or (grouped and not layer_ok):
                continue
            # fewest layer-checkpointed layers that fit (more of them: less memory)
            if ra_ok and layer_ok:
                candidates = range(grouped, n_ckpt + 1)
            else:
                candidates = [0] if ra_ok else [n_ckpt]
            found = None
            lo, hi = candidates[0], candidates[-1]
            if self.min_offload(n_none, hi) is None:
                continue
            while lo < hi:
                mid = (lo + hi) // 2
                if self.min_offload(n_none, mid) is not None:
                    hi = mid
                else:
                    lo = mid + 1
            n_off = self.min_offload(n_none, lo)
            found = self._layout(n_none, lo, n_off)
            cost = self.costs.plan(found, self.model.tiled_loss, self.model.tiled_mlp, self.model.optimizer_on_host)
            if cost < (best[0] if best else bound):
                best = (cost, found)
        return best


def _cheapest(models: list[MemoryModel], costs: StepCosts, budget: _Budget, modes: tuple[str, ...], allow_offload: bool,
              groupings: list[Grouping]) -> tuple[float, list[LayerChoice], MemoryModel] | None:
    """The cheapest fitting (cost, layers, model) over the global choices and ``groupings``; at equal cost the
    earlier model (untiled first, optimizer on the GPU first) and the earlier grouping (fewer layers held) win."""
    best = None
    for model in models:
        fixed = costs.tiling(model.tiled_loss, model.tiled_mlp, model.shape.layers)
        fixed += costs.optimizer_host if model.optimizer_on_host else 0.0
        for grouping in groupings:
            if best is not None and fixed >= best[0]:
                break
            found = _Search(model, costs, budget, modes, allow_offload, grouping).best(best[0] if best else math.inf,
                                                                                    fixed)
            if found is not None:
                best = (found[0], found[1], model)
    return best


def _precision_for(precision: str | None, zero_stage: int) -> str:
    return precision or ("fp32_master" if zero_stage else "bf16")


def plan_memory(config, tokens_per_gpu: int, sp_size: int = 1, gpu_bytes: int | None = None,
                host_bytes: int | None = None, zero_stage: int = 0, world: int = 1, *,
                precision: str | None = None, modes: Sequence[str] = CHECKPOINTING_CHOICES,
                allow_offload: bool = True, allow_optimizer_on_host: bool = False,
                tiled_loss: int | None = None, tiled_mlp: int | None = None,
                host_overhead_bytes: int | None = None, processes_per_host: int = 1,
                attention_context: float | None = None, fused_ops: bool | None = None,
                optimizer_on_host: bool | None = None, allow_groups: bool = True,
                kernel: str = CALIBRATION_KERNEL, adam_states: AdamStates | None = None) -> MemoryPlan:
    """The fastest memory plan for ``tokens_per_gpu`` tokens per GPU that fits the GPU and the host.

    ``config``: a transformers config (or a :class:`ModelShape`). ``gpu_bytes``: the GPU's total
    memory (default: torch.cuda.mem_get_info of the current device); the plan keeps under
    :func:`usable_gpu_bytes` of it. ``host_bytes``: the host's total memory (default: psutil or
    /proc/meminfo), shared by ``processes_per_host`` processes and ``host_overhead_bytes`` of
    everything else. ``precision``: ``bf16`` (bf16 weights, gradients and AdamW moments, what a
    bf16 model with torch AdamW keeps), ``bf16_fp32_adam``, ``fp32_master`` (DeepSpeed bf16: float32
    master weights, gradients and moments; the default under ZeRO) or ``fp32``. ZeRO ``zero_stage``
    shards over ``world`` ranks. ``modes``: the checkpointing modes allowed per layer.
    ``tiled_loss`` / ``tiled_mlp``: a chunk size fixes it (0: off), None lets the planner choose.
    ``attention_context``: mean keys per query for the cost model (default: one document over the
    whole context). ``fused_ops``: the model runs Liger's fused RMSNorm/RoPE/SwiGLU (:mod:`.fused_ops`), which
    keeps less per layer; None: wherever they can run here. ``optimizer_on_host``: where AdamW is (an optimizer
    that already exists); None lets the plan choose (the host only with ``allow_optimizer_on_host``).
    ``allow_groups``: where nothing fits otherwise, checkpoint groups of 2-4 layers as one (:data:`GROUP_SIZES`).
    ``kernel``: the attention kernel the run uses (its backward's own buffers differ: :mod:`.kernel_buffers`).
    ``adam_states``: how AdamW keeps its moments, wherever the plan puts it (default: in the parameters' dtype;
    torchao's 8- or 4-bit ones are the run's choice, never the plan's: :mod:`.adam_states`).
    Raises :class:`MemoryPlanError` naming the shortfall and what would fit.
    """
    shape = config if isinstance(config, ModelShape) else ModelShape.from_config(config)
    tokens = int(tokens_per_gpu)
    if tokens < 1:
        raise ValueError(f"tokens_per_gpu must be positive, got {tokens_per_gpu!r}")
    modes = tuple(modes)
    unknown = [m for m in modes if m not in CHECKPOINTING_CHOICES]
    if unknown or not modes:
        raise ValueError(f"modes must be some of {CHECKPOINTING_CHOICES}, got {modes!r}")
    gpu_total = int(gpu_bytes) if gpu_bytes is not None else gpu_memory_bytes()
    host_total = int(host_bytes) if host_bytes is not None else host_memory_bytes()
    if fused_ops is None:
        from .fused_ops import fused_ops_available

        fused_ops = fused_ops_available()
    settings = dict(sp_size=sp_size, precision=_precision_for(precision, zero_stage), zero_stage=zero_stage,
                    world=world, processes_per_host=processes_per_host, host_overhead_bytes=host_overhead_bytes,
                    fused_ops=bool(fused_ops), kernel=kernel, adam_states=adam_states or AdamStates())
    budget = _Budget(usable_gpu_bytes(gpu_total), host_total)
    if optimizer_on_host is not None:
        places = [bool(optimizer_on_host)]
        allow_optimizer_on_host = bool(optimizer_on_host)
    else:
        places = [False, True] if allow_optimizer_on_host else [False]
    # groups only where nothing fits without them; not under ZeRO-3/FSDP, whose hooks gather each layer's weights
    group = allow_groups and "layer" in modes and zero_stage != 3
    groupings = [Grouping(k, n) for k in GROUP_SIZES for n in range(1, shape.layers // k + 1)] if group else []

    def cheapest(t: int, any_fit: bool = False, states: AdamStates | None = None):
        """The cheapest plan for ``t`` tokens, or None. ``any_fit``: only whether one fits, so only the
        finest tiles (the least memory) are tried. ``states``: AdamW's other than the run's."""
        loss_options = [tiled_loss] if tiled_loss is not None else [0, *[c for c in LOSS_CHUNKS if c < t]]
        mlp_options = [tiled_mlp] if tiled_mlp is not None else [0, *[c for c in MLP_CHUNKS if c < t]]
        if any_fit:
            loss_options, mlp_options = loss_options[-1:], mlp_options[-1:]
        if zero_stage == 3:  # the chunked backward reads weights ZeRO-3 has freed (see tiled_mlp)
            mlp_options = [0]
        costs = StepCosts(shape, t, sp_size, attention_context, PRECISIONS[settings["precision"]], zero_stage, world)
        these = {**settings, "adam_states": states or settings["adam_states"]}
        models = [MemoryModel(shape, t, tiled_loss=loss, tiled_mlp=mlp, optimizer_on_host=on_host, **these)
                  for on_host in places for loss in loss_options for mlp in mlp_options]
        best = _cheapest(models, costs, budget, modes, allow_offload, [NO_GROUPS])
        if best is None and groupings:
            best = _cheapest(models, costs, budget, modes, allow_offload, groupings)
        return best, costs

    best, costs = cheapest(tokens)
    if best is None:
        grouped_fits = (lambda t: cheapest(t, any_fit=True)[0] is not None) if groupings else None
        low_bit = AdamStates(LOW_BIT_HINT_BITS)
        low_bit_fits = (not settings["adam_states"].low_bit and not PRECISIONS[settings["precision"]].master
                        and cheapest(tokens, any_fit=True, states=low_bit)[0] is not None)
        raise MemoryPlanError(_no_fit_message(shape, tokens, gpu_total, host_total, modes, allow_offload,
                                              allow_optimizer_on_host, tiled_loss, tiled_mlp, settings, grouped_fits,
                                              low_bit if low_bit_fits else None))
    cost, layers, model = best
    peak, phase, items = model.gpu_peak(layers)
    host = model.host_items(layers)
    forward, backward = model.layer_items(layers)
    return MemoryPlan(shape=shape, tokens_per_gpu=tokens, sp_size=sp_size, layers=tuple(layers),
                      tiled_loss=model.tiled_loss, tiled_mlp=model.tiled_mlp, optimizer_on_host=model.optimizer_on_host,
                      fused_ops=model.fused_ops, kernel=kernel, adam_states=model.adam_states,
                      gpu_peak=peak, gpu_phase=phase, gpu_items=items, gpu_usable=budget.gpu, gpu_total=gpu_total,
                      host_peak=sum(host.values()), host_items=host, host_total=host_total,
                      step_factor=(costs.base + cost) / costs.base,
                      layer_gpu=[0 if c.offload else model.checkpoint[c.checkpointing] for c in layers],
                      layer_host=[model.host_checkpoint[c.checkpointing] if c.offload else 0 for c in layers],
                      layer_forward_peak=[sum(it.values()) for it in forward],
                      layer_backward_peak=[sum(it.values()) for it in backward])


LOW_BIT_HINT_BITS = 8
"""Where nothing fits, the shortfall message says whether AdamW's states in this many bits would make it fit: the
plan never picks them itself, since they change the updates (:mod:`.adam_states`)."""


# ---------------------------------------------------------------------------------------------
# When nothing fits: the shortfall and what would fit.
# ---------------------------------------------------------------------------------------------


def _longest_grouped(known: int, tokens: int, fits) -> int:
    """The longest length below ``tokens`` that ``fits`` (group checkpointing allowed) accepts, at least
    ``known`` (what fits layer by layer), searched in steps of 1024 tokens: each try is a full plan search."""
    step = 1024
    lo, hi = known // step, (tokens - 1) // step  # in units of ``step``: lo fits (or is 0), hi may not
    if hi <= lo or not fits(max(1, (lo + 1) * step)):
        return known
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * step):
            lo = mid
        else:
            hi = mid - 1
    return lo * step


def _least_memory(shape, tokens, gpu_total, host_total, modes, allow_offload, on_host, tiled_loss, tiled_mlp,
                  settings) -> tuple[bool, int, int, MemoryModel, list[LayerChoice]]:
    """(fits, GPU bytes, host bytes) of the plan needing the least GPU memory that the host allows."""
    settings = dict(settings)
    zero3 = settings["zero_stage"] == 3
    loss = tiled_loss if tiled_loss is not None else (LOSS_CHUNKS[-1] if LOSS_CHUNKS[-1] < tokens else 0)
    mlp = 0 if zero3 else (tiled_mlp if tiled_mlp is not None else (MLP_CHUNKS[-1] if MLP_CHUNKS[-1] < tokens else 0))
    model = MemoryModel(shape, tokens, tiled_loss=loss, tiled_mlp=mlp, optimizer_on_host=on_host, **settings)
    mode = "layer" if "layer" in modes else ("recompute_aware" if "recompute_aware" in modes else "none")
    L = shape.layers
    n_none = L if mode == "none" else 0
    n_layer = L - n_none if mode == "layer" else 0
    # offload as many layers as the host takes
    n_off = 0
    if allow_offload and mode != "none":
        lo, hi = 0, L
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if sum(model.host_items(_layout(L, n_none, n_layer, mid)).values()) <= host_total:
                lo = mid
            else:
                hi = mid - 1
        n_off = lo
    layers = _layout(L, n_none, n_layer, n_off)
    gpu = model.gpu_peak(layers)[0]
    host = sum(model.host_items(layers).values())
    return gpu <= usable_gpu_bytes(gpu_total) and host <= host_total, gpu, host, model, layers


def _no_fit_message(shape, tokens, gpu_total, host_total, modes, allow_offload, allow_opt, tiled_loss, tiled_mlp,
                    settings, grouped_fits=None, low_bit_fit: AdamStates | None = None) -> str:
    """The shortfall and what would fit. The bounds price layer-by-layer layouts (cheap to bisect);
    ``grouped_fits(tokens)``, where group checkpointing is allowed, raises the shorter-context bound to
    what groups fit. ``low_bit_fit``: torchao's low-bit AdamW states with which ``tokens`` fit."""
    sp, world = settings["sp_size"], settings["world"]

    def fits(t, sp_size=sp, world_size=world, host=host_total, on_host=allow_opt, **changes):
        s = dict(settings, sp_size=sp_size, world=world_size, **changes)
        return any(_least_memory(shape, t, gpu_total, host, modes, allow_offload, place, tiled_loss, tiled_mlp, s)[0]
                   for place in ([False, True] if on_host else [False]))

    _, gpu, host, model, layers = _least_memory(shape, tokens, gpu_total, host_total, modes, allow_offload, allow_opt,
                                                tiled_loss, tiled_mlp, settings)
    usable = usable_gpu_bytes(gpu_total)
    off = sum(c.offload for c in layers)
    what = (f"the plan needing the least GPU memory ({layers[0].checkpointing} checkpointing on every layer, "
            f"{off} of {shape.layers} checkpoints on the host, tiled loss {model.tiled_loss or 'off'}, tiled MLP "
            f"{model.tiled_mlp or 'off'})")
    lines = [f"{tokens} tokens per GPU do not fit: {what} needs {format_gib(gpu)} GiB of GPU memory, "
             f"{format_gib(usable)} GiB usable of {format_gib(gpu_total)}"]
    if host > host_total:
        lines[0] += f"; and {format_gib(host)} GiB of host memory, the host has {format_gib(host_total)}"
    hints = []
    context = tokens * sp
    # more GPUs for the same context: as configured, else with DeepSpeed ZeRO sharding the optimizer
    sharded = [({}, "")] + [({"zero_stage": z, "precision": "fp32_master"}, f" under DeepSpeed ZeRO-{z}")
                            for z in (2, 3) if settings["zero_stage"] < z]
    for changes, how in sharded:
        more = next((n for n in range(sp + 1, 1025)
                     if fits(math.ceil(context / n), n, world * n // sp, **changes)), None)
        if more is not None:
            hints.append(f"sequence parallelism over {more} GPUs{how} (sp_size {more}: {math.ceil(context / more)} "
                         f"tokens per GPU for the same {context}-token context, each GPU with this much GPU and "
                         "host memory)")
            break
    lo, hi = 0, tokens - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    grouped = _longest_grouped(lo, tokens, grouped_fits) if grouped_fits is not None else lo
    if grouped > lo:
        hints.append(f"a shorter context: at most {grouped} tokens per GPU fit here with group checkpointing "
                     f"({grouped * sp} tokens over sp_size {sp})")
    elif lo > 0:
        hints.append(f"a shorter context: at most {lo} tokens per GPU fit here ({lo * sp} tokens over sp_size {sp})")
    if allow_offload and gpu > usable:
        full = sum(model.host_items(_layout(shape.layers, 0, shape.layers, shape.layers)).values())
        if off < shape.layers and full > host_total:
            full_fits = _least_memory(shape, tokens, gpu_total, full, modes, allow_offload, allow_opt, tiled_loss,
                                      tiled_mlp, settings)[0]
            if full_fits:
                lines[0] += (f"; host memory binds: {off} of {shape.layers} checkpoints fit on the host beside the "
                             f"rest it holds, {format_gib(full - host_total)} GiB short of holding every one")
                hints.append(f"more host memory: {format_gib(full)} GiB (has {format_gib(host_total)}) to offload "
                             "every layer's checkpoint")
    if low_bit_fit is not None:
        saved = (MemoryModel(shape, tokens, **settings).optimizer_gpu
                 - MemoryModel(shape, tokens, **{**settings, "adam_states": low_bit_fit}).optimizer_gpu)
        hints.append(f"AdamW's states in {low_bit_fit.bits} bits ({format_gib(saved)} GiB less wherever AdamW is; "
                     f"TrainingArguments(optim='adamw_torch_{low_bit_fit.bits}bit'): torchao's "
                     f"AdamW{low_bit_fit.bits}bit, whose block-quantized moments do not give AdamW's exact updates)")
    if not allow_opt and fits(tokens, on_host=True):
        hints.append("the optimizer states on the host (allow_optimizer_on_host=True: torchao's offload optimizer "
                     "in one process, pip install 'hf_longctx[offload]'; DeepSpeed's offload_optimizer under ZeRO)")
    if not hints:
        hints.append("none found among sequence parallelism up to 1024 GPUs, more host memory or a shorter context")
    return lines[0] + ". Would fit: " + "; or ".join(hints)

