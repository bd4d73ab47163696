"""A shared root's one capacity (pykvtier.sharing): members reserve against the evictor's grants,
the evictor alone evicts, root-wide least recently used first, and announces what it evicted."""
from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from pykvtier import DiskTier, JobResult, LookupResult, TransferJob
from pykvtier.layout import HEADER_BYTES, key_digest

BS = 64 << 10
FB = BS + HEADER_BYTES
HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY


def fill(a: np.ndarray, seed: int) -> np.ndarray:
    a[...] = np.random.default_rng(seed).integers(0, 256, a.shape, dtype=np.uint8)
    return a


def finish(tier: DiskTier) -> list[JobResult]:
    tier.drain()
    return tier.get_finished_jobs()


def store(tier: DiskTier, job_id: int, keys, slots) -> JobResult:
    tier.submit_store(TransferJob(job_id, list(keys), list(slots)))
    (res,) = finish(tier)
    return res


def load(tier: DiskTier, job_id: int, keys, slots) -> JobResult:
    tier.submit_load(TransferJob(job_id, list(keys), list(slots)))
    (res,) = finish(tier)
    return res


def block_files(root: str) -> list[str]:
    return sorted(glob.glob(os.path.join(root, "blocks", "*", "*.kvb")))


def names(root: str) -> set[str]:
    return {os.path.basename(p) for p in block_files(root)}


def name_of(tier: DiskTier, key: bytes) -> str:
    return os.path.basename(tier.layout.block_path(key_digest(key)))


def answer(tier: DiskTier, key: bytes) -> LookupResult:
    """The lookup's answer once any probe it asked for has been applied."""
    r = tier.lookup(key)
    while r == RETRY:
        tier.on_step_end()
        tier.drain()
        r = tier.lookup(key)
    return r


def rounds(*tiers: DiskTier) -> None:
    """One keeper round of each tier (the evictor's included), then each tier applies them."""
    for t in tiers:
        t._keeper.run_once()
    for t in tiers:
        t._keeper.run_once()
        t.get_finished_jobs()


def test_two_members_keep_one_capacity_and_every_store_succeeds(tmp_path, arena):
    root = str(tmp_path / "root")
    cap = 6
    tiers = [DiskTier(root, BS, shared=True, capacity_bytes=cap * FB) for _ in range(2)]
    try:
        src = fill(arena(2, BS), 1)
        for t in tiers:
            t.set_arena(src)
        most = 0
        for i in range(30):  # two keys a job, the members taking turns
            t = tiers[i % 2]
            res = store(t, i + 1, [b"a%d" % i, b"b%d" % i], [0, 1])
            assert res.success, res.failed_keys
            most = max(most, len(block_files(root)))
        assert most <= cap  # at every job's end, whoever stored
        rounds(*tiers)
        on_disk = names(root)
        assert len(on_disk) <= cap
        ev = [t for t in tiers if t.stats()["shared_evictor"]]
        assert len(ev) == 1  # one evictor per root
        evicted = ev[0].stats()["shared_evictions"]
        assert evicted == 60 - len(on_disk)  # every block stored once, evicted or still there
        with open(glob.glob(os.path.join(root, "shared", "evicted-*.log"))[0], "rb") as f:
            assert len(f.read()) == 16 * evicted  # each eviction announced once
        for t in tiers:  # every member's index holds only blocks on disk now
            s = t.stats()
            assert s["evictions"] == 0  # members never evict on their own
            assert s["blocks_present"] <= len(on_disk)
            assert s["shared_evicted_seen"] == evicted
            for i in range(30):
                for k in (b"a%d" % i, b"b%d" % i):
                    if t.holds(key_digest(k)):
                        assert name_of(t, k) in on_disk
    finally:
        for t in tiers:
            t.shutdown()


def test_a_block_evicted_by_another_member_is_a_miss_at_once(tmp_path, arena):
    root = str(tmp_path / "root")
    a = DiskTier(root, BS, shared=True, capacity_bytes=2 * FB)
    b = DiskTier(root, BS, shared=True, capacity_bytes=2 * FB)
    try:
        src = fill(arena(2, BS), 2)
        a.set_arena(src)
        b.set_arena(fill(arena(2, BS), 3))
        assert store(a, 1, [b"x"], [0]).success
        assert answer(b, b"x") == HIT  # b found it on disk (a probe)
        assert store(a, 2, [b"y", b"z"], [0, 1]).success  # evicts x, the oldest
        rounds(a, b)
        assert name_of(b, b"x") not in names(root)
        assert b.stats()["shared_evictions_applied"] == 1
        before = b.stats()["lookups"]
        assert b.lookup(b"x") == MISS  # no probe, no failed load
        s = b.stats()
        assert (s["lookups"] - before, s["loads_gone"], s["load_failures"]) == (1, 0, 0)
    finally:
        a.shutdown()
        b.shutdown()


def test_the_evictor_takes_the_least_recently_used_block_root_wide(tmp_path, arena):
    """b loads the oldest block: its use time is set, so the evictor (a) evicts the next one."""
    root = str(tmp_path / "root")
    a = DiskTier(root, BS, shared=True, capacity_bytes=4 * FB)
    b = DiskTier(root, BS, shared=True, capacity_bytes=4 * FB)
    try:
        src = fill(arena(4, BS), 4)
        a.set_arena(src)
        dst = arena(4, BS)
        dst[...] = 0
        b.set_arena(dst)
        keys = [b"k0", b"k1", b"k2", b"k3"]
        for i, k in enumerate(keys):  # stored one by one: k0 oldest
            assert store(a, i + 1, [k], [i]).success
        for i, k in enumerate(keys):  # distinct, ordered use times (whatever the clock's grain)
            os.utime(a.layout.block_path(key_digest(k)), ns=(10**18 + i, 10**18 + i))
        assert answer(b, b"k0") == HIT
        res = load(b, 1, [b"k0"], [0])
        assert res.success and np.array_equal(dst[0], src[0])
        b._keeper.run_once()  # (after any round in flight: the use time is set)
        assert b.stats()["shared_use_times_set"] == 1
        a._keeper._ev.rescan_soon = True  # (the count the evictor works from, afresh)
        a._keeper.run_once()
        assert store(a, 10, [b"k4"], [0]).success
        assert names(root) == {name_of(a, k) for k in (b"k0", b"k2", b"k3", b"k4")}
    finally:
        a.shutdown()
        b.shutdown()


def test_a_store_larger_than_the_grant_waits_then_keys_without_room_fail(tmp_path, arena, clock):
    root = str(tmp_path / "root")
    t = DiskTier(root, BS, shared=True, capacity_bytes=2 * FB)
    try:
        t.set_arena(fill(arena(3, BS), 5))
        keys = [b"p", b"q", b"r"]
        t.submit_store(TransferJob(1, keys, [0, 1, 2]))
        rounds(t)
        assert t.get_finished_jobs() == []  # waiting: 3 blocks, the root holds 2
        assert t.has_pending_work()
        assert t.stats()["stores_waiting_for_grant"] == 1
        clock.tick(11)  # past the wait (10 s)
        (res,) = t.get_finished_jobs() or finish(t)
        assert res.success is False
        assert res.successful_keys == [b"p", b"q"]
        assert list(res.failed_keys) == [b"r"]
        assert res.failed_keys[b"r"].startswith("no capacity: the shared root's evictor granted "
                                                "no room within 10 s")
        assert "reports room 0 B left" in res.failed_keys[b"r"]  # the evictor's own word
        assert names(root) == {name_of(t, b"p"), name_of(t, b"q")}
    finally:
        t.shutdown()


_MEMBER = textwrap.dedent("""
    import sys
    from pykvtier import DiskTier
    t = DiskTier(sys.argv[1], int(sys.argv[2]), shared=True, capacity_bytes=int(sys.argv[3]))
    t._keeper.run_once()
    print(t._keeper.member_id, flush=True)
    sys.stdin.read()  # until killed
""")


def test_a_killed_member_is_dropped_and_the_evictor_role_moves_on(tmp_path, arena):
    root = str(tmp_path / "root")
    os.makedirs(root)
    proc = subprocess.Popen([sys.executable, "-P", "-c", _MEMBER, root, str(BS), str(8 * FB)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        dead_id = proc.stdout.readline().strip()
        assert dead_id
        t = DiskTier(root, BS, shared=True, capacity_bytes=8 * FB)
        try:
            t._keeper.run_once()
            assert t.stats()["shared_evictor"] == 0  # the other process holds the role
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            t._keeper._evictor_try_at = 0.0  # (the next try, now rather than within 1 s)
            t._keeper.run_once()
            s = t.stats()
            assert (s["shared_evictor"], s["shared_evictor_terms"]) == (1, 1)
            t._keeper._ev.liveness_at = 0.0  # (the next liveness check, now)
            t._keeper.run_once()
            assert t.stats()["shared_dead_members"] == 1
            members = os.listdir(os.path.join(root, "shared", "members"))
            assert not [m for m in members if m.startswith(dead_id)]
            with open(os.path.join(root, "shared", "grants.json"), "rb") as f:
                assert dead_id not in json.loads(f.read().partition(b"\n")[0])["grants"]
            t.set_arena(fill(arena(1, BS), 6))
            assert store(t, 1, [b"after"], [0]).success  # granted by itself now
        finally:
            t.shutdown()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.sharedfs
def test_two_nodes_keep_one_capacity_on_a_shared_file_system(shared_roots, arena):
    """The two-mount JuiceFS: one capacity across the nodes, evictions announced across."""
    ra, rb = shared_roots
    cap = 6
    a = DiskTier(ra, BS, shared=True, capacity_bytes=cap * FB)
    b = DiskTier(rb, BS, shared=True, capacity_bytes=cap * FB)
    try:
        src = fill(arena(2, BS), 7)
        a.set_arena(src)
        b.set_arena(src)
        most = 0
        for i in range(16):
            t = (a, b)[i % 2]
            res = store(t, i + 1, [b"n%d" % i, b"m%d" % i], [0, 1])
            assert res.success, res.failed_keys
            most = max(most, len(block_files(ra)))
        assert most <= cap
        assert a.stats()["shared_evictor"] + b.stats()["shared_evictor"] == 1
        evicted = a.stats()["shared_evictions"] + b.stats()["shared_evictions"]
        assert evicted == 32 - len(block_files(ra))
    finally:
        a.shutdown()
        b.shutdown()


@pytest.mark.sharedfs
def test_a_block_evicted_through_one_mount_is_a_miss_on_the_other(shared_roots, arena):
    """A's evictor evicts a block B found by its probe: the eviction log reaches B (up to
    JuiceFS's 1 s attribute cache late: polled, bounded), and B answers MISS without a load."""
    import time

    ra, rb = shared_roots
    a = DiskTier(ra, BS, shared=True, capacity_bytes=2 * FB)
    b = DiskTier(rb, BS, shared=True, capacity_bytes=2 * FB)
    try:
        src = fill(arena(2, BS), 8)
        a.set_arena(src)
        dst = arena(2, BS)
        b.set_arena(dst)
        assert store(a, 1, [b"e0", b"e1"], [0, 1]).success
        for i, k in enumerate((b"e0", b"e1")):  # e0 older (one job's files may share a time)
            os.utime(a.layout.block_path(key_digest(k)), ns=(10**18 + i, 10**18 + i))
        assert [answer(b, k) for k in (b"e0", b"e1")] == [HIT, HIT]
        assert store(a, 2, [b"e2"], [0]).success  # the root is full: e0, the oldest, goes
        assert name_of(a, b"e0") not in names(ra)
        deadline = time.monotonic() + 10
        while b.stats()["shared_evictions_applied"] == 0 and time.monotonic() < deadline:
            b.wait(0.01)  # (a keeper round of B reads the log; wait() applies it)
        s = b.stats()
        assert s["shared_evictions_applied"] == 1
        assert b.lookup(b"e0") == MISS
        assert (b.stats()["load_failures"], b.stats()["loads_gone"]) == (0, 0)
        res = load(b, 3, [b"e1"], [1])
        assert res.success and np.array_equal(dst[1], src[1])
    finally:
        a.shutdown()
        b.shutdown()
