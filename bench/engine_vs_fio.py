#!/usr/bin/env python3
"""pykvtier's C++ io_uring engine against fio, side by side, on the same cold files.

Reads N files of B bytes each (one block per file, raw data, no header) with

  * fio           ioengine=io_uring, direct=1, bs=B, iodepth=QD over the N files
                  (the reference, "the device limit")
  * fio+fixedbufs the same with fio's fixedbufs=1 (pre-registered buffers), for information
  * engine+fixed  pykvtier._native.Engine, one Op.READ job per block, iodepth jobs in flight
                  (pykvtier.bench.runner.submit_each), O_DIRECT, into one host buffer
                  registered once with register_buffer() (READ_FIXED)  -- the headline
  * engine        the same without registered buffers

alternating the tools over several rounds (the order rotates every round), with cold
data each time: O_DIRECT for every run, and the page cache dropped
(`echo 3 > /proc/sys/vm/drop_caches`) before every run when that file is writable.

Destination memory is the same kind for both tools (--mem): "4k" (default) = ordinary 4 KiB
pages, as fio's malloc'd buffers are (the engine's buffer is mmap'd with MADV_NOHUGEPAGE);
"huge" = 2 MiB hugetlb pages for both (fio mem=mmaphuge, engine MAP_HUGETLB); "both" runs
the two sets. The backing alone changes bandwidth ~1.5x and CPU ~4x on a virtio disk (one
segment per 2 MiB page instead of 512), so comparing a THP-backed numpy array against fio's
4 KiB malloc buffers would credit the engine with what the memory did.

Per run and as medians: GB/s (1e9 B/s), IOPS, CPU seconds per GiB (usr+sys), latency
(fio: per-block clat p50/p99 from its JSON; engine: per block, the job's submit to result),
and the ratios pykvtier/fio against the targets:
bandwidth >= 0.9x fio, CPU/GiB <= 1.5x fio.

CPU accounting
  engine: getrusage(RUSAGE_SELF) delta around the timed jobs only (RUSAGE_SELF, not
          RUSAGE_THREAD, so that the engine's thread and io_uring's io-wq / sqpoll kernel
          workers, which belong to this process's thread group, are counted too). Each
          engine does one untimed 1-block warm-up job first; its cost is printed
          separately.
  fio:    fio's own usr_cpu/sys_cpu (percent of the job's runtime, measured by fio with
          getrusage(RUSAGE_SELF) in the forked job process, so io-wq workers count too),
          i.e. the I/O phase only -- the like-for-like figure used for the ratio. Also
          printed: getrusage(RUSAGE_CHILDREN) delta around the fio subprocess, which adds
          fio's start-up, file set-up and JSON output.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import zlib

GiB = 1 << 30
TARGET_BW_RATIO = 0.9    # pykvtier bandwidth >= 0.9 x fio
TARGET_CPU_RATIO = 1.5   # pykvtier CPU s/GiB <= 1.5 x fio
FILE_PREFIX = "blk."     # files are DIR/blk.0 .. DIR/blk.{N-1}; fio: filename_format=blk.$filenum
MANIFEST = "manifest.json"

BASE_VARIANTS = ("fio", "fio+fixedbufs", "engine+fixed", "engine")
HUGE_SUFFIX = "@huge"


def _load_sysutil():
    """pykvtier.bench.sysutil (the helpers shared with `pykvtier bench` and bench/compare_fio.py);
    loaded from the source tree when pykvtier itself cannot be imported (no native build)."""
    try:
        from pykvtier.bench import sysutil as mod
        return mod
    except Exception:  # pykvtier not importable: load the module file directly (stdlib-only)
        import importlib.util
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "pykvtier",
                            "bench", "sysutil.py")
        spec = importlib.util.spec_from_file_location("_pykvtier_bench_sysutil", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod


_su = _load_sysutil()
fmt_size, mount_of, read_first_line, meminfo = _su.fmt_size, _su.mount_of, _su.read_first_line, _su.meminfo
rusage_cpu, median, alloc_host = _su.rusage_cpu, _su.median, _su.alloc_host
ColdCache, HugePages, DevStat, remove_files = _su.ColdCache, _su.HugePages, _su.DevStat, _su.remove_files


# ----------------------------------------------------------------------------- helpers

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'2M', '2MiB', '2MB', '256K', '4096' -> bytes (binary multiples, as fio does)."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 2M, 2MiB, 256K, 4096)")
    n = int(m.group(1)) << (10 * " kmgt".index((m.group(2) or " ").lower()))
    if n <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0: {text!r}")
    return n


def default_dir(blocks: int, block_size: int) -> str:
    """A directory under /var/tmp (disk-backed); /tmp only if /var/tmp is tmpfs and /tmp is not."""
    name = f"pykvtier-bench-{blocks}x{fmt_size(block_size)}"
    for base in ("/var/tmp", "/tmp"):
        if os.path.isdir(base) and mount_of(base)[1] not in ("tmpfs", "ramfs"):
            return os.path.join(base, name)
    raise SystemExit("both /var/tmp and /tmp are tmpfs/ramfs (no O_DIRECT, not cold): pass --dir on a disk")


def variant_parts(v: str) -> tuple[str, bool, str]:
    """'engine+fixed@huge' -> ('engine', True, 'huge')."""
    base, _, mem = v.partition("@")
    return base.split("+")[0], "+" in base, mem or "4k"


# ----------------------------------------------------------------------------- data set

def file_path(d: str, i: int) -> str:
    return os.path.join(d, f"{FILE_PREFIX}{i}")


def prepare_files(d: str, blocks: int, block_size: int, seed: int) -> tuple[list[str], list[int], bool]:
    """Create N files of B random bytes (once); return (paths, crc32 per file, created?)."""
    os.makedirs(d, exist_ok=True)
    paths = [file_path(d, i) for i in range(blocks)]
    man_path = os.path.join(d, MANIFEST)
    try:
        with open(man_path) as f:
            man = json.load(f)
        if (man.get("blocks") == blocks and man.get("block_size") == block_size
                and len(man.get("crc32", [])) == blocks
                and all(os.path.isfile(p) and os.path.getsize(p) == block_size for p in paths)):
            return paths, man["crc32"], False
    except (OSError, ValueError):
        pass

    import numpy as np

    rng = np.random.default_rng(seed)
    crcs = []
    t0 = time.perf_counter()
    for p in paths:
        data = rng.bytes(block_size)
        crcs.append(zlib.crc32(data))
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            mv = memoryview(data)
            while mv:
                n = os.write(fd, mv)
                mv = mv[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
    # files left over from a larger earlier data set are harmless (fio uses nrfiles, the engine the list)
    with open(man_path, "w") as f:
        json.dump({"blocks": blocks, "block_size": block_size, "seed": seed, "crc32": crcs,
                   "layout": f"{FILE_PREFIX}<i>, one block per file, raw bytes, no header"}, f)
    os.sync()
    print(f"wrote {blocks} x {fmt_size(block_size)} = {blocks * block_size / GiB:.2f} GiB "
          f"in {time.perf_counter() - t0:.1f}s to {d}", flush=True)
    return paths, crcs, True


# ----------------------------------------------------------------------------- fio

def fio_cmd(d: str, blocks: int, block_size: int, iodepth: int, fixedbufs: bool, out_json: str,
            prefault: bool = True, mem: str = "4k") -> list[str]:
    # One job, N files of B bytes: size = N*B split evenly over nrfiles=N, with the default
    # file_service_type=roundrobin (switch file after every I/O) -> exactly N reads of B
    # bytes, each file read entirely once, up to iodepth in flight. The files are the ones
    # we wrote (filename_format matches our names; they exist with the right size, so fio
    # does not lay them out again). Verified from the JSON afterwards (io_bytes, total_ios).
    #
    # prefault: with rw=read, fio never touches its iodepth*B of I/O buffers before the timed
    # phase, so the first read into each buffer page takes a minor fault (16K faults for
    # 32 x 2 MiB) inside fio's measured CPU -- the engine's destination is already faulted in
    # (as a real pinned KV buffer is). rw=rw with rwmixread=100 makes fio fill (fault in) its
    # buffers at init while still issuing only reads (checked: write total_ios == 0, files
    # unchanged), so both tools are measured with warm destination pages.
    rw = ["--rw=rw", "--rwmixread=100"] if prefault else ["--rw=read"]
    cmd = [
        "fio", "--name=fio_read", f"--directory={d}", f"--filename_format={FILE_PREFIX}$filenum",
        f"--nrfiles={blocks}", f"--openfiles={blocks}", f"--size={blocks * block_size}",
        f"--bs={block_size}", *rw, "--file_service_type=roundrobin",
        "--ioengine=io_uring", "--direct=1", f"--iodepth={iodepth}", "--numjobs=1",
        "--invalidate=1", "--allow_file_create=0", "--output-format=json", f"--output={out_json}",
        "--mem=mmaphuge" if mem == "huge" else "--mem=malloc",
    ]
    if fixedbufs:
        cmd.append("--fixedbufs=1")
    return cmd


def run_fio(args, d: str, fixedbufs: bool, mem: str, workdir: str, tag: str, dev: DevStat) -> dict:
    out_json = os.path.join(workdir, f"fio-{tag}.json")
    cmd = fio_cmd(d, args.blocks, args.block_size, args.iodepth, fixedbufs, out_json, args.fio_prefault, mem)
    ds0 = dev.snap()
    c0 = rusage_cpu(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    child_cpu = rusage_cpu(resource.RUSAGE_CHILDREN) - c0
    ds = DevStat.delta(ds0, dev.snap())
    if proc.returncode != 0:
        raise RuntimeError(f"fio failed (rc={proc.returncode}): {proc.stderr.strip()[-2000:]}\ncmd: {' '.join(cmd)}")
    with open(out_json) as f:
        text = f.read()
    # fio may print warnings before the JSON object
    data = json.loads(text[text.index("{"):])
    job = data["jobs"][0]
    rd = job["read"]
    want = args.blocks * args.block_size
    problems = []
    if job.get("error"):
        problems.append(f"job error {job['error']}")
    if rd["io_bytes"] != want:
        problems.append(f"io_bytes {rd['io_bytes']} != N*B {want}")
    if rd["total_ios"] != args.blocks:
        problems.append(f"total_ios {rd['total_ios']} != N {args.blocks}")
    if job["write"]["total_ios"] or job["write"]["io_bytes"]:
        problems.append(f"fio wrote {job['write']['io_bytes']} bytes")
    if rd.get("short_ios"):
        problems.append(f"short_ios {rd['short_ios']}")
    if problems:
        raise RuntimeError("fio did not do exactly N reads of B bytes: " + "; ".join(problems))
    runtime_s = rd["runtime"] / 1000.0  # ms resolution
    job_s = job["job_runtime"] / 1000.0
    cpu = (job["usr_cpu"] + job["sys_cpu"]) / 100.0 * job_s
    pct = rd["clat_ns"].get("percentile", {})
    return {
        "wall_s": runtime_s,               # fio's own job runtime (I/O phase)
        "bytes": rd["io_bytes"], "ios": rd["total_ios"],
        "gbps": rd["io_bytes"] / runtime_s / 1e9,
        "iops": rd["total_ios"] / runtime_s,
        "cpu_s": cpu, "usr_s": job["usr_cpu"] / 100.0 * job_s, "sys_s": job["sys_cpu"] / 100.0 * job_s,
        "cpu_s_per_gib": cpu / (rd["io_bytes"] / GiB),
        "cpu_rusage_children_s": child_cpu,
        "cpu_rusage_children_s_per_gib": child_cpu / (rd["io_bytes"] / GiB),
        "process_wall_s": wall,
        "p50_ms": pct["50.000000"] / 1e6 if "50.000000" in pct else None,
        "p99_ms": pct["99.000000"] / 1e6 if "99.000000" in pct else None,
        "lat_kind": "per-block clat",
        "lat_mean_ms": rd["lat_ns"].get("mean", 0) / 1e6,
        "batch_ms": runtime_s * 1e3,
        "ctx_switches": job.get("ctx"), "minflt": job.get("minf"),
        "fio_bw_bytes": rd["bw_bytes"], "fio_iops": rd["iops"],
        "disk_util": data.get("disk_util"),
        "cmd": " ".join(cmd),
        **_fio_dev(data.get("disk_util"), dev.name, ds),
    }


def _fio_dev(disk_util, name: str, around_process: dict) -> dict:
    """Device read counters around the fio process (same method as for the engine; fio's
    binary and libraries are re-read into the page cache before, see ColdCache), plus fio's
    own disk_util figures (sampled every 250 ms, so they miss short jobs)."""
    out = dict(around_process)
    for du in disk_util or []:
        if du.get("name") == name or name.startswith(du.get("name") or "\0") or len(disk_util) == 1:
            out.update({"fio_disk_util_read_ios": du.get("read_ios"),
                        "fio_disk_util_read_merges": du.get("read_merges")})
            break
    return out


# ----------------------------------------------------------------------------- engine

def import_native():
    try:
        from pykvtier import _native  # noqa: WPS433
        return _native, None
    except Exception as e:  # ImportError, or a broken build
        return None, f"{type(e).__name__}: {e}"


class EngineBench:
    def __init__(self, native, args, paths: list[str], crcs: list[int], variants: list[str], hugepage: int):
        self.native = native
        self.args = args
        self.paths = paths
        self.crcs = crcs
        B, N = args.block_size, args.blocks
        self.probe = dict(native.probe_direct(os.path.dirname(paths[0])))
        align = max(4096, int(self.probe.get("mem_align") or 0))
        self.bufs = {}      # mem kind -> (mmap, ndarray)
        self.engines = {}   # variant -> (Engine, mem kind)
        self.setup = {}     # variant -> first-run (ring + registration) cost
        self.engine_kwargs = dict(queue_depth=args.iodepth,
                                  max_inflight_bytes=args.max_inflight_bytes or args.iodepth * B)
        for v in variants:
            _, fixed, mem = variant_parts(v)
            if mem not in self.bufs:
                m, arr = alloc_host(N * B, mem, hugepage)
                assert arr.ctypes.data % align == 0
                self.bufs[mem] = (m, arr[:N * B])
            base = self.bufs[mem][1].ctypes.data
            eng = native.Engine(**self.engine_kwargs)
            if fixed:
                eng.register_buffer(base, N * B)
            self.engines[v] = (eng, mem)
            self.setup[v] = self._warm_up(v)

    def _requests(self, mem: str):
        base = self.bufs[mem][1].ctypes.data
        B = self.args.block_size
        return [(p, 0, B, base + i * B) for i, p in enumerate(self.paths)]

    def _warm_up(self, variant: str) -> dict:
        """One 1-block job, untimed for the results (the engine's first job); report its cost."""
        from pykvtier.engines import run_job

        eng, mem = self.engines[variant]
        req = self._requests(mem)[:1]
        c0 = rusage_cpu(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        res = run_job(eng, self.native.Op.READ, req, direct=True)
        out = {"wall_ms": (time.perf_counter() - t0) * 1e3,
               "cpu_ms": (rusage_cpu(resource.RUSAGE_SELF) - c0) * 1e3}
        if res[0] != self.args.block_size:
            raise RuntimeError(f"{variant}: warm-up read returned {res[0]}")
        return out

    def run(self, variant: str, dev: DevStat) -> dict:
        from pykvtier.bench.runner import submit_each

        eng, mem = self.engines[variant]
        buf = self.bufs[mem][1]
        reqs = self._requests(mem)
        B, N = self.args.block_size, self.args.blocks
        buf[:] = 0  # so a read that silently does nothing cannot pass the checksum
        s0 = _stats(eng)
        ds0 = dev.snap()
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        rt0 = resource.getrusage(resource.RUSAGE_THREAD)
        t0 = time.perf_counter()
        res, lat_s = submit_each(eng, self.native.Op.READ, reqs, self.args.iodepth, direct=True)
        wall = time.perf_counter() - t0
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        rt1 = resource.getrusage(resource.RUSAGE_THREAD)
        ds = DevStat.delta(ds0, dev.snap())
        s1 = _stats(eng)
        bad = [(i, r) for i, r in enumerate(res) if r != B]
        if len(res) != N or bad:
            raise RuntimeError(f"{variant}: {len(bad)} of {N} blocks not read whole "
                               f"(first: {bad[:5]}; negative = -errno)")
        self.verify(variant, buf)
        usr = ru1.ru_utime - ru0.ru_utime
        sys_ = ru1.ru_stime - ru0.ru_stime
        cpu = usr + sys_
        nbytes = N * B
        out = {
            "wall_s": wall, "bytes": nbytes, "ios": N,
            "gbps": nbytes / wall / 1e9, "iops": N / wall,
            "cpu_s": cpu, "usr_s": usr, "sys_s": sys_, "cpu_s_per_gib": cpu / (nbytes / GiB),
            "cpu_thread_s": (rt1.ru_utime - rt0.ru_utime) + (rt1.ru_stime - rt0.ru_stime),
            "ctx_switches": (ru1.ru_nvcsw - ru0.ru_nvcsw) + (ru1.ru_nivcsw - ru0.ru_nivcsw),
            "minflt": ru1.ru_minflt - ru0.ru_minflt,
            "p50_ms": None, "p99_ms": None, "lat_kind": "whole batch",
            "batch_ms": wall * 1e3,
            "stats_delta": _delta(s0, s1),
            **ds,
        }
        # Per-block latency: the block's job from submit to result (as fio's clat measures
        # from submission to completion).
        ms = sorted(x * 1e3 for x in lat_s)
        out["p50_ms"] = ms[len(ms) // 2]
        out["p99_ms"] = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
        out["lat_kind"] = "per-block"
        return out

    def verify(self, variant: str, buf) -> None:
        """crc32 of blocks read == of blocks written (outside the timed region)."""
        B, N = self.args.block_size, self.args.blocks
        if self.args.verify == "all":
            idx = range(N)
        else:
            k = max(1, min(N, int(self.args.verify)))
            idx = sorted(set([0, N - 1] + list(range(0, N, max(1, N // k)))[:k]))
        mv = memoryview(buf)
        for i in idx:
            if zlib.crc32(mv[i * B:(i + 1) * B]) != self.crcs[i]:
                raise RuntimeError(f"{variant}: checksum mismatch in block {i} ({self.paths[i]})")

    def shutdown(self):
        for eng, _ in self.engines.values():
            try:
                eng.shutdown()
            except Exception:
                pass


def _stats(eng) -> dict:
    try:
        return dict(eng.stats())
    except Exception:
        return {}


def _delta(a: dict, b: dict) -> dict:
    out = {}
    for k, v in b.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and isinstance(a.get(k), (int, float)):
            out[k] = v - a[k]
        else:
            out[k] = v
    return out


# ----------------------------------------------------------------------------- report

COLS = [("GB/s", "gbps", "{:7.3f}"), ("IOPS", "iops", "{:7.0f}"), ("CPU s/GiB", "cpu_s_per_gib", "{:9.4f}"),
        ("p50 ms", "p50_ms", "{:7.2f}"), ("p99 ms", "p99_ms", "{:7.2f}"), ("batch ms", "batch_ms", "{:8.1f}")]
LABEL_W = 20


def fmt(v, f):
    if v is None:
        return "-".rjust(len(f.format(0)))
    return f.format(v)


def row(label: str, r: dict) -> str:
    cells = [fmt(r.get(k), f) for _, k, f in COLS]
    bits = []
    if r.get("cpu_rusage_children_s_per_gib") is not None:
        bits.append(f"whole fio process {r['cpu_rusage_children_s_per_gib']:.3f} s/GiB")
    if r.get("dev_reqs_per_block") is not None:
        bits.append(f"dev reqs/block {r['dev_reqs_per_block']:.2f}")
    if r.get("minflt") is not None:
        bits.append(f"minflt {r['minflt']}")
    sd = r.get("stats_delta") or {}
    bits += [f"{k} {sd[k]}" for k in ("submits", "sqes") if k in sd]
    extra = ("  (" + ", ".join(bits) + ")") if bits else ""
    return f"  {label:<{LABEL_W}}" + "  ".join(cells) + extra


def header() -> str:
    return f"  {'':<{LABEL_W}}" + "  ".join(h.rjust(len(f.format(0))) for h, _, f in COLS)


def summarize(runs: list[dict], variants: list[str]) -> dict:
    med = {}
    for v in variants:
        rs = [r for r in runs if r["variant"] == v and "error" not in r]
        if not rs:
            continue
        med[v] = {k: median([r.get(k) for r in rs]) for k in
                  ("gbps", "iops", "cpu_s_per_gib", "p50_ms", "p99_ms", "batch_ms", "wall_s",
                   "cpu_rusage_children_s_per_gib", "dev_reqs_per_block")}
        med[v]["gbps_min"] = min(r["gbps"] for r in rs)
        med[v]["gbps_max"] = max(r["gbps"] for r in rs)
        med[v]["n"] = len(rs)
    ratios = {}
    headline_set = False
    for mem in ("", HUGE_SUFFIX):
        for eng_v, fio_v in (("engine+fixed", "fio"), ("engine", "fio"),
                             ("engine+fixed", "fio+fixedbufs"), ("engine", "fio+fixedbufs")):
            eng_v, fio_v = eng_v + mem, fio_v + mem
            if eng_v not in med or fio_v not in med:
                continue
            e, f = med[eng_v], med[fio_v]
            bw = e["gbps"] / f["gbps"] if f["gbps"] else None
            cpu = e["cpu_s_per_gib"] / f["cpu_s_per_gib"] if f["cpu_s_per_gib"] else None
            # per-round paired ratios (same round, close in time)
            paired_bw, paired_cpu = [], []
            for rnd in sorted({r["round"] for r in runs}):
                er = [r for r in runs if r["round"] == rnd and r["variant"] == eng_v and "error" not in r]
                fr = [r for r in runs if r["round"] == rnd and r["variant"] == fio_v and "error" not in r]
                if er and fr:
                    paired_bw.append(er[0]["gbps"] / fr[0]["gbps"])
                    if fr[0]["cpu_s_per_gib"]:
                        paired_cpu.append(er[0]["cpu_s_per_gib"] / fr[0]["cpu_s_per_gib"])
            headline = (not headline_set) and eng_v.startswith("engine+fixed") and fio_v.split("@")[0] == "fio"
            headline_set = headline_set or headline
            ratios[f"{eng_v} / {fio_v}"] = {
                "bw_ratio": bw, "cpu_ratio": cpu,
                "bw_ratio_per_round": paired_bw, "cpu_ratio_per_round": paired_cpu,
                "bw_ratio_median_of_rounds": median(paired_bw), "cpu_ratio_median_of_rounds": median(paired_cpu),
                "bw_ok": None if bw is None else bw >= TARGET_BW_RATIO,
                "cpu_ok": None if cpu is None else cpu <= TARGET_CPU_RATIO,
                "is_headline": headline,
            }
    return {"medians": med, "ratios": ratios}


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--dir", help="directory for the N block files (default: /var/tmp/pykvtier-bench-NxB; "
                                  "never a tmpfs)")
    ap.add_argument("--blocks", type=int, default=256, help="N: number of blocks (= files) (default 256)")
    ap.add_argument("--block-size", type=parse_size, default=parse_size("2M"),
                    help="B: bytes per block, e.g. 2M, 2MiB, 256K (default 2MiB)")
    ap.add_argument("--iodepth", type=int, default=32, help="requests in flight, fio iodepth = engine "
                                                            "queue_depth (default 32)")
    ap.add_argument("--rounds", type=int, default=5, help="A/B rounds (default 5)")
    ap.add_argument("--variants", default=",".join(BASE_VARIANTS),
                    help=f"comma list of {', '.join(BASE_VARIANTS)} (default: all)")
    ap.add_argument("--mem", choices=("4k", "huge", "both"), default="4k",
                    help="destination memory for both tools: 4k pages (default; fio's malloc), 2 MiB "
                         "hugetlb pages (fio mem=mmaphuge, engine MAP_HUGETLB; raises vm.nr_hugepages "
                         "for the run if needed and allowed), or both sets")
    ap.add_argument("--max-inflight-bytes", type=parse_size, default=None,
                    help="engine byte cap on in-flight reads (default iodepth*B, so it never binds "
                         "before the queue depth does; fio has no such cap)")
    ap.add_argument("--verify", default="all", help="'all' or a number of blocks to checksum after "
                                                    "each engine run (default all; untimed)")
    ap.add_argument("--no-fio-prefault", dest="fio_prefault", action="store_false",
                    help="run fio as plain rw=read (its I/O buffers are then first touched inside "
                         "its timed phase, adding minor-fault CPU the engine does not pay); default: "
                         "rw=rw,rwmixread=100, which pre-faults fio's buffers and still only reads")
    ap.add_argument("--seed", type=int, default=12345)
    ap.add_argument("--no-drop-caches", action="store_true", help="do not drop the page cache before runs")
    ap.add_argument("--metadata", choices=("warm", "cold"), default="warm",
                    help="after dropping caches, stat() every file so dentries/inodes are cached "
                         "(warm, default: as after a phase-1 statx lookup; data stays cold), or not "
                         "(cold: both tools open the files inside their timed phase -- fio with "
                         "openat() before each file's first I/O, the engine in-ring, where a dentry miss "
                         "sends every open to io-wq -- and pay the inode reads)")
    ap.add_argument("--keep", action="store_true", help="keep the data files (default: remove them "
                                                         "at the end if this run created them)")
    ap.add_argument("--json", metavar="OUT", help="write all results as JSON to OUT")
    ap.add_argument("--workdir", help="keep fio's JSON outputs here (default: a temp dir, removed)")
    args = ap.parse_args(argv)

    bases = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in bases:
        if v not in BASE_VARIANTS:
            ap.error(f"unknown variant {v!r} (choose from {', '.join(BASE_VARIANTS)})")
    if args.blocks < 1 or args.iodepth < 1 or args.rounds < 1:
        ap.error("--blocks, --iodepth, --rounds must be >= 1")
    if args.block_size % 4096:
        ap.error("--block-size must be a multiple of 4096 for O_DIRECT")
    if args.verify != "all" and not args.verify.isdigit():
        ap.error("--verify takes 'all' or a number")

    d = os.path.abspath(args.dir or default_dir(args.blocks, args.block_size))
    probe_at = d
    while not os.path.exists(probe_at):
        probe_at = os.path.dirname(probe_at)
    mnt, fstype, src = mount_of(probe_at)
    if fstype in ("tmpfs", "ramfs"):
        print(f"error: {d} is on {fstype} (no O_DIRECT, data is in RAM): pick a disk with --dir", file=sys.stderr)
        return 2

    if any(v.startswith("fio") for v in bases) and not shutil.which("fio"):
        print("error: fio not found on PATH", file=sys.stderr)
        return 2
    native, native_err = (None, None)
    if any(v.startswith("engine") for v in bases):
        native, native_err = import_native()
        if native is None:
            print(f"warning: pykvtier._native not importable ({native_err}); running fio only", flush=True)
            bases = [v for v in bases if not v.startswith("engine")]
    if not bases:
        print("error: nothing to run", file=sys.stderr)
        return 2
    mems = {"4k": [""], "huge": [HUGE_SUFFIX], "both": ["", HUGE_SUFFIX]}[args.mem]
    variants = [b + m for m in mems for b in bases]

    thp = read_first_line("/sys/kernel/mm/transparent_hugepage/enabled")
    hp = HugePages()
    hp_note = None
    if HUGE_SUFFIX in mems:
        per = -(-args.block_size // hp.size)
        need = 0
        if any(v.startswith("engine") for v in bases):
            need += -(-(args.blocks * args.block_size) // hp.size)
        if any(v.startswith("fio") for v in bases):
            need += args.iodepth * per + 2  # fio: iodepth*bs rounded up, plus alignment slack
        try:
            hp_note = hp.ensure(need)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    try:
        return _run(args, d, mnt, fstype, src, native, native_err, bases, variants, mems, thp, hp, hp_note)
    finally:
        hp.restore()


def _run(args, d, mnt, fstype, src, native, native_err, bases, variants, mems, thp, hp, hp_note) -> int:
    existed = os.path.isdir(d)
    paths, crcs, created = prepare_files(d, args.blocks, args.block_size, args.seed)
    cold = ColdCache(enabled=not args.no_drop_caches, warm_paths=None if args.metadata == "cold" else paths,
                     warm_cmds=[["fio", "--version"]] if any(v.startswith("fio") for v in variants) else None)
    dev = DevStat(d)

    workdir = args.workdir or tempfile.mkdtemp(prefix="engine_vs_fio-")
    os.makedirs(workdir, exist_ok=True)

    fio_ver = subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip() \
        if shutil.which("fio") else None
    env = {
        "time": _dt.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(), "kernel": platform.release(), "python": platform.python_version(),
        "cpus": os.cpu_count(), "fio": fio_ver, "dir": d, "mount": mnt, "fstype": fstype, "device": src,
        "blocks": args.blocks, "block_size": args.block_size, "total_bytes": args.blocks * args.block_size,
        "iodepth": args.iodepth, "rounds": args.rounds, "variants": variants, "mem": args.mem,
        "fio_prefault": args.fio_prefault, "thp": thp, "hugetlb": hp_note,
        "cold_data": cold.describe(), "drop_caches": cold.works, "metadata": args.metadata,
        "native_import_error": native_err,
    }

    eb = None
    try:
        if any(v.startswith("engine") for v in variants):
            eb = EngineBench(native, args, paths, crcs, [v for v in variants if v.startswith("engine")], hp.size)
            env["probe_direct"] = eb.probe
            env["engine_kwargs"] = eb.engine_kwargs
            env["engine_setup"] = eb.setup
            if not eb.probe.get("direct", False):
                print(f"warning: probe_direct says no O_DIRECT on {d}: {eb.probe}", flush=True)

        total = args.blocks * args.block_size
        print(f"engine_vs_fio: {args.blocks} x {fmt_size(args.block_size)} = {total / GiB:.2f} GiB, "
              f"iodepth {args.iodepth}, {args.rounds} rounds, variants {', '.join(variants)}")
        print(f"  files : {d}/{FILE_PREFIX}0..{args.blocks - 1} ({fstype} on {src})"
              f"{'' if created else ' (reused)'}")
        print(f"  cold  : {cold.describe()}")
        print(f"  fio   : {fio_ver}, ioengine=io_uring direct=1 bs={args.block_size} iodepth={args.iodepth} "
              f"{'rw=rw rwmixread=100 (reads only; buffers pre-faulted)' if args.fio_prefault else 'rw=read'} "
              f"nrfiles={args.blocks}")
        print(f"  memory: destination pages {'/'.join('4 KiB' if not m else '2 MiB hugetlb' for m in mems)} "
              f"for both tools (THP: {thp}){'; ' + hp_note if hp_note else ''}")
        if thp and thp.startswith("[always]") and "" in mems:
            print("  warning: THP is 'always': fio's malloc'd buffers may get huge pages while the engine's "
                  "4k buffer is MADV_NOHUGEPAGE -- the 4k comparison may favour fio", flush=True)
        if eb:
            print(f"  engine: Engine({', '.join(f'{k}={v}' for k, v in eb.engine_kwargs.items())}), "
                  f"probe_direct={eb.probe}")
            for v, s in eb.setup.items():
                print(f"          {v}: first job (1 block{', into the registered buffer' if '+fixed' in v else ''})"
                      f" {s['wall_ms']:.1f} ms, {s['cpu_ms']:.1f} ms CPU -- untimed warm-up")
        print("  CPU   : engine = getrusage(RUSAGE_SELF) delta around the jobs; fio = its own usr_cpu+sys_cpu "
              "(I/O phase); 'whole fio process' = getrusage(RUSAGE_CHILDREN) around fio, start-up included")
        print("  dev reqs/block: read requests the block device completed per block (/sys/dev/block/*/stat)",
              flush=True)

        runs = []
        for rnd in range(args.rounds):
            k = rnd % len(variants)
            order = variants[k:] + variants[:k]
            print(f"\nround {rnd + 1}/{args.rounds}  (order: {', '.join(order)})")
            print(header(), flush=True)
            for v in order:
                tool, fixed, mem = variant_parts(v)
                cold.drop()
                try:
                    if tool == "fio":
                        r = run_fio(args, d, fixed, mem, workdir,
                                    f"r{rnd}-{v.replace('+', '_').replace('@', '_')}", dev)
                    else:
                        r = eb.run(v, dev)
                    if r.get("dev_read_reqs") is not None:
                        r["dev_reqs_per_block"] = r["dev_read_reqs"] / args.blocks
                except Exception as e:  # keep going; report the failure
                    r = {"error": str(e)}
                    print(f"  {v:<{LABEL_W}}FAILED: {e}", flush=True)
                r.update({"variant": v, "round": rnd, "cold_drop": cold.works})
                runs.append(r)
                if "error" not in r:
                    print(row(v, r), flush=True)

        summary = summarize(runs, variants)
        print(f"\nmedians over {args.rounds} rounds ({args.blocks} x {fmt_size(args.block_size)}, QD {args.iodepth}; "
              f"GB = 1e9 B; latency per block: fio clat, engine job submit -> result)")
        print(header() + "   GB/s min..max")
        for v in variants:
            if v in summary["medians"]:
                m = summary["medians"][v]
                print(row(v, {k: m[k] for k in ("gbps", "iops", "cpu_s_per_gib", "p50_ms", "p99_ms", "batch_ms",
                                                "dev_reqs_per_block", "cpu_rusage_children_s_per_gib")})
                      + f"   {m['gbps_min']:.2f}..{m['gbps_max']:.2f}")
        if summary["ratios"]:
            print(f"\nratios pykvtier / fio, medians (targets: bandwidth >= {TARGET_BW_RATIO}x, "
                  f"CPU/GiB <= {TARGET_CPU_RATIO}x)")

            def ok(b):
                return "-" if b is None else ("PASS" if b else "FAIL")

            for name, q in summary["ratios"].items():
                tag = "  <- headline" if q["is_headline"] else ""
                print(f"  {name:<34} bandwidth {q['bw_ratio']:.3f}x [{ok(q['bw_ok'])}]   "
                      f"CPU/GiB {q['cpu_ratio']:.3f}x [{ok(q['cpu_ok'])}]{tag}")
                print(f"  {'':<34} per round: bw " + " ".join(f"{x:.2f}" for x in q["bw_ratio_per_round"])
                      + "   cpu " + " ".join(f"{x:.2f}" for x in q["cpu_ratio_per_round"]))
        failed = [r for r in runs if "error" in r]
        if failed:
            print(f"\n{len(failed)} run{'s' if len(failed) != 1 else ''} FAILED: " + "; ".join(
                f"{r['variant']} r{r['round'] + 1}: {r['error'][:200]}" for r in failed))

        if args.json:
            with open(args.json, "w") as f:
                json.dump({"env": env, "runs": runs, "summary": summary,
                           "targets": {"bw_ratio_min": TARGET_BW_RATIO, "cpu_ratio_max": TARGET_CPU_RATIO}},
                          f, indent=2, default=str)
            print(f"\nwrote {args.json}")
        return 1 if failed else 0
    finally:
        if eb:
            eb.shutdown()
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        if created and not args.keep:
            remove_files(paths)
            try:
                os.unlink(os.path.join(d, MANIFEST))
                if not existed:
                    os.rmdir(d)
            except OSError:
                pass


if __name__ == "__main__":
    sys.exit(main())
