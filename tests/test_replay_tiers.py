"""`pykvtier replay` through vLLM's own fs tier (pykvtier.replay_tiers.VllmFsTier, ``--tier
vllm-fs``): a slice of the bundled trace with every loaded byte checked, the hits those of
pykvtier's DiskTier on the same slice and of a reference computed here from the trace alone,
unknown keys MISS, what the tier lacks (no capacity, no eviction), and the message where vLLM is
missing. The tests that need vLLM are marked ``vllm`` and skipped (saying why) without it.
Time passes only through the tier's own waits; no sleeps, no timed asserts."""

from __future__ import annotations

import dataclasses
import os
import sys

import numpy as np
import pytest

from pykvtier import models
from pykvtier import replay_tiers as rt
from pykvtier.replay import (
    BlockPattern,
    ReplayConfig,
    ReplayConfigError,
    ReplayDriver,
    block_key,
    run_replay,
)
from pykvtier.trace import TRACE_BLOCK_TOKENS, load_trace

pytest.importorskip("pykvtier._native", reason="the native engine is not built")

_NO_VLLM = rt.vllm_unavailable_reason()
needs_vllm = pytest.mark.skipif(_NO_VLLM is not None, reason=f"vLLM's fs tier is not importable: {_NO_VLLM}")

TPB = 128  # tiny model: 256 B/token x 128 = 32 KiB blocks, 4 per trace block
BS = models.block_size_bytes("tiny", TPB)
SPB = TRACE_BLOCK_TOKENS // TPB
N_REQUESTS = 20


def _config(root, **kw) -> ReplayConfig:
    """The tiny model, every engine block moved, back to back, no capacity, no progress bar
    (only the fields this ReplayConfig has: kv_sample_bytes and speed are newer)."""
    base = dict(model="tiny", tokens_per_block=TPB, max_requests=None, capacity_bytes=None,
                root=str(root), engine="auto", progress=False, kv_sample_bytes=None, speed=None)
    base.update(kw)
    have = {f.name for f in dataclasses.fields(ReplayConfig)}
    return ReplayConfig(**{k: v for k, v in base.items() if k in have})


def _reference(requests) -> tuple[int, int, set[bytes]]:
    """(blocks hit, blocks looked up, distinct keys) of an unlimited tier holding every block
    stored before: each request's longest prefix of keys stored by earlier requests, its
    lookups up to the first miss; every key it missed is then stored."""
    stored: set[bytes] = set()
    hits = looked = 0
    for r in requests:
        keys = [block_key(h, s, BS) for h in r.hash_ids for s in range(SPB)]
        n = 0
        while n < len(keys) and keys[n] in stored:
            n += 1
        hits += n
        looked += n + (n < len(keys))
        stored.update(keys)
    return hits, looked, stored


class _Counting:
    """A driver_factory making ReplayDrivers whose checks of loaded blocks count the bytes
    they compared (and the checks that failed)."""

    def __init__(self) -> None:
        self.compared = 0
        self.mismatches = 0

    def __call__(self, *args, **kw) -> ReplayDriver:
        driver = ReplayDriver(*args, **kw)
        matches = driver.pattern.matches

        def counted(data, key):
            self.compared += data.nbytes
            ok = matches(data, key)
            self.mismatches += not ok
            return ok

        driver.pattern.matches = counted
        return driver


def _block_files(root: str) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".bin")]


@pytest.fixture(scope="module")
def requests():
    return load_trace(None, max_requests=N_REQUESTS)


@pytest.fixture(scope="module")
def pykvtier_run(tmp_path_factory, requests):
    """The slice through pykvtier's DiskTier (the summary, the bytes its checks compared)."""
    counting = _Counting()
    s = run_replay(_config(tmp_path_factory.mktemp("pk")), requests, driver_factory=counting)
    return s, counting


# ------------------------------------------------------------------------- the slice


@pytest.mark.vllm
@needs_vllm
def test_the_slice_through_vllm_fs_verifies_every_byte_and_hits_what_pykvtier_hits(
        tmp_path, requests, pykvtier_run):
    ref_hits, ref_looked, distinct = _reference(requests)
    assert ref_hits > 0 and len(distinct) > ref_hits  # the slice has hits and misses
    n_blocks = SPB * sum(len(r.hash_ids) for r in requests)
    counting = _Counting()
    root = str(tmp_path / "vllm-fs")
    s = run_replay(_config(root), requests, tier_factory=rt.make_vllm_fs_tier_factory(),
                   driver_factory=counting)
    # every loaded byte verified
    assert s.ok, (s.error_samples, s.failure_reasons)
    assert s.verification_failures == 0 and s.errors == 0 and counting.mismatches == 0
    assert s.load_failed_keys == 0 and s.store_failed_keys == 0 and s.store_rejected_keys == 0
    assert s.blocks_loaded == ref_hits
    assert counting.compared == s.bytes_loaded == ref_hits * BS
    # the hits: exactly the blocks stored before, as pykvtier's
    assert s.blocks_requested == n_blocks
    assert s.blocks_hit == ref_hits and s.blocks_looked_up == ref_looked
    pk, pk_counting = pykvtier_run
    assert pk.ok and pk_counting.compared == pk.bytes_loaded
    assert (pk.blocks_hit, pk.blocks_looked_up, pk.blocks_loaded) == (ref_hits, ref_looked, ref_hits)
    assert s.block_hit_ratio == pk.block_hit_ratio == ref_hits / n_blocks
    assert s.byte_hit_ratio == pk.byte_hit_ratio
    # every missed block stored once, and still there: the fs tier never evicts
    assert s.bytes_stored == pk.bytes_stored == len(distinct) * BS
    assert s.engine.startswith("vllm-fs (")
    st = s.tier_stats
    assert (st["blocks_loaded"], st["bytes_loaded"]) == (s.blocks_loaded, s.bytes_loaded)
    assert (st["blocks_stored"], st["bytes_stored"]) == (len(distinct), s.bytes_stored)
    assert st["load_failures"] == st["store_failures"] == 0
    assert st["used_bytes"] == len(distinct) * BS and st["blocks_present"] == len(distinct)
    assert st["loads_submitted"] == s.load_jobs and st["stores_submitted"] == s.store_jobs
    assert "evictions" not in st and "verify_failures" not in st and s.evictions == 0
    files = _block_files(root)
    assert len(files) == len(distinct) and {os.path.getsize(f) for f in files} == {BS}


def _reference_no_eviction(requests, cap_blocks: int) -> tuple[int, int, int]:
    """(blocks hit, blocks declined, blocks kept) of a tier holding ``cap_blocks`` blocks that
    never evicts: the first new blocks stored fill it, the later ones are declined."""
    stored: set[bytes] = set()
    hits = declined = 0
    for r in requests:
        keys = [block_key(h, s, BS) for h in r.hash_ids for s in range(SPB)]
        n = 0
        while n < len(keys) and keys[n] in stored:
            n += 1
        hits += n
        for k in keys[n:]:
            if k in stored:
                continue
            if len(stored) < cap_blocks:
                stored.add(k)
            else:
                declined += 1
    return hits, declined, len(stored)


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("enforce", [True, False], ids=["enforced", "reported"])
def test_a_capacity_fills_and_nothing_is_evicted(tmp_path, requests, enforce):
    """vLLM's fs tier has no capacity nor eviction. Enforced (the default): the first blocks
    stored fill the capacity and stay, the later ones are declined (not errors), as on a disk
    of that size. Reported: every block is kept, the excess reported."""
    reqs = requests[:8]
    cap_blocks = 100
    ref_hits, _, distinct = _reference(reqs)
    assert len(distinct) > cap_blocks
    hits, declined, kept = _reference_no_eviction(reqs, cap_blocks) if enforce else (ref_hits, 0, len(distinct))
    assert declined > 0 or not enforce
    root = str(tmp_path / "vllm-fs")
    s = run_replay(_config(root, capacity_bytes=cap_blocks * BS), reqs,
                   tier_factory=rt.make_vllm_fs_tier_factory(enforce_capacity=enforce))
    assert s.ok, s.error_samples
    assert s.blocks_hit == s.blocks_loaded == hits
    assert s.store_rejected_keys == declined and s.store_failed_keys == 0
    assert s.bytes_stored == kept * BS
    st = s.tier_stats
    assert st["capacity_rejections"] == declined and st["no_room_failures"] == 0
    assert st["capacity_bytes"] == cap_blocks * BS
    assert st["used_bytes"] == kept * BS == st["blocks_present"] * BS
    assert st["bytes_over_capacity"] == max(0, kept - cap_blocks) * BS
    assert len(_block_files(root)) == kept


@pytest.mark.vllm
@needs_vllm
def test_the_free_space_floor_fails_stores_without_writing(tmp_path, requests):
    """The fs tier would write until the file system is full: below min_free_bytes the adapter
    fails a store's new blocks ("no room", as DiskTier) without sending them to vLLM."""
    st = os.statvfs(tmp_path)
    floor = st.f_bavail * st.f_frsize + (1 << 40)  # more than is free: nothing fits
    root = str(tmp_path / "vllm-fs")
    s = run_replay(_config(root), requests[:2],
                   tier_factory=rt.make_vllm_fs_tier_factory(min_free_bytes=floor))
    n_blocks = SPB * sum(len(r.hash_ids) for r in requests[:2])
    assert not s.ok and s.store_failed_keys == s.errors == n_blocks and s.verification_failures == 0
    assert all(reason.startswith("store: no room: free space") for reason in s.failure_reasons)
    assert s.bytes_stored == 0 and s.tier_stats["no_room_failures"] == n_blocks
    assert _block_files(root) == []


# ------------------------------------------------------------------------- the tier alone


@pytest.fixture
def arena():
    """A page-aligned arena of 8 slots of BS bytes (zeros)."""
    raw = np.zeros(8 * BS + 4096, np.uint8)
    off = (-raw.ctypes.data) % 4096
    return raw[off: off + 8 * BS]


@pytest.fixture
def fs_tier(tmp_path, arena):
    if _NO_VLLM is not None:
        pytest.skip(f"vLLM's fs tier is not importable: {_NO_VLLM}")
    tier = rt.make_vllm_fs_tier_factory()(str(tmp_path / "fs"), BS, None, "auto")
    tier.set_arena(arena)
    yield tier
    tier.shutdown()


def _wait_for(tier, job_id: int):
    """The JobResult of ``job_id`` (the tier's wait(): blocks until a job finished)."""
    while True:
        for r in tier.wait(timeout_s=None):
            if r.job_id == job_id:
                return r


@pytest.mark.vllm
def test_unknown_keys_miss(fs_tier):
    from pykvtier.tier import LookupResult

    keys = [block_key(h, s, BS) for h in (7, 1 << 40, 123456789) for s in range(SPB)]
    assert [fs_tier.lookup(k) for k in keys] == [LookupResult.MISS] * len(keys)
    fs_tier.on_step_end()
    assert [fs_tier.lookup(k) for k in keys] == [LookupResult.MISS] * len(keys)  # still, cached
    st = fs_tier.stats()
    assert st["misses"] == 2 * len(keys) and st["hits"] == 0 and st["retries"] == 0
    assert st["probe_steps"] >= 1  # the fs tier's own existence probe answered
    assert fs_tier.used_bytes == 0 and fs_tier.get_finished_jobs() == []


@pytest.mark.vllm
def test_store_then_load_lands_in_the_arena_slots(fs_tier, arena):
    """A store from arena slots, then a load into other slots: the bytes land in the arena
    itself (the fs tier's primary view is the arena); RETRY while the store is in flight,
    HIT once its result was collected."""
    from pykvtier.tier import LookupResult, TransferJob

    pattern = BlockPattern(BS)
    words = arena.view(np.uint64).reshape(8, -1)
    keys = [block_key(42, s, BS) for s in range(3)]
    for slot, k in enumerate(keys):
        pattern.fill(words[slot], k)
    assert [fs_tier.lookup(k) for k in keys] == [LookupResult.MISS] * 3
    fs_tier.submit_store(TransferJob(1, keys, [0, 1, 2]))
    assert fs_tier.lookup(keys[0]) == LookupResult.RETRY  # the store's result is not collected
    r = _wait_for(fs_tier, 1)
    assert r.success and not r.is_load and r.transfer_bytes == 3 * BS and r.successful_keys is None
    assert [fs_tier.lookup(k) for k in keys] == [LookupResult.HIT] * 3  # a new request probes
    assert [os.path.getsize(fs_tier.file_of(k)) for k in keys] == [BS] * 3
    words[:] = 0
    fs_tier.submit_load(TransferJob(2, keys[::-1], [7, 5, 3]))
    assert fs_tier.lookup(keys[1]) == LookupResult.HIT_PENDING
    r = _wait_for(fs_tier, 2)
    assert r.success and r.is_load and r.transfer_bytes == 3 * BS
    for slot, k in zip([7, 5, 3], keys[::-1]):
        assert pattern.matches(words[slot], k)
    assert not words[[0, 1, 2, 4, 6]].any()
    st = fs_tier.stats()
    assert (st["blocks_stored"], st["blocks_loaded"], st["used_bytes"]) == (3, 3, 3 * BS)


@pytest.mark.vllm
def test_a_load_of_a_missing_file_fails_that_key_and_later_lookups_miss(fs_tier, arena):
    """The block file removed behind the tier's back: the load keeps the blocks before it
    (vLLM's partial result), fails it (ENOENT) and those after it, and a later lookup misses."""
    from pykvtier.tier import LookupResult, TransferJob

    words = arena.view(np.uint64).reshape(8, -1)
    pattern = BlockPattern(BS)
    keys = [block_key(9, s, BS) for s in range(3)]
    for slot, k in enumerate(keys):
        pattern.fill(words[slot], k)
    fs_tier.submit_store(TransferJob(1, keys, [0, 1, 2]))
    assert _wait_for(fs_tier, 1).success
    assert [fs_tier.lookup(k) for k in keys] == [LookupResult.HIT] * 3
    os.remove(fs_tier.file_of(keys[1]))
    fs_tier.submit_load(TransferJob(2, keys, [4, 5, 6]))
    r = _wait_for(fs_tier, 2)
    assert not r.success and r.is_load
    assert r.successful_keys == [keys[0]] and pattern.matches(words[4], keys[0])
    assert set(r.failed_keys) == {keys[1], keys[2]}
    assert r.failed_keys[keys[1]].startswith("ENOENT")
    assert fs_tier.lookup(keys[1]) == LookupResult.MISS  # a new request: the probe finds no file
    assert fs_tier.stats()["load_failures"] == 2


@pytest.mark.vllm
@needs_vllm
def test_factory_signature_and_bad_settings(tmp_path, arena):
    factory = rt.make_vllm_fs_tier_factory(n_read_threads=2, n_write_threads=2)
    tier = factory(str(tmp_path / "a"), BS, None, "auto", True)  # _default_tier_factory's arguments
    try:
        with pytest.raises(RuntimeError, match="set_arena"):
            tier.lookup(b"k")
        tier.set_arena(arena)
        assert tier.stats()["io_threads"] == 4 and tier.engine_name.startswith("vllm-fs")
        with pytest.raises(RuntimeError, match="arena already"):
            tier.set_arena(arena)
    finally:
        tier.shutdown()
    tier.shutdown()  # idempotent
    with pytest.raises(ValueError, match="engine 'uring'"):
        factory(str(tmp_path / "b"), BS, None, "uring")
    with pytest.raises(ValueError, match="unknown vllm-fs tier option"):
        rt.make_vllm_fs_tier_factory(capacity=1)
    with pytest.raises(ReplayConfigError, match="leave --engine at auto"):
        run_replay(_config(tmp_path / "c", engine="uring"), load_trace(None, max_requests=1),
                   tier_factory=factory)


def test_without_vllm_the_message_names_the_pip_install(monkeypatch, tmp_path):
    """Runs with or without vLLM: its fs tier's module made unimportable."""
    monkeypatch.setitem(sys.modules, rt._FS_MODULE, None)
    rt._import_vllm_cached.cache_clear()
    try:
        with pytest.raises(rt.TierUnavailableError) as info:
            rt.make_vllm_fs_tier_factory()
        assert isinstance(info.value, ImportError) and isinstance(info.value, ValueError)
        msg = str(info.value)
        assert "pip install" in msg and "requirements-vllm.txt" in msg and "FileSystemTierManager" in msg
        assert rt.vllm_unavailable_reason() == msg
        # made by the replay: its ReplayConfigError, naming the install
        with pytest.raises(ReplayConfigError, match="requirements-vllm.txt"):
            run_replay(_config(tmp_path), load_trace(None, max_requests=1), tier_factory=rt.vllm_fs_tier)
    finally:
        rt._import_vllm_cached.cache_clear()
