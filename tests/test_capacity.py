"""Capacity under faults (issue #9 items 7 and 8): files that cannot be removed stay counted and
are removed later; a file system that fills up is handled by eviction, not by failing every
store from then on; per-key warnings are aggregated.

Faults are real: ``chattr +i`` / ``+a`` on a fan-out directory (ext4, as root) makes unlinks /
renames there fail with EPERM; a tmpfs mounted with ``size=`` fills up (ENOSPC). Each test
skips, saying why, where that is not possible. The tier's clock (``pykvtier.tier._now``:
statvfs interval, leftover retry interval, warning interval) is replaced by a hand-moved one,
so nothing depends on timing.
"""

from __future__ import annotations

import errno
import glob
import logging
import os
import subprocess
import tempfile
from collections.abc import Iterator

import numpy as np
import pytest

from pykvtier import DiskTier, LookupResult, TransferJob
from pykvtier.layout import HEADER_BYTES, key_digest

BS = 64 << 10
FB = BS + HEADER_BYTES  # 17 pages of 4 KiB
HIT, MISS = LookupResult.HIT, LookupResult.MISS







def fill(arr: np.ndarray, seed: int) -> np.ndarray:
    arr[...] = np.random.default_rng(seed).integers(0, 256, arr.shape, dtype=np.uint8)
    return arr


def run(tier: DiskTier, job_id: int, keys, slots, load: bool = False):
    job = TransferJob(job_id, list(keys), list(slots))
    (tier.submit_load if load else tier.submit_store)(job)
    tier.drain()
    (res,) = tier.get_finished_jobs()
    assert res.job_id == job_id
    return res


def keys_in_distinct_fanouts(n: int, tag: bytes) -> list[bytes]:
    out, seen, i = [], set(), 0
    while len(out) < n:
        k = b"%s-%d" % (tag, i)
        i += 1
        sub = key_digest(k).hex()[:2]
        if sub not in seen:
            seen.add(sub)
            out.append(k)
    return out


def pykvtier_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "pykvtier" and r.levelno == logging.WARNING]


# ------------------------------------------------------------------------- item 7: leftovers


class Attr:
    """chattr on directories, undone at the end of the test."""

    def __init__(self) -> None:
        self.set: list[tuple[str, str]] = []

    def __call__(self, path: str, flag: str) -> None:
        subprocess.run(["chattr", f"+{flag}", path], check=True, capture_output=True)
        self.set.append((path, flag))

    def clear(self, path: str, flag: str) -> None:
        subprocess.run(["chattr", f"-{flag}", path], check=True, capture_output=True)
        self.set.remove((path, flag))


@pytest.fixture
def chattr(root):
    probe = os.path.join(root, "chattr-probe")
    os.mkdir(probe)
    try:
        r = subprocess.run(["chattr", "+i", probe], capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("chattr is not installed (e2fsprogs)")
    if r.returncode != 0:
        pytest.skip(f"chattr +i refused at {root}: {r.stderr.strip()} (needs root on ext4/xfs)")
    subprocess.run(["chattr", "-i", probe], check=True)
    os.rmdir(probe)
    a = Attr()
    yield a
    for path, flag in list(a.set):
        a.clear(path, flag)


@pytest.mark.parametrize("engine", ["uring", "posix"])
def test_an_eviction_whose_unlink_fails_stays_counted_until_removed(root, make_tier, arena,
                                                                    chattr, clock, caplog,
                                                                    engine):
    """The victim's fan-out directory is immutable: its unlink fails (EPERM). The file stays
    in used_bytes and its name is refused to stores; its removal is retried at most once a
    second and succeeds once the fault is gone. (Before: it dropped out of used_bytes and the
    index at once and stayed on disk, uncounted, until the next start.)"""
    tier = make_tier(root, capacity_bytes=3 * FB, recycle=False, engine=engine)
    a = fill(arena(4, BS), 1)
    tier.set_arena(a)
    k = keys_in_distinct_fanouts(4, b"ev")
    for i in range(3):  # k[0] is the least recently used
        assert run(tier, i + 1, [k[i]], [i]).success is True
    victim = tier.layout.block_path(key_digest(k[0]))
    chattr(os.path.dirname(victim), "i")
    with caplog.at_level(logging.WARNING, logger="pykvtier"):
        assert run(tier, 4, [k[3]], [3]).success is True  # evicts k[0]: its unlink fails
    s = tier.stats()
    assert (s["evictions"], s["eviction_failures"], s["leftover_files"]) == (1, 1, 1)
    assert tier.used_bytes == 4 * FB and tier.num_blocks == 3  # 3 blocks + the leftover
    assert os.path.exists(victim)
    assert [tier.lookup(x) for x in k] == [MISS, HIT, HIT, HIT]
    (line,) = pykvtier_warnings(caplog)
    assert ("1 evicted files could not be removed (counted; removal retried) (EPERM: "
            f"Operation not permitted; e.g. {victim})") in line
    res = run(tier, 5, [k[0]], [0])  # its old file is still there: not stored over
    assert res.failed_keys == {k[0]: "an earlier file of this block could not be removed yet"}
    chattr.clear(os.path.dirname(victim), "i")
    assert tier.get_finished_jobs() == []  # less than a second since the last try
    assert os.path.exists(victim) and tier.stats()["leftover_files"] == 1
    clock.t += 1.0
    assert tier.get_finished_jobs() == []
    s = tier.stats()
    assert (s["leftover_files"], s["leftovers_removed"]) == (0, 1)
    assert not os.path.exists(victim)
    assert tier.used_bytes == 3 * FB
    src = a[0].copy()
    assert run(tier, 6, [k[0]], [0]).success is True  # evicts k[1]
    a[:] = 0
    assert run(tier, 7, [k[0]], [1], load=True).success is True
    assert np.array_equal(a[1], src)
    assert sorted(glob.glob(os.path.join(tier.layout.blocks_dir, "*", "*"))) == sorted(
        tier.layout.block_path(key_digest(x)) for x in (k[0], k[2], k[3]))


@pytest.mark.parametrize("engine", ["uring", "posix"])
def test_a_failed_stores_temporary_that_cannot_be_removed_is_counted(root, make_tier, arena,
                                                                     chattr, clock, engine):
    """An append-only fan-out directory: the temporary is created and written, its rename into
    place and its unlink fail (EPERM). The engine reports it (take_leftovers); the tier counts
    it in used_bytes and removes it once it can."""
    tier = make_tier(root, engine=engine)
    a = fill(arena(1, BS), 2)
    tier.set_arena(a)
    fan = os.path.dirname(tier.layout.block_path(key_digest(b"t")))
    chattr(fan, "a")
    res = run(tier, 1, [b"t"], [0])
    assert res.failed_keys == {b"t": "EPERM: Operation not permitted"}
    (tmp,) = os.listdir(fan)
    assert ".tmp." in tmp
    assert tier.stats()["leftover_files"] == 1 and tier.used_bytes == FB
    assert tier.num_blocks == 0
    chattr.clear(fan, "a")
    clock.t += 1.0
    tier.on_step_end()  # (once a step, as get_finished_jobs)
    assert os.listdir(fan) == []
    assert tier.stats()["leftover_files"] == 0 and tier.used_bytes == 0
    assert run(tier, 2, [b"t"], [0]).success is True and tier.used_bytes == FB


@pytest.mark.parametrize("host", ["uring", "posix"])
def test_the_bounce_engine_reports_its_host_engines_leftovers(root, chattr, aligned, host):
    """Device arenas store through BounceEngine: the temporary its host engine could not remove
    reaches the tier through BounceEngine.take_leftovers()."""
    from pykvtier import _native
    from pykvtier.engines import Op, run_job
    from pykvtier.engines.bounce import BounceEngine, HostCopier
    from pykvtier.posix_engine import PosixEngine

    h = _native.Engine(queue_depth=8) if host == "uring" else PosixEngine(queue_depth=8)
    eng = BounceEngine(h, HostCopier(), BS, bounce_slots=2, chunk_blocks=1)
    try:
        d = os.path.join(root, "d")
        os.mkdir(d)
        chattr(d, "a")
        dev = aligned(BS, fill=6)
        final = os.path.join(d, "b")
        res = run_job(eng, Op.WRITE_BLOCK, [(final + ".tmp", final, BS, int(dev.ctypes.data),
                                              key_digest(b"b"))], direct=False)
        assert res == [-errno.EPERM]
        assert eng.take_leftovers() == [final + ".tmp"]
        assert eng.take_leftovers() == []  # each once
        assert os.listdir(d) == ["b.tmp"]
    finally:
        eng.shutdown()
        h.shutdown()


# ------------------------------------------------------------------------- item 8: full disks


def _mounted(fstype: str, options: str) -> Iterator[str]:
    """A fresh mount of ``fstype`` with ``options`` in a temporary directory, unmounted after."""
    where = tempfile.mkdtemp(prefix=f"pykvtier-{fstype}-")
    r = subprocess.run(["mount", "-t", fstype, "-o", options, fstype, where],
                       capture_output=True, text=True)
    if r.returncode != 0:
        os.rmdir(where)
        pytest.skip(f"cannot mount a {fstype} at {where}: {r.stderr.strip() or r.returncode} "
                    "(needs root)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", where], check=False)
        os.rmdir(where)


@pytest.fixture
def small_fs():
    """A tmpfs of 4 MiB (1024 pages; a block file is 17 pages)."""
    yield from _mounted("tmpfs", "size=4m,mode=0700")


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill_up(path: str) -> str:
    """Writes a file until the file system is full; returns its name."""
    name = os.path.join(path, "filler")
    chunk = b"F" * (1 << 20)
    with open(name, "wb", buffering=0) as f:
        while True:
            try:
                f.write(chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                break
    chunk = b"F" * 4096
    with open(name, "ab", buffering=0) as f:
        while True:
            try:
                if f.write(chunk) < len(chunk):
                    break
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                break
    assert free_bytes(path) < 4096
    return name


@pytest.mark.parametrize("engine", ["uring", "posix"])
def test_capacity_none_keeps_min_free_bytes_free(small_fs, make_tier, arena, clock, caplog,
                                                 engine):
    """capacity_bytes=None, min_free_bytes by default (5 % of the file system): a burst of
    stores larger than the file system all succeed, eviction keeping the reserve free. (Before:
    the file system filled, every later store failed with ENOSPC, one WARNING per key.)"""
    with caplog.at_level(logging.WARNING, logger="pykvtier"):
        tier = make_tier(os.path.join(small_fs, "tier"), engine=engine)
        st = os.statvfs(small_fs)
        assert tier.min_free_bytes == st.f_blocks * st.f_frsize // 20 == 209715
        a = fill(arena(4, BS), 3)
        tier.set_arena(a)
        fits = (free_bytes(small_fs) - tier.min_free_bytes) // FB
        keys = [b"m-%d" % i for i in range(100)]
        results = [run(tier, j, keys[4 * j:4 * j + 4], range(4)) for j in range(25)]
    assert [r.success for r in results] == [True] * 25
    s = tier.stats()
    assert (s["blocks_stored"], s["store_failures"], s["capacity_rejections"]) == (100, 0, 0)
    assert tier.num_blocks == fits == 57 and tier.used_bytes == fits * FB
    assert s["evictions"] == 100 - fits and s["store_retries"] == 0
    assert free_bytes(small_fs) >= tier.min_free_bytes
    assert [tier.lookup(k) for k in keys] == [MISS] * (100 - fits) + [HIT] * fits
    assert [w for w in pykvtier_warnings(caplog) if "O_DIRECT" not in w] == []
    src = a.copy()
    a[:] = 0
    assert run(tier, 99, keys[-4:], range(4), load=True).success is True
    assert np.array_equal(a, src)  # the last job's slots: its blocks are whole


@pytest.mark.parametrize("engine", ["uring", "posix"])
def test_a_file_system_filled_by_others_evicts_and_retries(small_fs, make_tier, arena, clock,
                                                           caplog, engine):
    """min_free_bytes=0 and the file system filled behind the tier's back (its statvfs is not
    due yet): each store that meets ENOSPC evicts as many least recently used blocks and is
    written once more. With blocks to evict the burst succeeds; with too few, exactly the keys
    without room fail; once the space is back, stores succeed without evicting. Warnings:
    one line at the first failure, the rest counted into one line at shutdown."""
    with caplog.at_level(logging.WARNING, logger="pykvtier"):
        tier = make_tier(os.path.join(small_fs, "tier"), engine=engine, min_free_bytes=0,
                         queue_depth=1)
        a = fill(arena(8, BS), 8)
        tier.set_arena(a)
        old = [b"old-%d" % i for i in range(4)]
        assert run(tier, 1, old, range(4)).success is True
        filler = fill_up(small_fs)

        # Four blocks to evict: the four stores that met ENOSPC are retried and succeed.
        new = [b"new-%d" % i for i in range(4)]
        res = run(tier, 2, new, range(4))
        assert res.success is True and res.failed_keys == {} and res.transfer_bytes == 4 * BS
        s = tier.stats()
        assert (s["store_retries"], s["evictions"], s["store_failures"]) == (4, 4, 0)
        assert [tier.lookup(k) for k in old + new] == [MISS] * 4 + [HIT] * 4
        assert tier.used_bytes == 4 * FB and tier.num_blocks == 4

        # The next job's room is known (statvfs after ENOSPC): recycled, no ENOSPC.
        more = [b"more-%d" % i for i in range(4)]
        assert run(tier, 3, more, range(4)).success is True
        s = tier.stats()
        assert (s["store_retries"], s["evictions"], s["evictions_recycled"]) == (4, 8, 4)
        assert tier.num_blocks == 4

        # Every block being read: nothing to evict, stores are refused without I/O.
        tier.submit_load(TransferJob(4, more, [0, 1, 2, 3]))
        refused = [b"refused-%d" % i for i in range(4)]
        tier.submit_store(TransferJob(5, refused, [4, 5, 6, 7]))  # (not slots a load fills)
        tier.drain()
        done = {r.job_id: r for r in tier.get_finished_jobs()}
        assert done[4].success is True
        why = (f"no room: free space at {tier.layout.root} is below min_free_bytes=0 and "
               "every block is in use")
        assert done[5].failed_keys == {k: why for k in refused}
        assert tier.stats()["capacity_rejections"] == 4

        # Space back (filler removed, statvfs due again): stores succeed without evicting.
        os.unlink(filler)
        clock.t += 1.0
        again = [b"again-%d" % i for i in range(4)]
        assert run(tier, 6, again, range(4)).success is True
        s = tier.stats()
        assert (s["evictions"], s["store_retries"], s["store_failures"]) == (8, 4, 0)
        assert tier.num_blocks == 8 and tier.used_bytes == 8 * FB
        assert [tier.lookup(k) for k in more + again] == [HIT] * 8
        lines_before_shutdown = pykvtier_warnings(caplog)
        tier.shutdown()
    lines = [w for w in pykvtier_warnings(caplog) if "O_DIRECT" not in w]
    assert len([w for w in lines_before_shutdown if "O_DIRECT" not in w]) == 1
    root = tier.layout.root
    assert lines == [f"pykvtier: {root}: 1 stores refused ({why}; e.g. {root})",
                     f"pykvtier: {root}: 3 stores refused ({why}; e.g. {root})"]


@pytest.mark.parametrize("engine", ["uring", "posix"])
def test_enospc_without_enough_blocks_to_evict_fails_exactly_the_rest(small_fs, make_tier,
                                                                      arena, clock, caplog,
                                                                      engine):
    """One block of the tier's own on a file system filled by another file: of four stores
    that meet ENOSPC, one is written after evicting that block; three fail (ENOSPC), and keep
    failing as "no room" refusals (no I/O) while the file system stays full. 40 failed keys give
    2 warning lines (the first, then the count at shutdown), not 40."""
    with caplog.at_level(logging.WARNING, logger="pykvtier"):
        tier = make_tier(os.path.join(small_fs, "tier"), engine=engine, min_free_bytes=0,
                         queue_depth=1)
        a = fill(arena(4, BS), 5)
        tier.set_arena(a)
        assert run(tier, 1, [b"only"], [0]).success is True
        fill_up(small_fs)
        keys = [b"full-%d" % i for i in range(44)]
        results = [run(tier, 2 + j, keys[4 * j:4 * j + 4], range(4)) for j in range(11)]
        enospc = "ENOSPC: No space left on device"
        assert results[0].successful_keys == [keys[0]]
        assert results[0].failed_keys == {k: enospc for k in keys[1:4]}
        why = (f"no room: free space at {tier.layout.root} is below min_free_bytes=0 and "
               "every block is in use")
        for j, r in enumerate(results[1:], 1):  # each recycles the one block, refuses three
            assert r.successful_keys == [keys[4 * j]]
            assert r.failed_keys == {k: why for k in keys[4 * j + 1:4 * j + 4]}
        s = tier.stats()
        assert (s["store_retries"], s["store_failures"], s["capacity_rejections"]) == (4, 3, 30)
        assert (s["blocks_stored"], s["evictions"], s["evictions_recycled"]) == (12, 11, 10)
        assert tier.num_blocks == 1 and tier.used_bytes == FB
        assert [tier.lookup(k) for k in keys[40:]] == [HIT, MISS, MISS, MISS]
        src = a[0].copy()
        a[:] = 0
        assert run(tier, 99, [keys[40]], [1], load=True).success is True
        assert np.array_equal(a[1], src)
        tier.shutdown()
    lines = [w for w in pykvtier_warnings(caplog) if "O_DIRECT" not in w]
    root = tier.layout.root
    assert lines == [
        f"pykvtier: {root}: 1 stores failed ({enospc}; e.g. "
        f"{tier.layout.block_path(key_digest(keys[1]))})",
        f"pykvtier: {root}: 2 stores failed ({enospc}; e.g. "
        f"{tier.layout.block_path(key_digest(keys[2]))}); 30 stores refused ({why}; e.g. {root})",
    ]


@pytest.mark.parametrize("engine", ["uring", "posix"])
def test_a_retry_never_evicts_the_jobs_own_blocks(small_fs, make_tier, arena, clock, engine):
    """Room for one block and one old block to evict: of a job's three stores the first is
    written, the other two meet ENOSPC; the retry evicts the old block only (not the job's own
    first block), so one more is written and the last fails."""
    tier = make_tier(os.path.join(small_fs, "tier"), engine=engine, min_free_bytes=0,
                     queue_depth=1)
    a = fill(arena(3, BS), 7)
    tier.set_arena(a)
    assert run(tier, 1, [b"old"], [0]).success is True
    filler = fill_up(small_fs)
    os.truncate(filler, os.path.getsize(filler) - FB)  # room for exactly one block file
    assert free_bytes(small_fs) == FB
    k = [b"own-0", b"own-1", b"own-2"]
    res = run(tier, 2, k, [0, 1, 2])
    assert res.successful_keys == k[:2]
    assert res.failed_keys == {k[2]: "ENOSPC: No space left on device"}
    assert [tier.lookup(x) for x in [b"old"] + k] == [MISS, HIT, HIT, MISS]
    s = tier.stats()
    assert (s["store_retries"], s["evictions"], s["store_failures"]) == (2, 1, 1)
    assert tier.num_blocks == 2 and tier.used_bytes == 2 * FB


@pytest.fixture
def ramfs_root():
    """A ramfs (statvfs reports 0 blocks; O_DIRECT refused)."""
    yield from _mounted("ramfs", "mode=0700")


@pytest.mark.parametrize("engine", ["uring", "posix"])
def test_a_file_system_without_space_figures_stores(ramfs_root, make_tier, arena, engine):
    # ramfs's statvfs says 0 blocks of 0 bytes: the reserve cannot be kept there, and the tier
    # must not read that as "no room" (it refused every store before).
    assert os.statvfs(ramfs_root).f_blocks == 0
    tier = make_tier(ramfs_root, engine=engine)
    assert tier.direct is False
    a = arena(8, BS)
    tier.set_arena(a)
    keys = [b"ramfs-%d" % i for i in range(4)]
    fill(a[:4], 11)
    want = a[:4].copy()
    res = run(tier, 1, keys, range(4))
    assert (res.success, res.failed_keys) == (True, {})
    assert tier.num_blocks == 4
    res = run(tier, 2, keys, range(4, 8), load=True)
    assert (res.success, res.failed_keys) == (True, {})
    assert np.array_equal(a[4:8], want)
