"""Observers of single-device attention kernel calls (e.g. a per-rank kernel timer).

Why: measuring how much kernel time each sequence-parallel rank spends needs to see every kernel call
the backends make, without the backends knowing. :func:`observed` wraps the public entry points; with
no observer watching, a call goes straight through.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

# observer(name, fn, args, kwargs) -> what fn(*args, **kwargs) returns; it must call fn exactly once
KernelObserver = Callable[[str, Callable[..., Any], tuple, dict], Any]

_observers: list[KernelObserver] = []


@contextmanager
def observe_kernels(observer: KernelObserver) -> Iterator[None]:
    """Route every ``attention_forward``/``attention_backward`` call made inside the block through ``observer``
    (the innermost observer when several watch)."""
    _observers.append(observer)
    try:
        yield
    finally:
        _observers.remove(observer)


def observed(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn`` as seen by the observers, under ``name`` (``forward`` or ``backward``)."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not _observers:
            return fn(*args, **kwargs)
        return _observers[-1](name, fn, args, kwargs)

    return call
