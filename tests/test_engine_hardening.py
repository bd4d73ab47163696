"""Both host engines under hostile or failing storage (issue #9): links planted in the root,
hard links, exact file modes, short reads and real EIO, durable renames, files that cannot be
removed, and the O_DIRECT probe on full or O_DIRECT-refusing file systems.

Every test runs on the io_uring engine and the posix engine ("posix-walk": the posix engine as on
a kernel without openat2, walking each path component with O_NOFOLLOW). Tests that mount file
systems or set file attributes need root and skip, saying why, elsewhere; mounts are removed in
``finally``. No sleeps: every job is awaited with pykvtier.engines.run_job.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import subprocess
import tempfile

import numpy as np
import pytest

from pykvtier._native import Op
from pykvtier.engines import run_job
from pykvtier import _native
from pykvtier.layout import HEADER_BYTES, key_digest

KiB = 1 << 10
SIZE = 64 * KiB
KINDS = ["uring", "posix", "posix-walk"]


def addr(a: np.ndarray) -> int:
    return a.ctypes.data


def file_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture(params=KINDS)
def engine(request):
    kind = request.param
    e = _native.Engine(queue_depth=8) if kind == "uring" else _native.PosixEngine(queue_depth=8, threads=4)
    if kind == "posix-walk":
        _native._set_openat2_disabled(True)
    try:
        yield e
    finally:
        _native._set_openat2_disabled(False)
        e.shutdown()


@pytest.fixture
def outside(storage_base):
    """A directory beside the test's root (outside it), removed afterwards."""
    path = tempfile.mkdtemp(prefix="outside-", dir=storage_base[0])
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def need_root():
    if os.geteuid() != 0:
        pytest.skip("needs root (mounts file systems / sets file attributes)")


@contextlib.contextmanager
def mounted(fstype: str, options: str | None = None):
    """A fresh mount of fstype on a new directory; unmounted and removed afterwards."""
    need_root()
    where = tempfile.mkdtemp(prefix=f"mnt-{fstype}-")
    cmd = ["mount", "-t", fstype] + (["-o", options] if options else []) + ["none", where]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        os.rmdir(where)
        pytest.skip(f"cannot mount {fstype}: {proc.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", where], check=True)
        os.rmdir(where)


@contextlib.contextmanager
def attribute(path: str, attr: str):
    """chattr +attr on path for the block; skips where the file system does not take it."""
    need_root()
    proc = subprocess.run(["chattr", "+" + attr, path], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"chattr +{attr} not supported here: {proc.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-" + attr, path], check=True)


def store(engine, src, final, key, **kw):
    return run_job(engine, Op.WRITE_BLOCK, [(final + ".tmp", final, SIZE, addr(src), key_digest(key))], **kw)


# ------------------------------------------------------------------------- 1: links


@pytest.mark.parametrize("target_kind", ["valid block", "foreign bytes"])
def test_symlink_at_a_block_path_is_never_read(root, outside, aligned, engine, target_kind):
    """A link planted at a block's name: the load fails ELOOP, and nothing of the link's target
    reaches the slot (neither a valid block of the key, nor any other file's bytes)."""
    src = aligned(SIZE, fill=1)
    target = os.path.join(outside, "target.kvb")
    if target_kind == "valid block":
        assert store(engine, src, target, b"k", direct=False) == [SIZE]
    else:
        with open(target, "wb") as f:
            f.write(src.tobytes() * 2)
    before = file_bytes(target)
    block = os.path.join(root, "b.kvb")
    os.symlink(target, block)
    dst = aligned(SIZE)
    dst[:] = 0xAB  # the caller's own bytes
    assert run_job(engine, Op.READ_BLOCK, [(block, SIZE, addr(dst), key_digest(b"k"))], direct=False) == [-errno.ELOOP]
    assert (dst == 0xAB).all()  # the open was refused: nothing landed
    s = engine.stats()
    assert s["bytes_read"] == 0 and s["requests_failed"] == 1 and s["verify_failures"] == 0
    # a store of that key: the rename never replaces a name that is taken (here by the link),
    # as for another writer's block; the link stays, its target untouched, no temporary left
    assert store(engine, src, block, b"k", direct=False) == [SIZE]
    assert os.path.islink(block) and file_bytes(target) == before
    assert sorted(os.listdir(root)) == ["b.kvb"] and os.listdir(outside) == ["target.kvb"]
    # evicting it removes the link, never its target
    assert run_job(engine, Op.UNLINK, [block]) == [0]
    assert os.listdir(root) == [] and file_bytes(target) == before


def test_hard_linked_block_file_fails_emlink(root, aligned, engine):
    src = aligned(SIZE, fill=2)
    block = os.path.join(root, "b.kvb")
    assert store(engine, src, block, b"k", direct=False) == [SIZE]
    os.link(block, os.path.join(root, "other"))
    dst = aligned(SIZE)
    dst[:] = 0xAB
    assert run_job(engine, Op.READ_BLOCK, [(block, SIZE, addr(dst), key_digest(b"k"))], direct=False) == [-errno.EMLINK]
    assert not dst.any()  # the file was opened: whatever was read is zeroed
    s = engine.stats()
    assert s["bytes_read"] == 0 and s["verify_failures"] == 0
    os.unlink(os.path.join(root, "other"))  # one link again: loads as before
    assert run_job(engine, Op.READ_BLOCK, [(block, SIZE, addr(dst), key_digest(b"k"))], direct=False) == [SIZE]
    assert np.array_equal(dst, src)


def test_failed_verification_zeroes_the_slot(root, aligned, engine):
    src = aligned(SIZE, fill=3)
    block = os.path.join(root, "b.kvb")
    assert store(engine, src, block, b"k", direct=False) == [SIZE]
    dst = aligned(SIZE)
    dst[:] = 0xAB
    # a whole block of another key: its bytes were read into the slot, then refused
    assert run_job(engine, Op.READ_BLOCK, [(block, SIZE, addr(dst), key_digest(b"other"))],
                      direct=False) == [_native.ERR_KEY_MISMATCH]
    assert not dst.any()


def test_symlinked_fanout_directory(root, outside, aligned, engine):
    """blocks/ab is a link to a directory outside the root: stores, loads, unlinks and recycling
    through it fail ELOOP (or leave it alone); nothing outside is created, read, moved or removed."""
    src = aligned(SIZE, fill=4)
    real = os.path.join(root, "cd")
    os.mkdir(real)
    linked = os.path.join(root, "ab")
    os.symlink(outside, linked)
    # an outside file named as a block in the linked directory: a valid block of the key
    outside_block = os.path.join(outside, "x.kvb")
    assert store(engine, src, outside_block, b"x", direct=False) == [SIZE]
    outside_victim = os.path.join(outside, "v.kvb")
    shutil.copyfile(outside_block, outside_victim)
    snapshot = {n: file_bytes(os.path.join(outside, n)) for n in os.listdir(outside)}
    before = engine.stats()

    # store into the linked directory
    assert store(engine, src, os.path.join(linked, "y.kvb"), b"y", direct=False) == [-errno.ELOOP]
    # load through it (a valid block of the key sits there)
    dst = aligned(SIZE)
    dst[:] = 0xAB
    assert run_job(engine, Op.READ_BLOCK, [(os.path.join(linked, "x.kvb"), SIZE, addr(dst), key_digest(b"x"))],
                      direct=False) == [-errno.ELOOP]
    assert (dst == 0xAB).all()
    # evict through it
    assert run_job(engine, Op.UNLINK, [os.path.join(linked, "x.kvb")]) == [-errno.ELOOP]
    # recycle a "victim" through it into a real directory: the victim is left alone, the store
    # writes a fresh file
    final = os.path.join(real, "z.kvb")
    entry = (final + ".tmp", final, SIZE, addr(src), key_digest(b"z"), os.path.join(linked, "v.kvb"))
    assert run_job(engine, Op.WRITE_BLOCK, [entry], direct=False) == [SIZE]
    assert os.listdir(real) == ["z.kvb"] and file_bytes(final)[HEADER_BYTES:] == src.tobytes()
    # recycle a real victim into the linked directory: the store fails, nothing moves outside
    # (the victim, untouched, is removed as any victim that could not be reused)
    victim = os.path.join(real, "z.kvb")
    final2 = os.path.join(linked, "w.kvb")
    entry = (final2 + ".tmp", final2, SIZE, addr(src), key_digest(b"w"), victim)
    assert run_job(engine, Op.WRITE_BLOCK, [entry], direct=False) == [-errno.ELOOP]
    assert os.listdir(real) == []

    assert {n: file_bytes(os.path.join(outside, n)) for n in os.listdir(outside)} == snapshot
    s = engine.stats()
    assert s["bytes_written"] - before["bytes_written"] == SIZE  # only z.kvb
    assert s["bytes_read"] == 0 and s["recycled"] == 0
    assert engine.take_leftovers() == []  # a victim behind a link is never handed back to remove


def test_fanout_swapped_for_a_link_after_use_touches_nothing_outside(root, outside, aligned, engine):
    """A fan-out directory used once, then moved away and replaced by a link to an outside
    directory holding files of the same names: an unlink and a recycling store by the old paths
    never touch the outside files. The io_uring engine works relative to the directory descriptor
    it opened link-free on first use, so it reaches the moved real directory (an unlink is one
    SQE, a recycling store 7: rename, statx, open, header, data, close, rename); the posix engine
    resolves each path again and fails ELOOP."""
    src = aligned(SIZE, fill=5)
    fan = os.path.join(root, "ab")
    os.mkdir(fan)
    a, v = os.path.join(fan, "a.kvb"), os.path.join(fan, "v.kvb")
    assert store(engine, src, a, b"a", direct=False) == [SIZE]
    assert store(engine, src, v, b"v", direct=False) == [SIZE]
    for name in ("a.kvb", "v.kvb", "n.kvb"):
        with open(os.path.join(outside, name), "wb") as f:
            f.write(b"OUTSIDE " + name.encode())
    snapshot = {name: file_bytes(os.path.join(outside, name)) for name in os.listdir(outside)}
    moved = fan + ".moved"
    os.rename(fan, moved)
    os.symlink(outside, fan)
    uring = isinstance(engine, _native.Engine)

    before = engine.stats()
    assert run_job(engine, Op.UNLINK, [a]) == [0 if uring else -errno.ELOOP]
    mid = engine.stats()
    n = os.path.join(fan, "n.kvb")
    entry = (n + ".tmp", n, SIZE, addr(src), key_digest(b"n"), v)
    assert run_job(engine, Op.WRITE_BLOCK, [entry], direct=False) == [SIZE if uring else -errno.ELOOP]
    after = engine.stats()

    assert {name: file_bytes(os.path.join(outside, name)) for name in os.listdir(outside)} == snapshot
    if uring:
        assert os.listdir(moved) == ["n.kvb"]  # a removed, v recycled into n
        assert file_bytes(os.path.join(moved, "n.kvb"))[HEADER_BYTES:] == src.tobytes()
        assert mid["sqes"] - before["sqes"] == 1
        assert after["sqes"] - mid["sqes"] == 7 and after["recycled"] - mid["recycled"] == 1
    else:
        assert sorted(os.listdir(moved)) == ["a.kvb", "v.kvb"]
    assert engine.take_leftovers() == []


# ------------------------------------------------------------------------- 3: file modes


@pytest.fixture
def umask022():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.parametrize("mode", [None, 0o600, 0o640, 0o660])
def test_created_files_get_the_exact_mode(root, aligned, engine, umask022, mode):
    """file_mode (default 0o600) is the created file's mode exactly: 0o660 too, whose group
    write bit the umask 022 would take."""
    src = aligned(SIZE, fill=5)
    kw = {} if mode is None else {"file_mode": mode}
    block = os.path.join(root, "b.kvb")
    assert store(engine, src, block, b"k", direct=False, **kw) == [SIZE]
    assert os.stat(block).st_mode & 0o777 == (0o600 if mode is None else mode)
    raw = os.path.join(root, "raw")
    assert run_job(engine, Op.WRITE, [(raw + ".t", 0, SIZE, addr(src), raw)], direct=False, **kw) == [SIZE]
    assert os.stat(raw).st_mode & 0o777 == (0o600 if mode is None else mode)


def test_recycled_file_takes_the_mode(root, aligned, engine, umask022):
    src = aligned(SIZE, fill=6)
    victim = os.path.join(root, "v.kvb")
    assert store(engine, src, victim, b"v", direct=False, file_mode=0o644) == [SIZE]
    final = os.path.join(root, "n.kvb")
    entry = (final + ".tmp", final, SIZE, addr(src), key_digest(b"n"), victim)
    assert run_job(engine, Op.WRITE_BLOCK, [entry], direct=False) == [SIZE]
    assert engine.stats()["recycled"] == 1 and os.listdir(root) == ["n.kvb"]
    assert os.stat(final).st_mode & 0o777 == 0o600


@pytest.mark.parametrize("bad", [0o1600, 0o400, 0o200, 0o1000])
def test_bad_file_mode_is_refused(root, aligned, engine, bad):
    src = aligned(SIZE)
    with pytest.raises(ValueError, match=r"^file_mode must be permission bits \(within 0o777\) with owner "
                                         rf"read and write \(0o600\) set, got {oct(bad)}$"):
        store(engine, src, os.path.join(root, "b.kvb"), b"k", direct=False, file_mode=bad)
    assert os.listdir(root) == [] and engine.stats()["jobs_submitted"] == 0


# ------------------------------------------------------------------------- 5: short reads, EIO


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_file_truncated_meanwhile_is_short(direct_root, aligned, engine, direct):
    src = aligned(SIZE, fill=7)
    blocks = [os.path.join(direct_root, f"b{i}.kvb") for i in range(2)]
    for b in blocks:
        assert store(engine, src, b, b"k") == [SIZE]
    os.truncate(blocks[0], HEADER_BYTES + SIZE // 2 + 100)  # payload cut, unaligned end
    os.truncate(blocks[1], 1000)                            # header cut
    dst = aligned(2 * SIZE)
    dst[:] = 0xAB
    res = run_job(engine, Op.READ_BLOCK, [(b, SIZE, addr(dst) + i * SIZE, key_digest(b"k")) for i, b in enumerate(blocks)],
                     direct=direct)
    assert res == [_native.ERR_SHORT] * 2
    assert not dst.any()
    assert engine.stats()["verify_failures"] == 0


@contextlib.contextmanager
def eio_block(src):
    """A block file (SIZE payload, key b"e") on a small ext4 whose loop device (direct I/O) lost
    the end of its backing file: the header and the first half of the payload read, the rest
    fails EIO, as a bad sector does. Yields the block's path."""
    need_root()
    base = tempfile.mkdtemp(prefix="eio-")
    img = os.path.join(base, "img")
    mnt = os.path.join(base, "mnt")
    os.mkdir(mnt)
    loop = None
    try:
        with open(img, "wb") as f:
            f.truncate(32 << 20)
        subprocess.run(["mkfs.ext4", "-q", "-O", "^has_journal", "-b", "4096", img], check=True,
                       capture_output=True)
        proc = subprocess.run(["losetup", "--direct-io=on", "-f", "--show", img], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"no loop device: {proc.stderr.strip()}")
        loop = proc.stdout.strip()
        subprocess.run(["mount", loop, mnt], check=True, capture_output=True)
        block = os.path.join(mnt, "e.kvb")
        w = _native.PosixEngine(queue_depth=1, threads=1)
        try:
            assert run_job(w, Op.WRITE_BLOCK, [(block + ".t", block, SIZE, addr(src), key_digest(b"e"))],
                         fsync=True) == [SIZE]
        finally:
            w.shutdown()
        out = subprocess.run(["filefrag", "-v", block], capture_output=True, text=True, check=True).stdout
        m = re.search(r"^\s*0:\s*0\.\.\s*(\d+):\s*(\d+)\.\.\s*(\d+):\s*(\d+):", out, re.M)
        assert m, out
        first, length = int(m.group(2)), int(m.group(4))  # physical block of logical 0, extent length
        assert length == (HEADER_BYTES + SIZE) // 4096, out  # one extent
        # keep the header and half the payload on the device
        keep = first + (HEADER_BYTES + SIZE // 2) // 4096
        os.truncate(img, keep * 4096)
        yield block
    finally:
        if loop:
            subprocess.run(["umount", mnt], capture_output=True)
            subprocess.run(["losetup", "-d", loop], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


def drop_cache(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_eio_part_way_is_reported_as_eio(aligned, engine, direct):
    """A read that fails EIO after some bytes (a buffered read returns them short): EIO, not
    "truncated", not a verification failure; the slot holds zeros."""
    src = aligned(SIZE, fill=8)
    with eio_block(src) as block:
        drop_cache(block)
        dst = aligned(SIZE)
        dst[:] = 0xAB
        assert run_job(engine, Op.READ_BLOCK, [(block, SIZE, addr(dst), key_digest(b"e"))], direct=direct) == [-errno.EIO]
        assert not dst.any()
        s = engine.stats()
        assert s["verify_failures"] == 0 and s["bytes_read"] == 0 and s["requests_failed"] == 1


# ------------------------------------------------------------------------- 6: durable renames


def test_fsync_syncs_each_directory_once_per_job(root, aligned, engine):
    n_dirs, per_dir = 3, 2
    src = aligned(n_dirs * per_dir * SIZE, fill=9)
    dirs = [os.path.join(root, f"d{i}") for i in range(n_dirs)]
    for d in dirs:
        os.mkdir(d)

    def entries(tag):
        out = []
        for i in range(n_dirs * per_dir):
            final = os.path.join(dirs[i % n_dirs], f"{tag}{i}.kvb")
            out.append((final + ".tmp", final, SIZE, addr(src) + i * SIZE, key_digest(b"%s%d" % (tag.encode(), i))))
        return out

    assert run_job(engine, Op.WRITE_BLOCK, entries("a")) == [SIZE] * 6  # fsync=False
    assert engine.stats()["dir_fsyncs"] == 0
    assert run_job(engine, Op.WRITE_BLOCK, entries("b"), fsync=True) == [SIZE] * 6
    assert engine.stats()["dir_fsyncs"] == n_dirs
    if isinstance(engine, _native.Engine):
        engine.submit(7, Op.WRITE_BLOCK, entries("c"), fsync=True)
        engine.drain()
        assert [(j, r) for j, _op, r, *_ in engine.poll()] == [(7, [SIZE] * 6)]
    else:
        assert run_job(engine, Op.WRITE_BLOCK, entries("c"), fsync=True) == [SIZE] * 6
    assert engine.stats()["dir_fsyncs"] == 2 * n_dirs
    # a failed entry's directory is not synced; a job with nothing renamed syncs nothing
    bad = [(os.path.join(root, "gone", "x.tmp"), os.path.join(root, "gone", "x.kvb"), SIZE, addr(src),
            key_digest(b"x"))]
    assert run_job(engine, Op.WRITE_BLOCK, bad, fsync=True) == [-errno.ENOENT]
    assert engine.stats()["dir_fsyncs"] == 2 * n_dirs
    # reads and unlinks sync nothing
    assert run_job(engine, Op.UNLINK, [e[1] for e in entries("a")]) == [0] * 6
    assert engine.stats()["dir_fsyncs"] == 2 * n_dirs


# ------------------------------------------------------------------------- 7: leftovers


def test_temporary_that_cannot_be_removed_is_a_leftover(root, aligned, engine):
    """An append-only directory (chattr +a): files can be created there but never renamed away or
    removed. The store fails at its rename (EPERM) and its temporary stays: reported once."""
    src = aligned(SIZE, fill=10)
    d = os.path.join(root, "ab")
    os.mkdir(d)
    final = os.path.join(d, "b.kvb")
    with attribute(d, "a"):
        assert store(engine, src, final, b"k") == [-errno.EPERM]
        assert engine.take_leftovers() == [final + ".tmp"]
        assert engine.take_leftovers() == []  # once
        assert os.listdir(d) == ["b.kvb.tmp"]
    os.unlink(final + ".tmp")  # the caller's to remove
    assert store(engine, src, final, b"k") == [SIZE]
    assert engine.take_leftovers() == []


def test_recycle_victim_that_cannot_be_removed_is_a_leftover(root, aligned, engine):
    src = aligned(SIZE, fill=11)
    vdir, ndir = os.path.join(root, "v"), os.path.join(root, "n")
    os.mkdir(vdir)
    os.mkdir(ndir)
    victim = os.path.join(vdir, "old.kvb")
    assert store(engine, src, victim, b"old") == [SIZE]
    final = os.path.join(ndir, "new.kvb")
    entry = (final + ".tmp", final, SIZE, addr(src), key_digest(b"new"), victim)
    with attribute(vdir, "a"):
        # the victim can be neither renamed out of its directory nor removed: a fresh file is
        # written, the victim handed back
        assert run_job(engine, Op.WRITE_BLOCK, [entry]) == [SIZE]
        assert engine.take_leftovers() == [victim]
        s = engine.stats()
        assert s["recycled"] == 0 and s["recycle_failures"] == 1
    assert os.listdir(vdir) == ["old.kvb"] and os.listdir(ndir) == ["new.kvb"]
    assert engine.take_leftovers() == []


# ------------------------------------------------------------------------- 9/10: O_DIRECT probe


@pytest.mark.parametrize("tmpfile", [True, False], ids=["tmpfile", "named"])
def test_probe_leaves_nothing_and_skips_a_leftover(root, tmpfile):
    leftover = os.path.join(root, f".pykvtier-direct-probe-{os.getpid()}")
    with open(leftover, "wb") as f:
        f.write(b"crashed run")
    p = _native.probe_direct(root, tmpfile=tmpfile)
    assert isinstance(p["direct"], bool) and p["reason"]
    assert os.listdir(root) == [os.path.basename(leftover)]
    assert file_bytes(leftover) == b"crashed run"
    os.unlink(leftover)
    assert _native.probe_direct(root, tmpfile=tmpfile)["direct"] == p["direct"]
    assert os.listdir(root) == []


@pytest.mark.parametrize("tmpfile", [True, False], ids=["tmpfile", "named"])
def test_probe_on_ramfs_refuses_direct_and_leaves_nothing(tmpfile):
    with mounted("ramfs") as where:
        p = _native.probe_direct(where, tmpfile=tmpfile)
        assert p["direct"] is False and "O_DIRECT" in p["reason"]
        assert os.listdir(where) == []
        assert _native.probe_direct(where, tmpfile=tmpfile)["direct"] is False  # same pid again


def fill(where: str, prefix: str = "fill") -> None:
    """Uses up every inode and byte of the file system at where (files prefix0, prefix1, ...)."""
    i = 0
    chunk = b"\xee" * (64 * KiB)
    while True:
        try:
            fd = os.open(os.path.join(where, f"{prefix}{i}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
            return
        i += 1
        with os.fdopen(fd, "wb", buffering=0) as f:
            try:
                while True:
                    f.write(chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc


def test_probe_on_a_full_file_system(aligned):
    """No inode and no byte left: the probe answers from an existing block file (an O_DIRECT
    read), or says direct=False with the reason; it never raises."""
    with mounted("tmpfs", "size=1m,nr_inodes=16") as where:
        blocks = os.path.join(where, "blocks")
        os.makedirs(os.path.join(blocks, "ab"))
        src = aligned(SIZE, fill=12)
        block = os.path.join(blocks, "ab", "b.kvb")
        e = _native.PosixEngine(queue_depth=1, threads=1)
        try:
            assert run_job(e, Op.WRITE_BLOCK, [(block + ".t", block, SIZE, addr(src), key_digest(b"b"))],
                         direct=False) == [SIZE]
        finally:
            e.shutdown()
        fill(where)
        with pytest.raises(OSError):
            os.open(os.path.join(blocks, "x"), os.O_WRONLY | os.O_CREAT)  # full indeed
        for tmpfile in (True, False):
            p = _native.probe_direct(blocks, tmpfile=tmpfile)
            assert "full (No space left on device)" in p["reason"] and block in p["reason"], p
            # (whether this kernel's tmpfs takes O_DIRECT: the read answered, and says which)
            assert p["direct"] is p["reason"].startswith("ok"), p
            # where it does, it takes unaligned reads too (through the page cache): not enforced
            assert p["alignment_enforced"] is (False if p["direct"] else None), p
            assert p["alignment_probe"] == ("" if not p["direct"] else
                                            "an O_DIRECT read of 4096 B at file offset 1: taken (4096 B); an O_DIRECT "
                                            "read of 4096 B from memory 1 byte past its alignment: taken (4096 B)"), p
        assert sorted(os.listdir(blocks)) == ["ab"] and os.listdir(os.path.join(blocks, "ab")) == ["b.kvb"]
        os.unlink(block)  # nothing left to read; full again
        fill(where, "more")
        p = _native.probe_direct(blocks)
        assert p["direct"] is False, p
        assert p["reason"] == ("cannot probe O_DIRECT: the file system is full (No space left on device) "
                               f"and no file under {blocks} to read"), p
