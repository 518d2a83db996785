"""A run stopped mid-epoch and resumed from its Trainer checkpoint trains on exactly the rows of an
uninterrupted run, in the same order: no row skipped, none repeated (map-style and streaming)."""

from __future__ import annotations

import datasets
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from hf_longctx.data import PackedCollator, pack_documents

SEQ_LEN, ROWS, BATCH = 8, 12, 2  # 6 steps per epoch
STEPS, STOP_AT = 9, 4  # stop mid-epoch 1, resume, and cross into epoch 2


pytestmark = pytest.mark.usefixtures("tmp_datasets_cache")  # tests/conftest.py


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """A 32-wide model gains nothing from threads, and on a busy small machine they spin against each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def documents(streaming: bool):
    """12 rows of 8 tokens after packing; row r holds tokens 8r .. 8r+7, so a token names its row."""
    lengths = [3, 9, 1, 20, 5, 7, 11, 2, 16, 6, 4, 12]
    docs, start = [], 0
    for n in lengths:
        docs.append(list(range(start, start + n)))
        start += n
    ds = datasets.Dataset.from_dict({"input_ids": docs})
    return pack_documents(ds.to_iterable_dataset() if streaming else ds, seq_len=SEQ_LEN)


class StopAt(TrainerCallback):
    """Simulates a job killed right after the checkpoint of step ``step`` was written."""

    def __init__(self, step: int):
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def run(out, dataset, seen, resume=None, stop=None):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=SEQ_LEN * ROWS, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg)
    assert model.config._attn_implementation == "sdpa"

    def record(module, args, kwargs):  # what the model trains on, not what the loader prefetched
        ids = kwargs["input_ids"].reshape(-1, SEQ_LEN)
        seen.append(tuple(int(row[0]) // SEQ_LEN for row in ids))

    model.register_forward_pre_hook(record, with_kwargs=True)
    args = TrainingArguments(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=BATCH,
                             save_strategy="steps", save_steps=STOP_AT, report_to=[], use_cpu=True, seed=3,
                             remove_unused_columns=False, logging_steps=100, dataloader_num_workers=0,
                             learning_rate=1e-3, disable_tqdm=True)
    callbacks = [StopAt(stop)] if stop else []
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=PackedCollator(),
                      callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


@pytest.mark.parametrize("streaming", [False, True], ids=["map-style", "streaming"])
def test_resume_mid_epoch_loses_and_repeats_nothing(tmp_path, streaming):
    full: list = []
    run(tmp_path / "full", documents(streaming), full)
    assert len(full) == STEPS
    epoch = sorted(r for batch in full[: ROWS // BATCH] for r in batch)
    assert epoch == list(range(ROWS))  # the first epoch shows every row exactly once

    first: list = []
    stopped = run(tmp_path / "part", documents(streaming), first, stop=STOP_AT)
    assert stopped.state.global_step == STOP_AT and len(first) == STOP_AT
    rest: list = []
    checkpoint = tmp_path / "part" / f"checkpoint-{STOP_AT}"
    resumed = run(tmp_path / "part", documents(streaming), rest, resume=str(checkpoint))
    assert resumed.state.global_step == STEPS
    assert first + rest == full  # same rows, same order: none skipped, none repeated
