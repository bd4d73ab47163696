"""The ``posix`` engine: plain ``preadv``/``pwritev`` from a small thread pool.

For machines where io_uring is disabled (some containers' seccomp profiles refuse
``io_uring_setup``). Same interface, entry tuples, results and block format as
``pykvtier._native.Engine``, so :class:`~pykvtier.tier.DiskTier` uses either. The system calls
release the GIL; checksums run in C (``_native.xxh3_64``, GIL released).
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from . import _native

__all__ = ["PosixEngine"]

_HEADER = struct.Struct("<8sIIQ16sQQ")
_HB = _native.HEADER_BYTES
_OPS = ("read", "write", "read_block", "write_block", "unlink")


def _view(addr: int, n: int) -> memoryview:
    return memoryview((ctypes.c_char * n).from_address(addr)).cast("B")


def _aligned(n: int) -> memoryview:
    raw = bytearray(n + 4096)
    base = ctypes.addressof(ctypes.c_char.from_buffer(raw))
    off = (-base) % 4096
    return memoryview(raw)[off:off + n]


class FinishedJobsQueue:
    """The completion side that Python engines share with ``_native.Engine``: finished jobs as
    ``(job_id, op, results, submits, queued_s, transfer_s)``, each polled once. Subclasses set
    ``_mu`` (a Condition), ``_finished`` (a list) and ``_outstanding`` (jobs not finished) and
    notify ``_mu`` when a job finishes."""

    _mu: threading.Condition
    _finished: list
    _outstanding: int

    def poll(self) -> list[tuple]:
        with self._mu:
            out, self._finished = self._finished, []
        return out

    def wait(self, timeout_s: float | None = None) -> bool:
        with self._mu:
            self._mu.wait_for(lambda: self._finished or self._outstanding == 0, timeout_s)
            return bool(self._finished)

    def drain(self) -> None:
        with self._mu:
            self._mu.wait_for(lambda: self._outstanding == 0)

    def pending_jobs(self) -> int:
        with self._mu:
            return self._outstanding


class PosixEngine(FinishedJobsQueue):
    """Batched block I/O with one ``preadv``/``pwritev`` per request on ``threads`` threads.

    Interface as ``pykvtier._native.Engine`` (see its docstring); ``queue_depth`` bounds requests
    in flight. Thread-safe."""

    def __init__(self, queue_depth: int = 64, max_inflight_bytes: int = 256 << 20,
                 workers: int = 1, threads: int = 4) -> None:
        self.queue_depth = queue_depth
        self.max_inflight_bytes = max_inflight_bytes
        self._pool = ThreadPoolExecutor(max_workers=max(1, min(threads, queue_depth)),
                                        thread_name_prefix="pykvtier-posix")
        self._mu = threading.Condition()
        self._finished: list[tuple] = []
        self._outstanding = 0
        self._closed = False
        self._stats = dict.fromkeys(
            ("submits", "sqes", "cqes", "jobs_submitted", "jobs_finished", "requests_ok",
             "requests_failed", "bytes_read", "bytes_written", "fixed_buffer_ios",
             "verify_failures", "rename_existing", "buffer_registration_failures",
             "recycled", "recycle_failures",
             "buffer_registration_errno"), 0)

    # --- the Engine interface ------------------------------------------------------------

    def register_buffer(self, addr: int, nbytes: int) -> int:
        return 0  # no fixed buffers without io_uring

    def unregister_buffers(self) -> None:
        pass

    def await_buffers(self, timeout_s: float | None = None) -> bool:
        return True

    def run(self, op: str, entries, direct: bool = True, align: int = 4096, mem_align: int = 0,
            fsync: bool = False) -> list[int]:
        reqs = self._validate(op, entries, direct, align, mem_align or align)
        with self._mu:
            self._stats["jobs_submitted"] += 1
        results = list(self._pool.map(lambda r: self._do(op, r, direct, fsync), reqs))
        self._count(results)
        return results

    def submit(self, job_id: int, op: str, entries, direct: bool = True, align: int = 4096,
               mem_align: int = 0, fsync: bool = False) -> None:
        if self._closed:
            raise RuntimeError("engine is shut down")
        reqs = self._validate(op, entries, direct, align, mem_align or align)
        t0 = time.monotonic()
        with self._mu:
            self._outstanding += 1
            self._stats["jobs_submitted"] += 1
        if not reqs:
            self._complete(job_id, op, [], t0)
            return
        results: list[int | None] = [None] * len(reqs)
        left = [len(reqs)]

        def one(i: int) -> None:
            results[i] = self._do(op, reqs[i], direct, fsync)
            with self._mu:
                left[0] -= 1
                last = left[0] == 0
            if last:
                self._complete(job_id, op, results, t0)

        for i in range(len(reqs)):
            self._pool.submit(one, i)

    def shutdown(self) -> None:
        self.drain()
        self._closed = True
        self._pool.shutdown(wait=True)

    def stats(self) -> dict[str, int]:
        with self._mu:
            return dict(self._stats)

    # --- internals -------------------------------------------------------------------------

    def _complete(self, job_id: int, op: str, results: list, t0: float) -> None:
        self._count(results)
        with self._mu:
            self._finished.append((job_id, op, results, 0, 0.0, time.monotonic() - t0))
            self._outstanding -= 1
            self._stats["jobs_finished"] += 1
            self._mu.notify_all()

    def _count(self, results: list[int]) -> None:
        with self._mu:
            for r in results:
                self._stats["requests_ok" if r >= 0 else "requests_failed"] += 1

    @staticmethod
    def _validate(op: str, entries, direct: bool, align: int, mem_align: int) -> list[tuple]:
        if op not in _OPS:
            raise ValueError(f"unknown op '{op}': expected one of {', '.join(_OPS)}")
        reqs = []
        for i, e in enumerate(entries):
            if op == "unlink":
                reqs.append((e if isinstance(e, str) else e[0],))
                continue
            e = tuple(e)
            if op in ("read", "write"):
                path, offset, length, addr = e[:4]
                target = e[4] if len(e) == 5 and op == "write" else ""
                r = (path, offset, length, addr, target, None, "")
            elif op == "read_block":
                path, length, addr, digest = e
                offset, target = 0, ""
                r = (path, 0, length, addr, "", digest, "")
            else:
                path, target, length, addr, digest = e[:5]
                recycle = e[5] if len(e) == 6 else ""
                if len(e) not in (5, 6):
                    raise ValueError(f"entry {i}: expected a tuple of 5 or 6 items for op "
                                     f"'write_block', got {len(e)}")
                offset = 0
                r = (path, 0, length, addr, target, digest, recycle)
            if length <= 0:
                raise ValueError(f"entry {i} ({path}): length is 0")
            if direct:
                if addr % mem_align:
                    raise ValueError(f"entry {i} ({path}): host address {addr:#x} is not a multiple "
                                     f"of {mem_align} bytes, the memory alignment O_DIRECT needs here")
                if length % align or offset % align:
                    raise ValueError(f"entry {i} ({path}): length/offset not a multiple of {align} "
                                     "bytes, the O_DIRECT I/O alignment here")
            reqs.append(r)
        return reqs

    def _do(self, op: str, r: tuple, direct: bool, fsync: bool) -> int:
        try:
            if op == "unlink":
                os.unlink(r[0])
                return 0
            path, offset, length, addr, target, digest, recycle = r
            block = digest is not None
            flags = os.O_CLOEXEC | (getattr(os, "O_DIRECT", 0) if direct else 0)
            if op in ("read", "read_block"):
                return self._read(path, offset, length, addr, digest, flags)
            if recycle:
                return self._recycle_write(path, length, addr, target, digest, flags, fsync,
                                           recycle)
            return self._write(path, offset, length, addr, target, digest if block else None,
                               flags, fsync)
        except OSError as exc:
            return -(exc.errno or errno.EIO)

    def _read(self, path, offset, length, addr, digest, flags) -> int:
        # O_NONBLOCK: a FIFO put at a block's name must not hang the open (regular files ignore
        # it); anything but a regular file is refused.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | flags)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return -errno.EINVAL
            dst = _view(addr, length)
            if digest is None:
                n = os.preadv(fd, [dst], offset)
                return n if n == length else _native.ERR_SHORT
            hdr = _aligned(_HB)
            n = os.preadv(fd, [hdr, dst], 0)
            if n != _HB + length:
                return _native.ERR_SHORT
        finally:
            os.close(fd)
        magic, version, hbytes, plen, kd, pxx, hxx = _HEADER.unpack_from(hdr)
        if (magic != _native.MAGIC or version != _native.FORMAT_VERSION or hbytes != _HB
                or _native.xxh3_64(hdr[: _HEADER.size - 8]) != hxx):
            res = _native.ERR_BAD_HEADER
        elif kd != digest:
            res = _native.ERR_KEY_MISMATCH
        elif plen != length:
            res = _native.ERR_LENGTH
        elif _native.xxh3_64(dst) != pxx:
            res = _native.ERR_CHECKSUM
        else:
            with self._mu:
                self._stats["bytes_read"] += length
            return length
        with self._mu:
            self._stats["verify_failures"] += 1
        return res

    def _recycle_write(self, path, length, addr, target, digest, flags, fsync, recycle) -> int:
        """write_block over an evicted block file (as the io_uring engine's recycle_path): the
        file is renamed to the temporary name and overwritten -- if it is a regular file of one
        link, no longer than a block (anything else, e.g. a directory, FIFO, symlink or longer
        file put at its name, is renamed back and removed after the store: opening it could
        block forever, write through the link, or leave a block file longer than a block). If
        it cannot be renamed (other than: it is gone) the temporary is created afresh and the
        file removed afterwards."""
        renamed = failed = False
        try:
            os.rename(recycle, path)  # path is this process's own fresh temporary name
            renamed = True
        except FileNotFoundError:
            pass
        except OSError:
            failed = True
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        reuse = st is not None and _reusable(st, length)
        if renamed and not reuse:
            renamed = False
            try:
                if stat.S_ISDIR(st.st_mode):
                    os.rename(path, recycle)
                else:  # (link + unlink: never replaces what may be at its name now)
                    os.link(path, recycle, follow_symlinks=False)
                    os.unlink(path)
                failed = True  # back at its name: removed below
            except OSError:
                with self._mu:
                    self._stats["recycle_failures"] += 1  # left at the temporary name
        elif renamed:
            with self._mu:
                self._stats["recycled"] += 1
        try:
            return self._write(path, 0, length, addr, target, digest, flags, fsync, own=reuse)
        except OSError:
            if renamed:
                _unlink_quiet(path)  # the recycled file is ours: do not leave it behind
            raise
        finally:
            if failed:
                try:
                    os.unlink(recycle)
                except FileNotFoundError:
                    pass
                except OSError:
                    with self._mu:
                        self._stats["recycle_failures"] += 1

    def _write(self, path, offset, length, addr, target, digest, flags, fsync,
               own: bool = False) -> int:
        src = _view(addr, length)
        if own:  # a recycled file: never through a symlink, never waiting on a FIFO
            oflags = os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | flags
        else:
            oflags = os.O_WRONLY | os.O_CREAT | flags | (os.O_EXCL if target else 0)
        fd = os.open(path, oflags, 0o644)
        try:
            if own:
                if not _reusable(os.fstat(fd), length):  # swapped since the lstat
                    raise OSError(errno.EINVAL, "not a reusable block file", path)
                os.set_blocking(fd, True)
            if digest is not None:
                hdr = _aligned(_HB)
                hdr[:] = bytes(_HB)
                head = _HEADER.pack(_native.MAGIC, _native.FORMAT_VERSION, _HB, length, digest,
                                    _native.xxh3_64(src), 0)
                hdr[: _HEADER.size] = head[:-8] + struct.pack("<Q", _native.xxh3_64(head[:-8]))
                n = os.pwritev(fd, [hdr, src], 0)
                ok = n == _HB + length
            else:
                ok = os.pwritev(fd, [src], offset) == length
            if ok and fsync:
                os.fdatasync(fd)
        except OSError:
            os.close(fd)
            if target:
                _unlink_quiet(path)
            raise
        os.close(fd)
        if not ok:
            if target:
                _unlink_quiet(path)
            return -errno.ENOSPC
        if target:
            try:
                os.link(path, target)  # never replaces an existing block
            except FileExistsError:
                with self._mu:
                    self._stats["rename_existing"] += 1
            finally:
                _unlink_quiet(path)
        with self._mu:
            self._stats["bytes_written"] += length
        return length


def _reusable(st: os.stat_result, length: int) -> bool:
    """A file a store may overwrite in place: regular, one link, no longer than a block."""
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_size <= _HB + length


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
