"""Where the long-context settings of a run come from: the recipe's sidecar, the environment, the command line.

Recipes under ``recipes/`` are plain accelerate configs, one per hardware shape, which accelerate
validates strictly (an unknown top-level key is an error), so our settings live beside each in
``<recipe>.longctx.yaml``: the shape's defaults. :func:`load_config` finds that sidecar, in order:
an explicit path (``--recipe``), ``HF_LONGCTX_RECIPE``, the ``--config_file`` of the
``accelerate launch`` that started this process. Single keys are then overridden, lowest first:
``HF_LONGCTX_<KEY>`` environment variables, then command-line options ``--<key>`` (see
:func:`add_config_arguments`). Every value, wherever it comes from, is validated by
:class:`~.schema.LongContextConfig`; an unknown key or option is an error that suggests the right name.

The schema lives in :mod:`.schema`, user spellings of backend names in :mod:`.backend_names`, and
what the launcher was asked for in :mod:`.launcher`.
"""

from __future__ import annotations

import argparse
import difflib
import os
from collections.abc import Mapping, Sequence
from dataclasses import fields
from pathlib import Path

from .launcher import launcher_config_file
from .schema import WHOLE_NUMBER_RANGES, ConfigError, LongContextConfig, check_setting_name, whole_number_problem


def sidecar_path(recipe: str | os.PathLike) -> Path:
    """``recipes/x.yaml`` -> ``recipes/x.longctx.yaml``."""
    p = Path(recipe)
    return p.with_name(p.stem + ".longctx.yaml") if not p.name.endswith(".longctx.yaml") else p


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


def parse_backend_options(value: str) -> dict:
    """``eps=0.01,cost_model=flops`` -> ``{"eps": 0.01, "cost_model": "flops"}``: each value read as a YAML
    scalar (a number, true/false, null or text), as the same value in the sidecar is, and text that is a number
    written with an exponent (``1e-3``, which YAML 1.1 leaves as text) as that number."""
    import yaml

    out: dict = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        name, sep, text = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"{item!r} is not NAME=VALUE; write NAME=VALUE pairs separated by commas "
                             "(eps=0.01,cost_model=flops)")
        parsed = yaml.safe_load(text.strip()) if text.strip() else None
        if isinstance(parsed, str):
            try:
                parsed = float(parsed)
            except ValueError:
                pass
        out[name.strip()] = parsed
    return out


# How a setting given as text (environment, command line) becomes the sidecar's value, by the type of
# its field: a new key is settable from the environment and the command line with no edit here.
_PARSERS = {"str": str, "int": _parse_int, "bool": _parse_bool, "BackendOptions": parse_backend_options}
_FROM_TEXT = {f.name: _PARSERS[f.type] for f in fields(LongContextConfig)}


def _from_text(key: str, text: str, given_as: str):
    """``text`` as the value of ``key``; ``given_as`` (e.g. ``HF_LONGCTX_SEQ_LEN='x'``) names it in the error."""
    try:
        value = _FROM_TEXT[key](text)
    except ValueError as err:
        raise ValueError(f"{given_as}: {err}") from None
    if key in WHOLE_NUMBER_RANGES and whole_number_problem(key, value):
        raise ValueError(f"{given_as}: {key} {whole_number_problem(key, value)}")
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
# sample data lives, where profiled cost models are cached and how they are timed, the host memory the
# planner may assume, the cuDNN kernel's memory budget, the Triton kernels' switches (MoE rows, the merges of
# partial results, CAD's segment gather and return). Any other HF_LONGCTX_* name is a misspelled setting and is refused.
PACKAGE_ENVIRONMENT = ("HF_LONGCTX_RECIPE", "HF_LONGCTX_DATA_DIR", "HF_LONGCTX_CACHE", "HF_LONGCTX_PROFILE_L2",
                       "HF_LONGCTX_HOST_MEMORY_GIB", "HF_LONGCTX_CUDNN_LSE_BUDGET_MB", "HF_LONGCTX_MOE_TRITON",
                       "HF_LONGCTX_MERGE_TRITON", "HF_LONGCTX_GATHER_TRITON")


def _recipe(recipe: str | os.PathLike | None) -> str | os.PathLike | None:
    return recipe_and_origin(recipe)[0]


def recipe_and_origin(recipe: str | os.PathLike | None) -> tuple[str | os.PathLike | None, str]:
    """The recipe in use and how it was named: ``--recipe``, ``HF_LONGCTX_RECIPE=`` or the launcher's option."""
    if recipe:
        return recipe, "--recipe"
    if os.environ.get("HF_LONGCTX_RECIPE"):
        return os.environ["HF_LONGCTX_RECIPE"], "HF_LONGCTX_RECIPE="
    launcher = launcher_config_file()
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
    recipe, origin = recipe_and_origin(recipe)
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
            check_setting_name(key, "command line", spell=option_name, noun="option")
            given_as = f"command line: {option_name(key)} {value!r}"
            values[key] = _from_text(key, value, given_as) if isinstance(value, str) else value
        source += " with " + ", ".join(option_name(k) for k in overrides) + " from the command line"
    return LongContextConfig.from_dict(values, source)
