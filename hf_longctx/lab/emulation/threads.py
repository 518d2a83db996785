"""The long-lived threads that run emulated ranks: rank ``r`` of every hub on the same thread.

Why: libraries keep per-thread state that a new thread builds again and an ended thread may never give
back. torch's cuDNN attention keeps its execution graphs in per-thread caches that it leaks at thread exit
on purpose (to avoid teardown races), so a thread per rank and step would build every graph again each step
and keep all of them; reused threads build a graph once per rank and shape. A hub run from inside another
(or beside it, from another thread) finds rank ``r``'s thread busy and gets a thread of its own for it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable


class _Worker:
    """A daemon thread that runs the jobs handed to it one after another (``once``: a single job, then it ends)."""

    def __init__(self, name: str, once: bool = False) -> None:
        self.busy = False
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._once = once
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            job, done = self._jobs.get()
            try:
                job()
            finally:
                del job  # hold nothing of a finished run while waiting for the next
                done.set()
            if self._once:
                return

    def submit(self, job: Callable[[], None]) -> threading.Event:
        done = threading.Event()
        self._jobs.put((job, done))
        return done


_POOL: list[_Worker] = []  # _POOL[r] runs rank r of every hub, unless busy
_POOL_LOCK = threading.Lock()


def acquire_workers(world: int) -> list[_Worker]:
    """Workers for ranks ``0 .. world - 1``, marked busy until :func:`release_workers`: the pool's where free."""
    with _POOL_LOCK:
        while len(_POOL) < world:
            _POOL.append(_Worker(f"emulated-rank-{len(_POOL)}"))
        workers = []
        for r in range(world):
            w = _POOL[r]
            if w.busy:  # a hub running inside another (or beside it, from another thread): a thread of its own
                w = _Worker(f"emulated-rank-{r}-extra", once=True)
            w.busy = True
            workers.append(w)
        return workers


def release_workers(workers: list[_Worker]) -> None:
    """Hand ``workers`` back to the pool once their jobs are done."""
    with _POOL_LOCK:
        for w in workers:
            w.busy = False


def rank_threads() -> list[threading.Thread]:
    """The long-lived threads that run emulated ranks (rank r on the r-th), for checks and diagnostics."""
    with _POOL_LOCK:
        return [w.thread for w in _POOL]
