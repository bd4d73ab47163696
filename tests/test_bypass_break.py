"""Faults found by trying to break bypass="auto" and DiskTier(store_share=): one test per fault,
each failing before its fix. Exact values, no sleeps, no timing asserts."""

from __future__ import annotations

import numpy as np
import pytest

from pykvtier import DiskTier, LookupResult, Promoter, TransferJob
from pykvtier.config import DiskTierConfig
from pykvtier.costmodel import FixedBandwidth, PrefillModel

HIT, MISS, HIT_PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING
BS = 64 << 10  # the tier's block bytes (conftest's make_tier)
AUTO = dict(bypass="auto", bypass_model="llama-3-8b")


# ------------------------------------------------------------------ option checks, every adapter

def _vllm_config():
    pytest.importorskip("vllm.v1.kv_offload.tiering.base")
    from pykvtier.integrations.vllm import PyKVTierConfig

    return lambda **o: PyKVTierConfig.from_options("PyKVTier", {"root_dir": "/nonexistent/kv",
                                                                 **o})


def _sglang_config():
    import sglang_torchvision_stub

    sglang_torchvision_stub.install()
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
    from pykvtier.integrations.sglang import PyKVTierHiCacheConfig

    return lambda **o: PyKVTierHiCacheConfig.from_extra_config({"root_dir": "/nonexistent/kv",
                                                                **o})


def _lmcache_config():
    pytest.importorskip("lmcache.v1.storage_backend.abstract_backend")
    from pykvtier.integrations.lmcache import PyKVTierLMCacheConfig

    def make(**o):
        extra = {"storage_plugin.pykvtier.root_dir": "/nonexistent/kv"}
        extra.update({f"storage_plugin.pykvtier.{k}": v for k, v in o.items()})
        return PyKVTierLMCacheConfig.from_extra_config(extra, "pykvtier")

    return make


ADAPTERS = {"vllm": _vllm_config, "sglang": _sglang_config, "lmcache": _lmcache_config}


@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
def test_a_huge_bypass_bytes_per_s_is_a_value_error_naming_it(adapter):
    """bypass_bytes_per_s 10**400 (a JSON integer of 401 digits): math.isfinite raised
    OverflowError ('int too large to convert to float'), naming neither the option nor the
    adapter; now the ValueError of any other bad figure."""
    make = ADAPTERS[adapter]()
    with pytest.raises(ValueError, match=r"bypass_bytes_per_s must be null or a positive "
                                         r"number \(bytes/s\), got 1000"):
        make(bypass_bytes_per_s=10 ** 400)


@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
def test_numpy_figures_are_numbers(adapter):
    """np.float32(0.5) for bypass_mfu and np.int64(10**9) for bypass_bytes_per_s were refused
    as 'must be a number in (0, 1]' / 'a positive number' (np.float64 passed: a float
    subclass); the cost model itself takes any real number. Now taken, stored as floats."""
    make = ADAPTERS[adapter]()
    cfg = make(**AUTO, bypass_mfu=np.float32(0.5), bypass_bytes_per_s=np.int64(10 ** 9))
    assert (cfg.bypass_mfu, cfg.bypass_bytes_per_s) == (0.5, 1e9)
    assert type(cfg.bypass_mfu) is float and type(cfg.bypass_bytes_per_s) is float
    with pytest.raises(ValueError,
                       match=r"bypass_mfu must be a number in \(0, 1\], got np.float32\(1.5\)"):
        make(bypass_mfu=np.float32(1.5))
    with pytest.raises(ValueError, match="bypass_bytes_per_s must be null or a positive"):
        make(bypass_bytes_per_s=np.float64("nan"))


def test_yaml_bypass_off_is_off_through_lmcaches_config_loader(tmp_path):
    """LMCache reads its config with yaml.safe_load (YAML 1.1), where a bare `off` is false:
    `storage_plugin.pykvtier.bypass: off`, the documented default written out, was refused
    ('got False') and LMCache ran on without the plug-in. False is now "off"; a bare `on`
    (true) is refused with the hint to write "auto"."""
    pytest.importorskip("lmcache.v1.config")
    from lmcache.v1.config import LMCacheEngineConfig

    from pykvtier.integrations.lmcache import PyKVTierLMCacheConfig

    def load(value: str):
        path = tmp_path / f"lmcache-{value}.yaml"
        path.write_text(
            "chunk_size: 16\nlocal_cpu: false\nmax_local_cpu_size: 0.05\n"
            "storage_plugins: [\"pykvtier\"]\nextra_config:\n"
            "  storage_plugin.pykvtier.module_path: pykvtier.integrations.lmcache\n"
            "  storage_plugin.pykvtier.class_name: PyKVTierStoragePlugin\n"
            f"  storage_plugin.pykvtier.root_dir: {tmp_path}/kv\n"
            f"  storage_plugin.pykvtier.bypass: {value}\n")
        extra = LMCacheEngineConfig.from_file(str(path)).extra_config
        return extra, PyKVTierLMCacheConfig.from_extra_config(extra, "pykvtier")

    extra, cfg = load("off")
    assert extra["storage_plugin.pykvtier.bypass"] is False  # (YAML's reading, not ours)
    assert cfg.bypass == "off"
    with pytest.raises(ValueError, match=r"bypass must be \"off\" or \"auto\", got True "
                                         r"\(YAML reads a bare on/yes/true as true"):
        load("on")


@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
def test_json_false_bypass_is_off_in_every_adapter(adapter):
    make = ADAPTERS[adapter]()
    assert make(bypass=False).bypass == "off"
    assert make(bypass=False, **{k: v for k, v in AUTO.items() if k != "bypass"}).bypass == "off"
    for bad in (0, None, True, "Auto"):
        with pytest.raises(ValueError, match=r"bypass must be \"off\" or \"auto\""):
            make(bypass=bad)


def test_a_huge_store_share_is_a_value_error(root):
    """DiskTierConfig(store_share=10**400): float() raised OverflowError; now the ValueError of
    any share out of (0, 1]."""
    with pytest.raises(ValueError, match=r"store_share must be in \(0, 1\], got 1000"):
        DiskTierConfig(root, BS, store_share=10 ** 400)
    with pytest.raises(ValueError, match=r"store_share must be in \(0, 1\], got -"):
        DiskTierConfig(root, BS, store_share=-10 ** 400)
    assert DiskTierConfig(root, BS, store_share=np.float32(0.25)).store_share == 0.25


# ------------------------------------------------------------------ Promoter.lookup_prefix

PREFILL = PrefillModel("llama-3-8b", "h100", mfu=0.5)


@pytest.fixture
def stored(root, make_tier, arena):
    """A tier holding 4 blocks: (tier, keys, arena)."""
    tier = make_tier(root)
    a = arena(16, BS)
    a[:4] = np.random.default_rng(3).integers(0, 256, (4, BS), dtype=np.uint8)
    tier.set_arena(a)
    keys = [b"brk-%d" % i for i in range(4)]
    tier.submit_store(TransferJob(1, keys, list(range(4))))
    tier.drain()
    (res,) = tier.get_finished_jobs()
    assert res.success
    return tier, keys, a


def test_a_requests_own_blocks_are_not_queued_ahead_of_it(stored):
    """200 MB/s: a 64 KiB block loads in 327.68 us against 451.6 us + 0.27 us j to recompute:
    4 blocks load in 1,310.7 us <= 1,807.9 us, HIT. The same request asked again in the step
    counted its own 4 answered blocks as queued ahead of itself ((4 + 4) x 327.68 = 2,621 us >
    1,807.9 us): MISS, 4 more bypassed hits; and once promoted, its own blocks on their way
    (HIT_PENDING) answered MISS. A request's own blocks are its load, not a queue ahead."""
    tier, keys, a = stored
    p = Promoter(tier, bypass="auto", prefill=PREFILL, tokens_per_block=16,
                 bandwidth=FixedBandwidth(2e8))
    assert p.lookup_prefix(keys) == [HIT] * 4
    assert p.lookup_prefix(keys) == [HIT] * 4
    p.promote("a", keys, range(8, 12))
    assert p.lookup_prefix(keys) == [HIT_PENDING] * 4
    assert p.stats()["bypassed_hits"] == 0 and p.stats()["bypassed_requests"] == 0
    # another request's 4 blocks answered this step still queue ahead of a new request
    other = [b"brk-x%d" % i for i in range(4)]
    a[4:8] = 1
    tier.submit_store(TransferJob(2, other, list(range(4, 8))))
    tier.drain()
    assert [r.success for r in tier.get_finished_jobs()] == [True]
    assert p.lookup_prefix(other) == [MISS] * 4  # behind the 4 landing: 2,621 us > 1,807.9 us
    assert p.stats()["bypassed_hits"] == 4
    p.on_step_end()
    tier.drain()
    (res,) = p.poll()
    assert res.request_id == "a" and sorted(res.loaded.values()) == [8, 9, 10, 11]
    assert np.array_equal(a[8:12], a[:4])
