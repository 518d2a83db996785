"""Backend names, their schedules and the shard strategies they expect."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .schedule import Schedule, distflash_schedule, rotation_schedule


@dataclass(frozen=True)
class BackendSpec:
    name: str
    default_strategy: str
    strategies: tuple[str, ...]  # shard strategies the backend is exact for
    schedule: Callable[[int], Schedule] | None  # None: a backend with its own runner (or "auto")
    summary: str
    runner: str | None = None  # module of hf_longctx.backends with run_forward/run_backward


_BACKENDS: dict[str, BackendSpec] = {}


def register_backend(spec: BackendSpec) -> None:
    _BACKENDS[spec.name] = spec


def get_backend(name: str) -> BackendSpec:
    spec = _BACKENDS.get(name)
    if spec is None:
        raise ValueError(f"unknown sequence-parallel backend {name!r}; choose one of {', '.join(sorted(_BACKENDS))}")
    return spec


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def default_strategy(backend: str) -> str:
    """The shard_plan strategy ``backend`` expects by default."""
    return get_backend(backend).default_strategy


_ANY = ("contiguous", "zigzag", "doc_zigzag")

register_backend(BackendSpec(
    "local", "contiguous", _ANY, rotation_schedule,
    "single-device attention over the whole sequence (sequence-parallel size 1)",
))
register_backend(BackendSpec(
    "ring", "contiguous", _ANY, rotation_schedule,
    "ring attention: keys and values of rank r - s visit rank r at step s",
))
register_backend(BackendSpec(
    "zigzag", "zigzag", _ANY, rotation_schedule,
    "ring attention over zig-zag placement (doc_zigzag placement: per-document zig-zag ring)",
))
register_backend(BackendSpec(
    "ulysses", "contiguous", _ANY, None,
    "Ulysses: all_to_all from token shards to head shards, whole-sequence attention per head group",
    runner="ulysses",
))
register_backend(BackendSpec(
    "tasp", "zigzag", _ANY, None,
    "TASP: key/value sub-blocks travel on the arc-disjoint Hamiltonian cycles of K_n, one all_to_all per hop",
    runner="tasp",
))
register_backend(BackendSpec(
    "cad", "cad", ("cad", "contiguous"), None,
    "CAD: documents stay whole; a scheduler balances core-attention tasks over all ranks as servers",
    runner="cad.runtime",
))
register_backend(BackendSpec(
    "distflash", "contiguous", ("contiguous",), distflash_schedule,
    "DistFlashAttn: contiguous chunks, idle ranks compute for busy ones, P // 2 + 1 steps",
))
register_backend(BackendSpec(
    "auto", "zigzag", _ANY, None,
    "measures tasp against zigzag (and ring/distflash on contiguous placement) once per shape, keeps the fastest",
))
