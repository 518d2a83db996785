"""Device timing on the GPU: a timed region measures the device's work, not the host's dispatch.

The emulation's per-rank kernel times and CAD's profiled costs are events around calls; a stream that runs dry
while the host is busy would count the host's time as the call's (1 ms per attention call on an H100's host).
"""

from __future__ import annotations

import time

import torch

from hf_longctx.benchmarking import one_run_ms


def _host_bound_region():
    """A tiny kernel, 1 ms of host work (less than the ~2 ms the device spins ahead), another tiny kernel: ~1 ms
    of wall time, microseconds of device work."""
    x = torch.ones(16, device="cuda")

    def region():
        x.add_(1)
        time.sleep(0.001)
        x.add_(1)

    return region


def test_events_after_queue_ahead_exclude_host_time_between_launches():
    region = _host_bound_region()
    region()  # warm
    plain = min(one_run_ms(region, cuda=True) for _ in range(3))
    ahead = min(one_run_ms(region, cuda=True, ahead=True) for _ in range(3))
    assert plain > 0.9  # the stream waited for the host between the two launches
    assert ahead < 0.3  # it was still spinning: the events saw only the two tiny kernels


def test_the_spin_grows_to_cover_a_region_whose_host_side_takes_longer_than_the_shortest_spin(monkeypatch):
    """5 ms of host work between two tiny kernels: the shortest spin (~2 ms) runs out and the events count ~3 ms
    of waiting, counted as an overrun; once the spin has seen the host's time it covers it, and the events see
    only the kernels."""
    import hf_longctx.benchmarking as benchmarking

    ahead = benchmarking.HostAhead()
    monkeypatch.setattr(benchmarking, "HOST_AHEAD", ahead)
    x = torch.ones(16, device="cuda")

    def region():
        x.add_(1)
        time.sleep(0.005)
        x.add_(1)

    region()  # warm
    first = one_run_ms(region, cuda=True, ahead=True)
    assert first > 2.0 and ahead.overruns == 1
    later = [one_run_ms(region, cuda=True, ahead=True) for _ in range(3)]
    assert max(later) < 0.3 and ahead.overruns == 1
    assert ahead.longest_spin_s > 0.0075  # 1.5 x the host's 5 ms


def test_emulated_kernel_time_is_device_time():
    from hf_longctx.lab.emulation.group import EmulationHub
    from hf_longctx.lab.emulation.timing import KernelTimer

    hub = EmulationHub(1)
    timer = KernelTimer(hub, torch.device("cuda"))
    region = _host_bound_region()

    def rank(group):
        for _ in range(3):
            timer("forward", lambda: region(), (), {})

    hub.run(rank)
    assert timer.seconds()[0, "forward"] < 0.9e-3  # three calls of >= 1 ms host time each


def test_an_emulated_rank_pauses_after_a_call_for_as_long_as_it_took_and_the_pause_is_not_timed(monkeypatch):
    """A 10 ms call, then a tiny one: the tiny call waits behind a spin of at least 10 ms (the device idles as long
    as it worked), and neither call's time holds the pause. Without a pause the spin stays near its ~2 ms."""
    import hf_longctx.benchmarking as benchmarking
    import hf_longctx.lab.emulation.timing as timing
    from hf_longctx.lab.emulation.group import EmulationHub
    from hf_longctx.lab.emulation.timing import KernelTimer

    x = torch.ones(16, device="cuda")
    x.add_(1)
    for pause, spins_past_call in ((1.0, True), (0.0, False)):
        ahead = benchmarking.HostAhead()
        monkeypatch.setattr(benchmarking, "HOST_AHEAD", ahead)
        monkeypatch.setattr(timing, "HOST_AHEAD", ahead)
        ten_ms = int(0.010 * ahead.cycles_per_second())
        hub = EmulationHub(1)
        timer = KernelTimer(hub, torch.device("cuda"), pause=pause)

        def rank(group, timer=timer, cycles=ten_ms):
            timer("forward", lambda: torch.cuda._sleep(cycles), (), {})
            timer("forward", lambda: x.add_(1), (), {})

        hub.run(rank)
        assert (ahead.longest_spin_s >= 0.0095) == spins_past_call, (pause, ahead.longest_spin_s)
        assert 0.009 < timer.seconds()[0, "forward"] < 0.0115


def test_a_cold_run_reads_its_inputs_from_memory_not_from_the_l2_cache():
    """``cold`` evicts the L2 before the start event: a read of a buffer that fits in L2 (a quarter of it) takes
    longer timed cold than timed again warm, and the eviction itself is not in the time."""
    from hf_longctx.benchmarking import L2_FALLBACK_BYTES, flush_l2

    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or L2_FALLBACK_BYTES
    x = torch.ones(l2 // 4 // 4, device="cuda")

    def read():
        x.sum()

    read()
    flush_l2()
    warm = sorted(one_run_ms(read, cuda=True, ahead=True) for _ in range(21))[10]
    cold = sorted(one_run_ms(read, cuda=True, ahead=True, cold=True) for _ in range(21))[10]
    evict = sorted(one_run_ms(flush_l2, cuda=True, ahead=True) for _ in range(5))[2]
    assert cold > 1.1 * warm, (warm, cold)
    assert cold < evict, (cold, evict)  # the eviction (2x the L2 written) ran before the start event


def test_host_ms_of_a_launch_is_far_below_the_device_time_it_queues():
    from hf_longctx.benchmarking import host_and_device_ms

    x = torch.ones(16, device="cuda")
    x.add_(1)  # warm
    host, total = host_and_device_ms([lambda: torch.cuda._sleep(50_000_000), lambda: x.add_(1)],
                                     torch.device("cuda"))
    assert total > 5.0 and sum(host) < total / 5  # the device was busy long after the host had queued it


def test_an_op_profile_lists_device_kernels_in_start_order_with_their_stream(tmp_path):
    from hf_longctx.benchmarking import write_op_profile

    a = torch.randn(8192, 8192, device="cuda")  # over 1 ms per product, whatever the matmul precision
    side = torch.cuda.Stream()

    def step():
        a @ a
        with torch.cuda.stream(side):
            torch.cuda._sleep(2_000_000)
        a @ a

    step()  # warm
    path = tmp_path / "profile.txt"
    write_op_profile(step, torch.device("cuda"), path)
    text = path.read_text()
    assert "# ops by device time (self)" in text
    timeline = text.split("# device timeline")[1].splitlines()[1:]
    starts = [float(line.split()[0]) for line in timeline]
    streams = {line.split()[2] for line in timeline}
    assert len(timeline) >= 3 and starts == sorted(starts) and len(streams) >= 2, timeline
