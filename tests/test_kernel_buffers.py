"""The memory planner knows the attention kernel: each kernel's own buffers, and the plans that count them.

The buffers are checked against what each kernel allocated on a GPU (tests/kernel_buffer_measurements.json,
``scripts/bench_kernel_memory.py``; ``tests/gpu/test_kernel_buffers.py`` measures them again wherever a GPU runs
the suite), and the plans against whole training steps planned for one kernel each (the ``kernel_runs`` of
tests/memory_measurements.json).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from memory_windows import measured_runs, model_of_run, predicted_windows
from transformers import LlamaConfig

from hf_longctx.data.synthetic import document_lengths
from hf_longctx.hf.memory.kernel_buffers import (
    backward_bytes_beyond_torch_flash,
    kernel_buffer_bytes,
    planned_kernel,
)
from hf_longctx.hf.memory.model import GiB, LayerChoice, MemoryModel, ModelShape
from hf_longctx.hf.memory.search import plan_memory

HERE = Path(__file__).parent
LLAMA3_8B = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8)
K = 1024
H200_GPU, HOST = 150_121_086_976, 125 * GiB

# how far above a measured kernel's buffers its model may be: the FlashAttention kernels' are read from how their
# libraries allocate; the reference's transient float32 copies are bounded, not traced
HIGH = {"torch_flash": 1.02, "fa4": 1.02, "reference": 1.06}


@pytest.mark.parametrize("run", json.loads((HERE / "kernel_buffer_measurements.json").read_text())["runs"],
                         ids=lambda r: f"{r['kernel']}-{r['mix']}-{r['tokens']}")
def test_each_kernels_buffers_are_what_it_allocated_on_a_gpu(run):
    """The reference's rows of three documents hold a document's float32 output beside the previous one's."""
    lens = document_lengths(run["mix"], run["tokens"], seed=0)
    assert len(lens) == run["documents"]
    planned = kernel_buffer_bytes(run["kernel"], lens, heads=32, kv_heads=8, head_dim=128, itemsize=2)
    high = HIGH[run["kernel"]]
    for name, measured in (("forward", run["forward_extra"]), ("backward", run["backward_extra"])):
        if measured is None:  # not printed by the run that measured the row's other pass
            continue
        predicted = getattr(planned, name)
        assert measured <= predicted <= max(high * measured, measured + (1 << 20)), (name, predicted, measured)


def test_flashattention4_needs_less_than_torch_for_gqa_and_the_same_without():
    """torch's FlashAttention-2 writes every query head's dK and dV; FlashAttention-4 accumulates per KV head."""
    lens = [4096] * 16
    torch_gqa, fa4_gqa = (kernel_buffer_bytes(k, lens, 32, 8, 128, 2).backward for k in ("torch_flash", "fa4"))
    per_token = (torch_gqa - fa4_gqa) / sum(lens)
    # 2 x 32 heads x 128 x 2 bytes expanded, less 2 x 8 KV heads x 128 x 4 bytes accumulated, less a float32 per
    # head and padded row more in FlashAttention-4 (dpsum and lse_log2 where torch keeps softmax_d)
    assert 7_800 < per_token < 8_200
    torch_mha, fa4_mha = (kernel_buffer_bytes(k, lens, 32, 32, 128, 2).backward for k in ("torch_flash", "fa4"))
    assert abs(torch_mha - fa4_mha) / torch_mha < 0.02


def test_a_plan_counts_its_kernels_buffers():
    shape = ModelShape.from_config(LLAMA3_8B)
    layers = [LayerChoice("layer", True)] * 31 + [LayerChoice("none")]
    by_kernel = {k: MemoryModel(shape, 512 * K, tiled_loss=8192, tiled_mlp=16384, fused_ops=True, kernel=k)
                 for k in ("torch_flash", "fa4", "reference")}
    saved = by_kernel["torch_flash"].backward_work["layer"] - by_kernel["fa4"].backward_work["layer"]
    assert saved == -backward_bytes_beyond_torch_flash("fa4", 32, 8, 128, 2, 512 * K)
    assert 3.3 * GiB < saved < 4.2 * GiB  # FlashAttention-4's buffers are ~8 KB per token smaller at 8B shape
    assert by_kernel["fa4"].gpu_peak(layers)[0] < by_kernel["torch_flash"].gpu_peak(layers)[0]
    # the reference keeps float32 gradients of the whole row and of its longest document: planned as one document
    assert by_kernel["reference"].backward_work["layer"] > by_kernel["torch_flash"].backward_work["layer"]
    plan = plan_memory(LLAMA3_8B, 256 * K, gpu_bytes=H200_GPU, host_bytes=HOST, kernel="fa4")
    assert plan.kernel == "fa4" and plan.summary()["kernel"] == "fa4" and "kernel fa4" in str(plan)


def test_a_kernel_without_a_buffer_model_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="no buffer model for attention kernel 'mine'.*memory: manual"):
        plan_memory(LLAMA3_8B, 64 * K, gpu_bytes=H200_GPU, host_bytes=HOST, kernel="mine")


def test_cudnn_kernels_are_bounded_above_until_measured():
    lens = [8192] * 16
    for kernel in ("cudnn_varlen", "cudnn"):
        bound = kernel_buffer_bytes(kernel, lens, 32, 8, 128, 2)
        torch_flash = kernel_buffer_bytes("torch_flash", lens, 32, 8, 128, 2)
        assert bound.backward > torch_flash.backward and bound.forward > torch_flash.forward


def test_auto_is_planned_as_the_kernel_auto_runs_first():
    assert planned_kernel("fa4", "cuda") == "fa4"  # a kernel the run names is the one planned
    assert planned_kernel("auto", "cpu") == "reference"
    assert planned_kernel("auto", None) == "reference"


def test_steps_planned_per_kernel_against_their_measured_peaks():
    """One H100, the full 8B shape, planned by --memory auto for torch_flash and for FlashAttention-4 at 128K, 256K
    and the longest context each fits, and FlashAttention-4 at 512K on one H200
    (bench/results/2026-12-07_planner-per-kernel.md). The model never predicts less than a step or any of its layers'
    windows needed, and the step's peak within 5% at every size."""
    kernels = set()
    for run in measured_runs("kernel_runs"):
        model, layers = model_of_run(run)
        peak = model.gpu_peak(layers)[0] / GiB
        assert run["step_peak_gib"] <= peak <= 1.05 * run["step_peak_gib"], (run["command"], peak)
        windows = predicted_windows(model, layers)
        for name in ("forward", "backward"):
            for i, measured in enumerate(run["layer_peak_gib"][name]):
                if layers[i].checkpointing != "group":
                    assert windows[name][i] >= measured, (run["command"], name, i)
        kernels.add(run["kernel"])
    assert kernels == {"torch_flash", "fa4"}


def test_a_training_run_plans_for_its_recipes_kernel():
    from hf_longctx.hf import LongContextConfig
    from hf_longctx.hf.memory.training import plan_for_training

    tiny = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)
    named = plan_for_training(tiny, LongContextConfig(memory="auto", kernel="fa4"), tokens_per_gpu=4096)
    assert named.kernel == "fa4"
    assert plan_for_training(tiny, LongContextConfig(memory="auto"), tokens_per_gpu=4096).kernel == "reference"
