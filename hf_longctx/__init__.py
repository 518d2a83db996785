"""hf_longctx: exact distributed core attention for long-context training with transformers."""

__version__ = "0.1.0"
