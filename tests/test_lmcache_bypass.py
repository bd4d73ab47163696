"""PyKVTierStoragePlugin with ``bypass: auto`` under LMCache 0.5.6's own classes (marked
``lmcache``).

The plug-in is built by LMCache's ``storage_plugin_launcher`` inside a real ``LMCacheEngine`` on
CPU, as tests/test_lmcache.py does, and looked up through the engine's ``lookup`` and the
StorageManager's calls. A lookup answers at most the chunks whose load beats their recompute;
the expected count of every case is worked out here from the prefill FLOPs formula written out
(docs/design.md, "Load or recompute"), not by calling pykvtier.costmodel. The bandwidth is
``bypass_bytes_per_s``: every decision is made before any load has been measured. The queue
ahead is a load held in flight by the test (its engine's wait blocks until released): no
sleeps, no timing asserts.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading

import pytest

pytestmark = pytest.mark.lmcache

try:
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    from lmcache_cpu_connector import cpu_connector
    from pykvtier.integrations.lmcache import PyKVTierLMCacheConfig, PyKVTierStoragePlugin
except ImportError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"LMCache is not installed ({exc}); scripts/setup.sh installs it "
                "(requirements-lmcache.txt)", allow_module_level=True)

L, H, D, CH = 4, 2, 64, 16  # layers, KV heads, head dim, chunk tokens: a chunk is 32 KiB (bf16)
CHUNK = 2 * L * CH * H * D * 2
MODULE, CLASS = "pykvtier.integrations.lmcache", "PyKVTierStoragePlugin"
_ids = itertools.count()

# Llama-3-8B (pykvtier/models.py): N = params - embeddings, 32 layers, 32 query heads, head 128;
# an H100's 989.4e12 dense bf16 FLOP/s at mfu 0.5.
N = 8_030_261_248 - 1_050_673_152
LAYERS, QH, HD = 32, 32, 128
FLOPS_PER_S = 989.4e12 * 0.5


def recompute_s(s: int, t: int, gpus: int = 1) -> float:
    """Prefill seconds of prompt tokens s..s+t-1, the KV before s cached, on ``gpus`` GPUs:
    (2 N t + 4 L H d (t s + t (t + 1) / 2)) / (gpus x peak x mfu)."""
    return (2 * N * t + 4 * LAYERS * QH * HD * (t * s + t * (t + 1) // 2)) / (gpus * FLOPS_PER_S)


def expected_k(hits: int, queued: int, bytes_per_s: float, gpus: int = 1) -> int:
    """The largest k in 1..hits whose load (queued + k chunks) ends no later than recomputing
    chunks 0..k-1 (chunk j from token 16 j), else 0."""
    best, total = 0, 0.0
    for k in range(1, hits + 1):
        total += recompute_s((k - 1) * CH, CH, gpus)
        if (queued + k * CHUNK) / bytes_per_s <= total:
            best = k
    return best


R0 = recompute_s(0, CH)  # 451.6 us: 223,418,122,240 FLOPs
DR = recompute_s(CH, CH) - R0  # each chunk 16 tokens deeper: + 134,217,728 FLOPs, 0.27 us
AUTO = dict(bypass="auto", bypass_model="llama-3-8b", bypass_gpu="h100", bypass_mfu=0.5)


def extra(root, **options):
    out = {"storage_plugin.pykvtier.module_path": MODULE,
           "storage_plugin.pykvtier.class_name": CLASS,
           "storage_plugin.pykvtier.root_dir": root}
    out.update({f"storage_plugin.pykvtier.{k}": v for k, v in options.items()})
    return out


class Engine:
    """An LMCacheEngine on CPU with the plug-in configured, destroyed by close()."""

    def __init__(self, root, *, world_size=1, **options):
        self.id = f"bypass-{next(_ids)}"
        self.config = LMCacheEngineConfig.from_defaults(
            chunk_size=CH, local_cpu=False, max_local_cpu_size=0.05,
            storage_plugins=["pykvtier"], extra_config=extra(root, **options))
        self.meta = LMCacheMetadata(model_name="org/model", world_size=world_size,
                                    local_world_size=world_size, worker_id=0,
                                    local_worker_id=0, kv_dtype=torch.bfloat16,
                                    kv_shape=(L, 2, CH, H, D), chunk_size=CH)
        self.eng = LMCacheEngineBuilder.get_or_create(
            self.id, self.config, self.meta, cpu_connector(L, H * D), lambda t, r: None,
            lambda o, r: o)
        self.eng.post_init()
        self.sm = self.eng.storage_manager
        self.plugin = self.sm.storage_backends.get("pykvtier")

    def close(self):
        LMCacheEngineBuilder.destroy(self.id)

    def key(self, i):
        return CacheEngineKey("org/model", self.meta.world_size, 0, 5000 + i, torch.bfloat16)

    def put(self, keys):
        """Stores a chunk of random bytes under each key (as StorageManager.batched_put), and
        waits for the plug-in's jobs."""
        objs = [self.sm.allocate(self.meta.get_shapes(CH), self.meta.get_dtypes()) for _ in keys]
        assert self.plugin.batched_submit_put_task(list(keys), objs) is not None
        for o in objs:
            o.ref_count_down()
        self.plugin._shards.drain()


@pytest.fixture
def engine(tmp_path):
    made = []

    def make(n=12, **kw):
        """An engine with the plug-in (``kw``: its options) holding ``n`` chunks: (engine,
        their keys)."""
        e = Engine(str(tmp_path / "kv"), **kw)
        made.append(e)
        assert e.plugin is not None, ("the plug-in was not registered: LMCache swallowed its "
                                      "constructor's error (see the log)")
        assert e.plugin.block_bytes == CHUNK
        keys = [e.key(i) for i in range(n)]
        if keys:
            e.put(keys)
        return e, keys

    yield make
    for e in made:
        e.close()


def counters(e):
    st = e.plugin.stats()
    return st["bypassed_hits"], st["bypassed_requests"]


def test_bypass_off_by_default_answers_the_full_prefix(engine):
    e, keys = engine(bypass_bytes_per_s=1e3)  # a drive too slow for anything: off anyway
    assert e.plugin.options.bypass == "off" and e.plugin.prefill is None
    assert e.plugin.batched_contains(keys) == 12
    assert e.plugin.batched_contains(keys[:3] + [e.key(99)] + keys[3:]) == 3
    assert counters(e) == (0, 0)


def test_bypass_off_with_a_model_answers_the_full_prefix(engine):
    e, keys = engine(bypass="off", bypass_model="llama-3-8b", bypass_bytes_per_s=1e3)
    assert e.plugin.batched_contains(keys) == 12 and counters(e) == (0, 0)


def test_fast_drive_loads_every_chunk(engine):
    """1 GB/s: a chunk (32 KiB) loads in 32.8 us, against 451.6 us to recompute it."""
    e, keys = engine(**AUTO, bypass_bytes_per_s=1e9)
    assert expected_k(12, 0, 1e9) == 12
    assert e.plugin.batched_contains(keys) == 12 and counters(e) == (0, 0)


def test_slow_drive_recomputes_every_chunk_and_counts_them(engine):
    """1 MB/s: 32.8 ms a chunk against 451.6 us: none pays off; contains() is never capped."""
    e, keys = engine(**AUTO, bypass_bytes_per_s=1e6)
    assert expected_k(12, 0, 1e6) == 0
    p = e.plugin
    assert p.batched_contains(keys) == 0
    assert counters(e) == (12, 1)
    assert p.batched_contains(keys[:5] + [e.key(99)] + keys[5:], pin=True) == 0
    assert counters(e) == (17, 2)
    assert p._pins == {}  # nothing answered, nothing pinned
    assert p.batched_contains([e.key(99)] + keys) == 0 and counters(e) == (17, 2)
    assert all(p.contains(k) for k in keys) and counters(e) == (17, 2)
    assert asyncio.run(p.batched_async_contains("req", keys)) == 0
    assert counters(e) == (29, 3)


def test_long_runs_of_chunks_pay_off_where_short_ones_do_not(engine):
    """A chunk's load takes R0 + 3.25 DR (DR: what 16 tokens deeper adds to a chunk's
    recompute). k chunks load in k (R0 + 3.25 DR) and recompute in k R0 + DR k (k - 1) / 2: the
    load wins from k = 8 on, so 10 chunks load, 7 do not. Only the chunks answered are
    pinned."""
    w = CHUNK / (R0 + 3.25 * DR)
    e, keys = engine(**AUTO, bypass_bytes_per_s=w)
    p = e.plugin
    assert [expected_k(n, 0, w) for n in (5, 7, 8, 10)] == [0, 0, 8, 10]
    assert p.batched_contains(keys[:7], pin=True) == 0
    assert counters(e) == (7, 1) and p._pins == {}
    assert p.batched_contains(keys[:10], pin=True) == 10
    assert counters(e) == (7, 1) and len(p._pins) == 10
    for k in keys[:10]:
        assert p.unpin(k)


def test_the_engines_lookup_and_retrieve(engine):
    """Through LMCache's engine: stored by ``store``, a lookup at 1 MB/s finds 0 tokens (4
    chunks bypassed); on another engine at 1 GB/s all 64, and its retrieve loads them (its
    StorageManager asks batched_contains again: the chunks are the lookup's, answered as
    loadable without a second decision)."""
    tokens = torch.arange(4 * CH)
    kv = torch.randn(L, 2, 4 * CH, H * D).to(torch.bfloat16)
    slow, _ = engine(n=0, **AUTO, bypass_bytes_per_s=1e6)
    slow.eng.store(tokens, kvcaches=kv)
    slow.plugin._shards.drain()
    assert slow.eng.lookup(tokens) == 0
    assert counters(slow) == (4, 1)
    slow.close()
    fast, _ = engine(n=0, **AUTO, bypass_bytes_per_s=1e9)
    assert fast.eng.lookup(tokens) == 4 * CH
    assert len(fast.plugin._promised) == 4
    out = torch.zeros_like(kv)
    assert int(fast.eng.retrieve(tokens, kvcaches=out).sum()) == 4 * CH
    assert torch.equal(out.view(torch.uint8), kv.view(torch.uint8))
    assert counters(fast) == (0, 0) and fast.plugin._promised == {}


def test_tensor_parallel_workers_split_the_recompute(engine):
    """A chunk loads in 0.75 R0: on one GPU it beats its recompute; LMCache's world size 2 (a
    worker per GPU, each with its half of the heads) splits the prefill over two GPUs and
    recomputing wins."""
    w = CHUNK / (0.75 * R0)
    assert (expected_k(4, 0, w), expected_k(4, 0, w, gpus=2)) == (4, 0)
    one, keys = engine(n=4, **AUTO, bypass_bytes_per_s=w)
    assert one.plugin.prefill.gpus == 1 and one.plugin.batched_contains(keys) == 4
    one.close()
    two, keys = engine(n=4, world_size=2, **AUTO, bypass_bytes_per_s=w)
    assert two.plugin.prefill.gpus == 2
    assert two.plugin.batched_contains(keys) == 0 and counters(two) == (4, 1)


class _HeldEngine:
    """A tier's engine whose wait() blocks until ``release`` is set: the jobs it finishes are
    not collected until then, so a load stays in flight for as long as the test needs."""

    def __init__(self, real):
        self.real = real
        self.release = threading.Event()

    def wait(self, timeout_s=None):
        self.release.wait()
        return self.real.wait(timeout_s)

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_the_loads_in_flight_are_the_queue_ahead_and_a_lookups_promise_holds(engine):
    """A chunk loads in 0.905 R0. Alone every run of chunks pays off; behind one chunk being
    loaded (32 KiB, 0.905 R0) 9 chunks do not (9 x 0.095 R0 + 36 DR < 0.905 R0) and 10 do.
    Chunks a lookup answered loadable stay so while that load is in flight (the retrieve's
    second batched_contains), until a get reads them."""
    w = CHUNK / (0.905 * R0)
    assert (expected_k(9, 0, w), expected_k(9, CHUNK, w), expected_k(10, CHUNK, w)) == (9, 0, 10)
    e, keys = engine(n=20, **AUTO, bypass_bytes_per_s=w)
    p = e.plugin
    assert p.batched_contains(keys[:9]) == 9  # nothing in flight: loadable, remembered
    tier = p._shards.tiers[0]
    held = tier._engine = _HeldEngine(tier._engine)
    got = []
    t = threading.Thread(target=lambda: got.extend(p.batched_get_blocking([keys[19]])))
    t.start()
    try:
        with p._shards.cv:
            assert p._shards.cv.wait_for(lambda: p._shards.loading_blocks() == 1, timeout=60)
        assert p.batched_contains(keys[:9]) == 9  # the lookup's promise: not decided again
        assert counters(e) == (0, 0)
        assert p.batched_contains(keys[10:19]) == 0  # 9 others, behind the load: bypassed
        assert counters(e) == (9, 1)
        assert p.batched_contains(keys[9:19]) == 10
        assert counters(e) == (9, 1)
    finally:
        held.release.set()
        t.join()
        tier._engine = held.real
    assert len(got) == 1 and got[0] is not None
    got[0].ref_count_down()
    assert p.bandwidth.loads == 1  # the finished load was measured (its figure is the drive's)
    objs = p.batched_get_blocking(keys[:9])
    assert all(o is not None for o in objs)
    for o in objs:
        o.ref_count_down()
    assert not any(k.to_string().encode() in p._promised for k in keys[:9])


BAD = [
    ({"bypass": "on"}, r"PyKVTierStoragePlugin: bypass must be \"off\" or \"auto\", got 'on'"),
    ({"bypass": "auto"}, "PyKVTierStoragePlugin: bypass: auto needs bypass_model"),
    ({"bypass": "auto", "bypass_model": "gpt-5"},
     "PyKVTierStoragePlugin: bypass_model: unknown model preset 'gpt-5'; known presets: "),
    ({"bypass_gpu": "v100"},
     "PyKVTierStoragePlugin: bypass_gpu: unknown GPU preset 'v100'; known GPU presets: h100"),
    ({"bypass_mfu": 0}, r"PyKVTierStoragePlugin: bypass_mfu must be a number in \(0, 1\], got 0"),
    ({"bypass_mfu": True}, r"bypass_mfu must be a number in \(0, 1\], got True"),
    ({"bypass_bytes_per_s": 0}, "PyKVTierStoragePlugin: bypass_bytes_per_s must be null or a "
                                r"positive number \(bytes/s\), got 0"),
    ({"bypass_bytes_per_s": float("nan")}, "bypass_bytes_per_s must be null or a positive"),
    ({"bypass_bytes": 1e9}, r"unknown option storage_plugin\.pykvtier\.bypass_bytes in "
                            r"LMCache's extra_config; accepted: .*bypass_bytes_per_s"),
]


@pytest.mark.parametrize("bad,match", BAD)
def test_bad_bypass_options_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        PyKVTierLMCacheConfig.from_extra_config(extra("/nonexistent/kv", **bad), "pykvtier")


def test_a_bad_bypass_option_through_lmcaches_launcher(tmp_path, caplog):
    """LMCache's launcher logs the plug-in's error and runs on without it; nothing is created
    under the root."""
    root = tmp_path / "kv"
    with caplog.at_level(logging.ERROR, logger="pykvtier"):
        e = Engine(str(root), bypass="auto", bypass_model="llama-3-8b", bypass_gpu="v100")
    try:
        assert e.plugin is None and not root.exists()
        assert "bypass_gpu: unknown GPU preset 'v100'" in caplog.text
        with pytest.raises(ValueError, match="bypass_gpu: unknown GPU preset 'v100'"):
            PyKVTierStoragePlugin(config=e.config, dst_device="cpu", metadata=e.meta,
                                  local_cpu_backend=e.sm.storage_backends["LocalCPUBackend"],
                                  loop=e.sm.loop)
    finally:
        e.close()
