"""CAD's options (:class:`CadOptions`): what the scheduler balances and how the runtime batches a server's tasks.

Made once where they are given (a recipe's ``backend_options``, ``--backend-options``, a call's ``options=``) and
checked then: a cost model file is read and matched to this run's device and kernel before any model is built
(:mod:`.model_file`). The schedule a batch gets is not kept here but in the run (:class:`CadRun`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ...kernels.calls import CallTerms
from ..options import BackendOptions, parse_options
from .cost_model import CostModel
from .model_file import is_model_path, model_file_problem
from .tasks import CadTask

# the refinement's screen (refine_in_time): on steps of many moves, moves are priced in full in the order of an
# additive estimate until this many in a row found nothing better. On an H200's launch model, per batch on a 2-core
# host from cleared pricing caches: SFT 256K at 4 servers 10.1 s -> 1.0 s, at 16 servers 7.6 s -> 1.4 s, SFT 512K
# at 64 servers 11.3 s -> 5.9 s, the predicted max/mean within 0.002 (ProLong 128K and Pretrain 512K at 64 servers
# make steps of few moves, which are not screened)
REFINE_SCREEN = 32


class _CostModelsTerms:
    """The default of ``call_terms``: a profiled cost model's measured terms, else one call per batch."""

    def __repr__(self) -> str:
        return "COST_MODELS_TERMS"

    def __reduce__(self) -> str:
        return "COST_MODELS_TERMS"  # one object: copies and pickles (options sent to spawned ranks) are it


COST_MODELS_TERMS = _CostModelsTerms()


def _is_whole(value, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


@dataclass(frozen=True)
class CadOptions(BackendOptions):
    """CAD's options (see :func:`~.runtime.cad_schedule` and :func:`~.runtime.call_terms_for` for what they do).

    - ``eps``: the scheduler's tolerance, a number >= 0 (0.01 tighter) or ``"auto"`` (the eps whose schedule is
      predicted fastest);
    - ``cost_model``: ``"flops"``, the path of a fitted cost model file (``hf-longctx-lab profile-cad --out
      FILE``) or a cost model object; ``cost_kernel``: ``"auto"`` or the kernel a model file must have timed;
    - ``min_shard`` and ``search_width`` (None: the scheduler's own), whole numbers >= 1;
    - ``key_cuts``, ``refine_chains`` and ``refine_screen``: the refinement's moves and screen (0 or None: every
      move is priced);
    - ``pingpong``: two nano-batches per server;
    - ``call_terms``: how a server cuts its batch into kernel calls (a ``CallTerms``, or None / ``"none"``: one
      call); left out, the cost model's measured terms;
    - ``tasks``: a schedule's tasks to run instead of scheduling (kept as a tuple).
    """

    eps: float | str = 0.1
    cost_model: object = "flops"
    cost_kernel: str = "auto"
    min_shard: int | None = None
    search_width: int | None = None
    key_cuts: bool = True
    refine_chains: bool = True
    refine_screen: int | None = REFINE_SCREEN
    pingpong: bool = True
    call_terms: object = COST_MODELS_TERMS
    tasks: tuple[CadTask, ...] | None = None

    def __post_init__(self) -> None:
        tasks = self.tasks
        if tasks is not None and not isinstance(tasks, (str, bytes)) and isinstance(tasks, Sequence):
            object.__setattr__(self, "tasks", tuple(tasks))  # one immutable copy: the caller's list may change
        super().__post_init__()

    def problem(self) -> str | None:
        from ...kernels import kernel_names

        eps = self.eps
        number = isinstance(eps, (int, float)) and not isinstance(eps, bool)
        if eps != "auto" and (not number or not 0 <= eps < float("inf")):
            return f"eps must be a number >= 0 (the scheduler's tolerance: 0.1 by default, 0.01 tighter) or 'auto', " \
                   f"got {eps!r}"
        kernel = self.cost_kernel
        if kernel not in ("auto", *kernel_names()):
            return f"cost_kernel must be 'auto' or one of {', '.join(kernel_names())}, got {kernel!r}"
        model = self.cost_model
        if model is None or model == "flops":
            pass
        elif is_model_path(model):
            problem = model_file_problem(model, kernel)
            if problem:
                return problem
        elif not isinstance(model, CostModel):
            return f"cost_model must be 'flops', the path of a fitted cost model file or a cost model object (with " \
                   f"cost and cost_array), got {type(model).__name__}"
        for key in ("min_shard", "search_width"):
            value = getattr(self, key)
            if value is not None and not _is_whole(value, 1):
                return f"{key} must be a whole number >= 1, got {value!r}"
        for key in ("key_cuts", "refine_chains", "pingpong"):
            if not isinstance(getattr(self, key), bool):
                return f"{key} must be true or false, got {getattr(self, key)!r}"
        screen = self.refine_screen
        if screen is not None and not _is_whole(screen, 0):
            return f"refine_screen must be a whole number (moves priced in full per step; 0: every move), " \
                   f"got {screen!r}"
        terms = self.call_terms
        if terms is not COST_MODELS_TERMS and terms is not None and terms != "none" \
                and not isinstance(terms, CallTerms):
            return f"call_terms must be a CallTerms, None or 'none', got {terms!r}"
        tasks = self.tasks
        if tasks is not None and (not isinstance(tasks, tuple) or not all(isinstance(t, CadTask) for t in tasks)):
            return "tasks must be a schedule's tasks (a sequence of CadTask, e.g. cad_schedule(plan, options).tasks)"
        return None

    def scheduler_knobs(self) -> dict[str, int]:
        """The keyword arguments of :func:`~.scheduler.assign_servers` these options set (``min_shard``,
        ``search_width``)."""
        return {k: getattr(self, k) for k in ("min_shard", "search_width") if getattr(self, k) is not None}


def cad_options(options: CadOptions | Mapping | None) -> CadOptions:
    """``options`` as :class:`CadOptions`: an object as it is, a mapping (or None) parsed once, with the errors a
    call's options get (``backend 'cad' ...``). For the module functions that lab code and tests call directly."""
    return parse_options("cad", CadOptions, options)  # type: ignore[return-value]


@dataclass(frozen=True)
class CadRun:
    """What CAD's ``prepare`` gives a run of one plan: the tasks every rank runs, and the eps their schedule was made
    under (None for tasks given in the options)."""

    tasks: tuple[CadTask, ...]
    eps_used: float | None = None
