#!/usr/bin/env python3
"""Phase 1 under a probe storm: the shape of vLLM issue #45765, old and new probe path side by side.

A shared root (``shared=True``) holds a pool of real blocks; a fresh tier starts on it, then
another process (this script, after the tier's start-up scan) publishes ``--present`` block
files of the storm's keys. One scheduler step then asks ``--keys`` unknown keys (RETRY: each
needs a probe) while ``--loads`` load jobs run (each one block from the pool, resubmitted as
soon as it finished, so 16 stay in flight). Every step is: ``get_finished_jobs()`` (resubmit
the finished loads), ``lookup()`` of every key not answered yet, ``on_step_end()``, then
``--step-ms`` of "forward pass" (sleep). A run ends when every key answered HIT or MISS;
every answer is checked (HIT exactly for the published keys).

Per run: ``steps`` (the step whose lookups answered the last key: 2 = every key answered on
the first re-ask), the wall time of each ``on_step_end()`` (the storm step's, which submits
the batch, and every later one) and of each ``lookup()``. **cold**: ``sync; echo 3 >
/proc/sys/vm/drop_caches`` after the block files were published (dentries and inodes cold;
when not writable, said so and cold runs are skipped); **warm**: the same keys again with a
fresh tier, metadata cached.

Paths (``--path both``, the default, alternates their order each round):

* ``new``: this tree: the batch is prepared and submitted in one call into C, completions
  reaped in one call into C, a lookup applies only its own key's result (``take``), the rest
  is applied by ``on_step_end``.
* ``old``: the probe of ``--old-ref`` (default: the last commit before this work), its
  ``pykvtier._uring`` compiled from that commit's cffi builder: one Python iteration per SQE
  and per CQE, every finished result applied inside the first ``lookup()`` that follows.
  Needs git and a C compiler; the tier's other code is this tree's.

Block files of the storm are sparse (``truncate`` to the block file size): a probe reads
metadata only. Prints p50/p99/max per path and the ratios old/new; ``--json OUT`` keeps every
run's figures.

    python bench/probe_storm.py                             # 3,600 keys, 16 loads, 5 rounds
    python bench/probe_storm.py --rounds 9 --json bench/out/probe_storm.json
    python bench/probe_storm.py --path new --keys 20000     # a larger storm, new path only
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import gc
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from types import ModuleType

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
try:  # the installed pykvtier; else the source tree above (an editable or in-place build)
    import pykvtier  # noqa: F401
except ImportError:
    sys.path.insert(0, REPO)

from pykvtier import DiskTier, LookupResult, TransferJob  # noqa: E402
from pykvtier.bench.sysutil import ColdCache, default_bench_dir, mount_of  # noqa: E402
from pykvtier.buffers import host_arena  # noqa: E402
from pykvtier.layout import key_digest  # noqa: E402
from pykvtier.toolkit import parse_size  # noqa: E402

OLD_REF = "150a034"  # the last commit before the batch prepare/reap in C
HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY


# ----------------------------------------------------------------------------- the old path


def load_old_probe(ref: str, build_dir: str) -> ModuleType:
    """pykvtier/probe.py of `ref` as a module whose ExistenceProbe uses `ref`'s own
    pykvtier._uring (compiled here from `ref`'s cffi builder, cached in build_dir)."""
    def show(path: str) -> str:
        return subprocess.run(["git", "-C", REPO, "show", f"{ref}:{path}"], check=True,
                              capture_output=True, text=True).stdout

    os.makedirs(build_dir, exist_ok=True)
    builder_src, probe_src = show("pykvtier/_uring_build.py"), show("pykvtier/probe.py")
    builder = ModuleType("old_uring_build")
    exec(compile(builder_src, f"{ref}:pykvtier/_uring_build.py", "exec"), builder.__dict__)
    so = builder.make_ffi(libraries=["uring"]).compile(tmpdir=build_dir)
    importlib.import_module("pykvtier._uring")  # this tree's, before the old one is loaded
    saved = {k: v for k, v in sys.modules.items() if k.startswith("pykvtier._uring")}
    spec = importlib.util.spec_from_file_location("pykvtier._uring", so)
    uring = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(uring)
    for k in [k for k in sys.modules if k.startswith("pykvtier._uring")]:
        del sys.modules[k]
    sys.modules.update(saved)  # cffi registered the old one's names: this tree's stay current
    probe = ModuleType("old_probe")
    probe.__dict__["_old_uring"] = uring
    exec(compile(probe_src, f"{ref}:pykvtier/probe.py", "exec"), probe.__dict__)
    return probe


def make_old_tier_class(old_probe: ModuleType) -> type:
    """DiskTier with the probe handling of the old commit: its ExistenceProbe (per-entry
    Python loops), results applied all at once in the first lookup() after they completed."""

    class _NoTake:
        def __init__(self, inner):
            self._inner = inner

        def take(self, ticket):  # the old path had no per-key answer: RETRY until applied
            return None

        def __getattr__(self, name):
            return getattr(self._inner, name)

    class OldProbeTier(DiskTier):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self._probe.close()
            saved = sys.modules.get("pykvtier._uring")
            sys.modules["pykvtier._uring"] = old_probe._old_uring
            try:
                self._probe = _NoTake(old_probe.ExistenceProbe(entries=256))
            finally:
                sys.modules["pykvtier._uring"] = saved
            assert self._probe.backend == "io_uring", self._probe.fallback_reason

        def lookup(self, key):
            if self._probing:
                self._apply_probes()
            return super().lookup(key)

        def on_step_end(self):
            if self._probing:
                self._apply_probes()
            if self._probe_wanted:
                batch = [(d, self.layout.block_path(d)) for d in self._probe_wanted]
                self._probing.append((0, dict.fromkeys(self._probe_wanted, 0)))
                self._probe_wanted.clear()
                self._stats["probes"] += len(batch)
                self._probe.submit(batch)
                self._apply_probes()

        def _apply_probes(self, results=None, max_results=None):  # the old one applied all
            now = time.monotonic()
            for digest, size, err in self._probe.poll() if results is None else results:
                self._apply_probe(digest, size, err, 0o100600, 1, now)

    return OldProbeTier


# ----------------------------------------------------------------------------- one run


def publish(tier: DiskTier, digests: list[bytes]) -> None:
    """Block files as another process would leave them (sparse: metadata is what is probed)."""
    for d in digests:
        p = tier.layout.block_path(d)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.truncate(tier.file_bytes)


def unpublish(tier: DiskTier, digests: list[bytes]) -> None:
    for d in digests:
        try:
            os.unlink(tier.layout.block_path(d))
        except FileNotFoundError:
            pass


class GcWatch:
    """Counts the garbage collector's runs (gc.callbacks) and keeps their durations."""

    def __init__(self) -> None:
        self.runs = 0
        self.pauses_s: list[float] = []
        self._t0 = 0.0
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.runs += 1
            self._t0 = time.perf_counter()
        else:
            self.pauses_s.append(time.perf_counter() - self._t0)


GC = GcWatch()


def switches() -> int:
    """Involuntary context switches of the calling thread so far."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw


def run_once(cls, root: str, args, keys: list[bytes], present: set[bytes], pool: list[bytes],
             cold: ColdCache | None) -> dict:
    tier = cls(root, args.block_size, shared=True, probe_ttl_s=3600.0)
    if args.loads:
        tier.set_arena(host_arena(args.loads, args.block_size))
    digests = [key_digest(k) for k in keys if k in present]
    publish(tier, digests)
    try:
        if cold is not None:
            cold.drop()
        job_ids = iter(range(1, 1 << 60))
        slot_of: dict[int, int] = {}
        pool_i = 0
        loads_done = 0

        def start_load(slot: int) -> None:
            nonlocal pool_i
            jid = next(job_ids)
            slot_of[jid] = slot
            tier.submit_load(TransferJob(jid, [pool[pool_i % len(pool)]], [slot]))
            pool_i += 1

        for s in range(args.loads):
            start_load(s)
        unresolved = list(keys)
        answers: dict[bytes, LookupResult] = {}
        lookup_ns: list[int] = []
        lookup_preempted: list[int] = []  # indexes into lookup_ns
        lookup_gc: list[int] = []
        gc_pauses0 = len(GC.pauses_s)
        step_end_s: list[float] = []
        step_end_cpu_s: list[float] = []
        step_end_preempted: list[bool] = []
        t_start = time.perf_counter()
        resolved_s = 0.0
        finished_s: list[float] = []
        steps = 0
        clock = time.perf_counter_ns
        while unresolved:
            steps += 1
            if steps > args.max_steps:
                raise SystemExit(f"{len(unresolved)} keys still RETRY after {args.max_steps} steps")
            t0 = time.perf_counter()
            done = tier.get_finished_jobs()
            finished_s.append(time.perf_counter() - t0)
            for r in done:
                if not r.success:
                    raise SystemExit(f"a pool load failed: {r.failed_keys}")
                loads_done += 1
                start_load(slot_of.pop(r.job_id))
            still = []
            for k in unresolved:
                c0, g0 = switches(), GC.runs
                a = clock()
                r = tier.lookup(k)
                b = clock()
                if switches() != c0:  # the thread was preempted in or around the call
                    lookup_preempted.append(len(lookup_ns))
                if GC.runs != g0:  # the garbage collector ran inside the call
                    lookup_gc.append(len(lookup_ns))
                lookup_ns.append(b - a)
                if r is RETRY:
                    still.append(k)
                else:
                    answers[k] = r
            unresolved = still
            if not unresolved:
                resolved_s = time.perf_counter() - t_start
            c0 = switches()
            t0, cpu0 = time.perf_counter(), time.thread_time()
            tier.on_step_end()
            step_end_s.append(time.perf_counter() - t0)
            step_end_cpu_s.append(time.thread_time() - cpu0)
            step_end_preempted.append(switches() != c0)
            time.sleep(args.step_ms / 1000)
        tier.drain()
        tier.get_finished_jobs()
        wrong = [k for k in keys if answers[k] is not (HIT if k in present else MISS)]
        if wrong:
            raise SystemExit(f"{len(wrong)} wrong answers, e.g. {wrong[0]!r}: {answers[wrong[0]].name}")
        s = tier.stats()
        if s["probes"] != len(keys) or s["probe_hits"] != len(digests):
            raise SystemExit(f"probes {s['probes']} / probe_hits {s['probe_hits']}, expected "
                             f"{len(keys)} / {len(digests)}")
        return {"steps": steps, "resolved_s": resolved_s, "step_end_s": step_end_s,
                "step_end_cpu_s": step_end_cpu_s, "step_end_preempted": step_end_preempted,
                "finished_s": finished_s, "lookup_ns": lookup_ns,
                "lookup_preempted": lookup_preempted, "lookup_gc": lookup_gc,
                "gc_pauses_s": GC.pauses_s[gc_pauses0:], "loads_done": loads_done}
    finally:
        tier.shutdown()
        unpublish(tier, digests)


# ----------------------------------------------------------------------------- report


def pct(xs, q) -> float:
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if len(xs) else float("nan")


def summarize(runs: list[dict]) -> dict:
    storm = [r["step_end_s"][0] * 1e3 for r in runs]  # the step that submits the batch
    storm_cpu = [r["step_end_cpu_s"][0] * 1e3 for r in runs]
    every = [x * 1e3 for r in runs for x in r["step_end_s"]]
    calm = [x * 1e3 for r in runs for x, p in zip(r["step_end_s"], r["step_end_preempted"]) if not p]
    lk = [x / 1e3 for r in runs for x in r["lookup_ns"]]
    lk_calm, lk_gc = [], []
    for r in runs:
        out = set(r["lookup_preempted"]) | set(r["lookup_gc"])
        lk_calm += [x / 1e3 for i, x in enumerate(r["lookup_ns"]) if i not in out]
        lk_gc += [r["lookup_ns"][i] / 1e3 for i in r["lookup_gc"]]
    pauses = [x * 1e3 for r in runs for x in r["gc_pauses_s"]]
    gfj = [x * 1e3 for r in runs for x in r["finished_s"]]
    return {
        "runs": len(runs),
        "steps": [r["steps"] for r in runs],
        "resolved_ms": [r["resolved_s"] * 1e3 for r in runs],
        "on_step_end_ms": {"p50": pct(every, 50), "p99": pct(every, 99), "max": max(every),
                           "max_not_preempted": max(calm) if calm else float("nan")},
        "storm_step_end_ms": {"p50": pct(storm, 50), "max": max(storm)},
        "storm_step_end_cpu_ms": {"p50": pct(storm_cpu, 50), "max": max(storm_cpu)},
        "get_finished_jobs_ms": {"p50": pct(gfj, 50), "max": max(gfj)},
        "lookup_us": {"p50": pct(lk, 50), "p99": pct(lk, 99), "max": max(lk), "n": len(lk),
                      "max_not_preempted": max(lk_calm) if lk_calm else float("nan"),
                      "preempted": sum(len(r["lookup_preempted"]) for r in runs),
                      "with_gc": len(lk_gc), "max_with_gc": max(lk_gc) if lk_gc else float("nan")},
        "gc_pause_ms": {"n": len(pauses), "max": max(pauses) if pauses else 0.0},
        "loads_done": sum(r["loads_done"] for r in runs),
    }


def last(by_cache: dict[str, list]) -> dict:
    return (by_cache["warm"] or by_cache["cold"])[-1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="bench directory (default under /var/tmp)")
    ap.add_argument("--keys", type=int, default=3600, help="unknown keys asked in one step")
    ap.add_argument("--present", type=int, default=None, help="of which published (default half)")
    ap.add_argument("--loads", type=int, default=16, help="load jobs kept in flight")
    ap.add_argument("--pool", type=int, default=64, help="real blocks the loads read")
    ap.add_argument("--block-size", type=parse_size, default=parse_size("2M"))
    ap.add_argument("--step-ms", type=float, default=10.0, help="forward pass between steps")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--path", choices=("both", "new", "old"), default="both")
    ap.add_argument("--old-ref", default=OLD_REF)
    ap.add_argument("--cache", choices=("both", "cold", "warm"), default="both",
                    help="which runs: cold (metadata dropped), warm, or both (default)")
    ap.add_argument("--max-steps", type=int, default=1000)
    ap.add_argument("--keep", action="store_true", help="keep the directory")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.present is None:
        args.present = args.keys // 2

    base = args.dir or default_bench_dir("pykvtier-probe-storm")
    root = os.path.join(base, "root")
    mnt = mount_of(base)
    paths = ["new", "old"] if args.path == "both" else [args.path]
    classes = {"new": DiskTier}
    if "old" in paths:
        classes["old"] = make_old_tier_class(load_old_probe(args.old_ref, os.path.join(base, f"old-uring-{args.old_ref}")))
    cold = None if args.cache == "warm" else ColdCache()
    if cold is not None and not cold.works:
        print(f"cold runs skipped: {cold.reason}")
        cold = None

    # The pool of real blocks the loads read, stored once by a writer sharing the root.
    pool = [b"pool-%d" % i for i in range(args.pool)]
    writer = DiskTier(root, args.block_size, shared=True)
    src = host_arena(1, args.block_size)
    src[0] = np.arange(args.block_size, dtype=np.uint64).astype(np.uint8)
    writer.set_arena(src)
    missing = [k for k in pool if writer.lookup(k) is not HIT]
    for i, k in enumerate(missing):
        writer.submit_store(TransferJob(i + 1, [k], [0]))
        writer.drain()
        writer.get_finished_jobs()
    writer.shutdown()

    rng = np.random.default_rng(1)
    keys = [b"storm-%d" % i for i in range(args.keys)]
    present = set(keys[i] for i in rng.choice(args.keys, args.present, replace=False).tolist())
    print(f"probe_storm: {args.keys} unknown keys in one step ({args.present} published by "
          f"another writer), {args.loads} loads in flight ({args.block_size >> 10} KiB blocks), "
          f"{args.step_ms:g} ms per step; {base} ({mnt[1]} on {mnt[2]}); {os.cpu_count()} CPUs")
    print(f"cold: {'sync; echo 3 > /proc/sys/vm/drop_caches after publishing' if cold else 'not run'}; "
          f"old path: probe.py and _uring of {args.old_ref}" if "old" in paths else "")

    gc.collect()
    gc.freeze()  # as vLLM's engine core does after start-up
    results: dict[str, dict[str, list]] = {p: {"cold": [], "warm": []} for p in paths}
    for rnd in range(args.rounds):
        order = paths if rnd % 2 == 0 else paths[::-1]
        for p in order:
            if cold is not None:
                results[p]["cold"].append(run_once(classes[p], root, args, keys, present, pool, cold))
            if args.cache != "cold":
                results[p]["warm"].append(run_once(classes[p], root, args, keys, present, pool, None))
        print(f"  round {rnd + 1}/{args.rounds}: " + ", ".join(
            f"{p} steps " + " ".join(f"{c} {v[-1]['steps']} ({v[-1]['resolved_s'] * 1e3:.0f} ms)"
                                     for c, v in results[p].items() if v)
            + f", storm on_step_end {last(results[p])['step_end_s'][0] * 1e3:.2f} ms" for p in paths),
            flush=True)

    summary = {p: {c: summarize(v) for c, v in results[p].items() if v} for p in paths}
    print()
    print("| path | cache | steps to resolve (median, max) | time to resolve, median (ms) | storm step's "
          "on_step_end p50 / max (ms), CPU p50 | on_step_end max, not preempted (ms) | lookup p50 / p99 / max "
          "(us) | lookup max, neither preempted nor in a GC run (us) | lookups (preempted, in a GC run) | "
          "get_finished_jobs p50 / max (ms) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for p in paths:
        for c, s in summary[p].items():
            o, st, cpu, lk = (s["on_step_end_ms"], s["storm_step_end_ms"], s["storm_step_end_cpu_ms"],
                              s["lookup_us"])
            print(f"| {p} | {c} | {statistics.median(s['steps']):g}, {max(s['steps'])} | "
                  f"{statistics.median(s['resolved_ms']):.0f} | {st['p50']:.2f} / {st['max']:.2f}, "
                  f"{cpu['p50']:.2f} | {o['max_not_preempted']:.2f} | {lk['p50']:.2f} / {lk['p99']:.2f} / "
                  f"{lk['max']:.0f} | {lk['max_not_preempted']:.0f} | {lk['n']} ({lk['preempted']}, {lk['with_gc']}) | "
                  f"{s['get_finished_jobs_ms']['p50']:.2f} / {s['get_finished_jobs_ms']['max']:.2f} |")
    if len(paths) == 2:
        print()
        print("ratios old/new (higher: new is better):")
        for c in summary["new"]:
            n, o = summary["new"][c], summary["old"][c]

            def r(*path):
                x, y = o, n
                for k in path:
                    x, y = x[k], y[k]
                return x / y if y else float("inf")

            print(f"  {c}: storm on_step_end p50 {r('storm_step_end_ms', 'p50'):.1f}x (CPU "
                  f"{r('storm_step_end_cpu_ms', 'p50'):.1f}x), on_step_end max not preempted "
                  f"{r('on_step_end_ms', 'max_not_preempted'):.1f}x, lookup p99 {r('lookup_us', 'p99'):.1f}x, "
                  f"lookup max {r('lookup_us', 'max'):.1f}x (not preempted "
                  f"{r('lookup_us', 'max_not_preempted'):.1f}x), steps (median) "
                  f"{statistics.median(o['steps']):g} -> {statistics.median(n['steps']):g}, time to resolve "
                  f"{statistics.median(o['resolved_ms']):.0f} -> {statistics.median(n['resolved_ms']):.0f} ms")
    print()
    print("budgets (issue 15): on_step_end <= 5 ms, lookup max <= 500 us and p99 <= 10 us, warm "
          "resolved within 2 steps (\"not preempted\": calls during which the thread had no "
          "involuntary context switch (and, for lookups, the garbage collector did not run)")
    for p in paths:
        for c, s in summary[p].items():
            checks = {
                "on_step_end max": s["on_step_end_ms"]["max"] <= 5,
                "on_step_end max not preempted": s["on_step_end_ms"]["max_not_preempted"] <= 5,
                "lookup p99": s["lookup_us"]["p99"] <= 10,
                "lookup max": s["lookup_us"]["max"] <= 500,
                "lookup max not preempted, no GC": s["lookup_us"]["max_not_preempted"] <= 500,
            }
            if c == "warm":
                checks["2 steps"] = max(s["steps"]) <= 2
            print(f"  {p} {c}: " + ", ".join(f"{k} {'ok' if v else 'OVER'}" for k, v in checks.items()))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "summary": summary, "runs": results}, f)
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
