"""Phase-1 asynchronous existence probe: batched ``statx`` through io_uring, driven from Python.

The lookup path answers from its in-memory index first; keys the index cannot answer become
paths handed to :class:`ExistenceProbe`. One :meth:`ExistenceProbe.submit` per scheduler step
queues one ``statx`` SQE per path and makes a single ``io_uring_submit`` call; the kernel works
while the scheduler goes on; the next step's :meth:`ExistenceProbe.poll` reaps what completed,
without ever waiting.

Where io_uring is unavailable (the ``pykvtier._uring`` extension is not built, or the kernel or
a container's seccomp profile refuses ``io_uring_setup``), the probe falls back to a synchronous
``os.stat`` per path: the same results, but :meth:`~ExistenceProbe.submit` then costs one
blocking system call per path. The fallback is announced once per process in the
``pykvtier`` log.
"""

from __future__ import annotations

import errno
import importlib
import itertools
import logging
import os
import time
from collections.abc import Iterable
from typing import Any, Literal, NamedTuple, Union

__all__ = ["ExistenceProbe", "ProbeResult", "ProbePath"]

logger = logging.getLogger("pykvtier")

#: One probe outcome: ``(token, size_bytes, 0)`` when the path exists, ``(token, None, errno)``
#: otherwise (``errno.ENOENT`` for a missing path).
ProbeResult = tuple[object, Union[int, None], int]

#: A path to probe: ``str`` (encoded with :func:`os.fsencode`), ``bytes`` or a path-like object.
ProbePath = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]

BackendName = Literal["io_uring", "stat"]

#: Largest SQ ring the kernel accepts without clamping (``IORING_MAX_ENTRIES``).
MAX_ENTRIES = 32768

_fallback_logged = False


def _log_fallback_once(reason: str) -> None:
    global _fallback_logged
    if not _fallback_logged:
        _fallback_logged = True
        logger.warning(
            "pykvtier: io_uring existence probe unavailable (%s); "
            "falling back to synchronous os.stat",
            reason,
        )


class _BatchBuffers(NamedTuple):
    """Memory the kernel reads (paths) and writes (statx results) for one submitted batch."""

    path_blob: Any  # cdata char[]: the batch's paths, each NUL-terminated
    statx_array: Any  # cdata struct statx[]: one result buffer per probe


def _os_error(err: int, what: str) -> OSError:
    name = errno.errorcode.get(err, str(err))
    return OSError(err, f"{what} failed: {name} ({os.strerror(err)})")


class ExistenceProbe:
    """Asynchronous, batched existence-and-size check of files.

    Each probe is a ``(token, path)`` pair: ``token`` is any object the caller uses to match
    the result (a key, a request id), returned unchanged; tokens need not be unique. A result
    is ``(token, size_bytes, 0)`` when ``path`` exists (``size_bytes``: the file's size in
    bytes, from ``statx``'s ``stx_size``; symbolic links are followed, as by :func:`os.stat`),
    else ``(token, None, errno)``: ``errno.ENOENT`` when it is missing, ``ENOTDIR``,
    ``ENAMETOOLONG``, ``EACCES``, ``ELOOP``... as ``stat(2)`` reports them, or ``ENODATA``
    when the file system returned no size (io_uring backend only). Results come in completion
    order, not submission order.

    Attributes:
        backend: ``"io_uring"`` (asynchronous) or ``"stat"`` (synchronous fallback).
        fallback_reason: why io_uring is not used, or ``None`` when it is.
        submits: number of ``io_uring_submit`` calls that carried SQEs (always 0 on ``"stat"``).
        probes: number of probes queued since creation.

    Thread rules: not thread-safe. One owner (the scheduler thread) calls every method; the
    probe holds no lock. The GIL is released inside each liburing call, so other Python
    threads run while the kernel is entered, notably during :meth:`wait`.

    Memory rules: the path and ``struct statx`` buffers of a probe live until its completion
    is reaped; :meth:`close` (also run by the context manager and, as a last resort, by the
    garbage collector) waits for every in-flight probe before the ring is torn down, so the
    kernel never writes into freed memory.
    """

    def __init__(self, entries: int = 256, *, backend: str = "auto") -> None:
        """Create the ring.

        Args:
            entries: submission queue size (SQEs; rounded up to a power of two by the kernel),
                1 to 32768. The completion queue is twice as large; a batch larger than the
                free SQ space is split over several ``io_uring_submit`` calls.
            backend: ``"auto"`` (io_uring, else the ``os.stat`` fallback), ``"io_uring"``
                (raise instead of falling back) or ``"stat"`` (always synchronous).

        Raises:
            ValueError: ``entries`` or ``backend`` out of range.
            ImportError: ``backend="io_uring"`` and ``pykvtier._uring`` is not built.
            OSError: ``backend="io_uring"`` and ``io_uring_queue_init`` failed
                (``EPERM``/``ENOSYS`` where io_uring is blocked, ``ENOMEM``...).
        """
        if not 1 <= entries <= MAX_ENTRIES:
            raise ValueError(f"entries must be in [1, {MAX_ENTRIES}], got {entries!r}")
        if backend not in ("auto", "io_uring", "stat"):
            raise ValueError(f"backend must be 'auto', 'io_uring' or 'stat', got {backend!r}")

        self.backend: BackendName = "stat"
        self.fallback_reason: str | None = None
        self.submits = 0
        self.probes = 0

        self._closed = False
        self._ffi: Any = None
        self._lib: Any = None
        self._ring: Any = None
        # user_data -> (token, the batch's buffers, index in the batch); the buffers stay
        # alive until the last probe that uses them is reaped.
        self._pending: dict[int, tuple[object, _BatchBuffers, int]] = {}
        # Results reaped from the kernel (or computed by os.stat) not yet handed to the caller.
        self._ready: list[ProbeResult] = []
        self._next_id = itertools.count(1)

        if backend == "stat":
            self.fallback_reason = "backend='stat' requested"
            return
        try:
            self._open_ring(entries)
        except ImportError as exc:
            if backend == "io_uring":
                raise
            self.fallback_reason = f"pykvtier._uring cannot be imported: {exc}"
        except OSError as exc:
            if backend == "io_uring":
                raise
            self.fallback_reason = exc.strerror
        if self.fallback_reason is not None:
            _log_fallback_once(self.fallback_reason)

    def _open_ring(self, entries: int) -> None:
        # The cffi extension; ImportError when not built. import_module (unlike a from-import)
        # honours a None entry in sys.modules, the standard way to mark a module unavailable.
        _uring = importlib.import_module("pykvtier._uring")

        ffi, lib = _uring.ffi, _uring.lib
        ring = ffi.new("struct io_uring *")
        # SUBMIT_ALL: an SQE that fails at submission (e.g. ENAMETOOLONG) posts its CQE without
        # cutting the batch short. Kernels before 5.18 reject the flag: retry without it.
        rc = lib.io_uring_queue_init(entries, ring, lib.IORING_SETUP_SUBMIT_ALL)
        if rc == -errno.EINVAL:
            rc = lib.io_uring_queue_init(entries, ring, 0)
        if rc < 0:
            raise _os_error(-rc, "io_uring_queue_init")
        if not lib.pykvtier_ring_features(ring) & lib.IORING_FEAT_NODROP:
            # Without NODROP the kernel drops CQEs when the CQ ring is full; a dropped CQE
            # would leave its probe in flight forever.
            lib.io_uring_queue_exit(ring)
            raise _os_error(errno.ENOTSUP, "io_uring IORING_FEAT_NODROP check (kernel < 5.5)")

        self._ffi, self._lib, self._ring = ffi, lib, ring
        capacity = lib.pykvtier_cq_entries(ring)
        self._reap_capacity = capacity
        self._reap_user_data = ffi.new("uint64_t[]", capacity)
        self._reap_res = ffi.new("int32_t[]", capacity)
        self.backend = "io_uring"

    # -- public API -------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Probes submitted whose results :meth:`poll`/:meth:`wait` have not returned yet."""
        return len(self._pending) + len(self._ready)

    def submit(self, items: Iterable[tuple[object, ProbePath]]) -> int:
        """Queue one probe per ``(token, path)`` pair; return how many were queued.

        io_uring: prepares one ``statx(AT_FDCWD, path, AT_STATX_SYNC_AS_STAT, STATX_SIZE)`` SQE
        per pair and makes one ``io_uring_submit`` call for the whole batch (more only when
        the batch exceeds the free SQ space). Never waits for completions.
        ``"stat"`` fallback: runs :func:`os.stat` on each path now (blocking) and keeps the
        results for the next :meth:`poll`.

        Raises:
            ValueError: the probe is closed, or a path contains a NUL byte; nothing of the
                batch is queued then.
            TypeError: a path is not ``str``, ``bytes`` or path-like.
            OSError: ``io_uring_submit`` failed (a kernel resource shortage); probes already
                prepared stay queued and go out with the next submit or :meth:`wait`.
        """
        self._check_open()
        batch = [(token, os.fsencode(path)) for token, path in items]
        for _, raw in batch:
            if b"\0" in raw:
                raise ValueError(f"embedded NUL byte in path {raw!r}")
        if not batch:
            return 0
        if self._ring is None:
            self._stat_batch(batch)
            self.probes += len(batch)
        else:
            self._queue_batch(batch)
        return len(batch)

    def poll(self) -> list[ProbeResult]:
        """Return the results of every probe completed since the last call, without blocking.

        Each in-flight probe is returned exactly once, by :meth:`poll` or :meth:`wait`.
        Raises ``ValueError`` once closed.
        """
        self._check_open()
        if self._ring is not None:
            self._reap()
        results, self._ready = self._ready, []
        return results

    def wait(self, timeout_s: float | None = None) -> list[ProbeResult]:
        """Block until every in-flight probe completed, or ``timeout_s`` seconds passed.

        Returns the results :meth:`poll` would return at that moment: all in-flight probes
        unless the timeout expired first (the rest stay in flight). ``None`` waits without
        limit; ``0`` does not block. The GIL is released while blocked. For tests and shutdown;
        the scheduler loop uses :meth:`poll`.

        Raises:
            ValueError: the probe is closed, or ``timeout_s`` is negative.
            OSError: the kernel refused to wait (anything but a timeout or a signal).
        """
        self._check_open()
        if timeout_s is not None and timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0 or None, got {timeout_s!r}")
        if self._ring is not None:
            self._wait_ring(timeout_s)
        return self.poll()

    def close(self) -> None:
        """Wait for every in-flight probe, then release the ring. Idempotent.

        Results not yet returned by :meth:`poll`/:meth:`wait` are discarded; call
        :meth:`wait` first to keep them. Afterwards every method but :meth:`close` raises
        ``ValueError``.
        """
        if self._closed:
            return
        if self._ring is not None:
            self._wait_ring(None)
            self._lib.io_uring_queue_exit(self._ring)
            self._ring = None
        self._pending.clear()
        self._ready.clear()
        self._closed = True

    def __enter__(self) -> ExistenceProbe:
        self._check_open()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Last resort: never free buffers the kernel may still write into.
        if getattr(self, "_closed", True):
            return
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing sensible left to do
            pass

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"in_flight={self.in_flight}"
        return (
            f"<ExistenceProbe backend={self.backend} {state} "
            f"probes={self.probes} submits={self.submits}>"
        )

    # -- io_uring backend -------------------------------------------------------------------

    def _queue_batch(self, batch: list[tuple[object, bytes]]) -> None:
        ffi, lib, ring = self._ffi, self._lib, self._ring
        dfd, flags, mask = lib.AT_FDCWD, lib.AT_STATX_SYNC_AS_STAT, lib.STATX_SIZE
        # Two allocations per batch, not two per probe: every path, NUL-terminated, in one
        # char array, and one struct statx per probe in one array. Each pending entry holds
        # a reference to both, so they are freed once the batch's last probe is reaped.
        path_blob = ffi.new("char[]", b"\0".join(raw for _, raw in batch))
        statx_array = ffi.new("struct statx[]", len(batch))
        buffers = _BatchBuffers(path_blob, statx_array)
        pending = self._pending
        offset = 0
        prepared = 0
        try:
            for index, (token, raw) in enumerate(batch):
                sqe = lib.io_uring_get_sqe(ring)
                if sqe == ffi.NULL:  # SQ ring full: send what is there, then go on
                    self._flush()
                    sqe = lib.io_uring_get_sqe(ring)
                user_data = next(self._next_id)
                lib.io_uring_prep_statx(
                    sqe, dfd, path_blob + offset, flags, mask, statx_array + index
                )
                lib.io_uring_sqe_set_data64(sqe, user_data)
                pending[user_data] = (token, buffers, index)
                offset += len(raw) + 1
                prepared += 1
            self._flush()
        finally:
            self.probes += prepared

    def _flush(self) -> None:
        """Submit every prepared SQE. Raises ``OSError`` if the kernel keeps refusing."""
        lib, ring = self._lib, self._ring
        while lib.io_uring_sq_ready(ring):
            rc = lib.io_uring_submit(ring)
            if rc > 0:
                self.submits += 1
                continue
            if rc == -errno.EINTR:
                continue
            if rc in (-errno.EBUSY, -errno.EAGAIN) and self._reap():
                continue  # completions made room: try again
            raise _os_error(-rc if rc < 0 else errno.EIO, "io_uring_submit")

    def _reap(self) -> int:
        """Move every available CQE into ``self._ready``, without blocking; return the count."""
        lib, ring = self._lib, self._ring
        total = 0
        while True:
            n = lib.pykvtier_reap(ring, self._reap_user_data, self._reap_res, self._reap_capacity)
            if n == 0:
                return total
            total += n
            user_data = self._ffi.unpack(self._reap_user_data, n)
            res = self._ffi.unpack(self._reap_res, n)
            pop, ready = self._pending.pop, self._ready
            size_mask = lib.STATX_SIZE
            for uid, rc in zip(user_data, res):
                token, buffers, index = pop(uid)
                if rc < 0:
                    ready.append((token, None, -rc))
                    continue
                statx_buf = buffers.statx_array[index]
                if statx_buf.stx_mask & size_mask:
                    ready.append((token, statx_buf.stx_size, 0))
                else:  # the file system gave no size: cannot vouch for the block
                    ready.append((token, None, errno.ENODATA))
            if n < self._reap_capacity:
                return total

    def _wait_ring(self, timeout_s: float | None) -> None:
        self._flush()  # SQEs a failed submit left behind must go out before waiting
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._reap()
        while self._pending:
            if deadline is None:
                timeout_ns = -1
            else:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                timeout_ns = max(1, int(remaining * 1e9))
            rc = self._lib.pykvtier_wait(self._ring, len(self._pending), timeout_ns)
            if rc < 0 and rc not in (-errno.ETIME, -errno.EINTR):
                raise _os_error(-rc, "io_uring_wait_cqes")
            self._reap()

    # -- os.stat fallback -------------------------------------------------------------------

    def _stat_batch(self, batch: list[tuple[object, bytes]]) -> None:
        ready = self._ready
        for token, raw in batch:
            try:
                st = os.stat(raw)
            except OSError as exc:
                ready.append((token, None, exc.errno or errno.EIO))
            else:
                ready.append((token, st.st_size, 0))

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("ExistenceProbe is closed")
