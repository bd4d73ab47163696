"""DiskTier (phase 1 lookup, phase 2 load/store, integrity, recovery, capacity) and Promoter.

One test per row of docs/design.md's lookup table, then promotion, integrity and recovery, capacity
and bad input. Completion is awaited with ``drain()`` and collected with
``get_finished_jobs()``; no sleeps. The tier answers from its own bookkeeping, which only
``get_finished_jobs()`` (or ``drain()`` for probes) advances, so the RETRY / HIT_PENDING states
below are deterministic even when the engine has already finished the I/O.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from pykvtier import DiskTier, JobResult, LookupResult, Promoter, TransferJob
from pykvtier.layout import HEADER_BYTES, key_digest

HIT, MISS, RETRY, HIT_PENDING = (LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY,
                                 LookupResult.HIT_PENDING)
BS = 64 << 10  # block payload bytes
FB = BS + HEADER_BYTES  # block file bytes


# ------------------------------------------------------------------------- helpers




def fill(arr: np.ndarray, seed: int) -> np.ndarray:
    arr[...] = np.random.default_rng(seed).integers(0, 256, arr.shape, dtype=np.uint8)
    return arr


def keys_of(n: int, tag: bytes = b"k") -> list[bytes]:
    return [b"%s-%d" % (tag, i) for i in range(n)]


def finish(tier: DiskTier) -> list[JobResult]:
    tier.drain()
    return tier.get_finished_jobs()


def store(tier: DiskTier, job_id: int, keys, slots) -> JobResult:
    tier.submit_store(TransferJob(job_id, list(keys), list(slots)))
    (res,) = finish(tier)
    assert res.job_id == job_id and res.is_load is False
    return res


def load(tier: DiskTier, job_id: int, keys, slots) -> JobResult:
    tier.submit_load(TransferJob(job_id, list(keys), list(slots)))
    (res,) = finish(tier)
    assert res.job_id == job_id and res.is_load is True
    return res


def ok(res: JobResult, nbytes: int) -> None:
    assert res.success is True, res.failed_keys
    assert res.successful_keys is None and res.failed_keys == {}
    assert res.transfer_bytes == nbytes


def path_of(tier: DiskTier, key: bytes) -> str:
    return tier.layout.block_path(key_digest(key))


def block_files(tier: DiskTier) -> list[str]:
    return sorted(glob.glob(os.path.join(tier.layout.blocks_dir, "*", "*")))


def flip_byte(path: str, off: int) -> None:
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.fixture
def stored(root, make_tier, arena):
    """A tier on ``root`` holding 4 stored blocks: (tier, keys, source arena rows)."""
    tier = make_tier(root)
    a = fill(arena(8, BS), 1)
    tier.set_arena(a)
    keys = keys_of(4)
    ok(store(tier, 1, keys, range(4)), 4 * BS)
    src = a[:4].copy()
    a[:] = 0
    return tier, keys, src, a


# ------------------------------------------------------------------------- phase 1: the lookup table


def test_hit_when_stored(root, make_tier, arena):
    tier = make_tier(root)
    a = fill(arena(4, BS), 2)
    tier.set_arena(a)
    keys = keys_of(3)
    res = store(tier, 7, keys, [2, 0, 1])
    ok(res, 3 * BS)
    assert [tier.lookup(k) for k in keys] == [HIT, HIT, HIT]
    assert tier.num_blocks == 3 and tier.used_bytes == 3 * FB
    for k, slot in zip(keys, [2, 0, 1]):
        with open(path_of(tier, k), "rb") as f:
            raw = f.read()
        assert len(raw) == FB and raw[HEADER_BYTES:] == a[slot].tobytes()
    s = tier.stats()
    assert (s["lookups"], s["hits"], s["misses"], s["retries"], s["hit_pending"]) == (3, 3, 0, 0, 0)
    assert s["blocks_stored"] == 3 and s["bytes_stored"] == 3 * BS and s["stores_submitted"] == 1
    assert s["blocks_present"] == 3 and s["used_bytes"] == 3 * FB


def test_miss_when_never_stored(root, make_tier, stored):
    tier = stored[0]
    assert tier.lookup(b"never stored") is MISS
    assert tier.lookup(bytearray(b"never stored")) is MISS  # bytes-like keys are fine
    s = tier.stats()
    assert s["misses"] == 2 and s["probes"] == 0  # not shared: no probe either


def test_retry_while_being_written(root, make_tier, arena):
    tier = make_tier(root)
    a = fill(arena(4, BS), 3)
    tier.set_arena(a)
    keys = keys_of(2)
    tier.submit_store(TransferJob(1, keys, [0, 1]))
    assert [tier.lookup(k) for k in keys] == [RETRY, RETRY]  # being written is not a miss
    tier.drain()  # the engine is done, but the tier has not collected the job yet
    assert [tier.lookup(k) for k in keys] == [RETRY, RETRY]
    # a load of a block being written fails without I/O (the caller should have waited)
    sqes = tier.stats()["engine_sqes"]
    tier.submit_load(TransferJob(2, keys[:1], [3]))
    res = {r.job_id: r for r in tier.get_finished_jobs()}
    assert set(res) == {1, 2}
    ok(res[1], 2 * BS)
    assert res[2].success is False and res[2].failed_keys == {keys[0]: "block is writing"}
    assert tier.stats()["engine_sqes"] == sqes
    assert [tier.lookup(k) for k in keys] == [HIT, HIT]
    assert tier.stats()["retries"] == 4


def test_hit_pending_while_loading(stored):
    tier, keys, src, a = stored
    tier.submit_load(TransferJob(10, keys[:2], [5, 6]))
    assert [tier.lookup(k) for k in keys] == [HIT_PENDING, HIT_PENDING, HIT, HIT]
    tier.drain()
    assert tier.lookup(keys[0]) is HIT_PENDING  # until the tier collects the job
    (res,) = tier.get_finished_jobs()
    ok(res, 2 * BS)
    assert res.submits == 1
    assert [tier.lookup(k) for k in keys] == [HIT] * 4
    assert np.array_equal(a[5], src[0]) and np.array_equal(a[6], src[1])
    assert tier.stats()["hit_pending"] == 3


def test_miss_after_failed_load(stored):
    tier, keys, src, a = stored
    os.unlink(path_of(tier, keys[1]))  # gone behind the tier's back
    res = load(tier, 3, keys[:3], [0, 1, 2])
    assert res.success is False
    assert res.successful_keys == [keys[0], keys[2]]
    assert res.failed_keys == {keys[1]: "ENOENT: No such file or directory"}
    assert res.transfer_bytes == 2 * BS
    assert np.array_equal(a[0], src[0]) and np.array_equal(a[2], src[2])
    # a failed load is a MISS from then on: the engine recomputes instead of retrying forever
    assert [tier.lookup(k) for k in keys] == [HIT, MISS, HIT, HIT]
    assert tier.num_blocks == 3 and tier.used_bytes == 3 * FB
    s = tier.stats()
    assert s["load_failures"] == 1 and s["blocks_loaded"] == 2 and s["quarantined"] == 0
    # ... until it is stored again
    a[1] = src[1]
    ok(store(tier, 4, [keys[1]], [1]), BS)
    assert tier.lookup(keys[1]) is HIT
    a[1] = 0
    ok(load(tier, 5, [keys[1]], [1]), BS)
    assert np.array_equal(a[1], src[1])


def test_shared_retry_while_probe_in_flight_then_hit(root, make_tier, arena):
    a = fill(arena(4, BS), 4)
    first = make_tier(root, shared=True)
    first.set_arena(a)
    other = make_tier(root, shared=True)  # another writer of the same directory
    other.set_arena(a)
    key = b"written by the other"
    ok(store(other, 1, [key], [0]), BS)
    src = a[0].copy()

    assert first.lookup(key) is RETRY  # unknown to the index: a probe is needed
    assert first.lookup(key) is RETRY  # still unknown; asked once
    first.on_step_end()  # one batch of statx for the step
    assert first.stats()["probes"] == 1
    first.drain()  # applies the finished probe
    assert first.lookup(key) is HIT
    s = first.stats()
    assert s["probes"] == 1 and s["probe_hits"] == 1 and s["retries"] == 2
    assert first.num_blocks == 1 and first.used_bytes == FB
    a[3] = 0
    ok(load(first, 2, [key], [3]), BS)
    assert np.array_equal(a[3], src)


def test_shared_probe_that_finds_nothing_is_miss(root, make_tier):
    tier = make_tier(root, shared=True, probe_ttl_s=3600)
    assert tier.lookup(b"nowhere") is RETRY
    tier.on_step_end()
    tier.drain()
    assert tier.lookup(b"nowhere") is MISS
    tier.on_step_end()
    tier.drain()
    assert tier.lookup(b"nowhere") is MISS  # the probe's answer holds for probe_ttl_s
    s = tier.stats()
    assert s["probes"] == 1 and s["probe_hits"] == 0
    assert not tier.has_pending_work()


def test_shared_probe_miss_expires(root, make_tier):
    tier = make_tier(root, shared=True, probe_ttl_s=0)
    assert tier.lookup(b"nowhere") is RETRY
    tier.on_step_end()
    tier.drain()
    assert tier.lookup(b"nowhere") is RETRY  # expired at once: probed again
    tier.on_step_end()
    tier.drain()
    assert tier.stats()["probes"] == 2


def test_shared_probe_ignores_a_file_of_other_size(root, make_tier):
    tier = make_tier(root, shared=True)
    key = b"odd"
    with open(path_of(tier, key), "wb") as f:
        f.write(b"\0" * 100)
    assert tier.lookup(key) is RETRY
    tier.on_step_end()
    tier.drain()
    assert tier.lookup(key) is MISS and tier.num_blocks == 0


# ------------------------------------------------------------------------- promotion


def test_promoter_reads_a_shared_block_once(stored):
    tier, keys, src, a = stored
    k0, k1, k2, k3 = keys
    p = Promoter(tier)
    before = tier.stats()
    assert p.lookup(k1) is HIT
    assert p.promote("r1", [k0, k1], [4, 5]) == {k0: 4, k1: 5}
    assert p.lookup(k1) is HIT_PENDING  # asked for this step: do not start a second read
    assert p.lookup(k2) is HIT
    # r2 needs k1 too: it gets r1's slot, not its own slot 6
    assert p.promote("r2", [k1, k2], [6, 7]) == {k1: 5, k2: 7}
    assert p.in_flight == 2
    p.on_step_end()
    assert p.jobs_submitted == 2
    assert tier.lookup(k1) is HIT_PENDING and p.lookup(k2) is HIT_PENDING
    tier.drain()
    done = {r.request_id: r for r in p.poll()}
    assert set(done) == {"r1", "r2"} and p.in_flight == 0
    assert done["r1"].loaded == {k0: 4, k1: 5} and done["r1"].failed == {}
    assert done["r2"].loaded == {k1: 5, k2: 7} and done["r2"].failed == {}
    assert np.array_equal(a[4], src[0]) and np.array_equal(a[5], src[1])
    assert np.array_equal(a[7], src[2])
    assert not a[6].any()  # k1 was not read a second time into r2's slot
    after = tier.stats()
    assert after["blocks_loaded"] - before["blocks_loaded"] == 3
    assert after["loads_submitted"] - before["loads_submitted"] == 2
    assert after["submits"] - before["submits"] == 2  # one io_uring_submit per request
    # open, statx (link count), header, data, close
    assert after["engine_sqes"] - before["engine_sqes"] == 3 * 5
    assert [p.lookup(k) for k in keys] == [HIT] * 4
    assert p.poll() == [] and p.take_other_results() == []


def test_promoter_one_submit_per_request_per_step(root, make_tier, arena):
    tier = make_tier(root)
    a = fill(arena(40, BS), 5)
    tier.set_arena(a)
    keys = keys_of(20)
    ok(store(tier, 1, keys, range(20)), 20 * BS)
    src = a[:20].copy()
    p = Promoter(tier)
    for step in range(2):
        before = tier.stats()
        # three requests of 3, 5 and 2 blocks (disjoint)
        groups = [keys[10 * step : 10 * step + 3], keys[10 * step + 3 : 10 * step + 8],
                  keys[10 * step + 8 : 10 * step + 10]]
        slot = 20
        expect = {}
        for rid, g in enumerate(groups):
            slots = list(range(slot, slot + len(g)))
            assert p.promote((step, rid), g, slots) == dict(zip(g, slots))
            expect[(step, rid)] = dict(zip(g, slots))
            slot += len(g)
        p.on_step_end()
        tier.drain()
        done = {r.request_id: r.loaded for r in p.poll()}
        assert done == expect
        after = tier.stats()
        assert after["submits"] - before["submits"] == 3
        assert after["loads_submitted"] - before["loads_submitted"] == 3
        assert after["blocks_loaded"] - before["blocks_loaded"] == 10
        for i in range(10):
            assert np.array_equal(a[20 + i], src[10 * step + i])
    assert p.jobs_submitted == 6


def test_promoter_partial_failure(stored):
    tier, keys, src, a = stored
    k0, k1, k2, k3 = keys
    flip_byte(path_of(tier, k2), HEADER_BYTES + 100)  # corrupt payload
    p = Promoter(tier)
    p.promote("a", [k0, k2], [4, 5])
    p.promote("b", [k2, k3, b"never stored"], [6, 7, 0])
    p.on_step_end()
    tier.drain()
    done = {r.request_id: r for r in p.poll()}
    reason = "payload checksum mismatch (corrupt bytes)"
    assert done["a"].loaded == {k0: 4} and done["a"].failed == {k2: reason}
    assert done["b"].loaded == {k3: 7}
    assert done["b"].failed == {k2: reason, b"never stored": "not in the tier"}
    assert np.array_equal(a[4], src[0]) and np.array_equal(a[7], src[3])
    assert [p.lookup(k) for k in keys] == [HIT, HIT, MISS, HIT]
    assert tier.stats()["blocks_loaded"] == 2 and tier.stats()["load_failures"] == 1


def test_load_partial_failure_reports_exactly_the_good_keys(stored):
    tier, keys, src, a = stored
    flip_byte(path_of(tier, keys[0]), 20)  # header
    os.unlink(path_of(tier, keys[3]))
    before = tier.stats()
    res = load(tier, 9, [keys[0], keys[1], b"absent", keys[2], keys[3]], [4, 5, 6, 7, 0])
    assert res.success is False
    assert res.successful_keys == [keys[1], keys[2]]
    assert res.failed_keys == {
        keys[0]: "block header is corrupt (magic, version or header checksum)",
        b"absent": "not in the tier",
        keys[3]: "ENOENT: No such file or directory",
    }
    assert res.transfer_bytes == 2 * BS and res.submits == 1
    assert np.array_equal(a[5], src[1]) and np.array_equal(a[7], src[2])
    assert [tier.lookup(k) for k in keys] == [MISS, HIT, HIT, MISS]
    d = {k: tier.stats()[k] - before[k] for k in before}
    assert d["engine_sqes"] == 4 * 5  # the absent key cost no I/O
    assert d["blocks_loaded"] == 2 and d["load_failures"] == 2
    assert d["quarantined"] == 1 and d["verify_failures"] == 1


def test_all_keys_failed_has_no_successful_keys(stored):
    tier = stored[0]
    res = load(tier, 1, [b"x", b"y"], [0, 1])
    assert res.success is False and res.successful_keys is None
    assert res.failed_keys == {b"x": "not in the tier", b"y": "not in the tier"}
    assert res.transfer_bytes == 0 and res.submits == 0


# ------------------------------------------------------------------------- integrity


CORRUPTIONS = {
    "truncated": "block file is truncated (short read)",
    "payload_byte": "payload checksum mismatch (corrupt bytes)",
    "header_byte": "block header is corrupt (magic, version or header checksum)",
    "foreign_block": "block file belongs to another key",
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corrupt_block_is_quarantined(stored, kind):
    tier, keys, src, a = stored
    victim = path_of(tier, keys[1])
    if kind == "truncated":
        os.truncate(victim, HEADER_BYTES + BS // 2)
    elif kind == "payload_byte":
        flip_byte(victim, HEADER_BYTES + BS - 1)
    elif kind == "header_byte":
        flip_byte(victim, 24)  # inside the key digest: the header checksum catches it
    else:
        shutil.copyfile(path_of(tier, keys[2]), victim)  # a whole block, of another key
    with open(victim, "rb") as f:
        bad = f.read()

    res = load(tier, 2, keys[:2], [4, 5])
    assert res.success is False and res.successful_keys == [keys[0]]
    assert res.failed_keys == {keys[1]: CORRUPTIONS[kind]}
    assert np.array_equal(a[4], src[0])
    assert tier.lookup(keys[1]) is MISS
    assert not os.path.exists(victim)
    (q,) = os.listdir(tier.layout.quarantine_dir)
    assert q.startswith(key_digest(keys[1]).hex() + ".kvb.")
    with open(os.path.join(tier.layout.quarantine_dir, q), "rb") as f:
        assert f.read() == bad  # kept for inspection, as it was
    s = tier.stats()
    assert s["quarantined"] == 1 and s["verify_failures"] == 1 and s["load_failures"] == 1
    assert tier.num_blocks == 3 and tier.used_bytes == 3 * FB
    assert len(block_files(tier)) == 3
    # the key can be stored again and then loads
    a[1] = src[1]
    ok(store(tier, 3, [keys[1]], [1]), BS)
    a[1] = 0
    ok(load(tier, 4, [keys[1]], [1]), BS)
    assert np.array_equal(a[1], src[1])


# ------------------------------------------------------------------------- recovery


def test_restart_recovers_the_index(root, make_tier, arena):
    a = fill(arena(8, BS), 6)
    first = make_tier(root)
    first.set_arena(a)
    keys = keys_of(6)
    ok(store(first, 1, keys, range(6)), 6 * BS)
    src = a[:6].copy()
    first.shutdown()

    again = make_tier(root)
    assert again.num_blocks == 6 and again.used_bytes == 6 * FB
    assert [again.lookup(k) for k in keys] == [HIT] * 6
    assert again.lookup(b"other") is MISS
    a[:] = 0
    again.set_arena(a)
    res = load(again, 1, list(reversed(keys)), range(6))
    ok(res, 6 * BS)
    for i in range(6):
        assert np.array_equal(a[i], src[5 - i])
    s = again.stats()
    assert s["stale_temporaries_removed"] == 0 and s["malformed_block_files"] == 0
    assert s["fixed_buffer_ios"] == 6 and s["direct"] == int(again.direct)


def test_restart_quarantines_what_is_not_a_block_of_this_tier(root, make_tier, arena):
    """Entries at block names that are not block files of the root's block size (a truncated
    or longer file, a directory, a dangling link) are moved out of the way at start-up (kept in
    quarantine), so storing those keys again really stores them. (Blocks of another block
    size: the root is refused, tests/test_root.py.)"""
    a = fill(arena(2, BS), 7)
    first = make_tier(root)
    first.set_arena(a)
    ok(store(first, 1, [b"a", b"b", b"e"], [0, 1, 0]), 3 * BS)
    os.truncate(path_of(first, b"a"), FB - 1)                       # truncated
    os.truncate(path_of(first, b"b"), 2 * FB)                       # longer
    os.mkdir(path_of(first, b"c"))                                  # a directory at a block name
    os.symlink("/nonexistent", path_of(first, b"d"))                # a dangling link
    first.shutdown()
    other = make_tier(root)
    assert other.num_blocks == 1 and other.stats()["malformed_block_files"] == 4
    assert other.stats()["quarantined"] == 4
    assert other.stats()["quarantine_files"] == 4
    assert other.stats()["quarantine_bytes"] == (FB - 1) + 2 * FB
    assert [other.lookup(k) for k in (b"a", b"b", b"c", b"d", b"e")] == [MISS] * 4 + [HIT]
    assert block_files(other) == [path_of(other, b"e")]
    assert len(os.listdir(other.layout.quarantine_dir)) == 4
    b = fill(arena(4, BS), 9)
    other.set_arena(b)
    ok(store(other, 2, [b"a", b"c"], [0, 1]), 2 * BS)
    want = b[:2].copy()
    b[...] = 0
    ok(load(other, 3, [b"a", b"c"], [2, 3]), 2 * BS)
    assert np.array_equal(b[2:4], want)


def test_shared_root_sweeps_temporaries_by_age_only(root, make_tier):
    """On a shared root a temporary's pid says nothing (its writer may be in another pid
    namespace or on another node): a fresh one stays whatever its pid; an hours-old one goes."""
    make_tier(root, shared=True).shutdown()
    with open("/proc/sys/kernel/pid_max") as f:
        dead = int(f.read()) + 1  # no such process here
    blocks = os.path.join(root, "blocks")
    d = key_digest(b"x").hex()
    fresh = [f"{blocks}/{d[:2]}/{d}.kvb.tmp.{dead}.1", f"{blocks}/{d[:2]}/{d}.kvb.tmp.{os.getpid()}.2"]
    old = f"{blocks}/00/{'00' * 16}.kvb.tmp.{dead}.3"
    for p in fresh + [old]:
        with open(p, "wb") as f:
            f.write(b"partial")
    os.utime(old, (os.path.getmtime(old) - 7200,) * 2)
    tier = make_tier(root, shared=True)
    # (removed by the start-up sweep, or by the root keeper's first count if it ran first:
    # both run at start, the one to get there counts it)
    st = tier.stats()
    assert st["stale_temporaries_removed"] + st["shared_stale_temporaries_removed"] == 1
    assert [os.path.exists(p) for p in fresh + [old]] == [True, True, False]


def test_stale_temporaries_removed_at_start(root, make_tier, arena):
    a = fill(arena(2, BS), 8)
    first = make_tier(root)
    first.set_arena(a)
    ok(store(first, 1, [b"kept"], [0]), BS)
    first.shutdown()

    with open("/proc/sys/kernel/pid_max") as f:
        dead = int(f.read()) + 1  # above pid_max: no such process can exist
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        blocks = first.layout.blocks_dir
        d = key_digest(b"x").hex()
        stale = [
            f"{blocks}/{d[:2]}/{d}.kvb.tmp.{dead}.1",           # writer died
            f"{blocks}/{d[:2]}/{d}.kvb.tmp.garbage",            # unreadable owner
            f"{blocks}/00/{'00' * 16}.kvb.tmp.{child.pid}.3",   # live writer, but hours old
        ]
        live = f"{blocks}/01/{'01' * 16}.kvb.tmp.{child.pid}.4"  # live writer, fresh
        for p in stale + [live]:
            with open(p, "wb") as f:
                f.write(b"partial")
        os.utime(stale[2], (os.path.getmtime(stale[2]) - 7200,) * 2)

        again = make_tier(root)
        assert again.stats()["stale_temporaries_removed"] == 3
        assert [os.path.exists(p) for p in stale] == [False] * 3
        assert os.path.exists(live)
        assert again.num_blocks == 1 and again.lookup(b"kept") is HIT
    finally:
        child.communicate(b"")


# ------------------------------------------------------------------------- capacity


def test_eviction_keeps_within_capacity(root, make_tier, arena):
    cap = 4 * FB
    tier = make_tier(root, capacity_bytes=cap)
    a = fill(arena(10, BS), 9)
    tier.set_arena(a)
    keys = keys_of(10)
    for i, k in enumerate(keys):
        ok(store(tier, i, [k], [i]), BS)
        assert tier.used_bytes <= cap
        assert len(block_files(tier)) == tier.num_blocks == min(i + 1, 4)
        if i == 3:
            tier.touch([keys[0]])  # recently used: evicted after keys 1, 2, 3
    # LRU order: 1, 2, 3 go first, then 0 (touched), 4, 5
    alive = [keys[i] for i in (6, 7, 8, 9)]
    assert [tier.lookup(k) for k in keys] == [MISS] * 6 + [HIT] * 4
    assert block_files(tier) == sorted(path_of(tier, k) for k in alive)
    s = tier.stats()
    assert s["evictions"] == 6 and s["eviction_failures"] == 0
    assert tier.used_bytes == cap and tier.num_blocks == 4
    src = a.copy()
    a[:] = 0
    ok(load(tier, 100, alive, range(4)), 4 * BS)
    for i in range(4):
        assert np.array_equal(a[i], src[6 + i])


def test_eviction_order_after_the_first_evictions(root, make_tier, arena):
    """touch() of a block that a past eviction round spared still moves it to the back."""
    tier = make_tier(root, capacity_bytes=2 * FB)
    a = fill(arena(4, BS), 10)
    tier.set_arena(a)
    k = keys_of(4)
    ok(store(tier, 1, [k[0]], [0]), BS)
    ok(store(tier, 2, [k[1]], [1]), BS)
    ok(store(tier, 3, [k[2]], [2]), BS)  # evicts k0
    tier.touch([k[1]])
    ok(store(tier, 4, [k[3]], [3]), BS)  # evicts k2, not the touched k1
    assert [tier.lookup(x) for x in k] == [MISS, HIT, MISS, HIT]


def test_take_removed_reports_evicted_and_failed_blocks_once(root, make_tier, arena):
    """track_removals=True: every block that stops being loadable is reported once, by digest."""
    tier = make_tier(root, capacity_bytes=2 * FB, track_removals=True)
    a = fill(arena(4, BS), 14)
    tier.set_arena(a)
    k = keys_of(4)
    ok(store(tier, 1, k[:2], [0, 1]), 2 * BS)
    assert tier.take_removed() == []
    ok(store(tier, 2, [k[2]], [2]), BS)  # evicts k0
    assert tier.take_removed() == [key_digest(k[0])]
    assert tier.take_removed() == []  # reported once
    os.truncate(path_of(tier, k[1]), FB - 1)
    res = load(tier, 3, [k[1]], [3])
    assert res.success is False and tier.lookup(k[1]) is MISS
    assert tier.take_removed() == [key_digest(k[1])]
    res = load(tier, 4, [k[1]], [3])  # already a MISS: no second report
    assert res.success is False and tier.take_removed() == []
    ok(store(tier, 5, [k[0], k[3]], [0, 3]), 2 * BS)  # k0 stored again; room made by evicting k2
    assert tier.take_removed() == [key_digest(k[2])]
    assert [tier.lookup(x) for x in k] == [HIT, MISS, MISS, HIT]
    untracked = make_tier(os.path.join(root, "untracked"), capacity_bytes=FB)
    untracked.set_arena(a)
    ok(store(untracked, 1, [k[0]], [0]), BS)
    ok(store(untracked, 2, [k[1]], [1]), BS)  # evicts, but nothing is kept
    assert untracked.stats()["evictions"] == 1 and untracked.take_removed() == []


def test_one_job_larger_than_capacity(root, make_tier, arena):
    """Blocks being written cannot be evicted: what does not fit fails, per key."""
    tier = make_tier(root, capacity_bytes=4 * FB)
    a = fill(arena(6, BS), 11)
    tier.set_arena(a)
    keys = keys_of(6)
    res = store(tier, 1, keys, range(6))
    assert res.success is False and res.successful_keys == keys[:4]
    assert res.failed_keys == {k: "no capacity: every block is in use" for k in keys[4:]}
    assert res.transfer_bytes == 4 * BS
    assert tier.stats()["capacity_rejections"] == 2 and tier.used_bytes == 4 * FB
    assert [tier.lookup(k) for k in keys] == [HIT] * 4 + [MISS] * 2
    assert len(block_files(tier)) == 4


def test_block_being_loaded_is_never_evicted(root, make_tier, arena):
    tier = make_tier(root, capacity_bytes=3 * FB)
    a = fill(arena(8, BS), 12)
    tier.set_arena(a)
    old = keys_of(3, b"old")
    for i, k in enumerate(old):
        ok(store(tier, i, [k], [i]), BS)
    src = a.copy()
    tier.touch([old[1], old[2]])  # old[0] is now the least recently used
    tier.submit_load(TransferJob(10, [old[0]], [7]))
    new = keys_of(3, b"new")
    for i, k in enumerate(new):  # no draining in between: old[0]'s load is in flight
        tier.submit_store(TransferJob(20 + i, [k], [3 + i]))
    assert tier.used_bytes <= 3 * FB
    res = {r.job_id: r for r in finish(tier)}
    assert set(res) == {10, 20, 21, 22}
    ok(res[10], BS)
    assert np.array_equal(a[7], src[0])  # byte-exact despite the pressure
    ok(res[20], BS)
    ok(res[21], BS)
    assert res[22].failed_keys == {new[2]: "no capacity: every block is in use"}
    assert [tier.lookup(k) for k in old] == [HIT, MISS, MISS]
    assert [tier.lookup(k) for k in new] == [HIT, HIT, MISS]
    assert os.path.exists(path_of(tier, old[0]))
    assert len(block_files(tier)) == 3 and tier.used_bytes == 3 * FB
    s = tier.stats()
    assert s["evictions"] == 2 and s["capacity_rejections"] == 1
    a[7] = 0
    ok(load(tier, 30, [old[0]], [7]), BS)
    assert np.array_equal(a[7], src[0])


def test_restart_over_capacity_evicts_oldest(root, make_tier, arena):
    a = fill(arena(5, BS), 13)
    first = make_tier(root)
    first.set_arena(a)
    keys = keys_of(5)
    for i, k in enumerate(keys):
        ok(store(first, i, [k], [i]), BS)
        os.utime(path_of(first, k), (1_000_000 + i,) * 2)  # a clear age order
    first.shutdown()
    small = make_tier(root, capacity_bytes=2 * FB)
    small.drain()
    small.get_finished_jobs()
    assert small.used_bytes == 2 * FB and small.num_blocks == 2
    assert [small.lookup(k) for k in keys] == [MISS, MISS, MISS, HIT, HIT]
    assert len(block_files(small)) == 2 and small.stats()["evictions"] == 3


@pytest.mark.parametrize("engine", ["uring", "posix"])
def test_stores_at_capacity_reuse_the_evicted_files(root, make_tier, arena, engine):
    """recycle (default): each store that needs room takes over its victim's file -- the new
    blocks live in the old inodes, nothing else is left on disk, and every byte is the new one."""
    tier = make_tier(root, capacity_bytes=4 * FB, engine=engine)
    a = fill(arena(8, BS), 21)
    tier.set_arena(a)
    old, new = keys_of(4, b"old"), keys_of(4, b"new")
    ok(store(tier, 1, old, range(4)), 4 * BS)
    inodes = {os.stat(path_of(tier, k)).st_ino for k in old}
    ok(store(tier, 2, new, range(4, 8)), 4 * BS)  # one job: four victims, four reuses
    assert {os.stat(path_of(tier, k)).st_ino for k in new} == inodes
    assert block_files(tier) == sorted(path_of(tier, k) for k in new)  # no temporaries left
    assert [tier.lookup(k) for k in old + new] == [MISS] * 4 + [HIT] * 4
    s = tier.stats()
    assert (s["evictions"], s["evictions_recycled"], s["files_recycled"],
            s["recycle_failures"], s["eviction_failures"]) == (4, 4, 4, 0, 0)
    if engine == "uring":  # new files: one plain WRITEV each; recycled: payload from the arena
        assert s["fixed_buffer_ios"] == 4
    assert tier.used_bytes == 4 * FB and tier.num_blocks == 4
    src = a.copy()
    a[:] = 0
    ok(load(tier, 3, new, range(4)), 4 * BS)
    assert np.array_equal(a[:4], src[4:])
    # A restart sees exactly the new blocks, whole.
    tier.shutdown()
    again = make_tier(root, capacity_bytes=4 * FB, engine=engine)
    again.set_arena(a)
    a[:] = 0
    ok(load(again, 4, new, range(4)), 4 * BS)
    assert np.array_equal(a[:4], src[4:]) and again.num_blocks == 4


@pytest.mark.parametrize("engine", ["uring", "posix"])
def test_recycling_a_file_that_is_gone_writes_a_new_one(root, make_tier, arena, engine):
    """The victim's file removed behind the tier's back: the store creates its file afresh."""
    tier = make_tier(root, capacity_bytes=2 * FB, engine=engine)
    a = fill(arena(4, BS), 22)
    tier.set_arena(a)
    k = keys_of(4)
    ok(store(tier, 1, k[:2], [0, 1]), 2 * BS)
    os.unlink(path_of(tier, k[0]))
    ok(store(tier, 2, k[2:], [2, 3]), 2 * BS)  # victims k0 (gone) and k1
    assert block_files(tier) == sorted(path_of(tier, x) for x in k[2:])
    s = tier.stats()
    assert (s["evictions_recycled"], s["files_recycled"], s["recycle_failures"]) == (2, 1, 0)
    src = a.copy()
    a[:] = 0
    ok(load(tier, 3, k[2:], [0, 1]), 2 * BS)
    assert np.array_equal(a[:2], src[2:])


@pytest.mark.parametrize("flag", ["recycle", "shared", "fsync", "track_removals"])
def test_flags_must_be_bools(root, flag):
    with pytest.raises(ValueError, match=f"{flag} must be True or False, got 'no'"):
        DiskTier(root, BS, **{flag: "no"})


def test_shared_roots_and_recycle_false_unlink_evicted_files(root, make_tier, arena):
    """Another process may be reading an evicted file of a shared root: never reused there."""
    a = fill(arena(4, BS), 23)
    for name, kw in (("shared", {"shared": True}), ("off", {"recycle": False})):
        tier = make_tier(os.path.join(root, name), capacity_bytes=2 * FB, **kw)
        tier.set_arena(a)
        assert tier.recycle is False
        k = keys_of(4)
        ok(store(tier, 1, k[:2], [0, 1]), 2 * BS)
        ok(store(tier, 2, k[2:], [2, 3]), 2 * BS)
        tier.drain()  # the unlinks
        tier.get_finished_jobs()
        s = tier.stats()
        # a shared root's evictions are its evictor's (this tier, the only member), not the tier's
        local, by_evictor = (0, 2) if kw.get("shared") else (2, None)
        assert (s["evictions"], s["evictions_recycled"], s["files_recycled"]) == (local, 0, 0)
        assert s.get("shared_evictions") == by_evictor
        assert block_files(tier) == sorted(path_of(tier, x) for x in k[2:])


def test_engine_recycle_that_cannot_rename_removes_the_file(root, arena):
    """io_uring engine, write_block with recycle_path: when the rename into the temporary name
    fails for another reason than ENOENT (here EEXIST), the block is written to a new file and
    the file to recycle is removed; nothing else is touched."""
    from pykvtier import _native
    from pykvtier.engines import run_job

    a = fill(arena(1, BS), 24)
    eng = _native.Engine(queue_depth=4, max_inflight_bytes=1 << 20)
    victim, tmp, final = (os.path.join(root, n) for n in ("victim", "tmp", "final"))
    for path, fill_byte in ((victim, b"v"), (tmp, b"t")):
        with open(path, "wb") as f:
            f.write(fill_byte * FB)
    digest = key_digest(b"key")
    addr = a.ctypes.data
    res = run_job(eng, _native.WRITE_BLOCK, [(tmp, final, BS, addr, digest, victim)], direct=False)
    assert res == [BS]
    assert sorted(os.listdir(root)) == ["final"]
    s = eng.stats()
    assert (s["recycled"], s["recycle_failures"]) == (0, 0)
    b = fill(arena(1, BS), 0)
    b[:] = 0
    assert run_job(eng, _native.READ_BLOCK, [(final, BS, b.ctypes.data, digest)], direct=False) == [BS]
    assert np.array_equal(a, b)
    eng.shutdown()


@pytest.mark.parametrize("engine", ["uring", "posix"])
@pytest.mark.parametrize("kind", ["symlink", "fifo", "longer", "hardlinked", "directory"])
def test_a_victim_that_is_no_block_file_is_not_overwritten(root, make_tier, arena, engine, kind):
    """The evicted block's name holds something else by the time its file is recycled: a
    symlink (never written through: the file it names stays as it was), a FIFO (the store must
    not wait for a reader), a longer file (the new block file must be a block's length: capacity
    counts block files as such), a file with a second link (its other name keeps its bytes), a
    directory. Each is put back at its name and removed (a directory cannot be: the engine
    reports it as a leftover, which the tier moves to the quarantine), and the store writes a
    new file."""
    outside = os.path.join(root, "outside")
    with open(outside, "wb") as f:
        f.write(b"O" * (2 * FB))
    tier = make_tier(os.path.join(root, "tier"), capacity_bytes=2 * FB, engine=engine)
    a = fill(arena(4, BS), 25)
    tier.set_arena(a)
    k = keys_of(3)
    ok(store(tier, 1, k[:2], [0, 1]), 2 * BS)
    victim = path_of(tier, k[0])  # the least recently used: the victim of the next store
    other = os.path.join(root, "other-link")
    if kind == "hardlinked":
        os.link(victim, other)
        before = open(other, "rb").read()
    else:
        os.unlink(victim)
        if kind == "symlink":
            os.symlink(outside, victim)
        elif kind == "fifo":
            os.mkfifo(victim)
        elif kind == "longer":
            with open(victim, "wb") as f:
                f.write(b"L" * (3 * FB))
        else:
            os.mkdir(victim)
    tier.submit_store(TransferJob(2, [k[2]], [2]))
    done = tier.wait(30.0)
    if not done:  # the engine waits on the FIFO: give it a reader so that the test ends
        for p in glob.glob(os.path.join(tier.layout.blocks_dir, "*", "*")):
            if os.path.exists(p) and not os.path.isfile(p) and not os.path.isdir(p):
                os.close(os.open(p, os.O_RDONLY | os.O_NONBLOCK))
    assert [r.job_id for r in done] == [2], "the store did not finish"
    ok(done[0], BS)
    assert open(outside, "rb").read() == b"O" * (2 * FB)
    if kind == "hardlinked":
        assert open(other, "rb").read() == before
    files = block_files(tier)
    assert files == sorted(path_of(tier, x) for x in k[1:])  # no temporaries
    assert all(os.lstat(p).st_size == FB and os.path.isfile(p) for p in files)
    s = tier.stats()
    assert (s["files_recycled"], s["recycle_failures"]) == (0, int(kind == "directory"))
    assert (s["leftovers_removed"], s["leftover_files"]) == (int(kind == "directory"), 0)
    assert s["quarantine_files"] == int(kind == "directory")
    assert tier.used_bytes == 2 * FB and tier.num_blocks == 2
    src = a.copy()
    a[:] = 0
    ok(load(tier, 3, k[1:], [1, 2]), 2 * BS)
    assert np.array_equal(a[1:3], src[1:3])
    tier.shutdown()
    again = make_tier(os.path.join(root, "tier"), capacity_bytes=2 * FB, engine=engine)
    assert again.num_blocks == 2
    assert again.stats()["malformed_block_files"] == 0


def test_start_up_moves_a_directory_at_a_stale_temporary_name_aside(root, make_tier):
    """A stale temporary that cannot be unlinked (a directory) is moved to the quarantine
    folder instead of failing the tier's start-up."""
    tier = make_tier(root)
    name = key_digest(b"d").hex()
    stale = os.path.join(tier.layout.blocks_dir, name[:2], f"{name}.kvb.tmp.0.1")
    tier.shutdown()
    os.mkdir(stale)
    again = make_tier(root)
    assert not os.path.exists(stale) and again.num_blocks == 0
    assert again.stats()["quarantined"] == 1
    assert [n.startswith(f"{name}.kvb.tmp.0.1.") for n in os.listdir(again.layout.quarantine_dir)] == [True]


# ------------------------------------------------------------------------- stores


def test_store_skips_present_and_repeated_keys(stored):
    tier, keys, src, a = stored
    before = tier.stats()
    res = store(tier, 5, [keys[0], b"new", b"new", keys[1]], [0, 1, 1, 2])
    ok(res, BS)  # only the new block moved
    d = {k: tier.stats()[k] - before[k] for k in before}
    # skipped: the two present keys, and the repeat of b"new" (being written by then)
    assert d["stores_skipped_present"] == 3 and d["blocks_stored"] == 1
    assert tier.num_blocks == 5 and len(block_files(tier)) == 5


def test_two_tiers_store_the_same_block_at_once(root, make_tier, arena):
    """Two writers of one directory (content-addressed): both succeed, one file remains."""
    a = fill(arena(2, BS), 14)
    t1 = make_tier(root, shared=True)
    t2 = make_tier(root, shared=True)
    t1.set_arena(a)
    t2.set_arena(a)
    t1.submit_store(TransferJob(1, [b"same"], [0]))
    t2.submit_store(TransferJob(1, [b"same"], [0]))
    (r1,) = finish(t1)
    (r2,) = finish(t2)
    ok(r1, BS)
    ok(r2, BS)
    assert block_files(t1) == [path_of(t1, b"same")]
    assert t1.lookup(b"same") is HIT and t2.lookup(b"same") is HIT


def test_new_tier_keeps_temporaries_of_a_live_tier_in_this_process(root, make_tier, arena):
    """A temporary named with this process's pid belongs to a live writer while another tier
    of this process uses the root (shared tiers: a non-shared one has the root to itself); it
    is stale only once none does."""
    a = fill(arena(1, BS), 15)
    first = make_tier(root, shared=True)
    first.set_arena(a)
    d = key_digest(b"in flight")
    tmp = first.layout.tmp_path(d)  # as first's write of it would be named
    with open(tmp, "wb") as f:
        f.write(b"partial")
    second = make_tier(root, shared=True)
    assert os.path.exists(tmp) and second.stats()["stale_temporaries_removed"] == 0
    first.shutdown()
    second.shutdown()
    third = make_tier(root)
    assert not os.path.exists(tmp) and third.stats()["stale_temporaries_removed"] == 1


# ------------------------------------------------------------------------- bad input


def test_key_must_be_bytes(stored):
    tier = stored[0]
    with pytest.raises(TypeError, match="key must be bytes, not str"):
        tier.lookup("k-0")
    with pytest.raises(TypeError, match="key must be bytes, not int"):
        tier.submit_load(TransferJob(1, [b"k-0", 5], [0, 1]))
    with pytest.raises(TypeError, match="key must be bytes, not str"):
        tier.submit_store(TransferJob(1, ["k"], [0]))
    with pytest.raises(TypeError, match="job 1: keys must be a sequence of keys \\(bytes\\), not one bytes"):
        tier.submit_store(TransferJob(1, b"k-0", [0]))
    assert not tier.has_pending_work()
    from pykvtier import host_arena

    with pytest.raises(TypeError, match="num_slots must be an int, got '64'"):
        host_arena("64", BS)


@pytest.mark.parametrize("op", ["load", "store"])
def test_malformed_jobs_submit_nothing(stored, op):
    tier, keys, src, a = stored
    submit = tier.submit_load if op == "load" else tier.submit_store
    before = tier.stats()
    with pytest.raises(ValueError, match=r"job 1: 2 keys but 1 slot_ids"):
        submit(TransferJob(1, keys[:2], [0]))
    with pytest.raises(ValueError, match=r"job 1: slot 8 outside the arena \(0\.\.7\)"):
        submit(TransferJob(1, [keys[0], b"new"], [0, 8]))
    with pytest.raises(ValueError, match=r"job 1: slot -1 outside the arena"):
        submit(TransferJob(1, [b"new"], [-1]))
    assert tier.stats() == before
    assert not tier.has_pending_work()
    assert tier.lookup(b"new") is MISS


def test_load_into_one_slot_twice_is_rejected(stored):
    """Two reads racing into one slot could pass a corrupt block: each is verified over the
    bytes in its slot after its read."""
    tier, keys, src, a = stored
    before = tier.stats()
    with pytest.raises(ValueError, match=r"job 3: slot 5 given twice"):
        tier.submit_load(TransferJob(3, keys[:3], [5, 6, 5]))
    assert tier.stats() == before and not tier.has_pending_work()
    assert [tier.lookup(k) for k in keys[:3]] == [HIT] * 3
    ok(store(tier, 4, [b"x", b"y"], [5, 5]), 2 * BS)  # stores may share a source slot


def test_duplicate_in_flight_job_id(stored):
    tier, keys, src, a = stored
    tier.submit_load(TransferJob(42, keys[:1], [4]))
    with pytest.raises(ValueError, match="job_id 42 is already in flight"):
        tier.submit_load(TransferJob(42, keys[1:2], [5]))
    with pytest.raises(ValueError, match="job_id 42 is already in flight"):
        tier.submit_store(TransferJob(42, [b"new"], [5]))
    (res,) = finish(tier)
    ok(res, BS)
    ok(load(tier, 42, keys[1:2], [5]), BS)  # free again once collected


def test_read_only_arena(root, make_tier, arena):
    tier = make_tier(root)
    a = arena(2, BS)
    a.flags.writeable = False
    with pytest.raises(ValueError, match="arena is read-only"):
        tier.set_arena(a)


def test_misaligned_arena(direct_root, make_tier, arena):
    tier = make_tier(direct_root)
    assert tier.direct is True
    raw = arena(3, BS).reshape(-1)
    shifted = raw[512 : 512 + 2 * BS].reshape(2, BS)
    with pytest.raises(ValueError, match=r"arena address 0x[0-9a-f]+ is not a multiple of 4096 bytes"):
        tier.set_arena(shifted)
    with pytest.raises(ValueError, match=r"arena slot stride 66048 is not a multiple of 4096 bytes"):
        tier.set_arena(raw[: 2 * (BS + 512)], slot_bytes=BS + 512)
    with pytest.raises(ValueError, match="smaller than a block"):
        tier.set_arena(raw, slot_bytes=BS // 2)
    assert tier.stats()["fixed_buffer_ios"] == 0
    with pytest.raises(RuntimeError, match="no arena"):
        tier.submit_load(TransferJob(1, [b"k"], [0]))  # none of them was taken


def test_buffered_tier_takes_unaligned_arena(root, make_tier, arena):
    tier = make_tier(root, direct=False)
    raw = fill(arena(3, BS).reshape(-1), 16)
    shifted = raw[100 : 100 + 2 * BS].reshape(2, BS)
    tier.set_arena(shifted)
    src = shifted.copy()
    ok(store(tier, 1, [b"a", b"b"], [0, 1]), 2 * BS)
    shifted[:] = 0
    ok(load(tier, 2, [b"b", b"a"], [0, 1]), 2 * BS)
    assert np.array_equal(shifted[0], src[1]) and np.array_equal(shifted[1], src[0])


def test_jobs_need_an_arena_and_an_open_tier(root, make_tier, arena):
    tier = make_tier(root)
    with pytest.raises(RuntimeError, match="no arena"):
        tier.submit_load(TransferJob(1, [b"k"], [0]))
    tier.set_arena(arena(1, BS))
    tier.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        tier.submit_store(TransferJob(1, [b"k"], [0]))


def test_bad_construction(root):
    with pytest.raises(ValueError, match="block_size_bytes must be a positive int"):
        DiskTier(root, 0)
    with pytest.raises(ValueError, match="cannot hold one block"):
        DiskTier(root, BS, capacity_bytes=BS)
    with pytest.raises(ValueError, match="unknown engine 'gds'"):
        DiskTier(root, BS, engine="gds")
    with pytest.raises(TypeError, match="capacity_bytes must be an integer, not str"):
        DiskTier(root, BS, capacity_bytes="100G")
    with pytest.raises(ValueError, match=r"queue_depth must be in 1\.\.4096, got -1"):
        DiskTier(root, BS, queue_depth=-1)
    with pytest.raises(TypeError, match="queue_depth must be an integer, not float"):
        DiskTier(root, BS, queue_depth=2.5)
    with pytest.raises(ValueError, match="max_inflight_bytes must be positive, got 0"):
        DiskTier(root, BS, max_inflight_bytes=0)


def test_unusable_root_is_named(root):
    a_file = os.path.join(root, "a-file")
    with open(a_file, "w") as f:
        f.write("x")
    with pytest.raises(ValueError, match=f"root {a_file} is not a directory"):
        DiskTier(a_file, BS)
    with pytest.raises(ValueError, match=rf"root {a_file}/sub: cannot create the tier's directories "
                                         rf"\({a_file}/sub: Not a directory\)"):
        DiskTier(os.path.join(a_file, "sub"), BS)
    assert os.listdir(root) == ["a-file"]


@pytest.fixture
def refuses_o_direct(monkeypatch):
    """Makes the tier's O_DIRECT probe answer as a file system that refuses O_DIRECT would
    (tmpfs before Linux 6.6, some FUSE and network file systems); the I/O itself is real."""
    from pykvtier import tier as tier_mod

    real = tier_mod._native.probe_direct

    def probe(path):
        got = dict(real(path))
        got.update(direct=False, reason="open(O_DIRECT) failed: Invalid argument")
        return got

    monkeypatch.setattr(tier_mod._native, "probe_direct", probe)


@pytest.mark.parametrize("engine", ["uring", "posix"])
def test_buffered_fallback_where_o_direct_is_refused(root, refuses_o_direct, make_tier, arena,
                                                     caplog, engine):
    with caplog.at_level("WARNING", logger="pykvtier"):
        tier = make_tier(root, engine=engine)
    assert tier.direct is False
    assert tier.stats()["direct_fallbacks"] == 1
    assert any("O_DIRECT not used" in r.getMessage() and "Invalid argument" in r.getMessage()
               for r in caplog.records)
    src = fill(arena(4, BS), 7)
    tier.set_arena(src)
    keys = keys_of(4, b"fb")
    ok(store(tier, 1, keys, range(4)), 4 * BS)
    want = src.copy()
    src[...] = 0
    ok(load(tier, 2, keys[::-1], range(4)), 4 * BS)
    assert np.array_equal(src, want[::-1])


def test_unaligned_block_size_falls_back_to_buffered(root, make_tier, caplog):
    with caplog.at_level("WARNING", logger="pykvtier"):
        tier = make_tier(root, block_size_bytes=BS + 100)
    assert tier.direct is False and tier.stats()["direct_fallbacks"] == 1
    assert any("not a multiple of" in r.getMessage() for r in caplog.records)


def test_direct_true_where_o_direct_is_refused_is_an_error(root, refuses_o_direct):
    with pytest.raises(ValueError, match="refuses O_DIRECT"):
        DiskTier(root, BS, direct=True)


def test_arena_memory_cannot_be_freed_under_the_tier(root, make_tier):
    """The tier keeps a buffer export of its arena: resizing a bytearray or closing an mmap that
    the engine reads and writes by address raises instead of leaving a dangling address."""
    import mmap

    tier = make_tier(root, direct=False)
    ba = bytearray(4 * BS)
    tier.set_arena(ba)
    with pytest.raises(BufferError):
        ba.extend(b"\0" * BS)
    m = mmap.mmap(-1, 4 * BS)
    tier.set_arena(m)
    with pytest.raises(BufferError):
        m.close()


@pytest.mark.parametrize("field,value,kind", [
    ("slot", 1.7, TypeError), ("slot", "2", TypeError), ("slot", True, TypeError),
    ("job", None, TypeError), ("job", "x", TypeError), ("job", 2.0, TypeError)])
def test_slot_and_job_ids_must_be_integers(stored, field, value, kind):
    tier, keys, src, a = stored
    before = tier.stats()
    job = TransferJob(value, keys[:1], [0]) if field == "job" else TransferJob(9, keys[:1], [value])
    with pytest.raises(kind, match="must be an integer"):
        tier.submit_load(job)
    assert tier.stats() == before and not tier.has_pending_work()
    ok(load(tier, 10, keys[:1], [np.int64(3)]), BS)  # numpy integers are integers


def test_calls_after_shutdown(root, make_tier, arena):
    tier = make_tier(root, shared=True)
    tier.set_arena(arena(2, BS))
    assert tier.lookup(b"unknown") is RETRY
    tier.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        tier.lookup(b"unknown")
    with pytest.raises(RuntimeError, match="shut down"):
        tier.set_arena(arena(2, BS))
    with pytest.raises(RuntimeError, match="shut down"):
        tier.submit_load(TransferJob(1, [b"unknown"], [0]))
    with pytest.raises(RuntimeError, match="shut down"):
        tier.touch([b"unknown"])
    tier.on_step_end()  # a no-op now
    assert tier.has_pending_work() is False
    assert tier.get_finished_jobs() == []


def test_a_fifo_at_a_block_name_fails_the_load_without_hanging(root, make_tier, arena):
    """posix engine: the open does not wait for a writer; the load fails, the key is MISS."""
    tier = make_tier(root, engine="posix")
    a = fill(arena(2, BS), 3)
    tier.set_arena(a)
    ok(store(tier, 1, [b"f"], [0]), BS)
    p = path_of(tier, b"f")
    os.unlink(p)
    os.mkfifo(p)
    res = load(tier, 2, [b"f"], [1])
    assert res.success is False and b"f" in res.failed_keys
    assert tier.lookup(b"f") is MISS


def test_shutdown_and_a_new_arena_let_go_of_the_old_memory(root, make_tier):
    import mmap

    tier = make_tier(root, direct=False)
    first, second = mmap.mmap(-1, 4 * BS), mmap.mmap(-1, 4 * BS)
    tier.set_arena(first)
    tier.set_arena(second)
    first.close()  # no longer the arena: its owner may free it
    with pytest.raises(BufferError):
        second.close()
    tier.shutdown()
    second.close()


def test_jobs_and_lookups_by_digest(root, make_tier, arena):
    """submit_store/submit_load/lookup_digest/touch given the keys' digests act as by key; a
    digest list that does not match the keys is refused before anything is submitted."""
    tier = make_tier(root, capacity_bytes=3 * (BS + HEADER_BYTES))
    a = arena(3, BS)
    a[:] = np.random.default_rng(9).integers(0, 256, a.shape, dtype=np.uint8)
    src = a.copy()
    tier.set_arena(a)
    keys = [b"d0", b"d1", b"d2"]
    ds = [key_digest(k) for k in keys]
    tier.submit_store(TransferJob(1, keys, [0, 1, 2]), ds)
    tier.drain()
    (r,) = tier.get_finished_jobs()
    assert r.success and sorted(block_files(tier)) == sorted(tier.layout.block_path(d) for d in ds)
    assert [tier.lookup_digest(d) for d in ds] == [LookupResult.HIT] * 3
    assert tier.lookup_digest(key_digest(b"absent")) is LookupResult.MISS
    assert tier.stats()["lookups"] == 4 and tier.stats()["hits"] == 3
    for bad in (ds[:2], [b"short"] * 3, [k.decode() for k in keys]):
        with pytest.raises(ValueError, match="job 2: digests must be one 16-byte key_digest per key"):
            tier.submit_load(TransferJob(2, keys, [0, 1, 2]), bad)
    assert not tier.has_pending_work() and tier.stats()["loads_submitted"] == 0
    a[:] = 0
    tier.submit_load(TransferJob(2, keys[::-1], [0, 1, 2]), ds[::-1])
    tier.drain()
    (r,) = tier.get_finished_jobs()
    assert r.success and np.array_equal(a[::-1], src)
    # the load used d2, d1, d0 in that order; touching d2 leaves d1 the least recently used
    tier.touch((), digests=[ds[2]])
    a[0] = 5
    tier.submit_store(TransferJob(3, [b"d3"], [0]))
    tier.drain()
    assert tier.get_finished_jobs()[0].success
    assert [tier.lookup(k) for k in keys] == [LookupResult.HIT, LookupResult.MISS, LookupResult.HIT]


# ------------------------------------------------------------------------- found by breaking it


def test_two_loads_into_one_slot_in_flight_are_refused(stored):
    """A load into a slot another load in flight is filling is refused at submit (nothing is
    submitted, no block is touched): the two reads would race, each block would fail
    verification over the other's bytes, and intact files would be quarantined. The slot is
    free again once the first load is reported."""
    tier, keys, src, a = stored
    tier.submit_load(TransferJob(10, [keys[0]], [5]))
    before = tier.stats()
    with pytest.raises(ValueError) as ei:
        tier.submit_load(TransferJob(11, [keys[2], keys[1]], [6, 5]))
    assert str(ei.value) == "job 11: slot 5 is being loaded by another job (two reads into one slot would race)"
    tier_keys = ("loads_submitted", "load_failures", "loads_refused", "verify_failures", "used_bytes",
                 "blocks_present", "hit_pending")
    assert {k: tier.stats()[k] for k in tier_keys} == {k: before[k] for k in tier_keys}
    assert [tier.lookup(k) for k in keys] == [LookupResult.HIT_PENDING, HIT, HIT, HIT]
    (first,) = finish(tier)
    assert first.job_id == 10
    ok(first, BS)
    assert np.array_equal(a[5], src[0])
    ok(load(tier, 11, [keys[2], keys[1]], [6, 5]), 2 * BS)  # slot 6 was not left claimed
    assert np.array_equal(a[6], src[2]) and np.array_equal(a[5], src[1])
    assert tier.stats()["verify_failures"] == 0 and tier.stats()["quarantined"] == 0


def test_job_id_of_a_job_settled_without_io_is_in_use_until_reported(stored):
    """A job every key of which is refused (or present) settles at submit; its id stays in use
    until get_finished_jobs() reported it, so no id is reported twice."""
    tier, keys, src, a = stored
    tier.submit_load(TransferJob(6, [b"never stored"], [0]))
    with pytest.raises(ValueError, match=r"job_id 6 is already in flight \(or its result not yet reported"):
        tier.submit_load(TransferJob(6, [b"also never"], [1]))
    with pytest.raises(ValueError, match="job_id 6 is already in flight"):
        tier.submit_store(TransferJob(6, keys[:1], [0]))  # present: would settle at once too
    (res,) = tier.get_finished_jobs()
    assert (res.job_id, res.success, res.failed_keys) == (6, False, {b"never stored": "not in the tier"})
    ok(store(tier, 6, keys[:1], [0]), 0)  # free again: skipped as present
    assert tier.get_finished_jobs() == []


def test_refused_loads_are_counted_and_logged(stored, caplog):
    tier, keys, src, a = stored
    caplog.set_level("WARNING", logger="pykvtier")
    res = load(tier, 3, [keys[0], b"nope"], [0, 1])
    assert res.failed_keys == {b"nope": "not in the tier"} and res.successful_keys == [keys[0]]
    s = tier.stats()
    assert (s["loads_refused"], s["load_failures"], s["blocks_loaded"]) == (1, 0, 1)
    tier.shutdown()  # flushes the aggregated warnings
    assert any("1 loads refused without I/O (not in the tier; e.g. " + path_of(tier, b"nope") in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_shutdown_settles_finished_jobs_and_reports_them(stored, root, make_tier):
    """Jobs not collected before shutdown() are settled by it while the engine and the root's
    lock are held (a corrupt block is quarantined then, not after another tier may have opened
    the root); get_finished_jobs() reports each of them once afterwards."""
    tier, keys, src, a = stored
    flip_byte(path_of(tier, keys[1]), FB - 1)  # payload: fails verification
    tier.submit_load(TransferJob(1, [keys[0]], [4]))
    tier.submit_load(TransferJob(2, [keys[1]], [5]))
    tier.submit_store(TransferJob(3, [b"late"], [6]))
    tier.shutdown()
    assert os.listdir(tier.layout.quarantine_dir) != [] and not os.path.exists(path_of(tier, keys[1]))
    got = {r.job_id: r for r in tier.get_finished_jobs()}
    assert sorted(got) == [1, 2, 3]
    ok(got[1], BS)
    ok(got[3], BS)
    assert got[2].success is False and list(got[2].failed_keys) == [keys[1]]
    assert np.array_equal(a[4], src[0])
    assert tier.get_finished_jobs() == [] and tier.has_pending_work() is False
    again = make_tier(root)
    assert [again.lookup(k) for k in (keys[0], keys[1], b"late")] == [HIT, MISS, HIT]


def test_engine_refusing_a_job_at_submit_leaves_the_tier_as_it_was(stored):
    """An engine that raises in submit_blocks (none of the job ran): the caller gets the
    exception; the blocks stay (HIT, files kept), no failure is counted, the slots and the job
    id are free for the next job."""
    tier, keys, src, a = stored
    real = tier._engine

    class Refusing:
        def __getattr__(self, name):
            return getattr(real, name)

        def submit_blocks(self, *args, **kw):
            raise MemoryError("injected: the engine could not take the job")

    before = tier.stats()
    files = block_files(tier)
    tier._engine = Refusing()
    try:
        with pytest.raises(MemoryError):
            tier.submit_load(TransferJob(7, keys[:2], [4, 5]))
        with pytest.raises(MemoryError):
            tier.submit_store(TransferJob(8, [b"new"], [0]))
    finally:
        tier._engine = real
    s = tier.stats()
    for k in ("load_failures", "store_failures", "blocks_loaded", "evictions"):
        assert s[k] == before[k], k
    assert (s["blocks_present"], s["used_bytes"]) == (before["blocks_present"], before["used_bytes"]) == (4, 4 * FB)
    assert [tier.lookup(k) for k in keys] == [HIT] * 4 and tier.lookup(b"new") is MISS
    assert block_files(tier) == files
    ok(load(tier, 7, keys[:2], [4, 5]), 2 * BS)
    assert np.array_equal(a[4:6], src[:2])
    ok(store(tier, 8, [b"new"], [0]), BS)


def test_unknown_option_names_the_accepted_ones(root):
    with pytest.raises(TypeError) as ei:
        DiskTier(root, BS, capcity_bytes=1 << 30, engin="uring")
    msg = str(ei.value)
    assert msg.startswith("DiskTier: unknown options 'capcity_bytes', 'engin'; accepted: capacity_bytes, ")
    assert ", engine, " in msg and ", verify" in msg
    assert not os.path.exists(os.path.join(root, "blocks"))  # nothing created


def test_a_store_of_a_block_being_evicted_is_refused_and_counted(root, make_tier, arena):
    """The victim of the previous store is REMOVING until its unlink (or the store reusing its
    file) is collected: storing it again meanwhile fails, named and counted."""
    tier = make_tier(root, capacity_bytes=FB)
    tier.set_arena(fill(arena(2, BS), 31))
    ok(store(tier, 1, [b"v0"], [0]), BS)
    tier.submit_store(TransferJob(2, [b"v1"], [1]))  # evicts v0
    tier.submit_store(TransferJob(3, [b"v0"], [0]))  # before the eviction is collected
    res = {r.job_id: r for r in finish(tier)}
    assert res[2].success is True
    assert res[3].failed_keys == {b"v0": "block is being evicted"}
    assert tier.stats()["stores_refused_evicting"] == 1
