#!/usr/bin/env python3
"""A store burst larger than the file system (issue #9 item 8): what the tier does on a full disk.

Mounts a small file system (``--fs tmpfs``: a tmpfs of ``--size``; ``--fs ext4``: an ext4 image
of ``--size`` on a loop device), starts a tier on it with ``capacity_bytes=None`` and stores
``--factor`` times the file system's size in jobs of ``--job`` blocks (each job drained and
collected before the next). Two scenarios:

* ``reserve``: ``min_free_bytes`` at its default (5 % of the file system): eviction keeps the
  reserve free, no store meets ENOSPC.
* ``filled``: ``min_free_bytes=0``; after the first job another file fills the file system
  behind the tier's back. The tier's statvfs interval (``pykvtier.tier._FS_CHECK_S``, 0.1 s) is
  raised to an hour for this scenario, as if the disk filled between two statvfs: stores meet
  ENOSPC, evict and are retried.

Prints one line per (scenario, engine): stores ok / failed, blocks present, used bytes,
evictions, ENOSPC retries, WARNING lines logged, free bytes left, wall time of the burst.
Needs root (mount); unmounts and removes what it made.

    sudo python bench/full_disk.py                        # tmpfs of 64 MiB, 1 MiB blocks
    sudo python bench/full_disk.py --fs ext4 --size 256   # loop-mounted ext4, 256 MiB
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import subprocess
import sys
import tempfile
import time

from pykvtier import DiskTier, TransferJob, host_arena
from pykvtier import tier as tier_mod


class _Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "O_DIRECT not used" not in msg:  # (tmpfs: announced once at start)
            self.lines.append(msg)


def _mount(fs: str, size_mib: int) -> tuple[str, str | None]:
    where = tempfile.mkdtemp(prefix="pykvtier-full-disk-")
    image = None
    if fs == "tmpfs":
        cmd = ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", where]
    else:
        fd, image = tempfile.mkstemp(prefix="pykvtier-full-disk-", suffix=".img", dir="/var/tmp")
        os.close(fd)
        os.truncate(image, size_mib << 20)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", image], check=True)
        cmd = ["mount", "-o", "loop", image, where]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        os.rmdir(where)
        if image:
            os.unlink(image)
        sys.exit(f"cannot mount {fs}: {r.stderr.strip()} (needs root)")
    return where, image


def _fill(path: str) -> None:
    with open(os.path.join(path, "filler"), "wb", buffering=0) as f:
        for chunk in (1 << 20, 4096):
            buf = b"F" * chunk
            while True:
                try:
                    if f.write(buf) < chunk:
                        break
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
        os.fsync(f.fileno())


def run(fs: str, size_mib: int, block: int, job: int, factor: float, scenario: str,
        engine: str) -> dict:
    where, image = _mount(fs, size_mib)
    fs_check_s = getattr(tier_mod, "_FS_CHECK_S", None)
    counter = _Count()
    log = logging.getLogger("pykvtier")
    log.addHandler(counter)
    try:
        kw = {"min_free_bytes": 0} if scenario == "filled" else {}
        tier_mod._FS_CHECK_S = 3600.0 if scenario == "filled" else fs_check_s
        tier = DiskTier(os.path.join(where, "tier"), block, engine=engine, **kw)
        arena = host_arena(job, block)
        arena[:, ::4096] = 7
        tier.set_arena(arena)
        njobs = int(factor * (size_mib << 20) / (tier.file_bytes * job)) + 1
        ok = failed = 0
        t0 = time.perf_counter()
        for j in range(njobs):
            tier.submit_store(TransferJob(j, [b"%d" % (j * job + i) for i in range(job)],
                                          list(range(job))))
            tier.drain()
            for r in tier.get_finished_jobs():
                failed += len(r.failed_keys)
                ok += job - len(r.failed_keys)
            if j == 0 and scenario == "filled":
                _fill(where)
                t0 = time.perf_counter()  # the burst starts on a full file system
        wall = time.perf_counter() - t0
        s = tier.stats()
        st = os.statvfs(where)
        out = {"fs": fs, "size_mib": size_mib, "block_bytes": block, "scenario": scenario,
               "engine": tier.engine_name, "stores": ok + failed, "ok": ok, "failed": failed,
               "blocks_present": tier.num_blocks, "used_bytes": tier.used_bytes,
               "evictions": s["evictions"], "store_retries": s.get("store_retries"),
               "min_free_bytes": getattr(tier, "min_free_bytes", None),
               "free_bytes_after": st.f_bavail * st.f_frsize,
               "wall_s": round(wall, 3)}
        tier.shutdown()
        out["warning_lines"] = len(counter.lines)
        return out
    finally:
        tier_mod._FS_CHECK_S = fs_check_s
        log.removeHandler(counter)
        subprocess.run(["umount", where], check=False)
        os.rmdir(where)
        if image:
            os.unlink(image)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fs", choices=["tmpfs", "ext4"], default="tmpfs")
    ap.add_argument("--size", type=int, default=64, help="file system size, MiB")
    ap.add_argument("--block", type=int, default=1 << 20, help="block payload bytes")
    ap.add_argument("--job", type=int, default=8, help="blocks per store job")
    ap.add_argument("--factor", type=float, default=2.0, help="burst bytes / file system size")
    ap.add_argument("--engine", choices=["uring", "posix", "both"], default="both")
    ap.add_argument("--scenario", choices=["reserve", "filled", "both"], default="both")
    ap.add_argument("--json", help="write the runs' figures here")
    a = ap.parse_args()
    runs = []
    for scenario in (["reserve", "filled"] if a.scenario == "both" else [a.scenario]):
        for engine in (["uring", "posix"] if a.engine == "both" else [a.engine]):
            r = run(a.fs, a.size, a.block, a.job, a.factor, scenario, engine)
            runs.append(r)
            print(f"{r['fs']} {r['size_mib']} MiB, {scenario:7s} {r['engine']:5s}: "
                  f"{r['stores']} stores, ok {r['ok']}, failed {r['failed']}; "
                  f"{r['blocks_present']} blocks present, used {r['used_bytes']} B; "
                  f"evictions {r['evictions']}, ENOSPC retries {r['store_retries']}; "
                  f"free after {r['free_bytes_after']} B (min_free {r['min_free_bytes']}); "
                  f"{r['warning_lines']} WARNING lines; burst {r['wall_s']} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
