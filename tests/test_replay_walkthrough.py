"""`pykvtier replay` as a new user meets it: option errors name the option in one line (exit 2)
before any replay runs, options that would be silently ignored are refused, the summary says
n/a for a load rate with nothing loaded, and the plot's in-flight panel sees the stores that are
submitted between scheduler steps. A fake clock drives the schedule: no sleeps, no timing."""

from __future__ import annotations

import pytest

from pykvtier import cli, models
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


def _main(argv):
    try:
        return cli.main(argv)
    except SystemExit as exc:  # argparse's usage error
        return exc.code


@pytest.mark.parametrize("argv, line", [
    (["--mfu", "1.5"], "pykvtier replay: error: argument --mfu: expected a number in (0, 1], got 1.5"),
    (["--mfu", "0"], "pykvtier replay: error: argument --mfu: expected a number in (0, 1], got 0"),
    (["--gpu", "b200"], "pykvtier replay: --gpu: unknown GPU preset 'b200'; known GPU presets: h100, h200, "
                        "a100, l40s"),
    (["--model", "foo"], "pykvtier replay: --model: unknown model preset 'foo'; known presets: llama-3-8b, "
                         "qwen2.5-7b, llama-3-70b, tiny"),
    (["--tokens-per-block", "7"], "pykvtier replay: --tokens-per-block: tokens_per_block must divide the "
                                  "trace block size (512 tokens), got 7; valid values: 1, 2, 4, 8, 16, 32, "
                                  "64, 128, 256, 512"),
    (["--as-fast-as-possible", "--speed", "3"], "pykvtier replay: --as-fast-as-possible replays back to "
                                                "back, arrival times ignored: no --speed or --step-ms with it"),
    (["--as-fast-as-possible", "--step-ms", "5"], "pykvtier replay: --as-fast-as-possible replays back to "
                                                  "back, arrival times ignored: no --speed or --step-ms with it"),
    (["--tier", "vllm-fs", "--store-share", "0.25"], "pykvtier replay: --store-share and --no-recycle set "
                                                     "pykvtier's DiskTier: not with --tier vllm-fs"),
    (["--tier", "vllm-fs", "--no-recycle"], "pykvtier replay: --store-share and --no-recycle set "
                                            "pykvtier's DiskTier: not with --tier vllm-fs"),
    (["--plot", "x.jpg"], "pykvtier replay: --plot: the plot is a PNG: give a FILE.png, got 'x.jpg'"),
])
def test_bad_options_are_refused_before_the_replay_naming_the_option(tmp_path, capsys, argv, line):
    root = tmp_path / "root"
    assert _main(["replay", "--no-progress", "--max-requests", "1", "--root", str(root), *argv]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.splitlines()[-1] == line
    if not line.startswith("pykvtier replay: error: "):  # argparse's own: usage, then the line
        assert out.err == line + "\n"
    assert not root.exists()  # refused before the replay opened anything


def test_a_plot_into_a_missing_directory_is_refused_before_the_replay(tmp_path, capsys):
    png = tmp_path / "no" / "such" / "replay.png"
    assert _main(["replay", "--no-progress", "--max-requests", "1", "--plot", str(png)]) == 2
    assert capsys.readouterr().err == (f"pykvtier replay: --plot: no directory {png.parent} to write "
                                       f"{png} into\n")


def test_the_defaults_the_refusals_stand_in_for(tmp_path, capsys):
    """--speed, --step-ms and --store-share not given: 6, 10 ms, 0.5 (their help's defaults)."""
    import json

    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}\n')
    assert _main(["replay", str(trace), "--model", "tiny", "--tokens-per-block", str(TINY_TPB),
                  "--capacity", "none", "--no-progress", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["speed"], d["step_ms"], d["store_share"]) == (6.0, 10.0, 0.5)


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


def test_sub_millisecond_times_are_not_printed_as_zero():
    """A tiny model's prefill is well under a millisecond: it printed 'p50 0 ms'."""
    from pykvtier.replay import _seconds

    assert [_seconds(v) for v in (None, 0.0, 0.00042, 0.0042, 0.01, 0.812, 6.1)] == \
        ["n/a", "0 ms", "0.42 ms", "4.2 ms", "10 ms", "812 ms", "6.10 s"]
