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
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

import pykvtier.probe as probe_module
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


def _by_token(results: list) -> dict:
    tokens = [r[0] for r in results]
    assert len(tokens) == len(set(tokens)), f"a probe was reported twice: {results}"
    return {token: (size, err) for token, size, err in results}


# -- results -------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 4095, 2 * 1024 * 1024 + 3, 5 * 2**30])
def test_existing_file_reports_exact_size(any_probe, tmp_path, size):
    path = _write(tmp_path / "block.bin", size)
    assert any_probe.submit([("key", str(path))]) == 1
    assert any_probe.wait() == [("key", size, 0)]
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
    assert any_probe.wait() == [(token, 10, 0), (token, 10, 0)]


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
    with _make_probe("io_uring") as uring, ExistenceProbe(backend="stat") as stat:
        assert uring.backend == "io_uring" and stat.backend == "stat"
        uring.submit(items)
        stat.submit(items)
        uring_results = _by_token(uring.wait())
        stat_results = _by_token(stat.wait())
    assert uring_results == stat_results
    assert len(uring_results) == len(items)
    # Spot checks, so that "identical" is not "identically wrong".
    assert uring_results["file5"] == (2 * 1024 * 1024, 0)
    assert uring_results["relative"] == (65537, 0)
    assert uring_results["link-to-file"] == (4096, 0)
    assert uring_results["dangling-link"] == (None, errno.ENOENT)
    assert uring_results["empty"] == (None, errno.ENOENT)
    assert uring_results["loop"] == (None, errno.ELOOP)
    assert uring_results["through-a-file"] == (None, errno.ENOTDIR)
    assert uring_results["long-component"] == (None, errno.ENAMETOOLONG)
    assert uring_results["longer-than-path-max"] == (None, errno.ENAMETOOLONG)


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
    assert first.poll() == [("f", 3, 0), ("g", None, errno.ENOENT)]
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
    assert probe.poll() == [("f", 9, 0)]
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
