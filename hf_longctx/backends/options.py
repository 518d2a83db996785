"""A backend's options: one frozen dataclass per backend, parsed from a mapping once where they are given.

Why typed: the options travel from a recipe (``backend_options``), the command line (``--backend-options``) or a
call's ``options=`` down to every attention call. As one frozen object, checked when it is made, they are refused
once where they are written (a misspelt key names the closest one, a wrong value says what it must be), every layer
below receives them unchanged, and nothing a run computes (a schedule, the eps it used) can be left in them for the
next batch to find.

A backend declares its type (:attr:`~.contract.Backend.options_type`); its fields are the keys a mapping may name
and their defaults what an absent key means. ``__post_init__`` refuses a value the backend cannot run (one sentence
naming the fix, :meth:`BackendOptions.problem`), so an options object that exists is one the backend runs.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class BackendOptions:
    """Base of every backend's options; a subclass is a frozen dataclass whose fields are its options."""

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem:
            raise ValueError(problem)

    def problem(self) -> str | None:
        """What is wrong with these values (one sentence naming the fix), or None."""
        return None

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The keys a mapping of these options may name, in declaration order."""
        return tuple(f.name for f in fields(cls) if f.init)

    def given(self) -> dict[str, object]:
        """The options that differ from their defaults, by name (what a run's summary shows)."""
        default = type(self)()
        return {name: getattr(self, name) for name in self.names() if getattr(self, name) != getattr(default, name)}


@dataclass(frozen=True)
class NoOptions(BackendOptions):
    """The options of a backend that reads none."""


def parse_options(backend: str, options_type: type[BackendOptions], value: object) -> BackendOptions:
    """``value`` (None, a mapping of option names to values, or an ``options_type`` object) as ``options_type``.

    A key the type does not have is refused naming the closest one (an ignored option would run another
    configuration than the one asked for, silently), then a value the backend cannot run; both errors start with
    ``backend '<name>'``. An object of the type is returned as it is: it was checked when it was made.
    """
    if isinstance(value, options_type):
        return value
    if isinstance(value, BackendOptions):
        raise ValueError(f"backend {backend!r} takes {options_type.__name__}, got {type(value).__name__} (the "
                         "options of another backend)")
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        raise ValueError(f"backend {backend!r}: options must be a mapping of option names to values or a "
                         f"{options_type.__name__}, got {value!r}")
    names = options_type.names()
    unknown = sorted(set(value) - set(names), key=str)
    if unknown:
        hints = [f"{key!r} (did you mean {close[0]!r}?)"
                 if (close := difflib.get_close_matches(str(key), names, n=1)) else repr(key) for key in unknown]
        takes = f"it takes {', '.join(names)}" if names else "it takes none"
        raise ValueError(f"backend {backend!r} has no option {', '.join(hints)}; {takes}")
    try:
        return options_type(**value)
    except ValueError as err:
        raise ValueError(f"backend {backend!r}: {err}") from None
