"""The long-context settings of a run, as one typed, validated object: :class:`LongContextConfig`.

Every value, wherever it comes from (a recipe's sidecar, an environment variable, the command line;
see :mod:`.sources`), is checked here, so a wrong value fails the same way in each place; an unknown
key fails with the closest known name.
"""

from __future__ import annotations

import difflib
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from ...backends.options import BackendOptions
from .backend_names import backend_from_name


def liger_installed() -> bool:
    """Whether Liger-Kernel can be imported (``pip install hf_longctx[liger]``): the ``fused_ops: liger`` setting is
    refused without it, where it is read."""
    return importlib.util.find_spec("liger_kernel") is not None


class ConfigError(ValueError):
    """A mistake in the run's settings, found before any model or data is built."""


CHECKPOINTING_MODES = ("none", "layer", "recompute_aware")
GROUP_MODE = "group"
"""Per-layer mode of a decoder layer recomputed inside the checkpoint of the ``layer`` layer below it (see
:func:`group_heads`); a whole model cannot be set to it."""
PER_LAYER_MODES = (*CHECKPOINTING_MODES, GROUP_MODE)
MOE_DISPATCHES = ("allgather", "all_to_all")
MEMORY_MODES = ("manual", "auto")
FUSED_OPS_MODES = ("auto", "liger", "off")


# The least valid value of each whole-number setting, and what that value means. Nothing below it is
# read as a default: seq_len 0 or tp_size 0 is an error, wherever it is written.
WHOLE_NUMBER_RANGES = {
    "sp_size": (0, "0 = all processes"),
    "seq_len": (1, "tokens per process per step"),
    "tiled_loss": (0, "0 = off"),
    "tiled_mlp": (0, "0 = off"),
    "tp_size": (1, "1 = off"),
    "ep_size": (1, "1 = off"),
    "expert_tp_size": (1, "1 = off"),
}


def whole_number_problem(key: str, value) -> str | None:
    """Why ``value`` is not valid for the whole-number setting ``key`` (None when it is)."""
    least, meaning = WHOLE_NUMBER_RANGES[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        return f"must be a whole number >= {least} ({meaning})"
    return None


@dataclass(frozen=True)
class LongContextConfig:
    backend: str = "distfa"
    sp_size: int = 0  # 0: the whole world is one sequence-parallel group
    checkpointing: str = "recompute_aware"
    kernel: str = "auto"
    seq_len: int = 1024  # tokens per process per step
    tiled_loss: int = 0  # tokens per chunk of the vocabulary loss (0: off, logits for the whole shard)
    tiled_mlp: int = 0  # tokens per chunk of each decoder layer's MLP (0: off)
    offload_checkpoints: bool = False  # keep layer checkpoints in pinned host memory between the passes
    tp_size: int = 1  # ranks splitting each attention layer's heads (tensor parallel)
    ep_size: int = 1  # ranks splitting each MoE layer's experts (expert parallel)
    moe_dispatch: str = "allgather"  # how tokens reach their experts: allgather or all_to_all
    expert_tp_size: int = 1  # ranks splitting each expert's intermediate dimension (expert tensor parallel)
    memory: str = "manual"  # auto: a memory plan picks per-layer checkpointing, offload and tiling (hf.memory_plan)
    fused_ops: str = "auto"  # Liger's RMSNorm/RoPE/SwiGLU: auto (memory: auto uses them where they run), liger, off
    # the backend's own options (CAD: eps, cost_model, ...): given as a mapping, parsed into the backend's options
    # object when read (checked then); every attention call of the run gets that object (kept out of the hash)
    backend_options: BackendOptions = field(default_factory=dict, hash=False)

    def __post_init__(self):
        object.__setattr__(self, "backend", backend_from_name(self.backend))
        _check_kernel(self.kernel)
        if self.checkpointing not in CHECKPOINTING_MODES:
            raise ValueError(f"unknown checkpointing {self.checkpointing!r}; choose one of {CHECKPOINTING_MODES}")
        if not isinstance(self.offload_checkpoints, bool):
            raise ValueError(f"offload_checkpoints must be true or false, got {self.offload_checkpoints!r}")
        if self.offload_checkpoints and self.checkpointing == "none":
            raise ValueError("offload_checkpoints moves layer checkpoints to the host: it needs checkpointing "
                             "'layer' or 'recompute_aware', not 'none'")
        for key in WHOLE_NUMBER_RANGES:
            value = getattr(self, key)
            if whole_number_problem(key, value):
                raise ValueError(f"{key} {whole_number_problem(key, value)}, got {value!r}")
        if self.memory not in MEMORY_MODES:
            hint = difflib.get_close_matches(str(self.memory), MEMORY_MODES, n=1, cutoff=0.5)
            raise ValueError(f"unknown memory {self.memory!r}" + (f"; did you mean {hint[0]!r}?" if hint else "")
                             + f" (choose one of {', '.join(MEMORY_MODES)})")
        if self.fused_ops not in FUSED_OPS_MODES:
            hint = difflib.get_close_matches(str(self.fused_ops), FUSED_OPS_MODES, n=1, cutoff=0.5)
            raise ValueError(f"unknown fused_ops {self.fused_ops!r}" + (f"; did you mean {hint[0]!r}?" if hint else "")
                             + f" (choose one of {', '.join(FUSED_OPS_MODES)})")
        if self.fused_ops == "liger":
            if not liger_installed():
                raise ValueError("fused_ops: liger needs Liger-Kernel: pip install 'hf_longctx[liger]' (GPU only), "
                                 "or set fused_ops: auto or off")
        object.__setattr__(self, "backend_options", checked_backend_options(self.backend, self.backend_options))
        if self.moe_dispatch not in MOE_DISPATCHES:
            raise ValueError(f"unknown moe_dispatch {self.moe_dispatch!r}; choose one of {MOE_DISPATCHES}")
        if self.expert_tp_size > 1 and self.moe_dispatch != "allgather":
            raise ValueError(f"expert_tp_size {self.expert_tp_size} needs moe_dispatch 'allgather' (every rank of an "
                             f"expert group sees every token routed to its experts), not {self.moe_dispatch!r}")

    @property
    def attn_implementation(self) -> str:
        from .backend_names import implementation_name

        return implementation_name(self.backend)

    def resolved_sp_size(self, world_size: int) -> int:
        size = self.sp_size or world_size
        if world_size == 1 and size > 1:
            raise ValueError(
                f"sp_size {size} asks for sequence parallelism but this run has ONE process. On CPU, "
                "`accelerate launch --num_processes N` without --multi_gpu (or a recipe with distributed_type "
                "MULTI_GPU) starts one process: use `accelerate launch --config_file recipes/cpu-2proc.yaml "
                "...`, or set sp_size: 1 to train without sequence parallelism"
            )
        if world_size % size:
            raise ValueError(
                f"sp_size {size} does not divide the {world_size} processes; pick one of "
                f"{[d for d in range(1, world_size + 1) if world_size % d == 0]} in the recipe"
            )
        return size

    def resolved_sizes(self, world_size: int, model_config=None) -> tuple[int, int, int, int]:
        """(dp, sp, tp, ep) on ``world_size`` processes; errors name the fix (checked against the model if given)."""
        from ...comm.mesh import check_parallel_sizes

        sp = self.sp_size or max(1, world_size // self.tp_size)
        text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
        heads = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
        inter = (getattr(text, "moe_intermediate_size", None) or getattr(text, "intermediate_size", None)) if experts \
            else None
        dp = check_parallel_sizes(world_size, sp, self.tp_size, self.ep_size, experts, *heads,
                                  expert_tp_size=self.expert_tp_size, expert_intermediate_size=inter)
        return dp, sp, self.tp_size, self.ep_size

    @classmethod
    def from_dict(cls, values: dict, source: str = "config") -> LongContextConfig:
        for key in values:
            check_setting_name(key, source)
        try:
            return cls(**values)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{source}: {err}") from None

    def to_dict(self) -> dict:
        """The settings as :meth:`from_dict` takes them: ``backend_options`` as the mapping of those that differ
        from the backend's defaults."""
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"backend_options": self.backend_options.given()}


def group_heads(modes) -> list[int]:
    """For each layer, the index of the layer whose checkpoint covers it: its own, or for a ``group`` layer that of
    the ``layer`` layer starting its group (``layer``, ``group``, ``group`` is one checkpoint of three layers).

    Checked here, so that the execution and the memory model agree on what a group is: a group starts at a
    ``layer`` layer (recompute-aware keeps attention outputs per layer, which one checkpoint of several layers
    does not) and its members carry no offload of their own (the group's one checkpoint is its first layer's).
    """
    heads: list[int] = []
    for i, mode in enumerate(modes):
        if mode != GROUP_MODE:
            heads.append(i)
            continue
        head = heads[i - 1] if i else None
        if head is None or modes[head] != "layer":
            raise ValueError(f"layer {i} is 'group' but no 'layer' layer starts its group (a group is a 'layer' "
                             "layer followed by 'group' layers)")
        heads.append(head)
    return heads


def checked_backend_options(backend: str, options, hint: str = "options belong to one backend: change them with "
                            "it; --backend-options '' sets none") -> BackendOptions:
    """``options`` (a mapping, None, or the backend's options object) as the backend's options object, every key one
    the backend reads and every value one it can run (see :func:`hf_longctx.backends.api.check_options`): a misspelt
    option would otherwise be ignored, and the run would silently be another one than the recipe asked for. The one
    place the settings' options are parsed; ``hint`` ends the error."""
    from ...backends.api import check_options

    if options is not None and not isinstance(options, (Mapping, BackendOptions)):
        raise ValueError(f"backend_options must be a mapping of option names to values (in a sidecar `backend_options: "
                         f"{{eps: 0.01}}`, on the command line `--backend-options eps=0.01`), got {options!r}")
    try:
        return check_options(backend, options)
    except ValueError as err:
        raise ValueError(f"backend_options: {err} ({hint})") from None


def _check_kernel(kernel: str) -> None:
    """Kernel names are checked when the recipe is read, not at the first forward."""
    from ...kernels import kernel_names

    valid = ("auto", *kernel_names())
    if kernel not in valid:
        hint = difflib.get_close_matches(str(kernel), valid, n=1, cutoff=0.5)
        raise ValueError(f"unknown kernel {kernel!r}" + (f"; did you mean {hint[0]!r}?" if hint else "")
                         + f" (choose one of {', '.join(valid)})")


def check_setting_name(key: str, source: str, spell=repr, noun: str = "key") -> None:
    """An unknown setting name fails with the closest known one, spelled as where it was written."""
    known = [f.name for f in fields(LongContextConfig)]
    if key in known:
        return
    hint = difflib.get_close_matches(key, known, n=1)
    raise ValueError(f"{source}: unknown {noun} {spell(key)}" + (f"; did you mean {spell(hint[0])}?" if hint else "")
                     + f" (known {noun}s: {', '.join(spell(k) for k in known)})")
