"""Every recipe is a valid accelerate config with a valid long-context sidecar."""

from __future__ import annotations

from pathlib import Path

import pytest
from accelerate.commands.config.config_args import ClusterConfig

from hf_longctx.hf import LongContextConfig, load_config
from hf_longctx.hf.config import sidecar_path

RECIPES = sorted(p for p in (Path(__file__).parent.parent / "recipes").glob("*.yaml")
                 if not p.name.endswith(".longctx.yaml"))


def test_there_are_cpu_and_gpu_recipes():
    names = [p.stem for p in RECIPES]
    assert "cpu-2proc-distfa" in names and any("8gpu" in n for n in names) and any("2node" in n for n in names)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_is_accelerate_config_with_sidecar(recipe):
    cluster = ClusterConfig.from_yaml_file(str(recipe))
    cfg = load_config(recipe)
    sp = cfg.resolved_sp_size(cluster.num_processes)
    assert cluster.num_processes % sp == 0 and cfg.seq_len > 0


def test_environment_overrides_and_rejects_unknown_keys(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_LONGCTX_BACKEND", "zigzag")
    assert load_config(RECIPES[0]).backend == "zigzag"
    monkeypatch.setenv("HF_LONGCTX_BAKCEND", "ring")
    with pytest.raises(ValueError, match="unknown environment setting"):
        load_config(RECIPES[0])
    monkeypatch.delenv("HF_LONGCTX_BAKCEND")
    bad = tmp_path / "x.yaml"
    bad.write_text("compute_environment: LOCAL_MACHINE\n")
    sidecar_path(bad).write_text("backend: ring\ncheckpoint: layer\n")
    with pytest.raises(ValueError, match="did you mean 'checkpointing'"):
        load_config(bad)
    with pytest.raises(ValueError, match="no long-context settings"):
        load_config(tmp_path / "missing.yaml")


def test_defaults():
    assert LongContextConfig().attn_implementation == "longctx_distfa"
