"""A backend as the user names it (recipe, command line, attn_implementation) -> its registry name.

This is the one place that reads user spellings: everything below it takes registry names only.
"""

from __future__ import annotations

import difflib

from ..backends import backend_names

# Spellings accepted from users only: DistFlashAttn's paper name. The registry and every API below the
# settings call it ``distfa`` (transformers reads "flash" in an attention name as a FlashAttention kernel).
USER_ALIASES = {"distflash": "distfa"}


def backend_from_name(name: str) -> str:
    """Registry name of a backend given as in a recipe or as an attn_implementation.

    One name per backend: the recipe's ``backend`` is the ``attn_implementation`` without its
    ``longctx_`` prefix (``zigzag``, ``distfa``, ...); the full ``longctx_*`` name and the paper's
    ``distflash`` (:data:`USER_ALIASES`) are accepted too. Anything else fails with the closest valid name.
    """
    from .attention import PREFIX, backend_of, implementation_name

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
