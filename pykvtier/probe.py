"""Phase-1 asynchronous existence probe: batched ``statx`` through io_uring.

The lookup path answers from its in-memory index first; keys the index cannot answer become
paths handed to :class:`ExistenceProbe`. One submit per scheduler step queues one ``statx``
SQE per path: the per-probe loops run in C (``pykvtier._uring``, built by cffi from
``_uring_build.py``): one call prepares and submits the whole batch, one call reaps every
completed probe into arrays. The kernel works while the scheduler goes on; results are
collected without ever waiting, in bounded slices (:meth:`ExistenceProbe.poll` with
``max_results``), or one probe at a time (:meth:`ExistenceProbe.take`).

``statx`` is asked with ``AT_SYMLINK_NOFOLLOW``: a symbolic link is reported as the link itself
(its ``mode`` says ``S_IFLNK``), never as its target, so a link planted at a block path cannot
pass for a block. The result carries the file type and the link count for that check.

Where io_uring is unavailable (the ``pykvtier._uring`` extension is not built, or the kernel or
a container's seccomp profile refuses ``io_uring_setup``), the probe falls back to a synchronous
``os.lstat`` per path: the same results, but a submit then costs one blocking system call per
path. The fallback is announced once per process in the ``pykvtier`` log.
"""

from __future__ import annotations

import errno
import importlib
import itertools
import logging
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any, Literal, NamedTuple, Union

import numpy as np

__all__ = ["ExistenceProbe", "ProbeColumns", "ProbeResult", "ProbePath"]

logger = logging.getLogger("pykvtier")


class ProbeResult(NamedTuple):
    """One probe outcome.

    ``size_bytes`` is the file's size (``stx_size``) when ``error`` is 0, else ``None``;
    ``error`` is 0 or the errno (``ENOENT`` for a missing path, ``ENOTDIR``, ``ENAMETOOLONG``,
    ``EACCES``, ``ELOOP``... as ``lstat(2)`` reports them; ``ENODATA`` when the file system
    returned no size, type or link count). ``mode`` (``st_mode``: file type and permission
    bits) and ``nlink`` (hard links) are 0 unless ``error`` is 0.
    """

    token: object
    size_bytes: Union[int, None]
    error: int
    mode: int
    nlink: int


class ProbeColumns(NamedTuple):
    """Several probe outcomes as parallel lists (element ``i`` of each is one probe), for
    callers that apply many results in a loop. As :class:`ProbeResult`, except that
    ``sizes[i]`` is 0 (not ``None``) where ``errors[i]`` is not 0."""

    tokens: list
    sizes: list
    errors: list
    modes: list
    nlinks: list


#: A path to probe: ``str`` (encoded with :func:`os.fsencode`), ``bytes`` or a path-like object.
ProbePath = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]

BackendName = Literal["io_uring", "stat"]

#: Largest SQ ring the kernel accepts without clamping (``IORING_MAX_ENTRIES``).
MAX_ENTRIES = 32768

#: Completions one :meth:`ExistenceProbe.take` reaps at most (the rest wait for the next
#: take, poll or wait).
TAKE_REAP_MAX = 64

_TICKET_BITS = 32  # a ticket is (batch number << 32) | index in the batch
_INDEX_MASK = (1 << _TICKET_BITS) - 1

_fallback_logged = False


def _log_fallback_once(reason: str) -> None:
    global _fallback_logged
    if not _fallback_logged:
        _fallback_logged = True
        logger.warning(
            "pykvtier: io_uring existence probe unavailable (%s); "
            "falling back to synchronous os.lstat",
            reason,
        )


def _os_error(err: int, what: str) -> OSError:
    name = errno.errorcode.get(err, str(err))
    return OSError(err, f"{what} failed: {name} ({os.strerror(err)})")


_new_result = tuple.__new__  # _new_result(ProbeResult, fields): no NamedTuple __new__ call


def _empty_columns() -> ProbeColumns:
    return ProbeColumns([], [], [], [], [])


class _Batch:
    """One submitted batch: its tokens, the memory the kernel reads (paths) and writes
    (requests), and which results were handed out. Freed once every result was handed out
    (every CQE has been reaped by then, so the kernel no longer touches the memory)."""

    __slots__ = ("tokens", "paths", "reqs", "handed", "left")

    def __init__(self, tokens: list, paths: Any, reqs: Any) -> None:
        self.tokens = tokens
        self.paths = paths  # cdata over the caller's buffer (keeps it alive) or an owned copy
        self.reqs = reqs  # cdata struct pykvtier_statx_req[len(tokens)]
        self.handed = bytearray(len(tokens))  # 1 once the result was handed out
        self.left = len(tokens)  # results not yet handed out


class ExistenceProbe:
    """Asynchronous, batched check of files: existence, size, file type, link count.

    Each probe is a ``(token, path)`` pair: ``token`` is any object the caller uses to match
    the result (a key, a request id), returned unchanged; tokens need not be unique. Every
    probe gets a **ticket** (an int, unique for the probe's lifetime) from
    :meth:`submit_packed`; :meth:`take` answers one ticket. Each result is handed out exactly
    once, by :meth:`poll`, :meth:`poll_columns`, :meth:`wait` or :meth:`take`. Results come in
    completion order, not submission order.

    Attributes:
        backend: ``"io_uring"`` (asynchronous) or ``"stat"`` (synchronous fallback).
        fallback_reason: why io_uring is not used, or ``None`` when it is.
        entries: SQ ring size (a batch up to this many probes goes out in one
            ``io_uring_submit``); 0 on ``"stat"``.
        submits: number of ``io_uring_submit`` calls that carried SQEs (always 0 on ``"stat"``).
        probes: number of probes queued since creation.

    Thread rules: not thread-safe. One owner (the scheduler thread) calls every method; the
    probe holds no lock. The GIL is released inside each call into ``pykvtier._uring``, so
    other Python threads run while the kernel is entered, notably during :meth:`wait`.

    Memory rules: the paths and ``statx`` buffers of a batch live until each of its results
    was handed out; :meth:`close` (also run by the context manager and, as a last resort, by
    the garbage collector) waits for every in-flight probe before the ring is torn down, so
    the kernel never writes into freed memory.
    """

    def __init__(self, entries: int = 256, *, backend: str = "auto") -> None:
        """Create the ring.

        Args:
            entries: submission queue size (SQEs; rounded up to a power of two by the kernel),
                1 to 32768: size it for the usual batch. The completion queue is twice as
                large; a batch larger than the SQ ring goes out in several ``io_uring_submit``
                calls (still one call into C); more completions than the CQ ring holds wait
                in the kernel (``IORING_FEAT_NODROP``), none is lost.
            backend: ``"auto"`` (io_uring, else the ``os.lstat`` fallback), ``"io_uring"``
                (raise instead of falling back) or ``"stat"`` (always synchronous).

        Raises:
            ValueError: ``entries`` or ``backend`` out of range.
            ImportError: ``backend="io_uring"`` and ``pykvtier._uring`` is not built.
            OSError: ``backend="io_uring"`` and ``io_uring_queue_init`` failed
                (``EPERM``/``ENOSYS`` where io_uring is blocked, ``ENOMEM``...).
        """
        if isinstance(entries, bool) or not isinstance(entries, int) or not 1 <= entries <= MAX_ENTRIES:
            raise ValueError(f"entries must be an int in [1, {MAX_ENTRIES}], got {entries!r}")
        if backend not in ("auto", "io_uring", "stat"):
            raise ValueError(f"backend must be 'auto', 'io_uring' or 'stat', got {backend!r}")

        self.backend: BackendName = "stat"
        self.fallback_reason: str | None = None
        self.entries = 0
        self.submits = 0
        self.probes = 0

        self._closed = False
        self._ffi: Any = None
        self._lib: Any = None
        self._ring: Any = None
        self._batch_numbers = itertools.count(1)
        self._batches: dict[int, _Batch] = {}  # batch number -> batch with results not handed out
        self._unreturned = 0  # probes queued whose result was not handed out yet
        self._unreaped = 0  # probes queued whose CQE was not reaped yet (io_uring)
        # "stat" backend: ticket -> result, in completion (= submission) order.
        self._stat_ready: dict[int, ProbeResult] = {}

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
        self.entries = lib.pykvtier_sq_entries(ring)
        self._flags = lib.AT_SYMLINK_NOFOLLOW | lib.AT_STATX_SYNC_AS_STAT
        self._mask = lib.STATX_TYPE | lib.STATX_MODE | lib.STATX_NLINK | lib.STATX_SIZE
        # CQ ring head and tail (kernel-shared memory): read without a call into C, so a
        # take() of a probe still in flight costs no call when nothing completed meanwhile.
        self._cq_head = lib.pykvtier_cq_khead(ring)
        self._cq_tail = lib.pykvtier_cq_ktail(ring)
        self._prepared = ffi.new("unsigned *")
        self._submit_calls = ffi.new("unsigned *")
        # Reaped results not handed out yet, in completion order: entries [pos, count) of five
        # parallel arrays. Capacity >= results not handed out + CQEs still to come, so a reap
        # never runs out of room (see _make_room).
        self._out_pos = 0
        self._out_count = 0
        self._alloc_out(lib.pykvtier_cq_entries(ring))
        self.backend = "io_uring"

    # -- public API -------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Probes queued whose results have not been handed out yet."""
        return self._unreturned

    def submit(self, items: Iterable[tuple[object, ProbePath]]) -> int:
        """Queue one probe per ``(token, path)`` pair; return how many were queued.

        A convenience over :meth:`submit_packed` for paths of any length and type (the
        per-path encoding runs in Python). Raises as :meth:`submit_packed`, and
        ``TypeError`` for a path that is not ``str``, ``bytes`` or path-like; nothing of the
        batch is queued then.
        """
        self._check_open()
        batch = [(token, os.fsencode(path)) for token, path in items]
        for _, raw in batch:
            if b"\0" in raw:
                raise ValueError(f"embedded NUL byte in path {raw!r}")
        if not batch:
            return 0
        tokens = [token for token, _ in batch]
        raws = [raw for _, raw in batch]
        if self._ring is None:
            self._stat_batch(next(self._batch_numbers), tokens, raws)
        else:
            offsets = self._ffi.new("uint64_t[]", [0, *itertools.accumulate(len(r) + 1 for r in raws[:-1])])
            blob = self._ffi.new("char[]", b"\0".join(raws))  # one trailing NUL from char[]
            self._queue(tokens, blob, 0, offsets)
        return len(batch)

    def submit_packed(self, tokens: Sequence[object], paths: Any, stride: int) -> int:
        """Queue one probe per token with its path taken from a packed buffer, in one call
        into C (one ``io_uring_submit`` when the batch fits in the SQ ring); never waits.

        ``paths`` (any buffer: ``bytes``, a NumPy array...) holds ``len(tokens)`` slots of
        ``stride`` bytes; slot ``i`` is the NUL-terminated path of ``tokens[i]`` (absolute, or
        relative to the working directory), NUL-padded to ``stride``. Each probe is
        ``statx(AT_FDCWD, path, AT_SYMLINK_NOFOLLOW | AT_STATX_SYNC_AS_STAT, STATX_TYPE |
        STATX_MODE | STATX_NLINK | STATX_SIZE)``. The buffer is kept (not copied) until every
        probe of the batch was handed out: do not change it meanwhile. On ``"stat"`` the
        ``os.lstat`` calls run now (blocking) and the results wait for the next poll.

        Returns the first ticket: ``tokens[i]``'s probe has ticket ``first + i``. A probe the
        kernel refused to take (``io_uring_submit`` failing even after completions made room)
        completes with that errno instead.

        Raises:
            ValueError: the probe is closed, ``stride`` < 1, ``paths`` is shorter than
                ``len(tokens) * stride`` bytes, or a slot's last byte is not NUL; nothing
                of the batch is queued then.
        """
        self._check_open()
        n = len(tokens)
        if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
            raise ValueError(f"stride must be a positive int, got {stride!r}")
        view = np.frombuffer(paths, dtype=np.uint8)
        if view.size < n * stride:
            raise ValueError(f"paths holds {view.size} bytes, {n} paths of stride {stride} need {n * stride}")
        if n and view[stride - 1:n * stride:stride].any():
            bad = int(np.flatnonzero(view[stride - 1:n * stride:stride])[0])
            raise ValueError(f"path {bad} of the batch is not NUL-terminated within stride {stride}")
        tokens = list(tokens)
        if self._ring is None:
            raws = [bytes(view[i * stride:(i + 1) * stride]).split(b"\0", 1)[0] for i in range(n)]
            return self._stat_batch(next(self._batch_numbers), tokens, raws)
        return self._queue(tokens, self._ffi.from_buffer("char[]", paths), stride, self._ffi.NULL)

    def take(self, ticket: int) -> ProbeResult | None:
        """The result of one probe if it completed, else ``None``; never waits.

        When this probe's completion was not reaped yet and the CQ ring holds completions,
        reaps up to :data:`TAKE_REAP_MAX` of them, oldest first (one call into C): a take
        never pays for a whole batch; ``None`` then when this probe's was not among them. The
        result is then handed out: :meth:`poll` will not return it.

        Raises:
            KeyError: ``ticket`` is not a probe in flight (unknown, or its result was
                already handed out).
            ValueError: the probe is closed.
        """
        self._check_open()
        if self._ring is None:
            result = self._stat_ready.pop(ticket, None)
            if result is None:
                raise KeyError(f"probe ticket {ticket!r} is not in flight")
            self._unreturned -= 1
            return result
        number, index = ticket >> _TICKET_BITS, ticket & _INDEX_MASK
        batch = self._batches.get(number)
        if batch is None or index >= len(batch.tokens) or batch.handed[index]:
            raise KeyError(f"probe ticket {ticket!r} is not in flight")
        req = batch.reqs[index]
        if not req.done:
            if self._cq_tail[0] == self._cq_head[0]:  # no CQE waiting (overflow: ring full)
                return None
            self._reap(TAKE_REAP_MAX)
            if not req.done:
                return None
        res = req.res
        if res:
            result = _new_result(ProbeResult, (batch.tokens[index], None, -res, 0, 0))
        else:
            stx = req.stx
            result = _new_result(ProbeResult, (batch.tokens[index], stx.stx_size, 0, stx.stx_mode,
                                               stx.stx_nlink))
        batch.handed[index] = 1
        batch.left -= 1
        self._unreturned -= 1
        if batch.left == 0:  # `req` points into its memory: read above, before this
            del self._batches[number]
        return result

    def poll(self, max_results: int | None = None) -> list[ProbeResult]:
        """Return results of completed probes (at most ``max_results``; all when ``None``),
        without blocking. Each probe's result is handed out exactly once.
        Raises ``ValueError`` once closed, or for a negative ``max_results``."""
        c = self.poll_columns(max_results)
        return [
            ProbeResult(t, s if e == 0 else None, e, m, n)
            for t, s, e, m, n in zip(c.tokens, c.sizes, c.errors, c.modes, c.nlinks)
        ]

    def poll_columns(self, max_results: int | None = None) -> ProbeColumns:
        """As :meth:`poll`, as parallel lists: the form for applying many results in a loop
        (the results are copied out of the reap arrays by NumPy, not one by one)."""
        self._check_open()
        if max_results is not None and max_results < 0:
            raise ValueError(f"max_results must be >= 0 or None, got {max_results!r}")
        if self._ring is None:
            return self._stat_poll(max_results)
        self._reap()
        out = _empty_columns()
        want = max_results
        while True:
            k = self._out_count - self._out_pos
            if want is not None:
                k = min(k, want)
            if k <= 0:
                return out
            cols = self._hand_out(k)
            for mine, more in zip(out, cols):
                mine.extend(more)
            if want is None:
                return out
            want -= len(cols.tokens)  # fewer than k when take() had handed some out

    def _hand_out(self, k: int) -> ProbeColumns:
        """The next `k` reaped results, less those take() handed out already."""
        pos = self._out_pos
        ffi = self._ffi
        tags = np.frombuffer(ffi.buffer(self._out_tag + pos, 8 * k), dtype=np.uint64)
        res = np.frombuffer(ffi.buffer(self._out_res + pos, 4 * k), dtype=np.int32)
        size = np.frombuffer(ffi.buffer(self._out_size + pos, 8 * k), dtype=np.uint64)
        mode = np.frombuffer(ffi.buffer(self._out_mode + pos, 4 * k), dtype=np.uint32)
        nlink = np.frombuffer(ffi.buffer(self._out_nlink + pos, 4 * k), dtype=np.uint32)
        numbers = tags >> np.uint64(_TICKET_BITS)
        indexes = (tags & np.uint64(_INDEX_MASK)).astype(np.intp)
        if (numbers == numbers[0]).all():  # the usual case: one batch
            groups = [int(numbers[0])]
        else:
            groups = np.unique(numbers).tolist()
        keep = np.ones(k, dtype=bool)
        tokens_of: dict[int, list] = {}
        for number in groups:
            sel = None if len(groups) == 1 else numbers == number
            idx = indexes if sel is None else indexes[sel]
            batch = self._batches.get(number)
            if batch is None:  # every result of it was handed out by take()
                fresh = np.zeros(len(idx), dtype=bool)
            else:
                handed_flags = np.frombuffer(batch.handed, dtype=bool)
                fresh = ~handed_flags[idx]
                handed_flags[idx] = True
                handed = int(fresh.sum())
                batch.left -= handed
                self._unreturned -= handed
                tokens_of[number] = batch.tokens
                if batch.left == 0:
                    del self._batches[number]
            if sel is None:
                keep = fresh
            else:
                keep[sel] = fresh
        self._out_pos = pos + k
        if not keep.all():
            numbers, indexes = numbers[keep], indexes[keep]
            res, size, mode, nlink = res[keep], size[keep], mode[keep], nlink[keep]
        if len(tokens_of) == 1:
            (toks,) = tokens_of.values()
            tokens = [toks[i] for i in indexes.tolist()]
        else:
            tokens = [tokens_of[b][i] for b, i in zip(numbers.tolist(), indexes.tolist())]
        return ProbeColumns(tokens, size.tolist(), (-res).tolist(), mode.tolist(), nlink.tolist())

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
        self.wait_completed(timeout_s)
        return self.poll()

    def wait_completed(self, timeout_s: float | None = None) -> bool:
        """As :meth:`wait`, but the results stay to be handed out (by :meth:`poll`,
        :meth:`take`...). Returns True when no probe is left in flight in the kernel."""
        self._check_open()
        if timeout_s is not None and timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0 or None, got {timeout_s!r}")
        if self._ring is not None:
            self._wait_ring(timeout_s)
            return self._unreaped == 0
        return True

    def close(self) -> None:
        """Wait for every in-flight probe, then release the ring. Idempotent.

        Results not yet handed out are discarded; call :meth:`wait` first to keep them.
        Afterwards every method but :meth:`close` raises ``ValueError``.
        """
        if self._closed:
            return
        if self._ring is not None:
            self._wait_ring(None)
            self._lib.io_uring_queue_exit(self._ring)
            self._ring = None
        self._batches.clear()
        self._stat_ready.clear()
        self._unreturned = 0
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

    def _alloc_out(self, capacity: int) -> None:
        """(Re)allocate the reap arrays with room for `capacity` results, keeping the
        results not handed out yet at the front."""
        ffi = self._ffi
        pos, count = self._out_pos, self._out_count
        arrays = []
        for name, ctype in (("_out_tag", "uint64_t"), ("_out_res", "int32_t"),
                            ("_out_size", "uint64_t"), ("_out_mode", "uint32_t"),
                            ("_out_nlink", "uint32_t")):
            new = ffi.new(f"{ctype}[]", capacity)
            old = getattr(self, name, None)
            if old is not None and count > pos:
                ffi.memmove(new, old + pos, (count - pos) * ffi.sizeof(ctype))
            arrays.append((name, new))
        for name, new in arrays:
            setattr(self, name, new)
        out = ffi.new("struct pykvtier_reap_out *")
        out.tag, out.res, out.size = self._out_tag, self._out_res, self._out_size
        out.mode, out.nlink = self._out_mode, self._out_nlink
        self._reap_out = out  # what pykvtier_statx_reap writes through (one cdata per call saved)
        self._out_count = count - pos
        self._out_pos = 0
        self._out_capacity = capacity

    def _make_room(self, coming: int) -> None:
        """Ensure the reap arrays take every result not handed out plus `coming` more."""
        if self._out_pos == self._out_count:
            self._out_pos = self._out_count = 0
        unconsumed = self._out_count - self._out_pos
        need = unconsumed + coming
        if need > self._out_capacity:
            self._alloc_out(max(need, 2 * self._out_capacity))
        elif self._out_count + coming > self._out_capacity:  # room, but behind the front
            self._alloc_out(self._out_capacity)

    def _queue(self, tokens: list, paths: Any, stride: int, offsets: Any) -> int:
        ffi, lib = self._ffi, self._lib
        n = len(tokens)
        number = next(self._batch_numbers)
        first = number << _TICKET_BITS
        if not n:
            return first
        self._make_room(self._unreaped + n)
        reqs = ffi.new("struct pykvtier_statx_req[]", n)
        self._batches[number] = _Batch(tokens, paths, reqs)
        self._unreturned += n
        prepared, calls = self._prepared, self._submit_calls
        prepared[0] = 0
        calls[0] = 0
        while True:
            rc = lib.pykvtier_statx_submit(self._ring, paths, stride, offsets, reqs, n, first,
                                           lib.AT_FDCWD, self._flags, self._mask, prepared, calls)
            if rc in (-errno.EBUSY, -errno.EAGAIN) and self._reap():
                continue  # completions made room: go on with the rest
            if rc != -errno.EINTR:
                break
        self.submits += calls[0]
        queued = prepared[0]
        self.probes += n
        self._unreaped += queued
        if rc < 0:  # the kernel refused the rest: they complete with its errno
            self._fail(reqs, first, range(queued, n), -rc)
        return first

    def _fail(self, reqs: Any, first: int, indexes: range, err: int) -> None:
        """Complete never-submitted probes with `err` (appended to the reap arrays)."""
        for i in indexes:
            reqs[i].res = -err
            reqs[i].done = 1
            c = self._out_count
            self._out_tag[c] = first + i
            self._out_res[c] = -err
            self._out_size[c] = self._out_mode[c] = self._out_nlink[c] = 0
            self._out_count = c + 1

    def _flush(self) -> None:
        """Submit SQEs a failed submit left in the SQ ring. Raises ``OSError`` if refused."""
        lib = self._lib
        prepared, calls = self._prepared, self._submit_calls
        prepared[0] = 0
        calls[0] = 0
        while True:
            rc = lib.pykvtier_statx_submit(self._ring, self._ffi.NULL, 0, self._ffi.NULL,
                                           self._ffi.NULL, 0, 0, 0, 0, 0, prepared, calls)
            if rc in (-errno.EBUSY, -errno.EAGAIN) and self._reap():
                continue
            if rc != -errno.EINTR:
                break
        self.submits += calls[0]
        if rc < 0:
            raise _os_error(-rc, "io_uring_submit")

    def _reap(self, max_cqes: int | None = None) -> int:
        """Move every available CQE (at most `max_cqes`) into the reap arrays, without
        blocking (one call into C); return the count."""
        if not self._unreaped:
            return 0
        self._make_room(self._unreaped)
        c = self._out_count
        room = self._out_capacity - c
        n = self._lib.pykvtier_statx_reap(self._ring, self._mask, self._reap_out, c,
                                          room if max_cqes is None else min(room, max_cqes))
        self._out_count = c + n
        self._unreaped -= n
        return n

    def _wait_ring(self, timeout_s: float | None) -> None:
        self._flush()  # SQEs a failed submit left behind must go out before waiting
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._reap()
        while self._unreaped:
            if deadline is None:
                timeout_ns = -1
            else:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                timeout_ns = max(1, int(remaining * 1e9))
            rc = self._lib.pykvtier_wait(self._ring, self._unreaped, timeout_ns)
            if rc < 0 and rc not in (-errno.ETIME, -errno.EINTR):
                raise _os_error(-rc, "io_uring_wait_cqes")
            self._reap()

    # -- os.lstat fallback ------------------------------------------------------------------

    def _stat_batch(self, number: int, tokens: list, raws: list[bytes]) -> int:
        first = number << _TICKET_BITS
        ready = self._stat_ready
        for i, (token, raw) in enumerate(zip(tokens, raws)):
            try:
                st = os.lstat(raw)
            except OSError as exc:
                ready[first + i] = ProbeResult(token, None, exc.errno or errno.EIO, 0, 0)
            else:
                ready[first + i] = ProbeResult(token, st.st_size, 0, st.st_mode, st.st_nlink)
        self.probes += len(tokens)
        self._unreturned += len(tokens)
        return first

    def _stat_poll(self, max_results: int | None) -> ProbeColumns:
        ready = self._stat_ready
        k = len(ready) if max_results is None else min(max_results, len(ready))
        out = _empty_columns()
        for ticket in list(itertools.islice(ready, k)):
            r = ready.pop(ticket)
            out.tokens.append(r.token)
            out.sizes.append(0 if r.size_bytes is None else r.size_bytes)
            out.errors.append(r.error)
            out.modes.append(r.mode)
            out.nlinks.append(r.nlink)
        self._unreturned -= k
        return out

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("ExistenceProbe is closed")
