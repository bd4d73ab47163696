"""Tests of the phase-1 existence probe (pykvtier.probe) on both backends.

``pykvtier._uring`` is normally built by CMake. When it is not importable (a source checkout),
the ``uring_module`` fixture builds it once per session with the cffi builder into a temporary
directory, linked to the system liburing, and registers it as ``pykvtier._uring`` in
``sys.modules`` so the probe imports it the ordinary way.
"""

from __future__ import annotations

import errno
import importlib.util
import logging
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

import pykvtier.probe as probe_module
from pykvtier.buffers import host_arena
from pykvtier.probe import ExistenceProbe

REPO_ROOT = Path(__file__).resolve().parents[1]
BUILDER = REPO_ROOT / "pykvtier" / "_uring_build.py"


# -- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def uring_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModuleType]:
    """``pykvtier._uring``: the installed one, else one built here for the session."""
    try:
        from pykvtier import _uring

        yield _uring
        return
    except ImportError:
        pass
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"pykvtier._uring not built and no C compiler ({compiler}) to build it")

    from pykvtier._uring_build import make_ffi

    build_dir = tmp_path_factory.mktemp("uring_build")
    so_path = make_ffi(libraries=["uring"]).compile(tmpdir=str(build_dir))
    spec = importlib.util.spec_from_file_location("pykvtier._uring", so_path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["pykvtier._uring"] = module
    try:
        yield module
    finally:
        sys.modules.pop("pykvtier._uring", None)


def _make_probe(backend: str, entries: int = 256) -> ExistenceProbe:
    try:
        return ExistenceProbe(entries, backend=backend)
    except OSError as exc:  # io_uring blocked here (seccomp, sysctl kernel.io_uring_disabled)
        pytest.skip(f"io_uring unavailable on this machine: {exc}")


@pytest.fixture
def uring_probe(uring_module: ModuleType) -> Iterator[ExistenceProbe]:
    with _make_probe("io_uring") as probe:
        yield probe


@pytest.fixture(params=["io_uring", "stat"])
def any_probe(request: pytest.FixtureRequest) -> Iterator[ExistenceProbe]:
    """A probe on each backend in turn."""
    if request.param == "io_uring":
        request.getfixturevalue("uring_module")
    with _make_probe(request.param) as probe:
        yield probe


def _write(path: Path, size: int) -> Path:
    """Create ``path`` with exactly ``size`` bytes (sparse beyond the first bytes)."""
    with open(path, "wb") as f:
        f.write(b"x" * min(size, 17))
        f.truncate(size)
    return path


def _triples(results: list) -> list:
    """(token, size_bytes, error) of each result."""
    return [(r.token, r.size_bytes, r.error) for r in results]


def _by_token(results: list) -> dict:
    tokens = [r.token for r in results]
    assert len(tokens) == len(set(tokens)), f"a probe was reported twice: {results}"
    return {r.token: (r.size_bytes, r.error) for r in results}


# -- results -------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 4095, 2 * 1024 * 1024 + 3, 5 * 2**30])
def test_existing_file_reports_exact_size(any_probe, tmp_path, size):
    path = _write(tmp_path / "block.bin", size)
    assert any_probe.submit([("key", str(path))]) == 1
    (result,) = any_probe.wait()
    assert result == ("key", size, 0, result.mode, 1)
    assert stat.S_ISREG(result.mode) and stat.S_IMODE(result.mode) == stat.S_IMODE(path.stat().st_mode)
    assert any_probe.in_flight == 0


def test_missing_file_is_enoent(any_probe, tmp_path):
    any_probe.submit([("absent", str(tmp_path / "absent.bin"))])
    any_probe.submit([("no-dir", str(tmp_path / "no" / "such" / "dir.bin"))])
    assert _by_token(any_probe.wait()) == {
        "absent": (None, errno.ENOENT),
        "no-dir": (None, errno.ENOENT),
    }


def test_tokens_are_returned_unchanged_and_may_repeat(any_probe, tmp_path):
    path = str(_write(tmp_path / "b", 10))
    token = ("request-7", b"\x01\x02", 3)
    any_probe.submit([(token, path), (token, path)])
    assert _triples(any_probe.wait()) == [(token, 10, 0), (token, 10, 0)]


def test_non_ascii_paths(any_probe, tmp_path):
    unicode_path = _write(tmp_path / "blöck-日本語-🙂.bin", 321)
    raw_name = b"\xff\xfe-not-utf8.bin"  # not decodable: os.fsdecode gives surrogate escapes
    raw_path = os.fsencode(tmp_path) + b"/" + raw_name
    with open(raw_path, "wb") as f:
        f.write(b"y" * 77)
    items = [
        ("unicode-str", str(unicode_path)),
        ("unicode-pathlike", unicode_path),
        ("raw-bytes", raw_path),
        ("surrogate-str", os.fsdecode(raw_path)),
        ("unicode-missing", str(tmp_path / "ключ-отсутствует.bin")),
    ]
    assert any_probe.submit(items) == 5
    assert _by_token(any_probe.wait()) == {
        "unicode-str": (321, 0),
        "unicode-pathlike": (321, 0),
        "raw-bytes": (77, 0),
        "surrogate-str": (77, 0),
        "unicode-missing": (None, errno.ENOENT),
    }


def _varied_paths(root: Path) -> list[tuple[str, object]]:
    """Paths covering found and not-found outcomes, some relative to the working directory."""
    for i, size in enumerate([0, 1, 512, 4096, 65537, 2 * 1024 * 1024]):
        _write(root / f"file{i}", size)
    (root / "dir").mkdir()
    os.symlink(root / "file3", root / "link-to-file")
    os.symlink(root / "gone", root / "dangling-link")
    os.symlink(root / "loop-b", root / "loop-a")
    os.symlink(root / "loop-a", root / "loop-b")
    items: list[tuple[str, object]] = [(f"file{i}", str(root / f"file{i}")) for i in range(6)]
    items += [
        ("relative", "file4"),
        ("relative-missing", "nothing-here"),
        ("empty", ""),
        ("dir", str(root / "dir")),
        ("link-to-file", str(root / "link-to-file")),
        ("dangling-link", str(root / "dangling-link")),
        ("loop", str(root / "loop-a")),
        ("through-a-file", str(root / "file1" / "child")),
        ("long-component", str(root / ("n" * 300))),
        ("longer-than-path-max", "/".join(["x" * 200] * 25)),
        ("missing", str(root / "missing")),
    ]
    return items


def test_fallback_gives_identical_results(uring_module, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    items = _varied_paths(tmp_path)
    with _make_probe("io_uring") as uring, ExistenceProbe(backend="stat") as stat_probe:
        assert uring.backend == "io_uring" and stat_probe.backend == "stat"
        uring.submit(items)
        stat_probe.submit(items)
        uring_results = {r.token: r for r in uring.wait()}
        stat_results = {r.token: r for r in stat_probe.wait()}
    assert uring_results == stat_results  # size, errno, mode and link count alike
    assert len(uring_results) == len(items)

    # Spot checks, so that "identical" is not "identically wrong".
    def short(token):
        r = uring_results[token]
        return r.size_bytes, r.error, stat.S_IFMT(r.mode), r.nlink

    assert short("file5") == (2 * 1024 * 1024, 0, stat.S_IFREG, 1)
    assert short("relative") == (65537, 0, stat.S_IFREG, 1)
    assert short("dir")[1:3] == (0, stat.S_IFDIR)
    # Links are never followed (AT_SYMLINK_NOFOLLOW / lstat): each is reported as itself, a
    # link whose size is the length of the path it holds.
    assert short("link-to-file") == (len(str(tmp_path / "file3")), 0, stat.S_IFLNK, 1)
    assert short("dangling-link") == (len(str(tmp_path / "gone")), 0, stat.S_IFLNK, 1)
    assert short("loop") == (len(str(tmp_path / "loop-b")), 0, stat.S_IFLNK, 1)
    assert short("empty") == (None, errno.ENOENT, 0, 0)
    assert short("missing") == (None, errno.ENOENT, 0, 0)
    assert short("through-a-file") == (None, errno.ENOTDIR, 0, 0)
    assert short("long-component") == (None, errno.ENAMETOOLONG, 0, 0)
    assert short("longer-than-path-max") == (None, errno.ENAMETOOLONG, 0, 0)


def test_hard_links_are_counted(any_probe, tmp_path):
    _write(tmp_path / "one", 100)
    os.link(tmp_path / "one", tmp_path / "two")
    _write(tmp_path / "single", 100)
    any_probe.submit([("one", tmp_path / "one"), ("two", tmp_path / "two"),
                      ("single", tmp_path / "single")])
    assert {r.token: (r.size_bytes, r.nlink) for r in any_probe.wait()} == {
        "one": (100, 2), "two": (100, 2), "single": (100, 1)}


# -- batching ------------------------------------------------------------------------------


def test_batch_of_100_is_one_submit_with_exact_results(uring_probe, tmp_path):
    expected = {}
    items = []
    for i in range(100):
        path = tmp_path / f"blk{i:03d}"
        if i % 3:
            _write(path, 1000 + i)
            expected[i] = (1000 + i, 0)
        else:
            expected[i] = (None, errno.ENOENT)
        items.append((i, str(path)))
    assert uring_probe.submit(items) == 100
    assert uring_probe.submits == 1
    assert uring_probe.probes == 100
    assert _by_token(uring_probe.wait()) == expected
    assert uring_probe.in_flight == 0
    assert uring_probe.submits == 1


def test_failing_sqe_does_not_split_the_batch(uring_probe, tmp_path):
    """A path the kernel rejects at submission time still costs no extra submit call."""
    _write(tmp_path / "a", 5)
    items = [("a", str(tmp_path / "a")), ("too-long", "x" * 5000), ("b", str(tmp_path / "b"))]
    uring_probe.submit(items)
    assert uring_probe.submits == 1
    assert _by_token(uring_probe.wait()) == {
        "a": (5, 0),
        "too-long": (None, errno.ENAMETOOLONG),
        "b": (None, errno.ENOENT),
    }


@pytest.mark.parametrize(("entries", "count", "submits"), [(16, 100, 7), (16, 16, 1), (4, 1000, 250)])
def test_batch_larger_than_the_ring(uring_module, tmp_path, entries, count, submits):
    """As few submits as the SQ ring allows; CQ overflow (more in flight than CQ slots) is lossless."""
    _write(tmp_path / "present", 42)
    items = [(i, str(tmp_path / ("present" if i % 2 else f"absent{i}"))) for i in range(count)]
    with _make_probe("io_uring", entries=entries) as probe:
        assert probe.submit(items) == count
        assert probe.submits == submits
        results = _by_token(probe.wait())
    assert results == {i: (42, 0) if i % 2 else (None, errno.ENOENT) for i in range(count)}


def test_empty_batch_submits_nothing(any_probe):
    assert any_probe.submit([]) == 0
    assert any_probe.submit(iter(())) == 0
    assert any_probe.submits == 0 and any_probe.probes == 0
    assert any_probe.poll() == []


# -- never blocking ------------------------------------------------------------------------


class _LibThatMustNotWait:
    """Forwards to the real cffi lib but fails the test on any call that can block."""

    BLOCKING = {"pykvtier_wait", "io_uring_wait_cqes", "io_uring_wait_cqe_nr"}

    def __init__(self, lib):
        self._lib = lib

    def __getattr__(self, name):
        if name in self.BLOCKING:
            raise AssertionError(f"{name} called where the probe must not wait")
        return getattr(self._lib, name)


def test_submit_and_poll_never_wait(uring_probe, tmp_path):
    _write(tmp_path / "present", 7)
    items = [(i, str(tmp_path / ("present" if i % 2 else f"absent{i}"))) for i in range(2000)]
    real_lib = uring_probe._lib
    uring_probe._lib = _LibThatMustNotWait(real_lib)
    uring_probe.submit(items)
    early = uring_probe.poll()  # whatever completed already, possibly nothing
    assert uring_probe.in_flight == len(items) - len(early)
    early += uring_probe.poll()
    assert uring_probe.in_flight == len(items) - len(early)
    uring_probe._lib = real_lib
    late = uring_probe.wait()
    assert uring_probe.in_flight == 0
    results = _by_token(early + late)
    assert results == {i: (7, 0) if i % 2 else (None, errno.ENOENT) for i in range(2000)}


def test_poll_with_nothing_in_flight_returns_empty(any_probe):
    assert any_probe.poll() == []
    assert any_probe.wait() == []
    assert any_probe.wait(timeout_s=0) == []


def test_wait_with_zero_timeout_returns_each_result_once(any_probe, tmp_path):
    items = [(i, str(tmp_path / f"absent{i}")) for i in range(500)]
    any_probe.submit(items)
    first = any_probe.wait(timeout_s=0)
    assert any_probe.in_flight == 500 - len(first)
    rest = any_probe.wait(timeout_s=30)
    assert any_probe.in_flight == 0
    assert _by_token(first + rest) == {i: (None, errno.ENOENT) for i in range(500)}


# -- fallback selection --------------------------------------------------------------------


def test_missing_extension_falls_back_to_stat_and_warns_once(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pykvtier._uring", None)  # makes the import fail
    monkeypatch.setattr(probe_module, "_fallback_logged", False)
    with caplog.at_level(logging.WARNING, logger="pykvtier"):
        first, second = ExistenceProbe(), ExistenceProbe()
    assert first.backend == second.backend == "stat"
    assert first.fallback_reason is not None and "pykvtier._uring" in first.fallback_reason
    assert len([r for r in caplog.records if r.name == "pykvtier"]) == 1
    _write(tmp_path / "f", 3)
    assert first.submit([("f", str(tmp_path / "f")), ("g", str(tmp_path / "g"))]) == 2
    assert first.submits == 0 and first.probes == 2
    assert first.in_flight == 2  # results wait for the next poll, as with io_uring
    assert _triples(first.poll()) == [("f", 3, 0), ("g", None, errno.ENOENT)]
    assert first.in_flight == 0
    with pytest.raises(ImportError):
        ExistenceProbe(backend="io_uring")
    first.close()
    second.close()


class _LibWhereRingSetupFails:
    """Forwards to the real cffi lib, but io_uring_queue_init fails as under a seccomp filter."""

    def __init__(self, lib, err: int):
        self._lib = lib
        self._err = err

    def io_uring_queue_init(self, entries, ring, flags):
        return -self._err

    def __getattr__(self, name):
        return getattr(self._lib, name)


@pytest.mark.parametrize("err", [errno.EPERM, errno.ENOSYS])
def test_ring_setup_failure_falls_back_to_stat(uring_module, tmp_path, monkeypatch, err):
    fake = ModuleType("pykvtier._uring")
    fake.ffi = uring_module.ffi
    fake.lib = _LibWhereRingSetupFails(uring_module.lib, err)
    monkeypatch.setitem(sys.modules, "pykvtier._uring", fake)
    monkeypatch.setattr(probe_module, "_fallback_logged", False)
    probe = ExistenceProbe()
    assert probe.backend == "stat"
    assert probe.fallback_reason is not None
    assert errno.errorcode[err] in probe.fallback_reason
    _write(tmp_path / "f", 9)
    probe.submit([("f", tmp_path / "f")])
    assert _triples(probe.poll()) == [("f", 9, 0)]
    probe.close()
    with pytest.raises(OSError) as excinfo:
        ExistenceProbe(backend="io_uring")
    assert excinfo.value.errno == err


def test_io_uring_backend_reports_no_fallback(uring_probe):
    assert uring_probe.backend == "io_uring"
    assert uring_probe.fallback_reason is None


# -- errors and lifetime -------------------------------------------------------------------


def test_argument_errors():
    with pytest.raises(ValueError):
        ExistenceProbe(0)
    with pytest.raises(ValueError):
        ExistenceProbe(65536)
    with pytest.raises(ValueError):
        ExistenceProbe(backend="posix")


def test_nul_in_path_rejects_the_whole_batch(any_probe, tmp_path):
    with pytest.raises(ValueError):
        any_probe.submit([("ok", str(tmp_path / "a")), ("bad", "a\0b")])
    with pytest.raises(TypeError):
        any_probe.submit([("bad", 42)])
    assert any_probe.in_flight == 0 and any_probe.probes == 0 and any_probe.submits == 0


def test_negative_timeout_is_rejected(any_probe):
    with pytest.raises(ValueError):
        any_probe.wait(timeout_s=-1)


@pytest.mark.parametrize("backend", ["io_uring", "stat"])
def test_close_waits_for_in_flight_and_is_idempotent(request, tmp_path, backend):
    if backend == "io_uring":
        request.getfixturevalue("uring_module")
    probe = _make_probe(backend)
    probe.submit([(i, str(tmp_path / f"absent{i}")) for i in range(300)])
    probe.close()
    assert probe.in_flight == 0
    probe.close()
    for call in (lambda: probe.submit([]), probe.poll, probe.wait):
        with pytest.raises(ValueError):
            call()
    with pytest.raises(ValueError):
        probe.__enter__()


def test_context_manager_closes(uring_module, tmp_path):
    with _make_probe("io_uring") as probe:
        probe.submit([("a", str(tmp_path / "a"))])
    with pytest.raises(ValueError):
        probe.poll()


# -- the builder as CMake runs it ----------------------------------------------------------


def test_builder_script_emits_c_source(tmp_path):
    out = tmp_path / "_uring.c"
    subprocess.run([sys.executable, str(BUILDER), str(out)], check=True, capture_output=True)
    source = out.read_text()
    assert "PyInit__uring" in source
    assert "#include <liburing.h>" in source
    assert "Py_BEGIN_ALLOW_THREADS" in source  # the GIL is released around C calls
    usage = subprocess.run([sys.executable, str(BUILDER)], capture_output=True)
    assert usage.returncode == 2


# -- one call into C per batch -------------------------------------------------------------


class _CountingLib:
    """Forwards to the real cffi lib, counting the calls by name."""

    def __init__(self, lib):
        self._lib = lib
        self.calls: dict[str, int] = {}

    def __getattr__(self, name):
        attr = getattr(self._lib, name)
        if not callable(attr):
            return attr

        def call(*args):
            self.calls[name] = self.calls.get(name, 0) + 1
            return attr(*args)

        return call


def _packed(paths: list[bytes]) -> tuple[bytes, int]:
    stride = max(map(len, paths)) + 1
    return b"".join(p.ljust(stride, b"\0") for p in paths), stride


def test_a_batch_is_one_call_into_c_to_submit_and_one_to_reap(uring_module, tmp_path):
    _write(tmp_path / "present", 42)
    paths = [os.fsencode(tmp_path / ("present" if i % 3 == 0 else f"absent{i}")) for i in range(3600)]
    blob, stride = _packed(paths)
    with _make_probe("io_uring", entries=4096) as probe:
        counting = _CountingLib(probe._lib)
        probe._lib = counting
        first = probe.submit_packed(list(range(3600)), blob, stride)
        assert counting.calls == {"pykvtier_statx_submit": 1}
        assert probe.submits == 1 and probe.probes == 3600
        counting.calls.clear()
        assert probe.wait_completed(timeout_s=60)
        # one reap per wake-up of the wait (each reap takes every CQE there), none per probe
        assert set(counting.calls) <= {"pykvtier_statx_submit", "pykvtier_wait", "pykvtier_statx_reap"}
        assert counting.calls["pykvtier_statx_reap"] <= counting.calls.get("pykvtier_wait", 0) + 1
        counting.calls.clear()
        results = probe.poll()  # all reaped already: handed out without a call into C
        assert counting.calls == {} and probe.in_flight == 0
    assert first & 0xFFFFFFFF == 0
    assert _by_token(results) == {i: (42, 0) if i % 3 == 0 else (None, errno.ENOENT) for i in range(3600)}


def test_poll_hands_out_bounded_slices(uring_probe, tmp_path):
    _write(tmp_path / "present", 5)
    items = [(i, tmp_path / ("present" if i % 2 else f"absent{i}")) for i in range(100)]
    uring_probe.submit(items)
    assert uring_probe.wait_completed(timeout_s=60)
    slices = [uring_probe.poll(max_results=16) for _ in range(7)]
    assert [len(s) for s in slices] == [16, 16, 16, 16, 16, 16, 4]
    assert uring_probe.poll(max_results=16) == [] and uring_probe.in_flight == 0
    assert _by_token([r for s in slices for r in s]) == {
        i: (5, 0) if i % 2 else (None, errno.ENOENT) for i in range(100)}
    with pytest.raises(ValueError):
        uring_probe.poll(max_results=-1)


class _LibWhereNothingCompletes:
    """Forwards to the real cffi lib, but reaps nothing: every probe looks in flight."""

    def __init__(self, lib):
        self._lib = lib

    def pykvtier_statx_reap(self, *args):
        return 0

    def __getattr__(self, name):
        return getattr(self._lib, name)


def test_take_answers_one_ticket_exactly_once(any_probe, tmp_path):
    _write(tmp_path / "a", 7)
    paths = [os.fsencode(tmp_path / n) for n in ("a", "b", "a", "c")]
    blob, stride = _packed(paths)
    first = any_probe.submit_packed(["a0", "b", "a2", "c"], blob, stride)
    if any_probe.backend == "io_uring":
        real = any_probe._lib
        any_probe._lib = _LibWhereNothingCompletes(real)
        assert any_probe.take(first + 2) is None  # not reaped yet: in flight
        any_probe._lib = real
        assert any_probe.wait_completed(timeout_s=60)
    r = any_probe.take(first + 2)
    assert (r.token, r.size_bytes, r.error, r.nlink) == ("a2", 7, 0, 1) and stat.S_ISREG(r.mode)
    with pytest.raises(KeyError):
        any_probe.take(first + 2)  # handed out already
    with pytest.raises(KeyError):
        any_probe.take(first + 4)  # no such probe
    assert any_probe.take(first + 1) == ("b", None, errno.ENOENT, 0, 0)
    rest = any_probe.poll()  # the two not taken, each once
    assert _by_token(rest) == {"a0": (7, 0), "c": (None, errno.ENOENT)}
    assert any_probe.in_flight == 0
    with pytest.raises(KeyError):
        any_probe.take(first)


def test_take_reaps_a_bounded_number_of_completions(uring_module, tmp_path):
    _write(tmp_path / "p", 3)
    paths = [os.fsencode(tmp_path / ("p" if i % 2 else f"absent{i}")) for i in range(1000)]
    blob, stride = _packed(paths)
    with _make_probe("io_uring", entries=1024) as probe:
        first = probe.submit_packed(list(range(1000)), blob, stride)
        assert probe._lib.pykvtier_wait(probe._ring, 1000, -1) == 0  # all in the CQ, none reaped
        r = probe.take(first + 999)
        assert probe._out_count - probe._out_pos == probe_module.TAKE_REAP_MAX == 64
        assert probe._unreaped == 1000 - 64
        if r is None:  # its completion was not among the 64 oldest
            assert not probe._batches[first >> 32].reqs[999].done
        else:
            assert r == (999, 3, 0, r.mode, 1)
        rest = probe.poll()
        assert len(rest) == 1000 - (r is not None) and probe.in_flight == 0
        results = _by_token(rest + ([r] if r is not None else []))
    assert results == {i: (3, 0) if i % 2 else (None, errno.ENOENT) for i in range(1000)}


def test_submit_packed_rejects_bad_buffers(any_probe):
    with pytest.raises(ValueError, match="stride"):
        any_probe.submit_packed(["a"], b"/x\0", 0)
    with pytest.raises(ValueError, match="need 8"):
        any_probe.submit_packed(["a", "b"], b"/x\0\0/y\0", 4)
    with pytest.raises(ValueError, match="path 1 of the batch is not NUL-terminated"):
        any_probe.submit_packed(["a", "b"], b"/x\0\0/yyy", 4)
    assert any_probe.in_flight == 0 and any_probe.probes == 0


class _LibWhereSubmitFails:
    def __init__(self, lib, err):
        self._lib, self._err = lib, err

    def pykvtier_statx_submit(self, *args):
        return -self._err

    def __getattr__(self, name):
        return getattr(self._lib, name)


def test_probes_the_kernel_refuses_complete_with_its_errno(uring_probe, tmp_path):
    real = uring_probe._lib
    uring_probe._lib = _LibWhereSubmitFails(real, errno.ENOMEM)
    uring_probe.submit([(i, tmp_path / f"x{i}") for i in range(10)])
    uring_probe._lib = real
    assert _by_token(uring_probe.poll()) == {i: (None, errno.ENOMEM) for i in range(10)}
    _write(tmp_path / "y", 3)
    uring_probe.submit([("y", tmp_path / "y")])  # the probe still works
    assert _triples(uring_probe.wait()) == [("y", 3, 0)]


def test_builder_releases_the_gil_in_the_batch_calls(tmp_path):
    out = tmp_path / "_uring.c"
    subprocess.run([sys.executable, str(BUILDER), str(out)], check=True, capture_output=True)
    source = out.read_text()
    for fn in ("pykvtier_statx_submit", "pykvtier_statx_reap", "pykvtier_wait"):
        body = source[source.index(f"_cffi_f_{fn}(PyObject *self, PyObject *args)"):]
        body = body[:body.index("\n}\n")]
        assert "Py_BEGIN_ALLOW_THREADS" in body and f"{{ result = {fn}(" in body, fn


# -- the tier's probe: symlinks, hard links, a storm ----------------------------------------

from pykvtier import DiskTier, LookupResult, TransferJob  # noqa: E402
from pykvtier.layout import HEADER_BYTES, key_digest  # noqa: E402
import pykvtier.tier as tier_mod  # noqa: E402

HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
HIT_PENDING = LookupResult.HIT_PENDING
BS = 64 << 10


def _block_file(tier: DiskTier, key: bytes) -> str:
    path = tier.layout.block_path(key_digest(key))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return path


@pytest.fixture
def shared_pair(root):
    """(writer, shared tier): the writer stores `b"real"`; the shared tier started before it."""
    reader = DiskTier(root, BS, shared=True, probe_ttl_s=3600)
    writer = DiskTier(root, BS, shared=True)
    src = np.random.default_rng(3).integers(0, 256, (1, BS), dtype=np.uint8)
    arena_w = host_arena(1, BS)
    arena_w[...] = src
    writer.set_arena(arena_w)
    writer.submit_store(TransferJob(1, [b"real"], [0]))
    writer.drain()
    (res,) = writer.get_finished_jobs()
    assert res.success
    try:
        yield writer, reader
    finally:
        reader.shutdown()
        writer.shutdown()


def _probe_once(tier: DiskTier, keys: list[bytes]) -> list:
    assert [tier.lookup(k) for k in keys] == [RETRY] * len(keys)
    tier.on_step_end()
    tier.drain()
    return [tier.lookup(k) for k in keys]


def test_symlink_at_a_block_path_is_a_miss(shared_pair, tmp_path):
    writer, reader = shared_pair
    real = writer.layout.block_path(key_digest(b"real"))
    outside = tmp_path / "outside.kvb"
    shutil.copyfile(real, outside)  # a block-sized file outside the root
    os.symlink(outside, _block_file(reader, b"link-out"))
    os.symlink(real, _block_file(reader, b"link-in"))  # to a real block of the root
    assert _probe_once(reader, [b"real", b"link-out", b"link-in"]) == [HIT, MISS, MISS]
    s = reader.stats()
    assert s["probes"] == 3 and s["probe_hits"] == 1 and s["probe_results_applied"] == 3
    assert reader.num_blocks == 1 and reader.used_bytes == BS + HEADER_BYTES


def test_block_file_with_two_links_is_a_miss(shared_pair):
    writer, reader = shared_pair
    os.link(writer.layout.block_path(key_digest(b"real")), _block_file(reader, b"hard"))
    d = _block_file(reader, b"dir")
    os.mkdir(d)
    # both names of the twice-linked file are refused, as is a directory
    assert _probe_once(reader, [b"real", b"hard", b"dir"]) == [MISS, MISS, MISS]
    assert reader.stats()["probe_hits"] == 0 and reader.num_blocks == 0


def test_shared_block_removed_elsewhere_is_probed_again(shared_pair, tmp_path, monkeypatch):
    """A shared tier's load of a block another process or node removed fails (ENOENT) without
    marking the key failed: the block is forgotten, a MISS for probe_ttl_s (as after a probe's
    "not found"; a node's stale attribute cache could make a probe at once a HIT whose load
    fails again: tests/test_sharedfs.py), then a lookup probes the root again and finds it once
    it is stored there again, and it loads byte-exact."""
    now = [tier_mod._now()]
    monkeypatch.setattr(tier_mod, "_now", lambda: now[0])
    writer, reader = shared_pair
    real = writer.layout.block_path(key_digest(b"real"))
    assert _probe_once(reader, [b"real"]) == [HIT]
    kept = tmp_path / "kept.kvb"
    shutil.copyfile(real, kept)
    os.unlink(real)  # removed by another node
    a = host_arena(1, BS)
    reader.set_arena(a)
    reader.submit_load(TransferJob(5, [b"real"], [0]))
    reader.drain()
    (res,) = reader.get_finished_jobs()
    assert res.success is False and res.failed_keys == {b"real": "ENOENT: No such file or directory"}
    assert reader.num_blocks == 0 and reader.used_bytes == 0
    shutil.copyfile(kept, real)  # stored there again
    assert reader.lookup(b"real") is MISS  # not probed before probe_ttl_s
    now[0] += reader.probe_ttl_s
    assert _probe_once(reader, [b"real"]) == [HIT]
    reader.submit_load(TransferJob(6, [b"real"], [0]))
    reader.drain()
    (res,) = reader.get_finished_jobs()
    assert res.success is True
    with open(real, "rb") as f:
        assert f.read()[HEADER_BYTES:] == a[0].tobytes()
    s = reader.stats()
    assert (s["load_failures"], s["blocks_loaded"], s["probe_hits"]) == (1, 1, 2)


def _storm(root, n_keys: int, n_loads: int):
    """A shared tier with `n_loads` loads in flight and `n_keys` unknown keys (every third
    published by another writer after the tier's start) asked in one step."""
    tier = DiskTier(root, BS, shared=True, probe_ttl_s=3600)
    arena = host_arena(2 * n_loads, BS)
    src = np.random.default_rng(5).integers(0, 256, (n_loads, BS), dtype=np.uint8)
    arena[:n_loads] = src
    tier.set_arena(arena)
    pool = [b"pool-%d" % i for i in range(n_loads)]
    tier.submit_store(TransferJob(1, pool, list(range(n_loads))))
    tier.drain()
    (res,) = tier.get_finished_jobs()
    assert res.success
    keys = [b"storm-%d" % i for i in range(n_keys)]
    present = {k for i, k in enumerate(keys) if i % 3 == 0}
    for k in present:
        with open(_block_file(tier, k), "wb") as f:
            f.truncate(BS + HEADER_BYTES)
    for i, k in enumerate(pool):  # loads in flight through the storm
        tier.submit_load(TransferJob(100 + i, [k], [n_loads + i]))
    return tier, keys, present, arena, src


def test_probe_storm_resolves_every_key_exactly(root):
    tier, keys, present, arena, src = _storm(root, 3600, 16)
    try:
        assert [tier.lookup(k) for k in keys] == [RETRY] * 3600  # step 1
        tier.on_step_end()
        s = tier.stats()
        assert s["probes"] == 3600 and s["probe_results_applied"] == 0
        assert tier._probe.wait_completed(timeout_s=60)  # completed, not applied yet
        # step 2: every key answers, each lookup applying its own probe's result only
        applied = []
        answers = []
        for k in reversed(keys):  # not the order they were submitted in
            before = tier.stats()["probe_results_applied"]
            answers.append(tier.lookup(k))
            applied.append(tier.stats()["probe_results_applied"] - before)
        assert answers == [HIT if k in present else MISS for k in reversed(keys)]
        assert applied == [1] * 3600
        assert [tier.lookup(k) for k in keys] == [HIT if k in present else MISS for k in keys]
        s = tier.stats()
        assert s["probes"] == 3600 and s["probe_hits"] == len(present) == 1200
        assert s["probe_results_applied"] == 3600 and s["hits"] == 2400 and s["misses"] == 4800
        assert s["retries"] == 3600 and tier.num_blocks == 16 + 1200
        tier.drain()
        loads = tier.get_finished_jobs()
        assert sorted(r.job_id for r in loads) == list(range(100, 116))
        assert all(r.success for r in loads)
        assert np.array_equal(arena[16:], src)
        assert not tier.has_pending_work()
    finally:
        tier.shutdown()


def test_a_lookup_applies_at_most_its_own_probe_result_get_finished_jobs_a_slice(root):
    from pykvtier.tier import _FINISHED_PROBE_SLICE

    n = _FINISHED_PROBE_SLICE + 904  # more than one slice (and more than the SQ ring holds)
    tier, keys, present, _arena, _src = _storm(root, n, 4)
    try:
        for k in keys:
            tier.lookup(k)
        tier.on_step_end()
        assert tier._probe.submits == 2  # the 4096-entry ring took the batch in two submits
        assert tier._probe.wait_completed(timeout_s=60)
        applied = tier.stats()["probe_results_applied"]
        assert tier.lookup(b"pool-0") is HIT_PENDING  # known block (being loaded): nothing
        assert tier.lookup(b"never-seen") is RETRY  # queued for the next step: nothing
        assert tier.stats()["probe_results_applied"] == applied == 0
        assert tier.lookup(keys[500]) is MISS  # its own result only (500 % 3 != 0)
        assert tier.lookup(keys[999]) is HIT
        assert tier.stats()["probe_results_applied"] == 2
        tier.get_finished_jobs()  # a bounded slice
        assert tier.stats()["probe_results_applied"] == 2 + _FINISHED_PROBE_SLICE
        tier.on_step_end()  # the rest, and submits b"never-seen"
        s = tier.stats()
        assert s["probe_results_applied"] == n and s["probe_hits"] == len(present) == (n + 2) // 3
        assert s["probes"] == n + 1
        assert [tier.lookup(k) for k in keys] == [HIT if k in present else MISS for k in keys]
        assert tier.stats()["probe_results_applied"] == n  # all from the index now
        tier.drain()
    finally:
        tier.shutdown()


def test_probe_storm_bench_runs_and_checks_its_answers(tmp_path):
    """bench/probe_storm.py end to end at a small size (it exits non-zero on a wrong answer or
    a wrong probe count); the old path too where git can show the old commit."""
    script = REPO_ROOT / "bench" / "probe_storm.py"
    has_old = subprocess.run(["git", "-C", str(REPO_ROOT), "cat-file", "-e", "150a034^{commit}"],
                             capture_output=True).returncode == 0
    args = [sys.executable, str(script), "--dir", str(tmp_path / "bench"), "--keys", "300",
            "--loads", "4", "--pool", "4", "--block-size", "64K", "--step-ms", "1", "--rounds", "1",
            "--cache", "warm", "--path", "both" if has_old else "new", "--json", str(tmp_path / "o.json")]
    run = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    import json

    out = json.loads((tmp_path / "o.json").read_text())
    for path in ("new", "old") if has_old else ("new",):
        (r,) = out["runs"][path]["warm"]
        # step 1 asks all 300 (RETRY), later steps only the keys still unanswered
        assert r["steps"] >= 2 and len(r["lookup_ns"]) >= 300 + 1
    assert not (tmp_path / "bench").exists()  # removed without --keep


def test_a_lookup_that_applies_its_probe_answers_as_the_index_would(root):
    for ttl, after in ((3600, MISS), (0, RETRY)):  # 0: the MISS expired at once: probed again
        tier = DiskTier(os.path.join(root, str(ttl)), BS, shared=True, probe_ttl_s=ttl)
        try:
            with open(_block_file(tier, b"there"), "wb") as f:
                f.truncate(BS + HEADER_BYTES)
            assert [tier.lookup(k) for k in (b"there", b"absent")] == [RETRY, RETRY]
            tier.on_step_end()
            assert tier._probe.wait_completed(timeout_s=60)
            assert [tier.lookup(k) for k in (b"there", b"absent")] == [HIT, after]
            s = tier.stats()
            assert s["probe_results_applied"] == 2 and s["probe_hits"] == 1
            tier.on_step_end()
            assert tier.stats()["probes"] == (2 if ttl else 3)
            tier.drain()
        finally:
            tier.shutdown()


def test_tier_probe_on_the_lstat_fallback(root, tmp_path, monkeypatch):
    """Where io_uring is unavailable the tier's probe is os.lstat: the same answers."""
    monkeypatch.setitem(sys.modules, "pykvtier._uring", None)
    monkeypatch.setattr(probe_module, "_fallback_logged", False)
    tier = DiskTier(root, BS, shared=True, probe_ttl_s=3600)
    try:
        assert tier._probe.backend == "stat"
        with open(_block_file(tier, b"there"), "wb") as f:
            f.truncate(BS + HEADER_BYTES)
        outside = tmp_path / "outside"
        _write(outside, BS + HEADER_BYTES)
        os.symlink(outside, _block_file(tier, b"link"))
        keys = [b"there", b"link", b"absent"]
        assert [tier.lookup(k) for k in keys] == [RETRY] * 3
        tier.on_step_end()
        assert [tier.lookup(k) for k in keys] == [HIT, MISS, MISS]
        s = tier.stats()
        assert s["probes"] == 3 and s["probe_hits"] == 1 and s["probe_results_applied"] == 3
        assert not tier.has_pending_work()
    finally:
        tier.shutdown()


def test_shared_tier_takes_numpy_keys_as_their_bytes(shared_pair):
    """A numpy key (a strided column too) is the key of its bytes on a shared tier's probe
    path and in touch, as lookups and jobs of an unshared tier take it; a str stays refused."""
    writer, reader = shared_pair
    col = np.frombuffer(b"rxeyaxlx", dtype=np.uint8)[::2]  # b"real"
    assert col.tobytes() == b"real"
    assert reader.lookup(col) is RETRY
    reader.on_step_end()
    reader.drain()
    assert reader.lookup(col) is HIT and reader.lookup(b"real") is HIT
    reader.touch([col, np.frombuffer(b"real", dtype=np.uint8)])
    with pytest.raises(TypeError, match="key must be bytes, not str"):
        reader.touch(["real"])
