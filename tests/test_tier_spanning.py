"""DiskTier's spanning arenas (blocks at any page of an allocator's arena) and pin / unpin /
remove, the tier features LMCache's plug-in stands on. No sleeps: completion via drain()."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pykvtier import DiskTier, LookupResult, TransferJob, host_arena
from pykvtier import _native
from pykvtier.layout import HEADER_BYTES, key_digest

PAGE = 4096
BS = 3 * PAGE  # a block covers three pages
FB = BS + HEADER_BYTES


def finish(tier):
    tier.drain()
    return tier.get_finished_jobs()


def flat_arena(pages):
    return host_arena(1, pages * PAGE).reshape(-1)


def test_blocks_start_at_any_page_and_round_trip_byte_exact(tmp_path):
    tier = DiskTier(str(tmp_path / "t"), BS)
    arena = flat_arena(16)
    a = tier.set_arena(arena, spanning=True)
    assert (a.slot_bytes, a.span, a.num_slots) == (PAGE, 3, 14)  # a block may start at 0..13
    rng = np.random.default_rng(1)
    src = {1: rng.integers(0, 256, BS, dtype=np.uint8), 5: rng.integers(0, 256, BS, dtype=np.uint8)}
    for page, data in src.items():
        arena[page * PAGE:page * PAGE + BS] = data
    tier.submit_store(TransferJob(1, [b"a", b"b"], [1, 5]))
    (res,) = finish(tier)
    assert res.success and res.transfer_bytes == 2 * BS
    arena[:] = 0
    tier.submit_load(TransferJob(2, [b"b", b"a"], [13, 8]))
    (res,) = finish(tier)
    assert res.success
    assert np.array_equal(arena[13 * PAGE:16 * PAGE], src[5])
    assert np.array_equal(arena[8 * PAGE:11 * PAGE], src[1])
    assert not arena[:8 * PAGE].any() and not arena[11 * PAGE:13 * PAGE].any()  # nothing else written
    tier.shutdown()


def test_overlapping_slots_of_jobs_in_flight_are_refused_by_name(tmp_path):
    tier = DiskTier(str(tmp_path / "t"), BS)
    tier.set_arena(flat_arena(16), spanning=True)
    tier.submit_store(TransferJob(1, [b"a", b"b"], [0, 3]))
    finish(tier)
    tier.submit_load(TransferJob(2, [b"a"], [4]))  # pages 4, 5, 6
    with pytest.raises(ValueError, match=r"^job 3: slot 6 is being loaded by another job "):
        tier.submit_load(TransferJob(3, [b"b"], [6]))
    with pytest.raises(ValueError, match=r"^job 4: slot 2 overlaps a slot that is being loaded "):
        tier.submit_store(TransferJob(4, [b"c"], [2]))  # pages 2, 3, 4
    tier.submit_load(TransferJob(5, [b"b"], [7]))  # pages 7..9: apart, accepted
    assert {r.job_id: r.success for r in finish(tier)} == {2: True, 5: True}
    tier.submit_load(TransferJob(6, [b"b"], [6]))  # free again once job 2 finished
    assert [r.success for r in finish(tier)] == [True]
    tier.shutdown()


def test_a_slot_whose_block_would_pass_the_end_is_refused(tmp_path):
    tier = DiskTier(str(tmp_path / "t"), BS)
    tier.set_arena(flat_arena(16), spanning=True)
    with pytest.raises(ValueError, match=r"slot 14 outside the arena \(0\.\.13\)"):
        tier.submit_store(TransferJob(1, [b"a"], [14]))
    tier.shutdown()


def test_spanning_arena_options_are_checked(tmp_path):
    tier = DiskTier(str(tmp_path / "t"), BS)
    with pytest.raises(ValueError, match=r"slot_bytes \(1000\) must be a positive multiple of 4096"):
        tier.set_arena(flat_arena(16), 1000, spanning=True)
    with pytest.raises(TypeError, match="spanning must be a bool"):
        tier.set_arena(flat_arena(16), spanning=1)
    with pytest.raises(ValueError, match=r"arena of 8192 bytes is smaller than one block \(12288 bytes\)"):
        tier.set_arena(flat_arena(2), spanning=True)
    tier.shutdown()


def test_slot_claims_with_a_span_release_everything_they_took():
    c = _native.SlotClaims(10, 3)
    slots = np.array([0, 4], np.int64).tobytes()
    c.claim(1, slots, True)
    assert c.claimed() == 6
    with pytest.raises(ValueError, match="job 2: slot 5 is being loaded by another job"):
        c.claim(2, np.array([8, 5], np.int64).tobytes(), True)  # slot 8 claimed, then refused
    assert c.claimed() == 6  # ... and slot 8's pages given back
    c.release(slots, True)
    assert c.claimed() == 0
    with pytest.raises(ValueError, match="span is 0"):
        _native.SlotClaims(4, 0)


def test_block_space_spanning_allows_slots_smaller_than_a_block():
    with pytest.raises(ValueError, match="slot_bytes 4096 is smaller than payload_bytes 12288"):
        _native.BlockSpace("/b", BS, PAGE, PAGE, 4)
    s = _native.BlockSpace("/b", BS, PAGE, PAGE, 4, True)
    assert s.spanning and s.slot_bytes == PAGE


def stored_tier(tmp_path, n, **kw):
    tier = DiskTier(str(tmp_path / "t"), BS, **kw)
    arena = host_arena(8, BS)
    tier.set_arena(arena)
    keys = [b"k%d" % i for i in range(n)]
    tier.submit_store(TransferJob(1, keys, list(range(n))))
    assert all(r.success for r in finish(tier))
    return tier, keys, [key_digest(k) for k in keys]


def test_pinned_blocks_are_not_evicted_and_unpin_releases_them(tmp_path):
    tier, keys, ds = stored_tier(tmp_path, 3, capacity_bytes=3 * FB)
    assert tier.pin([ds[0], key_digest(b"absent")]) == [True, False]
    assert tier.lookup(keys[0]) is LookupResult.HIT_PENDING  # held, as a load holds it
    tier.submit_store(TransferJob(2, [b"n1", b"n2"], [3, 4]))
    assert all(r.success for r in finish(tier))
    assert [tier.lookup(k) for k in keys] == [LookupResult.HIT_PENDING, LookupResult.MISS,
                                              LookupResult.MISS]
    tier.unpin([ds[0]])
    assert tier.lookup(keys[0]) is LookupResult.HIT
    tier.submit_store(TransferJob(3, [b"n3"], [5]))  # k0 is the least recently used now
    assert all(r.success for r in finish(tier))
    assert tier.lookup(keys[0]) is LookupResult.MISS
    assert tier.stats()["evictions"] == 3
    tier.shutdown()


def test_every_block_pinned_refuses_a_store_needing_room(tmp_path):
    tier, keys, ds = stored_tier(tmp_path, 2, capacity_bytes=2 * FB)
    assert tier.pin(ds) == [True, True]
    tier.submit_store(TransferJob(2, [b"new"], [3]))
    (res,) = finish(tier)
    assert res.success is False and res.failed_keys == {b"new": "no capacity: every block is in use"}
    tier.shutdown()


def test_remove_unlinks_present_blocks_but_not_pinned_ones(tmp_path):
    tier, keys, ds = stored_tier(tmp_path, 3)
    tier.pin([ds[2]])
    assert tier.remove([ds[0], ds[2], key_digest(b"absent")]) == [True, False, False]
    assert tier.lookup(keys[0]) is LookupResult.MISS
    assert tier.used_bytes == 2 * FB
    finish(tier)
    assert not os.path.exists(tier.layout.block_path(ds[0]))
    assert os.path.exists(tier.layout.block_path(ds[1]))
    assert tier.stats()["blocks_removed"] == 1
    tier.unpin([ds[2]])
    tier.shutdown()
    again = DiskTier(str(tmp_path / "t"), BS)  # a restart: the removal held
    assert [again.lookup(k) for k in keys] == [LookupResult.MISS, LookupResult.HIT, LookupResult.HIT]
    again.shutdown()
