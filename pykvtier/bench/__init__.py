"""``pykvtier bench``: fio-style benchmarks of pykvtier's engines and KV workloads.

Runs fio job files (and fio-style command lines) through pykvtier's engines and prints a report
shaped like fio's, or fio's JSON (``--output-format=json``), so the numbers sit beside fio's
for the same job. Modules:

* :mod:`.options`  -- fio's job-file / command-line format and value rules
* :mod:`.workload` -- files, I/O order, file contents, KV requests and keys
* :mod:`.runner`   -- engines and the measured loops
* :mod:`.report`   -- fio-shaped text and JSON
* :mod:`.fio`      -- running fio itself on the same job (bench/compare_fio.py, bench/sweep.py)
* :mod:`.sysutil`  -- measurement helpers shared with bench/engine_vs_fio.py

Examples::

    pykvtier bench bench/kv-randread-2m-qd32.fio
    pykvtier bench --directory=/var/tmp/kvbench --direct=1 --ioengine=io_uring \\
        --name=r --rw=randread --bs=2m --size=512m --nrfiles=256 --iodepth=32
    pykvtier bench --output-format=json bench/kv-promote.fio > out.json
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from typing import Sequence

HELP = "fio-style benchmarks: fio job files and options, pykvtier's engines, fio-shaped reports"

_OWN_FLAGS = ("output-format", "output", "eta", "no-progress", "parse-only", "cmdhelp", "help")

USAGE = """\
usage: pykvtier bench [--output-format=normal|json] [--output=FILE] [--eta=auto|always|never]
                      [--no-progress] [--parse-only] [--cmdhelp[=OPTION]]
                      [JOB OPTIONS ...] [--name=NAME JOB OPTIONS ...] [JOBFILE ...]

Runs fio jobs through pykvtier's engines. Job options are fio's (job files: INI with [global]
and one section per job; command line: --name=NAME starts a job, options before the first
--name are global). `pykvtier bench --cmdhelp` lists every option.

  --output-format=FMT   normal (fio's text, default) or json (fio's JSON keys)
  --output=FILE         write the report to FILE instead of stdout
  --eta=WHEN            progress line on stderr: auto (when stderr is a terminal, default),
                        always, never
  --no-progress         same as --eta=never
  --parse-only          resolve the jobs, print them, run nothing
  --cmdhelp[=OPTION]    describe the job options (or one of them)

ioengine: pykvtier-uring (io_uring, default), pykvtier-posix, pykvtier-gds; fio's io_uring /
psync / libcufile are read as these, so one job file runs under both tools.
rw: read, write, randread, randwrite, rw, randrw (fio's), promote and lookup (KV workloads:
bench/kv-promote.fio, bench/kv-lookup.fio). cpu: usr/sys as in fio, percent of the job's runtime
(above 100 % when several threads work), with CPU time per GiB moved (cpu/GiB) or per key (cpu/key).
Exit status: 0 when every job succeeded, 1 when a job failed, 2 for an unusable job option.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """fio's options (``--rw=randread``) are not argparse options: the bench subparser hands
    its argument list over verbatim (as ``args.bench_argv``) and :func:`run` parses it."""
    orig = parser.parse_known_args

    def parse_known_args(args=None, namespace=None):
        ns, _ = orig([], namespace)
        ns.bench_argv = list(sys.argv[2:] if args is None else args)
        return ns, []

    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]


def _split_own(argv: Sequence[str]) -> tuple[dict, list[str]]:
    own: dict[str, str] = {}
    rest: list[str] = []
    for a in argv:
        if a in ("-h", "--help"):
            own["help"] = "1"
            continue
        if a.startswith("--"):
            k, _, v = a[2:].partition("=")
            if k in _OWN_FLAGS:
                own[k] = v if v or "=" in a else "1"
                continue
        rest.append(a)
    return own, rest


def _cmdhelp(which: str | None) -> str | None:
    """The description of every job option, or of ``which``; None when there is no such option."""
    from .options import OPTIONS

    lines = []
    for name, o in OPTIONS.items():
        if which not in (None, "1", "all") and name != which:
            continue
        dflt = "" if o.default is None else f" (default {o.default})"
        tag = " [pykvtier]" if o.ours else (" [accepted, no effect]" if o.ignored else "")
        lines.append(f"{name:<18} {o.help}{dflt}{tag}")
    if not lines:
        return None
    return "\n".join(lines) + "\n"


class _Progress:
    """fio's ETA line on stderr: ``Jobs: 1 (f=256): [R(1)][45.0%][r=1400MiB/s][r=700 IOPS][eta 00m:02s]``."""

    def __init__(self, stream=sys.stderr):
        self.stream = stream
        self.last_t = None
        self.last = {}
        self.width = 0

    def __call__(self, clones, t0: float, final: bool = False) -> None:
        from .report import _iops, _num

        now = time.perf_counter()
        if final:
            if self.width:
                self.stream.write("\r" + " " * self.width + "\r")
                self.stream.flush()
            self.last_t = None
            return
        rates = {"read": 0.0, "write": 0.0}
        iops = {"read": 0.0, "write": 0.0}
        done = 0
        total = 0
        unknown = False
        files = 0
        letters = []
        eta_s = None
        for c in clones:
            t = c.progress_total()
            if t is None:
                unknown = True
            else:
                total += t
            files += len(getattr(getattr(c, "files", None), "paths", ()) or ())
            for s in c.streams:
                b = s.live_bytes()
                done += b
                key = id(s)
                prev = self.last.get(key)
                if prev is not None and self.last_t is not None and now > self.last_t:
                    d = "write" if s.op == "write" else "read"
                    rates[d] += (b - prev) / (now - self.last_t)
                    bs = c.spec.values["bs"][0]
                    iops[d] += (b - prev) / bs / (now - self.last_t)
                self.last[key] = b
                letters.append({"read": "R" if c.spec.random is False else "r",
                                "write": "W" if c.spec.random is False else "w"}.get(s.op, s.op[0].upper()))
            exp = c.expected_seconds()
            if exp is not None:
                eta_s = max(eta_s or 0.0, exp - (now - t0))
        self.last_t = now
        if not unknown and total:
            pct = 100.0 * min(done, total) / total
            if eta_s is None and done:
                eta_s = (now - t0) * (total - done) / done
        else:
            pct = None
        if eta_s is not None and not unknown and total and done and eta_s < 0:
            eta_s = 0
        pct_s = f"[{pct:.1f}%]" if pct is not None else ("[" + f"{min(100.0, 100.0 * (now - t0) / max(1e-9, (now - t0) + (eta_s or 0))):.1f}%]" if eta_s is not None else "[-.-%]")
        dirs = [d for d in ("read", "write") if any(s.op == d or (d == "read" and s.op == "promote")
                                                    for c in clones for s in c.streams)] or ["read"]
        bw = "[" + ",".join(f"{d[0]}={_num(rates[d] / 1024, 1024, ('KiB/s', 'MiB/s', 'GiB/s'))}"
                            for d in dirs) + "]"
        io = "[" + ",".join(f"{d[0]}={_iops(iops[d])}" for d in dirs) + " IOPS]"
        eta = "" if eta_s is None else f"[eta {int(eta_s) // 60:02d}m:{int(eta_s) % 60:02d}s]"
        counts = {}
        for ch in letters:
            counts[ch] = counts.get(ch, 0) + 1
        line = (f"Jobs: {len(clones)} (f={files}): [" + "".join(f"{k}({v})" for k, v in counts.items())
                + f"]{pct_s}{bw}{io}{eta}")
        self.width = max(self.width, len(line))
        self.stream.write("\r" + line.ljust(self.width))
        self.stream.flush()


def _env(specs) -> dict:
    from .sysutil import mount_of, read_first_line

    dirs = sorted({s.values["directory"] or os.getcwd() for s in specs})
    mounts = {}
    for d in dirs:
        probe = d
        while not os.path.exists(probe) and probe != os.path.dirname(probe):
            probe = os.path.dirname(probe)
        mnt, fstype, src = mount_of(probe)
        mounts[d] = {"mount": mnt, "fstype": fstype, "device": src}
    notes = []
    for s in specs:
        for k in ("bs", "size", "filesize"):
            t = s.given.get(k, "")
            if s.values["kb_base"] == 1024 and any(u in t.lower() for u in ("kib", "mib", "gib", "tib")):
                notes.append(f"job '{s.name}': {k}={t} -- with fio's default kb_base=1024, KiB/MiB/GiB "
                             "are powers of 1000 (fio's rule); write 256k / 2m / 1g for powers of 1024")
    return {"host": platform.node(), "kernel": platform.release(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "directories": mounts,
            "thp": read_first_line("/sys/kernel/mm/transparent_hugepage/enabled"),
            "argv": sys.argv[1:], "notes": notes}


def run(args: argparse.Namespace) -> int:
    return main(getattr(args, "bench_argv", []))


def main(argv: Sequence[str]) -> int:
    from .options import BenchOptionError, jobs_from_args

    own, rest = _split_own(argv)
    if "help" in own:
        sys.stdout.write(USAGE)
        return 0
    if "cmdhelp" in own:
        text = _cmdhelp(own["cmdhelp"] or None)
        if text is None:  # an unusable job option: exit 2, as for a job that names one
            print(f"pykvtier bench: error: --cmdhelp={own['cmdhelp']}: no option {own['cmdhelp']!r}; "
                  "`pykvtier bench --cmdhelp` lists them", file=sys.stderr)
            return 2
        sys.stdout.write(text)
        return 0
    fmt = own.get("output-format", "normal")
    if fmt not in ("normal", "json"):
        print(f"pykvtier bench: error: --output-format={fmt}: expected normal or json", file=sys.stderr)
        return 2
    eta = "never" if "no-progress" in own else own.get("eta", "auto")
    if eta not in ("auto", "always", "never"):
        print(f"pykvtier bench: error: --eta={eta}: expected auto, always or never", file=sys.stderr)
        return 2
    try:
        specs = jobs_from_args(rest)
    except BenchOptionError as e:
        print(f"pykvtier bench: error: {e}", file=sys.stderr)
        return 2
    env = _env(specs)
    for n in env["notes"]:
        print(f"pykvtier bench: note: {n}", file=sys.stderr)
    if "parse-only" in own:
        import json

        for s in specs:
            vals = {k: (list(v) if isinstance(v, tuple) else v) for k, v in s.values.items()}
            print(json.dumps({"name": s.name, "group": s.group, "values": vals}, default=str))
        return 0
    from .report import dumps, format_text, to_json
    from .runner import run_jobs

    show = eta == "always" or (eta == "auto" and sys.stderr.isatty())
    progress = _Progress() if show else None
    try:
        groups = run_jobs(specs, log=sys.stderr, progress=progress)
    except BenchOptionError as e:
        print(f"pykvtier bench: error: {e}", file=sys.stderr)
        return 2
    text = dumps(to_json(groups, env)) + "\n" if fmt == "json" else format_text(groups, specs, env)
    if own.get("output"):
        with open(own["output"], "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    failed = [r for g in groups for r in g.clones if r.error]
    for r in failed:
        print(f"pykvtier bench: job '{r.spec.name}' (clone {r.jobnum}) failed: {r.error_msg}",
              file=sys.stderr)
    return 1 if failed else 0
