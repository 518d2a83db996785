"""Check a launch's settings before anything expensive happens, and report a mistake once, briefly.

A wrong recipe value found at the first forward costs a whole launch: the model and data are built,
every rank prints its own traceback. :func:`check_run` reads the recipe, checks its values (backend
and kernel names with the closest valid name), the sequence-parallel size against the processes that
were actually started, and local dataset or model paths, all before a model or dataset exists.
:func:`report_config_errors` turns a :class:`ConfigError` into a few lines on rank 0 and exit status 2
on every rank, without a traceback.
"""

from __future__ import annotations

import difflib
import json
import os
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from .config import load_config, recipe_source
from .fsdp import check_fsdp_launch
from .launcher import launcher_num_processes
from .settings import ConfigError, LongContextConfig

_DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".arrow", ".csv", ".txt")


def _looks_local(value: str, suffixes: tuple[str, ...] = ()) -> bool:
    """A local path rather than a hub name: explicit path syntax, a known suffix, or an existing parent folder."""
    if value.startswith((".", "/", "~")) or (suffixes and value.endswith(suffixes)):
        return True
    parent = Path(value).expanduser().parent
    return str(parent) not in ("", ".") and parent.is_dir()


def _missing_path(option: str, value: str) -> ConfigError:
    path = Path(value).expanduser()
    parent = path.parent if str(path.parent) else Path(".")
    siblings = [p.name for p in parent.iterdir()] if parent.is_dir() else []
    hint = difflib.get_close_matches(path.name, siblings, n=1, cutoff=0.6)
    where = f"; did you mean {str(parent / hint[0])!r}?" if hint else (
        f" (folder {str(parent)!r} does not exist either)" if not parent.is_dir() else "")
    return ConfigError(f"{option} {value!r}: no such file or folder{where}")


def check_path(option: str, value: str | None, builtin: tuple[str, ...] = (),
               suffixes: tuple[str, ...] = ()) -> None:
    """Raise ConfigError when ``value`` names a local path that does not exist (hub names pass)."""
    if value is None or value in builtin:
        return
    if any(c in value for c in "*?["):  # a glob: its folder must exist
        folder = Path(value).expanduser().parent
        if not folder.is_dir():
            raise _missing_path(option, str(folder))
        return
    if _looks_local(value, suffixes) and not Path(value).expanduser().exists():
        raise _missing_path(option, value)


def check_positive(option: str, value: float) -> None:
    """Raise ConfigError unless a script's numeric option is positive (a whole number >= 1 when an int).

    ``--max-steps 0`` or ``--lr -1`` would otherwise be taken as a default or train nonsense."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ConfigError(f"command line: {option} {value}: must be a whole number >= 1")
    elif not value > 0:  # NaN too
        raise ConfigError(f"command line: {option} {value}: must be a number > 0")


def check_attn_implementation(name: str | None) -> str | None:
    """``name`` when transformers can build a model with it, else a ConfigError naming the closest name.

    transformers accepts every name registered with its ``AttentionInterface`` (the ``longctx_*``
    names among them, registered when ``hf_longctx`` is imported), but its error for an unknown name
    lists only its own implementations (a fixed list in ``PreTrainedModel.get_correct_attn_implementation``),
    so ``longctx_zigzg`` gets no hint there. Checked here first, the closest name is the registered
    one. Hub kernels (``org/repo``) are left to transformers.
    """
    if name is None or "/" in name:
        return name
    from transformers import AttentionInterface

    from .attention import PREFIX

    known = ["eager", *AttentionInterface().valid_keys()]
    if name in known or name.removeprefix("paged|") in known:
        return name
    ours = [k for k in known if k.startswith(PREFIX)]
    theirs = [k for k in known if not k.startswith(PREFIX)]
    hint = difflib.get_close_matches(name, ours if name.startswith(PREFIX) else known, n=1, cutoff=0.5)
    raise ConfigError(f"attn_implementation {name!r} is not registered with transformers"
                      + (f"; did you mean {hint[0]!r}?" if hint else "")
                      + f" (hf_longctx: {', '.join(ours)}; transformers: {', '.join(theirs)})")


def check_process_count(world: int) -> None:
    """A launcher asked for N processes but this run has fewer: say so instead of training alone.

    ``accelerate launch --num_processes 2`` on a CPU machine without ``--multi_gpu`` (or a recipe with
    ``distributed_type: MULTI_GPU``) starts ONE process, which would otherwise train silently at
    sequence-parallel size 1.
    """
    asked = launcher_num_processes()
    if asked is not None and asked > world:
        raise ValueError(
            f"accelerate launch was given --num_processes {asked} but started {world} process(es): on CPU add "
            "--multi_gpu (accelerate's multi-process launcher, it runs on CPU with gloo), or launch with "
            "--config_file recipes/cpu-2proc.yaml"
        )


def check_run(recipe: str | os.PathLike | None = None, *, overrides: Mapping[str, object] | None = None,
              world_size: int | None = None, dataset: str | None = None, model: str | None = None,
              attn_implementation: str | None = None) -> LongContextConfig:
    """The run's :class:`LongContextConfig`, or a ConfigError naming the file, the value and the fix.

    ``world_size`` defaults to the launcher's ``WORLD_SIZE`` (1 without a launcher). ``dataset`` and
    ``model`` are checked only where they name local paths; ``"synthetic"``/``"sample"`` and the
    built-in model names of the training script pass. ``overrides``: settings from the command line
    (see :func:`~hf_longctx.hf.config.config_overrides`), checked like the sidecar's.
    ``attn_implementation``: a name the caller will give transformers instead of the recipe's
    backend (see :func:`check_attn_implementation`).
    """
    try:
        cfg = load_config(recipe, overrides)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    world = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    try:
        check_process_count(world)
        cfg.resolved_sp_size(world)
    except ValueError as err:
        raise ConfigError(f"{recipe_source(recipe, overrides)}: {err}") from None
    check_fsdp_launch(cfg)  # an FSDP launch: version 2, no FSDP activation checkpointing, no expert parallelism
    check_path("--dataset", dataset, builtin=("synthetic", "sample"), suffixes=_DATA_SUFFIXES)
    check_path("--model", model, builtin=("tiny", "llama3-8b-shape"))
    check_attn_implementation(attn_implementation)
    return cfg


def _tell_launcher(message: str) -> None:
    """Write ``message`` where torchrun's launcher (the one ``accelerate launch`` runs) looks for a worker's error.

    The launcher names each worker an error file (``TORCHELASTIC_ERROR_FILE``) and, when a worker
    exits non-zero, ends its summary with the "root cause": the earliest failure's file message, or
    else "To enable traceback see ...". The file holds what torch's own ``ErrorHandler`` writes,
    without a Python traceback. Every rank writes the same message: whichever rank the launcher
    sees fail first (a rank still exiting is stopped by it) is the one it reports.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}
    try:
        Path(path).write_text(json.dumps(data))
    except OSError:
        pass  # the launcher then says what it says without it; rank 0 printed the message anyway


@contextmanager
def report_config_errors() -> Iterator[None]:
    """Inside the block, a ConfigError prints once (rank 0) in a few lines and every rank exits with status 2.

    Under a torchrun launcher (``accelerate launch``, ``torchrun``) the message is also the root cause
    in the launcher's failure summary, instead of a pointer to torch's documentation.
    """
    try:
        yield
    except ConfigError as err:
        message = f"hf_longctx: configuration error, nothing was started\n  {err}"
        if int(os.environ.get("RANK", "0")) == 0:
            print(message, file=sys.stderr, flush=True)
        _tell_launcher(message)
        raise SystemExit(2) from None
