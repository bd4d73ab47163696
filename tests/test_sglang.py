"""PyKVTierHiCache under SGLang 0.5.23's own classes (marked ``sglang``; skipped without SGLang).

The backend is built by SGLang's ``StorageBackendFactory`` from the extra config a user passes
to ``--hicache-storage-backend-extra-config``, and moves pages of SGLang's real host pools
(``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``, built over SGLang's own device pools on
"cpu"; ``pin_memory=False``, since pinning needs CUDA). One test drives it through SGLang's
``HybridCacheController`` (the controller serving builds for a plain model), its threads and
queues included. Every page read is compared byte for byte (as uint8: random bf16 bytes hold
NaNs) with what was written.
"""

from __future__ import annotations

import glob
import os
import threading
import time

import pytest

import sglang_torchvision_stub  # (tests/ is on sys.path, as for conftest)

pytestmark = pytest.mark.sglang

sglang_torchvision_stub.install()
try:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from pykvtier.integrations.sglang import PyKVTierHiCache
except ImportError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"SGLang is not installed ({exc}); scripts/setup.sh installs it "
                "(requirements-sglang.txt)", allow_module_level=True)

P = 16  # tokens per page
L, H, D = 2, 2, 32  # MHA: one page's K (or V) is P*L*H*D*2 = 4096 bytes (bf16)
KV_LORA, ROPE = 24, 8  # MLA: kv_cache_dim 32, a page P*L*32*2 = 2048 bytes per layer pair
MLA_L = 4  # MLA layers: a page is 4096 bytes


def extra(root, **options):
    return {"backend_name": "pykvtier", "module_path": "pykvtier.integrations.sglang",
            "class_name": "PyKVTierHiCache", "interface_v1": 1, "root_dir": root, **options}


def storage_config(extra_config, *, mla=False, tp_rank=0, tp_size=1, model="org/model",
                   layout="page_first"):
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=True,
        is_page_first_layout=layout == "page_first", model_name=model,
        extra_config=dict(extra_config))


def mha_host(layout, tokens=2048):
    dev = MHATokenToKVPool(tokens, P, torch.bfloat16, H, D, L, "cpu", False, start_layer=0,
                           end_layer=L - 1)
    host = MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, P, layout,
                                pin_memory=False, device_capacity_tokens=dev.size,
                                start_layer=0, end_layer=L - 1)
    return dev, host


def mla_host(layout, tokens=2048):
    dev = MLATokenToKVPool(tokens, P, torch.bfloat16, KV_LORA, ROPE, MLA_L, "cpu", False,
                           start_layer=0, end_layer=MLA_L - 1)
    host = MLATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, P, layout,
                                pin_memory=False, device_capacity_tokens=dev.size,
                                start_layer=0, end_layer=MLA_L - 1, target_layer_num=MLA_L)
    return dev, host


def fill_random(host, seed):
    flat = host.kv_buffer.view(-1).view(torch.uint8)
    g = torch.Generator().manual_seed(seed)
    flat.copy_(torch.randint(0, 256, (flat.numel(),), dtype=torch.uint8, generator=g))


def page(host, first_slot):
    return host.get_data_page(int(first_slot), flat=True).reshape(-1).view(torch.uint8).clone()


def build(host, root, *, mla=False, tp_rank=0, tp_size=1, model="org/model", **options):
    """The backend as SGLang's attach makes it: factory, then the pool registration calls."""
    sc = storage_config(extra(root, **options), mla=mla, tp_rank=tp_rank, tp_size=tp_size,
                        model=model, layout=host.layout)
    backend = StorageBackendFactory.create_backend("dynamic", sc, host)
    backend.register_mem_pool_host(host)
    backend.register_mem_host_pool_v2(host, "kv")
    backend.on_host_pools_registered()
    return backend


def keys_of(n, tag="k"):
    return [f"{tag}{i:063x}"[-64:] for i in range(n)]


def scattered(host, npages):
    """Token slots of ``npages`` pages, not contiguous and not in order."""
    idx = host.alloc(2 * npages * P).reshape(-1, P)
    picked = idx[torch.arange(2 * npages - 1, -1, -2)]  # every other page, backwards
    return picked.reshape(-1)


@pytest.fixture
def backends():
    made = []
    yield made
    for b in made:
        b.close()


LAYOUTS = [("mha", "page_first", True), ("mha", "page_first_direct", True),
           ("mha", "layer_first", False), ("mla", "page_first", True),
           ("mla", "layer_first", False)]


@pytest.mark.parametrize("kind,layout,zero_copy", LAYOUTS)
def test_v1_round_trip_byte_exact(root, backends, kind, layout, zero_copy):
    dev, host = (mha_host if kind == "mha" else mla_host)(layout)
    b = build(host, root, mla=kind == "mla")
    backends.append(b)
    assert isinstance(b, PyKVTierHiCache)
    assert b._geometry.zero_copy is zero_copy
    assert b._geometry.blocks_per_page == (2 if zero_copy and kind == "mha" else 1)
    fill_random(host, 7)
    src = scattered(host, 40)
    keys = keys_of(40)
    want = [page(host, t) for t in src[::P]]
    assert b.batch_set_v1(keys, src) == [True] * 40
    assert b.batch_exists(keys) == 40
    dst = scattered(host, 40)
    host.kv_buffer.view(-1).view(torch.uint8)[:] = 0  # nothing left to read back by accident
    assert b.batch_get_v1(keys, dst) == [True] * 40
    for t, w in zip(dst[::P], want):
        assert torch.equal(page(host, t), w)
    st = b.stats()
    per = b._geometry.blocks_per_page
    assert (st["blocks_stored"], st["blocks_loaded"]) == (40 * per, 40 * per)
    assert (st["pages_stored"], st["pages_loaded"]) == (40, 40)
    if zero_copy:  # the pool itself is the arena: loads read straight into it, fixed buffers
        assert st["fixed_buffer_ios"] >= 40 * per


def test_factory_refuses_unknown_and_missing_options(root):
    _, host = mha_host("page_first")
    with pytest.raises(ValueError, match=r"unknown option 'capacity'.*accepted: root_dir"):
        StorageBackendFactory.create_backend("dynamic", storage_config(extra(root, capacity=1)),
                                             host)
    bad = extra(root)
    del bad["root_dir"]
    with pytest.raises(ValueError, match="'root_dir' is required"):
        StorageBackendFactory.create_backend("dynamic", storage_config(bad), host)
    with pytest.raises(ValueError, match="queue_depth must be a positive integer, got 'x'"):
        StorageBackendFactory.create_backend(
            "dynamic", storage_config(extra(root, queue_depth="x")), host)
    # SGLang's own keys (and the one --file-storage-path injects) are not ours, and accepted
    b = PyKVTierHiCache(storage_config(extra(root, file_storage_path="/elsewhere",
                                             prefetch_threshold=64)), {})
    b.close()


def test_batch_exists_is_a_prefix_count(root, backends):
    _, host = mha_host("page_first")
    b = build(host, root)
    backends.append(b)
    fill_random(host, 1)
    keys = keys_of(10)
    src = host.alloc(10 * P)
    assert b.batch_set_v1(keys[:4] + keys[5:], torch.cat([src[:4 * P], src[5 * P:]])) == [True] * 9
    assert b.batch_exists(keys) == 4  # page 4 missing: the count stops there
    assert b.batch_exists(keys[5:]) == 5
    assert b.batch_exists([]) == 0
    assert b.exists(keys[3]) and not b.exists(keys[4])
    # zero copy: a page of an MHA model is two block files, its K and its V region
    assert len(glob.glob(os.path.join(b.namespace_dirs[0], "blocks", "*", "*"))) == 18


def test_corrupt_page_fails_alone_and_is_missing_after(root, backends):
    _, host = mla_host("page_first")
    b = build(host, root, mla=True)
    backends.append(b)
    fill_random(host, 3)
    keys = keys_of(6)
    src = host.alloc(6 * P)
    want = [page(host, t) for t in src[::P]]
    assert b.batch_set_v1(keys, src) == [True] * 6
    from pykvtier.layout import key_digest

    victim = b._tiers[0].layout.block_path(key_digest(keys[2].encode()))
    with open(victim, "r+b") as f:
        f.seek(4096 + 100)
        byte = f.read(1)
        f.seek(4096 + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    dst = host.alloc(6 * P)
    assert b.batch_get_v1(keys, dst) == [True, True, False, True, True, True]
    for i in (0, 1, 3, 4, 5):
        assert torch.equal(page(host, dst[i * P]), want[i])
    assert b.batch_exists(keys) == 2
    st = b.stats()
    assert (st["verify_failures"], st["quarantined"], st["pages_load_failed"]) == (1, 1, 1)


def test_restart_finds_the_pages(root):
    _, host = mha_host("page_first")
    b = build(host, root)
    fill_random(host, 5)
    keys = keys_of(12)
    src = host.alloc(12 * P)
    want = [page(host, t) for t in src[::P]]
    assert b.batch_set_v1(keys, src) == [True] * 12
    b.close()
    b2 = build(host, root)
    try:
        assert b2.batch_exists(keys) == 12
        dst = host.alloc(12 * P)
        assert b2.batch_get_v1(keys, dst) == [True] * 12
        assert all(torch.equal(page(host, t), w) for t, w in zip(dst[::P], want))
    finally:
        b2.close()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_legacy_tensor_path(root, backends, layout):
    _, host = mha_host(layout)
    b = build(host, root, interface_v1=0)
    backends.append(b)
    assert not b._geometry.zero_copy
    g = torch.Generator().manual_seed(11)
    vals = [torch.randint(-100, 100, host.get_dummy_flat_data_page().shape,
                          generator=g).to(torch.bfloat16) for _ in range(70)]
    keys = keys_of(70, "l")
    assert b.batch_set(keys, vals) is True  # 70 pages > one staging chunk (32)
    assert b.set(keys[0], vals[0]) is True  # present: not written again, still True
    targets = [host.get_dummy_flat_data_page() for _ in range(71)]
    got = b.batch_get(keys + ["0" * 64], targets)
    assert got[-1] is None
    for v, t, r in zip(vals, targets, got[:-1]):
        assert r is t and torch.equal(t.view(torch.uint8), v.view(torch.uint8))
    fresh = b.get(keys[5])
    assert torch.equal(fresh.view(torch.uint8), vals[5].view(torch.uint8))
    with pytest.raises(ValueError, match="page tensor of 2 bytes"):
        b.set("1" * 64, torch.zeros(1, dtype=torch.bfloat16))
    assert b.stats()["blocks_stored"] == 70


def test_legacy_methods_on_a_zero_copy_backend_say_what_to_do(root, backends):
    _, host = mha_host("page_first")
    b = build(host, root)
    backends.append(b)
    with pytest.raises(RuntimeError, match="zero_copy: false, or drop interface_v1"):
        b.batch_get(keys_of(1))


def test_v1_through_staging_when_zero_copy_is_off(root, backends):
    _, host = mha_host("page_first")
    b = build(host, root, zero_copy=False, staging_pages=4)
    backends.append(b)
    fill_random(host, 9)
    keys = keys_of(9)
    src = scattered(host, 9)
    want = [page(host, t) for t in src[::P]]
    assert b.batch_set_v1(keys, src) == [True] * 9  # in chunks of 1 slot, 2 in flight
    dst = scattered(host, 9)
    assert b.batch_get_v1(keys, dst) == [True] * 9
    assert all(torch.equal(page(host, t), w) for t, w in zip(dst[::P], want))


def test_namespaces_keep_models_and_ranks_apart(root, backends):
    _, host = mha_host("page_first")
    a = build(host, root, model="org/a")
    backends.append(a)
    fill_random(host, 2)
    keys = keys_of(3)
    assert a.batch_set_v1(keys, host.alloc(3 * P)) == [True] * 3
    other_model = build(host, root, model="org/b")
    backends.append(other_model)
    other_rank = build(host, root, model="org/a", tp_rank=1, tp_size=2)
    backends.append(other_rank)
    assert (a.batch_exists(keys), other_model.batch_exists(keys),
            other_rank.batch_exists(keys)) == (3, 0, 0)
    assert len({a.namespace_dirs[0], other_model.namespace_dirs[0],
                other_rank.namespace_dirs[0]}) == 3
    with pytest.raises(ValueError, match="is in use by pid .*locked"):
        build(host, root, model="org/a")


def test_mla_ranks_share_pages_and_only_the_writer_stores(root, backends):
    _, host = mla_host("page_first")
    writer = build(host, root, mla=True, tp_rank=0, tp_size=2)
    backends.append(writer)
    # probe_ttl_s=0: the reader's "not found" before the writer stored is not remembered
    reader = build(host, root, mla=True, tp_rank=1, tp_size=2, probe_ttl_s=0)
    backends.append(reader)
    assert writer.namespace_dirs == reader.namespace_dirs  # one directory for the model
    assert (writer.is_writer, reader.is_writer) == (True, False)
    fill_random(host, 4)
    keys = keys_of(5)
    src = host.alloc(5 * P)
    want = [page(host, t) for t in src[::P]]
    assert reader.batch_set_v1(keys, src) == [True] * 5  # skipped: the writer stores them
    assert reader.stats()["sets_skipped_not_writer"] == 5
    assert reader.batch_exists(keys) == 0
    assert writer.batch_set_v1(keys, src) == [True] * 5
    assert reader.batch_exists(keys) == 5  # found by one batch of probes (shared)
    assert reader.stats()["probe_hits"] == 5
    dst = host.alloc(5 * P)
    assert reader.batch_get_v1(keys, dst) == [True] * 5
    assert all(torch.equal(page(host, t), w) for t, w in zip(dst[::P], want))


def test_sidecar_pools_are_refused_at_attach(root):
    _, host = mha_host("page_first")
    sc = storage_config(extra(root))
    b = StorageBackendFactory.create_backend("dynamic", sc, host)
    try:
        b.register_mem_pool_host(host)
        b.register_mem_host_pool_v2(host, "kv")
        b.register_mem_host_pool_v2(host, "mamba")
        with pytest.raises(ValueError, match=r"host pools \['mamba'\] are not supported"):
            b.on_host_pools_registered()
    finally:
        b.close()


def test_clear_removes_every_page(root, backends):
    _, host = mha_host("page_first")
    b = build(host, root)
    backends.append(b)
    fill_random(host, 6)
    keys = keys_of(4)
    assert b.batch_set_v1(keys, host.alloc(4 * P)) == [True] * 4
    b.clear()
    assert b.batch_exists(keys) == 0
    assert glob.glob(os.path.join(b.namespace_dirs[0], "blocks", "*", "*")) == []
    assert b.batch_set_v1(keys, host.alloc(4 * P)) == [True] * 4
    assert b.batch_exists(keys) == 4


def test_storage_metrics_since_the_last_call(root, backends):
    from sglang.srt.observability.metrics_collector import StorageMetrics

    _, host = mha_host("page_first")
    b = build(host, root)
    backends.append(b)
    fill_random(host, 8)
    keys = keys_of(3)
    assert b.batch_set_v1(keys, host.alloc(3 * P)) == [True] * 3
    assert b.batch_get_v1(keys[:2], host.alloc(2 * P)) == [True] * 2
    m = b.get_stats()
    assert isinstance(m, StorageMetrics)
    assert (m.backup_pgs, m.prefetch_pgs) == ([3], [2])
    assert len(m.backup_bandwidth) == 1 and m.backup_bandwidth[0] > 0
    assert b.get_stats().prefetch_pgs == []


SOAK_S = float(os.environ.get("PYKVTIER_SGLANG_SOAK_S", "60"))


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_three_controller_threads_at_once(root, backends, layout):
    """SGLang's three storage threads on one backend: existence checks, gets and sets of 128
    pages at once, for PYKVTIER_SGLANG_SOAK_S seconds (60) per layout; every page read is
    checked against the bytes its key was written from."""
    _, host = mha_host(layout, tokens=8192)
    b = build(host, root, capacity_bytes=600 * 8192 + 600 * 2 * 4096)  # eviction under way
    backends.append(b)
    fill_random(host, 12)
    pages = host.alloc(256 * P)  # sources: page i of the pool holds the bytes of key i
    want = {}
    keys = keys_of(256, "s")
    for i, k in enumerate(keys):
        want[k] = page(host, pages[i * P])
    dst_get = host.alloc(128 * P)
    errors: list[str] = []
    counts = {"sets": 0, "gets": 0, "pages_checked": 0, "exists": 0}
    stop = threading.Event()

    def setter():
        i = 0
        while not stop.is_set():
            sel = [(i + j) % 256 for j in range(128)]
            idx = torch.cat([pages[s * P:(s + 1) * P] for s in sel])
            if not all(b.batch_set_v1([keys[s] for s in sel], idx)):
                errors.append("a set failed")
            counts["sets"] += 1
            i += 37

    def getter():
        i = 0
        while not stop.is_set():
            sel = [(i * 7 + j) % 256 for j in range(128)]
            ks = [keys[s] for s in sel]
            n = b.batch_exists(ks)
            got = b.batch_get_v1(ks[:n], dst_get[:n * P]) if n else []
            for j, ok in enumerate(got):
                if ok:
                    if not torch.equal(page(host, dst_get[j * P]), want[ks[j]]):
                        errors.append(f"page of {ks[j]} differs")
                    counts["pages_checked"] += 1
            counts["gets"] += 1
            i += 1

    def exister():
        i = 0
        while not stop.is_set():
            b.batch_exists([keys[(i + j) % 256] for j in range(300 % 256)])
            counts["exists"] += 1
            i += 11

    threads = [threading.Thread(target=f) for f in (setter, getter, exister)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + SOAK_S
    while time.monotonic() < deadline and all(t.is_alive() for t in threads):
        threads[0].join(0.5)
    stop.set()
    for t in threads:
        t.join()
    assert errors == []
    assert counts["sets"] > 0 and counts["gets"] > 0 and counts["exists"] > 0
    assert counts["pages_checked"] > 0
    st = b.stats()
    assert st["verify_failures"] == 0 and st["load_failures"] == 0


def _drive_controller(host, dev, root, mla):
    """Stores 30 pages and prefetches them back through SGLang's HybridCacheController, as the
    scheduler does; returns (hit pages, acks, loaded pages ok, backend stats)."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
    from sglang.srt.mem_cache.pool_host import HostPoolGroup
    from sglang.srt.mem_cache.utils import get_storage_hash_str
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0, tp_rank=0, tp_size=1,
                                        pp_rank=0, pp_size=1)

    class Allocator:
        def get_kvcache(self):
            return dev

        def set_hicache_transfer_done_event(self, *args):
            pass

    layers = MLA_L if mla else L
    group = HostPoolGroup([build_pool_entry(
        name=PoolName.KV, host_pool=host, device_pool=dev,
        layer_mapping={i: i for i in range(layers)}, transfer_layer_id_max=layers,
        is_anchor=True)])
    ctrl = HybridCacheController(Allocator(), group, P, None, threading.Event(),
                                 storage_backend="dynamic",
                                 storage_backend_extra_config=dict(extra(root)),
                                 model_name="org/model")
    try:
        backend = ctrl.storage_backend
        assert isinstance(getattr(backend, "_backend", backend), PyKVTierHiCache)
        fill_random(host, 21)
        n = 30
        tokens = list(range(1000, 1000 + n * P))
        hashes = get_storage_hash_str(tokens, None, page_size=P)
        src = host.alloc(n * P)
        want = [page(host, t) for t in src[::P]]
        ctrl.write_storage(src, tokens, hash_value=hashes)
        op = ctrl.ack_backup_queue.get(timeout=60)
        assert op.completed_tokens == n * P
        inner = getattr(backend, "_backend", backend)
        handle = CacheRequestHandle(rid="r1", attempt_id=0)
        ctrl.prefetch(handle, tokens)
        hit = ctrl.prefetch_hit_queue.get(timeout=60)
        hit.host_indices = host.alloc(hit.storage_hit_count)
        ctrl.prefetch_buffer.put(hit)
        acks = []
        while True:
            ack = ctrl.ack_prefetch_queue.get(timeout=60)
            acks.append(ack)
            if getattr(ack, "completed_req", None):
                break
        ok = all(torch.equal(page(host, hit.host_indices[i * P]), want[i])
                 for i in range(hit.storage_hit_count // P))
        return hit.storage_hit_count // P, ok, inner.stats()
    finally:
        ctrl.detach_storage_backend()


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_driven_by_sglangs_hybrid_cache_controller(root, kind):
    dev, host = (mha_host if kind == "mha" else mla_host)("page_first", tokens=1024)
    pages, ok, st = _drive_controller(host, dev, root, kind == "mla")
    assert pages == 30 and ok
    per = 2 if kind == "mha" else 1
    assert (st["pages_stored"], st["pages_loaded"]) == (30, 30)
    assert (st["blocks_stored"], st["blocks_loaded"]) == (30 * per, 30 * per)


def test_an_existence_check_does_not_wait_for_a_get_stuck_on_the_disk(root, backends):
    """A get whose block file is a FIFO no one writes blocks in the engine (its open waits for
    a writer); meanwhile batch_exists from another thread answers, and the get fails alone once
    the FIFO is opened and closed."""
    _, host = mha_host("page_first")
    b = build(host, root, direct=False)  # (an O_DIRECT open of a FIFO fails at once on some fs)
    backends.append(b)
    fill_random(host, 13)
    keys = keys_of(4)
    assert b.batch_set_v1(keys, host.alloc(4 * P)) == [True] * 4
    from pykvtier.layout import key_digest

    fifo = b._tiers[0].layout.block_path(key_digest(f"{keys[0]}:0".encode()))
    os.unlink(fifo)
    os.mkfifo(fifo)
    submitted = threading.Event()
    tier = b._tiers[0]
    real_submit = tier.submit_load

    def submit_load(job, digests=None):
        real_submit(job, digests)
        submitted.set()

    tier.submit_load = submit_load
    result = {}
    getter = threading.Thread(
        target=lambda: result.setdefault("get", b.batch_get_v1(keys[:1], host.alloc(P))))
    getter.start()
    assert submitted.wait(60)
    assert b.batch_exists(keys[1:]) == 3  # answered while the get is in the engine
    assert getter.is_alive()  # still waiting: nothing has opened the FIFO for writing
    # Let the engine through: each time it opens the FIFO (it may open a file more than once),
    # a writer comes and goes, so its read ends at EOF: a short block file, failed.
    os.close(os.open(fifo, os.O_WRONLY))
    deadline = time.monotonic() + 60
    while getter.is_alive() and time.monotonic() < deadline:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # ENXIO: no reader now
        except OSError:
            pass
        getter.join(0.05)
    assert result["get"] == [False]
    assert b.batch_exists(keys) == 0  # the failed page answers missing from now on
    assert b.batch_exists(keys[1:]) == 3


def test_no_metrics_are_kept_without_storage_metrics(root):
    """SGLang calls get_stats() only with --enable-storage-metrics: without it the per-batch
    figures are not kept (they would grow forever)."""
    _, host = mha_host("page_first")
    sc = storage_config(extra(root))
    sc.enable_storage_metrics = False
    b = StorageBackendFactory.create_backend("dynamic", sc, host)
    try:
        b.register_mem_pool_host(host)
        fill_random(host, 14)
        assert b.batch_set_v1(keys_of(2), host.alloc(2 * P)) == [True, True]
        assert b._metrics == {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                              "backup_bandwidth": []}
        assert b.stats()["pages_stored"] == 2
    finally:
        b.close()


def test_batch_exists_on_a_shared_root_probes_each_unknown_key_once(root, backends):
    """probe_ttl_s=0 (a miss is not remembered): one batch_exists of 8 unknown keys submits 8
    probes and returns 0 once they are applied, rather than probing again until its deadline."""
    _, host = mla_host("page_first")
    b = build(host, root, mla=True, shared=True, probe_ttl_s=0)
    backends.append(b)
    assert b.batch_exists(keys_of(8, "u")) == 0
    st = b.stats()
    assert (st["probes"], st["probe_results_applied"]) == (8, 8)


def test_a_capacity_too_small_once_split_over_the_roots_says_so(tmp_path):
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    with pytest.raises(ValueError, match=r"capacity_bytes=12288 split over 2 roots\): "
                                         r"capacity_bytes=6144 cannot hold one block"):
        PyKVTierHiCache(storage_config(extra(roots, capacity_bytes=12288)), {})
