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


def test_emulated_kernel_time_is_device_time():
    from hf_longctx.comm.emulated import EmulationHub
    from hf_longctx.emulation.timing import KernelTimer

    hub = EmulationHub(1)
    timer = KernelTimer(hub, torch.device("cuda"))
    region = _host_bound_region()

    def rank(group):
        for _ in range(3):
            timer("forward", lambda: region(), (), {})

    hub.run(rank)
    assert timer.seconds()[0, "forward"] < 0.9e-3  # three calls of >= 1 ms host time each
