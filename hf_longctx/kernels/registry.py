"""The registry of kernels: name -> :class:`~.contract.Kernel` object, and the order ``auto`` tries them in.

The package's own kernels are registered by :mod:`.builtin`; another package adds one with
:func:`register_kernel` and it is then usable everywhere a built-in is: by name in ``kernel=`` of every
backend and recipe, and, when placed in the ``auto`` order, as one of ``auto``'s candidates.

A kernel is checked when it registers, so a kernel that would be missing from a path cannot exist:
it must have a name and all three of ``supports``, ``forward`` and ``backward``. An unknown name is
an error that lists the registered ones, never a silent fallback to another kernel.
"""

from __future__ import annotations

from collections.abc import Iterator

from .contract import Kernel

AUTO = "auto"


class KernelRegistry:
    """Kernels by name, in registration order, plus ``auto``'s order (a list of names, fastest first)."""

    def __init__(self) -> None:
        self._kernels: dict[str, Kernel] = {}
        self._auto_order: list[str] = []

    def register(self, kernel: Kernel, *, auto_before: str | None = None, in_auto: bool = True,
                 replace: bool = False) -> Kernel:
        name = getattr(kernel, "name", None)
        if not isinstance(name, str) or not name.replace("_", "").isalnum() or name != name.lower() or name == AUTO:
            raise ValueError(f"kernel name {name!r} must be lower-case letters, digits and '_' (and not 'auto')")
        missing = [m for m in ("supports", "forward", "backward") if not callable(getattr(kernel, m, None))]
        if missing:
            raise TypeError(f"kernel {name!r} lacks {', '.join(missing)}: a kernel serves every path "
                            "(supports, forward and backward) or it is not registered")
        if name in self._kernels and not replace:
            raise ValueError(f"a kernel named {name!r} is already registered; pick another name or pass replace=True")
        if auto_before is not None and auto_before not in self._auto_order:
            raise ValueError(f"auto_before={auto_before!r} is not in auto's order {self._auto_order}")
        self._kernels[name] = kernel
        if name in self._auto_order:
            self._auto_order.remove(name)
        if in_auto:
            at = self._auto_order.index(auto_before) if auto_before is not None else len(self._auto_order)
            self._auto_order.insert(at, name)
        return kernel

    def unregister(self, name: str) -> None:
        """Forget ``name`` (and take it out of ``auto``'s order)."""
        self.get(name)
        del self._kernels[name]
        if name in self._auto_order:
            self._auto_order.remove(name)

    def get(self, name: str) -> Kernel:
        kernel = self._kernels.get(name)
        if kernel is None:
            raise ValueError(f"unknown kernel {name!r}; choose one of {', '.join([AUTO, *self._kernels])}")
        return kernel

    def auto_order(self) -> list[str]:
        return list(self._auto_order)

    def __contains__(self, name: object) -> bool:
        return name in self._kernels

    def __iter__(self) -> Iterator[Kernel]:
        return iter(list(self._kernels.values()))


REGISTRY = KernelRegistry()


def register_kernel(kernel: Kernel, *, auto_before: str | None = None, in_auto: bool = True,
                    replace: bool = False) -> Kernel:
    """Make ``kernel`` usable by name everywhere.

    ``in_auto``: also a candidate of ``auto``, tried just before ``auto_before`` (a registered name), or
    last when None; ``reference`` serves every input, so a kernel placed after it is never picked.
    """
    return REGISTRY.register(kernel, auto_before=auto_before, in_auto=in_auto, replace=replace)


def unregister_kernel(name: str) -> None:
    REGISTRY.unregister(name)


def get_kernel(name: str) -> Kernel:
    """The kernel registered as ``name``; ValueError naming the registered ones when there is none."""
    return REGISTRY.get(name)


def kernel_names() -> list[str]:
    """Every registered kernel's name, in registration order."""
    return [k.name for k in REGISTRY]


def auto_order() -> list[str]:
    """The names ``auto`` tries, fastest first."""
    return REGISTRY.auto_order()
