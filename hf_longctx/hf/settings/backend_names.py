"""A backend's names: its registry name, its transformers attention name, and the user's spellings of either.

transformers knows a backend as ``longctx_<name>`` (:func:`implementation_name`, :func:`backend_of`); a recipe, the
command line or an ``attn_implementation`` may spell it several ways (:func:`backend_from_name`). This is the one
place that reads user spellings: everything below it takes registry names only.
"""

from __future__ import annotations

import difflib

from ...backends import backend_names, registered_backends

PREFIX = "longctx_"


def implementation_name(backend: str) -> str:
    """transformers attention name of a backend: ``longctx_<backend>``.

    transformers treats every attention name containing "flash" as a FlashAttention kernel to import,
    so "flash" in a backend name becomes "fa".
    """
    return PREFIX + backend.replace("flash", "fa")


def backend_of(implementation: str) -> str:
    """Registry name of the backend behind a ``longctx_*`` attention name."""
    if not implementation.startswith(PREFIX):
        raise ValueError(f"{implementation!r} is not an hf_longctx attention implementation")
    return next((b.name for b in registered_backends() if implementation_name(b.name) == implementation),
                implementation[len(PREFIX):])


# Spellings accepted from users only: DistFlashAttn's paper name. The registry and every API below the
# settings call it ``distfa`` (transformers reads "flash" in an attention name as a FlashAttention kernel).
USER_ALIASES = {"distflash": "distfa"}


def backend_from_name(name: str) -> str:
    """Registry name of a backend given as in a recipe or as an attn_implementation.

    One name per backend: the recipe's ``backend`` is the ``attn_implementation`` without its
    ``longctx_`` prefix (``zigzag``, ``distfa``, ...); the full ``longctx_*`` name and the paper's
    ``distflash`` (:data:`USER_ALIASES`) are accepted too. Anything else fails with the closest valid name.
    """
    if not isinstance(name, str):
        raise ValueError(f"backend must be a name, got {name!r}")
    short = name[len(PREFIX):] if name.startswith(PREFIX) else name
    short = USER_ALIASES.get(short, short)
    names = backend_names()
    if short in names:
        return short
    try:
        backend = backend_of(PREFIX + short)
    except ValueError:
        backend = None
    if backend in names:
        return backend
    public = [implementation_name(b)[len(PREFIX):] for b in names]
    hint = difflib.get_close_matches(short, public, n=1, cutoff=0.5)
    raise ValueError(f"unknown backend {name!r}" + (f"; did you mean {hint[0]!r}?" if hint else "")
                     + f" (choose one of {', '.join(public)}; the same names as attn_implementation='longctx_<name>')")
