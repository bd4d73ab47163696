#!/usr/bin/env python3
"""pykvtier's LMCache storage plug-in against LMCache's own LocalDiskBackend, side by side.

Every tier is built by LMCache itself, inside a real ``LMCacheEngine`` on CPU
(``LMCacheEngineConfig.from_defaults`` + ``LMCacheMetadata`` +
``LMCacheEngineBuilder.get_or_create``, with the CPU connector of tests/lmcache_cpu_connector.py,
then ``post_init()``), and is driven through the backend calls LMCache's StorageManager makes,
with the same chunks under the same ``CacheEngineKey``s:

* ``pykvtier``: ``storage_plugins: ["pykvtier"]`` with ``storage_plugin.pykvtier.module_path:
  pykvtier.integrations.lmcache`` (``PyKVTierStoragePlugin``): chunks move by address from
  LocalCPUBackend's arena, O_DIRECT, no copy.
* ``disk-buffered``: LMCache's ``LocalDiskBackend`` (``local_disk: <dir>/``): one ``.pt`` file per
  chunk, plain ``open().write`` / ``readinto`` on its thread pools (buffered: its stores end in
  the page cache).
* ``disk-odirect``: the same with ``extra_config: {"use_odirect": true}`` (O_DIRECT where the
  chunk's size is a multiple of the file system's block size; the header says whether it was).

Store, per batch (default 8 chunks): chunks allocated from the StorageManager (LocalCPUBackend's
allocator, as ``LMCacheEngine.store`` does) and filled outside the timing; then, timed:
``backend.batched_submit_put_task(keys, objs)``, ``ref_count_down()`` on every object right after
(as ``StorageManager.batched_put`` does), and a wait until every key is durable
(``not exists_in_put_tasks(k) and contains(k)``, polled every 0.5 ms). Retrieve, per batch:
``backend.batched_get_blocking(keys)`` timed (memory objects from LocalCPUBackend), then, outside
the timing, every chunk compared byte for byte (as uint8: random bf16 bytes hold NaNs) with what
was stored, overwritten with a poison pattern, and ``ref_count_down()``. Retrieves read the set
in random order of chunks, pass after pass until each tier has ``--min-batches`` batches.

Cold: the page cache is dropped (``sync; echo 3 > /proc/sys/vm/drop_caches``, where writable)
before each store phase, between the store and the retrieve phase, and before every retrieve
pass. LocalDiskBackend's buffered stores end in the page cache: the ``sync`` after each store
phase is timed apart (``sync s`` and GB/s with it). The page cache's growth over each phase
(/proc/meminfo Cached) is printed: it shows which tier's I/O went through the page cache.

Measured per batch call: wall time (p50/p99 over the batches), GB/s (chunk bytes / the calls'
wall time), CPU-s/GiB (``getrusage(RUSAGE_SELF)`` user+sys around each call: every thread of
the process: LMCache's event loop and disk pools, pykvtier's collectors, io_uring's workers; the
bench's own poll loop too, whose thread CPU is printed apart). The checksum floor is the
CPU-s/GiB of pykvtier's own XXH3-64 (``pykvtier._native.xxh3_64``, the payload check of every
pykvtier load) over the same chunk bytes, measured in the same run.

Targets (printed, never asserted): pykvtier's retrieves at >= 1.0x the bandwidth of
LocalDiskBackend's best mode, <= 0.5x its per-batch p50, at CPU-s/GiB no higher than its own
plus the checksum floor. Store figures are printed beside them.

    python bench/vs_lmcache_disk.py                        # 2 GiB of 32 MiB chunks per tier
    python bench/vs_lmcache_disk.py --total 64MiB --min-batches 2      # a smoke run, seconds
    python bench/vs_lmcache_disk.py --rounds 3 --json bench/out/vs_lmcache_disk.json
    python bench/vs_lmcache_disk.py --tiers pykvtier,disk-odirect --total 8G --dir /mnt/nvme/kvbench
    python bench/vs_lmcache_disk.py --layers 80 --chunk-tokens 128      # other geometries
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import logging
import math
import os
import shutil
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from resource import RUSAGE_SELF

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
try:  # the installed pykvtier; else the source tree above (an editable or in-place build)
    import pykvtier  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(HERE))

from pykvtier.bench.sysutil import (  # noqa: E402
    GiB, ColdCache, add_side_by_side_args, disk_bench_dir, fmt_size, meminfo, plural, rusage_cpu)
from pykvtier.bench.sysutil import quantile as pct  # noqa: E402
from pykvtier.toolkit import parse_size  # noqa: E402

TIERS = ("pykvtier", "disk-buffered", "disk-odirect")
LMCACHE_TIERS = TIERS[1:]
STAMP = 8  # bytes of chunk index written at the start of a chunk's K and V halves
POISON = 0x5A  # what the arena holds where no chunk was just read
POLL_S = 0.0005
DURABLE_TIMEOUT_S = 300.0
MODEL = "bench/llama-3-8b-like"  # a '/' in it: LocalDiskBackend maps it to '-' in file names
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "fp32": "float32", "float32": "float32"}


def import_lmcache() -> str:
    """LMCache's engine pieces and the CPU connector of tests/ (imported as vs_sglang_file.py
    imports its torchvision placeholder). LMCache's log level defaults to WARNING here."""
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    tests = os.path.join(os.path.dirname(HERE), "tests")
    if os.path.isdir(tests) and tests not in sys.path:
        sys.path.insert(0, tests)
    warnings.filterwarnings("ignore")
    from importlib.metadata import version

    import lmcache.v1.cache_engine  # noqa: F401
    import lmcache.v1.storage_backend.local_disk_backend  # noqa: F401
    import lmcache.v1.token_database  # noqa: F401
    import lmcache_cpu_connector  # noqa: F401
    return version("lmcache")


#: LMCache's start-up warnings of every engine on CPU without vLLM: counted, not printed.
QUIET = ("Could not load 'builtin' from vLLM", "Using builtin hash without PYTHONHASHSEED",
         "Controller message sender is not initialized",
         "The 'memory_allocator' argument is deprecated")


class LogCollector(logging.Handler):
    """WARNING+ records of LMCache's and pykvtier's loggers, summed up after each tier. LMCache's
    loggers do not propagate (lmcache.logging.init_logger): :meth:`route` moves them here."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        if record.name.startswith(("lmcache", "pykvtier")):
            self.records.append(record)

    def route(self) -> None:
        """Every ``lmcache*`` logger made so far logs here instead of its own stream handler."""
        for name, lg in list(logging.root.manager.loggerDict.items()):
            if name.startswith("lmcache") and isinstance(lg, logging.Logger):
                for h in list(lg.handlers):
                    if type(h) is logging.StreamHandler:
                        lg.removeHandler(h)
                if self not in lg.handlers:
                    lg.addHandler(self)

    def take(self) -> list[str]:
        out: dict[str, int] = {}
        quiet = 0
        for r in self.records:
            msg = r.getMessage()
            if r.levelno < logging.ERROR and msg.startswith(QUIET):
                quiet += 1
                continue
            msg = f"{r.levelname} {r.name}: {msg}"[:300]
            out[msg] = out.get(msg, 0) + 1
        self.records = []
        lines = [m if n == 1 else f"{m} (x{n})" for m, n in out.items()]
        if quiet:
            lines.append(f"({plural(quiet, 'known start-up warning')} of LMCache on CPU not shown)")
        return lines


# ----------------------------------------------------------------------------- geometry


@dataclass
class Geometry:
    chunk_tokens: int
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str

    @property
    def itemsize(self) -> int:
        return {"bfloat16": 2, "float16": 2, "float32": 4}[self.dtype]

    @property
    def chunk_bytes(self) -> int:  # K and V of every layer for chunk_tokens tokens
        return 2 * self.layers * self.chunk_tokens * self.kv_heads * self.head_dim * self.itemsize

    def torch_dtype(self):
        import torch
        return getattr(torch, self.dtype)

    def describe(self) -> str:
        return (f"{self.chunk_tokens} tokens x {self.layers} layers x {self.kv_heads} KV heads x "
                f"{self.head_dim} head_dim {self.dtype} (K and V) = {fmt_size(self.chunk_bytes)}"
                " per chunk (KV_2LTD)")


# ----------------------------------------------------------------------------- LMCache tiers


def build_engine(name: str, geo: Geometry, tier_dir: str, eid: str, args):
    """An LMCacheEngine on CPU holding tier ``name`` (LMCache builds the backend); returns
    (engine, meta, backend). Exits when LMCache dropped the backend (it swallows constructor
    errors of plug-ins)."""
    import torch
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache_cpu_connector import cpu_connector

    common = dict(chunk_size=geo.chunk_tokens, local_cpu=False,
                  max_local_cpu_size=args.cpu_gib, save_unfull_chunk=False)
    if name == "pykvtier":
        extra = {"storage_plugin.pykvtier.module_path": "pykvtier.integrations.lmcache",
                 "storage_plugin.pykvtier.class_name": "PyKVTierStoragePlugin",
                 "storage_plugin.pykvtier.root_dir": tier_dir,
                 "storage_plugin.pykvtier.capacity_bytes": args.capacity_bytes}
        for opt in ("queue_depth", "max_inflight_bytes", "engine", "verify"):
            if getattr(args, opt) is not None:
                extra[f"storage_plugin.pykvtier.{opt}"] = getattr(args, opt)
        config = LMCacheEngineConfig.from_defaults(**common, storage_plugins=["pykvtier"],
                                                   extra_config=extra)
        backend_name = "pykvtier"
    else:
        extra = {"use_odirect": True} if name == "disk-odirect" else {}
        if args.disk_io_threads is not None:
            extra["disk_io_threads"] = args.disk_io_threads
        config = LMCacheEngineConfig.from_defaults(**common, local_disk=tier_dir + "/",
                                                   max_local_disk_size=args.capacity_bytes / GiB,
                                                   extra_config=extra)
        backend_name = "LocalDiskBackend"
    L, H, D, T = geo.layers, geo.kv_heads, geo.head_dim, geo.chunk_tokens
    meta = LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=geo.torch_dtype(),
                           kv_shape=(L, 2, T, H, D), chunk_size=T)
    eng = LMCacheEngineBuilder.get_or_create(eid, config, meta, cpu_connector(L, H * D),
                                             lambda t, r: None, lambda o, r: o)
    eng.post_init()
    backends = eng.storage_manager.storage_backends
    if backend_name not in backends:
        LMCacheEngineBuilder.destroy(eid)
        raise SystemExit(f"{name}: LMCache built no {backend_name!r} backend (it has "
                         f"{list(backends)}; LMCache logs a backend's constructor error and goes "
                         "on without it: see the log: lines)")
    return eng, meta, backends[backend_name]


def destroy_engine(eid: str) -> None:
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    LMCacheEngineBuilder.destroy(eid)


def arena_of(eng):
    """LocalCPUBackend's allocator arena as a flat uint8 tensor (every chunk object lives in
    it), or None where the allocator has none."""
    import torch
    lcb = eng.storage_manager.storage_backends.get("LocalCPUBackend")
    alloc = getattr(lcb, "memory_allocator", None)
    buf = getattr(alloc, "buffer", None)
    if buf is None:
        buf = getattr(getattr(alloc, "pin_allocator", None), "buffer", None)
    if not isinstance(buf, torch.Tensor):
        return None
    return buf.reshape(-1).view(torch.uint8)


def tier_info(name: str, backend, geo: Geometry) -> dict:
    if name == "pykvtier":
        tiers = backend._shards.tiers
        return {"io": f"engine {tiers[0].engine_name}, O_DIRECT {all(t.direct for t in tiers)}, "
                      f"verify {tiers[0].verify}",
                "dirs": list(backend.namespace_dirs)}
    bs = backend.os_disk_bs
    if not backend.use_odirect:
        io = "buffered (open().write / readinto)"
    elif geo.chunk_bytes % bs == 0:
        io = (f"O_DIRECT (use_odirect; {fmt_size(geo.chunk_bytes)} chunks are f_bsize {bs} "
              "multiples)")
    else:
        io = (f"buffered: use_odirect asked, but {geo.chunk_bytes}-byte chunks are no multiple "
              f"of f_bsize {bs}, so LocalDiskBackend falls back to open()")
    return {"io": io, "dirs": [backend.path],
            "disk_io_threads": getattr(backend._read_thread_pool, "_max_workers", None),
            "use_odirect": bool(backend.use_odirect), "f_bsize": bs}


#: pykvtier's bookkeeping files beside its blocks (not counted as chunk files)
_META_FILES = ("config.json", "pykvtier-root.json", ".pykvtier.lock")


def files_under(path: str) -> tuple[int, int]:
    """(chunk files, their bytes) under ``path``: every file but pykvtier's bookkeeping."""
    n = size = 0
    for dp, _, fs in os.walk(path):
        for f in fs:
            if f in _META_FILES:
                continue
            try:
                size += os.path.getsize(os.path.join(dp, f))
                n += 1
            except OSError:
                pass
    return n, size


# ----------------------------------------------------------------------------- chunks


def stamp(i: int) -> np.ndarray:
    return np.frombuffer(int(i).to_bytes(STAMP, "little"), dtype=np.uint8)


def u8(obj) -> np.ndarray:
    """A memory object's logical bytes as a writable uint8 array (a view, no copy)."""
    import torch
    return obj.tensor.reshape(-1).view(torch.uint8).numpy()


def fill_chunk(obj, base: np.ndarray, i: int) -> None:
    """Chunk ``i``'s bytes: base row ``i % B`` with ``i`` written at the start of its K and its V
    half (chunks sharing a row still differ where a mix-up would show)."""
    dst = u8(obj)
    row = base[i % base.shape[0]]
    if dst.size != row.size:
        raise SystemExit(f"LMCache allocated {dst.size}-byte chunks, expected {row.size}")
    dst[:] = row
    half = row.size // 2
    s = stamp(i)
    dst[:STAMP] = s
    dst[half:half + STAMP] = s


def chunk_ok(got: np.ndarray, base: np.ndarray, i: int) -> bool:
    row = base[i % base.shape[0]]
    half = row.size // 2
    s = stamp(i)
    return bool(got.size == row.size and np.array_equal(got[:STAMP], s)
                and np.array_equal(got[half:half + STAMP], s)
                and np.array_equal(got[STAMP:half], row[STAMP:half])
                and np.array_equal(got[half + STAMP:], row[half + STAMP:]))


def make_keys(n: int, seed: int, rnd: int, dtype):
    """Real CacheEngineKeys with distinct chunk hashes (the same for every tier of a round)."""
    from lmcache.utils import CacheEngineKey
    return [CacheEngineKey(MODEL, 1, 0,
                           int.from_bytes(hashlib.sha256(f"{seed}:{rnd}:{i}".encode()).digest()[:8],
                                          "little") >> 1, dtype)
            for i in range(n)]


# ----------------------------------------------------------------------------- measurement


class Meter:
    """Wall and process CPU (getrusage(RUSAGE_SELF): all threads) of each measured call."""

    def __init__(self):
        self.call_s: list[float] = []
        self.cpu = 0.0
        self.poll_cpu = 0.0  # the bench's poll loop (its thread's CPU), part of cpu
        self.bytes = 0

    def call(self, fn, nbytes: int):
        c0, w0 = rusage_cpu(RUSAGE_SELF), time.perf_counter()
        out = fn()
        self.call_s.append(time.perf_counter() - w0)
        self.cpu += rusage_cpu(RUSAGE_SELF) - c0
        self.bytes += nbytes
        return out

    def row(self, **kw) -> dict:
        gib = self.bytes / GiB
        return {**kw, "batches": len(self.call_s), "bytes": self.bytes,
                "gbps": self.bytes / sum(self.call_s) / 1e9,
                "cpu_s_per_gib": self.cpu / gib, "poll_cpu_s_per_gib": self.poll_cpu / gib,
                "p50_ms": pct(self.call_s, 0.5) * 1e3, "p99_ms": pct(self.call_s, 0.99) * 1e3}


def wait_durable(backend, keys, meter: Meter, name: str) -> None:
    """Polls until no put of ``keys`` is in flight and every one is stored (a wait only: the
    bench's thread sleeps 0.5 ms between polls)."""
    c0 = time.thread_time()
    t_end = time.monotonic() + DURABLE_TIMEOUT_S
    pending = list(keys)
    while True:
        pending = [k for k in pending if backend.exists_in_put_tasks(k) or not backend.contains(k)]
        if not pending:
            break
        if time.monotonic() > t_end:
            raise SystemExit(f"{name}: {len(pending)} of {len(keys)} chunks of a store batch not "
                             f"durable after {DURABLE_TIMEOUT_S:.0f} s (a put failed? see the log)")
        time.sleep(POLL_S)
    meter.poll_cpu += time.thread_time() - c0


def checksum_floor(base: np.ndarray, passes: int = 3) -> float:
    """CPU-s/GiB of pykvtier's own XXH3-64 (the payload check of every pykvtier load) over the
    chunk bytes, one chunk per call; this thread's CPU clock, the best of ``passes`` (the rows
    are far past the last-level cache: read from DRAM, as after a DMA). As vs_sglang_file.py."""
    from pykvtier import _native

    best = float("inf")
    for _ in range(passes):
        c0 = time.thread_time()
        for r in range(base.shape[0]):
            _native.xxh3_64(memoryview(base[r]))
        best = min(best, time.thread_time() - c0)
    return best / (base.size / GiB)


def cached_kib() -> int:
    return meminfo("Cached") or 0


# ----------------------------------------------------------------------------- one tier


def run_tier(args, geo: Geometry, name: str, base: np.ndarray, cold: ColdCache, keys,
             store_batches, retrieve_passes, rnd: int, logs: LogCollector) -> list[dict]:
    cb = geo.chunk_bytes
    tier_dir = os.path.join(args.dir, f"r{rnd}-{name}")
    shutil.rmtree(tier_dir, ignore_errors=True)
    os.makedirs(tier_dir)
    eid = f"vs-lmcache-disk-{os.getpid()}-r{rnd}-{name}"
    results = []
    eng = None
    try:
        logs.route()
        eng, meta, backend = build_engine(name, geo, tier_dir, eid, args)
        logs.route()
        sm = eng.storage_manager
        shapes, dtypes = meta.get_shapes(geo.chunk_tokens), meta.get_dtypes()
        info = tier_info(name, backend, geo)
        arena = arena_of(eng)
        if arena is not None:
            arena.fill_(POISON)  # faulted in now, outside any timing; no stale chunk bytes

        # ---- stores
        cold.drop()
        m = Meter()
        c_kib = cached_kib()
        for ids in store_batches:
            objs = []
            for i in ids:  # allocated and filled outside the timing
                obj = sm.allocate(shapes, dtypes)
                if obj is None:
                    raise SystemExit(f"{name}: LMCache's CPU allocator gave no chunk "
                                     f"(--cpu-size {args.cpu_gib:.2f} GiB too small?)")
                fill_chunk(obj, base, i)
                objs.append(obj)
            bkeys = [keys[i] for i in ids]

            def store():
                backend.batched_submit_put_task(bkeys, objs)
                for o in objs:  # as StorageManager.batched_put, right after submitting
                    o.ref_count_down()
                wait_durable(backend, bkeys, m, name)
            m.call(store, len(ids) * cb)
            del objs
        store_cached = (cached_kib() - c_kib) * 1024
        c0, w0 = rusage_cpu(RUSAGE_SELF), time.perf_counter()
        os.sync()
        sync_s = time.perf_counter() - w0
        sync_cpu = rusage_cpu(RUSAGE_SELF) - c0
        nfiles, fbytes = files_under(tier_dir)
        row = m.row(phase="store", tier=name, round=rnd, sync_s=sync_s,
                    sync_cpu_s=sync_cpu, page_cache_growth_bytes=store_cached,
                    files=nfiles, file_bytes=fbytes, **info)
        row["gbps_with_sync"] = m.bytes / (sum(m.call_s) + sync_s) / 1e9
        results.append(row)
        print(f"  {name}: stored {fmt_size(m.bytes)} in "
              f"{plural(len(store_batches), 'batch', 'batches')}: {row['gbps']:.2f} GB/s (then "
              f"sync {sync_s:.2f} s); page cache {round(store_cached / 2**20):+d} MiB; "
              f"{nfiles} files, {fbytes / 2**20:.0f} MiB; {info['io']}", flush=True)
        if arena is not None:
            arena.fill_(POISON)  # every store object is freed: nothing a read could leave stale

        # ---- cold retrieves
        m = Meter()
        bad = 0
        ret_cached = 0
        for batches in retrieve_passes:
            cold.drop()
            c_kib = cached_kib()
            for ids in batches:
                bkeys = [keys[i] for i in ids]
                got = m.call(lambda: backend.batched_get_blocking(bkeys), len(ids) * cb)
                missing = sum(g is None for g in got)
                if missing or len(got) != len(ids):
                    for g in got:
                        if g is not None:
                            g.ref_count_down()
                    raise SystemExit(f"{name}: {missing} of {len(ids)} chunks of a retrieve batch "
                                     "missing")
                for i, g in zip(ids, got):  # outside the timing
                    b = u8(g)
                    bad += not chunk_ok(b, base, i)
                    b.fill(POISON)
                    g.ref_count_down()
                del got
            ret_cached += (cached_kib() - c_kib) * 1024
        if bad:
            raise SystemExit(f"{name}: {bad} chunks retrieved with wrong bytes")
        row = m.row(phase="retrieve", tier=name, round=rnd, verified_chunks=m.bytes // cb,
                    passes=len(retrieve_passes), page_cache_growth_bytes=ret_cached, **info)
        if name == "pykvtier":
            row["backend_stats"] = backend.stats()
        results.append(row)
        print(f"  {name}: retrieved {fmt_size(m.bytes)} cold in "
              f"{plural(len(m.call_s), 'batch', 'batches')} "
              f"({plural(len(retrieve_passes), 'pass', 'passes')}): {row['gbps']:.2f} GB/s; page "
              f"cache {round(ret_cached / 2**20):+d} MiB; every chunk byte-exact", flush=True)
    finally:
        if eng is not None:
            destroy_engine(eid)
        for line in logs.take():
            print(f"    log: {line}")
        if not args.keep:
            shutil.rmtree(tier_dir, ignore_errors=True)
        gc.collect()
    return results


# ----------------------------------------------------------------------------- report

FIGS = ("gbps", "cpu_s_per_gib", "poll_cpu_s_per_gib", "p50_ms", "p99_ms",
        "page_cache_growth_bytes")
STORE_FIGS = ("sync_s", "gbps_with_sync")


def combine(rounds: list[list[dict]]) -> list[dict]:
    """One row per (phase, tier): each figure's median over the rounds (this disk swings 2x
    from run to run: read the medians of several rounds)."""
    groups: dict = {}
    for rows in rounds:
        for r in rows:
            groups.setdefault((r["phase"], r["tier"]), []).append(r)
    out = []
    for rows in groups.values():
        m = {k: v for k, v in rows[0].items() if k not in ("round", "backend_stats")}
        figs = FIGS + (STORE_FIGS if m["phase"] == "store" else ())
        for k in figs:
            m[k] = statistics.median(r[k] for r in rows)
        m["rounds"] = len(rows)
        m["per_round"] = [{k: r[k] for k in figs} for r in rows]
        out.append(m)
    return out


def _key(r):
    return (r["phase"] != "store", TIERS.index(r["tier"]))


def table(results: list[dict]) -> str:
    hdr = (f"{'phase':8} {'tier':22} {'batches':>7} {'GB/s':>6} {'CPU-s/GiB':>9} {'p50 ms':>8} "
           f"{'p99 ms':>8} {'poll CPU':>8} | {'sync s':>6} {'GB/s+sync':>9} {'cache+ MiB':>10}")
    lines = [hdr, "-" * len(hdr)]
    groups: dict = {}
    for r in sorted(results, key=_key):
        groups.setdefault(r["phase"], []).append(r)
    for phase, rows in groups.items():
        for r in rows:
            sync = (f"{r['sync_s']:6.2f} {r['gbps_with_sync']:9.2f}" if phase == "store"
                    else f"{'':6} {'':9}")
            poll = f"{r['poll_cpu_s_per_gib']:.3f}" if phase == "store" else ""
            lines.append(f"{phase:8} {r['tier']:22} {r['batches']:>7} {r['gbps']:6.2f} "
                         f"{r['cpu_s_per_gib']:9.3f} {r['p50_ms']:8.1f} {r['p99_ms']:8.1f} "
                         f"{poll:>8} | {sync} "
                         f"{round(r['page_cache_growth_bytes'] / 2**20):10d}")
        a = next((r for r in rows if r["tier"] == "pykvtier"), None)
        if a is None:
            continue
        for f in rows:
            if f["tier"] == "pykvtier":
                continue
            sync = (f"{'':6} {a['gbps_with_sync'] / f['gbps_with_sync']:8.2f}x" if phase == "store"
                    else f"{'':6} {'':9}")
            lines.append(f"{'':8} {'pykvtier / ' + f['tier'][5:]:22} {'':>7} "
                         f"{a['gbps'] / f['gbps']:5.2f}x "
                         f"{a['cpu_s_per_gib'] / f['cpu_s_per_gib']:8.2f}x "
                         f"{a['p50_ms'] / f['p50_ms']:7.2f}x {a['p99_ms'] / f['p99_ms']:7.2f}x "
                         f"{'':8} | {sync}")
    return "\n".join(lines)


def targets(results: list[dict], floor: float) -> list[str]:
    def ok(flag):
        return "MET" if flag else "MISSED"

    rows = {(r["phase"], r["tier"]): r for r in results}
    a = rows.get(("retrieve", "pykvtier"))
    modes = [rows[("retrieve", t)] for t in LMCACHE_TIERS if ("retrieve", t) in rows]
    if a is None or not modes:
        return ["(needs pykvtier and at least one LocalDiskBackend mode)"]
    best = max(modes, key=lambda r: r["gbps"])
    bw = a["gbps"] / best["gbps"]
    out = [f"GB/s: pykvtier {a['gbps']:.2f} vs LocalDiskBackend's best mode ({best['tier']}, "
           f"{best['gbps']:.2f}) = {bw:.2f}x >= 1.0x {ok(bw >= 1.0)}"]
    for f in modes:
        bw, lat = a["gbps"] / f["gbps"], a["p50_ms"] / f["p50_ms"]
        bound = f["cpu_s_per_gib"] + floor
        out.append(f"vs {f['tier']}: GB/s {bw:.2f}x; p50 {a['p50_ms']:.1f} / {f['p50_ms']:.1f} ms "
                   f"= {lat:.2f}x <= 0.5x {ok(lat <= 0.5)}; CPU-s/GiB {a['cpu_s_per_gib']:.3f} <= "
                   f"{f['tier']} {f['cpu_s_per_gib']:.3f} + floor {floor:.3f} = {bound:.3f} "
                   f"{ok(a['cpu_s_per_gib'] <= bound)}")
    return out


def store_lines(results: list[dict], floor: float) -> list[str]:
    rows = {(r["phase"], r["tier"]): r for r in results}
    a = rows.get(("store", "pykvtier"))
    out = []
    for t in LMCACHE_TIERS:
        f = rows.get(("store", t))
        if a is None or f is None:
            continue
        bound = f["cpu_s_per_gib"] + floor
        out.append(f"vs {t}: GB/s {a['gbps'] / f['gbps']:.2f}x (with each phase's sync: "
                   f"{a['gbps_with_sync']:.2f} vs {f['gbps_with_sync']:.2f} GB/s = "
                   f"{a['gbps_with_sync'] / f['gbps_with_sync']:.2f}x); p50 "
                   f"{a['p50_ms'] / f['p50_ms']:.2f}x; CPU-s/GiB {a['cpu_s_per_gib']:.3f} vs "
                   f"{f['cpu_s_per_gib']:.3f} + floor {floor:.3f} = {bound:.3f} "
                   f"({'within' if a['cpu_s_per_gib'] <= bound else 'above'})")
    return out


# ----------------------------------------------------------------------------- main


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=None, help="bench directory on the disk under test "
                   "(default /var/tmp/pykvtier-vs-lmcache-disk; a tmpfs is refused)")
    p.add_argument("--total", default="2G", help="chunk bytes stored and retrieved per tier (2G)")
    p.add_argument("--batch", type=int, default=8, help="chunks per batch call (8)")
    p.add_argument("--min-batches", type=int, default=16,
                   help="retrieve batches per tier at least (passes over the set, each cold; 16)")
    p.add_argument("--chunk-tokens", type=int, default=256,
                   help="LMCache chunk_size, tokens per chunk (256: LMCache's default)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads per rank (8)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--tiers", default=",".join(TIERS), help=f"subset of {','.join(TIERS)}")
    p.add_argument("--cpu-size", default=None,
                   help="LMCache max_local_cpu_size (its allocator arena; default 2 batches of "
                        "chunks + 256 MiB)")
    p.add_argument("--disk-io-threads", type=int, default=None,
                   help="LocalDiskBackend's extra_config disk_io_threads (default: LMCache's, 4)")
    p.add_argument("--queue-depth", type=int, default=None,
                   help="pykvtier's queue_depth (default: the plug-in's)")
    p.add_argument("--engine", default=None, choices=("auto", "uring", "posix"),
                   help="pykvtier's engine (default: the plug-in's, auto)")
    p.add_argument("--max-inflight-bytes", type=parse_size, default=None,
                   help="pykvtier's max_inflight_bytes per root (default: the plug-in's, 256 MiB)")
    p.add_argument("--verify", default=None, choices=("payload", "header"),
                   help="pykvtier's verify (default: the plug-in's, payload: header and payload "
                        "checksum; header: header, key digest and length only)")
    add_side_by_side_args(p)
    args = p.parse_args(argv)

    args.total = parse_size(args.total)
    args.tiers = [x for x in args.tiers.split(",") if x]
    for x in args.tiers:
        if x not in TIERS:
            p.error(f"--tiers: {x!r} is not one of {', '.join(TIERS)}")
    if args.batch < 1 or args.min_batches < 1 or args.rounds < 1:
        p.error("--batch, --min-batches and --rounds must be at least 1")
    geo = Geometry(args.chunk_tokens, args.layers, args.kv_heads, args.head_dim, DTYPES[args.dtype])
    cb = geo.chunk_bytes
    args.chunks = args.total // cb
    if args.chunks < 1:
        p.error(f"--total {fmt_size(args.total)} holds no {fmt_size(cb)} chunk")
    args.batch = min(args.batch, args.chunks)
    B = args.batch
    phys = -(-cb // 4096) * 4096
    cpu_bytes = parse_size(args.cpu_size) if args.cpu_size else 2 * B * phys + (256 << 20)
    args.cpu_gib = cpu_bytes / GiB
    set_bytes = args.chunks * cb
    # room for the whole set with headroom (no eviction in the bench), for both tiers
    args.capacity_bytes = int(set_bytes * 1.25) + (256 << 20)
    args.dir, mnt = disk_bench_dir(args.dir, "pykvtier-vs-lmcache-disk")

    logs = LogCollector()
    logging.getLogger().addHandler(logs)
    lmcache_version = import_lmcache()
    logs.route()
    import torch
    if "pykvtier" in args.tiers:
        try:
            import pykvtier.integrations.lmcache  # noqa: F401
        except Exception as exc:
            raise SystemExit(f"pykvtier's LMCache plug-in does not import ({type(exc).__name__}: "
                             f"{exc}); --tiers {','.join(LMCACHE_TIERS)} runs LMCache alone")

    cold = ColdCache(enabled=not args.no_drop_caches)
    rng = np.random.default_rng(args.seed)
    base = rng.integers(0, 256, (B, cb), dtype=np.uint8)  # the chunks' bytes (rows + stamps)
    if not args.no_freeze_gc:
        gc.collect()
        gc.freeze()
    store_batches = [list(range(s, min(s + B, args.chunks))) for s in range(0, args.chunks, B)]
    per_pass = len(store_batches)
    passes = max(1, math.ceil(args.min_batches / per_pass))
    print(f"vs_lmcache_disk: LMCache {lmcache_version}, torch {torch.__version__}; dir {args.dir} "
          f"({mnt[1]} on {mnt[2]}); {os.cpu_count()} CPUs")
    print(f"chunks: {geo.describe()}; set {fmt_size(set_bytes)} = {args.chunks} chunks per "
          f"tier, batches of {B} chunks ({fmt_size(B * cb)}); retrieves: "
          f"{plural(passes, 'pass', 'passes')} over the set in random order = "
          f"{plural(passes * per_pass, 'batch', 'batches')} per tier; LMCache local_cpu=False, "
          f"max_local_cpu_size {args.cpu_gib:.2f} GiB (arena faulted in and poisoned before "
          "each tier)")
    if cold.works:
        cold_s = ("page cache dropped (sync; echo 3 > /proc/sys/vm/drop_caches) before each "
                  "store phase, between store and retrieve, and before every retrieve pass")
    else:
        cold_s = (f"page cache NOT dropped ({cold.reason}): retrieves may be warm for "
                  "LocalDiskBackend's buffered mode")
    print(f"cold: {cold_s}; the sync after each store phase is timed apart (LocalDiskBackend "
          "buffered: its stores end in the page cache)")
    print("CPU: getrusage(RUSAGE_SELF) user+sys around each batch call (every thread: LMCache's "
          "event loop and disk pools, pykvtier's collectors and io_uring workers, the bench's "
          "0.5 ms poll loop, whose own thread CPU is 'poll CPU'); chunk filling and the "
          "byte-exact check of every retrieved chunk outside the timing; GC "
          f"{'left unfrozen' if args.no_freeze_gc else 'frozen after start-up'}", flush=True)

    t0 = time.perf_counter()
    rounds = []
    dt = geo.torch_dtype()
    for n in range(args.rounds):
        rounds.append([])
        if args.rounds > 1:
            print(f"round {n + 1} of {args.rounds}:", flush=True)
        keys = make_keys(args.chunks, args.seed, n, dt)
        retrieve_passes = []
        for _ in range(passes):
            perm = [int(x) for x in rng.permutation(args.chunks)]
            retrieve_passes.append([perm[s:s + B] for s in range(0, args.chunks, B)])
        order = list(args.tiers)
        k = n % len(order)
        for name in order[k:] + order[:k]:
            rounds[-1] += run_tier(args, geo, name, base, cold, keys, store_batches,
                                   retrieve_passes, n, logs)
    results = combine(rounds)
    floor = checksum_floor(base)
    from pykvtier import _native

    print(f"\n{time.perf_counter() - t0:.0f} s"
          f"{f'; medians of {args.rounds} rounds' if args.rounds > 1 else ''}; GB = 1e9 B; "
          "GB/s and p50/p99: the batch calls' wall time (store: submit -> every chunk durable; "
          "retrieve: batched_get_blocking); cache+: page cache growth over the phase\n")
    print(table(results))
    io = {r["tier"]: r["io"] for r in results if r["phase"] == "store"}
    print("\nI/O: " + "; ".join(f"{t}: {v}" for t, v in io.items()))
    print(f"\nchecksum floor: pykvtier._native.xxh3_64 ({_native.CHECKSUM_IMPL}) over the same "
          f"chunk bytes, {fmt_size(cb)} per call: {floor:.4f} CPU-s/GiB")
    print("\ntargets (retrieves; ratios pykvtier / LocalDiskBackend; printed, not asserted):")
    for line in targets(results, floor):
        print("  " + line)
    print("\nstores (no target; LocalDiskBackend buffered ends in the page cache, its O_DIRECT "
          "mode and pykvtier do not):")
    for line in store_lines(results, floor):
        print("  " + line)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"lmcache": lmcache_version, "geometry": asdict(geo), "chunk_bytes": cb,
                       "batch_chunks": B, "chunks": args.chunks, "retrieve_passes": passes,
                       "max_local_cpu_size_gib": args.cpu_gib, "cold": cold_s,
                       "checksum_floor_s_per_gib": floor, "checksum_impl": _native.CHECKSUM_IMPL,
                       "results": results, "per_round": rounds}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
