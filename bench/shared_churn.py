#!/usr/bin/env python3
"""Several processes sharing one root (``shared=True``) under eviction: how much they fight (issue 13).

``--procs`` worker processes (multiprocessing, spawn) each open
``DiskTier(ROOT, block_size, shared=True, capacity_bytes=CAP)`` on one fresh root under
``--dir`` and serve "requests" the way engines sharing a prefix cache do, for ``--seconds``:

* The key space: ``--prefixes`` chains of up to ``--request-blocks`` keys (key ``i`` of chain
  ``p``: ``b"churn/p/i"``); by default ``--keys-factor`` (3) times the capacity in blocks. Every
  process ranks the chains the same way (one permutation from ``--seed``) and draws a chain per
  request from a Zipf-like law (weight ``1/rank**--zipf``), with its own generator (seeded
  ``(seed, rank)``); the request is the chain's first ``L`` keys, ``L`` uniform in
  ``[ceil(R/2), R]`` (R = ``--request-blocks``).
* Phase 1: the request's keys are looked up in order (``tier.lookup``), stopping at the first
  MISS; a RETRY (a probe in flight) is answered by a later scheduler step: ``on_step_end()``
  (submits the probes), ``get_finished_jobs()``, then the keys from the first one not HIT are
  asked again at once (``--probe-wait poll``, the default: a busy loop while the probes are in
  flight), or after ``tier.drain()`` (``drain``: blocks until they answered; no job of the
  worker is in flight then). The HIT prefix is what the request can load.
* Phase 2: the HIT prefix is loaded in one ``submit_load`` job and every loaded byte is
  compared with the block's content, a deterministic function of the key
  (``pykvtier.replay.BlockPattern``). The request's keys from the first one not loaded (the
  first MISS, or an earlier key whose load failed: an engine recomputes from there) are written
  to the arena and stored in one ``submit_store`` job, not waited for (as an engine's store is
  not): up to ``--stores-in-flight`` (4) per process, each in its own arena slots; its result is
  counted when a later ``tier.wait(timeout)`` or ``get_finished_jobs()`` reports it. A lookup of
  a key whose store is in flight answers RETRY (the next step asks again).

Each worker counts lookup answers, load and store keys (submitted, ok, failed per reason: the
``JobResult.failed_keys`` texts), bytes verified and wrong bytes, and keeps the tier's
``stats()`` at the end. While the workers run, the parent counts the block files
(``ROOT/blocks/hh/<32 hex>.kvb``) and the temporaries (``....kvb.tmp.<pid>.<n>``) on the root
every ``--sample-ms`` (100) and reports the most seen at once and what is left at the end,
against ``capacity_bytes`` (plus one block file per process of slack).

Prints the exact command line first, then one table (totals and per process) and one summary
line; ``--json FILE`` writes every figure (per-worker counters and stats, every sample). Exit
status 1 when a loaded byte was wrong or a worker failed; nothing is timed against a limit.

    python bench/shared_churn.py                      # 4 procs, 400 blocks of 1 MiB, 30 s
    python bench/shared_churn.py --procs 1 --json bench/out/churn-1.json
    python bench/shared_churn.py --procs 4 --capacity-blocks 400 --block-size 1MiB \
        --dir /var/tmp/churn --seconds 60

Another checkout's package (e.g. a worktree of an older commit, its compiled modules copied
into its pykvtier/): ``PYTHONPATH=WORKTREE:VENV_SITE_PACKAGES python -S bench/shared_churn.py
...``. An editable install's import hook (a .pth file) wins over PYTHONPATH; ``-S`` skips it,
and multiprocessing passes ``-S`` on to the workers. The output names the package the workers
imported (``pykvtier in the workers:``).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import queue as queue_mod
import shlex
import shutil
import sys
import tempfile
import time
import traceback
from collections import Counter

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
try:  # the installed pykvtier (or whatever is first on the path); else the source tree above
    import pykvtier
except ImportError:
    sys.path.insert(0, REPO)
    import pykvtier

from pykvtier import DiskTier, LookupResult, TransferJob, host_arena  # noqa: E402
from pykvtier.bench.sysutil import default_bench_dir, mount_of  # noqa: E402
from pykvtier.layout import BLOCK_SUFFIX, HEADER_BYTES  # noqa: E402
from pykvtier.replay import BlockPattern  # noqa: E402
from pykvtier.toolkit import format_bytes, jsonable, parse_size  # noqa: E402

HIT, MISS, RETRY, HIT_PENDING = (LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY,
                                 LookupResult.HIT_PENDING)
TMP_MARK = BLOCK_SUFFIX + ".tmp."  # a block's temporary: <32 hex>.kvb.tmp.<pid>.<n>
RETRY_GIVE_UP_S = 10.0  # a key still RETRY after this long is taken as a MISS (counted)
WAIT_S = 1.0  # tier.wait() slice while a job of ours is in flight


def key_of(prefix: int, i: int) -> bytes:
    return b"churn/%d/%d" % (prefix, i)


def is_enoent(reason: str) -> bool:
    return reason.startswith("ENOENT") or "No such file" in reason


# ----------------------------------------------------------------------------- a worker


def worker(rank: int, cfg: dict, barrier, results) -> None:
    """One process: a shared tier on cfg["root"], requests until cfg["seconds"] passed (or
    cfg["requests"] were served); puts ("ok", rank, figures) or ("error", rank, text)."""
    try:
        results.put(("ok", rank, run_worker(rank, cfg, barrier)))
    except BaseException:  # noqa: BLE001 (reported to the parent, which fails the run)
        try:
            barrier.abort()
        except Exception:  # noqa: BLE001
            pass
        results.put(("error", rank, traceback.format_exc()))


class Worker:
    """One process's tier, arena and counters; every job result goes through :meth:`collect`.

    Arena: slots ``[0, R)`` take the loads (waited for: the request needs them); ``K`` sets of
    R more slots (``--stores-in-flight``) hold the stores in flight, each set untouched until
    its store is reported (the engine reads a store's slots until then). A store is not waited
    for, as an engine's is not: the next request's lookups and load run meanwhile, and its
    result is counted when a later wait() or get_finished_jobs() reports it. With K = 0 each
    store is waited for at once (one set of slots)."""

    def __init__(self, rank: int, cfg: dict) -> None:
        self.cfg = cfg
        self.bs, self.R = cfg["block_size"], cfg["request_blocks"]
        opts = {"shared": True, "capacity_bytes": cfg["capacity_bytes"]}
        if cfg["probe_ttl_s"] is not None:
            opts["probe_ttl_s"] = cfg["probe_ttl_s"]
        self.tier = DiskTier(cfg["root"], self.bs, **opts)
        self.sets = max(1, cfg["stores_in_flight"])
        self.arena = host_arena(self.R * (1 + self.sets), self.bs)
        self.tier.set_arena(self.arena)
        self.words = self.arena.view(np.uint64)  # (slots, bs // 8)
        self.pattern = BlockPattern(self.bs)
        self.free_sets = list(range(self.sets))
        self.stores: dict[int, tuple[int, list[bytes], int]] = {}  # job id -> (set, keys, hits)
        self.loads: dict[int, object] = {}  # job id -> its JobResult, once reported
        self.next_id = 1
        self.c: Counter = Counter()
        self.fail_load: Counter = Counter()
        self.fail_store: Counter = Counter()
        self.busy = {"lookup_s": 0.0, "load_s": 0.0, "store_wait_s": 0.0, "verify_s": 0.0}

    def job_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def collect(self, results) -> None:
        for res in results:
            st = self.stores.pop(res.job_id, None)
            if st is None:
                self.loads[res.job_id] = res
                continue
            slot_set, keys, after_miss_from = st
            self.free_sets.append(slot_set)
            for i, k in enumerate(keys):
                why = res.failed_keys.get(k)
                if why is None:
                    self.c["store_ok"] += 1
                    continue
                self.c["store_failed"] += 1
                self.c["store_failed_after_miss"] += i >= after_miss_from
                self.fail_store[why] += 1

    def wait_for(self, done) -> None:
        """tier.wait() until done() (a job of ours finished)."""
        while not done():
            self.collect(self.tier.wait(WAIT_S))

    def lookup_prefix(self, keys: list[bytes]) -> tuple[int, int]:
        """Phase 1 of one request: (HIT prefix length, index of the first MISS or len(keys))."""
        tier, c = self.tier, self.c
        hits = 0  # keys[:hits] answered HIT
        t_retry = None
        while True:
            retry = False
            stop = len(keys)
            for i in range(hits, len(keys)):
                r = tier.lookup(keys[i])
                c[f"lookup_{r.name}"] += 1
                if r is HIT:
                    if not retry and i == hits:
                        hits += 1
                    continue
                if r is RETRY:
                    retry = True  # ask the rest too: their probes go out in the same batch
                    continue
                stop = i  # MISS (or HIT_PENDING: no load of ours is in flight, so never expected)
                break
            if not retry or hits >= stop:
                return hits, stop
            # RETRY before the first MISS (a probe, or a store of ours in flight): a later step
            now = time.perf_counter()
            if t_retry is None:
                t_retry = now
            elif now - t_retry > RETRY_GIVE_UP_S:
                c["retry_given_up"] += 1
                return hits, hits
            c["probe_steps"] += 1
            tier.on_step_end()  # submits the probes asked for
            if self.cfg["probe_wait"] == "drain":
                if self.stores:  # (a RETRY may be a store of ours being written)
                    self.collect(tier.wait(0.001))
                else:  # no job of ours in flight: waits for the probes (and unlinks)
                    tier.drain()
            self.collect(tier.get_finished_jobs())

    def request(self, keys: list[bytes]) -> None:
        c, tier, bs = self.c, self.tier, self.bs
        n = len(keys)
        c["requests"] += 1
        c["request_keys"] += n
        t = time.perf_counter()
        hits, stop = self.lookup_prefix(keys)
        self.busy["lookup_s"] += time.perf_counter() - t
        c["keys_hit"] += hits
        c["keys_after_first_miss"] += n - stop
        first_bad = hits
        if hits:
            jid = self.job_id()
            t = time.perf_counter()
            tier.submit_load(TransferJob(jid, keys[:hits], list(range(hits))))
            self.wait_for(lambda: jid in self.loads)
            res = self.loads.pop(jid)
            self.busy["load_s"] += time.perf_counter() - t
            c["load_jobs"] += 1
            c["load_keys"] += hits
            t = time.perf_counter()
            for i, k in enumerate(keys[:hits]):
                why = res.failed_keys.get(k)
                if why is not None:
                    c["load_failed"] += 1
                    c["load_failed_enoent"] += is_enoent(why)
                    self.fail_load[why] += 1
                    first_bad = min(first_bad, i)
                    continue
                c["load_ok"] += 1
                want = self.pattern.expected(k)
                if np.array_equal(self.words[i], want):
                    c["bytes_verified"] += bs
                else:
                    c["wrong_blocks"] += 1
                    c["wrong_bytes"] += int(np.count_nonzero(self.arena[i] != want.view(np.uint8)))
            self.busy["verify_s"] += time.perf_counter() - t
        if first_bad == n:
            return
        t = time.perf_counter()
        self.wait_for(lambda: self.free_sets)
        self.busy["store_wait_s"] += time.perf_counter() - t
        slot_set = self.free_sets.pop()
        skeys = keys[first_bad:]
        base = self.R * (1 + slot_set)
        slots = list(range(base, base + len(skeys)))
        for s, k in zip(slots, skeys):
            self.pattern.fill(self.words[s], k)
        jid = self.job_id()
        self.stores[jid] = (slot_set, skeys, hits - first_bad)
        tier.submit_store(TransferJob(jid, skeys, slots))
        c["store_jobs"] += 1
        c["store_keys"] += len(skeys)
        c["store_keys_after_miss"] += n - hits
        c["store_keys_after_load_failure"] += hits - first_bad
        if self.cfg["stores_in_flight"] == 0:
            t = time.perf_counter()
            self.wait_for(lambda: jid not in self.stores)
            self.busy["store_wait_s"] += time.perf_counter() - t


def run_worker(rank: int, cfg: dict, barrier) -> dict:
    w = Worker(rank, cfg)
    weights = 1.0 / np.arange(1, cfg["prefixes"] + 1, dtype=np.float64) ** cfg["zipf"]
    cdf = np.cumsum(weights / weights.sum())
    ranked = np.random.default_rng(cfg["seed"]).permutation(cfg["prefixes"])  # shared ranking
    rng = np.random.default_rng([cfg["seed"], rank])
    R = cfg["request_blocks"]
    lo = max(1, math.ceil(R / 2))
    barrier.wait()
    t0 = time.perf_counter()
    deadline = t0 + cfg["seconds"]
    while time.perf_counter() < deadline and (not cfg["requests"] or w.c["requests"] < cfg["requests"]):
        p = int(ranked[min(int(np.searchsorted(cdf, rng.random(), side="right")), len(cdf) - 1)])
        w.request([key_of(p, i) for i in range(int(rng.integers(lo, R + 1)))])
    w.wait_for(lambda: not w.stores)
    wall = time.perf_counter() - t0
    w.tier.drain()
    w.collect(w.tier.get_finished_jobs())
    stats = w.tier.stats()
    w.tier.shutdown()
    return {"rank": rank, "pid": os.getpid(), "pykvtier": pykvtier.__file__,
            "modules": {m: sys.modules[m].__file__ for m in ("pykvtier.tier", "pykvtier._native")},
            "wall_s": wall, "counts": dict(w.c), "load_failures": dict(w.fail_load),
            "store_failures": dict(w.fail_store), "busy_s": w.busy, "stats": stats}


# ----------------------------------------------------------------------------- the root


def count_root(blocks_dir: str) -> tuple[int, int, int]:
    """(block files, temporaries, other entries) in the fan-out directories of blocks_dir."""
    blocks = tmps = other = 0
    try:
        fans = os.listdir(blocks_dir)
    except FileNotFoundError:
        return 0, 0, 0
    for fan in fans:
        try:
            with os.scandir(os.path.join(blocks_dir, fan)) as it:
                for de in it:
                    name = de.name
                    if name.endswith(BLOCK_SUFFIX):
                        blocks += 1
                    elif TMP_MARK in name:
                        tmps += 1
                    else:
                        other += 1
        except (FileNotFoundError, NotADirectoryError):
            continue
    return blocks, tmps, other


def count_entries(path: str) -> int:
    try:
        return len(os.listdir(path))
    except FileNotFoundError:
        return 0


def init_root(root: str, bs: int) -> None:
    """The root made (its marker and fan-out directories) before the workers open it."""
    DiskTier(root, bs, shared=True).shutdown()


# ----------------------------------------------------------------------------- report


def pct(a: float, b: float) -> str:
    return f"{100.0 * a / b:.1f} %" if b else "-"


def summarize(cfg: dict, workers: list[dict], samples: list, final: tuple, wall: float) -> dict:
    tot: Counter = Counter()
    fl: Counter = Counter()
    fs: Counter = Counter()
    for w in workers:
        tot.update(w["counts"])
        fl.update(w["load_failures"])
        fs.update(w["store_failures"])
    fb = cfg["file_bytes"]
    n = cfg["procs"]
    cap_blocks = cfg["capacity_bytes"] // fb
    max_blocks = max((s[1] for s in samples), default=final[0])
    max_tmps = max((s[2] for s in samples), default=final[1])
    max_total = max((s[1] + s[2] for s in samples), default=final[0] + final[1])
    moved_load = tot["load_ok"] * cfg["block_size"]
    moved_store = tot["store_ok"] * cfg["block_size"]
    return {
        "requests": tot["requests"],
        "store_keys": tot["store_keys"], "store_failed": tot["store_failed"],
        "store_keys_after_miss": tot["store_keys_after_miss"],
        "store_failed_after_miss": tot["store_failed_after_miss"],
        "store_failure_pct_after_miss": (100.0 * tot["store_failed_after_miss"] / tot["store_keys_after_miss"]
                                         if tot["store_keys_after_miss"] else None),
        "store_failure_pct": 100.0 * tot["store_failed"] / tot["store_keys"] if tot["store_keys"] else None,
        "load_keys": tot["load_keys"], "load_failed": tot["load_failed"],
        "load_failed_enoent": tot["load_failed_enoent"],
        "load_failure_pct": 100.0 * tot["load_failed"] / tot["load_keys"] if tot["load_keys"] else None,
        "load_enoent_pct": 100.0 * tot["load_failed_enoent"] / tot["load_keys"] if tot["load_keys"] else None,
        "load_failures_by_reason": dict(fl), "store_failures_by_reason": dict(fs),
        "bytes_verified": tot["bytes_verified"], "wrong_blocks": tot["wrong_blocks"],
        "wrong_bytes": tot["wrong_bytes"],
        "hit_keys_pct": 100.0 * tot["keys_hit"] / tot["request_keys"] if tot["request_keys"] else None,
        "load_gbps": moved_load / wall / 1e9, "store_gbps": moved_store / wall / 1e9,
        "total_gbps": (moved_load + moved_store) / wall / 1e9,
        "capacity_blocks": cap_blocks, "slack_blocks": n,
        "root_max_blocks": max_blocks, "root_max_tmps": max_tmps, "root_max_files": max_total,
        "root_final_blocks": final[0], "root_final_tmps": final[1], "root_final_other": final[2],
        "root_max_bytes": max_total * fb, "root_final_bytes": (final[0] + final[1]) * fb,
        "capacity_bytes": cfg["capacity_bytes"], "capacity_plus_slack_bytes": cfg["capacity_bytes"] + n * fb,
        "root_within_capacity_plus_slack": max_total * fb <= cfg["capacity_bytes"] + n * fb,
        "tier_used_bytes_sum": sum(w["stats"].get("used_bytes", 0) for w in workers),
        "root_blocks_over_time": [samples[min(len(samples) - 1, max(0, math.ceil(q * len(samples)) - 1))][1]
                                  for q in (0.25, 0.5, 0.75, 1.0)] if samples else [],
        "root_mean_blocks": sum(s[1] for s in samples) / len(samples) if samples else 0.0,
        "quarantine_files_at_end": final[3],
        "samples": len(samples), "wall_s": wall,
    }


STAT_KEYS = ("probes", "probe_hits", "probe_results_applied", "evictions", "eviction_failures",
             "capacity_rejections", "load_failures", "loads_refused", "store_failures",
             "stores_skipped_present", "blocks_stored", "blocks_loaded", "leftover_files",
             "blocks_present", "used_bytes")


def print_table(cfg: dict, workers: list[dict], s: dict) -> None:
    fb, bs = cfg["file_bytes"], cfg["block_size"]
    cols = [w["counts"] for w in workers]
    width = 12

    def row(label: str, total, per) -> None:
        cells = "".join(f"{v:>{width}}" for v in per) if len(workers) > 1 else ""
        print(f"  {label:<44}{total!s:>{width}}{cells}")

    def crow(label: str, key: str) -> None:
        row(label, sum(c.get(key, 0) for c in cols), [c.get(key, 0) for c in cols])

    head = "".join(f"{'proc ' + str(w['rank']):>{width}}" for w in workers) if len(workers) > 1 else ""
    print(f"  {'':<44}{'total':>{width}}{head}")
    crow("requests", "requests")
    crow("request keys", "request_keys")
    for r in (HIT, MISS, RETRY, HIT_PENDING):
        crow(f"lookup answers {r.name}", f"lookup_{r.name}")
    crow("probe steps (RETRY before the first MISS)", "probe_steps")
    if any(c.get("retry_given_up") for c in cols):
        crow(f"keys still RETRY after {RETRY_GIVE_UP_S:g} s (taken as MISS)", "retry_given_up")
    crow("keys in HIT prefixes", "keys_hit")
    row("keys in HIT prefixes %",
        pct(sum(c.get("keys_hit", 0) for c in cols), sum(c.get("request_keys", 0) for c in cols)),
        [pct(c.get("keys_hit", 0), c.get("request_keys", 0)) for c in cols])
    crow("load jobs", "load_jobs")
    crow("load keys submitted", "load_keys")
    crow("load keys ok", "load_ok")
    crow("load keys failed", "load_failed")
    row("load failure %", pct(s["load_failed"], s["load_keys"]),
        [pct(c.get("load_failed", 0), c.get("load_keys", 0)) for c in cols])
    row("load failure % ENOENT (evicted elsewhere)", pct(s["load_failed_enoent"], s["load_keys"]),
        [pct(c.get("load_failed_enoent", 0), c.get("load_keys", 0)) for c in cols])
    for why in sorted(s["load_failures_by_reason"]):
        row(f"  load failed: {why}"[:44], s["load_failures_by_reason"][why],
            [w["load_failures"].get(why, 0) for w in workers])
    crow("store jobs", "store_jobs")
    crow("store keys submitted", "store_keys")
    crow("  of them after a MISS", "store_keys_after_miss")
    crow("  of them after a failed load", "store_keys_after_load_failure")
    crow("store keys ok", "store_ok")
    crow("store keys failed", "store_failed")
    row("store failure % (of stores after a MISS)",
        pct(s["store_failed_after_miss"], s["store_keys_after_miss"]),
        [pct(c.get("store_failed_after_miss", 0), c.get("store_keys_after_miss", 0)) for c in cols])
    row("store failure % (of all stores)", pct(s["store_failed"], s["store_keys"]),
        [pct(c.get("store_failed", 0), c.get("store_keys", 0)) for c in cols])
    for why in sorted(s["store_failures_by_reason"]):
        row(f"  store failed: {why}"[:44], s["store_failures_by_reason"][why],
            [w["store_failures"].get(why, 0) for w in workers])
    crow("bytes verified", "bytes_verified")
    crow("wrong blocks (loaded, not the key's bytes)", "wrong_blocks")
    crow("wrong bytes", "wrong_bytes")
    row("GB/s loaded (verified) / stored", f"{s['load_gbps']:.2f}/{s['store_gbps']:.2f}",
        [f"{c.get('load_ok', 0) * bs / w['wall_s'] / 1e9:.2f}/{c.get('store_ok', 0) * bs / w['wall_s'] / 1e9:.2f}"
         for c, w in zip(cols, workers)])
    row("GB/s total", f"{s['total_gbps']:.2f}",
        [f"{(c.get('load_ok', 0) + c.get('store_ok', 0)) * bs / w['wall_s'] / 1e9:.2f}"
         for c, w in zip(cols, workers)])
    keys = [k for k in STAT_KEYS if any(k in w["stats"] for w in workers)]
    keys += sorted({k for w in workers for k in w["stats"]
                    if ("shared" in k or "evict" in k) and k not in keys})
    for k in keys:
        vals = [w["stats"].get(k, "-") for w in workers]
        total = sum(v for v in vals if isinstance(v, int))
        if k == "used_bytes":
            row("stats used_bytes (blocks of file_bytes)", total // fb, [v // fb if isinstance(v, int) else v
                                                                       for v in vals])
        else:
            row(f"stats {k}", total, vals)
    cap, n = s["capacity_blocks"], s["slack_blocks"]
    print(f"  {'root: block files, most at once / at the end':<44}"
          f"{s['root_max_blocks']:>{width}} / {s['root_final_blocks']}")
    print(f"  {'root: temporaries, most at once / at the end':<44}"
          f"{s['root_max_tmps']:>{width}} / {s['root_final_tmps']}")
    print(f"  {'root: files (blocks + temporaries), most':<44}{s['root_max_files']:>{width}}"
          f"   = {format_bytes(s['root_max_bytes'])} vs capacity {cap} blocks = "
          f"{format_bytes(s['capacity_bytes'])} (+{n} slack: {cap + n} blocks): "
          f"{'within' if s['root_within_capacity_plus_slack'] else 'OVER'}")
    print(f"  {'root: block files at 25/50/75/100 % of the run':<44}{'':>{width}}   "
          + " / ".join(str(b) for b in s["root_blocks_over_time"]) + f"; mean {s['root_mean_blocks']:.0f}")
    if s["root_final_other"]:
        print(f"  {'root: other entries at the end':<44}{s['root_final_other']:>{width}}")
    if s["quarantine_files_at_end"]:
        print(f"  {'root: quarantined entries at the end':<44}{s['quarantine_files_at_end']:>{width}}")


def headline(s: dict) -> str:
    def f(v):
        return "-" if v is None else f"{v:.1f} %"

    return (f"store failure {f(s['store_failure_pct_after_miss'])} of {s['store_keys_after_miss']} stores "
            f"after a MISS; load failure {f(s['load_failure_pct'])} of {s['load_keys']} "
            f"(ENOENT {f(s['load_enoent_pct'])}); wrong bytes {s['wrong_bytes']}; root most "
            f"{s['root_max_files']} files ({s['root_max_blocks']} blocks), at the end "
            f"{s['root_final_blocks']} blocks, vs capacity {s['capacity_blocks']} "
            f"(+{s['slack_blocks']}): {'within' if s['root_within_capacity_plus_slack'] else 'OVER'}; "
            f"{s['total_gbps']:.2f} GB/s")


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--procs", type=int, default=4, help="worker processes sharing the root")
    p.add_argument("--capacity-blocks", type=int, default=400,
                   help="each tier's capacity_bytes, in block files (payload + header)")
    p.add_argument("--block-size", type=parse_size, default="1MiB", help="payload bytes per block")
    p.add_argument("--dir", default=None,
                   help="where the root is made (a fresh subdirectory, removed after unless --keep); "
                        "default /var/tmp/pykvtier-shared-churn (a disk)")
    p.add_argument("--seconds", type=float, default=30.0, help="how long each worker serves requests")
    p.add_argument("--requests", type=int, default=0,
                   help="stop a worker after this many requests too (0: --seconds only)")
    p.add_argument("--request-blocks", type=int, default=8,
                   help="R: a request is L consecutive keys of a chain, L uniform in [ceil(R/2), R]")
    p.add_argument("--keys-factor", type=float, default=3.0,
                   help="key space (chains x R keys) as a multiple of the capacity in blocks")
    p.add_argument("--prefixes", type=int, default=None,
                   help="chains in the key space (default: keys-factor x capacity-blocks / R)")
    p.add_argument("--zipf", type=float, default=1.0, help="skew: chain of rank r drawn with weight 1/r**zipf")
    p.add_argument("--seed", type=int, default=0, help="the ranking's seed; worker k draws with (seed, k)")
    p.add_argument("--probe-ttl-s", type=float, default=None, help="the tiers' probe_ttl_s (default: the tier's)")
    p.add_argument("--stores-in-flight", type=int, default=4,
                   help="K: a worker's stores are not waited for (as an engine's are not) while fewer "
                        "than K are in flight; 0: each store waited for at once")
    p.add_argument("--probe-wait", choices=("poll", "drain"), default="poll",
                   help="between the steps of a request whose lookups answered RETRY: poll: "
                        "on_step_end() and get_finished_jobs() only, the next step at once (a busy "
                        "loop while probes are in flight); drain: tier.drain() too (blocks until the "
                        "probes answered; none of the worker's jobs is in flight then)")
    p.add_argument("--sample-ms", type=float, default=100.0, help="how often the parent counts the root's files")
    p.add_argument("--keep", action="store_true", help="leave the root in place")
    p.add_argument("--json", default=None, metavar="FILE", help="write every figure to FILE")
    args = p.parse_args(argv)
    for name in ("procs", "capacity_blocks", "request_blocks"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.stores_in_flight < 0:
        p.error("--stores-in-flight must be >= 0")
    if args.seconds <= 0 or args.keys_factor <= 0 or args.sample_ms <= 0:
        p.error("--seconds, --keys-factor and --sample-ms must be > 0")
    if args.block_size <= 0 or args.block_size % 4096:
        p.error("--block-size must be a positive multiple of 4096")
    if args.prefixes is None:
        args.prefixes = max(1, round(args.keys_factor * args.capacity_blocks / args.request_blocks))
    return args


def main(argv: list[str] | None = None) -> int:
    command = sys.orig_argv if argv is None else [sys.executable, os.path.abspath(__file__), *argv]
    env = " ".join(f"{k}={shlex.quote(os.environ[k])}" for k in ("PYTHONPATH",) if k in os.environ)
    print("command: " + (env + " " if env else "") + shlex.join(command), flush=True)
    args = parse_args(argv)
    base = args.dir or default_bench_dir("pykvtier-shared-churn")
    os.makedirs(base, exist_ok=True)
    root = tempfile.mkdtemp(prefix="shared-churn-", dir=base)
    mnt = mount_of(root)
    bs = args.block_size
    fb = bs + HEADER_BYTES
    cfg = {"root": root, "block_size": bs, "file_bytes": fb, "procs": args.procs,
           "capacity_bytes": args.capacity_blocks * fb, "seconds": args.seconds,
           "requests": args.requests, "request_blocks": args.request_blocks,
           "prefixes": args.prefixes, "zipf": args.zipf, "seed": args.seed,
           "probe_ttl_s": args.probe_ttl_s, "probe_wait": args.probe_wait,
           "stores_in_flight": args.stores_in_flight}
    nkeys = args.prefixes * args.request_blocks
    print(f"pykvtier: {os.path.dirname(pykvtier.__file__)} (this process)")
    print(f"root: {root} on {mnt[1]} ({mnt[2]}); {args.procs} process{'es' if args.procs > 1 else ''}, "
          f"each DiskTier(shared=True, capacity_bytes={cfg['capacity_bytes']} = {args.capacity_blocks} "
          f"block files of {format_bytes(bs)} + {HEADER_BYTES} B header)")
    print(f"workload: {args.prefixes} chains x {args.request_blocks} keys = {nkeys} keys "
          f"({nkeys / args.capacity_blocks:.2f}x capacity), requests of "
          f"{max(1, math.ceil(args.request_blocks / 2))}..{args.request_blocks} keys, zipf {args.zipf:g}, "
          f"seed {args.seed}, up to {args.stores_in_flight} stores in flight per process, probe wait "
          f"{args.probe_wait}, {args.seconds:g} s" + (f" or {args.requests} requests" if args.requests else "")
          + f"; root counted every {args.sample_ms:g} ms", flush=True)
    init_root(root, bs)
    blocks_dir = os.path.join(root, "blocks")
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(args.procs + 1)
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(k, cfg, barrier, results), name=f"churn-{k}")
             for k in range(args.procs)]
    for pr in procs:
        pr.start()
    workers: dict[int, dict] = {}
    errors: dict[int, str] = {}
    samples: list[tuple[float, int, int]] = []
    rc = 0
    try:
        try:
            barrier.wait(timeout=300)  # every worker opened its tier and set its arena
        except Exception:  # noqa: BLE001 (a worker failed before starting: its error follows)
            pass
        t0 = time.perf_counter()
        interval = args.sample_ms / 1000.0
        while len(workers) + len(errors) < args.procs:
            b, t, _ = count_root(blocks_dir)
            samples.append((time.perf_counter() - t0, b, t))
            try:
                kind, rank, payload = results.get(timeout=interval)  # (the sampling period)
            except queue_mod.Empty:
                dead = [pr for k, pr in enumerate(procs)
                        if not pr.is_alive() and k not in workers and k not in errors]
                for pr in dead:  # died without a word (killed)
                    pr.join()
                    errors[procs.index(pr)] = f"exited with status {pr.exitcode} without a result"
                continue
            (workers if kind == "ok" else errors)[rank] = payload
        wall = max((w["wall_s"] for w in workers.values()), default=time.perf_counter() - t0)
        for pr in procs:
            pr.join()
        final = (*count_root(blocks_dir), count_entries(os.path.join(root, "quarantine")))
        for rank, text in sorted(errors.items()):
            print(f"worker {rank} failed:\n{text}", file=sys.stderr)
            rc = 1
        ws = [workers[k] for k in sorted(workers)]
        if not ws:
            return 1
        paths = sorted({os.path.dirname(w["pykvtier"]) for w in ws})
        mods = sorted({f for w in ws for f in w["modules"].values()})
        print(f"pykvtier in the workers: {', '.join(paths)} ({', '.join(mods)})")
        s = summarize(cfg, ws, samples, final, wall)
        print()
        print_table(cfg, ws, s)
        print()
        print(headline(s))
        if s["wrong_bytes"]:
            print(f"WRONG BYTES: {s['wrong_bytes']} in {s['wrong_blocks']} loaded blocks", file=sys.stderr)
            rc = 1
        if args.json:
            out = {"command": command, "env": env, "config": cfg, "args": vars(args),
                   "mount": list(mnt), "pykvtier": paths, "summary": s, "workers": ws,
                   "samples": [{"t_s": round(t, 3), "blocks": b, "tmps": m} for t, b, m in samples],
                   "root_final": {"blocks": final[0], "tmps": final[1], "other": final[2],
                                  "quarantine": final[3]}}
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(jsonable(out), f, indent=1)
            print(f"wrote {args.json}")
    finally:
        for pr in procs:
            if pr.is_alive():
                pr.join(timeout=60)
            if pr.is_alive():
                pr.kill()  # (only the workers this run started)
                pr.join()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"kept {root}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
