"""`pykvtier replay` end to end against the real DiskTier (small blocks, small slices)."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from pykvtier import cli, models
from pykvtier.replay import ReplayConfig, ReplayConfigError, block_key, format_summary, run_replay
from pykvtier.trace import Request, load_trace

pytest.importorskip("pykvtier._native", reason="the native engine is not built")

TINY_TPB = 128  # tiny model: 256 B/token x 128 = 32 KiB blocks, 4 per trace block
TINY_BS = models.block_size_bytes("tiny", TINY_TPB)
SPB = 512 // TINY_TPB

# (hash_ids) of a handmade trace, with the hits an unlimited tier must give
HANDMADE = [
    ([1, 2, 3], 0),  # cold: miss at (1,0); stores 12 blocks
    ([1, 2, 4], 8),  # 1 and 2 hit, miss at (4,0); stores 4
    ([1, 5], 4),  # 1 hits; stores 4
    ([6, 1], 0),  # miss at (6,0): prefix stops although 1 is there; stores 4 new (+4 present)
    ([1, 2, 3], 12),  # all hit, nothing to store
    ([6, 1, 2], 12),  # all hit
]


def _requests(spec):
    return [Request(i, 512 * len(ids), 1, tuple(ids)) for i, (ids, _) in enumerate(spec)]


def _config(root, **kw):
    base = dict(
        model="tiny",
        tokens_per_block=TINY_TPB,
        max_requests=None,
        capacity_bytes=None,
        root=root,
        engine="auto",
        progress=False,
    )
    base.update(kw)
    return ReplayConfig(**base)


def _reference_hits(requests, spb):
    """Prefix hits per request of an unlimited tier (every missed block is stored)."""
    present: set[tuple[int, int]] = set()
    out = []
    for r in requests:
        keys = [(h, s) for h in r.hash_ids for s in range(spb)]
        hits = 0
        for k in keys:
            if k not in present:
                break
            hits += 1
        out.append(hits)
        present.update(keys)
    return out


@pytest.mark.parametrize("engine", ["auto", "uring", "posix"])
def test_handmade_trace_exact_counts(root, engine):
    reqs = _requests(HANDMADE)
    try:
        s = run_replay(_config(root, engine=engine), reqs)
    except ReplayConfigError as exc:
        pytest.skip(f"engine {engine} unavailable here: {exc}")
    if engine != "auto":
        assert s.engine.startswith(engine)
    assert s.ok, s.error_samples
    assert s.requests == 6
    assert s.block_size_bytes == TINY_BS == 32768
    assert s.blocks_requested == SPB * sum(len(ids) for ids, _ in HANDMADE) == 64
    expected_hits = sum(SPB * 0 + h for _, h in HANDMADE)
    assert s.blocks_hit == expected_hits == 36
    # every hit is looked up, plus the first miss of each request that has one
    assert s.blocks_looked_up == 36 + 4 == 40
    assert s.load_jobs == 4 and s.store_jobs == 4
    assert s.blocks_loaded == 36
    assert s.bytes_loaded == 36 * TINY_BS
    assert s.bytes_stored == (12 + 4 + 4 + 4) * TINY_BS  # the 4 present blocks of request 3 are skipped
    assert s.verification_failures == 0 and s.errors == 0
    assert s.evictions == 0
    assert s.block_hit_ratio == pytest.approx(36 / 64)
    assert s.byte_hit_ratio == pytest.approx(36 * TINY_TPB / (512 * 16))
    assert s.load_latency_ms_p50 is not None and s.load_latency_ms_p99 >= s.load_latency_ms_p50
    assert s.root_removed is False and os.path.isdir(s.root)

    # a second replay over the same root starts warm: every block is a hit, nothing is stored
    s2 = run_replay(_config(root, engine=engine), reqs)
    assert s2.ok, s2.error_samples
    assert s2.blocks_hit == s2.blocks_requested == 64
    assert s2.bytes_stored == 0 and s2.store_jobs == 0


def test_bundled_slice_matches_reference():
    tpb = TINY_TPB  # 32 KiB blocks, 4 per trace block
    spb = 512 // tpb
    reqs = load_trace(None, max_requests=20)
    s = run_replay(_config(None, tokens_per_block=tpb), reqs)  # root: a temporary directory
    assert s.ok, s.error_samples
    ref = _reference_hits(reqs, spb)
    n_blocks = spb * sum(len(r.hash_ids) for r in reqs)
    assert s.blocks_requested == n_blocks
    assert s.blocks_hit == sum(ref)
    assert s.blocks_looked_up == sum(ref) + sum(1 for r, h in zip(reqs, ref) if h < spb * len(r.hash_ids))
    assert s.blocks_loaded == sum(ref)
    distinct = {(h, i) for r in reqs for h in r.hash_ids for i in range(spb)}
    assert s.bytes_stored == len(distinct) * s.block_size_bytes
    assert s.verification_failures == 0 and s.errors == 0
    assert s.root_removed and not os.path.exists(s.root)


def test_capacity_forces_eviction_and_stays_correct(root):
    reqs = load_trace(None, max_requests=20)
    # 1000 blocks: more than the largest request (684 blocks), far less than the 2,240 distinct ones
    s = run_replay(_config(root, capacity_bytes=1000 * (TINY_BS + 4096)), reqs)
    assert s.ok, s.error_samples
    assert s.evictions > 0
    # every eviction made room for a store, which took over the evicted file
    assert s.tier_stats["files_recycled"] == s.tier_stats["evictions_recycled"] == s.evictions
    assert f"  evictions   {s.evictions} ({s.evictions} files taken over by stores)" in \
        format_summary(s).splitlines()
    assert s.verification_failures == 0 and s.errors == 0
    off = run_replay(_config(os.path.join(root, "off"), capacity_bytes=1000 * (TINY_BS + 4096),
                             recycle=False), reqs)
    assert off.ok and off.evictions > 0, off.error_samples
    assert off.tier_stats["files_recycled"] == off.tier_stats["evictions_recycled"] == 0
    assert off.verification_failures == 0 and off.errors == 0
    # How many evictions a run makes depends on timing (stores run in the background, so a
    # store may find capacity held by another still in flight and be declined), so the two
    # runs need not agree; in each, every block written is either present or was evicted.
    for run in (s, off):
        present = run.tier_stats["blocks_present"]
        # (the tier's count: the replay's also counts keys a store skipped as already present)
        assert run.tier_stats["blocks_stored"] - run.evictions == present
        assert 0 < present <= 1000 and run.tier_stats["used_bytes"] == present * (TINY_BS + 4096)
    # eviction can only lose hits relative to an unlimited tier
    assert s.blocks_hit <= sum(_reference_hits(reqs, SPB))
    assert s.blocks_requested == SPB * sum(len(r.hash_ids) for r in reqs)


class _CorruptingTier:
    """Wraps a DiskTier and flips one byte of every loaded block before the replay sees it."""

    def __init__(self, inner, block_size):
        self._inner = inner
        self._bs = block_size
        self._arena = None
        self._loads = {}

    def set_arena(self, buf):
        self._arena = np.asarray(buf).view(np.uint8)
        self._inner.set_arena(buf)

    def submit_load(self, job):
        self._loads[job.job_id] = list(job.slot_ids)
        self._inner.submit_load(job)

    def _corrupt(self, results):
        for r in results:
            for slot in self._loads.pop(r.job_id, []):
                self._arena[slot * self._bs + 123] ^= 0xFF
        return results

    def get_finished_jobs(self):
        return self._corrupt(self._inner.get_finished_jobs())

    def wait(self, timeout_s=None):
        return self._corrupt(self._inner.wait(timeout_s=timeout_s))

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_verification_catches_wrong_bytes(root):
    from pykvtier import DiskTier

    def factory(root, bs, capacity, engine):
        return _CorruptingTier(DiskTier(root, bs, capacity_bytes=capacity, engine=engine), bs)

    s = run_replay(_config(root), _requests(HANDMADE), tier_factory=factory)
    assert s.verification_failures == 36  # every loaded block
    assert not s.ok


def test_cli_json(tmp_path, root, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 0, "input_length": 512 * len(ids), "output_length": 1, "hash_ids": ids}) + "\n" for ids, _ in HANDMADE))
    root = os.path.join(root, "cliroot")  # created by the tier
    rc = cli.main(
        ["replay", str(trace), "--model", "tiny", "--tokens-per-block", str(TINY_TPB),
         "--capacity", "none", "--root", str(root), "--json", "--max-requests", "all"]
    )
    out = capsys.readouterr().out
    assert rc == 0
    d = json.loads(out)  # exactly one JSON object
    assert d["ok"] is True
    assert d["blocks_hit"] == 36 and d["blocks_looked_up"] == 40 and d["requests"] == 6
    assert d["verification_failures"] == 0 and d["errors"] == 0
    assert d["root"] == root and os.path.isdir(root)
    for key in ("load_gbps", "store_gbps", "load_latency_ms_p50", "load_latency_ms_p99", "cpu_s_per_gib",
                "evictions", "wall_s", "block_size_bytes", "engine", "byte_hit_ratio", "bytes_loaded", "bytes_stored"):
        assert key in d


def test_cli_text_and_max_requests(capsys):
    rc = cli.main(
        ["replay", "--model", "tiny", "--tokens-per-block", "64", "--max-requests", "5",
         "--capacity", "64MiB", "--no-progress"]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "pykvtier replay: 5 requests" in out
    assert "verification failures 0, errors 0" in out
    assert out.rstrip().endswith("OK")


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--model", "gpt-5"], "known presets: llama-3-8b"),
        (["--tokens-per-block", "48"], "must divide the trace block size"),
        (["/nonexistent/trace.jsonl"], "/nonexistent/trace.jsonl"),
    ],
)
def test_cli_bad_arguments(args, needle, capsys):
    rc = cli.main(["replay", "--no-progress", *args])
    assert rc == 2
    assert needle in capsys.readouterr().err


def test_cli_unusable_root_and_empty_trace(tmp_path, capsys):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    assert cli.main(["replay", "--no-progress", "--root", str(a_file)]) == 2
    assert f"pykvtier replay: cannot open the tier at {a_file}: not a directory" in capsys.readouterr().err
    assert cli.main(["replay", "--no-progress", "--root", str(a_file / "sub")]) == 2
    assert f"cannot open the tier at {a_file / 'sub'}: Not a directory" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert cli.main(["replay", "--no-progress", str(empty)]) == 2
    assert f"pykvtier replay: {empty}: the trace holds no requests" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "empty.jsonl"]


def test_cli_bad_capacity(capsys):
    with pytest.raises(SystemExit) as ei:
        cli.main(["replay", "--capacity", "8XB"])
    assert ei.value.code == 2
    assert "invalid size" in capsys.readouterr().err


def test_keys_distinct_per_sub_block():
    keys = {block_key(h, s, TINY_BS) for h in range(100) for s in range(SPB)}
    assert len(keys) == 100 * SPB


@pytest.mark.nvme
def test_default_replay_on_nvme(root, capsys):
    """`pykvtier replay` with its defaults (about a minute, ~27 GiB written, 8 GiB on disk at
    most) on the storage under test: no verification failures, no errors, evictions."""
    rc = cli.main(["replay", "--root", os.path.join(root, "replay"), "--json"])
    d = json.loads(capsys.readouterr().out)
    assert rc == 0, d["error_samples"]
    assert d["verification_failures"] == 0 and d["errors"] == 0
    assert d["evictions"] > 0 and d["blocks_hit"] > 0


class _Tty(io.StringIO):
    def isatty(self):  # tqdm draws its bar only on a terminal
        return True


@pytest.mark.parametrize("with_tqdm", [True, False])
def test_progress_ends_on_the_summary_counts(root, monkeypatch, with_tqdm):
    """The bar (or the fallback line without tqdm) ends on the summary's figures: the last
    request's store job finishes after that request is counted, and still shows."""
    from pykvtier.replay import format_bytes

    if with_tqdm:
        pytest.importorskip("tqdm")
    else:
        monkeypatch.setitem(sys.modules, "tqdm", None)  # `from tqdm import tqdm` fails
    err = _Tty()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setenv("COLUMNS", "1000")  # no truncated bar
    spec = HANDMADE + [([7, 8, 9, 10], 0)]  # the last request stores 16 blocks
    s = run_replay(_config(root, progress=True), _requests(spec))
    assert s.ok, s.error_samples
    # 44 blocks stored; 4 of them (request [6, 1]) were on disk already, so 40 written
    assert s.requests == 7 and s.blocks_stored == 28 + 16 and s.bytes_stored == 40 * TINY_BS
    out = err.getvalue()
    last = [seg for seg in re.split(r"[\r\n]", out) if seg.strip()][-1]
    want = (f"hit {s.block_hit_ratio:.2%}, loaded {format_bytes(s.bytes_loaded)}, "
            f"stored {format_bytes(s.bytes_stored)}")
    if with_tqdm:
        assert re.search(r"\| 7/7 \[", last), last
        assert last.rstrip().endswith(want + "]"), last
    else:
        assert last == f"replay: 7/7 requests  {want}"
    assert "in flight" not in last
    # the same figures as the text summary
    text = format_summary(s)
    assert f"hit ratio   blocks {s.block_hit_ratio:.2%}" in text
    assert f"loaded      {format_bytes(s.bytes_loaded)} in" in text
    assert f"stored      {format_bytes(s.bytes_stored)} in" in text


def test_sigterm_unwinds_and_removes_the_temporary_root(tmp_path):
    """kill / timeout / a CI cancel: the replay stops as on Ctrl-C, its temporary root removed."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-P", "-m", "pykvtier.cli", "replay", "--no-progress",
                             "--model", "tiny", "--max-requests", "all"],
                            env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 120
        while not any(p.name.startswith("pykvtier-replay-") for p in tmp_path.iterdir()):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the replay never created its root"
            time.sleep(0.05)  # polling for the root to appear (not a synchronization by time)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "pykvtier: terminated (SIGTERM)" in err
    assert list(tmp_path.iterdir()) == []
