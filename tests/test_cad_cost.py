"""CAD on measured cost: the profiled model's disk cache, the eps rule, and exactness under both."""

from __future__ import annotations

import pytest
import torch
from test_backends import make_problem, reference

from hf_longctx.backends.cad.cost_model import FlopsCostModel, ProfiledCostModel
from hf_longctx.backends.cad.eps import EpsCandidate, choose_eps, sweep_eps
from hf_longctx.backends.cad.runtime import cad_schedule
from hf_longctx.backends.cad.scheduler import verify_schedule
from hf_longctx.backends.cad.tasks import docs_per_rank
from hf_longctx.lab.cad.profiled import ProfileBudget, SegmentShape, measured_cost_model
from hf_longctx.lab.emulation import emulate_step
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
    model, source = measured_cost_model("reference", "cpu", SHAPE, **TINY)
    assert isinstance(model, ProfiledCostModel) and "now" in source
    files = list((tmp_path / "cad_cost").glob("cpu-reference-*.json"))
    assert len(files) == 1
    again, source = measured_cost_model("reference", "cpu", SHAPE, **TINY)
    assert "now" not in source and str(files[0]) in source
    assert again.cost(64, 256) == pytest.approx(model.cost(64, 256))
    assert model.cost(64, 256) > model.cost(16, 256) > 0


def test_without_a_gpu_the_default_is_flops():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    model, source = measured_cost_model()
    assert isinstance(model, FlopsCostModel) and source.startswith("FLOPs")


@pytest.mark.parametrize("world", [3, 4])
def test_cad_on_a_profiled_model_and_auto_eps_stays_exact(tmp_path, monkeypatch, world):
    monkeypatch.setenv("HF_LONGCTX_CACHE", str(tmp_path))
    model, _ = measured_cost_model("reference", "cpu", SegmentShape(4, 2, 16, torch.float64), **TINY)
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


def test_a_model_file_makes_every_rank_schedule_on_one_table():
    """A cost model file read on every rank: ranks whose copies differ agree on the largest value per cell (and on
    one launch grid: the most SMs any rank has)."""
    import hf_longctx.backends.cad.runtime as runtime
    import hf_longctx.comm.mode as mode
    from hf_longctx.kernels.launch import LaunchGrid
    from hf_longctx.lab.emulation.group import EmulationHub

    base = ProfiledCostModel.from_grid((16, 64), (16, 64), [[1.0, 2.0], [3.0, 4.0]], interpolate="rate",
                                       segment_cost=0.25, tile=16, launch=LaunchGrid(slots=114), launch_heads=4)
    other = ProfiledCostModel.from_grid((16, 64), (16, 64), [[1.0, 2.5], [3.0, 4.0]], interpolate="rate",
                                        segment_cost=0.5, tile=16, launch=LaunchGrid(slots=132), launch_heads=4)

    def per_rank(group):  # rank 1's copy holds one cell and the per-segment term slower
        return runtime.agreed_cost_model(other if group.rank == 1 else base, group)

    kept = {group: dict(state) for group, state in mode._STATE_BY_GROUP.items()}
    for _ in range(2):  # a new group each time: agreed again, never taken from another group
        models = EmulationHub(3).run(per_rank)
        assert all(m.table == ((1.0, 2.5), (3.0, 4.0)) and m.segment_cost == 0.5 and m.tile == 16 for m in models)
        assert all(m.launch == LaunchGrid(slots=132) and m.launch_heads == 4 for m in models)
    # emulated groups keep theirs on their hub (their own comm ops' state), freed with it
    assert {group: dict(state) for group, state in mode._STATE_BY_GROUP.items()} == kept


def _fake_clock(call_ms: float, per_segment_ms: float, per_pair_ms: float):
    """A stand-in for the profiler's clock: a fused call costs ``call_ms``, each segment ``per_segment_ms`` and each
    visible (query, key) pair ``per_pair_ms``."""
    from hf_longctx.backends.cad.cost_model import PAIRS

    def run_ms(step, device):
        return call_ms + sum(per_segment_ms + per_pair_ms * PAIRS.cost(q, k) for q, k in step.shapes)

    return run_ms


def test_profiler_fits_the_per_segment_term_from_cut_batches(tmp_path, monkeypatch):
    """On a clock with a known per-segment cost the profiler recovers it, the grid keeps the rows' cost, and the
    model prices shapes far from the grid (where a per-pair rate alone misses the term) right."""
    import hf_longctx.lab.cad.profiled as profiled
    from hf_longctx.backends.cad.cost_model import PAIRS

    monkeypatch.setattr(profiled, "_run_ms", _fake_clock(call_ms=0.005, per_segment_ms=0.02, per_pair_ms=1e-6))
    budget = ProfileBudget(min_tokens=256, max_kv_tokens=4096, max_pairs=1 << 16, warmup=0, reps=1)
    model, meta = profiled.profile_segment_costs("reference", "cpu", SHAPE, (16, 64, 256), (16, 64, 256, 1024),
                                                 budget, tile=16)
    assert model.segment_cost == pytest.approx(0.02, rel=1e-6) and model.tile == 16
    samples = meta["segment_cost_samples"]
    assert len(samples) == 3 and all(ms == pytest.approx(0.02) for *_, ms in samples)
    truth = [(16, 16), (16, 1024), (64, 700), (1, 1000), (3, 40)]
    for q, k in truth:
        exact = 0.02 + 1e-6 * PAIRS.cost(-(-q // 16) * 16, -(-k // 16) * 16)
        assert model.cost(q, k) == pytest.approx(exact, rel=0.05), (q, k)
    # without the term, a short segment is priced at the grid's per-pair rate: far too cheap
    flat, _ = profiled.profile_segment_costs("reference", "cpu", SHAPE, (16, 64, 256), (16, 64, 256, 1024), budget,
                                             tile=0, segment_cost=False)
    assert flat.segment_cost == 0.0 and flat.cost(1, 1000) < 0.5 * model.cost(1, 1000)


def test_a_cached_profile_without_the_segment_term_is_measured_again(tmp_path, monkeypatch):
    import json

    import hf_longctx.lab.cad.profiled as profiled

    monkeypatch.setenv("HF_LONGCTX_CACHE", str(tmp_path))
    monkeypatch.setattr(profiled, "_run_ms", _fake_clock(call_ms=0.0, per_segment_ms=0.01, per_pair_ms=1e-6))
    model, source = measured_cost_model("reference", "cpu", SHAPE, **TINY)
    path = next((tmp_path / "cad_cost").glob("*.json"))
    assert "now" in source and model.segment_cost == pytest.approx(0.01, rel=1e-6)
    doc = json.loads(path.read_text())
    del doc["segment_cost"], doc["tile"]  # as written before the term existed
    path.write_text(json.dumps(doc))
    again, source = measured_cost_model("reference", "cpu", SHAPE, **TINY)
    assert "now" in source and again.segment_cost == pytest.approx(0.01, rel=1e-6)
    assert "segment_cost" in json.loads(path.read_text())


@pytest.mark.parametrize("world", [3, 4])
def test_cad_with_a_segment_term_and_tiles_stays_exact(world):
    from hf_longctx.backends.cad.cost_model import PAIRS

    grid = (16, 64, 256, 1024)
    model = ProfiledCostModel.from_grid(grid, grid, [[0.3 + 1e-4 * PAIRS.cost(q, k) for k in grid] for q in grid],
                                        interpolate="rate", segment_cost=0.3, tile=16)
    batch, q, k, v, dout = make_problem(21 + world, world, torch.float64)
    want = reference(batch, q, k, v, dout)
    for options in ({"cost_model": model, "eps": 0.0, "min_shard": 4}, {"cost_model": model, "eps": "auto"}):
        step = emulate_step(batch, world, (q, k, v, dout), "cad", options=options, kernel="reference",
                            keep_results=True)
        plan = shard_plan(batch, world, "cad")
        verify_schedule(docs_per_rank(plan), cad_schedule(plan, options), model)  # every row once, loads priced
        for r in step.ranks:
            idx = plan.local_indices(r.rank)
            for got, ref in zip(r.results, want):
                torch.testing.assert_close(got, ref[idx], rtol=1e-9, atol=1e-9)


def test_a_profile_with_a_launch_grid_keeps_each_cells_work_without_its_copies_tail(monkeypatch):
    """On a clock whose calls take their work times their tail factor, a profile that knows the launch grid holds
    each cell's work at full throughput (its timed copies' factor taken out, listed in the metadata); priced
    back with a call's factor it gives what that call took. Without the grid the cells keep their copies' tail."""
    import hf_longctx.lab.cad.profiled as profiled
    from hf_longctx.backends.cad.cost_model import PAIRS
    from hf_longctx.kernels.launch import LaunchGrid, tail_factor

    grid = LaunchGrid(forward_tile=(16, 16), backward_tile=(16, 16), forward_weight=0.3, slots=3)
    per_pair = 1e-5

    def run_ms(step, device):
        q, k = [s[0] for s in step.shapes], [s[1] for s in step.shapes]
        return per_pair * sum(PAIRS.cost(a, b) for a, b in step.shapes) * tail_factor(q, k, SHAPE.heads, grid)

    monkeypatch.setattr(profiled, "_run_ms", run_ms)
    monkeypatch.setattr(profiled, "launch_grid", lambda kernel, device, head_dim, mode="fwd+bwd", shape=None: grid)
    args = ("reference", "cpu", SHAPE, (16, 64), (16, 64, 256), TINY["budget"])
    model, meta = profiled.profile_segment_costs(*args, tile=0, segment_cost=False)
    assert model.launch == grid and model.launch_heads == SHAPE.heads
    assert meta["tail_factors"] and all(f >= 1.0 for *_, f in meta["tail_factors"])
    for q, k in ((16, 16), (16, 256), (64, 64), (64, 256)):
        assert model.cost(q, k) == pytest.approx(per_pair * PAIRS.cost(q, k), rel=1e-9), (q, k)
        assert model.cost(q, k) * model.call_factor([q], [k]) == pytest.approx(
            per_pair * PAIRS.cost(q, k) * tail_factor([q], [k], SHAPE.heads, grid), rel=1e-9)
    monkeypatch.setattr(profiled, "launch_grid", lambda kernel, device, head_dim, mode="fwd+bwd", shape=None: None)
    plain, meta = profiled.profile_segment_costs(*args, tile=0, segment_cost=False)
    assert plain.launch is None and meta["tail_factors"] == []
    assert plain.cost(64, 64) > model.cost(64, 64)  # the copies' tail stays in the cell
