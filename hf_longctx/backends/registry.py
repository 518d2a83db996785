"""The registry of backends: name -> :class:`~.contract.Backend` object, in registration order.

The package's own backends are registered by :mod:`.builtin` when ``hf_longctx.backends`` is imported;
another package adds one with :func:`register_backend` and it is then usable everywhere a built-in is:
by name in :func:`~hf_longctx.backends.sequence_parallel_attention`, as an ``auto`` candidate when it
says so, and in transformers as ``longctx_<name>``.

That last step belongs to the transformers layer, which this layer must not import. So the registry
only announces registrations: :func:`on_backend_registered` hands a listener every backend registered
so far and every one registered later, and :mod:`hf_longctx.hf.integration.attention` installs the listener that
registers the attention names. Registering before or after ``import hf_longctx`` gives the same result.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from .contract import Backend

BackendListener = Callable[[Backend], None]


class BackendRegistry:
    """Backends by name, plus the listeners told about each registration."""

    def __init__(self) -> None:
        self._backends: dict[str, Backend] = {}
        self._listeners: list[BackendListener] = []

    def register(self, backend: Backend, *, replace: bool = False) -> Backend:
        if not isinstance(backend, Backend):
            raise TypeError(f"register_backend takes a hf_longctx.backends.Backend object, got {backend!r}; "
                            "subclass Backend (or ScheduleBackend) and register an instance")
        name = backend.name
        if not name or not name.replace("_", "").isalnum() or name != name.lower():
            raise ValueError(f"backend name {name!r} must be lower-case letters, digits and '_' (it becomes the "
                             f"attention name longctx_<name>)")
        if backend.default_strategy not in backend.strategies:
            raise ValueError(f"backend {name!r}: default strategy {backend.default_strategy!r} is not one of its "
                             f"strategies {backend.strategies}")
        if name in self._backends and not replace:
            raise ValueError(f"a backend named {name!r} is already registered ({self._backends[name]!r}); pick "
                             "another name or pass replace=True")
        self._backends[name] = backend
        for listener in list(self._listeners):
            listener(backend)
        return backend

    def get(self, name: str) -> Backend:
        backend = self._backends.get(name)
        if backend is None:
            raise ValueError(f"unknown sequence-parallel backend {name!r}; choose one of "
                             f"{', '.join(sorted(self._backends))}")
        return backend

    def __contains__(self, name: object) -> bool:
        return name in self._backends

    def __iter__(self) -> Iterator[Backend]:
        return iter(list(self._backends.values()))

    def subscribe(self, listener: BackendListener) -> None:
        """Call ``listener(backend)`` for every backend registered so far and every later one (once)."""
        if listener in self._listeners:
            return
        self._listeners.append(listener)
        for backend in self:
            listener(backend)


REGISTRY = BackendRegistry()


def register_backend(backend: Backend, *, replace: bool = False) -> Backend:
    """Make ``backend`` usable by name everywhere (and, with transformers, as ``longctx_<name>``)."""
    return REGISTRY.register(backend, replace=replace)


def get_backend(name: str) -> Backend:
    return REGISTRY.get(name)


def registered_backends() -> list[Backend]:
    """Every registered backend, in registration order."""
    return list(REGISTRY)


def backend_names() -> list[str]:
    return sorted(b.name for b in REGISTRY)


def default_strategy(backend: str) -> str:
    """The shard_plan strategy ``backend`` expects by default."""
    return get_backend(backend).default_strategy


def on_backend_registered(listener: BackendListener) -> None:
    """Tell ``listener`` about every backend, registered now or later (see the module docstring)."""
    REGISTRY.subscribe(listener)
