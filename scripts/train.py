"""Train a Llama-family model on packed long documents with a sequence-parallel attention backend.

    accelerate launch --config_file recipes/cpu-2proc.yaml scripts/train.py
    accelerate launch --config_file recipes/cpu-2proc.yaml scripts/train.py --backend cad --seq-len 2048

The recipe (an accelerate config for the hardware shape plus its ``.longctx.yaml`` sidecar) picks
the backend, the sequence-parallel size and the checkpointing mode; ``--<key> VALUE`` overrides one
sidecar key (``--backend``, ``--seq-len``, ``--sp-size``, ...), checked like the sidecar. Defaults: a
tiny random Llama, the sample corpus and tokenizer shipped in ``data/``, CPU when no GPU is present.
``--model`` takes any local Llama-family checkpoint (or a hub name where a network exists),
``--dataset`` any local json/parquet/arrow text set.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

# long contexts allocate and free many large blocks: growable segments keep the caching allocator from
# fragmenting (the memory planner budgets for the rest); set before CUDA starts, a user's value wins
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Trainer,
    TrainingArguments,
)

import hf_longctx
from hf_longctx.data import (
    PackedCollator,
    load_sample_tokenizer,
    load_text_dataset,
    pack_documents,
    packed_synthetic_dataset,
    sample_corpus_path,
)
from hf_longctx.data.tokenization import TextColumnError
from hf_longctx.hf import ConfigError, apply_model_parallelism, check_positive, check_run, report_config_errors
from hf_longctx.hf.integration.preflight import check_model_config
from hf_longctx.hf.memory.checkpointing import checkpointing_training_args
from hf_longctx.hf.memory.optimizer_offload import trainer_optimizer_cls_and_kwargs
from hf_longctx.hf.memory.training import plan_for_training
from hf_longctx.hf.parallel.fsdp import enable_fsdp_on_cpu
from hf_longctx.hf.settings.sources import add_config_arguments, config_overrides, recipe_source


def tiny_llama_config(vocab_size: int, attn_implementation: str) -> LlamaConfig:
    """A small Llama with GQA: big enough to learn the sample corpus in a few dozen CPU steps."""
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=65536,
        attn_implementation=attn_implementation, tie_word_embeddings=True,
    )


def tiny_moe_config(vocab_size: int, attn_implementation: str) -> Qwen3MoeConfig:
    """A small Qwen3-MoE (8 experts, top-2, aux loss on): the model for recipes with ep_size."""
    return Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_experts=8,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        output_router_logits=True, max_position_embeddings=65536, attn_implementation=attn_implementation,
        tie_word_embeddings=True,
    )


def llama3_8b_shape(vocab_size: int, layers: int, attn_implementation: str) -> LlamaConfig:
    """Llama-3-8B dimensions (hidden 4096, 32 heads, 8 KV heads, MLP 14336) with a chosen depth and vocab."""
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=1 << 22, rope_theta=500000.0,
        attn_implementation=attn_implementation,
    )


def model_config(args, cfg, tokenizer):
    """The config of the model --model names, without building the model."""
    if args.model == "tiny":
        return tiny_llama_config(len(tokenizer), cfg.attn_implementation)
    if args.model == "tiny-moe":
        return tiny_moe_config(len(tokenizer), cfg.attn_implementation)
    if args.model == "llama3-8b-shape":
        return llama3_8b_shape(args.vocab_size, args.num_layers, cfg.attn_implementation)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(args.model)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny",
                   help="'tiny', 'tiny-moe' or 'llama3-8b-shape' (random weights, built here), or a path / hub name")
    p.add_argument("--num-layers", type=int, default=32, help="depth of llama3-8b-shape")
    p.add_argument("--vocab-size", type=int, default=32000, help="vocabulary of llama3-8b-shape")
    p.add_argument("--dataset", default=None,
                   help="text dataset (default: the shipped sample corpus), or 'synthetic' for random tokens")
    p.add_argument("--synthetic-mix", default="lognormal", help="document-length mix of --dataset synthetic")
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--logging-steps", type=int, default=5)
    p.add_argument("--output-dir", default="outputs/train")
    p.add_argument("--recipe", default=None, help="an accelerate config with its sidecar beside it, or a "
                   ".longctx.yaml sidecar (default: the --config_file accelerate launch was given)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-json", default=None, help="write the Trainer's log history (losses, grad norms) here")
    add_config_arguments(p)  # --backend, --seq-len (tokens per process, default 1024), --sp-size, ...
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args, unknown = p.parse_known_args(argv)
    logging.basicConfig(format="%(message)s")
    logging.getLogger("hf_longctx").setLevel(logging.INFO)  # the callback says what it set up
    with report_config_errors():  # before any model or data: one short message, no per-rank tracebacks
        for option in ("--max-steps", "--logging-steps", "--num-layers", "--vocab-size", "--lr"):
            check_positive(option, getattr(args, option[2:].replace("-", "_")))
        overrides = config_overrides(args, unknown, p)
        cfg = check_run(args.recipe, overrides=overrides, dataset=args.dataset, model=args.model)
    seq_len = cfg.seq_len
    on_gpu = torch.cuda.is_available()
    built = args.model in ("tiny", "tiny-moe", "llama3-8b-shape")
    if built:
        tokenizer = load_sample_tokenizer()
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
    torch.manual_seed(args.seed)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    memory_plan = None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    with report_config_errors():  # what the model's config answers (heads, experts, layers), before building it
        config = model_config(args, cfg, tokenizer)
        check_model_config(cfg, config, world, source=recipe_source(args.recipe, overrides))
        if cfg.memory == "auto":  # a plan that cannot fit stops the run here, before any model or data is built
            memory_plan = plan_for_training(config, cfg, tokens_per_gpu=seq_len, world=world,
                                            sp_size=cfg.resolved_sp_size(world), precision="bf16" if on_gpu else "fp32")
        texts = None
        if args.dataset != "synthetic":  # read (not tokenized) here: a text column that is not text stops the run
            try:
                texts = load_text_dataset(args.dataset or str(sample_corpus_path()))
            except TextColumnError as err:
                raise ConfigError(f"--dataset: {err}") from None
    if args.model == "tiny":
        model = LlamaForCausalLM(tiny_llama_config(len(tokenizer), cfg.attn_implementation))
    elif args.model == "tiny-moe":
        model = Qwen3MoeForCausalLM(tiny_moe_config(len(tokenizer), cfg.attn_implementation))
    elif args.model == "llama3-8b-shape":
        with torch.device("cuda" if on_gpu else "cpu"):
            model = LlamaForCausalLM(llama3_8b_shape(args.vocab_size, args.num_layers, cfg.attn_implementation))
        model.to(dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation=cfg.attn_implementation,
                                                     dtype=dtype)
    apply_model_parallelism(model, cfg)  # the recipe's ep_size / expert_tp_size (nothing when all are 1)
    if args.dataset == "synthetic":
        packed = packed_synthetic_dataset(4 * args.max_steps * max(1, torch.cuda.device_count()), seq_len,
                                          mix=args.synthetic_mix, vocab_size=model.config.vocab_size, seed=args.seed)
    else:
        packed = pack_documents(texts, tokenizer, seq_len=seq_len, seed=args.seed)
    training_args = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=1,
        learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=max(1, args.max_steps // 10),
        logging_steps=min(args.logging_steps, args.max_steps), save_strategy="no", report_to=[], seed=args.seed,
        remove_unused_columns=False,  # keep doc_lens: the document structure the backends need
        use_cpu=not on_gpu, dataloader_drop_last=True, ddp_find_unused_parameters=False,
        **checkpointing_training_args(cfg.checkpointing != "none"),  # the callback makes it recompute-aware
    )
    enable_fsdp_on_cpu(training_args)  # an FSDP2 recipe on CPU: accelerate would fall back to DDP (hf.parallel.fsdp)
    callback = hf_longctx.LongContextCallback(cfg)
    # a plan that keeps AdamW on the host needs that optimizer from the start (the callback checks it)
    host_adamw = memory_plan is not None and memory_plan.optimizer_on_host
    trainer = Trainer(model=model, args=training_args, train_dataset=packed, data_collator=PackedCollator(),
                      callbacks=[callback],
                      optimizer_cls_and_kwargs=trainer_optimizer_cls_and_kwargs(training_args) if host_adamw else None)
    start = time.perf_counter()
    trainer.train()
    elapsed = time.perf_counter() - start
    if trainer.is_world_process_zero():
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        summary = {
            **callback.summary, "steps": trainer.state.global_step, "rows": len(packed),
            "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
            "seconds": round(elapsed, 1), "processes": training_args.world_size,
        }
        print("hf_longctx training summary: " + json.dumps(summary))
        if args.log_json:
            with open(args.log_json, "w") as f:
                json.dump(trainer.state.log_history, f)
    if torch.distributed.is_initialized():  # leave together: a gloo group torn down at interpreter exit can abort
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
