"""PyKVTierHiCache with ``bypass: auto`` under SGLang 0.5.23's own classes (marked ``sglang``).

The backend is built by SGLang's ``StorageBackendFactory`` over SGLang's real host pool
(``MHATokenToKVPoolHost``, page_first, on "cpu"), as tests/test_sglang.py does. ``batch_exists``
answers at most the pages whose load beats their recompute; the expected count of every case is
worked out here from the prefill FLOPs formula written out (docs/design.md, "Load or
recompute"), not by calling pykvtier.costmodel. The bandwidth is ``bypass_bytes_per_s``: every
decision is made before any load has been measured. The queue ahead is a load held in flight
by the test (its engine's wait blocks until released): no sleeps, no timing asserts.
"""

from __future__ import annotations

import threading

import pytest

import sglang_torchvision_stub  # (tests/ is on sys.path, as for conftest)

pytestmark = pytest.mark.sglang

sglang_torchvision_stub.install()
try:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from pykvtier.integrations.sglang import PyKVTierHiCache
except ImportError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"SGLang is not installed ({exc}); scripts/setup.sh installs it "
                "(requirements-sglang.txt)", allow_module_level=True)

P = 16  # tokens per page
L, H, D = 2, 2, 32  # a page's K (or V) region is P*L*H*D*2 = 4096 bytes (bf16)
PAGE = 2 * 4096  # a page's bytes: its K and its V block

# Llama-3-8B (pykvtier/models.py): N = params - embeddings, 32 layers, 32 query heads, head 128;
# an H100's 989.4e12 dense bf16 FLOP/s at mfu 0.5.
N = 8_030_261_248 - 1_050_673_152
LAYERS, QH, HD = 32, 32, 128
FLOPS_PER_S = 989.4e12 * 0.5


def recompute_s(s: int, t: int, gpus: int = 1) -> float:
    """Prefill seconds of prompt tokens s..s+t-1, the KV before s cached, on ``gpus`` GPUs:
    (2 N t + 4 L H d (t s + t (t + 1) / 2)) / (gpus x peak x mfu)."""
    return (2 * N * t + 4 * LAYERS * QH * HD * (t * s + t * (t + 1) // 2)) / (gpus * FLOPS_PER_S)


def expected_k(hits: int, queued: int, bytes_per_s: float, start: int = 0, gpus: int = 1) -> int:
    """The largest k in 1..hits whose load (queued + k pages) ends no later than recomputing
    pages 0..k-1 (page j from token start + 16 j), else 0."""
    best, total = 0, 0.0
    for k in range(1, hits + 1):
        total += recompute_s(start + (k - 1) * P, P, gpus)
        if (queued + k * PAGE) / bytes_per_s <= total:
            best = k
    return best


R0 = recompute_s(0, P)  # 451.6 us: 223,418,122,240 FLOPs
DR = recompute_s(P, P) - R0  # each page 16 tokens deeper: + 134,217,728 FLOPs, 0.27 us
assert 2 * N * P + 4 * LAYERS * QH * HD * 136 == 223_418_122_240


def extra(root, **options):
    return {"backend_name": "pykvtier", "module_path": "pykvtier.integrations.sglang",
            "class_name": "PyKVTierHiCache", "interface_v1": 1, "root_dir": root, **options}


def storage_config(extra_config, tp_size=1):
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=True, is_page_first_layout=True,
        model_name="org/model", extra_config=dict(extra_config))


def mha_host(tokens=2048):
    dev = MHATokenToKVPool(tokens, P, torch.bfloat16, H, D, L, "cpu", False, start_layer=0,
                           end_layer=L - 1)
    return MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, P,
                                "page_first", pin_memory=False, device_capacity_tokens=dev.size,
                                start_layer=0, end_layer=L - 1)


def keys_of(n, tag="k"):
    return [f"{tag}{i:063x}"[-64:] for i in range(n)]


@pytest.fixture
def backend(root):
    """build(**options) -> (backend, host, keys of 12 pages stored), as SGLang's attach makes
    it (factory, then the pool registration calls); closed at the end."""
    made = []

    def build(tp_size=1, **options):
        host = mha_host()
        sc = storage_config(extra(root, **options), tp_size)
        b = StorageBackendFactory.create_backend("dynamic", sc, host)
        made.append(b)
        b.register_mem_pool_host(host)
        b.register_mem_host_pool_v2(host, "kv")
        b.on_host_pools_registered()
        assert isinstance(b, PyKVTierHiCache) and b._geometry.zero_copy
        assert b._geometry.page_bytes == PAGE
        keys = keys_of(12)
        assert b.batch_set_v1(keys, host.alloc(12 * P)) == [True] * 12
        return b, host, keys

    yield build
    for b in made:
        b.close()


def counters(b):
    st = b.stats()
    return st["bypassed_hits"], st["bypassed_requests"]


AUTO = dict(bypass="auto", bypass_model="llama-3-8b", bypass_gpu="h100", bypass_mfu=0.5)


def test_bypass_off_by_default_answers_the_full_prefix(backend):
    b, _, keys = backend(bypass_bytes_per_s=1e3)  # a drive too slow for anything: off anyway
    assert b.config.bypass == "off" and b.prefill is None and b.bandwidth is None
    assert b.batch_exists(keys) == 12
    assert b.batch_exists(keys[:3] + ["absent"] + keys[3:]) == 3
    assert counters(b) == (0, 0)


def test_bypass_off_with_a_model_answers_the_full_prefix(backend):
    b, _, keys = backend(bypass="off", bypass_model="llama-3-8b", bypass_bytes_per_s=1e3)
    assert b.batch_exists(keys) == 12 and counters(b) == (0, 0)


def test_fast_drive_loads_every_page(backend):
    """1 GB/s: a page (8 KiB) loads in 8.2 us, against 451.6 us to recompute it."""
    b, _, keys = backend(**AUTO, bypass_bytes_per_s=1e9)
    assert expected_k(12, 0, 1e9) == 12
    assert b.batch_exists(keys) == 12 and counters(b) == (0, 0)


def test_slow_drive_recomputes_every_page_and_counts_them(backend):
    """1 MB/s: 8.2 ms a page against 451.6 us: none pays off; exists() is never capped."""
    b, _, keys = backend(**AUTO, bypass_bytes_per_s=1e6)
    assert expected_k(12, 0, 1e6) == 0
    assert b.batch_exists(keys) == 0
    assert counters(b) == (12, 1)
    assert b.batch_exists(keys[:5] + ["absent"] + keys[5:]) == 0  # 5 found, 5 bypassed
    assert counters(b) == (17, 2)
    assert b.batch_exists(["absent"] + keys) == 0  # nothing found, nothing bypassed
    assert counters(b) == (17, 2)
    assert all(b.exists(k) for k in keys)
    assert counters(b) == (17, 2)


def test_long_runs_of_pages_pay_off_where_short_ones_do_not(backend):
    """A page's load takes R0 + 3.25 DR (DR: what 16 tokens deeper adds to a page's
    recompute). k pages load in k (R0 + 3.25 DR) and recompute in k R0 + DR k (k - 1) / 2: the
    load wins from k = 8 on (k - 1) / 2 >= 3.25), so 10 pages load, 7 or 5 do not. Pages that
    start 4 pages into the prompt (prefix_keys) recompute (4 + j) DR dearer: 5 pay off."""
    w = PAGE / (R0 + 3.25 * DR)
    b, _, keys = backend(**AUTO, bypass_bytes_per_s=w)
    assert [expected_k(n, 0, w) for n in (5, 7, 8, 10)] == [0, 0, 8, 10]
    assert b.batch_exists(keys[:10]) == 10
    assert counters(b) == (0, 0)
    assert b.batch_exists(keys[:7]) == 0
    assert counters(b) == (7, 1)
    assert b.batch_exists(keys[:5] + ["absent"] + keys[5:]) == 0  # the prefix found: 5 pages
    assert counters(b) == (12, 2)
    four = HiCacheStorageExtraInfo(prefix_keys=keys_of(4, "p"))
    assert expected_k(5, 0, w, start=4 * P) == 5
    assert b.batch_exists(keys[:5], four) == 5
    assert b.batch_exists(keys[:5], HiCacheStorageExtraInfo(prefix_keys=None)) == 0
    assert counters(b) == (17, 3)


def test_tensor_parallel_ranks_split_the_recompute(backend):
    """A page loads in 0.75 R0: on one GPU it beats its recompute (R0 + DR j); with tp_size 2
    the prefill is split over two GPUs (R0 / 2 + DR j / 2 a page) and recomputing wins."""
    w = PAGE / (0.75 * R0)
    assert (expected_k(4, 0, w), expected_k(4, 0, w, gpus=2)) == (4, 0)
    b1, _, keys = backend(**AUTO, bypass_bytes_per_s=w)
    assert b1.prefill.gpus == 1 and b1.batch_exists(keys[:4]) == 4 and counters(b1) == (0, 0)
    b1.close()
    b2, _, keys = backend(tp_size=2, **AUTO, bypass_bytes_per_s=w)
    assert b2.prefill.gpus == 2
    assert b2.batch_exists(keys[:4]) == 0 and counters(b2) == (4, 1)


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


def test_the_loads_in_flight_are_the_queue_ahead(backend):
    """At 20 MB/s a page loads in 409.6 us and recomputes in 451.6 us + 0.27 us j: alone, every
    run of pages pays off; behind one page being loaded (2 blocks, 8 KiB: 409.6 us), 9 pages
    do not (9 x 42 us + 9.8 us < 409.6 us) and 10 do. Once the load finished it feeds the
    bandwidth estimate."""
    w = 2e7
    b, host, keys = backend(**AUTO, bypass_bytes_per_s=w)
    assert (expected_k(9, 0, w), expected_k(9, PAGE, w), expected_k(10, PAGE, w)) == (9, 0, 10)
    assert b.batch_exists(keys[:9]) == 9  # nothing in flight
    tier = b._tiers[0]
    held = tier._engine = _HeldEngine(tier._engine)
    got = []
    t = threading.Thread(target=lambda: got.append(b.batch_get_v1(keys[11:], host.alloc(P))))
    t.start()
    try:
        with b._cv:
            assert b._cv.wait_for(lambda: b._shards.loading_blocks() == 2, timeout=60)
        assert b.batch_exists(keys[:9]) == 0
        assert counters(b) == (9, 1)
        assert b.batch_exists(keys[:10]) == 10
        assert counters(b) == (9, 1)
    finally:
        held.release.set()
        t.join()
        tier._engine = held.real
    assert got == [[True]]
    assert b.bandwidth.loads == 1  # the finished load was measured (its figure is the drive's)
    with b._cv:
        assert b._shards.loading_blocks() == 0


@pytest.mark.parametrize("bad,match", [
    ({"bypass": "on"}, r"PyKVTierHiCache: bypass must be \"off\" or \"auto\", got 'on'"),
    ({"bypass": True}, r"bypass must be \"off\" or \"auto\", got True"),
    ({"bypass": "auto"}, "PyKVTierHiCache: bypass: auto needs bypass_model"),
    ({"bypass": "auto", "bypass_model": "gpt-5"},
     "PyKVTierHiCache: bypass_model: unknown model preset 'gpt-5'; known presets: llama-3-8b"),
    ({"bypass_model": "gpt-5"}, "bypass_model: unknown model preset 'gpt-5'"),
    ({"bypass_gpu": "v100"},
     "PyKVTierHiCache: bypass_gpu: unknown GPU preset 'v100'; known GPU presets: h100"),
    ({"bypass_mfu": 0}, r"PyKVTierHiCache: bypass_mfu must be a number in \(0, 1\], got 0"),
    ({"bypass_mfu": 1.5}, r"bypass_mfu must be a number in \(0, 1\], got 1.5"),
    ({"bypass_mfu": "0.5"}, r"bypass_mfu must be a number in \(0, 1\], got '0.5'"),
    ({"bypass_bytes_per_s": -1}, "PyKVTierHiCache: bypass_bytes_per_s must be null or a "
                                 r"positive number \(bytes/s\), got -1"),
    ({"bypass_bytes_per_s": float("inf")}, "bypass_bytes_per_s must be null or a positive"),
    ({"bypass_bytes_per_s": "fast"}, "bypass_bytes_per_s must be null or a positive"),
    ({"bypass_byte_per_s": 1e9},
     r"unknown option 'bypass_byte_per_s'.*accepted: .*bypass_bytes_per_s"),
])
def test_bad_bypass_options_are_named(root, bad, match):
    host = mha_host()
    with pytest.raises(ValueError, match=match):
        StorageBackendFactory.create_backend("dynamic", storage_config(extra(root, **bad)), host)
