"""bypass: auto in the vLLM adapter, corner cases found by a breaking review: the decision does
not depend on the order vLLM looks keys up in (its sliding-window lookup scans a request's keys
from the end), counts every KV-cache group's key at a position, and is made again when the
request resumes after a preemption. Driven through vLLM's own classes (its scheduler's lookup
loops, ReqContext, ScheduleEndContext, a tier made by SecondaryTierFactory); exact values, no
sleeps, no timing asserts."""

from __future__ import annotations

import types
import uuid

import pytest

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        OffloadingConnectorScheduler,
    )
    from vllm.v1.kv_offload.base import ReqContext, ScheduleEndContext, make_offload_key
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
except Exception as exc:  # noqa: BLE001 - any import failure means: no usable vLLM here
    pytest.skip(f"vLLM's kv_offload.tiering is not importable ({type(exc).__name__}: {exc})",
                allow_module_level=True)

from pykvtier.layout import key_digest  # noqa: E402
from test_vllm import (  # noqa: E402
    BLOCK, HIT, MISS, RETRY, _r, aligned_rows, fill, job, make_tier, offloading_config,  # noqa: F401
    run, tier_config)

STATS = ("bypassed_hits", "bypassed_requests", "bypass_deferrals")


def end_step(tier, preempted=()) -> None:
    tier.on_schedule_end(ScheduleEndContext((), tuple(preempted)))


def counters(tier) -> tuple[int, int, int]:
    st = tier.stats()
    return tuple(st[k] for k in STATS)


def gkey(i: int, group: int, tag: bytes = b"o") -> bytes:
    """group's OffloadKey of the request's i-th block, as vLLM makes it (block hash + group)."""
    return make_offload_key(key_digest(b"%s-%d" % (tag, i)) * 2, group)


def store(tier, arr, keys) -> None:
    fill(arr, keys, range(len(keys)))
    assert all(r.success for r in run(tier, job(1, keys, range(len(keys)), False)).values())


class Answers:
    """A stand-in for vLLM's OffloadingManager in its scheduler's lookup loops: the tier's
    answers (HIT/MISS/RETRY, what vLLM's tiering manager gets from it), recorded per key."""

    def __init__(self, tier):
        self.tier = tier
        self.got: dict[bytes, object] = {}
        self.order: list[bytes] = []

    def lookup(self, k, ctx):
        r = self.tier.lookup(k, ctx)
        self.got[k] = r
        self.order.append(k)
        return r


def scheduler(answers: Answers):
    """The object vLLM's OffloadingConnectorScheduler lookup loops read: .manager, and the
    events tracker _maximal_prefix_lookup records hits in."""
    return types.SimpleNamespace(
        manager=answers,
        _events_tracker=types.SimpleNamespace(record_lookup=lambda *a, **kw: None))


def prefix_lookup(answers, keys, ctx):
    """vLLM's full-attention lookup: keys in prompt order, stop at the first MISS."""
    return OffloadingConnectorScheduler._maximal_prefix_lookup(
        scheduler(answers), keys, ctx, None, None, 0)


def window_lookup(answers, keys, ctx, window):
    """vLLM's sliding-window lookup: keys from the END backwards."""
    return OffloadingConnectorScheduler._sliding_window_lookup(
        scheduler(answers), keys, window, ctx)


# ------------------------------------------------------------------ 1. lookup order

# 4 keys at chunks 0..3. A load of BLOCK bytes takes L, between r[0] and r[3]: the last key
# alone pays off (L <= r[3]), the first does not, and no prefix does (k L > r[0] + .. + r[k-1]
# for k = 1..4): the right answer is MISS for all 4, whichever order vLLM asks in.
_L = 0.25 * _r(0) + 0.75 * _r(3)
assert _L <= _r(3) and all(k * _L > sum(_r(j) for j in range(k)) for k in range(1, 5))


@pytest.mark.parametrize("order", ["prefix", "sliding_window"])
def test_the_decision_does_not_depend_on_the_lookup_order(root, make_tier, order):
    """vLLM 0.33's _sliding_window_lookup asks `for idx in range(len(keys) - 1, -1, -1)`: the
    tier saw the highest-position (most expensive) key first, its 'first hit alone pays off'
    shortcut passed, and the 4 keys answered HIT (promoted, loaded, slower than recomputing)
    without being counted; asked in prompt order the same keys were counted and bypassed. Now
    both orders: RETRY for a step (counted, 1 deferral), then MISS for the 4 (bypassed)."""
    cfg = tier_config(root, bypass="auto", bypass_model="llama-3-8b", bypass_gpu="h100",
                      bypass_mfu=0.5, bypass_bytes_per_s=BLOCK / _L)
    tier, arr = make_tier(cfg, num_chunks=32)
    keys = [gkey(j, 0) for j in range(4)]
    store(tier, arr, keys)
    ctx = ReqContext("r")
    for j, k in enumerate(keys):
        ctx.set_offload_key_position(k, 16 * (j + 1))
    ask = (lambda a: prefix_lookup(a, keys, ctx)) if order == "prefix" else \
        (lambda a: window_lookup(a, keys, ctx, 4))
    a = Answers(tier)
    assert ask(a) is None  # deferred: vLLM asks again next step
    assert a.got == dict.fromkeys(keys, RETRY)
    assert counters(tier) == (0, 0, 1)
    end_step(tier)
    a = Answers(tier)
    assert ask(a) == 0
    # prefix order stops at the first MISS; the window scan goes through every key
    assert a.got == ({keys[0]: MISS} if order == "prefix" else dict.fromkeys(keys, MISS))
    assert counters(tier) == (4, 1, 1)
    assert tier.stats()["loads_submitted"] == 0


def test_a_fast_tier_still_hits_at_once_from_the_end(root, make_tier):
    """1e9 B/s (32.8 us a key against r[0] = 451.6 us): the shortcut holds for the prompt's
    first block, so for every block: HIT at once, in either order, nothing deferred."""
    cfg = tier_config(root, bypass="auto", bypass_model="llama-3-8b", bypass_gpu="h100",
                      bypass_mfu=0.5, bypass_bytes_per_s=1e9)
    tier, arr = make_tier(cfg, num_chunks=32)
    keys = [gkey(j, 0) for j in range(4)]
    store(tier, arr, keys)
    ctx = ReqContext("r")
    for j, k in enumerate(keys):
        ctx.set_offload_key_position(k, 16 * (j + 1))
    a = Answers(tier)
    assert window_lookup(a, keys, ctx, 4) == 4
    assert a.order == keys[::-1] and a.got == dict.fromkeys(keys, HIT)
    assert counters(tier) == (0, 0, 0)


# ------------------------------------------------------------------ 2. several KV-cache groups


def two_group_tier(root, bytes_per_s, num_chunks=32):
    """A tier over a spec of two full-attention KV-cache groups (vLLM's keys: the same block
    hash, group 0 and group 1, at the same end-token position), one BLOCK row per key."""
    cfg = tier_config(root, bypass="auto", bypass_model="llama-3-8b", bypass_gpu="h100",
                      bypass_mfu=0.5, bypass_bytes_per_s=bytes_per_s)
    base = offloading_config([cfg])
    spec_cfg = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layers.0",), group_id=0),
                OffloadingGroupConfig(tokens_per_block=16, layer_names=("layers.1",), group_id=1)),
        worker_kv_bytes_per_block=BLOCK, enable_kv_cache_events=False,
        extra_config=base.extra_config, engine_id=f"pykvtier-test-{uuid.uuid4().hex[:12]}",
        model=base.model, cache=base.cache, parallel=base.parallel)
    spec = OffloadingSpecFactory.create_spec(spec_cfg)
    assert spec.tokens_per_block == (16, 16)
    arr = aligned_rows(num_chunks)
    tier = SecondaryTierFactory.create_secondary_tier(dict(cfg), memoryview(arr), spec)
    return tier, arr


def test_two_groups_keys_at_one_position_are_two_loads(root):
    """Two KV-cache groups, 8 blocks each (16 keys, 2 per end position). A key loads in L = r[0]
    + 0.5 us: one key per position would pay off from 5 positions on (k L <= sum r[:k] once
    0.5 us <= 0.1357 us x (k - 1)), but each position loads 2 keys (2 L ~ 904 us > 453 us of
    recompute): nothing pays off. The deferral step kept the end positions as a set (8), so the
    tier decided k = 8 and answered HIT for all 16; now it counts the 16 keys: MISS all 16."""
    L = _r(0) + 0.5e-6
    assert 8 * L <= sum(_r(j) for j in range(8))  # what the set of 8 positions gave
    assert all(2 * k * L > sum(_r(j) for j in range(k)) for k in range(1, 9))
    tier, arr = two_group_tier(root, BLOCK / L)
    try:
        g0, g1 = [gkey(j, 0) for j in range(8)], [gkey(j, 1) for j in range(8)]
        store(tier, arr, g0 + g1)
        ctx = ReqContext("r")
        for j in range(8):
            ctx.set_offload_key_position(g0[j], 16 * (j + 1))
            ctx.set_offload_key_position(g1[j], 16 * (j + 1))
        a = Answers(tier)  # vLLM's _lookup_complete_chunks: group 0's prefix, then group 1's
        assert prefix_lookup(a, g0, ctx) is None and prefix_lookup(a, g1, ctx) is None
        assert a.got == dict.fromkeys(g0 + g1, RETRY)
        assert prefix_lookup(a, g1, ctx) is None  # asked again in the step: counted once
        end_step(tier)
        assert [tier.lookup(k, ctx) for k in g0 + g1] == [MISS] * 16
        assert counters(tier) == (16, 1, 1)
        assert tier.stats()["loads_submitted"] == 0
    finally:
        tier.shutdown()


def test_two_groups_first_hit_shortcut_counts_every_groups_key(root):
    """The 'HIT at once' shortcut weighs a position's keys of every group: L = 0.6 r[0] (one
    key alone would pay off, a position's 2 keys, 1.2 r[0], do not): counted for a step, then
    MISS for the 8 keys; 1 deferral. Before: HIT at once for all 8."""
    L = 0.6 * _r(0)
    assert L <= _r(0) and all(2 * k * L > sum(_r(j) for j in range(k)) for k in range(1, 5))
    tier, arr = two_group_tier(root, BLOCK / L)
    try:
        g0, g1 = [gkey(j, 0) for j in range(4)], [gkey(j, 1) for j in range(4)]
        store(tier, arr, g0 + g1)
        ctx = ReqContext("r")
        for j in range(4):
            ctx.set_offload_key_position(g0[j], 16 * (j + 1))
            ctx.set_offload_key_position(g1[j], 16 * (j + 1))
        assert [tier.lookup(k, ctx) for k in g0 + g1] == [RETRY] * 8
        end_step(tier)
        assert [tier.lookup(k, ctx) for k in g0 + g1] == [MISS] * 8
        assert counters(tier) == (8, 1, 1)
    finally:
        tier.shutdown()


# ------------------------------------------------------------------ 3. preemption


def test_a_preempted_request_decides_again_when_it_resumes(root, make_tier):
    """vLLM keeps a request's ReqContext from on_new_request to its end, preemption included
    (scheduler.py: on_new_request makes it; a preempted request's get_num_new_matched_tokens
    looks its keys up again with it), so the decision made before the preemption was reused
    after it, in another queue. 1e8 B/s (327.68 us a key): b's 10 hits decided behind 4 queued
    keys, k = 0 (MISS all 10); b is preempted; resumed with nothing queued its first hit alone
    pays off: HIT all 10 (was MISS all 10, stale)."""
    cfg = tier_config(root, bypass="auto", bypass_model="llama-3-8b", bypass_gpu="h100",
                      bypass_mfu=0.5, bypass_bytes_per_s=1e8)
    tier, arr = make_tier(cfg, num_chunks=32)
    ka = [gkey(j, 0, b"a") for j in range(4)]
    kb = [gkey(j, 0, b"b") for j in range(10)]
    store(tier, arr, ka + kb)

    def ctx_of(rid, keys):
        c = ReqContext(rid)
        for j, k in enumerate(keys):
            c.set_offload_key_position(k, 16 * (j + 1))
        return c

    a, a2, b = ctx_of("a", ka), ctx_of("a2", ka), ctx_of("b", kb)
    assert [tier.lookup(k, a) for k in ka] == [HIT] * 4
    assert [tier.lookup(k, b) for k in kb] == [RETRY] * 10  # behind a's 4: counted
    end_step(tier)
    assert [tier.lookup(k, a2) for k in ka] == [HIT] * 4  # a queue again
    assert [tier.lookup(k, b) for k in kb] == [MISS] * 10  # (4 + 10) x 327.68 > sum r[:10]
    assert counters(tier) == (10, 1, 1)
    end_step(tier)
    assert [tier.lookup(k, b) for k in kb] == [MISS] * 10  # kept while b waits
    end_step(tier, preempted=["b"])
    assert [tier.lookup(k, b) for k in kb] == [HIT] * 10  # decided again: nothing queued
    assert counters(tier) == (10, 1, 1)
    tier.on_request_finished(b)
    assert tier._bypass_preempted == set()
