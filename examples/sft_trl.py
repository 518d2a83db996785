"""Supervised fine-tuning with TRL's SFTTrainer (packing + padding_free) and sequence parallelism.

    accelerate launch --config_file recipes/cpu-2proc.yaml examples/sft_trl.py     # 2 CPU processes
    python examples/sft_trl.py                                                            # one process

Needs TRL: ``pip install -e '.[examples]'``.

A small random Llama built from a config, the tokenizer and corpus shipped in ``data/`` (no
download). TRL packs documents into rows and passes them padding-free (position_ids restarting per
document); ``LongContextCallback`` shards each step's rows over the sequence-parallel group. The
attention backend is the model's ``attn_implementation`` (default: the recipe's backend).

``--rows-per-process`` is per process: 2 processes at 1 row each log the losses of one process at
``--rows-per-process 2`` (the same rows per step), not of one at 1.
"""

from __future__ import annotations

import argparse
import json
import logging

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_longctx
from hf_longctx.data import load_sample_tokenizer, load_text_dataset, sample_corpus_path
from hf_longctx.hf import check_run, report_config_errors
from hf_longctx.hf.memory.checkpointing import checkpointing_training_args

NEEDS_TRL = "examples/sft_trl.py needs TRL: pip install -e '.[examples]' (or pip install 'trl>=1.16')"
try:
    from trl import SFTConfig, SFTTrainer
except ModuleNotFoundError as missing:  # TRL is not a dependency of hf_longctx: say how to get it, in one line
    if missing.name != "trl":  # TRL itself is there, something it imports is not: its own error says what
        raise
    raise SystemExit(NEEDS_TRL) from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--attn-implementation", default=None,
                   help="longctx_<backend> or any transformers implementation (default: the recipe's backend)")
    p.add_argument("--max-steps", type=int, default=10)
    p.add_argument("--max-length", type=int, default=512, help="tokens per packed row")
    p.add_argument("--rows-per-process", type=int, default=1, help="packed rows per process per step")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast over float32 weights (TRL's default on GPU)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="outputs/sft_trl")
    p.add_argument("--log-json", default=None, help="write the logged losses here (rank 0)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(format="%(message)s")
    logging.getLogger("hf_longctx").setLevel(logging.INFO)  # the callback says what it set up
    with report_config_errors():
        cfg = check_run(attn_implementation=args.attn_implementation)
    impl = args.attn_implementation or cfg.attn_implementation
    tokenizer = load_sample_tokenizer()
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
        num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden_size // 32),
        num_key_value_heads=max(1, args.hidden_size // 64), max_position_embeddings=65536,
        attn_implementation=impl, tie_word_embeddings=True,
    ))
    sft = SFTConfig(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.rows_per_process,
        learning_rate=args.lr, logging_steps=1, save_strategy="no", report_to=[], seed=args.seed, bf16=args.bf16,
        use_cpu=not torch.cuda.is_available(), packing=True, padding_free=True, max_length=args.max_length,
        train_sampling_strategy="sequential", dataloader_drop_last=True,
        # TRL turns checkpointing on by default under transformers' deprecated name; name it the current way
        **checkpointing_training_args(cfg.checkpointing != "none"),
    )
    callbacks = [hf_longctx.LongContextCallback(cfg)] if impl.startswith("longctx_") else []
    trainer = SFTTrainer(model=model, args=sft, train_dataset=load_text_dataset(str(sample_corpus_path())),
                         processing_class=tokenizer, callbacks=callbacks)
    trainer.train()
    if trainer.is_world_process_zero():
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        print(json.dumps({"attn_implementation": impl, "bf16": args.bf16, "losses": losses}))
        if args.log_json:
            with open(args.log_json, "w") as f:
                json.dump({"attn_implementation": impl, "bf16": args.bf16, "losses": losses}, f)


if __name__ == "__main__":
    main()
