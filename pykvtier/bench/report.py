"""``pykvtier bench`` reports: fio's text layout and fio's JSON key names.

JSON follows fio 3.x's ``--output-format=json`` wherever pykvtier has the same figure:
``jobs[].jobname, groupid, error, elapsed, "job options", read/write/trim/sync: {io_bytes,
io_kbytes, bw_bytes, bw (KiB/s), iops, runtime (ms), total_ios, short_ios, drop_ios, slat_ns,
clat_ns{min,max,mean,stddev,N,percentile{"99.000000": ns}}, lat_ns, bw_min...}, job_runtime,
usr_cpu, sys_cpu (percent of job_runtime), ctx, majf, minf, latency_ns/us/ms`` and a top-level
``disk_util``. pykvtier's own figures sit under ``jobs[].pykvtier`` and the top-level
``pykvtier`` object. Differences from fio, on purpose:

* ``clat_ns`` is measured from an I/O's SQEs being prepared to its result -- fio's ``lat``; so
  ``lat_ns`` repeats it and ``slat_ns`` is empty (N=0).
* percentiles are exact (nearest rank over every I/O), not fio's histogram bins.
* no bandwidth/IOPS sampling over time (``bw_samples`` = 0, as fio reports for short jobs).
* rw=promote counts one I/O per request (``total_ios`` = requests, ``clat_ns`` = request
  latency: promote() to every block landed); rw=lookup one per key (``io_bytes`` = 0).
* ``usr_cpu``/``sys_cpu`` are fio's: CPU time as a percentage of the job's runtime (100 % = one
  CPU for the whole runtime; more when several threads work). The text adds CPU seconds per
  GiB moved (``cpu/GiB``) or, for rw=lookup, CPU time per key (``cpu/key``).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import time
from typing import Any

import numpy as np

from ..toolkit import jsonable
from .runner import CloneResult, DirStats, GroupResult

__all__ = ["DEFAULT_PERCENTILES", "job_json", "to_json", "format_text", "merge_clones",
           "dir_json", "lat_stats"]

DEFAULT_PERCENTILES = (1.0, 5.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 95.0, 99.0,
                       99.5, 99.9, 99.95, 99.99)
_BUCKETS = {"latency_ns": (1, (2, 4, 10, 20, 50, 100, 250, 500, 750, 1000)),
            "latency_us": (1000, (2, 4, 10, 20, 50, 100, 250, 500, 750, 1000)),
            "latency_ms": (1000000, (2, 4, 10, 20, 50, 100, 250, 500, 750, 1000, 2000, ">=2000"))}


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("pykvtier")
    except Exception:
        return "unknown"


def lat_stats(lat_ns: np.ndarray, percentiles=DEFAULT_PERCENTILES) -> dict:
    """fio's clat_ns object from per-I/O latencies in ns."""
    n = int(len(lat_ns))
    if n == 0:
        return {"min": 0, "max": 0, "mean": 0.0, "stddev": 0.0, "N": 0}
    s = np.sort(lat_ns)
    out: dict[str, Any] = {"min": int(s[0]), "max": int(s[-1]), "mean": float(s.mean()),
                           "stddev": float(s.std(ddof=1)) if n > 1 else 0.0, "N": n}
    out["percentile"] = {f"{p:.6f}": int(s[max(0, min(n - 1, math.ceil(p / 100.0 * n) - 1))])
                         for p in percentiles}
    return out


def _empty_lat() -> dict:
    return {"min": 0, "max": 0, "mean": 0.0, "stddev": 0.0, "N": 0}


def dir_json(d: DirStats, percentiles=DEFAULT_PERCENTILES, with_pct: bool = True) -> dict:
    rt = d.runtime_s
    lat = d.lat()
    clat = lat_stats(lat, percentiles) if with_pct else {k: v for k, v in lat_stats(lat).items()
                                                          if k != "percentile"}
    bw_bytes = d.io_bytes / rt if rt > 0 else 0.0
    return {
        "io_bytes": int(d.io_bytes), "io_kbytes": int(d.io_bytes // 1024),
        "bw_bytes": int(bw_bytes), "bw": int(bw_bytes // 1024),
        "iops": d.ios / rt if rt > 0 else 0.0,
        "runtime": int(round(rt * 1000)), "total_ios": int(d.ios), "short_ios": 0, "drop_ios": 0,
        "slat_ns": _empty_lat(), "clat_ns": clat, "lat_ns": dict(clat),
        "bw_min": 0, "bw_max": 0, "bw_agg": 100.0 if d.ios else 0.0, "bw_mean": 0.0, "bw_dev": 0.0,
        "bw_samples": 0, "iops_min": 0, "iops_max": 0, "iops_mean": 0.0, "iops_stddev": 0.0,
        "iops_samples": 0,
    }


def _buckets(lat_ns: np.ndarray) -> dict:
    out = {}
    n = len(lat_ns)
    for key, (scale, edges) in _BUCKETS.items():
        d: dict[str, float] = {}
        lo = 0 if key == "latency_ns" else (1000 if key == "latency_us" else 1000 * 1000)
        prev = lo
        for e in edges:
            if e == ">=2000":
                cnt = int(np.count_nonzero(lat_ns >= 2000 * scale)) if n else 0
            else:
                hi = e * scale
                cnt = int(np.count_nonzero((lat_ns >= prev) & (lat_ns < hi))) if n else 0
                prev = hi
            d[str(e)] = 100.0 * cnt / n if n else 0.0
        out[key] = d
    return out


def merge_clones(results: list[CloneResult]) -> list[CloneResult]:
    """group_reporting: the clones of one job become one result (sums; runtime = longest)."""
    out: list[CloneResult] = []
    by_job: dict[int, list[CloneResult]] = {}
    for r in results:
        if r.spec.values["group_reporting"]:
            by_job.setdefault(r.spec.index, []).append(r)
        else:
            out.append(r)
    for idx, rs in by_job.items():
        m = CloneResult(rs[0].spec, 0)
        for r in rs:
            m.read = m.read.merge(r.read)
            m.write = m.write.merge(r.write)
            m.usr_s += r.usr_s
            m.sys_s += r.sys_s
            m.ctx += r.ctx
            m.majf += r.majf
            m.minf += r.minf
            m.elapsed_s = max(m.elapsed_s, r.elapsed_s)
            if r.error and not m.error:
                m.error, m.error_msg = r.error, r.error_msg
            m.notes.extend(n for n in r.notes if n not in m.notes)
        m.unit = rs[0].unit
        m.cpu_note = rs[0].cpu_note
        m.extra = {"clones": len(rs), **{k: v for k, v in rs[0].extra.items()
                                         if not isinstance(v, (int, float)) or isinstance(v, bool)}}
        m.jobs = len(rs)
        out.append(m)
    out.sort(key=lambda r: (r.spec.index, r.jobnum))
    return out


def _pcts(r: CloneResult):
    return tuple(r.spec.values["percentile_list"] or DEFAULT_PERCENTILES)


def job_json(r: CloneResult) -> dict:
    spec = r.spec
    rt = r.job_runtime_s
    pct = _pcts(r)
    with_pct = bool(spec.values["clat_percentiles"])
    lat_all = np.concatenate([r.read.lat(), r.write.lat()])
    j: dict[str, Any] = {
        "jobname": spec.name, "groupid": spec.group, "error": int(r.error), "eta": 0,
        "elapsed": int(round(r.elapsed_s)),
        "job options": {k: v for k, v in spec.given.items()},
        "read": dir_json(r.read, pct, with_pct),
        "write": dir_json(r.write, pct, with_pct),
        "trim": dir_json(DirStats(), pct, False),
        "sync": {"total_ios": 0, "lat_ns": _empty_lat()},
        "job_runtime": int(round(rt * 1000)),
        "usr_cpu": 100.0 * r.usr_s / rt if rt > 0 else 0.0,
        "sys_cpu": 100.0 * r.sys_s / rt if rt > 0 else 0.0,
        "ctx": int(r.ctx), "majf": int(r.majf), "minf": int(r.minf),
        **_buckets(lat_all),
        "latency_depth": spec.values["iodepth"], "latency_target": 0, "latency_percentile": 100.0,
        "latency_window": 0,
    }
    gib = (r.read.io_bytes + r.write.io_bytes) / (1 << 30)
    keys = r.read.ios if r.unit == "key" else 0
    j["pykvtier"] = {
        "rw": spec.values["rw"], "ioengine": spec.values["ioengine"], "unit": r.unit,
        "jobs": getattr(r, "jobs", 1), "jobnum": r.jobnum,
        "usr_s": r.usr_s, "sys_s": r.sys_s,
        "cpu_s_per_gib": (r.usr_s + r.sys_s) / gib if gib else None,
        **({"cpu_ns_per_key": (r.usr_s + r.sys_s) * 1e9 / keys} if keys else {}),
        "cpu_accounting": r.cpu_note,
        "latency": "clat_ns = from the I/O's SQEs being prepared to its result (fio's lat); "
                   "percentiles exact",
        **({"error_msg": r.error_msg} if r.error else {}),
        **({"notes": r.notes} if r.notes else {}),
        **jsonable(r.extra),
    }
    return j


def to_json(groups: list[GroupResult], env: dict | None = None) -> dict:
    now = time.time()
    jobs = []
    disk = []
    for g in groups:
        jobs += [job_json(r) for r in merge_clones(g.clones)]
        disk += g.disk_util
    out = {
        "fio version": f"pykvtier-bench-{_version()}",
        "timestamp": int(now), "timestamp_ms": int(now * 1000), "time": time.ctime(now),
        "jobs": jobs,
    }
    if disk:
        out["disk_util"] = _merge_disk(disk)
    out["pykvtier"] = jsonable(env or {})
    return out


def _merge_disk(entries: list[dict]) -> list[dict]:
    if len(entries) == 1:
        return entries
    m: dict[str, Any] = {"name": entries[0]["name"]}
    for k in ("read_ios", "write_ios", "read_merges", "write_merges", "read_ticks", "write_ticks",
              "in_queue"):
        m[k] = sum(e.get(k, 0) for e in entries)
    m["util"] = max(e.get("util", 0.0) for e in entries)
    return [m]


# --------------------------------------------------------------------------- text

def _num(v: float, base: int, units: tuple[str, ...]) -> str:
    i = 0
    while v >= 10000 and i < len(units) - 1:
        v /= base
        i += 1
    if v >= 100 or v == int(v) and v >= 10:
        s = f"{v:.0f}"
    else:
        s = f"{v:.3g}"
        if "." not in s and "e" not in s and v < 100:
            s = f"{v:.1f}" if v < 10 else s
    return s + units[i]


def _bw(bps: float) -> str:
    return (_num(bps / 1024, 1024, ("KiB/s", "MiB/s", "GiB/s", "TiB/s")) + " ("
            + _num(bps / 1000, 1000, ("kB/s", "MB/s", "GB/s", "TB/s")) + ")")


def _size(n: float) -> str:
    return _num(n, 1024, ("B", "KiB", "MiB", "GiB", "TiB"))


def _size10(n: float) -> str:
    return _num(n, 1000, ("B", "kB", "MB", "GB", "TB"))


def _iops(v: float) -> str:
    if v < 10000:
        return f"{v:.0f}" if v >= 10 else f"{v:.2f}"
    for unit, div in (("k", 1e3), ("M", 1e6)):
        x = v / div
        if x < 10000:
            return (f"{x:.1f}" if x < 100 else f"{x:.0f}") + unit
    return f"{v / 1e9:.1f}G"


def _duration(seconds: float) -> str:
    """A short duration in fio's units: 850ns, 2.13us, 1.50ms, 2.00s."""
    for unit, scale in (("ns", 1e9), ("us", 1e6), ("ms", 1e3)):
        v = seconds * scale
        if v < 1000:
            return f"{v:.0f}{unit}" if unit == "ns" else f"{v:.2f}{unit}"
    return f"{seconds:.2f}s"


def _lat_unit(st: dict) -> tuple[str, float]:
    """fio's rule (stat.c): msec when min, max, mean and stdev all exceed 20 ms, usec when they
    all exceed 20 us, else nsec."""
    vals = (st["min"], st["max"], st["mean"], st["stddev"])
    for unit, div in (("msec", 1e6), ("usec", 1e3)):
        if all(v > 20 * div for v in vals):
            return unit, div
    return "nsec", 1.0


def _dir_text(label: str, d: DirStats, r: CloneResult) -> list[str]:
    rt = d.runtime_s
    lines = []
    bps = d.io_bytes / rt if rt > 0 else 0.0
    iops = d.ios / rt if rt > 0 else 0.0
    unit_note = "" if r.unit == "I/O" else f" ({r.unit}s/s)"
    if r.unit == "key":
        lines.append(f"  {label}: keys/s={_iops(iops)}, keys={d.ios} in {rt * 1e3:.0f}msec")
    else:
        lines.append(f"  {label}: IOPS={_iops(iops)}{unit_note}, BW={_bw(bps)}"
                     f"({_size(d.io_bytes)}/{rt * 1e3:.0f}msec)")
    lat = d.lat()
    if len(lat):
        st = lat_stats(lat, _pcts(r))
        unit, div = _lat_unit(st)
        what = {"I/O": "clat", "request": "clat (per request)", "key": "clat (per key)"}[r.unit]
        lines.append(f"    {what} ({unit}): min={st['min'] / div:.0f}, max={st['max'] / div:.0f}, "
                     f"avg={st['mean'] / div:.2f}, stdev={st['stddev'] / div:.2f}")
        if r.spec.values["clat_percentiles"]:
            lines.append(f"    clat percentiles ({unit}):")
            cells = [f"{float(p):5.2f}th=[{v / div:5.0f}]" for p, v in st["percentile"].items()]
            for i in range(0, len(cells), 4):
                lines.append("     | " + ", ".join(cells[i:i + 4]) + ("," if i + 4 < len(cells) else ""))
    return lines


def _bucket_text(lat: np.ndarray) -> list[str]:
    if not len(lat):
        return []
    b = _buckets(lat)
    lines = []
    for key, label in (("latency_ns", "nsec"), ("latency_us", "usec"), ("latency_ms", "msec")):
        cells = [f"{k}={v:.2f}%" for k, v in b[key].items() if v >= 0.01]
        if cells:
            lines.append(f"  lat ({label})   : " + ", ".join(cells))
    return lines


def _job_text(r: CloneResult) -> list[str]:
    spec = r.spec
    when = _dt.datetime.now().strftime("%a %b %d %H:%M:%S %Y")
    out = [f"{spec.name}: (groupid={spec.group}, jobs={getattr(r, 'jobs', 1)}): err={r.error:2d}: "
           f"pid={os.getpid()}: {when}"]
    if r.error:
        out.append(f"  error: {r.error_msg}")
    if r.unit == "request":
        out.append("  promote: 1 I/O = 1 request (one load job of its blocks)")
    idle = r.error and not r.read.ios and not r.write.ios
    if r.read.ios or (spec.reads and not r.write.ios and not idle):
        out += _dir_text("lookup" if r.unit == "key" else "read", r.read, r)
    if r.write.ios or (spec.writes and not r.read.ios and not idle):
        out += _dir_text("write", r.write, r)
    out += _bucket_text(np.concatenate([r.read.lat(), r.write.lat()]))
    rt = r.job_runtime_s
    usr = 100.0 * r.usr_s / rt if rt > 0 else 0.0
    sys_ = 100.0 * r.sys_s / rt if rt > 0 else 0.0
    gib = (r.read.io_bytes + r.write.io_bytes) / (1 << 30)
    cpg = f", cpu/GiB={(r.usr_s + r.sys_s) / gib:.4f}s" if gib else ""
    if r.unit == "key" and r.read.ios:
        cpg = f", cpu/key={_duration((r.usr_s + r.sys_s) / r.read.ios)}"
    out.append(f"  cpu          : usr={usr:.2f}%, sys={sys_:.2f}%, ctx={r.ctx}, majf={r.majf}, "
               f"minf={r.minf}{cpg}")
    e = r.extra
    bits = []
    # (keys_per_s is the lookup line's keys/s: not repeated here)
    for k in ("engine", "fixedbufs", "workload", "mode", "blocks_per_s", "requests_per_s",
              "hit_pending", "answers", "verify", "requests_split"):
        if k in e and e[k] not in (None, "", 0) or (k == "fixedbufs" and k in e):
            val = e[k]
            if isinstance(val, float):
                val = f"{val:.1f}"
            if isinstance(val, dict):  # answers: HIT=5000, MISS=5240
                bits.append(f"{k}: " + ", ".join(f"{a}={b}" for a, b in val.items()))
            else:
                bits.append(f"{k}={val}")
    es = e.get("engine_stats")
    if isinstance(es, dict):
        for op, st in es.items():
            if st:
                bits.append(f"{op}: submits={st.get('submits')}, sqes={st.get('sqes')}, "
                            f"fixed_buffer_ios={st.get('fixed_buffer_ios')}")
    if "submits" in e:
        bits.append(f"submits={e['submits']}, sqes={e.get('engine_sqes')}")
    if bits:
        out.append("  pykvtier     : " + "; ".join(str(b) for b in bits))
    for n in r.notes:
        out.append(f"  note         : {n}")
    return out


def _group_text(g: GroupResult, results: list[CloneResult]) -> list[str]:
    out = [f"Run status group {g.group} (all jobs):"]
    for label, attr in (("READ", "read"), ("WRITE", "write")):
        ds = [getattr(r, attr) for r in results if getattr(r, attr).io_bytes]
        if not ds:
            continue
        io = sum(d.io_bytes for d in ds)
        rts = [d.runtime_s for d in ds]
        agg = io / max(rts) if max(rts) > 0 else 0.0
        bws = [d.io_bytes / d.runtime_s for d in ds if d.runtime_s > 0] or [0.0]
        lo, hi = min(bws), max(bws)
        out.append(f"  {label:>5}: bw={_bw(agg)}, {_num(lo / 1024, 1024, ('KiB/s', 'MiB/s', 'GiB/s'))}-"
                   f"{_num(hi / 1024, 1024, ('KiB/s', 'MiB/s', 'GiB/s'))} "
                   f"({_num(lo / 1000, 1000, ('kB/s', 'MB/s', 'GB/s'))}-"
                   f"{_num(hi / 1000, 1000, ('kB/s', 'MB/s', 'GB/s'))}), io={_size(io)} ({_size10(io)}), "
                   f"run={min(rts) * 1e3:.0f}-{max(rts) * 1e3:.0f}msec")
    keys = [r for r in results if r.unit == "key" and r.read.ios]
    if keys:
        tot = sum(r.read.ios for r in keys)
        rt = max(r.read.runtime_s for r in keys)
        out.append(f"  LOOKUP: keys={tot}, keys/s={_iops(tot / rt if rt else 0)}, run={rt * 1e3:.0f}msec")
    return out


def format_text(groups: list[GroupResult], specs, env: dict | None = None) -> str:
    lines: list[str] = []
    for s in specs:
        lines.append(s.describe())
    lines.append(f"pykvtier-bench-{_version()} (fio job options; engines: {', '.join(sorted({s.engine for s in specs}))})")
    n = sum(s.values["numjobs"] for s in specs)
    lines.append(f"Starting {n} thread{'s' if n != 1 else ''}")
    for g in groups:
        merged = merge_clones(g.clones)
        for r in merged:
            lines.append("")
            lines += _job_text(r)
        lines.append("")
        lines += _group_text(g, merged)
    disk = [d for g in groups for d in g.disk_util]
    if disk:
        d = _merge_disk(disk)[0]
        lines += ["", "Disk stats (read/write):",
                  f"  {d['name']}: ios={d['read_ios']}/{d['write_ios']}, merge={d['read_merges']}/"
                  f"{d['write_merges']}, ticks={d['read_ticks']}/{d['write_ticks']}, "
                  f"in_queue={d['in_queue']}, util={d['util']:.2f}%"]
    if env and env.get("notes"):
        lines.append("")
        lines += [f"note: {n}" for n in env["notes"]]
    return "\n".join(lines) + "\n"


def dumps(obj: dict) -> str:
    return json.dumps(obj, indent=2, default=str)
