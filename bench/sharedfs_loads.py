"""Loads through a shared JuiceFS volume (scripts/sharedfs.sh) beside the local disk (issue 13).

For each of --runs rounds: node A stores --blocks fresh blocks of --block-mib MiB (shared=True,
through mount A), then node B (a second shared tier, through mount B) probes them and loads them
in one job; every byte is compared. The same on a local directory (--local, one tier stores and a
second loads, O_DIRECT: cold). Reports per case the median GB/s of the load job (submit to
drain), the tier process's CPU seconds per GiB loaded, and on JuiceFS the FUSE client's (the
`juicefs mount` process of mount B, from /proc): on FUSE most of the work is in that daemon.

    .venv/bin/python bench/sharedfs_loads.py --mounts /tmp/pykvtier-sharedfs/a:/tmp/pykvtier-sharedfs/b \\
        --local /var/tmp/pykvtier-bench

"JuiceFS first read": B's JuiceFS client has not read these blocks (its data cache is empty; the
object store is a local directory whose files A just wrote, so mostly in the host's page cache);
"JuiceFS again": the same blocks loaded a second time by a new tier on B (JuiceFS's read cache on
B warm). Not a disk benchmark of JuiceFS's object store: it isolates the FUSE client's cost.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import tempfile
import time

import numpy as np

from pykvtier import DiskTier, LookupResult, TransferJob, host_arena

CLK = os.sysconf("SC_CLK_TCK")


def fuse_client_pids(mount: str) -> list[int]:
    """The pids of the `juicefs mount` processes serving ``mount`` (the client and its
    watchdog; JuiceFS rewrites its command line into one string)."""
    mount = os.path.realpath(mount)
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                words = f.read().replace(b"\0", b" ").split()
        except OSError:
            continue
        if words and words[0].endswith(b"juicefs") and b"mount" in words and mount.encode() in words:
            out.append(int(pid))
    return out


def proc_cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / CLK  # utime + stime
    return total


def self_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def settle(tier: DiskTier) -> list:
    tier.drain()
    return tier.get_finished_jobs()


def one_round(store_root: str, load_root: str, n: int, bs: int, seed: int, direct, client: list[int],
              again: bool) -> list[tuple[str, float, float, float]]:
    keys = [b"bench-%d-%d" % (seed, i) for i in range(n)]
    data = np.random.default_rng(seed).integers(0, 256, (n, bs), dtype=np.uint8)
    src = host_arena(n, bs)
    src[:] = data
    # (posix: the io_uring engine's stores are not whole on another FUSE node when reported)
    writer = DiskTier(store_root, bs, shared=True, arena=src, direct=direct, engine="posix")
    writer.submit_store(TransferJob(1, keys, list(range(n))))
    (res,) = settle(writer)
    assert res.success, res.failed_keys
    out = []
    for label in (["first read", "again"] if again else ["first read"]):
        dst = host_arena(n, bs)
        reader = DiskTier(load_root, bs, shared=True, arena=dst, direct=direct)
        for k in keys:  # (RETRY: probed; HIT: the tier's start-up scan found it)
            reader.lookup(k)
        reader.on_step_end()
        reader.drain()
        assert all(reader.lookup(k) is LookupResult.HIT for k in keys)
        c0, f0, t0 = self_cpu_s(), proc_cpu_s(client), time.perf_counter()
        reader.submit_load(TransferJob(2, keys, list(range(n))))
        (res,) = settle(reader)
        t, c, f = time.perf_counter() - t0, self_cpu_s() - c0, proc_cpu_s(client) - f0
        assert res.success, res.failed_keys
        assert np.array_equal(dst, data), "loaded bytes differ"
        gib = n * bs / (1 << 30)
        out.append((label, n * bs / t / 1e9, c / gib, f / gib))
        reader.shutdown()
    writer.shutdown()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mounts", required=True, help="A:B, the two mounts (scripts/sharedfs.sh up)")
    p.add_argument("--local", required=True, help="a directory on the local disk")
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--block-mib", type=int, default=2)
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    a, b = args.mounts.split(":")
    bs = args.block_mib << 20
    client = fuse_client_pids(b)
    cases = []
    for name, direct in (("JuiceFS O_DIRECT", None), ("JuiceFS buffered", False)):
        ra = tempfile.mkdtemp(prefix="bench-", dir=a)
        rb = os.path.join(b, os.path.basename(ra))
        rows: dict[str, list] = {}
        try:
            for r in range(args.runs):
                for label, gbs, cpu, fcpu in one_round(ra, rb, args.blocks, bs, 100 + r, direct,
                                                       client, again=True):
                    rows.setdefault(f"{name}, {label}", []).append((gbs, cpu, fcpu))
        finally:
            shutil.rmtree(ra, ignore_errors=True)
        cases += rows.items()
    os.makedirs(args.local, exist_ok=True)
    rl = tempfile.mkdtemp(prefix="bench-", dir=args.local)
    rows = {}
    try:
        for r in range(args.runs):
            for label, gbs, cpu, fcpu in one_round(rl, rl, args.blocks, bs, 200 + r, None, [],
                                                   again=False):
                rows.setdefault("local disk O_DIRECT (cold)", []).append((gbs, cpu, fcpu))
    finally:
        shutil.rmtree(rl, ignore_errors=True)
    cases += rows.items()
    print(f"{args.blocks} blocks of {args.block_mib} MiB per load job, {args.runs} runs, medians "
          f"(FUSE client pids {client})")
    print(f"{'case':44} {'GB/s':>7} {'tier CPU-s/GiB':>15} {'FUSE client CPU-s/GiB':>22}")
    for name, vals in cases:
        g, c, f = (statistics.median(v[i] for v in vals) for i in range(3))
        print(f"{name:44} {g:7.2f} {c:15.3f} {f:22.3f}")


if __name__ == "__main__":
    main()
