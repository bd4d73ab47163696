"""Measurement helpers shared by ``pykvtier bench`` and the scripts in ``bench/``.

These carry the lessons of ``bench/engine_vs_fio.py`` (see ``bench/README.md``): the page cache
dropped before each run where allowed, with metadata and fio's binary warmed again; the same
kind of destination memory for both tools (4 KiB pages without THP, as fio's malloc'd buffers
get, or hugetlb pages for both); device counters from ``/sys/dev/block``; CPU from getrusage.
"""

from __future__ import annotations

import mmap
import os
import resource
import statistics
import subprocess


def quantile(xs, q: float) -> float:
    """The ``q`` quantile (0..1, linear interpolation, as numpy.quantile) of ``xs``; NaN for
    none."""
    import numpy as np

    return float(np.quantile(np.asarray(xs, dtype=np.float64), q)) if len(xs) else float("nan")


def plural(n: int, noun: str, plural_form: str | None = None) -> str:
    """``1 job``, ``3 jobs`` (``plural_form``: where the plural is not noun + "s")."""
    return f"{n} {noun if n == 1 else plural_form or noun + 's'}"

__all__ = [
    "GiB",
    "quantile",
    "plural",
    "MAP_HUGETLB",
    "fmt_size",
    "mount_of",
    "default_bench_dir",
    "read_first_line",
    "meminfo",
    "rusage_cpu",
    "median",
    "ColdCache",
    "HugePages",
    "DevStat",
    "alloc_host",
    "remove_files",
]

GiB = 1 << 30
MAP_HUGETLB = getattr(mmap, "MAP_HUGETLB", 0x40000)


def fmt_size(n: int) -> str:
    """2097152 -> '2MiB' (exact binary units only, else bytes)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= (1 << shift) and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return f"{n}B"


def mount_of(path: str) -> tuple[str, str, str]:
    """(mount point, fs type, source) of the mount holding path (longest prefix in /proc/mounts)."""
    path = os.path.realpath(path)
    best = ("/", "?", "?")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                src, mnt, fstype = parts[0], parts[1].replace("\\040", " "), parts[2]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                    best = (mnt, fstype, src)
    except OSError:
        pass
    return best


def default_bench_dir(name: str) -> str:
    """A directory under /var/tmp (disk-backed); /tmp only if /var/tmp is tmpfs and /tmp is not."""
    for base in ("/var/tmp", "/tmp"):
        if os.path.isdir(base) and mount_of(base)[1] not in ("tmpfs", "ramfs"):
            return os.path.join(base, name)
    raise SystemExit("both /var/tmp and /tmp are tmpfs/ramfs (no O_DIRECT, not cold): pass a "
                     "directory on a disk")


def disk_bench_dir(path: str | None, name: str) -> tuple[str, tuple[str, str, str]]:
    """The bench directory (``path``, or :func:`default_bench_dir` ``name``), created; with the
    mount holding it. SystemExit where it is on a tmpfs or ramfs (its reads never leave memory)."""
    path = path or default_bench_dir(name)
    mnt = mount_of(path if os.path.exists(path) else os.path.dirname(os.path.abspath(path)))
    if mnt[1] in ("tmpfs", "ramfs"):
        raise SystemExit(f"{path} is on {mnt[1]}: its reads never leave memory (never cold); "
                         "use a disk")
    os.makedirs(path, exist_ok=True)
    return path, mnt


def add_side_by_side_args(p, keep_help: str = "keep each tier's directory") -> None:
    """The options every side-by-side bench against an engine's own tier takes: ``--rounds``,
    ``--seed``, ``--no-drop-caches``, ``--no-freeze-gc``, ``--keep``, ``--json`` (``p``: an
    argparse parser)."""
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat everything this many times, the tiers taking turns going "
                        "first; medians reported (1)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-drop-caches", action="store_true")
    p.add_argument("--no-freeze-gc", action="store_true",
                   help="leave the GC heap unfrozen after start-up")
    p.add_argument("--keep", action="store_true", help=keep_help)
    p.add_argument("--json", default=None, help="write the results here too")


def read_first_line(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.readline().strip()
    except OSError:
        return None


def meminfo(key: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rusage_cpu(who: int) -> float:
    ru = resource.getrusage(who)
    return ru.ru_utime + ru.ru_stime


def freeze_gc() -> None:
    """As vLLM's engine core does after start-up (vllm.utils.gc_utils.freeze_gc_heap; without
    vLLM, gc.collect() then gc.freeze()): the start-up heap (vLLM's and torch's modules) leaves
    the GC's view. Without it, full collections over that heap take about half of both tiers'
    CPU in the side-by-side benches, as perf shows."""
    import gc
    try:
        from vllm.utils.gc_utils import freeze_gc_heap
    except ImportError:
        gc.collect()
        gc.freeze()
        return
    freeze_gc_heap()


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


class ColdCache:
    """Drop the page cache before each run if /proc/sys/vm/drop_caches is writable."""

    PATH = "/proc/sys/vm/drop_caches"

    def __init__(self, enabled: bool = True, warm_paths: list[str] | None = None,
                 warm_cmds: list[list[str]] | None = None):
        self.enabled = enabled
        self.warm_paths = warm_paths  # stat these after each drop: metadata warm, data cold
        # run these after each drop (e.g. `fio --version`: reloads fio's binary and libraries,
        # ~60 MiB on Debian, so the device counters around fio count only its data reads)
        self.warm_cmds = warm_cmds or []
        self.works = False
        self.reason = "disabled (--no-drop-caches)"
        if enabled:
            self.works, self.reason = self._drop()

    def _drop(self) -> tuple[bool, str]:
        try:
            os.sync()
            with open(self.PATH, "w") as f:
                f.write("3\n")
            return True, "ok"
        except OSError as e:
            return False, f"{self.PATH} not writable: {e.strerror or e}"

    def drop(self) -> None:
        if self.works:
            ok, reason = self._drop()
            if not ok:  # should not flip mid-run; record it if it does
                self.works, self.reason = False, reason
        for p in self.warm_paths or ():
            os.stat(p)
        if self.works:
            for cmd in self.warm_cmds:
                subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def describe(self) -> str:
        if self.works:
            s = ("O_DIRECT for every run (fio direct=1, engine direct=True) + page cache dropped "
                 "(sync; echo 3 > /proc/sys/vm/drop_caches) before every run")
        else:
            s = f"O_DIRECT for every run (fio direct=1, engine direct=True) only; page cache NOT dropped: {self.reason}"
        if self.warm_paths:
            s += "; then every file stat()ed (metadata warm, as after a phase-1 lookup; data cold)"
        elif self.works:
            s += "; metadata cold too (both tools' opens, inside their timed phase, read inodes from disk)"
        return s


class HugePages:
    """Makes sure enough 2 MiB hugetlb pages are free; if not, and vm.nr_hugepages is writable,
    raises it for the run and restores it at the end (:meth:`restore`)."""

    PATH = "/proc/sys/vm/nr_hugepages"

    def __init__(self):
        self.orig = None
        self.size = (meminfo("Hugepagesize") or 2048) * 1024

    def ensure(self, pages: int) -> str:
        free = meminfo("HugePages_Free") or 0
        if free >= pages:
            return f"{free} hugetlb pages free, {pages} needed"
        try:
            cur = int(read_first_line(self.PATH) or 0)
            new = cur + pages - free
            with open(self.PATH, "w") as f:
                f.write(str(new))
            self.orig = cur
        except OSError as e:
            raise RuntimeError(f"need {pages} free hugetlb pages, have {free}, and cannot raise "
                               f"{self.PATH}: {e}; use 4 KiB pages") from e
        got = meminfo("HugePages_Free") or 0
        if got < pages:
            self.restore()
            raise RuntimeError(f"asked the kernel for {pages} free hugetlb pages, got {got}; use 4 KiB pages")
        return f"raised vm.nr_hugepages {cur} -> {new} for this run (restored at exit)"

    def restore(self):
        if self.orig is not None:
            try:
                with open(self.PATH, "w") as f:
                    f.write(str(self.orig))
            except OSError:
                pass
            self.orig = None


class DevStat:
    """Counters of the block device under a directory, from /sys/dev/block/MAJ:MIN/stat (the
    same counters fio's disk_util reports). :meth:`snap` / :meth:`delta`: reads only (requests,
    merges, bytes); :meth:`snap_all` / :meth:`disk_util`: fio's disk_util fields."""

    def __init__(self, path: str):
        st = os.stat(path)
        sysdir = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
        self.path = sysdir + "/stat"
        self.name = os.path.basename(os.path.realpath(sysdir))
        self.ok = self.snap() is not None

    def snap_all(self):
        try:
            with open(self.path) as f:
                return [int(x) for x in f.read().split()]
        except (OSError, ValueError):
            return None

    def snap(self):
        v = self.snap_all()
        if not v or len(v) < 3:
            return None
        return v[0], v[1], v[2]  # read ios, read merges, read sectors

    @staticmethod
    def delta(a, b) -> dict:
        if a is None or b is None:
            return {}
        return {"dev_read_reqs": b[0] - a[0], "dev_read_merges": b[1] - a[1],
                "dev_read_bytes": (b[2] - a[2]) * 512}

    def disk_util(self, a, b, wall_s: float) -> dict | None:
        """fio's disk_util entry for the interval between two :meth:`snap_all` snapshots."""
        if not a or not b or len(a) < 11 or len(b) < 11:
            return None
        d = [y - x for x, y in zip(a, b)]
        io_ticks_ms = d[9]
        return {"name": self.name, "read_ios": d[0], "write_ios": d[4], "read_merges": d[1],
                "write_merges": d[5], "read_ticks": d[3], "write_ticks": d[7], "in_queue": d[10],
                "util": min(100.0, 100.0 * io_ticks_ms / (wall_s * 1e3)) if wall_s > 0 else 0.0}


def alloc_host(nbytes: int, mem: str = "4k", hugepage: int = 2 << 20):
    """Page-aligned, faulted-in memory: ``4k`` = 4 KiB pages (MADV_NOHUGEPAGE, like fio's
    malloc'd buffers) or ``huge`` = hugetlb pages (MAP_HUGETLB, like fio mem=mmaphuge).
    Returns (mmap, uint8 ndarray of nbytes)."""
    import numpy as np

    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if mem == "huge":
        total = -(-nbytes // hugepage) * hugepage
        m = mmap.mmap(-1, total, flags=flags | MAP_HUGETLB)
    else:
        total = -(-nbytes // 4096) * 4096
        m = mmap.mmap(-1, total, flags=flags)
        if hasattr(m, "madvise") and hasattr(mmap, "MADV_NOHUGEPAGE"):
            m.madvise(mmap.MADV_NOHUGEPAGE)
    arr = np.frombuffer(m, dtype=np.uint8)
    arr[:] = 0  # fault every page in now, outside any timed region
    return m, arr[:nbytes]


def remove_files(paths) -> None:
    """Unlinks each path; one that is gone or cannot be removed is skipped (bench clean-up)."""
    for p in paths:
        try:
            os.unlink(p)
        except OSError:
            pass
