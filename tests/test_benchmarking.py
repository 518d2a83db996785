"""The measuring helpers shared by the training callback and the benchmarks: FLOPs, MFU, tables, and
the kernel that is skipped so a benchmark can time what surrounds the kernels."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_longctx.benchmarking import (
    attention_flops,
    model_flops_per_token,
    peak_flops,
    table_header,
    table_row,
    training_mfu,
)
from hf_longctx.kernels import SKIP_KERNEL, attention_backward, attention_forward


def _llama(tied: bool) -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied))


@pytest.mark.parametrize("tied", [False, True])
def test_model_flops_count_the_embedding_only_as_the_tied_output_matmul(tied):
    model = _llama(tied)
    every = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    assert model_flops_per_token(model) == 6.0 * (every if tied else every - embedding)


def test_mfu_is_model_and_attention_flops_over_the_devices_peak():
    model = _llama(False)
    per_token = model_flops_per_token(model)
    # 4 heads x head_dim 4 x 2 layers: 4 * 16 * 2 * 3.5 = 448 FLOPs per visible pair, forward + backward
    assert attention_flops(model.config, 10) == pytest.approx(4480.0)
    flops = 1000 * per_token + 4480.0
    assert training_mfu(model.config, per_token, 1000, 10, 2.0, 4, 1e6) == pytest.approx(flops / 2.0 / 4e6)
    assert training_mfu(model.config, per_token, 1000, 10, 2.0, 4, None) is None
    assert peak_flops(torch.device("cpu")) is None


def test_table_rows_line_up_with_the_header():
    header = table_header(["backend", "MFU"])
    assert header == "| backend | MFU |\n|---|---|"
    assert table_row(["zigzag", None]) == "| zigzag | - |"


def test_skip_kernel_returns_zeros_without_running_a_kernel():
    q, k, v = torch.randn(6, 2, 4), torch.randn(6, 1, 4), torch.randn(6, 1, 4)
    out, lse = attention_forward(q, k, v, [0, 6], [0, 6], 6, 6, kernel=SKIP_KERNEL)
    assert torch.equal(out, torch.zeros_like(q)) and lse.shape == (2, 6)
    grads = attention_backward(torch.ones_like(q), q, k, v, out, lse, [0, 6], [0, 6], 6, 6, kernel=SKIP_KERNEL)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape] and all(not g.any() for g in grads)


def test_recorded_commands_name_no_path_of_the_machine_that_ran_them(tmp_path):
    from hf_longctx.benchmarking import portable_command

    repo = tmp_path / "repo"
    (repo / "bench").mkdir(parents=True)
    command = portable_command("scripts/lab/simulate_cad.py", ["--profile", "/tmp/cadsched/profile.json",
                                                           f"--out={repo}/bench/sim.md", "--ranks", "8"], repo)
    assert command == "python scripts/lab/simulate_cad.py --profile profile.json --out=bench/sim.md --ranks 8"


def test_host_and_device_ms_times_each_phase_on_the_host_and_the_whole_until_the_device_is_done():
    import time

    from hf_longctx.benchmarking import host_and_device_ms

    host, total = host_and_device_ms([lambda: time.sleep(0.03), lambda: time.sleep(0.01)], torch.device("cpu"))
    assert len(host) == 2 and 30 <= host[0] < 60 and 10 <= host[1] < 30
    assert total >= sum(host) - 1e-6


def test_the_spin_before_a_timed_region_follows_the_hosts_dispatch_times():
    """A region whose host side takes longer than the shortest spin gets a spin of ``margin`` times the longest
    recent host time, capped; a single outlier (a call that compiled) does not stretch it; a region whose host
    time passed its spin is counted."""
    from hf_longctx.benchmarking import HostAhead

    ahead = HostAhead(margin=1.5, history=8, maximum_s=0.02, outlier=10.0)
    assert ahead.target_seconds(0.002) == 0.002  # nothing recorded yet: the shortest spin
    assert ahead.record(0.001, 0.002) is False
    assert ahead.target_seconds(0.002) == 0.002  # 1.5 x 1 ms is under the shortest
    assert ahead.record(0.004, 0.002) is True  # outran: counted
    assert ahead.target_seconds(0.002) == pytest.approx(0.006)
    for _ in range(3):
        ahead.record(0.004, 0.006)
    ahead.record(0.9, 0.006)  # a compile: over 10 x the median, ignored by the spin, still an overrun
    assert ahead.target_seconds(0.002) == pytest.approx(0.006)
    assert (ahead.regions, ahead.overruns) == (6, 2)
    for _ in range(8):
        ahead.record(0.05, 0.006)  # the host now always slow: the spin follows, up to its cap
    assert ahead.target_seconds(0.002) == 0.02
    assert ahead.target_seconds(0.03) == 0.03  # the cap never cuts the shortest spin


def test_a_fixed_spin_ignores_the_hosts_times_but_still_counts_overruns():
    from hf_longctx.benchmarking import HostAhead

    ahead = HostAhead(adaptive=False)
    assert ahead.record(0.01, 0.002) is True
    assert ahead.target_seconds(0.002) == 0.002
    assert ahead.overruns == 1
    with pytest.raises(ValueError, match="margin >= 1"):
        HostAhead(margin=0.5)
