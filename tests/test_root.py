"""The root directory of a tier: links never followed (issue #9 item 2), file and directory
modes (3), the block-size marker and the bounded quarantine (11), the root lock (13).

Every test asserts exact names, bytes, modes, pids and counts. Cross-process tests synchronize
on pipes (a child says "locked" once it holds the lock), never on sleeps.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import numpy as np
import pytest

from pykvtier import DiskTier, LookupResult, TransferJob, layout
from pykvtier.layout import HEADER_BYTES, key_digest

HIT, MISS = LookupResult.HIT, LookupResult.MISS
BS = 64 << 10
FB = BS + HEADER_BYTES


# ------------------------------------------------------------------------- helpers




def fill(arr: np.ndarray, seed: int) -> np.ndarray:
    arr[...] = np.random.default_rng(seed).integers(0, 256, arr.shape, dtype=np.uint8)
    return arr


def run_job(tier: DiskTier, load: bool, job_id: int, keys, slots):
    job = TransferJob(job_id, list(keys), list(slots))
    (tier.submit_load if load else tier.submit_store)(job)
    tier.drain()
    (res,) = tier.get_finished_jobs()
    assert res.job_id == job_id
    return res


def key_in_fanout(byte: int, tag: bytes = b"k") -> bytes:
    """A key whose block file lives in the fan-out directory ``blocks/<byte:02x>``."""
    i = 0
    while key_digest(b"%s-%d" % (tag, i))[0] != byte:
        i += 1
    return b"%s-%d" % (tag, i)


def snapshot(d: str) -> dict[str, tuple[bytes, int, int]]:
    """name -> (bytes, mtime ns, mode) of every entry of a flat directory."""
    out = {}
    for name in sorted(os.listdir(d)):
        p = os.path.join(d, name)
        st = os.lstat(p)
        with open(p, "rb") as f:
            out[name] = (f.read(), st.st_mtime_ns, st.st_mode)
    return out


def mode_of(path: str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


# ------------------------------------------------------------------------- item 2: no links


def test_fanout_link_to_outside_is_quarantined_and_nothing_outside_changes(root, make_tier, arena):
    """blocks/ab is a link to a directory outside the root holding a stale-temporary-named file,
    a whole block file and a block-named file of another size: start-up touches none of them
    (no unlink, no rename, no index entry), moves the link itself into quarantine, makes
    blocks/ab a real directory, and a store of a key in that fan-out lands inside the root."""
    src_root = os.path.join(root, "src")
    tree = os.path.join(root, "tree")
    outside = os.path.join(root, "outside")
    os.mkdir(outside)
    a = fill(arena(2, BS), 1)
    kb = key_in_fanout(0xAB, b"outside")
    with DiskTier(src_root, BS) as src:  # a real block file of kb, copied outside
        src.set_arena(a)
        assert run_job(src, False, 1, [kb], [0]).success
        with open(src.layout.block_path(key_digest(kb)), "rb") as f:
            block_bytes = f.read()
    assert len(block_bytes) == FB
    hb = key_digest(kb).hex()
    stale = key_digest(b"stale").hex()
    files = {
        f"{stale}.kvb.tmp.0.1": b"T" * 100,            # stale temporary name (pid 0)
        f"{hb}.kvb": block_bytes,                      # a whole block file
        f"{key_digest(b'short').hex()}.kvb": b"S" * 5,  # a block name, another size
    }
    for name, data in files.items():
        with open(os.path.join(outside, name), "wb") as f:
            f.write(data)
    before = snapshot(outside)

    make_tier(tree).shutdown()
    fan = os.path.join(tree, "blocks", "ab")
    os.rmdir(fan)
    os.symlink(outside, fan)

    tier = make_tier(tree)
    assert snapshot(outside) == before
    assert not os.path.islink(fan) and os.path.isdir(fan) and os.listdir(fan) == []
    (q,) = os.listdir(tier.layout.quarantine_dir)
    assert q.startswith("blocks-ab.")
    qpath = os.path.join(tier.layout.quarantine_dir, q)
    assert os.path.islink(qpath) and os.readlink(qpath) == outside
    assert tier.num_blocks == 0 and tier.lookup(kb) is MISS
    s = tier.stats()
    assert (s["stale_temporaries_removed"], s["quarantined"], s["malformed_block_files"]) == (0, 0, 0)
    assert (s["quarantine_files"], s["quarantine_bytes"]) == (1, 0)

    tier.set_arena(a)
    k = key_in_fanout(0xAB, b"new")
    assert run_job(tier, False, 2, [k], [1]).success
    path = tier.layout.block_path(key_digest(k))
    assert os.path.dirname(path) == os.path.join(os.path.realpath(tree), "blocks", "ab")
    assert os.listdir(fan) == [os.path.basename(path)] and os.lstat(path).st_size == FB
    assert snapshot(outside) == before


@pytest.mark.parametrize("which", ["blocks", "quarantine", "fanout-file"])
def test_blocks_and_quarantine_that_are_not_directories_are_moved_aside(root, make_tier, which):
    """blocks/ or quarantine/ a link to an outside directory, or a fan-out that is a regular
    file: moved into the (real) quarantine, never followed, and replaced by a directory."""
    tree = os.path.join(root, "tree")
    outside = os.path.join(root, "outside")
    os.mkdir(outside)
    name = key_digest(b"x").hex()
    with open(os.path.join(outside, f"{name}.kvb.tmp.0.7"), "wb") as f:
        f.write(b"T" * 10)
    before = snapshot(outside)
    make_tier(tree).shutdown()
    if which == "blocks":
        target = os.path.join(tree, "blocks")
        os.rename(target, os.path.join(root, "old-blocks"))
        os.symlink(outside, target)
        label = "blocks"
    elif which == "quarantine":
        target = os.path.join(tree, "quarantine")
        os.rmdir(target)
        os.symlink(outside, target)
        label = "quarantine"
    else:
        target = os.path.join(tree, "blocks", "07")
        os.rmdir(target)
        with open(target, "wb") as f:
            f.write(b"F" * 3)
        label = "blocks-07"
    tier = make_tier(tree)
    assert snapshot(outside) == before
    assert os.path.isdir(target) and not os.path.islink(target)
    qdir = tier.layout.quarantine_dir
    assert os.path.isdir(qdir) and not os.path.islink(qdir)
    (q,) = os.listdir(qdir)
    assert q.startswith(label + ".")
    if which == "fanout-file":
        assert open(os.path.join(qdir, q), "rb").read() == b"F" * 3
        assert tier.stats()["quarantine_bytes"] == 3
    else:
        assert os.readlink(os.path.join(qdir, q)) == outside
    assert sorted(os.listdir(tier.layout.blocks_dir)) == [f"{i:02x}" for i in range(256)]
    assert [n for n in os.listdir(tree) if n.startswith(".quarantine")] == []


def test_root_is_canonical(root, make_tier):
    """A root given through a link is resolved once (the engines get paths without links)."""
    real = os.path.join(root, "real")
    os.mkdir(real)
    os.symlink(real, os.path.join(root, "via"))
    tier = make_tier(os.path.join(root, "via"))
    assert tier.layout.root == os.path.realpath(real)
    assert tier.layout.block_path(b"\x01" * 16).startswith(os.path.realpath(real) + "/blocks/01/")


def test_leftover_direct_probe_files_are_swept(root, make_tier):
    """Leftover O_DIRECT probe files (a dead process's, and one named with this process's pid:
    a container restart reuses pids) neither stop the tier nor stay."""
    make_tier(root).shutdown()
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    dead = int(child.stdout)
    blocks = os.path.join(root, "blocks")
    for pid in (dead, os.getpid()):
        with open(os.path.join(blocks, f".pykvtier-direct-probe-{pid}"), "wb") as f:
            f.write(b"p")
    tier = make_tier(root)
    assert sorted(os.listdir(blocks)) == [f"{i:02x}" for i in range(256)]
    assert tier.num_blocks == 0


# ------------------------------------------------------------------------- item 3: modes


@pytest.mark.parametrize("mode,dir_mode", [(0o600, 0o700), (0o640, 0o750), (0o660, 0o770)])
def test_directories_get_the_mode_matching_the_file_mode(root, make_tier, mode, dir_mode):
    tree = os.path.join(root, "new", "tree")
    old = os.umask(0o022)
    try:
        tier = make_tier(tree, **({} if mode == 0o600 else {"mode": mode}))
    finally:
        os.umask(old)
    assert tier.file_mode == mode and tier.dir_mode == dir_mode
    dirs = [tree, os.path.join(tree, "blocks"), os.path.join(tree, "quarantine")]
    dirs += [os.path.join(tree, "blocks", f"{i:02x}") for i in range(256)]
    assert {d: mode_of(d) for d in dirs} == dict.fromkeys(dirs, dir_mode)
    assert mode_of(os.path.join(tree, layout.ROOT_MARKER)) == mode
    assert mode_of(os.path.join(tree, layout.LOCK_NAME)) == mode


def _engine_takes_file_mode() -> bool:
    from pykvtier import _native

    return "file_mode" in (_native.Engine.submit.__doc__ or "")


@pytest.mark.skipif(not _engine_takes_file_mode(), reason="engines without the file_mode keyword")
@pytest.mark.parametrize("engine", ["uring", "posix"])
@pytest.mark.parametrize("mode", [0o600, 0o640])
def test_stored_block_files_get_the_file_mode(root, make_tier, arena, engine, mode):
    old = os.umask(0o022)
    try:
        tier = make_tier(root, mode=mode, engine=engine)
        tier.set_arena(fill(arena(1, BS), 3))
        assert run_job(tier, False, 1, [b"m"], [0]).success
    finally:
        os.umask(old)
    assert mode_of(tier.layout.block_path(key_digest(b"m"))) == mode


@pytest.mark.parametrize("bad,exc", [(b"0o600", TypeError), (1.5, TypeError), (True, TypeError),
                                     (0o700, ValueError), (0o200, ValueError), (0o400, ValueError),
                                     (0o1600, ValueError), (-1, ValueError), ("+6_00", ValueError),
                                     (" 600 ", ValueError), ("0o700", ValueError), ("64a", ValueError)])
def test_mode_option_is_checked(root, bad, exc):
    with pytest.raises(exc, match=r"^mode must be"):
        DiskTier(os.path.join(root, "t"), BS, mode=bad)
    assert os.listdir(root) == []  # nothing created


@pytest.mark.parametrize("given", ["640", "0640", "000640", "0o640", "0O640", 0o640])
def test_mode_as_chmod_spells_it(root, given):
    """A config file's octal string is the mode chmod would take (as the vLLM adapter's)."""
    tier = DiskTier(os.path.join(root, "t"), BS, mode=given)
    try:
        assert tier.config.mode == 0o640 and tier.file_mode == 0o640
    finally:
        tier.shutdown()


# ------------------------------------------------------------------------- item 11: marker


def test_marker_records_the_block_size(root, make_tier):
    make_tier(root)
    with open(os.path.join(root, "pykvtier-root.json")) as f:
        assert json.load(f) == {"format": 1, "block_size_bytes": BS}
    assert layout.read_root_config(root) == {"format": 1, "block_size_bytes": BS}
    assert layout.read_root_config(os.path.join(root, "blocks", "00")) is None


@pytest.mark.parametrize("shared", [False, True])
def test_another_block_size_is_refused_naming_both_and_moves_nothing(root, make_tier, arena, shared):
    """A tier of another block size refuses the root (with shared=True too, while the first tier
    runs); the blocks stay where they are, loadable by a tier of their size."""
    a = fill(arena(2, BS), 5)
    first = make_tier(root, shared=shared)
    first.set_arena(a)
    assert run_job(first, False, 1, [b"a", b"b"], [0, 1]).success
    if not shared:
        first.shutdown()
    files = sorted(os.path.join(dp, f) for dp, _, fs in os.walk(os.path.join(root, "blocks"))
                   for f in fs)
    real = os.path.realpath(root)
    with pytest.raises(ValueError) as err:
        DiskTier(root, 2 * BS, shared=shared)
    assert str(err.value) == (
        f"root {real} holds blocks of block_size_bytes={BS} (from {real}/pykvtier-root.json); "
        f"this tier has block_size_bytes={2 * BS}: give each block size its own root_dir")
    assert sorted(os.path.join(dp, f) for dp, _, fs in os.walk(os.path.join(root, "blocks"))
                  for f in fs) == files
    assert os.listdir(os.path.join(root, "quarantine")) == []
    again = first if shared else make_tier(root, arena=a)
    want = a.copy()
    a[:] = 0
    assert run_job(again, True, 2, [b"a", b"b"], [0, 1]).success
    assert np.array_equal(a, want)


def test_root_without_marker_takes_the_size_of_its_blocks(root, make_tier, arena):
    """A root from before the marker: the first block header decides."""
    first = make_tier(root)
    first.set_arena(fill(arena(1, BS), 6))
    assert run_job(first, False, 1, [b"a"], [0]).success
    first.shutdown()
    os.unlink(os.path.join(root, "pykvtier-root.json"))
    with pytest.raises(ValueError, match=rf"holds blocks of block_size_bytes={BS} \(from block file "
                                         rf".*{key_digest(b'a').hex()}\.kvb\); this tier has "
                                         rf"block_size_bytes={2 * BS}"):
        DiskTier(root, 2 * BS)
    assert not os.path.exists(os.path.join(root, "pykvtier-root.json"))
    tier = make_tier(root)
    assert tier.num_blocks == 1
    assert layout.read_root_config(root) == {"format": 1, "block_size_bytes": BS}


@pytest.mark.parametrize("text", ["{not json", '{"format": 2, "block_size_bytes": 4096}',
                                  '{"format": 1, "block_size_bytes": "big"}', "[1]",
                                  '{"format": true, "block_size_bytes": 65536}'])
def test_malformed_marker_is_named(root, text):
    with open(os.path.join(root, "pykvtier-root.json"), "w") as f:
        f.write(text)
    with pytest.raises(ValueError, match=f"root marker {os.path.realpath(root)}/pykvtier-root.json"):
        DiskTier(root, BS)


def test_root_dir_with_a_nul_byte_is_named():
    with pytest.raises(ValueError, match=r"root_dir '/tmp/a\\x00b' contains a NUL byte"):
        DiskTier("/tmp/a\0b", BS)


def _fill_quarantine(root: str, n: int, first_stamp: int = 1000) -> list[str]:
    q = os.path.join(root, "quarantine")
    os.makedirs(q, exist_ok=True)
    names = []
    for i in range(n):
        name = f"{key_digest(b'q%d' % i).hex()}.kvb.{first_stamp + i}"
        with open(os.path.join(q, name), "wb") as f:
            f.write(b"q" * (i + 1))
        names.append(name)
    return names


def test_quarantine_is_bounded_oldest_first_and_counted(root, make_tier, arena):
    names = _fill_quarantine(root, 5)
    tier = make_tier(root, quarantine_max_files=3)
    assert sorted(os.listdir(tier.layout.quarantine_dir)) == sorted(names[2:])
    s = tier.stats()
    assert (s["quarantine_files"], s["quarantine_bytes"]) == (3, 3 + 4 + 5)
    # a corrupt block found by a load is moved in: the oldest entry goes
    tier.set_arena(fill(arena(1, BS), 8))
    assert run_job(tier, False, 1, [b"c"], [0]).success
    path = tier.layout.block_path(key_digest(b"c"))
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + 7)
        f.write(b"\x00\xff")
    res = run_job(tier, True, 2, [b"c"], [0])
    assert res.success is False
    left = sorted(os.listdir(tier.layout.quarantine_dir))
    assert len(left) == 3 and names[2] not in left and names[3] in left and names[4] in left
    (new,) = [n for n in left if n not in names]
    assert new.startswith(f"{key_digest(b'c').hex()}.kvb.")
    s = tier.stats()
    assert (s["quarantine_files"], s["quarantine_bytes"], s["quarantined"]) == (3, 4 + 5 + FB, 1)


def test_quarantine_default_bound_is_256(root, make_tier):
    names = _fill_quarantine(root, 258)
    tier = make_tier(root)
    assert sorted(os.listdir(tier.layout.quarantine_dir)) == sorted(names[2:])
    assert tier.stats()["quarantine_files"] == 256
    assert tier.stats()["quarantine_bytes"] == sum(range(3, 259))


def test_quarantine_trim_removes_a_directory_off_the_callers_thread(root, monkeypatch):
    """A directory moved into the quarantine (e.g. one found at a block name) is neither walked
    by move_in nor removed by the trim on the caller's thread (the scheduler's, through
    get_finished_jobs): its tree goes in a thread of its own."""
    import threading

    lay = layout.Layout(os.path.join(root, "r"))
    box = layout.Quarantine(lay, max_files=1)
    sub = os.path.join(lay.blocks_dir, "00")
    d = os.path.join(sub, "big.kvb")
    os.mkdir(d)
    for i in range(50):
        with open(os.path.join(d, str(i)), "wb") as f:
            f.write(b"x" * 10)
    removed_in: list[str] = []
    real_rmtree = layout.shutil.rmtree

    def rmtree(*a, **kw):
        removed_in.append(threading.current_thread().name)
        return real_rmtree(*a, **kw)

    monkeypatch.setattr(layout.shutil, "rmtree", rmtree)
    dfd = os.open(sub, os.O_RDONLY | os.O_DIRECTORY)
    try:
        qdir = box.move_in(dfd, "big.kvb")
        assert (box.files, box.bytes) == (1, 0)  # not walked: counted at the next start
        with open(os.path.join(sub, "f.kvb"), "wb") as f:
            f.write(b"y" * 7)
        qfile = box.move_in(dfd, "f.kvb")  # trims the directory, the oldest
    finally:
        os.close(dfd)
    for t in threading.enumerate():
        if t.name == "pykvtier-quarantine-trim":
            t.join()
    assert removed_in == ["pykvtier-quarantine-trim"]
    assert os.listdir(lay.quarantine_dir) == [qfile] and qdir != qfile
    assert (box.files, box.bytes) == (1, 7)


def test_empty_quarantine_follows_no_link(root, make_tier):
    outside = os.path.join(root, "outside")
    os.mkdir(outside)
    with open(os.path.join(outside, "keep"), "wb") as f:
        f.write(b"K")
    tree = os.path.join(root, "tree")
    _fill_quarantine(tree, 2)
    q = os.path.join(tree, "quarantine")
    os.symlink(outside, os.path.join(q, "link.1"))
    os.mkdir(os.path.join(q, "dir.2"))
    with open(os.path.join(q, "dir.2", "inner"), "wb") as f:
        f.write(b"I" * 10)
    assert layout.quarantine_usage(tree) == (4, 1 + 2 + 10)
    assert layout.empty_quarantine(tree) == (4, 1 + 2 + 10)
    assert os.listdir(q) == [] and os.listdir(outside) == ["keep"]
    assert layout.empty_quarantine(tree) == (0, 0)
    assert make_tier(tree).stats()["quarantine_files"] == 0


def test_doctor_reports_block_size_and_quarantine(root, make_tier):
    from pykvtier import doctor

    make_tier(root).shutdown()
    _fill_quarantine(root, 2)
    r = doctor.collect(root, no_gpu=True)["root"]
    assert (r["block_size_bytes"], r["quarantine_files"], r["quarantine_bytes"]) == (BS, 2, 3)
    text = doctor.format_text(doctor.collect(root, no_gpu=True))
    assert f"block_size_bytes={BS}; quarantine: 2 entries, 3 B" in text


# ------------------------------------------------------------------------- item 13: the lock


def test_two_non_shared_tiers_on_one_root_are_refused(root, make_tier):
    first = make_tier(root)
    with pytest.raises(layout.RootLockedError) as err:
        DiskTier(root, BS)
    e = err.value
    assert isinstance(e, ValueError) and e.holders == [os.getpid()] and e.shared is False
    real = os.path.realpath(root)
    assert str(e).startswith(
        f"root {real} is in use: an exclusive (shared=False) lock on {real}/.pykvtier.lock is "
        f"held by pid {os.getpid()} (this process); asked for an exclusive lock (shared=False)")
    assert layout.RootLock.holders(root) == [os.getpid()]
    first.shutdown()
    assert layout.RootLock.holders(root) == []
    assert os.path.exists(os.path.join(root, ".pykvtier.lock"))  # never removed
    make_tier(root)  # opens again


@pytest.mark.parametrize("first_shared", [False, True])
def test_shared_and_non_shared_tiers_do_not_mix(root, make_tier, first_shared):
    first = make_tier(root, shared=first_shared)
    with pytest.raises(layout.RootLockedError, match=rf"held by pid {os.getpid()} \(this process\); "
                                                     rf"asked for an? {'exclusive' if first_shared else 'shared'}"):
        DiskTier(root, BS, shared=not first_shared)
    if first_shared:
        second = make_tier(root, shared=True)  # shared ones share
        assert layout.RootLock.holders(root) == [os.getpid()]
        second.shutdown()
    first.shutdown()
    make_tier(root, shared=not first_shared)


def test_failed_start_releases_the_lock(root, make_tier):
    make_tier(root).shutdown()
    with pytest.raises(ValueError, match="holds blocks of block_size_bytes"):
        DiskTier(root, 2 * BS)  # refused after it took the lock
    assert layout.RootLock.holders(root) == []
    make_tier(root)


_HOLDER = """
import sys
from pykvtier import layout
lock = layout.lock_root(sys.argv[1], shared=sys.argv[2] == "shared")
print("locked", flush=True)
sys.stdin.read()
lock.release()
"""


@pytest.mark.parametrize("child_shared", [False, True])
def test_lock_held_by_another_process_names_its_pid(root, make_tier, child_shared):
    make_tier(root).shutdown()
    child = subprocess.Popen([sys.executable, "-P", "-c", _HOLDER, root,
                              "shared" if child_shared else "exclusive"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "locked\n"
        with pytest.raises(layout.RootLockedError) as err:
            DiskTier(root, BS)
        assert err.value.holders == [child.pid]
        held = "an exclusive (shared=False)" if child_shared is False else "a shared (shared=True)"
        assert f"{held} lock on {os.path.realpath(root)}/.pykvtier.lock is held by pid {child.pid};" \
            in str(err.value)
        assert layout.RootLock.holders(root) == [child.pid]
        if child_shared:
            make_tier(root, shared=True).shutdown()
        else:
            with pytest.raises(layout.RootLockedError, match=f"held by pid {child.pid};"):
                DiskTier(root, BS, shared=True)
            with open(os.path.join(root, ".pykvtier.lock")) as f:
                assert f.read() == f"{child.pid}\n"
    finally:
        child.stdin.close()
        assert child.wait(60) == 0
    make_tier(root)
