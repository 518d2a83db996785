"""The long-context settings of a run: backend, sequence-parallel size, checkpointing, kernel.

Recipes under ``recipes/`` are plain accelerate configs, which accelerate validates strictly (an
unknown top-level key is an error), so our settings live beside them in ``<recipe>.longctx.yaml``.
:func:`load_config` finds them, in order: an explicit path, ``HF_LONGCTX_RECIPE``, the
``--config_file`` of the ``accelerate launch`` that started this process; then ``HF_LONGCTX_*``
environment variables override single keys. Unknown keys are errors that suggest the right name.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from ..backends import backend_names

CHECKPOINTING_MODES = ("none", "layer", "recompute_aware")
MOE_DISPATCHES = ("allgather", "all_to_all")


@dataclass(frozen=True)
class LongContextConfig:
    backend: str = "distflash"
    sp_size: int = 0  # 0: the whole world is one sequence-parallel group
    checkpointing: str = "recompute_aware"
    kernel: str = "auto"
    seq_len: int = 0  # tokens per process per step (0: the training script's default)
    tiled_loss: int = 0  # tokens per chunk of the vocabulary loss (0: off, logits for the whole shard)
    tiled_mlp: int = 0  # tokens per chunk of each decoder layer's MLP (0: off)
    offload_checkpoints: bool = False  # keep layer checkpoints in pinned host memory between the passes
    tp_size: int = 1  # ranks splitting each attention layer's heads (tensor parallel)
    ep_size: int = 1  # ranks splitting each MoE layer's experts (expert parallel)
    moe_dispatch: str = "allgather"  # how tokens reach their experts: allgather or all_to_all
    expert_tp_size: int = 1  # ranks splitting each expert's intermediate dimension (expert tensor parallel)

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
        for key in ("sp_size", "seq_len", "tiled_loss", "tiled_mlp"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{key} must be a non-negative int (0 = default/off), got {value!r}")
        for key in ("tp_size", "ep_size", "expert_tp_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{key} must be a positive int (1 = off), got {value!r}")
        if self.moe_dispatch not in MOE_DISPATCHES:
            raise ValueError(f"unknown moe_dispatch {self.moe_dispatch!r}; choose one of {MOE_DISPATCHES}")
        if self.expert_tp_size > 1 and self.moe_dispatch != "allgather":
            raise ValueError(f"expert_tp_size {self.expert_tp_size} needs moe_dispatch 'allgather' (every rank of an "
                             f"expert group sees every token routed to its experts), not {self.moe_dispatch!r}")

    @property
    def attn_implementation(self) -> str:
        from .attention import implementation_name

        return implementation_name(self.backend)

    def resolved_sp_size(self, world_size: int) -> int:
        size = self.sp_size or world_size
        if world_size == 1 and size > 1:
            raise ValueError(
                f"sp_size {size} asks for sequence parallelism but this run has ONE process. On CPU, "
                "`accelerate launch --num_processes N` without --multi_gpu (or a recipe with distributed_type "
                "MULTI_GPU) starts one process: use `accelerate launch --config_file recipes/cpu-2proc-distfa.yaml "
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
        from ..comm.mesh import check_parallel_sizes

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
        known = [f.name for f in fields(cls)]
        for key in values:
            if key not in known:
                hint = difflib.get_close_matches(key, known, n=1)
                raise ValueError(f"{source}: unknown key {key!r}" + (f"; did you mean {hint[0]!r}?" if hint else "")
                                 + f" (known keys: {', '.join(known)})")
        try:
            return cls(**values)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{source}: {err}") from None

    def to_dict(self) -> dict:
        return asdict(self)


def backend_from_name(name: str) -> str:
    """Registry name of a backend given as in a recipe or as an attn_implementation.

    One name per backend: the recipe's ``backend`` is the ``attn_implementation`` without its
    ``longctx_`` prefix (``zigzag``, ``distfa``, ...); the full ``longctx_*`` name and the registry's
    ``distflash`` are accepted too. Anything else fails with the closest valid name.
    """
    from .attention import PREFIX, backend_of, implementation_name

    if not isinstance(name, str):
        raise ValueError(f"backend must be a name, got {name!r}")
    short = name[len(PREFIX):] if name.startswith(PREFIX) else name
    names = backend_names()
    if short in names:
        return short
    try:
        backend = backend_of(PREFIX + short)
    except ValueError:
        backend = None
    if backend in names:
        return backend
    public = [implementation_name(b)[len(PREFIX):] for b in names]
    hint = difflib.get_close_matches(short, public, n=1, cutoff=0.5)
    raise ValueError(f"unknown backend {name!r}" + (f"; did you mean {hint[0]!r}?" if hint else "")
                     + f" (choose one of {', '.join(public)}; the same names as attn_implementation='longctx_<name>')")


def _check_kernel(kernel: str) -> None:
    """Kernel names are checked when the recipe is read, not at the first forward."""
    from ..kernels import KERNELS

    valid = ("auto",) + tuple(KERNELS)
    if kernel not in valid:
        hint = difflib.get_close_matches(str(kernel), valid, n=1, cutoff=0.5)
        raise ValueError(f"unknown kernel {kernel!r}" + (f"; did you mean {hint[0]!r}?" if hint else "")
                         + f" (choose one of {', '.join(valid)})")


def sidecar_path(recipe: str | os.PathLike) -> Path:
    """``recipes/x.yaml`` -> ``recipes/x.longctx.yaml``."""
    p = Path(recipe)
    return p.with_name(p.stem + ".longctx.yaml") if not p.name.endswith(".longctx.yaml") else p


def _launcher_argv() -> list[str] | None:
    """Command line of the ``accelerate launch`` among this process's ancestors (Linux /proc), if any."""
    pid = os.getppid()
    for _ in range(4):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        args = [a.decode(errors="replace") for a in argv if a]
        if any(a.endswith("accelerate") or a == "launch" or a.endswith("accelerate.commands.launch") for a in args):
            return args
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        if pid <= 1:
            return None
    return None


def _launcher_option(name: str) -> str | None:
    """Value of ``--name`` / ``--name=value`` (dashes or underscores) on the launcher's command line."""
    args = _launcher_argv() or []
    spellings = {f"--{name}", f"--{name.replace('_', '-')}"}
    for i, a in enumerate(args):
        if a in spellings and i + 1 < len(args):
            return args[i + 1]
        key, _, value = a.partition("=")
        if key in spellings and value:
            return value
    return None


def _launcher_config_file() -> str | None:
    """The ``--config_file`` of an ``accelerate launch`` among this process's ancestors."""
    return _launcher_option("config_file")


def launcher_num_processes() -> int | None:
    """``--num_processes`` given to the ``accelerate launch`` that started this process, if any."""
    value = _launcher_option("num_processes")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _parse_bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("not a boolean; use 1/0 or true/false")


_ENV = {"backend": str, "sp_size": int, "checkpointing": str, "kernel": str, "seq_len": int, "tiled_loss": int,
        "tiled_mlp": int, "offload_checkpoints": _parse_bool, "tp_size": int, "ep_size": int, "moe_dispatch": str,
        "expert_tp_size": int}


def _recipe(recipe: str | os.PathLike | None) -> str | os.PathLike | None:
    return recipe or os.environ.get("HF_LONGCTX_RECIPE") or _launcher_config_file()


def recipe_source(recipe: str | os.PathLike | None = None) -> str:
    """Where :func:`load_config` reads the settings from: the sidecar file, or the environment."""
    found = _recipe(recipe)
    return str(sidecar_path(found)) if found else "settings from the environment (no recipe)"


def load_config(recipe: str | os.PathLike | None = None) -> LongContextConfig:
    """Settings from the recipe's sidecar file (see the module docstring), then HF_LONGCTX_* overrides."""
    import yaml

    values: dict = {}
    recipe = _recipe(recipe)
    if recipe:
        path = sidecar_path(recipe)
        if not path.is_file():
            raise ValueError(f"no long-context settings for recipe {recipe}: expected {path}")
        values = yaml.safe_load(path.read_text()) or {}
        source = str(path)
    else:
        source = "environment"
    overridden = []
    for key, cast in _ENV.items():
        env = os.environ.get(f"HF_LONGCTX_{key.upper()}")
        if env is not None:
            try:
                values[key] = cast(env)
            except ValueError as err:
                raise ValueError(f"HF_LONGCTX_{key.upper()}={env!r}: {err}") from None
            overridden.append(f"HF_LONGCTX_{key.upper()}")
    if overridden and source != "environment":
        source += f" with {', '.join(overridden)} from the environment"
    unknown_env = [k for k in os.environ if k.startswith("HF_LONGCTX_") and k[11:].lower() not in _ENV
                   and k != "HF_LONGCTX_RECIPE"]
    if unknown_env:
        raise ValueError(f"unknown environment setting(s) {unknown_env}; known: "
                         + ", ".join(f"HF_LONGCTX_{k.upper()}" for k in _ENV))
    return LongContextConfig.from_dict(values, source)
