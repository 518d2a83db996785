"""The backward's dK/dV accumulators out of the L2: how the launch model prices a long segment's few-step blocks."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import numpy as np
import pytest
import torch
from test_cad_launch_cost import _fake_call_clock, small_profiles

from hf_longctx.backends.cad.launch_cost import LaunchCostModel, PhaseTerms, accumulator_terms, call_features
from hf_longctx.kernels import fa4
from hf_longctx.kernels.launch import LaunchGrid, accumulator_share, backward_short_steps
from hf_longctx.lab.cad import call_profile, profiled
from hf_longctx.lab.cad.call_profile import profile_launch_cost
from hf_longctx.lab.cad.profiled import SegmentShape, measured_cost_model

FA4_LIKE = LaunchGrid(forward_tile=(128, 128), backward_tile=(64, 128), forward_weight=0.3, launch_order="segment",
                      backward_min_steps=16, backward_accumulator_keys=(15360, 46080))


def test_the_share_out_of_the_l2_ramps_from_the_first_keys_to_the_full():
    keys = (15360, 46080)
    assert accumulator_share(15360, keys) == 0.0 and accumulator_share(1000, keys) == 0.0
    assert accumulator_share(46080, keys) == 1.0 and accumulator_share(200_000, keys) == 1.0
    assert accumulator_share(30720, keys) == pytest.approx(0.5)
    lengths = np.array([0, 15360, 20000, 30720, 46080, 90000])
    np.testing.assert_allclose(accumulator_share(lengths, keys), [accumulator_share(int(k), keys) for k in lengths])
    assert accumulator_share(90000, None) == 0.0  # the kernel writes dK/dV directly: nothing to leave the cache
    assert accumulator_share(lengths, None).tolist() == [0.0] * len(lengths)


def test_each_segment_pays_by_its_own_keys_in_the_backward_only():
    """A segment's heads run one after another over its own keys, so its own length decides: two segments of 30K
    keys in one call pay as two of 30K, not as 60K."""
    pairs = [(128, 30000), (256, 30000)]
    past_l2, waiting = accumulator_terms("backward", pairs, FA4_LIKE)
    share = accumulator_share(30000, FA4_LIKE.backward_accumulator_keys)
    assert 0 < share < 1
    assert past_l2 == pytest.approx(share * 60000)
    assert waiting == pytest.approx(share * sum(backward_short_steps(q, k, (64, 128), 8) for q, k in pairs))
    assert waiting > 0  # 2 and 4 query tiles: every key block is short of 8
    assert accumulator_terms("forward", pairs, FA4_LIKE) == (0.0, 0.0)
    assert accumulator_terms("backward", pairs, replace(FA4_LIKE, backward_accumulator_keys=None)) == (0.0, 0.0)
    assert accumulator_terms("backward", [(128, 12000)], FA4_LIKE) == (0.0, 0.0)  # under the first keys
    features = call_features("backward", [q for q, _ in pairs], [k for _, k in pairs], FA4_LIKE, 32)
    assert features[-2:].tolist() == pytest.approx([past_l2, waiting])


def test_a_segments_price_and_its_calls_price_hold_the_same_accumulator_cost():
    """The terms add over segments, so the scheduler's price of a segment alone, its numpy form and a call's
    phases agree, and a call's tail does not count them twice."""
    terms = PhaseTerms(5e-4, 1.3e-5, 1.4e-5, 1e-3, 1e-3, 0.03, short_step=1e-4, accumulator_key=2e-6,
                       accumulator_short_step=1.2e-4)
    model = LaunchCostModel(FA4_LIKE, 32, PhaseTerms(9e-5, 1e-5, 0.0, 0.0, 0.0, 0.01), terms)
    plain = LaunchCostModel(FA4_LIKE, 32, model.forward, replace(terms, accumulator_key=0.0,
                                                                  accumulator_short_step=0.0))
    rng = random.Random(2)
    for _ in range(40):
        k = rng.randint(64, 120000)
        q = rng.randint(1, min(k, 4096))
        past_l2, waiting = accumulator_terms("backward", [(q, k)], FA4_LIKE)
        assert model.cost(q, k) - plain.cost(q, k) == pytest.approx(2e-6 * past_l2 + 1.2e-4 * waiting, abs=1e-12)
        assert model.cost_array(np.array([q]), np.array([k]))[0] == pytest.approx(model.cost(q, k), rel=1e-12)
    q_lens, k_lens = [128, 900, 4000], [60000, 40000, 4000]
    extra = model.phase_cost("backward", q_lens, k_lens) - plain.phase_cost("backward", q_lens, k_lens)
    assert extra == pytest.approx(sum(model.cost(q, k) - plain.cost(q, k) for q, k in zip(q_lens, k_lens)))
    assert model.tail_cost(q_lens, k_lens) == pytest.approx(plain.tail_cost(q_lens, k_lens))


def test_the_profiler_recovers_what_accumulators_out_of_the_l2_cost(monkeypatch):
    """On a grid that declares where the accumulators leave the L2, the fit recovers both prices: the profile's
    few-row calls over long prefixes and CAD's server calls hold such segments."""
    grid = LaunchGrid(forward_tile=(16, 16), backward_tile=(8, 16), slots=6, launch_order="segment",
                      backward_min_steps=6, backward_accumulator_keys=(120, 360), backward_accumulator_steps=4)
    truth = {"forward": PhaseTerms(2e-3, 1e-4, 2e-4, 1e-3, 0.0, 0.05),
             "backward": PhaseTerms(5e-3, 3e-4, 2e-4, 2e-3, 1e-2, 0.08, short_step=3e-3, accumulator_key=4e-4,
                                    accumulator_short_step=6e-3)}
    monkeypatch.setattr(call_profile, "_run_ms", _fake_call_clock(truth, grid, heads=2))
    model, meta = profile_launch_cost("reference", torch.device("cpu"), grid, heads=2, kv_heads=1, head_dim=8,
                                      dtype=torch.float32, count=32, warmup=0, reps=1, scale=1 / 256,
                                      server_calls=24, step_seeds=())
    np.testing.assert_allclose(model.backward.as_vector(), truth["backward"].as_vector(), rtol=1e-6, atol=1e-12)
    assert model.forward.accumulator_key == 0.0 and model.forward.accumulator_short_step == 0.0
    assert max(meta["held_out_relative_error_std"].values()) < 1e-9


def test_flash_attention_4_declares_its_accumulator_keys_from_the_l2_and_the_head_dim():
    # 1 KB of fp32 dK and dV per key at head dim 128: a 60 MiB L2 (an H200's) holds 61,440 keys' worth; they
    # leave it from a quarter of that on and are out of it at three quarters
    assert fa4.backward_accumulator_keys(32, 8, 128, 60 * 2 ** 20) == (15360, 46080)
    assert fa4.backward_accumulator_keys(32, 8, 64, 60 * 2 ** 20) == (30720, 92160)
    assert fa4.backward_accumulator_keys(32, 32, 128, 60 * 2 ** 20) is None  # no grouped heads: no accumulators
    assert fa4.backward_accumulator_keys(32, 8, 128, 0) is None  # an L2 the device does not report


def test_a_grid_checks_and_keeps_its_accumulator_keys():
    assert LaunchGrid.from_dict(FA4_LIKE.to_dict()) == FA4_LIKE
    older = FA4_LIKE.to_dict()
    del older["backward_accumulator_keys"], older["backward_accumulator_steps"]  # saved before they existed
    assert LaunchGrid.from_dict(older) == replace(FA4_LIKE, backward_accumulator_keys=None)
    for bad in ((5000, 5000), (-1, 10), (1, 2, 3)):
        with pytest.raises(ValueError, match="backward_accumulator_keys"):
            LaunchGrid(backward_accumulator_keys=bad)
    with pytest.raises(ValueError, match="backward_accumulator_steps"):
        LaunchGrid(backward_accumulator_steps=0)


def test_a_cached_model_without_the_accumulator_terms_is_kept_only_where_the_grid_declares_none(tmp_path,
                                                                                               monkeypatch):
    """A model saved before the terms existed prices accumulators out of the L2 as free: fitted again where the grid
    declares them, kept where it does not (the terms are 0 there whatever the fit)."""
    monkeypatch.setenv("HF_LONGCTX_CACHE", str(tmp_path))
    monkeypatch.delenv("HF_LONGCTX_PROFILE_L2", raising=False)
    grid = LaunchGrid(forward_tile=(16, 8), backward_tile=(8, 16), slots=6)
    truth = {p: PhaseTerms(1e-3, 1e-4, 1e-4, 1e-3, 1e-3, 0.05) for p in ("forward", "backward")}
    monkeypatch.setattr(call_profile, "_run_ms", _fake_call_clock(truth, grid, heads=2))
    current = {"grid": grid}
    monkeypatch.setattr(profiled, "launch_grid",
                        lambda kernel, device, head_dim, mode="fwd+bwd", shape=None: current["grid"])
    fits = small_profiles(monkeypatch, server_calls=0)
    shape = SegmentShape(2, 1, 8, torch.float32)
    measured_cost_model("reference", "cpu", shape)
    cached = profiled.launch_cache_path(torch.device("cpu"), "reference", shape)
    older = json.loads(cached.read_text())
    for phase in ("forward", "backward"):
        del older[phase]["accumulator_key"], older[phase]["accumulator_short_step"]
    cached.write_text(json.dumps(older))
    _, source = measured_cost_model("reference", "cpu", shape)
    assert "now" not in source and len(fits) == 1  # the grid declares no accumulator keys: kept
    current["grid"] = replace(grid, backward_accumulator_keys=(120, 360))
    _, source = measured_cost_model("reference", "cpu", shape)
    assert "now" in source and len(fits) == 2  # now it does: fitted again
    _, source = measured_cost_model("reference", "cpu", shape)
    assert "now" not in source and len(fits) == 2
    current["grid"] = replace(grid, backward_accumulator_keys=(100, 300))  # another L2: its terms mean otherwise
    _, source = measured_cost_model("reference", "cpu", shape)
    assert "now" in source and len(fits) == 3
