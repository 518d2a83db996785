"""PackedCollator: one (1, T) packed sequence with the conventions of transformers' DataCollatorWithFlattening."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from transformers import DataCollatorWithFlattening

from hf_longctx.data import PackedCollator, packed_synthetic_dataset


def random_rows(rng: random.Random, n_rows: int):
    rows = []
    for _ in range(n_rows):
        lens = [rng.randint(1, 9) for _ in range(rng.randint(1, 4))]
        rows.append({"input_ids": [rng.randrange(100) for _ in range(sum(lens))], "doc_lens": lens})
    return rows


def per_document(rows):
    """The same batch as transformers sees it: one example per document."""
    out = []
    for row in rows:
        pos = 0
        for n in row["doc_lens"]:
            example = {"input_ids": row["input_ids"][pos : pos + n]}
            if "labels" in row:
                example["labels"] = row["labels"][pos : pos + n]
            out.append(example)
            pos += n
    return out


@pytest.mark.parametrize("seed", range(5))
def test_equals_data_collator_with_flattening(seed):
    rows = random_rows(random.Random(seed), 3)
    ours = PackedCollator(return_flash_attn_kwargs=True, return_seq_idx=True)(rows)
    theirs = DataCollatorWithFlattening(return_tensors="pt", return_flash_attn_kwargs=True,
                                        return_seq_idx=True)(per_document(rows))
    assert set(theirs) <= set(ours)
    for key, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), key
        else:
            assert ours[key] == value, key
    lens = [n for r in rows for n in r["doc_lens"]]
    assert ours["doc_lens"].dtype == torch.int64 and ours["doc_lens"].tolist() == lens
    for key in ("input_ids", "labels", "position_ids"):
        assert ours[key].dtype == torch.int64 and ours[key].shape == (1, sum(lens))


def test_labels_unshifted_with_ignore_at_every_document_start():
    rows = [{"input_ids": [5, 6, 7, 8, 9], "doc_lens": [2, 3]}, {"input_ids": [1, 2, 3], "doc_lens": [3]}]
    out = PackedCollator()(rows)
    assert out["input_ids"].tolist() == [[5, 6, 7, 8, 9, 1, 2, 3]]
    assert out["labels"].tolist() == [[-100, 6, -100, 8, 9, -100, 2, 3]]
    assert out["position_ids"].tolist() == [[0, 1, 0, 1, 2, 0, 1, 2]]
    # the targets Trainer counts (num_items_in_batch) are the real next-token targets: T - documents
    assert int((out["labels"] != -100).sum()) == 8 - 3


def test_row_labels_are_used_and_rows_without_doc_lens_are_one_document():
    rows = [{"input_ids": [1, 2, 3], "labels": [-100, 20, 30]}, {"input_ids": [4, 5], "doc_lens": [1, 1],
                                                                  "labels": [40, 50]}]
    out = PackedCollator()(rows)
    assert out["labels"].tolist() == [[-100, 20, 30, -100, -100]] and out["doc_lens"].tolist() == [3, 1, 1]
    theirs = DataCollatorWithFlattening(return_tensors="pt")(per_document([{**rows[0], "doc_lens": [3]}, rows[1]]))
    assert torch.equal(out["labels"], theirs["labels"])


def test_padding_is_an_ignored_document():
    out = PackedCollator(pad_to_multiple_of=4, pad_token_id=9)([{"input_ids": [1, 2, 3, 4, 5], "doc_lens": [5]}])
    assert out["input_ids"].tolist() == [[1, 2, 3, 4, 5, 9, 9, 9]] and out["doc_lens"].tolist() == [5, 3]
    assert out["labels"].tolist() == [[-100, 2, 3, 4, 5, -100, -100, -100]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    same = PackedCollator(pad_to_multiple_of=4)([{"input_ids": [1, 2, 3, 4], "doc_lens": [4]}])
    assert same["doc_lens"].tolist() == [4]  # already a multiple: no padding document


def test_tensor_and_numpy_rows_and_validation():
    rows = [{"input_ids": torch.tensor([3, 4, 5]), "doc_lens": np.array([1, 2])}]
    assert PackedCollator()(rows)["position_ids"].tolist() == [[0, 0, 1]]
    with pytest.raises(ValueError, match="do not add up"):
        PackedCollator()([{"input_ids": [1, 2, 3], "doc_lens": [1, 1]}])
    with pytest.raises(ValueError, match="empty batch"):
        PackedCollator()([])
    without = PackedCollator(return_position_ids=False)(rows)
    assert "position_ids" not in without and without["doc_lens"].tolist() == [1, 2]


def test_synthetic_rows_collate_to_full_budget():
    ds = packed_synthetic_dataset(4, 256, mix="lognormal", vocab_size=50, seed=2)
    assert all(len(r) == 256 and sum(d) == 256 for r, d in zip(ds["input_ids"], ds["doc_lens"]))
    assert max(max(r) for r in ds["input_ids"]) < 50
    assert ds["input_ids"] == packed_synthetic_dataset(4, 256, mix="lognormal", vocab_size=50, seed=2)["input_ids"]
    out = PackedCollator()([ds[0], ds[1]])
    lens = ds[0]["doc_lens"] + ds[1]["doc_lens"]
    assert out["input_ids"].shape == (1, 512) and out["doc_lens"].tolist() == lens
    starts = np.cumsum([0] + lens[:-1])
    assert (out["position_ids"][0, starts] == 0).all() and (out["labels"][0, starts] == -100).all()
    assert packed_synthetic_dataset(2, 64, mix="uniform")["doc_lens"] == [[64], [64]]
