"""Promoter(bypass="auto"): a request's prefix of hits answers MISS past the k of
pykvtier.costmodel.loadable_prefix, at a bandwidth the test pins (FixedBandwidth), with the
bytes queued ahead counted as documented; bypass off (the default) changes nothing. No sleeps:
the decisions are made before any load finishes, and the loads' bytes are checked after."""

from __future__ import annotations

import numpy as np
import pytest

from pykvtier import DiskTier, LookupResult, Promoter, TransferJob
from pykvtier.costmodel import BandwidthEstimate, FixedBandwidth, PrefillModel, loadable_prefix

HIT, MISS, HIT_PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING
BS = 64 << 10  # the tier's block bytes (16 tokens of a 4 KiB/token model, see PREFILL)
TPB = 16
# Llama-3-8B's FLOPs, 16 tokens a block: block j from position 16 j recomputes in
# (223,418,122,240 + 134,217,728 j) FLOPs / (989.4e12 x 0.5) = 451.623 us + 0.2713 us x j
# (tests/test_costmodel.py has the hand calculation); the tier's 64 KiB blocks stand for them.
PREFILL = PrefillModel("llama-3-8b", "h100", mfu=0.5)
R0 = 223_418_122_240 / 494.7e12
DR = 134_217_728 / 494.7e12


@pytest.fixture
def stored(root, make_tier, arena):
    """A tier holding 12 blocks: (tier, keys, source rows, arena)."""
    tier = make_tier(root)
    a = arena(32, BS)
    a[:12] = np.random.default_rng(7).integers(0, 256, (12, BS), dtype=np.uint8)
    tier.set_arena(a)
    keys = [b"blk-%d" % i for i in range(12)]
    tier.submit_store(TransferJob(1, keys, list(range(12))))
    tier.drain()
    (res,) = tier.get_finished_jobs()
    assert res.success
    src = a[:12].copy()
    a[:] = 0
    return tier, keys, src, a


def promoter(tier: DiskTier, bytes_per_s: float | None) -> Promoter:
    bw = FixedBandwidth(bytes_per_s) if bytes_per_s else BandwidthEstimate()
    return Promoter(tier, bypass="auto", prefill=PREFILL, tokens_per_block=TPB, bandwidth=bw)


def test_bypass_is_off_by_default_and_changes_nothing(stored):
    tier, keys, _, _ = stored
    for p in (Promoter(tier), Promoter(tier, bypass="off"), Promoter(tier, bypass=None)):
        assert p.bypass is False and p.bandwidth is None
        ask = keys[:4] + [b"absent"] + keys[4:6]
        assert p.lookup_prefix(ask) == [p.lookup(k) for k in ask] == [HIT] * 4 + [MISS, HIT, HIT]
        assert p.stats() == {"jobs_submitted": 0, "bypassed_hits": 0, "bypassed_requests": 0,
                             "bandwidth_loads": 0}


def test_a_fast_tier_loads_every_hit(stored):
    """1 GB/s: a 64 KiB block loads in 65.536 us, against 451.6 us to recompute it."""
    tier, keys, src, a = stored
    p = promoter(tier, 1e9)
    assert p.lookup_prefix(keys[:4]) == [HIT] * 4
    # a second request behind those 4 blocks: (4 + 1) x 65.536 = 327.7 us <= 451.6 us at k = 1
    assert p.lookup_prefix(keys[4:8], start_token=64) == [HIT] * 4
    assert p.stats()["bypassed_hits"] == 0
    p.promote("a", keys[:4], range(4))
    p.promote("b", keys[4:8], range(4, 8))
    p.on_step_end()
    tier.drain()
    done = {r.request_id: r for r in p.poll()}
    assert sorted(done["a"].loaded) == sorted(keys[:4])
    assert sorted(done["b"].loaded) == sorted(keys[4:8])
    assert np.array_equal(a[:8], src[:8])
    assert p.stats()["bandwidth_loads"] == 2  # each finished load job went to the estimate


def test_a_slow_tier_recomputes_every_hit(stored):
    """100 MB/s: 655.36 us a block against 451.6 + 0.27 j us: no prefix of 4 pays off
    (4 x 655.36 = 2,621 us to load, 4 x 451.6 + 6 x 0.27 = 1,808 us to recompute)."""
    tier, keys, _, _ = stored
    p = promoter(tier, 1e8)
    assert p.lookup_prefix(keys[:4] + [b"absent"]) == [MISS] * 5
    assert p.stats()["bypassed_hits"] == 4 and p.stats()["bypassed_requests"] == 1
    assert tier.lookup(keys[0]) is HIT  # the tier still holds them: only the answer changed


def test_the_queue_ahead_tips_the_second_request(stored):
    """200 MB/s: a block loads in 327.68 us (< 451.6 us: request a loads its 4); request b,
    behind a's 4 blocks, would end its k-th block at (4 + k) x 327.68 us against
    k x 451.6 + ... us: 1,638 > 452, 1,966 > 904, ..., 2,621 > 1,808 for k = 4: MISS all 4."""
    tier, keys, _, _ = stored
    p = promoter(tier, 2e8)
    load = BS / 2e8
    assert load == 327.68e-6
    assert p.lookup_prefix(keys[:4]) == [HIT] * 4
    assert p.lookup_prefix(keys[4:8], start_token=64) == [MISS] * 4
    # by hand: block j of b starts at token 64 + 16 j, i.e. it is block 4 + j of the prompt
    r = [R0 + DR * (4 + j) for j in range(4)]
    assert all((4 + k) * load > sum(r[:k]) for k in range(1, 5))
    assert loadable_prefix(4, BS, 4 * BS, 2e8, PREFILL.blocks_seconds(64, TPB, 4)) == 0
    assert p.stats()["bypassed_hits"] == 4
    # promoted, a's blocks are queued as asked for (not twice): b still sees 4 blocks ahead
    p.promote("a", keys[:4], range(4))
    assert p.lookup_prefix(keys[4:8], start_token=64) == [MISS] * 4
    assert p.stats()["bypassed_hits"] == 8 and p.stats()["bypassed_requests"] == 2
    # the next step, once a's load has been collected, nothing is queued: b loads
    p.on_step_end()
    tier.drain()
    (res,) = p.poll()
    assert res.request_id == "a" and len(res.loaded) == 4
    assert p.lookup_prefix(keys[4:8], start_token=64) == [HIT] * 4
    assert p.stats()["bypassed_hits"] == 8


def test_deep_blocks_are_worth_loading_behind_the_same_queue(stored):
    """The same 200 MB/s and 4 blocks queued, b's blocks at token 100,000: each recomputes in
    (223,346,819,072 + 524,288 x (16 x (100,000 + 16 j) + 136)) / 494.7e12 >= 2.147 ms, so
    its first block, landing at (4 + 1) x 327.68 = 1,638 us, already pays off: all 4 load."""
    tier, keys, _, _ = stored
    p = promoter(tier, 2e8)
    assert p.lookup_prefix(keys[:4]) == [HIT] * 4
    first = (223_346_819_072 + 524_288 * (16 * 100_000 + 136)) / 494.7e12
    assert first == pytest.approx(2.1473e-3, rel=1e-4) and 5 * BS / 2e8 <= first
    assert p.lookup_prefix(keys[4:8], start_token=100_000) == [HIT] * 4
    assert p.stats()["bypassed_hits"] == 0


def test_pending_blocks_count_as_hits_and_the_prefix_stays_contiguous(stored):
    """Hits after the first non-hit are left alone; HIT_PENDING (another request's block on its
    way) belongs to the run; at 100 MB/s the run answers MISS."""
    tier, keys, _, _ = stored
    p = promoter(tier, 1e9)
    p.promote("a", keys[:2], [0, 1])
    fast = p.lookup_prefix(keys[:3] + [b"absent"] + keys[3:5])
    assert fast == [HIT_PENDING, HIT_PENDING, HIT, MISS, HIT, HIT]
    p.bandwidth = FixedBandwidth(1e8)
    slow = p.lookup_prefix(keys[:3] + [b"absent"] + keys[3:5])
    assert slow == [MISS, MISS, MISS, MISS, HIT, HIT]
    assert p.stats()["bypassed_hits"] == 3


def test_without_an_estimate_every_hit_is_loaded_and_measured(stored):
    tier, keys, src, a = stored
    p = promoter(tier, None)
    assert p.bandwidth.bytes_per_s is None
    assert p.lookup_prefix(keys[:6]) == [HIT] * 6
    p.promote("a", keys[:6], range(6))
    p.on_step_end()
    tier.drain()
    (res,) = p.poll()
    assert len(res.loaded) == 6 and np.array_equal(a[:6], src[:6])
    assert p.bandwidth.loads == 1 and p.bandwidth.bytes_per_s > 0  # (its figure: this disk's)


def test_bad_bypass_options(stored):
    tier, _, _, _ = stored
    with pytest.raises(ValueError, match=r"bypass must be None, \"off\" or \"auto\", got 'on'"):
        Promoter(tier, bypass="on")
    with pytest.raises(ValueError, match="needs prefill"):
        Promoter(tier, bypass="auto")
    # 64 KiB blocks hold half a Llama-3-8B token (131,072 B): tokens_per_block must be given
    with pytest.raises(ValueError, match="no whole number of llama-3-8b tokens"):
        Promoter(tier, bypass="auto", prefill=PREFILL)
    with pytest.raises(ValueError, match="tokens_per_block must be a positive integer"):
        Promoter(tier, bypass="auto", prefill=PREFILL, tokens_per_block=0)
    tiny = Promoter(tier, bypass="auto", prefill=PrefillModel("tiny", "h100"))
    assert tiny.tokens_per_block == BS // 256
