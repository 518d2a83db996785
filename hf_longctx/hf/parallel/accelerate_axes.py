"""accelerate's own context, sequence and tensor parallel axes, refused beside a ``longctx_*`` backend.

accelerate (and the Trainer through ``TrainingArguments(parallelism_config=...)``) can split the sequence itself:
``cp_size`` with torch's context parallelism, ``sp_size`` with DeepSpeed's Ulysses (ALST), and split heads with
``tp_size``. Each rewrites what the model sees (the batch cut along the sequence before it reaches the model, or
the attention swapped for its own), so beside a backend that shards the sequence itself the two would cut the same
batch twice, or the run would not be the one the recipe describes. Only data-parallel axes (``dp_replicate_size``,
``dp_shard_size``) compose; the sequence is split by the recipe's ``sp_size``.

Checked before any model is built (the launcher's ``PARALLELISM_CONFIG_*`` variables, whatever the distributed
type) and at train begin (the Trainer's arguments too).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..settings.schema import ConfigError

REFUSED_AXES = ("cp", "sp", "tp")


def _axis_sizes(args=None, environ: Mapping[str, str] | None = None) -> dict[str, tuple[int, str]]:
    """The size of each refused axis above 1, with where it was set."""
    env = os.environ if environ is None else environ
    found: dict[str, tuple[int, str]] = {}
    for axis in REFUSED_AXES:
        size = int(env.get(f"PARALLELISM_CONFIG_{axis.upper()}_SIZE", "1") or 1)
        if size > 1:
            found[axis] = (size, f"accelerate config: parallelism_config_{axis}_size {size}")
    config = getattr(args, "parallelism_config", None) if args is not None else None
    for axis in REFUSED_AXES:
        size = int(getattr(config, f"{axis}_size", 1) or 1) if config is not None else 1
        if size > 1 and axis not in found:
            found[axis] = (size, f"TrainingArguments(parallelism_config=ParallelismConfig({axis}_size={size}))")
    return found


def check_accelerate_parallelism(args=None, environ: Mapping[str, str] | None = None) -> None:
    """Raise ConfigError when accelerate's context, sequence or tensor parallel axis is above 1: set by the
    launcher's config (``environ``, default the process's) or by ``args.parallelism_config``."""
    found = _axis_sizes(args, environ)
    if not found:
        return
    axis, (size, where) = next(iter(found.items()))
    raise ConfigError(f"{where}: accelerate's own {axis} axis splits the {'heads' if axis == 'tp' else 'sequence'} "
                      "itself and cannot run beside a longctx_* backend; shard the sequence with the recipe's sp_size "
                      "and leave accelerate's parallelism_config at dp_replicate_size / dp_shard_size only")
