"""Check a launch's settings before anything expensive happens, and report a mistake once, briefly.

A wrong recipe value found at the first forward costs a whole launch: the model and data are built,
every rank prints its own traceback. :func:`check_run` reads the recipe, checks its values (backend
and kernel names with the closest valid name), the sequence-parallel size against the processes that
were actually started, local dataset or model paths, and a run sized for a GPU where none is visible
(:func:`check_gpu_present`), all before a model or dataset exists; :func:`check_model_config` then
checks what the model's config answers (heads, experts, layers) before the model is built.
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

from ..parallel.accelerate_axes import check_accelerate_parallelism
from ..parallel.fsdp import check_fsdp_launch
from ..settings.launcher import launcher_num_processes
from ..settings.schema import ConfigError, LongContextConfig
from ..settings.sources import load_config, recipe_and_origin, recipe_source
from .model_support import packed_sequence_refusal, unsupported_layers

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

    from ..settings.backend_names import PREFIX

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


def check_training_arguments(args, sp_size: int) -> None:
    """At train begin: raise ConfigError for a Trainer option that sequence parallelism would silently change.

    ``neftune_noise_alpha``: NEFTune draws its noise with a magnitude of alpha / sqrt(length x hidden) from the
    embeddings' tensor, which under sequence parallelism holds a shard of the sequence: every rank's noise would
    be sqrt(sp_size) times what the same run draws in one process. ``parallelism_config``: accelerate's own cp, sp
    or tp axis (:mod:`~hf_longctx.hf.parallel.accelerate_axes`). ``torch_compile``: the attention's backward cannot
    be traced (:data:`~hf_longctx.backends.op.COMPILE_REFUSAL`), in any process count.
    """
    check_accelerate_parallelism(args)
    if getattr(args, "torch_compile", False):
        from ...backends.op import COMPILE_REFUSAL

        raise ConfigError(COMPILE_REFUSAL.removeprefix("hf_longctx: "))
    alpha = getattr(args, "neftune_noise_alpha", None)
    if alpha and sp_size > 1:
        raise ConfigError(f"neftune_noise_alpha={alpha} with sp_size {sp_size}: NEFTune scales its noise by "
                          "1/sqrt(sequence length x hidden size) of the tensor it sees, and each rank sees a shard of "
                          f"the sequence, so the noise would be {sp_size ** 0.5:.2f}x what one process draws; unset "
                          "neftune_noise_alpha, or train with sp_size 1")


# Model shapes of the training script sized for a GPU: on a CPU they would be built in host memory and run it out
GPU_SCALE_MODELS = {"llama3-8b-shape": "Llama-3-8B's dimensions (hidden 4096, MLP 14336 per layer)"}
_GPU_PRECISIONS = ("bf16", "fp16", "fp8")  # what GPU recipes ask accelerate for; every CPU recipe says 'no'


def _accelerate_config(recipe: str | os.PathLike | None) -> Path | None:
    """The accelerate config of the run's recipe (beside its sidecar when a sidecar was named), if it exists."""
    found = recipe_and_origin(recipe)[0]
    if not found:
        return None
    path = Path(found).expanduser()
    if path.name.endswith(".longctx.yaml"):
        path = path.with_name(path.name[: -len(".longctx.yaml")] + ".yaml")
    return path if path.is_file() else None


def check_gpu_present(recipe: str | os.PathLike | None = None, model: str | None = None,
                      cuda_available: bool | None = None) -> None:
    """Raise ConfigError when the run is sized for a GPU and no CUDA GPU is visible.

    Sized for a GPU: a model shape of :data:`GPU_SCALE_MODELS`, or a recipe whose accelerate config asks
    for GPU mixed precision (``mixed_precision: bf16``, as every GPU recipe does; the CPU recipes say
    ``'no'``; ``ACCELERATE_MIXED_PRECISION`` from the launcher counts the same). Without this, the 8B
    shape is built on the CPU and the host runs out of memory a minute later, with no word about the GPU.
    CPU runs (a CPU recipe, no recipe, the tiny models, a checkpoint of the user's) pass.
    """
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    if cuda_available:
        return
    config = _accelerate_config(recipe)
    precision = None
    if config is not None:
        import yaml

        precision = str((yaml.safe_load(config.read_text()) or {}).get("mixed_precision", "no"))
    precision = precision if precision in _GPU_PRECISIONS else os.environ.get("ACCELERATE_MIXED_PRECISION")
    if model in GPU_SCALE_MODELS:
        why = f"--model {model} builds {GPU_SCALE_MODELS[model]}, a model for a GPU"
    elif precision in _GPU_PRECISIONS:
        why = (f"recipe {config} is a GPU recipe (mixed_precision: {precision})" if config is not None
               else f"accelerate launch asked for {precision} mixed precision, a GPU setting")
    else:
        return
    raise ConfigError(f"no CUDA GPU was found (torch.cuda.is_available() is False), but {why}; on this machine "
                      "train the tiny model with a CPU recipe (`accelerate launch --config_file recipes/cpu-2proc.yaml "
                      "scripts/train.py`), or run this on a GPU machine with a CUDA build of torch")


def check_model_config(cfg: LongContextConfig, model_config, world_size: int | None = None,
                       source: str = "the settings") -> None:
    """Raise ConfigError for what a Trainer run with :class:`~hf_longctx.LongContextCallback` would refuse only
    after its model and data were built, and that the model's config and the settings already answer.

    Checked: layers that cannot take the packed sequence the callback makes (:func:`unsupported_layers`),
    the parallel sizes against the model's heads and experts (as the callback checks at train begin),
    ``tp_size`` > 1 (the Trainer gives every process its own rows), and the query heads Ulysses splits
    over the sequence-parallel group (:func:`hf_longctx.backends.ulysses.kv_repeat`, its first forward's
    check). ``source`` names where the settings came from (see :func:`~..settings.sources.recipe_source`).
    """
    world = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    reason = unsupported_layers(model_config)
    if reason is not None:
        raise ConfigError(packed_sequence_refusal(type(model_config).__name__.removesuffix("Config") + " model",
                                                  reason))
    try:
        _, sp, tp, _ = cfg.resolved_sizes(world, model_config)
        sp = cfg.resolved_sp_size(world)
    except ValueError as err:
        raise ConfigError(f"{source}: {err}") from None
    if tp > 1:
        raise ConfigError(f"{source}: tp_size {tp}: head-parallel attention needs the tensor-parallel ranks to see the "
                          "same batch, but the Trainer gives every process its own rows; set tp_size: 1 for Trainer "
                          "runs (sp_size and ep_size work), or train in a loop of your own")
    heads = getattr(text, "num_attention_heads", None)
    if cfg.backend == "ulysses" and heads:
        from ...backends.ulysses import kv_repeat

        kv_heads = getattr(text, "num_key_value_heads", None) or heads

        def splits(size: int) -> bool:
            try:
                kv_repeat(heads, kv_heads, size)
            except ValueError:
                return False
            return True

        if not splits(sp):
            fits = [d for d in range(1, world + 1) if world % d == 0 and splits(d)]
            raise ConfigError(f"{source}: backend ulysses splits the model's {heads} query heads over the {sp} "
                              f"processes of a sequence-parallel group, and {sp} does not divide {heads}; set sp_size "
                              f"to one of {fits}, or use a ring backend (--backend zigzag, distfa or ring)")
    from ...backends import get_backend
    from ...backends.ulysses_mesh import UlyssesMeshBackend, mesh_problem

    spec = get_backend(cfg.backend)
    if isinstance(spec, UlyssesMeshBackend) and heads:
        problem = mesh_problem(getattr(cfg.backend_options, "ulysses_size", None), sp, heads,
                               getattr(text, "num_key_value_heads", None) or heads)
        if problem:
            raise ConfigError(f"{source}: backend {cfg.backend}: {problem}")


def check_run(recipe: str | os.PathLike | None = None, *, overrides: Mapping[str, object] | None = None,
              world_size: int | None = None, dataset: str | None = None, model: str | None = None,
              attn_implementation: str | None = None) -> LongContextConfig:
    """The run's :class:`LongContextConfig`, or a ConfigError naming the file, the value and the fix.

    ``world_size`` defaults to the launcher's ``WORLD_SIZE`` (1 without a launcher). ``dataset`` and
    ``model`` are checked only where they name local paths; ``"synthetic"``/``"sample"`` and the
    built-in model names of the training script pass. ``overrides``: settings from the command line
    (see :func:`~hf_longctx.hf.settings.sources.config_overrides`), checked like the sidecar's.
    ``attn_implementation``: a name the caller will give transformers instead of the recipe's
    backend (see :func:`check_attn_implementation`). Last, :func:`check_gpu_present` for ``model``
    and the recipe.
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
    check_accelerate_parallelism()  # any launch: accelerate's own cp / sp / tp axes
    check_path("--dataset", dataset, builtin=("synthetic", "sample"), suffixes=_DATA_SUFFIXES)
    check_path("--model", model, builtin=("tiny", "llama3-8b-shape"))
    check_attn_implementation(attn_implementation)
    check_gpu_present(recipe, model)
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
