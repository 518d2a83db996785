"""hf_longctx: exact distributed core attention for long-context training with transformers.

Importing the package registers the ``longctx_<backend>`` attention implementations with
transformers (when transformers is installed).
"""

__version__ = "0.1.0"

try:
    from .hf.attention import register_attention_implementations as _register

    ATTENTION_IMPLEMENTATIONS = _register()
except ImportError:  # transformers missing: kernels, layouts and backends still work
    ATTENTION_IMPLEMENTATIONS = []


_SUBPACKAGES = ("backends", "comm", "data", "hf", "kernels", "layout")


def __getattr__(name: str):
    if name == "LongContextCallback":  # imports transformers.Trainer machinery only when asked for
        from .hf.callback import LongContextCallback

        return LongContextCallback
    if name in _SUBPACKAGES:  # hf_longctx.data etc. work after a plain `import hf_longctx`
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'hf_longctx' has no attribute {name!r}")
