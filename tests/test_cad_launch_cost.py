"""CAD's launch cost model: a kernel call priced from its tile steps, tokens and launched blocks, fitted to calls."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import numpy as np
import pytest
import torch
from test_backends import make_problem, reference

from hf_longctx.backends.cad.cost_model import ProfiledCostModel
from hf_longctx.backends.cad.launch_cost import (
    PHASES,
    TERM_NAMES,
    LaunchCostModel,
    PhaseTerms,
    call_features,
    call_waves,
    fit_phase_terms,
)
from hf_longctx.backends.cad.runtime import prepare, server_costs
from hf_longctx.kernels.calls import call_order, calls_overhead, cut_into_calls
from hf_longctx.kernels.launch import (
    LaunchGrid,
    backward_step_total,
    backward_steps,
    forward_step_total,
    forward_steps,
)
from hf_longctx.lab.cad import call_profile, profiled
from hf_longctx.lab.cad.call_profile import (
    MIX_SHORTS,
    check_call_mix,
    check_launch_cost,
    errors_by_waves,
    mix_pairs,
    phase_spreads,
    profile_launch_cost,
    random_calls,
    server_phase_errors,
    short_document_calls,
    sweep_shapes,
)
from hf_longctx.lab.cad.profiled import SegmentShape, measured_cost_model
from hf_longctx.lab.emulation import emulate_step
from hf_longctx.layout import shard_plan

GRID = LaunchGrid(forward_tile=(128, 64), backward_tile=(64, 128), slots=132)
# the terms fitted on an H200 (torch_flash, 32 heads of 128), rounded: a realistic model to test with
H200 = LaunchCostModel(GRID, 32, PhaseTerms(3.5e-4, 4.2e-6, 7.3e-6, 0.0, 0.0, 0.0195),
                       PhaseTerms(1.02e-3, 1.84e-5, 1.55e-5, 1.49e-4, 1.5e-3, 0.0292))


@pytest.mark.parametrize("tiles", [((128, 64), (64, 128)), ((128, 128), (128, 128)), ((96, 64), (64, 96))])
def test_step_totals_in_closed_form_equal_the_blocks_summed(tiles):
    forward_tile, backward_tile = tiles
    rng = random.Random(0)
    shapes = [(0, 0), (1, 1), (128, 128), (129, 129), (644, 644), (1, 5000)]
    shapes += [(q, q + rng.choice([0, rng.randint(1, 6000)])) for q in (rng.randint(1, 4000) for _ in range(400))]
    for q, k in shapes:
        assert forward_step_total(q, k, forward_tile) == (sum(forward_steps(q, k, forward_tile)) if q else 0)
        assert backward_step_total(q, k, backward_tile) == (sum(backward_steps(q, k, backward_tile)) if q else 0)
    q, k = np.array([s[0] for s in shapes]), np.array([s[1] for s in shapes])
    assert forward_step_total(q, k, forward_tile).tolist() == [forward_step_total(int(a), int(b), forward_tile)
                                                               for a, b in shapes]
    assert backward_step_total(q, k, backward_tile).tolist() == [backward_step_total(int(a), int(b), backward_tile)
                                                                 for a, b in shapes]


def test_a_segment_past_a_tile_boundary_pays_its_own_steps_not_the_rounded_shape():
    """644 rows do 36 of the 42 backward tile steps of 768 (and 41 of 42 forward ones): a grid that rounds up to
    whole tiles prices them as 768."""
    assert backward_step_total(644, 644, GRID.backward_tile) == 36
    assert backward_step_total(768, 768, GRID.backward_tile) == 42
    assert forward_step_total(644, 644, GRID.forward_tile) == 41
    assert H200.cost(644, 644) < 0.92 * H200.cost(768, 768)
    assert H200.cost(640, 640) < H200.cost(644, 644) < H200.cost(700, 700)


def test_a_call_is_its_segments_plus_the_call_terms_plus_its_tail():
    """Three ways to price a call agree: the features times the terms, the model's call cost, and what the runtime
    adds up (segments alone, :func:`calls_overhead` under the model's call terms, the tail)."""
    rng = random.Random(3)
    for _ in range(30):
        n = rng.randint(1, 12)
        q = [rng.randint(1, 3000) for _ in range(n)]
        k = [x + rng.choice([0, rng.randint(0, 20000)]) for x in q]
        order = call_order(q, k)
        q, k = [q[i] for i in order], [k[i] for i in order]
        by_features = sum(float(np.dot(H200.terms(p).as_vector(), call_features(p, q, k, GRID, 32))) for p in PHASES)
        by_parts = (sum(H200.cost(a, b) for a, b in zip(q, k)) + calls_overhead(q, k, [(0, n)], H200.call_terms)
                    + H200.tail_cost(q, k))
        assert H200.call_cost(q, k) == pytest.approx(by_features, rel=1e-12)
        by_phase = H200.phase_cost("forward", q, k) + H200.phase_cost("backward", q, k)
        assert by_phase == pytest.approx(by_features, rel=1e-12)
        assert by_parts == pytest.approx(by_features, rel=1e-12)
    assert H200.tail_cost([8192], [8192]) > 0.02 * H200.cost(8192, 8192)  # a lone square's last blocks run alone
    assert H200.without_tails().tail_cost([8192], [8192]) == 0.0
    np.testing.assert_allclose(H200.cost_array(np.array([0, 644]), np.array([0, 900])), [0.0, H200.cost(644, 900)],
                               rtol=1e-12)


def test_the_fit_recovers_the_terms_and_keeps_them_non_negative():
    calls = random_calls(60, seed=1, scale=0.25)
    truth = {"forward": PhaseTerms(3e-4, 5e-6, 7e-6, 2e-5, 0.0, 0.02),
             "backward": PhaseTerms(1e-3, 2e-5, 1.5e-5, 1.5e-4, 1.5e-3, 0.03)}
    for phase in PHASES:
        x = np.array([call_features(phase, [q for q, _ in c], [k for _, k in c], GRID, 32) for c in calls])
        y = x @ truth[phase].as_vector()
        terms, err = fit_phase_terms(x, y)
        np.testing.assert_allclose(terms.as_vector(), truth[phase].as_vector(), rtol=1e-6, atol=1e-12)
        assert err < 1e-9
        noisy, _ = fit_phase_terms(x, y * np.random.default_rng(0).uniform(0.98, 1.02, len(y)))
        assert (noisy.as_vector() >= 0).all()  # the zero segment term does not turn negative on noise
    with pytest.raises(ValueError, match="calls"):
        fit_phase_terms(np.ones((3, 6)), np.ones(3))


def small_profiles(monkeypatch, server_calls: int) -> list:
    """The backend's profile (``profiled.profile_launch_cost``) shrunk to CPU sizes, with ``server_calls`` calls of
    CAD's servers and no emulated steps: the list it returns grows by one per profile made."""
    real, fits = profiled.profile_launch_cost, []

    def small_fit(*args, **kwargs):
        fits.append(1)
        return real(*args, **{**kwargs, "count": 24, "warmup": 0, "reps": 1, "scale": 1 / 256,
                              "server_calls": server_calls, "step_seeds": ()})

    monkeypatch.setattr(profiled, "profile_launch_cost", small_fit)
    return fits


def _fake_call_clock(terms: dict[str, PhaseTerms], grid: LaunchGrid, heads: int, l2: list | None = None):
    """A stand-in for the profiler's clock: each phase of a call takes exactly what ``terms`` price it at (and
    ``l2``, when given, collects whether each run was asked to evict the L2 cache first)."""
    def run_ms(step, device, cold=False):
        if l2 is not None:
            l2.append(cold)
        q, k = [a for a, _ in step.shapes], [b for _, b in step.shapes]
        return float(np.dot(terms[step.phase].as_vector(), call_features(step.phase, q, k, grid, heads)))

    return run_ms


def test_the_profiler_times_both_phases_of_random_calls_and_fits_them(monkeypatch):
    grid = LaunchGrid(forward_tile=(16, 8), backward_tile=(8, 16), slots=6)
    truth = {"forward": PhaseTerms(2e-3, 1e-4, 2e-4, 1e-3, 0.0, 0.05),
             "backward": PhaseTerms(5e-3, 3e-4, 2e-4, 2e-3, 1e-2, 0.08)}
    monkeypatch.setattr(call_profile, "_run_ms", _fake_call_clock(truth, grid, heads=2))
    drawn = []

    def server_calls_on(model, *args):
        drawn.append((model, real_server_calls(model, *args)))
        return drawn[-1][1]

    real_server_calls = call_profile.cad_server_calls
    monkeypatch.setattr(call_profile, "cad_server_calls", server_calls_on)
    model, meta = profile_launch_cost("reference", torch.device("cpu"), grid, heads=2, kv_heads=1, head_dim=8,
                                      dtype=torch.float32, count=32, warmup=0, reps=1, scale=1 / 256,
                                      server_calls=40, step_seeds=())
    for phase in PHASES:
        np.testing.assert_allclose(model.terms(phase).as_vector(), truth[phase].as_vector(), rtol=1e-6, atol=1e-12)
    # the random calls and the batches of short documents (the grid neither limits keys nor splits forwards), then
    # calls of CAD's servers, scheduled on the fit of the first ones
    calls = 32 + len(short_document_calls())
    assert max(meta["held_out_relative_error_std"].values()) < 1e-9
    assert meta["server_calls"] == 40 and meta["calls"] == calls + 40
    assert meta["call_set"] == call_profile.CALL_SET
    # every timed call is kept beside the fit, so the fit can be checked again away from the device
    assert len(meta["timed"]) == calls + 40 and all(t["forward"] > 0 and t["backward"] > 0 for t in meta["timed"])
    (first_fit, servers), = drawn  # scheduled on the first fit (already the truth here), then timed
    np.testing.assert_allclose(first_fit.backward.as_vector(), truth["backward"].as_vector(), rtol=1e-6, atol=1e-12)
    assert [t["shapes"] for t in meta["timed"][calls:]] == [[list(s) for s in c] for c in servers]
    first = meta["timed"][0]
    q, k = [a for a, _ in first["shapes"]], [b for _, b in first["shapes"]]
    assert first["forward"] == pytest.approx(truth["forward"].as_vector() @ call_features("forward", q, k, grid, 2))


def test_the_profile_fits_again_with_the_server_calls_it_timed(monkeypatch):
    """The final model is fitted on the server calls too: where they run slower than the random calls' fit says,
    the model moves toward them."""
    grid = LaunchGrid(forward_tile=(16, 8), backward_tile=(8, 16), slots=6)
    truth = {"forward": PhaseTerms(2e-3, 1e-4, 2e-4, 1e-3, 0.0, 0.05),
             "backward": PhaseTerms(5e-3, 3e-4, 2e-4, 2e-3, 1e-2, 0.08)}
    exact = _fake_call_clock(truth, grid, heads=2)
    servers: set = set()

    def slower_on_servers(step, device, cold=False):
        return exact(step, device, cold) * (1.2 if tuple(map(tuple, step.shapes)) in servers else 1.0)

    def drawn(*args):
        calls = real_server_calls(*args)
        servers.update(tuple(map(tuple, c)) for c in calls)
        return calls

    real_server_calls = call_profile.cad_server_calls
    monkeypatch.setattr(call_profile, "cad_server_calls", drawn)
    monkeypatch.setattr(call_profile, "_run_ms", slower_on_servers)
    model, meta = profile_launch_cost("reference", torch.device("cpu"), grid, heads=2, kv_heads=1, head_dim=8,
                                      dtype=torch.float32, count=32, warmup=0, reps=1, scale=1 / 256,
                                      server_calls=40, step_seeds=())
    assert meta["server_calls"] == 40 and servers
    shapes = [list(c) for c in servers]
    for phase in PHASES:
        priced = [LaunchCostModel(grid, 2, truth["forward"], truth["backward"]).phase_cost(
            phase, [q for q, _ in c], [k for _, k in c]) for c in shapes]
        refit = [model.phase_cost(phase, [q for q, _ in c], [k for _, k in c]) for c in shapes]
        assert sum(refit) > 1.05 * sum(priced), phase  # priced up toward the 20% the server calls took more


def test_only_causal_server_calls_are_drawn(monkeypatch):
    """A server's calls of rectangles (key cuts) run the non-causal kernel; the profile times causal calls only."""
    from hf_longctx.backends.cad import runtime

    monkeypatch.setattr(runtime, "server_calls", lambda plan, tasks, options, model: [([64], [640], False),
                                                                                      ([32, 16], [32, 16], True)])
    model = LaunchCostModel(GRID, 32, H200.forward, H200.backward)
    drawn = call_profile.cad_server_calls(model, 100, batches=(("sft", 2048, 2),), rounds=1)
    assert drawn == [[(32, 32), (16, 16)]] * 2  # one causal call per server


def test_the_profiles_server_calls_are_those_cads_servers_run():
    """The calls the profile adds are drawn from what CAD's servers run on the schedules of a few batches, each
    drawn in rounds of other documents (``runtime.server_calls``: ping-pong halves, cut into calls as the runtime
    cuts them), causal ones only."""
    from hf_longctx.backends.cad.runtime import cad_schedule, server_calls
    from hf_longctx.lab.emulation.workloads import doc_lengths
    from hf_longctx.layout import PackedBatch, shard_plan

    batches = (("pretrain", 4096, 4), ("sft", 2048, 3))
    model = LaunchCostModel(GRID, 32, H200.forward, H200.backward)
    drawn = call_profile.cad_server_calls(model, 30, seed=5, batches=batches, rounds=2)
    assert drawn == call_profile.cad_server_calls(model, 30, seed=5, batches=batches, rounds=2)  # a seed: the same
    pool = []
    for i, (mix, tokens, world) in enumerate(batches * 2):  # each batch twice, of other documents
        lengths = doc_lengths(mix, tokens, seed=call_profile.SERVER_CALL_SEED + 5 + i)
        plan = shard_plan(PackedBatch.from_doc_lens(lengths), world, "cad")
        options = {"cost_model": model, "eps": 0.01}
        tasks = cad_schedule(plan, options).tasks
        for server in range(world):
            calls = server_calls(plan, [t for t in tasks if t.server == server], options, model)
            # a server's calls hold every row of its tasks once
            rows = sum(t.q_end - t.q_start for t in tasks if t.server == server)
            assert sum(sum(q) for q, _, _ in calls) == rows
            pool += [list(zip(q, k)) for q, k, causal in calls if causal]
    assert len(drawn) == min(30, len(pool)) and all(call in pool for call in drawn)
    assert all(q <= k for call in drawn for q, k in call)


def test_short_backward_blocks_are_counted_in_the_steps_they_fall_short_of_the_grids_minimum():
    """A backward block of few query tiles (few rows over a long prefix) is slower per step: the steps by which
    each block falls short of the grid's minimum are counted, in closed form, as the block-by-block sum."""
    from hf_longctx.kernels.launch import backward_short_steps, backward_steps

    rng = random.Random(3)
    for tile in ((64, 128), (128, 64), (64, 64)):
        for min_steps in (1, 6, 16):
            for _ in range(150):
                k = rng.randint(1, 6000)
                q, causal = rng.randint(1, k), rng.random() < 0.7
                want = sum(max(0, min_steps - s) for s in backward_steps(q, k, tile, causal))
                assert backward_short_steps(q, k, tile, min_steps, causal) == want, (tile, min_steps, q, k, causal)
                both = backward_short_steps(np.array([q, 0]), np.array([k, 7]), tile, min_steps, causal)
                assert both.tolist() == [want, 0]
    # 128 rows over 4096 keys: 32 key blocks, each swept by both query tiles (the last one's masked in part)
    assert backward_short_steps(128, 4096, (64, 128), 16) == 32 * 14
    assert backward_short_steps(4096, 4096, (64, 128), None) == 0  # no minimum: nothing is short


def test_the_profiler_recovers_what_short_backward_blocks_cost_per_step(monkeypatch):
    """On a grid with a backward minimum, the fit recovers the price of each step a block falls short of it (the
    profile's calls of few rows over long keys hold such blocks), and a segment's cost counts them."""
    grid = LaunchGrid(forward_tile=(16, 16), backward_tile=(8, 16), slots=6, launch_order="segment",
                      backward_min_steps=6)
    truth = {"forward": PhaseTerms(2e-3, 1e-4, 2e-4, 1e-3, 0.0, 0.05),
             "backward": PhaseTerms(5e-3, 3e-4, 2e-4, 2e-3, 1e-2, 0.08, short_step=3e-3)}
    monkeypatch.setattr(call_profile, "_run_ms", _fake_call_clock(truth, grid, heads=2))
    model, meta = profile_launch_cost("reference", torch.device("cpu"), grid, heads=2, kv_heads=1, head_dim=8,
                                      dtype=torch.float32, count=32, warmup=0, reps=1, scale=1 / 256,
                                      server_calls=0, step_seeds=())
    assert model.backward.short_step == pytest.approx(3e-3, rel=1e-6)
    assert max(meta["held_out_relative_error_std"].values()) < 1e-9
    plain = LaunchCostModel(grid, 2, model.forward, replace(model.backward, short_step=0.0))
    from hf_longctx.kernels.launch import backward_short_steps

    short = backward_short_steps(20, 600, grid.backward_tile, 6)
    assert short > 0
    assert model.cost(20, 600) - plain.cost(20, 600) == pytest.approx(3e-3 * short)
    assert model.cost_array(np.array([20]), np.array([600]))[0] == pytest.approx(model.cost(20, 600))


def test_the_profiler_prices_backward_keys_past_the_kernels_limit(monkeypatch):
    """Where the kernel slows down past a keys limit, the profile also times single segments on both sides of it,
    and the fit recovers what every key of a backward call past the limit costs on top."""
    grid = LaunchGrid(forward_tile=(16, 8), backward_tile=(8, 16), slots=6, backward_keys_limit=300)
    assert [k for (call,) in call_profile.keys_limit_calls(grid, 1 / 256) for _, k in [call]] == [225, 375, 525] * 2
    assert call_profile.keys_limit_calls(GRID) == []
    truth = {"forward": PhaseTerms(2e-3, 1e-4, 2e-4, 1e-3, 0.0, 0.05),
             "backward": PhaseTerms(5e-3, 3e-4, 2e-4, 2e-3, 1e-2, 0.08, 4e-4)}
    monkeypatch.setattr(call_profile, "_run_ms", _fake_call_clock(truth, grid, heads=2))
    model, meta = profile_launch_cost("reference", torch.device("cpu"), grid, heads=2, kv_heads=1, head_dim=8,
                                      dtype=torch.float32, count=32, warmup=0, reps=1, scale=1 / 256,
                                      server_calls=0, step_seeds=())
    np.testing.assert_allclose(model.backward.as_vector(), truth["backward"].as_vector(), rtol=1e-6, atol=1e-12)
    assert model.forward.k_spill == 0.0 and meta["calls"] == 32 + 6 + len(short_document_calls())


def test_a_backward_past_the_keys_limit_pays_the_spill_on_every_key():
    """A call over the limit pays ``k_spill`` on all its keys, in its backward only; a segment over it alone pays it
    in the scheduler's price too; the runtime cuts calls under the limit (the call terms carry it)."""
    limit = 262_144
    model = LaunchCostModel(replace(GRID, backward_keys_limit=limit), 32, H200.forward,
                            replace(H200.backward, k_spill=2e-6))
    under, over = ([256], [limit]), ([256], [limit + 8000])
    spill = TERM_NAMES.index("k_spill")
    assert call_features("backward", *under, model.launch, 32)[spill] == 0
    assert call_features("backward", *over, model.launch, 32)[spill] == limit + 8000
    assert call_features("forward", *over, model.launch, 32)[spill] == 0
    extra = model.phase_cost("backward", *over) - H200.phase_cost("backward", *over)
    assert extra == pytest.approx(2e-6 * (limit + 8000), rel=1e-12)
    assert model.phase_cost("forward", *over) == H200.phase_cost("forward", *over)
    assert model.cost(256, limit + 8000) - H200.cost(256, limit + 8000) == pytest.approx(extra, rel=1e-12)
    assert model.cost(256, limit) == H200.cost(256, limit)
    np.testing.assert_allclose(model.cost_array(np.array([256, 256]), np.array([limit, limit + 8000])),
                               [model.cost(256, limit), model.cost(256, limit + 8000)], rtol=1e-12)
    assert model.call_terms.max_keys == limit and H200.call_terms.max_keys is None
    # a model saved without the limit, the spill or the merge (before they existed) loads with none of them
    old = H200.to_dict()
    del old["backward"]["k_spill"], old["launch"]["backward_keys_limit"], old["forward"]["merge_row"]
    assert LaunchCostModel.from_dict(old) == H200
    assert LaunchCostModel.from_dict(model.to_dict()) == model


def test_the_keys_limit_check_times_both_sides_of_the_limit_and_a_batch_cut_under_it():
    """``profile_cad.py --keys-limit``'s measurements (here on the CPU's reference kernel, tiny): segments straddle
    the limit, only those past it are priced with the spill, and the batch over it is timed as one call and as
    the calls a server would cut it into, every one under the limit."""
    from hf_longctx.lab.cad.call_profile import KEYS_LIMIT_SWEEP, check_keys_limit

    limit = 60
    model = LaunchCostModel(replace(GRID, backward_keys_limit=limit), 2, H200.forward,
                            replace(H200.backward, k_spill=1e-3))
    out = check_keys_limit(model, "reference", 1, 8, torch.float64, torch.device("cpu"), warmup=0, reps=1, rows=4)
    assert [row["keys"] for row in out["sweep"]] == [int(limit * f) for f in KEYS_LIMIT_SWEEP]
    for row in out["sweep"]:
        assert row["measured"] > 0
        spill = row["priced"] - row["priced_without_spill"]
        assert spill == (pytest.approx(1e-3 * row["keys"]) if row["keys"] > limit else 0.0)
    batch = out["batch"]
    assert sum(k for _, k in batch["segments"]) > limit and len(batch["runs"]) == 2
    assert all(sum(k for _, k in batch["segments"][a:b]) <= limit for a, b in batch["runs"])
    assert batch["one_call"] > 0 and batch["cut_calls"] > 0
    with pytest.raises(ValueError, match="keys limit"):
        check_keys_limit(H200, "reference", 1, 8, torch.float64, torch.device("cpu"))


def test_sweep_lines_hold_one_thing_fixed_and_grow_the_other():
    """``prefix``: the same query rows over longer prefixes; ``waves``: one forward query tile (one block per head)
    more each call over a fixed prefix; ``square``: whole documents."""
    prefix, waves, square = (sweep_shapes(name, GRID) for name in ("prefix", "waves", "square"))
    assert len({q for q, _ in prefix}) == 1 and [k for _, k in prefix] == sorted({k for _, k in prefix})
    assert [q for q, _ in waves] == [128 * i for i in range(1, len(waves) + 1)]
    assert {k - q for q, k in waves} == {64 * 128}
    assert all(q == k for q, k in square) and len(square) == len(set(square))
    with pytest.raises(ValueError, match="prefix, waves, square"):
        sweep_shapes("diagonal", GRID)


def test_the_sweep_check_prices_each_timed_phase_with_the_model(monkeypatch):
    """Each single-segment call is timed per phase and priced by the model; on a clock that runs exactly as the
    model prices, the two agree call by call (so a gap on the device is the kernel's, not the check's)."""
    grid = LaunchGrid(forward_tile=(16, 8), backward_tile=(8, 16), slots=6)
    model = LaunchCostModel(grid, 2, PhaseTerms(2e-3, 1e-4, 2e-4, 1e-3, 0.0, 0.05),
                            PhaseTerms(5e-3, 3e-4, 2e-4, 2e-3, 1e-2, 0.08))
    monkeypatch.setattr(call_profile, "_run_ms", _fake_call_clock({p: model.terms(p) for p in PHASES}, grid, 2))
    shapes = sweep_shapes("waves", grid, scale=1 / 4)
    rows = check_launch_cost(model, shapes, "reference", 1, 8, torch.float32, torch.device("cpu"), warmup=0, reps=1)
    assert [(r["q_len"], r["kv_len"]) for r in rows] == shapes
    for row in rows:
        for phase in PHASES:
            assert row[phase]["measured"] == pytest.approx(row[phase]["predicted"], rel=1e-9)
            assert row[phase]["predicted"] > 0


def test_short_document_calls_are_server_batches_of_short_documents_in_launch_order():
    calls = short_document_calls()
    assert calls == short_document_calls() and calls != short_document_calls(seed=1)  # seeded
    assert len(calls) == 32 and all(2 <= len(c) <= 16 for c in calls)
    segments = [s for c in calls for s in c]
    assert all(1 <= q <= k <= 4096 for q, k in segments)
    shards = sum(q < k for q, k in segments)
    assert 0.1 < shards / len(segments) < 0.3  # some are a document's last rows over its prefix
    assert 300 < sorted(k for _, k in segments)[len(segments) // 2] < 600  # SFT-like: a few hundred rows
    for c in calls:
        assert [c[i] for i in call_order([q for q, _ in c], [k for _, k in c])] == c
    assert max(k for c in short_document_calls(scale=1 / 64) for _, k in c) <= 64


def test_mix_pairs_put_a_long_prefix_beside_sets_of_short_documents():
    pairs = mix_pairs(GRID)
    assert len(pairs) == 3 * 4 * len(MIX_SHORTS)
    assert {long for long, _ in pairs} == {(q, k) for q in (128, 256, 512) for k in (2048, 4096, 8192, 16384)}
    for long, shorts in pairs:
        assert all(q == k and k < long[1] for q, k in shorts)  # whole short documents, fewer keys than the prefix
        segments = [long, *shorts]
        assert [segments[i] for i in call_order([q for q, _ in segments], [k for _, k in segments])] == segments


def test_the_mix_check_times_one_call_and_its_two_parts_and_prices_each(monkeypatch):
    """On a clock that runs as the model prices, every way agrees with its price, and one call costs more than its
    two parts by exactly what the model says (one call's constant less, the tail and surplus blocks more)."""
    grid = LaunchGrid(forward_tile=(16, 8), backward_tile=(8, 16), slots=6)
    model = LaunchCostModel(grid, 2, PhaseTerms(2e-3, 1e-4, 2e-4, 1e-3, 0.0, 0.05),
                            PhaseTerms(5e-3, 3e-4, 2e-4, 2e-3, 1e-2, 0.08))
    monkeypatch.setattr(call_profile, "_run_ms", _fake_call_clock({p: model.terms(p) for p in PHASES}, grid, 2))
    pairs = mix_pairs(grid, scale=1 / 16)[:3]
    rows = check_call_mix(model, pairs, "reference", 1, 8, torch.float32, torch.device("cpu"), warmup=0, reps=1)
    assert [(r["prefix"], r["beside"]) for r in rows] == [(tuple(a), [tuple(s) for s in b]) for a, b in pairs]
    for row, (long, shorts) in zip(rows, pairs):
        for way, segments in (("long", [long]), ("shorts", shorts), ("one call", [long, *shorts])):
            for phase in PHASES:
                priced = model.phase_cost(phase, [q for q, _ in segments], [k for _, k in segments])
                assert row[way][phase]["predicted"] == pytest.approx(priced)
                assert row[way][phase]["measured"] == pytest.approx(priced, rel=1e-9)


def _dump_with_errors(model: LaunchCostModel, errors: dict[tuple[int, str], float], reps: int = 3) -> dict:
    """A dumped emulated step whose calls took ``model``'s price times (1 + error) of their rank and phase, the
    calls in a different order in every repetition (ranks run in threads)."""
    calls = [(rank, phase, segments) for rank in (0, 1) for phase in PHASES
             for segments in ([(64, 64), (32, 256)], [(16, 16)])]
    out = []
    for rep in range(reps):
        rows = [{"rank": rank, "phase": phase, "q_lens": [q for q, _ in seg], "k_lens": [k for _, k in seg],
                 "seconds": model.phase_cost(phase, [q for q, _ in seg], [k for _, k in seg]) / 1e3
                 * (1 + errors[rank, phase]) * (1 + 0.01 * (rep - 1))} for rank, phase, seg in calls]
        random.Random(rep).shuffle(rows)
        out.append(rows)
    return {"world": 2, "reps": out}


def test_dumped_calls_are_priced_per_server_and_phase():
    """Each server's forward and backward: the calls' medians over repetitions against the model's price."""
    errors = {(0, "forward"): 0.10, (0, "backward"): 0.0, (1, "forward"): -0.05, (1, "backward"): 0.02}
    rows = server_phase_errors(H200, _dump_with_errors(H200, errors))
    assert [r["rank"] for r in rows] == [0, 1]
    for row in rows:
        for phase in PHASES:
            assert row[phase]["measured"] / row[phase]["predicted"] - 1 == pytest.approx(errors[row["rank"], phase])
    uneven = _dump_with_errors(H200, errors)
    uneven["reps"][1] = uneven["reps"][1][1:]
    with pytest.raises(ValueError, match="same kernel calls"):
        server_phase_errors(H200, uneven)


def test_dumped_calls_errors_are_told_by_call_size_and_by_phase():
    """Where a model goes wrong: the calls' error grouped by their size in waves of blocks, and which phase makes
    the servers' spread. Here every backward call of under one wave took 10% over its price and everything else
    its price: that group alone shows it, and only the backward spreads the servers (a uniform error would not)."""
    grid = LaunchGrid(forward_tile=(16, 8), backward_tile=(8, 16), slots=4)
    model = LaunchCostModel(grid, 2, PhaseTerms(2e-3, 1e-4, 2e-4, 1e-3, 0.0, 0.05),
                            PhaseTerms(5e-3, 3e-4, 2e-4, 2e-3, 1e-2, 0.08))
    small, large = [(16, 16)], [(64, 512)]  # backward: 1 key block x 2 heads on 4 slots; 32 x 2: 16 waves
    assert call_waves("backward", [16], [16], grid, 2) == 0.5
    assert call_waves("backward", [64], [512], grid, 2) == 16
    assert call_waves("forward", [64], [512], grid, 2) == 2  # the forward launches a block per 16 query rows
    # a forward that packs a KV head's two query heads into one tile launches half as many blocks
    assert call_waves("forward", [64], [512], replace(grid, launch_order="segment", forward_head_pack=2), 2) == 1
    calls = [(0, small), (0, large), (1, large), (1, large)]  # server 0 runs the small call, server 1 does not

    def seconds(phase, segments):
        price = model.phase_cost(phase, [q for q, _ in segments], [k for _, k in segments]) / 1e3
        slow = phase == "backward" and call_waves(phase, [q for q, _ in segments], [k for _, k in segments], grid,
                                                  2) < 1
        return price * (1.10 if slow else 1.0)

    dump = {"world": 2, "reps": [[{"rank": rank, "phase": phase, "q_lens": [q for q, _ in seg],
                                   "k_lens": [k for _, k in seg], "seconds": seconds(phase, seg)}
                                  for rank, seg in calls for phase in PHASES]]}
    groups = {(g["phase"], g["waves"]): g for g in errors_by_waves(model, [dump])}
    assert set(groups) == {("backward", (0.0, 1.0)), ("backward", (16.0, 64.0)), ("forward", (0.0, 1.0)),
                           ("forward", (2.0, 4.0))}
    assert groups["backward", (0.0, 1.0)]["mean"] == pytest.approx(0.10)
    assert groups["backward", (0.0, 1.0)]["calls"] == 1
    for key in (("backward", (16.0, 64.0)), ("forward", (0.0, 1.0)), ("forward", (2.0, 4.0))):
        assert groups[key]["mean"] == pytest.approx(0.0, abs=1e-12) and groups[key]["std"] == pytest.approx(0.0)
    spreads = phase_spreads(server_phase_errors(model, dump))
    assert spreads["forward"] == pytest.approx(0.0, abs=1e-12)
    assert spreads["backward"] > 1e-4
    # the same 10% on every backward call spreads nothing: a schedule balanced on the price stays balanced
    uniform = {"world": 2, "reps": [[{**c, "seconds": c["seconds"] * (1.10 if c["phase"] == "backward" and
                                                                     c["q_lens"] != [16] else 1.0)}
                                     for c in dump["reps"][0]]]}
    assert phase_spreads(server_phase_errors(model, uniform))["backward"] == pytest.approx(0.0, abs=1e-12)


def test_a_replayed_dump_times_each_distinct_call_once_alone(monkeypatch):
    """``--replay``: every dumped call comes back once with its median time in the step and its time alone; a call
    of the same segments on several servers (or phases) is timed once, rectangles as rectangles."""
    from hf_longctx.lab.cad.call_profile import dumped_calls, replay_dumped_calls

    dump = _dump_with_errors(H200, dict.fromkeys([(r, p) for r in (0, 1) for p in PHASES], 0.0))
    for rep in dump["reps"]:
        rep.append({"rank": 1, "phase": "backward", "q_lens": [16], "k_lens": [64], "causal": False,
                    "seconds": 1e-4})
    timed = []

    def fake_time(shapes, kernel, heads, kv_heads, head_dim, dtype, device, warmup, reps, seed=0, causal=True,
                  key_split=None, cold=False):
        timed.append((tuple(shapes), causal, cold))
        return 1.0 + len(shapes) + (not causal), 10.0 + len(shapes) + (not causal)

    monkeypatch.setattr(call_profile, "time_call_phases", fake_time)
    for cold in (False, True):
        timed.clear()
        rows = replay_dumped_calls(dump, "reference", 32, 8, 128, torch.float32, torch.device("cpu"), cold=cold)
        assert [(c, ms) for c, ms, _ in rows] == dumped_calls(dump)
        for call, _, alone in rows:
            causal = call.get("causal", True)
            assert alone == (1.0 if call["phase"] == "forward" else 10.0) + len(call["q_lens"]) + (not causal)
        assert sorted(timed) == sorted([(((64, 64), (32, 256)), True, cold), (((16, 16),), True, cold),
                                        (((16, 64),), False, cold)])


def test_random_calls_cover_every_kind_in_launch_order():
    calls = random_calls(60, seed=2)
    kinds = len(call_profile.CALL_KINDS)
    assert {len(c) for c in calls[0::kinds]} != {1} and all(len(c) == 1 for c in calls[3::kinds])
    for c in calls:
        assert [c[i] for i in call_order([q for q, _ in c], [k for _, k in c])] == c
        assert all(0 < q <= k for q, k in c)


def test_a_launch_model_saves_and_loads_and_refuses_a_grid_file(tmp_path):
    H200.save(tmp_path / "m.json", device="test")
    assert LaunchCostModel.load(tmp_path / "m.json") == H200
    (tmp_path / "grid.json").write_text(json.dumps({"q_lens": [16], "kv_lens": [16], "cost": [[1.0]]}))
    with pytest.raises(ValueError, match="not a launch cost model"):
        LaunchCostModel.load(tmp_path / "grid.json")


def test_profiled_picks_the_launch_model_where_the_kernel_declares_a_grid(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_LONGCTX_CACHE", str(tmp_path))
    grid = LaunchGrid(forward_tile=(16, 8), backward_tile=(8, 16), slots=6)
    truth = {p: PhaseTerms(1e-3, 1e-4, 1e-4, 1e-3, 1e-3, 0.05) for p in PHASES}
    evicted = []
    monkeypatch.setattr(call_profile, "_run_ms", _fake_call_clock(truth, grid, heads=2, l2=evicted))
    monkeypatch.delenv("HF_LONGCTX_PROFILE_L2", raising=False)
    monkeypatch.setattr(profiled, "launch_grid", lambda kernel, device, head_dim, mode="fwd+bwd", shape=None: grid)
    fits = small_profiles(monkeypatch, server_calls=8)
    shape = SegmentShape(2, 1, 8, torch.float32)
    model, source = measured_cost_model("reference", "cpu", shape)
    assert isinstance(model, LaunchCostModel) and source.startswith("launch-fitted") and "now" in source
    again, source = measured_cost_model("reference", "cpu", shape)
    assert again == model and "now" not in source and len(fits) == 1  # read from the cache
    cached = profiled.launch_cache_path(torch.device("cpu"), "reference", shape)
    older = json.loads(cached.read_text())
    del older["forward"]["merge_row"], older["backward"]["merge_row"]  # saved before the term existed: fitted again
    cached.write_text(json.dumps(older))
    _, source = measured_cost_model("reference", "cpu", shape)
    assert "now" in source and len(fits) == 2
    fitted = json.loads(cached.read_text())
    assert fitted["meta"]["merge"] == "torch"  # the CPU merges cut forwards with torch's index ops
    fitted["meta"]["merge"] = "triton"  # fitted where one Triton kernel merged them: priced for another merge
    cached.write_text(json.dumps(fitted))
    _, source = measured_cost_model("reference", "cpu", shape)
    assert "now" in source and len(fits) == 3
    # the L2 state the profile times calls in: a model timed warm is fitted again where calls are to be timed cold
    assert json.loads(cached.read_text())["meta"]["l2"] == "warm" and not any(evicted)
    monkeypatch.setenv("HF_LONGCTX_PROFILE_L2", "evicted")
    _, source = measured_cost_model("reference", "cpu", shape)
    assert "now" in source and len(fits) == 4 and json.loads(cached.read_text())["meta"]["l2"] == "evicted"
    assert evicted and all(evicted[-10:])
    _, source = measured_cost_model("reference", "cpu", shape)
    assert "now" not in source and len(fits) == 4
    monkeypatch.setenv("HF_LONGCTX_PROFILE_L2", "cold")
    with pytest.raises(ValueError, match="HF_LONGCTX_PROFILE_L2='cold': choose one of evicted, warm"):
        measured_cost_model("reference", "cpu", shape)
    monkeypatch.delenv("HF_LONGCTX_PROFILE_L2")
    _, source = measured_cost_model("reference", "cpu", shape)  # back to warm: fitted again, then read
    assert "now" in source and len(fits) == 5
    _, source = measured_cost_model("reference", "cpu", shape)
    assert "now" not in source and len(fits) == 5
    earlier = json.loads(cached.read_text())
    earlier["meta"]["call_set"] = call_profile.CALL_SET - 1  # fitted on another set of calls: fitted again
    cached.write_text(json.dumps(earlier))
    _, source = measured_cost_model("reference", "cpu", shape)
    assert "now" in source and len(fits) == 6
    # a term the grid never measures (short backward blocks, where it declares no minimum) may be missing
    unmeasured = json.loads(cached.read_text())
    del unmeasured["forward"]["short_step"], unmeasured["backward"]["short_step"]
    cached.write_text(json.dumps(unmeasured))
    _, source = measured_cost_model("reference", "cpu", shape)
    assert "now" not in source and len(fits) == 6
    monkeypatch.setattr(profiled, "launch_grid", lambda kernel, device, head_dim, mode="fwd+bwd", shape=None:
                        replace(grid, backward_min_steps=4))
    _, source = measured_cost_model("reference", "cpu", shape)  # now the grid measures it: fitted again
    assert "now" in source and len(fits) == 7
    monkeypatch.setattr(profiled, "launch_grid", lambda kernel, device, head_dim, mode="fwd+bwd", shape=None: grid)
    grid_model, _ = measured_cost_model("reference", "cpu", shape, model="grid", q_lens=(16, 64),
                                        kv_lens=(16, 64, 256), budget=profiled.ProfileBudget(
                                            min_tokens=64, max_kv_tokens=1024, max_pairs=4096, warmup=0, reps=1))
    assert isinstance(grid_model, ProfiledCostModel)
    monkeypatch.setattr(profiled, "launch_grid", lambda kernel, device, head_dim, mode="fwd+bwd", shape=None: None)
    flops, source = measured_cost_model("reference", "cpu", shape, model="launch")
    assert "declares no launch grid" in source  # asked for, impossible: said why, FLOPs stand in
    with pytest.raises(ValueError, match="model must be one of"):
        measured_cost_model("reference", "cpu", shape, model="lanch")


@pytest.mark.parametrize("world", [2, 3])
def test_cad_scheduled_on_a_launch_model_stays_exact(world):
    small = LaunchCostModel(LaunchGrid(forward_tile=(16, 8), backward_tile=(8, 16), slots=4), 4,
                            PhaseTerms(1e-3, 1e-4, 2e-4, 1e-3, 0.0, 0.05),
                            PhaseTerms(3e-3, 3e-4, 2e-4, 2e-3, 1e-2, 0.08))
    batch, q, k, v, dout = make_problem(21 + world, world, torch.float64)
    want = reference(batch, q, k, v, dout)
    options = {"cost_model": small, "eps": 0.01}
    step = emulate_step(batch, world, (q, k, v, dout), "cad", options=options, kernel="reference",
                        keep_results=True)
    plan = shard_plan(batch, world, "cad")
    for r in step.ranks:
        idx = plan.local_indices(r.rank)
        for got, ref in zip(r.results, want):
            torch.testing.assert_close(got, ref[idx], rtol=1e-9, atol=1e-9)


def test_the_runtime_prices_a_server_as_the_sum_of_its_calls():
    """A server's predicted time under the launch model is the model's call cost of every call the runtime plans
    for it (segments in launch order, cut by the call terms)."""
    from hf_longctx.backends.cad.tasks import segment_shape
    from hf_longctx.layout import PackedBatch

    batch = PackedBatch.from_doc_lens([9000, 300, 2500, 700, 128, 4100, 1500, 64, 3000])
    plan = shard_plan(batch, 3, "cad")
    options = {"cost_model": H200, "eps": 0.01, "pingpong": False}
    tasks = prepare(plan, options).tasks
    predicted = server_costs(plan, options)
    for s in range(3):
        seg = [segment_shape(plan, t) for t in tasks if t.server == s and t.q_end > t.q_start]
        seg = [seg[i] for i in call_order([q for q, _ in seg], [k for _, k in seg])]
        q, k = [a for a, _ in seg], [b for _, b in seg]
        calls = cut_into_calls(q, k, H200.call_terms)
        assert predicted[s] == pytest.approx(sum(H200.call_cost(q[a:b], k[a:b]) for a, b in calls), rel=1e-9)


def test_ranks_agree_on_one_launch_model():
    """A launch model file whose copies differ between ranks (other terms, more SMs): every rank schedules on the
    largest of each."""
    import hf_longctx.backends.cad.runtime as runtime
    from hf_longctx.lab.emulation.group import EmulationHub

    slower = LaunchCostModel(LaunchGrid(slots=114), 32, PhaseTerms(4e-4, 4.2e-6, 7.3e-6, 0.0, 0.0, 0.0195),
                             PhaseTerms(1.0e-3, 1.9e-5, 1.55e-5, 1.49e-4, 1.5e-3, 0.0292))

    def per_rank(group):
        return runtime.agreed_cost_model(slower if group.rank == 2 else H200, group)

    models = EmulationHub(3).run(per_rank)
    want_forward = PhaseTerms(4e-4, 4.2e-6, 7.3e-6, 0.0, 0.0, 0.0195)
    want_backward = PhaseTerms(1.02e-3, 1.9e-5, 1.55e-5, 1.49e-4, 1.5e-3, 0.0292)
    for m in models:
        assert isinstance(m, LaunchCostModel) and m.launch.slots == 132
        np.testing.assert_allclose(m.forward.as_vector(), want_forward.as_vector(), rtol=1e-12)
        np.testing.assert_allclose(m.backward.as_vector(), want_backward.as_vector(), rtol=1e-12)


def test_forward_blocks_past_one_per_sm_are_priced_two_to_an_sm():
    """With ``forward_pairing`` the forward's launch simulation puts blocks two to an SM past one per SM, each
    1.6x slower (measured on an H200 and an H100: 160-256 long blocks take 1.61-1.65x what 128 take; one long
    block per head among one-tile documents 1.58-1.60x at most spacings). One slot per SM prices the first 2.0x
    and the second 1.0x."""
    terms = PhaseTerms(1e-3, 0.0, 0.0, 0.0, 0.0, 0.0)
    paired = LaunchCostModel(LaunchGrid(slots=132, forward_pairing=1.6, empty_hold=0.3), 32, terms, terms)
    one_slot = LaunchCostModel(LaunchGrid(slots=132), 32, terms, terms)
    keys = 512 * 64
    for model, full, spaced in ((paired, 1.6, 1.6), (one_slot, 2.0, 1.0)):
        lone = model.phase_cost("forward", [128], [keys])  # 32 long blocks
        tiles = model.phase_cost("forward", [640], [keys + 512]) / model.phase_cost("forward", [512], [keys + 384])
        among = model.phase_cost("forward", [128] * 5, [keys] + [128] * 4) / lone  # 160 blocks, long ones 5 apart
        assert tiles == pytest.approx(full, rel=0.02) and among == pytest.approx(spaced, rel=0.02)
    assert LaunchGrid.from_dict(paired.launch.to_dict()) == paired.launch
    old = {k: v for k, v in one_slot.launch.to_dict().items() if k not in ("forward_pairing", "empty_hold")}
    assert LaunchGrid.from_dict(old) == one_slot.launch  # a model saved before pairing reads as one slot per SM
