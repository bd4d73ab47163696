"""Breaking tests, third round (issue #10): a load into a slot a store in flight reads, a store
evicting its own present key, junk and misplaced names at start-up, huge reserve options, odd
slot-id types. Each found a real problem; each asserts exact values, nothing timed."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from pykvtier import DiskTier, LookupResult, TransferJob, _native
from pykvtier.layout import HEADER_BYTES, key_digest

BS = 4096
FB = BS + HEADER_BYTES
HIT, MISS = LookupResult.HIT, LookupResult.MISS


def finish(tier: DiskTier, *job_ids: int) -> dict:
    done: dict = {}
    while not set(job_ids) <= set(done):
        tier.on_step_end()
        done.update((r.job_id, r) for r in tier.wait())
    return done


@pytest.mark.parametrize("engine", ["uring", "posix"])
def test_a_load_into_a_slot_a_store_in_flight_reads_is_refused(make_tier, root, arena, engine):
    """The store of A from slot 0 is queued; a load of B into slot 0 would (loads go first)
    overwrite what A's store writes: A's block would hold B's bytes under a valid checksum. The
    load is refused (nothing submitted), the store of A holds A's bytes; and the other way round
    a store from a slot a load fills is refused."""
    tier = make_tier(root, engine=engine, queue_depth=1)
    a = arena(4, BS)
    a[0] = 0xBB
    tier.set_arena(a)
    tier.submit_store(TransferJob(1, [b"B"], [0]))
    finish(tier, 1)
    a[0] = 0xAA
    tier.submit_store(TransferJob(2, [b"A"], [0]))
    with pytest.raises(ValueError) as ei:
        tier.submit_load(TransferJob(3, [b"B"], [0]))
    assert str(ei.value) == ("job 3: slot 0 is being read by a store in flight (the load would "
                             "overwrite what it stores)")
    assert finish(tier, 2)[2].success is True
    # Slot 0 is free again: the load of B goes in; a store from slot 0 meanwhile is refused.
    tier.submit_load(TransferJob(3, [b"B"], [0]))
    with pytest.raises(ValueError) as ei:
        tier.submit_store(TransferJob(4, [b"C", b"E"], [1, 0]))
    assert str(ei.value) == ("job 4: slot 0 is being loaded by another job (a store from it "
                             "would write what that load leaves there)")
    assert finish(tier, 3)[3].success is True and bool((a[0] == 0xBB).all())
    tier.submit_load(TransferJob(5, [b"A"], [2]))
    assert finish(tier, 5)[5].success is True and bool((a[2] == 0xAA).all())
    # Two stores from one slot share it; a job id refused above may be used again.
    tier.submit_store(TransferJob(4, [b"C"], [1]))
    tier.submit_store(TransferJob(6, [b"D"], [1]))
    done = finish(tier, 4, 6)
    assert (done[4].success, done[6].success) == (True, True)
    assert tier._claims.claimed() == 0


def test_slot_claims_count_store_readers(arena):
    c = _native.SlotClaims(4)
    s01 = np.array([0, 1], np.int64).tobytes()
    s1 = np.array([1], np.int64).tobytes()
    c.claim(1, s01, False)
    c.claim(2, s1 + s1, False)  # (one store job may read a slot twice)
    assert c.claimed() == 2
    with pytest.raises(ValueError):
        c.claim(3, s1, True)
    c.release(s1 + s1, False)
    with pytest.raises(ValueError):  # job 1 still reads slot 1
        c.claim(3, s1, True)
    c.release(s01, False)
    assert c.claimed() == 0
    c.claim(3, s1, True)
    assert c.claimed() == 1


@pytest.mark.parametrize("recycle", [True, False])
def test_a_store_does_not_evict_its_own_present_key(make_tier, root, arena, recycle):
    """A full tier (capacity 3 blocks: a, x, y, a least recently used). A store of [a, b, c]:
    a is present (skipped, reported stored), b and c need room: they evict x and y, never a."""
    tier = make_tier(root, capacity_bytes=3 * FB, recycle=recycle)
    ar = arena(8, BS)
    for i in range(8):
        ar[i] = i
    tier.set_arena(ar)
    for jid, key, slot in ((1, b"a", 0), (2, b"x", 1), (3, b"y", 2)):
        tier.submit_store(TransferJob(jid, [key], [slot]))
        finish(tier, jid)
    tier.submit_store(TransferJob(4, [b"a", b"b", b"c"], [0, 3, 4]))
    res = finish(tier, 4)[4]
    assert (res.success, res.failed_keys) == (True, {})
    assert [tier.lookup(k) for k in (b"a", b"b", b"c", b"x", b"y")] == [HIT, HIT, HIT, MISS, MISS]
    assert tier.used_bytes == 3 * FB
    tier.submit_load(TransferJob(5, [b"a", b"b", b"c"], [5, 6, 7]))
    assert finish(tier, 5)[5].success is True
    assert [int(ar[s][0]) for s in (5, 6, 7)] == [0, 3, 4]


def _store_one(root: str, key: bytes, fill: int, arena_fn) -> str:
    tier = DiskTier(root, BS)
    a = arena_fn(1, BS)
    a[0] = fill
    tier.set_arena(a)
    tier.submit_store(TransferJob(1, [key], [0]))
    finish(tier, 1)
    tier.shutdown()
    h = key_digest(key).hex()
    return os.path.join(root, "blocks", h[:2], h + ".kvb")


def test_junk_block_like_names_and_huge_pids_do_not_stop_a_restart(root, arena):
    """Names bytes.fromhex took (spaces: an 11-byte digest) or a temporary whose pid is beyond
    any pid (os.kill overflowed): the tier opens, the junk name is quarantined, the block
    loads."""
    path = _store_one(root, b"k", 7, arena)
    fan = os.path.dirname(path)
    spaced = os.path.join(fan, "00 11 22 33 44 55 66 77 88 99 aa.kvb")
    shutil.copy(path, spaced)
    huge = path + ".tmp.99999999999999999999.1"
    with open(huge, "wb") as f:
        f.write(b"x")
    tier = DiskTier(root, BS)
    try:
        assert tier.stats()["malformed_block_files"] == 1
        assert not os.path.exists(spaced) and not os.path.exists(huge)
        assert (tier.num_blocks, tier.used_bytes, tier.lookup(b"k")) == (1, FB, HIT)
    finally:
        tier.shutdown()


def test_misnamed_and_misplaced_block_files_are_not_indexed(root, arena):
    """An upper-case copy (lookups would HIT a name the tier never opens) and a copy in another
    fan-out directory (counted twice): both quarantined at start-up; the real block stays."""
    path = _store_one(root, b"k", 9, arena)
    name = os.path.basename(path)
    upper = os.path.join(os.path.dirname(path), name[:32].upper() + ".kvb")
    other_fan = "00" if name[:2] != "00" else "01"
    misplaced = os.path.join(root, "blocks", other_fan, name)
    shutil.copy(path, upper)
    shutil.copy(path, misplaced)
    tier = DiskTier(root, BS)
    try:
        assert tier.stats()["malformed_block_files"] == 2
        assert (tier.num_blocks, tier.used_bytes) == (1, FB)
        assert not os.path.exists(upper) and not os.path.exists(misplaced)
        assert sorted(os.listdir(os.path.join(root, "quarantine"))) != []
        a = arena(1, BS)
        tier.set_arena(a)
        tier.submit_load(TransferJob(2, [b"k"], [0]))
        assert finish(tier, 2)[2].success is True and bool((a[0] == 9).all())
    finally:
        tier.shutdown()


@pytest.mark.parametrize("name", ["min_free_bytes", "capacity_bytes"])
def test_huge_space_options_are_refused_naming_them(root, name):
    with pytest.raises(ValueError) as ei:
        DiskTier(root, BS, **{name: 2**80})
    assert str(ei.value) == f"{name} must be at most 2**62 bytes (4 EiB), got {2**80}"
    assert os.listdir(root) == []  # refused before touching the root


def test_odd_slot_id_types_and_numpy_job_ids(make_tier, root, arena):
    tier = make_tier(root)
    tier.set_arena(arena(4, BS))
    torch = pytest.importorskip("torch")
    for bad, msg in ((torch.tensor([True]), "job 2: slot id must be an integer, not bool"),
                     (np.array(["2020-01-01"], dtype="datetime64[D]"),
                      "job 2: slot id must be an integer, not datetime64")):
        with pytest.raises(TypeError) as ei:
            tier.submit_store(TransferJob(2, [b"k"], bad))
        assert str(ei.value) == msg
    tier.submit_store(TransferJob(np.int64(4), [b"k"], torch.tensor([3])))
    (res,) = finish(tier, 4).values()
    assert type(res.job_id) is int and res.job_id == 4 and res.success is True


def test_a_tilde_root_is_the_home_directory(tmp_path, monkeypatch):
    """A root of "~/..." (JSON configs never meet a shell) is under $HOME, not a directory named
    "~" under the current one."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "home").mkdir()
    tier = DiskTier("~/kv", BS)
    try:
        assert tier.layout.root == os.path.realpath(tmp_path / "home" / "kv")
        assert not os.path.exists(tmp_path / "~")
    finally:
        tier.shutdown()


def test_a_memory_root_larger_than_the_memory_available_is_warned_about(tmp_path, caplog,
                                                                         monkeypatch):
    """tmpfs's size is not free memory: a root there without capacity_bytes, whose file system
    holds more than the memory available, is warned about at start (once); with a capacity, or
    with more memory available than the file system holds, it is not."""
    if _native.statfs_type("/dev/shm") != 0x01021994:
        pytest.skip("/dev/shm is not tmpfs here")
    root = f"/dev/shm/pykvtier-test-{os.getpid()}"
    st = os.statvfs("/dev/shm")
    size = st.f_blocks * st.f_frsize
    page = os.sysconf("SC_PAGE_SIZE")
    real_sysconf = os.sysconf
    avail = {"pages": (size // 2) // page}  # half the file system's size is available

    def sysconf(name):
        return avail["pages"] if name == "SC_AVPHYS_PAGES" else real_sysconf(name)

    monkeypatch.setattr(os, "sysconf", sysconf)
    try:
        with caplog.at_level("WARNING", logger="pykvtier"):
            DiskTier(root, BS, min_free_bytes=0).shutdown()
            DiskTier(root, BS, capacity_bytes=4 * FB).shutdown()
            avail["pages"] = size // page + 1
            DiskTier(root, BS, min_free_bytes=0).shutdown()
        memory = [r.getMessage() for r in caplog.records if "(memory)" in r.getMessage()]
        assert memory == [
            f"pykvtier: root {os.path.realpath(root)} is on tmpfs (memory): with "
            f"capacity_bytes=None its blocks may use {size / 2**30:.1f} GiB, more than the "
            f"{(size // 2) // page * page / 2**30:.1f} GiB of memory available; set capacity_bytes"]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_the_adapters_and_fios_spellings_are_taken(root):
    tier = DiskTier(root, BS, direct="auto", engine="io_uring")
    try:
        assert (tier.config.direct, tier.config.engine) == (None, "uring")
    finally:
        tier.shutdown()
    with pytest.raises(ValueError) as ei:
        DiskTier(root, BS, direct="yes")
    assert str(ei.value) == "direct must be None ('auto'), True or False, got 'yes'"
