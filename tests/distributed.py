"""Spawn a gloo process group on this machine and run a function on every rank.

Backends registered in this process from outside the package (tests that define one) are registered
in every spawned rank too: a spawned process imports only the module of the function it runs.
"""

from __future__ import annotations

import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _outside_backends() -> list:
    from hf_longctx.backends import registered_backends

    return [b for b in registered_backends() if not type(b).__module__.startswith("hf_longctx.")]


def _worker(rank, world, init_file, timeout_s, fn, args, outside_backends=()):
    from hf_longctx.backends import backend_names, register_backend

    for backend in outside_backends:  # unpickling imported the defining module, which may register it itself
        if backend.name not in backend_names():
            register_backend(backend)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    _leave_without_finalizing()


def _leave_without_finalizing() -> None:
    """End a rank that finished cleanly without running the interpreter's finalization.

    A gloo group lives on while anything still references it (a traceback kept by ``pytest.raises``,
    a hook, a model's context), and its worker thread drops each finished collective's tensors a
    little after the caller's ``wait`` returns; that drop takes the GIL. When it comes after the
    interpreter started to finalize, CPython ends the thread inside a C++ destructor and the rank
    aborts (``terminate called without an active exception``, SIGABRT) after a passing run. Nothing
    is left to do once the group is destroyed, so the rank flushes its output and exits at once.
    A rank that raised never gets here: the spawner records its traceback and exits it normally.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(world: int, fn, *args, timeout_s: float = 120.0) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; any rank's exception fails the caller."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(_worker, args=(world, init_file, timeout_s, fn, args, _outside_backends()), nprocs=world,
                 join=True)

