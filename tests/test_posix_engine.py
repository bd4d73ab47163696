"""The C++ posix engine (pykvtier._native.PosixEngine): the io_uring engine's contract, by
plain system calls on a thread pool.

The engine-agnostic tests of test_engine.py run here again with ``engine`` a PosixEngine (same
entries, results, errors and counters); the rest checks what is the posix engine's own: its
thread count, the jobs submit() counts, shutdown with stores held back, FIFOs.
(Loads before stores and shutdown with queued work: test_engine.py, for both engines.)
Completions are awaited with run_job, drain() or wait(); no sleeps.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import numpy as np
import pytest

from pykvtier._native import Op
from pykvtier.engines import run_job
from pykvtier import _native
from pykvtier.layout import HEADER_BYTES, key_digest

from test_engine import (  # noqa: F401  (collected again here, with the fixture below)
    KiB,
    MiB,
    addr,
    drain_poll,
    file_bytes,
    test_alignment_is_the_callers,
    test_block_verification_results,
    test_buffered_path_takes_unaligned_memory,
    test_failed_exclusive_open_leaves_foreign_temporary_alone,
    test_malformed_entries,
    test_misaligned_direct_entry_rejected_before_any_io,
    test_missing_file_fails_only_its_entry,
    test_raw_write_with_rename_target,
    test_short_reads_are_never_success,
    test_write_block_keeps_existing_final_file,
)

PosixEngine = _native.PosixEngine


@pytest.fixture
def engine():
    e = PosixEngine(queue_depth=16)
    yield e
    e.shutdown()


@pytest.mark.parametrize("size", [4 * KiB, 256 * KiB, 2 * MiB], ids=["4K", "256K", "2M"])
def test_block_and_raw_round_trip(direct_root, aligned, engine, size):
    n = 5
    src = aligned(n * size)
    src.view(np.uint32)[:] = np.arange(src.nbytes // 4, dtype=np.uint32) * np.uint32(2654435761)
    dst = aligned(n * size)
    paths = [os.path.join(direct_root, f"b{i}.kvb") for i in range(n)]
    digests = [key_digest(b"k%d" % i) for i in range(n)]
    engine.submit(1, Op.WRITE_BLOCK, [(p + ".t", p, size, addr(src) + i * size, digests[i])
                                     for i, p in enumerate(paths)])
    assert drain_poll(engine) == {1: (Op.WRITE_BLOCK, [size] * n, 0)}  # 0: no io_uring_submit
    assert sorted(os.listdir(direct_root)) == sorted(os.path.basename(p) for p in paths)
    for i, p in enumerate(paths):
        assert file_bytes(p)[HEADER_BYTES:] == src[i * size : (i + 1) * size].tobytes()
    # read back in reverse into other slots
    engine.submit(2, Op.READ_BLOCK, [(p, size, addr(dst) + (n - 1 - i) * size, digests[i])
                                    for i, p in enumerate(paths)])
    assert drain_poll(engine) == {2: (Op.READ_BLOCK, [size] * n, 0)}
    for i in range(n):
        assert np.array_equal(dst[(n - 1 - i) * size : (n - i) * size], src[i * size : (i + 1) * size])
    raw = os.path.join(direct_root, "raw")
    assert run_job(engine, Op.WRITE, [(raw, size, size, addr(src)), (raw + "2", 0, size, addr(src) + size)]) == [size] * 2
    assert run_job(engine, Op.READ, [(raw, size, size, addr(dst))]) == [size]
    assert np.array_equal(dst[:size], src[:size])
    s = engine.stats()
    assert s["jobs_submitted"] == s["jobs_finished"] == 4
    assert s["requests_ok"] == 2 * n + 3 and s["requests_failed"] == 0
    assert s["bytes_written"] == (n + 2) * size and s["bytes_read"] == (n + 1) * size
    assert s["submits"] == s["sqes"] == s["fixed_buffer_ios"] == 0


def test_threads_are_bounded_by_queue_depth_and_checked():
    for qd, threads, want in [(16, 4, 4), (2, 8, 2), (64, 1, 1), (64, None, 16), (8, None, 8)]:
        e = PosixEngine(queue_depth=qd, **({} if threads is None else {"threads": threads}))
        try:
            assert e.threads == want and e.queue_depth == qd
        finally:
            e.shutdown()
    with pytest.raises(ValueError, match="store_share"):
        PosixEngine(store_share=1.5)
    with pytest.raises(ValueError, match=r"threads must be in 1\.\.4096"):
        PosixEngine(threads=0)
    with pytest.raises(ValueError, match=r"threads must be in 1\.\.4096"):
        PosixEngine(threads=5000)
    with pytest.raises(ValueError, match=r"queue_depth must be in 1\.\.4096"):
        PosixEngine(queue_depth=5000)


def test_fixed_buffer_calls_are_accepted_and_do_nothing(aligned, engine):
    buf = aligned(4 * KiB)
    assert engine.register_buffer(addr(buf), buf.nbytes) == 0
    assert engine.await_buffers(0.0) is True
    engine.unregister_buffers()
    assert engine.stats()["buffer_registration_failures"] == 0


def test_unlink_and_empty_jobs(root, engine):
    paths = [os.path.join(root, f"u{i}") for i in range(3)]
    for p in paths[:2]:
        with open(p, "wb") as f:
            f.write(b"x")
    assert run_job(engine, Op.UNLINK, [paths[0], (paths[1],), paths[2]], direct=False) == [0, 0, -errno.ENOENT]
    assert os.listdir(root) == []
    assert run_job(engine, Op.READ, []) == []
    engine.submit(7, Op.UNLINK, [paths[0]])
    engine.submit(8, Op.READ, [])
    assert drain_poll(engine) == {7: (Op.UNLINK, [-errno.ENOENT], 0), 8: (Op.READ, [], 0)}
    s = engine.stats()
    assert s["requests_ok"] == 2 and s["requests_failed"] == 2


_SHUTDOWN_SCRIPT = r"""
import mmap, os, sys
import numpy as np
from pykvtier import _native
from pykvtier._native import Op
from pykvtier.layout import key_digest
root = sys.argv[1]
# 4 threads, stores may hold 1: three threads sleep on the store limit while one writes
e = _native.PosixEngine(threads=4, store_share=0.25)
m = mmap.mmap(-1, 64 << 10)
a = np.frombuffer(m, dtype=np.uint8).ctypes.data
e.submit(1, Op.WRITE_BLOCK, [(f"{root}/b{i}.t", f"{root}/b{i}", 64 << 10, a, key_digest(b"%d" % i))
                            for i in range(200)])
e.submit(2, Op.UNLINK, [f"{root}/none{i}" for i in range(50)])
e.shutdown()  # no drain first: the queued requests finish, then every thread stops
got = {jid: results for jid, _op, results, *_ in e.poll()}
assert got[1] == [64 << 10] * 200 and got[2] == [-2] * 50, got
del e
e = _native.PosixEngine(threads=16)
e.submit(3, Op.WRITE_BLOCK, [(f"{root}/c{i}.t", f"{root}/c{i}", 64 << 10, a, key_digest(b"c%d" % i))
                            for i in range(100)])
del e  # the destructor: same path, with the jobs unpolled
print(len(os.listdir(root)))
"""


def test_shutdown_with_stores_queued_beyond_the_store_limit(root):
    """Threads asleep on the store limit wake to stop when the last queued request is taken
    (in a child: a lost wake-up would hang the interpreter; timeout only as a deadlock guard)."""
    proc = subprocess.run([sys.executable, "-c", _SHUTDOWN_SCRIPT, root], capture_output=True,
                          text=True, cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert proc.stdout.split() == ["300"]  # 200 + 100 blocks, no temporaries


def test_never_waits_on_a_fifo_and_reads_what_io_uring_reads(root, aligned, engine):
    buf = aligned(8 * KiB, fill=9)
    fifo = os.path.join(root, "fifo")
    os.mkfifo(fifo)
    # an in-place write to a FIFO without a reader: the open does not wait for one
    assert run_job(engine, Op.WRITE, [(fifo, 0, 4096, addr(buf))], direct=False) == [-errno.ENXIO]
    # reads: the open does not wait for a writer; the positioned read of a FIFO fails
    assert run_job(engine, Op.READ, [(fifo, 0, 4096, addr(buf))], direct=False) == [-errno.ESPIPE]
    assert run_job(engine, Op.READ_BLOCK, [(fifo, 4096, addr(buf), key_digest(b"f"))],
                      direct=False) == [-errno.ESPIPE]
    # not a regular file, read as the io_uring engine reads it
    ref = _native.Engine(queue_depth=4)
    try:
        for path, op in [(root, Op.READ), ("/dev/zero", Op.READ), ("/dev/zero", Op.READ_BLOCK),
                         ("/dev/null", Op.READ_BLOCK)]:
            entry = ((path, 0, 4096, addr(buf)) if op == Op.READ
                     else (path, 4096, addr(buf), key_digest(b"z")))
            assert run_job(engine, op, [entry], direct=False) == run_job(ref, op, [entry], direct=False), (path, op)
    finally:
        ref.shutdown()
