"""Operators' commands (pykvtier.admin; ``pykvtier du | fsck | gc | quarantine``).

Roots are made by DiskTier with real stored blocks; damage is done by hand (a flipped payload
byte, a flipped header byte, a truncation, a file renamed to another key's name, a block of
another size, a symlink at a block name, a hard-linked block file, a fan-out directory replaced
by a link). Values are checked through the functions, exit codes and the one-line refusals
through the command line (a subprocess).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from pykvtier import DiskTier, LookupResult, TransferJob, _native, admin
from pykvtier.buffers import host_arena
from pykvtier.layout import HEADER_BYTES, RootLockedError, key_digest

BS = 64 << 10
FB = BS + HEADER_BYTES
NO_PROBLEM = dict.fromkeys(admin.CORRUPT_REASONS, 0)


# ------------------------------------------------------------------------- helpers


def payload(i: int, nbytes: int = BS) -> np.ndarray:
    return np.random.default_rng(1000 + i).integers(0, 256, nbytes, dtype=np.uint8)


def make_root(root: str, keys: list[bytes], bs: int = BS, seed: int = 0) -> dict[bytes, bytes]:
    """Stores one block per key (payload from ``seed + index``) with a DiskTier, shut down after.
    Returns key -> payload bytes."""
    arena = host_arena(len(keys), bs)
    data = {}
    for i, k in enumerate(keys):
        arena[i] = payload(seed + i, bs)
        data[k] = arena[i].tobytes()
    with DiskTier(root, bs) as t:
        t.set_arena(arena)
        t.submit_store(TransferJob(1, keys, list(range(len(keys)))))
        t.drain()
        (res,) = t.get_finished_jobs()
        assert res.success, res.failed_keys
    return data


def block_path(root: str, key: bytes) -> str:
    h = key_digest(key).hex()
    return os.path.join(os.path.realpath(root), "blocks", h[:2], f"{h}.kvb")


def load_all(root: str, keys: list[bytes], bs: int = BS) -> tuple[DiskTier, dict[bytes, bytes]]:
    """Opens a DiskTier on root and loads every key it has (HIT): key -> bytes loaded."""
    t = DiskTier(root, bs)
    arena = host_arena(max(1, len(keys)), bs)
    t.set_arena(arena)
    hits = [k for k in keys if t.lookup(k) is LookupResult.HIT]
    out: dict[bytes, bytes] = {}
    if hits:
        t.submit_load(TransferJob(7, hits, list(range(len(hits)))))
        t.drain()
        (res,) = t.get_finished_jobs()
        assert res.success, res.failed_keys
        out = {k: arena[i].tobytes() for i, k in enumerate(hits)}
    return t, out


def snapshot(top: str) -> dict[str, tuple]:
    """Every entry under top (links not followed): kind, size, content hash / link target, links."""
    snap = {}
    for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            rel = os.path.relpath(p, top)
            if os.path.islink(p):
                snap[rel] = ("link", os.readlink(p))
            elif os.path.isdir(p):
                snap[rel] = ("dir",)
            else:
                with open(p, "rb") as f:
                    snap[rel] = ("file", st.st_size, st.st_nlink, hashlib.sha256(f.read()).hexdigest())
    return snap


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "pykvtier.cli", *args], capture_output=True,
                          text=True, timeout=300)


def flip(path: str, offset: int) -> None:
    """Inverts the byte at ``offset`` of the file."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def unused_fanout(keys: list[bytes]) -> str:
    used = {key_digest(k).hex()[:2] for k in keys}
    return next(f"{i:02x}" for i in range(256) if f"{i:02x}" not in used)


KEYS = [b"key-%d" % i for i in range(10)]
OTHER = b"a key never stored"


@pytest.fixture
def damaged(root: str, tmp_path) -> dict:
    """A root of 10 blocks, 7 of them damaged one way each, plus a fan-out link; the outside
    files that links point at live under tmp_path/outside."""
    data = make_root(root, KEYS)
    other_root = str(tmp_path / "other-size")
    make_root(other_root, [KEYS[4]], bs=2 * BS, seed=50)
    outside = tmp_path / "outside"
    outside.mkdir()
    p = {i: block_path(root, k) for i, k in enumerate(KEYS)}
    flip(p[0], HEADER_BYTES + 100)  # a payload byte
    flip(p[1], 0)  # a magic byte
    os.truncate(p[2], HEADER_BYTES + BS // 2)  # truncated
    renamed = block_path(root, OTHER)  # key-3's file under another key's name
    os.rename(p[3], renamed)
    shutil.copyfile(block_path(other_root, KEYS[4]), p[4])  # a whole block of another size
    shutil.copyfile(p[5], outside / "target.kvb")  # a link at key-5's name to a valid copy
    os.unlink(p[5])
    os.symlink(outside / "target.kvb", p[5])
    os.link(p[6], outside / "hardlink.kvb")  # key-6's file has a second name outside the root
    fan = unused_fanout(KEYS + [OTHER])
    fandir = os.path.join(os.path.realpath(root), "blocks", fan)
    os.rmdir(fandir)
    (outside / "fanout").mkdir()
    shutil.copyfile(p[7], outside / "fanout" / os.path.basename(p[7]))
    os.symlink(outside / "fanout", fandir)
    return {"root": root, "data": data, "paths": p, "renamed": renamed, "fanout": fandir,
            "outside": str(outside)}


EXPECTED = {"header": 1, "key_mismatch": 1, "length": 1, "checksum": 1, "short": 1, "io_error": 0}


def expected_problems(d: dict) -> dict[str, str]:
    p = d["paths"]
    return {p[0]: "checksum", p[1]: "header", p[2]: "short", d["renamed"]: "key_mismatch",
            p[4]: "length", p[5]: "non_block", p[6]: "non_block", d["fanout"]: "non_block"}


# ------------------------------------------------------------------------- fsck


def test_fsck_clean_root(root: str) -> None:
    make_root(root, KEYS[:6])
    r = admin.fsck(root)
    assert (r["checked"], r["ok"], r["corrupt"], r["non_block_entries"], r["problems"]) == (
        6, 6, NO_PROBLEM, 0, [])
    assert r["clean"] is True and r["block_size_bytes"] == BS and r["block_size_from"] == "root marker"
    proc = cli("fsck", root, "--json")
    assert proc.returncode == 0, proc.stderr
    j = json.loads(proc.stdout)
    assert (j["ok"], j["corrupt"], j["clean"]) == (6, NO_PROBLEM, True)


@pytest.mark.parametrize("engine", ["uring", "posix"])
def test_fsck_counts_each_reason_and_changes_nothing(damaged: dict, engine: str, tmp_path) -> None:
    root = damaged["root"]
    before = snapshot(os.path.realpath(root)), snapshot(damaged["outside"])
    # 3-block jobs, 2 in flight: several jobs, each damaged block in some job
    r = admin.fsck(root, engine=engine, batch=3, jobs_in_flight=2)
    assert r["engine"] == engine
    assert r["checked"] == 8  # 10 stored - the link - the hard-linked file
    assert r["ok"] == 3  # key-7, key-8, key-9
    assert r["corrupt"] == EXPECTED
    assert r["non_block_entries"] == 3
    assert {p["path"]: p["reason"] for p in r["problems"]} == expected_problems(damaged)
    assert r["repaired"] == 0 and r["clean"] is False
    assert (snapshot(os.path.realpath(root)), snapshot(damaged["outside"])) == before


def test_fsck_cli_exit_codes_and_json(damaged: dict) -> None:
    root = damaged["root"]
    before = snapshot(os.path.realpath(root))
    proc = cli("fsck", root, "--json")
    assert proc.returncode == 1, proc.stderr
    j = json.loads(proc.stdout)
    assert (j["ok"], j["corrupt"], j["non_block_entries"]) == (3, EXPECTED, 3)
    text = cli("fsck", root)
    assert text.returncode == 1
    assert "corrupt     5  (header 1, key mismatch 1, length 1, checksum 1, short 1, I/O errors 0)" \
        in text.stdout
    assert "run with --repair" in text.stdout
    assert snapshot(os.path.realpath(root)) == before


def test_fsck_repair_quarantines_exactly_the_bad_ones(damaged: dict) -> None:
    root = damaged["root"]
    real = os.path.realpath(root)
    outside_before = snapshot(damaged["outside"])
    proc = cli("fsck", root, "--repair", "--json")
    assert proc.returncode == 1, proc.stderr  # problems were found (and repaired)
    j = json.loads(proc.stdout)
    bad = expected_problems(damaged)
    assert j["repaired"] == len(bad) == 8 and j["repair_failures"] == []
    assert j["quarantine_files"] == 8
    # each moved as the entry itself, named as DiskTier names quarantine entries
    names = sorted(os.listdir(os.path.join(real, "quarantine")))
    fan = os.path.basename(damaged["fanout"])
    want = sorted([os.path.basename(p) for p in bad if p != damaged["fanout"]] + [f"blocks-{fan}"])
    assert sorted(n.rpartition(".")[0] for n in names) == want
    assert all(n.rpartition(".")[2].isdigit() for n in names)
    moved_link = next(n for n in names if n.startswith(os.path.basename(damaged["paths"][5])))
    assert os.path.islink(os.path.join(real, "quarantine", moved_link))
    for p in bad:
        assert not os.path.lexists(p) or p == damaged["fanout"]
    assert os.path.isdir(damaged["fanout"]) and not os.path.islink(damaged["fanout"])  # recreated
    # nothing outside the root was read into the quarantine, changed or removed
    after = snapshot(damaged["outside"])
    assert after.keys() == outside_before.keys()
    assert after["hardlink.kvb"][3] == outside_before["hardlink.kvb"][3]
    assert after["target.kvb"] == outside_before["target.kvb"]
    assert after["fanout"] == outside_before["fanout"]
    # a second check is clean, and a tier loads the rest byte-exact
    assert cli("fsck", root).returncode == 0
    t, loaded = load_all(root, KEYS + [OTHER])
    try:
        assert t.num_blocks == 3
        assert loaded == {k: damaged["data"][k] for k in KEYS[7:]}
    finally:
        t.shutdown()


def test_fsck_other_shapes(root: str, tmp_path) -> None:
    """A smaller block size's whole block is 'length' (not truncated), as is a valid block with
    bytes appended; a file shorter than a header is 'short'; a directory at a block name and a
    block file in another fan-out directory are non-block entries."""
    keys = KEYS[:6]
    make_root(root, keys)
    small = str(tmp_path / "small")
    make_root(small, [keys[0]], bs=BS // 2, seed=9)
    shutil.copyfile(block_path(small, keys[0]), block_path(root, keys[0]))
    with open(block_path(root, keys[1]), "ab") as f:
        f.write(b"extra")
    os.truncate(block_path(root, keys[2]), 100)
    os.unlink(block_path(root, keys[3]))
    os.mkdir(block_path(root, keys[3]))
    src = block_path(root, keys[4])
    fan = unused_fanout(keys)
    misplaced = os.path.join(os.path.realpath(root), "blocks", fan, os.path.basename(src))
    os.rename(src, misplaced)
    r = admin.fsck(root)
    assert (r["checked"], r["ok"]) == (4, 1)
    assert r["corrupt"] == {**NO_PROBLEM, "length": 2, "short": 1}
    assert {p["path"]: p["reason"] for p in r["problems"]} == {
        block_path(root, keys[0]): "length", block_path(root, keys[1]): "length",
        block_path(root, keys[2]): "short", block_path(root, keys[3]): "non_block",
        misplaced: "non_block"}
    r = admin.fsck(root, repair=True)
    assert r["repaired"] == 5
    t, loaded = load_all(root, keys)
    try:
        assert list(loaded) == [keys[5]] and t.num_blocks == 1
    finally:
        t.shutdown()


@pytest.fixture
def ramfs_root(tmp_path):
    """A root on ramfs (refuses O_DIRECT at open); skipped where it cannot be mounted."""
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount ramfs here (needs root)")
    try:
        yield str(mnt / "root")
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_fsck_where_o_direct_is_refused(root: str, ramfs_root: str, monkeypatch) -> None:
    make_root(root, KEYS[:3])
    shutil.copytree(root, ramfs_root, symlinks=True)  # (made on disk: fsck is under test here)
    flip(block_path(ramfs_root, KEYS[0]), HEADER_BYTES + 7)
    r = admin.fsck(ramfs_root)
    assert (r["direct"], r["ok"], r["corrupt"]) == (False, 2, {**NO_PROBLEM, "checksum": 1})
    # O_DIRECT reads that fail with EINVAL are read again buffered, not counted as I/O errors
    monkeypatch.setattr(admin, "_direct_ok", lambda path, block_size: True)
    r = admin.fsck(ramfs_root)
    assert (r["direct"], r["ok"], r["corrupt"]) == (False, 2, {**NO_PROBLEM, "checksum": 1})


def test_fsck_without_marker_takes_the_first_header(root: str) -> None:
    make_root(root, KEYS[:3])
    os.unlink(os.path.join(os.path.realpath(root), "pykvtier-root.json"))
    r = admin.fsck(root)
    assert (r["block_size_bytes"], r["ok"], r["clean"]) == (BS, 3, True)
    assert r["block_size_from"].startswith("header of ")


def test_malformed_marker_is_one_line_and_exit_2(root: str) -> None:
    make_root(root, KEYS[:2])
    with open(os.path.join(os.path.realpath(root), "pykvtier-root.json"), "w") as f:
        f.write("{not json")
    for args in (("fsck", root), ("du", root)):
        proc = cli(*args)
        assert proc.returncode == 2, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and "pykvtier-root.json" in proc.stderr


def test_fsck_reasons_of_results() -> None:
    assert admin._reason(BS, BS) == "ok"
    assert admin._reason(-errno.EIO, BS) == "io_error"
    assert admin._reason(-errno.ELOOP, BS) == "io_error"
    assert admin._reason(-errno.ENOENT, BS) == "vanished"
    assert [admin._reason(c, BS) for c in (_native.ERR_BAD_HEADER, _native.ERR_KEY_MISMATCH,
                                           _native.ERR_LENGTH, _native.ERR_CHECKSUM,
                                           _native.ERR_SHORT)] == [
        "header", "key_mismatch", "length", "checksum", "short"]


def test_fsck_progress_bar_on_stderr(root: str, capsys) -> None:
    make_root(root, KEYS[:4])
    admin.fsck(root, progress=True)
    err = capsys.readouterr().err
    assert "fsck" in err and "4/4" in err


# ------------------------------------------------------------------------- du


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_du_counts_and_bytes(root: str, tmp_path) -> None:
    keys = KEYS[:5]
    make_root(root, keys)
    real = os.path.realpath(root)
    other_root = str(tmp_path / "other")
    make_root(other_root, [OTHER], bs=2 * BS)
    shutil.copyfile(block_path(other_root, OTHER), block_path(root, OTHER))  # another size
    for i, k in enumerate(keys):
        os.utime(block_path(root, k), ns=(0, 1_600_000_000_000_000_000 + i * 10**9))
    os.utime(block_path(root, OTHER), ns=(0, 1_600_000_000_000_000_000 + 99 * 10**9))
    qdir = os.path.join(real, "quarantine")
    with open(os.path.join(qdir, "x.kvb.123"), "wb") as f:
        f.write(b"q" * 3000)
    with open(os.path.join(qdir, "y.kvb.124"), "wb") as f:
        f.write(b"q" * 500)
    gone = dead_pid()
    fan = os.path.join(real, "blocks", "00")
    with open(os.path.join(fan, f"{'00' * 16}.kvb.tmp.{gone}.1"), "wb") as f:
        f.write(b"t" * 1000)
    with open(os.path.join(fan, f"{'00' * 16}.kvb.tmp.{gone}.2"), "wb") as f:
        f.write(b"t" * 10)
    with open(os.path.join(fan, f"{'01' * 16}.kvb.tmp.{os.getpid()}.1"), "wb") as f:
        f.write(b"t" * 2000)
    os.symlink("/etc/passwd", os.path.join(fan, f"{'00' * 15}ff.kvb"))  # a link at a block name
    with open(os.path.join(fan, "notes.txt"), "w") as f:
        f.write("x")
    r = admin.disk_usage(root)
    assert r["block_size_bytes"] == BS and r["block_size_from"] == "root marker"
    assert (r["blocks"], r["bytes"]) == (6, 5 * FB + 2 * BS + HEADER_BYTES)
    assert r["by_block_size"] == [
        {"block_size_bytes": BS, "file_bytes": FB, "blocks": 5, "bytes": 5 * FB, "matches_root": True},
        {"block_size_bytes": 2 * BS, "file_bytes": 2 * BS + HEADER_BYTES, "blocks": 1,
         "bytes": 2 * BS + HEADER_BYTES, "matches_root": False}]
    assert r["quarantine"]["files"] == 2 and r["quarantine"]["bytes"] == 3500
    assert r["temporaries"] == {"live": {"files": 1, "bytes": 2000, "pids": [os.getpid()]},
                                "dead": {"files": 2, "bytes": 1010, "pids": [gone]}}
    assert (r["non_block_entries"], r["other_files"]) == (1, 1)
    assert r["oldest_use"] == 1_600_000_000_000_000_000
    assert r["newest_use"] == 1_600_000_000_000_000_000 + 99 * 10**9
    assert "mtime" in r["use_from"] or "modification" in r["use_from"]
    st = os.statvfs(real)
    assert r["file_system"]["total_bytes"] == st.f_blocks * st.f_frsize
    proc = cli("du", root, "--json")
    assert proc.returncode == 0, proc.stderr
    j = json.loads(proc.stdout)
    assert (j["blocks"], j["bytes"], j["temporaries"]) == (6, r["bytes"], r["temporaries"])
    text = cli("du", root)
    assert text.returncode == 0 and "blocks       6 files" in text.stdout


def test_du_on_an_empty_root(root: str) -> None:
    DiskTier(root, BS).shutdown()
    r = admin.disk_usage(root)
    assert (r["blocks"], r["bytes"], r["oldest_use"], r["by_block_size"]) == (0, 0, None, [])


# ------------------------------------------------------------------------- gc


def test_gc_keeps_the_newest_by_mtime(root: str) -> None:
    keys = KEYS[:8]
    data = make_root(root, keys)
    order = [5, 2, 7, 0, 3, 6, 1, 4]  # order[j] = key index with the j-th oldest mtime
    for j, i in enumerate(order):
        os.utime(block_path(root, keys[i]), ns=(0, 1_700_000_000_000_000_000 + j * 10**9))
    proc = cli("gc", root, "--capacity", "204KiB", "--json")  # 204 KiB = 3 block files exactly
    assert proc.returncode == 0, proc.stderr
    j = json.loads(proc.stdout)
    assert j["capacity_bytes"] == 3 * FB
    assert j["before"] == {"blocks": 8, "bytes": 8 * FB}
    assert j["removed"] == {"blocks": 5, "bytes": 5 * FB}
    assert j["kept"] == {"blocks": 3, "bytes": 3 * FB}
    survivors = [keys[i] for i in order[5:]]
    for k in keys:
        assert os.path.exists(block_path(root, k)) == (k in survivors)
    t, loaded = load_all(root, keys)
    try:
        assert loaded == {k: data[k] for k in survivors}
    finally:
        t.shutdown()
    r = admin.gc(root, 0)
    assert r["removed"] == {"blocks": 3, "bytes": 3 * FB} and r["kept"] == {"blocks": 0, "bytes": 0}


def test_gc_bad_capacity_is_a_usage_error(root: str) -> None:
    make_root(root, KEYS[:2])
    proc = cli("gc", root, "--capacity", "12q")
    assert proc.returncode == 2 and "12q" in proc.stderr
    assert cli("gc", root).returncode == 2  # --capacity is required
    assert all(os.path.exists(block_path(root, k)) for k in KEYS[:2])


# ------------------------------------------------------------------------- quarantine


def test_quarantine_list_and_empty(damaged: dict) -> None:
    root = damaged["root"]
    assert admin.fsck(root, repair=True)["repaired"] == 8
    qdir = os.path.join(os.path.realpath(root), "quarantine")
    nbytes = sum(os.lstat(os.path.join(qdir, n)).st_size for n in os.listdir(qdir)
                 if not os.path.islink(os.path.join(qdir, n))
                 and not os.path.isdir(os.path.join(qdir, n)))
    r = admin.quarantine_list(root)
    assert (r["files"], r["bytes"]) == (8, nbytes)
    proc = cli("quarantine", root, "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["files"] == 8
    proc = cli("quarantine", root, "--empty", "--json")
    assert proc.returncode == 0, proc.stderr
    assert (json.loads(proc.stdout)["removed_files"], json.loads(proc.stdout)["removed_bytes"]) == (8, nbytes)
    assert os.listdir(qdir) == []
    assert admin.quarantine_list(root)["files"] == 0
    assert os.path.exists(os.path.join(damaged["outside"], "target.kvb"))  # the link's target stays
    assert os.listdir(os.path.join(damaged["outside"], "fanout")) == [
        os.path.basename(damaged["paths"][7])]


# ------------------------------------------------------------------------- locks, bad roots


WRITERS = [("fsck", "--repair"), ("gc", "--capacity", "0"), ("quarantine", "--empty")]
READERS = [("du",), ("fsck",), ("quarantine",)]


def test_commands_refuse_a_root_held_by_a_live_tier(root: str) -> None:
    make_root(root, KEYS[:3])
    before = snapshot(os.path.realpath(root))
    t = DiskTier(root, BS, shared=False)
    try:
        for cmd, *rest in READERS + WRITERS:
            proc = cli(cmd, root, *rest)
            assert proc.returncode == 2, (cmd, proc.stdout, proc.stderr)
            lines = proc.stderr.strip().splitlines()
            assert len(lines) == 1 and str(os.getpid()) in lines[0], (cmd, proc.stderr)
            assert proc.stdout == ""
        with pytest.raises(RootLockedError, match=str(os.getpid())):
            admin.disk_usage(root)
    finally:
        t.shutdown()
    assert snapshot(os.path.realpath(root)) == before


def test_shared_tier_allows_reading_commands_only(root: str) -> None:
    make_root(root, KEYS[:3])
    t = DiskTier(root, BS, shared=True)
    try:
        for cmd, *rest in READERS:
            proc = cli(cmd, root, *rest)
            assert proc.returncode == 0, (cmd, proc.stderr)
        for cmd, *rest in WRITERS:
            proc = cli(cmd, root, *rest)
            assert proc.returncode == 2 and str(os.getpid()) in proc.stderr, (cmd, proc.stderr)
    finally:
        t.shutdown()
    assert all(os.path.exists(block_path(root, k)) for k in KEYS[:3])


def test_not_a_root(tmp_path) -> None:
    missing = str(tmp_path / "nope")
    plain = tmp_path / "plain"
    plain.mkdir()
    for args in (("du", missing), ("fsck", str(plain)), ("gc", str(plain), "--capacity", "1"),
                 ("quarantine", missing, "--empty")):
        proc = cli(*args)
        assert proc.returncode == 2, args
        assert os.path.realpath(args[1]) in proc.stderr
    assert not os.path.exists(missing) and os.listdir(plain) == []


def test_tilde_in_the_root_is_the_home_directory(tmp_path, monkeypatch) -> None:
    """``pykvtier du '~/kv'`` (quoted, or from a script that never met a shell) is $HOME/kv, as
    a shell would expand it, for every command; the result names the expanded path."""
    home = tmp_path / "home"
    kv = str(home / "kv")
    make_root(kv, KEYS[:2])
    monkeypatch.setenv("HOME", str(home))
    real = os.path.realpath(kv)
    assert admin.disk_usage("~/kv")["root"] == real
    assert admin.fsck("~/kv")["root"] == real
    assert admin.quarantine_list("~/kv") == {"root": real, "path": os.path.join(real, "quarantine"),
                                             "files": 0, "bytes": 0}
    assert admin.gc("~/kv", 2 * FB)["kept"] == {"blocks": 2, "bytes": 2 * FB}
    proc = subprocess.run([sys.executable, "-P", "-m", "pykvtier.cli", "du", "~/kv", "--json"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HOME": str(home)}, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["root"] == real
    assert sorted(os.listdir(tmp_path)) == ["home"]  # no directory called "~"
