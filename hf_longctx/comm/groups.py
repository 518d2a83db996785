"""Sequence-parallel process groups from torch.distributed / DeviceMesh.

The world is laid out as a 2-D DeviceMesh (data parallel x sequence parallel): ranks that share a
sequence sit in one "sp" row. Everything in the package takes an optional ``group``; None means the
whole default group (or a single process when torch.distributed is not initialised).
"""

from __future__ import annotations

import atexit
import gc
import inspect
from functools import cache

import torch
import torch.distributed as dist

from .mode import current_device, ops_for  # noqa: F401 - current_device: importable here as before
from .subgroups import forget_sub_groups

# Float dtypes as small integers, for the signatures ranks exchange before a collective (0: none of them).
DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}


def group_rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank inside ``group``, group size); (0, 1) without torch.distributed."""
    return ops_for(group).rank_and_size()


def global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """Translate a rank inside ``group`` into the global rank P2P calls need."""
    return ops_for(group).global_rank(group_rank)


def high_priority_options() -> dist.ProcessGroupNCCL.Options | None:
    """Options of an NCCL process group whose internal streams run at the device's highest priority; None where
    torch has no NCCL (a CPU build).

    Why: the sequence-parallel backends post the next step's transfers, then launch a kernel that fills every SM.
    An NCCL kernel queued on a normal-priority stream behind it gets SMs only as the compute kernel's blocks drain
    in launch order, so the transfer lands late and every peer waits; the block scheduler serves a
    higher-priority stream's blocks first as SMs free up."""
    if not (dist.is_available() and hasattr(dist, "ProcessGroupNCCL")):
        return None
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = True
    return options


def sequence_parallel_override(device_type: str, sp_size: int, world_size: int) -> dict[str, tuple] | None:
    """``init_device_mesh``'s ``backend_override`` that gives the mesh's "sp" groups high-priority NCCL streams
    (:func:`high_priority_options`); None where it does not apply: not CUDA, a torch without NCCL or without
    ``backend_override``, or a sequence-parallel group that spans the world (the default group serves it, and a
    second communicator over every rank would cost memory; ``TORCH_NCCL_HIGH_PRIORITY=1`` raises the default
    group's streams instead). CAD's all-to-alls, which overlap its kernels, no longer wait behind
    them (``scripts/bench_comm_priority.sh``; measured: bench/results/2026-11-22_backends-multi-gpu.md)."""
    from torch.distributed.device_mesh import init_device_mesh

    options = high_priority_options() if device_type == "cuda" else None
    if options is None or sp_size >= world_size \
            or "backend_override" not in inspect.signature(init_device_mesh).parameters:
        return None
    return {"sp": ("nccl", options)}


def mesh_device_type() -> str:
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


_built_meshes: list = []


def remember_mesh(mesh):
    """Record a DeviceMesh this package built, so :func:`release_groups` can let its groups go; returns it."""
    if not _built_meshes:
        atexit.register(release_groups)
    _built_meshes.append(mesh)
    return mesh


_cached_with_groups: list = []  # cache_clear of every cache that holds groups of the built meshes


def clear_with_groups(cache_clear) -> None:
    """Have :func:`release_groups` call ``cache_clear`` too: a module above this one (:mod:`.mesh`) that caches
    groups of the meshes this package built registers its cache here, so that this module need not import it."""
    _cached_with_groups.append(cache_clear)


clear_with_groups(forget_sub_groups)  # the sub-groups made of groups (e.g. a two-dimensional mesh's)


def release_groups() -> None:
    """Destroy the sub-groups of the meshes this package built and forget the meshes.

    A DeviceMesh holds strong references to its process groups (the default group included), and
    gloo stops a group's worker and transport threads only when the last reference goes:
    ``destroy_process_group()`` alone leaves them running while a cached mesh lives. Left to the
    interpreter's exit, those threads outlive the start of finalization, and a gloo thread that
    then needs the GIL (torch takes it from C++ to update a tensor's Python reference) is ended by
    CPython with ``pthread_exit`` inside a destructor: ``terminate called without an active
    exception`` and SIGABRT after a finished run. Registered with ``atexit`` (which runs before
    finalization) when the first mesh is built; safe to call at any time, before or after the world
    is destroyed, on every rank alike. The next call that needs a mesh builds it anew.
    """
    meshes = list(_built_meshes)
    _built_meshes.clear()
    _mesh.cache_clear()
    for cache_clear in _cached_with_groups:
        cache_clear()
    if dist.is_available() and dist.is_initialized():  # else destroy_process_group() unregistered them all
        world = dist.group.WORLD
        seen: list = []
        for mesh in meshes:
            for name in mesh.mesh_dim_names or ():
                pg = mesh.get_group(name)
                if pg is world or any(pg is s for s in seen):
                    continue
                seen.append(pg)
                dist.destroy_process_group(pg)
        del seen
    del meshes
    gc.collect()  # a DeviceMesh sits in reference cycles: free it, and the groups it holds, now


@cache
def _mesh(sp_size: int, world_size: int, device_type: str):
    from torch.distributed.device_mesh import init_device_mesh

    override = sequence_parallel_override(device_type, sp_size, world_size)
    return remember_mesh(init_device_mesh(device_type, (world_size // sp_size, sp_size), mesh_dim_names=("dp", "sp"),
                                          **({"backend_override": override} if override else {})))


def sequence_parallel_mesh(sp_size: int):
    """The ("dp", "sp") DeviceMesh of the initialised world; raises if sp_size does not divide it."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("torch.distributed is not initialised; launch with accelerate/torchrun first")
    world = dist.get_world_size()
    if sp_size < 1 or world % sp_size:
        raise ValueError(
            f"sequence-parallel size {sp_size} must divide the world size {world}; "
            f"pick one of {[d for d in range(1, world + 1) if world % d == 0]}"
        )
    return _mesh(sp_size, world, mesh_device_type())


def sequence_parallel_group(sp_size: int) -> dist.ProcessGroup | None:
    """Process group of the sequence-parallel row this rank belongs to (None when sp_size == world)."""
    mesh = sequence_parallel_mesh(sp_size)
    if sp_size == dist.get_world_size():
        return None
    return mesh.get_group("sp")

