"""What the ``accelerate launch`` that started this process was asked for: its recipe and process count.

Used for two checks that would otherwise fail late or silently: finding the recipe's sidecar from the
launcher's ``--config_file``, and catching "the launcher asked for several processes but started one"
(on CPU, ``--num_processes N`` without ``--multi_gpu`` does that). Neither accelerate nor torch passes
the launcher's command line to its children, so the only source is the process table.
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
