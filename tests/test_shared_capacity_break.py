"""Breaking a shared root's one capacity (pykvtier.sharing): grants that deadlock, foreign or
damaged files under ROOT/shared/, a forked child, a lost grants record, odd clocks."""
from __future__ import annotations

import functools
import glob
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import pykvtier.sharing as sharing
import pykvtier.tier as tier_mod
from pykvtier import DiskTier, JobResult, TransferJob
from pykvtier.layout import HEADER_BYTES, key_digest
from pykvtier.sharing import RootKeeper

BS = 64 << 10
FB = BS + HEADER_BYTES
OLD_NS = 10**18  # (2001: older than any count's start)


@pytest.fixture
def manual(monkeypatch):
    """Keepers without their thread: rounds run only when the test calls run_once()."""
    monkeypatch.setattr(tier_mod, "RootKeeper", functools.partial(RootKeeper, start=False))


def block_files(root: str) -> list[str]:
    return sorted(glob.glob(os.path.join(root, "blocks", "*", "*.kvb")))


def set_mtimes(paths, ns: int) -> None:
    for i, p in enumerate(paths):
        os.utime(p, ns=(ns + i, ns + i))


def rounds(*tiers: DiskTier, into: dict[int, JobResult] | None = None) -> None:
    """Each keeper publishes, the evictor evicts and grants, each reads the grants; each tier
    applies them (admitting the stores its grant covers); results go ``into``."""
    for t in tiers:
        t._keeper.run_once()
    for t in tiers:
        t._keeper.run_once()
        for r in t.get_finished_jobs():
            if into is not None:
                into[r.job_id] = r


def store(t: DiskTier, job_id: int, keys, slots) -> JobResult:
    t.submit_store(TransferJob(job_id, list(keys), list(slots)))
    t.drain()
    (res,) = t.get_finished_jobs()
    return res


def collect(t: DiskTier, into: dict[int, JobResult]) -> None:
    """The results the tier has (engine jobs in flight waited for, bounded)."""
    deadline = time.monotonic() + 10
    while t._pending and time.monotonic() < deadline:
        for r in t.wait(0.1):
            into[r.job_id] = r
    for r in t.get_finished_jobs():
        into[r.job_id] = r


def test_partial_grants_spread_over_members_do_not_deadlock_the_root(tmp_path, manual, clock,
                                                                    arena):
    """Root of 4 blocks; a and b each wait to store 3. The evictor can free 2 blocks, then 2
    more: it gave a 2 (of 3), then b 2 (of 3): all 4 granted, none used, the root empty, both
    stores waiting for their deadline (seen with 16 processes of bench/shared_churn.py-like
    churn: 52 % of stores failed "no capacity", the root held 0.6 of 8 blocks on average). A
    grant should cover a waiting store whole, first come first served, so one of them goes on
    and the other follows once the first's blocks can be evicted."""
    root = str(tmp_path / "root")
    cap = 4
    e = DiskTier(root, BS, shared=True, capacity_bytes=cap * FB)
    a = DiskTier(root, BS, shared=True, capacity_bytes=cap * FB)
    b = DiskTier(root, BS, shared=True, capacity_bytes=cap * FB)
    tiers = (e, a, b)
    try:
        for t in tiers:
            t.set_arena(arena(4, BS))
        e._keeper.run_once()
        assert e._keeper.is_evictor
        got: dict[int, JobResult] = {}
        e.submit_store(TransferJob(1, [b"x1", b"x2", b"y1", b"y2"], [0, 1, 2, 3]))
        rounds(*tiers, into=got)
        collect(e, got)
        assert got[1].success
        xs = [e.layout.block_path(key_digest(k)) for k in (b"x1", b"x2")]
        ys = [e.layout.block_path(key_digest(k)) for k in (b"y1", b"y2")]
        set_mtimes(xs, OLD_NS)  # evictable
        set_mtimes(ys, time.time_ns() + 10 * 10**9)  # not yet (newer than the count)
        a.submit_store(TransferJob(2, [b"a1", b"a2", b"a3"], [0, 1, 2]))
        b.submit_store(TransferJob(3, [b"b1", b"b2", b"b3"], [0, 1, 2]))
        e._keeper._ev.rescan_soon = True
        rounds(*tiers, into=got)  # x1, x2 evicted: 2 blocks of room
        set_mtimes(ys, OLD_NS + 10)  # y1, y2 evictable now too
        most = 0
        for _ in range(8):  # (each pass: every block on the root evictable, a fresh count)
            e._keeper._ev.rescan_soon = True
            rounds(*tiers, into=got)
            for t in (a, b):
                collect(t, got)
            most = max(most, len(block_files(root)))
            set_mtimes(block_files(root), OLD_NS + 100)
            if 2 in got and 3 in got:
                break
        assert (got.get(2) and got[2].success, got.get(3) and got[3].success) == (True, True)
        assert most <= cap
    finally:
        clock.tick(11)  # (a store still waiting gives up at once)
        for t in tiers:
            t.shutdown()


_FORKING_MEMBER = textwrap.dedent("""
    import os, sys, time
    from pykvtier import DiskTier
    t = DiskTier(sys.argv[1], int(sys.argv[2]), shared=True, capacity_bytes=int(sys.argv[3]))
    deadline = time.monotonic() + 10
    while not t._keeper.is_evictor and time.monotonic() < deadline:
        t._keeper.run_once()
    print(t._keeper.member_id, int(t._keeper.is_evictor), flush=True)
    child = os.fork()
    if child == 0:  # (a forked worker that never uses the tier, but closes what it inherited)
        t._keeper.close()
        print("child", os.getpid(), flush=True)
        time.sleep(3600)
        os._exit(0)
    sys.stdin.read()  # until killed
""")


def test_a_child_forked_after_open_does_not_keep_a_dead_members_locks(tmp_path, arena):
    """A member (the evictor) forks a child that outlives it: the child's copies of the
    member's and the evictor's lock descriptors held both flocks, so the SIGKILLed member
    stayed 'alive' and no other member could ever become the evictor (every store failed 'no
    capacity' after 10 s). The child should close its copies, as the root lock's at-fork hook
    does."""
    root = str(tmp_path / "root")
    os.makedirs(root)
    proc = subprocess.Popen([sys.executable, "-P", "-c", _FORKING_MEMBER, root, str(BS), str(8 * FB)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    child = None
    try:
        dead_id, was_evictor = proc.stdout.readline().split()
        assert was_evictor == "1"
        what, child = proc.stdout.readline().split()
        child = int(child)
        members = os.path.join(root, "shared", "members")
        # the child's close() left the parent's files alone
        assert sorted(os.listdir(members)) == [dead_id + ".json", dead_id + ".lock"]
        t = DiskTier(root, BS, shared=True, capacity_bytes=8 * FB)
        try:
            t._keeper.run_once()
            assert t.stats()["shared_evictor"] == 0
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            t._keeper._evictor_try_at = 0.0  # (the next try now, not within 1 s)
            t._keeper.run_once()
            assert t.stats()["shared_evictor"] == 1  # the child holds no copy of the lock
            t._keeper._ev.liveness_at = 0.0
            t._keeper.run_once()
            assert t.stats()["shared_dead_members"] == 1
            assert not [m for m in os.listdir(members) if m.startswith(dead_id)]
            t.set_arena(arena(1, BS))
            assert store(t, 1, [b"after"], [0]).success
        finally:
            t.shutdown()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if child is not None:
            os.kill(child, signal.SIGKILL)


_TWO_MEMBERS = textwrap.dedent("""
    import json, sys, time
    from pykvtier import DiskTier, TransferJob, host_arena
    root, bs, fb = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    tiers = [DiskTier(root, bs, shared=True, capacity_bytes=2 * fb) for _ in range(2)]
    for t in tiers:
        t.set_arena(host_arena(1, bs))
    out = {"ok": [], "failed": {}}
    for i in range(4):  # one block a job, the members taking turns: evictions from the 3rd on
        t = tiers[i % 2]
        t.submit_store(TransferJob(i, [b"k%d" % i], [0]))
        t.drain()
        (res,) = t.get_finished_jobs()
        if res.success:
            out["ok"].append(i)
        else:
            out["failed"][i] = list(res.failed_keys.values())[0]
    evicted = sum(t.stats()["shared_evictions"] for t in tiers)
    deadline = time.monotonic() + 5  # (until both members read the evictions announced)
    while (any(t.stats()["shared_evicted_seen"] < evicted for t in tiers)
           and time.monotonic() < deadline):
        tiers[0].wait(0.01)
    out["evicted"] = evicted
    out["seen"] = [t.stats()["shared_evicted_seen"] for t in tiers]
    t0 = time.monotonic()
    for t in tiers:
        t.shutdown()
    out["shutdown_s"] = time.monotonic() - t0
    print(json.dumps(out), flush=True)
""")

_FOREIGN = [("grants.json", "fifo"), ("grants.json", "dir"), ("grants.json", "symlink"),
            ("evictor.lock", "dir"), ("evictor.lock", "symlink"), ("evicted-1.log", "fifo"),
            ("evicted-1.log", "dir"), ("members/x.json", "fifo"), ("members/x.lock", "dir"),
            ("members/x.lock", "symlink")]


@pytest.mark.parametrize("name,kind", _FOREIGN, ids=[f"{n}-{k}" for n, k in _FOREIGN])
def test_a_foreign_entry_under_shared_neither_hangs_nor_stops_the_root(tmp_path, name, kind):
    """Something that is no regular file at a name the keepers use, there before the tiers
    start: a FIFO made the keeper thread block in open() for good (every store 'no capacity'
    after 10 s, shutdown() hung joining the thread); a directory or a symlink at grants.json or
    evictor.lock stopped every round of the evictor (or let none become it), at members/x.lock
    every liveness check. Expected: ignored where read, moved aside where written; every store
    succeeds within capacity and shutdown() returns at once."""
    root = tmp_path / "root"
    (root / "shared" / "members").mkdir(parents=True)
    path = root / "shared" / name
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
        (path / "inside").write_bytes(b"x")
    else:
        path.symlink_to(tmp_path / "elsewhere")
        (tmp_path / "elsewhere").write_bytes(b"x")
    try:
        run = subprocess.run([sys.executable, "-P", "-c", _TWO_MEMBERS, str(root), str(BS), str(FB)],
                             capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("the two members did not finish within 20 s (a keeper thread blocked?)")
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.splitlines()[-1])
    assert (out["ok"], out["failed"]) == ([0, 1, 2, 3], {})
    assert (out["evicted"], out["seen"]) == (2, [2, 2])  # each eviction announced, and read
    assert out["shutdown_s"] < 5
    assert len(block_files(str(root))) == 2
    if kind == "symlink":
        assert (tmp_path / "elsewhere").read_bytes() == b"x"  # nothing written through it


_MEMBER = textwrap.dedent("""
    import sys
    from pykvtier import DiskTier
    t = DiskTier(sys.argv[1], int(sys.argv[2]), shared=True, capacity_bytes=int(sys.argv[3]))
    print(t._keeper.member_id, flush=True)
    sys.stdin.read()  # until killed
""")


def test_a_dead_member_is_dropped_beside_foreign_lock_entries(tmp_path, manual):
    """members/ holds a directory and a symlink at lock names (foreign): the evictor's
    liveness check raised at the first of them (IsADirectoryError, ELOOP), every time, so the
    members after it in the listing were never checked: a SIGKILLed member stayed alive, its
    grant held for good. Expected: the foreign entries are no members' locks (skipped), the dead
    member is dropped at the next check."""
    root = tmp_path / "root"
    members = root / "shared" / "members"
    members.mkdir(parents=True)
    (members / "foreign-dir.lock").mkdir()
    (members / "foreign-link.lock").symlink_to(tmp_path / "nowhere")
    proc = subprocess.Popen([sys.executable, "-P", "-c", _MEMBER, str(root), str(BS), str(8 * FB)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        dead_id = proc.stdout.readline().strip()
        t = DiskTier(str(root), BS, shared=True, capacity_bytes=8 * FB)
        try:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            k = t._keeper
            deadline = time.monotonic() + 10
            while not k.is_evictor and time.monotonic() < deadline:
                k._evictor_try_at = 0.0
                k.run_once()
            assert k.is_evictor
            k._ev.liveness_at = 0.0
            k.run_once()  # (raised IsADirectoryError or ELOOP)
            assert t.stats()["shared_dead_members"] == 1
            assert not [m for m in os.listdir(members) if m.startswith(dead_id)]
            assert {"foreign-dir.lock", "foreign-link.lock"} <= set(os.listdir(members))
        finally:
            t.shutdown()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_takeover_without_the_grants_record_still_counts_the_grants_members_hold(
        tmp_path, manual, clock, arena, monkeypatch):
    """The evictor's grants.json is gone (removed, or torn by a crash) when a new evictor takes
    over: its books started every member's grant at 0, so the headroom b held unused was
    granted again (to c) and b's stores into it took the root past capacity_bytes by more than a
    block per member. Members should publish their grant, and a new evictor count it."""
    monkeypatch.setattr(sharing, "RETURN_IDLE_S", 3600.0)  # (b keeps its unused grant)
    bs = 4096
    fb = bs + HEADER_BYTES
    cap = 128
    root = str(tmp_path / "root")
    e, b, c = (DiskTier(root, bs, shared=True, capacity_bytes=cap * fb) for _ in range(3))
    tiers = (e, b, c)
    try:
        for t in tiers:
            t.set_arena(arena(122, bs))
        e._keeper.run_once()
        assert e._keeper.is_evictor
        got: dict[int, JobResult] = {}
        b.submit_store(TransferJob(1, [b"b0"], [0]))
        rounds(*tiers, into=got)
        collect(b, got)
        assert got[1].success
        held = b._keeper.room()
        assert held == 5 * fb  # its headroom share: cap / 8 over 3 members
        e.submit_store(TransferJob(2, [b"e%d" % i for i in range(122)], list(range(122))))
        rounds(*tiers, into=got)
        collect(e, got)
        assert got[2].success
        assert len(block_files(root)) == 123  # b's 5 unused blocks of grant make the 128
        set_mtimes(block_files(root), OLD_NS)  # (all evictable from now on)
        os.unlink(os.path.join(root, "shared", "grants.json"))
        e.shutdown()
        c.submit_store(TransferJob(3, [b"c%d" % i for i in range(5)], list(range(5))))
        c._keeper._evictor_try_at = 0.0
        c._keeper.run_once()
        assert c._keeper.is_evictor
        for _ in range(4):
            rounds(b, c, into=got)
            collect(c, got)
        assert got[3].success
        b.submit_store(TransferJob(4, [b"b%d" % i for i in range(1, 6)], list(range(5))))
        collect(b, got)  # (within its grant: not waiting)
        assert got[4].success
        assert len(block_files(root)) <= cap  # (132: c was granted what b held unused again)
    finally:
        clock.tick(11)
        for t in tiers:
            t.shutdown()


def test_an_idle_members_grant_given_back_during_a_store_is_not_written_past(
        tmp_path, manual, clock, arena, monkeypatch):
    """A member idle for RETURN_IDLE_S gives back its unused grant at its keeper's next round.
    A store submitted just then read room() (enough), and the round gave the grant back before
    the store's reserve(), whose False was ignored: the blocks were written without a grant
    (reserved + returned would be past granted: the evictor's books did not count them). A
    member should not give its grant back while a store is on its way to reserving it."""
    root = str(tmp_path / "root")
    t = DiskTier(root, BS, shared=True, capacity_bytes=64 * FB)
    try:
        t.set_arena(arena(2, BS))
        k = t._keeper
        k.run_once()
        got: dict[int, JobResult] = {}
        t.submit_store(TransferJob(1, [b"first"], [0]))
        rounds(t, into=got)
        collect(t, got)
        assert got[1].success and k.room() == 8 * FB  # its headroom share, unused
        calls = []
        room = k.room

        def room_then_a_keeper_round() -> int:
            out = room()
            calls.append(out)
            if len(calls) == 2:  # (the keeper thread's round, between room() and reserve())
                k._publish()
            return out

        monkeypatch.setattr(k, "room", room_then_a_keeper_round)
        k._want_at = time.monotonic() - 2 * sharing.RETURN_IDLE_S  # idle since its last store
        t.submit_store(TransferJob(2, [b"second"], [0]))
        for _ in range(3):
            rounds(t, into=got)
            collect(t, got)
        assert got[2].success
        assert k.reserved == 2 * FB  # (1 block: the second store's was never reserved)
        assert k.reserved + k.returned <= k.granted
    finally:
        clock.tick(11)
        t.shutdown()


def test_blocks_dated_in_the_future_can_still_be_evicted(tmp_path, manual, clock, arena):
    """A node whose clock is an hour ahead wrote (or used) every block on the root: their
    modification times are in the evictor's future, and blocks newer than a count's start are
    no eviction candidates, so nothing could ever be evicted: every store 'no capacity' for an
    hour (as with an evictor whose own clock is behind). Blocks dated far ahead should be
    candidates (the newest)."""
    root = str(tmp_path / "root")
    t = DiskTier(root, BS, shared=True, capacity_bytes=2 * FB)
    try:
        t.set_arena(arena(2, BS))
        t._keeper.run_once()
        got: dict[int, JobResult] = {}
        t.submit_store(TransferJob(1, [b"f0", b"f1"], [0, 1]))
        rounds(t, into=got)
        collect(t, got)
        assert got[1].success
        ahead = time.time_ns() + 3600 * 10**9
        set_mtimes([t.layout.block_path(key_digest(k)) for k in (b"f0", b"f1")], ahead)
        t._keeper._ev.rescan_soon = True
        t.submit_store(TransferJob(2, [b"now"], [0]))
        for _ in range(3):
            rounds(t, into=got)
            collect(t, got)
        assert 2 in got and got[2].success
        assert [os.path.exists(t.layout.block_path(key_digest(k))) for k in (b"f0", b"f1")] \
            == [False, True]  # the older of the two went
        assert len(block_files(root)) == 2
    finally:
        clock.tick(11)
        t.shutdown()


def test_no_capacity_names_the_evictors_capacity_when_members_differ(
        tmp_path, manual, clock, arena, caplog):
    """Members with different capacity_bytes: the evictor's is the root's. A store of b that got
    no room said 'capacity_bytes=<b's> for the root', which is not what was kept. It should name
    the evictor's (and b's own), and b should warn once that they differ."""
    root = str(tmp_path / "root")
    a = DiskTier(root, BS, shared=True, capacity_bytes=2 * FB)
    b = DiskTier(root, BS, shared=True, capacity_bytes=64 * FB)
    try:
        a._keeper.run_once()
        assert a._keeper.is_evictor
        b.set_arena(arena(3, BS))
        got: dict[int, JobResult] = {}
        with caplog.at_level("WARNING", logger="pykvtier"):
            b.submit_store(TransferJob(1, [b"p", b"q", b"r"], [0, 1, 2]))
            rounds(a, b, into=got)
            rounds(a, b, into=got)
        clock.tick(11)
        rounds(a, b, into=got)
        collect(b, got)
        assert got[1].successful_keys == [b"p", b"q"]
        why = got[1].failed_keys[b"r"]
        assert f"capacity_bytes={2 * FB} for the root (the evictor's; this tier's {64 * FB})" \
            in why, why
        warned = [r.getMessage() for r in caplog.records if "differs" in r.getMessage()]
        assert len(warned) == 1, warned
        assert f"capacity_bytes={64 * FB}" in warned[0] and f"{2 * FB}" in warned[0]
    finally:
        clock.tick(11)
        a.shutdown()
        b.shutdown()


def test_no_capacity_says_why_the_keepers_rounds_fail(tmp_path, manual, clock, arena):
    """ROOT/shared/members/ removed while a tier runs (say, by hand): every keeper round fails
    (logged once a minute), and a store that got no grant said only 'no evictor has written
    grants.json yet'. It should say what the rounds meet."""
    import shutil

    root = str(tmp_path / "root")
    t = DiskTier(root, BS, shared=True, capacity_bytes=8 * FB)
    try:
        t.set_arena(arena(1, BS))
        shutil.rmtree(os.path.join(root, "shared"))
        with pytest.raises(FileNotFoundError):
            t._keeper.run_once()
        got: dict[int, JobResult] = {}
        t.submit_store(TransferJob(1, [b"k"], [0]))
        clock.tick(11)
        collect(t, got)
        why = got[1].failed_keys[b"k"]
        assert "this tier's keeper rounds fail: FileNotFoundError" in why, why
        assert os.path.join(root, "shared", "members") in why
    finally:
        clock.tick(11)
        t.shutdown()


def test_without_capacity_stores_in_flight_count_against_the_free_space(
        tmp_path, manual, clock, monkeypatch):
    """capacity_bytes=None: the evictor grants the file system's free space above
    min_free_bytes, less the grants not reserved yet. Bytes reserved by stores still in flight
    (not on the disk yet: statvfs does not see them) were not taken off, so they were granted
    again: 4 blocks free, 3 of them reserved by b's stores in flight, and e was granted 4 more
    (7 to write into 4: ENOSPC, or min_free_bytes eaten)."""
    root = str(tmp_path / "root")
    e = DiskTier(root, BS, shared=True, min_free_bytes=0)
    b = DiskTier(root, BS, shared=True, min_free_bytes=0)

    class Fs:  # the root's file system: 4 block files free, whatever is written meanwhile
        f_frsize, f_bavail, f_blocks = FB, 4, 100

    monkeypatch.setattr(os, "statvfs", lambda path: Fs)
    try:
        e._keeper.run_once()
        assert e._keeper.is_evictor
        b._keeper.want(3 * FB)
        rounds(e, b)
        assert b._keeper.room() == 3 * FB
        assert b._keeper.reserve(3 * FB)  # (a store of 3 blocks on its way to the disk)
        e._keeper.want(4 * FB)
        rounds(b, e)
        assert e._keeper.granted == 0  # 1 block of room left, not 4
        assert e._keeper._ev.room_written == 1
    finally:
        monkeypatch.undo()
        for t in (e, b):
            t.shutdown()


def test_a_block_evicted_while_this_member_reads_it_is_a_miss_once_read(
        tmp_path, manual, clock, arena):
    """b loads x; before b collects the load, the evictor evicts x and b reads the
    announcement: x could not be dropped then (a load was reading it) and was forgotten, so x
    stayed in b's index for good: HIT, a store of x 'skipped, present' (a success for a block
    that is not on the disk), until a later load failed ENOENT. The announcement should be
    applied once the load is done (the read itself is whole: the file was open)."""
    import numpy as np

    root = str(tmp_path / "root")
    a = DiskTier(root, BS, shared=True, capacity_bytes=2 * FB)
    b = DiskTier(root, BS, shared=True, capacity_bytes=2 * FB)
    try:
        src = arena(2, BS)
        src[...] = np.random.default_rng(9).integers(0, 256, src.shape, dtype=np.uint8)
        a.set_arena(src)
        dst = arena(2, BS)
        b.set_arena(dst)
        a._keeper.run_once()
        got: dict[int, JobResult] = {}
        a.submit_store(TransferJob(1, [b"x", b"y"], [0, 1]))
        rounds(a, b, into=got)
        collect(a, got)
        assert got[1].success
        set_mtimes([a.layout.block_path(key_digest(k)) for k in (b"x", b"y")], OLD_NS)
        assert b.lookup(b"x") == tier_mod.LookupResult.RETRY
        b.on_step_end()
        b.drain()
        assert b.lookup(b"x") == tier_mod.LookupResult.HIT
        b.submit_load(TransferJob(2, [b"x"], [0]))  # (not collected yet: x is being read)
        a._keeper._ev.rescan_soon = True
        a.submit_store(TransferJob(3, [b"z"], [0]))
        rounds(a, into=got)  # x, the oldest, evicted and announced
        collect(a, got)
        assert got[3].success and not os.path.exists(a.layout.block_path(key_digest(b"x")))
        b._keeper.run_once()  # b reads the announcement
        collect(b, got)  # ... while the load is in flight, then the load is collected
        assert got[2].success and np.array_equal(dst[0], src[0])  # (the open file, read whole)
        b.on_step_end()
        assert b.lookup(b"x") == tier_mod.LookupResult.MISS
        set_mtimes(block_files(root), OLD_NS + 10)  # (y, z)
        a._keeper._ev.rescan_soon = True
        b.submit_store(TransferJob(4, [b"x"], [1]))
        for _ in range(3):
            rounds(a, b, into=got)
            collect(b, got)
        assert got[4].success
        assert b.stats()["stores_skipped_present"] == 0  # written again, not 'present'
        assert os.path.exists(b.layout.block_path(key_digest(b"x")))
    finally:
        clock.tick(11)
        a.shutdown()
        b.shutdown()


class _Killed(BaseException):
    """The evictor's process dying at that point (nothing after it runs)."""


def test_an_evictor_killed_in_the_middle_of_evicting_leaves_no_block_unannounced(
        tmp_path, manual, clock, arena, monkeypatch):
    """The evictor unlinked its victims one by one and announced them after the last: killed
    in between (here at its second unlink), the first victim was gone from the disk but never
    announced, so b kept it in its index for good (HIT; a store of its key 'skipped,
    present'). Announcing before unlinking leaves at worst a block announced and still there
    (a MISS, then found again by a probe)."""
    root = str(tmp_path / "root")
    a = DiskTier(root, BS, shared=True, capacity_bytes=2 * FB)
    b = DiskTier(root, BS, shared=True, capacity_bytes=2 * FB)
    try:
        a.set_arena(arena(2, BS))
        b.set_arena(arena(2, BS))
        a._keeper.run_once()
        got: dict[int, JobResult] = {}
        a.submit_store(TransferJob(1, [b"x", b"y"], [0, 1]))
        rounds(a, b, into=got)
        collect(a, got)
        paths = [a.layout.block_path(key_digest(k)) for k in (b"x", b"y")]
        set_mtimes(paths, OLD_NS)  # x the older
        for k in (b"x", b"y"):
            assert b.lookup(k) == tier_mod.LookupResult.RETRY
        b.on_step_end()
        b.drain()
        assert [b.lookup(k) for k in (b"x", b"y")] == [tier_mod.LookupResult.HIT] * 2
        unlinks = []
        real_unlink = os.unlink

        def unlink_then_die(path, *args, **kwargs):
            if path in paths:
                unlinks.append(path)
                if len(unlinks) == 2:
                    raise _Killed
            return real_unlink(path, *args, **kwargs)

        a._keeper._ev.rescan_soon = True
        a.submit_store(TransferJob(2, [b"z1", b"z2"], [0, 1]))
        monkeypatch.setattr(os, "unlink", unlink_then_die)
        with pytest.raises(_Killed):
            a._keeper.run_once()  # a's want published, evicting x, then y: dies there
        monkeypatch.undo()
        gone = [not os.path.exists(p) for p in paths]
        b._keeper.run_once()
        b.on_step_end()
        answers = [b.lookup(k) for k in (b"x", b"y")]
        for g, r in zip(gone, answers):  # a block gone from the disk is no HIT
            assert not (g and r == tier_mod.LookupResult.HIT), (gone, answers)
        assert gone[0]
    finally:
        clock.tick(11)
        a.shutdown()
        b.shutdown()


def test_a_grant_held_short_of_a_waiting_store_does_not_stall_the_store_before_it(
        tmp_path, manual, clock, arena, monkeypatch):
    """a waits to store 16 blocks, the whole root; b holds 1 block of grant (headroom) and
    waits to store 3 behind it. The evictor can free 15 blocks for a, never 16 (b's block is
    b's), and grants in order: neither went on until a's wait ran out (10 s). A member whose
    grant falls short of its first waiting store should give it back after RETURN_IDLE_S
    (here 0), so that the store before it can have it."""
    monkeypatch.setattr(sharing, "RETURN_IDLE_S", 0.0)
    root = str(tmp_path / "root")
    cap = 16
    a = DiskTier(root, BS, shared=True, capacity_bytes=cap * FB)
    b = DiskTier(root, BS, shared=True, capacity_bytes=cap * FB)
    try:
        a.set_arena(arena(cap, BS))
        b.set_arena(arena(3, BS))
        a._keeper.run_once()
        got: dict[int, JobResult] = {}
        b.submit_store(TransferJob(1, [b"b0"], [0]))
        rounds(a, b, into=got)
        collect(b, got)
        assert got[1].success and b._keeper.room() == FB  # its headroom share
        a.submit_store(TransferJob(2, [b"a%d" % i for i in range(cap)], list(range(cap))))
        a._keeper.run_once()  # a asks first
        b.submit_store(TransferJob(3, [b"b1", b"b2", b"b3"], [0, 1, 2]))  # (b never idle)
        for _ in range(8):
            set_mtimes(block_files(root), OLD_NS)
            a._keeper._ev.rescan_soon = True
            rounds(a, b, into=got)
            collect(a, got)
            collect(b, got)
            if 2 in got and 3 in got:
                break
        assert (got.get(2) and got[2].success, got.get(3) and got[3].success) == (True, True)
        assert len(block_files(root)) <= cap
    finally:
        clock.tick(11)
        a.shutdown()
        b.shutdown()


def test_temporaries_a_killed_member_left_do_not_hold_the_root_for_an_hour(
        tmp_path, manual, clock, arena):
    """Members SIGKILLed in the middle of stores leave their temporaries (12 kills of a member
    storing 8 blocks of 4 MiB a job left 18 on a 64-block root). The evictor counts each as a
    whole block file and nobody removes them: a shared tier's start-up removes temporaries only
    an hour old. The root held that much less for an hour; all of it, when enough members
    died. A temporary nobody has written for a minute is a dead writer's: the evictor's count
    should remove it."""
    root = str(tmp_path / "root")
    t = DiskTier(root, BS, shared=True, capacity_bytes=2 * FB)
    try:
        t.set_arena(arena(2, BS))
        dead = []
        for i, k in enumerate((b"dead0", b"dead1")):  # as a killed writer leaves them
            p = t.layout.block_path(key_digest(k)) + ".tmp.999999.%d" % i
            with open(p, "wb") as f:
                f.write(b"\0" * (FB // 2))
            os.utime(p, ns=(time.time_ns() - 120 * 10**9,) * 2)  # two minutes untouched
            dead.append(p)
        live = t.layout.block_path(key_digest(b"live")) + ".tmp.999998.0"
        with open(live, "wb") as f:  # (a writer at work: not touched)
            f.write(b"\0" * 4096)
        t._keeper.run_once()
        got: dict[int, JobResult] = {}
        t.submit_store(TransferJob(1, [b"k0"], [0]))
        for _ in range(3):
            rounds(t, into=got)
            collect(t, got)
        assert 1 in got and got[1].success
        assert [os.path.exists(p) for p in dead] == [False, False]
        assert os.path.exists(live)
    finally:
        clock.tick(11)
        t.shutdown()


@pytest.mark.parametrize("grants", [[], None, "x", 7])
def test_a_grants_record_of_the_wrong_shape_stops_no_member_round(tmp_path, manual, grants):
    """grants.json with a valid checksum but 'grants' no object (a bug elsewhere, a hand
    edit): every member's round raised AttributeError reading it, before the eviction log was
    read (no eviction reached any index) and until the evictor rewrote the record."""
    import zlib

    root = str(tmp_path / "root")
    a = DiskTier(root, BS, shared=True, capacity_bytes=4 * FB)
    try:
        body = json.dumps({"evictor": "someone", "log_gen": 1, "grants": grants}).encode()
        with open(os.path.join(root, "shared", "grants.json"), "wb") as f:
            f.write(body + b"\n%08x\n" % zlib.crc32(body))
        a._keeper._evictor_try_at = 1e18  # (not the evictor: the record stays as it is)
        a._keeper.run_once()  # (raised AttributeError)
        assert a._keeper.granted == 0
    finally:
        a.shutdown()


def test_a_member_starting_during_a_liveness_check_is_not_taken_for_dead(tmp_path, manual,
                                                                        monkeypatch):
    """A member's lock file was created, then locked: an evictor whose liveness check came in
    between took the lock, found the member 'dead' and removed its files; the member then
    locked the removed file and ran on as a member without a lock file, which no check could
    ever find dead (its grant held for good once it died). The lock file should appear only
    once locked."""
    root = str(tmp_path / "root")
    e = DiskTier(root, BS, shared=True, capacity_bytes=8 * FB)
    members = os.path.join(root, "shared", "members")
    real_flock = sharing.fcntl.flock
    checked = []

    def flock_after_a_liveness_check(fd, op):
        if not checked and os.readlink(f"/proc/self/fd/{fd}").startswith(members):
            checked.append(os.readlink(f"/proc/self/fd/{fd}"))
            e._keeper._ev.liveness_at = 0.0
            e._keeper.run_once()  # (the evictor's check, between the open and the lock)
        return real_flock(fd, op)

    b = None
    try:
        e._keeper.run_once()
        assert e._keeper.is_evictor
        monkeypatch.setattr(sharing.fcntl, "flock", flock_after_a_liveness_check)
        b = DiskTier(root, BS, shared=True, capacity_bytes=8 * FB)
        monkeypatch.undo()
        assert checked
        assert os.path.exists(os.path.join(members, b._keeper.member_id + ".lock"))
        e._keeper._ev.liveness_at = 0.0
        b._keeper.run_once()
        e._keeper.run_once()
        assert e.stats()["shared_dead_members"] == 0
    finally:
        monkeypatch.undo()
        for t in (e, b):
            if t is not None:
                t.shutdown()
