"""How much memory this machine gives a run: the GPU's total and the host's, read where the system says it.

Host probes of the planner (:mod:`.search`, :mod:`.training`): torch for the GPU; psutil or ``/proc/meminfo``
for the host, capped by the cgroup's limit, since a container's limit is what a process may pin, not what
``/proc/meminfo`` reports. ``HF_LONGCTX_HOST_MEMORY_GIB`` overrides the host's size.
"""

from __future__ import annotations

import os
from pathlib import Path

from .model import GiB


def gpu_memory_bytes(device=None) -> int:
    """Total memory of the current (or given) CUDA device (torch.cuda.mem_get_info)."""
    import torch

    return int(torch.cuda.mem_get_info(device)[1])


def host_memory_bytes(available: bool = False) -> int:
    """Total (or available) host memory this process may use.

    ``HF_LONGCTX_HOST_MEMORY_GIB`` overrides it: some virtual machines report a small MemTotal that grows
    as memory is touched, and a container's limit is not what /proc/meminfo says. Otherwise psutil (or
    /proc/meminfo), capped by the cgroup's memory limit where one is set.
    """
    override = os.environ.get("HF_LONGCTX_HOST_MEMORY_GIB")
    if override:
        return int(float(override) * GiB)
    try:
        import psutil

        vm = psutil.virtual_memory()
        found = int(vm.available if available else vm.total)
    except ImportError:
        key = "MemAvailable:" if available else "MemTotal:"
        found = None
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key):
                    found = int(line.split()[1]) * 1024
        if found is None:
            raise RuntimeError("cannot read the host's memory size; set HF_LONGCTX_HOST_MEMORY_GIB") from None
    return min(found, _cgroup_limit() or found)


def _cgroup_limit() -> int | None:
    """The memory limit of this process's cgroup (v2, then v1), or None."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            return int(text)
    return None

