"""PyKVTier (the vLLM adapter) against the breaking round's findings: chunk rows raced across
shards, reused job ids, results after shutdown, bad root_dir values (marked ``vllm``; skipped
without vLLM). Tiers are made by vLLM's SecondaryTierFactory as in test_vllm.py; time passes
only through ``drain_jobs()``; every loaded byte is compared with what was stored."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from test_vllm import (  # noqa: F401 - make_tier is a fixture
    HIT,
    MISS,
    TIER,
    ReqContext,
    SecondaryTierFactory,
    OffloadingSpecFactory,
    aligned_rows,
    fill,
    job,
    key,
    make_tier,
    offloading_config,
    payload,
    run,
    tier_config,
)

from pykvtier.layout import key_digest
from pykvtier.tier import DiskTier
from pykvtier.tier import JobResult as TierJobResult

pytestmark = pytest.mark.vllm


def shard_keys(nroots: int, per_shard: int, tag: bytes = b"k") -> list[list[bytes]]:
    """per_shard keys of each shard of a tier with nroots roots (shard: the digest's first 8
    bytes, little-endian, modulo the roots)."""
    by: list[list[bytes]] = [[] for _ in range(nroots)]
    i = 0
    while min(map(len, by)) < per_shard:
        k = key(i, tag)
        i += 1
        s = int.from_bytes(key_digest(k)[:8], "little") % nroots
        if len(by[s]) < per_shard:
            by[s].append(k)
    return by


def two_roots(make_tier, root, num_chunks=16, **options):
    roots = [os.path.join(root, "a"), os.path.join(root, "b")]
    return make_tier(tier_config(roots, **options), num_chunks=num_chunks)


def errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def results(tier) -> list[tuple[int, bool, object]]:
    tier.drain_jobs()
    return [(r.job_id, r.success, r.successful_keys) for r in tier.get_finished_jobs()]


# ------------------------------------------------------------------ chunk rows across shards


def test_two_roots_a_load_into_a_chunk_another_load_fills_is_refused(root, make_tier, caplog):
    """Two load jobs, keys on different shards, into one row: the second is refused at submit
    (logged, failed, nothing read); the first loads byte-exact, no block is quarantined."""
    tier, arr = two_roots(make_tier, root)
    (a,), (b,) = shard_keys(2, 1)
    fill(arr, [a, b], [0, 1])
    assert run(tier, job(1, [a, b], [0, 1], False))[1].success
    arr[:] = 0xAB
    caplog.clear()
    tier.submit_load(job(2, [a], [5], True))
    tier.submit_load(job(3, [b], [5], True))  # same row, another job, the other shard
    assert tier._claims.claimed() == 1
    assert results(tier) == [(3, False, None), (2, True, None)]
    assert arr[5].tobytes() == payload(a)
    assert (arr[np.arange(16) != 5] == 0xAB).all()
    assert errors(caplog) == [
        "pykvtier: load job 3 (1 keys) not submitted: job 3: slot 5 is being loaded by another "
        "job (two reads into one slot would race)"]
    st = tier.stats()
    assert (st["loads_submitted"], st["verify_failures"], st["quarantined"]) == (1, 0, 0)
    assert tier._claims.claimed() == 0  # released when job 2 was reported
    assert [tier.lookup(k, ReqContext("r")) for k in (a, b)] == [HIT, HIT]
    assert run(tier, job(4, [b], [5], True))[4].success  # the row is free again
    assert arr[5].tobytes() == payload(b)


def test_two_roots_a_load_into_a_chunk_a_store_in_flight_reads_is_refused(root, make_tier, caplog):
    """A store job reads row 0 (key on shard 0); a load of a shard-1 key into row 0 is refused:
    the store writes row 0's own bytes, and loads back byte-exact."""
    tier, arr = two_roots(make_tier, root)
    (a, a2), (b, b2) = shard_keys(2, 2)
    fill(arr, [b], [1])
    assert run(tier, job(1, [b], [1], False))[1].success
    fill(arr, [a, a2, b2], [0, 2, 3])
    caplog.clear()
    tier.submit_store(job(2, [a, a2, b2], [0, 2, 3], False))  # both shards, row 0 on shard 0
    tier.submit_load(job(3, [b], [0], True))  # into row 0, from shard 1
    assert results(tier) == [(3, False, None), (2, True, None)]
    assert errors(caplog) == [
        "pykvtier: load job 3 (1 keys) not submitted: job 3: slot 0 is being read by a store in "
        "flight (the load would overwrite what it stores)"]
    assert tier._claims.claimed() == 0
    arr[:] = 0
    assert run(tier, job(4, [a, a2, b2, b], [8, 9, 10, 11], True))[4].success
    for k, c in zip([a, a2, b2, b], [8, 9, 10, 11]):
        assert arr[c].tobytes() == payload(k)
    st = tier.stats()
    assert (st["verify_failures"], st["quarantined"]) == (0, 0)


def test_two_roots_a_store_from_a_chunk_a_load_fills_is_refused(root, make_tier, caplog):
    """A load fills row 5 (shard 0); a store of a shard-1 key from row 5 is refused: no block
    of that key is written (it would hold whatever the load leaves in the row)."""
    tier, arr = two_roots(make_tier, root)
    (a,), (c,) = shard_keys(2, 1)
    fill(arr, [a], [0])
    assert run(tier, job(1, [a], [0], False))[1].success
    arr[:] = 0
    caplog.clear()
    tier.submit_load(job(2, [a], [5], True))
    tier.submit_store(job(3, [c], [5], False))
    assert results(tier) == [(3, False, None), (2, True, None)]
    assert errors(caplog) == [
        "pykvtier: store job 3 (1 keys) not submitted: job 3: slot 5 is being loaded by another "
        "job (a store from it would write what that load leaves there)"]
    assert arr[5].tobytes() == payload(a)
    assert tier.lookup(c, ReqContext("r")) is MISS
    assert tier.stats()["stores_submitted"] == 1  # job 1 only
    assert tier._claims.claimed() == 0


def test_two_roots_stores_share_a_chunk(root, make_tier):
    """Stores only read their rows: two store jobs (different shards) from one row both go
    through, and each block holds the row's bytes."""
    tier, arr = two_roots(make_tier, root)
    (a,), (b,) = shard_keys(2, 1)
    arr[3] = np.frombuffer(payload(a), np.uint8)
    tier.submit_store(job(1, [a], [3], False))
    j2 = job(2, [b], [3], False)
    j2.chunk_ids = [3]  # (a list too: the rows are claimed as from an array)
    tier.submit_store(j2)
    assert tier._claims.claimed() == 1
    assert sorted(results(tier)) == [(1, True, None), (2, True, None)]
    assert tier._claims.claimed() == 0
    arr[:] = 0
    assert run(tier, job(3, [a, b], [6, 7], True))[3].success
    assert arr[6].tobytes() == arr[7].tobytes() == payload(a)


def test_two_roots_claims_released_when_a_submit_fails(root, make_tier, monkeypatch, caplog):
    """A job one shard refuses at submit keeps its rows until it is reported (the other part
    runs); a job every shard refuses releases them at once. Both are reported failed once."""
    tier, arr = two_roots(make_tier, root)
    (a, a2), (b, b2) = shard_keys(2, 2)
    fill(arr, [a, b, a2, b2], [0, 1, 2, 3])
    refuse = {tier.tiers[1]}
    real = DiskTier.submit_store

    def submit_store(self, j, digests=None):
        if self in refuse:
            raise OSError("injected")
        return real(self, j, digests)

    monkeypatch.setattr(DiskTier, "submit_store", submit_store)
    tier.submit_store(job(1, [a, b], [0, 1], False))  # shard 1's part refused
    assert tier._claims.claimed() == 2  # held for shard 0's part in flight
    refuse.add(tier.tiers[0])
    tier.submit_store(job(2, [a2, b2], [2, 3], False))  # both parts refused
    assert tier._claims.claimed() == 2  # job 2's rows released at once
    assert results(tier) == [(2, False, None), (1, False, None)]
    assert tier._claims.claimed() == 0
    assert len(errors(caplog)) == 3
    assert [tier.lookup(k, ReqContext("r")) for k in (a, b, a2, b2)] == [HIT, MISS, MISS, MISS]


def test_two_roots_a_chunk_outside_the_view_is_refused_whole(root, make_tier, caplog):
    tier, arr = two_roots(make_tier, root, num_chunks=4)
    (a,), (b,) = shard_keys(2, 1)
    fill(arr, [a], [0])
    tier.submit_store(job(1, [a, b], [0, 4], False))
    assert results(tier) == [(1, False, None)]
    assert errors(caplog) == ["pykvtier: store job 1 (2 keys) not submitted: slot 4 is outside "
                              "[0, 4)"]
    assert tier.stats()["stores_submitted"] == 0 and tier._claims.claimed() == 0


# ------------------------------------------------------------------ job ids


@pytest.mark.parametrize("nroots", [1, 2])
def test_a_reused_job_id_is_refused_and_reported_after_the_first(root, make_tier, caplog, nroots):
    """Job 7 (shard 0 only) in flight; id 7 reused for a job over both shards: refused before
    any root sees it. get_finished_jobs() gives the first job's own result, then the refusal."""
    roots = [os.path.join(root, f"r{i}") for i in range(nroots)]
    tier, arr = make_tier(tier_config(roots if nroots > 1 else roots[0]))
    by = shard_keys(nroots, 3)
    k0, k0b, k1 = by[0][0], by[0][1], by[-1][2]
    fill(arr, [k0, k0b, k1], [0, 1, 2])
    tier.submit_store(job(7, [k0], [0], False))
    caplog.clear()
    tier.submit_store(job(7, [k0b, k1], [1, 2], False))  # before 7 was reported
    assert errors(caplog) == [
        "pykvtier: store job 7 (2 keys) not submitted: job id 7 is in use by a job not "
        "reported yet; reported failed after it"]
    assert tier.stats()["stores_submitted"] == 1
    assert results(tier) == [(7, True, None), (7, False, None)]
    assert list(tier.get_finished_jobs()) == [] and not tier.has_pending_work()
    assert [tier.lookup(k, ReqContext("r")) for k in (k0, k0b, k1)] == [HIT, MISS, MISS]
    # reported: the id is free again
    assert run(tier, job(7, [k0b, k1], [1, 2], False))[7].success
    arr[:] = 0
    # a load job too, its first finished through wait(): the refusal still right after it
    tier.submit_load(job(8, [k0, k0b], [5, 6], True))
    tier.submit_load(job(8, [k1], [7], True))
    while not tier._ready:
        tier.wait()
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(8, True), (8, False)]
    assert (arr[5].tobytes(), arr[6].tobytes()) == (payload(k0), payload(k0b))
    assert not arr[7].any()
    if nroots > 1:
        assert tier._claims.claimed() == 0


def test_a_reused_id_of_a_job_settled_at_submit_is_reported_after_it(root, make_tier, caplog):
    """Id 9's first job settled at submit (no keys; a chunk count that does not match): its
    result waits for get_finished_jobs(); a job reusing 9 is refused and reported after it."""
    tier, arr = two_roots(make_tier, root)
    (a,), (b,) = shard_keys(2, 1)
    fill(arr, [a, b], [0, 1])
    tier.submit_store(job(9, [], [], False))
    tier.submit_store(job(9, [a, b], [0, 1], False))
    bad = job(10, [a, b], [0, 1], False)
    bad.chunk_ids = np.array([0], np.int32)
    tier.submit_store(bad)
    tier.submit_store(job(10, [a], [0], False))
    assert results(tier) == [(9, True, None), (9, False, None), (10, False, None),
                             (10, False, None)]
    assert tier.stats()["stores_submitted"] == 0
    assert len(errors(caplog)) == 3


def test_a_result_no_job_is_waiting_for_is_logged_not_raised(root, make_tier, caplog):
    """_merge never raises: a shard's result for no job in flight (or a part reported twice)
    is logged and dropped, and the results around it are reported."""
    tier, arr = two_roots(make_tier, root)
    (a,), _ = shard_keys(2, 1)
    fill(arr, [a], [0])
    tier.submit_store(job(1, [a], [0], False))
    out: list = []
    tier._merge(1, TierJobResult(1, True), out)  # job 1 has no part on shard 1
    tier._merge(0, TierJobResult(99, True), out)  # no job 99
    assert out == []
    assert [m.split(" reported ")[1] for m in errors(caplog)] == [
        "job 1, which it has no part of in flight; ignored",
        "job 99, which it has no part of in flight; ignored"]
    assert results(tier) == [(1, True, None)]


# ------------------------------------------------------------------ shutdown


@pytest.mark.parametrize("nroots", [1, 2])
def test_results_after_shutdown_are_each_reported_once(root, make_tier, nroots):
    """shutdown() with stores and loads in flight finishes them; get_finished_jobs() then
    reports each once, with its real outcome (the loaded rows byte-exact)."""
    roots = [os.path.join(root, f"r{i}") for i in range(nroots)]
    tier, arr = make_tier(tier_config(roots if nroots > 1 else roots[0]))
    keys = [key(i) for i in range(12)]
    fill(arr, keys, range(12))
    assert run(tier, job(1, keys[:6], range(6), False))[1].success
    tier.submit_store(job(2, keys[6:], range(6, 12), False))
    tier.submit_load(job(3, keys[:4], range(12, 16), True))
    tier.submit_store(job(3, keys[6:], range(6, 12), False))  # a reused id: failed after 3
    tier.submit_store(job(4, [], [], False))  # settled at submit
    tier.shutdown()
    tier.submit_load(job(5, keys[:1], [0], True))  # after shutdown: failed, reported once
    got = [(r.job_id, r.success) for r in tier.get_finished_jobs()]
    assert sorted(got) == [(2, True), (3, False), (3, True), (4, True), (5, False)]
    assert got.index((3, True)) + 1 == got.index((3, False))
    assert list(tier.get_finished_jobs()) == [] and not tier.has_pending_work()
    for k, c in zip(keys[:4], range(12, 16)):
        assert arr[c].tobytes() == payload(k)
    if nroots > 1:
        assert tier._claims.claimed() == 0


def test_wait_after_shutdown_returns_the_settled_results(root, make_tier):
    tier, arr = two_roots(make_tier, root)
    keys = [key(i) for i in range(8)]
    fill(arr, keys, range(8))
    tier.submit_store(job(1, keys, range(8), False))
    tier.shutdown()
    seen = []
    while tier.has_pending_work():
        tier.wait()
        seen += [(r.job_id, r.success) for r in tier.get_finished_jobs()]
    assert seen == [(1, True)]


# ------------------------------------------------------------------ root_dir


@pytest.mark.parametrize("root_dir, exc, match", [
    ("", ValueError, r"^PyKVTier: root_dir '' names an empty path \(it would mean the current "
                     r"directory\)$"),
    (["{root}/a", ""], ValueError, r"^PyKVTier: root_dir \['.*/a', ''\] names an empty path"),
    ([5], TypeError, r"^PyKVTier: root_dir entries must be paths \(str or os.PathLike giving a "
                     r"str\), got int 5$"),
    (["{root}/a", None], TypeError, r"^PyKVTier: root_dir entries must be paths .*got NoneType "
                                    r"None$"),
    ([b"/tmp/x"], TypeError, r"^PyKVTier: root_dir entries must be paths .*got bytes b'/tmp/x'$"),
    (["{root}/a", "{root}/b\0"], ValueError, r"^PyKVTier: root_dir entry '.*/b\\x00' contains a "
                                             r"NUL byte"),
])
def test_bad_root_dir_entries_are_refused_naming_root_dir(root, monkeypatch, root_dir, exc, match):
    monkeypatch.chdir(root)  # nothing may land in the current directory
    if isinstance(root_dir, list):
        root_dir = [r.format(root=root) if isinstance(r, str) else r for r in root_dir]
    cfg = {**TIER, "root_dir": root_dir}
    spec = OffloadingSpecFactory.create_spec(offloading_config([cfg]))
    with pytest.raises(exc, match=match):
        SecondaryTierFactory.create_secondary_tier(dict(cfg), memoryview(aligned_rows(4)), spec)
    assert os.listdir(root) == []


def test_no_stored_event_for_a_skipped_key_evicted_before_its_job_is_reported(root, make_tier):
    """Job 2 stores a, present (skipped, settled at submit); before job 2 is reported, job 3's
    new keys evict a and b (capacity: two blocks). The events say stored [a, b], removed
    [a, b], stored [c, d]: no stored event for a after it is gone (it was: a consumer then
    believed a in the tier)."""
    from test_vllm import BLOCK

    from pykvtier.layout import HEADER_BYTES

    v, arr = make_tier(tier_config(root, capacity_bytes=2 * (BLOCK + HEADER_BYTES),
                                   enable_kv_events=True), num_chunks=8, events=True)
    a, b, c, d = (key(i, b"ev") for i in range(4))
    name = {a: "a", b: "b", c: "c", d: "d"}
    for n, k in enumerate((a, b, c, d)):
        arr[n] = np.frombuffer(payload(k), np.uint8)
    events = []

    def take():
        events.extend(("removed" if e.removed else "stored", sorted(name[k] for k in e.keys))
                      for e in v.take_events())

    assert results_of(v, job(1, [a, b], [0, 1], False)) == {1: True}
    take()
    v.submit_store(job(2, [a], [0], False))
    v.submit_store(job(3, [c, d], [2, 3], False))
    take()  # (a step's take_events)
    assert {r.job_id: r.success for r in drained(v)} == {2: True, 3: True}
    take()
    assert events == [("stored", ["a", "b"]), ("removed", ["a", "b"]), ("stored", ["c", "d"])]
    assert [v.lookup(k, ReqContext("r")) for k in (a, b, c, d)] == [MISS, MISS, HIT, HIT]


def results_of(v, *jobs) -> dict:
    for j in jobs:
        (v.submit_load if j.is_promotion else v.submit_store)(j)
    return {r.job_id: r.success for r in drained(v)}


def drained(v) -> list:
    v.drain_jobs()
    return list(v.get_finished_jobs())
