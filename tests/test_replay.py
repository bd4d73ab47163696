"""`pykvtier replay` end to end against the real DiskTier (small blocks, small slices)."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
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


# Children that are signalled get SIGINT at its default action (Python's KeyboardInterrupt)
# whatever this process has: pytest started as a background job of a non-interactive shell (or
# under nohup) inherits SIGINT ignored, its children too, and the CLI rightly keeps an ignored
# SIGINT ignored. A small interpreter resets it, then becomes the child (exec keeps SIG_DFL; no
# preexec_fn, which is unsafe with threads).
_SIGINT_DEFAULT = [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, "
                   "signal.SIG_DFL); os.execv(sys.executable, [sys.executable] + sys.argv[1:])"]


def _python(*args: str) -> list[str]:
    """argv of ``python ARGS`` with SIGINT at its default action."""
    return [*_SIGINT_DEFAULT, *args]


@pytest.fixture
def sigint_deliverable():
    """SIGINT raises KeyboardInterrupt in this process during the test (pytest may have started
    with it ignored, see _SIGINT_DEFAULT); put back after."""
    previous = signal.getsignal(signal.SIGINT)
    if previous == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    if previous == signal.SIG_IGN:
        signal.signal(signal.SIGINT, previous)


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


def test_empty_root_is_refused_not_the_current_directory(tmp_path, monkeypatch, capsys):
    """``--root "$UNSET"`` made the current directory the root; refused as DiskTier('') and the
    operators' commands refuse it (exit 2, nothing created)."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["replay", "--no-progress", "--model", "tiny", "--max-requests", "1", "--root", ""]) == 2
    assert capsys.readouterr() == ("", "pykvtier replay: root '' is empty (it would mean the current directory)\n")
    with pytest.raises(ReplayConfigError, match=r"^root '' is empty \(it would mean the current directory\)$"):
        run_replay(_config(""), _requests(HANDMADE))
    assert os.listdir(tmp_path) == []


def test_tilde_in_the_root_is_the_home_directory(tmp_path, monkeypatch, capsys):
    """``--root '~/kv'`` (quoted, or from a config that never met a shell) is $HOME/kv, as a
    shell would expand it, and the summary names that path; no directory called "~"."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    trace = _trace_file(tmp_path / "t.jsonl")
    assert cli.main(["replay", trace, "--model", "tiny", "--tokens-per-block", str(TINY_TPB),
                     "--capacity", "none", "--root", "~/kv", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["ok"], d["root"], d["root_removed"]) == (True, str(home / "kv"), False)
    assert sorted(os.listdir(home / "kv")) == [".pykvtier.lock", "blocks", "pykvtier-root.json", "quarantine"]
    assert os.listdir(cwd) == []


# the arena the default run (the first 800 requests of the bundled trace, arriving by time) needs
# with llama-3-70b, 16 tokens/block: the largest request has 239 trace blocks, one engine block of
# each moved (--kv-sample 1MiB), 5 MiB (327680 B/token x 16); room for four such requests, within
# 4 GiB
_ARENA_70B = ("cannot allocate the host arena of 4.00 GiB (819 blocks of 5.00 MiB; the largest of the "
              "800 requests needs 239): Cannot allocate memory; replay fewer requests (--max-requests N), "
              "a smaller model (--model), a smaller --arena (down to 1.17 GiB, the largest request), or run "
              "where more memory is free")


@pytest.mark.parametrize("argv,message", [
    (["--model", "llama-3-70b"], _ARENA_70B),
    (["--model", "tiny", "--tokens-per-block", "128", "--arena", "8GiB"],
     "cannot allocate the host arena of 8.00 GiB (262144 blocks of 32.00 KiB; the largest of the 800 "
     "requests needs 956): Cannot allocate memory; replay fewer requests (--max-requests N), a smaller "
     "model (--model), a smaller --arena (down to 29.88 MiB, the largest request), or run where more "
     "memory is free"),
], ids=["llama-3-70b", "arena-option"])
def test_an_arena_the_memory_cannot_hold_is_one_line_and_exit_2(tmp_path, argv, message):
    """The arena does not fit (here: RLIMIT_AS of 4 GiB, as `ulimit -v` sets it; on a real machine,
    too little memory): one line naming its size and the ways out, exit 2, no traceback, the
    temporary root removed."""
    assert models.block_size_bytes("llama-3-70b", 16) == 5 << 20
    assert max(len(r.hash_ids) for r in load_trace(None, 800)) == 239
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    code = ("import resource, sys\n"
            "resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))\n"
            "from pykvtier import cli\n"
            f"sys.exit(cli.main(['replay', '--no-progress', *{argv!r}]))")
    proc = subprocess.run([sys.executable, "-P", "-c", code], env={**os.environ, "TMPDIR": str(tmpdir)},
                          cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", f"pykvtier replay: {message}\n")
    assert os.listdir(tmpdir) == []


def test_summary_counts_and_units(tmp_path):
    """One request, one job: singular nouns; the hit ratio's second figure counts prompt tokens
    (a request of 700 tokens in two 512-token trace blocks), loaded and stored whole blocks; GB
    is 1e9 B beside GiB sizes."""
    from pykvtier.replay import format_bytes

    req = [Request(0, 700, 1, (1, 2))]
    root = str(tmp_path / "root")
    first = run_replay(_config(root), req)
    s = run_replay(_config(root), req)  # the second run hits every block
    assert first.ok and s.ok, (first.error_samples, s.error_samples)
    assert (s.requests, s.load_jobs, s.store_jobs, s.blocks_loaded, s.blocks_stored) == (1, 1, 0, 8, 0)
    assert (s.block_hit_ratio, s.byte_hit_ratio) == (1.0, 1.0)
    assert (s.prompt_kv_bytes, s.hit_kv_bytes, s.bytes_loaded) == (700 * 256, 700 * 256, 8 * TINY_BS)
    lines = format_summary(s).splitlines()
    assert lines[0] == "pykvtier replay: 1 request of <in-memory>"
    assert lines[3] == "  blocks      8 requested, 8 looked up, 8 hit (0 pending), 0 RETRY answers"
    assert lines[4] == ("  hit ratio   blocks 100.00%, prompt tokens 100.00% (KV of the tokens hit: "
                        "175.00 KiB of 175.00 KiB)")
    assert lines[5].startswith(f"  loaded      {format_bytes(8 * TINY_BS)} in 1 job (8 whole blocks), ")
    assert " GB/s (GB = 1e9 B); per-request latency p50 " in lines[5]
    assert lines[6].startswith("  stored      0 B in 0 jobs (0 whole blocks written), ")
    assert lines[6].endswith(" GB/s; 0 blocks declined by the tier (capacity)")
    lines = format_summary(first).splitlines()
    assert lines[5].startswith("  loaded      0 B in 0 jobs (0 whole blocks), ")
    assert lines[6].startswith(f"  stored      {format_bytes(8 * TINY_BS)} in 1 job (8 whole blocks written), ")
    assert lines[3] == "  blocks      8 requested, 1 looked up, 0 hit (0 pending), 0 RETRY answers"


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
    """`pykvtier replay` with its defaults (about a minute, ~16 GiB written, 8 GiB on disk at
    most) on the storage under test: no verification failures, no errors, evictions."""
    rc = cli.main(["replay", "--root", os.path.join(root, "replay"), "--json"])
    d = json.loads(capsys.readouterr().out)
    assert rc == 0, d["error_samples"]
    assert d["verification_failures"] == 0 and d["errors"] == 0
    assert d["evictions"] > 0 and d["blocks_hit"] > 0


class _Tty(io.StringIO):
    def isatty(self):  # tqdm draws its bar only on a terminal
        return True


def test_progress_ends_on_the_summary_counts(root, monkeypatch):
    """The bar ends on the summary's figures: the last request's store job finishes after
    that request is counted, and still shows."""
    from pykvtier.replay import format_bytes

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
    assert re.search(r"\| 7/7 \[", last), last
    assert last.rstrip().endswith(want + "]"), last
    assert "in flight" not in last
    # the same figures as the text summary
    text = format_summary(s)
    assert f"hit ratio   blocks {s.block_hit_ratio:.2%}" in text
    assert f"loaded      {format_bytes(s.bytes_loaded)} in" in text
    assert f"stored      {format_bytes(s.bytes_stored)} in" in text


def test_signalled_children_get_sigint_at_its_default_action():
    """This process with SIGINT ignored (pytest as a background job): a plain child inherits
    that, one started through _python() has Python's KeyboardInterrupt handler."""
    code = "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        reset = subprocess.run(_python("-c", code), capture_output=True, text=True, timeout=60)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert (plain.stdout, reset.stdout, reset.returncode) == ("False\n", "True\n", 0)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_unwinds_and_removes_the_temporary_root(tmp_path, signum):
    """kill / timeout / a CI cancel / Ctrl-C: the replay stops, its temporary root removed."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(_python("-P", "-m", "pykvtier.cli", "replay", "--no-progress",
                                    "--model", "tiny", "--max-requests", "all"),
                            env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 120
        while not any(p.name.startswith("pykvtier-replay-") for p in tmp_path.iterdir()):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the replay never created its root"
            time.sleep(0.05)  # polling for the root to appear (not a synchronization by time)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signum, err
    assert err.splitlines()[-1] == _NOTICE[signum], err
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------
# signals at every point of a run: the clean-up holds (item 14)
#
# Points are events of the interpreter's profiler (sys.setprofile: every Python and C call and
# return in the main thread), counted from an anchor (the first call of a named function after
# the previous signal): deterministic places in the code, not moments in time.

_NOTICE = {signal.SIGTERM: "pykvtier: terminated (SIGTERM)", signal.SIGINT: "pykvtier: interrupted"}


def _event_name(frame, event, arg) -> str | None:
    if event == "call":
        return f"{frame.f_globals.get('__name__')}.{frame.f_code.co_qualname}"
    if event == "c_call":
        return getattr(arg, "__qualname__", None)
    return None


class SignalAt:
    """Profile function: ``shots`` = [(anchor, nth, offset, signum), ...]; shot i counts events
    from the ``nth`` call (1 = first) of ``anchor`` (``module.qualname``, or a C function's
    qualname) after shot i-1 fired and, at its ``offset``-th event, raises ``signum`` in this
    thread (``kill=True``: to the process, as ``kill`` does, any thread may take it). With no
    shots it measures: ``start[a]``, ``extent[a]`` = event index of the first call of each
    anchor of ``measure`` and how many events that call spans."""

    def __init__(self, shots=(), measure=(), kill=False):
        self.shots = list(shots)
        self.fired: list[tuple] = []
        self.where: list[str] = []  # the event each shot fired at
        self.kill = kill
        self.measure = set(measure)
        self.start: dict[str, int] = {}
        self.extent: dict[str, int] = {}
        self._open: dict[object, str] = {}  # frame (or C function) -> anchor
        self.n = 0
        self._calls = 0
        self._from: int | None = None

    def __call__(self, frame, event, arg):
        self.n += 1
        name = _event_name(frame, event, arg)
        if self.measure:
            if name in self.measure and name not in self.start:
                self.start[name] = self.n
                self._open[frame if event == "call" else arg] = name
            elif event in ("return", "c_return", "c_exception"):
                hit = self._open.pop(frame if event == "return" else arg, None)
                if hit is not None:
                    self.extent[hit] = self.n - self.start[hit]
        if not self.shots:
            return
        anchor, nth, offset, signum = self.shots[0]
        if self._from is None:
            if name != anchor:
                return
            self._calls += 1
            if self._calls < nth:
                return
            self._from = self.n
        if self.n - self._from < offset:
            return
        handler = signal.getsignal(signum)
        if not callable(handler) and not self.kill:
            return  # SIGTERM's default action would end pytest (never expected here)
        self.shots.pop(0)
        self._from = None
        self._calls = 0
        self.fired.append((anchor, nth, offset, signum))
        self.where.append(f"{event} {name or ''} in {frame.f_code.co_qualname}:{frame.f_lineno}")
        if not self.shots and not self.measure:
            sys.setprofile(None)
        if self.kill:
            os.kill(os.getpid(), signum)
        else:
            signal.raise_signal(signum)

    def _trace(self, frame, event, arg):
        # A handler that raises inside the profile function unsets it (CPython's rule for an
        # exception there): put it back at the next Python call while shots remain.
        if (self.shots or self.measure) and sys.getprofile() is None:
            sys.setprofile(self)

    def install(self) -> None:
        sys.setprofile(self)
        if len(self.shots) > 1 or (self.shots and self.measure):
            sys.settrace(self._trace)

    def uninstall(self) -> None:
        sys.setprofile(None)
        sys.settrace(None)


def _trace_file(path) -> str:
    with open(path, "w") as f:
        for ids, _ in HANDMADE:
            f.write(json.dumps({"timestamp": 0, "input_length": 512 * len(ids), "output_length": 1,
                                "hash_ids": ids}) + "\n")
    return str(path)


def _replay_argv(trace: str) -> list[str]:
    return ["replay", trace, "--model", "tiny", "--tokens-per-block", str(TINY_TPB),
            "--capacity", "none", "--max-requests", "all", "--no-progress", "--json"]


# Where signals go: the set-up (temporary root, arena and its prefault, the tier), the run, its
# end (drain), the clean-up (tier shutdown, the removal), and the report after it.
_SETUP = ("pykvtier.replay.run_replay", "tempfile.mkdtemp", "pykvtier.replay._allocate_arena",
          "mmap.madvise", "pykvtier.tier.DiskTier.__init__", "pykvtier.tier.DiskTier.set_arena")
_CLEANUP = ("pykvtier.tier.DiskTier.shutdown", "shutil.rmtree")
_LATER = ("pykvtier.tier.DiskTier.submit_store", "pykvtier.tier.DiskTier.submit_load",
          "pykvtier.tier.DiskTier.drain", "pykvtier.tier.DiskTier.shutdown", "shutil.rmtree",
          "pykvtier.replay.ReplaySummary.to_dict")


def _offsets(extent: int, limit: int) -> list[int]:
    """Every event of a span when it has few, else ``limit`` spread over it; and the first
    event after it."""
    if extent + 2 <= limit:
        return list(range(extent + 2))
    return sorted({round(i * extent / (limit - 2)) for i in range(limit - 1)} | {extent + 1})


@pytest.fixture
def fast_tmpdir(tmp_path):
    """An empty TMPDIR on tmpfs where there is one (a tier's start makes 258 directories)."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else str(tmp_path)
    d = tempfile.mkdtemp(prefix="pykvtier-test-", dir=base)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _stopped_run(argv, shots, tmpdir, capsys, monkeypatch, hook=None):
    """cli.main(argv) in this process with the shots; (rc, stderr, what fired, left behind)."""
    monkeypatch.setattr(tempfile, "tempdir", tmpdir)
    capsys.readouterr()
    hook = hook or SignalAt(shots)
    hook.install()
    try:
        rc = cli.main(argv)
    except (Exception, KeyboardInterrupt, cli._Terminated) as exc:  # escaped main(): a failure
        rc = f"{type(exc).__name__} raised: {exc}"
    finally:
        hook.uninstall()
    err = capsys.readouterr().err
    return rc, err, hook, sorted(os.listdir(tmpdir))


def _signal_plans(extent, start, unwinding):
    """Shots: one signal at each point (SIGTERM and SIGINT in turn), and more (``unwinding``:
    the extents of the clean-up's calls when a signal stopped the replay at its first store)."""
    term, intr = signal.SIGTERM, signal.SIGINT
    plans = []
    n = 0

    def one(anchor, nth, offset):
        nonlocal n
        plans.append([(anchor, nth, offset, (term, intr)[n % 2])])
        n += 1

    # the set-up, event by event where it is short: nothing runs in the background yet, so the
    # events from run_replay's start to the end of set_arena are the same in every run
    setup = start["pykvtier.tier.DiskTier.set_arena"] + extent["pykvtier.tier.DiskTier.set_arena"] \
        - start["pykvtier.replay.run_replay"]
    for off in _offsets(setup, 60):
        one("pykvtier.replay.run_replay", 1, off)
    for anchor in _SETUP[1:] + _LATER:
        for off in _offsets(extent[anchor], 24):
            one(anchor, 1, off)
    # the run: at each request's first key, and a few events later
    for nth in range(1, 65, 4):
        for off in (0, 9):
            one("pykvtier.replay.block_key", nth, off)
    # a second signal (the other one) while the first unwinds the replay: in the tier's
    # shutdown, in the removal of the root, in the notice itself
    for anchor in _CLEANUP:
        for j, off in enumerate(_offsets(unwinding[anchor], 8)):
            a, b = (term, intr) if j % 2 else (intr, term)
            plans.append([("pykvtier.tier.DiskTier.submit_store", 1, 0, a), (anchor, 1, off, b)])
    for a, b in ((term, intr), (intr, term)):
        plans.append([("pykvtier.tier.DiskTier.submit_load", 1, 0, a), ("print", 1, 0, b)])
        plans.append([("pykvtier.tier.DiskTier.drain", 1, 0, a), ("print", 1, 0, b)])
        plans.append([("pykvtier.tier.DiskTier.drain", 1, 0, a), ("print", 1, 0, b),
                      ("pykvtier.cli._Stop.uninstall", 1, 0, a)])
    return plans


@pytest.mark.skipif(sys.version_info < (3, 11), reason="anchors are qualified names (co_qualname)")
def test_signal_at_every_point_removes_the_temporary_root(tmp_path, fast_tmpdir, capsys,
                                                          monkeypatch, sigint_deliverable):
    """SIGTERM or SIGINT at each of ~270 points of a replay: before and during the creation of
    the temporary root, the arena's prefault, the tier's start, the run, its drain, the tier's
    shutdown, the root's removal and the report; alone or with more signals during the
    clean-up or the notice. Each time: exit 128 + the first signal, its one-line notice, and
    nothing left in TMPDIR."""
    trace = _trace_file(tmp_path / "t.jsonl")
    argv = _replay_argv(trace)

    # measure where the anchors are and how many events their calls span (no signal), after
    # a first run that did the imports
    monkeypatch.setattr(tempfile, "tempdir", fast_tmpdir)
    assert cli.main(argv) == 0
    probe = SignalAt(measure=_SETUP + _LATER)
    sys.setprofile(probe)
    try:
        assert cli.main(argv) == 0
    finally:
        sys.setprofile(None)
    capsys.readouterr()
    assert os.listdir(fast_tmpdir) == []
    assert set(probe.extent) == set(_SETUP + _LATER), sorted(set(_SETUP + _LATER) - set(probe.extent))

    # the same for the clean-up when a signal stopped the replay at its first store
    unwinding = SignalAt([("pykvtier.tier.DiskTier.submit_store", 1, 0, signal.SIGTERM)],
                         measure=_CLEANUP)
    assert _stopped_run(argv, None, fast_tmpdir, capsys, monkeypatch, unwinding)[0] == 143
    assert set(unwinding.extent) == set(_CLEANUP)

    plans = _signal_plans(probe.extent, probe.start, unwinding.extent)
    failures = []
    for shots in plans:
        rc, err, hook, left = _stopped_run(argv, shots, fast_tmpdir, capsys, monkeypatch)
        first = shots[0][3]
        ok = (hook.fired == shots and rc == 128 + first and left == []
              and err.splitlines().count(_NOTICE[first]) == 1
              and err.rstrip().endswith(_NOTICE[first]) and "Traceback" not in err)
        if not ok:
            failures.append(f"{shots}: fired at {hook.where}, rc {rc}, left {left}, "
                            f"stderr {err[-300:]!r}")
        for name in left:  # the next point starts from an empty TMPDIR
            shutil.rmtree(os.path.join(fast_tmpdir, name))
    assert len(plans) >= 250
    assert not failures, f"{len(failures)} of {len(plans)} points:\n" + "\n".join(failures[:10])


_CHILD = """
import os, sys
sys.path.insert(0, {tests!r})
from test_replay import SignalAt
hook = SignalAt({shots!r}, kill=True)
hook.install()
{body}
"""


def _child(tmp_path, shots, body):
    """A fresh interpreter that runs ``body`` with the shots sent by kill(2) to itself (any of
    its threads may take them: the engine's, numpy's); TMPDIR is tmp_path/tmp."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    code = _CHILD.format(tests=os.path.dirname(__file__), shots=shots, body=body)
    proc = subprocess.run(_python("-P", "-c", code), env={**os.environ, "TMPDIR": str(tmpdir)},
                          cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    return proc, sorted(os.listdir(tmpdir))


_TERM, _INT = int(signal.SIGTERM), int(signal.SIGINT)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="anchors are qualified names (co_qualname)")
@pytest.mark.parametrize("shots", [
    [("pykvtier.replay._allocate_arena", 1, 0, _TERM)],  # the root exists, the arena does not
    [("shutil.rmtree", 1, 300, _INT)],  # in the removal at the end of a run
    [("pykvtier.tier.DiskTier.submit_store", 1, 0, _TERM), ("shutil.rmtree", 1, 100, _INT)],
    [("pykvtier.tier.DiskTier.submit_load", 1, 0, _INT), ("pykvtier.tier.DiskTier.shutdown", 1, 1, _TERM),
     ("print", 1, 0, _INT)],
], ids=["term-before-arena", "int-in-removal", "term-then-int-in-removal",
        "int-then-term-in-shutdown-and-int-in-notice"])
def test_console_script_signalled_from_outside(tmp_path, shots):
    """``pykvtier replay`` as a process, signals sent with kill(2): exit status 128 + the first,
    its notice as the last line of stderr, no traceback, TMPDIR empty."""
    trace = _trace_file(tmp_path / "t.jsonl")
    proc, left = _child(tmp_path, shots, f"sys.argv = ['pykvtier', *{_replay_argv(trace)!r}]\n"
                                         "from pykvtier import cli\nsys.exit(cli.main())")
    first = shots[0][3]
    assert proc.returncode == 128 + first, proc.stderr
    assert proc.stderr.splitlines()[-1] == _NOTICE[first], proc.stderr
    assert "Traceback" not in proc.stderr
    assert left == []


@pytest.mark.skipif(sys.version_info < (3, 11), reason="anchors are qualified names (co_qualname)")
def test_library_replay_under_default_sigterm_cleans_up_then_dies_of_it(tmp_path):
    """run_replay() in a program that left SIGTERM at its default action: the temporary root
    is removed, then the process ends by SIGTERM as it would have."""
    trace = _trace_file(tmp_path / "t.jsonl")
    body = (f"from pykvtier.replay import ReplayConfig, run_replay\n"
            f"run_replay(ReplayConfig(trace={trace!r}, model='tiny', tokens_per_block={TINY_TPB}, "
            "max_requests=None, capacity_bytes=None, progress=False))\n"
            "print('not reached')")
    proc, left = _child(tmp_path, [("pykvtier.tier.DiskTier.submit_store", 1, 0, _TERM)], body)
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert "not reached" not in proc.stdout
    assert left == []


class _Stopped(BaseException):
    pass


def _raise_stopped(signum, frame):
    raise _Stopped(signum)


class _DropsIt:
    """Python drops an exception raised in __del__ (it only reports it)."""

    def __del__(self):
        signal.raise_signal(signal.SIGTERM)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("where", ["check", "release"])
def test_a_signal_whose_exception_was_dropped_is_delivered_again(where):
    """A signal handled inside a __del__ raises there and Python drops the exception: the
    replay delivers it again at its next check (per request, per wait), or at its end."""
    from pykvtier.replay import _SignalGuard

    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        guard = _SignalGuard()
        guard.install()
        try:
            _DropsIt()  # collected at once: the handler raised inside __del__, dropped
            assert guard.delivered == signal.SIGTERM
            if where == "check":
                with pytest.raises(_Stopped):
                    guard.check()
        finally:
            guard.hold = True
            if where == "release":
                with pytest.raises(_Stopped):
                    guard.release(unwinding=False)
            else:
                guard.release(unwinding=True)  # _Stopped is what unwinds: not sent again
        assert signal.getsignal(signal.SIGTERM) is _raise_stopped
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_remove_tree_is_idempotent_and_follows_no_link(tmp_path):
    from pykvtier.replay import _remove_tree

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"x")
    tree = tmp_path / "tree"
    (tree / "blocks" / "ab").mkdir(parents=True)
    (tree / "blocks" / "ab" / "f").write_bytes(b"y" * 100)
    (tree / "blocks" / "cd").symlink_to(outside)
    assert _remove_tree(str(tree)) is True
    assert not os.path.lexists(tree)
    assert (outside / "keep").read_bytes() == b"x"
    assert _remove_tree(str(tree)) is True  # already gone
