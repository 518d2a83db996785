"""Regenerate data/sample_corpus.jsonl and data/tokenizer/ deterministically (CC0, generated text).

The generator lives in :mod:`hf_longctx.data.sample_data` (also reachable as ``hf-longctx sample-data``),
so the shipped files, the command line and the test that compares them share one definition.
"""

from __future__ import annotations

import json
from pathlib import Path

from hf_longctx.data.sample_data import write_sample_data

DATA = Path(__file__).resolve().parent.parent / "data"


def main() -> None:
    print(json.dumps(write_sample_data(DATA)))


if __name__ == "__main__":
    main()
