"""FSDP2 (``fully_shard``) through accelerate and the Trainer trains exactly like DDP under sequence parallelism.

accelerate (1.15) runs FSDP only on accelerator devices (on CPU it silently falls back to DDP), so
these CPU runs call :func:`hf_longctx.hf.parallel.fsdp.enable_fsdp_on_cpu` first, which sets accelerate's state
to FSDP as accelerate itself does on GPUs; from there the Trainer's own FSDP2 path runs: accelerate's
``fsdp2_prepare_model`` (``fully_shard`` per decoder layer, embedding, tail and root, on the default
world mesh over gloo), its gradient clipping over DTensors and its sharded checkpoints
(``torch.distributed.checkpoint``). Every rank holds the same sequence-parallel group's weights, so the
parameters shard over the whole world and the gradient of a step is reduced once, as DDP's: losses
and gradient norms must equal DDP's at every step (float32, rel 1e-5 as tests/test_deepspeed.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from hf_longctx.hf import ConfigError, LongContextConfig
from hf_longctx.hf.parallel.fsdp import check_fsdp_launch, check_fsdp_model, enable_fsdp_on_cpu

from distributed import run_distributed
from trainer_runs import flattening_run, join_world, tiny_llama

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("longctx_zigzag", "longctx_distfa", "longctx_tasp", "longctx_cad")
# what `accelerate launch` puts in the environment for recipes/cpu-2proc-fsdp2.yaml
FSDP_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
            "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT", "FSDP_RESHARD_AFTER_FORWARD": "true",
            "FSDP_ACTIVATION_CHECKPOINTING": "false", "FSDP_CPU_RAM_EFFICIENT_LOADING": "false"}


@contextmanager
def accelerate_mode(fsdp: bool):
    """A fresh accelerate state for the next Trainer of this process: FSDP2 as launched for it, or plain DDP."""
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType

    def reset():
        AcceleratorState._reset_state()
        GradientState._reset_state()
        if PartialState._shared_state:
            PartialState._shared_state["distributed_type"] = DistributedType.MULTI_CPU

    saved = {k: os.environ.get(k) for k in FSDP_ENV}
    reset()
    join_world()  # the environment accelerate reads to join the spawned gloo world
    PartialState(cpu=True)
    if fsdp:
        os.environ.update(FSDP_ENV)
        assert enable_fsdp_on_cpu()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        reset()


# the state accelerate_mode configured is the Trainer's (TrainingArguments would otherwise reset it)
CONFIGURED = {"accelerator_config": {"use_configured_state": True}}


def _assert_same(ddp: dict, fsdp: dict, what: str) -> None:
    assert len(ddp["losses"]) == len(fsdp["losses"]) > 0, what
    assert fsdp["losses"] == pytest.approx(ddp["losses"], rel=1e-5), what
    assert fsdp["grad_norms"] == pytest.approx(ddp["grad_norms"], rel=1e-5), what


def _backends_like_ddp(rank, world, out_dir):
    from torch.distributed.fsdp import FSDPModule

    from hf_longctx.kernels import reset_stats, stats

    for impl in BACKENDS:
        runs = {}
        for fsdp in (False, True):
            reset_stats()
            with accelerate_mode(fsdp):
                runs[fsdp] = flattening_run(os.path.join(out_dir, f"{impl}-{fsdp}-{rank}"), impl=impl, evaluate=False,
                                            gradient_checkpointing=True, **CONFIGURED)
            calls = stats()["core_attention.forward"]
        # recompute-aware inside the FSDP units: attention ran once per layer and step (layer checkpointing: twice)
        assert calls == 3 * runs[True]["model"].config.num_hidden_layers, (impl, calls)
        sharded = runs[True]
        assert isinstance(sharded["model"], FSDPModule) and not isinstance(runs[False]["model"], FSDPModule)
        assert sharded["summary"]["fsdp_shard_size"] == world, "parameters shard over dp x sp, the whole world"
        assert sharded["summary"]["checkpointing"] == "recompute_aware"
        _assert_same(runs[False], sharded, impl)
    # the memory options that run on FSDP units: tiled MLP, checkpoints waiting in host memory
    memory = LongContextConfig(tiled_mlp=16, offload_checkpoints=True)
    runs = {}
    for fsdp in (False, True):
        with accelerate_mode(fsdp):
            runs[fsdp] = flattening_run(os.path.join(out_dir, f"memory-{fsdp}-{rank}"), evaluate=False,
                                        gradient_checkpointing=True, config=memory, **CONFIGURED)
    assert runs[True]["summary"]["tiled_mlp"] == 16 and runs[True]["summary"]["offload_checkpoints"]
    _assert_same(runs[False], runs[True], "tiled MLP, offloaded checkpoints")


def test_fsdp2_trains_like_ddp_for_every_backend(tmp_path):
    run_distributed(2, _backends_like_ddp, str(tmp_path), timeout_s=600)


def _resume_and_load(rank, world, out_dir):
    from transformers import LlamaForCausalLM

    whole_dir = os.path.join(out_dir, "whole")
    options = dict(impl="longctx_zigzag", evaluate=False, gradient_checkpointing=True, steps=4, **CONFIGURED)
    with accelerate_mode(True):  # 4 steps uninterrupted, a sharded checkpoint at step 2
        whole = flattening_run(whole_dir, save_strategy="steps", save_steps=2, **options)
        trainer = whole["trainer"]
        # a model for from_pretrained: the full state dict, gathered (the checkpoints stay sharded)
        trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
        trainer.save_model(os.path.join(out_dir, "final"))
        full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in whole["model"].state_dict().items()}
    checkpoint = os.path.join(whole_dir, "checkpoint-2")
    saved = sorted(os.listdir(checkpoint))
    assert "pytorch_model_fsdp_0" in saved and "optimizer_0" in saved, saved  # sharded model and optimizer
    with accelerate_mode(True):  # a new Trainer, model and optimizer from step 2 on
        resumed = flattening_run(os.path.join(out_dir, "resumed"), resume_from_checkpoint=checkpoint, **options)
    # the resumed history holds the checkpoint's 2 steps, then its own 2: those equal the uninterrupted run's
    assert len(resumed["losses"]) == len(whole["losses"]) == 4
    assert resumed["losses"][2:] == pytest.approx(whole["losses"][2:], rel=1e-5)
    assert resumed["grad_norms"][2:] == pytest.approx(whole["grad_norms"][2:], rel=1e-5)
    assert resumed["losses"][2:] != whole["losses"][:2]
    if rank == 0:
        loaded = LlamaForCausalLM.from_pretrained(os.path.join(out_dir, "final"), attn_implementation="longctx_zigzag")
        state = loaded.state_dict()
        for name, value in full.items():
            assert torch.equal(state[name], value), name
    # fsdp_activation_checkpointing (plain checkpoint wrappers around the layers) is refused by name
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    model = tiny_llama("longctx_zigzag")
    model.model.layers[0] = checkpoint_wrapper(model.model.layers[0])
    fully_shard(model)
    with pytest.raises(ValueError, match="fsdp_activation_checkpointing"):
        check_fsdp_model(model, None, LongContextConfig())


def test_fsdp2_resumes_from_a_sharded_checkpoint_and_saves_for_from_pretrained(tmp_path):
    run_distributed(2, _resume_and_load, str(tmp_path), timeout_s=600)


@pytest.mark.parametrize("env,cfg,message", [
    ({"FSDP_VERSION": "1"}, None, "fsdp_version 1"),
    ({"FSDP_ACTIVATION_CHECKPOINTING": "true"}, None, "fsdp_activation_checkpointing: true"),
    ({}, LongContextConfig(ep_size=2), "ep_size=2, expert_tp_size=1 under FSDP"),
    ({}, LongContextConfig(tiled_loss=256), "tiled_loss=256 under FSDP"),
], ids=["fsdp1", "fsdp-activation-checkpointing", "expert-parallel", "tiled-loss"])
def test_fsdp_launches_that_cannot_work_are_refused_by_name(env, cfg, message):
    with pytest.raises(ConfigError, match=message):
        check_fsdp_launch(cfg, {**FSDP_ENV, **env})
    check_fsdp_launch(cfg, {k: v for k, v in env.items() if k.startswith("FSDP_")})  # no FSDP launch: nothing to say


def test_the_memory_plan_of_an_fsdp2_launch_shards_like_zero3_without_the_tiled_loss(monkeypatch):
    """memory: auto under FSDP2: weights, gradients and optimizer states over the world, no tiled loss."""
    from hf_longctx.hf.memory.training import plan_for_training

    model = tiny_llama("longctx_zigzag")
    cfg = LongContextConfig(memory="auto", seq_len=256, tiled_loss=0)
    ddp = plan_for_training(model, cfg, tokens_per_gpu=256, world=4, sp_size=2)
    for k, v in FSDP_ENV.items():
        monkeypatch.setenv(k, v)
    check_fsdp_launch(cfg)  # planned, not refused
    fsdp = plan_for_training(model, cfg, tokens_per_gpu=256, world=4, sp_size=2)
    assert fsdp.tiled_loss == 0
    assert fsdp.gpu_items["optimizer"] * 4 == pytest.approx(ddp.gpu_items["optimizer"], rel=0.01)


def test_an_fsdp_launch_whose_model_was_not_sharded_is_refused(monkeypatch):
    """On CPU accelerate drops FSDP and wraps the model in DDP: the callback must not train that silently."""
    for k, v in FSDP_ENV.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match="reached the Trainer unsharded.*enable_fsdp_on_cpu"):
        check_fsdp_model(tiny_llama("longctx_zigzag"), None, LongContextConfig())


def _launch(tmp_path: Path, name: str, config_file: str, sidecar: str, extra: tuple[str, ...] = ()) -> list[dict]:
    log = tmp_path / f"{name}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_LONGCTX_")}
    env.update(PYTHONPATH=str(ROOT), HF_LONGCTX_RECIPE=str(ROOT / "recipes" / sidecar))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "recipes" / config_file),
           str(ROOT / "scripts" / "train.py"), "--max-steps", "3", "--logging-steps", "1",
           "--output-dir", str(tmp_path / name), "--log-json", str(log), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    summary = [line for line in proc.stdout.splitlines() if line.startswith("hf_longctx training summary: ")]
    assert len(summary) == 1, proc.stdout[-3000:]
    return [e for e in json.loads(log.read_text()) if "loss" in e], json.loads(summary[0].split(": ", 1)[1])


@pytest.mark.slow
@pytest.mark.parametrize("shape,backend", [("cpu-2proc", None)] + [("cpu-4proc", b) for b in
                                                                    ("zigzag", "distfa", "tasp", "cad")])
def test_fsdp2_recipe_launch_trains_like_ddp(tmp_path, shape, backend):
    """The real command line of the FSDP2 recipe against the DDP recipe of the same shape, same settings;
    on 4 processes (sp 2 x dp 2) for zigzag, distfa, tasp and cad."""
    sidecar = f"{shape}-fsdp2.yaml"
    extra = ("--backend", backend) if backend else ()
    ddp, _ = _launch(tmp_path, "ddp", f"{shape}.yaml", sidecar, extra)
    fsdp, summary = _launch(tmp_path, "fsdp2", f"{shape}-fsdp2.yaml", sidecar, extra)
    if backend:
        assert summary["backend"] == backend
    assert summary["fsdp_shard_size"] == summary["sp_size"] * summary["dp_size"] == int(shape[4])
    assert len(ddp) == len(fsdp) == 3
    for step, (a, b) in enumerate(zip(ddp, fsdp)):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), step
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), step
