"""Recipes: one accelerate config per hardware shape, each with a valid long-context sidecar, and the
settings of a run overridable from the environment and the command line, checked like the sidecar."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import ClusterConfig

from hf_longctx.backends.cad.options import CadOptions
from hf_longctx.backends.options import NoOptions
from hf_longctx.hf import ConfigError, LongContextConfig, check_run, load_config
from hf_longctx.hf.settings.sources import PACKAGE_ENVIRONMENT, add_config_arguments, config_overrides, sidecar_path

ROOT = Path(__file__).parent.parent
RECIPES = sorted(p for p in (ROOT / "recipes").glob("*.yaml") if not p.name.endswith(".longctx.yaml"))


def test_one_recipe_per_hardware_shape():
    names = [p.stem for p in RECIPES]
    assert {"cpu-2proc", "cpu-3proc", "cpu-4proc", "cpu-2proc-zero2", "cpu-2proc-zero3",
            "1node-2gpu", "1node-4gpu", "1node-8gpu", "2node-16gpu", "cpu-2proc-fsdp2", "cpu-4proc-fsdp2",
            "1node-2gpu-fsdp2", "1node-4gpu-fsdp2", "1node-8gpu-fsdp2", "2node-16gpu-fsdp2"} == set(names)
    shapes = {}
    for recipe in RECIPES:  # the settings are the sidecar's: no two accelerate configs may be the same
        config = yaml.safe_load(recipe.read_text())
        shape = tuple(sorted((k, str(v)) for k, v in config.items()))
        assert shape not in shapes, f"{recipe.name} is the same hardware shape as {shapes.get(shape)}"
        shapes[shape] = recipe.name
    sidecars = {p.name for p in (ROOT / "recipes").glob("*.longctx.yaml")}
    assert sidecars == {sidecar_path(r).name for r in RECIPES}, "every sidecar belongs to one accelerate config"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_is_accelerate_config_with_sidecar(recipe):
    cluster = ClusterConfig.from_yaml_file(str(recipe))
    cfg = load_config(recipe)
    sp = cfg.resolved_sp_size(cluster.num_processes)
    assert cluster.num_processes % sp == 0 and cfg.seq_len > 0


def test_environment_overrides_and_rejects_unknown_keys(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_LONGCTX_BACKEND", "zigzag")
    assert load_config(RECIPES[0]).backend == "zigzag"
    monkeypatch.setenv("HF_LONGCTX_SEQ_LEN", "lots")
    with pytest.raises(ValueError, match="HF_LONGCTX_SEQ_LEN='lots': not a whole number"):
        load_config(RECIPES[0])
    monkeypatch.delenv("HF_LONGCTX_SEQ_LEN")
    monkeypatch.setenv("HF_LONGCTX_BAKCEND", "ring")
    with pytest.raises(ValueError, match="unknown environment setting"):
        load_config(RECIPES[0])
    monkeypatch.delenv("HF_LONGCTX_BAKCEND")
    for name in PACKAGE_ENVIRONMENT:  # the package's own switches are not misspelled settings
        monkeypatch.setenv(name, os.environ.get(name, "0") if name != "HF_LONGCTX_RECIPE" else str(RECIPES[0]))
    assert load_config(RECIPES[0]).backend == "zigzag"
    bad = tmp_path / "x.yaml"
    bad.write_text("compute_environment: LOCAL_MACHINE\n")
    sidecar_path(bad).write_text("backend: ring\ncheckpoint: layer\n")
    with pytest.raises(ValueError, match="did you mean 'checkpointing'"):
        load_config(bad)
    alone = tmp_path / "alone.yaml"
    alone.write_text("compute_environment: LOCAL_MACHINE\n")
    with pytest.raises(ValueError, match="no long-context settings for recipe .*alone.yaml"):
        load_config(alone)


def test_every_environment_variable_the_package_reads_is_accepted_by_the_recipe_loader(monkeypatch):
    """A variable the package reads (its cache, its kernels' switches) set in a training run's environment is not
    refused as a misspelled setting."""
    import re
    from dataclasses import fields

    root = Path(__file__).resolve().parents[1]
    read = set()
    for folder in ("hf_longctx", "scripts"):
        for source in (root / folder).rglob("*.py"):
            read |= set(re.findall(r"HF_LONGCTX_[A-Z0-9_]*[A-Z0-9]", source.read_text()))
    settings = {f"HF_LONGCTX_{f.name.upper()}" for f in fields(LongContextConfig)}
    assert {"HF_LONGCTX_CACHE", "HF_LONGCTX_MERGE_TRITON", "HF_LONGCTX_PROFILE_L2"} <= read
    assert sorted(read - settings - set(PACKAGE_ENVIRONMENT)) == []
    for name in read - settings:
        monkeypatch.setenv(name, str(RECIPES[0]) if name == "HF_LONGCTX_RECIPE" else "0")
    assert load_config(RECIPES[0]).backend


@pytest.mark.parametrize("given,closest", [
    ("1node-2gpux.yaml", "1node-2gpu.yaml"),
    ("cpu-2prc.yaml", "cpu-2proc.yaml"),
    ("1node-8gpu.longctx.yml", "1node-8gpu.longctx.yaml"),
])
def test_a_recipe_that_does_not_exist_is_named_with_the_closest_recipe(given, closest, monkeypatch):
    """Not a missing sidecar: the recipe itself is missing, and the nearest name in its folder is suggested."""
    missing = str(ROOT / "recipes" / given)
    with pytest.raises(ConfigError) as err:
        check_run(missing, world_size=2)
    message = str(err.value)
    assert f"--recipe {missing!r}: recipe file does not exist" in message, message
    assert f"did you mean {str(ROOT / 'recipes' / closest)!r}?" in message, message
    assert "long-context settings" not in message
    monkeypatch.setenv("HF_LONGCTX_RECIPE", missing)
    with pytest.raises(ConfigError, match=f"HF_LONGCTX_RECIPE='.*{given}': recipe file does not exist"):
        check_run(world_size=2)
    with pytest.raises(ConfigError, match=r"recipe file does not exist \(folder .* does not exist either\)"):
        check_run(str(ROOT / "recipez" / "cpu-2proc.yaml"), world_size=2)


def _overrides(*argv: str) -> tuple[str, dict]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=3)
    add_config_arguments(parser)
    args, unknown = parser.parse_known_args(list(argv))
    return str(ROOT / "recipes" / "cpu-2proc.yaml"), config_overrides(args, unknown, parser)


def test_command_line_overrides_the_sidecar_and_the_environment(monkeypatch):
    monkeypatch.setenv("HF_LONGCTX_BACKEND", "zigzag")
    recipe, overrides = _overrides("--backend", "tasp", "--seq-len=131072", "--offload-checkpoints", "true",
                                   "--max-steps", "5")
    assert overrides == {"backend": "tasp", "seq_len": "131072", "offload_checkpoints": "true"}
    cfg = load_config(recipe, overrides)
    assert (cfg.backend, cfg.seq_len, cfg.offload_checkpoints, cfg.sp_size) == ("tasp", 131072, True, 2)
    assert load_config(recipe, {"sp_size": 1}).sp_size == 1  # values, not only text, from a caller


def test_backend_options_come_from_the_sidecar_the_environment_or_the_command_line(monkeypatch, tmp_path):
    """A backend's own options (CAD's eps, cost model, ...) are one setting, a mapping: written as one in the
    sidecar, as NAME=VALUE pairs in the environment or on the command line, each value read as YAML reads it."""
    recipe = tmp_path / "cad.yaml"
    recipe.write_text("compute_environment: LOCAL_MACHINE\n")
    sidecar_path(recipe).write_text("backend: cad\nbackend_options: {eps: 0.01, cost_model: flops}\n")
    assert load_config(recipe).backend_options == CadOptions(eps=0.01, cost_model="flops")
    monkeypatch.setenv("HF_LONGCTX_BACKEND_OPTIONS", "eps=auto, pingpong=false")
    assert load_config(recipe).backend_options == CadOptions(eps="auto", pingpong=False)
    _, overrides = _overrides("--backend-options", "refine_screen=0,key_cuts=true,call_terms=null")
    assert load_config(recipe, overrides).backend_options == CadOptions(refine_screen=0, key_cuts=True,
                                                                        call_terms=None)
    assert load_config(recipe, {"backend_options": ""}).backend_options == CadOptions()
    # a number with an exponent, which YAML 1.1 reads as text, is the number
    assert load_config(recipe, {"backend_options": "eps=1e-3"}).backend_options == CadOptions(eps=0.001)
    assert LongContextConfig().backend_options == NoOptions()
    # parsed once, as the backend's frozen options: what the settings print, and read back, is what differs
    cfg = load_config(recipe, overrides)
    assert cfg.to_dict()["backend_options"] == {"refine_screen": 0, "call_terms": None}
    assert LongContextConfig.from_dict(cfg.to_dict()) == cfg
    assert LongContextConfig.from_dict(cfg.to_dict()).backend_options == cfg.backend_options


@pytest.mark.parametrize("argv,expected", [
    (["--backend", "distflsh"], ["cpu-2proc.longctx.yaml with --backend from the command line",
                                 "did you mean 'distfa'?"]),
    (["--kernel", "cudn"], ["did you mean 'cudnn'?"]),
    (["--seq-len", "64k"], ["--seq-len '64k': not a whole number"]),
    (["--chekpointing", "layer"], ["unknown option --chekpointing; did you mean --checkpointing?"]),
    (["--checkpointing", "none", "--offload-checkpoints", "1"], ["needs checkpointing 'layer' or 'recompute_aware'"]),
    (["--sp-size", "3"], ["with --sp-size from the command line", "sp_size 3 does not divide the 2 processes"]),
    (["--max-stpes", "3"], ["unknown option --max-stpes; did you mean --max-steps?"]),
    (["--backend-options", "eps=0.01"], ["backend_options: backend 'distfa' has no option 'eps'; it takes none",
                                         "change them with it"]),
    (["--backend", "cad", "--backend-options", "epss=0.01"], ["has no option 'epss' (did you mean 'eps'?)"]),
    (["--backend", "cad", "--backend-options", "eps=-1"], ["backend 'cad': eps must be a number >= 0"]),
    (["--backend", "cad", "--backend-options", "eps"], ["--backend-options 'eps': 'eps' is not NAME=VALUE"]),
], ids=["backend", "kernel", "not-an-int", "misspelled-key", "combination", "sp-size", "script-option",
        "option-of-another-backend", "misspelled-option", "option-value", "option-not-a-pair"])
def test_command_line_values_fail_like_sidecar_values(argv, expected):
    with pytest.raises(ConfigError) as err:
        recipe, overrides = _overrides(*argv)
        check_run(recipe, overrides=overrides, world_size=2)
    for text in expected:
        assert text in str(err.value), (text, str(err.value))


def test_defaults():
    assert LongContextConfig().attn_implementation == "longctx_distfa"
