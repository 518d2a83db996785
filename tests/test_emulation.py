"""W ranks emulated on one device: the same backend code, so outputs and gradients equal one device.

Every backend the emulation measures runs on an in-process group of W = 2, 3, 4 ranks (random packed
documents, GQA, float64 and float32) and each rank's output and q/k/v gradient rows are checked
against the fp64 reference kernel on the whole sequence. The transport itself is checked on its own:
matching, byte counts, a failing rank and a transfer nobody answers.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_backends import make_problem, reference

from hf_longctx.backends import default_strategy, sequence_parallel_attention
from hf_longctx.comm.links import LINKS, MB, ONE_NODE
from hf_longctx.lab.emulation import EmulatedStep, RankStep, emulate_step, noise_only_imbalance, real_rank_kernel_times
from hf_longctx.lab.emulation.group import EmulationError, EmulationHub
from hf_longctx.lab.emulation.timing import KernelTimer
from hf_longctx.layout import shard_plan

from distributed import run_distributed

BACKENDS = ("ring", "zigzag", "distfa", "tasp", "cad", "ulysses")


def _tolerance(dtype):
    return dict(rtol=1e-9, atol=1e-9) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_emulated_backends_match_single_device(world, dtype):
    for seed in range(2):
        batch, q, k, v, dout = make_problem(seed * 13 + world, world, dtype)
        want = reference(batch, q, k, v, dout)
        for backend in BACKENDS:
            step = emulate_step(batch, world, (q, k, v, dout), backend, kernel="reference", keep_results=True)
            plan = shard_plan(batch, world, step.strategy)
            assert len(step.ranks) == world
            for r in step.ranks:
                idx = plan.local_indices(r.rank)
                for name, got, ref in zip(("out", "dq", "dk", "dv"), r.results, want):
                    torch.testing.assert_close(got, ref[idx], **_tolerance(dtype),
                                               msg=lambda m, w=f"{backend} W={world} rank {r.rank} {name}": f"{w}: {m}")
            assert sum(r.kernel_calls for r in step.ranks) > 0
            assert step.timed_calls == sum(r.kernel_calls for r in step.ranks)  # one timed repetition
            assert step.host_overruns == 0  # the CPU runs each call before the host goes on: nothing to outrun
            assert all(t >= 0 for t in step.kernel_s) and step.imbalance >= 1.0
            assert step.predicted_step_s >= step.predicted_overlapped_s > 0


def test_autograd_path_through_the_op_on_an_emulated_group():
    """``sequence_parallel_attention`` + ``backward`` (the op, autograd) on emulated ranks (CPU autograd runs
    in the calling thread)."""
    world = 3
    batch, q, k, v, dout = make_problem(5, world, torch.float64)
    want = reference(batch, q, k, v, dout)
    for backend in BACKENDS:
        plan = shard_plan(batch, world, "cad" if backend == "cad" else
                          "zigzag" if backend == "zigzag" else "contiguous")

        def rank_fn(group, plan=plan, backend=backend):
            idx = plan.local_indices(group.rank)
            ql, kl, vl = (t[idx].clone().requires_grad_() for t in (q, k, v))
            out = sequence_parallel_attention(ql, kl, vl, plan=plan, backend=backend, group=group,
                                              kernel="reference")
            out.backward(dout[idx])
            return idx, out.detach(), ql.grad, kl.grad, vl.grad

        for idx, *got in EmulationHub(world).run(rank_fn):
            for g, ref in zip(got, want):
                torch.testing.assert_close(g, ref[idx], **_tolerance(torch.float64))


def test_point_to_point_matches_by_tag_and_counts_bytes():
    hub = EmulationHub(2)

    def rank_fn(group):
        me, other = group.rank, 1 - group.rank
        sends = [(other, torch.full((3,), float(me)), 7), (other, torch.full((2,), 10.0 + me), 8)]
        bufs = [torch.empty(2), torch.empty(3)]
        works = group.post(sends, [(other, bufs[0], 8), (other, bufs[1], 7)], "test")
        for w in works:
            w.wait()
        return [b.tolist() for b in bufs]

    got = hub.run(rank_fn)
    assert got[0] == [[11.0, 11.0], [1.0, 1.0, 1.0]]
    assert got[1] == [[10.0, 10.0], [0.0, 0.0, 0.0]]
    assert hub.traffic[0].calls == [("p2p", {1: 20})]  # 12 + 8 bytes, both to rank 1
    assert hub.traffic[0].sent_bytes == 20


def test_all_to_all_moves_rows_and_counts_only_remote_bytes():
    hub = EmulationHub(3)

    def rank_fn(group):
        r = group.rank
        send = torch.arange(7, dtype=torch.float32).view(7, 1) + 100 * r  # in order: splits[d] rows to rank d
        splits = [2, 2, 3] if r < 2 else [3, 3, 1]  # rank 2 sends 3 rows to ranks 0 and 1, one to itself
        recv = torch.empty(7, 1)
        group.all_to_all_single(recv, send, splits, splits)  # what each rank receives mirrors what it sends
        return recv.view(-1).tolist()

    got = hub.run(rank_fn)
    assert got[1] == [2.0, 3.0, 102.0, 103.0, 203.0, 204.0, 205.0]
    assert got[2] == [4.0, 5.0, 6.0, 104.0, 105.0, 106.0, 206.0]
    assert [t.calls for t in hub.traffic] == [[("a2a", {1: 8, 2: 12})], [("a2a", {0: 8, 2: 12})],
                                              [("a2a", {0: 12, 1: 12})]]  # per destination, none to itself
    assert hub.largest_all_to_all == 64  # what staging holds on the host at once: every sender's remote rows
    assert hub.largest_all_to_all_on_device == 0  # on the CPU nothing is on a device


def test_a_failing_rank_stops_its_peers_and_an_unanswered_receive_times_out():
    def fails(group):
        if group.rank == 0:
            raise ValueError("rank 0 broke")
        group.barrier()

    with pytest.raises(ValueError, match="rank 0 broke"):
        EmulationHub(2).run(fails)

    def waits(group):
        for w in group.post([], [(1 - group.rank, torch.empty(1), 0)], "lonely receive"):
            w.wait()

    with pytest.raises(EmulationError, match="lonely receive"):
        EmulationHub(2, timeout_s=0.5).run(waits)


def test_link_model_uses_the_measured_figures_and_interpolates_between_them():
    assert LINKS["p2p"].at(64 * MB) == pytest.approx(114e9)
    assert LINKS["a2a"].at(256 * MB) == pytest.approx(148e9)
    assert LINKS["p2p"].at(1 * MB) == pytest.approx(71e9)  # held at the smallest measured size
    assert 71e9 < LINKS["p2p"].at(32 * MB) < 114e9
    calls = [("p2p", {1: 64 * MB}), ("a2a", {1: 8 * MB, 2: 8 * MB})]  # a call's message: its bytes to every peer
    assert ONE_NODE.seconds(0, calls) == pytest.approx(64 * MB / 114e9 + 16 * MB / 87e9)


def test_auto_decides_from_emulated_steps_and_says_why():
    """On one device, auto's choice for W ranks: the product's prices and shortlist, the shortlist emulated; the
    choice becomes the verdict a real group's first call takes without timing anything."""
    from hf_longctx.backends.auto import AutoOptions, auto_decisions, reset_auto_decisions
    from hf_longctx.backends.prediction import fixed_rates
    from hf_longctx.lab.emulation.choose import decide_auto

    world = 3
    batch, q, k, v, dout = make_problem(9, world, torch.float64)
    reset_auto_decisions()
    try:
        choice = decide_auto(batch, world, (q, k, v, dout), kernel="reference", rates=fixed_rates(1.0),
                             options=AutoOptions(shortlist=100.0), q_local=q[:1], k_local=k[:1])
        timed = {c.backend for c in choice.timed}
        assert choice.backend in timed and {c.strategy for c in choice.timed} == {choice.placement}
        assert timed == {c.backend for c in choice.predictions if c.strategy == choice.placement}
        assert "placement priced best" in choice.reason and " ms" in choice.reason
        (row,) = auto_decisions()
        assert row["backend"] == choice.backend and row["reason"].startswith("emulated on one device")
        assert set(row["seconds"]) == {c.label for c in choice.timed}
    finally:
        reset_auto_decisions()


# ---------------------------------------------------------------- repetitions


def test_median_rep_is_the_lower_median_of_the_totals():
    from hf_longctx.lab.emulation import median_rep

    assert median_rep([(1.0, 2.0)]) == (1.0, 2.0)
    assert median_rep([(5.0, 5.0), (1.0, 2.0)]) == (1.0, 2.0)  # of two, the smaller: one outlier dropped
    assert median_rep([(9.0, 9.0), (1.0, 1.0), (2.0, 1.0)]) == (2.0, 1.0)
    # forward and backward of one repetition (not the medians of each, 0.5 and 0.5)
    assert median_rep([(0.5, 0.5), (0.1, 2.0), (0.9, 0.2)]) == (0.9, 0.2)
    assert median_rep([]) == (0.0, 0.0)


def test_each_rank_reports_the_median_of_its_timed_repetitions():
    """A timer that reports scripted seconds per step: warm-up steps are dropped, each rank gets the lower median of
    the timed ones, and a first-call outlier does not reach the result."""

    world = 3
    # seconds per step (warm-up first), per rank: (forward, backward)
    script = [[(50.0, 50.0)] * world,  # warm-up: ignored
              [(8.0, 9.0), (1.0, 2.0), (3.0, 3.0)],  # rank 0 has a first-call outlier here
              [(1.0, 1.0), (1.5, 2.0), (3.0, 4.0)],
              [(1.0, 2.0), (1.0, 1.0), (2.0, 3.0)]]
    steps = iter(script)

    class ScriptedTimer(KernelTimer):
        def __init__(self, hub, device):
            super().__init__(hub, device)
            self.values = next(steps)

        def seconds(self):
            out = {}
            for r, (f, b) in enumerate(self.values):
                out[r, "forward"], out[r, "backward"] = f, b
            return out

    batch, q, k, v, dout = make_problem(2, world, torch.float64)
    step = emulate_step(batch, world, (q, k, v, dout), "ring", kernel="reference", warmup=1, reps=3,
                        make_timer=ScriptedTimer)
    assert [(r.forward_s, r.backward_s) for r in step.ranks] == [(1.0, 2.0), (1.0, 2.0), (3.0, 3.0)]
    assert [r.repetitions for r in step.ranks] == [(17.0, 2.0, 3.0), (3.0, 3.5, 2.0), (6.0, 7.0, 5.0)]
    assert next(steps, None) is None
    with pytest.raises(ValueError, match="reps"):
        emulate_step(batch, world, (q, k, v, dout), "ring", kernel="reference", reps=0)


def _step_of(repetitions: list[tuple[float, ...]]) -> EmulatedStep:
    step = EmulatedStep("ring", len(repetitions), "contiguous", 1.0, "cpu")
    step.ranks = [RankStep(r, min(reps), 0.0, 1, [], repetitions=reps) for r, reps in enumerate(repetitions)]
    return step


def test_timing_noise_comes_from_how_each_ranks_repetitions_differ():
    # equal repetitions: no noise, and no floor above 1
    quiet = _step_of([(2.0, 2.0), (3.0, 3.0)])
    assert quiet.timing_noise == 0.0 and quiet.noise_floor == 1.0
    # two repetitions 2% apart on every rank (whatever the rank's work): a difference carries twice the variance,
    # and the median of |N(0, 2 s^2)| is 0.6745 * sqrt(2) * s
    noisy = _step_of([(1.0, 1.02), (5.0, 5.1), (2.04, 2.0)])
    assert noisy.timing_noise == pytest.approx(0.02 / 1.01 / (0.6744897501960817 * 2**0.5))
    # one repetition only: nothing to estimate from
    single = _step_of([(1.0,), (2.0,)])
    assert single.timing_noise is None and single.noise_floor is None


def test_one_far_out_repetition_does_not_make_the_timing_noise():
    """A rank's time is the lower median of its repetitions, which one repetition far out does not move; the noise
    is read the same way. Normal noise of 0.5% on 64 ranks of four repetitions reads about 0.5%, and still does
    with one repetition of one rank 30% slow, where the root mean square of the differences would read over three
    times as much."""
    g = torch.Generator().manual_seed(0)
    reps = (1.0 + 0.005 * torch.randn(64, 4, generator=g, dtype=torch.float64)).tolist()
    steady = _step_of([tuple(r) for r in reps])
    assert steady.timing_noise == pytest.approx(0.005, rel=0.2)
    reps[7][0] *= 1.3
    spiked = _step_of([tuple(r) for r in reps])
    assert spiked.timing_noise == pytest.approx(steady.timing_noise, rel=0.1)
    diffs = [(a - b) / (sum(r) / 4) for r in reps for i, a in enumerate(r) for b in r[i + 1:]]
    assert (sum(d * d for d in diffs) / len(diffs) / 2) ** 0.5 > 3 * steady.timing_noise  # the mean square's reading
    assert spiked.imbalance == pytest.approx(steady.imbalance, abs=0.003)  # lower medians: the spike left out


def test_noise_alone_lifts_max_over_mean_with_more_ranks_and_less_with_more_repetitions():
    assert noise_only_imbalance(0.0, 64, 3) == 1.0
    assert noise_only_imbalance(0.01, 1, 1) == 1.0
    # the expected maximum of 64 standard normals is about 2.41
    assert noise_only_imbalance(0.01, 64, 1) == pytest.approx(1 + 0.0241, abs=0.001)
    assert noise_only_imbalance(0.01, 8, 1) < noise_only_imbalance(0.01, 64, 1)
    # the median of three repetitions is steadier than one
    assert noise_only_imbalance(0.01, 64, 3) < noise_only_imbalance(0.01, 64, 1) - 0.005
    assert noise_only_imbalance(0.01, 64, 3) == noise_only_imbalance(0.01, 64, 3)  # fixed seed
    with pytest.raises(ValueError, match="noise"):
        noise_only_imbalance(-0.1, 4, 2)


# ---------------------------------------------------------------- nothing kept across configurations


@pytest.fixture
def no_gc():
    """Freed means freed by reference counting: the collector does not run during the test."""
    import gc

    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_emulated_step_frees_its_plan_and_caches_when_it_returns(backend, no_gc, monkeypatch):
    """The plan of a step holds what its backend cached (schedules, device index tensors): it must go when the
    step does, not at the collector's next full pass (a plan that referred to itself kept every configuration's
    caches of a benchmark alive)."""
    import weakref

    import hf_longctx.lab.emulation.runner as runner

    plans = []
    real = runner.shard_plan

    def spy(*args, **kwargs):
        plan = real(*args, **kwargs)
        plans.append(weakref.ref(plan))
        return plan

    monkeypatch.setattr(runner, "shard_plan", spy)
    world = 3
    batch, q, k, v, dout = make_problem(4, world, torch.float32)
    step = emulate_step(batch, world, (q, k, v, dout), backend, kernel="reference", warmup=1, reps=2,
                        keep_results=True)
    results = [weakref.ref(t) for r in step.ranks for t in r.results]
    assert plans and all(p() is None for p in plans)
    del step
    assert all(t() is None for t in results)


def test_a_failed_run_leaves_nothing_referenced(no_gc):
    """A rank's exception carries its frames (and their tensors) in its traceback: once the caller drops the
    exception, they must be freed without the collector (no cycle through the hub)."""
    import weakref

    refs = []

    def rank_fn(group):
        big = torch.ones(1000)
        refs.append(weakref.ref(big))
        if group.rank == 1:
            raise ValueError("rank 1 broke")
        group.barrier()

    hub = EmulationHub(3)
    with pytest.raises(ValueError, match="rank 1 broke"):
        hub.run(rank_fn)
    assert refs and all(r() is None for r in refs)

    def unanswered(group):  # a send nobody receives stays with the hub until the run ends, not longer
        t = torch.ones(10)
        refs.append(weakref.ref(t))
        if group.rank == 0:
            group.post([(1, t, 5)], [], "never received")

    refs.clear()
    hub = EmulationHub(2)
    hub.run(unanswered)
    assert refs and all(r() is None for r in refs)


def test_ranks_run_on_reused_threads():
    """Rank r of every hub runs on the same thread, so libraries' per-thread state (cuDNN's graph caches) is
    built once per rank, not per step and leaked at every thread's exit."""
    import threading

    from hf_longctx.lab.emulation.group import rank_threads

    def ident(group):
        return threading.get_ident()

    first = EmulationHub(4).run(ident)
    alive = threading.active_count()
    for world in (2, 4, 3, 4):
        got = EmulationHub(world).run(ident)
        assert got == first[:world]
    assert threading.active_count() == alive
    assert [t.ident for t in rank_threads()[:4]] == first

    def nested(group):  # a hub run from inside another gets threads of its own
        return EmulationHub(2).run(ident) if group.rank == 0 else None

    inner = EmulationHub(2).run(nested)[0]
    assert not set(inner) & set(first)


def test_emulated_ranks_pause_after_each_call_and_a_real_runs_rank_does_not():
    """An emulated rank's calls run one after another on one device, which heats up and slows down as a busy
    stretch goes on; each call is followed by a pause as long as itself (see the timing module). A real run's
    ranks run at once: their timer never pauses."""
    from hf_longctx.lab.emulation.timing import EMULATED_PAUSE, ThisProcess

    assert KernelTimer(EmulationHub(1), torch.device("cpu")).pause == EMULATED_PAUSE > 0
    assert KernelTimer(ThisProcess(0), torch.device("cpu")).pause == 0.0
    assert KernelTimer(EmulationHub(1), torch.device("cpu"), pause=0.25).pause == 0.25
    with pytest.raises(ValueError, match="pause >= 0"):
        KernelTimer(EmulationHub(1), torch.device("cpu"), pause=-1.0)


def test_the_pause_after_a_call_counts_only_the_time_the_device_worked():
    """A call whose host dispatch outran the spin ahead of it held the device waiting for the difference (a kernel
    compiling inside the call: seconds); the pause after it covers what the device did, not the wait."""
    from hf_longctx.lab.emulation.timing import pause_seconds

    assert pause_seconds(0.010, host_s=0.001, spun_s=0.002, pause=1.0) == pytest.approx(0.010)
    assert pause_seconds(0.010, host_s=0.001, spun_s=0.002, pause=0.5) == pytest.approx(0.005)
    assert pause_seconds(2.180, host_s=2.172, spun_s=0.002, pause=1.0) == pytest.approx(0.010)
    assert pause_seconds(0.001, host_s=0.500, spun_s=0.002, pause=1.0) == 0.0


def test_a_kept_call_log_names_every_calls_segments_whichever_entry_point_made_it():
    from hf_longctx.kernels import attention_forward, kernel_call, kernel_forward, observe_kernels

    hub = EmulationHub(1, 30.0)
    timer = KernelTimer(hub, torch.device("cpu"), keep_calls=True)
    q, k = torch.randn(10, 2, 8, dtype=torch.float64), torch.randn(14, 1, 8, dtype=torch.float64)

    def rank(group):
        attention_forward(q, k, k, [0, 4, 10], [0, 6, 14], 6, 8, kernel="reference")
        kernel_forward(kernel_call(q, k, k, [0, 10], [0, 14], 10, 14, causal=True), "reference")

    with observe_kernels(timer):
        hub.run(rank)
    log = timer.call_log()
    assert [(c["rank"], c["phase"], c["q_lens"], c["k_lens"]) for c in log] == [
        (0, "forward", [4, 6], [6, 8]), (0, "forward", [10], [14])]
    assert all(c["seconds"] > 0 for c in log)
    assert sum(c["seconds"] for c in log) == pytest.approx(timer.seconds()[0, "forward"])


def _real_kernel_times(rank, world, backends, out_path):
    """Each backend's real step on this gloo group, its kernel calls timed per rank as the emulation times them."""
    batch, q, k, v, dout = make_problem(5, world, torch.float64)
    found = {}
    for backend in backends:
        plan = shard_plan(batch, world, default_strategy(backend))
        idx = plan.local_indices(rank)
        ql, kl, vl = (t[idx].clone().requires_grad_() for t in (q, k, v))

        def step(ql=ql, kl=kl, vl=vl, plan=plan, backend=backend, grad=dout[idx]):
            out = sequence_parallel_attention(ql, kl, vl, plan=plan, backend=backend, kernel="reference")
            torch.autograd.backward(out, grad)

        found[backend] = real_rank_kernel_times(step, torch.device("cpu"), reps=2)
    if rank == 0:
        out_path.write_text(json.dumps(found))


def test_a_real_run_times_every_ranks_kernel_calls_as_the_emulation_does(tmp_path):
    """The per-rank kernel time of a real run (one process per rank) is gathered on every rank, and each rank's
    timed calls are those its emulated twin makes: an emulated max/mean and a real one measure the same calls."""
    world, backends = 3, ["ring", "distfa", "cad"]
    out = tmp_path / "times.json"
    run_distributed(world, _real_kernel_times, backends, out)
    real = json.loads(out.read_text())
    batch, q, k, v, dout = make_problem(5, world, torch.float64)
    timers = []

    def logging_timer(hub, device):
        timers.append(KernelTimer(hub, device, keep_calls=True))
        return timers[-1]

    for backend in backends:
        emulate_step(batch, world, (q, k, v, dout), backend, kernel="reference", make_timer=logging_timer)
        logged = [sum(c["rank"] == r for c in timers[-1].call_log()) for r in range(world)]  # every call, both phases
        assert [calls for _, _, calls in real[backend]] == logged, backend
        assert all(f > 0 and b > 0 for f, b, _ in real[backend]), backend


def test_a_step_out_of_device_memory_runs_again_staged_on_the_host(monkeypatch):
    """One large step (every rank's buffers on one device) still measures: it runs again with its all_to_all
    buffers on the host, and says so; a step asked to stage runs staged once; any other error is the caller's."""
    from hf_longctx.lab.emulation import emulate_step_or_stage, runner

    tensors = (torch.zeros(4, 1, 2),)
    calls = []

    def fake(batch, world, tensors, backend, stage_on_host=False, **kwargs):
        calls.append(stage_on_host)
        if world == 2 and not stage_on_host:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
        if world == 3:
            raise RuntimeError("not a memory error")
        return f"step of {world}"

    monkeypatch.setattr(runner, "emulate_step", fake)
    assert emulate_step_or_stage(None, 1, tensors, "ring", reps=2) == ("step of 1", False) and calls == [False]
    calls.clear()
    assert emulate_step_or_stage(None, 2, tensors, "ring", reps=2) == ("step of 2", True) and calls == [False, True]
    calls.clear()
    assert emulate_step_or_stage(None, 1, tensors, "ring", stage_on_host=True) == ("step of 1", True)
    assert calls == [True]
    with pytest.raises(RuntimeError, match="not a memory error"):
        emulate_step_or_stage(None, 3, tensors, "ring")


def test_an_emulated_group_is_its_own_comm_mode():
    """The comm layer sees an emulated group only through its comm ops: every rank in this process, collectives on
    CPU tensors, all_to_alls staged on the host where the hub says, state per rank freed with the hub."""
    from hf_longctx.comm.collectives import collective_device, group_state, in_one_process, is_distributed
    from hf_longctx.comm.groups import global_rank, group_rank_and_size
    from hf_longctx.comm.mode import CommOps, ops_for
    from hf_longctx.lab.emulation.group import EmulatedGroup

    hub = EmulationHub(3, stage_on_host=True)
    group = EmulatedGroup(hub, 2)
    assert ops_for(group) is group and isinstance(group, CommOps)
    assert is_distributed(group) and in_one_process(group) and collective_device(group) == torch.device("cpu")
    assert group_rank_and_size(group) == (2, 3) and global_rank(group, 1) == 1
    assert group.stages_on_host() and not EmulatedGroup(EmulationHub(3), 0).stages_on_host()
    assert group_state(group) is group_state(EmulatedGroup(hub, 2))  # one rank's state, whatever handle
    assert group_state(group) is not group_state(EmulatedGroup(hub, 1))
