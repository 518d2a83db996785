"""CAD on measured cost: the profiled model's disk cache, the eps rule, and exactness under both."""

from __future__ import annotations

import pytest
import torch
from test_backends import make_problem, reference

from hf_longctx.backends.cad.cost_model import FlopsCostModel, ProfiledCostModel
from hf_longctx.backends.cad.eps import EpsCandidate, choose_eps, sweep_eps
from hf_longctx.backends.cad.profiled import ProfileBudget, SegmentShape, profiled_cost_model
from hf_longctx.backends.cad.runtime import cad_schedule
from hf_longctx.emulation import emulate_step
from hf_longctx.layout import shard_plan

TINY = dict(q_lens=(16, 64), kv_lens=(16, 64, 256), budget=ProfileBudget(min_tokens=64, max_kv_tokens=1024,
                                                                           max_pairs=4096, warmup=0, reps=1))
SHAPE = SegmentShape(heads=2, kv_heads=1, head_dim=8, dtype=torch.float32)


def test_choose_eps_weighs_compute_against_bytes():
    cands = [EpsCandidate(0.0, compute_s=1.00, max_bytes=4e9), EpsCandidate(0.1, compute_s=1.10, max_bytes=1e9),
             EpsCandidate(0.2, compute_s=1.30, max_bytes=0.0)]
    assert choose_eps(cands, bandwidth=1e12).eps == 0.0  # bytes nearly free: the tightest balance
    assert choose_eps(cands, bandwidth=1e10).eps == 0.1  # 1.1 + 0.1 beats 1.0 + 0.4 and 1.3
    assert choose_eps(cands, bandwidth=1e9).eps == 0.2  # bytes dear: move nothing more
    tie = [EpsCandidate(0.05, 1.0, 0.0), EpsCandidate(0.1, 1.0, 0.0)]
    assert choose_eps(tie, bandwidth=1e9).eps == 0.1  # a tie keeps fewer moves
    with pytest.raises(ValueError):
        choose_eps([], 1e9)


def test_sweep_picks_one_of_its_candidates():
    docs = [[4096], [512, 512, 512], [128] * 8, [2048, 1024]]
    sched, cands = sweep_eps(docs, 4, FlopsCostModel())
    assert sched.eps in {c.eps for c in cands} and len(cands) == 6


def test_profiled_model_is_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_LONGCTX_CACHE", str(tmp_path))
    model, source = profiled_cost_model("reference", "cpu", SHAPE, **TINY)
    assert isinstance(model, ProfiledCostModel) and "now" in source
    files = list((tmp_path / "cad_cost").glob("cpu-reference-*.json"))
    assert len(files) == 1
    again, source = profiled_cost_model("reference", "cpu", SHAPE, **TINY)
    assert "now" not in source and str(files[0]) in source
    assert again.cost(64, 256) == pytest.approx(model.cost(64, 256))
    assert model.cost(64, 256) > model.cost(16, 256) > 0


def test_without_a_gpu_the_default_is_flops():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    model, source = profiled_cost_model()
    assert isinstance(model, FlopsCostModel) and source.startswith("FLOPs")


@pytest.mark.parametrize("world", [3, 4])
def test_cad_on_a_profiled_model_and_auto_eps_stays_exact(tmp_path, monkeypatch, world):
    monkeypatch.setenv("HF_LONGCTX_CACHE", str(tmp_path))
    model, _ = profiled_cost_model("reference", "cpu", SegmentShape(4, 2, 16, torch.float64), **TINY)
    batch, q, k, v, dout = make_problem(11 + world, world, torch.float64)
    want = reference(batch, q, k, v, dout)
    options = {"cost_model": model, "eps": "auto"}
    step = emulate_step(batch, world, (q, k, v, dout), "cad", options=options, kernel="reference",
                        keep_results=True)
    plan = shard_plan(batch, world, "cad")
    assert cad_schedule(plan, options).eps in (0.0, 0.01, 0.02, 0.05, 0.1, 0.2)
    for r in step.ranks:
        idx = plan.local_indices(r.rank)
        for got, ref in zip(r.results, want):
            torch.testing.assert_close(got, ref[idx], rtol=1e-9, atol=1e-9)


def test_profiled_string_makes_every_rank_schedule_on_one_table(tmp_path, monkeypatch):
    """``cost_model="profiled"``: ranks that measured different tables agree on the largest value per cell."""
    import hf_longctx.backends.cad.runtime as runtime
    from hf_longctx.comm.emulated import EmulationHub

    base = ProfiledCostModel.from_grid((16, 64), (16, 64), [[1.0, 2.0], [3.0, 4.0]], interpolate="rate")
    monkeypatch.setattr(runtime, "_profiled", lambda kernel: base)

    def per_rank(group):
        if group.rank == 1:  # a rank whose device measured one cell slower
            monkeypatch.setattr(runtime, "_profiled", lambda kernel: ProfiledCostModel.from_grid(
                (16, 64), (16, 64), [[1.0, 2.5], [3.0, 4.0]], interpolate="rate"))
        return runtime.agreed_profile("reference", group)

    models = EmulationHub(3).run(per_rank)
    assert all(m.table == ((1.0, 2.5), (3.0, 4.0)) for m in models)
