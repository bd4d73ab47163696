"""Where a step's first submit_store goes: this thread's CPU time (time.thread_time_ns) in each
stage of DiskTier.submit_store (the C++ checks, the Python around them, the index's admission, the
free-space estimate, the engine's submit) at the first job of a step (the tier sat idle while the
step's I/O ran) and at the step's other jobs, DiskTier alone, side by side in one run; and what an
eventfd write costs the writer when a thread sleeps on it (the engine's wake-up) and when none does.

    python bench/first_job.py [--dir DIR] [--block 64K] [--steps 16] [--job-blocks 32]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from collections import defaultdict

import numpy as np

import pykvtier.tier as tier_module
from pykvtier import DiskTier, TransferJob, host_arena
from pykvtier.toolkit import parse_size


class _Timed:
    """obj.name replaced by a wrapper adding its thread CPU time to acc[label]."""

    def __init__(self, acc: dict, obj, name: str, label: str) -> None:
        f = getattr(obj, name)

        def timed(*a, **k):
            t = time.thread_time_ns()
            try:
                return f(*a, **k)
            finally:
                acc[label] = acc.get(label, 0) + time.thread_time_ns() - t

        setattr(obj, name, timed)


class _NativeView:
    """pykvtier.tier's _native module with check_job timed (the rest as it is)."""

    def __init__(self, native, acc: dict) -> None:
        self._native = native
        _Timed(acc, self, "check_job", "C++ checks")

    def __getattr__(self, name):
        return getattr(self._native, name)



def stages(root: str, block: int, steps: int, per_job: int, jobs: int = 8) -> dict:
    tier = DiskTier(root, block)
    tier.set_arena(host_arena(per_job * jobs, block))
    cur: dict = {}
    _Timed(cur, tier, "_check_job", "checks (all)")
    _Timed(cur, tier, "_fs_room", "free-space estimate")
    _Timed(cur, tier, "_submit", "engine submit")
    index = tier._bindex

    class Index:  # the index's admission timed (a C++ object's methods cannot be replaced)
        def __getattr__(self, name):
            return getattr(index, name)

    tier._bindex = Index()
    _Timed(cur, tier._bindex, "admit_stores", "admission")
    native = tier_module._native
    tier_module._native = _NativeView(native, cur)
    out: dict = defaultdict(list)
    try:
        jid = 0
        for step in range(steps):
            for j in range(jobs):
                jid += 1
                keys = [b"first-job-%d-%d-%d" % (step, j, i) for i in range(per_job)]
                cur.clear()
                t = time.thread_time_ns()
                tier.submit_store(TransferJob(jid, keys, range(per_job * j, per_job * (j + 1))))
                cur["total"] = time.thread_time_ns() - t
                if step >= 2:  # (the first steps warm the process up)
                    for k, v in cur.items():
                        out[("first" if j == 0 else "rest", k)].append(v / 1e3)
            tier.drain()
            tier.get_finished_jobs()
    finally:
        tier_module._native = native
        tier.shutdown()
    return {k: float(np.median(v)) for k, v in out.items()}


def eventfd_write_cost(n: int = 300) -> tuple[float, float]:
    """Median us of this thread's CPU per eventfd write: with a thread asleep on it, and with none."""
    fd, back = os.eventfd(0), os.eventfd(0)
    one = (1).to_bytes(8, "little")

    def sleeper():
        while os.read(fd, 8):
            os.write(back, one)

    threading.Thread(target=sleeper, daemon=True).start()
    woken, alone = [], []
    for _ in range(n):
        time.sleep(0.002)  # (the sleeper is asleep again; this is no synchronization)
        t = time.thread_time_ns()
        os.write(fd, one)
        woken.append((time.thread_time_ns() - t) / 1e3)
        os.read(back, 8)
    for _ in range(n):
        t = time.thread_time_ns()
        os.write(back, one)
        alone.append((time.thread_time_ns() - t) / 1e3)
        os.read(back, 8)
    return float(np.median(woken)), float(np.median(alone))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="directory for the tier's root (default: a new one under /var/tmp)")
    ap.add_argument("--block", default="64K", help="block bytes (default 64K)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--job-blocks", type=int, default=32, help="keys per job (default 32; 8 jobs per step)")
    a = ap.parse_args()
    base = a.dir or tempfile.mkdtemp(prefix="pykvtier-first-job-", dir="/var/tmp")
    root = os.path.join(base, "root")
    try:
        r = stages(root, parse_size(a.block), a.steps, a.job_blocks)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if a.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    labels = ["C++ checks", "checks (all)", "admission", "free-space estimate", "engine submit", "total"]
    print(f"submit_store of {a.job_blocks}-key jobs, 8 a step; median us of this thread's CPU per job")
    print(f"{'stage':22s} {'first job':>10s} {'other jobs':>11s} {'ratio':>6s}")
    for k in labels:
        f, o = r.get(("first", k), 0.0), r.get(("rest", k), 0.0)
        print(f"{k:22s} {f:10.1f} {o:11.1f} {f / o if o else float('nan'):5.1f}x")
    woken, alone = eventfd_write_cost()
    print(f"eventfd write: {woken:.1f} us with a thread asleep on it, {alone:.1f} us with none")


if __name__ == "__main__":
    main()
