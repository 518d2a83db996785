"""Trainer and accelerate options that sequence parallelism would silently change are refused by name; in one
process, where nothing is sharded, they train as with transformers' own attention.

* NEFTune (``neftune_noise_alpha``) sizes its noise from the embeddings' tensor, a shard of the sequence on each rank;
* accelerate's own context, sequence and tensor parallel axes (``parallelism_config``, from the launcher's config or
  the Trainer's arguments) would split what the backend splits;
* ``torch_compile`` cannot trace the attention's backward (each call's schedule lives outside the graph), in any
  process count: the callback refuses it at train begin, and a model compiled by hand names it in its error.
"""

from __future__ import annotations

import pytest
import torch
from accelerate.parallelism_config import ParallelismConfig
from transformers import TrainingArguments

from hf_longctx.hf.integration.preflight import check_run, check_training_arguments
from hf_longctx.hf.parallel.accelerate_axes import check_accelerate_parallelism
from hf_longctx.hf.settings.schema import ConfigError

from distributed import run_distributed
from trainer_runs import flattening_run, tiny_llama


def _neftune_on_two_processes(rank, world, output_dir):
    with pytest.raises(ConfigError, match=r"neftune_noise_alpha=5.0 with sp_size 2: .* 1.41x what one process draws"):
        flattening_run(f"{output_dir}/{rank}", neftune_noise_alpha=5.0, evaluate=False)


def test_neftune_under_sequence_parallelism_is_refused_on_every_rank_before_a_step(tmp_path):
    run_distributed(2, _neftune_on_two_processes, str(tmp_path))


def test_neftune_in_one_process_trains_as_with_sdpa(tmp_path):
    ours = flattening_run(str(tmp_path / "ours"), neftune_noise_alpha=5.0, evaluate=False)
    sdpa = flattening_run(str(tmp_path / "sdpa"), neftune_noise_alpha=5.0, evaluate=False, impl="sdpa",
                          callback=False)
    plain = flattening_run(str(tmp_path / "plain"), evaluate=False, impl="sdpa", callback=False)
    assert ours["losses"] == pytest.approx(sdpa["losses"], rel=1e-5)
    assert ours["losses"][1:] != pytest.approx(plain["losses"][1:], rel=1e-5)  # the noise did act


@pytest.mark.parametrize("axis", ["cp", "sp", "tp"])
def test_accelerates_own_axes_are_refused_from_the_launchers_config_under_any_launch(axis, monkeypatch):
    monkeypatch.setenv(f"PARALLELISM_CONFIG_{axis.upper()}_SIZE", "2")
    with pytest.raises(ConfigError, match=f"parallelism_config_{axis}_size 2: accelerate's own {axis} axis"):
        check_run()
    monkeypatch.setenv(f"PARALLELISM_CONFIG_{axis.upper()}_SIZE", "1")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2")
    check_run()  # data-parallel axes compose


@pytest.mark.parametrize("axis", ["cp", "sp"])
def test_accelerates_own_axes_are_refused_from_the_trainers_arguments(axis, tmp_path):
    config = ParallelismConfig(**{f"{axis}_size": 2})
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], parallelism_config=config)
    with pytest.raises(ConfigError, match=rf"ParallelismConfig\({axis}_size=2\)\): accelerate's own {axis} axis"):
        check_training_arguments(args, sp_size=1)
    check_accelerate_parallelism(TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                                                   parallelism_config=ParallelismConfig(dp_shard_size=2)))


def test_torch_compile_is_refused_at_train_begin_and_named_when_compiled_by_hand(tmp_path):
    with pytest.raises(ConfigError, match=r"torch.compile cannot trace the backward of a longctx_\* attention"):
        flattening_run(str(tmp_path), evaluate=False, torch_compile=True)
    model = torch.compile(tiny_llama("longctx_zigzag"))
    ids = torch.randint(3, 61, (1, 32), generator=torch.Generator().manual_seed(0))
    try:
        with pytest.raises(Exception, match=r"train without torch_compile"):
            model(input_ids=ids, labels=ids, position_ids=torch.arange(32)[None]).loss.backward()
    finally:
        torch._dynamo.reset()  # no compiled frame of this model's forward outlives the test
