"""What the ``accelerate launch`` that started this process was asked for: its recipe, process count and FSDP version.

Used for checks that would otherwise fail late or silently: finding the recipe's sidecar from the
launcher's ``--config_file``, and catching "the launcher asked for several processes but started one"
(on CPU, ``--num_processes N`` without ``--multi_gpu`` does that). Neither accelerate nor torch passes
the launcher's command line to its children, so the only source is the process table. The FSDP version is
in the environment accelerate hands its processes (:func:`launcher_fsdp_version`): the FSDP checks and the memory
plan read it here.
"""

from __future__ import annotations

import os
from pathlib import Path


def _launcher_argv() -> list[str] | None:
    """Command line of the ``accelerate launch`` among this process's ancestors, if any.

    Reads Linux's ``/proc/<pid>/cmdline`` of up to four ancestors: no portable way exists for a child to
    learn its launcher's arguments (accelerate exports neither ``--config_file`` nor the process count
    it was asked for). Elsewhere, or without /proc, it returns None and the checks it feeds are skipped.
    """
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


def launcher_config_file() -> str | None:
    """The ``--config_file`` of an ``accelerate launch`` among this process's ancestors."""
    return _launcher_option("config_file")


def launcher_num_processes() -> int | None:
    """``--num_processes`` given to the ``accelerate launch`` that started this process, if any."""
    value = _launcher_option("num_processes")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


TRUE_TEXTS = ("1", "true", "yes")
"""How accelerate writes a switch that is on in the environment it hands its processes."""


def launcher_fsdp_version(environ=None) -> int | None:
    """The FSDP version ``accelerate launch`` asked for (its ``ACCELERATE_USE_FSDP`` / ``FSDP_VERSION``), or None."""
    env = os.environ if environ is None else environ
    if env.get("ACCELERATE_USE_FSDP", "false").strip().lower() not in TRUE_TEXTS:
        return None
    return int(env.get("FSDP_VERSION", "1") or 1)


def requested_fsdp_version(args=None) -> int | None:
    """FSDP version asked for by the launcher or by ``TrainingArguments(fsdp=..., fsdp_config=...)``, or None."""
    version = launcher_fsdp_version()
    if version is None and args is not None and getattr(args, "fsdp", None):
        version = int((getattr(args, "fsdp_config", None) or {}).get("version", 1))
    return version
