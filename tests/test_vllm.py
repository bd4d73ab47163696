"""PyKVTier under vLLM 0.33's own tiered offloading (marked ``vllm``; skipped without vLLM).

Two levels:

- Through vLLM's real stack, built from config only: ``OffloadingSpecFactory`` makes a
  ``TieringOffloadingSpec`` whose ``get_manager()`` makes the ``CPUPrimaryTierOffloadingManager``
  (on its shared mmap) and, through ``SecondaryTierFactory``, our ``PyKVTier``; the
  :class:`Scheduler` below drives that ``TieringOffloadingManager`` as vLLM's scheduler does
  (lookups, prepare/complete store, ``on_schedule_end``), under the manager's own lock.
- vLLM's fs-tier behaviours run against ``PyKVTier`` alone (made by the same factory over a
  page-aligned view): data integrity across chunk ids and batch sizes, failed and partial
  loads, corrupt files, shutdown with pending work, every job reported once.

Time passes only through ``drain_jobs()`` (the tier's I/O finishes, as it would between two
scheduler steps); no sleeps. Every loaded byte is compared with what was stored.
"""

from __future__ import annotations

import contextlib
import glob
import os
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

pytestmark = pytest.mark.vllm

try:
    from vllm.v1.kv_offload.base import (
        LookupResult,
        Medium,
        OffloadPolicy,
        ReqContext,
        ScheduleEndContext,
        make_offload_key,
    )
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.base import SecondaryTierManager, TransferJob
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except Exception as exc:  # noqa: BLE001 - any import failure means: no usable vLLM here
    pytest.skip(f"vLLM's kv_offload.tiering is not importable ({type(exc).__name__}: {exc}); "
                "install it with: pip install torch==2.13.0 && "
                "pip install --no-deps -r requirements-vllm.txt", allow_module_level=True)

from pykvtier.integrations.vllm import PyKVTier, PyKVTierInfo, PyKVTierMetrics  # noqa: E402
from pykvtier.layout import HEADER_BYTES, key_digest  # noqa: E402

HIT, MISS, RETRY, HIT_PENDING = (LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY,
                                 LookupResult.HIT_PENDING)
BLOCK = 32 << 10  # bytes per chunk (the primary view's row stride)
TIER = {"type": "PyKVTier", "module_path": "pykvtier.integrations.vllm"}


# ------------------------------------------------------------------------- helpers


def offloading_config(tier_configs: list[dict], num_chunks: int = 8, events: bool = False,
                      model: str = "test-org/tiny-model") -> OffloadingConfig:
    """The normalized config vLLM's OffloadingConnector hands to its spec (one group, one
    worker, 1 block per chunk of BLOCK bytes)."""
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layers.0",),
                                      group_id=0),),
        worker_kv_bytes_per_block=BLOCK,
        enable_kv_cache_events=events,
        extra_config={"spec_name": "TieringOffloadingSpec",
                      "cpu_bytes_to_use": num_chunks * BLOCK,
                      "secondary_tiers": tier_configs},
        engine_id=f"pykvtier-test-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name=model, dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=True),
    )


def sections(stats) -> tuple[dict, dict]:
    """(metric types, metric values) of an OffloadingConnectorStats."""
    if hasattr(stats, "metric_sections"):
        return stats.metric_sections()
    return stats.data["types"], stats.data["data"]  # vLLM 0.32


def tier_config(root, **options) -> dict:
    return {**TIER, "root_dir": root, **options}


def key(i: int, tag: bytes = b"k") -> bytes:
    """An OffloadKey as vLLM makes it: a 32-byte block hash + the group index."""
    return make_offload_key(key_digest(b"%s-%d" % (tag, i)) * 2, 0)


def payload(k: bytes) -> bytes:
    seed = int.from_bytes(key_digest(k)[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, BLOCK, dtype=np.uint8).tobytes()


def aligned_rows(num_chunks: int) -> np.ndarray:
    """A zeroed, page-aligned uint8 (num_chunks, BLOCK) array: a stand-in primary view."""
    raw = np.zeros(num_chunks * BLOCK + 4096, np.uint8)
    off = (-raw.ctypes.data) % 4096
    return raw[off: off + num_chunks * BLOCK].reshape(num_chunks, BLOCK)


def rows(view: memoryview) -> np.ndarray:
    """A uint8 (num_chunks, BLOCK) array over the view; drop it before the view is released."""
    return np.asarray(view).view(np.uint8)


class Scheduler:
    """Calls a TieringOffloadingManager as vLLM's scheduler-side connector does: every call
    under ``manager.lock``; the GPU<->CPU transfers are simulated by writing/reading the
    primary tier's rows between prepare_store/complete_store and prepare_load/complete_load."""

    def __init__(self, manager: TieringOffloadingManager):
        self.m = manager
        # vLLM 0.33 guards the manager with a lock; 0.32 has none (one thread only)
        self.lock = getattr(manager, "lock", None) or contextlib.nullcontext()
        self.tier: PyKVTier = manager.secondary_tiers[0]
        self.view = manager.primary_tier.get_kv_memoryview()
        self.new_reqs: list[str] = []

    def request(self, rid: str) -> ReqContext:
        ctx = ReqContext(rid)
        with self.lock:
            assert self.m.on_new_request(ctx).policy is OffloadPolicy.CHUNK_LEVEL
        self.new_reqs.append(rid)
        return ctx

    def offload(self, ctx: ReqContext, keys: list[bytes]) -> list[bytes]:
        """GPU -> CPU store of keys' payloads, then the cascade vLLM starts on completion."""
        with self.lock:
            out = self.m.prepare_store(keys, ctx)
            assert out is not None, "primary tier full"
            a = rows(self.view)
            for k, c in zip(out.keys_to_store, out.store_spec.chunk_ids):
                a[c] = np.frombuffer(payload(k), np.uint8)
            del a
            self.m.complete_store(out.keys_to_store, ctx)
        return out.keys_to_store

    def lookup(self, ctx: ReqContext, keys: list[bytes]) -> list[LookupResult]:
        with self.lock:
            return [self.m.lookup(k, ctx) for k in keys]

    def end_step(self) -> None:
        with self.lock:
            self.m.on_schedule_end(ScheduleEndContext(self.new_reqs, ()))
        self.new_reqs = []

    def io(self) -> None:
        """Time passes: the tier's I/O completes (it is collected by the next step)."""
        with self.lock:
            self.tier.drain_jobs()

    def step(self) -> None:
        """A scheduler step with nothing scheduled: on_schedule_end() alone (it collects the
        tiers' finished jobs, as vLLM keeps stepping while has_pending_work())."""
        self.end_step()

    def loaded_bytes(self, ctx: ReqContext, keys: list[bytes]) -> list[bytes]:
        """CPU -> GPU load of primary HITs: the bytes of each key's primary row."""
        with self.lock:
            spec = self.m.prepare_load(keys, ctx)
            a = rows(self.view)
            out = [a[c].tobytes() for c in spec.chunk_ids]
            del a
            self.m.complete_load(keys, ctx)
        return out

    def finish(self, ctx: ReqContext) -> None:
        with self.lock:
            self.m.on_request_finished(ctx)


@pytest.fixture
def stack():
    """stack(tier_configs or one root, num_chunks=8, events=False) -> Scheduler over vLLM's
    real TieringOffloadingSpec/-Manager built from config; shut down after the test."""
    made: list[TieringOffloadingManager] = []

    def make(tiers, num_chunks: int = 8, events: bool = False) -> Scheduler:
        if not isinstance(tiers, list):
            tiers = [tier_config(tiers)]
        spec = OffloadingSpecFactory.create_spec(offloading_config(tiers, num_chunks, events))
        assert isinstance(spec, TieringOffloadingSpec)
        m = spec.get_manager()
        assert isinstance(m, TieringOffloadingManager)
        assert isinstance(m.secondary_tiers[0], PyKVTier)
        made.append(m)
        return Scheduler(m)

    yield make
    for m in made:
        m.shutdown()


@pytest.fixture
def make_tier():
    """make_tier(root or tier config, num_chunks=16, events=False) -> (PyKVTier, uint8 rows):
    the tier alone, made by SecondaryTierFactory over a page-aligned (num_chunks, BLOCK) view."""
    made: list[PyKVTier] = []

    def make(cfg, num_chunks: int = 16, events: bool = False):
        if not isinstance(cfg, dict):
            cfg = tier_config(cfg)
        spec = OffloadingSpecFactory.create_spec(offloading_config([cfg], events=events))
        arr = aligned_rows(num_chunks)
        tier = SecondaryTierFactory.create_secondary_tier(dict(cfg), memoryview(arr), spec)
        made.append(tier)
        return tier, arr

    yield make
    for t in made:
        t.shutdown()


def job(job_id: int, keys, chunk_ids, promotion: bool) -> TransferJob:
    return TransferJob(job_id=job_id, keys=list(keys), chunk_ids=np.array(chunk_ids, np.int32),
                       is_promotion=promotion, req_context=ReqContext("r"))


def run(tier: PyKVTier, *jobs: TransferJob) -> dict:
    """Submits jobs (promotions load, others store), waits, returns job_id -> JobResult."""
    for j in jobs:
        (tier.submit_load if j.is_promotion else tier.submit_store)(j)
    tier.drain_jobs()
    results = list(tier.get_finished_jobs())
    ids = [r.job_id for r in results]
    assert sorted(ids) == sorted(j.job_id for j in jobs), "every job exactly once"
    assert not tier.has_pending_work()
    return {r.job_id: r for r in results}


def fill(arr: np.ndarray, keys, chunk_ids) -> None:
    for k, c in zip(keys, chunk_ids):
        arr[c] = np.frombuffer(payload(k), np.uint8)


def block_files(tier: PyKVTier) -> list[str]:
    return sorted(f for ns in tier.namespace_dirs for f in glob.glob(f"{ns}/blocks/*/*"))


def path_of(tier: PyKVTier, k: bytes) -> str:
    (p,) = [t.layout.block_path(key_digest(k)) for t in tier.tiers
            if os.path.exists(t.layout.block_path(key_digest(k)))]
    return p


# ------------------------------------------------------------------------- loading from config


def test_config_only_loading_through_vllms_factories(root, stack):
    s = stack([tier_config(root, capacity_bytes=1 << 30, locality="LOCAL", queue_depth=32)])
    tier = s.tier
    assert SecondaryTierFactory.get_tier_class(dict(TIER)) is PyKVTier
    assert isinstance(tier, SecondaryTierManager) and tier.tier_type == "PyKVTier"
    assert tier.medium is Medium.STORAGE and tier.cache_hit_source is CacheHitSource.DISK
    assert tier.locality.value == "LOCAL" and tier.block_size_bytes == BLOCK
    (ns,) = tier.namespace_dirs
    assert ns.startswith(os.path.join(root, "pykvtier", "test-org_tiny-model_"))
    assert os.path.isfile(os.path.join(ns, "config.json"))
    # The primary view is the arena, registered as the engine's fixed buffers.
    st = tier.stats()
    assert st["buffer_registration_failures"] == 0
    if not hasattr(s.m, "config_info"):  # vLLM 0.32 has no config info metric
        return
    (info,) = [i for i in s.m.config_info() if i["tier"] == "1:PyKVTier"]
    assert info["pykvtier_engine"] == tier.engine_name and info["pykvtier_block_bytes"] == BLOCK
    assert info["pykvtier_capacity_bytes"] == 1 << 30 and info["pykvtier_roots"] == 1


def test_another_model_gets_another_namespace(root, make_tier):
    a, _ = make_tier(root)
    spec = OffloadingSpecFactory.create_spec(
        offloading_config([tier_config(root)], model="other-org/other-model"))
    arr = aligned_rows(4)
    b = SecondaryTierFactory.create_secondary_tier(tier_config(root), memoryview(arr), spec)
    try:
        assert a.namespace_dirs != b.namespace_dirs  # never each other's blocks
    finally:
        b.shutdown()


def test_importing_pykvtier_does_not_import_vllm():
    code = ("import sys, pykvtier, pykvtier.integrations; "
            "assert 'vllm' not in sys.modules and 'torch' not in sys.modules, "
            "sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch'))")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(__file__))


@pytest.mark.parametrize("bad, match", [
    ({"n_read_threads": 4}, "unknown config key 'n_read_threads'"),
    ({"root_dirs": "/x", "quue_depth": 3}, "unknown config keys 'quue_depth', 'root_dirs'"),
    ({"locality": "NEARBY"}, "locality must be one of"),
    ({"capacity_bytes": -1}, "capacity_bytes must be a positive int"),
    ({"engine": "spdk"}, "unknown engine 'spdk'"),
    ({"recycle": "false"}, "recycle must be true or false, got 'false'"),
    ({"shared": 1}, "shared must be true or false, got 1"),
    ({"enable_kv_events": "yes"}, "enable_kv_events must be true or false"),
    ({"queue_depth": -1}, r"queue_depth must be a positive integer, got -1"),
    ({"queue_depth": "64"}, r"queue_depth must be a positive integer, got '64'"),
    ({"max_inflight_bytes": 1.5}, r"max_inflight_bytes must be a positive integer, got 1.5"),
    ({"probe_ttl_s": "1"}, r"probe_ttl_s must be a positive number, got '1'"),
    ({"queue_depth": 5000}, r"queue_depth must be in 1\.\.4096, got 5000"),
    ({"mode": 0o744}, r"PyKVTier: mode must be file permission bits within 0o666 .*got 0o744"),
    ({"mode": 0o440}, r"PyKVTier: mode must be .*owner read and write set .*got 0o440"),
    ({"mode": "rw-r-----"}, r"PyKVTier: mode must be file permission bits, an int or a string "
                            r"of octal digits such as \"640\", got 'rw-r-----'"),
    ({"mode": "0o"}, r"PyKVTier: mode must be file permission bits, an int or a string"),
    ({"mode": True}, r"PyKVTier: mode must be an int of permission bits"),
    ({"mode": 6.4}, r"PyKVTier: mode must be an int of permission bits"),
    ({"min_free_bytes": -1}, r"PyKVTier: min_free_bytes must be null or an integer >= 0 "
                             r"\(bytes\), got -1"),
    ({"min_free_bytes": "5%"}, r"min_free_bytes must be null or an integer >= 0 \(bytes\), got '5%'"),
    ({"min_free_bytes": 1.5}, r"min_free_bytes must be null or an integer >= 0 \(bytes\), got 1.5"),
    ({"min_free_bytes": False}, r"min_free_bytes must be null or an integer >= 0 \(bytes\), got False"),
    ({"direct": "no"}, r"PyKVTier: direct must be true, false, null or \"auto\", got 'no'"),
    ({"direct": 1}, r"PyKVTier: direct must be true, false, null or \"auto\", got 1"),
    ({"verify": "none"}, r"PyKVTier: verify must be 'payload' or 'header', got 'none'"),
])
def test_bad_config_is_a_clear_error(root, bad, match):
    cfg = {**tier_config(root), **bad}
    spec = OffloadingSpecFactory.create_spec(offloading_config([cfg]))
    arr = aligned_rows(4)
    with pytest.raises(ValueError, match=match):
        SecondaryTierFactory.create_secondary_tier(cfg, memoryview(arr), spec)
    if "direct" in bad:  # refused before any directory is made
        assert not os.path.exists(os.path.join(root, "pykvtier"))


@pytest.mark.parametrize("bad, match", [
    ({"engine": "io-uring"}, r"^PyKVTier: unknown engine 'io-uring': expected 'auto', 'uring' or 'posix'$"),
    ({"queue_depth": 10000}, r"^PyKVTier: queue_depth must be in 1\.\.4096, got 10000$"),
    ({"capacity_bytes": 1}, r"^PyKVTier \(capacity_bytes=1 split over 2 roots\): capacity_bytes=0 cannot hold one"),
])
def test_disk_tier_options_are_checked_before_any_root_is_touched(root, bad, match):
    cfg = {**tier_config([os.path.join(root, "a"), os.path.join(root, "b")]), **bad}
    spec = OffloadingSpecFactory.create_spec(offloading_config([cfg]))
    with pytest.raises(ValueError, match=match):
        SecondaryTierFactory.create_secondary_tier(cfg, memoryview(aligned_rows(4)), spec)
    assert sorted(os.listdir(root)) == []


def test_verify_reaches_every_root(root):
    roots = [os.path.join(root, "a"), os.path.join(root, "b")]
    cfg = tier_config(roots, verify="header")
    spec = OffloadingSpecFactory.create_spec(offloading_config([cfg]))
    tier = SecondaryTierFactory.create_secondary_tier(cfg, memoryview(aligned_rows(4)), spec)
    try:
        assert [t.verify for t in tier.tiers] == ["header", "header"]
        assert tier.config.verify == "header" and tier.config.root_dir == roots
    finally:
        tier.shutdown()


def test_direct_auto_is_the_file_systems_choice(root):
    cfg = {**tier_config(root), "direct": "auto"}
    spec = OffloadingSpecFactory.create_spec(offloading_config([cfg]))
    tier = SecondaryTierFactory.create_secondary_tier(cfg, memoryview(aligned_rows(4)), spec)
    try:
        from pykvtier import _native

        want = bool(_native.probe_direct(root)["direct"])
        assert tier.direct is want
    finally:
        tier.shutdown()


def _modes(tier: PyKVTier) -> dict[str, int]:
    """Permission bits of what the tier made: its directories, config.json, a block file."""
    (ns,) = tier.namespace_dirs
    (block,) = block_files(tier)
    paths = {"pykvtier/": os.path.dirname(ns), "namespace/": ns,
             "blocks/": os.path.join(ns, "blocks"), "fan-out/": os.path.dirname(block),
             "config.json": os.path.join(ns, "config.json"), "block": block}
    return {name: os.stat(p).st_mode & 0o7777 for name, p in paths.items()}


@pytest.mark.parametrize("mode, files, dirs", [
    (None, 0o600, 0o700),  # default: KV blocks are user data
    ("640", 0o640, 0o750),  # a string of octal digits (JSON has no octal literals)
    ("0o660", 0o660, 0o770),
    (0o640, 0o640, 0o750),  # 416 in JSON
])
def test_mode_sets_the_files_and_directories_it_makes(root, make_tier, mode, files, dirs):
    old_umask = os.umask(0o077)  # exact modes, whatever the umask
    try:
        cfg = tier_config(os.path.join(root, "r")) if mode is None else \
            tier_config(os.path.join(root, "r"), mode=mode)
        tier, arr = make_tier(cfg)
    finally:
        os.umask(old_umask)
    assert [t.file_mode for t in tier.tiers] == [files]
    fill(arr, [key(1)], [0])
    assert run(tier, job(1, [key(1)], [0], promotion=False))[1].success
    assert _modes(tier) == {"pykvtier/": dirs, "namespace/": dirs, "blocks/": dirs,
                            "fan-out/": dirs, "config.json": files, "block": files}


def test_min_free_bytes_is_passed_to_every_root(root, make_tier):
    roots = [os.path.join(root, "a"), os.path.join(root, "b")]
    tier, _ = make_tier(tier_config(roots, min_free_bytes=12345))
    assert [t.min_free_bytes for t in tier.tiers] == [12345, 12345]  # per file system, not split
    zero, _ = make_tier(tier_config(os.path.join(root, "z"), min_free_bytes=0))
    assert [t.min_free_bytes for t in zero.tiers] == [0]
    default, _ = make_tier(tier_config(os.path.join(root, "d")))  # null: 5 % of the file system
    st = os.statvfs(default.namespace_dirs[0])
    assert [t.min_free_bytes for t in default.tiers] == [st.f_blocks * st.f_frsize // 20]


def _second_tier_error(root, **options) -> str:
    """The error of a PyKVTier on ``root`` made as vLLM makes it (OffloadingSpecFactory ->
    get_manager -> SecondaryTierFactory): the message it fails with at start-up."""
    spec = OffloadingSpecFactory.create_spec(offloading_config([tier_config(root, **options)]))
    with pytest.raises(ValueError) as ei:
        spec.get_manager()
    return str(ei.value)


def test_two_instances_on_one_root_the_second_is_refused_naming_the_holder(root, stack):
    first = stack([tier_config(root)])  # holds ROOT/pykvtier/<model ns> exclusively
    (ns,) = first.tier.namespace_dirs
    msg = _second_tier_error(root)
    assert msg == (
        f"PyKVTier: root {root!r} is in use by pid {os.getpid()} (this process): its directory "
        f"for this model ({ns}) is locked ({ns}/.pykvtier.lock) and another tier holds it (an "
        "instance of the same model and layout). Give each vLLM instance its own root_dir "
        "entry, or set shared: true on every instance if they share it on purpose")
    # shared instances share it; an exclusive one cannot join them, nor they it
    first.m.shutdown()
    a = stack([tier_config(root, shared=True)])
    b = stack([tier_config(root, shared=True)])
    assert a.tier.namespace_dirs == b.tier.namespace_dirs == [ns]
    assert _second_tier_error(root).startswith(
        f"PyKVTier: root {root!r} is in use by pid {os.getpid()} (this process): ")


def test_shared_instance_refused_by_an_exclusive_one_in_another_process(root, stack):
    s = stack([tier_config(root)])
    (ns,) = s.tier.namespace_dirs
    s.m.shutdown()  # the lock is let go with the tier: another process takes it
    holder = subprocess.Popen(
        [sys.executable, "-P", "-c", "import sys; from pykvtier import DiskTier; "
         f"t = DiskTier({ns!r}, {BLOCK}); print('locked', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        msg = _second_tier_error(root, shared=True)
    finally:
        holder.communicate("")
    assert msg == (
        f"PyKVTier: root {root!r} is in use by pid {holder.pid}: its directory for this model "
        f"({ns}) is locked ({ns}/.pykvtier.lock) and a tier with shared: false holds it "
        "(exclusively). Set shared: true on every vLLM instance that shares this root_dir on "
        "purpose")
    assert holder.returncode == 0
    stack([tier_config(root, shared=True)])  # the holder is gone: it starts


def test_root_dir_that_is_a_file_is_named(root):
    a_file = os.path.join(root, "a-file")
    with open(a_file, "w") as f:
        f.write("x")
    spec = OffloadingSpecFactory.create_spec(offloading_config([tier_config(a_file)]))
    with pytest.raises(ValueError, match=f"PyKVTier: root '{a_file}': cannot create the tier's "
                                         f"directory \\({a_file}/pykvtier.*: Not a directory\\)"):
        SecondaryTierFactory.create_secondary_tier(tier_config(a_file), memoryview(aligned_rows(4)), spec)


def test_root_dir_is_required_and_listed_once(root):
    spec = OffloadingSpecFactory.create_spec(offloading_config([tier_config(root)]))
    view = memoryview(aligned_rows(4))
    with pytest.raises(ValueError, match="'root_dir' is required"):
        SecondaryTierFactory.create_secondary_tier(dict(TIER), view, spec)
    with pytest.raises(ValueError, match="lists .* twice"):
        SecondaryTierFactory.create_secondary_tier(tier_config([root, root + "/"]), view, spec)


# ------------------------------------------------------------------------- under vLLM's manager


@pytest.mark.parametrize("nroots", [1, 3])
def test_cascade_evict_promote_bytes_exact(root, stack, nroots):
    """Stores cascade to the tier; the primary evicts them; a lookup promotes them back and
    the primary rows hold the original bytes exactly."""
    roots = [os.path.join(root, f"nvme{i}") for i in range(nroots)]
    s = stack([tier_config(roots if nroots > 1 else roots[0])], num_chunks=8)
    a, b = s.request("A"), s.request("B")
    ka = [key(i, b"A") for i in range(8)]
    kb = [key(i, b"B") for i in range(8)]
    assert s.offload(a, ka) == ka
    s.end_step()  # the cascade jobs were submitted in complete_store
    assert s.tier.has_pending_work() and s.m.has_pending_work()
    s.io()
    assert s.offload(b, kb) == kb  # collects the cascades, then evicts all of A from the primary
    s.end_step()
    s.io()
    s.step()
    with s.lock:
        assert [s.m.primary_tier.lookup(k, a) for k in ka] == [MISS] * 8
        assert [s.tier.lookup(k, a) for k in ka] == [HIT] * 8
    assert len(block_files(s.tier)) == 16
    if nroots > 1:  # sharded by key digest: every root holds some, each key in its own shard
        assert all(glob.glob(f"{ns}/blocks/*/*") for ns in s.tier.namespace_dirs)
        for k in ka + kb:
            shard = int.from_bytes(key_digest(k)[:8], "little") % nroots  # the documented rule
            assert path_of(s.tier, k).startswith(s.tier.namespace_dirs[shard])

    c = s.request("C")
    assert s.lookup(c, ka) == [HIT_PENDING] * 8  # promotions started (allocated in the primary)
    s.end_step()  # one load job for request C
    assert s.tier.stats()["loads_submitted"] == min(nroots, 8)  # one part per shard
    s.io()
    assert s.lookup(c, ka) == [HIT] * 8
    assert s.loaded_bytes(c, ka) == [payload(k) for k in ka]
    st = s.tier.stats()
    assert st["blocks_loaded"] == 8 and st["load_failures"] == 0
    if s.tier.engine_name == "uring":
        # the 8 loads read through the registered view; new block files are written by one
        # WRITEV each (header + payload), recycled ones from the view
        assert st["fixed_buffer_ios"] == 8 + st.get("files_recycled", 0)
    for ctx in (a, b, c):
        s.finish(ctx)


def test_two_requests_sharing_a_block_in_one_step_read_it_once(root, stack):
    s = stack(root, num_chunks=8)
    w = s.request("writer")
    keys = [key(i) for i in range(8)]
    s.offload(w, keys)
    s.end_step()
    s.io()
    s.offload(w, [key(i, b"filler") for i in range(8)])  # evicts all 8 from the primary
    s.end_step()
    s.io()
    s.step()
    s.finish(w)
    r1, r2 = s.request("r1"), s.request("r2")
    shared, own1, own2 = keys[0], keys[1], keys[2]
    assert s.lookup(r1, [shared, own1]) == [HIT_PENDING, HIT_PENDING]
    assert s.lookup(r2, [shared, own2]) == [HIT_PENDING, HIT_PENDING]  # same step
    s.end_step()
    s.io()
    assert s.lookup(r1, [shared, own1]) == [HIT, HIT]
    assert s.lookup(r2, [shared, own2]) == [HIT, HIT]
    st = s.tier.stats()
    assert st["blocks_loaded"] == 3 and st["bytes_loaded"] == 3 * BLOCK  # the shared block once
    assert st["loads_submitted"] == 2  # one load job per request
    assert s.loaded_bytes(r1, [shared, own1]) == [payload(shared), payload(own1)]
    assert s.loaded_bytes(r2, [shared, own2]) == [payload(shared), payload(own2)]


@pytest.mark.parametrize("damage", ["truncate", "flip_payload_byte", "remove"])
def test_damaged_block_is_miss_after_the_failed_promotion(root, stack, damage):
    s = stack(root, num_chunks=4)
    w = s.request("w")
    keys = [key(i) for i in range(4)]
    s.offload(w, keys)
    s.end_step()
    s.io()
    s.offload(w, [key(i, b"filler") for i in range(4)])
    s.end_step()
    s.io()
    s.step()
    s.finish(w)
    bad = keys[1]
    path = path_of(s.tier, bad)
    if damage == "truncate":
        os.truncate(path, HEADER_BYTES + BLOCK // 2)
    elif damage == "flip_payload_byte":
        with open(path, "r+b") as f:
            f.seek(HEADER_BYTES + 1000)
            b = f.read(1)
            f.seek(HEADER_BYTES + 1000)
            f.write(bytes([b[0] ^ 1]))
    else:
        os.unlink(path)
    r = s.request("r")
    answers = [s.lookup(r, keys)]
    assert answers[0] == [HIT_PENDING] * 4  # the index still says present: promotion starts
    for _ in range(4):  # bounded: a few steps, never a livelock
        s.end_step()
        s.io()
        answers.append(s.lookup(r, keys))
        if answers[-1][1] is MISS:
            break
    assert answers[-1] == [HIT, MISS, HIT, HIT], answers
    assert len(answers) == 2  # MISS right at the step after the failed promotion
    for _ in range(3):  # and it stays a MISS: nothing is promoted again
        s.end_step()
        s.io()
        assert s.lookup(r, [bad]) == [MISS]
    st = s.tier.stats()
    assert st["load_failures"] == 1 and st["blocks_loaded"] == 3
    if damage != "remove":
        assert st["verify_failures"] == 1 and st["quarantined"] == 1
        assert not os.path.exists(path)
    good = [keys[0], keys[2], keys[3]]
    assert s.loaded_bytes(r, good) == [payload(k) for k in good]


def test_reset_cache_drains_in_flight_jobs(root, stack):
    s = stack(root, num_chunks=8)
    w = s.request("w")
    keys = [key(i) for i in range(8)]
    s.offload(w, keys)
    s.end_step()
    s.io()
    s.offload(w, [key(i, b"filler") for i in range(4)])  # cascades in flight, not drained
    r = s.request("r")
    assert s.lookup(r, keys[:4]) == [HIT_PENDING] * 4
    s.end_step()  # promotion submitted, not drained
    assert s.tier.has_pending_work()
    with s.lock:
        s.m.reset_cache()  # drain_jobs(), then asserts no job is left in flight
        assert not s.m._jobs and not s.tier.has_pending_work()
        assert all(t.engine.pending_jobs() == 0 for t in s.tier.tiers)
        if hasattr(s.m, "on_reset_flushed"):  # vLLM >= 0.33 holds promotions until then
            s.m.on_reset_flushed()
    # The tier keeps its blocks across the reset (persistent store): promote again.
    assert s.lookup(r, keys[4:]) == [HIT_PENDING] * 4
    s.end_step()
    s.io()
    assert s.lookup(r, keys[4:]) == [HIT] * 4
    assert s.loaded_bytes(r, keys[4:]) == [payload(k) for k in keys[4:]]


def _fail(what: str):
    def call(*args, **kwargs):
        raise AssertionError(f"lookup called {what}")
    return call


_BLOCKING = ("wait", "drain", "await_buffers", "shutdown")  # an engine's blocking calls


def test_lookup_never_blocks(root, stack, make_tier):
    """Every lookup answer (HIT, MISS, RETRY while written, RETRY while probed) comes from
    memory: the engines' and the probe's blocking calls are made to fail during lookups. The
    measured time per lookup is printed (no timed assert)."""
    # probe_ttl_s: a probe's "not found" must not expire before the MISS it is asserted as
    s = stack([tier_config(root, shared=True, probe_ttl_s=3600.0)], num_chunks=8)
    tier = s.tier
    w = s.request("w")
    stored = [key(i) for i in range(4)]
    s.offload(w, stored)
    s.end_step()
    s.io()
    s.step()
    writing = [key(i, b"writing") for i in range(4)]
    s.offload(w, writing)  # cascade in flight, not collected: RETRY
    # another process's tier on the same root writes a block (shared too: a root is locked)
    other, arr = make_tier(tier_config(root, shared=True))
    fill(arr, [key(0, b"other")], [0])
    run(other, job(1, [key(0, b"other")], [0], promotion=False))

    ctx = ReqContext("probe")
    with pytest.MonkeyPatch.context() as mp:  # every blocking call fails inside
        for t in tier.tiers:
            for name in _BLOCKING:
                mp.setattr(type(t.engine), name, _fail(f"the blocking engine.{name}()"))
            for name in ("wait", "drain", "shutdown"):
                mp.setattr(t, name, _fail(f"DiskTier.{name}()"))
            if t._probe is not None:
                mp.setattr(t._probe, "wait", _fail("ExistenceProbe.wait()"))
        assert [tier.lookup(k, ctx) for k in stored] == [HIT] * 4
        assert [tier.lookup(k, ctx) for k in writing] == [RETRY] * 4  # being written
        assert tier.lookup(key(0, b"other"), ctx) is RETRY  # unknown here: probed
        n = 20000
        ks = [stored[i % 4] for i in range(n)]
        t0 = time.perf_counter()
        for k in ks:
            tier.lookup(k, ctx)
        per_hit = (time.perf_counter() - t0) / n
        misses = [key(i, b"absent") for i in range(n)]
        t0 = time.perf_counter()
        for k in misses:
            tier.lookup(k, ctx)  # shared root: RETRY, a probe is queued
        per_new = (time.perf_counter() - t0) / n
        print(f"\nPyKVTier.lookup: {per_hit * 1e6:.2f} us per HIT, {per_new * 1e6:.2f} us per "
              f"unknown key (probe queued), {n} lookups each")
    tier.on_schedule_end(ScheduleEndContext((), ()))  # the probes go out
    tier.drain_jobs()
    assert tier.lookup(key(0, b"other"), ctx) is HIT  # found by the probe
    assert tier.lookup(misses[0], ctx) is MISS


def test_touch_feeds_eviction(root, stack):
    s = stack([tier_config(root, capacity_bytes=3 * (BLOCK + HEADER_BYTES))], num_chunks=8)
    w = s.request("w")
    k = [key(i) for i in range(4)]
    s.offload(w, k[:3])
    s.end_step()
    s.io()
    s.step()
    with s.lock:
        s.m.touch([k[0]], w)  # vLLM touches every tier: k0 is now the most recent
    s.offload(w, [k[3]])  # the tier must evict one: k1, not k0
    s.end_step()
    s.io()
    s.step()
    assert [s.tier.lookup(x, w) for x in k] == [HIT, MISS, HIT, HIT]
    assert s.tier.stats()["evictions"] == 1


# ------------------------------------------------------------------------- the tier alone


@pytest.mark.parametrize("batch", [1, 3, 16])
def test_data_integrity_across_chunk_ids_and_batch_sizes(root, make_tier, batch):
    tier, arr = make_tier(root, num_chunks=16)
    keys = [key(i) for i in range(16)]
    src_rows = list(np.random.default_rng(batch).permutation(16))
    fill(arr, keys, src_rows)
    jobs = [job(j, keys[i:i + batch], src_rows[i:i + batch], promotion=False)
            for j, i in enumerate(range(0, 16, batch))]
    res = run(tier, *jobs)
    assert all(r.success and r.transfer_bytes == len(jobs[r.job_id].keys) * BLOCK
               for r in res.values())
    arr[:] = 0
    dst_rows = list(np.random.default_rng(batch + 100).permutation(16))
    jobs = [job(100 + j, keys[i:i + batch], dst_rows[i:i + batch], promotion=True)
            for j, i in enumerate(range(0, 16, batch))]
    res = run(tier, *jobs)
    assert all(r.success and r.successful_keys is None for r in res.values())
    assert all(r.transfer_time is not None and r.transfer_time >= 0 for r in res.values())
    for k, c in zip(keys, dst_rows):
        assert arr[c].tobytes() == payload(k)


def test_partial_load_reports_exactly_the_good_keys(root, make_tier):
    tier, arr = make_tier([os.path.join(root, "a"), os.path.join(root, "b")], num_chunks=16)
    keys = [key(i) for i in range(8)]
    fill(arr, keys, range(8))
    assert run(tier, job(1, keys, range(8), promotion=False))[1].success
    os.truncate(path_of(tier, keys[2]), 100)
    os.unlink(path_of(tier, keys[5]))
    arr[:] = 0
    never = key(99, b"never")
    res = run(tier, job(2, keys + [never], list(range(8, 16)) + [0], promotion=True))[2]
    good = [k for i, k in enumerate(keys) if i not in (2, 5)]
    assert res.success is False and sorted(res.successful_keys) == sorted(good)
    assert res.transfer_bytes == len(good) * BLOCK
    for i, k in enumerate(keys):
        if k in good:
            assert arr[8 + i].tobytes() == payload(k)
    assert [tier.lookup(k, ReqContext("r")) for k in keys] == \
        [HIT, HIT, MISS, HIT, HIT, MISS, HIT, HIT]
    res = run(tier, job(3, [keys[2]], [1], promotion=True))[3]  # no second attempt at the disk
    assert res.success is False and res.successful_keys is None
    assert tier.stats()["load_failures"] == 2


@pytest.mark.parametrize("nroots", [1, 2])
def test_load_giving_one_chunk_to_two_keys_fails_whole_and_loses_nothing(root, make_tier, caplog, nroots):
    """Two keys of one load job into one row (with two roots: keys of different shards) would
    race into it; the job fails before anything is read, logged, and every block stays intact."""
    roots = [os.path.join(root, f"r{i}") for i in range(nroots)]
    tier, arr = make_tier(tier_config(roots if nroots > 1 else roots[0]), num_chunks=16)
    shard = lambda k: int.from_bytes(key_digest(k)[:8], "little") % nroots  # noqa: E731
    candidates = [key(i) for i in range(40)]
    a = next(k for k in candidates if shard(k) == 0)
    b = next(k for k in candidates if shard(k) == nroots - 1 and k != a)
    fill(arr, [a, b], [0, 1])
    assert run(tier, job(1, [a, b], [0, 1], promotion=False))[1].success
    arr[:] = 0xAB
    caplog.clear()
    res = run(tier, job(2, [a, b], [15, 15], promotion=True))[2]
    assert (res.success, res.successful_keys, res.transfer_bytes) == (False, None, 0)
    assert (arr == 0xAB).all()  # nothing read
    where = f" to {tier.tiers[0].layout.root}: job 2: slot 15" if nroots == 1 else ": chunk 15"
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [
        f"pykvtier: load job 2 (2 keys) not submitted{where} given twice; a load needs a "
        + ("slot" if nroots == 1 else "chunk") + " per key"]
    st = tier.stats()
    assert (st["loads_submitted"], st["load_failures"], st["verify_failures"], st["quarantined"]) == \
        (0, 0, 0, 0)
    assert [tier.lookup(k, ReqContext("r")) for k in (a, b)] == [HIT, HIT]
    assert run(tier, job(3, [b, a], [14, 15], promotion=True))[3].success
    assert (arr[14].tobytes(), arr[15].tobytes()) == (payload(b), payload(a))


def test_corrupt_header_and_wrong_key_are_never_returned(root, make_tier):
    tier, arr = make_tier(root, num_chunks=8)
    keys = [key(i) for i in range(3)]
    fill(arr, keys, range(3))
    assert run(tier, job(1, keys, range(3), promotion=False))[1].success
    with open(path_of(tier, keys[0]), "r+b") as f:  # header magic
        f.write(b"XXXX")
    os.replace(path_of(tier, keys[2]), path_of(tier, keys[1]))  # k1's name, k2's bytes
    arr[:] = 0
    res = run(tier, job(2, keys[:2], [5, 6], promotion=True))[2]
    assert res.success is False and res.successful_keys is None
    assert not arr[5].any() or arr[5].tobytes() != payload(keys[1])  # never k2's bytes as k1
    st = tier.stats()
    assert st["verify_failures"] == 2 and st["quarantined"] == 2
    assert [tier.lookup(k, ReqContext("r")) for k in keys[:2]] == [MISS, MISS]


def test_every_job_reported_exactly_once_across_roots(root, make_tier):
    roots = [os.path.join(root, f"d{i}") for i in range(3)]
    tier, arr = make_tier(roots, num_chunks=64)
    keys = [key(i) for i in range(64)]
    fill(arr, keys, range(64))
    stores = [job(i, keys[i * 8:(i + 1) * 8], range(i * 8, (i + 1) * 8), False) for i in range(8)]
    for j in stores:
        tier.submit_store(j)
    seen: list[int] = []
    for _ in range(3):  # polled while running, then drained: still once each
        seen += [r.job_id for r in tier.get_finished_jobs()]
    tier.drain_jobs()
    seen += [r.job_id for r in tier.get_finished_jobs()]
    assert sorted(seen) == list(range(8)) and not tier.has_pending_work()
    assert list(tier.get_finished_jobs()) == []
    arr[:] = 0
    loads = [job(100 + i, keys[i::8], range(i * 8, (i + 1) * 8), True) for i in range(8)]
    empty = job(200, [], [], True)
    res = run(tier, *loads, empty)
    assert all(r.success for r in res.values())
    for i in range(8):
        for n, k in enumerate(keys[i::8]):
            assert arr[i * 8 + n].tobytes() == payload(k)


def test_drain_waits_for_every_copy_and_aborts_none(root, make_tier):
    tier, arr = make_tier(root, num_chunks=64)
    keys = [key(i) for i in range(64)]
    fill(arr, keys, range(64))
    for i in range(8):
        tier.submit_store(job(i, keys[i * 8:(i + 1) * 8], range(i * 8, (i + 1) * 8), False))
    tier.drain_jobs()
    assert all(t.engine.pending_jobs() == 0 for t in tier.tiers)
    assert len(block_files(tier)) == 64
    assert not glob.glob(f"{tier.namespace_dirs[0]}/blocks/*/*.tmp.*")
    assert sorted(r.job_id for r in tier.get_finished_jobs() if r.success) == list(range(8))
    arr[:] = 0
    for i in range(8):
        tier.submit_load(job(10 + i, keys[i * 8:(i + 1) * 8], range(i * 8, (i + 1) * 8), True))
    tier.drain_jobs()  # after this no I/O touches the view: its bytes are final
    snapshot = arr.copy()
    res = list(tier.get_finished_jobs())
    assert sorted(r.job_id for r in res) == list(range(10, 18)) and all(r.success for r in res)
    assert np.array_equal(arr, snapshot)
    for k, c in zip(keys, range(64)):
        assert arr[c].tobytes() == payload(k)


def test_shutdown_with_pending_work(root, make_tier):
    tier, arr = make_tier(root, num_chunks=32)
    keys = [key(i) for i in range(32)]
    fill(arr, keys, range(32))
    assert run(tier, job(0, keys[:16], range(16), False))[0].success
    tier.submit_store(job(1, keys[16:], range(16, 32), False))
    tier.submit_load(job(2, keys[:16], range(16), True))
    tier.shutdown()  # in flight: finished, not aborted, then everything released
    tier.shutdown()  # idempotent
    assert all(t._closed for t in tier.tiers)
    # Whatever landed is whole: a new tier on the root loads every block byte-exact.
    again, arr2 = make_tier(root, num_chunks=32)
    assert not glob.glob(f"{again.namespace_dirs[0]}/blocks/*/*.tmp.*")
    present = [k for k in keys if again.lookup(k, ReqContext("r")) is HIT]
    assert len(present) == 32
    assert run(again, job(3, present, range(32), True))[3].success
    for k, c in zip(present, range(32)):
        assert arr2[c].tobytes() == payload(k)


def test_manager_shutdown_releases_the_primary_mmap(root, stack):
    s = stack(root, num_chunks=8)
    w = s.request("w")
    s.offload(w, [key(i) for i in range(8)])  # cascades in flight at shutdown
    region = s.m.primary_tier._mmap_region
    s.view = None
    s.m.shutdown()
    assert region.mmap_obj is None  # no export of ours kept the mapping alive
    assert all(t._closed for t in s.tier.tiers)


@pytest.mark.parametrize("nroots", [1, 2])
def test_wait_blocks_until_a_job_finished(root, make_tier, nroots):
    roots = [os.path.join(root, f"d{i}") for i in range(nroots)]
    tier, arr = make_tier(roots if nroots > 1 else roots[0])
    keys = [key(i) for i in range(8)]
    fill(arr, keys, range(8))
    tier.submit_store(job(1, keys, range(8), False))
    seen = []
    while tier.has_pending_work():  # wait() returns only with a result ready (no timeout)
        tier.wait()
        got = list(tier.get_finished_jobs())
        assert got or not tier.has_pending_work()
        seen += [r.job_id for r in got]
    assert seen == [1]
    tier.wait()  # nothing in flight: returns at once
    tier.wait(0.001)


def test_retry_while_block_is_written_hit_after(root, make_tier):
    tier, arr = make_tier(root)
    k = key(1)
    fill(arr, [k], [0])
    tier.submit_store(job(1, [k], [0], False))
    assert tier.lookup(k, ReqContext("r")) is RETRY  # being written is not a miss
    tier.drain_jobs()
    assert tier.lookup(k, ReqContext("r")) is RETRY  # until the job is collected
    assert [r.job_id for r in tier.get_finished_jobs()] == [1]
    assert tier.lookup(k, ReqContext("r")) is HIT


def test_load_in_flight_is_a_hit_for_vllm(root, make_tier):
    """DiskTier says HIT_PENDING while a load of the block is in flight; vLLM gets HIT."""
    tier, arr = make_tier(root)
    k = key(1)
    fill(arr, [k], [0])
    run(tier, job(1, [k], [0], False))
    tier.submit_load(job(2, [k], [1], True))
    assert tier.tiers[0].lookup(k).name == "HIT_PENDING"
    assert tier.lookup(k, ReqContext("r")) is HIT
    tier.drain_jobs()
    tier.get_finished_jobs()


# ------------------------------------------------------------------------- events and figures


def test_kv_events_for_stores_evictions_and_failed_loads(root, make_tier):
    cap = 3 * (BLOCK + HEADER_BYTES)
    tier, arr = make_tier(tier_config(root, enable_kv_events=True, locality="LOCAL",
                                      capacity_bytes=cap), events=True)
    keys = [key(i) for i in range(5)]
    fill(arr, keys, range(5))
    run(tier, job(1, keys[:3], range(3), False))
    run(tier, job(2, keys[:2], range(2), False))  # already there: not announced again
    (ev,) = list(tier.take_events())
    assert ev.removed is False and ev.medium is Medium.STORAGE and ev.locality.value == "LOCAL"
    assert ev.keys == keys[:3]
    tier.touch([keys[2]], ReqContext("r"))  # LRU order k0, k1, k2 (job 2 made k0, k1 recent)
    run(tier, job(3, keys[3:5], [3, 4], False))  # evicts k0, k1 (LRU)
    evs = list(tier.take_events())
    assert [(e.removed, sorted(e.keys)) for e in evs] == [
        (False, sorted(keys[3:5])), (True, sorted(keys[:2]))]
    os.truncate(path_of(tier, keys[3]), 10)
    run(tier, job(4, [keys[3]], [9], True))
    (ev,) = list(tier.take_events())
    assert ev.removed is True and ev.keys == [keys[3]]
    assert list(tier.take_events()) == []


def test_no_events_unless_enabled_globally(root, make_tier, caplog):
    tier, arr = make_tier(tier_config(root, enable_kv_events=True), events=False)
    assert "KV cache events are off globally" in caplog.text
    fill(arr, [key(0)], [0])
    run(tier, job(1, [key(0)], [0], False))
    assert list(tier.take_events()) == []


def test_metrics_and_config_info_are_declared_and_filled(root, make_tier):
    cfg = tier_config(root, capacity_bytes=2 * (BLOCK + HEADER_BYTES))
    defs = PyKVTier.build_metric_definitions(cfg)
    extra = offloading_config([cfg]).extra_config
    assert set(defs) <= set(TieringOffloadingSpec.build_metric_definitions(dict(extra)))
    if hasattr(TieringOffloadingSpec, "config_info_keys"):  # vLLM >= 0.33
        keys_declared = TieringOffloadingSpec.config_info_keys(dict(extra))
        assert set(PyKVTierInfo.config_info_keys()) <= set(keys_declared)
    tier, arr = make_tier(cfg)
    assert tuple(tier.config_info()) == PyKVTier.config_info_keys(cfg)
    keys = [key(i) for i in range(3)]
    fill(arr, keys, range(3))
    run(tier, job(1, keys[:2], range(2), False))
    run(tier, job(3, keys[2:], [2], False))  # one eviction
    os.truncate(path_of(tier, keys[2]), 10)
    run(tier, job(2, keys[1:], [5, 6], True))  # one good, one corrupt
    st = tier.get_stats()
    types, values = sections(st)
    for name, per_label in values.items():
        assert name in defs, name
        for labels in per_label:
            assert len(labels) == len(defs[name].labelnames), name
    M, lab = PyKVTierMetrics, (root,)
    assert values[M.WRITE_BYTES][lab] == 3 * BLOCK and values[M.BLOCKS_WRITTEN][lab] == 3
    assert values[M.READ_BYTES][lab] == BLOCK and values[M.LOAD_FAILURES][lab] == 1
    assert values[M.VERIFY_FAILURES][lab] == 1 and values[M.EVICTIONS][lab] == 1
    assert values[M.WRITE_TIME][lab] > 0 and values[M.READ_TIME][lab] > 0
    assert values[M.USED_BYTES][lab] == BLOCK + HEADER_BYTES
    assert len(values[M.LOAD_JOB_TIME][()]) == 1 and len(values[M.STORE_JOB_TIME][()]) == 2
    direct_fallbacks = values.get(M.DIRECT_FALLBACKS, {}).get(lab, 0)
    assert direct_fallbacks == int(not tier.direct)
    assert tier.config_info()["pykvtier_direct"] == tier.direct
    st2 = tier.get_stats()  # counters are deltas since the last call; gauges stay
    assert M.WRITE_BYTES not in sections(st2)[1]
    assert sections(st2)[1][M.USED_BYTES][lab] == BLOCK + HEADER_BYTES


def test_stats_aggregate_through_the_manager(root, stack):
    s = stack(root, num_chunks=8)
    w = s.request("w")
    s.offload(w, [key(i) for i in range(4)])
    s.end_step()
    s.io()
    s.step()
    with s.lock:
        reduced = s.m.get_stats().reduce()
    assert reduced[f"{PyKVTierMetrics.WRITE_BYTES}:{(root,)}"] == 4 * BLOCK
    assert reduced["vllm:kv_offload_tiering_write_bytes:('1:PyKVTier',)"] == 4 * BLOCK


def test_each_key_is_hashed_once_per_call_across_shards(root, make_tier, monkeypatch):
    """With several roots the adapter computes a key's digest once per call and hands it to
    the shard's DiskTier (which then hashes nothing): lookups, stores, loads and touches."""
    import pykvtier.integrations.vllm as adapter
    import pykvtier.tier as tier_mod

    tier, arr = make_tier(tier_config([os.path.join(root, "a"), os.path.join(root, "b")]))
    keys = [key(i) for i in range(6)]
    fill(arr, keys, range(6))
    calls = []
    real = adapter.key_digest
    monkeypatch.setattr(adapter, "key_digest", lambda k: calls.append(k) or real(k))

    def no_hash(*a, **kw):
        raise AssertionError("DiskTier hashed a key the adapter had hashed")

    monkeypatch.setattr(tier_mod._native, "key_digests", no_hash)
    monkeypatch.setattr(tier_mod, "key_digest", no_hash)
    assert all(r.success for r in run(tier, job(1, keys, range(6), False)).values())
    assert calls == keys
    calls.clear()
    ctx = ReqContext("r")
    assert [tier.lookup(k, ctx) for k in keys] == [HIT] * 6 and calls == keys
    calls.clear()
    tier.touch(keys[:2], ctx)
    assert calls == keys[:2]
    calls.clear()
    arr[:] = 0
    assert all(r.success for r in run(tier, job(2, keys, range(6), True)).values())
    assert calls == keys and [arr[i].tobytes() for i in range(6)] == [payload(k) for k in keys]


# ------------------------------------------------------------------------- bypass: auto
# The recompute estimate of bypass_model llama-3-8b on one H100 at mfu 0.5, a key being a
# 16-token chunk (the spec's 16-token GPU blocks, 1 per chunk): the key ending at token
# 16 (j + 1) recomputes in (223,418,122,240 + 134,217,728 j) FLOPs / 494.7e12 FLOP/s
# = 451.623 us + 0.2713 us x j (hand calculation: tests/test_costmodel.py). A key loads
# BLOCK = 32 KiB: 327.68 us at 1e8 B/s, 655.36 us at 5e7 B/s.


def _r(j: int) -> float:
    return (223_418_122_240 + 134_217_728 * j) / 494.7e12


def bypass_tier(make_tier, root, bytes_per_s, num_chunks=32):
    cfg = tier_config(root, bypass="auto", bypass_model="llama-3-8b", bypass_gpu="h100",
                      bypass_mfu=0.5, bypass_bytes_per_s=bytes_per_s)
    return make_tier(cfg, num_chunks=num_chunks)


def request(rid: str, keys, first_chunk: int = 0) -> ReqContext:
    """A ReqContext with its keys' end-token positions, as vLLM's scheduler records them."""
    ctx = ReqContext(rid)
    for j, k in enumerate(keys):
        ctx.set_offload_key_position(k, 16 * (first_chunk + j + 1))
    return ctx


def stored_keys(tier, arr, n: int, tag: bytes = b"bp") -> list[bytes]:
    keys = [key(i, tag) for i in range(n)]
    fill(arr, keys, range(n))
    assert all(r.success for r in run(tier, job(1, keys, range(n), False)).values())
    return keys


BYPASS_STATS = ("bypassed_hits", "bypassed_requests", "bypass_deferrals")


def test_bypass_is_off_by_default(root, make_tier):
    tier, arr = make_tier(root)
    assert tier.config.bypass == "off" and tier.prefill is None and tier.bandwidth is None
    keys = stored_keys(tier, arr, 4)
    ctx = request("r", keys + [key(99)])
    assert [tier.lookup(k, ctx) for k in keys + [key(99)]] == [HIT] * 4 + [MISS]
    assert ctx._state == {}  # nothing kept in the request's scratch space
    assert {k: tier.stats()[k] for k in BYPASS_STATS} == dict.fromkeys(BYPASS_STATS, 0)


def test_bypass_fast_tier_hits_at_once(root, make_tier):
    """1e9 B/s: 32.8 us to load a key, 451.6 us to recompute it: HIT, no deferral."""
    tier, arr = bypass_tier(make_tier, root, 1e9)
    keys = stored_keys(tier, arr, 8)
    a, b = request("a", keys[:4]), request("b", keys[4:], first_chunk=4)
    assert [tier.lookup(k, a) for k in keys[:4]] == [HIT] * 4
    # b behind a's 4 HITs of this step: (4 + 1) x 32.77 us <= 451.6 + 4 x 0.27 us
    assert [tier.lookup(k, b) for k in keys[4:]] == [HIT] * 4
    assert {k: tier.stats()[k] for k in BYPASS_STATS} == dict.fromkeys(BYPASS_STATS, 0)


def test_bypass_slow_tier_counts_for_a_step_then_misses(root, make_tier):
    """5e7 B/s: 655.36 us a key against 451.6 us: the first hit is not worth loading alone, so
    the request's hits answer RETRY for a step (counted: 4, the absent 5th key ends the
    scan); the next step decides k = 0 (4 x 655.36 = 2,621 us > 1,808 us), MISS for good."""
    tier, arr = bypass_tier(make_tier, root, 5e7)
    keys = stored_keys(tier, arr, 4)
    ask = keys + [key(99)]
    r = request("r", ask)
    assert [tier.lookup(k, r) for k in ask] == [RETRY] * 4 + [MISS]
    assert tier.lookup(keys[1], r) is RETRY  # looked up again in the same step: still counting
    assert tier.stats()["bypass_deferrals"] == 1 and tier.stats()["bypassed_hits"] == 0
    assert 4 * BLOCK / 5e7 > sum(_r(j) for j in range(4))
    for _ in range(3):
        tier.on_schedule_end(ScheduleEndContext((), ()))
        assert [tier.lookup(k, r) for k in ask] == [MISS] * 5
    st = tier.stats()
    assert (st["bypassed_hits"], st["bypassed_requests"], st["bypass_deferrals"]) == (4, 1, 1)
    assert st["loads_submitted"] == 0
    # vLLM's metrics get the counters (deltas since the last get_stats)
    types, values = sections(tier.get_stats())
    assert values[PyKVTierMetrics.BYPASSED_HITS][()] == 4
    assert values[PyKVTierMetrics.BYPASS_DEFERRALS][()] == 1
    assert PyKVTierMetrics.BYPASSED_HITS not in sections(tier.get_stats())[1]  # deltas


def test_bypass_queue_ahead_is_amortized_over_the_requests_hits(root, make_tier):
    """1e8 B/s (327.68 us a key < 451.6 us): a's 4 hits load at once, and its load job stays in
    flight (not collected). b (10 hits) and c (11 hits) queue behind 4 keys; their first hit
    would land at 5 x 327.68 = 1,638 us > 451.6 us, so both are counted for a step. Then:
    b: (4 + 10) x 327.68 = 4,587.5 us > sum r[0..9] = 4,528.4 us -> k = 0, MISS all 10;
    c: (4 + 11) x 327.68 = 4,915.2 us <= sum r[0..10] = 4,982.8 us -> k = 11, HIT all."""
    tier, arr = bypass_tier(make_tier, root, 1e8)
    keys = stored_keys(tier, arr, 25)
    ka, kb, kc = keys[:4], keys[4:14], keys[14:]
    a, b, c = request("a", ka), request("b", kb), request("c", kc)
    assert [tier.lookup(k, a) for k in ka] == [HIT] * 4
    assert [tier.lookup(k, b) for k in kb] == [RETRY] * 10
    assert [tier.lookup(k, c) for k in kc] == [RETRY] * 11
    tier.submit_load(TransferJob(job_id=7, keys=ka, chunk_ids=np.arange(25, 29, dtype=np.int32),
                                 is_promotion=True, req_context=a))  # vLLM's flush at step end
    tier.on_schedule_end(ScheduleEndContext((), ()))
    load = BLOCK / 1e8
    assert (4 + 10) * load > sum(_r(j) for j in range(10))
    assert (4 + 11) * load <= sum(_r(j) for j in range(11))
    assert [tier.lookup(k, b) for k in kb] == [MISS] * 10
    assert [tier.lookup(k, c) for k in kc] == [HIT] * 11
    st = tier.stats()
    assert (st["bypassed_hits"], st["bypassed_requests"], st["bypass_deferrals"]) == (10, 1, 2)
    tier.drain_jobs()
    (res,) = list(tier.get_finished_jobs())
    assert res.job_id == 7 and res.success
    assert [arr[c].tobytes() for c in range(25, 29)] == [payload(k) for k in ka]
    assert tier.bandwidth.loads == 1  # the finished load feeds the estimate


def test_bypass_through_vllms_manager(root, stack):
    """Through the TieringOffloadingManager: at 5e7 B/s the tier's RETRY defers the request a
    step without a promotion, then its hits are MISS; without positions (a lookup vLLM's
    scheduler did not place) the tier answers as without bypass."""
    cfg = tier_config(root, bypass="auto", bypass_model="llama-3-8b", bypass_bytes_per_s=5e7)
    s = stack([cfg], num_chunks=4)
    w = s.request("w")
    keys = [key(i) for i in range(4)]
    s.offload(w, keys)
    s.end_step()
    s.io()
    s.offload(w, [key(i, b"filler") for i in range(4)])  # evicts keys from the CPU tier
    s.end_step()
    s.io()
    s.step()
    s.finish(w)
    r = s.request("r")
    for j, k in enumerate(keys):
        r.set_offload_key_position(k, 16 * (j + 1))
    assert s.lookup(r, keys) == [RETRY] * 4
    s.end_step()
    assert s.lookup(r, keys) == [MISS] * 4
    assert s.tier.stats()["loads_submitted"] == 0 and s.tier.stats()["bypassed_hits"] == 4
    fast = s.request("fast")  # no positions: answered as without bypass, promoted
    assert s.lookup(fast, keys) == [HIT_PENDING] * 4
    s.end_step()
    s.io()
    assert s.lookup(fast, keys) == [HIT] * 4
    assert s.loaded_bytes(fast, keys) == [payload(k) for k in keys]
    s.finish(r)
    s.finish(fast)


@pytest.mark.parametrize("bad, match", [
    ({"bypass": "on"}, r"bypass must be \"off\" or \"auto\", got 'on'"),
    ({"bypass": "auto"}, "bypass: auto needs bypass_model"),
    ({"bypass": "auto", "bypass_model": "gpt-5"}, "bypass_model: unknown model preset 'gpt-5'"),
    ({"bypass_gpu": "v100"}, "bypass_gpu: unknown GPU preset 'v100'"),
    ({"bypass_mfu": 0}, r"bypass_mfu must be a number in \(0, 1\], got 0"),
    ({"bypass_bytes_per_s": -1}, "bypass_bytes_per_s must be null or a positive number"),
    ({"bypass_bytes_per_s": float("inf")}, "bypass_bytes_per_s must be null or a positive number"),
])
def test_bad_bypass_config(root, bad, match):
    with pytest.raises(ValueError, match=match):
        OffloadingSpecFactory.create_spec(offloading_config([tier_config(root, **bad)])) \
            .get_manager()
