"""The ``bounce`` path to GPU memory: the host engine into a pinned bounce arena, then copies.

Where GPUDirect Storage is not usable, a load into a device arena goes disk -> pinned host slot
(the host engine, O_DIRECT, fixed buffers, the block header and payload checksum verified on the
host as for any host load) -> device slot (a host-to-device copy on a side CUDA stream). A job is
cut into chunks of ``chunk_blocks`` blocks, each its own host-engine job, so the copies of one
chunk overlap the reads of the next. A store runs the other way: device slot -> pinned slot (after
the work queued so far on the caller's current stream) -> a WRITE_BLOCK host job.

:class:`BounceEngine` satisfies :class:`pykvtier.engines.Engine` (entries carry device
addresses). The device side is a :class:`Copier`: :class:`TorchCopier` on a GPU,
:class:`HostCopier` (memmove between host buffers) for tests and machines without one.
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

from . import FinishedJob, Op, as_op

__all__ = ["BounceEngine", "Copier", "HostCopier", "TorchCopier"]

logger = logging.getLogger("pykvtier")

_INTERNAL = 1 << 40  # host-engine job ids of the bounce engine's own chunks
# the counters this engine keeps of its callers' jobs (the host's count its chunks)
_OWN_STATS = ("jobs_submitted", "jobs_finished", "requests_ok", "requests_failed", "bytes_read",
              "bytes_written")


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


class TorchCopier:
    """The :class:`Copier` for a CUDA torch tensor: copies on a side stream of the tensor's
    device, one CUDA event per marked copy (per chunk). Raises ValueError for a non-contiguous
    tensor, or a copy outside the arenas."""

    def __init__(self, device_tensor: Any) -> None:
        import torch

        self._torch = torch
        if not device_tensor.is_contiguous():
            raise ValueError("device arena is not contiguous")
        self.device = device_tensor.device
        self._dev = device_tensor.reshape(-1).view(torch.uint8)
        self._dev_base = int(device_tensor.data_ptr())
        self._dev_len = self._dev.numel()
        self.stream = torch.cuda.Stream(device=self.device)
        self._host: Any = None
        self._host_base = 0

    def alloc_host(self, nbytes: int) -> tuple[int, Any]:
        t = self._torch.empty(nbytes, dtype=self._torch.uint8, pin_memory=True)
        if t.data_ptr() % 4096:  # cudaHostAlloc memory is page-aligned; be sure anyway
            t = self._torch.empty(nbytes + 4096, dtype=self._torch.uint8, pin_memory=True)
        self._host, self._host_base = t, int(t.data_ptr())
        return self._host_base + (-self._host_base) % 4096, t

    def _views(self, dev_addr: int, host_addr: int, n: int) -> tuple[Any, Any]:
        d, h = dev_addr - self._dev_base, host_addr - self._host_base
        if not (0 <= d and d + n <= self._dev_len and 0 <= h and h + n <= self._host.numel()):
            raise ValueError(f"copy of {n} bytes outside the arenas (device offset {d}, host offset {h})")
        return self._dev[d:d + n], self._host[h:h + n]

    def fence(self) -> Any:
        ev = self._torch.cuda.Event()
        ev.record(self._torch.cuda.current_stream(self.device))
        return ev

    def _marked(self, mark: bool) -> Any:
        if not mark:
            return None
        ev = self._torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def h2d(self, dst: int, src: int, nbytes: int, mark: bool = True) -> Any:
        dev, host = self._views(dst, src, nbytes)
        with self._torch.cuda.stream(self.stream):
            dev.copy_(host, non_blocking=True)
            return self._marked(mark)

    def d2h(self, dst: int, src: int, nbytes: int, after: Any = None, mark: bool = True) -> Any:
        dev, host = self._views(src, dst, nbytes)
        with self._torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            host.copy_(dev, non_blocking=True)
            return self._marked(mark)

    def done(self, token: Any) -> bool:
        return token is None or bool(token.query())

    def wait(self, token: Any) -> None:
        if token is not None:
            token.synchronize()


@dataclass
class _Parent:
    """A caller's job."""

    job_id: int
    op: Any
    entries: list
    results: list
    submit_time: float
    left: int
    io: dict  # the submit keywords, passed to the host engine
    start_time: float = 0.0
    fence: Any = None


@dataclass
class _Chunk:
    parent: _Parent
    idx: list[int]  # entry indexes
    slots: list[int] = field(default_factory=list)  # bounce slots, one per entry
    tokens: list = field(default_factory=list)  # copies in flight (loads: after the read)
    host_results: list[int] = field(default_factory=list)


class BounceEngine:
    """Loads into / stores from device memory through ``host`` (a host engine) and a pinned
    bounce arena of ``bounce_slots`` slots of ``slot_bytes`` (see the module docs).

    ``chunk_blocks``: blocks per host-engine job (the overlap granularity). Loads go before
    stores. Other ops (unlink, raw read/write) pass straight to ``host``. Thread-safe; a
    background thread moves chunks along. ``host`` stays its caller's: :meth:`shutdown` stops
    this engine and unregisters its bounce arena from ``host``, which keeps running.
    ``stats()``: the host's counters, with the job and request counters of this engine's own
    jobs; :meth:`copy_stats` has the copies'. Raises ValueError for slots or chunks < 1.
    """

    def __init__(self, host: Any, copier: Copier, slot_bytes: int, bounce_slots: int = 64,
                 chunk_blocks: int = 4) -> None:
        if bounce_slots < 1 or chunk_blocks < 1:
            raise ValueError("bounce_slots and chunk_blocks must be >= 1")
        self.name = f"bounce+{host.name}"
        self.host_engine = host
        self.copier = copier
        self.slot_stride = -(-slot_bytes // 4096) * 4096
        self.bounce_slots = bounce_slots
        self.chunk_blocks = min(chunk_blocks, bounce_slots)
        self._base, self._owner = copier.alloc_host(self.slot_stride * bounce_slots)
        host.unregister_buffers()
        host.register_buffer(self._base, self.slot_stride * bounce_slots)
        host.await_buffers()
        self._free = list(range(bounce_slots - 1, -1, -1))
        self._mu = threading.Condition()
        self._waiting: deque[_Chunk] = deque()  # loads waiting for bounce slots
        self._waiting_stores: deque[_Chunk] = deque()
        self._host_jobs: dict[int, _Chunk | _Parent] = {}  # host job id -> chunk (or pass-through)
        self._copying: deque[_Chunk] = deque()  # chunks whose copies are in flight, oldest first
        self._finished: list = []
        self._outstanding = 0
        self._next_host_id = _INTERNAL
        self._closed = False
        self._own = dict.fromkeys(_OWN_STATS, 0)
        self._copy_stats = dict.fromkeys(("chunks", "h2d_copies", "d2h_copies", "copy_failures"), 0)
        self._thread = threading.Thread(target=self._loop, name="pykvtier-bounce", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the Engine interface

    def register_buffer(self, addr: int, nbytes: int) -> int:
        return 0  # device memory: nothing to register for copies

    def unregister_buffers(self) -> None:
        pass

    def await_buffers(self, timeout_s: float | None = None) -> bool:
        return True

    def submit(self, job_id: int, op: Any, entries, direct: bool = True, align: int = 4096,
               mem_align: int = 0, fsync: bool = False, file_mode: int = 0o600,
               verify: str = "payload") -> None:
        """As a host engine's submit; TypeError for an op that is not an ``Op`` member (a str
        included), ValueError for a malformed entry or one longer than a bounce slot;
        RuntimeError once shut down."""
        op = as_op(op)
        entries = list(entries)
        io = dict(direct=direct, align=align, mem_align=mem_align, fsync=fsync, file_mode=file_mode)
        if verify != "payload":
            io["verify"] = verify
        device = op in (Op.READ_BLOCK, Op.WRITE_BLOCK)
        if device:
            n, at = (4, 1) if op is Op.READ_BLOCK else (5, 2)
            for i, e in enumerate(entries):
                if len(e) != n:
                    raise ValueError(f"entry {i}: expected a tuple of {n} items for op "
                                     f"'{op.name.lower()}', got {len(e)}")
                if not 0 < e[at] <= self.slot_stride:
                    raise ValueError(f"entry {i} ({e[0]}): length {e[at]} does not fit a bounce "
                                     f"slot of {self.slot_stride} bytes")
        p = _Parent(job_id, op, entries, [0] * len(entries), time.monotonic(), len(entries), io)
        if op is Op.WRITE_BLOCK:
            p.fence = self.copier.fence()  # the caller's stream work so far: copy after it
        with self._mu:
            if self._closed:
                raise RuntimeError("engine is shut down")
            self._outstanding += 1
            if not entries:
                self._complete(p)
            elif not device:
                hid = self._host_id()
                p.start_time = time.monotonic()
                try:
                    self.host_engine.submit(hid, op, entries, **io)
                except Exception:
                    self._outstanding -= 1
                    raise
                self._host_jobs[hid] = p
            else:
                q = self._waiting if op is Op.READ_BLOCK else self._waiting_stores
                for k in range(0, len(entries), self.chunk_blocks):
                    q.append(_Chunk(p, list(range(k, min(k + self.chunk_blocks, len(entries))))))
                self._pump()
            self._own["jobs_submitted"] += 1
            self._mu.notify_all()

    def submit_blocks(self, job_id: int, op: Any, space: Any, digests: Any, slots: Any = None,
                      victims: dict[int, bytes] | None = None, options: Any = None,
                      **submit_kw: Any) -> None:
        """As a host engine's submit_blocks (``space``: the device arena's BlockSpace;
        ``options``: a ``_native.SubmitOptions`` or the keywords), through :meth:`submit` of
        ``space.entries(...)``; ValueError for victims (this engine does not recycle block
        files), as submit_blocks' and :meth:`submit`'s."""
        if options is not None:
            if submit_kw:
                raise ValueError("submit_blocks takes options (a SubmitOptions) or the option "
                                 "keywords, not both")
            submit_kw = options.as_kwargs()
        entries = space.entries(op, digests, slots, victims)
        for i in victims or ():
            raise ValueError(f"entry {i} ({entries[i][0]}): this engine does not recycle block files")
        self.submit(job_id, op, entries, **submit_kw)

    def poll(self) -> list:
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

    def shutdown(self) -> None:
        """Stops this engine after its jobs; the host engine keeps running, the bounce arena
        unregistered from it. Idempotent."""
        with self._mu:
            if self._closed:
                return
            self._mu.wait_for(lambda: self._outstanding == 0)
            self._closed = True
            self._mu.notify_all()
        self._thread.join()
        self.host_engine.unregister_buffers()

    def stats(self) -> dict[str, int]:
        s = dict(self.host_engine.stats())
        with self._mu:
            s.update(self._own)
        return s

    def copy_stats(self) -> dict[str, int]:
        """chunks (host jobs), h2d_copies, d2h_copies, copy_failures, slots_free."""
        with self._mu:
            return {**self._copy_stats, "slots_free": len(self._free)}

    def take_leftovers(self) -> list[str]:
        """The host engine's files it could not remove after a failure (each reported once)."""
        return self.host_engine.take_leftovers()

    # ------------------------------------------------------------------ internals (under _mu)

    def _host_id(self) -> int:
        hid = self._next_host_id
        self._next_host_id += 1
        return hid

    def _slot_addr(self, s: int) -> int:
        return self._base + s * self.slot_stride

    def _pump(self) -> None:
        """Starts waiting chunks that get bounce slots, loads first."""
        for q in (self._waiting, self._waiting_stores):
            while q and len(self._free) >= len(q[0].idx):
                c = q.popleft()
                c.slots = [self._free.pop() for _ in c.idx]
                p = c.parent
                if not p.start_time:
                    p.start_time = time.monotonic()
                self._copy_stats["chunks"] += 1
                if p.op is Op.READ_BLOCK:
                    entries = [(p.entries[i][0], p.entries[i][1], self._slot_addr(s), p.entries[i][3])
                               for i, s in zip(c.idx, c.slots)]
                    self._host_submit(c, entries)
                    continue
                # device -> pinned first; the write is submitted once the copies landed
                c.host_results = []
                try:
                    last = len(c.idx) - 1  # one marker per chunk: the copies complete in order
                    c.tokens = [self.copier.d2h(self._slot_addr(s), p.entries[i][3], p.entries[i][2],
                                                p.fence if k == 0 else None, mark=k == last)
                                for k, (i, s) in enumerate(zip(c.idx, c.slots))]
                    self._copy_stats["d2h_copies"] += len(c.idx)
                except Exception as exc:  # a failed copy fails the chunk's keys
                    self._copy_failed(c, exc)
                    continue
                self._copying.append(c)

    def _copy_failed(self, c: _Chunk, exc: Exception) -> None:
        logger.warning("pykvtier: bounce copy failed: %s", exc)
        self._copy_stats["copy_failures"] += 1
        self._finish_chunk(c, [-errno.EIO] * len(c.idx))

    def _count(self, p: _Parent, results: list[int]) -> None:
        moved = "bytes_read" if p.op in (Op.READ_BLOCK, Op.READ) else "bytes_written"
        for r in results:
            self._own["requests_ok" if r >= 0 else "requests_failed"] += 1
            if r > 0 and p.op is not Op.UNLINK:
                self._own[moved] += r

    def _finish_chunk(self, c: _Chunk, results: list[int]) -> None:
        p = c.parent
        for i, r in zip(c.idx, results):
            p.results[i] = r
        self._count(p, results)
        self._free.extend(c.slots)
        c.slots = []
        p.left -= len(c.idx)
        if p.left == 0:
            self._complete(p)

    def _complete(self, p: _Parent) -> None:
        now = time.monotonic()
        start = p.start_time or now
        self._outstanding -= 1
        self._own["jobs_finished"] += 1
        self._finished.append(FinishedJob(p.job_id, p.op, p.results, 1, start - p.submit_time,
                                          now - start))
        self._mu.notify_all()

    def _on_host_done(self, hid: int, results: list[int]) -> None:
        item = self._host_jobs.pop(hid)
        if isinstance(item, _Parent):  # pass-through (unlink, raw read/write)
            item.results = list(results)
            self._count(item, item.results)
            self._complete(item)
            return
        c = item
        p = c.parent
        if p.op is Op.WRITE_BLOCK:
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
                self._copy_stats["h2d_copies"] += 1
        except Exception as exc:
            self._copy_failed(c, exc)
            return
        self._copying.append(c)

    def _copies_landed(self, c: _Chunk) -> None:
        p = c.parent
        if p.op is Op.READ_BLOCK:
            self._finish_chunk(c, c.host_results)
            return
        entries = [(p.entries[i][0], p.entries[i][1], p.entries[i][2], self._slot_addr(s), p.entries[i][4])
                   for i, s in zip(c.idx, c.slots)]
        self._host_submit(c, entries)

    def _host_submit(self, c: _Chunk, entries: list) -> None:
        hid = self._host_id()
        try:
            self.host_engine.submit(hid, c.parent.op, entries, **c.parent.io)
        except Exception as exc:  # e.g. entries the host engine refuses: fail the chunk's keys
            logger.warning("pykvtier: bounce %s chunk refused by the host engine: %s",
                           c.parent.op.name.lower(), exc)
            self._finish_chunk(c, [-errno.EINVAL] * len(c.idx))
            return
        self._host_jobs[hid] = c

    def _loop(self) -> None:
        host = self.host_engine
        while True:
            progressed = False
            for job in host.poll():
                with self._mu:
                    self._on_host_done(job.job_id, job.results)
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
