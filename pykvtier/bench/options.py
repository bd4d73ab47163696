"""fio's job options for ``pykvtier bench``: job files, command lines, values.

A job is described exactly as fio describes it, so a fio job file runs unchanged (for the
options listed in :data:`OPTIONS`):

* **job files** (INI): a ``[global]`` section sets defaults for the job sections that follow
  it (a later ``[global]`` changes the defaults of later jobs only); every other section is a
  job named after it. Options without a value (``time_based``, ``group_reporting``) mean
  ``=1``; a key given twice keeps the last value; lines starting with ``;`` or ``#`` are
  comments; ``include FILE`` includes another job file; ``${VAR}`` is replaced by the
  environment variable.
* **command lines**: ``--name=NAME`` starts a new job; options before the first ``--name`` are
  global. ``--opt=value`` or a bare ``--opt`` (= 1). Options given on the command line before any
  job file apply to the jobs of the file as defaults (the file's own values win), as in fio.

Values follow fio's parser (``parse.c``), quirks included:

* sizes: ``4k`` = ``4K`` = ``4kb`` = ``4KB`` = ``4ki`` = 4096 with the default ``kb_base=1024``,
  while ``4KiB`` / ``4kib`` mean 4000 there (fio keeps the old, "opposite" meaning of the
  IEC suffixes unless ``kb_base=1000``, which swaps the two). ``b``/``B`` alone = bytes, ``0x``
  = hex. Fractions are refused, as by fio. Unlike fio, an unknown suffix (``4q``) is an error
  rather than silently ignored.
* times (``runtime``, ``ramp_time``): a bare number is seconds; suffixes ``us``/``usec``,
  ``ms``/``msec``, ``s``/``sec``, ``m``/``min``, ``h``/``hour``, ``d``/``day``.

An option that is neither fio's (in the subset listed) nor pykvtier's is an error naming it;
so is a known fio option that pykvtier cannot honour (``rw=trim``, ``ioengine=libaio``, ...).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

__all__ = [
    "BenchOptionError",
    "Option",
    "OPTIONS",
    "ALIASES",
    "JobSpec",
    "RawJob",
    "parse_size",
    "parse_time_us",
    "parse_bool",
    "parse_jobfile_text",
    "parse_jobfile",
    "parse_cmdline_jobs",
    "resolve_jobs",
    "IOENGINE_ALIASES",
    "IOENGINES",
    "RW_IO",
    "RW_KV",
    "VERIFY_METHODS",
]


class BenchOptionError(ValueError):
    """A job option is unknown, malformed or out of range (the message names it)."""


# --------------------------------------------------------------------------- values

_SIZE_RE = re.compile(r"^\s*(0[xX][0-9a-fA-F]+|[0-9]+)\s*([A-Za-z%]*)\s*$")


def parse_size(text: str | int, kb_base: int = 1024, what: str = "size") -> int:
    """A byte count with fio's suffix rules (see the module docstring).

    ``k``, ``kb``, ``ki`` (any case) multiply by ``kb_base``; ``kib`` by the other base
    (1000 when kb_base is 1024, 1024 when it is 1000); likewise m, g, t, p.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise BenchOptionError(f"{what}: must be >= 0, got {text}")
        return text
    s = str(text)
    m = _SIZE_RE.match(s)
    if not m:
        if re.match(r"^\s*[0-9]*\.[0-9]", s):
            raise BenchOptionError(f"{what}={s}: fractions are not allowed (fio refuses them too); "
                                   "use a smaller unit, e.g. 1536k for 1.5m")
        raise BenchOptionError(f"{what}={s}: not a size (examples: 4096, 4k, 256KiB, 2m, 1g)")
    num = int(m.group(1), 0)
    suffix = m.group(2).lower()
    if suffix == "%":
        raise BenchOptionError(f"{what}={s}: percentages of a file or device are not supported")
    if kb_base not in (1000, 1024):
        raise BenchOptionError(f"kb_base={kb_base}: must be 1000 or 1024")
    other = 1000 if kb_base == 1024 else 1024
    if suffix in ("", "b"):
        return num
    powers = {"k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
    if len(suffix) == 3 and suffix[0] in powers and suffix[1:] == "ib":
        return num * other ** powers[suffix[0]]
    if suffix[0] in powers and suffix[1:] in ("", "b", "i"):
        return num * kb_base ** powers[suffix[0]]
    raise BenchOptionError(f"{what}={s}: unknown unit {m.group(2)!r} (use k, m, g, t, p, with an "
                           "optional b, or KiB/MiB/GiB...; kb_base decides which are 1024)")


_TIME_UNITS_US = {
    "us": 1, "usec": 1, "ms": 1000, "msec": 1000, "s": 10**6, "sec": 10**6,
    "m": 60 * 10**6, "min": 60 * 10**6, "h": 3600 * 10**6, "hour": 3600 * 10**6,
    "d": 86400 * 10**6, "day": 86400 * 10**6,
}
_TIME_RE = re.compile(r"^\s*([0-9]+)\s*([A-Za-z]*)\s*$")


def parse_time_us(text: str | int, what: str = "time") -> int:
    """A duration in microseconds; a bare number is seconds (fio's rule for runtime and ramp_time)."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text * 10**6
    m = _TIME_RE.match(str(text))
    if not m or m.group(2).lower() not in _TIME_UNITS_US and m.group(2) != "":
        raise BenchOptionError(f"{what}={text}: not a duration (examples: 30, 30s, 500ms, 2m, 1h)")
    unit = m.group(2).lower()
    return int(m.group(1)) * (_TIME_UNITS_US[unit] if unit else 10**6)


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_bool(text: str, what: str = "option") -> bool:
    v = str(text).strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise BenchOptionError(f"{what}={text}: expected 0 or 1")


# --------------------------------------------------------------------------- the options

IOENGINES = ("pykvtier-uring", "pykvtier-posix", "pykvtier-gds")
#: fio engine names accepted in a job file, so the same file runs under fio and pykvtier.
IOENGINE_ALIASES = {
    "io_uring": "pykvtier-uring",
    "psync": "pykvtier-posix",
    "pvsync": "pykvtier-posix",
    "pvsync2": "pykvtier-posix",
    "sync": "pykvtier-posix",
    "libcufile": "pykvtier-gds",
}
RW_IO = ("read", "write", "randread", "randwrite", "rw", "readwrite", "randrw")
RW_KV = ("promote", "lookup")
_RW_FIO_UNSUPPORTED = ("trim", "randtrim", "trimwrite", "randtrimwrite")
VERIFY_METHODS = ("md5", "crc64", "crc32c", "crc32c-intel", "crc32", "crc16", "crc7", "xxhash",
                  "sha512", "sha256", "sha1", "sha3-224", "sha3-256", "sha3-384", "sha3-512",
                  "meta", "pattern")


@dataclass(frozen=True)
class Option:
    name: str
    kind: str  # str, int, size, bsize, time, bool, choice, float, list
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    minimum: int | None = None
    maximum: int | None = None
    ours: bool = False  # pykvtier's own option (fio does not know it)
    ignored: bool = False  # accepted for compatibility, changes nothing here (help says why)


def _o(*a, **k) -> Option:
    return Option(*a, **k)


OPTIONS: dict[str, Option] = {o.name: o for o in (
    _o("name", "str", None, "job name (the section name in a job file)"),
    _o("description", "str", None, "free text, printed nowhere"),
    _o("rw", "choice", "read", "I/O pattern: read, write, randread, randwrite, rw/readwrite, randrw "
       "(fio's), or pykvtier's KV workloads promote and lookup",
       choices=RW_IO + RW_KV),
    _o("rwmixread", "int", 50, "randrw/rw: percentage of I/Os that are reads", minimum=0, maximum=100),
    _o("rwmixwrite", "int", None, "randrw/rw: percentage of writes (sets rwmixread=100-x)", minimum=0,
       maximum=100),
    _o("bs", "bsize", 4096, "block size of each I/O (bs=R,W for reads and writes); for promote/lookup "
       "the KV block size (or give model= and tokens_per_block=)"),
    _o("size", "size", None, "bytes of I/O for each job over its files (split evenly: each of the "
       "nrfiles files gets size/nrfiles); promote/lookup: bytes of the block population"),
    _o("filesize", "size", None, "bytes of each file (instead of size: size = filesize x nrfiles)"),
    _o("nrfiles", "int", 1, "number of files per job; promote/lookup: number of KV blocks",
       minimum=1),
    _o("filename", "str", None, "file name(s), ':'-separated (overrides nrfiles/filename_format)"),
    _o("filename_format", "str", "$jobname.$jobnum.$filenum",
       "file names: $jobname, $jobnum, $filenum are replaced"),
    _o("directory", "str", None, "directory of the files (default: the current directory)"),
    _o("iodepth", "int", 1, "I/Os in flight per job (the engine's queue depth); promote: blocks in "
       "flight, new requests are submitted while fewer are outstanding", minimum=1, maximum=4096),
    _o("numjobs", "int", 1, "clones of this job, run at the same time (threads, each with its own "
       "ring/engine and, with $jobnum in the file names, its own files)", minimum=1, maximum=256),
    _o("direct", "bool", False, "O_DIRECT (non-buffered) I/O"),
    _o("buffered", "bool", None, "opposite of direct"),
    _o("runtime", "time", None, "stop after this long (seconds unless a unit is given)"),
    _o("time_based", "bool", False, "run for runtime even when the files have been covered "
       "(the workload repeats)"),
    _o("ramp_time", "time", 0, "run this long before measuring"),
    _o("loops", "int", 1, "repeat the job this many times", minimum=1),
    _o("number_ios", "int", None, "stop after this many I/Os (per job)", minimum=1),
    _o("verify", "choice", "0", "check data: reads compare every block with the pattern the files "
       "were laid out with; writes read back what they wrote after the write phase; any fio "
       "method name means 'compare every byte'", choices=("0", "null") + VERIFY_METHODS),
    _o("do_verify", "bool", True, "write jobs with verify: run the read-back phase"),
    _o("invalidate", "bool", True, "drop the files' pages from the page cache before the job "
       "(posix_fadvise DONTNEED)"),
    _o("ioengine", "str", "pykvtier-uring", "pykvtier-uring (C++ io_uring engine), pykvtier-posix "
       "(preadv/pwritev threads), pykvtier-gds (GPUDirect Storage through kvikio); fio's io_uring, "
       "psync/pvsync/pvsync2/sync and libcufile are accepted as these"),
    _o("fixedbufs", "bool", None, "register the I/O buffers with io_uring (fio's io_uring option; "
       "pykvtier's default is 1, as DiskTier registers its arena; fio's is 0)"),
    _o("mem", "choice", "malloc", "I/O buffer memory: malloc/mmap (4 KiB pages, no THP) or "
       "mmaphuge (2 MiB hugetlb pages)", choices=("malloc", "mmap", "mmaphuge")),
    _o("iomem", "choice", None, "alias of mem", choices=("malloc", "mmap", "mmaphuge")),
    _o("randseed", "int", 0x89, "seed of the random offsets", minimum=0),
    _o("randrepeat", "bool", True, "same random sequence every run (0: seeded from the clock)"),
    _o("norandommap", "bool", False, "random offsets with replacement (default: each block once "
       "per pass)"),
    _o("file_service_type", "choice", "roundrobin", "how jobs pick the next file: roundrobin "
       "(switch after every I/O), sequential (finish a file first), random",
       choices=("roundrobin", "sequential", "random")),
    _o("openfiles", "int", None, "accepted; pykvtier opens each file inside the ring for every I/O, "
       "so this changes nothing", minimum=1, ignored=True),
    _o("allow_file_create", "bool", True, "create (lay out) missing files; 0: missing files are an "
       "error"),
    _o("group_reporting", "bool", False, "report each job's clones as one"),
    _o("stonewall", "bool", False, "wait for the previous jobs to finish before starting; starts a "
       "new reporting group"),
    _o("wait_for_previous", "bool", False, "alias of stonewall"),
    _o("new_group", "bool", False, "start a new reporting group"),
    _o("percentile_list", "list", None, "latency percentiles to report, ':'-separated"),
    _o("clat_percentiles", "bool", True, "report completion latency percentiles"),
    _o("lat_percentiles", "bool", False, "accepted (pykvtier's clat is fio's lat: see the docs)",
       ignored=True),
    _o("thread", "bool", False, "accepted; pykvtier runs every job as a thread", ignored=True),
    _o("cuda_io", "str", None, "accepted (fio's libcufile engine option); pykvtier-gds moves data "
       "by its own rules", ignored=True),
    _o("gpu_dev_ids", "str", None, "accepted (fio's libcufile engine option)", ignored=True),
    _o("kb_base", "int", 1024, "1024 (fio's default: 4k = 4096, 4KiB = 4000) or 1000 (4k = 4000, "
       "4KiB = 4096)"),
    # ---- pykvtier's own
    _o("batch", "int", 32, "promote: blocks per request (one load job each)", minimum=1, ours=True),
    _o("trace", "str", None, "promote: draw the requests from a Mooncake trace (a path, or "
       "'mooncake' for the bundled conversation trace); each request loads its whole prefix",
       ours=True),
    _o("trace_requests", "int", 16, "promote with trace: how many requests to take from the trace",
       minimum=1, ours=True),
    _o("model", "str", None, "KV block size from a model preset (with tokens_per_block): "
       "llama-3-8b, qwen2.5-7b, llama-3-70b, tiny", ours=True),
    _o("tokens_per_block", "int", 16, "with model=: tokens per KV block (divides 512)", minimum=1,
       ours=True),
    _o("lookup", "choice", "indexed", "lookup: 'indexed' (answers from the tier's in-memory index) "
       "or 'probed' (a shared tier that has not seen the keys: batched statx probes)",
       choices=("indexed", "probed"), ours=True),
    _o("lookup_hit", "int", 50, "lookup: percentage of looked-up keys that are stored", minimum=0,
       maximum=100, ours=True),
)}

#: fio's alternative spellings.
ALIASES = {"readwrite": "rw", "blocksize": "bs"}

#: fio options we recognise but cannot honour: error with this reason.
_FIO_UNSUPPORTED = {
    "bssplit": "mixed block sizes are not supported: use one bs per job",
    "bsrange": "block size ranges are not supported: use one bs per job",
    "blocksize_range": "block size ranges are not supported: use one bs per job",
    "offset": "start offsets are not supported",
    "offset_increment": "start offsets are not supported",
    "fsync": "fsync after writes is not supported",
    "fdatasync": "fdatasync after writes is not supported",
    "end_fsync": "end_fsync is not supported",
    "rate": "rate limiting is not supported",
    "rate_iops": "rate limiting is not supported",
    "sqthread_poll": "SQPOLL is not used by pykvtier's engine",
    "hipri": "polled I/O is not used by pykvtier's engine",
    "registerfiles": "pykvtier opens files into fixed-file slots inside the ring by itself",
    "zonemode": "zoned devices are not supported",
    "cpus_allowed": "CPU pinning is not supported",
    "cpumask": "CPU pinning is not supported",
    "rate_process": "rate limiting is not supported",
    "startdelay": "start delays are not supported",
    "iodepth_batch_submit": "the engine decides its own submit batching",
    "iodepth_batch_complete_min": "the engine decides its own completion batching",
}


def _convert(opt: Option, value: str, kb_base: int) -> Any:
    what = opt.name
    if opt.kind == "str":
        return value
    if opt.kind == "bool":
        return parse_bool(value, what)
    if opt.kind == "int":
        try:
            v = int(str(value).strip(), 0)
        except ValueError:
            raise BenchOptionError(f"{what}={value}: expected an integer") from None
        if opt.minimum is not None and v < opt.minimum:
            raise BenchOptionError(f"{what}={value}: must be >= {opt.minimum}")
        if opt.maximum is not None and v > opt.maximum:
            raise BenchOptionError(f"{what}={value}: must be <= {opt.maximum}")
        return v
    if opt.kind == "size":
        return parse_size(value, kb_base, what)
    if opt.kind == "bsize":
        parts = [p for p in str(value).split(",")]
        if len(parts) > 3 or any(not p.strip() for p in parts[:1]):
            raise BenchOptionError(f"{what}={value}: expected bs=SIZE or bs=READ,WRITE")
        sizes = [parse_size(p, kb_base, what) if p.strip() else None for p in parts]
        r = sizes[0]
        w = sizes[1] if len(sizes) > 1 and sizes[1] is not None else r
        if r <= 0 or w <= 0:
            raise BenchOptionError(f"{what}={value}: must be > 0")
        return (r, w)
    if opt.kind == "time":
        return parse_time_us(value, what)
    if opt.kind == "choice":
        v = str(value).strip()
        if what == "rw":
            v = v.lower()
            if v in _RW_FIO_UNSUPPORTED:
                raise BenchOptionError(f"rw={v}: trim workloads are not supported (pykvtier moves "
                                       "KV blocks: read, write, randread, randwrite, rw, randrw, "
                                       "promote, lookup)")
            if ":" in v:
                raise BenchOptionError(f"rw={v}: fio's ':N' offset modifier is not supported")
        if v not in opt.choices:
            raise BenchOptionError(f"{what}={value}: expected one of {', '.join(opt.choices)}")
        return v
    if opt.kind == "list":
        try:
            out = [float(x) for x in str(value).split(":") if x.strip()]
        except ValueError:
            raise BenchOptionError(f"{what}={value}: expected numbers separated by ':'") from None
        if not out or any(not 0 < x <= 100 for x in out):
            raise BenchOptionError(f"{what}={value}: percentiles must be in (0, 100]")
        return sorted(out)
    raise AssertionError(opt.kind)


def canonical_name(key: str, where: str = "") -> str:
    """The option's name in :data:`OPTIONS`, or BenchOptionError naming it."""
    k = key.strip().lower()
    k = ALIASES.get(k, k)
    if k in OPTIONS:
        return k
    loc = f" ({where})" if where else ""
    if k in _FIO_UNSUPPORTED:
        raise BenchOptionError(f"option '{key}'{loc}: {_FIO_UNSUPPORTED[k]}")
    raise BenchOptionError(f"unknown option '{key}'{loc}; `pykvtier bench --help` lists the options")


# --------------------------------------------------------------------------- raw jobs

@dataclass
class RawJob:
    """A job as written: ordered (option, text value) pairs, global defaults first."""

    name: str
    options: list[tuple[str, str, str]] = field(default_factory=list)  # (name, value, where)


_ENV_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _expand_env(value: str, where: str) -> str:
    def sub(m: re.Match) -> str:
        if m.group(1) not in os.environ:
            raise BenchOptionError(f"{where}: environment variable ${{{m.group(1)}}} is not set")
        return os.environ[m.group(1)]

    return _ENV_RE.sub(sub, value)


def _split_kv(text: str) -> tuple[str, str]:
    if "=" in text:
        k, v = text.split("=", 1)
        return k.strip(), v.strip()
    return text.strip(), "1"


def _expand_lines(text: str, source: str, depth: int = 0) -> list[tuple[str, str]]:
    """(where, stripped line) pairs, with ``include FILE`` lines replaced by the file's lines
    (fio pastes included files in place)."""
    if depth > 8:
        raise BenchOptionError(f"{source}: include nesting is too deep")
    out: list[tuple[str, str]] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        where = f"{source}:{lineno}"
        if not line or line[0] in ";#":
            continue
        if line.split(None, 1)[0] == "include" and "=" not in line:
            parts = line.split(None, 1)
            if len(parts) < 2:
                raise BenchOptionError(f"{where}: include needs a file name")
            path = _expand_env(parts[1].strip(), where)
            if not os.path.isabs(path) and os.path.dirname(source):
                path = os.path.join(os.path.dirname(source), path)
            try:
                with open(path) as f:
                    sub = f.read()
            except OSError as e:
                raise BenchOptionError(f"{where}: cannot include {path}: {e.strerror or e}") from None
            out.extend(_expand_lines(sub, path, depth + 1))
            continue
        out.append((where, line))
    return out


def parse_jobfile_text(text: str, source: str = "<jobfile>",
                       defaults: Sequence[tuple[str, str, str]] = ()) -> list[RawJob]:
    """Parse fio job-file text into jobs, each carrying the globals in force at its section."""
    jobs: list[RawJob] = []
    glob: list[tuple[str, str, str]] = list(defaults)
    current: RawJob | None = None
    in_global = False
    for where, line in _expand_lines(text, source):
        if line.startswith("["):
            if not line.endswith("]") or len(line) < 3:
                raise BenchOptionError(f"{where}: malformed section header {line!r}")
            name = line[1:-1].strip()
            if name == "global":
                in_global, current = True, None
            else:
                in_global = False
                current = RawJob(name, list(glob))
                jobs.append(current)
            continue
        k, v = _split_kv(line)
        v = _expand_env(v, where)
        if canonical_name(k, where) == "name" and current is not None:
            current.name = v  # fio: name= inside a section renames the job
            continue
        if current is None:
            if not in_global:
                raise BenchOptionError(f"{where}: option '{k}' outside any section "
                                       "(put it under [global] or a [job])")
            glob.append((k, v, where))
        else:
            current.options.append((k, v, where))
    return jobs


def parse_jobfile(path: str, defaults: Sequence[tuple[str, str, str]] = ()) -> list[RawJob]:
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise BenchOptionError(f"cannot read job file {path}: {e.strerror or e}") from None
    return parse_jobfile_text(text, path, defaults)


def parse_cmdline_jobs(args: Sequence[str]) -> tuple[list[tuple[str, str, str]], list[RawJob], list[str]]:
    """fio-style command-line job options: ``--name=`` starts a job; options before the first
    ``--name`` are global. Returns (global options, jobs, positional arguments = job files)."""
    glob: list[tuple[str, str, str]] = []
    jobs: list[RawJob] = []
    files: list[str] = []
    current: RawJob | None = None
    for a in args:
        if not a.startswith("--"):
            files.append(a)
            continue
        k, v = _split_kv(a[2:])
        where = f"command line {a!r}"
        name = canonical_name(k, "command line")
        if name == "name":
            current = RawJob(v, list(glob))
            jobs.append(current)
            continue
        if current is None:
            glob.append((k, v, where))
        else:
            current.options.append((k, v, where))
    return glob, jobs, files


# --------------------------------------------------------------------------- resolved jobs

@dataclass
class JobSpec:
    """One job with every option resolved to its value (see :data:`OPTIONS`)."""

    name: str
    values: dict[str, Any]
    given: dict[str, str]  # option -> text as written (for "job options" in the JSON)
    index: int = 0  # position in the job list
    group: int = 0  # reporting group (stonewall / new_group)

    def __getattr__(self, item: str) -> Any:  # spec.bs, spec.iodepth, ...
        values = self.__dict__.get("values")
        if values is not None and item in values:
            return values[item]
        raise AttributeError(item)

    # derived
    @property
    def engine(self) -> str:
        return self.values["ioengine"]

    @property
    def is_kv(self) -> bool:
        return self.values["rw"] in RW_KV

    @property
    def reads(self) -> bool:
        return self.values["rw"] in ("read", "randread", "rw", "randrw") or self.is_kv

    @property
    def writes(self) -> bool:
        return self.values["rw"] in ("write", "randwrite", "rw", "randrw")

    @property
    def random(self) -> bool:
        return self.values["rw"].startswith("rand")

    @property
    def verify_on(self) -> bool:
        return self.values["verify"] not in ("0", "null")

    def describe(self) -> str:
        """fio's one-line job header."""
        r, w = self.values["bs"]
        return (f"{self.name}: (g={self.group}): rw={self.values['rw']}, bs=(R) {_fmt_bs(r)}-{_fmt_bs(r)}, "
                f"(W) {_fmt_bs(w)}-{_fmt_bs(w)}, (T) {_fmt_bs(r)}-{_fmt_bs(r)}, "
                f"ioengine={self.values['ioengine']}, iodepth={self.values['iodepth']}")


def _fmt_bs(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return f"{n}B"


def _resolve_one(raw: RawJob, index: int) -> JobSpec:
    # kb_base first: it changes how sizes given before it are read (fio reads it as given;
    # we apply the job's final kb_base to all its sizes, which is what a job file means).
    kb_base = 1024
    for k, v, where in raw.options:
        if canonical_name(k, where) == "kb_base":
            try:
                kb_base = int(v)
            except ValueError:
                raise BenchOptionError(f"kb_base={v} ({where}): must be 1000 or 1024") from None
            if kb_base not in (1000, 1024):
                raise BenchOptionError(f"kb_base={v} ({where}): must be 1000 or 1024")
    values: dict[str, Any] = {name: opt.default for name, opt in OPTIONS.items()}
    values["bs"] = (4096, 4096)
    given: dict[str, str] = {}
    for k, v, where in raw.options:
        name = canonical_name(k, where)
        try:
            values[name] = _convert(OPTIONS[name], v, kb_base)
        except BenchOptionError as e:
            raise BenchOptionError(f"{e} ({where})") from None
        given[name] = v
        if name == "rwmixwrite":
            values["rwmixread"] = 100 - values[name]
        elif name == "buffered":
            values["direct"] = not values[name]
        elif name == "iomem":
            values["mem"] = values[name]
        elif name == "wait_for_previous":
            values["stonewall"] = values["stonewall"] or values[name]
    values["name"] = raw.name
    eng = str(values["ioengine"]).strip()
    eng = IOENGINE_ALIASES.get(eng, eng)
    if eng not in IOENGINES:
        raise BenchOptionError(
            f"ioengine={values['ioengine']} (job '{raw.name}'): pykvtier's engines are "
            f"{', '.join(IOENGINES)}; fio's {', '.join(sorted(IOENGINE_ALIASES))} are accepted as "
            "the matching one")
    values["ioengine"] = eng
    if values["fixedbufs"] is None:
        values["fixedbufs"] = True
    spec = JobSpec(raw.name, values, given, index)
    _check(spec)
    return spec


def _check(spec: JobSpec) -> None:
    v = spec.values
    name = spec.name
    if v["model"] is not None:
        from .. import models

        try:
            bs = models.block_size_bytes(v["model"], v["tokens_per_block"])
        except ValueError as e:
            raise BenchOptionError(f"job '{name}': {e}") from None
        if "bs" in spec.given and v["bs"][0] != bs:
            raise BenchOptionError(
                f"job '{name}': bs={spec.given['bs']} ({v['bs'][0]} bytes) disagrees with "
                f"model={v['model']} tokens_per_block={v['tokens_per_block']} ({bs} bytes); give one")
        v["bs"] = (bs, bs)
    if spec.is_kv:
        if v["size"] is None and "nrfiles" not in spec.given and v["trace"] is None:
            raise BenchOptionError(f"job '{name}': rw={v['rw']} needs size= or nrfiles= (the number "
                                   "of KV blocks), or trace=")
    elif v["size"] is None and v["filesize"] is None:
        if not (v["filename"] and all(os.path.exists(f) for f in _filenames(v))):
            raise BenchOptionError(f"job '{name}': size= is required (bytes of I/O over the job's files)")
    if v["runtime"] is not None and v["runtime"] <= 0:
        raise BenchOptionError(f"job '{name}': runtime must be > 0")
    if v["time_based"] and not v["runtime"]:
        raise BenchOptionError(f"job '{name}': time_based needs runtime=")
    if spec.is_kv:
        if v["bs"][0] != v["bs"][1]:
            raise BenchOptionError(f"job '{name}': rw={v['rw']} has one block size (bs=SIZE)")
        if v["filename"]:
            raise BenchOptionError(f"job '{name}': rw={v['rw']} keeps its blocks in a pykvtier root "
                                   "(directory=), not in filename=")
    if v["trace"] is not None and v["rw"] != "promote":
        raise BenchOptionError(f"job '{name}': trace= is for rw=promote")


def _filenames(v: dict) -> list[str]:
    names = [n for n in str(v["filename"]).split(":") if n]
    d = v["directory"]
    return [n if os.path.isabs(n) or not d else os.path.join(d, n) for n in names]


def resolve_jobs(raws: Iterable[RawJob]) -> list[JobSpec]:
    """Resolve every job's values and assign reporting groups (stonewall / new_group)."""
    out: list[JobSpec] = []
    group = 0
    for i, raw in enumerate(raws):
        spec = _resolve_one(raw, i)
        if i > 0 and (spec.values["stonewall"] or spec.values["new_group"]):
            group += 1
        spec.group = group
        out.append(spec)
    if not out:
        raise BenchOptionError("no jobs: give a job file or --name=NAME with options")
    return out


def jobs_from_args(args: Sequence[str]) -> list[JobSpec]:
    """Jobs from a fio-style argument list: command-line options and job files, in order."""
    glob, cmd_jobs, files = parse_cmdline_jobs(args)
    raws: list[RawJob] = []
    for path in files:
        raws.extend(parse_jobfile(path, glob))
    raws.extend(cmd_jobs)
    return resolve_jobs(raws)

