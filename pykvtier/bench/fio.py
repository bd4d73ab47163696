"""fio and ``pykvtier bench`` side by side: one job, both tools, the same files.

Used by ``bench/compare_fio.py`` and ``bench/sweep.py``. The job is parsed once with
:mod:`.options`; fio gets an equivalent job file written from the parsed options
(:func:`fio_jobfile`), ``pykvtier bench`` gets the same options. Both write fio's JSON, and
:func:`metrics` reads the same figures out of either.

Fairness rules (the lessons of ``bench/engine_vs_fio.py``, see ``bench/README.md``):

* the files are laid out once, by pykvtier's layout, before any run; fio is told
  ``allow_file_create=0`` so it reuses them as they are;
* both tools run cold: O_DIRECT where the job says ``direct=1``, and the page cache dropped
  before every run where that is allowed, then the files ``stat()``ed and both tools' code
  warmed again (fio's binary, pykvtier's modules), so device reads are the job's own;
* fio's I/O buffers are faulted in before its clock starts (``prefault``: a read job runs in fio
  as ``rw=rw``/``randrw`` with ``rwmixread=100`` -- still only reads, checked from its JSON), as
  pykvtier's buffers are; without it fio pays ~1 minor fault per 4 KiB page inside its clock;
* latency: pykvtier's clat is fio's ``lat`` (submission + completion), so fio runs with
  ``lat_percentiles=1`` and its ``lat_ns`` percentiles are the ones compared;
* CPU: fio's own ``usr_cpu + sys_cpu`` over its job runtime, pykvtier's getrusage over its
  measured phase (both include io_uring's io-wq workers); the whole-process CPU of each tool
  (``RUSAGE_CHILDREN`` around it, start-up included) is recorded beside it.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Sequence

from .options import OPTIONS, JobSpec, jobs_from_args
from .sysutil import GiB, ColdCache, rusage_cpu
from .workload import FilePattern, job_files, layout_files

__all__ = ["fio_available", "fio_version", "fio_jobfile", "prepare_files", "run_tool", "metrics",
           "bench_command", "TOOLS"]

TOOLS = ("fio", "pykvtier")
# options fio must not see (pykvtier's own) or that pykvtier owns the meaning of
_NOT_FOR_FIO = {name for name, o in OPTIONS.items() if o.ours} | {"name", "ioengine", "fixedbufs"}


def fio_available() -> bool:
    return shutil.which("fio") is not None


def fio_version() -> str | None:
    if not fio_available():
        return None
    return subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip()


def bench_command() -> list[str]:
    """How to start ``pykvtier bench`` (this interpreter, so the same pykvtier). ``-P`` (Python
    3.11+): the current directory is not put first on sys.path, so a source checkout there
    (without its built extension) never shadows the installed package."""
    return [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), "-m", "pykvtier.cli", "bench"]


def fio_jobfile(specs: Sequence[JobSpec], prefault: bool = True, fio_fixedbufs: bool | None = None,
                directory: str | None = None) -> str:
    """An fio job file equivalent to ``specs`` (fio's io_uring engine for every job)."""
    lines = ["; written by pykvtier.bench.fio from the pykvtier bench job", "[global]",
             "ioengine=io_uring", "allow_file_create=0", "lat_percentiles=1"]
    if directory:
        lines.append(f"directory={directory}")
    for s in specs:
        if s.is_kv:
            raise ValueError(f"job '{s.name}': rw={s.values['rw']} is pykvtier's own workload; fio "
                             "has no equivalent")
        lines.append(f"[{s.name}]")
        for k, v in s.given.items():
            if k in _NOT_FOR_FIO or (directory and k == "directory"):
                continue
            if prefault and k in ("rw", "rwmixread", "rwmixwrite"):
                continue
            lines.append(f"{k}={v}")
        if prefault:
            rw = s.values["rw"]
            if rw in ("read", "randread"):
                lines += ["rw=randrw" if rw == "randread" else "rw=rw", "rwmixread=100"]
            else:
                lines.append(f"rw={rw}")
                if rw in ("rw", "readwrite", "randrw"):
                    lines.append(f"rwmixread={s.values['rwmixread']}")
        fb = s.values["fixedbufs"] if fio_fixedbufs is None and "fixedbufs" in s.given else fio_fixedbufs
        if fb:
            lines.append("fixedbufs=1")
    return "\n".join(lines) + "\n"


def prepare_files(specs: Sequence[JobSpec], log=sys.stderr) -> list[str]:
    """Lay out every job's files (pykvtier's pattern) once; returns all paths."""
    pattern = FilePattern()
    paths: list[str] = []
    for s in specs:
        for j in range(s.values["numjobs"]):
            fs = job_files(s, j)
            layout_files(fs, pattern, True, s.name, log)
            paths += list(fs.paths)
    return sorted(set(paths))


def cold_cache(paths: list[str], enabled: bool = True) -> ColdCache:
    """Page cache dropped before each run (where allowed), then metadata and both tools' code
    warmed again (fio's binary, pykvtier's Python modules)."""
    warm = [[sys.executable, "-c", "import pykvtier.bench.runner, pykvtier.bench.report"]]
    if fio_available():
        warm.insert(0, ["fio", "--version"])
    return ColdCache(enabled=enabled, warm_paths=paths, warm_cmds=warm)


def run_tool(tool: str, job_args: list[str], workdir: str, tag: str, timeout: float = 600) -> dict:
    """Run one tool on a job (``job_args``: a job file path for fio; job file or options for
    pykvtier). Returns {"json": fio-format JSON, "process_cpu_s", "wall_s", "cmd"}."""
    out = os.path.join(workdir, f"{tag}.json")
    if tool == "fio":
        cmd = ["fio", "--output-format=json", f"--output={out}", *job_args]
    else:
        cmd = [*bench_command(), "--output-format=json", f"--output={out}", "--eta=never", *job_args]
    c0 = rusage_cpu(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    cpu = rusage_cpu(resource.RUSAGE_CHILDREN) - c0
    text = ""
    if os.path.exists(out):
        with open(out) as f:
            text = f.read()
    if proc.returncode != 0 or "{" not in text:
        raise RuntimeError(f"{tool} failed (rc={proc.returncode}): {(proc.stderr or proc.stdout).strip()[-1500:]}\n"
                           f"cmd: {' '.join(cmd)}")
    data = json.loads(text[text.index("{"):])  # fio may print warnings before the JSON
    return {"json": data, "process_cpu_s": cpu, "wall_s": wall, "cmd": " ".join(cmd)}


def _pct(clat: dict, key: str) -> float | None:
    p = clat.get("percentile") or {}
    return p.get(key)


def metrics(data: dict, tool: str, expect_reads_only: bool | None = None) -> dict[str, dict]:
    """Per job name: GB/s (1e9 B/s), IOPS, p50/p99 latency (ms), CPU s/GiB, bytes, runtime --
    read out of fio's JSON, whichever tool wrote it. Clones of a job are summed."""
    out: dict[str, dict] = {}
    for j in data.get("jobs", []):
        name = j["jobname"]
        m = out.setdefault(name, {"bytes": 0, "ios": 0, "runtime_s": 0.0, "cpu_s": 0.0,
                                  "p50_ms": None, "p99_ms": None, "errors": 0, "written": 0})
        if j.get("error"):
            m["errors"] += 1
        for d in ("read", "write"):
            x = j[d]
            if not x["io_bytes"]:
                continue
            m["bytes"] += x["io_bytes"]
            m["ios"] += x["total_ios"]
            m["runtime_s"] = max(m["runtime_s"], x["runtime"] / 1000.0)
            if d == "write":
                m["written"] += x["io_bytes"]
            lat = x["lat_ns"] if (x.get("lat_ns") or {}).get("percentile") else x["clat_ns"]
            for p, key in (("p50_ms", "50.000000"), ("p99_ms", "99.000000")):
                v = _pct(lat, key)
                if v is not None:
                    m[p] = max(m[p] or 0.0, v / 1e6)
        pk = j.get("pykvtier") or {}
        if "usr_s" in pk:
            m["cpu_s"] += pk["usr_s"] + pk["sys_s"]
        else:
            m["cpu_s"] += (j["usr_cpu"] + j["sys_cpu"]) / 100.0 * j["job_runtime"] / 1000.0
    for name, m in out.items():
        rt = m["runtime_s"]
        m["gbps"] = m["bytes"] / rt / 1e9 if rt else 0.0
        m["iops"] = m["ios"] / rt if rt else 0.0
        m["cpu_s_per_gib"] = m["cpu_s"] / (m["bytes"] / GiB) if m["bytes"] else None
        m["tool"] = tool
    return out


def parse(job_args: list[str]) -> list[JobSpec]:
    return jobs_from_args(job_args)


def write_temp(text: str, workdir: str, name: str) -> str:
    path = os.path.join(workdir, name)
    with open(path, "w") as f:
        f.write(text)
    return path


def tempdir(prefix: str) -> str:
    return tempfile.mkdtemp(prefix=prefix)