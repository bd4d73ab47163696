#!/usr/bin/env python3
"""PyKVTierHiCache against SGLang's own ``file`` backend (HiCacheFile), side by side in one run.

Every tier is built as SGLang builds it (``StorageBackendFactory.create_backend``, then the
host-pool registration calls of an attach) over a real SGLang host pool
(``MHATokenToKVPoolHost`` on "cpu", ``pin_memory=False``), and moves the same pages in the same
batches:

* ``pykvtier-v1``: ``PyKVTierHiCache`` with ``interface_v1: 1``: ``batch_set_v1`` /
  ``batch_get_v1`` with host indices, as SGLang's controller calls a zero-copy backend. On a
  ``page_first`` pool the pool is the backend's arena (a page's K and V regions move by address,
  O_DIRECT, no copy); on ``layer_first`` it goes through its staging arena.
* ``pykvtier-legacy``: the same backend with ``interface_v1: 0``: ``batch_set(keys, values)`` /
  ``batch_get(keys, target_locations)`` with flat page tensors, as the controller's
  ``_generic_page_set`` / ``_generic_page_get`` make them (``host.get_data_page(i, flat=True)``,
  ``host.get_dummy_flat_data_page()``, then ``host.set_from_flat_data_page``).
* ``hicache-file``: SGLang's ``HiCacheFile`` (``--hicache-storage-backend file``), which has the
  legacy methods only: the same flat page tensors.

Each tier stores the page set (default 2 GiB of 8 MiB pages: Llama-3-8B-like, 64 tokens x 32
layers x 8 KV heads x 128 head_dim, bf16) in batches of 128 pages (SGLang's
STORAGE_BATCH_SIZE), then loads it back cold, in random order, in batches of the same size,
pass after pass until it has ``--min-batches`` load batches. Each tier works in its own fresh
directory under the bench directory, removed when it is done (unless ``--keep``); tiers take
turns going first from round to round.

Cold: the page cache is dropped (``sync; echo 3 > /proc/sys/vm/drop_caches``, where writable)
before each store phase, between the store and the load phase, and before every load pass.
pykvtier uses O_DIRECT; HiCacheFile is buffered, so its stores end in the page cache: the
``sync`` after each store phase is timed apart (``sync s``, and GB/s with it).

Measured per batch call (``batch_set*`` / ``batch_get*``): wall time (p50/p99 over the batches),
GB/s (page bytes / the calls' wall time), CPU-s/GiB (``getrusage(RUSAGE_SELF)`` user+sys
around each call: every thread of the process, pykvtier's collector threads and io_uring's
workers included). The controller's own page copies around a legacy call are measured apart
(``ctl`` columns: CPU and wall of the get_data_page / dummy page / set_from_flat_data_page
work; v1 calls have none) and added for the "as SGLang's controller runs it" view. Every
loaded page is compared byte for byte (as uint8: random bf16 bytes hold NaNs) with what was
stored, outside the measured calls. The checksum floor is the CPU-s/GiB of pykvtier's own
XXH3-64 (``pykvtier._native.xxh3_64``, the payload check of every pykvtier load) over the
same page bytes, measured in the same run.

Targets (the issue; printed, never asserted): pykvtier's loads at >= 1.0x HiCacheFile's
bandwidth and <= 0.5x its per-batch p50, at CPU-s/GiB no higher than HiCacheFile's plus the
checksum floor. Store figures are printed beside them.

    python bench/vs_sglang_file.py                          # 2 GiB, both layouts, ~3.5 min here
    python bench/vs_sglang_file.py --rounds 3 --json bench/out/vs_sglang_file.json
    python bench/vs_sglang_file.py --layouts page_first --tiers pykvtier-v1,hicache-file
    python bench/vs_sglang_file.py --set-bytes 8G --dir /mnt/nvme/kvbench --keep
    python bench/vs_sglang_file.py --layers 80 --kv-heads 8 --page-size 32   # other geometries
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
    GiB, ColdCache, add_side_by_side_args, disk_bench_dir, fmt_size, plural, rusage_cpu)
from pykvtier.bench.sysutil import quantile as pct  # noqa: E402
from pykvtier.toolkit import parse_size  # noqa: E402

TIERS = ("pykvtier-v1", "pykvtier-legacy", "hicache-file")
LAYOUTS = ("page_first", "layer_first")
STAMP = 8  # bytes of page index written at the start of a page's K and V halves
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "fp32": "float32", "float32": "float32"}


def import_sglang():
    """SGLang on CPU: the torchvision placeholder of tests/ first (PyPI's torchvision wheels are
    CUDA builds and fail to import on CPU torch; nothing used here needs it)."""
    tests = os.path.join(os.path.dirname(HERE), "tests")
    if os.path.isdir(tests) and tests not in sys.path:
        sys.path.insert(0, tests)
    try:
        import sglang_torchvision_stub
        sglang_torchvision_stub.install()
    except ImportError:
        pass  # a real torchvision, or none needed
    warnings.filterwarnings("ignore")
    for name in ("sglang", "vllm", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    from importlib.metadata import version

    import sglang.srt.mem_cache.hicache_storage  # noqa: F401
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: F401
    return version("sglang")


# ----------------------------------------------------------------------------- SGLang objects


@dataclass
class Geometry:
    page_size: int
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str

    @property
    def itemsize(self) -> int:
        return {"bfloat16": 2, "float16": 2, "float32": 4}[self.dtype]

    @property
    def region_bytes(self) -> int:  # one page's K (or V)
        return self.page_size * self.layers * self.kv_heads * self.head_dim * self.itemsize

    @property
    def page_bytes(self) -> int:
        return 2 * self.region_bytes

    def torch_dtype(self):
        import torch
        return getattr(torch, self.dtype)

    def describe(self) -> str:
        return (f"{self.page_size} tokens x {self.layers} layers x {self.kv_heads} KV heads x "
                f"{self.head_dim} head_dim {self.dtype} = {fmt_size(self.page_bytes)} "
                f"(K {fmt_size(self.region_bytes)} + V {fmt_size(self.region_bytes)})")


def make_host_pool(geo: Geometry, layout: str, pages: int):
    """SGLang's MHA host pool of ``pages`` pages over a one-page device pool on "cpu"."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    P, L = geo.page_size, geo.layers
    dev = MHATokenToKVPool(P, P, geo.torch_dtype(), geo.kv_heads, geo.head_dim, L, "cpu", False,
                           start_layer=0, end_layer=L - 1)
    host = MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, P, layout,
                                pin_memory=False, device_capacity_tokens=dev.size,
                                start_layer=0, end_layer=L - 1, host_token_capacity=pages * P)
    return dev, host


def storage_config(layout: str, extra: dict):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False,
        is_page_first_layout=layout == "page_first", model_name="bench/llama-3-8b-like",
        extra_config=dict(extra))


def build_tier(name: str, layout: str, host, tier_dir: str, args):
    """The backend as SGLang's attach makes it: the factory, then the pool registration."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    if name == "hicache-file":
        sc = storage_config(layout, {"file_storage_path": tier_dir})
        backend = StorageBackendFactory.create_backend("file", sc, host)
    else:
        extra = {"backend_name": "pykvtier", "module_path": "pykvtier.integrations.sglang",
                 "class_name": "PyKVTierHiCache", "interface_v1": int(name == "pykvtier-v1"),
                 "root_dir": tier_dir, "queue_depth": args.queue_depth, "engine": args.engine}
        if args.staging_pages is not None:
            extra["staging_pages"] = args.staging_pages
        backend = StorageBackendFactory.create_backend("dynamic", storage_config(layout, extra),
                                                       host)
    backend.register_mem_pool_host(host)
    backend.register_mem_host_pool_v2(host, "kv")
    backend.on_host_pools_registered()
    return backend


def tier_info(name: str, backend) -> dict:
    inner = getattr(backend, "_backend", backend)  # (SGLang's failure-injector wrapper)
    if name == "hicache-file":
        return {"path": "legacy tensors", "io": "buffered", "dir": inner.file_path}
    geo = inner._geometry
    return {"path": ("zero copy" if geo.zero_copy else "staging arena")
            + (" (v1)" if inner.interface_v1 else " (legacy tensors)"),
            "io": f"engine {inner._tiers[0].engine_name}, O_DIRECT "
                  f"{all(t.direct for t in inner._tiers)}",
            "blocks_per_page": geo.blocks_per_page}


def close_tier(backend) -> None:
    close = getattr(backend, "close", None)
    if close is not None:
        close()


# ----------------------------------------------------------------------------- pages


def stamp(i: int) -> np.ndarray:
    return np.frombuffer(int(i).to_bytes(STAMP, "little"), dtype=np.uint8)


def stamp_row(base: np.ndarray, r: int, i: int) -> None:
    """Page ``i``'s bytes are base row ``r`` with ``i`` written at the start of its K and its V
    half (so two pages sharing a row still differ where a mix-up would show)."""
    half = base.shape[1] // 2
    s = stamp(i)
    base[r, :STAMP] = s
    base[r, half:half + STAMP] = s


def page_ok(got: np.ndarray, base: np.ndarray, r: int, i: int) -> bool:
    half = base.shape[1] // 2
    s = stamp(i)
    row = base[r]
    return bool(np.array_equal(got[:STAMP], s) and np.array_equal(got[half:half + STAMP], s)
                and np.array_equal(got[STAMP:half], row[STAMP:half])
                and np.array_equal(got[half + STAMP:], row[half + STAMP:]))


def u8(t) -> np.ndarray:
    import torch
    return t.reshape(-1).view(torch.uint8).numpy()


# ----------------------------------------------------------------------------- measurement




class Meter:
    """Wall and process CPU (getrusage(RUSAGE_SELF): all threads) of the measured pieces of
    one phase: the backend calls, and apart the controller's page copies around them."""

    def __init__(self):
        self.call_s: list[float] = []  # per batch
        self.ctl_s: list[float] = []  # per batch (0 for v1)
        self.call_cpu = 0.0
        self.ctl_cpu = 0.0
        self.bytes = 0
        self._ctl = 0.0

    def ctl(self, fn):
        c0, w0 = rusage_cpu(RUSAGE_SELF), time.perf_counter()
        out = fn()
        self._ctl += time.perf_counter() - w0
        self.ctl_cpu += rusage_cpu(RUSAGE_SELF) - c0
        return out

    def call(self, fn):
        c0, w0 = rusage_cpu(RUSAGE_SELF), time.perf_counter()
        out = fn()
        self.call_s.append(time.perf_counter() - w0)
        self.call_cpu += rusage_cpu(RUSAGE_SELF) - c0
        return out

    def end_batch(self, nbytes: int) -> None:
        self.ctl_s.append(self._ctl)
        self._ctl = 0.0
        self.bytes += nbytes

    def row(self, **kw) -> dict:
        gib = self.bytes / GiB
        e2e = [a + b for a, b in zip(self.call_s, self.ctl_s)]
        return {**kw, "batches": len(self.call_s), "bytes": self.bytes,
                "gbps": self.bytes / sum(self.call_s) / 1e9,
                "cpu_s_per_gib": self.call_cpu / gib,
                "p50_ms": pct(self.call_s, 0.5) * 1e3, "p99_ms": pct(self.call_s, 0.99) * 1e3,
                "ctl_cpu_s_per_gib": self.ctl_cpu / gib,
                "ctl_gbps": self.bytes / sum(e2e) / 1e9,
                "ctl_total_cpu_s_per_gib": (self.call_cpu + self.ctl_cpu) / gib,
                "ctl_p50_ms": pct(e2e, 0.5) * 1e3, "ctl_p99_ms": pct(e2e, 0.99) * 1e3}


def checksum_floor(base: np.ndarray, block: int, passes: int = 3) -> float:
    """CPU-s/GiB of pykvtier's own XXH3-64 (the payload check of every pykvtier load) over the
    set's page bytes in ``block``-sized pieces; this thread's CPU clock, the best of ``passes``
    (the rows are the 1 GiB-class page buffer: far past the last-level cache, read from DRAM as
    after a DMA)."""
    from pykvtier import _native

    flat = base.reshape(-1)
    view = memoryview(flat)
    n = (flat.size // block) * block
    best = float("inf")
    for _ in range(passes):
        c0 = time.thread_time()
        for off in range(0, n, block):
            _native.xxh3_64(view[off:off + block])
        best = min(best, time.thread_time() - c0)
    return best / (n / GiB)


# ----------------------------------------------------------------------------- one layout


def run_layout(args, geo: Geometry, layout: str, base: np.ndarray, cold: ColdCache, rng,
               rnd: int) -> list[dict]:
    import torch

    P, B, pb = geo.page_size, args.batch_pages, geo.page_bytes
    npages = args.pages
    dt = geo.torch_dtype()
    dev, host = make_host_pool(geo, layout, 2 * B)
    idx = host.alloc(2 * B * P)
    if idx is None:
        raise SystemExit(f"{layout}: the host pool gave no {2 * B} pages")
    src_idx, dst_idx = idx[:B * P], idx[B * P:]
    src_first = [int(x) for x in src_idx[::P]]
    dst_first = [int(x) for x in dst_idx[::P]]
    keys = [hashlib.sha256(f"{args.seed}:{rnd}:{layout}:{i}".encode()).hexdigest()
            for i in range(npages)]
    store_batches = [list(range(s, min(s + B, npages))) for s in range(0, npages, B)]
    per_pass = len(store_batches)
    passes = max(1, math.ceil(args.min_batches / per_pass))
    load_passes = []
    for _ in range(passes):
        perm = [int(x) for x in rng.permutation(npages)]
        load_passes.append([perm[s:s + B] for s in range(0, npages, B)])
    order = list(args.tiers)
    k = rnd % len(order)
    order = order[k:] + order[:k]
    results = []
    for name in order:
        tier_dir = os.path.join(args.dir, f"r{rnd}-{layout}-{name}")
        shutil.rmtree(tier_dir, ignore_errors=True)
        os.makedirs(tier_dir)
        v1 = name == "pykvtier-v1"
        backend = build_tier(name, layout, host, tier_dir, args)
        info = tier_info(name, backend)
        try:
            # ---- stores
            cold.drop()
            m = Meter()
            for ids in store_batches:
                n = len(ids)
                for r, i in enumerate(ids):  # the pages into the pool's source slots (unmeasured)
                    stamp_row(base, r, i)
                    host.set_from_flat_data_page(src_first[r], torch.from_numpy(base[r]).view(dt))
                bkeys = [keys[i] for i in ids]
                if v1:
                    ok = m.call(lambda: backend.batch_set_v1(bkeys, src_idx[:n * P]))
                    good = all(ok)
                else:
                    data = m.ctl(lambda: [host.get_data_page(src_first[r], flat=True)
                                          for r in range(n)])
                    good = m.call(lambda: backend.batch_set(bkeys, data))
                    del data
                m.end_batch(n * pb)
                if not good:
                    raise SystemExit(f"{name} ({layout}): a store batch failed")
            w0 = time.perf_counter()
            os.sync()
            sync_s = time.perf_counter() - w0
            row = m.row(phase="store", layout=layout, tier=name, round=rnd, sync_s=sync_s,
                        **info)
            row["gbps_with_sync"] = m.bytes / (sum(m.call_s) + sync_s) / 1e9
            results.append(row)
            print(f"  {layout} {name}: stored {fmt_size(m.bytes)} in "
                  f"{plural(len(store_batches), 'batch', 'batches')}: {row['gbps']:.2f} GB/s "
                  f"(then sync {sync_s:.2f} s); {info['path']}, {info['io']}", flush=True)

            # ---- cold loads
            m = Meter()
            bad = 0
            for batches in load_passes:
                cold.drop()
                for ids in batches:
                    n = len(ids)
                    slots = [int(s) for s in rng.permutation(B)[:n]]  # scattered pool slots
                    bkeys = [keys[i] for i in ids]
                    if v1:
                        for s in slots:  # nothing left to read back by accident (unmeasured)
                            host.get_data_page(dst_first[s], flat=False).zero_()
                        hidx = torch.cat([dst_idx[s * P:(s + 1) * P] for s in slots])
                        ok = m.call(lambda: backend.batch_get_v1(bkeys, hidx))
                        m.end_batch(n * pb)
                        if not all(ok):
                            raise SystemExit(f"{name} ({layout}): {ok.count(False)} pages of a "
                                             "load batch failed")
                        for j, s in enumerate(slots):  # outside the measured calls
                            got = u8(host.get_data_page(dst_first[s], flat=True))
                            bad += not page_ok(got, base, ids[j] % B, ids[j])
                    else:
                        dummy = m.ctl(lambda: [host.get_dummy_flat_data_page() for _ in ids])
                        got = m.call(lambda: backend.batch_get(bkeys, dummy))
                        if got is None or any(g is None for g in got):
                            raise SystemExit(f"{name} ({layout}): pages of a load batch missing")

                        def to_pool():
                            for j, s in enumerate(slots):
                                host.set_from_flat_data_page(dst_first[s], got[j])
                        m.ctl(to_pool)
                        m.end_batch(n * pb)
                        for j in range(n):  # outside the measured calls
                            bad += not page_ok(u8(got[j]), base, ids[j] % B, ids[j])
                        del dummy, got
            if bad:
                raise SystemExit(f"{name} ({layout}): {bad} pages loaded with wrong bytes")
            row = m.row(phase="load", layout=layout, tier=name, round=rnd,
                        verified_pages=m.bytes // pb, passes=passes, **info)
            if name != "hicache-file":
                row["backend_stats"] = getattr(backend, "_backend", backend).stats()
            results.append(row)
            print(f"  {layout} {name}: loaded {fmt_size(m.bytes)} cold in "
                  f"{plural(len(m.call_s), 'batch', 'batches')} ({plural(passes, 'pass', 'passes')}"
                  f"): {row['gbps']:.2f} GB/s, every page byte-exact", flush=True)
        finally:
            close_tier(backend)
            if not args.keep:
                shutil.rmtree(tier_dir, ignore_errors=True)
    del host, dev
    gc.collect()
    return results


# ----------------------------------------------------------------------------- report

FIGS = ("gbps", "cpu_s_per_gib", "p50_ms", "p99_ms", "ctl_cpu_s_per_gib", "ctl_gbps",
        "ctl_total_cpu_s_per_gib", "ctl_p50_ms", "ctl_p99_ms")


def combine(rounds: list[list[dict]]) -> list[dict]:
    """One row per (phase, layout, tier): each figure's median over the rounds (this disk swings
    2x from run to run: read the medians of several rounds)."""
    groups: dict = {}
    for rows in rounds:
        for r in rows:
            groups.setdefault((r["phase"], r["layout"], r["tier"]), []).append(r)
    out = []
    for rows in groups.values():
        m = {k: v for k, v in rows[0].items() if k not in ("round", "backend_stats")}
        figs = FIGS + (("sync_s", "gbps_with_sync") if m["phase"] == "store" else ())
        for k in figs:
            m[k] = statistics.median(r[k] for r in rows)
        m["rounds"] = len(rows)
        m["per_round"] = [{k: r[k] for k in figs} for r in rows]
        out.append(m)
    return out


def _key(r):
    return (r["phase"] != "store", LAYOUTS.index(r["layout"]) if r["layout"] in LAYOUTS else 9,
            TIERS.index(r["tier"]))


def table(results: list[dict]) -> str:
    hdr = (f"{'phase':5} {'layout':11} {'tier':15} {'batches':>7} {'GB/s':>6} {'CPU-s/GiB':>9} "
           f"{'p50 ms':>8} {'p99 ms':>8} | {'ctl CPU':>7} {'+ctl GB/s':>9} {'+ctl CPU':>8} "
           f"{'+ctl p50':>8}")
    lines = [hdr, "-" * len(hdr)]
    groups: dict = {}
    for r in sorted(results, key=_key):
        groups.setdefault((r["phase"], r["layout"]), []).append(r)
    for (phase, layout), rows in groups.items():
        for r in rows:
            lines.append(f"{phase:5} {layout:11} {r['tier']:15} {r['batches']:>7} "
                         f"{r['gbps']:6.2f} {r['cpu_s_per_gib']:9.3f} {r['p50_ms']:8.1f} "
                         f"{r['p99_ms']:8.1f} | {r['ctl_cpu_s_per_gib']:7.3f} "
                         f"{r['ctl_gbps']:9.2f} {r['ctl_total_cpu_s_per_gib']:8.3f} "
                         f"{r['ctl_p50_ms']:8.1f}")
        f = next((r for r in rows if r["tier"] == "hicache-file"), None)
        for r in rows:
            if f is None or r is f:
                continue
            lines.append(f"{'':5} {'':11} {r['tier'][9:] + ' / file':15} {'':>7} "
                         f"{r['gbps'] / f['gbps']:5.2f}x {r['cpu_s_per_gib'] / f['cpu_s_per_gib']:8.2f}x "
                         f"{r['p50_ms'] / f['p50_ms']:7.2f}x {r['p99_ms'] / f['p99_ms']:7.2f}x | "
                         f"{'':>7} {r['ctl_gbps'] / f['ctl_gbps']:8.2f}x "
                         f"{r['ctl_total_cpu_s_per_gib'] / f['ctl_total_cpu_s_per_gib']:7.2f}x "
                         f"{r['ctl_p50_ms'] / f['ctl_p50_ms']:7.2f}x")
    return "\n".join(lines)


def _pairs(results, phase):
    rows = {(r["phase"], r["layout"], r["tier"]): r for r in results}
    for layout in LAYOUTS:
        f = rows.get((phase, layout, "hicache-file"))
        for t in TIERS[:2]:
            a = rows.get((phase, layout, t))
            if a and f:
                yield layout, t, a, f


def targets(results: list[dict], floor: float) -> list[str]:
    def ok(flag):
        return "MET" if flag else "MISSED"

    out = []
    for layout, t, a, f in _pairs(results, "load"):
        for view, g, cpu, p50 in (("backend calls", "gbps", "cpu_s_per_gib", "p50_ms"),
                                  ("+ controller copies", "ctl_gbps", "ctl_total_cpu_s_per_gib",
                                   "ctl_p50_ms")):
            bw, lat = a[g] / f[g], a[p50] / f[p50]
            bound = f[cpu] + floor
            out.append(f"{layout} {t} ({view}): GB/s {bw:.2f}x >= 1.0x {ok(bw >= 1.0)}; "
                       f"p50 {lat:.2f}x <= 0.5x {ok(lat <= 0.5)}; CPU-s/GiB {a[cpu]:.3f} <= "
                       f"file {f[cpu]:.3f} + floor {floor:.3f} = {bound:.3f} {ok(a[cpu] <= bound)}")
    return out


def store_lines(results: list[dict], floor: float) -> list[str]:
    out = []
    for layout, t, a, f in _pairs(results, "store"):
        out.append(f"{layout} {t}: GB/s {a['gbps'] / f['gbps']:.2f}x file (with each phase's "
                   f"sync: {a['gbps_with_sync']:.2f} vs {f['gbps_with_sync']:.2f} GB/s = "
                   f"{a['gbps_with_sync'] / f['gbps_with_sync']:.2f}x); p50 "
                   f"{a['p50_ms'] / f['p50_ms']:.2f}x; CPU-s/GiB {a['cpu_s_per_gib']:.3f} vs file "
                   f"{f['cpu_s_per_gib']:.3f} + floor {floor:.3f} = {f['cpu_s_per_gib'] + floor:.3f}"
                   f" ({'within' if a['cpu_s_per_gib'] <= f['cpu_s_per_gib'] + floor else 'above'});"
                   f" + controller copies {a['ctl_total_cpu_s_per_gib']:.3f} vs "
                   f"{f['ctl_total_cpu_s_per_gib']:.3f}")
    return out


# ----------------------------------------------------------------------------- main


def fit_batch(args, geo: Geometry) -> str | None:
    """Halves the batch until SGLang's host-pool budget (free memory less its 10 GiB reserve)
    holds the pool (2 batches of pages) and the bench's own page copies (2 more). Returns a note
    when it had to."""
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_bytes

    want = args.batch_pages
    budget = host_memory_budget_bytes()
    while args.batch_pages > 1 and 4 * args.batch_pages * geo.page_bytes > budget:
        args.batch_pages //= 2
    if args.batch_pages != want:
        return (f"batches of {args.batch_pages} pages, not {want}: SGLang's host-pool budget here "
                f"is {budget / GiB:.1f} GiB (free memory less its reserve), and a batch needs 4x "
                "its pages (the pool's source and destination slots, the pages' bytes, the "
                "controller's flat copies)")
    return None


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=None, help="bench directory on the disk under test "
                   "(default /var/tmp/pykvtier-vs-sglang-file; a tmpfs is refused)")
    p.add_argument("--set-bytes", default="2G", help="pages stored and loaded per tier (2G)")
    p.add_argument("--batch-pages", type=int, default=128,
                   help="pages per batch call (128: SGLang's STORAGE_BATCH_SIZE); halved where "
                        "SGLang's host-pool budget cannot hold it")
    p.add_argument("--min-batches", type=int, default=8,
                   help="load batches per tier at least (passes over the set, each cold)")
    p.add_argument("--page-size", type=int, default=64, help="tokens per page (64)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads per rank (8)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--layouts", default=",".join(LAYOUTS),
                   help="host pool layouts (page_first,layer_first)")
    p.add_argument("--tiers", default=",".join(TIERS), help=f"subset of {','.join(TIERS)}")
    p.add_argument("--queue-depth", type=int, default=64, help="pykvtier queue_depth (64)")
    p.add_argument("--engine", default="auto", choices=("auto", "uring", "posix"),
                   help="pykvtier's engine")
    p.add_argument("--staging-pages", type=int, default=None,
                   help="pykvtier staging_pages (default: the backend's, 64)")
    add_side_by_side_args(p)
    args = p.parse_args(argv)

    args.set_bytes = parse_size(args.set_bytes)
    args.layouts = [x for x in args.layouts.split(",") if x]
    args.tiers = [x for x in args.tiers.split(",") if x]
    for x in args.layouts:
        if x not in LAYOUTS:
            p.error(f"--layouts: {x!r} is not one of {', '.join(LAYOUTS)}")
    for x in args.tiers:
        if x not in TIERS:
            p.error(f"--tiers: {x!r} is not one of {', '.join(TIERS)}")
    if args.batch_pages < 1 or args.min_batches < 1 or args.rounds < 1:
        p.error("--batch-pages, --min-batches and --rounds must be at least 1")
    if os.environ.get("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"):
        p.error("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR is set: it would put HiCacheFile's "
                "files outside the bench directory; unset it")
    geo = Geometry(args.page_size, args.layers, args.kv_heads, args.head_dim, DTYPES[args.dtype])
    if geo.page_bytes % 4096:
        print(f"note: {fmt_size(geo.page_bytes)} pages are not 4 KiB multiples: pykvtier's v1 "
              "path goes through its staging arena", file=sys.stderr)
    args.pages = args.set_bytes // geo.page_bytes
    if args.pages < 1:
        p.error(f"--set-bytes {fmt_size(args.set_bytes)} holds no {fmt_size(geo.page_bytes)} page")
    args.dir, mnt = disk_bench_dir(args.dir, "pykvtier-vs-sglang-file")

    sglang_version = import_sglang()
    import torch  # noqa: F401

    note = fit_batch(args, geo)
    args.batch_pages = min(args.batch_pages, args.pages)
    B = args.batch_pages
    cold = ColdCache(enabled=not args.no_drop_caches)
    rng = np.random.default_rng(args.seed)
    base = rng.integers(0, 256, (B, geo.page_bytes), dtype=np.uint8)  # the pages' bytes
    if not args.no_freeze_gc:
        gc.collect()
        gc.freeze()
    per_pass = math.ceil(args.pages / B)
    passes = max(1, math.ceil(args.min_batches / per_pass))
    print(f"vs_sglang_file: SGLang {sglang_version}; dir {args.dir} ({mnt[1]} on {mnt[2]}); "
          f"{os.cpu_count()} CPUs")
    print(f"pages: {geo.describe()}; set {fmt_size(args.pages * geo.page_bytes)} = "
          f"{args.pages} pages per tier, batches of {B} pages ({fmt_size(B * geo.page_bytes)}); "
          f"loads: {plural(passes, 'pass', 'passes')} over the set = "
          f"{plural(passes * per_pass, 'batch', 'batches')} per tier")
    if note:
        print(f"note: {note}")
    if cold.works:
        cold_s = ("page cache dropped (sync; echo 3 > /proc/sys/vm/drop_caches) before each "
                  "store phase, between store and load, and before every load pass")
    else:
        cold_s = f"page cache NOT dropped ({cold.reason}): loads may be warm for HiCacheFile"
    print(f"cold loads: {cold_s}; pykvtier O_DIRECT, HiCacheFile buffered (its stores end in "
          "the page cache: the sync after each store phase is timed apart)")
    print("CPU: getrusage(RUSAGE_SELF) user+sys around each call (every thread: pykvtier's "
          "collectors and io_uring workers included); page setup and the byte-exact check of "
          "every loaded page outside the measured calls; GC "
          f"{'left unfrozen' if args.no_freeze_gc else 'frozen after start-up'}", flush=True)

    t0 = time.perf_counter()
    rounds = []
    for n in range(args.rounds):
        rounds.append([])
        if args.rounds > 1:
            print(f"round {n + 1} of {args.rounds}:", flush=True)
        for layout in args.layouts:
            rounds[-1] += run_layout(args, geo, layout, base, cold, rng, n)
    results = combine(rounds)
    floor = checksum_floor(base, geo.region_bytes)
    from pykvtier import _native

    print(f"\n{time.perf_counter() - t0:.0f} s"
          f"{f'; medians of {args.rounds} rounds' if args.rounds > 1 else ''}; GB = 1e9 B; "
          "GB/s and p50/p99: the batch calls' wall time; ctl: the controller's page copies "
          "around a legacy call (get_data_page / dummy pages / set_from_flat_data_page), "
          "+ctl: the call with them\n")
    print(table(results))
    print(f"\nchecksum floor: pykvtier._native.xxh3_64 ({_native.CHECKSUM_IMPL}) over the same "
          f"page bytes in {fmt_size(geo.region_bytes)} pieces: {floor:.4f} CPU-s/GiB")
    print("\ntargets (loads; ratios pykvtier / HiCacheFile, same layout; printed, not asserted):")
    for line in targets(results, floor):
        print("  " + line)
    print("\nstores (no target in the issue; HiCacheFile's stores are buffered, pykvtier's "
          "O_DIRECT):")
    for line in store_lines(results, floor):
        print("  " + line)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"sglang": sglang_version, "geometry": asdict(geo),
                       "page_bytes": geo.page_bytes, "batch_pages": B, "pages": args.pages,
                       "load_passes": passes, "cold": cold_s, "checksum_floor_s_per_gib": floor,
                       "checksum_impl": _native.CHECKSUM_IMPL, "results": results,
                       "per_round": rounds}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
