"""What a user of transformers, TRL and accelerate meets first: every path a ``longctx_*`` model takes.

- without the callback (one process, evaluation, ``generate()``, padded batches) the model is exact
  attention per document, equal to SDPA;
- ``bf16=True`` (autocast over float32 weights) trains like SDPA under the same autocast;
- Trainer + ``DataCollatorWithFlattening`` with no recipe, and TRL's ``SFTTrainer`` with packing and
  padding_free, give on 2 processes the losses, gradient norms and ``compute_metrics`` logits of one;
- checkpointing follows ``TrainingArguments``; the callback takes the backend from the model;
- a bad setting stops the training script before any model or data exists, in one short message.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

import hf_longctx
from hf_longctx.hf import (
    ConfigError,
    LongContextConfig,
    backend_from_name,
    check_attn_implementation,
    check_run,
    implementation_name,
)
from hf_longctx.kernels import reset_stats, stats

from distributed import run_distributed
from trainer_runs import flattening_run, trl_run

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 61
FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
            "mistral": (MistralConfig, MistralForCausalLM)}


def family_model(family: str, seed: int = 0):
    config_class, model_class = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = config_class(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
                       attn_implementation="sdpa", pad_token_id=0, eos_token_id=2, bos_token_id=1)
    if hasattr(cfg, "sliding_window"):
        cfg.sliding_window = None  # windows are another feature; these families run here without one
    return model_class(cfg).double().eval()


def _per_document_reference(model, ids, lens):
    """SDPA, one forward per document: logits and the gradients of the summed next-token loss."""
    model.set_attn_implementation("sdpa")
    model.zero_grad()
    logits, start = [], 0
    for n in lens:
        out = model(input_ids=ids[:, start : start + n]).logits
        torch.nn.functional.cross_entropy(out[0, :-1], ids[0, start + 1 : start + n], reduction="sum").backward()
        logits.append(out.detach())
        start += n
    return torch.cat(logits, dim=1), {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_batch_without_callback_equals_sdpa_per_document(family):
    """No callback, no process group: documents found from position_ids (or TRL's cu_seq_lens) stay apart."""
    model = family_model(family)
    lens = [7, 1, 12, 4]
    ids = torch.randint(3, VOCAB, (1, sum(lens)), generator=torch.Generator().manual_seed(1))
    ref_logits, ref_grads = _per_document_reference(model, ids, lens)
    model.set_attn_implementation("longctx_zigzag")
    model.zero_grad()
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    logits = model(input_ids=ids, position_ids=pos).logits
    torch.testing.assert_close(logits.detach(), ref_logits, rtol=1e-10, atol=1e-10)
    start = 0
    for n in lens:  # the same loss, from the packed logits
        torch.nn.functional.cross_entropy(logits[0, start : start + n - 1], ids[0, start + 1 : start + n],
                                          reduction="sum").backward(retain_graph=True)
        start += n
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-9, atol=1e-10, msg=name)
    cu = torch.tensor([0, 7, 8, 20, 24], dtype=torch.int32)  # what TRL's padding-free collator passes
    with torch.no_grad():
        flat = model(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=12,
                     max_length_k=12).logits
    torch.testing.assert_close(flat, ref_logits, rtol=1e-10, atol=1e-10)


def test_padded_batch_and_generate_equal_sdpa():
    """A padded batch and KV-cache decoding (q shorter than k: bottom-right causal) equal SDPA."""
    model = family_model("llama")
    ids = torch.randint(3, VOCAB, (3, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[0, :3] = 0  # left padding (generation)
    mask[1, 8:] = 0  # right padding (a padded training batch)
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        ref = model(input_ids=ids, attention_mask=mask).logits
        model.set_attn_implementation("longctx_distfa")
        out = model(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(out[keep], ref[keep], rtol=1e-10, atol=1e-10)

    left = mask.clone()
    left[1] = 1
    for inputs in ({"input_ids": ids, "attention_mask": left}, {"input_ids": ids[2:]}):
        runs = {}
        for impl in ("sdpa", "longctx_zigzag"):
            model.set_attn_implementation(impl)
            runs[impl] = model.generate(**inputs, max_new_tokens=5, do_sample=False, output_logits=True,
                                        return_dict_in_generate=True, pad_token_id=0)
        assert torch.equal(runs["sdpa"].sequences, runs["longctx_zigzag"].sequences)
        torch.testing.assert_close(torch.stack(runs["longctx_zigzag"].logits), torch.stack(runs["sdpa"].logits),
                                   rtol=1e-9, atol=1e-9)


def test_mixed_dtypes_follow_autocast_and_are_refused_outside_it():
    """Under autocast q/k (float32 out of RoPE) and v (bf16) meet in the autocast dtype; outside, a clear error."""
    from transformers import AttentionInterface

    attention = AttentionInterface()["longctx_ring"]
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 9, 8, generator=g) for h in (4, 2, 2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attention(torch.nn.Module(), q, k, v.bfloat16(), None)
    assert out.dtype == torch.bfloat16
    expected, _ = attention(torch.nn.Module(), q.bfloat16(), k.bfloat16(), v.bfloat16(), None)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="outside autocast: cast the whole model to one dtype"):
        attention(torch.nn.Module(), q, k, v.bfloat16(), None)


def test_trainer_bf16_autocast_trains_like_sdpa_and_generates_after(tmp_path):
    """Trainer(bf16=True) on CPU autocasts over float32 weights; after train() the hooks are gone."""
    ours = flattening_run(str(tmp_path / "ours"), steps=2, bf16=True)
    ref = flattening_run(str(tmp_path / "sdpa"), steps=2, bf16=True, impl="sdpa", callback=False)
    assert ours["losses"] == pytest.approx(ref["losses"], rel=1e-3)
    assert ours["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-3)
    model = ours["model"].eval()
    assert not model._forward_pre_hooks and not model._forward_hooks  # the callback removed what it installed
    prompt = torch.tensor([[0, 0, 5, 6, 7], [9, 8, 7, 6, 5]])
    mask = (prompt != 0).long()
    sequences = {}
    for impl in ("longctx_zigzag", "sdpa"):
        model.set_attn_implementation(impl)
        sequences[impl] = model.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                         pad_token_id=0)
    assert torch.equal(sequences["longctx_zigzag"], sequences["sdpa"])


def test_checkpointing_follows_training_arguments_and_backend_follows_the_model(tmp_path, caplog):
    """activation_checkpointing off: none; on: recompute-aware (attention runs once per layer and step), logged
    with the TrainingArguments name this transformers has (activation_checkpointing, not the deprecated alias)."""
    recipe_says_ring = LongContextConfig(backend="ring")
    for on in (False, True):
        reset_stats()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hf_longctx"):
            run = flattening_run(str(tmp_path / str(on)), steps=1, evaluate=False, gradient_checkpointing=on,
                                 config=recipe_says_ring)
        said = "activation checkpointing is on: recompute-aware" if on else \
            "activation checkpointing is off (set TrainingArguments(activation_checkpointing=True)"
        assert said in caplog.text, caplog.text
        assert run["summary"]["checkpointing"] == ("recompute_aware" if on else "none")
        assert run["summary"]["backend"] == "zigzag"  # the model's, not the recipe's
        model = run["model"]
        assert getattr(model, "is_activation_checkpointing", None) in (on, None)
        assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules()) == on
        layers = run["model"].config.num_hidden_layers
        assert stats()["core_attention.forward"] == layers  # plain layer checkpointing would give 2 x layers


def test_checkpointing_uses_the_current_training_argument_without_warnings():
    """transformers 5.x deprecates TrainingArguments(gradient_checkpointing=...): neither the code nor the
    README's instructions use it where activation_checkpointing exists."""
    import warnings

    from transformers import TrainingArguments

    from hf_longctx.hf.memory.checkpointing import checkpointing_argument, checkpointing_training_args

    assert checkpointing_argument() == "activation_checkpointing"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        args = TrainingArguments(output_dir="unused", use_cpu=True, report_to=[], **checkpointing_training_args(True))
    assert args.activation_checkpointing
    for doc in ("README.md", "recipes/README.md"):
        text = (ROOT / doc).read_text()
        assert "gradient_checkpointing=True" not in text and "activation_checkpointing=True" in text, doc


def _two_process_runs(rank, world, out_dir):
    flat = flattening_run(os.path.join(out_dir, f"flat{rank}"))
    for key in ("model", "summary", "trainer"):
        flat.pop(key)
    sft = trl_run(os.path.join(out_dir, f"trl{rank}"))
    if rank == 0:
        Path(out_dir, "two.json").write_text(json.dumps({"flat": flat, "trl": sft}))


def test_trainer_and_trl_on_two_processes_equal_one_process(tmp_path):
    """Sequence parallelism over 2 gloo ranks is invisible: losses, grad norms, eval loss, metric logits."""
    one = {"flat": flattening_run(str(tmp_path / "flat")), "trl": trl_run(str(tmp_path / "trl"))}
    run_distributed(2, _two_process_runs, str(tmp_path), timeout_s=300)
    two = json.loads((tmp_path / "two.json").read_text())
    for name in ("flat", "trl"):
        assert len(two[name]["losses"]) == 3, name
        assert two[name]["losses"] == pytest.approx(one[name]["losses"], rel=1e-5), name
        assert two[name]["grad_norms"] == pytest.approx(one[name]["grad_norms"], rel=1e-4), name
    assert two["flat"]["eval_loss"] == pytest.approx(one["flat"]["eval_loss"], rel=1e-5)
    # compute_metrics saw, at every labelled position, the logits one process computes (in document order)
    one_logits = torch.tensor([row for rows in one["flat"]["predictions"] for row in rows])
    two_logits = torch.tensor([row for rows in two["flat"]["predictions"] for row in rows])
    assert one_logits.shape == two_logits.shape and one_logits.shape[0] > 0
    torch.testing.assert_close(two_logits, one_logits, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- names and settings


def test_one_backend_name_everywhere():
    """Recipes use the attn_implementation names; either spelling works in either place."""
    for name in ("distfa", "longctx_distfa", "distflash"):
        assert LongContextConfig(backend=name).attn_implementation == "longctx_distfa"
    for impl in hf_longctx.ATTENTION_IMPLEMENTATIONS:
        assert implementation_name(backend_from_name(impl)) == impl
        assert implementation_name(backend_from_name(impl[len("longctx_"):])) == impl
    for sidecar in (ROOT / "recipes").glob("*.longctx.yaml"):
        backend = yaml.safe_load(sidecar.read_text())["backend"]
        assert "longctx_" + backend in hf_longctx.ATTENTION_IMPLEMENTATIONS, sidecar.name
    documented = [ROOT / "README.md", ROOT / "recipes" / "README.md", *(ROOT / "hf_longctx").rglob("*.py")]
    assert not [p.name for p in documented if "longctx_distflash" in p.read_text()]


def _load_train_script():
    spec = importlib.util.spec_from_file_location("train_script", ROOT / "scripts" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BAD_SETTINGS = [
    ("backend: distflsh\n", [], 2, ["bad.longctx.yaml", "'distflsh'", "did you mean 'distfa'?"]),
    ("backend: longctx_zigzg\n", [], 2, ["bad.longctx.yaml", "did you mean 'zigzag'?"]),
    ("kernel: cudn\n", [], 2, ["bad.longctx.yaml", "'cudn'", "did you mean 'cudnn'?"]),
    ("chekpointing: layer\n", [], 2, ["bad.longctx.yaml", "did you mean 'checkpointing'?"]),
    ("sp_size: 3\n", [], 2, ["bad.longctx.yaml", "sp_size 3 does not divide the 2 processes", "pick one of [1, 2]"]),
    ("sp_size: 2\n", [], 1, ["ONE process", "--config_file recipes/cpu-2proc.yaml"]),
    ("backend: zigzag\n", ["--dataset", str(ROOT / "data" / "sample_corpus.jsnl")], 1,
     ["--dataset", "no such file", "did you mean", "sample_corpus.jsonl"]),
    # a number below its range is an error, never the default
    ("seq_len: 0\n", [], 2, ["bad.longctx.yaml", "seq_len must be a whole number >= 1", "got 0"]),
    ("backend: zigzag\n", ["--seq-len", "0"], 2, ["--seq-len '0'", "seq_len must be a whole number >= 1"]),
    ("backend: zigzag\n", ["--seq-len", "-4096"], 2, ["--seq-len '-4096'", ">= 1 (tokens per process per step)"]),
    ("backend: zigzag\n", ["--tp-size", "0"], 2, ["--tp-size '0'", "tp_size must be a whole number >= 1"]),
    ("backend: zigzag\n", ["--max-steps", "0"], 2, ["--max-steps 0: must be a whole number >= 1"]),
    ("backend: zigzag\n", ["--lr", "-1"], 2, ["--lr -1.0: must be a number > 0"]),
    # a backend's options are checked against that backend, names and values
    ("backend: cad\nbackend_options: {epss: 0.01}\n", [], 2,
     ["bad.longctx.yaml", "backend 'cad' has no option 'epss'", "did you mean 'eps'?"]),
    ("backend: cad\nbackend_options: {cost_model: profile}\n", [], 2,
     ["bad.longctx.yaml", "cost_model must be 'flops' or the path of a fitted cost model file"]),
    ("backend: cad\nbackend_options: 0.01\n", [], 2, ["backend_options must be a mapping"]),
]


@pytest.mark.parametrize("sidecar,extra,world,expected", BAD_SETTINGS, ids=[c[3][-1] for c in BAD_SETTINGS])
def test_bad_settings_stop_before_any_model_or_data_in_one_short_message(sidecar, extra, world, expected,
                                                                        tmp_path, monkeypatch, capsys):
    train = _load_train_script()

    def built(*args, **kwargs):
        raise AssertionError("a model or dataset was built before the settings were checked")

    for name in ("LlamaForCausalLM", "AutoModelForCausalLM", "load_text_dataset", "pack_documents",
                 "load_sample_tokenizer"):
        monkeypatch.setattr(train, name, built)
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("compute_environment: LOCAL_MACHINE\n")
    (tmp_path / "bad.longctx.yaml").write_text(sidecar)
    monkeypatch.delenv("HF_LONGCTX_RECIPE", raising=False)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as stop:
        train.main(["--recipe", str(recipe), *extra])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) <= 3 and "Traceback" not in err, err
    for text in expected:
        assert text in err, (text, err)
    monkeypatch.setenv("RANK", "1")  # the other ranks stop too, silently
    with pytest.raises(SystemExit):
        train.main(["--recipe", str(recipe), *extra])
    assert capsys.readouterr().err == ""


def _refuse_builds(train, monkeypatch, names=("LlamaForCausalLM", "Qwen3MoeForCausalLM", "AutoModelForCausalLM",
                                                 "pack_documents")) -> None:
    def built(*args, **kwargs):
        raise AssertionError("a model or dataset was built before the settings were checked")

    for name in names:
        monkeypatch.setattr(train, name, built)


GPU_SIZED = [  # (command line, processes, what the message must say)
    (["--model", "llama3-8b-shape", "--num-layers", "8", "--seq-len", "65536", "--max-steps", "8"], 1,
     ["no CUDA GPU was found", "--model llama3-8b-shape builds Llama-3-8B's dimensions",
      "--config_file recipes/cpu-2proc.yaml", "a GPU machine"]),
    (["--recipe", str(ROOT / "recipes" / "1node-2gpu.yaml")], 2,
     ["no CUDA GPU was found", "1node-2gpu.yaml is a GPU recipe (mixed_precision: bf16)", "a CPU recipe"]),
]


@pytest.mark.parametrize("argv,world,expected", GPU_SIZED, ids=["8b-shape", "gpu-recipe"])
def test_a_run_sized_for_a_gpu_without_one_stops_before_the_model(argv, world, expected, monkeypatch, capsys):
    """The README's one-GPU command on a machine without a GPU: one message and exit 2, not the 8B shape built
    on the CPU until the host runs out of memory. CPU runs (a CPU recipe, no recipe, the tiny model) pass."""
    train = _load_train_script()
    _refuse_builds(train, monkeypatch, ("LlamaForCausalLM", "AutoModelForCausalLM", "load_text_dataset",
                                        "pack_documents", "load_sample_tokenizer"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("HF_LONGCTX_RECIPE", raising=False)
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as stop:
        train.main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) <= 3 and "Traceback" not in err, err
    for text in expected:
        assert text in err, (text, err)
    cpu_recipe = str(ROOT / "recipes" / "cpu-2proc.yaml")
    assert check_run(cpu_recipe, world_size=2).backend == "distfa"  # make demo's recipe
    assert check_run(world_size=1, model="tiny").sp_size == 0  # python scripts/train.py
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # accelerate launch --mixed_precision bf16
    with pytest.raises(ConfigError, match="accelerate launch asked for bf16 mixed precision"):
        check_run(world_size=1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # with a GPU the same run passes
    check_run(world_size=1, model="llama3-8b-shape")


MODEL_CONFIG_ANSWERS = [  # (sidecar, command line, processes, what the message must say)
    ("backend: ulysses\n", [], 3,
     ["bad.longctx.yaml", "backend ulysses splits the model's 4 query heads over the 3 processes",
      "set sp_size to one of [1]", "ring backend"]),
    ("backend: zigzag\n", ["--backend", "ulysses", "--model", "tiny-moe"], 3,
     ["with --backend from the command line", "ulysses splits the model's 4 query heads"]),
    ("backend: zigzag\ntp_size: 3\n", [], 3, ["tp_size 3 does not split the model's 4 attention heads"]),
    ("backend: zigzag\ntp_size: 2\n", [], 2, ["tp_size 2: head-parallel attention needs", "set tp_size: 1"]),
    ("backend: zigzag\nep_size: 3\nsp_size: 1\n", ["--model", "tiny-moe"], 3,
     ["ep_size 3 does not divide the model's 8 experts"]),
]


@pytest.mark.parametrize("sidecar,extra,world,expected", MODEL_CONFIG_ANSWERS,
                         ids=["ulysses-heads", "ulysses-moe", "tp-heads", "tp-trainer", "ep-experts"])
def test_settings_the_model_config_answers_stop_before_the_model_and_data(sidecar, extra, world, expected, tmp_path,
                                                                         monkeypatch, capsys):
    """What would fail only after the model and data exist (Ulysses at its first forward, on every rank, the
    callback at train begin) is checked against the model's config first: one message from rank 0, exit 2."""
    train = _load_train_script()
    _refuse_builds(train, monkeypatch, ("LlamaForCausalLM", "Qwen3MoeForCausalLM", "AutoModelForCausalLM",
                                        "load_text_dataset", "pack_documents"))
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("compute_environment: LOCAL_MACHINE\n")
    (tmp_path / "bad.longctx.yaml").write_text(sidecar)
    monkeypatch.delenv("HF_LONGCTX_RECIPE", raising=False)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    for rank in ("0", "1"):  # rank 0 says it, the others stop silently
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as stop:
            train.main(["--recipe", str(recipe), *extra])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        if rank == "1":
            assert err == ""
            continue
        assert len(err.strip().splitlines()) <= 3 and "Traceback" not in err, err
        for text in expected:
            assert text in err, (text, err)


def test_a_text_that_is_not_a_string_stops_the_training_script_before_the_model(tmp_path, monkeypatch, capsys):
    train = _load_train_script()
    _refuse_builds(train, monkeypatch)
    data = tmp_path / "docs.jsonl"
    data.write_text('{"text": "one two"}\n{"text": 42}\n')
    monkeypatch.delenv("HF_LONGCTX_RECIPE", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as stop:
        train.main(["--dataset", str(data), "--backend", "local"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"--dataset: {data}:2: 'text' is 42 (a number), not a string" in err, err
    message = err[err.index("hf_longctx: configuration error"):]  # after datasets' own progress bar
    assert len(message.strip().splitlines()) <= 3 and "Traceback" not in err, err


def test_a_state_space_model_in_one_process_is_told_what_the_callback_does(tmp_path):
    """Mamba in ONE process under the callback: the refusal names the packing (every batch becomes one packed
    sequence), not sequence parallelism, and how to train it instead."""
    from transformers import MambaConfig, MambaForCausalLM, Trainer, TrainingArguments

    model = MambaForCausalLM(MambaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, state_size=4))
    model.config._attn_implementation = "longctx_distfa"
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, use_cpu=True, report_to=[], save_strategy="no")
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}],
                      callbacks=[hf_longctx.LongContextCallback(LongContextConfig())])
    with pytest.raises(ValueError) as err:
        trainer.train()
    message = str(err.value)
    assert "cannot be sequence parallel" not in message
    for text in ("MambaForCausalLM cannot train with LongContextCallback", "flattens every batch into one packed "
                 "sequence (in one process too", "Train it without LongContextCallback, one document per row",
                 "attn_implementation='sdpa'"):
        assert text in message, (text, message)


def test_the_launcher_reports_the_configuration_error_as_the_root_cause(tmp_path, monkeypatch, capsys):
    """Under torchrun (``accelerate launch``) each rank leaves the message in its TORCHELASTIC_ERROR_FILE, so
    the launcher's failure summary ends with it instead of "To enable traceback see ..."."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    train = _load_train_script()
    monkeypatch.delenv("HF_LONGCTX_RECIPE", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    failures = {}
    for rank in (1, 0):  # whichever rank the launcher sees fail first, it reports the message
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / f"error{rank}.json"))
        with pytest.raises(SystemExit) as stop:
            train.main(["--recipe", str(ROOT / "recipes" / "cpu-2proc.yaml"), "--backend", "zigzg"])
        assert stop.value.code == 2
        failures[rank] = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=2,
                                        error_file=str(tmp_path / f"error{rank}.json"))
    summary = ChildFailedError("scripts/train.py", failures).format_msg()
    root = summary.split("Root Cause (first observed failure):", 1)[1]
    assert "hf_longctx: configuration error, nothing was started" in root, summary
    assert "did you mean 'zigzag'?" in root, summary
    assert "To enable traceback" not in summary and "Traceback" not in summary, summary
    assert capsys.readouterr().err.count("did you mean 'zigzag'?") == 1  # rank 0 prints it, once


@pytest.mark.parametrize("example", ["trainer_flattening.py", "sft_trl.py"])
def test_a_misspelled_attn_implementation_names_the_registered_one(example, monkeypatch, capsys):
    """transformers' own error lists only its implementations; the examples check the name first."""
    with pytest.raises(ValueError) as theirs:  # what transformers says (no longctx_* name, no hint)
        LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1,
                                     attn_implementation="longctx_zigzg"))
    assert "longctx_zigzag" not in str(theirs.value)
    monkeypatch.delenv("HF_LONGCTX_RECIPE", raising=False)
    monkeypatch.setenv("RANK", "0")
    spec = importlib.util.spec_from_file_location(example[:-3], ROOT / "examples" / example)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "load_sample_tokenizer", lambda: pytest.fail("built before the check"))
    with pytest.raises(SystemExit) as stop:
        module.main(["--attn-implementation", "longctx_zigzg"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "attn_implementation 'longctx_zigzg' is not registered" in err, err
    assert "did you mean 'longctx_zigzag'?" in err, err
    for name in ("sdpa", "longctx_distfa", "paged|eager", "kernels-community/flash-attn3"):
        assert check_attn_implementation(name) == name
    with pytest.raises(ConfigError, match="did you mean 'sdpa'"):
        check_attn_implementation("spda")


def test_one_process_where_the_launcher_asked_for_more_is_refused(monkeypatch):
    """`accelerate launch --num_processes 2` without --multi_gpu starts one process on CPU: say so."""
    import hf_longctx.hf.integration.preflight as preflight

    monkeypatch.delenv("HF_LONGCTX_RECIPE", raising=False)
    monkeypatch.setattr(preflight, "launcher_num_processes", lambda: 2)
    with pytest.raises(ConfigError, match="--num_processes 2 but started 1 process.*--multi_gpu"):
        check_run(world_size=1)
    monkeypatch.setattr(preflight, "launcher_num_processes", lambda: None)
    assert check_run(world_size=1).resolved_sp_size(1) == 1


def test_readme_first_code_block_runs(tmp_path):
    """The first Python block of the README runs as written, in a fresh interpreter."""
    block = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("HF_LONGCTX_RECIPE", None)
    proc = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_trl_example_without_trl_says_how_to_install_it_in_one_line(tmp_path):
    """TRL is no dependency of the package: the example stops with the install command, and that command (the
    ``examples`` extra, which the README names) installs TRL."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    code = "import runpy, sys; sys.modules['trl'] = None; runpy.run_path(sys.argv[1], run_name='__main__')"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code, str(ROOT / "examples" / "sft_trl.py")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    ours = [line for line in proc.stderr.strip().splitlines() if "sft_trl" in line or "Traceback" in line]
    assert ours == ["examples/sft_trl.py needs TRL: pip install -e '.[examples]' (or pip install 'trl>=1.16')"], \
        proc.stderr  # other libraries' import warnings (torchao's on a CPU torch) are not the example's
    assert proc.stderr.strip().splitlines()[-1] == ours[0]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert [d for d in extras["examples"] if d.startswith("trl")] == ["trl>=1.16"]
    assert "pip install -e '.[examples]'" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("example,argv", [
    ("trainer_flattening.py", ["--max-steps", "1", "--docs-per-step", "2", "--max-tokens", "64"]),
    ("sft_trl.py", ["--max-steps", "1", "--max-length", "128"]),
])
def test_examples_run_on_cpu(example, argv, tmp_path, monkeypatch, capsys):
    """The examples run as shipped (one process here; the 2-process paths are the tests above)."""
    monkeypatch.delenv("HF_LONGCTX_RECIPE", raising=False)
    monkeypatch.setenv("HF_LONGCTX_BACKEND", "zigzag")
    spec = importlib.util.spec_from_file_location(example[:-3], ROOT / "examples" / example)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main([*argv, "--output-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert ("generated:" in out) if example.startswith("trainer") else ('"losses": [' in out), out[-2000:]
