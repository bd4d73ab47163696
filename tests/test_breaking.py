"""Breaking tests: attacks on the issue #9 hardening (planted links, odd entries, bad markers,
full disks, option checks, operators' commands) that found a real problem. Each asserts exact
values; nothing is timed and no sleep synchronizes anything."""

from __future__ import annotations

import json
import os

import pytest

from pykvtier import DiskTier, layout

BS = 4096


def test_lock_file_hard_linked_to_an_outside_file_is_not_written(root, tmp_path):
    """A hard link at ROOT/.pykvtier.lock to a file outside the root: the exclusive holder's
    pid hint (ftruncate + pwrite) must not land in that file."""
    outside = tmp_path / "victim"
    outside.write_bytes(b"VICTIM DATA\n")
    try:
        os.link(outside, os.path.join(root, layout.LOCK_NAME))
    except OSError as exc:  # tmp_path on another file system than the root
        pytest.skip(f"cannot hard-link across {tmp_path} and {root}: {exc}")
    with pytest.raises(ValueError) as ei:
        DiskTier(root, BS)
    assert str(ei.value) == (f"root {os.path.realpath(root)}: its lock file "
                             f"{os.path.realpath(root)}/{layout.LOCK_NAME} has 2 hard links "
                             "(one may be outside the root); remove it")
    assert outside.read_bytes() == b"VICTIM DATA\n"


def test_deeply_nested_marker_is_a_value_error_naming_it(root):
    """A marker of deeply nested JSON was a RecursionError (not naming the marker)."""
    path = os.path.join(root, layout.ROOT_MARKER)
    with open(path, "w") as f:
        f.write("[" * 20000 + "]" * 20000)
    with pytest.raises(ValueError) as ei:
        layout.read_root_config(root)
    assert str(ei.value).startswith(f"root marker {os.path.realpath(path)} is not JSON (")
    with pytest.raises(ValueError) as ei:
        DiskTier(root, BS)
    assert str(ei.value).startswith(f"root marker {os.path.realpath(path)} is not JSON (")


# ------------------------------------------------------------------ racing fan-out swaps

def _renameat2_exchange():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def exchange(a: str, b: str) -> int:  # RENAME_EXCHANGE: both names stay, swapped atomically
        return libc.renameat2(-100, os.fsencode(a), -100, os.fsencode(b), 2)

    return exchange


@pytest.mark.parametrize("engine", ["posix", "uring"])
def test_fanouts_swapped_for_links_while_evicting_touch_nothing_outside(root, tmp_path, engine):
    """A thread swaps fan-out directories with links to outside directories (renameat2
    RENAME_EXCHANGE, and back) while stores evict under a small capacity: every file outside
    stays as it was, none is added, no load returns wrong bytes. Fixed job counts."""
    import hashlib
    import random
    import threading

    import numpy as np

    from pykvtier import TransferJob, host_arena
    from pykvtier.layout import key_digest

    exchange = _renameat2_exchange()
    keys = [b"race-%d" % i for i in range(256)]
    out = tmp_path / "outside"
    planted = {}
    for i in range(256):
        (out / f"{i:02x}").mkdir(parents=True)
    for k in keys:
        h = key_digest(k).hex()
        p = out / h[:2] / f"{h}.kvb"
        p.write_bytes(b"OUTSIDE " + k)
        planted[str(p)] = b"OUTSIDE " + k

    def payload(k: bytes) -> np.ndarray:
        return np.frombuffer(hashlib.blake2b(k, digest_size=64).digest() * (BS // 64), np.uint8)

    tier = DiskTier(root, BS, engine=engine, capacity_bytes=24 * (BS + layout.HEADER_BYTES),
                    recycle=False)
    try:
        arena = host_arena(16, BS)
        tier.set_arena(arena)
        blocks = tier.layout.blocks_dir
        fans = sorted({key_digest(k).hex()[:2] for k in keys})
        for f in fans:
            os.symlink(str(out / f), f"{blocks}/.link-{f}")
        stop = threading.Event()

        def swapper() -> None:
            rnd = random.Random(1)
            while not stop.is_set():
                f = rnd.choice(fans)
                if exchange(f"{blocks}/{f}", f"{blocks}/.link-{f}") == 0:
                    exchange(f"{blocks}/{f}", f"{blocks}/.link-{f}")

        th = threading.Thread(target=swapper)
        th.start()
        rnd = random.Random(2)
        wrong = reported = 0
        try:
            for jid in range(0, 1000, 2):
                ks = rnd.sample(keys, 8)
                for i, k in enumerate(ks):
                    arena[i] = payload(k)
                tier.submit_store(TransferJob(jid, ks, list(range(8))))
                lk = rnd.sample(keys, 8)
                arena[8:16] = 0xEE
                tier.submit_load(TransferJob(jid + 1, lk, list(range(8, 16))))
                tier.drain()
                for r in tier.get_finished_jobs():
                    reported += 1
                    if r.is_load:
                        ok = set(lk) if r.success else set(r.successful_keys or ())
                        wrong += sum(not (arena[8 + i] == payload(k)).all()
                                     for i, k in enumerate(lk) if k in ok)
        finally:
            stop.set()
            th.join()
    finally:
        tier.shutdown()
    assert reported == 1000
    assert wrong == 0
    now = {}
    for d in out.iterdir():
        for p in d.iterdir():
            now[str(p)] = p.read_bytes()
    assert {p for p in planted if p not in now} == set()  # none deleted
    assert {p for p in now if p not in planted} == set()  # none added
    assert {p for p in planted if now[p] != planted[p]} == set()  # none changed


def test_gc_removes_through_the_real_fanout_not_a_link_swapped_in_after_its_scan(
        root, tmp_path, monkeypatch):
    """`pykvtier gc` lists the blocks, then removes them. A fan-out swapped for a link to an
    outside directory in between (here: right after the scan) must not make gc delete the
    outside files of the same names (the removal fails, naming the path)."""
    from pykvtier import TransferJob, admin, host_arena

    tier = DiskTier(root, BS)
    arena = host_arena(1, BS)
    tier.set_arena(arena)
    tier.submit_store(TransferJob(1, [b"gc-key"], [0]))
    tier.drain()
    (res,) = tier.get_finished_jobs()
    assert res.success
    path = tier.layout.block_path(layout.key_digest(b"gc-key"))
    tier.shutdown()
    fan = os.path.dirname(path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / os.path.basename(path)).write_bytes(b"OUTSIDE")
    real_scan = admin._scan

    def scan_then_swap(r):
        s = real_scan(r)
        os.rename(fan, fan + ".real")
        os.symlink(str(outside), fan)
        return s

    monkeypatch.setattr(admin, "_scan", scan_then_swap)
    out = admin.gc(root, 0)
    assert (outside / os.path.basename(path)).read_bytes() == b"OUTSIDE"
    assert os.listdir(fan + ".real") == [os.path.basename(path)]
    assert out["removed"] == {"blocks": 0, "bytes": 0}
    assert out["failures"] == [{"path": path, "error": "Not a directory"}]
    assert out["kept"] == {"blocks": 1, "bytes": BS + layout.HEADER_BYTES}


@pytest.mark.parametrize("argv", [["gc", "", "--capacity", "0"], ["du", ""], ["fsck", ""],
                                  ["quarantine", "", "--empty"]])
def test_operators_commands_refuse_an_empty_root(root, monkeypatch, capsys, argv):
    """An empty ROOT argument was the current directory (realpath('')): `pykvtier gc ''
    --capacity 0` run inside a root removed all its blocks. Refused as DiskTier refuses
    root_dir='' (exit 2, nothing removed)."""
    from pykvtier import TransferJob, cli, host_arena

    tier = DiskTier(root, BS)
    tier.set_arena(host_arena(1, BS))
    tier.submit_store(TransferJob(1, [b"cwd-key"], [0]))
    tier.drain()
    assert tier.get_finished_jobs()[0].success
    path = tier.layout.block_path(layout.key_digest(b"cwd-key"))
    tier.shutdown()
    monkeypatch.chdir(root)
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == (
        f"pykvtier {argv[0]}: root '' is empty (it would mean the current directory)\n")
    assert os.path.getsize(path) == BS + layout.HEADER_BYTES


def test_a_forked_child_does_not_keep_the_root_locked(root):
    """A process forks (multiprocessing's default start method on Linux) while its tier holds
    the root; after shutdown() the root must open again although the child still runs (the
    child's copy of the lock descriptor kept the flock: RootLockedError naming this process)."""
    tier = DiskTier(root, BS)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: wait until the parent is done, then leave at once
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    try:
        tier.shutdown()
        again = DiskTier(root, BS)
        again.shutdown()
    finally:
        os.close(w)
        os.waitpid(pid, 0)
    assert layout.RootLock.holders(root) == []


def test_release_unlocks_although_a_copy_of_the_lock_descriptor_lives_on(root):
    """A copy of the lock's descriptor (a forked child that has not yet run its at-fork hook, a
    dup) shares the flock: release() closing only its own descriptor left the root locked (the
    CI run of test_a_forked_child_does_not_keep_the_root_locked lost that race once)."""
    tier = DiskTier(root, BS)
    copy = os.dup(tier._root_lock._fd)
    try:
        tier.shutdown()
        again = DiskTier(root, BS)
        assert layout.RootLock.holders(root) == [os.getpid()]
        again.shutdown()
    finally:
        os.close(copy)
