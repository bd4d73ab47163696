"""The engines a :class:`~pykvtier.tier.DiskTier` drives, and the one contract they share.

Host engines are C++ (``pykvtier._native.Engine``: io_uring; ``pykvtier._native.PosixEngine``);
the Python-side ones wrap a host engine for device arenas (``pykvtier.engines.bounce``, the GPU
path dispatch in ``pykvtier.engines.gpu``). Every one of them satisfies :class:`Engine`.
:func:`run_job` is plain submit-and-wait over any of them.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Protocol, Sequence, runtime_checkable

from .. import _native

__all__ = ["STATS_KEYS", "Engine", "FinishedJob", "ForeignJobs", "Op", "as_op", "make_host_engine",
           "run_job"]

logger = logging.getLogger("pykvtier")

Op = _native.Op
FinishedJob = _native.FinishedJob
STATS_KEYS: tuple[str, ...] = tuple(_native.STATS_KEYS)


def as_op(op: Any) -> Any:
    """``op`` itself if it is an :data:`Op` member; TypeError otherwise, a str included (ops
    cross to Python as the enum only), with the message the C++ engines raise."""
    if isinstance(op, Op):
        return op
    what = type(op).__name__ + (f" {op!r}" if isinstance(op, str) else "")
    raise TypeError(f"op must be a pykvtier._native.Op (e.g. Op.READ_BLOCK), not {what}")


def make_host_engine(name: str, queue_depth: int, max_inflight_bytes: int,
                     store_share: float = 0.5) -> Any:
    """A host engine: ``name`` "uring" (io_uring; ValueError where the kernel refuses it),
    "posix" (preadv/pwritev thread pool) or "auto" (io_uring, else posix with a WARNING);
    ``store_share``: the share of its slots and bytes (posix: threads) stores may hold."""
    if name == "posix":
        return _native.PosixEngine(queue_depth=queue_depth, max_inflight_bytes=max_inflight_bytes,
                                   store_share=store_share)
    try:
        return _native.Engine(queue_depth=queue_depth, max_inflight_bytes=max_inflight_bytes,
                              store_share=store_share)
    except ValueError as exc:  # io_uring refused (old kernel, seccomp, io_uring_disabled)
        if name == "uring":
            raise
        logger.warning("pykvtier: %s; using the posix engine (preadv/pwritev thread pool)", exc)
        return _native.PosixEngine(queue_depth=queue_depth, max_inflight_bytes=max_inflight_bytes,
                                   store_share=store_share)


@runtime_checkable
class Engine(Protocol):
    """What DiskTier and the tools need of an engine.

    ``name``: "uring", "posix", "bounce+uring", "bounce+posix", "gds", "kvikio-compat".
    ``submit`` queues a job (``op``: a ``pykvtier._native.Op`` member, TypeError for a str;
    ``entries``: the op's entry tuples; ``verify``: "payload" or "header") and never blocks on
    its I/O. ``poll`` returns the jobs finished since the last call
    (``pykvtier._native.FinishedJob``: job_id, op, results, submits, queued_s, transfer_s), each
    once; ``wait(timeout_s)`` blocks, GIL released, until ``poll`` has something or nothing is
    pending (True if ``poll`` has something); ``drain``
    blocks until every submitted job finished (results stay for ``poll``). ``stats`` has exactly
    the keys ``pykvtier._native.STATS_KEYS``. Thread-safe.

    ``submit_blocks(job_id, op, space, digests, slots=None, victims=None, options=None,
    **submit_kw)`` (``options``: a ``pykvtier._native.SubmitOptions``, checked once, in place of
    the keywords; ValueError for both) queues
    the job of ``space``'s blocks (``space``: a ``pykvtier._native.BlockSpace`` of the arena the
    engine moves, host or device) that ``submit(job_id, op, space.entries(op, digests, slots,
    victims), **submit_kw)`` would: ``op`` READ_BLOCK, WRITE_BLOCK or UNLINK; ``digests`` a
    buffer of n * 16 bytes (n key digests); ``slots`` a buffer of n int64 slot numbers (None for
    UNLINK); ``victims`` (WRITE_BLOCK) None or {entry index: 16-byte digest of an evicted block
    whose file that entry recycles}. Results per entry in digest order. ValueError (TypeError for
    a wrong type) naming the argument and index before anything is queued, also for victims on
    an engine that does not recycle block files.
    """

    name: str

    def submit(self, job_id: int, op: Any, entries: Sequence[tuple], *, direct: bool = True,
               align: int = 4096, mem_align: int = 0, fsync: bool = False, file_mode: int = 0o600,
               verify: str = "payload") -> None: ...
    def submit_blocks(self, job_id: int, op: Any, space: Any, digests: Any, slots: Any = None,
                      victims: dict[int, bytes] | None = None, options: Any = None,
                      **submit_kw: Any) -> None: ...
    def poll(self) -> list: ...
    def wait(self, timeout_s: float | None = None) -> bool: ...
    def drain(self) -> None: ...
    def pending_jobs(self) -> int: ...
    def stats(self) -> dict[str, int]: ...
    def take_leftovers(self) -> list[str]: ...
    def register_buffer(self, addr: int, nbytes: int) -> int: ...
    def unregister_buffers(self) -> None: ...
    def await_buffers(self, timeout_s: float | None = None) -> bool: ...
    def shutdown(self) -> None: ...


class ForeignJobs(RuntimeError):
    """:func:`run_job` polled jobs it did not submit and was given no ``keep`` list for them.
    ``jobs``: those finished jobs (nothing is lost); ``results``: the run job's results."""

    def __init__(self, jobs: list, results: list[int]) -> None:
        super().__init__("run_job polled jobs it did not submit (ids "
                         f"{[j.job_id for j in jobs]}): pass keep=[] to collect them")
        self.jobs = jobs
        self.results = results


_ids = itertools.count((1 << 63) + (1 << 62))  # never a caller's or the bounce engine's own ids


def run_job(engine: Engine, op: Any, entries: Sequence[tuple], *, keep: list | None = None,
            **submit_kw: Any) -> list[int]:
    """Submits one job of ``entries`` to ``engine`` and blocks (in ``engine.wait``, GIL
    released) until it finished; returns its results (one int per entry: bytes moved, -errno,
    or a ``BlockError`` code). ``submit_kw``: the engine's submit keywords.

    Other jobs polled meanwhile are appended to ``keep``; without ``keep`` they raise
    :class:`ForeignJobs` (carrying them) once this job finished. Raises what ``submit`` raises
    (bad entries) before anything is queued, and TypeError for an ``op`` that is not an
    :data:`Op` member (a str included) before calling it. Any thread that owns ``engine``'s
    polling."""
    as_op(op)
    job_id = next(_ids)
    engine.submit(job_id, op, entries, **submit_kw)
    others: list = []
    while True:
        for job in engine.poll():
            if job.job_id == job_id:
                results = list(job.results)
                if others and keep is None:
                    raise ForeignJobs(others, results)
                if keep is not None:
                    keep.extend(others)
                return results
            others.append(job)
        engine.wait(None)

