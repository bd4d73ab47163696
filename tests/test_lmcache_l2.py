"""PyKVTierL2Adapter under LMCache 0.5.6's own classes (marked ``lmcache``; skipped without
LMCache).

The adapter is built as LMCache's multiprocess server builds an ``--l2-adapter`` of type
"plugin": the JSON parsed by LMCache's own argument parser, then LMCache's factory
(``create_l2_adapter``) with the ``L1MemoryDesc`` of a real L1 memory manager
(``L1MemoryManager``: LMCache's MixedMemoryAllocator over one host arena, on CPU). It is driven
as LMCache's store and prefetch controllers drive it: submit, wait on the task category's
eventfd with poll(), then pop / query the result. Memory objects come from that L1 manager;
every load is compared byte for byte with what was stored.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import select
import threading
import time

import pytest

pytestmark = pytest.mark.lmcache

try:
    import torch
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.distributed.config import L1MemoryManagerConfig
    from lmcache.v1.distributed.internal_api import L2StoreResult
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import (
        add_l2_adapters_args, parse_args_to_l2_adapters_config)
    from lmcache.v1.distributed.memory_manager.l1_memory_manager import L1MemoryManager
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
    from lmcache.v1.platform import consume_fd

    from pykvtier.integrations.lmcache_l2 import PyKVTierL2Adapter, object_key_bytes
except ImportError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"LMCache is not installed ({exc}); scripts/setup.sh installs it "
                "(requirements-lmcache.txt)", allow_module_level=True)

MODEL = "org/model-7b"
SHAPE = torch.Size([2, 4, 16, 128])  # a 32 KiB bf16 chunk
LAYOUT = MemoryLayoutDesc([SHAPE], [torch.bfloat16])
OBJ = 2 * 4 * 16 * 128 * 2
SMALL = MemoryLayoutDesc([torch.Size([3, 5, 7])], [torch.float32])  # 420 bytes (a 4 KiB page)
SMALL_OBJ = 3 * 5 * 7 * 4
FILE = OBJ + 4096  # a block file: payload + header
WAIT_S = 30.0  # deadline of one eventfd wait (a hang fails the test; nothing sleeps)


def l2_json(root, **params):
    return json.dumps({"type": "plugin", "module_path": "pykvtier.integrations.lmcache_l2",
                       "class_name": "PyKVTierL2Adapter",
                       "adapter_params": {"root_dir": str(root), "min_free_bytes": 0, **params}})


def build(l1, root, **params):
    """The adapter as LMCache's MP server builds ``--l2-adapter <JSON>``."""
    parser = argparse.ArgumentParser()
    add_l2_adapters_args(parser)
    args = parser.parse_args(["--l2-adapter", l2_json(root, **params)])
    (cfg,) = parse_args_to_l2_adapters_config(args).adapters
    adapter = create_l2_adapter(cfg, l1.get_l1_memory_desc())
    assert type(adapter) is PyKVTierL2Adapter
    return adapter


@pytest.fixture
def l1():
    m = L1MemoryManager(L1MemoryManagerConfig(size_in_bytes=8 << 20, use_lazy=False, shm_name=""))
    yield m
    m.close()


def alloc(l1, n, layout=LAYOUT):
    err, objs = l1.allocate(layout, n)
    assert str(err) == "L1Error.SUCCESS" and len(objs) == n
    return objs


def key(i, model=MODEL, salt=""):
    return ObjectKey(chunk_hash=i.to_bytes(8, "big") + b"\x5a" * 8, model_name=model, kv_rank=0,
                     cache_salt=salt)


def fill(objs, seed):
    """Random bytes in each object (its logical size); returns them."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for o in objs:
        data = torch.randint(0, 256, (o.get_size(),), dtype=torch.uint8, generator=g).numpy().tobytes()
        ctypes.memmove(o.data_ptr, data, len(data))
        out.append(data)
    return out


def read(o):
    return ctypes.string_at(o.data_ptr, o.get_size())


def wait_fd(fd, done):
    """poll() ``fd`` (consuming its signal) until ``done()`` returns non-None; returns it."""
    deadline = time.monotonic() + WAIT_S
    p = select.poll()
    p.register(fd, select.POLLIN)
    while True:
        got = done()
        if got is not None:
            return got
        left = deadline - time.monotonic()
        assert left > 0, "no completion signalled on the eventfd"
        if p.poll(left * 1000):
            consume_fd(fd)


def store(a, keys, objs):
    tid = a.submit_store_task(keys, objs)
    res = {}

    def done():
        res.update(a.pop_completed_store_tasks())
        return res.get(tid)
    r = wait_fd(a.get_store_event_fd(), done)
    assert set(res) == {tid}
    return r


def lookup(a, keys):
    tid = a.submit_lookup_and_lock_task(keys, {})
    bm = wait_fd(a.get_lookup_and_lock_event_fd(), lambda: a.query_lookup_and_lock_result(tid))
    assert a.query_lookup_and_lock_result(tid) is None  # (returned once)
    return bm.get_indices_list()


def load(a, keys, objs):
    tid = a.submit_load_task(keys, objs)
    bm = wait_fd(a.get_load_event_fd(), lambda: a.query_load_result(tid))
    assert a.query_load_result(tid) is None
    return bm.get_indices_list()


class Listener:
    def __init__(self):
        self.stored, self.accessed, self.deleted = [], [], []

    def on_l2_keys_stored(self, keys, sizes):
        self.stored += list(zip(keys, sizes))

    def on_l2_keys_accessed(self, keys):
        self.accessed += keys

    def on_l2_keys_deleted(self, keys):
        self.deleted += keys


def block_file(a, k, nbytes=OBJ):
    space = a._namespaces[(k.model_name, nbytes)]
    tier, d = space.shards.tier_of(object_key_bytes(k))
    return str(tier.layout.block_path(d))


def test_store_lookup_load_zero_copy(l1, tmp_path):
    a = build(l1, tmp_path)
    try:
        lis = Listener()
        a.register_listener(lis)
        fds = {a.get_store_event_fd(), a.get_lookup_and_lock_event_fd(), a.get_load_event_fd()}
        assert len(fds) == 3
        keys = [key(i) for i in range(6)]
        objs = alloc(l1, 6)
        data = fill(objs, 1)
        r = store(a, keys, objs)
        assert isinstance(r, L2StoreResult) and r.is_successful() and r.bytes_transferred() == 6 * OBJ
        assert lis.stored == [(k, OBJ) for k in keys]
        st = a.stats()
        assert (st["stores_zero_copy"], st["stores_refused"], st["stores_failed"]) == (6, 0, 0)
        # present/absent mix, and another model's key of the same hash
        q = [keys[0], keys[1], key(100), keys[2], key(0, model="other/model"), keys[5]]
        assert lookup(a, q) == [0, 1, 3, 5]
        fresh = alloc(l1, 4)
        assert load(a, [keys[0], keys[1], keys[2], keys[5]], fresh) == [0, 1, 2, 3]
        assert [read(o) for o in fresh] == [data[0], data[1], data[2], data[5]]
        assert lis.accessed == [keys[0], keys[1], keys[2], keys[5]]
        a.submit_unlock([keys[0], keys[1], keys[2], keys[5]])
        assert all(not s.pins for s in a._namespaces.values())
        # storing them again: skipped, successful, no bytes written
        r = store(a, keys, objs)
        assert r.is_successful() and r.bytes_transferred() == 0
        assert a.stats()["stores_skipped_present"] == 6
        u = a.get_usage()
        assert (u.total_bytes_used, u.total_capacity_bytes, dict(u.bytes_by_cache_salt)) == (
            6 * OBJ, 0, {"": 6 * OBJ})
        assert [n for n in os.listdir(tmp_path / "pykvtier-lmcache-l2") if n != ".pykvtier.lock"] == [
            os.path.basename(a._namespaces[(MODEL, OBJ)].dirs[0])]
    finally:
        a.close()


def test_corrupt_block_fails_only_its_key(l1, tmp_path):
    a = build(l1, tmp_path)
    try:
        keys = [key(i) for i in range(3)]
        objs = alloc(l1, 3)
        data = fill(objs, 2)
        assert store(a, keys, objs).bytes_transferred() == 3 * OBJ
        with open(block_file(a, keys[1]), "r+b") as f:
            f.seek(4096 + 1000)
            b = f.read(1)
            f.seek(4096 + 1000)
            f.write(bytes([b[0] ^ 0xFF]))
        assert lookup(a, keys) == [0, 1, 2]
        fresh = alloc(l1, 3)
        assert load(a, keys, fresh) == [0, 2]
        assert (read(fresh[0]), read(fresh[2])) == (data[0], data[2])
        a.submit_unlock(keys)
        assert lookup(a, keys) == [0, 2]  # quarantined: absent now
        a.submit_unlock([keys[0], keys[2]])
        assert a.stats()["loads_failed"] == 1
    finally:
        a.close()


def test_restart_finds_blocks(l1, tmp_path):
    roots = [str(tmp_path / "d0"), str(tmp_path / "d1")]
    a = build(l1, tmp_path, root_dir=roots)
    keys = [key(i, salt="u1") for i in range(8)]
    objs = alloc(l1, 8)
    data = fill(objs, 3)
    small_keys = [key(50 + i) for i in range(2)]
    small = alloc(l1, 2, SMALL)
    small_data = fill(small, 4)
    assert store(a, keys + small_keys, objs + small).bytes_transferred() == 8 * OBJ + 2 * SMALL_OBJ
    spread = [sum(t.num_blocks for t in s.shards.tiers[i:i + 1]) for s in a._namespaces.values()
              for i in range(2)]
    a.close()
    assert sum(spread) == 10 and 0 not in spread[:2]  # (the 8 big blocks on both roots)
    b = build(l1, tmp_path, root_dir=roots)
    try:
        assert sorted(b._namespaces) == [(MODEL, SMALL_OBJ), (MODEL, OBJ)]
        assert lookup(b, keys + small_keys + [key(3)]) == list(range(10))  # key(3): no salt
        fresh, fresh_small = alloc(l1, 8), alloc(l1, 2, SMALL)
        assert load(b, keys + small_keys, fresh + fresh_small) == list(range(10))
        assert [read(o) for o in fresh + fresh_small] == data + small_data
        b.submit_unlock(keys + small_keys)
        assert b.get_usage().total_bytes_used == 8 * OBJ + 2 * SMALL_OBJ
    finally:
        b.close()


def test_objects_of_other_sizes_and_outside_the_arena(l1, tmp_path):
    a = build(l1, tmp_path)
    try:
        big, small = alloc(l1, 1), alloc(l1, 1, SMALL)
        fill(big, 5)
        small_data = fill(small, 6)
        kb, ks = key(1), key(2)
        assert store(a, [kb, ks], big + small).bytes_transferred() == OBJ + SMALL_OBJ
        # a load into an object of another size than the key's block: that bit false
        wrong_big, wrong_small = alloc(l1, 1, SMALL), alloc(l1, 1)
        assert load(a, [kb, ks], wrong_big + wrong_small) == []
        right = alloc(l1, 1, SMALL)
        assert load(a, [ks], right) == [0] and read(right[0]) == small_data[0]
        # an object outside LMCache's L1 arena: refused visibly
        raw = torch.zeros(OBJ, dtype=torch.uint8)
        outside = TensorMemoryObj(raw, MemoryObjMetadata(
            shape=torch.Size([OBJ]), dtype=torch.uint8, address=raw.data_ptr(), phy_size=OBJ,
            fmt=MemoryFormat.KV_2LTD, ref_count=1), parent_allocator=None)
        r = store(a, [key(3), key(4)], [outside, alloc(l1, 1)[0]])
        assert not r.is_successful() and int(r) == -1
        assert lookup(a, [key(3), key(4)]) == [1]  # the other key of the task was stored
        a.submit_unlock([key(4)])
        assert load(a, [kb], [outside]) == []
        st = a.stats()
        assert (st["stores_refused"], st["loads_refused"]) == (1, 1)
    finally:
        a.close()


def test_locked_key_survives_eviction(l1, tmp_path):
    a = build(l1, tmp_path, capacity_bytes=4 * FILE)
    try:
        lis = Listener()
        a.register_listener(lis)
        objs = alloc(l1, 1)
        data = {}
        keys = [key(i) for i in range(9)]
        data[0] = fill(objs, 10)[0]
        assert store(a, keys[:1], objs).is_successful()
        assert lookup(a, keys[:1]) == [0]  # locked
        for i in range(1, 9):
            data[i] = fill(objs, 10 + i)[0]
            assert store(a, [keys[i]], objs).bytes_transferred() == OBJ
        assert lookup(a, keys) == [0, 6, 7, 8]  # key 0 locked twice now
        assert sorted(k.chunk_hash[:8] for k in lis.deleted) == [
            i.to_bytes(8, "big") for i in range(1, 6)]
        fresh = alloc(l1, 4)
        assert load(a, [keys[0], keys[6], keys[7], keys[8]], fresh) == [0, 1, 2, 3]
        assert [read(o) for o in fresh] == [data[0], data[6], data[7], data[8]]
        a.submit_unlock([keys[0], keys[6], keys[7], keys[8]])
        a.submit_unlock([keys[0]])  # the first lookup's lock
        a.submit_unlock([keys[0], key(99)])  # more unlocks than locks: ignored
        u = a.get_usage()
        assert (u.total_bytes_used, u.total_capacity_bytes, dict(u.bytes_by_cache_salt)) == (
            4 * OBJ, 4 * FILE, {"": 4 * OBJ})
        for i in range(9, 13):  # unlocked: evicted like any other block now
            fill(objs, 10 + i)
            assert store(a, [key(i)], objs).is_successful()
        assert lookup(a, keys[:1]) == []
    finally:
        a.close()


def test_delete(l1, tmp_path):
    a = build(l1, tmp_path)
    try:
        lis = Listener()
        a.register_listener(lis)
        keys = [key(i) for i in range(3)]
        assert store(a, keys, alloc(l1, 3)).is_successful()
        assert lookup(a, [keys[1]]) == [0]
        a.delete([keys[0], keys[1], key(77)])  # keys[1] is locked: it stays
        assert lis.deleted == [keys[0]]
        assert lookup(a, keys) == [1, 2]
        a.submit_unlock([keys[1], keys[1], keys[2]])
        a.delete([keys[1]])
        assert lis.deleted == [keys[0], keys[1]]
        assert lookup(a, keys) == [2]
        a.submit_unlock([keys[2]])
        assert a.get_usage().total_bytes_used == OBJ
        assert dict(a.get_usage().bytes_by_cache_salt) == {"": OBJ}
    finally:
        a.close()


def test_options_errors(l1, tmp_path):
    with pytest.raises(ValueError) as e:
        build(l1, tmp_path, bogus=1, capacity=2)
    assert str(e.value) == (
        "PyKVTierL2Adapter: unknown options bogus, capacity in adapter_params; accepted: "
        "root_dir, capacity_bytes, shared, engine, queue_depth, max_inflight_bytes, direct, "
        "fsync, mode, min_free_bytes, probe_ttl_s, verify")
    with pytest.raises(ValueError, match=r"^PyKVTierL2Adapter: capacity_bytes must be a "
                                         r"positive integer, got -1$"):
        build(l1, tmp_path, capacity_bytes=-1)
    with pytest.raises(ValueError, match="adapter_params.root_dir is required"):
        PyKVTierL2Adapter({}, l1_memory_desc=l1.get_l1_memory_desc())
    with pytest.raises(ValueError, match="built without l1_memory_desc"):
        PyKVTierL2Adapter({"root_dir": str(tmp_path)})
    assert not os.path.exists(tmp_path / "pykvtier-lmcache-l2")


def test_close_drains_and_refuses_later_calls(l1, tmp_path):
    a = build(l1, tmp_path)
    keys = [key(i) for i in range(40)]
    objs = alloc(l1, 40)
    data = fill(objs, 7)
    tid = a.submit_store_task(keys, objs)
    a.close()  # at once: waits for the task
    assert a.pop_completed_store_tasks() == {tid: 40 * OBJ}
    a.close()  # idempotent
    with pytest.raises(RuntimeError, match="PyKVTierL2Adapter is closed"):
        a.submit_load_task(keys[:1], objs[:1])
    b = build(l1, tmp_path)
    try:
        assert lookup(b, keys) == list(range(40))
        fresh = alloc(l1, 40)
        assert load(b, keys, fresh) == list(range(40))
        assert [read(o) for o in fresh] == data
        b.submit_unlock(keys)
    finally:
        b.close()


def test_controller_threads_concurrently(l1, tmp_path):
    """A store thread and a prefetch thread (lookup, load, unlock), as LMCache's controllers."""
    a = build(l1, tmp_path)
    try:
        n, batch = 48, 4
        keys = [key(i) for i in range(n)]
        src = alloc(l1, n)
        data = fill(src, 8)
        stored = threading.Event()
        errors = []

        def storer():
            try:
                for i in range(0, n, batch):
                    assert store(a, keys[i:i + batch], src[i:i + batch]).bytes_transferred() == batch * OBJ
            except BaseException as exc:
                errors.append(exc)
            finally:
                stored.set()

        loaded = {}

        def prefetcher():
            try:
                dst = alloc(l1, batch)
                while len(loaded) < n:
                    done = stored.is_set()
                    for i in range(0, n, batch):
                        ks = keys[i:i + batch]
                        hit = lookup(a, ks)
                        if hit:
                            assert load(a, [ks[j] for j in hit], dst[:len(hit)]) == list(range(len(hit)))
                            for j, o in zip(hit, dst):
                                loaded[i + j] = read(o)
                            a.submit_unlock([ks[j] for j in hit])
                    if done:
                        break
            except BaseException as exc:
                errors.append(exc)

        ts = [threading.Thread(target=storer), threading.Thread(target=prefetcher)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert errors == []
        assert sorted(loaded) == list(range(n))
        assert all(loaded[i] == data[i] for i in range(n))
        assert all(not s.pins for s in a._namespaces.values())
    finally:
        a.close()


def test_shared_roots_probe_on_the_lookup_worker(l1, tmp_path):
    """Two servers sharing a root (shared: true): blocks one stored, in a namespace made after
    the other started, are found by the other's lookups (probed on its worker thread)."""
    a = build(l1, tmp_path, shared=True)
    b = build(l1, tmp_path, shared=True, probe_ttl_s=0)
    try:
        keys = [key(i) for i in range(3)]
        objs = alloc(l1, 3)
        data = fill(objs, 9)
        assert store(a, keys, objs).bytes_transferred() == 3 * OBJ
        assert b._namespaces == {}
        assert lookup(b, keys + [key(9)]) == [0, 1, 2]
        fresh = alloc(l1, 3)
        assert load(b, keys, fresh) == [0, 1, 2]
        assert [read(o) for o in fresh] == data
        b.submit_unlock(keys)
    finally:
        b.close()
        a.close()


def test_l1_in_posix_shared_memory(tmp_path):
    """LMCache's MP server puts L1 in POSIX shared memory by default: moved by address too."""
    m = L1MemoryManager(L1MemoryManagerConfig(size_in_bytes=4 << 20, use_lazy=False,
                                              shm_name=f"pykvtier_test_{os.getpid()}"))
    try:
        assert m.get_l1_memory_desc().stable_registration_size is None  # (SHM-backed)
        a = build(m, tmp_path)
        try:
            keys = [key(i) for i in range(4)]
            objs = alloc(m, 4)
            data = fill(objs, 11)
            assert store(a, keys, objs).bytes_transferred() == 4 * OBJ
            assert lookup(a, keys) == [0, 1, 2, 3]
            fresh = alloc(m, 4)
            assert load(a, keys, fresh) == [0, 1, 2, 3]
            assert [read(o) for o in fresh] == data
            a.submit_unlock(keys)
            assert a.stats()["stores_zero_copy"] == 4
        finally:
            a.close()
    finally:
        m.close()


def test_a_store_of_something_not_a_memory_obj_is_a_type_error_and_no_task(l1, tmp_path):
    """objects[i] that is no MemoryObj: TypeError naming it, and no task result recorded (the
    caller got no task id); the next store's result is the only one."""
    a = build(l1, tmp_path)
    try:
        for bad in (None, 5):
            with pytest.raises(TypeError, match=r"^PyKVTierL2Adapter: objects\[1\] must be an "
                                                r"LMCache MemoryObj"):
                a.submit_store_task([key(0), key(1)], [alloc(l1, 1)[0], bad])
        assert a.pop_completed_store_tasks() == {}
        objs = alloc(l1, 1)
        fill(objs, 3)
        assert store(a, [key(2)], objs) == OBJ
    finally:
        a.close()


def test_a_second_unshared_adapter_on_a_root_is_refused_at_construction(l1, tmp_path):
    """Even on an empty root (no namespace yet), a second adapter without shared is refused
    by name when it is built, not at its first store; shared ones share; close lets go."""
    a = build(l1, tmp_path)
    try:
        with pytest.raises(ValueError, match=r"^PyKVTierL2Adapter: root '.*' is in use by pid "
                                             rf"{os.getpid()}: .*pykvtier-lmcache-l2 is locked"):
            build(l1, tmp_path)
        with pytest.raises(ValueError, match="is in use by pid"):
            build(l1, tmp_path, shared=True)
    finally:
        a.close()
    b = build(l1, tmp_path)  # released by close()
    b.close()
    s1, s2 = (build(l1, tmp_path, shared=True, probe_ttl_s=0) for _ in range(2))
    try:
        objs = alloc(l1, 1)
        fill(objs, 4)
        assert store(s1, [key(0)], objs) == OBJ
        assert lookup(s2, [key(0)]) == [0]
    finally:
        s1.close()
        s2.close()


def test_a_shared_server_finds_a_model_another_server_made_after_it_started(l1, tmp_path):
    """B (shared, default probe_ttl_s) was built before A made the model's namespace: B's first
    lookup of that model looks for it at once instead of answering absent for probe_ttl_s."""
    a = build(l1, tmp_path, shared=True)
    b = build(l1, tmp_path, shared=True)
    try:
        objs = alloc(l1, 3)
        data = fill(objs, 8)
        assert store(a, [key(i) for i in range(3)], objs) == 3 * OBJ
        assert lookup(b, [key(i) for i in range(4)]) == [0, 1, 2]
        fresh = alloc(l1, 3)
        assert load(b, [key(i) for i in range(3)], fresh) == [0, 1, 2]
        assert [read(o) for o in fresh] == data
    finally:
        a.close()
        b.close()
