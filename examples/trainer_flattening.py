"""transformers Trainer + DataCollatorWithFlattening with sequence parallelism, then generate().

    accelerate launch --config_file recipes/cpu-2proc.yaml examples/trainer_flattening.py
    python examples/trainer_flattening.py                                  # one process

Every example is one tokenized document; the collator flattens a batch into one sequence with
position_ids restarting per document, which is all a ``longctx_*`` model needs. After training the
callback has taken its hooks off: the same model evaluates and generates in each process.

``--docs-per-step`` is per process: 2 processes at ``--docs-per-step 4`` log the losses of one
process at ``--docs-per-step 8`` (the same documents per step), not of one at 4.
"""

from __future__ import annotations

import argparse
import logging

import torch
from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import hf_longctx
from hf_longctx.data import load_sample_tokenizer, load_text_dataset, sample_corpus_path
from hf_longctx.hf import check_run, report_config_errors


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--attn-implementation", default=None, help="default: the recipe's backend")
    p.add_argument("--max-steps", type=int, default=10)
    p.add_argument("--docs-per-step", type=int, default=4, help="documents per process per step")
    p.add_argument("--max-tokens", type=int, default=512, help="documents are cut to this many tokens")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--output-dir", default="outputs/trainer_flattening")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(format="%(message)s")
    logging.getLogger("hf_longctx").setLevel(logging.INFO)  # the callback says what it set up
    with report_config_errors():
        cfg = check_run(attn_implementation=args.attn_implementation)
    impl = args.attn_implementation or cfg.attn_implementation
    tokenizer = load_sample_tokenizer()
    texts = load_text_dataset(str(sample_corpus_path())).filter(lambda row: row["text"].strip() != "")
    docs = texts.map(lambda row: {"input_ids": tokenizer(row["text"])["input_ids"][: args.max_tokens]},
                     remove_columns=texts.column_names)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation=impl, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    ))
    training = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.docs_per_step,
        learning_rate=3e-3, logging_steps=1, save_strategy="no", report_to=[], bf16=args.bf16,
        use_cpu=not torch.cuda.is_available(), dataloader_drop_last=True,
    )
    callbacks = [hf_longctx.LongContextCallback(cfg)] if impl.startswith("longctx_") else []
    trainer = Trainer(model=model, args=training, train_dataset=docs, data_collator=DataCollatorWithFlattening(),
                      callbacks=callbacks)
    trainer.train()
    model.eval()
    prompt = tokenizer(["Logbook 7 of", "The warehouse"], return_tensors="pt", padding=True, padding_side="left")
    out = model.generate(**prompt.to(model.device), max_new_tokens=12, do_sample=False)
    if trainer.is_world_process_zero():
        for text in tokenizer.batch_decode(out, skip_special_tokens=True):
            print("generated:", text)


if __name__ == "__main__":
    main()
