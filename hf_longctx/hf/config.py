"""The long-context settings of a run: backend, sequence-parallel size, checkpointing, kernel.

Recipes under ``recipes/`` are plain accelerate configs, one per hardware shape, which accelerate
validates strictly (an unknown top-level key is an error), so our settings live beside each in
``<recipe>.longctx.yaml``: the shape's defaults. :func:`load_config` finds that sidecar, in order:
an explicit path (``--recipe``), ``HF_LONGCTX_RECIPE``, the ``--config_file`` of the
``accelerate launch`` that started this process. Single keys are then overridden, lowest first:
``HF_LONGCTX_<KEY>`` environment variables, then command-line options ``--<key>`` (see
:func:`add_config_arguments`). Every value, wherever it comes from, is validated here, by
:class:`LongContextConfig`; an unknown key or option is an error that suggests the right name.
"""

from __future__ import annotations

import argparse
import difflib
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from ..backends import backend_names


class ConfigError(ValueError):
    """A mistake in the run's settings, found before any model or data is built."""


CHECKPOINTING_MODES = ("none", "layer", "recompute_aware")
MOE_DISPATCHES = ("allgather", "all_to_all")
MEMORY_MODES = ("manual", "auto")


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


def _out_of_range(key: str, value) -> str | None:
    """Why ``value`` is not valid for the whole-number setting ``key`` (None when it is)."""
    least, meaning = WHOLE_NUMBER_RANGES[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        return f"must be a whole number >= {least} ({meaning})"
    return None


@dataclass(frozen=True)
class LongContextConfig:
    backend: str = "distflash"
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
            if _out_of_range(key, value):
                raise ValueError(f"{key} {_out_of_range(key, value)}, got {value!r}")
        if self.memory not in MEMORY_MODES:
            hint = difflib.get_close_matches(str(self.memory), MEMORY_MODES, n=1, cutoff=0.5)
            raise ValueError(f"unknown memory {self.memory!r}" + (f"; did you mean {hint[0]!r}?" if hint else "")
                             + f" (choose one of {', '.join(MEMORY_MODES)})")
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
        for key in values:
            _check_key(key, source)
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
    from ..kernels import kernel_names

    valid = ("auto", *kernel_names())
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


def _check_key(key: str, source: str, spell=repr, noun: str = "key") -> None:
    """An unknown setting name fails with the closest known one, spelled as where it was written."""
    known = [f.name for f in fields(LongContextConfig)]
    if key in known:
        return
    hint = difflib.get_close_matches(key, known, n=1)
    raise ValueError(f"{source}: unknown {noun} {spell(key)}" + (f"; did you mean {spell(hint[0])}?" if hint else "")
                     + f" (known {noun}s: {', '.join(spell(k) for k in known)})")


def _parse_bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("not a boolean; use 1/0 or true/false")


def _parse_int(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError("not a whole number") from None


# How a setting given as text (environment, command line) becomes the sidecar's value, by the type of
# its field: a new key is settable from the environment and the command line with no edit here.
_PARSERS = {"str": str, "int": _parse_int, "bool": _parse_bool}
_FROM_TEXT = {f.name: _PARSERS[f.type] for f in fields(LongContextConfig)}


def _from_text(key: str, text: str, given_as: str):
    """``text`` as the value of ``key``; ``given_as`` (e.g. ``HF_LONGCTX_SEQ_LEN='x'``) names it in the error."""
    try:
        value = _FROM_TEXT[key](text)
    except ValueError as err:
        raise ValueError(f"{given_as}: {err}") from None
    if key in WHOLE_NUMBER_RANGES and _out_of_range(key, value):
        raise ValueError(f"{given_as}: {key} {_out_of_range(key, value)}")
    return value


def option_name(key: str) -> str:
    """The command-line spelling of a setting: ``seq_len`` -> ``--seq-len``."""
    return "--" + key.replace("_", "-")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``--<key>`` option per setting (``--backend``, ``--seq-len``, ...), each overriding the sidecar.

    Values stay text here and are converted and validated by :func:`load_config`, so a wrong value
    on the command line fails exactly like the same value in the sidecar.
    """
    group = parser.add_argument_group("long-context settings", "override single keys of the recipe's "
                                      "sidecar (recipes/README.md); checked like the sidecar's values")
    for f in fields(LongContextConfig):
        group.add_argument(option_name(f.name), dest=f"longctx_{f.name}", default=None, metavar="VALUE",
                           help=f"sidecar key {f.name} (default: the sidecar's value)")


def config_overrides(args: argparse.Namespace, unknown: Sequence[str] = (),
                     parser: argparse.ArgumentParser | None = None) -> dict[str, str]:
    """Settings named on the command line, as text: the options of :func:`add_config_arguments` that were
    given, plus any other ``--name value`` the parser did not know (``parse_known_args``), which
    :func:`load_config` then rejects with the closest setting name. A name closer to one of the
    ``parser``'s own options (``--max-step``) fails here, naming that option."""
    overrides = {f.name: getattr(args, f"longctx_{f.name}") for f in fields(LongContextConfig)
                 if getattr(args, f"longctx_{f.name}", None) is not None}
    rest = list(unknown)
    while rest:
        token = rest.pop(0)
        if not token.startswith("--"):
            raise ConfigError(f"command line: unexpected argument {token!r}")
        name, has_value, value = token[2:].partition("=")
        if not has_value:
            value = rest.pop(0) if rest and not rest[0].startswith("--") else ""
        _check_script_option(token.partition("=")[0], parser)
        overrides[name.replace("-", "_")] = value
    return overrides


def _check_script_option(option: str, parser: argparse.ArgumentParser | None) -> None:
    """``--max-step`` is a misspelled script option, not a misspelled setting: say which one."""
    settings = {option_name(f.name) for f in fields(LongContextConfig)}
    options = [o for a in (parser._actions if parser else []) for o in a.option_strings if o.startswith("--")]
    hint = difflib.get_close_matches(option, options, n=1)
    if hint and hint[0] not in settings:
        raise ConfigError(f"command line: unknown option {option}; did you mean {hint[0]}?")


# The package's environment variables that are not recipe settings: where the recipe is, where the
# sample data lives, the cuDNN kernel's memory budget, the MoE row kernels' switch. Any other
# HF_LONGCTX_* name is a misspelled setting and is refused.
PACKAGE_ENVIRONMENT = ("HF_LONGCTX_RECIPE", "HF_LONGCTX_DATA_DIR", "HF_LONGCTX_CUDNN_LSE_BUDGET_MB",
                       "HF_LONGCTX_MOE_TRITON")


def _recipe(recipe: str | os.PathLike | None) -> str | os.PathLike | None:
    return _recipe_and_origin(recipe)[0]


def _recipe_and_origin(recipe: str | os.PathLike | None) -> tuple[str | os.PathLike | None, str]:
    """The recipe in use and how it was named: ``--recipe``, ``HF_LONGCTX_RECIPE=`` or the launcher's option."""
    if recipe:
        return recipe, "--recipe"
    if os.environ.get("HF_LONGCTX_RECIPE"):
        return os.environ["HF_LONGCTX_RECIPE"], "HF_LONGCTX_RECIPE="
    launcher = _launcher_config_file()
    return (launcher, "accelerate launch --config_file") if launcher else (None, "")


def _missing_recipe(recipe: str | os.PathLike, origin: str) -> ValueError:
    """A recipe path that does not exist, with the closest recipe of its folder (or the folder's recipes)."""
    path = Path(recipe).expanduser()
    folder = path.parent
    names = sorted(p.name for p in folder.iterdir() if p.suffix in (".yaml", ".yml")) if folder.is_dir() else []
    hint = difflib.get_close_matches(path.name, names, n=1, cutoff=0.6)
    recipes = [n for n in names if not n.endswith(".longctx.yaml")]
    if hint:
        where = f"; did you mean {str(folder / hint[0])!r}?"
    elif recipes:
        where = f" (recipes in {str(folder)!r}: {', '.join(recipes)})"
    else:
        where = f" (folder {str(folder)!r} holds no recipe)" if folder.is_dir() else \
            f" (folder {str(folder)!r} does not exist either)"
    named = origin + ("" if origin.endswith("=") else " ") + repr(str(recipe))
    return ValueError(f"{named}: recipe file does not exist{where}")


def recipe_source(recipe: str | os.PathLike | None = None, overrides: Mapping[str, object] | None = None) -> str:
    """Where :func:`load_config` reads the settings from: the sidecar file or the environment, and
    the command-line options that override it."""
    found = _recipe(recipe)
    source = str(sidecar_path(found)) if found else "settings from the environment (no recipe)"
    if overrides:
        source += " with " + ", ".join(option_name(k) for k in overrides) + " from the command line"
    return source


def load_config(recipe: str | os.PathLike | None = None,
                overrides: Mapping[str, object] | None = None) -> LongContextConfig:
    """Settings from the recipe's sidecar file (see the module docstring), then HF_LONGCTX_* variables,
    then ``overrides`` (the command line's, as :func:`config_overrides` returns them: text or values)."""
    import yaml

    values: dict = {}
    recipe, origin = _recipe_and_origin(recipe)
    if recipe:
        if not Path(recipe).expanduser().is_file():
            raise _missing_recipe(recipe, origin)
        path = sidecar_path(recipe)
        if not path.is_file():
            raise ValueError(f"no long-context settings for recipe {recipe}: expected {path}")
        values = yaml.safe_load(path.read_text()) or {}
        source = str(path)
    else:
        source = "environment"
    overridden = []
    for key in _FROM_TEXT:
        env = os.environ.get(f"HF_LONGCTX_{key.upper()}")
        if env is not None:
            values[key] = _from_text(key, env, f"HF_LONGCTX_{key.upper()}={env!r}")
            overridden.append(f"HF_LONGCTX_{key.upper()}")
    if overridden and source != "environment":
        source += f" with {', '.join(overridden)} from the environment"
    unknown_env = [k for k in os.environ if k.startswith("HF_LONGCTX_") and k[11:].lower() not in _FROM_TEXT
                   and k not in PACKAGE_ENVIRONMENT]
    if unknown_env:
        raise ValueError(f"unknown environment setting(s) {unknown_env}; known: "
                         + ", ".join(f"HF_LONGCTX_{k.upper()}" for k in _FROM_TEXT))
    if overrides:
        for key, value in overrides.items():
            _check_key(key, "command line", spell=option_name, noun="option")
            given_as = f"command line: {option_name(key)} {value!r}"
            values[key] = _from_text(key, value, given_as) if isinstance(value, str) else value
        source += " with " + ", ".join(option_name(k) for k in overrides) + " from the command line"
    return LongContextConfig.from_dict(values, source)
