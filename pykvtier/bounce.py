"""The ``bounce`` path to GPU memory: the host engine into a pinned bounce arena, then copies.

Where GPUDirect Storage is not usable (no nvidia-fs, a container, kvikio missing), a load into a
device arena goes disk -> pinned host slot (the io_uring engine, O_DIRECT, fixed buffers, the
block header and payload checksum verified on the host as for any host load) -> device slot (a
host-to-device copy on a side CUDA stream). A job is cut into chunks of ``chunk_blocks`` blocks,
each its own host-engine job, so the copies of one chunk overlap the reads of the next ("overlapped
per block", with chunk granularity). A store runs the other way: device slot -> pinned slot (after
the work queued so far on the caller's current stream) -> write_block.

:class:`BounceEngine` has the interface of ``pykvtier._native.Engine`` (entries carry device
addresses), so :class:`~pykvtier.tier.DiskTier` drives it like any engine. The device side is a
*copier* (see :class:`Copier`): :class:`pykvtier.gpu.TorchCopier` on a GPU, :class:`HostCopier` (plain
memmove between host buffers) for tests and for machines without a GPU.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol


__all__ = ["BounceEngine", "Copier", "HostCopier"]

logger = logging.getLogger("pykvtier")

_DEVICE_OPS = ("read_block", "write_block")
_INTERNAL = 1 << 40  # host-engine job ids of the bounce engine's own chunks


class Copier(Protocol):
    """Moves bytes between pinned host memory and the device arena, asynchronously.

    ``alloc_host(nbytes)`` -> (address, owner): page-aligned pinned host memory kept alive by owner.
    ``fence()`` -> a marker of the work queued so far on the caller's current stream (stores copy
    only after it), or None. ``h2d`` / ``d2h`` (dst, src, nbytes[, after][, mark]) -> a token;
    ``done(token)`` never blocks; ``wait(token)`` blocks (releasing the GIL) until that copy
    finished. Copies complete in the order they were issued; with ``mark=False`` the copier may
    return None (no marker: a later marked copy covers it), and ``done(None)`` / ``wait(None)``
    must then be True / return at once.
    """

    def alloc_host(self, nbytes: int) -> tuple[int, Any]: ...
    def fence(self) -> Any: ...
    def h2d(self, dst: int, src: int, nbytes: int, mark: bool = True) -> Any: ...
    def d2h(self, dst: int, src: int, nbytes: int, after: Any = None, mark: bool = True) -> Any: ...
    def done(self, token: Any) -> bool: ...
    def wait(self, token: Any) -> None: ...


class HostCopier:
    """A :class:`Copier` whose "device" is host memory: synchronous memmove. For tests (CPU-only
    machines exercise the whole bounce path with it) and as the protocol's reference."""

    def __init__(self) -> None:
        self.copies = 0
        self.bytes = 0
        self.fail_next = 0  # tests: the next n copies raise RuntimeError

    def alloc_host(self, nbytes: int) -> tuple[int, Any]:
        raw = bytearray(nbytes + 4096)
        base = ctypes.addressof(ctypes.c_char.from_buffer(raw))
        return base + (-base) % 4096, raw

    def fence(self) -> Any:
        return None

    def _copy(self, dst: int, src: int, nbytes: int) -> int:
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("copy failed (injected)")
        ctypes.memmove(dst, src, nbytes)
        self.copies += 1
        self.bytes += nbytes
        return self.copies

    def h2d(self, dst: int, src: int, nbytes: int, mark: bool = True) -> Any:
        return self._copy(dst, src, nbytes)

    def d2h(self, dst: int, src: int, nbytes: int, after: Any = None, mark: bool = True) -> Any:
        return self._copy(dst, src, nbytes)

    def done(self, token: Any) -> bool:
        return True

    def wait(self, token: Any) -> None:
        return None


@dataclass
class _Parent:
    """A caller's job."""

    job_id: int
    op: str
    entries: list
    results: list
    submit_time: float
    left: int
    start_time: float = 0.0
    sync: bool = False
    done_event: threading.Event | None = None
    fence: Any = None
    io: dict = field(default_factory=dict)  # direct/align/mem_align/fsync for the host engine


@dataclass
class _Chunk:
    parent: _Parent
    idx: list[int]  # entry indexes
    slots: list[int] = field(default_factory=list)  # bounce slots, one per entry
    tokens: list = field(default_factory=list)  # copies in flight (loads: after the read)
    host_results: list[int] = field(default_factory=list)


class FinishedJobsQueue:
    """The completion side of a Python engine, as ``_native.Engine``'s: finished jobs as
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


class BounceEngine(FinishedJobsQueue):
    """Loads into / stores from device memory through ``host`` (the io_uring or posix engine) and a
    pinned bounce arena of ``bounce_slots`` slots of ``slot_bytes`` (see the module docs).

    ``chunk_blocks``: blocks per host-engine job (the overlap granularity). Loads go before stores.
    Ops other than read_block / write_block (unlink) pass straight to ``host``. Thread-safe; a
    background thread moves chunks along. ``host_engine`` is kept (and shut down with this engine).
    """

    def __init__(self, host: Any, copier: Copier, slot_bytes: int, bounce_slots: int = 64,
                 chunk_blocks: int = 4) -> None:
        if bounce_slots < 1 or chunk_blocks < 1:
            raise ValueError("bounce_slots and chunk_blocks must be >= 1")
        self.host_engine = host
        self.copier = copier
        self.slot_stride = -(-slot_bytes // 4096) * 4096
        self.bounce_slots = bounce_slots
        self.chunk_blocks = min(chunk_blocks, bounce_slots)
        self.queue_depth = getattr(host, "queue_depth", 64)
        self.max_inflight_bytes = getattr(host, "max_inflight_bytes", 256 << 20)
        self._base, self._owner = copier.alloc_host(self.slot_stride * bounce_slots)
        host.unregister_buffers()
        host.register_buffer(self._base, self.slot_stride * bounce_slots)
        host.await_buffers()
        self._free = list(range(bounce_slots - 1, -1, -1))
        self._mu = threading.Condition()
        self._waiting: deque[_Chunk] = deque()  # loads (and stores) waiting for bounce slots
        self._waiting_stores: deque[_Chunk] = deque()
        self._host_jobs: dict[int, _Chunk | _Parent] = {}  # host job id -> chunk (or pass-through)
        self._copying: deque[_Chunk] = deque()  # chunks whose copies are in flight, oldest first
        self._finished: list[tuple] = []
        self._outstanding = 0
        self._next_host_id = _INTERNAL
        self._closed = False
        self._stats = dict.fromkeys(("jobs_submitted", "jobs_finished", "requests_ok", "requests_failed",
                                     "chunks", "h2d_copies", "d2h_copies", "copy_failures",
                                     "bytes_read", "bytes_written"), 0)
        self._thread = threading.Thread(target=self._loop, name="pykvtier-bounce", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the Engine interface

    def register_buffer(self, addr: int, nbytes: int) -> bool:
        return True  # device memory: nothing to register for copies

    def unregister_buffers(self) -> None:
        pass

    def await_buffers(self, timeout_s: float | None = None) -> bool:
        return True

    def submit(self, job_id: int, op: str, entries, direct: bool = True, align: int = 4096,
               mem_align: int = 0, fsync: bool = False, file_mode: int = 0o600) -> None:
        self._submit(job_id, op, list(entries), dict(direct=direct, align=align, mem_align=mem_align,
                                                     fsync=fsync, file_mode=file_mode))

    def run(self, op: str, entries, direct: bool = True, align: int = 4096, mem_align: int = 0,
            fsync: bool = False, file_mode: int = 0o600) -> list[int]:
        p = self._submit(-1, op, list(entries), dict(direct=direct, align=align, mem_align=mem_align,
                                                     fsync=fsync, file_mode=file_mode), sync=True)
        assert p.done_event is not None
        p.done_event.wait()
        return p.results

    def shutdown(self) -> None:
        with self._mu:
            if self._closed:
                return
            self._mu.wait_for(lambda: self._outstanding == 0)
            self._closed = True
            self._mu.notify_all()
        self._thread.join()
        self.host_engine.shutdown()

    def detach(self) -> None:
        """Stops this engine (after its jobs) but leaves the host engine running, its bounce buffers
        unregistered: for a tier that moves to another arena."""
        with self._mu:
            self._mu.wait_for(lambda: self._outstanding == 0)
            self._closed = True
            self._mu.notify_all()
        self._thread.join()
        self.host_engine.unregister_buffers()

    def stats(self) -> dict[str, int]:
        s = dict(self.host_engine.stats())
        with self._mu:
            s.update({f"bounce_{k}": v for k, v in self._stats.items()})
            s["bounce_slots_free"] = len(self._free)
        return s

    def take_leftovers(self) -> list[str]:
        """The host engine's files it could not remove after a failure (each reported once)."""
        take = getattr(self.host_engine, "take_leftovers", None)
        return take() if take is not None else []

    # ------------------------------------------------------------------ internals

    def _submit(self, job_id: int, op: str, entries: list, io: dict, sync: bool = False) -> _Parent:
        if op not in ("read", "write", "read_block", "write_block", "unlink"):
            raise ValueError(f"unknown op '{op}': expected read, write, read_block, write_block or unlink")
        for i, e in enumerate(entries):
            if op in _DEVICE_OPS:
                n = len(e)
                if n != (4 if op == "read_block" else 5):
                    raise ValueError(f"entry {i}: expected a tuple of {4 if op == 'read_block' else 5} "
                                     f"items for op '{op}', got {n}")
                length = e[1] if op == "read_block" else e[2]
                if not 0 < length <= self.slot_stride:
                    raise ValueError(f"entry {i} ({e[0]}): length {length} does not fit a bounce slot "
                                     f"of {self.slot_stride} bytes")
        p = _Parent(job_id, op, entries, [0] * len(entries), time.monotonic(), len(entries), sync=sync,
                    done_event=threading.Event() if sync else None, io=io)
        if op == "write_block":
            p.fence = self.copier.fence()  # the caller's stream work so far: copy after it
        with self._mu:
            if self._closed:
                raise RuntimeError("engine is shut down")
            self._outstanding += 1
            self._stats["jobs_submitted"] += 1
            if not entries:
                self._complete(p)
            elif op not in _DEVICE_OPS:
                hid = self._host_id()
                p.start_time = time.monotonic()
                try:
                    self.host_engine.submit(hid, op, entries, **io)
                except Exception:
                    self._outstanding -= 1
                    self._stats["jobs_submitted"] -= 1
                    raise
                self._host_jobs[hid] = p
            else:
                q = self._waiting if op == "read_block" else self._waiting_stores
                for k in range(0, len(entries), self.chunk_blocks):
                    q.append(_Chunk(p, list(range(k, min(k + self.chunk_blocks, len(entries))))))
                self._pump()
            self._mu.notify_all()
        return p

    def _host_id(self) -> int:
        hid = self._next_host_id
        self._next_host_id += 1
        return hid

    def _slot_addr(self, s: int) -> int:
        return self._base + s * self.slot_stride

    def _pump(self) -> None:
        """Starts waiting chunks that get bounce slots, loads first (caller holds the lock)."""
        for q in (self._waiting, self._waiting_stores):
            while q and len(self._free) >= len(q[0].idx):
                c = q.popleft()
                c.slots = [self._free.pop() for _ in c.idx]
                p = c.parent
                if not p.start_time:
                    p.start_time = time.monotonic()
                self._stats["chunks"] += 1
                if p.op == "read_block":
                    entries = [(p.entries[i][0], p.entries[i][1], self._slot_addr(s), p.entries[i][3])
                               for i, s in zip(c.idx, c.slots)]
                    self._host_submit(c, "read_block", entries)
                else:
                    # device -> pinned first; the write is submitted once the copies landed
                    c.host_results = []
                    try:
                        last = len(c.idx) - 1  # one marker per chunk: the copies complete in order
                        c.tokens = [self.copier.d2h(self._slot_addr(s), p.entries[i][3], p.entries[i][2],
                                                    p.fence if k == 0 else None, mark=k == last)
                                    for k, (i, s) in enumerate(zip(c.idx, c.slots))]
                        self._stats["d2h_copies"] += len(c.idx)
                    except Exception as exc:  # a failed copy fails the chunk's keys
                        self._copy_failed(c, exc)
                        continue
                    self._copying.append(c)

    def _copy_failed(self, c: _Chunk, exc: Exception) -> None:
        logger.warning("pykvtier: bounce copy failed: %s", exc)
        self._stats["copy_failures"] += 1
        self._finish_chunk(c, [-errno.EIO] * len(c.idx))

    def _finish_chunk(self, c: _Chunk, results: list[int]) -> None:
        p = c.parent
        for i, r in zip(c.idx, results):
            p.results[i] = r
            self._stats["requests_ok" if r >= 0 else "requests_failed"] += 1
            if r > 0:
                self._stats["bytes_read" if p.op == "read_block" else "bytes_written"] += r
        self._free.extend(c.slots)
        c.slots = []
        p.left -= len(c.idx)
        if p.left == 0:
            self._complete(p)

    def _complete(self, p: _Parent) -> None:
        now = time.monotonic()
        start = p.start_time or now
        self._outstanding -= 1
        self._stats["jobs_finished"] += 1
        if p.sync:
            assert p.done_event is not None
            p.done_event.set()
        else:
            self._finished.append((p.job_id, p.op, p.results, 1, start - p.submit_time, now - start))
        self._mu.notify_all()

    def _on_host_done(self, hid: int, results: list[int]) -> None:
        item = self._host_jobs.pop(hid)
        if isinstance(item, _Parent):  # pass-through (unlink, raw read/write)
            item.results = list(results)
            for r in results:
                self._stats["requests_ok" if r >= 0 else "requests_failed"] += 1
            self._complete(item)
            return
        c = item
        p = c.parent
        if p.op == "write_block":
            self._finish_chunk(c, list(results))
            return
        # Landed (and verified) in pinned slots: copy the good ones to the device.
        c.host_results = list(results)
        c.tokens = []
        try:
            good = [(i, s) for i, s, r in zip(c.idx, c.slots, results) if r >= 0]
            for k, (i, s) in enumerate(good):  # one marker per chunk: the copies complete in order
                c.tokens.append(self.copier.h2d(p.entries[i][2], self._slot_addr(s), p.entries[i][1],
                                                mark=k == len(good) - 1))
                self._stats["h2d_copies"] += 1
        except Exception as exc:
            self._copy_failed(c, exc)
            return
        self._copying.append(c)

    def _copies_landed(self, c: _Chunk) -> None:
        p = c.parent
        if p.op == "read_block":
            self._finish_chunk(c, c.host_results)
            return
        entries = [(p.entries[i][0], p.entries[i][1], p.entries[i][2], self._slot_addr(s), p.entries[i][4])
                   for i, s in zip(c.idx, c.slots)]
        self._host_submit(c, "write_block", entries)

    def _host_submit(self, c: _Chunk, op: str, entries: list) -> None:
        hid = self._host_id()
        try:
            self.host_engine.submit(hid, op, entries, **c.parent.io)
        except Exception as exc:  # e.g. entries the host engine refuses: fail the chunk's keys
            logger.warning("pykvtier: bounce %s chunk refused by the host engine: %s", op, exc)
            self._finish_chunk(c, [-errno.EINVAL] * len(c.idx))
            return
        self._host_jobs[hid] = c

    def _loop(self) -> None:
        host = self.host_engine
        while True:
            progressed = False
            for hid, _op, results, *_ in host.poll():
                with self._mu:
                    self._on_host_done(hid, results)
                progressed = True
            with self._mu:
                while self._copying:
                    try:
                        if not all(self.copier.done(t) for t in self._copying[0].tokens):
                            break
                    except Exception as exc:  # a failed copy (CUDA error): its chunk's keys fail
                        self._copy_failed(self._copying.popleft(), exc)
                        progressed = True
                        continue
                    self._copies_landed(self._copying.popleft())
                    progressed = True
                if progressed:
                    self._pump()
                    continue
                if self._copying:
                    oldest = self._copying[0].tokens
                elif self._host_jobs:
                    oldest = None
                else:
                    if self._closed:
                        return
                    self._mu.wait()
                    continue
            if oldest is not None:
                try:
                    for t in oldest:  # the oldest chunk's copies: short; the GIL is released
                        self.copier.wait(t)
                except Exception:
                    pass  # reported by done() on the next pass
            else:
                host.wait(None)
