#!/usr/bin/env python3
"""Loads into GPU memory, path against path, on the same cold block files.

Writes N block files (pykvtier's format: 4096-byte header + payload) once, then loads all of them
into a CUDA arena, in jobs of --batch blocks submitted together, through

  * gds            DiskTier(device_path="gds"): the gds engine, cuFile (GPUDirect Storage).
                   Only where GDS is usable here (or --force-gds).
  * gds-nover      the same with verify="header" (payload checksum not checked): the cost of the
                   device checksum kernel is the difference.
  * kvikio-compat  DiskTier(device_path="kvikio-compat"): the gds engine in kvikio's POSIX mode.
  * bounce         DiskTier(device_path="bounce"): io_uring (O_DIRECT) into pinned host slots,
                   verified there, copied to the device on a side stream per chunk.
  * host           DiskTier into a pinned host arena (no GPU copy): the disk's ceiling for bounce.
  * kvikio-ref     kvikio's own CuFile(path).pread(dst, payload, file_offset=4096) for every
                   block, all futures in flight (KVIKIO_NTHREADS = --threads): the reference.
                   It reads payloads only (no header, no checksum) -- what the target compares to.

rotating the order every round, with cold data each time: every block file gets
posix_fadvise(DONTNEED) before every run (and /proc/sys/vm/drop_caches when writable); the
engines also read with O_DIRECT where the file system takes it. Each path's first round checks
the arena byte for byte against the data written.

Per path: GB/s (1e9 B/s) and blocks/s per round and as the median, job latency p50/p99, and the
ratio to kvikio-ref (target of issue 5: the path `auto` picks >= 0.95x). Writes OUT/gpu_bench.json
and OUT/gpu_bench.txt. --fake runs the whole script without a GPU (host memory as the "device",
memmove copies, the posix engine as "gds"): for testing the script; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

try:  # the installed pykvtier; else the source tree above (an editable or in-place build)
    import pykvtier  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pykvtier import DiskTier, TransferJob, gpu  # noqa: E402
from pykvtier.buffers import Arena  # noqa: E402
from pykvtier.layout import key_digest  # noqa: E402
from pykvtier.toolkit import parse_size  # noqa: E402

PATHS_ALL = ("gds", "gds-nover", "kvikio-compat", "bounce", "host", "kvikio-ref")


class Env:
    """The GPU (torch) or its --fake stand-in."""

    def __init__(self, fake: bool) -> None:
        self.fake = fake
        if fake:
            from pykvtier.engines import gpu as engines_gpu
            from pykvtier.engines.bounce import HostCopier
            from pykvtier.posix_engine import PosixEngine

            st = gpu.gds_status()
            st = dict(st, built=True, importable=True, cuda_devices=1, cufile_library=True,
                      cufile_available=True, gds_available=True, nvfs_version="fake", root_probe=None)
            st["usable"], st["reason"] = True, "fake GPU (--fake): numbers mean nothing"
            engines_gpu.hooks = engines_gpu._Hooks(status=lambda root: st,
                                   make_gds=lambda threads, compat, checksum: PosixEngine(queue_depth=threads),
                                   make_copier=lambda arena: HostCopier())
            self.torch = None
        else:
            import torch

            if not torch.cuda.is_available():
                raise SystemExit("gpu_paths: no CUDA device visible to torch (use --fake to test the script)")
            self.torch = torch

    def device_arena(self, n: int, bs: int) -> Any:
        if self.fake:
            raw = np.zeros(n * bs + 4096, np.uint8)
            off = (-raw.ctypes.data) % 4096
            arr = raw[off:off + n * bs].reshape(n, bs)
            return Arena(int(arr.ctypes.data), arr.nbytes, bs, False, arr, device="cuda:0")
        return self.torch.zeros((n, bs), dtype=self.torch.uint8, device="cuda")

    def host_arena(self, n: int, bs: int) -> Any:
        if self.fake:
            raw = np.zeros(n * bs + 4096, np.uint8)
            off = (-raw.ctypes.data) % 4096
            return raw[off:off + n * bs].reshape(n, bs)
        return self.torch.zeros((n, bs), dtype=self.torch.uint8).pin_memory()

    def equal(self, arena: Any, expect: np.ndarray) -> bool:
        if isinstance(arena, Arena):
            return bool(np.array_equal(arena.owner, expect))
        if isinstance(arena, np.ndarray):
            return bool(np.array_equal(arena, expect))
        self.torch.cuda.synchronize()
        return bool(np.array_equal(arena.cpu().numpy(), expect))

    def sync(self) -> None:
        if not self.fake:
            self.torch.cuda.synchronize()


def make_cold(paths: list[str]) -> str:
    how = "fadvise(DONTNEED)"
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        how += " + drop_caches"
    except OSError:
        pass
    return how


def tier_run(env: Env, root: str, bs: int, keys: list[bytes], batch: int, path: str, args: Any,
             arena: Any) -> dict:
    """Loads every key (jobs of `batch` into slot == key index) through a DiskTier; returns timings."""
    if path == "host":
        tier = DiskTier(root, bs, queue_depth=args.qd, max_inflight_bytes=args.inflight_bytes)
    else:
        opts = gpu.DeviceOptions(path="gds" if path.startswith("gds") else path, io_threads=args.threads,
                                 checksum=args.verify, bounce_slots=args.bounce_slots,
                                 chunk_blocks=args.chunk_blocks)
        tier = DiskTier(root, bs, queue_depth=args.qd, max_inflight_bytes=args.inflight_bytes, device_path=opts,
                        verify="header" if path == "gds-nover" else "payload")
    try:
        tier.set_arena(arena)
        chosen = tier.device_path.path if tier.device_path else "host"
        jobs = [(j, keys[k:k + batch], list(range(k, min(k + batch, len(keys)))))
                for j, k in enumerate(range(0, len(keys), batch))]
        submit_t: dict[int, float] = {}
        lat: list[float] = []
        failed = 0
        t0 = time.perf_counter()
        for j, ks, slots in jobs:
            submit_t[j] = time.perf_counter()
            tier.submit_load(TransferJob(j, ks, slots))
        done = 0
        while done < len(jobs):
            for r in tier.wait(60.0):
                lat.append(time.perf_counter() - submit_t[r.job_id])
                failed += len(r.failed_keys)
                done += 1
        env.sync()
        wall = time.perf_counter() - t0
        st = tier.stats()
        return {"wall_s": wall, "job_latency_s": lat, "failed": failed, "engine": tier.engine_name,
                "path": chosen, "reason": tier.device_path.reason if tier.device_path else "",
                "direct": bool(st["direct"])}
    finally:
        tier.shutdown()


def kvikio_ref_run(env: Env, files: list[str], bs: int, arena: Any) -> dict:
    if env.fake:  # plain preads into the host "device" arena
        t0 = time.perf_counter()
        for i, p in enumerate(files):
            with open(p, "rb", buffering=0) as f:
                f.readinto(memoryview(arena.owner[i]))  # (header included: shape only)
        return {"wall_s": time.perf_counter() - t0, "job_latency_s": [], "failed": 0, "engine": "fake",
                "path": "kvikio-ref", "reason": "fake", "direct": False}
    import kvikio

    t0 = time.perf_counter()
    fhs = [kvikio.CuFile(p, "r") for p in files]
    futs = [fh.pread(arena[i], size=bs, file_offset=4096) for i, fh in enumerate(fhs)]
    n = sum(f.get() for f in futs)
    for fh in fhs:
        fh.close()
    env.sync()
    wall = time.perf_counter() - t0
    d = kvikio.defaults

    def ask(*names: str) -> Any:
        for name in names:
            if hasattr(d, name):
                try:
                    return getattr(d, name)()
                except Exception:
                    return None
        return None

    mode = "compat (POSIX)" if ask("is_compat_mode_preferred", "compat_mode") in (True, "ON") else "cuFile"
    return {"wall_s": wall, "job_latency_s": [], "failed": len(files) - n // bs, "engine": f"kvikio {mode}",
            "path": "kvikio-ref", "reason": f"kvikio {getattr(kvikio, '__version__', '?')}, {mode}, "
            f"{ask('thread_pool_nthreads', 'num_threads')} threads, task size {ask('task_size')}",
            "direct": False}


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", required=True, help="directory for the block files (on the disk under test)")
    ap.add_argument("--out", required=True, help="folder for gpu_bench.json and gpu_bench.txt")
    ap.add_argument("--block-size", default="2M")
    ap.add_argument("--blocks", type=int, default=512, help="block files (N x block size bytes in all)")
    ap.add_argument("--batch", type=int, default=32, help="blocks per load job (one job per request)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--paths", default=",".join(PATHS_ALL))
    ap.add_argument("--threads", type=int, default=16, help="gds engine io_threads and KVIKIO_NTHREADS")
    ap.add_argument("--verify", default="auto", help="gds engine payload verification (auto/device/host)")
    ap.add_argument("--qd", type=int, default=64, help="io_uring queue depth (host and bounce paths)")
    ap.add_argument("--inflight-bytes", type=parse_size, default=256 << 20)
    ap.add_argument("--bounce-slots", type=int, default=64)
    ap.add_argument("--chunk-blocks", type=int, default=4)
    ap.add_argument("--force-gds", action="store_true", help="run gds even where GDS is not usable")
    ap.add_argument("--fake", action="store_true", help="no GPU: test the script itself")
    args = ap.parse_args(argv)
    os.environ.setdefault("KVIKIO_NTHREADS", str(args.threads))
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    bs = parse_size(args.block_size)
    env = Env(args.fake)
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.root, exist_ok=True)

    from pykvtier.engines import gpu as engines_gpu

    status = engines_gpu.hooks.status(os.path.join(args.root, "blocks") if os.path.isdir(os.path.join(args.root, "blocks"))
                              else args.root)
    wanted = [p for p in args.paths.split(",") if p]
    skipped: dict[str, str] = {}
    runnable = []
    for p in wanted:
        if p not in PATHS_ALL:
            raise SystemExit(f"unknown path {p!r}: expected {', '.join(PATHS_ALL)}")
        if p in ("gds", "gds-nover") and not (status["usable"] or args.force_gds):
            skipped[p] = f"GDS not usable here: {status['reason']}"
        elif p in ("gds", "gds-nover", "kvikio-compat") and not status["importable"]:
            skipped[p] = f"gds engine unavailable: {status['reason']}"
        elif p == "kvikio-ref" and not env.fake:
            try:
                import kvikio  # noqa: F401
                runnable.append(p)
            except Exception as exc:
                skipped[p] = f"kvikio (python) not importable: {exc}"
        else:
            runnable.append(p)

    # --- the files: written once through the host path -------------------------------------
    rng = np.random.default_rng(42)
    data = rng.integers(0, 256, (args.blocks, bs), dtype=np.uint8)
    keys = [f"gpu-bench-{bs}-{i}".encode() for i in range(args.blocks)]
    t0 = time.perf_counter()
    with DiskTier(args.root, bs, queue_depth=args.qd) as tier:
        host = env.host_arena(args.blocks, bs)
        if isinstance(host, np.ndarray):
            host[:] = data
        else:
            host.numpy()[:] = data
        tier.set_arena(host)
        missing = [i for i, k in enumerate(keys) if tier.lookup(k).name != "HIT"]
        for j in range(0, len(missing), 64):
            part = missing[j:j + 64]
            tier.submit_store(TransferJob(j, [keys[i] for i in part], part))
        tier.drain()
        bad = [r for r in tier.get_finished_jobs() if not r.success]
        if bad:
            raise SystemExit(f"gpu_paths: writing the block files failed: {bad[0].failed_keys}")
        files = [tier.layout.block_path(key_digest(k)) for k in keys]
        direct = tier.direct
        del host
    prep_s = time.perf_counter() - t0

    results: dict[str, list[dict]] = {p: [] for p in runnable}
    meta = {"status": status, "skipped": skipped, "direct": direct, "prep_s": prep_s}
    exact: dict[str, bool] = {}
    cold = ""
    arena_dev = env.device_arena(args.blocks, bs)
    arena_host = env.host_arena(args.blocks, bs) if "host" in runnable else None
    for rnd in range(args.rounds):
        order = runnable[rnd % len(runnable):] + runnable[:rnd % len(runnable)] if runnable else []
        for p in order:
            cold = make_cold(files)
            if p == "kvikio-ref":
                r = kvikio_ref_run(env, files, bs, arena_dev)
            else:
                r = tier_run(env, args.root, bs, keys, args.batch, p, args,
                             arena_host if p == "host" else arena_dev)
            r["round"] = rnd
            r["gb_s"] = args.blocks * bs / r["wall_s"] / 1e9
            results[p].append(r)
            if rnd == 0 and p != "kvikio-ref" or (p == "kvikio-ref" and not env.fake and rnd == 0):
                arena = arena_host if p == "host" else arena_dev
                exact[p] = env.equal(arena, data)
            # scrub the arena so the next path cannot pass on stale bytes
            if p != "host":
                if isinstance(arena_dev, Arena):
                    arena_dev.owner[:] = 0
                else:
                    arena_dev.zero_()
            print(f"round {rnd} {p:14s} {r['gb_s']:7.2f} GB/s  failed {r['failed']}  ({r['engine']})", flush=True)
            write_report(args, bs, results, exact, cold, meta, final=False)
    return write_report(args, bs, results, exact, cold, meta, final=True)


def write_report(args: Any, bs: int, results: dict[str, list[dict]], exact: dict[str, bool], cold: str,
                 meta: dict, final: bool) -> int:
    """Writes OUT/gpu_bench.json and .txt from the runs so far (after every run: a timeout keeps
    what was measured); prints the table when final. Returns the exit status."""
    status, skipped, direct, prep_s = meta["status"], meta["skipped"], meta["direct"], meta["prep_s"]
    summary: dict[str, Any] = {}
    for p, rs in results.items():
        if not rs:
            continue
        gbs = [r["gb_s"] for r in rs]
        lat = [x for r in rs for x in r["job_latency_s"]]
        summary[p] = {"gb_s_median": statistics.median(gbs), "gb_s_rounds": gbs,
                      "blocks_per_s_median": statistics.median(gbs) * 1e9 / bs,
                      "job_p50_ms": None if not lat else pct(lat, 0.5) * 1e3,
                      "job_p99_ms": None if not lat else pct(lat, 0.99) * 1e3,
                      "failed": sum(r["failed"] for r in rs), "byte_exact": exact.get(p),
                      "engine": rs[0]["engine"], "path": rs[0]["path"], "reason": rs[0]["reason"]}
    ref = summary.get("kvikio-ref", {}).get("gb_s_median")
    for p, s in summary.items():
        s["vs_kvikio_ref"] = None if not ref or p == "kvikio-ref" else s["gb_s_median"] / ref
    auto = gpu.choose_path(status, "auto", "uring")
    auto_key = "gds" if auto.path == "gds" else auto.path
    verdict = None
    if ref and auto_key in summary:
        ratio = summary[auto_key]["vs_kvikio_ref"]
        verdict = {"auto_path": auto.path, "ratio": ratio, "target": 0.95, "met": ratio >= 0.95}

    report = {
        "config": {"block_size": bs, "blocks": args.blocks, "batch": args.batch, "rounds": args.rounds,
                   "threads": args.threads, "qd": args.qd, "bounce_slots": args.bounce_slots,
                   "chunk_blocks": args.chunk_blocks, "verify": args.verify, "fake": args.fake,
                   "o_direct": direct, "cold": cold, "KVIKIO_NTHREADS": os.environ.get("KVIKIO_NTHREADS"),
                   "KVIKIO_COMPAT_MODE": os.environ.get("KVIKIO_COMPAT_MODE")},
        "prepare_s": prep_s,
        "gds_status": {k: v for k, v in status.items() if k != "notes"} | {"notes": status.get("notes")},
        "auto_choice": {"path": auto.path, "reason": auto.reason},
        "skipped": skipped,
        "paths": summary,
        "rounds": results,
        "verdict": verdict,
        "complete": final,
    }
    with open(os.path.join(args.out, "gpu_bench.json"), "w") as f:
        json.dump(report, f, indent=2, default=str)
    lines = [f"GPU load paths: {args.blocks} blocks x {bs >> 10} KiB, jobs of {args.batch}, {args.rounds} rounds, "
             f"cold ({cold}; O_DIRECT {'on' if direct else 'off'}){' -- FAKE GPU' if args.fake else ''}",
             f"auto picks: {auto.path} ({auto.reason})", "",
             f"{'path':14s} {'GB/s':>7s} {'blk/s':>8s} {'p50 ms':>8s} {'p99 ms':>8s} {'vs ref':>7s} "
             f"{'exact':>5s} {'fail':>4s}  engine"]
    for p in PATHS_ALL:
        if p in summary:
            s = summary[p]
            f = lambda v, w, fmt: f"{v:{w}{fmt}}" if v is not None else f"{'-':>{w}s}"  # noqa: E731
            lines.append(f"{p:14s} {s['gb_s_median']:7.2f} {s['blocks_per_s_median']:8.0f} "
                         f"{f(s['job_p50_ms'], 8, '.1f')} {f(s['job_p99_ms'], 8, '.1f')} "
                         f"{f(s['vs_kvikio_ref'], 7, '.2f')} {str(s['byte_exact'])[:5]:>5s} {s['failed']:4d}  "
                         f"{s['engine']}")
        elif p in skipped:
            lines.append(f"{p:14s} skipped: {skipped[p]}")
    if verdict:
        lines += ["", f"target: {verdict['auto_path']} >= 0.95x kvikio CuFile.pread: {verdict['ratio']:.2f}x "
                      f"({'met' if verdict['met'] else 'NOT met'})"]
    if not final:
        lines.append("(incomplete: written after every run)")
    text = "\n".join(lines)
    with open(os.path.join(args.out, "gpu_bench.txt"), "w") as f:
        f.write(text + "\n")
    if final:
        print(text)
    bad = [p for p, s in summary.items() if s["byte_exact"] is False or s["failed"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
