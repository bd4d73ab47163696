"""Shared fixtures: storage roots (O_DIRECT-capable where possible) and page-aligned arenas.

Storage root
    ``PYKVTIER_TEST_ROOT`` set: every test gets a fresh subdirectory under it, removed after the
    test. Point it at the NVMe (or any file system) under test; tests marked ``nvme`` run only
    then. Unset: pytest's temporary directory when its file system takes O_DIRECT, else a
    session directory under ``/var/tmp`` when that one does (``/tmp`` is often tmpfs, which
    refuses O_DIRECT), else pytest's temporary directory anyway (buffered I/O only: tests that
    need O_DIRECT skip, saying why).

Fixtures
    ``root``: a fresh, empty directory (str) on that storage.
    ``direct_root``: the same, skipping the test when the file system refuses O_DIRECT.
    ``aligned``: ``aligned(nbytes, align=4096, fill=None)`` -> a page-aligned uint8 numpy
    array (``fill``: an int seed of random bytes, or None for zeros).
    ``arena``: ``arena(num_slots, slot_bytes, align=4096)`` -> a page-aligned 2-D uint8 array
    ``(num_slots, slot_bytes)``, zero-filled (``DiskTier.set_arena`` infers ``slot_bytes``).
    ``make_tier``: ``make_tier(root, **kw)`` -> a DiskTier (``block_size_bytes`` defaults to the
    test module's ``BS``), shut down at the end of the test.

Shared file system (tests marked ``sharedfs``)
    ``sharedfs``: ``(A, B)``, the two mount points of one JuiceFS volume (two nodes) that
    ``scripts/sharedfs.sh up DIR`` brought up: from ``PYKVTIER_SHAREDFS="A:B"`` (.ci/run sets
    it), else DIR=/tmp/pykvtier-sharedfs when both of its mounts are up. Neither: the test is
    skipped, saying why (``PYKVTIER_SHAREDFS_UNAVAILABLE``: the reason .ci/run got from the
    script, e.g. no FUSE here). A variable naming something that is not a fuse.juicefs mount
    fails the test (a broken set-up, not a missing one).
    ``shared_roots``: ``(root via A, root via B)``: one fresh directory of the volume, seen
    through each mount; removed after the test.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from pykvtier import DiskTier, _native

ENV_ROOT = "PYKVTIER_TEST_ROOT"
ENV_SHAREDFS = "PYKVTIER_SHAREDFS"
ENV_SHAREDFS_UNAVAILABLE = "PYKVTIER_SHAREDFS_UNAVAILABLE"
SHAREDFS_DEFAULT_DIR = "/tmp/pykvtier-sharedfs"
FUSE_SUPER_MAGIC = 0x65735546


def page_aligned(nbytes: int, align: int = 4096, fill: int | None = None) -> np.ndarray:
    """A uint8 array of ``nbytes`` whose first byte is ``align``-aligned (its base stays alive
    through ``.base``). ``fill``: seed of random content, None: zeros."""
    raw = np.zeros(nbytes + align, dtype=np.uint8)
    off = (-raw.ctypes.data) % align
    out = raw[off : off + nbytes]
    assert out.ctypes.data % align == 0
    if fill is not None:
        out[:] = np.random.default_rng(fill).integers(0, 256, nbytes, dtype=np.uint8)
    return out


def _probe(path: str) -> dict:
    try:
        return _native.probe_direct(path)
    except ValueError as exc:  # cannot even create a file there
        return {"direct": False, "reason": str(exc)}


@pytest.fixture(scope="session")
def storage_base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict]]:
    """(directory under which each test's root is made, its O_DIRECT probe)."""
    env = os.environ.get(ENV_ROOT)
    if env:
        os.makedirs(env, exist_ok=True)
        yield env, _probe(env)
        return
    base = str(tmp_path_factory.getbasetemp())
    probe = _probe(base)
    if probe["direct"]:
        yield base, probe
        return
    var_tmp = None
    if os.path.isdir("/var/tmp") and os.access("/var/tmp", os.W_OK):
        var_tmp = tempfile.mkdtemp(prefix="pykvtier-tests-", dir="/var/tmp")
        vprobe = _probe(var_tmp)
        if vprobe["direct"]:
            try:
                yield var_tmp, vprobe
            finally:
                shutil.rmtree(var_tmp, ignore_errors=True)
            return
        shutil.rmtree(var_tmp, ignore_errors=True)
    yield base, probe


@pytest.fixture
def root(storage_base: tuple[str, dict], request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh, empty directory for one test; removed afterwards."""
    base, _ = storage_base
    name = "".join(c if c.isalnum() else "_" for c in request.node.name)[:60]
    path = tempfile.mkdtemp(prefix=f"{name}-", dir=base)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def direct_root(root: str, storage_base: tuple[str, dict]) -> str:
    """As ``root``, but the test is skipped when the file system refuses O_DIRECT."""
    probe = storage_base[1]
    if not probe["direct"]:
        pytest.skip(
            f"{storage_base[0]} refuses O_DIRECT ({probe['reason']}); set {ENV_ROOT} to a "
            "directory on a file system that takes it (ext4, xfs, an NVMe mount; not tmpfs)"
        )
    return root


@pytest.fixture
def aligned() -> Callable[..., np.ndarray]:
    return page_aligned


@pytest.fixture
def arena() -> Callable[..., np.ndarray]:
    def make(num_slots: int, slot_bytes: int, align: int = 4096) -> np.ndarray:
        return page_aligned(num_slots * slot_bytes, align).reshape(num_slots, slot_bytes)

    return make


@pytest.fixture
def make_tier(request: pytest.FixtureRequest) -> Iterator[Callable[..., DiskTier]]:
    made: list[DiskTier] = []

    def make(root: str, **kw) -> DiskTier:
        kw.setdefault("block_size_bytes", request.module.BS)
        t = DiskTier(root, **kw)
        made.append(t)
        return t

    yield make
    for t in made:
        t.shutdown()


class Clock:
    """DiskTier's clock (``pykvtier.tier._now``: probe_ttl_s, statvfs intervals), moved by the
    test only: set ``t``, or ``tick()`` one second."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def tick(self, seconds: float = 1.0) -> None:
        self.t += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """The tier's clock, frozen at 1000 s until the test moves it."""
    import pykvtier.tier as tier_mod

    c = Clock()
    monkeypatch.setattr(tier_mod, "_now", c)
    return c


@pytest.fixture
def frozen_clock(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """DiskTier's clock 100 s ahead of now and frozen there; the fixture is its ``tick()``
    (one second on)."""
    import pykvtier.tier as tier_mod

    c = Clock(tier_mod._now() + 100.0)
    monkeypatch.setattr(tier_mod, "_now", c)
    return c.tick


def mount_fstype(path: str) -> str | None:
    """The file system type /proc/self/mountinfo gives the mount whose mount point is ``path``
    (e.g. "fuse.juicefs"), None when ``path`` is no mount point."""
    path = os.path.realpath(path)
    found = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if left.split()[4].encode().decode("unicode_escape") == path:
                found = right.split()[0]  # the last mount there is the one in effect
    return found


def _juicefs_mount_problem(path: str) -> str | None:
    """Why ``path`` is not a live JuiceFS mount, or None when it is."""
    fstype = mount_fstype(path)
    if fstype != "fuse.juicefs":
        return f"{path} is not a JuiceFS mount point (mount type {fstype!r})"
    try:
        os.statvfs(path)  # a dead client: ENOTCONN
    except OSError as exc:
        return f"{path} is a JuiceFS mount that does not answer ({exc.strerror})"
    return None


@pytest.fixture(scope="session")
def sharedfs() -> tuple[str, str]:
    """(A, B): the two mount points of one JuiceFS volume (see the module's doc)."""
    env = os.environ.get(ENV_SHAREDFS)
    if env:
        mounts = env.split(":")
        if len(mounts) != 2 or not all(mounts):
            pytest.fail(f"{ENV_SHAREDFS}={env!r}: expected two mount points, \"A:B\"")
        problems = [p for p in map(_juicefs_mount_problem, mounts) if p]
        if problems:
            pytest.fail(f"{ENV_SHAREDFS}={env!r}: " + "; ".join(problems))
        return mounts[0], mounts[1]
    default = (os.path.join(SHAREDFS_DEFAULT_DIR, "a"), os.path.join(SHAREDFS_DEFAULT_DIR, "b"))
    if not any(map(_juicefs_mount_problem, default)):
        return default
    why = os.environ.get(ENV_SHAREDFS_UNAVAILABLE)
    if why:
        pytest.skip(f"no shared file system: scripts/sharedfs.sh up failed here: {why}")
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no shared file system: /dev/fuse is missing (no FUSE here), and "
                    f"{ENV_SHAREDFS} is unset")
    pytest.skip(f"no shared file system: {ENV_SHAREDFS} is unset and "
                f"{SHAREDFS_DEFAULT_DIR} is not up; run `bash scripts/sharedfs.sh up "
                f"{SHAREDFS_DEFAULT_DIR}` (JuiceFS mounted twice through FUSE)")


@pytest.fixture
def shared_roots(sharedfs: tuple[str, str], request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """(the root through mount A, the same root through mount B): a fresh directory of the
    volume, removed (through A) after the test."""
    a, b = sharedfs
    name = "".join(c if c.isalnum() else "_" for c in request.node.name)[:60]
    root_a = tempfile.mkdtemp(prefix=f"{name}-", dir=a)
    root_b = os.path.join(b, os.path.basename(root_a))
    try:
        yield root_a, root_b
    finally:
        shutil.rmtree(root_a, ignore_errors=True)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("nvme") is not None and not os.environ.get(ENV_ROOT):
        pytest.skip(
            f"needs real O_DIRECT storage and room for large data: set {ENV_ROOT} to a "
            "directory on the NVMe (or other file system) under test"
        )
