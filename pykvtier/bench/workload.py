"""What a ``pykvtier bench`` job does, before any I/O: its files, the order of its I/Os, the
bytes its files hold, and the requests and keys of the KV workloads.

File I/O (rw=read, write, randread, randwrite, rw, randrw) follows fio:

* each job (clone) has ``nrfiles`` files of ``size / nrfiles`` bytes (rounded down to a
  multiple of bs), named by ``filename_format`` in ``directory``;
* a **pass** covers every block of every file once: sequential rw reads each file from start to
  end, random rw visits the blocks of each file in a random order (``norandommap``: drawn with
  replacement); ``file_service_type=roundrobin`` (fio's default) switches file after every I/O;
* rw/randrw decide read or write for every I/O with probability ``rwmixread``.

File contents are a deterministic pattern: 64-bit words ``table[w] ^ (file_word + page x
GOLDEN)`` per 4 KiB page, where ``file_word`` is a digest of the file's base name. Any range of
any file can be regenerated from (name, offset), which is what ``verify`` compares against.

KV workloads keep real pykvtier blocks in a :class:`~pykvtier.DiskTier` root (``directory``):
``rw=promote`` loads per-request batches of blocks (synthetic: ``batch`` random blocks per
request, every block once per pass; or a Mooncake trace's requests, each loading its whole
prefix), ``rw=lookup`` asks phase-1 questions about stored and absent keys.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from dataclasses import dataclass

import numpy as np

from .options import BenchOptionError, JobSpec
from .sysutil import plural

__all__ = [
    "FileSet",
    "job_files",
    "IoPass",
    "io_pass",
    "FilePattern",
    "layout_files",
    "invalidate_files",
    "kv_block_key",
    "absent_key",
    "PromoteWorkload",
    "promote_workload",
]

PAGE = 4096
_WORDS_PER_PAGE = PAGE // 8
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_TABLE_SEED = 0x6B76_7469_6572_6662  # "kvtierfb"


# --------------------------------------------------------------------------- files

@dataclass(frozen=True)
class FileSet:
    """The files of one job clone: paths, bytes used of each, and the I/O block size."""

    paths: tuple[str, ...]
    file_size: int  # bytes of I/O per file (a multiple of bs)
    bs: int

    @property
    def blocks_per_file(self) -> int:
        return self.file_size // self.bs

    @property
    def total_bytes(self) -> int:
        return self.file_size * len(self.paths)


def _format_name(fmt: str, jobname: str, jobnum: int, filenum: int) -> str:
    return (fmt.replace("$jobname", jobname).replace("$jobnum", str(jobnum))
            .replace("$filenum", str(filenum)))


def job_files(spec: JobSpec, jobnum: int) -> FileSet:
    """The files of clone ``jobnum`` of ``spec`` (fio's rules for size, nrfiles, filename*)."""
    v = spec.values
    bs_r, bs_w = v["bs"]
    if spec.reads and spec.writes and bs_r != bs_w:
        raise BenchOptionError(f"job '{spec.name}': rw={v['rw']} needs one block size for reads "
                               "and writes")
    bs = bs_r if spec.reads else bs_w
    directory = v["directory"] or os.getcwd()
    if v["filename"]:
        names = [n for n in str(v["filename"]).split(":") if n]
        paths = [n if os.path.isabs(n) else os.path.join(directory, n) for n in names]
    else:
        paths = [os.path.join(directory, _format_name(v["filename_format"], spec.name, jobnum, i))
                 for i in range(v["nrfiles"])]
    if v["filesize"] is not None:
        per_file = v["filesize"]
    elif v["size"] is not None:
        per_file = v["size"] // len(paths)
    else:  # existing files named by filename=, no size: use the smallest one's size
        per_file = min(os.path.getsize(p) for p in paths)
    per_file -= per_file % bs
    if per_file <= 0:
        raise BenchOptionError(
            f"job '{spec.name}': " + ("its file gets" if len(paths) == 1 else f"each of its {len(paths)} files gets")
            + f" less than one block (size {v['size']} / nrfiles {len(paths)} < bs {bs})")
    return FileSet(tuple(paths), per_file, bs)


# --------------------------------------------------------------------------- I/O order

@dataclass
class IoPass:
    """One pass over a FileSet: per I/O, the file index, the byte offset, and (mixed
    workloads) whether it is a write."""

    file_idx: np.ndarray  # int32
    offsets: np.ndarray  # int64 bytes
    is_write: np.ndarray | None  # bool, or None when every I/O has the same direction

    def __len__(self) -> int:
        return len(self.offsets)


def _rng(spec: JobSpec, jobnum: int, pass_no: int, seed: int | None = None) -> np.random.Generator:
    if seed is None:
        seed = spec.values["randseed"] if spec.values["randrepeat"] else time.time_ns()
    return np.random.default_rng([int(seed), jobnum, pass_no])


def io_pass(spec: JobSpec, files: FileSet, jobnum: int = 0, pass_no: int = 0,
            seed: int | None = None) -> IoPass:
    """The I/Os of pass ``pass_no`` of clone ``jobnum``, in issue order (see the module doc).
    ``seed``: default randseed (randrepeat=1) or the clock."""
    v = spec.values
    nf, bpf = len(files.paths), files.blocks_per_file
    n = nf * bpf
    rng = _rng(spec, jobnum, pass_no, seed)
    service = v["file_service_type"]
    if service == "roundrobin":
        fidx = np.arange(n, dtype=np.int64) % nf
        k = np.arange(n, dtype=np.int64) // nf
    elif service == "sequential":
        fidx = np.arange(n, dtype=np.int64) // bpf
        k = np.arange(n, dtype=np.int64) % bpf
    else:  # random: a random order of the files' I/O slots; each file's blocks still in order
        fidx = rng.permutation(np.repeat(np.arange(nf, dtype=np.int64), bpf))
        order = np.argsort(fidx, kind="stable")
        k = np.empty(n, dtype=np.int64)
        k[order] = np.arange(n, dtype=np.int64) - np.repeat(np.arange(nf, dtype=np.int64) * bpf, bpf)
    if spec.random:
        if v["norandommap"]:
            block = rng.integers(0, bpf, size=n, dtype=np.int64)
        else:
            perms = np.argsort(rng.random((nf, bpf)), axis=1)
            block = perms[fidx, k]
    else:
        block = k
    is_write = None
    if v["rw"] in ("rw", "readwrite", "randrw"):
        is_write = rng.random(n) >= v["rwmixread"] / 100.0
    return IoPass(fidx.astype(np.int32), block * files.bs, is_write)


# --------------------------------------------------------------------------- contents

def _name_word(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(os.path.basename(name).encode(), digest_size=8).digest(),
                          "little")


class FilePattern:
    """The bytes pykvtier bench lays files out with (and ``verify`` expects)."""

    def __init__(self) -> None:
        self.table = np.random.Generator(np.random.PCG64(_TABLE_SEED)).integers(
            0, 2**64, size=_WORDS_PER_PAGE, dtype=np.uint64, endpoint=False)

    def pages(self, path: str, first_page: int, npages: int) -> np.ndarray:
        """uint64 words of pages [first_page, first_page + npages) of ``path``."""
        salts = np.arange(first_page, first_page + npages, dtype=np.uint64) * _GOLDEN
        salts += np.uint64(_name_word(path))
        return np.bitwise_xor(self.table[None, :], salts[:, None]).reshape(-1)

    def expected(self, path: str, offset: int, length: int) -> np.ndarray:
        """uint8 bytes [offset, offset + length) of ``path``."""
        p0 = offset // PAGE
        p1 = -(-(offset + length) // PAGE)
        raw = self.pages(path, p0, p1 - p0).view(np.uint8)
        start = offset - p0 * PAGE
        return raw[start:start + length]

    def fill(self, out: np.ndarray, path: str, offset: int) -> None:
        out[:] = self.expected(path, offset, len(out))

    def first_mismatch(self, data: np.ndarray, path: str, offset: int) -> int:
        """Offset in the file of the first byte of ``data`` that differs, or -1."""
        exp = self.expected(path, offset, len(data))
        if np.array_equal(data, exp):
            return -1
        return offset + int(np.flatnonzero(data != exp)[0])


def layout_files(files: FileSet, pattern: FilePattern, allow_create: bool, jobname: str,
                 log=sys.stderr) -> int:
    """Create (or extend) the files that are missing or shorter than needed, filled with the
    pattern and fsync'ed, as fio lays out its files. Returns bytes written."""
    todo = []
    for p in files.paths:
        try:
            if os.path.getsize(p) >= files.file_size:
                continue
        except FileNotFoundError:
            if not allow_create:
                raise BenchOptionError(f"job '{jobname}': {p} does not exist and allow_file_create=0")
        todo.append(p)
    if not todo:
        return 0
    if log is not None:
        many = len(todo) > 1  # fio's wording: "IO file (1 file / 1MiB)", "IO files (2 files / total 2MiB)"
        print(f"{jobname}: Laying out IO file{'s' if many else ''} ({plural(len(todo), 'file')} / "
              f"{'total ' if many else ''}{_fmt(len(todo) * files.file_size)})", file=log, flush=True)
    chunk = 8 << 20
    written = 0
    for p in todo:
        os.makedirs(os.path.dirname(p) or ".", exist_ok=True)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            off = 0
            while off < files.file_size:
                n = min(chunk, files.file_size - off)
                data = pattern.expected(p, off, n)
                mv = memoryview(data)
                while mv:
                    k = os.pwrite(fd, mv, off)
                    mv = mv[k:]
                    off += k
            os.fsync(fd)
        finally:
            os.close(fd)
        written += files.file_size
    return written


def invalidate_files(paths) -> None:
    """Drop the files' pages from the page cache (fio's invalidate=1)."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def _fmt(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            v = n / (1 << shift)
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.1f}{unit}"
    return f"{n}B"


# --------------------------------------------------------------------------- KV workloads

def kv_block_key(i: int) -> bytes:
    """Key of synthetic KV block ``i`` of a promote/lookup population."""
    return b"pykvtier-bench-block:%d" % i


def absent_key(i: int) -> bytes:
    """A key that is never stored (lookup misses)."""
    return b"pykvtier-bench-absent:%d" % i


@dataclass
class PromoteWorkload:
    """The block population of a promote/lookup job and, for promote, its requests."""

    population: list[bytes]  # keys to store before the run
    requests: list[list[bytes]]  # one pass: each request's keys (loaded as one job)
    source: str  # how the requests were made (for the report)
    split_requests: int = 0  # trace requests larger than the arena, split into parts

    def max_request_blocks(self) -> int:
        return max((len(r) for r in self.requests), default=0)


def _population_size(spec: JobSpec) -> int:
    v = spec.values
    bs = v["bs"][0]
    if "nrfiles" in spec.given:
        return v["nrfiles"]
    if v["size"] is not None:
        n = v["size"] // bs
        if n < 1:
            raise BenchOptionError(f"job '{spec.name}': size {v['size']} is less than one block ({bs})")
        return n
    return v["nrfiles"]


def _load_requests(spec: JobSpec):
    from ..trace import load_trace

    path = spec.values["trace"]
    return load_trace(None if path in ("mooncake", "bundled") else path, spec.values["trace_requests"])


def promote_workload(spec: JobSpec, jobnum: int = 0, pass_no: int = 0,
                     max_blocks_per_job: int | None = None) -> PromoteWorkload:
    """Requests of one pass (and the population to store) for rw=promote or rw=lookup.

    Synthetic (no trace=): the population is ``nrfiles`` (or size/bs) blocks; a pass is a random
    permutation of them cut into requests of ``batch`` blocks (the last one may be shorter).
    Trace: each of the first ``trace_requests`` requests loads every engine block of its
    ``hash_ids`` prefix (512-token trace blocks split into bs-sized engine blocks, the keys of
    ``pykvtier replay``); requests stop being added once the population would exceed ``size``
    (when given). A request of more blocks than ``max_blocks_per_job`` is split into parts.
    """
    v = spec.values
    bs = v["bs"][0]
    if v["trace"] is None or v["rw"] == "lookup":
        n = _population_size(spec)
        population = [kv_block_key(i) for i in range(n)]
        if v["rw"] == "lookup":
            return PromoteWorkload(population, [], "synthetic")
        rng = _rng(spec, jobnum, pass_no)
        order = rng.permutation(n)
        b = v["batch"]
        reqs = [[population[i] for i in order[s:s + b]] for s in range(0, n, b)]
        return PromoteWorkload(population, reqs, f"synthetic: {plural(n, 'block')}, {b} per request")
    from ..models import PRESETS
    from ..replay import block_key
    from ..trace import TRACE_BLOCK_TOKENS

    if v["model"] is not None:
        tpb = v["tokens_per_block"]
    else:  # bs alone: find a model whose token size divides bs into a divisor of 512
        tpb = None
        for p in PRESETS.values():
            if bs % p.kv_bytes_per_token == 0 and TRACE_BLOCK_TOKENS % (bs // p.kv_bytes_per_token) == 0:
                tpb = bs // p.kv_bytes_per_token
                break
        if tpb is None:
            raise BenchOptionError(f"job '{spec.name}': trace= needs model= and tokens_per_block= "
                                   f"(bs={bs} is no whole number of tokens of a known model)")
    sub = TRACE_BLOCK_TOKENS // tpb
    cap = v["size"] // bs if v["size"] is not None else None
    seen: dict[bytes, None] = {}
    reqs: list[list[bytes]] = []
    split = 0
    for r in _load_requests(spec):
        keys = [block_key(h, i, bs) for h in r.hash_ids for i in range(sub)]
        if not keys:
            continue
        new = [k for k in keys if k not in seen]
        if cap is not None and reqs and len(seen) + len(new) > cap:
            break
        for k in new:
            seen[k] = None
        if max_blocks_per_job and len(keys) > max_blocks_per_job:
            split += 1
            reqs.extend(keys[s:s + max_blocks_per_job] for s in range(0, len(keys), max_blocks_per_job))
        else:
            reqs.append(keys)
    name = v["trace"]
    return PromoteWorkload(list(seen), reqs,
                           f"trace {name}: {plural(len(reqs), 'request')}, {tpb} tokens/block "
                           f"({plural(sub, 'block')} per 512-token trace block)", split)
