"""Per-key cost of the tier's Python side, through vLLM's own classes, beside vLLM's fs tier.

For each tier (the PyKVTier adapter, its ``verify="header"`` variant, and vLLM 0.33's
``FileSystemTierManager``) in the same run: this thread's CPU time (``time.thread_time``) per
key in ``submit_store`` and ``submit_load`` calls of J-key jobs, in the
``get_finished_jobs`` calls that report them, and lookups of indexed keys per second through
``lookup(key, ctx)``. The I/O runs on the tiers' own threads and is not what is measured here
(``bench/vs_vllm_fs.py`` measures the bytes); blocks are small by default so the run is
short. Every loaded block is checked byte-exact; every lookup of a stored key must be HIT.

    python bench/per_key.py                         # 4096 keys, 64 KiB blocks, 32-key jobs
    python bench/per_key.py --keys 16384 --job-blocks 128 --block 2M --dir /mnt/nvme/x
    python bench/per_key.py --shards 2              # two roots: keys sharded by digest
    python bench/per_key.py --breakdown             # a step's first submit apart from the others

Targets (issue #10): submit_load and submit_store <= 1 us per key, lookups >= 1 M indexed
keys/s from Python. Printed beside the figures, never asserted (these machines are noisy).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
import uuid

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
try:
    import pykvtier  # noqa: F401  (the installed one; else the source tree above)
except ImportError:
    sys.path.insert(0, os.path.dirname(HERE))

from pykvtier.bench.sysutil import default_bench_dir, freeze_gc, plural  # noqa: E402
from pykvtier.toolkit import parse_size  # noqa: E402
from vs_vllm_fs import make_spec  # noqa: E402


def finish(mgr, ids: set, wait) -> float:
    """Collects the jobs ``ids`` (each must succeed); this thread's CPU time in the
    get_finished_jobs calls that reported them."""
    spent = 0.0
    while ids:
        c0 = time.thread_time()
        got = list(mgr.get_finished_jobs())
        spent += time.thread_time() - c0
        for r in got:
            if not r.success:
                raise SystemExit(f"job {r.job_id} failed")
            ids.discard(r.job_id)
        if ids and not got:
            wait()
    return spent


def run(args) -> None:
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
    from vllm.v1.kv_offload.tiering.base import TransferJob
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    block, J, n = args.block, args.job_blocks, args.keys
    root = os.path.join(args.dir, f"per-key-{uuid.uuid4().hex[:8]}")
    def roots(name: str):
        dirs = [os.path.join(root, f"{name}-{i}") for i in range(args.shards)]
        return dirs if args.shards > 1 else dirs[0]

    ours = {"type": "PyKVTier", "module_path": "pykvtier.integrations.vllm"}
    cfgs = {"pykvtier": dict(ours, root_dir=roots("pykvtier")),
            "pykvtier-hdr": dict(ours, root_dir=roots("pykvtier-hdr"), verify="header"),
            "vllm-fs": {"type": "fs", "root_dir": os.path.join(root, "fs")}}
    rows = n
    spec = make_spec(block, list(cfgs.values()))
    region = SharedOffloadRegion(engine_id=f"per-key-{uuid.uuid4().hex[:8]}", num_chunks=rows,
                                 rank=None, kv_bytes_per_chunk=block, cpu_page_size=block)
    view = region.create_kv_memoryview()
    prim = np.asarray(view).view(np.uint8)
    rng = np.random.default_rng(args.seed)
    src = rng.integers(0, 256, (rows, block), dtype=np.uint8)
    ctx = ReqContext("bench")
    keys = [make_offload_key(rng.bytes(32), 0) for _ in range(n)]
    mgrs = {name: SecondaryTierFactory.create_secondary_tier(dict(c), view, spec)
            for name, c in cfgs.items()}
    freeze_gc()
    out = {}
    next_id = 0
    try:
        for name, mgr in mgrs.items():
            if name == "vllm-fs":
                pool = mgr._pool  # vLLM's DualQueueThreadPool: notify_all at each job end
                def wait(pool=pool):
                    with pool._condition:
                        pool._condition.wait_for(lambda: pool._finished_q or pool._inflight_jobs == 0,
                                                 timeout=1.0)
            else:
                def wait(mgr=mgr):
                    mgr.wait(1.0)
            fig = {}
            for is_load in (False, True):
                if is_load:
                    prim[:] = 0
                else:
                    prim[:] = src
                submit = mgr.submit_load if is_load else mgr.submit_store
                jobs = []
                for s in range(0, n, J):
                    jobs.append(TransferJob(job_id=next_id, keys=keys[s:s + J],
                                            chunk_ids=np.arange(s, min(s + J, n), dtype=np.int32),
                                            is_promotion=is_load, req_context=ctx))
                    next_id += 1
                spent, settle = 0.0, 0.0
                first, rest = [], []  # us per key of each submit call: a step's first, the others
                for s in range(0, len(jobs), args.inflight):
                    step = jobs[s:s + args.inflight]
                    for k, j in enumerate(step):
                        c0 = time.thread_time()
                        submit(j)
                        c1 = time.thread_time()
                        spent += c1 - c0
                        (rest if k else first).append((c1 - c0) / len(j.keys) * 1e6)
                    settle += finish(mgr, {j.job_id for j in step}, wait)
                phase = "load" if is_load else "store"
                fig[f"submit_{phase}"] = spent / n * 1e6
                fig[f"settle_{phase}"] = settle / n * 1e6
                fig[f"first_{phase}"] = statistics.median(first)
                fig[f"rest_{phase}"] = statistics.median(rest) if rest else float("nan")
            if not np.array_equal(prim, src):
                bad = int((prim != src).any(axis=1).sum())
                raise SystemExit(f"{name}: {bad} blocks loaded with wrong bytes")
            best = float("nan")  # vLLM fs's lookup is asynchronous (RETRY until its check ran)
            for _ in range(args.passes if name != "vllm-fs" else 0):
                t0 = time.perf_counter()
                answers = [mgr.lookup(k, ctx) for k in keys]
                best = max(best if best == best else 0.0, n / (time.perf_counter() - t0))
                if any(a != LookupResult.HIT for a in answers):
                    raise SystemExit(f"{name}: a stored key did not look up HIT")
            fig["lookups_per_s"] = best
            out[name] = fig
    finally:
        for mgr in mgrs.values():
            mgr.shutdown()
        view.release()
        region.cleanup()
        shutil.rmtree(root, ignore_errors=True)

    print(f"{plural(n, 'key')} of {block} B in {J}-key jobs, {plural(args.inflight, 'job')} per step, "
          f"{plural(args.shards, 'root')}; us of this thread's CPU per key")
    print(f"{'tier':14s} {'submit_store':>12s} {'submit_load':>12s} {'settle_store':>12s} "
          f"{'settle_load':>12s} {'lookups M/s':>12s}")
    for name, f in out.items():
        print(f"{name:14s} {f['submit_store']:12.2f} {f['submit_load']:12.2f} "
              f"{f['settle_store']:12.2f} {f['settle_load']:12.2f} {f['lookups_per_s'] / 1e6:12.2f}")
    if args.breakdown:
        print("median us per key of one submit call: the first job of a step (after the tier sat "
              "idle while the step's I/O ran) / the step's other jobs")
        print(f"{'tier':14s} {'store first':>12s} {'store rest':>12s} {'load first':>12s} {'load rest':>12s}")
        for name, f in out.items():
            print(f"{name:14s} {f['first_store']:12.2f} {f['rest_store']:12.2f} {f['first_load']:12.2f} "
                  f"{f['rest_load']:12.2f}")
    a, b = out["pykvtier"], out["vllm-fs"]
    print(f"ratios pykvtier / vllm-fs: submit_store {a['submit_store'] / b['submit_store']:.2f}x, "
          f"submit_load {a['submit_load'] / b['submit_load']:.2f}x (vLLM fs's lookup answers RETRY "
          "until its asynchronous existence check ran: no lookup rate)")
    for name in ("pykvtier", "pykvtier-hdr"):
        f = out[name]
        worst = max(f["submit_store"], f["submit_load"])
        print(f"{name}: submit <= 1 us/key: {'MET' if worst <= 1.0 else 'MISSED'} ({worst:.2f}); "
              f"lookups >= 1 M/s: {'MET' if f['lookups_per_s'] >= 1e6 else 'MISSED'} "
              f"({f['lookups_per_s'] / 1e6:.2f} M/s)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=None, help="bench directory (default: the bench default dir)")
    p.add_argument("--keys", type=int, default=4096)
    p.add_argument("--block", default="64K", help="block bytes (default 64K)")
    p.add_argument("--job-blocks", type=int, default=32, help="keys per job (default 32)")
    p.add_argument("--inflight", type=int, default=8, help="jobs submitted per step (default 8)")
    p.add_argument("--shards", type=int, default=1, help="roots of the PyKVTier adapter")
    p.add_argument("--passes", type=int, default=3, help="lookup passes (the best is printed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--breakdown", action="store_true",
                   help="also print the median cost of a step's first submit and of the others")
    args = p.parse_args()
    args.block = parse_size(args.block)
    args.dir = args.dir or default_bench_dir("pykvtier-per-key")
    os.makedirs(args.dir, exist_ok=True)
    run(args)


if __name__ == "__main__":
    main()
