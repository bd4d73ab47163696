#!/usr/bin/env python3
"""fio and `pykvtier bench` on the same job files, the same files, alternating, with ratios.

For every job file: the files are laid out once (pykvtier's layout; fio reuses them), then each
round runs both tools once -- the order alternates from round to round -- with the page cache
dropped before every run (where allowed). fio runs an equivalent job file written from the
parsed options (ioengine=io_uring, lat_percentiles=1, allow_file_create=0 and, for read jobs,
rw=randrw/rw with rwmixread=100 so its buffers are faulted in before its clock, as pykvtier's
are); `pykvtier bench` runs the job file itself. Prints per run and as medians over the rounds:
GB/s (1e9 B/s), IOPS, p50/p99 latency (ms; fio's lat = pykvtier's clat), CPU s/GiB, and the
ratios pykvtier/fio against the targets (reads: bandwidth >= 0.9x, CPU/GiB <= 1.5x), with the
ratio of each round's pair. See BENCHMARKS.md.

    python bench/compare_fio.py                                  # the three acceptance jobs
    python bench/compare_fio.py --dir /mnt/nvme/kvbench --rounds 7 bench/kv-models.fio
    python bench/compare_fio.py --engine pykvtier-posix bench/kv-randread-2m-qd32.fio
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import sys

from pykvtier.bench import fio as F
from pykvtier.bench.sysutil import (default_bench_dir, median, mount_of, plural, read_first_line,
                                     remove_files)

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_JOBS = [os.path.join(HERE, f) for f in
                ("kv-randread-2m-qd32.fio", "kv-randread-256k-qd1.fio", "kv-write-2m-qd8.fio")]
TARGET_BW = 0.9
TARGET_CPU = 1.5
COLS = (("GB/s", "gbps", "{:7.3f}"), ("IOPS", "iops", "{:8.0f}"), ("p50 ms", "p50_ms", "{:7.3f}"),
        ("p99 ms", "p99_ms", "{:7.3f}"), ("CPU s/GiB", "cpu_s_per_gib", "{:9.4f}"),
        ("proc CPU s", "process_cpu_s", "{:10.3f}"))


def fmt(v, f):
    return "-".rjust(len(f.format(0))) if v is None else f.format(v)


def row(label, m, width=26):
    return f"  {label:<{width}}" + "  ".join(fmt(m.get(k), f) for _, k, f in COLS)


def header(width=26):
    return f"  {'':<{width}}" + "  ".join(h.rjust(len(f.format(0))) for h, _, f in COLS)


def job_labels(cases):
    """(case, job name) -> the job's label in every table: its name, whole; "case/job" where
    jobs of two job files share a name. ``cases``: [{"name": file stem, "jobs": [job names]}]."""
    owners = {}
    for c in cases:
        for jn in c["jobs"]:
            owners.setdefault(jn, set()).add(c["name"])
    return {(c["name"], jn): jn if len(owners[jn]) == 1 else f"{c['name']}/{jn}"
            for c in cases for jn in c["jobs"]}


def label_width(labels):
    """The label column: room for the longest label and the tool name after it."""
    return max([26] + [len(v) + 1 + max(len(t) for t in F.TOOLS) for v in labels.values()])


def headline(ncases, rounds, d, mount):
    return (f"compare_fio: {plural(ncases, 'job file')}, {plural(rounds, 'round')}, files in {d} "
            f"({mount[1]} on {mount[2]})")


def ratio(a, b):
    return a / b if a is not None and b else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("jobfiles", nargs="*", help="fio job files (default: the three acceptance jobs: "
                                                "2 MiB randread QD32, 256 KiB randread QD1, 2 MiB write QD8)")
    ap.add_argument("--dir", help="directory for the files (default /var/tmp/pykvtier-bench; never a tmpfs)")
    ap.add_argument("--rounds", type=int, default=5, help="A/B rounds (default 5)")
    ap.add_argument("--engine", help="run pykvtier with this ioengine instead of the job file's "
                                     "(pykvtier-uring, pykvtier-posix); fio always uses io_uring")
    ap.add_argument("--no-fio-prefault", dest="prefault", action="store_false",
                    help="run fio's read jobs as written (its buffers are then faulted in inside its clock)")
    ap.add_argument("--no-drop-caches", action="store_true", help="do not drop the page cache between runs")
    ap.add_argument("--json", metavar="OUT", help="write every run and the summary as JSON")
    ap.add_argument("--markdown", action="store_true", help="also print the summary as a Markdown table")
    ap.add_argument("--keep", action="store_true", help="keep the data files (default: remove them)")
    ap.add_argument("--workdir", help="keep both tools' JSON outputs and fio's job files here")
    args = ap.parse_args(argv)
    if not F.fio_available():
        print("error: fio not found on PATH (apt-get install fio)", file=sys.stderr)
        return 2
    jobfiles = args.jobfiles or DEFAULT_JOBS
    d = os.path.abspath(args.dir or default_bench_dir("pykvtier-bench"))
    os.makedirs(d, exist_ok=True)
    if mount_of(d)[1] in ("tmpfs", "ramfs"):
        print(f"error: {d} is a tmpfs (data in RAM, no O_DIRECT): pick a disk with --dir", file=sys.stderr)
        return 2
    workdir = args.workdir or F.tempdir("compare_fio-")
    os.makedirs(workdir, exist_ok=True)

    cases = []
    for jf in jobfiles:
        base = os.path.splitext(os.path.basename(jf))[0]
        specs = F.parse([f"--directory={d}", jf])
        fio_job = F.write_temp(F.fio_jobfile(specs, prefault=args.prefault, directory=d), workdir, f"{base}.fio-job")
        if args.engine:
            eng_specs = F.parse([f"--directory={d}", jf])
            text = F.fio_jobfile(eng_specs, prefault=False, directory=d).replace(
                "ioengine=io_uring", f"ioengine={args.engine}").replace("allow_file_create=0\n", "")
            kv_args = [F.write_temp(text.replace("lat_percentiles=1\n", ""), workdir, f"{base}.pykvtier-job")]
        else:
            kv_args = [f"--directory={d}", jf]
        paths = F.prepare_files(specs)
        cases.append({"name": base, "jobfile": jf, "specs": specs, "fio_args": [fio_job], "kv_args": kv_args,
                      "paths": paths, "reads_only": not any(s.writes for s in specs),
                      "jobs": list(dict.fromkeys(s.name for s in specs))})
    labels = job_labels(cases)
    width = label_width(labels)
    all_paths = sorted({p for c in cases for p in c["paths"]})
    cold = F.cold_cache(all_paths, enabled=not args.no_drop_caches)
    env = {"time": _dt.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
           "kernel": platform.release(), "cpus": os.cpu_count(), "fio": F.fio_version(), "dir": d,
           "mount": mount_of(d), "cold": cold.describe(), "rounds": args.rounds, "fio_prefault": args.prefault,
           "thp": read_first_line("/sys/kernel/mm/transparent_hugepage/enabled"),
           "pykvtier_engine": args.engine or "as in the job file"}
    print(headline(len(cases), args.rounds, d, env["mount"]))
    print(f"  fio   : {env['fio']}, ioengine=io_uring (job file written from the parsed options; "
          f"{'read jobs as rw=randrw/rw rwmixread=100: buffers pre-faulted' if args.prefault else 'as written'})")
    print(f"  cold  : {cold.describe()}")
    print("  CPU   : fio = its usr_cpu+sys_cpu over its job runtime; pykvtier = getrusage over its measured "
          "phase; 'proc CPU s' = the whole process (RUSAGE_CHILDREN), start-up included", flush=True)

    runs = []
    failed = 0
    for rnd in range(args.rounds):
        order = list(F.TOOLS) if rnd % 2 == 0 else list(reversed(F.TOOLS))
        print(f"\nround {rnd + 1}/{args.rounds}  (order: {', '.join(order)})")
        print(header(width), flush=True)
        for c in cases:
            for tool in order:
                cold.drop()
                tag = f"{c['name']}-r{rnd}-{tool}"
                try:
                    r = F.run_tool(tool, c["fio_args"] if tool == "fio" else c["kv_args"], workdir, tag)
                    per_job = F.metrics(r["json"], tool)
                    for jn, m in per_job.items():
                        m.update({"case": c["name"], "job": jn, "round": rnd, "process_cpu_s": r["process_cpu_s"],
                                  "cmd": r["cmd"]})
                        if m["errors"]:
                            raise RuntimeError(f"{tool}: job {jn} reported an error")
                        if tool == "fio" and args.prefault and c["reads_only"] and m["written"]:
                            raise RuntimeError(f"fio wrote {m['written']} bytes in a read job")
                        runs.append(m)
                        print(row(f"{labels.get((c['name'], jn), jn)} {tool}", m, width), flush=True)
                except Exception as e:  # keep going; report
                    failed += 1
                    names = ", ".join(labels[(c["name"], jn)] for jn in c["jobs"])
                    print(f"  {names} {tool}: FAILED: {e}", flush=True)
                    runs.append({"case": c["name"], "round": rnd, "tool": tool, "error": str(e)})

    summary = []
    print(f"\nmedians over {plural(args.rounds, 'round')} (GB = 1e9 B; latency: fio lat = pykvtier clat, per I/O)")
    print(header(width) + "   GB/s min..max")
    for c in cases:
        seen = {r["job"] for r in runs if r.get("case") == c["name"] and "job" in r}
        jobs = [jn for jn in c["jobs"] if jn in seen] + sorted(seen - set(c["jobs"]))
        for jn in jobs:
            med = {}
            for tool in F.TOOLS:
                rs = [r for r in runs if r.get("case") == c["name"] and r.get("job") == jn and r["tool"] == tool]
                if not rs:
                    continue
                med[tool] = {k: median([r.get(k) for r in rs]) for _, k, _ in COLS}
                med[tool]["gbps_min"] = min(r["gbps"] for r in rs)
                med[tool]["gbps_max"] = max(r["gbps"] for r in rs)
                print(row(f"{labels.get((c['name'], jn), jn)} {tool}", med[tool], width)
                      + f"   {med[tool]['gbps_min']:.2f}..{med[tool]['gbps_max']:.2f}")
            if len(med) < 2:
                continue
            f_, k_ = med["fio"], med["pykvtier"]
            paired = {"bw": [], "cpu": []}
            for rnd in range(args.rounds):
                a = [r for r in runs if r.get("case") == c["name"] and r.get("job") == jn
                     and r.get("round") == rnd and r.get("tool") == "pykvtier"]
                b = [r for r in runs if r.get("case") == c["name"] and r.get("job") == jn
                     and r.get("round") == rnd and r.get("tool") == "fio"]
                if a and b:
                    paired["bw"].append(ratio(a[0]["gbps"], b[0]["gbps"]))
                    paired["cpu"].append(ratio(a[0]["cpu_s_per_gib"], b[0]["cpu_s_per_gib"]))
            reads = c["reads_only"]
            s = {"case": c["name"], "job": jn, "label": labels.get((c["name"], jn), jn), "reads_only": reads,
                 "fio": f_, "pykvtier": k_,
                 "bw_ratio": ratio(k_["gbps"], f_["gbps"]), "iops_ratio": ratio(k_["iops"], f_["iops"]),
                 "p99_ratio": ratio(k_["p99_ms"], f_["p99_ms"]),
                 "cpu_ratio": ratio(k_["cpu_s_per_gib"], f_["cpu_s_per_gib"]),
                 "bw_ratio_per_round": paired["bw"], "cpu_ratio_per_round": paired["cpu"]}
            s["bw_ok"] = None if not reads or s["bw_ratio"] is None else s["bw_ratio"] >= TARGET_BW
            s["cpu_ok"] = None if not reads or s["cpu_ratio"] is None else s["cpu_ratio"] <= TARGET_CPU
            summary.append(s)

    def ok(b):
        return "" if b is None else (" [PASS]" if b else " [FAIL]")

    if summary:
        print(f"\nratios pykvtier / fio, medians (targets on reads: bandwidth >= {TARGET_BW}x, CPU/GiB <= {TARGET_CPU}x)")
        w = max(24, *(len(s["label"]) for s in summary))
        for s in summary:
            print(f"  {s['label']:<{w}} bandwidth {fmt(s['bw_ratio'], '{:.3f}')}x{ok(s['bw_ok'])}  "
                  f"IOPS {fmt(s['iops_ratio'], '{:.3f}')}x  p99 {fmt(s['p99_ratio'], '{:.3f}')}x  "
                  f"CPU/GiB {fmt(s['cpu_ratio'], '{:.3f}')}x{ok(s['cpu_ok'])}")
            print(f"  {'':<{w}} per round: bw " + " ".join(fmt(x, "{:.2f}") for x in s["bw_ratio_per_round"])
                  + "   cpu " + " ".join(fmt(x, "{:.2f}") for x in s["cpu_ratio_per_round"]))
    if args.markdown and summary:
        print("\n| job | fio GB/s | pykvtier GB/s | bw ratio | fio IOPS | pykvtier IOPS | fio p99 ms | "
              "pykvtier p99 ms | p99 ratio | fio CPU s/GiB | pykvtier CPU s/GiB | CPU ratio |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for s in summary:
            f_, k_ = s["fio"], s["pykvtier"]
            print(f"| {s['label']} | {f_['gbps']:.3f} | {k_['gbps']:.3f} | **{s['bw_ratio']:.2f}x** | "
                  f"{f_['iops']:.0f} | {k_['iops']:.0f} | {fmt(f_['p99_ms'], '{:.2f}')} | "
                  f"{fmt(k_['p99_ms'], '{:.2f}')} | {fmt(s['p99_ratio'], '{:.2f}')}x | "
                  f"{fmt(f_['cpu_s_per_gib'], '{:.4f}')} | {fmt(k_['cpu_s_per_gib'], '{:.4f}')} | "
                  f"**{fmt(s['cpu_ratio'], '{:.2f}')}x** |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "runs": runs, "summary": summary,
                       "targets": {"bw_ratio_min": TARGET_BW, "cpu_ratio_max": TARGET_CPU}}, f, indent=2, default=str)
        print(f"\nwrote {args.json}")
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    if not args.keep:
        remove_files(all_paths)
    if failed:
        print(f"\n{plural(failed, 'run')} FAILED", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
