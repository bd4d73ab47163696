"""`pykvtier replay` as a server sees it (issue 14): requests by arrival time in scheduler steps,
one load job per request, what the hits were worth (TTFT, GPU time), --bypass auto, --plot,
--as-fast-as-possible. A fake clock drives the schedule: no test sleeps or asserts on timing."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from pykvtier import cli, models
from pykvtier.replay import (ReplayConfig, ReplayConfigError, format_summary, moved_per_trace_block,
                             run_replay)
from pykvtier.trace import Request, load_trace

pytest.importorskip("pykvtier._native", reason="the native engine is not built")

TINY_TPB = 128  # tiny model: 256 B/token x 128 = 32 KiB blocks, 4 per trace block
TINY_BS = models.block_size_bytes("tiny", TINY_TPB)
SPB = 512 // TINY_TPB


class FakeClock:
    """The driver's time source: ``sleep`` advances it; nothing else does (a load takes no
    time on it, however long its real I/O takes)."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def sleep(self, dt: float) -> None:
        assert dt >= 0
        self.t += dt


class CountingTier:
    """A DiskTier whose submit_load calls are recorded (job id, keys)."""

    def __init__(self, tier, loads):
        self._tier = tier
        self.loads = loads

    def submit_load(self, job, *args, **kw):
        self.loads.append((job.job_id, list(job.keys)))
        return self._tier.submit_load(job, *args, **kw)

    def __getattr__(self, name):
        return getattr(self._tier, name)


def counting_factory(loads):
    from pykvtier import DiskTier

    def factory(root, bs, cap, engine):
        return CountingTier(DiskTier(root, bs, capacity_bytes=cap, engine=engine), loads)

    return factory


class OneMsPerToken:
    """A prefill model for hand calculations: 1 ms per token wherever it is (no attention)."""

    def block_seconds(self, start_token, tokens):
        return tokens * 1e-3

    def prefix_seconds(self, tokens):
        return tokens * 1e-3

    def break_even_bytes_per_s(self, start_token, tokens):
        return tokens * 256 / self.block_seconds(start_token, tokens)


def _config(root, **kw):
    base = dict(model="tiny", tokens_per_block=TINY_TPB, max_requests=None, capacity_bytes=None,
                root=str(root), engine="auto", progress=False)
    base.update(kw)
    return ReplayConfig(**base)


def _req(ts_ms, ids, input_length=None):
    return Request(ts_ms, 512 * len(ids) if input_length is None else input_length, 1, tuple(ids))


def _driver_recorder(drivers):
    from pykvtier.replay import ReplayDriver

    def make(*args):
        drivers.append(ReplayDriver(*args))
        return drivers[-1]

    return make


# ------------------------------------------------------------------------------------------
# arrival times and scheduler steps

# (timestamp ms, hash ids): at 1x with a 10 ms step, request 0 is looked up in step 0 (0 ms),
# 1 and 2 in step 1 (10 ms), 3 and 4 in step 3 (30 ms: step 2 has nothing to do), 5 in step 6
STEPPED = [(0, [1, 2]), (3, [1, 3]), (7, [1, 2, 4]), (25, [5]), (26, [1, 2, 4]), (55, [5, 1])]


def test_requests_of_one_step_share_it_and_each_loads_in_one_job(tmp_path):
    loads, drivers, clock = [], [], FakeClock()
    reqs = [_req(ts, ids) for ts, ids in STEPPED]
    s = run_replay(_config(tmp_path / "root", speed=1.0, step_ms=10.0), reqs,
                   tier_factory=counting_factory(loads), driver_factory=_driver_recorder(drivers),
                   clock=clock.now, sleep=clock.sleep)
    assert s.ok, s.error_samples
    d = drivers[0]
    assert [r.step for r in d.records] == [0, 1, 1, 3, 3, 6]
    assert [r.arrival_t for r in d.records] == pytest.approx([0, 0.003, 0.007, 0.025, 0.026, 0.055])
    assert [r.sched_t for r in d.records] == pytest.approx([0, 0.01, 0.01, 0.03, 0.03, 0.06])
    assert (s.steps, s.max_requests_per_step, s.speed, s.step_ms) == (4, 2, 1.0, 10.0)
    # step 1: request 1 finds block 1 (request 0 stored it; its store finished before the
    # step), request 2 finds 1 (being loaded by request 1's job: HIT_PENDING) and 2; the misses
    # of a request with hits are stored once its load finished, so request 4 finds block 4
    hits = [r.hits for r in d.records]
    assert hits == [0, SPB, 2 * SPB, 0, 3 * SPB, 2 * SPB]
    assert s.blocks_hit == sum(hits) and s.blocks_hit_pending == SPB
    # one load job per request with hits, holding exactly its hit prefix
    want = [[k for k in r.keys[: r.hits]] for r in d.records if r.hits]
    assert [keys for _, keys in loads] == want
    assert s.load_jobs == len(loads) == 4 and s.blocks_loaded == sum(hits)
    # stores: requests 0, 3 at once (no hits), 1, 2 after their loads; 4 and 5 had nothing new
    assert s.store_jobs == 4 and s.bytes_stored == (2 + 1 + 1 + 1) * SPB * TINY_BS
    assert s.requests_deferred == 0 and s.lookup_retries == 0
    # the schedule line of the text summary
    waits = [0, 7, 3, 5, 4, 5]  # ms from arrival to the step
    assert (s.schedule_wait_ms_p50, s.schedule_wait_ms_p99) == pytest.approx(
        (np.percentile(waits, 50), np.percentile(waits, 99)))
    text = format_summary(s)
    assert ("  schedule    by arrival time at 1x the trace's pace, a step every 10 ms: 4 steps, at most 2 "
            "requests a step, 0 requests put off a step (0 for a RETRY, 0 for want of free slots); arrival to lookup "
            "p50 4.5 ms, p99 6.9 ms") in text.splitlines()


def test_a_request_meeting_a_block_being_written_is_asked_again_next_step(tmp_path):
    """Two requests in one step with the same prefix: the first stores it at once (nothing hit),
    the second meets those blocks being written (RETRY) and is looked up again at the next
    step, where they are there. The lookups counted are those of the pass that scheduled it."""
    drivers, clock = [], FakeClock()
    reqs = [_req(0, [1, 2]), _req(0, [1, 2, 3])]
    s = run_replay(_config(tmp_path / "root", speed=1.0), reqs, driver_factory=_driver_recorder(drivers),
                   clock=clock.now, sleep=clock.sleep)
    assert s.ok, s.error_samples
    d = drivers[0]
    assert [r.step for r in d.records] == [0, 1]
    assert [r.deferred for r in d.records] == [0, 1]
    assert s.requests_deferred == s.requests_deferred_retry == 1 and s.lookup_retries == 1
    assert (s.blocks_hit, s.blocks_looked_up, s.load_jobs) == (2 * SPB, 1 + 2 * SPB + 1, 1)


def test_no_free_slots_puts_a_request_off_with_those_after_it(tmp_path):
    """First come, first served: a request the arena has no slots for waits for the next step,
    and so does the one behind it, although that one would fit."""
    drivers, clock = [], FakeClock()
    reqs = [_req(0, [1, 2]), _req(0, [3, 4]), _req(0, [5])]
    # 16 slots: the first request takes 8, the second needs 8 more: fits; make it 12 slots
    s = run_replay(_config(tmp_path / "root", speed=1.0, arena_bytes=12 * TINY_BS), reqs,
                   driver_factory=_driver_recorder(drivers), clock=clock.now, sleep=clock.sleep)
    assert s.ok, s.error_samples
    assert [r.step for r in drivers[0].records] == [0, 1, 1]
    assert (s.requests_deferred, s.requests_deferred_retry) == (2, 0)


def test_speed_compresses_the_trace_time(tmp_path):
    drivers, clock = [], FakeClock()
    reqs = [_req(1000, [1]), _req(3000, [2]), _req(5000, [3])]  # time origin: the first
    s = run_replay(_config(tmp_path / "root", speed=100.0, step_ms=5.0), reqs,
                   driver_factory=_driver_recorder(drivers), clock=clock.now, sleep=clock.sleep)
    assert s.ok
    d = drivers[0]
    assert [r.arrival_t for r in d.records] == pytest.approx([0, 0.02, 0.04])
    assert [r.trace_s for r in d.records] == pytest.approx([0, 2, 4])
    assert [r.step for r in d.records] == [0, 4, 8]


# ------------------------------------------------------------------------------------------
# as fast as possible: the replay of earlier releases

HANDMADE = [[1, 2, 3], [1, 2, 4], [1, 5], [6, 1], [1, 2, 3], [6, 1, 2]]


def _trace_file(path, spacing_ms=0):
    with open(path, "w") as f:
        for i, ids in enumerate(HANDMADE):
            f.write(json.dumps({"timestamp": i * spacing_ms, "input_length": 512 * len(ids),
                                "output_length": 1, "hash_ids": ids}) + "\n")
    return str(path)


COUNTS = ("requests", "blocks_requested", "blocks_looked_up", "blocks_hit", "blocks_hit_pending",
          "load_jobs", "store_jobs", "blocks_loaded", "blocks_stored", "bytes_loaded",
          "bytes_stored", "verification_failures", "errors", "requests_deferred", "steps")


def test_as_fast_as_possible_is_the_back_to_back_replay(tmp_path, capsys):
    trace = _trace_file(tmp_path / "t.jsonl", spacing_ms=1)
    argv = ["replay", trace, "--model", "tiny", "--tokens-per-block", str(TINY_TPB), "--capacity", "none",
            "--max-requests", "all", "--json", "--as-fast-as-possible"]
    assert cli.main([*argv, "--root", str(tmp_path / "a")]) == 0
    d = json.loads(capsys.readouterr().out)
    lib = run_replay(_config(tmp_path / "b"), load_trace(trace))  # ReplayConfig's default: speed None
    assert d["speed"] is None and d["step_ms"] is None and lib.speed is None
    assert {k: d[k] for k in COUNTS} == {k: getattr(lib, k) for k in COUNTS}
    # the exact counts of this trace back to back (tests/test_replay.py's handmade trace)
    assert (d["blocks_hit"], d["blocks_looked_up"], d["load_jobs"], d["store_jobs"]) == (36, 40, 4, 4)
    assert (d["blocks_hit_pending"], d["steps"]) == (0, 0)
    assert d["bytes_stored"] == 24 * TINY_BS
    assert "  schedule    back to back (as fast as possible: arrival times ignored), each load waited for" \
        in format_summary(lib).splitlines()


def test_bundled_slice_back_to_back_through_the_cli_matches_the_reference(tmp_path, capsys):
    reqs = load_trace(None, max_requests=20)
    present, want = set(), 0
    for r in reqs:  # prefix hits of an unlimited tier, request after request
        keys = [(h, s) for h in r.hash_ids for s in range(SPB)]
        n = next((i for i, k in enumerate(keys) if k not in present), len(keys))
        want += n
        present.update(keys)
    assert cli.main(["replay", "--model", "tiny", "--tokens-per-block", str(TINY_TPB), "--capacity", "none",
                     "--max-requests", "20", "--as-fast-as-possible", "--json",
                     "--root", str(tmp_path / "r")]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["ok"] and d["blocks_hit"] == want


# ------------------------------------------------------------------------------------------
# the KV sample

@pytest.mark.parametrize("bs,spb,sample,moved", [
    (917504, 32, 1 << 20, 1),  # qwen2.5-7b, 16 tokens: one 896 KiB block of 32
    (2 << 20, 32, 1 << 20, 1),  # llama-3-8b, 16 tokens: one 2 MiB block (at least one)
    (32768, 4, 1 << 20, 4),  # tiny: every block
    (32768, 4, 64 << 10, 2),
    (32768, 4, 96 << 10, 2),  # the largest divisor of 4 that fits 3 blocks
    (32768, 4, None, 4),
])
def test_moved_per_trace_block(bs, spb, sample, moved):
    assert moved_per_trace_block(bs, spb, sample) == moved


def test_a_sampled_replay_counts_every_token_and_scales_its_load_times(tmp_path):
    """qwen2.5-7b at 16 tokens per block, the default sample: one 896 KiB block of each trace
    block's 32 moves; hit ratios are those of the blocks moved, the TTFT and GPU time count
    every token, and a load time is the measured one x 32."""
    drivers, clock = [], FakeClock()
    reqs = [_req(0, [1, 2]), _req(0, [1, 2, 3])]
    cfg = ReplayConfig(model="qwen2.5-7b", tokens_per_block=16, max_requests=None, capacity_bytes=None,
                       root=str(tmp_path / "root"), progress=False)
    s = run_replay(cfg, reqs, driver_factory=_driver_recorder(drivers), clock=clock.now,
                   sleep=clock.sleep, prefill=OneMsPerToken())
    assert s.ok, s.error_samples
    assert (s.blocks_per_trace_block, s.moved_per_trace_block, s.block_size_bytes) == (32, 1, 917504)
    assert (s.blocks_requested, s.blocks_hit, s.blocks_loaded) == (5, 2, 2)
    assert s.hit_kv_bytes == 1024 * 57344 and s.byte_hit_ratio == pytest.approx(1024 / 2560)
    assert s.load_time_source == "measured x 32 (the replay moved 1/32 of the KV)"
    load_s = drivers[0].records[1].load_s
    assert load_s is not None
    assert s.load_s_of_hits == pytest.approx(32 * load_s)
    assert s.prefill_gpu_s_saved == pytest.approx(1.024)
    assert s.ttft_ms_tier_p99 == pytest.approx(1e3 * np.percentile([1.024, 32 * load_s + 0.512], 99))
    assert "  KV moved    the first 1 of each 512-token trace block's 32 engine blocks (896.00 KiB of " \
        "28.00 MiB); the others count as hit or missed with them (--kv-sample)" in format_summary(s).splitlines()


# ------------------------------------------------------------------------------------------
# what the hits were worth

def test_ttft_and_gpu_time_against_a_hand_calculation(tmp_path):
    """1 ms of prefill per token (OneMsPerToken) and a modeled disk of 32,768 B per ms (one tiny
    block): TTFT without the tier = the prompt's tokens in ms; with it = blocks loaded x 1 ms +
    the tokens after them in ms (load, then compute the rest)."""
    reqs = [_req(0, [1, 2], 1024), _req(1, [1, 2, 3], 1400), _req(2, [7], 300)]
    s = run_replay(_config(tmp_path / "root", disk_gbps=0.032768), reqs, prefill=OneMsPerToken())
    assert s.ok, s.error_samples
    assert s.load_time_source == "modeled: full KV bytes / 0.032768 GB/s"
    # request 1: 8 blocks hit (1024 tokens): 8 ms of load, then 376 tokens
    none = [1.024, 1.400, 0.300]
    tier = [1.024, 0.008 + 0.376, 0.300]
    assert s.ttft_ms_no_tier_p50 == pytest.approx(1e3 * np.percentile(none, 50))
    assert s.ttft_ms_no_tier_p99 == pytest.approx(1e3 * np.percentile(none, 99))
    assert s.ttft_ms_tier_p50 == pytest.approx(1e3 * np.percentile(tier, 50))
    assert s.ttft_ms_tier_p99 == pytest.approx(1e3 * np.percentile(tier, 99))
    assert s.prefill_gpu_s_no_tier == pytest.approx(2.724)
    assert s.prefill_gpu_s_saved == pytest.approx(1.024)
    assert s.load_s_of_hits == pytest.approx(0.008)
    assert (s.requests_loaded, s.requests_load_faster) == (1, 1)
    # the KV of the loaded tokens over their prefill: 1024 x 256 B / 1.024 s
    assert s.break_even_gbps_hits == pytest.approx(256e3 / 1e9)
    assert s.break_even_gbps_block0 == pytest.approx(128 * 256 / 0.128 / 1e9)
    lines = format_summary(s).splitlines()
    assert ("    TTFT      without the tier p50 1.02 s, p99 1.39 s; with it p50 384 ms, p99 1.01 s"
            " (load, then compute the rest)") in lines
    assert ("    prefill   2.72 GPU-s without the tier; 1.02 GPU-s saved (37.6%) for 0.008 s of loads;"
            " 1 of 1 request loaded faster than their tokens compute") in lines


def test_ttft_without_the_tier_with_the_real_cost_model():
    """llama-3-8b on an H100 at MFU 0.5, one request of 512 tokens, cold: its TTFT is the
    prefill of 512 tokens, 2 x 6,979,588,096 x 512 + 4 x 32 x 32 x 128 x (512 x 513 / 2) =
    7,215,951,904,768 FLOPs at 494.7e12 FLOP/s."""
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        s = run_replay(ReplayConfig(model="llama-3-8b", tokens_per_block=16, max_requests=None,
                                    capacity_bytes=None, root=root, progress=False), [_req(0, [1])])
    assert s.ok
    flops = 2 * 6_979_588_096 * 512 + 4 * 32 * 32 * 128 * (512 * 513 // 2)
    assert flops == 7_215_951_904_768
    assert s.ttft_ms_no_tier_p50 == pytest.approx(flops / (989.4e12 * 0.5) * 1e3)
    assert s.ttft_ms_tier_p50 == s.ttft_ms_no_tier_p50  # nothing hit
    assert (s.gpu, s.mfu) == ("h100", 0.5)
    # 16 tokens of 128 KiB at token 0: 223,418,122,240 FLOPs (tests/test_costmodel.py)
    assert s.break_even_gbps_block0 == pytest.approx(16 * 131072 / (223_418_122_240 / 494.7e12) / 1e9)


# ------------------------------------------------------------------------------------------
# --bypass auto

def test_bypass_loads_the_prefix_that_loads_faster(tmp_path):
    """A modeled disk of 100 ms a block, 1 ms of prefill per token (128 ms a block): every
    whole block is worth loading; a prompt that ends 10 tokens into its third trace block has
    hits whose last blocks recompute in 10 ms, 0, 0, 0: k is the largest k with k x 100 ms <=
    their recompute time: 10 of 12 (1000 <= 1034, 1100 > 1034). A prompt of 50 tokens: k = 0
    (100 > 50). Back to back: no load in flight at a decision."""
    reqs = [_req(0, [1, 2, 3], 1536), _req(1, [1, 2, 3], 1034), _req(2, [1], 50)]
    s = run_replay(_config(tmp_path / "root", bypass="auto", disk_gbps=TINY_BS / 0.1 / 1e9), reqs,
                   prefill=OneMsPerToken())
    assert s.ok, s.error_samples
    assert (s.blocks_hit, s.blocks_bypassed, s.requests_bypassed) == (16, 2 + 4, 2)
    assert (s.blocks_loaded, s.load_jobs) == (10, 1)
    # TTFT: with bypass [1.536, 10 x 0.1 + 0, 0 + 0.05]; every hit loaded [1.536, 1.2, 0.4]
    assert s.ttft_ms_tier_p50 == pytest.approx(1000.0)
    assert s.ttft_ms_no_bypass_p50 == pytest.approx(1200.0)
    assert s.ttft_ms_no_tier_p50 == pytest.approx(1034.0)
    lines = format_summary(s).splitlines()
    assert ("    bypass    6 hit blocks of 2 requests recomputed instead of loaded; TTFT with every hit "
            "loaded: p50 1.20 s, p99 1.53 s") in lines


def test_bypass_counts_the_loads_in_flight(tmp_path):
    """The measured disk at an injected bandwidth of 100 ms a block: two requests in one step,
    the first loads its 12 hits (12 x 100 ms <= 12 x 128 ms); the second's 8 hits queue behind
    those 1.2 s of loads in flight: 1.2 + 0.1 k > 0.128 k for every k <= 8, so none is loaded.
    (On a modeled disk, --disk-gbps, each load is served on its own: both would load.)"""
    from pykvtier.costmodel import FixedBandwidth

    reqs = [_req(0, [1, 2, 3]), _req(12, [1, 2, 3]), _req(15, [1, 2])]  # 1 and 2: step 2
    results = []
    for kw in (dict(bandwidth=FixedBandwidth(TINY_BS / 0.1)), dict(disk_gbps=TINY_BS / 0.1 / 1e9)):
        clock = FakeClock()
        cfg = _config(tmp_path / f"root{len(results)}", speed=1.0, bypass="auto",
                      disk_gbps=kw.pop("disk_gbps", None))
        s = run_replay(cfg, reqs, prefill=OneMsPerToken(), clock=clock.now, sleep=clock.sleep, **kw)
        assert s.ok, s.error_samples
        results.append((s.blocks_hit, s.blocks_loaded, s.blocks_bypassed, s.requests_bypassed, s.load_jobs))
    assert results == [(20, 12, 8, 1, 1), (20, 20, 0, 0, 2)]


def test_bypass_without_a_bandwidth_yet_loads_every_hit(tmp_path):
    """Measured bandwidth: before any load has finished there is no estimate, and the first
    request with hits loads them all (and measures)."""
    reqs = [_req(0, [1, 2]), _req(1, [1, 2])]
    s = run_replay(_config(tmp_path / "root", bypass="auto"), reqs, prefill=OneMsPerToken())
    assert s.ok
    assert (s.blocks_loaded, s.blocks_bypassed) == (2 * SPB, 0)
    assert "TTFT with every hit loaded: n/a without --disk-gbps" in format_summary(s)


def test_bad_schedule_and_cost_options_are_config_errors(tmp_path):
    for kw, needle in ((dict(speed=0.0), "speed"), (dict(step_ms=-1.0), "step"),
                       (dict(bypass="sometimes"), "bypass"), (dict(disk_gbps=0.0), "GB/s"),
                       (dict(mfu=1.5), "MFU"), (dict(gpu="gtx1080"), "gtx1080"),
                       (dict(tier="nfs"), "tier")):
        with pytest.raises(ReplayConfigError, match=needle):
            run_replay(_config(tmp_path / "r", **kw), [_req(0, [1])])


def test_cli_options(tmp_path, capsys):
    trace = _trace_file(tmp_path / "t.jsonl", spacing_ms=5)
    base = ["replay", trace, "--model", "tiny", "--tokens-per-block", str(TINY_TPB), "--capacity", "none",
            "--max-requests", "all", "--no-progress"]
    assert cli.main([*base, "--speed", "2", "--step-ms", "5", "--gpu", "a100", "--mfu", "0.4",
                     "--bypass", "auto", "--disk-gbps", "7", "--store-share", "0.125", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["speed"], d["step_ms"], d["gpu"], d["mfu"], d["bypass"], d["disk_gbps"]) == \
        (2.0, 5.0, "a100", 0.4, "auto", 7.0)
    assert d["store_share"] == 0.125 and d["tier_stats"]["blocks_stored"] > 0
    assert d["ok"] and d["ttft_ms_no_bypass_p50"] is not None
    assert d["wall_s"] >= d["setup_s"] + d["run_s"] + d["cleanup_s"] > 0
    for bad, needle in ((["--speed", "0"], "--speed"), (["--gpu", "gtx1080"], "gtx1080"),
                        (["--bypass", "yes"], "--bypass"), (["--disk-gbps", "-1"], "--disk-gbps"),
                        (["--store-share", "0"], "--store-share"),
                        (["--store-share", "1.5"], "--store-share")):
        try:
            rc = cli.main([*base, *bad])
        except SystemExit as exc:  # argparse's usage error
            rc = exc.code
        assert rc == 2, bad
        assert needle in capsys.readouterr().err


def test_text_summary_times_cover_the_whole_replay(tmp_path):
    s = run_replay(_config(tmp_path / "root"), [_req(0, [1]), _req(1, [1])])
    assert s.setup_s > 0 and s.run_s > 0 and s.wall_s >= s.setup_s + s.run_s + s.cleanup_s
    (line,) = [x for x in format_summary(s).splitlines() if x.startswith("  wall ")]
    assert line == (f"  wall        {s.wall_s:.2f} s: set-up {s.setup_s:.2f} s (trace, arena and its "
                     f"prefault, the tier's start), replay {s.run_s:.2f} s, clean-up {s.cleanup_s:.2f} s")


# ------------------------------------------------------------------------------------------
# --plot and --tier

def test_plot_is_written(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (pip install 'pykvtier[plot]')")
    trace = _trace_file(tmp_path / "t.jsonl", spacing_ms=5)
    png = tmp_path / "replay.png"
    assert cli.main(["replay", trace, "--model", "tiny", "--tokens-per-block", str(TINY_TPB), "--capacity",
                     "none", "--max-requests", "all", "--no-progress", "--bypass", "auto", "--disk-gbps",
                     "0.5", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr()
    assert out.out.rstrip().endswith("OK") and f"plot written to {png}" in out.err


def test_plot_without_matplotlib_names_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    png = tmp_path / "replay.png"
    assert cli.main(["replay", "--model", "tiny", "--max-requests", "1", "--no-progress",
                     "--plot", str(png)]) == 2
    err = capsys.readouterr().err
    assert err == ("pykvtier replay: --plot needs matplotlib, which is not installed: pip install "
                   "'pykvtier[plot]' (or pip install matplotlib)\n")
    assert not png.exists()


def test_tier_vllm_fs_flag(tmp_path, capsys):
    from pykvtier import replay_tiers

    trace = _trace_file(tmp_path / "t.jsonl", spacing_ms=5)
    argv = ["replay", trace, "--model", "tiny", "--tokens-per-block", str(TINY_TPB), "--capacity", "none",
            "--max-requests", "all", "--no-progress", "--json", "--tier", "vllm-fs",
            "--root", str(tmp_path / "root")]
    reason = replay_tiers.vllm_unavailable_reason()
    rc = cli.main(argv)
    out = capsys.readouterr()
    if reason is not None:
        assert rc == 2 and reason in out.err
        return
    assert rc == 0, out.err[-2000:]
    d = json.loads(out.out)
    assert d["tier_kind"] == "vllm-fs" and d["engine"].startswith("vllm-fs") and d["ok"]
    assert d["blocks_loaded"] == d["blocks_hit"] > 0 and d["verification_failures"] == 0
    assert cli.main(["replay", "--nodes", f"{tmp_path},{tmp_path}", "--tier", "vllm-fs"]) == 2
    assert "no --plot or --tier with it" in capsys.readouterr().err
