"""Liger-Kernel's fused ops on the GPU: they keep what the memory model says, and they train like transformers' own.

The memory planner reaches longer contexts with Liger's RMSNorm, RoPE and SwiGLU, which keep less for
backward than transformers' modules (hf_longctx.hf.memory.fused_ops). Here a tiny Llama patched
by :func:`enable_fused_ops` keeps, per decoder layer, exactly the bytes :class:`MemoryModel` predicts
with ``fused_ops=True``; and a Trainer run with ``use_liger_kernel=True`` (TRL's flag is the same
TrainingArguments field) and the long-context callback gives the losses and gradient norms of the
same run without Liger, for every backend at world size one, under ``memory: manual`` and ``auto``.
"""

from __future__ import annotations

import pytest
import torch
from test_memory_plan import _batch, _SavedPerLayer, _tiny
from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
from transformers.models.llama import modeling_llama

import hf_longctx
from hf_longctx.backends.registry import backend_names
from hf_longctx.hf.memory.enable import enable_memory_options
from hf_longctx.hf.memory.fused_ops import enable_fused_ops, uses_fused_norms
from hf_longctx.hf.memory.model import MemoryModel, ModelShape
from hf_longctx.hf.settings.schema import LongContextConfig

pytest.importorskip("liger_kernel")

# Liger patches transformers' Llama module as well as the instance (its RoPE is a module function): each run
# here starts from transformers' own modules, as a fresh process would
_LLAMA_NAMES = ("LlamaRMSNorm", "LlamaMLP", "apply_rotary_pos_emb")
_ORIGINAL = {name: getattr(modeling_llama, name) for name in _LLAMA_NAMES}


def _fresh_transformers() -> None:
    for name, value in _ORIGINAL.items():
        setattr(modeling_llama, name, value)


@pytest.fixture(autouse=True)
def _unpatched_transformers():
    _fresh_transformers()
    yield
    _fresh_transformers()


def _on_gpu(batch: dict) -> dict:
    return {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()}


def test_fused_layers_keep_what_the_memory_model_predicts():
    """A layer without checkpointing keeps exactly the model's bytes (its checkpoint under checkpointing is its
    input, the same with or without fused ops: tests/test_memory_plan.py)."""
    tokens, layers = 256, 3
    model = _tiny(layers).cuda()
    model.train()
    enable_fused_ops(model, swiglu=True)
    assert uses_fused_norms(model)
    probe = _SavedPerLayer(model)
    loss = model(**_on_gpu(_batch(tokens))).loss
    fused = MemoryModel(ModelShape.from_config(model.config), tokens, precision="bf16", fused_ops=True)
    plain = MemoryModel(ModelShape.from_config(model.config), tokens, precision="bf16")
    saved = probe.per_layer_bytes()
    assert saved == [fused.checkpoint["none"]] * layers, (saved, fused.checkpoint["none"], plain.checkpoint["none"])
    assert fused.checkpoint["none"] < plain.checkpoint["none"]
    loss.backward()


def test_tiled_mlp_composes_with_fused_norms():
    tokens, layers = 256, 2
    model = _tiny(layers).cuda()
    model.train()
    enable_fused_ops(model, swiglu=False)
    enable_memory_options(model, tiled_mlp=64)
    probe = _SavedPerLayer(model)
    batch = _on_gpu(_batch(tokens))
    model(**batch).loss.backward()
    fused = MemoryModel(ModelShape.from_config(model.config), tokens, precision="bf16", tiled_mlp=64, fused_ops=True)
    assert probe.per_layer_bytes() == [fused.checkpoint["none"]] * layers


class _Rows(torch.utils.data.Dataset):
    def __init__(self, count: int, vocab: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        lens = torch.randint(20, 120, (count,), generator=g).tolist()
        self.rows = [{"input_ids": torch.randint(3, vocab, (n,), generator=g).tolist()} for n in lens]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def _train(tmp_path, backend: str, liger: bool, memory: str) -> tuple[list[float], list[float], bool]:
    _fresh_transformers()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attn_implementation=f"longctx_{backend}")
    model = LlamaForCausalLM(cfg).cuda()
    args = TrainingArguments(output_dir=str(tmp_path / f"{backend}-{liger}-{memory}"), per_device_train_batch_size=4,
                             max_steps=3, logging_steps=1, learning_rate=1e-3, report_to=[], save_strategy="no",
                             use_liger_kernel=liger, seed=0, dataloader_num_workers=0,
                             gradient_checkpointing=memory == "manual")
    # a Ulysses mesh backend needs its group size, as a user's recipe gives it: one rank here
    options = {"ulysses_size": 1} if backend.startswith("ulysses_") else {}
    callback = hf_longctx.LongContextCallback(LongContextConfig(memory=memory, seq_len=512, backend=backend,
                                                                backend_options=options))
    trainer = Trainer(model=model, args=args, train_dataset=_Rows(32, 97),
                      data_collator=DataCollatorWithFlattening(return_position_ids=True), callbacks=[callback])
    trainer.train()
    logs = trainer.state.log_history
    return ([e["loss"] for e in logs if "loss" in e], [e["grad_norm"] for e in logs if "grad_norm" in e],
            uses_fused_norms(model))


@pytest.mark.parametrize("backend", sorted(set(backend_names()) - {"auto"}))
def test_trainer_use_liger_kernel_trains_like_without_it(tmp_path, backend):
    """Reference: transformers' own modules, recompute-aware checkpointing. Liger through the Trainer's flag
    (which also swaps in its fused linear cross-entropy), with manual options and with ``memory: auto`` (which
    must see the patched norms and not patch again), and ``memory: auto`` alone (which switches them on)."""
    ref_losses, ref_norms, ref_fused = _train(tmp_path, backend, liger=False, memory="manual")
    assert not ref_fused
    for liger, memory in ((True, "manual"), (True, "auto"), (False, "auto")):
        losses, norms, fused = _train(tmp_path, backend, liger=liger, memory=memory)
        assert fused, (liger, memory)
        assert len(losses) == len(ref_losses) == 3
        assert losses == pytest.approx(ref_losses, rel=2e-4), (liger, memory)
        assert norms == pytest.approx(ref_norms, rel=2e-3), (liger, memory)
