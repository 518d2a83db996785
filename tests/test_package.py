"""What ``import hf_longctx`` gives: every subpackage by attribute, and import failures as they are."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import hf_longctx


def test_every_subpackage_is_an_attribute_after_a_plain_import():
    subpackages = sorted(m.name for m in pkgutil.iter_modules(hf_longctx.__path__) if m.ispkg and m.name != "lab")
    assert "moe" in subpackages  # the lab is imported by name only: the product never imports it
    for name in subpackages:
        assert getattr(hf_longctx, name).__name__ == f"hf_longctx.{name}"


def test_a_broken_import_inside_the_package_is_not_hidden():
    """A failing import below the transformers glue raises at ``import hf_longctx`` instead of leaving
    ``ATTENTION_IMPLEMENTATIONS`` silently empty."""
    code = ("import sys; sys.modules['hf_longctx.hf.integration.attention'] = None\n"
            "try:\n    import hf_longctx\nexcept ImportError as exc:\n    print('raised', exc)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.startswith("raised"), result.stdout + result.stderr
