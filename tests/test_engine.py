"""The C++ io_uring engine (pykvtier._native.Engine): data, results, submit counts.

Every completion is awaited with ``pykvtier.engines.run_job`` (submit, then ``wait()`` until
polled), ``drain()`` or ``wait()``; no sleeps.
Byte-exact checks compare whole buffers; submit counts come from the engine's own counters
(``stats()["submits"]``: io_uring_submit calls carrying SQEs) and the per-job ``submits`` that
``poll()`` reports.
"""

from __future__ import annotations

import errno
import os
import time
import re
import stat
import struct
import subprocess
import sys

import numpy as np
import pytest

from pykvtier._native import Op
from pykvtier.engines import run_job
from pykvtier import _native
from pykvtier.layout import HEADER_BYTES, key_digest, read_header

Engine = _native.Engine


def op_id(value):
    """Test ids: an Op as its lower-case name ("read_block"), anything else pytest's default."""
    return value.name.lower() if isinstance(value, Op) else None


KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SIZES = [4 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 2 * MiB, 8 * MiB]
SIZE_IDS = ["4K", "64K", "256K", "1M", "2M", "8M"]


def addr(a: np.ndarray) -> int:
    return a.ctypes.data


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def file_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def drain_poll(e) -> dict:
    """drain(), then poll(): {job_id: (op: Op, results, submits)}; each job id must come once."""
    e.drain()
    out = {}
    for job in e.poll():
        assert isinstance(job, _native.FinishedJob) and isinstance(job.op, Op)
        assert job.job_id not in out, f"job {job.job_id} reported twice"
        assert job.queued_s >= 0 and job.transfer_s >= 0
        out[job.job_id] = (job.op, list(job.results), job.submits)
    assert e.pending_jobs() == 0
    return out


@pytest.fixture
def engine():
    e = Engine(queue_depth=16)
    yield e
    e.shutdown()


# ------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("fixed", [False, True], ids=["plain", "fixed"])
@pytest.mark.parametrize("size", SIZES, ids=SIZE_IDS)
def test_raw_round_trip(direct_root, aligned, engine, size, fixed):
    n = 3
    src = aligned(n * size, fill=size)
    dst = aligned(n * size)
    if fixed:
        engine.register_buffer(addr(src), src.nbytes)
        engine.register_buffer(addr(dst), dst.nbytes)
    a = os.path.join(direct_root, "a")
    b = os.path.join(direct_root, "b")
    # two pieces in one file (at 0 and at `size`), one in another
    writes = [(a, 0, size, addr(src)), (a, size, size, addr(src) + size), (b, 0, size, addr(src) + 2 * size)]
    assert run_job(engine, Op.WRITE, writes) == [size] * n
    assert file_bytes(a) == src[: 2 * size].tobytes()
    assert file_bytes(b) == src[2 * size :].tobytes()
    # a store: one submit for the batch's opens (regular descriptors), then the chains (data,
    # close) as the opens come in: one submit for all of them at best, one each at worst
    w = engine.stats()
    assert 2 <= w["submits"] <= 1 + n

    # read back in another order into other places
    reads = [(b, 0, size, addr(dst)), (a, size, size, addr(dst) + size), (a, 0, size, addr(dst) + 2 * size)]
    assert run_job(engine, Op.READ, reads) == [size] * n
    assert np.array_equal(dst[:size], src[2 * size :])
    assert np.array_equal(dst[size : 2 * size], src[size : 2 * size])
    assert np.array_equal(dst[2 * size :], src[:size])

    s = engine.stats()
    assert s["fixed_buffer_ios"] == (2 * n if fixed else 0)
    assert s["bytes_written"] == s["bytes_read"] == n * size
    assert s["requests_ok"] == 2 * n and s["requests_failed"] == 0
    assert s["jobs_submitted"] == s["jobs_finished"] == 2
    assert s["submits"] - w["submits"] == 1  # a load: one per batch (3 requests fit the ring)
    assert s["sqes"] == 2 * n * 3  # open, data, close per request


@pytest.mark.parametrize("fixed", [False, True], ids=["plain", "fixed"])
@pytest.mark.parametrize("size", SIZES, ids=SIZE_IDS)
def test_block_round_trip(direct_root, aligned, engine, size, fixed):
    n = 3
    src = aligned(n * size, fill=size + 1)
    dst = aligned(n * size)
    if fixed:
        engine.register_buffer(addr(src), src.nbytes)
        engine.register_buffer(addr(dst), dst.nbytes)
    keys = [b"key-%d" % i for i in range(n)]
    digests = [key_digest(k) for k in keys]
    finals = [os.path.join(direct_root, f"{i}.kvb") for i in range(n)]
    tmps = [f + ".tmp" for f in finals]
    writes = [(tmps[i], finals[i], size, addr(src) + i * size, digests[i]) for i in range(n)]
    assert run_job(engine, Op.WRITE_BLOCK, writes) == [size] * n

    for i in range(n):
        assert not os.path.exists(tmps[i])
        raw = file_bytes(finals[i])
        assert len(raw) == HEADER_BYTES + size
        assert raw[HEADER_BYTES:] == src[i * size : (i + 1) * size].tobytes()
        assert raw[56:HEADER_BYTES] == bytes(HEADER_BYTES - 56)  # zero padding
        h = read_header(finals[i])
        assert h.header_ok()
        assert h.magic == _native.MAGIC and h.version == _native.FORMAT_VERSION
        assert h.header_bytes == HEADER_BYTES and h.payload_bytes == size
        assert h.key_digest == digests[i]
        assert h.payload_xxh3 == _native.xxh3_64(src[i * size : (i + 1) * size])

    order = [2, 0, 1]
    reads = [(finals[j], size, addr(dst) + k * size, digests[j]) for k, j in enumerate(order)]
    assert run_job(engine, Op.READ_BLOCK, reads) == [size] * n
    for k, j in enumerate(order):
        assert np.array_equal(dst[k * size : (k + 1) * size], src[j * size : (j + 1) * size])

    s = engine.stats()
    # A new block file is written by one WRITEV (header + payload, plain pages); loads read the
    # payload from the registered buffers.
    assert s["fixed_buffer_ios"] == (n if fixed else 0)
    assert s["rename_existing"] == 0 and s["verify_failures"] == 0
    assert s["bytes_written"] == s["bytes_read"] == n * size
    assert s["requests_ok"] == 2 * n and s["requests_failed"] == 0


def test_fixed_buffers_only_inside_registered_region(direct_root, aligned, engine):
    size = 64 * KiB
    inside = aligned(2 * size, fill=1)
    outside = aligned(size, fill=2)
    engine.register_buffer(addr(inside), inside.nbytes)
    p = os.path.join(direct_root, "f")
    res = run_job(engine, Op.WRITE, [(p, 0, size, addr(inside)), (p, size, size, addr(inside) + size),
                               (p, 2 * size, size, addr(outside))])
    assert res == [size] * 3
    assert engine.stats()["fixed_buffer_ios"] == 2
    engine.unregister_buffers()
    back = aligned(3 * size)
    assert run_job(engine, Op.READ, [(p, 0, 3 * size, addr(back))]) == [3 * size]
    assert engine.stats()["fixed_buffer_ios"] == 2  # unregistered: plain reads again
    assert back.tobytes() == inside.tobytes() + outside.tobytes()


def test_fixed_buffers_used_by_submit_workers(direct_root, aligned):
    size = 256 * KiB
    e = Engine(queue_depth=8)
    try:
        src = aligned(4 * size, fill=3)
        dst = aligned(4 * size)
        e.register_buffer(addr(src), src.nbytes)
        e.register_buffer(addr(dst), dst.nbytes)
        paths = [os.path.join(direct_root, f"w{i}") for i in range(4)]
        e.submit(1, Op.WRITE, [(p, 0, size, addr(src) + i * size) for i, p in enumerate(paths)])
        assert drain_poll(e) == {1: (Op.WRITE, [size] * 4, 1)}
        e.submit(2, Op.READ, [(p, 0, size, addr(dst) + i * size) for i, p in enumerate(paths)])
        assert drain_poll(e) == {2: (Op.READ, [size] * 4, 1)}
        assert np.array_equal(src, dst)
        assert e.stats()["fixed_buffer_ios"] == 8
    finally:
        e.shutdown()


def test_buffered_path_takes_unaligned_memory(root, aligned, engine):
    """direct=False: any address, length and offset (the fallback where O_DIRECT is refused)."""
    length = 3 * 4096 + 7
    src = aligned(length + 64, fill=9)
    dst = aligned(length + 64)
    p = os.path.join(root, "buffered")
    entry = (p, 3, length, addr(src) + 1)
    with pytest.raises(ValueError, match=r"^entry 0 "):
        run_job(engine, Op.WRITE, [entry], direct=True)  # what the buffered path exists for
    assert not os.path.exists(p)
    assert run_job(engine, Op.WRITE, [entry], direct=False) == [length]
    raw = file_bytes(p)
    assert raw == bytes(3) + src[1 : 1 + length].tobytes()
    assert run_job(engine, Op.READ, [(p, 3, length, addr(dst) + 5)], direct=False) == [length]
    assert np.array_equal(dst[5 : 5 + length], src[1 : 1 + length])
    assert not dst[:5].any() and not dst[5 + length :].any()  # nothing outside the request

    # blocks too: unaligned payload length and memory, header at 0, payload at 4096
    key = key_digest(b"k")
    final = os.path.join(root, "blk.kvb")
    assert run_job(engine, Op.WRITE_BLOCK, [(final + ".tmp", final, length, addr(src) + 1, key)],
                      direct=False) == [length]
    dst[:] = 0
    assert run_job(engine, Op.READ_BLOCK, [(final, length, addr(dst) + 3, key)], direct=False) == [length]
    assert np.array_equal(dst[3 : 3 + length], src[1 : 1 + length])


# ------------------------------------------------------------------------- errors per entry


@pytest.mark.parametrize("op", [Op.READ, Op.READ_BLOCK], ids=op_id)
def test_missing_file_fails_only_its_entry(direct_root, aligned, engine, op):
    size = 64 * KiB
    src = aligned(3 * size, fill=4)
    dst = aligned(3 * size)
    paths = [os.path.join(direct_root, f"f{i}") for i in range(3)]
    digests = [key_digest(b"%d" % i) for i in range(3)]
    if op == Op.READ:
        writes = [(p, 0, size, addr(src) + i * size) for i, p in enumerate(paths)]
        assert run_job(engine, Op.WRITE, writes) == [size] * 3
    else:
        writes = [(p + ".t", p, size, addr(src) + i * size, digests[i]) for i, p in enumerate(paths)]
        assert run_job(engine, Op.WRITE_BLOCK, writes) == [size] * 3
    os.unlink(paths[1])
    before = engine.stats()
    if op == Op.READ:
        entries = [(p, 0, size, addr(dst) + i * size) for i, p in enumerate(paths)]
    else:
        entries = [(p, size, addr(dst) + i * size, digests[i]) for i, p in enumerate(paths)]
    dst[size : 2 * size] = 0xAB
    assert run_job(engine, op, entries) == [size, -errno.ENOENT, size]
    assert np.array_equal(dst[:size], src[:size])
    assert np.array_equal(dst[2 * size :], src[2 * size :])
    assert (dst[size : 2 * size] == 0xAB).all()  # nothing landed for the failed entry
    d = delta(engine.stats(), before)
    assert d["requests_ok"] == 2 and d["requests_failed"] == 1
    assert d["bytes_read"] == 2 * size and d["verify_failures"] == 0


@pytest.mark.parametrize("what", ["address", "length", "offset"])
@pytest.mark.parametrize("via", ["run", "submit"])
def test_misaligned_direct_entry_rejected_before_any_io(direct_root, aligned, engine, what, via):
    buf = aligned(4 * 8192, fill=5)
    good = os.path.join(direct_root, "good")
    bad = os.path.join(direct_root, "bad")
    entry = {
        "address": (bad, 0, 8192, addr(buf) + 512),
        "length": (bad, 0, 8192 + 512, addr(buf)),
        "offset": (bad, 512, 8192, addr(buf)),
    }[what]
    needle = {
        "address": rf"host address {hex(addr(buf) + 512)} is not a multiple of 4096 bytes",
        "length": r"length 8704 is not a multiple of 4096 bytes",
        "offset": r"file offset 512 is not a multiple of 4096 bytes",
    }[what]
    entries = [(good, 0, 8192, addr(buf)), entry]
    with pytest.raises(ValueError) as ei:
        if via == "run":
            run_job(engine, Op.WRITE, entries)
        else:
            engine.submit(1, Op.WRITE, entries)
    msg = str(ei.value)
    assert msg.startswith(f"entry 1 ({bad}): "), msg
    assert re.search(needle, msg), msg
    assert "O_DIRECT" in msg
    # nothing was queued or written, not even the valid entry 0
    assert not os.path.exists(good) and not os.path.exists(bad)
    s = engine.stats()
    assert s["jobs_submitted"] == 0 and s["submits"] == 0 and s["sqes"] == 0
    assert engine.pending_jobs() == 0 and engine.poll() == []


def test_alignment_is_the_callers(direct_root, aligned, engine, storage_base):
    """align / mem_align narrow the check to what the file system needs (statx DIOALIGN)."""
    probe = storage_base[1]
    al = int(probe["offset_align"])
    if al >= 4096:
        pytest.skip(f"this file system needs {al}-byte O_DIRECT alignment; nothing finer to test")
    buf = aligned(4 * 4096, fill=6)
    p = os.path.join(direct_root, "fine")
    assert run_job(engine, Op.WRITE, [(p, al, 4096 + al, addr(buf) + al)], align=al,
                      mem_align=int(probe["mem_align"])) == [4096 + al]
    assert file_bytes(p)[al:] == buf[al : 4096 + 2 * al].tobytes()


@pytest.mark.parametrize(
    ("op", "entry", "needle"),
    [
        (Op.READ, ("p", 0, 4096), r"entry 0: expected a tuple of 4 items for op 'read', got 3"),
        (Op.READ_BLOCK, ("p", 4096, 1, b"x" * 16, 0), r"entry 0: expected a tuple of 4 items"),
        (Op.READ_BLOCK, ("p", 4096, 4096, b"short"), r"entry 0 \(p\): key digest must be 16 bytes"),
        (Op.READ, ("p", 0, 0, 4096), r"entry 0 \(p\): length is 0"),
        (Op.READ, ("p", 0, GiB + 4096, 4096), r"entry 0 \(p\): length 1073745920 exceeds the 1 GiB"),
        (Op.READ, ("p", 0, 4096, 0), r"entry 0 \(p\): host address is NULL"),
    ],
    ids=op_id,
)
def test_malformed_entries(engine, op, entry, needle):
    with pytest.raises(ValueError, match=needle):
        run_job(engine, op, [entry], direct=False)
    assert engine.stats()["jobs_submitted"] == 0


@pytest.mark.parametrize("cls", ["Engine", "PosixEngine"])
@pytest.mark.parametrize("op", [Op.READ, Op.READ_BLOCK, Op.WRITE, Op.WRITE_BLOCK, Op.UNLINK], ids=op_id)
def test_paths_the_kernel_cannot_take_are_rejected_before_any_io(root, aligned, cls, op):
    """An empty path, a NUL byte or PATH_MAX bytes fail before the ring (io_uring would fail
    them while preparing the open, cancelling the rest of the chain without completions)."""
    e = getattr(_native, cls)(queue_depth=4)
    buf = aligned(4096)
    good = os.path.join(root, "good")
    long_ = "/" + "/".join(["d" * 200] * 21)[: 4094] + "x"  # 4096 bytes
    assert len(long_) == 4096

    def entry(path, target=None, recycle=None):
        if op == Op.UNLINK:
            return path
        if op in (Op.READ, Op.WRITE):
            return (path, 0, 4096, addr(buf)) + ((target,) if target is not None else ())
        if op == Op.READ_BLOCK:
            return (path, 4096, addr(buf), key_digest(b"k"))
        return (path, target if target is not None else good + ".kvb", 4096, addr(buf), key_digest(b"k"),
                recycle if recycle is not None else "")

    cases = [(entry(""), "path is empty"), (entry(good + "\0x"), "path contains a NUL byte"),
             (entry(long_), "path is 4096 bytes, not shorter than PATH_MAX")]
    if op in (Op.WRITE, Op.WRITE_BLOCK):
        cases.append((entry(good, target=good + "\0"), "rename target contains a NUL byte"))
    if op == Op.WRITE_BLOCK:
        cases.append((entry(good, recycle=long_), "recycle path is 4096 bytes"))
    try:
        for bad, needle in cases:
            for via in ("run", "submit"):
                with pytest.raises(ValueError, match=r"^entry 1 \(.*\): " + needle):
                    if via == "run":
                        run_job(e, op, [entry(good), bad], direct=False)
                    else:
                        e.submit(1, op, [entry(good), bad], direct=False)
        assert os.listdir(root) == [] and e.stats()["jobs_submitted"] == 0
        # one byte shorter reaches the kernel, which answers per entry (its directories do not exist)
        res = run_job(e, op, [entry(long_[:4095])], direct=False)
        assert res == [-errno.ENOENT]
    finally:
        e.shutdown()


def op_type_error(what: str) -> str:
    """The TypeError's text for an op that is not an Op member (what: "str 'read_block'")."""
    return f"op must be a pykvtier._native.Op (e.g. Op.READ_BLOCK), not {what}"


def test_op_names_are_a_type_error(root, aligned, any_engine):
    """Ops cross to Python as the enum only: submit with an op's name (or anything else not an
    Op) is a TypeError naming it, and nothing is queued, run or written."""
    buf = aligned(4096, fill=3)
    p = os.path.join(root, "f")
    entries = {
        Op.READ: (p, 0, 4096, addr(buf)),
        Op.WRITE: (p, 0, 4096, addr(buf)),
        Op.READ_BLOCK: (p, 4096, addr(buf), key_digest(b"k")),
        Op.WRITE_BLOCK: (p + ".t", p, 4096, addr(buf), key_digest(b"k")),
        Op.UNLINK: p,
    }
    before = any_engine.stats()
    for op, entry in entries.items():
        name = op.name.lower()
        for bad in (name, op.name, "Op." + op.name):
            with pytest.raises(TypeError) as ei:
                any_engine.submit(1, bad, [entry], direct=False)
            assert str(ei.value) == op_type_error(f"str {bad!r}")
    for bad, what in ((int(Op.READ), "int"), (None, "NoneType"), (b"read", "bytes")):
        with pytest.raises(TypeError) as ei:
            any_engine.submit(1, bad, [entries[Op.READ]], direct=False)
        assert str(ei.value) == op_type_error(what)
    assert any_engine.stats() == before and before["jobs_submitted"] == 0
    assert any_engine.pending_jobs() == 0 and any_engine.poll() == [] and any_engine.wait(0) is False
    assert os.listdir(root) == []


def test_unknown_op_and_bad_align(engine):
    with pytest.raises(TypeError, match=re.escape(op_type_error("str 'copy'"))):
        run_job(engine, "copy", [])
    with pytest.raises(ValueError, match="align must be a power of two"):
        run_job(engine, Op.READ, [], align=3000)
    with pytest.raises(ValueError, match="mem_align must be a power of two"):
        run_job(engine, Op.READ, [], mem_align=3000)
    with pytest.raises(ValueError, match="queue_depth must be in 1..4096"):
        Engine(queue_depth=0)


def test_short_reads_are_never_success(direct_root, aligned, engine):
    size = 64 * KiB
    src = aligned(size, fill=7)
    dst = aligned(2 * size)
    raw_path = os.path.join(direct_root, "short")
    with open(raw_path, "wb") as f:
        f.write(src[:10000].tobytes())  # 10000 bytes: not even a whole 4 KiB unit at the end
    before = engine.stats()
    res = run_job(engine, Op.READ, [
        (raw_path, 0, 16384, addr(dst)),      # file ends inside the request (direct)
        (raw_path, 16384, 4096, addr(dst)),   # starts past the end
        (raw_path, 0, 8192, addr(dst)),       # wholly inside: fine
    ])
    assert res == [_native.ERR_SHORT, _native.ERR_SHORT, 8192]
    assert run_job(engine, Op.READ, [(raw_path, 0, 10001, addr(dst) + 1)], direct=False) == [_native.ERR_SHORT]
    assert run_job(engine, Op.READ, [(raw_path, 0, 10000, addr(dst) + 1)], direct=False) == [10000]

    digest = key_digest(b"blk")
    blocks = [os.path.join(direct_root, f"b{i}.kvb") for i in range(4)]
    assert run_job(engine, Op.WRITE_BLOCK, [(b + ".t", b, size, addr(src), digest) for b in blocks]) == [size] * 4
    os.truncate(blocks[0], HEADER_BYTES + size // 2)   # payload cut
    os.truncate(blocks[1], HEADER_BYTES)               # header only
    os.truncate(blocks[2], 100)                        # not even a header
    os.truncate(blocks[3], 0)                          # empty
    res = run_job(engine, Op.READ_BLOCK, [(b, size, addr(dst), digest) for b in blocks])
    assert res == [_native.ERR_SHORT] * 4
    d = delta(engine.stats(), before)
    assert d["requests_failed"] == 2 + 1 + 4 and d["requests_ok"] == 1 + 1 + 4
    assert d["bytes_read"] == 8192 + 10000  # failed requests move no counted bytes
    assert d["verify_failures"] == 0  # a short file is not a verification failure


def test_block_verification_results(direct_root, aligned, engine):
    size = 64 * KiB
    src = aligned(2 * size, fill=8)
    d1, d2 = key_digest(b"one"), key_digest(b"two")
    p = [os.path.join(direct_root, f"v{i}.kvb") for i in range(5)]
    assert run_job(engine, Op.WRITE_BLOCK, [(x + ".t", x, size, addr(src), d1) for x in p]) == [size] * 5
    small = os.path.join(direct_root, "small.kvb")
    assert run_job(engine, Op.WRITE_BLOCK, [(small + ".t", small, size // 2, addr(src), d1)]) == [size // 2]

    def flip(path, off):
        with open(path, "r+b") as f:
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0x01]))

    flip(p[1], HEADER_BYTES + 12345)  # payload byte
    flip(p[2], 0)                     # magic
    flip(p[3], 16)                    # payload_bytes field: caught by the header checksum
    # each request its own destination: verification hashes the bytes that landed there
    dst = aligned(7 * size)
    slot = [addr(dst) + i * size for i in range(7)]
    res = run_job(engine, Op.READ_BLOCK, [
        (p[0], size, slot[0], d2),          # whole block of another key
        (p[1], size, slot[1], d1),
        (p[2], size, slot[2], d1),
        (p[3], size, slot[3], d1),
        (p[4], size // 2, slot[4], d1),     # header says 64 KiB, caller expects 32 KiB
        (small, size, slot[5], d1),         # file shorter than the caller expects
        (p[4], size, slot[6], d1),          # intact
    ])
    assert res == [_native.ERR_KEY_MISMATCH, _native.ERR_CHECKSUM, _native.ERR_BAD_HEADER,
                   _native.ERR_BAD_HEADER, _native.ERR_LENGTH, _native.ERR_SHORT, size]
    assert np.array_equal(dst[6 * size :], src[:size])
    assert engine.stats()["verify_failures"] == 5


# ------------------------------------------------------------------------- writes, renames, unlink


def test_write_block_keeps_existing_final_file(direct_root, aligned, engine):
    size = 64 * KiB
    first = aligned(size, fill=10)
    second = aligned(size, fill=11)
    digest = key_digest(b"same key")
    final = os.path.join(direct_root, "x.kvb")
    assert run_job(engine, Op.WRITE_BLOCK, [(final + ".tmp.1", final, size, addr(first), digest)]) == [size]
    original = file_bytes(final)
    ino = os.stat(final).st_ino
    # another writer of the same (content-addressed) block: its rename finds ours in place
    assert run_job(engine, Op.WRITE_BLOCK, [(final + ".tmp.2", final, size, addr(second), digest)]) == [size]
    assert engine.stats()["rename_existing"] == 1
    assert file_bytes(final) == original and os.stat(final).st_ino == ino
    assert sorted(os.listdir(direct_root)) == ["x.kvb"]  # the duplicate temporary is gone


def test_raw_write_with_rename_target(direct_root, aligned, engine):
    size = 256 * KiB
    a = aligned(size, fill=12)
    b = aligned(size, fill=13)
    target = os.path.join(direct_root, "target")
    assert run_job(engine, Op.WRITE, [(target + ".t1", 0, size, addr(a), target)]) == [size]
    assert file_bytes(target) == a.tobytes()
    assert run_job(engine, Op.WRITE, [(target + ".t2", 0, size, addr(b), target)]) == [size]
    assert engine.stats()["rename_existing"] == 1
    assert file_bytes(target) == a.tobytes()
    assert sorted(os.listdir(direct_root)) == ["target"]


def test_write_block_fsync(direct_root, aligned, engine):
    size = 64 * KiB
    src = aligned(size, fill=14)
    final = os.path.join(direct_root, "s.kvb")
    before = engine.stats()
    assert run_job(engine, Op.WRITE_BLOCK, [(final + ".t", final, size, addr(src), key_digest(b"s"))],
                      fsync=True) == [size]
    # open, header + data (one WRITEV), fsync, close, then the rename; then the directory's fsync
    d = delta(engine.stats(), before)
    assert d["sqes"] == 6 and d["dir_fsyncs"] == 1
    assert file_bytes(final)[HEADER_BYTES:] == src.tobytes()


@pytest.mark.parametrize("kind", ["uring", "posix"])
@pytest.mark.parametrize("op", [Op.WRITE, Op.WRITE_BLOCK], ids=op_id)
def test_failed_rename_removes_the_temporary(direct_root, aligned, kind, op):
    """The final name cannot be made (its directory is gone): the entry fails with the rename's
    errno and its written temporary is removed; the other entry lands."""
    e = Engine(queue_depth=4) if kind == "uring" else _native.PosixEngine(queue_depth=4)
    try:
        size = 64 * KiB
        src = aligned(2 * size, fill=16)
        tmp = [os.path.join(direct_root, f"t{i}") for i in range(2)]
        final = [os.path.join(direct_root, "gone", "f0"), os.path.join(direct_root, "f1")]
        if op == Op.WRITE:
            entries = [(tmp[i], 0, size, addr(src) + i * size, final[i]) for i in range(2)]
        else:
            entries = [(tmp[i], final[i], size, addr(src) + i * size, key_digest(b"%d" % i)) for i in range(2)]
        assert run_job(e, op, entries) == [-errno.ENOENT, size]
        assert os.listdir(direct_root) == ["f1"]
        s = e.stats()
        assert s["requests_failed"] == 1 and s["bytes_written"] == size
    finally:
        e.shutdown()


def test_failed_exclusive_open_leaves_foreign_temporary_alone(direct_root, aligned, engine):
    size = 64 * KiB
    src = aligned(size, fill=15)
    final = os.path.join(direct_root, "y.kvb")
    tmp = final + ".tmp.1"
    with open(tmp, "wb") as f:  # another writer's temporary, in progress
        f.write(b"theirs")
    assert run_job(engine, Op.WRITE_BLOCK, [(tmp, final, size, addr(src), key_digest(b"y"))]) == [-errno.EEXIST]
    assert not os.path.exists(final)
    assert file_bytes(tmp) == b"theirs"


def _files_open_under(root: str) -> list[str]:
    """This process's descriptors of regular files under root (by /proc/self/fd)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            where = os.readlink(f"/proc/self/fd/{fd}")
            regular = stat.S_ISREG(os.stat(f"/proc/self/fd/{fd}").st_mode)
        except OSError:  # (the listing's own descriptor, closed by now)
            continue
        if regular and where.startswith(root + os.sep):
            out.append(where)
    return out


@pytest.mark.parametrize("op", [Op.WRITE, Op.WRITE_BLOCK], ids=op_id)
def test_stores_leave_no_descriptor_open(direct_root, aligned, engine, op):
    """A store's file is opened into a regular descriptor (its close must reach the file
    system's flush): every path closes it, whether the store lands, its rename fails, its
    exclusive open finds another's temporary, or (a write: a write_block checksums its payload
    first) its write faults."""
    size = 64 * KiB
    src = aligned(4 * size, fill=21)
    d = os.path.join(direct_root, "d")
    os.mkdir(d)
    with open(os.path.join(d, "t2"), "wb") as f:  # another writer's temporary
        f.write(b"theirs")
    tmp = [os.path.join(d, f"t{i}") for i in range(4)]
    final = [os.path.join(d, "f0"), os.path.join(direct_root, "gone", "f1"), os.path.join(d, "f2"),
             os.path.join(d, "f3")]
    if op == Op.WRITE:  # the last one's memory is unmapped (4096): the write fails EFAULT
        where = [addr(src), addr(src) + size, addr(src) + 2 * size, 4096]
        entries = [(tmp[i], 0, size, where[i], final[i]) for i in range(4)]
        want = [size, -errno.ENOENT, -errno.EEXIST, -errno.EFAULT]
    else:
        entries = [(tmp[i], final[i], size, addr(src) + i * size, key_digest(b"%d" % i)) for i in range(3)]
        want = [size, -errno.ENOENT, -errno.EEXIST]
    assert run_job(engine, op, entries) == want
    assert sorted(os.listdir(d)) == ["f0", "t2"]
    assert file_bytes(final[0])[-size:] == src[:size].tobytes()
    assert _files_open_under(direct_root) == []


def test_unlink(root, engine):
    paths = [os.path.join(root, f"u{i}") for i in range(4)]
    for p in paths[:3]:
        with open(p, "wb") as f:
            f.write(b"x")
    res = run_job(engine, Op.UNLINK, [paths[0], (paths[1],), paths[3], paths[2]], direct=False)
    assert res == [0, 0, -errno.ENOENT, 0]
    assert os.listdir(root) == []
    engine.submit(5, Op.UNLINK, [paths[0]])
    assert drain_poll(engine) == {5: (Op.UNLINK, [-errno.ENOENT], 1)}


# ------------------------------------------------------------------------- submit counts


def _make_files(engine, root, src, n, size):
    paths = [os.path.join(root, f"r{i}") for i in range(n)]
    assert run_job(engine, Op.WRITE, [(p, 0, size, addr(src) + i * size) for i, p in enumerate(paths)]) == [size] * n
    return paths


@pytest.mark.parametrize("op", [Op.READ, Op.READ_BLOCK], ids=op_id)
def test_run_batch_is_one_submit(direct_root, aligned, op):
    qd, size = 16, 64 * KiB
    e = Engine(queue_depth=qd)
    try:
        src = aligned(qd * size, fill=16)
        dst = aligned(qd * size)
        digests = [key_digest(b"%d" % i) for i in range(qd)]
        paths = [os.path.join(direct_root, f"r{i}") for i in range(qd)]
        assert run_job(e, Op.WRITE_BLOCK, [(p + ".t", p, size, addr(src) + i * size, digests[i])
                                     for i, p in enumerate(paths)]) == [size] * qd
        if op == Op.READ:
            run_job(e, Op.WRITE, [(p, 0, size, addr(src) + i * size) for i, p in enumerate(paths)])
            entries = [(p, 0, size, addr(dst) + i * size) for i, p in enumerate(paths)]
        else:
            entries = [(p, size, addr(dst) + i * size, digests[i]) for i, p in enumerate(paths)]
        before = e.stats()
        assert run_job(e, op, entries) == [size] * qd
        d = delta(e.stats(), before)
        assert d["submits"] == 1
        # open, [statx of the link count, header], data, close
        assert d["sqes"] == qd * (3 if op == Op.READ else 5)
        assert d["jobs_submitted"] == d["jobs_finished"] == 1
        assert np.array_equal(src, dst)
    finally:
        e.shutdown()


_THREADS_SCRIPT = r"""
import sys, threading
import numpy as np
from pykvtier import _native
from pykvtier._native import Op
from pykvtier.engines import run_job
e = _native.Engine(queue_depth=4)
buf = np.zeros(4096, np.uint8)
path = sys.argv[1]
bad = []
def work(i):
    try:
        r = run_job(e, Op.WRITE, [(path, 0, 4096, buf.ctypes.data)], direct=False)
        if r != [4096]:
            bad.append((i, r))
    except Exception as exc:
        bad.append((i, repr(exc)))
for i in range(30):  # one after another: a new thread may get a finished one's id
    t = threading.Thread(target=work, args=(i,))
    t.start()
    t.join()
e.shutdown()
print("failed runs:", len(bad), bad[:2])
sys.exit(1 if bad else 0)
"""


def test_jobs_from_short_lived_threads(root):
    # in a child process: the failure mode aborts the interpreter
    # (cwd=root: the source tree must not shadow the installed package)
    proc = subprocess.run([sys.executable, "-c", _THREADS_SCRIPT, os.path.join(root, "t")],
                          capture_output=True, text=True, cwd=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]


@pytest.mark.parametrize("op", [Op.READ, Op.READ_BLOCK, Op.WRITE, Op.WRITE_BLOCK], ids=op_id)
def test_submitted_job_is_one_submit(direct_root, aligned, op):
    """Jobs that fit the ring (stores: its store share, half the slots) go to the kernel in one
    io_uring_submit each."""
    qd, size, jobs = 16, 64 * KiB, 4
    e = Engine(queue_depth=qd * jobs * (2 if op in (Op.WRITE, Op.WRITE_BLOCK) else 1))
    try:
        n = qd * jobs
        src = aligned(n * size, fill=17)
        dst = aligned(n * size)
        paths = [os.path.join(direct_root, f"r{i}") for i in range(n)]
        digests = [key_digest(b"%d" % i) for i in range(n)]
        if op == Op.READ:
            _make_files(e, direct_root, src, n, size)
        elif op == Op.READ_BLOCK:
            run_job(e, Op.WRITE_BLOCK, [(p + ".t", p, size, addr(src) + i * size, digests[i])
                                  for i, p in enumerate(paths)])
        before = e.stats()
        mem = dst if op in (Op.READ, Op.READ_BLOCK) else src
        for j in range(jobs):
            idx = range(j * qd, (j + 1) * qd)
            if op == Op.READ:
                entries = [(paths[i], 0, size, addr(mem) + i * size) for i in idx]
            elif op == Op.READ_BLOCK:
                entries = [(paths[i], size, addr(mem) + i * size, digests[i]) for i in idx]
            elif op == Op.WRITE:
                entries = [(paths[i], 0, size, addr(mem) + i * size) for i in idx]
            else:
                entries = [(paths[i] + ".t", paths[i], size, addr(mem) + i * size, digests[i]) for i in idx]
            e.submit(100 + j, op, entries)
        got = drain_poll(e)
        assert got == {100 + j: (op, [size] * qd, 1) for j in range(jobs)}
        d = delta(e.stats(), before)
        if op in (Op.READ, Op.READ_BLOCK):
            assert d["submits"] == jobs  # exactly one io_uring_submit per job
            assert np.array_equal(src, dst)
        else:
            # one per job for the chains; a write_block's renames follow as its chains complete
            assert d["submits"] >= jobs
            for i, p in enumerate(paths):
                raw = file_bytes(p)
                assert raw[-size:] == src[i * size : (i + 1) * size].tobytes()
    finally:
        e.shutdown()


@pytest.mark.parametrize("op", [Op.WRITE, Op.WRITE_BLOCK], ids=op_id)
def test_store_jobs_beyond_the_store_share_stream_in_batches(direct_root, aligned, op):
    """Store jobs of the whole store share each (32 slots of a 64-deep ring): the next one does not
    wait for the ring to drain, it streams in batches of at least a quarter of the share (8
    requests) per io_uring_submit: at most 32 / 8 = 4 submits a job, and every byte lands."""
    qd, size, jobs = 32, 16 * KiB, 6
    e = Engine(queue_depth=2 * qd)
    try:
        n = qd * jobs
        src = aligned(n * size, fill=23)
        paths = [os.path.join(direct_root, f"s{i}") for i in range(n)]
        for j in range(jobs):
            idx = range(j * qd, (j + 1) * qd)
            if op == Op.WRITE:
                entries = [(paths[i], 0, size, addr(src) + i * size) for i in idx]
            else:
                entries = [(paths[i] + ".t", paths[i], size, addr(src) + i * size,
                            key_digest(b"%d" % i)) for i in idx]
            e.submit(200 + j, op, entries)
        got = drain_poll(e)
        assert {j: (o, res) for j, (o, res, _) in got.items()} == {
            200 + j: (op, [size] * qd) for j in range(jobs)}
        assert all(1 <= sub <= 4 for _, _, sub in got.values()), got
        for i, p in enumerate(paths):
            assert file_bytes(p)[-size:] == src[i * size:(i + 1) * size].tobytes()
    finally:
        e.shutdown()


def test_a_store_job_does_not_wait_for_the_previous_one_to_drain(tmp_path, aligned):
    """Job A: 32 writes (the whole store share of a 64-deep ring), one of them into a FIFO with no
    reader, so A cannot finish; job B: 32 writes of plain files. B streams in beside A's last
    request and finishes while A is still blocked (admitted only whole, B would wait for A)."""
    qd, size = 32, 4096
    e = Engine(queue_depth=2 * qd)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    src = aligned(2 * qd * size, fill=5)
    paths = [str(tmp_path / f"w{i}") for i in range(2 * qd)]
    paths[qd - 1] = str(fifo)  # A's last entry
    released = False
    try:
        for j in range(2):
            e.submit(300 + j, Op.WRITE, [(paths[i], 0, size, addr(src) + i * size)
                                         for i in range(j * qd, (j + 1) * qd)], direct=False)
        got = {}
        deadline = time.monotonic() + 60  # (a bound on a failure, not a synchronization)
        while 301 not in got and time.monotonic() < deadline:
            e.wait(1.0)
            got.update((f.job_id, list(f.results)) for f in e.poll())
        assert got == {301: [size] * qd}  # B done, A still blocked on the FIFO
        with open(fifo, "rb") as reader:  # A's write gets its reader: A finishes
            released = True
            e.drain()
            assert reader.read() == src[(qd - 1) * size:qd * size].tobytes()
        assert {f.job_id: list(f.results) for f in e.poll()} == {300: [size] * qd}
    finally:
        if not released:
            with open(fifo, "rb") as reader:
                reader.read()
        e.shutdown()


@pytest.mark.parametrize("via", ["run", "submit"])
@pytest.mark.parametrize("limit", ["queue_depth", "inflight_bytes"])
def test_more_requests_than_the_ring_holds(direct_root, aligned, via, limit):
    size, n = 64 * KiB, 19
    if limit == "queue_depth":
        e, per_submit = Engine(queue_depth=4), 4
    else:
        e, per_submit = Engine(queue_depth=64, max_inflight_bytes=3 * size), 3
    try:
        src = aligned(n * size, fill=18)
        dst = aligned(n * size)
        paths = [os.path.join(direct_root, f"m{i}") for i in range(n)]
        digests = [key_digest(b"%d" % i) for i in range(n)]
        writes = [(p + ".t", p, size, addr(src) + i * size, digests[i]) for i, p in enumerate(paths)]
        reads = [(p, size, addr(dst) + i * size, digests[i]) for i, p in enumerate(paths)]
        before = e.stats()
        if via == "run":
            assert run_job(e, Op.WRITE_BLOCK, writes) == [size] * n
            assert run_job(e, Op.READ_BLOCK, reads) == [size] * n
            jobs_submits = None
        else:
            e.submit(1, Op.WRITE_BLOCK, writes)
            e.drain()  # the reads need the files
            e.submit(2, Op.READ_BLOCK, reads)
            got = drain_poll(e)
            assert got[1][:2] == (Op.WRITE_BLOCK, [size] * n)
            assert got[2][:2] == (Op.READ_BLOCK, [size] * n)
            jobs_submits = got[2][2]
        assert np.array_equal(src, dst)
        min_submits = -(-n // per_submit)
        if jobs_submits is not None:
            assert min_submits <= jobs_submits <= n
        d = delta(e.stats(), before)
        assert d["submits"] >= 2 * min_submits
        assert d["requests_ok"] == 2 * n and d["requests_failed"] == 0
    finally:
        e.shutdown()


# ------------------------------------------------------------------------- poll, wait, drain, shutdown


def test_poll_reports_each_job_once(root, aligned, engine):
    size, n = 4 * KiB, 40
    src = aligned(n * size, fill=19)
    paths = [os.path.join(root, f"p{i}") for i in range(n)]
    assert engine.wait(0) is False  # nothing pending: returns at once
    got = {}
    for i, p in enumerate(paths):
        engine.submit(1000 + i, Op.WRITE, [(p, 0, size, addr(src) + i * size)], direct=False)
    while len(got) < n:
        # wait() returns once something can be polled; False only when nothing is pending
        # either, which would mean a job was lost
        assert engine.wait(), f"{n - len(got)} jobs never reported"
        for jid, op, results, submits, _q, _t in engine.poll():
            assert jid not in got, f"job {jid} reported twice"
            got[jid] = (op, results, submits)
    assert got == {1000 + i: (Op.WRITE, [size], 1) for i in range(n)}
    assert engine.poll() == [] and engine.wait(0) is False
    for i, p in enumerate(paths):
        assert file_bytes(p) == src[i * size : (i + 1) * size].tobytes()


def test_drain_many_jobs(root, aligned):
    e = Engine(queue_depth=8, workers=2)
    try:
        size, n = 4 * KiB, 300
        src = aligned(n * size, fill=20)
        dst = aligned(n * size)
        paths = [os.path.join(root, f"d{i}") for i in range(n)]
        for i in range(n):
            e.submit(i, Op.WRITE, [(paths[i], 0, size, addr(src) + i * size)], direct=False)
        assert drain_poll(e) == {i: (Op.WRITE, [size], 1) for i in range(n)}  # 1 request: 1 submit
        # reads of pairs, and an empty job (finishes at once)
        for i in range(0, n, 2):
            e.submit(10_000 + i, Op.READ, [(paths[i + 1], 0, size, addr(dst) + (i + 1) * size),
                                           (paths[i], 0, size, addr(dst) + i * size)], direct=False)
        e.submit(99_999, Op.READ, [])
        got = drain_poll(e)
        assert got.pop(99_999) == (Op.READ, [], 0)
        assert {jid: r[:2] for jid, r in got.items()} == {
            10_000 + i: (Op.READ, [size, size]) for i in range(0, n, 2)}
        # a worker admits a job only when all of it fits its ring: one submit per job
        assert all(r[2] == 1 for r in got.values())
        assert np.array_equal(src, dst)
        s = e.stats()
        assert s["jobs_submitted"] == s["jobs_finished"] == n + n // 2 + 1
        assert e.poll() == []
    finally:
        e.shutdown()


@pytest.mark.parametrize("kind", ["uring", "posix"])
def test_shutdown_completes_pending_work(direct_root, aligned, kind):
    e = Engine(queue_depth=4) if kind == "uring" else _native.PosixEngine(queue_depth=4, threads=2)
    size, n = 256 * KiB, 30
    src = aligned(n * size, fill=21)
    paths = [os.path.join(direct_root, f"s{i}") for i in range(n)]
    for i in range(n):
        e.submit(i, Op.WRITE_BLOCK,
                 [(paths[i] + ".t", paths[i], size, addr(src) + i * size, key_digest(b"%d" % i))])
    e.shutdown()  # no drain first
    assert e.pending_jobs() == 0
    got = {jid: (op, results) for jid, op, results, *_ in e.poll()}
    assert got == {i: (Op.WRITE_BLOCK, [size]) for i in range(n)}
    for i in range(n):
        assert file_bytes(paths[i])[HEADER_BYTES:] == src[i * size : (i + 1) * size].tobytes()
    assert sorted(os.listdir(direct_root)) == sorted(os.path.basename(p) for p in paths)
    with pytest.raises(RuntimeError, match="shut down"):
        e.submit(n, Op.UNLINK, [paths[0]])
    with pytest.raises(RuntimeError, match="shut down"):
        run_job(e, Op.UNLINK, [paths[0]])
    assert e.pending_jobs() == 0 and e.poll() == []
    e.shutdown()  # idempotent
    assert os.path.exists(paths[0])


# ------------------------------------------------------------------------- large data (NVMe)


@pytest.mark.nvme
def test_large_batch_round_trip(direct_root, aligned):
    """1.25 GiB of 8 MiB blocks in one job each way, through registered buffers."""
    size, n = 8 * MiB, 160
    e = Engine(queue_depth=64)
    try:
        src = aligned(n * size)
        src.view(np.uint64)[:] = np.arange(n * size // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        dst = aligned(n * size)
        e.register_buffer(addr(src), src.nbytes)
        e.register_buffer(addr(dst), dst.nbytes)
        paths = [os.path.join(direct_root, f"L{i}.kvb") for i in range(n)]
        digests = [key_digest(b"L%d" % i) for i in range(n)]
        e.submit(1, Op.WRITE_BLOCK, [(p + ".t", p, size, addr(src) + i * size, digests[i])
                                    for i, p in enumerate(paths)])
        assert drain_poll(e)[1][1] == [size] * n
        e.submit(2, Op.READ_BLOCK, [(p, size, addr(dst) + i * size, digests[i]) for i, p in enumerate(paths)])
        op, results, submits = drain_poll(e)[2]
        assert results == [size] * n
        assert submits >= -(-n * size // (256 * MiB))  # bounded by max_inflight_bytes
        assert np.array_equal(src, dst)
        assert e.stats()["fixed_buffer_ios"] == n  # the loads; new files take one WRITEV each
    finally:
        e.shutdown()


@pytest.mark.nvme
def test_one_gib_request(direct_root, aligned):
    """The per-request limit: one 1 GiB read (the CQE's int32 result holds it)."""
    e = Engine(queue_depth=2, max_inflight_bytes=GiB)
    try:
        buf = aligned(GiB)
        buf.view(np.uint64)[:] = np.arange(GiB // 8, dtype=np.uint64)
        p = os.path.join(direct_root, "big")
        assert run_job(e, Op.WRITE, [(p, 0, GiB, addr(buf))]) == [GiB]
        back = aligned(GiB)
        assert run_job(e, Op.READ, [(p, 0, GiB, addr(back))]) == [GiB]
        assert np.array_equal(buf, back)
    finally:
        e.shutdown()


@pytest.mark.parametrize("kind", ["uring", "posix"])
def test_loads_overtake_a_burst_of_stores(direct_root, aligned, kind):
    """Loads have priority: stores hold at most store_share of the ring (of the posix engine's
    threads: 1 of 4), so a load submitted after a long store job is issued at once and
    finishes first."""
    if kind == "uring":
        e = Engine(queue_depth=8, workers=1, store_share=0.25)
    else:
        e = _native.PosixEngine(queue_depth=8, threads=4, store_share=0.25)
    try:
        size, n_store = 1 * MiB, 64
        src = aligned(n_store * size, fill=3)
        dst = aligned(2 * size)
        paths = [os.path.join(direct_root, f"l{i}") for i in range(2)]
        run_job(e, Op.WRITE, [(p, 0, size, addr(src)) for p in paths])
        e.submit(1, Op.WRITE, [(os.path.join(direct_root, f"s{i}"), 0, size, addr(src) + i * size)
                              for i in range(n_store)])
        e.submit(2, Op.READ, [(p, 0, size, addr(dst) + i * size) for i, p in enumerate(paths)])
        order = [jid for jid, *_ in e.poll()]
        if order or e.stats()["bytes_written"] >= (2 + n_store // 2) * size:
            # this thread was off the CPU while half the stores ran: the load came too late to
            # show anything (the precondition, not the behaviour, failed)
            e.drain()
            pytest.skip("the store job was mostly done before the load was submitted")
        while len(order) < 2:
            e.wait()
            order += [jid for jid, *_ in e.poll()]
        assert order == [2, 1]
        assert np.array_equal(dst[:size], src[:size]) and np.array_equal(dst[size:], src[:size])
    finally:
        e.shutdown()


def test_store_share_is_checked():
    with pytest.raises(ValueError, match="store_share"):
        Engine(store_share=0.0)


@pytest.mark.parametrize("size", [0, 1, 240, 241, 4096, 1 * MiB + 17, 2 * MiB])
def test_payload_checksum_is_xxh3_64(size):
    """Our XXH3 (AVX2 build where the CPU has it) equals the xxhash package's, byte for byte."""
    xxhash = pytest.importorskip("xxhash", reason="the xxhash package is a test extra")
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    assert _native.CHECKSUM_IMPL in ("avx2", "sse2")
    assert _native.xxh3_64(data) == xxhash.xxh3_64_intdigest(data.tobytes())


# ------------------------------------------------------------------------- the one model, verify


@pytest.fixture(params=["uring", "posix"])
def any_engine(request):
    e = Engine(queue_depth=8) if request.param == "uring" else _native.PosixEngine(queue_depth=8)
    yield e
    e.shutdown()


def _v1_header(digest: bytes, payload: bytes) -> bytes:
    """A format-1 header written by hand (magic, version, header_bytes, payload_bytes, digest,
    payload xxh3, header xxh3 of the 48 bytes before it), zero padded to HEADER_BYTES."""
    head = struct.pack("<8sIIQ16sQ", b"PYKVTBLK", 1, HEADER_BYTES, len(payload), digest,
                       _native.xxh3_64(np.frombuffer(payload, np.uint8)))
    head += struct.pack("<Q", _native.xxh3_64(np.frombuffer(head, np.uint8)))
    return head.ljust(HEADER_BYTES, b"\0")


def _store(engine, root, key: bytes, src, size, verify):
    final = os.path.join(root, key.decode() + ".kvb")
    res = run_job(engine, Op.WRITE_BLOCK, [(final + ".tmp", final, size, addr(src), key_digest(key))],
                  direct=False, verify=verify)
    assert res == [size]
    return final


def _load(engine, final, key: bytes, dst, size, verify):
    return run_job(engine, Op.READ_BLOCK, [(final, size, addr(dst), key_digest(key))], direct=False,
                   verify=verify)


def test_module_exports_the_one_model():
    assert [Op.READ, Op.WRITE, Op.READ_BLOCK, Op.WRITE_BLOCK, Op.UNLINK] == [
        _native.READ, _native.WRITE, _native.READ_BLOCK, _native.WRITE_BLOCK, _native.UNLINK]
    assert {e.name: int(e) for e in _native.BlockError.__members__.values()} == {
        "SHORT": _native.ERR_SHORT, "BAD_HEADER": _native.ERR_BAD_HEADER,
        "KEY_MISMATCH": _native.ERR_KEY_MISMATCH, "LENGTH": _native.ERR_LENGTH,
        "CHECKSUM": _native.ERR_CHECKSUM}
    assert _native.ERR_CHECKSUM == -100005
    assert _native.FORMAT_VERSIONS == (1, 2)
    assert len(_native.STATS_KEYS) == len(set(_native.STATS_KEYS))
    assert "loads_unchecked_payload" in _native.STATS_KEYS
    assert _native.result_text(_native.ERR_CHECKSUM) == "payload checksum mismatch (corrupt bytes)"
    assert _native.result_text(-errno.ENOENT) == "ENOENT: " + os.strerror(errno.ENOENT)


def test_finished_job_is_tuple_compatible():
    f = _native.FinishedJob(7, Op.READ_BLOCK, [4096, -2], submits=1, queued_s=0.5, transfer_s=0.25)
    assert (f.job_id, f.op, f.results, f.submits, f.queued_s, f.transfer_s) == (
        7, Op.READ_BLOCK, [4096, -2], 1, 0.5, 0.25)
    jid, op, results, *rest = f
    assert (jid, op, results, rest) == (7, Op.READ_BLOCK, [4096, -2], [1, 0.5, 0.25])
    assert len(f) == 6 and f[2] == [4096, -2] and f[-1] == 0.25 and f[:2] == (7, Op.READ_BLOCK)
    assert f == (7, Op.READ_BLOCK, [4096, -2], 1, 0.5, 0.25)
    assert _native.FinishedJob(1, Op.UNLINK, [0]).op == Op.UNLINK


@pytest.mark.parametrize("bad, what", [("unlink", "str 'unlink'"), ("scan", "str 'scan'"), (4, "int")],
                         ids=["unlink", "scan", "int"])
def test_finished_job_takes_only_an_op(bad, what):
    with pytest.raises(TypeError) as ei:
        _native.FinishedJob(1, bad, [0])
    assert str(ei.value) == op_type_error(what)


def test_stats_keys_are_every_engines(any_engine):
    assert tuple(any_engine.stats()) == _native.STATS_KEYS
    assert any_engine.name in ("uring", "posix")


def test_bad_verify_is_refused_naming_it(root, aligned, any_engine):
    src = aligned(4096)
    with pytest.raises(ValueError, match=r'verify must be "payload" or "header", got \'none\''):
        any_engine.submit(1, Op.WRITE_BLOCK, [(f"{root}/x.tmp", f"{root}/x", 4096, addr(src), key_digest(b"x"))],
                          verify="none")
    assert any_engine.pending_jobs() == 0 and os.listdir(root) == []


@pytest.mark.parametrize("verify", ["payload", "header"])
def test_block_round_trip_with_each_verify(root, aligned, any_engine, verify):
    size = 64 * KiB
    src = aligned(size, fill=0)
    src[:] = np.arange(size, dtype=np.uint32).astype(np.uint8)
    final = _store(any_engine, root, b"k", src, size, verify)
    raw = file_bytes(final)
    assert raw[HEADER_BYTES:] == src.tobytes()
    h = _native.parse_header(raw[:HEADER_BYTES])
    assert h["header_ok"] and h["key_digest"] == key_digest(b"k") and h["payload_bytes"] == size
    if verify == "payload":  # flags 0: version 1, byte-identical to earlier releases
        assert (h["version"], h["flags"], h["payload_checksum"]) == (1, 0, True)
        assert h["payload_xxh3"] == _native.xxh3_64(src)
        assert raw[:HEADER_BYTES] == _v1_header(key_digest(b"k"), src.tobytes())
    else:
        assert (h["version"], h["flags"], h["payload_xxh3"], h["payload_checksum"]) == (
            2, _native.HEADER_FLAG_NO_PAYLOAD_CHECKSUM, 0, False)
    dst = aligned(size, fill=0xEE)
    assert _load(any_engine, final, b"k", dst, size, verify) == [size]
    assert dst.tobytes() == src.tobytes()
    assert any_engine.stats()["loads_unchecked_payload"] == 0


@pytest.mark.parametrize("verify", ["payload", "header"])
def test_hand_written_v1_block_loads(root, aligned, any_engine, verify):
    size = 8 * KiB
    payload = bytes(range(256)) * (size // 256)
    path = os.path.join(root, "v1.kvb")
    with open(path, "wb") as f:
        f.write(_v1_header(key_digest(b"old"), payload) + payload)
    dst = aligned(size)
    assert _load(any_engine, path, b"old", dst, size, verify) == [size]
    assert dst.tobytes() == payload
    assert _load(any_engine, path, b"other", dst, size, verify) == [_native.ERR_KEY_MISMATCH]
    assert not dst.any()


def test_corrupt_payload_caught_by_payload_not_by_header(root, aligned, any_engine):
    size = 16 * KiB
    src = aligned(size, fill=5)
    src[100] = 5
    final = _store(any_engine, root, b"c", src, size, "payload")
    with open(final, "r+b") as f:
        f.seek(HEADER_BYTES + 100)
        f.write(b"\x06")
    dst = aligned(size, fill=1)
    assert _load(any_engine, final, b"c", dst, size, "payload") == [_native.BlockError.CHECKSUM]
    assert not dst.any()  # a failed load leaves zeros
    assert _load(any_engine, final, b"c", dst, size, "header") == [size]
    want = bytearray(src.tobytes())
    want[100] = 6
    assert dst.tobytes() == bytes(want)
    s = any_engine.stats()
    assert s["verify_failures"] == 1 and s["loads_unchecked_payload"] == 0


def test_header_verified_block_read_by_payload_reader(root, aligned, any_engine):
    size = 16 * KiB
    src = aligned(size, fill=9)
    finals = [_store(any_engine, root, b"h%d" % i, src, size, "header") for i in range(3)]
    dst = aligned(3 * size)
    res = run_job(any_engine, Op.READ_BLOCK,
                  [(p, size, addr(dst) + i * size, key_digest(b"h%d" % i)) for i, p in enumerate(finals)],
                  direct=False, verify="payload")
    assert res == [size] * 3 and dst.tobytes() == src.tobytes() * 3
    assert any_engine.stats()["loads_unchecked_payload"] == 3
    assert _load(any_engine, finals[0], b"h0", dst, size, "header") == [size]  # not counted
    assert any_engine.stats()["loads_unchecked_payload"] == 3


def test_parse_header_refuses_damaged_headers():
    digest = key_digest(b"p")
    v1 = bytearray(_v1_header(digest, b"\1" * 4096))
    assert _native.parse_header(bytes(v1))["header_ok"]
    assert _native.parse_header(bytes(v1[:64]))["header_ok"]
    assert not _native.parse_header(bytes(v1[:40]))["header_ok"]  # too short: not raised
    for off in (0, 8, 12, 16, 40):  # magic, version, header_bytes, payload_bytes, payload xxh3
        bad = bytearray(v1)
        bad[off] ^= 1
        assert not _native.parse_header(bytes(bad))["header_ok"], off
    unknown_flags = struct.pack("<8sIIQ16sQII", b"PYKVTBLK", 2, HEADER_BYTES, 4096, digest, 0, 2, 0)
    unknown_flags += struct.pack("<Q", _native.xxh3_64(np.frombuffer(unknown_flags, np.uint8)))
    h = _native.parse_header(unknown_flags)
    assert (h["version"], h["flags"], h["header_ok"]) == (2, 2, False)  # a flag this reader does not know


def test_block_name_is_layouts():
    from pykvtier.layout import Layout

    digest = key_digest(b"named")
    assert _native.block_name(digest) == f"{digest.hex()[:2]}/{digest.hex()}.kvb"
    assert Layout.digest_from_name(_native.block_name(digest).split("/")[1]) == digest
    assert _native.block_name(bytes(range(16))) == "00/000102030405060708090a0b0c0d0e0f.kvb"
    with pytest.raises(ValueError, match="key digest must be 16 bytes, got 3"):
        _native.block_name(b"abc")
