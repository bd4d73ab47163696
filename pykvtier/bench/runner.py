"""Running ``pykvtier bench`` jobs: engines, the I/O loops, and what they measure.

Jobs of one reporting group run at the same time, as in fio (``stonewall`` / ``new_group``
separate groups); each clone (``numjobs``) runs on its own thread. Before a group starts, its
files are laid out (fio's "Laying out IO files"), KV populations are stored, every engine has
built its ring and registered its buffers (one untimed 1-I/O warm-up per stream), and the
files' cached pages are dropped (``invalidate=1``).

**File I/O** goes through the engine's job interface (``submit`` / ``wait`` / ``poll``, as
DiskTier drives it) with raw ``Op.READ`` / ``Op.WRITE`` requests: :func:`submit_each` keeps
``iodepth`` jobs of one I/O each in flight (each I/O opening its file, moving its bytes and
closing the file in the engine); the GIL is released while the stream waits. Batches are
large (up to 16384 I/Os, or about a second of I/O when a runtime is set), so the queue drains
only between batches. rw/randrw run reads and writes as two streams at once, each with its own
engine, ``iodepth`` split between them by ``rwmixread``.

**Latency** (clat) is the engine's per-job time from submit to its result (``queued_s +
transfer_s`` of the finished job: one I/O per job), i.e. fio's ``lat`` (submission +
completion); pykvtier has no separate slat.

**CPU** (usr/sys) is getrusage over the measured phase: ``RUSAGE_SELF`` when the group has one
stream (so the engine's threads and io_uring's io-wq workers count, as they do in fio's
figure), else each stream's ``RUSAGE_THREAD`` plus an equal share of the rest of the process's
CPU (the engines' threads among it) over the group.
rw=lookup measures CPU over exactly the intervals its runtime adds up (the timed lookups;
checking the answers and, for lookup=probed, setting up each pass's tier are left out of
both), so usr/sys are, as in fio, percentages of the job's runtime: 100 % = one CPU busy for
the whole runtime; above 100 % only when other threads (io_uring workers) add to it.
"""

from __future__ import annotations

import errno as _errno
import os
import resource
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .options import BenchOptionError, JobSpec
from .sysutil import DevStat, HugePages, alloc_host, plural
from .workload import (
    FilePattern,
    FileSet,
    PromoteWorkload,
    absent_key,
    invalidate_files,
    io_pass,
    job_files,
    layout_files,
    promote_workload,
)

__all__ = [
    "EngineUnavailable",
    "gds_unavailable_reason",
    "DirStats",
    "CloneResult",
    "GroupResult",
    "run_jobs",
    "submit_each",
    "CHUNK_MAX",
]

CHUNK_MAX = 16384  # I/Os per engine batch at most
CHUNK_SECONDS = 1.0  # with a runtime/ramp: aim for batches of about this long
ARENA_MAX_BYTES = 4 << 30  # promote: host arena limit (requests larger than this are split)


class EngineUnavailable(RuntimeError):
    """The job's ioengine cannot run here (the message says why)."""


def gds_unavailable_reason() -> str | None:
    """None when a GDS path could run here, else why not (build, kvikio, GPU)."""
    import importlib.util

    from .. import _native

    reasons = []
    info = getattr(_native, "gds_build_info", None)
    if info is not None:
        bi = info()
        if not bi.get("built"):
            reasons.append(f"pykvtier was built without its gds engine ({bi.get('reason') or 'kvikio not found'})")
    elif importlib.util.find_spec("pykvtier._gds") is None:
        reasons.append("this build of pykvtier has no gds engine (pykvtier._gds)")
    if importlib.util.find_spec("kvikio") is None:
        reasons.append("kvikio is not installed")
    if not any(os.path.exists(p) for p in ("/dev/nvidia0", "/dev/nvidiactl")):
        reasons.append("no NVIDIA GPU (/dev/nvidia0 missing)")
    if reasons:
        return "pykvtier-gds unavailable: " + "; ".join(reasons)
    return None


_GDS_NOT_WIRED = ("pykvtier-gds: GPUDirect Storage is available here, but `pykvtier bench` does not "
                  "drive the gds engine yet (device destinations); use pykvtier-uring for the host path")


# --------------------------------------------------------------------------- engines

def make_engine(engine: str, queue_depth: int, bs: int):
    """(engine object, kind) for one stream."""
    if engine == "pykvtier-gds":
        raise EngineUnavailable(gds_unavailable_reason() or _GDS_NOT_WIRED)
    if engine == "pykvtier-posix":
        from ..posix_engine import PosixEngine

        # one thread per request in flight, so iodepth means what it says; store_share=1 as below
        return PosixEngine(queue_depth=queue_depth, max_inflight_bytes=queue_depth * bs,
                           threads=min(queue_depth, 256), store_share=1.0), "posix"
    from .. import _native

    try:
        # store_share=1: a bench stream is one direction, and iodepth writes mean iodepth writes
        # (DiskTier keeps half the ring for loads; that priority rule is not what fio measures)
        return _native.Engine(queue_depth=queue_depth, max_inflight_bytes=max(queue_depth * bs, bs),
                              store_share=1.0), "uring"
    except ValueError as e:
        raise EngineUnavailable(f"pykvtier-uring unavailable: {e} (try ioengine=pykvtier-posix)") from None


# --------------------------------------------------------------------------- results

@dataclass
class DirStats:
    """One direction (read or write) of one job: what fio reports under "read"/"write"."""

    io_bytes: int = 0
    ios: int = 0
    runtime_s: float = 0.0
    lat_ns: list = field(default_factory=list)  # numpy chunks of per-I/O latencies (ns)

    def lat(self) -> np.ndarray:
        return np.concatenate(self.lat_ns) if self.lat_ns else np.empty(0)

    def merge(self, other: DirStats) -> DirStats:
        return DirStats(self.io_bytes + other.io_bytes, self.ios + other.ios,
                        max(self.runtime_s, other.runtime_s), self.lat_ns + other.lat_ns)


@dataclass
class CloneResult:
    spec: JobSpec
    jobnum: int
    read: DirStats = field(default_factory=DirStats)
    write: DirStats = field(default_factory=DirStats)
    usr_s: float = 0.0
    sys_s: float = 0.0
    ctx: int = 0
    majf: int = 0
    minf: int = 0
    error: int = 0
    error_msg: str = ""
    elapsed_s: float = 0.0
    unit: str = "I/O"  # what one of ios is: "I/O", "request" (promote), "key" (lookup)
    extra: dict = field(default_factory=dict)  # pykvtier-specific figures for the report
    notes: list = field(default_factory=list)
    cpu_note: str = ""

    @property
    def job_runtime_s(self) -> float:
        return max(self.read.runtime_s, self.write.runtime_s)


@dataclass
class GroupResult:
    group: int
    clones: list[CloneResult]
    disk_util: list[dict]
    wall_s: float


# --------------------------------------------------------------------------- streams

class _Stream:
    """One thread's worth of work: a direction of a clone, with its engine and buffers."""

    def __init__(self, clone: "_Clone", op: str):
        self.clone = clone
        self.op = op  # "read", "write", "promote", "lookup"
        self.stats = DirStats()
        self.done_bytes = 0  # for progress (all I/O, ramp included)
        self.engine = None
        self.error: tuple[int, str] | None = None
        self.ru_thread = (None, None)
        self.ru_self = (None, None)
        self.thread: threading.Thread | None = None
        self.m_start: float | None = None
        self.m_end: float | None = None
        self.setup_ms = 0.0
        # rw=lookup: rusage deltas summed over the timed intervals only ({"self": .., "thread": ..})
        self.cpu_windows: dict | None = None

    def live_bytes(self) -> int:
        eng = self.engine
        if eng is not None and self.op in ("read", "write") and self.clone.engine_kind == "uring":
            try:
                st = eng.stats()
                return max(self.done_bytes, st["bytes_read" if self.op == "read" else "bytes_written"]
                           - self.clone.engine_base_bytes.get(self.op, 0))
            except Exception:
                pass
        return self.done_bytes


def _ru(who):
    r = resource.getrusage(who)
    return r


def _ru_delta(a, b) -> dict:
    return {"usr": b.ru_utime - a.ru_utime, "sys": b.ru_stime - a.ru_stime,
            "ctx": (b.ru_nvcsw - a.ru_nvcsw) + (b.ru_nivcsw - a.ru_nivcsw),
            "majf": b.ru_majflt - a.ru_majflt, "minf": b.ru_minflt - a.ru_minflt}


def _ru_pair() -> tuple:
    """(RUSAGE_SELF, RUSAGE_THREAD) now: the two ends of a timed interval."""
    return resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_THREAD)


def _ru_add(acc: dict, start: tuple, end: tuple) -> None:
    """Add the rusage of one timed interval (two _ru_pair()s) to acc {"self": .., "thread": ..}."""
    for who, a, b in (("self", start[0], end[0]), ("thread", start[1], end[1])):
        d = _ru_delta(a, b)
        tot = acc.setdefault(who, dict.fromkeys(d, 0))
        for k, v in d.items():
            tot[k] += v


def _errtext(res: int) -> str:
    from .. import _native

    return _native.result_text(res)


def submit_each(engine: Any, op: Any, entries: list[tuple], depth: int,
                **submit_kw: Any) -> tuple[list[int], np.ndarray]:
    """Each of ``entries`` as a job of its own on ``engine`` (which this thread alone polls),
    ``depth`` jobs in flight, until all finished. Returns (results: one int per entry, bytes
    moved or -errno; latencies: float64 seconds per entry, submit to result as the engine
    timed it). ``submit_kw``: the engine's submit keywords. Raises what ``submit`` raises."""
    n = len(entries)
    results = [0] * n
    lat = np.zeros(n, dtype=np.float64)
    submitted = finished = 0
    while finished < n:
        while submitted < n and submitted - finished < depth:
            engine.submit(submitted, op, [entries[submitted]], **submit_kw)
            submitted += 1
        jobs = engine.poll()
        if not jobs:
            engine.wait(None)
            continue
        for job in jobs:
            results[job.job_id] = job.results[0]
            lat[job.job_id] = job.queued_s + job.transfer_s
        finished += len(jobs)
    return results, lat


class _Clone:
    """Common parts of a job clone (one of numjobs)."""

    engine_kind = "-"

    def __init__(self, spec: JobSpec, jobnum: int, ctx: "_RunContext"):
        self.spec = spec
        self.jobnum = jobnum
        self.ctx = ctx
        self.streams: list[_Stream] = []
        self.result = CloneResult(spec, jobnum)
        self.engine_base_bytes: dict[str, int] = {}
        self.t_start = 0.0
        self.t_end = 0.0
        self.seed = spec.values["randseed"] if spec.values["randrepeat"] else time.time_ns()

    # limits -------------------------------------------------------------------------
    def ramp_end(self) -> float:
        return self.t_start + self.spec.values["ramp_time"] / 1e6

    def deadline(self, m_start: float | None) -> float | None:
        rt = self.spec.values["runtime"]
        if rt is None:
            return None
        base = m_start if m_start is not None else self.ramp_end()
        return base + rt / 1e6

    def expected_seconds(self) -> float | None:
        rt = self.spec.values["runtime"]
        if rt is None:
            return None
        return (rt + self.spec.values["ramp_time"]) / 1e6

    def prepare(self) -> None:  # main thread, before the group starts
        raise NotImplementedError

    def warm_up(self, stream: _Stream) -> None:  # the stream's thread, before the start
        pass

    def work(self, stream: _Stream) -> None:  # the stream's thread, timed
        raise NotImplementedError

    def finish(self) -> None:  # main thread, after every stream of the group ended
        pass

    def progress_total(self) -> int | None:
        return None

    def fail(self, stream: _Stream | None, err: int, msg: str) -> None:
        if stream is not None and stream.error is None:
            stream.error = (err, msg)
        if not self.result.error:
            self.result.error = err
            self.result.error_msg = msg


# --------------------------------------------------------------------------- file I/O

class IoClone(_Clone):
    def __init__(self, spec: JobSpec, jobnum: int, ctx: "_RunContext"):
        super().__init__(spec, jobnum, ctx)
        self.files: FileSet = job_files(spec, jobnum)
        self.pattern = ctx.pattern
        self._passes: dict[int, Any] = {}
        self._pass_lock = threading.Lock()
        self.written: list[np.ndarray] = []  # verify writes: (file * bpf + block) of every write
        self.total_ios_done = 0
        self._count_lock = threading.Lock()

    def prepare(self) -> None:
        v = self.spec.values
        if v["direct"]:
            from .. import _native

            d = os.path.dirname(self.files.paths[0]) or "."
            probe = _native.probe_direct(d)
            if not probe["direct"]:
                raise BenchOptionError(f"job '{self.spec.name}': direct=1 but {d} refuses O_DIRECT "
                                       f"({probe['reason']})")
            self.align = max(512, int(probe["offset_align"]))
            self.mem_align = max(512, int(probe["mem_align"]))
            if self.files.bs % self.align:
                raise BenchOptionError(f"job '{self.spec.name}': bs={self.files.bs} is not a multiple "
                                       f"of {self.align}, the O_DIRECT alignment of {d}")
        else:
            self.align = self.mem_align = 4096
        ops = []
        if v["rw"] in ("rw", "readwrite", "randrw"):
            mix = v["rwmixread"]
            if mix > 0:
                ops.append("read")
            if mix < 100:
                ops.append("write")
        else:
            ops.append("write" if self.spec.writes else "read")
        qd = v["iodepth"]
        if len(ops) == 2:
            qd_r = min(qd - 1, max(1, round(qd * v["rwmixread"] / 100))) if qd > 1 else 1
            depths = {"read": qd_r, "write": max(1, qd - qd_r)}
            if qd == 1:
                self.result.notes.append("rw mix with iodepth=1: reads and writes each get one slot")
        else:
            depths = {ops[0]: qd}
        self.depths = depths
        bs = self.files.bs
        mem = "huge" if v["mem"] == "mmaphuge" else "4k"
        verify = self.spec.verify_on
        for op in ops:
            s = _Stream(self, op)
            d = depths[op]
            s.qd = d
            s.slots = max(64, 2 * d) if verify else max(2, 2 * d)
            nbytes = s.slots * bs
            if mem == "huge":
                self.ctx.ensure_hugepages(-(-nbytes // self.ctx.hugepages.size))
            s.mmap, s.buf = alloc_host(nbytes, mem, self.ctx.hugepages.size)
            s.base = s.buf.ctypes.data
            if op == "write" and not verify:
                # fio fills its write buffers once with random data; so do we (pattern bytes)
                for i in range(s.slots):
                    self.pattern.fill(s.buf[i * bs:(i + 1) * bs], "write-buffer", i * bs)
            s.engine, self.engine_kind = make_engine(v["ioengine"], d, bs)
            if v["fixedbufs"]:
                s.engine.register_buffer(s.base, nbytes)
            self.streams.append(s)

    def warm_up(self, stream: _Stream) -> None:
        # One untimed 1-I/O read: the engine's first job (its ring or threads at work, the
        # registered buffers in use), as bench/engine_vs_fio.py does.
        from .. import _native
        from ..engines import run_job

        t0 = time.perf_counter()
        res = run_job(stream.engine, _native.Op.READ, [(self.files.paths[0], 0, self.files.bs, stream.base)],
                      direct=self.spec.values["direct"], align=self.align, mem_align=self.mem_align)
        stream.setup_ms = (time.perf_counter() - t0) * 1e3
        if res[0] != self.files.bs:
            raise RuntimeError(f"warm-up read of {self.files.paths[0]} failed: {_errtext(res[0])}")
        st = stream.engine.stats()
        self.engine_base_bytes[stream.op] = st["bytes_read" if stream.op == "read" else "bytes_written"]

    def _pass_for(self, stream: _Stream, pass_no: int):
        """(file_idx, offsets) of this stream's I/Os in pass pass_no."""
        with self._pass_lock:
            p = self._passes.get(pass_no)
            if p is None:
                p = io_pass(self.spec, self.files, self.jobnum, pass_no, seed=self.seed)
                self._passes = {pass_no: p, **{k: x for k, x in self._passes.items() if k >= pass_no - 1}}
        if p.is_write is None:
            return p.file_idx, p.offsets
        sel = p.is_write if stream.op == "write" else ~p.is_write
        return p.file_idx[sel], p.offsets[sel]

    def progress_total(self) -> int | None:
        v = self.spec.values
        if v["time_based"]:
            return None
        n = self.files.total_bytes * v["loops"]
        if v["number_ios"]:
            n = min(n, v["number_ios"] * self.files.bs)
        return n

    def _io_budget(self) -> int | None:
        n = self.spec.values["number_ios"]
        if n is None:
            return None
        with self._count_lock:
            return n - self.total_ios_done

    def work(self, stream: _Stream) -> None:
        v = self.spec.values
        direct = v["direct"]
        eng = stream.engine
        bs = self.files.bs
        paths = self.files.paths
        verify = self.spec.verify_on
        time_based = v["time_based"]
        loops = v["loops"]
        op = stream.op
        from .. import _native

        io_op = _native.Op.READ if op == "read" else _native.Op.WRITE
        ramp_end = self.ramp_end()
        measuring = v["ramp_time"] == 0
        if measuring:
            self._start_measuring(stream, time.perf_counter())
        rate = None  # I/Os per second, from the last batch
        pass_no = 0
        pos = 0
        fidx, offs = self._pass_for(stream, 0)
        slot = 0
        while True:
            if pos >= len(fidx):
                pass_no += 1
                pos = 0
                if not time_based and pass_no >= loops:
                    break
                fidx, offs = self._pass_for(stream, pass_no)
                if len(fidx) == 0:
                    if time_based:
                        continue
                    break
            now = time.perf_counter()
            deadline = self.deadline(stream.m_start)
            if measuring and deadline is not None and now >= deadline:
                break
            n = min(len(fidx) - pos, CHUNK_MAX)
            if verify:
                n = min(n, stream.slots)
            limit_t = ramp_end if not measuring else deadline
            if limit_t is not None:
                if rate is None:
                    n = min(n, max(4 * stream.qd, 8))
                else:
                    n = min(n, max(stream.qd, int(rate * min(CHUNK_SECONDS, max(0.0, limit_t - now)))))
            budget = self._io_budget()
            if budget is not None:
                if budget <= 0:
                    break
                n = min(n, budget)
            n = max(1, n)
            f = fidx[pos:pos + n]
            o = offs[pos:pos + n]
            t0 = time.perf_counter()
            if verify:
                addrs = [stream.base + i * bs for i in range(n)]
                if op == "write":
                    for i in range(n):
                        self.pattern.fill(stream.buf[i * bs:(i + 1) * bs], paths[f[i]], int(o[i]))
                else:
                    stream.buf[:n * bs] = 0
            else:
                addrs = [stream.base + ((slot + i) % stream.slots) * bs for i in range(n)]
                slot = (slot + n) % stream.slots
            entries = [(paths[fi], oi, bs, a) for fi, oi, a in zip(f.tolist(), o.tolist(), addrs)]
            res, lat = submit_each(eng, io_op, entries, stream.qd, direct=direct,
                                   align=self.align, mem_align=self.mem_align)
            t1 = time.perf_counter()
            bad = [i for i, r in enumerate(res) if r != bs]
            if bad:
                i = bad[0]
                self.fail(stream, -res[i] if -4096 < res[i] < 0 else _errno.EIO,
                          f"{op} of {paths[f[i]]} at offset {int(o[i])}: {_errtext(res[i])}"
                          + (f" ({len(bad)} of {n} I/Os of the batch failed)" if len(bad) > 1 else ""))
                break
            if verify and op == "read":
                for i in range(n):
                    bad_at = self.pattern.first_mismatch(stream.buf[i * bs:(i + 1) * bs], paths[f[i]], int(o[i]))
                    if bad_at >= 0:
                        self.fail(stream, _errno.EILSEQ,
                                  f"verify: bad data in {paths[f[i]]} at offset {bad_at} (block at "
                                  f"offset {int(o[i])}, {bs} bytes): not the bytes the file was laid "
                                  "out with")
                        break
                if stream.error:
                    break
            if verify and op == "write":
                self.written.append(f.astype(np.int64) * self.files.blocks_per_file + o // bs)
            pos += n
            stream.done_bytes += n * bs
            with self._count_lock:
                self.total_ios_done += n
            rate = n / max(t1 - t0, 1e-6)
            if measuring:
                stream.stats.io_bytes += n * bs
                stream.stats.ios += n
                stream.stats.lat_ns.append(lat * 1e9)
                stream.m_end = t1
            elif t1 >= ramp_end:
                measuring = True
                self._start_measuring(stream, t1)
        if stream.m_start is not None and stream.m_end is None:
            stream.m_end = stream.m_start
        self._stop_measuring(stream)

    def _start_measuring(self, stream: _Stream, t: float) -> None:
        stream.m_start = t
        stream.ru_thread = (_ru(resource.RUSAGE_THREAD), None)
        stream.ru_self = (_ru(resource.RUSAGE_SELF), None)

    def _stop_measuring(self, stream: _Stream) -> None:
        if stream.m_start is None:
            return
        stream.ru_thread = (stream.ru_thread[0], _ru(resource.RUSAGE_THREAD))
        stream.ru_self = (stream.ru_self[0], _ru(resource.RUSAGE_SELF))
        stream.stats.runtime_s = max(0.0, stream.m_end - stream.m_start)

    def finish(self) -> None:
        r = self.result
        for s in self.streams:
            setattr(r, s.op, s.stats)
        r.extra = {
            "engine": self.engine_kind,
            **({"fixedbufs": bool(self.spec.values["fixedbufs"])} if self.engine_kind == "uring" else {}),
            "files": len(self.files.paths),
            "file_size": self.files.file_size,
            "iodepth_per_stream": self.depths,
            "setup_ms": {s.op: round(s.setup_ms, 2) for s in self.streams},
            "engine_stats": {s.op: _engine_stats(s.engine) for s in self.streams},
        }
        if self.spec.verify_on and not r.error:
            if self.spec.reads:
                r.extra["verify"] = "every block read compared with the pattern the files hold"
            if self.spec.writes and self.spec.values["do_verify"] and self.written:
                self._verify_written()
        for s in self.streams:
            try:
                s.engine.shutdown()
            except Exception:
                pass

    def _verify_written(self) -> None:
        """fio's verify phase of a write job: read back every block written and compare."""
        from .. import _native

        s = next(x for x in self.streams if x.op == "write")
        ids = np.unique(np.concatenate(self.written))
        bs, bpf, paths = self.files.bs, self.files.blocks_per_file, self.files.paths
        checked = 0
        for a in range(0, len(ids), s.slots):
            chunk = ids[a:a + s.slots]
            s.buf[:len(chunk) * bs] = 0
            entries = [(paths[int(i) // bpf], (int(i) % bpf) * bs, bs, s.base + k * bs)
                       for k, i in enumerate(chunk)]
            res, _ = submit_each(s.engine, _native.Op.READ, entries, s.qd,
                                 direct=self.spec.values["direct"], align=self.align, mem_align=self.mem_align)
            for k, (e, r) in enumerate(zip(entries, res)):
                if r != bs:
                    self.fail(None, _errno.EIO, f"verify: reading back {e[0]} at offset {e[1]}: {_errtext(r)}")
                    return
                bad_at = self.pattern.first_mismatch(s.buf[k * bs:(k + 1) * bs], e[0], e[1])
                if bad_at >= 0:
                    self.fail(None, _errno.EILSEQ, f"verify: bad data in {e[0]} at offset {bad_at}, "
                                                   "after writing it")
                    return
            checked += len(chunk)
        prev = self.result.extra.get("verify")
        self.result.extra["verify"] = (prev + "; " if prev else "") + \
            f"read back and compared {checked} written blocks"


def _engine_stats(eng) -> dict:
    try:
        st = dict(eng.stats())
    except Exception:
        return {}
    return {k: st[k] for k in ("submits", "sqes", "cqes", "fixed_buffer_ios",
                               "buffer_registration_failures") if k in st}


# --------------------------------------------------------------------------- KV: promote

def _tier_engine(spec: JobSpec) -> str:
    eng = spec.values["ioengine"]
    if eng == "pykvtier-gds":
        raise EngineUnavailable(gds_unavailable_reason() or _GDS_NOT_WIRED)
    return "posix" if eng == "pykvtier-posix" else "uring"


def _kv_root(spec: JobSpec) -> str:
    """KV jobs keep their blocks in DIRECTORY/kv-<block bytes>: a DiskTier root holds one block
    size, and jobs of the same block size share (and reuse) their stored blocks."""
    return os.path.join(spec.values["directory"] or os.getcwd(), f"kv-{spec.values['bs'][0]}")


def _store_population(tier, keys: list[bytes], bs: int, slots: int, log, name: str) -> int:
    """Store the keys the tier does not have (BlockPattern contents). Returns blocks stored."""
    from ..replay import BlockPattern
    from ..tier import LookupResult, TransferJob

    missing = [k for k in keys if tier.lookup(k) is not LookupResult.HIT]
    if not missing:
        return 0
    if log is not None:
        print(f"{name}: storing {plural(len(missing), 'KV block')} of {bs} bytes in {tier.layout.root}",
              file=log, flush=True)
    pat = BlockPattern(bs)
    arena = tier._arena  # the job's arena: its slots stage the blocks
    words = arena.slot_bytes // 8
    base = np.frombuffer((np.ctypeslib.as_ctypes_type(np.uint8) * arena.nbytes).from_address(arena.addr),
                         dtype=np.uint8)
    per = max(1, min(slots, arena.num_slots))
    job = 1
    for a in range(0, len(missing), per):
        part = missing[a:a + per]
        for i, k in enumerate(part):
            pat.fill(base[i * arena.slot_bytes:(i + 1) * arena.slot_bytes].view(np.uint64)[:words], k)
        tier.submit_store(TransferJob(job, part, list(range(len(part)))))
        job += 1
        tier.drain()
        for r in tier.get_finished_jobs():
            if not r.success:
                raise RuntimeError(f"{name}: storing the population failed: "
                                   f"{next(iter(r.failed_keys.values()))}")
    return len(missing)


class PromoteClone(_Clone):
    engine_kind = "uring"

    def prepare(self) -> None:
        from ..tier import DiskTier

        v = self.spec.values
        bs = v["bs"][0]
        qd = v["iodepth"]
        # the arena: iodepth blocks in flight plus the largest request
        max_job = max(1, ARENA_MAX_BYTES // bs - qd)
        self.workload: PromoteWorkload = promote_workload(self.spec, self.jobnum, 0, max_job)
        if not self.workload.requests:
            raise BenchOptionError(f"job '{self.spec.name}': no requests (empty population or trace)")
        slots = qd + self.workload.max_request_blocks()
        self.engine_kind = _tier_engine(self.spec)
        self.tier = DiskTier(_kv_root(self.spec), bs, direct=True if v["direct"] else False,
                             queue_depth=qd, max_inflight_bytes=qd * bs, engine=self.engine_kind)
        mem = "huge" if v["mem"] == "mmaphuge" else "4k"
        if mem == "huge":
            self.ctx.ensure_hugepages(-(-(slots * bs) // self.ctx.hugepages.size))
        self.mmap, buf = alloc_host(slots * bs, mem, self.ctx.hugepages.size)
        self.arena = buf.reshape(slots, bs)
        self.tier.set_arena(self.arena)
        if not v["fixedbufs"]:
            self.result.notes.append("fixedbufs=0 is not honoured by rw=promote: DiskTier always "
                                     "registers its arena")
        self.stored = _store_population(self.tier, self.workload.population, bs, slots,
                                        self.ctx.log, self.spec.name)
        if v["invalidate"]:
            from ..layout import key_digest

            invalidate_files(self.tier.layout.block_path(key_digest(k)) for k in self.workload.population)
        self.slots = slots
        s = _Stream(self, "promote")
        s.engine = self.tier.engine
        self.streams.append(s)
        self.result.unit = "request"

    def progress_total(self) -> int | None:
        if self.spec.values["time_based"]:
            return None
        bs = self.spec.values["bs"][0]
        return sum(len(r) for r in self.workload.requests) * bs * self.spec.values["loops"]

    def work(self, stream: _Stream) -> None:
        from ..promotion import Promoter
        from ..replay import BlockPattern
        from ..tier import LookupResult

        v = self.spec.values
        bs = v["bs"][0]
        qd = v["iodepth"]
        tier = self.tier
        prom = Promoter(tier)
        free = list(range(self.slots - 1, -1, -1))
        outstanding: dict[int, tuple[float, list[int], int, list[bytes]]] = {}
        out_blocks = 0
        ramp_end = self.ramp_end()
        measuring = v["ramp_time"] == 0
        pat = BlockPattern(bs) if self.spec.verify_on else None
        st0 = None
        lat: list[float] = []
        counts = {"requests": 0, "blocks_requested": 0, "hit_pending": 0, "verified": 0}
        if measuring:
            self._start(stream, time.perf_counter())
            st0 = tier.stats()
        rid = 0

        def collect(results) -> None:
            nonlocal out_blocks
            now = time.perf_counter()
            for pr in results:
                t0, own, nblocks, keys = outstanding.pop(pr.request_id)
                if pr.failed:
                    k, why = next(iter(pr.failed.items()))
                    self.fail(stream, _errno.EIO, f"promote: block {k!r} failed: {why}")
                if pat is not None:
                    for k, sl in pr.loaded.items():
                        if not pat.matches(self.arena[sl].view(np.uint64), k):
                            self.fail(stream, _errno.EILSEQ, f"verify: block {k!r} in slot {sl} does "
                                                             "not hold its bytes")
                    counts["verified"] += len(pr.loaded)
                free.extend(own)
                out_blocks -= nblocks
                stream.done_bytes += nblocks * bs
                if measuring and t0 >= (stream.m_start or 0):
                    lat.append((now - t0) * 1e9)
                    counts["requests"] += 1
                    counts["blocks_requested"] += len(keys)

        pass_no = 0
        requests = self.workload.requests
        stop = False
        while not stop and not stream.error:
            for keys in requests:
                now = time.perf_counter()
                if not measuring and now >= ramp_end:
                    measuring = True
                    self._start(stream, now)
                    st0 = tier.stats()
                deadline = self.deadline(stream.m_start)
                if measuring and deadline is not None and now >= deadline:
                    stop = True
                    break
                while outstanding and (out_blocks >= qd or len(free) < len(keys)):
                    collect(prom.wait(0.5))
                if stream.error:
                    stop = True
                    break
                for k in keys:  # phase 1, as an engine asks before loading
                    r = prom.lookup(k)
                    if r is LookupResult.HIT_PENDING:
                        counts["hit_pending"] += 1
                    elif r is not LookupResult.HIT:
                        self.fail(stream, _errno.ENOENT, f"lookup of stored block {k!r} answered {r.name}")
                own = [free.pop() for _ in keys]
                t0 = time.perf_counter()
                prom.promote(rid, keys, own)
                prom.on_step_end()
                outstanding[rid] = (t0, own, len(keys), keys)
                out_blocks += len(keys)
                rid += 1
                collect(prom.poll())
            pass_no += 1
            if not v["time_based"] and pass_no >= v["loops"]:
                break
            if not v["time_based"] or stop:
                continue
            self.workload = promote_workload(self.spec, self.jobnum, pass_no) if v["trace"] is None \
                else self.workload
            requests = self.workload.requests
        while outstanding:
            collect(prom.wait(0.5))
        t_end = time.perf_counter()
        if stream.m_start is None:
            self._start(stream, t_end)
            st0 = tier.stats()
        st1 = tier.stats()
        stream.m_end = t_end
        stream.ru_thread = (stream.ru_thread[0], _ru(resource.RUSAGE_THREAD))
        stream.ru_self = (stream.ru_self[0], _ru(resource.RUSAGE_SELF))
        d = {k: st1[k] - st0[k] for k in ("blocks_loaded", "bytes_loaded", "submits", "engine_sqes",
                                          "fixed_buffer_ios", "load_failures", "verify_failures")}
        stream.stats = DirStats(d["bytes_loaded"], counts["requests"], t_end - stream.m_start,
                                [np.asarray(lat)])
        self.kv = {**counts, **d, "promoter_jobs": prom.jobs_submitted}

    def _start(self, stream: _Stream, t: float) -> None:
        stream.m_start = t
        stream.ru_thread = (_ru(resource.RUSAGE_THREAD), None)
        stream.ru_self = (_ru(resource.RUSAGE_SELF), None)

    def finish(self) -> None:
        r = self.result
        s = self.streams[0]
        r.read = s.stats
        kv = getattr(self, "kv", {})
        rt = max(r.read.runtime_s, 1e-9)
        r.extra = {
            "engine": self.engine_kind, "workload": self.workload.source,
            "root": self.tier.layout.root, "population_blocks": len(self.workload.population),
            "stored_at_setup": self.stored, "block_bytes": self.spec.values["bs"][0],
            "arena_slots": self.slots, "requests_split": self.workload.split_requests,
            "blocks_per_s": kv.get("blocks_loaded", 0) / rt,
            "requests_per_s": kv.get("requests", 0) / rt,
            "verify": ("block header + XXH3 payload checksum of every block (always)"
                       + (" + every byte compared with the block's pattern" if self.spec.verify_on else "")),
            **kv,
        }
        self.tier.shutdown()


# --------------------------------------------------------------------------- KV: lookup

class LookupClone(PromoteClone):
    engine_kind = "-"

    def prepare(self) -> None:
        from ..tier import DiskTier

        v = self.spec.values
        bs = v["bs"][0]
        self.workload = promote_workload(self.spec, self.jobnum, 0)
        self.root = _kv_root(self.spec)
        tier = DiskTier(self.root, bs, direct=True if v["direct"] else False, queue_depth=32,
                        max_inflight_bytes=32 * bs, engine=_tier_engine(self.spec))
        slots = 16
        self.mmap, buf = alloc_host(slots * bs, "4k")
        tier.set_arena(buf.reshape(slots, bs))
        self.stored = _store_population(tier, self.workload.population, bs, slots, self.ctx.log,
                                        self.spec.name)
        self.mode = v["lookup"]
        if self.mode == "indexed":
            self.tier = tier
        else:
            tier.shutdown()
            self.tier = None
        n = len(self.workload.population)
        rng = np.random.default_rng([self.seed, self.jobnum])
        present = rng.random(n) < v["lookup_hit"] / 100.0
        self.keys = [k if p else absent_key(i) for i, (k, p) in enumerate(zip(self.workload.population, present))]
        self.present = present
        s = _Stream(self, "lookup")
        self.streams.append(s)
        self.result.unit = "key"

    def progress_total(self) -> int | None:
        return None

    def work(self, stream: _Stream) -> None:
        from ..tier import LookupResult

        v = self.spec.values
        batch = v["iodepth"]
        lat: list[np.ndarray] = []
        answers = {"HIT": 0, "MISS": 0}
        measured_s = 0.0
        n_keys = 0
        cpu: dict = {}
        self._start(stream, time.perf_counter())
        t_begin = stream.m_start
        pass_no = 0
        ramp_end = self.ramp_end()
        while True:
            now = time.perf_counter()
            deadline = t_begin + v["runtime"] / 1e6 if v["runtime"] else None
            if deadline is not None and now >= deadline:
                break
            if not v["time_based"] and pass_no >= v["loops"]:
                break
            pass_cpu: dict = {}
            if self.mode == "indexed":
                t, l, ans = self._indexed_pass(deadline, pass_cpu)
            else:
                t, l, ans = self._probed_pass(batch, deadline, pass_cpu)
            if ans.get("wrong"):
                self.fail(stream, _errno.EILSEQ, ans["wrong"])
                break
            if now >= ramp_end:
                for who, delta in pass_cpu.items():
                    tot = cpu.setdefault(who, dict.fromkeys(delta, 0))
                    for k, x in delta.items():
                        tot[k] += x
                measured_s += t
                lat.append(l)
                n_keys += len(l)
                for k in ("HIT", "MISS"):
                    answers[k] += ans.get(k, 0)
            pass_no += 1
        stream.ru_thread = (stream.ru_thread[0], _ru(resource.RUSAGE_THREAD))
        stream.ru_self = (stream.ru_self[0], _ru(resource.RUSAGE_SELF))
        stream.m_end = stream.m_start + measured_s
        stream.stats = DirStats(0, n_keys, measured_s, lat)
        stream.cpu_windows = cpu or None
        self.kv = {"mode": self.mode, "keys": n_keys, "answers": answers,
                   "keys_per_s": n_keys / measured_s if measured_s else 0.0, "passes": pass_no}
        _ = LookupResult

    def _indexed_pass(self, deadline, cpu: dict):
        from ..tier import LookupResult

        tier = self.tier
        keys = self.keys
        batch = self.spec.values["iodepth"]
        lat = np.empty(len(keys), dtype=np.float64)
        res = [None] * len(keys)
        clock = time.perf_counter_ns
        lookup = tier.lookup
        ru0 = _ru_pair()
        t0 = time.perf_counter()
        n = 0
        for i, k in enumerate(keys):
            a = clock()
            res[i] = lookup(k)
            lat[i] = clock() - a
            n += 1
            if n % batch == 0:
                tier.on_step_end()
                if deadline is not None and n % 4096 == 0 and time.perf_counter() >= deadline:
                    break
        t = time.perf_counter() - t0
        _ru_add(cpu, ru0, _ru_pair())
        ans = {"HIT": 0, "MISS": 0}
        for i in range(n):
            want = LookupResult.HIT if self.present[i] else LookupResult.MISS
            if res[i] is not want:
                ans["wrong"] = f"lookup of {keys[i]!r} answered {res[i].name}, expected {want.name}"
                break
            ans[want.name] += 1
        return t, lat[:n], ans

    def _probed_pass(self, batch: int, deadline, cpu: dict):
        """A tier that shares the root with other processes and has not seen the keys: each
        step looks up `iodepth` keys (RETRY), the step's end sends one batch of statx probes,
        the next lookups answer HIT or MISS. Latency per key: first lookup -> definite answer."""
        from ..layout import Layout
        from ..tier import DiskTier, LookupResult

        v = self.spec.values
        bs = v["bs"][0]
        probe_root = os.path.join(self.root, f".probe-{self.spec.name}-{self.jobnum}")
        shutil.rmtree(probe_root, ignore_errors=True)
        tier = DiskTier(probe_root, bs, shared=True, probe_ttl_s=3600.0,
                        direct=True if v["direct"] else False, engine=_tier_engine(self.spec))
        src = Layout(self.root).blocks_dir
        dst = tier.layout.blocks_dir
        moved = []
        try:
            # The blocks appear after the tier's start-up scan, as blocks written by another process.
            for sub in sorted(os.listdir(src)):
                os.rename(os.path.join(src, sub), os.path.join(dst, sub))
                moved.append(sub)
            keys = self.keys
            lat = np.empty(len(keys), dtype=np.float64)
            ans = {"HIT": 0, "MISS": 0}
            t_total = 0.0
            n = 0
            for a in range(0, len(keys), batch):
                part = keys[a:a + batch]
                ru0 = _ru_pair()
                t0 = time.perf_counter_ns()
                first = [tier.lookup(k) for k in part]
                tier.on_step_end()
                tier.drain()  # waits (GIL released) for the step's probes
                final = [tier.lookup(k) for k in part]
                t1 = time.perf_counter_ns()
                _ru_add(cpu, ru0, _ru_pair())
                lat[a:a + len(part)] = t1 - t0
                t_total += (t1 - t0) / 1e9
                for i, (f0, f1) in enumerate(zip(first, final)):
                    want = LookupResult.HIT if self.present[a + i] else LookupResult.MISS
                    if f0 is not LookupResult.RETRY or f1 is not want:
                        ans["wrong"] = (f"probed lookup of {part[i]!r}: {f0.name} then {f1.name}, "
                                        f"expected RETRY then {want.name}")
                        return t_total, lat[:n], ans
                    ans[want.name] += 1
                n += len(part)
                if deadline is not None and time.perf_counter() >= deadline:
                    break
            return t_total, lat[:n], ans
        finally:
            tier.shutdown()
            for sub in moved:
                target = os.path.join(src, sub)
                if os.path.isdir(target) and not os.listdir(target):
                    os.rmdir(target)
                os.rename(os.path.join(dst, sub), target)
            shutil.rmtree(probe_root, ignore_errors=True)

    def finish(self) -> None:
        r = self.result
        r.read = self.streams[0].stats
        r.extra = {"workload": f"{plural(len(self.keys), 'key')} per pass, {self.spec.values['lookup_hit']}% stored",
                   "root": self.root, "stored_at_setup": self.stored, **getattr(self, "kv", {})}
        if self.tier is not None:
            self.tier.shutdown()


# --------------------------------------------------------------------------- groups

class _RunContext:
    def __init__(self, log, progress: Callable | None):
        self.log = log
        self.progress = progress
        self.pattern = FilePattern()
        self.hugepages = HugePages()
        self.hugepage_notes: list[str] = []

    def ensure_hugepages(self, pages: int) -> None:
        self.hugepage_notes.append(self.hugepages.ensure(pages + 2))


def _make_clones(spec: JobSpec, ctx: _RunContext) -> list[_Clone]:
    cls = {"promote": PromoteClone, "lookup": LookupClone}.get(spec.values["rw"], IoClone)
    return [cls(spec, j, ctx) for j in range(spec.values["numjobs"])]


def run_group(specs: list[JobSpec], ctx: _RunContext) -> GroupResult:
    """Run the jobs of one reporting group at the same time; returns their results."""
    clones: list[_Clone] = []
    failed: list[CloneResult] = []
    for spec in specs:
        for c in _make_clones(spec, ctx):
            try:
                if spec.values["ioengine"] == "pykvtier-gds":
                    raise EngineUnavailable(gds_unavailable_reason() or _GDS_NOT_WIRED)
                if isinstance(c, IoClone):
                    layout_files(c.files, ctx.pattern, spec.values["allow_file_create"], spec.name, ctx.log)
                c.prepare()
                if isinstance(c, IoClone) and spec.values["invalidate"]:
                    invalidate_files(c.files.paths)
                clones.append(c)
            except (EngineUnavailable, OSError, RuntimeError, ValueError) as e:
                if isinstance(e, BenchOptionError):
                    raise
                err = e.errno if isinstance(e, OSError) and e.errno else (
                    _errno.EOPNOTSUPP if isinstance(e, EngineUnavailable) else _errno.EIO)
                c.fail(None, err, str(e))
                failed.append(c.result)
                for s in c.streams:
                    if s.engine is not None:
                        try:
                            s.engine.shutdown()
                        except Exception:
                            pass
    streams = [s for c in clones for s in c.streams]
    dev = None
    d0 = None
    if clones:
        first = clones[0]
        where = (first.files.paths[0] if isinstance(first, IoClone) else _kv_root(first.spec))
        try:
            dev = DevStat(os.path.dirname(where) if os.path.isfile(where) else where)
        except OSError:
            dev = None
    ready = threading.Barrier(len(streams) + 1) if streams else None
    go = threading.Event()
    start_box: list[float] = []

    def body(s: _Stream) -> None:
        c = s.clone
        try:
            c.warm_up(s)
        except Exception as e:  # noqa: BLE001 - reported as the job's error
            c.fail(s, _errno.EIO, f"setup: {e}")
        try:
            ready.wait()
        except threading.BrokenBarrierError:
            return
        go.wait()
        if s.error:
            return
        try:
            c.work(s)
        except Exception as e:  # noqa: BLE001
            c.fail(s, _errno.EIO, f"{type(e).__name__}: {e}")
            if s.m_start is not None and s.m_end is None:
                s.m_end = time.perf_counter()

    for s in streams:
        s.thread = threading.Thread(target=body, args=(s,), name=f"bench-{s.clone.spec.name}-{s.op}",
                                    daemon=True)
        s.thread.start()
    t_wall0 = time.perf_counter()
    if streams:
        ready.wait()
        d0 = dev.snap_all() if dev else None
        ru0 = _ru(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        for c in clones:
            c.t_start = t0
        start_box.append(t0)
        go.set()
        try:
            while True:
                alive = [s for s in streams if s.thread.is_alive()]
                if not alive:
                    break
                if ctx.progress is None:
                    alive[0].thread.join()
                else:
                    ctx.progress(clones, t0)
                    alive[0].thread.join(0.5)
        except KeyboardInterrupt:
            raise
        ru1 = _ru(resource.RUSAGE_SELF)
        t1 = time.perf_counter()
        d1 = dev.snap_all() if dev else None
        if ctx.progress is not None:
            ctx.progress(clones, t0, final=True)
        _account_cpu(clones, streams, ru0, ru1)
        for c in clones:
            c.result.elapsed_s = t1 - t0
            try:
                c.finish()
            except Exception as e:  # noqa: BLE001
                c.fail(None, _errno.EIO, f"{type(e).__name__}: {e}")
        util = dev.disk_util(d0, d1, t1 - t0) if dev else None
    else:
        t1 = time.perf_counter()
        util = None
    results = [c.result for c in clones] + failed
    results.sort(key=lambda r: (r.spec.index, r.jobnum))
    return GroupResult(specs[0].group, results, [util] if util else [], time.perf_counter() - t_wall0)


def _account_cpu(clones: list[_Clone], streams: list[_Stream], ru0, ru1) -> None:
    """usr/sys per clone; see the module docstring."""
    measured = [s for s in streams if s.ru_thread[0] is not None and s.ru_thread[1] is not None]
    if len(streams) == 1 and measured:
        s = measured[0]
        c = s.clone.result
        if s.cpu_windows:
            d, dt = s.cpu_windows["self"], s.cpu_windows["thread"]
            c.cpu_note = "getrusage(RUSAGE_SELF) over the timed lookups (the intervals of the runtime)"
        else:
            d, dt = _ru_delta(*s.ru_self), _ru_delta(*s.ru_thread)
            c.cpu_note = "getrusage(RUSAGE_SELF) over the measured phase"
        c.usr_s, c.sys_s = d["usr"], d["sys"]
        c.ctx, c.majf, c.minf = dt["ctx"], dt["majf"], dt["minf"]
        return
    total = _ru_delta(ru0, ru1)
    per = {id(s): _ru_delta(*s.ru_thread) for s in measured}
    rest_u = max(0.0, total["usr"] - sum(p["usr"] for p in per.values()))
    rest_s = max(0.0, total["sys"] - sum(p["sys"] for p in per.values()))
    n = max(1, len(measured))
    for s in measured:
        s.clone.result.cpu_note = ("getrusage(RUSAGE_THREAD) of the job's thread(s) + an equal share "
                                   "of the rest of the process's CPU over the group")
        p = per[id(s)]
        if s.cpu_windows:  # rw=lookup: its own thread over the timed lookups only
            p = s.cpu_windows["thread"]
            s.clone.result.cpu_note = ("getrusage(RUSAGE_THREAD) of the job's thread over the timed "
                                       "lookups + an equal share of the rest of the process's CPU "
                                       "over the group")
        c = s.clone.result
        c.usr_s += p["usr"] + rest_u / n
        c.sys_s += p["sys"] + rest_s / n
        c.ctx += p["ctx"]
        c.majf += p["majf"]
        c.minf += p["minf"]


def run_jobs(specs: list[JobSpec], log=None, progress: Callable | None = None) -> list[GroupResult]:
    """Run every job, group by group (groups one after another, jobs of a group together)."""
    ctx = _RunContext(log, progress)
    groups: dict[int, list[JobSpec]] = {}
    for s in specs:
        groups.setdefault(s.group, []).append(s)
    out = []
    try:
        for g in sorted(groups):
            out.append(run_group(groups[g], ctx))
    finally:
        ctx.hugepages.restore()
    return out
