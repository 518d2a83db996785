"""CAD's fitted cost model read from a file made ahead of training.

Why: a measured cost model (a profiled grid, :class:`~.cost_model.ProfiledCostModel`, or a launch model fitted to
timed calls, :class:`~.launch_cost.LaunchCostModel`) takes minutes of a GPU to make. Training never makes one: the
command ``hf-longctx-lab profile-cad --out FILE`` (:mod:`hf_longctx.lab`) writes it, and CAD's ``cost_model`` option
names the file. The file is checked when the backend's options are (a missing, unreadable or mismatched file is an
error before any model is built, never a silent fall back to FLOPs) and read once per file version.

What a file must hold: the model (a grid's ``q_lens``/``kv_lens``/``cost``, or a launch model's ``kind: launch``)
and in ``meta`` the ``device`` it was measured on and the ``kernel`` it timed. Both must match the run: the device
kind this process computes on (the current CUDA device's name, else ``cpu``) and CAD's ``cost_kernel`` where it
names a kernel.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .cost_model import CostModel, ProfiledCostModel
from .launch_cost import KIND as LAUNCH_KIND
from .launch_cost import LaunchCostModel

MAKE_ONE = "make one with `hf-longctx-lab profile-cad --out FILE` on the machine kind that trains"


def is_model_path(spec: object) -> bool:
    """Whether a ``cost_model`` option names a file (any string but ``flops``, or a path object)."""
    return isinstance(spec, os.PathLike) or (isinstance(spec, str) and spec != "flops")


def run_device_name() -> str:
    """The device kind this process computes on: the current CUDA device's name, else ``cpu``."""
    return torch.cuda.get_device_name(torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"


def _stamp(path: Path) -> tuple[str, int, int]:
    stat = path.stat()
    return str(path.resolve()), stat.st_mtime_ns, stat.st_size


_READ: dict[tuple[str, int, int], tuple[CostModel, dict]] = {}


def _read(path: Path) -> tuple[CostModel, dict]:
    """(model, meta) of the file, kept per file version (path, modification time, size)."""
    key = _stamp(path)
    if key not in _READ:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        if data.get("kind") == LAUNCH_KIND:
            model: CostModel = LaunchCostModel.from_dict(data)
        elif all(k in data for k in ("q_lens", "kv_lens", "cost")):
            model = ProfiledCostModel.load(path, interpolate="rate")
        else:
            raise ValueError("neither a launch cost model (kind 'launch') nor a profiled grid (q_lens, kv_lens, cost)")
        _READ[key] = (model, dict(data.get("meta") or {}))
    return _READ[key]


def model_file_problem(spec: str | os.PathLike, kernel: str = "auto") -> str | None:
    """What is wrong with ``cost_model=spec`` as a model file (one sentence naming the fix), or None.

    ``kernel``: CAD's ``cost_kernel``; a kernel name must be the one the file timed ('auto': any)."""
    path = Path(spec)
    if spec == "profiled":
        return (f"cost_model 'profiled' is not measured inside training any more: {MAKE_ONE} and pass its path "
                "(cost_model=/path/model.json), or use cost_model=flops")
    if not path.is_file():
        return f"cost_model must be 'flops' or the path of a fitted cost model file; no file at {str(spec)!r}: " \
               f"{MAKE_ONE}"
    try:
        _, meta = _read(path)
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"cost_model file {str(spec)!r} is not a cost model ({type(err).__name__}: {err}): {MAKE_ONE}"
    device = meta.get("device")
    here = run_device_name()
    if device != here:
        return (f"cost_model file {str(spec)!r} was measured on {device!r}, this run computes on {here!r}: "
                f"{MAKE_ONE}")
    if kernel != "auto" and meta.get("kernel") != kernel:
        return (f"cost_model file {str(spec)!r} timed kernel {meta.get('kernel')!r}, cost_kernel is {kernel!r}: "
                "make the file with that kernel (--kernel) or set cost_kernel to the file's")
    return None


def load_model_file(spec: str | os.PathLike, kernel: str = "auto") -> CostModel:
    """The cost model of the file ``spec`` (checked as :func:`model_file_problem` checks it; raises on a problem)."""
    problem = model_file_problem(spec, kernel)
    if problem:
        raise ValueError(f"cad: {problem}")
    return _read(Path(spec))[0]
