#!/usr/bin/env python3
"""CPU per block store (and load) of the C++ engines, through the real store path.

Each round stores N new blocks with ``Op.WRITE_BLOCK`` jobs of J blocks (a temporary opened
O_EXCL, header + payload written from a registered buffer, closed, renamed into place: what
DiskTier submits), K jobs in flight, then loads them back with ``Op.READ_BLOCK`` jobs (header
and XXH3 checksum verified; every payload compared byte-exact, untimed), then removes them
(untimed). CPU is ``getrusage(RUSAGE_SELF)`` user + system around the timed jobs only, so the
engine's worker thread and io_uring's io-wq workers (threads of this process) count; this
process does nothing else meanwhile. Printed per round and as medians: CPU microseconds per
store and per load, and wall time; per round also io_uring_submit calls per block (the
engine's ``submits`` counter; 0 for the posix engine).

``--native A.so,B.so`` runs the rounds with those builds of ``pykvtier._native`` instead of
the installed one (each in its own process, alternating round by round: an A/B of two builds
on the same files and the same disk). Without it, the installed build runs.

    python bench/store_cpu.py                                   # /var/tmp, 2048 x 256 KiB, uring
    python bench/store_cpu.py --native /tmp/old/_native.cpython-311-x86_64-linux-gnu.so,installed
    python bench/store_cpu.py --block 2M --blocks 512 --engine posix
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if importlib.util.find_spec("pykvtier") is None:  # not installed: the source tree above
    sys.path.insert(0, os.path.dirname(HERE))


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _load_native(path: str):
    """pykvtier._native, or the extension module at path (another build of it), which then is
    pykvtier._native for this process (loaded before pykvtier, which imports it)."""
    if path != "installed":
        loader = importlib.machinery.ExtensionFileLoader("pykvtier._native", path)
        spec = importlib.util.spec_from_file_location("pykvtier._native", path, loader=loader)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["pykvtier._native"] = mod
        loader.exec_module(mod)
    from pykvtier import _native

    return _native


def one_round(args: argparse.Namespace) -> dict:
    """One round in this process: the figures as a dict."""
    import numpy as np

    native = _load_native(args.native_one)
    from pykvtier.layout import key_digest
    from pykvtier.toolkit import parse_size

    bs, n, j, k = parse_size(args.block), args.blocks, args.job_blocks, args.inflight
    base = os.path.join(args.dir, f"store-cpu-{os.getpid()}")
    fan = [os.path.join(base, "%02x" % i) for i in range(16)]
    for d in fan:
        os.makedirs(d)
    raw = np.zeros(n * bs + 4096, dtype=np.uint8)
    off = (-raw.ctypes.data) % 4096
    src = raw[off: off + n * bs]
    src[:] = np.random.default_rng(args.round).integers(0, 256, n * bs, dtype=np.uint8)
    raw2 = np.zeros(n * bs + 4096, dtype=np.uint8)
    off2 = (-raw2.ctypes.data) % 4096
    dst = raw2[off2: off2 + n * bs]
    digests = [key_digest(b"store-cpu-%d-%d" % (args.round, i)) for i in range(n)]
    finals = [os.path.join(fan[i % 16], digests[i].hex() + ".kvb") for i in range(n)]
    if args.engine == "uring":
        e = native.Engine(queue_depth=args.queue_depth)
    else:
        e = native.PosixEngine(queue_depth=args.queue_depth)
    try:
        e.register_buffer(src.ctypes.data, src.nbytes)
        e.register_buffer(dst.ctypes.data, dst.nbytes)
        if hasattr(e, "await_buffers"):
            e.await_buffers(10.0)

        def run(op, make_entry) -> tuple[float, float, int]:
            jobs = [list(range(s, min(s + j, n))) for s in range(0, n, j)]
            pending: set[int] = set()
            nxt = 0
            submits = e.stats()["submits"]
            c0, t0 = _cpu(), time.perf_counter()
            while nxt < len(jobs) or pending:
                while nxt < len(jobs) and len(pending) < k:
                    e.submit(nxt, op, [make_entry(i) for i in jobs[nxt]], direct=not args.buffered,
                             fsync=args.fsync)
                    pending.add(nxt)
                    nxt += 1
                e.wait(10.0)
                for jid, _op, results, *_rest in e.poll():
                    want = [bs] * len(jobs[jid])
                    if list(results) != want:
                        raise SystemExit(f"job {jid} of {op}: results {list(results)}")
                    pending.discard(jid)
            cpu, wall = _cpu() - c0, time.perf_counter() - t0
            return cpu, wall, e.stats()["submits"] - submits

        s_cpu, s_wall, s_submits = run(native.Op.WRITE_BLOCK, lambda i: (finals[i] + ".tmp", finals[i], bs,
                                                              src.ctypes.data + i * bs, digests[i]))
        if args.drop_caches:
            subprocess.run(["sync"], check=False)
            try:
                with open("/proc/sys/vm/drop_caches", "w") as f:
                    f.write("3\n")
            except OSError:
                pass
        l_cpu, l_wall, l_submits = run(native.Op.READ_BLOCK, lambda i: (finals[i], bs, dst.ctypes.data + i * bs, digests[i]))
        if not np.array_equal(src, dst):
            raise SystemExit("loaded bytes differ from the stored ones")
        leftovers = sorted(set(os.listdir(fan[0])) - {os.path.basename(p) for p in finals})
        if any(name.endswith(".tmp") for name in leftovers):
            raise SystemExit(f"temporaries left: {leftovers}")
    finally:
        e.shutdown()
        shutil.rmtree(base, ignore_errors=True)
    return {"native": args.native_one, "engine": args.engine, "block": bs, "blocks": n,
            "store_cpu_us": 1e6 * s_cpu / n, "load_cpu_us": 1e6 * l_cpu / n,
            "store_wall_s": s_wall, "load_wall_s": l_wall,
            "store_submits_per_block": s_submits / n, "load_submits_per_block": l_submits / n}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/var/tmp", help="where the blocks go (default /var/tmp; a directory "
                                                     "store-cpu-PID is made and removed in it)")
    p.add_argument("--blocks", type=int, default=2048, help="N: blocks stored per round (default 2048)")
    p.add_argument("--block", default="256K", help="payload bytes per block (default 256K)")
    p.add_argument("--job-blocks", type=int, default=32, help="J: blocks per job (default 32)")
    p.add_argument("--inflight", type=int, default=4, help="K: jobs in flight (default 4)")
    p.add_argument("--queue-depth", type=int, default=64, help="engine queue_depth (default 64)")
    p.add_argument("--engine", choices=("uring", "posix"), default="uring")
    p.add_argument("--buffered", action="store_true", help="direct=False (default: O_DIRECT)")
    p.add_argument("--fsync", action="store_true", help="fsync=True stores")
    p.add_argument("--rounds", type=int, default=5, help="rounds per build (default 5)")
    p.add_argument("--native", default="installed",
                   help="comma list of builds of pykvtier._native to compare: paths of the extension "
                        "module, or 'installed' (default: installed)")
    p.add_argument("--no-drop-caches", dest="drop_caches", action="store_false",
                   help="do not drop the page cache between the stores and the loads")
    p.add_argument("--json", help="write every round's figures to this file")
    p.add_argument("--native-one", help=argparse.SUPPRESS)
    p.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.native_one:
        print(json.dumps(one_round(args)))
        return
    builds = args.native.split(",")
    rows: list[dict] = []
    print(f"{args.engine} engine, {args.blocks} blocks of {args.block}, jobs of {args.job_blocks}, "
          f"{args.inflight} in flight, {'buffered' if args.buffered else 'O_DIRECT'}"
          f"{', fsync' if args.fsync else ''}, in {args.dir}", flush=True)
    for r in range(args.rounds):
        order = builds if r % 2 == 0 else builds[::-1]
        for b in order:
            cmd = [sys.executable, os.path.abspath(__file__), "--native-one", b, "--round", str(r)]
            for name in ("dir", "blocks", "block", "job_blocks", "inflight", "queue_depth", "engine"):
                cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
            cmd += ["--buffered"] * args.buffered + ["--fsync"] * args.fsync
            cmd += [] if args.drop_caches else ["--no-drop-caches"]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"round {r} of {b} failed:\n{out.stdout}{out.stderr}")
            row = json.loads(out.stdout.strip().splitlines()[-1])
            row["round"] = r
            rows.append(row)
            print(f"round {r}  {b}: store {row['store_cpu_us']:.1f} us CPU ({row['store_wall_s']:.2f} s, "
                  f"{row['store_submits_per_block']:.2f} submits/block), load {row['load_cpu_us']:.1f} us CPU "
                  f"({row['load_wall_s']:.2f} s, {row['load_submits_per_block']:.2f} submits/block)", flush=True)
    print("medians:")
    for b in builds:
        mine = [x for x in rows if x["native"] == b]
        med = {key: statistics.median(x[key] for x in mine)
               for key in ("store_cpu_us", "load_cpu_us", "store_wall_s", "load_wall_s")}
        print(f"  {b}: store {med['store_cpu_us']:.1f} us CPU/block ({med['store_wall_s']:.2f} s), "
              f"load {med['load_cpu_us']:.1f} us CPU/block ({med['load_wall_s']:.2f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
