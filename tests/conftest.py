import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402 - after the path set-up above


@pytest.fixture
def tmp_datasets_cache(tmp_path, monkeypatch):
    """A datasets cache of the test's own: no test reads what another one cached."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_datasets_cache")
