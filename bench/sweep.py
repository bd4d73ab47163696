#!/usr/bin/env python3
"""Sweep block size x iodepth x engine with `pykvtier bench`, fio as the reference, and plot it.

For every block size the files are laid out once (one block per file, as KV blocks are); then
for every iodepth, each round runs fio (ioengine=io_uring, the reference line) and
`pykvtier bench` with each engine on the same files with the same options, in rotating order,
cold (O_DIRECT; page cache dropped between runs where allowed). Medians over the rounds go to a
JSON file and a PNG: bandwidth (top) and CPU seconds per GiB (bottom) against iodepth, one
column per block size. Needs matplotlib for the plot (`pip install -e '.[bench]'` in the clone:
pykvtier is not on PyPI; or `pip install matplotlib`); without it the table and the JSON are
still written.

    python bench/sweep.py                                   # 128k,512k,2m,5m x 1,4,16,32 x uring,posix
    python bench/sweep.py --bs 2m,5m --iodepth 8,32 --engines pykvtier-uring --rounds 3
    python bench/sweep.py --dir /mnt/nvme/kvbench --size 8g --png bench/sweep-nvme.png
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
from pykvtier.bench.options import parse_size
from pykvtier.bench.sysutil import default_bench_dir, fmt_size, median, mount_of, plural, remove_files

HERE = os.path.dirname(os.path.abspath(__file__))
ENGINES = ("pykvtier-uring", "pykvtier-posix")
STYLE = {"fio": dict(color="black", linestyle="--", marker="o", label="fio io_uring (reference)"),
         "pykvtier-uring": dict(color="tab:blue", marker="s", label="pykvtier uring"),
         "pykvtier-posix": dict(color="tab:orange", marker="^", label="pykvtier posix")}


#: The install hint where matplotlib is missing (pykvtier is not on PyPI: the clone's extra).
MATPLOTLIB_HINT = ("matplotlib is not installed: no plot written (pip install -e '.[bench]' in the "
                   "pykvtier clone, or pip install matplotlib); the JSON has every number")


def job_name(bs: int, qds: list[int]) -> str:
    """``sweep-2MiB-qd8``; for the layout, which serves every iodepth, ``sweep-2MiB-qd8,32``."""
    return f"sweep-{fmt_size(bs)}-qd{','.join(map(str, qds))}"


def job_args(d: str, bs: int, qd: int, size: int, engine: str, name: str | None = None) -> list[str]:
    n = max(1, size // bs)
    return [f"--directory={d}", "--direct=1", f"--ioengine={engine}", f"--name={name or job_name(bs, [qd])}",
            "--rw=randread", f"--bs={bs}", f"--size={n * bs}", f"--nrfiles={n}", f"--iodepth={qd}",
            f"--filename_format=sweep{bs}.$filenum"]


def plot(results: dict, bss: list[int], qds: list[int], tools: list[str], png: str, title: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return MATPLOTLIB_HINT
    fig, axes = plt.subplots(2, len(bss), figsize=(3.2 * len(bss) + 1, 6.2), sharex=True, squeeze=False)
    for c, bs in enumerate(bss):
        for tool in tools:
            pts = [(qd, results.get(f"{bs}/{qd}/{tool}")) for qd in qds]
            pts = [(q, m) for q, m in pts if m]
            if not pts:
                continue
            xs = [q for q, _ in pts]
            axes[0][c].plot(xs, [m["gbps"] for _, m in pts], **STYLE.get(tool, {"label": tool}))
            axes[1][c].plot(xs, [m["cpu_s_per_gib"] for _, m in pts], **STYLE.get(tool, {"label": tool}))
        axes[0][c].set_title(f"bs={fmt_size(bs)}", fontsize=10)
        axes[1][c].set_xlabel("iodepth")
        for r in (0, 1):
            axes[r][c].set_xscale("log", base=2)
            axes[r][c].set_xticks(qds)
            axes[r][c].set_xticklabels([str(q) for q in qds])
            axes[r][c].grid(True, alpha=0.3)
        axes[0][c].set_ylim(bottom=0)
        axes[1][c].set_yscale("log")
        axes[1][c].yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axes[1][c].yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        axes[1][c].yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes[0][0].set_ylabel("GB/s (randread, O_DIRECT)")
    axes[1][0].set_ylabel("CPU s / GiB")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 0.95))
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--dir", help="directory for the files (default /var/tmp/pykvtier-sweep; not a tmpfs)")
    ap.add_argument("--bs", default="128k,512k,2m,5m", help="block sizes, fio units (default 128k,512k,2m,5m)")
    ap.add_argument("--iodepth", default="1,4,16,32", help="iodepths (default 1,4,16,32)")
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"pykvtier engines (default {','.join(ENGINES)})")
    ap.add_argument("--size", default="512m", help="bytes per run (one block per file; default 512m)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds, order rotating (default 2)")
    ap.add_argument("--png", default=os.path.join(HERE, "sweep.png"), help="plot (default bench/sweep.png)")
    ap.add_argument("--json", default=os.path.join(HERE, "out", "sweep.json"), help="results (default bench/out/sweep.json)")
    ap.add_argument("--title", help="plot title (default: host, kernel, file system)")
    ap.add_argument("--note", default="", help="a second title line (e.g. 'virtual disk, throttled')")
    ap.add_argument("--replot", metavar="JSON", help="only redraw the PNG from a sweep JSON written earlier")
    ap.add_argument("--no-drop-caches", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the data files")
    args = ap.parse_args(argv)
    if args.replot:
        with open(args.replot) as fh:
            data = json.load(fh)
        keys = [k.split("/") for k in data["medians"]]
        bss = sorted({int(k[0]) for k in keys})
        qds = sorted({int(k[1]) for k in keys})
        tools = [t for t in ("fio", *ENGINES) if any(k[2] == t for k in keys)]
        env = data["env"]
        title = args.title or (f"pykvtier bench vs fio: randread, O_DIRECT, one block per file, cold; medians of "
                               f"{plural(env['rounds'], 'round')}\n{env['host']} {env['kernel']}, {env['mount'][1]} on "
                               f"{env['mount'][2]}" + (f" -- {args.note}" if args.note else ""))
        why = plot(data["medians"], bss, qds, tools, args.png, title)
        print(why if why else f"wrote {args.png}")
        return 0 if not why else 1
    if not F.fio_available():
        print("error: fio not found on PATH (apt-get install fio)", file=sys.stderr)
        return 2
    bss = [parse_size(x) for x in args.bs.split(",") if x]
    qds = [int(x) for x in args.iodepth.split(",") if x]
    engines = [e for e in args.engines.split(",") if e]
    size = parse_size(args.size)
    d = os.path.abspath(args.dir or default_bench_dir("pykvtier-sweep"))
    os.makedirs(d, exist_ok=True)
    mnt = mount_of(d)
    if mnt[1] in ("tmpfs", "ramfs"):
        print(f"error: {d} is a tmpfs: pick a disk with --dir", file=sys.stderr)
        return 2
    workdir = F.tempdir("sweep-")
    tools = ["fio", *engines]
    paths = []
    for bs in bss:
        # one layout per block size serves every iodepth: its label names them all
        paths += F.prepare_files(F.parse(job_args(d, bs, qds[0], size, engines[0], job_name(bs, qds))))
    cold = F.cold_cache(paths, enabled=not args.no_drop_caches)
    print(f"sweep: bs {','.join(fmt_size(b) for b in bss)} x iodepth {','.join(map(str, qds))} x "
          f"{', '.join(tools)}; {fmt_size(size)} per run; {plural(args.rounds, 'round')}; files in {d} "
          f"({mnt[1]} on {mnt[2]})")
    print(f"  cold: {cold.describe()}", flush=True)
    runs = []
    k = 0
    for rnd in range(args.rounds):
        for bs in bss:
            for qd in qds:
                order = tools[k % len(tools):] + tools[:k % len(tools)]
                k += 1
                for tool in order:
                    ja = job_args(d, bs, qd, size, engines[0] if tool == "fio" else tool)
                    cold.drop()
                    try:
                        if tool == "fio":
                            jf = F.write_temp(F.fio_jobfile(F.parse(ja)), workdir, "sweep.fio")
                            r = F.run_tool("fio", [jf], workdir, "fio")
                        else:
                            r = F.run_tool("pykvtier", ja, workdir, "kv")
                        (m,) = F.metrics(r["json"], tool).values()
                        if m["errors"]:
                            raise RuntimeError("the job reported an error")
                    except Exception as e:  # noqa: BLE001 - record and go on
                        print(f"  bs={fmt_size(bs)} qd={qd} {tool}: FAILED {e}", flush=True)
                        continue
                    m.update({"bs": bs, "iodepth": qd, "round": rnd})
                    runs.append(m)
                    print(f"  r{rnd + 1} bs={fmt_size(bs):>7} qd={qd:<3} {tool:<15} {m['gbps']:6.3f} GB/s "
                          f"{m['iops']:8.0f} IOPS  p99 {m['p99_ms'] or 0:8.3f} ms  "
                          f"{m['cpu_s_per_gib'] or 0:.4f} CPU s/GiB", flush=True)
    results = {}
    for bs in bss:
        for qd in qds:
            for tool in tools:
                rs = [r for r in runs if r["bs"] == bs and r["iodepth"] == qd and r["tool"] == tool]
                if rs:
                    results[f"{bs}/{qd}/{tool}"] = {x: median([r[x] for r in rs]) for x in
                                                   ("gbps", "iops", "p99_ms", "cpu_s_per_gib")}
    print("\nmedians: GB/s (ratio to fio)   CPU s/GiB (ratio to fio)")
    for bs in bss:
        for qd in qds:
            f = results.get(f"{bs}/{qd}/fio")
            cells = []
            for tool in tools:
                m = results.get(f"{bs}/{qd}/{tool}")
                if not m:
                    continue
                rb = f" ({m['gbps'] / f['gbps']:.2f}x)" if f and tool != "fio" and f["gbps"] else ""
                rc = (f" ({m['cpu_s_per_gib'] / f['cpu_s_per_gib']:.2f}x)"
                      if f and tool != "fio" and f["cpu_s_per_gib"] else "")
                cells.append(f"{tool} {m['gbps']:.3f}{rb} {m['cpu_s_per_gib']:.4f}{rc}")
            print(f"  bs={fmt_size(bs):>7} qd={qd:<3} " + " | ".join(cells))
    title = args.title or (f"pykvtier bench vs fio: randread, O_DIRECT, one block per file, cold; "
                           f"medians of {plural(args.rounds, 'round')}\n{platform.node()} {platform.release()}, "
                           f"{mnt[1]} on {mnt[2]}, {os.cpu_count()} CPUs" + (f" -- {args.note}" if args.note else ""))
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump({"env": {"time": _dt.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
                           "kernel": platform.release(), "fio": F.fio_version(), "dir": d, "mount": mnt,
                           "cold": cold.describe(), "size": size, "rounds": args.rounds},
                   "medians": results, "runs": runs}, fh, indent=1, default=str)
    print(f"\nwrote {args.json}")
    why = plot(results, bss, qds, tools, args.png, title)
    print(why if why else f"wrote {args.png}")
    shutil.rmtree(workdir, ignore_errors=True)
    if not args.keep:
        remove_files(paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
