#!/usr/bin/env python3
"""The main job side by side: ``pykvtier replay`` through pykvtier's DiskTier and through vLLM's
own fs tier (``FileSystemTierManager``, via pykvtier.replay_tiers.VllmFsTier: ``--tier
vllm-fs``), in one process, on the same requests with the same settings.

Each run is ``run_replay`` on a fresh root under ``--dir`` (removed after it, unless
``--keep``), the page cache dropped before it (``sync; echo 3 > /proc/sys/vm/drop_caches``,
where writable): both tiers start cold, and both read with O_DIRECT where the file system takes
it (pykvtier: its probe; vLLM's fs tier: its own probe_o_direct), so their loads never come from
the page cache; the metadata of the files a run wrote is warm for both. The tiers take turns
going first (``--rounds``: medians). As in vLLM's engine core, the GC heap is frozen once vLLM
is imported (``--no-freeze-gc``: not).

Figures per tier, from the replay's summary: block hit ratio, per-request load latency p50/p99
(submit of a request's one load job to its completion observed), load and store GB/s (payload
bytes / the union of the jobs' busy intervals, 10^9 B/s), CPU-s/GiB moved (the process's
user+sys over the replay per GiB loaded+stored, and without the replay's own fill+verify: the
tier's share), blocks declined, evictions, wall. Ratios are pykvtier / vllm-fs.

Capacity: vLLM's fs tier never evicts. With a capacity (the replay's default), pykvtier's
DiskTier evicts least recently used blocks, while the fs tier keeps the first blocks stored
and declines the rest once full (pykvtier.replay_tiers enforces the capacity so the replay
cannot fill the disk); ``--capacity unlimited`` compares them with the same hits (a slice
whose blocks fit the disk).

    python bench/replay_vs_vllm_fs.py                        # the replay's default slice
    python bench/replay_vs_vllm_fs.py --max-requests 10 --capacity unlimited
    python bench/replay_vs_vllm_fs.py --rounds 3 --json bench/out/replay_vs_vllm_fs.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
try:  # the installed pykvtier; else the source tree above (an editable or in-place build)
    import pykvtier  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(HERE))

from pykvtier import replay_tiers  # noqa: E402
from pykvtier.bench.sysutil import (  # noqa: E402
    ColdCache, add_side_by_side_args, disk_bench_dir, freeze_gc)
from pykvtier.replay import ReplayConfig, format_summary, run_replay  # noqa: E402
from pykvtier.toolkit import format_bytes, parse_size  # noqa: E402
from pykvtier.trace import load_trace  # noqa: E402

TIERS = ("pykvtier", "vllm-fs")
#: (summary field, label, format, "lower" / "higher" is better / None: no ratio)
FIGURES = (
    ("block_hit_ratio", "block hit ratio", "{:.2%}", None),
    ("blocks_hit", "blocks hit", "{}", None),
    ("load_latency_ms_p50", "load latency p50 (ms)", "{:.2f}", "lower"),
    ("load_latency_ms_p99", "load latency p99 (ms)", "{:.2f}", "lower"),
    ("load_gbps", "load GB/s", "{:.3f}", "higher"),
    ("store_gbps", "store GB/s", "{:.3f}", "higher"),
    ("cpu_s_per_gib", "CPU-s/GiB moved", "{:.3f}", "lower"),
    ("tier_cpu_s_per_gib", "CPU-s/GiB, tier alone", "{:.3f}", "lower"),
    ("bytes_loaded", "loaded", "bytes", None),
    ("bytes_stored", "stored", "bytes", None),
    ("store_rejected_keys", "blocks declined (capacity)", "{}", None),
    ("evictions", "evictions", "{}", None),
    ("wall_s", "wall (s)", "{:.2f}", "lower"),
)


def _config(args, root: str) -> ReplayConfig:
    """The replay's defaults but for what the options set (only fields ReplayConfig has)."""
    kw = dict(root=root, progress=False)
    if args.max_requests is not None:
        kw["max_requests"] = None if args.max_requests == "all" else int(args.max_requests)
    if args.model is not None:
        kw["model"] = args.model
    if args.tokens_per_block is not None:
        kw["tokens_per_block"] = args.tokens_per_block
    if args.capacity is not None:
        kw["capacity_bytes"] = (None if args.capacity.lower() in ("none", "unlimited", "inf")
                                else parse_size(args.capacity))
    have = {f.name for f in dataclasses.fields(ReplayConfig)}
    return ReplayConfig(**{k: v for k, v in kw.items() if k in have})


def _fmt(v, fmt: str) -> str:
    if v is None:
        return "n/a"
    return format_bytes(v) if fmt == "bytes" else fmt.format(v)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-requests", default=None, help="requests replayed (default: the replay's)")
    p.add_argument("--model", default=None, help="model preset (default: the replay's)")
    p.add_argument("--tokens-per-block", type=int, default=None)
    p.add_argument("--capacity", default=None, help="capacity of both tiers, or 'unlimited' "
                   "(default: the replay's)")
    p.add_argument("--dir", default=None, help="where the tiers' roots go (a disk; default "
                   "/var/tmp/pykvtier-replay-vs-vllm-fs)")
    add_side_by_side_args(p)
    args = p.parse_args(argv)

    reason = replay_tiers.vllm_unavailable_reason()
    if reason is not None:
        print(f"replay_vs_vllm_fs: {reason}", file=sys.stderr)
        return 2
    base, mnt = disk_bench_dir(args.dir, "pykvtier-replay-vs-vllm-fs")
    fs_factory = replay_tiers.make_vllm_fs_tier_factory()
    if not args.no_freeze_gc:
        freeze_gc()
    cold = ColdCache(enabled=not args.no_drop_caches)
    probe = _config(args, base)
    requests = load_trace(probe.trace, probe.max_requests)
    print(f"replay_vs_vllm_fs: {len(requests)} requests of the bundled trace, model {probe.model}, "
          f"{probe.tokens_per_block} tokens/block, capacity "
          f"{'unlimited' if probe.capacity_bytes is None else format_bytes(probe.capacity_bytes)}; "
          f"roots under {base} ({mnt[1]} on {mnt[0]}); page cache: "
          f"{'dropped before each run' if cold.works else cold.reason}; "
          f"GC {'unfrozen' if args.no_freeze_gc else 'frozen after start-up'}", flush=True)

    runs: dict[str, list] = {t: [] for t in TIERS}
    for rnd in range(args.rounds):
        for name in TIERS if rnd % 2 == 0 else TIERS[::-1]:
            root = os.path.join(base, name)
            shutil.rmtree(root, ignore_errors=True)
            cold.drop()
            try:
                s = run_replay(_config(args, root), requests,
                               tier_factory=fs_factory if name == "vllm-fs" else None)
            finally:
                if not args.keep:
                    shutil.rmtree(root, ignore_errors=True)
            runs[name].append(s)
            print(f"\n--- {name}, round {rnd + 1}\n{format_summary(s)}", flush=True)

    def med(name: str, field: str):
        vals = [getattr(s, field) for s in runs[name] if getattr(s, field) is not None]
        return statistics.median(vals) if vals else None

    rows = []
    print(f"\n{'':30} {'pykvtier':>14} {'vllm-fs':>14} {'pykvtier/vllm-fs':>17}")
    for field, label, fmt, better in FIGURES:
        a, b = med("pykvtier", field), med("vllm-fs", field)
        ratio = a / b if better and a is not None and b else None
        rows.append({"figure": field, "pykvtier": a, "vllm-fs": b, "ratio": ratio, "better": better})
        rtxt = "" if ratio is None else f"{ratio:.2f}x ({better} is better)"
        print(f"{label:30} {_fmt(a, fmt):>14} {_fmt(b, fmt):>14} {rtxt:>17}")
    ok = all(s.ok for ss in runs.values() for s in ss)
    print("\nevery loaded byte verified in every run" if ok else "\nFAILED: a run had errors")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"requests": len(requests), "dir": base, "cold": cold.works,
                       "figures": rows,
                       "runs": {t: [s.to_dict() for s in ss] for t, ss in runs.items()}},
                      f, indent=2, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
