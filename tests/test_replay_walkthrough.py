"""`pykvtier replay` as a new user meets it: the summary says n/a for a load rate with nothing
loaded, and the plot's in-flight panel sees the stores that are submitted between scheduler
steps. A fake clock drives the schedule: no sleeps, no timing."""

from __future__ import annotations

import pytest

from pykvtier import models
from pykvtier.replay import ReplayConfig, format_summary, run_replay
from pykvtier.trace import Request

pytest.importorskip("pykvtier._native", reason="the native engine is not built")

TINY_TPB = 128  # tiny model: 256 B/token x 128 = 32 KiB blocks, 4 per trace block
TINY_BS = models.block_size_bytes("tiny", TINY_TPB)
SPB = 512 // TINY_TPB


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def sleep(self, dt: float) -> None:
        self.t += dt


def _config(root, **kw):
    base = dict(model="tiny", tokens_per_block=TINY_TPB, max_requests=None, capacity_bytes=None,
                root=str(root), engine="auto", progress=False)
    base.update(kw)
    return ReplayConfig(**base)


def _req(ts_ms, ids, input_length=None):
    return Request(ts_ms, 512 * len(ids) if input_length is None else input_length, 1, tuple(ids))


def test_nothing_loaded_says_na_for_the_load_rate(tmp_path):
    """--bypass auto on a modeled disk too slow for every hit: nothing is loaded, and the
    summary's load rate is n/a, not 0.00 GB/s."""
    reqs = [_req(0, [1, 2]), _req(1, [1, 2])]
    s = run_replay(_config(tmp_path / "root", bypass="auto", disk_gbps=1e-6), reqs)
    assert s.ok, s.error_samples
    assert (s.blocks_hit, s.blocks_loaded, s.blocks_bypassed) == (2 * SPB, 0, 2 * SPB)
    text = format_summary(s)
    assert " 0.00 s busy -> n/a (nothing loaded) (GB = 1e9 B); per-request latency p50 n/a," in text
    assert "this disk's loads here: n/a (nothing loaded) (modeled: 1e-06 GB/s)" in text


def test_the_plots_in_flight_panel_sees_stores_submitted_between_steps(tmp_path):
    """Request 1 (at 100 ms) hits request 0's two trace blocks and misses its third: its store
    is submitted once its load finished, between scheduler steps. The queue samples (the plot's
    in-flight panel) hold that store's bytes alone; sampled only at steps they never did."""
    from pykvtier.replay import ReplayDriver

    drivers, clock = [], FakeClock()

    def make(*args):
        drivers.append(ReplayDriver(*args))
        return drivers[-1]

    s = run_replay(_config(tmp_path / "root", speed=1.0), [_req(0, [1, 2]), _req(100, [1, 2, 3])],
                   driver_factory=make, clock=clock.now, sleep=clock.sleep)
    assert s.ok, s.error_samples
    assert (s.blocks_hit, s.load_jobs, s.store_jobs) == (2 * SPB, 1, 2)
    samples = {(lb, sb) for _, lb, sb in drivers[0].queue_samples}
    assert (0, 2 * SPB * TINY_BS) in samples  # step 0: request 0's store
    assert (2 * SPB * TINY_BS, 0) in samples  # request 1's step: its load
    assert (0, SPB * TINY_BS) in samples  # after its load: its store, between steps
    assert (0, SPB * TINY_BS) in {(lb, sb) for _, lb, sb in s.timeline["queue"]}
