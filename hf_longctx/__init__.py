"""hf_longctx: exact distributed core attention for long-context training with transformers.

Importing the package registers the ``longctx_<backend>`` attention implementations with
transformers when transformers is installed; without it, kernels, layouts and backends still work.
Only the absence of transformers is tolerated: any other import failure surfaces as it is.
"""

import importlib
import importlib.util

__version__ = "0.1.0"

if importlib.util.find_spec("transformers") is not None:
    from .hf.integration.attention import register_attention_implementations as _register

    ATTENTION_IMPLEMENTATIONS = _register()
else:
    ATTENTION_IMPLEMENTATIONS = []


# the product's subpackages; hf_longctx.lab (research) is imported by name, never from here
_SUBPACKAGES = ("backends", "comm", "data", "hf", "kernels", "layout", "moe")


def __getattr__(name: str):
    if name == "LongContextCallback":  # imports transformers.Trainer machinery only when asked for
        from .hf.integration.callback import LongContextCallback

        return LongContextCallback
    if name in _SUBPACKAGES:  # hf_longctx.moe etc. work after a plain `import hf_longctx`
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'hf_longctx' has no attribute {name!r}")
