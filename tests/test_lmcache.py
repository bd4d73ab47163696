"""PyKVTierStoragePlugin under LMCache 0.5.6's own classes (marked ``lmcache``; skipped without
LMCache).

The plug-in is built by LMCache's ``storage_plugin_launcher`` from the config a user writes
(``storage_plugins`` + ``extra_config``), inside a real ``LMCacheEngine`` (built by
``LMCacheEngineBuilder`` on CPU, with tests/lmcache_cpu_connector.py moving the bytes between a
CPU KV tensor and LMCache's memory objects), and driven through the engine's ``store`` /
``lookup`` / ``retrieve`` or through its StorageManager's backend calls with real
``CacheEngineKey``s. Every chunk read is compared byte for byte (as uint8: random bf16 bytes hold
NaNs) with what was written.
"""

from __future__ import annotations

import glob
import itertools
import json
import logging
import os
import subprocess
import sys
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
    from pykvtier.integrations.lmcache import PyKVTierStoragePlugin
except ImportError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"LMCache is not installed ({exc}); scripts/setup.sh installs it "
                "(requirements-lmcache.txt)", allow_module_level=True)

L, H, D, CH = 4, 2, 64, 16  # layers, KV heads, head dim, chunk tokens: a chunk is 32 KiB (bf16)
CHUNK_BYTES = 2 * L * CH * H * D * 2
MODULE, CLASS = "pykvtier.integrations.lmcache", "PyKVTierStoragePlugin"
_ids = itertools.count()


def extra(root, name="pykvtier", **options):
    out = {f"storage_plugin.{name}.module_path": MODULE,
           f"storage_plugin.{name}.class_name": CLASS,
           f"storage_plugin.{name}.root_dir": root}
    out.update({f"storage_plugin.{name}.{k}": v for k, v in options.items()})
    return out


class Engine:
    """An LMCacheEngine on CPU with the plug-in configured, destroyed by close()."""

    def __init__(self, root, *, model="org/model", local_cpu=False, save_unfull_chunk=False,
                 name="pykvtier", worker_id=0, **options):
        self.id = f"test-{next(_ids)}"
        self.config = LMCacheEngineConfig.from_defaults(
            chunk_size=CH, local_cpu=local_cpu, max_local_cpu_size=0.05,
            save_unfull_chunk=save_unfull_chunk, storage_plugins=[name],
            extra_config=extra(root, name, **options))
        self.meta = LMCacheMetadata(model_name=model, world_size=1, local_world_size=1,
                                    worker_id=worker_id, local_worker_id=worker_id,
                                    kv_dtype=torch.bfloat16, kv_shape=(L, 2, CH, H, D),
                                    chunk_size=CH)
        self.eng = LMCacheEngineBuilder.get_or_create(
            self.id, self.config, self.meta, cpu_connector(L, H * D), lambda t, r: None,
            lambda o, r: o)
        self.eng.post_init()
        self.sm = self.eng.storage_manager
        self.plugin = self.sm.storage_backends.get(name)

    def close(self):
        LMCacheEngineBuilder.destroy(self.id)

    def key(self, i, model="org/model"):
        return CacheEngineKey(model, 1, 0, 1000 + i, torch.bfloat16)

    def chunk(self, seed):
        """A full chunk's memory object (ref 1) holding seeded random bytes, and those bytes."""
        obj = self.sm.allocate(self.meta.get_shapes(CH), self.meta.get_dtypes())
        g = torch.Generator().manual_seed(seed)
        data = torch.randint(0, 256, (obj.get_size(),), dtype=torch.uint8, generator=g)
        obj.byte_array.cast("B")[:] = data.numpy().tobytes()
        return obj, data

    def put(self, keys, seeds, **kw):
        """Puts as StorageManager.batched_put does (submit, then drop the caller's refs); waits
        for the plug-in's jobs. Returns the bytes by key index."""
        objs, datas = zip(*(self.chunk(s) for s in seeds))
        futs = self.plugin.batched_submit_put_task(list(keys), list(objs), **kw)
        for o in objs:
            o.ref_count_down()
        self.plugin._shards.drain()
        return list(datas), futs


def as_bytes(obj):
    return torch.frombuffer(bytearray(obj.byte_array), dtype=torch.uint8)


@pytest.fixture
def engine(tmp_path):
    made = []

    def make(root=None, **kw):
        e = Engine(str(root or tmp_path / "kv"), **kw)
        made.append(e)
        assert e.plugin is not None, ("the plug-in was not registered: LMCache swallowed its "
                                      "constructor's error (see the log)")
        return e

    yield make
    for e in made:
        e.close()


def block_files(root):
    return sorted(glob.glob(os.path.join(root, "pykvtier-lmcache", "*", "blocks", "*", "*.kvb")))


def test_built_by_lmcache_launcher_and_round_trip_through_its_engine(engine, tmp_path):
    e = engine(local_cpu=False)
    assert type(e.plugin) is PyKVTierStoragePlugin
    assert list(e.sm.storage_backends) == ["LocalCPUBackend", "pykvtier"]
    assert e.sm.storage_backends["pykvtier"].get_allocator_backend() is e.sm.storage_backends["LocalCPUBackend"]
    tokens = torch.arange(4 * CH)
    kv = torch.randn(L, 2, 4 * CH, H * D).to(torch.bfloat16)
    e.eng.store(tokens, kvcaches=kv)
    e.plugin._shards.drain()
    assert len(block_files(str(tmp_path / "kv"))) == 4
    assert e.eng.lookup(tokens) == 4 * CH
    out = torch.zeros_like(kv)
    mask = e.eng.retrieve(tokens, kvcaches=out)
    assert int(mask.sum()) == 4 * CH
    assert torch.equal(out.view(torch.uint8), kv.view(torch.uint8))
    s = e.plugin.stats()
    # 4 chunks written from LMCache's own memory objects, 4 read into fresh ones: no copy; the
    # reads from the registered (fixed) buffers (a new block file is one writev of header and
    # payload, which takes no fixed buffer).
    assert (s["puts_zero_copy"], s["puts_packed"], s["gets_hit"]) == (4, 0, 4)
    assert (s["blocks_stored"], s["blocks_loaded"], s["fixed_buffer_ios"]) == (4, 4, 4)
    ns = e.plugin.namespace_dirs[0]
    cfg = json.load(open(os.path.join(ns, "config.json")))
    assert (cfg["format"], cfg["model_name"], cfg["chunk_size"], cfg["block_bytes"]) == (
        "pykvtier-lmcache", "org/model", CH, CHUNK_BYTES)


def test_local_cpu_tier_above_then_the_plugin_serves_after_l1_is_cleared(engine):
    e = engine(local_cpu=True)
    tokens = torch.arange(3 * CH)
    kv = torch.randn(L, 2, 3 * CH, H * D).to(torch.bfloat16)
    e.eng.store(tokens, kvcaches=kv)
    e.plugin._shards.drain()
    e.sm.clear(locations=["LocalCPUBackend"])
    out = torch.zeros_like(kv)
    assert int(e.eng.retrieve(tokens, kvcaches=out).sum()) == 3 * CH
    assert torch.equal(out.view(torch.uint8), kv.view(torch.uint8))
    assert e.plugin.stats()["gets_hit"] == 3


def test_batched_contains_is_a_prefix_count(engine):
    e = engine()
    keys = [e.key(i) for i in range(4)]
    e.put([keys[0], keys[1], keys[3]], [0, 1, 3])
    assert e.plugin.batched_contains(keys) == 2
    assert e.plugin.batched_contains(keys[3:]) == 1
    assert e.plugin.batched_contains([keys[2], keys[3]]) == 0
    assert [e.plugin.contains(k) for k in keys] == [True, True, False, True]
    assert e.plugin.exists_in_put_tasks(keys[0]) is False


def test_gets_are_byte_exact_and_a_missing_chunk_is_none(engine):
    e = engine()
    keys = [e.key(i) for i in range(3)]
    datas, _ = e.put(keys, [10, 11, 12])
    got = e.plugin.batched_get_blocking([keys[0], e.key(99), keys[2], keys[1]])
    assert got[1] is None
    for obj, data in zip([got[0], got[2], got[3]], [datas[0], datas[2], datas[1]]):
        assert torch.equal(as_bytes(obj), data)
        assert obj.meta.ref_count == 1  # the caller's reference, nothing else held
        obj.ref_count_down()
    one = e.plugin.get_blocking(keys[1])
    assert torch.equal(as_bytes(one), datas[1])
    one.ref_count_down()


def test_a_corrupt_file_is_a_miss_for_that_chunk_alone(engine, tmp_path):
    e = engine()
    keys = [e.key(i) for i in range(3)]
    datas, _ = e.put(keys, [20, 21, 22])
    tier = e.plugin._shards.tiers[0]
    path = tier.layout.block_path(__import__("pykvtier").layout.key_digest(keys[1].to_string().encode()))
    with open(path, "r+b") as f:
        f.seek(4096 + 1000)
        b = f.read(1)
        f.seek(4096 + 1000)
        f.write(bytes([b[0] ^ 0x40]))
    got = e.plugin.batched_get_blocking(keys)
    assert got[1] is None
    assert torch.equal(as_bytes(got[0]), datas[0]) and torch.equal(as_bytes(got[2]), datas[2])
    for o in (got[0], got[2]):
        o.ref_count_down()
    s = e.plugin.stats()
    assert (s["verify_failures"], s["quarantined"], s["gets_failed"], s["gets_hit"]) == (1, 1, 1, 2)
    assert [e.plugin.contains(k) for k in keys] == [True, False, True]
    assert e.plugin.batched_contains(keys) == 1


def test_restart_finds_the_chunks_in_process(engine, tmp_path):
    e = engine()
    keys = [e.key(i) for i in range(5)]
    datas, _ = e.put(keys, range(30, 35))
    e.close()
    e2 = engine()
    assert e2.plugin.batched_contains(keys) == 5
    got = e2.plugin.batched_get_blocking(keys)
    for obj, data in zip(got, datas):
        assert torch.equal(as_bytes(obj), data)
        obj.ref_count_down()


_RESTART_SCRIPT = r"""
import sys, torch
sys.path.insert(0, sys.argv[3])
from test_lmcache import Engine, CH, H, D, L
root, phase = sys.argv[1], sys.argv[2]
e = Engine(root, save_unfull_chunk=True)
assert e.plugin is not None
n = 4 * CH + 5  # 4 full chunks and a partial one (packed)
tokens = torch.arange(n)
g = torch.Generator().manual_seed(7)
kv = torch.randn(L, 2, n, H * D, generator=g).to(torch.bfloat16)
if phase == "store":
    e.eng.store(tokens, kvcaches=kv)
    # no wait: LMCache's own close order must drain the puts before the arena goes
else:
    assert e.eng.lookup(tokens) == n, e.eng.lookup(tokens)
    out = torch.zeros_like(kv)
    assert int(e.eng.retrieve(tokens, kvcaches=out).sum()) == n
    assert torch.equal(out.view(torch.uint8), kv.view(torch.uint8))
    s = e.plugin.stats()
    assert (s["gets_hit"], s["blocks_loaded"]) == (5, 5), s
    print("retrieved", n)
if phase == "store":
    s = e.plugin.stats()
    print("puts", s["puts_zero_copy"], s["puts_packed"])
e.close()
"""


def test_restart_across_processes_with_a_partial_chunk_and_lmcache_close_order(tmp_path):
    # LMCache's chunk hashes use Python's builtin hash without vLLM: fixed PYTHONHASHSEED, as
    # LMCache itself asks for in production.
    env = dict(os.environ, PYTHONHASHSEED="0", LMCACHE_LOG_LEVEL="WARNING")
    here = os.path.dirname(__file__)
    root = str(tmp_path / "kv")
    for phase, want in (("store", "puts 4 1"), ("load", "retrieved 69")):
        p = subprocess.run([sys.executable, "-P", "-c", _RESTART_SCRIPT, root, phase, here],
                           capture_output=True, text=True, env=env, timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr[-4000:]
        assert want in p.stdout, p.stdout
    assert len(block_files(root)) == 5


def test_futures_and_callback_report_each_put_exactly_once(engine):
    e = engine()
    keys = [e.key(i) for i in range(4)]
    called = []
    _, futs = e.put(keys, range(40, 44), on_complete_callback=called.append)
    assert [f.result(timeout=10) for f in futs] == [True] * 4
    assert called == keys or sorted(map(str, called)) == sorted(map(str, keys))
    assert len(called) == 4
    # Keys already stored are skipped: no future, no callback, no write.
    _, futs2 = e.put(keys, range(40, 44), on_complete_callback=called.append)
    assert futs2 is None and len(called) == 4
    s = e.plugin.stats()
    assert (s["blocks_stored"], s["puts_skipped_present"]) == (4, 4)


def test_a_raising_callback_is_logged_and_the_put_still_counts(engine, caplog):
    e = engine()

    def boom(key):
        raise RuntimeError("callback bug")

    with caplog.at_level(logging.ERROR, logger="pykvtier"):
        _, futs = e.put([e.key(0)], [1], on_complete_callback=boom)
    assert futs[0].result(timeout=10) is True
    assert "LMCache put callback" in caplog.text
    assert e.plugin.contains(e.key(0))


def test_eviction_under_capacity_keeps_pinned_chunks(engine):
    file_bytes = CHUNK_BYTES + 4096
    e = engine(capacity_bytes=3 * file_bytes)
    keys = [e.key(i) for i in range(6)]
    e.put(keys[:3], [0, 1, 2])
    assert e.plugin.pin(keys[0]) is True
    assert e.plugin.pin(e.key(77)) is False
    e.put(keys[3:5], [3, 4])  # needs two evictions: keys 1 and 2 (key 0 is pinned)
    assert [e.plugin.contains(k) for k in keys[:5]] == [True, False, False, True, True]
    assert e.plugin.stats()["used_bytes"] <= 3 * file_bytes
    assert e.plugin.unpin(keys[0]) is True
    assert e.plugin.unpin(keys[0]) is False  # only what this plug-in pinned
    e.put(keys[5:], [5])  # key 0 is the least recently used now
    assert [e.plugin.contains(k) for k in keys] == [False, False, False, True, True, True]


def test_lookup_pin_then_every_tier_unpins(engine):
    e = engine()
    keys = [e.key(i) for i in range(2)]
    e.put(keys, [0, 1])
    assert e.plugin.batched_contains(keys, pin=True) == 2
    assert e.plugin.remove(keys[0]) is False  # pinned by a lookup
    assert e.plugin.unpin(keys[0]) and e.plugin.unpin(keys[1])
    assert e.plugin.remove(keys[0]) is True


def test_remove_unlinks_the_file(engine, tmp_path):
    e = engine()
    keys = [e.key(i) for i in range(2)]
    e.put(keys, [0, 1])
    assert e.plugin.remove(keys[0]) is True
    assert e.plugin.remove(keys[0]) is False
    assert e.plugin.contains(keys[0]) is False and e.plugin.contains(keys[1]) is True
    e.plugin._shards.drain()
    with e.plugin._shards.cv:
        e.plugin._shards.tiers[0].get_finished_jobs()
    e.close()  # (shutdown waits for the unlink)
    assert len(block_files(str(tmp_path / "kv"))) == 1
    assert e.plugin.stats()["puts_zero_copy"] == 2


def test_concurrent_puts_and_gets_from_threads(engine):
    e = engine()
    n_writers, per = 2, 24
    stored: dict[int, torch.Tensor] = {}
    lock = threading.Lock()
    errors = []

    def writer(w):
        try:
            for i in range(per):
                k = w * 1000 + i
                (data,), _ = e.put([e.key(k)], [k])
                with lock:
                    stored[k] = data
        except Exception as exc:  # reported below
            errors.append(exc)

    def reader():
        try:
            checked = 0
            while checked < n_writers * per:
                with lock:
                    ks = sorted(stored)
                got = e.plugin.batched_get_blocking([e.key(k) for k in ks])
                for k, obj in zip(ks, got):
                    assert obj is not None, k
                    assert torch.equal(as_bytes(obj), stored[k]), k
                    obj.ref_count_down()
                checked = len(ks)
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(n_writers)]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert e.plugin.stats()["blocks_stored"] == n_writers * per


def test_unknown_option_is_named_and_lmcache_runs_without_the_plugin(tmp_path, caplog):
    with caplog.at_level(logging.ERROR, logger="pykvtier"):
        e = Engine(str(tmp_path / "kv"), capacity=5)
    try:
        assert e.plugin is None  # LMCache's launcher swallowed the error...
        # ... which pykvtier logged with the key named
        assert "unknown option storage_plugin.pykvtier.capacity" in caplog.text
        lcb = e.sm.storage_backends["LocalCPUBackend"]
        with pytest.raises(ValueError, match=r"unknown option storage_plugin\.pykvtier\.capacity "
                                             r"in LMCache's extra_config; accepted: "
                                             r"storage_plugin\.pykvtier\.root_dir, "):
            PyKVTierStoragePlugin(config=e.config, dst_device="cpu", metadata=e.meta,
                                  local_cpu_backend=lcb, loop=e.sm.loop)
    finally:
        e.close()


def test_plugin_under_another_name_reads_its_own_prefix(engine, tmp_path):
    e = engine(name="nvme", capacity_bytes=1 << 30)
    assert e.plugin.name == "nvme"
    assert e.plugin.options.capacity_bytes == 1 << 30
    e.put([e.key(0)], [0])
    assert e.plugin.contains(e.key(0))


def test_a_locked_root_is_named(engine, tmp_path):
    e = engine()
    e2 = Engine(str(tmp_path / "kv"))
    try:
        assert e2.plugin is None
        with pytest.raises(ValueError, match=r"root '.*' is in use by pid \d+"):
            PyKVTierStoragePlugin(config=e2.config, dst_device="cpu", metadata=e2.meta,
                                  local_cpu_backend=e2.sm.storage_backends["LocalCPUBackend"],
                                  loop=e2.sm.loop)
    finally:
        e2.close()
    assert e.plugin.contains(e.key(0)) is False


def test_models_and_workers_get_their_own_namespaces(engine, tmp_path):
    a = engine(model="org/a")
    b = engine(model="org/b")
    w1 = engine(model="org/a", worker_id=1)
    dirs = {a.plugin.namespace_dirs[0], b.plugin.namespace_dirs[0], w1.plugin.namespace_dirs[0]}
    assert len(dirs) == 3
    assert all(os.path.dirname(d) == str(tmp_path / "kv" / "pykvtier-lmcache") for d in dirs)


def test_several_roots_shard_the_chunks(engine, tmp_path):
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    e = engine(root=None, **{}) if False else Engine(roots, capacity_bytes=64 * (CHUNK_BYTES + 4096))
    try:
        assert e.plugin is not None
        keys = [e.key(i) for i in range(16)]
        datas, _ = e.put(keys, range(16))
        per_root = [len(block_files(r)) for r in roots]
        assert sum(per_root) == 16 and min(per_root) > 0
        got = e.plugin.batched_get_blocking(keys)
        for obj, data in zip(got, datas):
            assert torch.equal(as_bytes(obj), data)
            obj.ref_count_down()
    finally:
        e.close()


def test_keys_must_be_cache_engine_keys(engine):
    e = engine()
    with pytest.raises(TypeError, match="keys must be LMCache CacheEngineKeys, not int"):
        e.plugin.contains(5)
