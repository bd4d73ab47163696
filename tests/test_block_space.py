"""_native.BlockSpace (block names and slot addresses built in C++), _native.tmp_sequence, and
every engine's submit_blocks: the uring and posix engines, BounceEngine on CPU (HostCopier).

Jobs are awaited with ``pykvtier.engines.run_job`` or ``drain()``; no sleeps. Data is compared
byte for byte, results and counters exactly.
"""

from __future__ import annotations

import errno
import os
import re
import threading
from array import array

import numpy as np
import pytest

from pykvtier import _native
from pykvtier._native import BlockSpace, Op
from pykvtier.engines import run_job
from pykvtier.engines.bounce import BounceEngine, HostCopier
from pykvtier.layout import Layout, key_digest, read_header

BS = 16 * 1024  # payload bytes of a block
GiB = 1 << 30


def make_engine(kind: str):
    return _native.Engine(queue_depth=8) if kind == "uring" else _native.PosixEngine(queue_depth=8)


@pytest.fixture(params=["uring", "posix"])
def engine(request):
    e = make_engine(request.param)
    yield e
    e.shutdown()


@pytest.fixture
def layout(root):
    return Layout(root)


def digests_of(*keys: bytes) -> bytes:
    return b"".join(key_digest(k) for k in keys)


def space_of(layout: Layout, arena: np.ndarray) -> BlockSpace:
    return BlockSpace(layout.blocks_dir, BS, arena.ctypes.data, arena.shape[1], arena.shape[0])


def block_files(layout: Layout) -> list[str]:
    """Every file under blocks/ (relative names, sorted)."""
    out = []
    for sub in sorted(os.listdir(layout.blocks_dir)):
        out += [f"{sub}/{n}" for n in sorted(os.listdir(os.path.join(layout.blocks_dir, sub)))]
    return out


def seq_of(tmp: str) -> int:
    return int(tmp.rsplit(".", 1)[1])


# ------------------------------------------------------------------------- names


def test_names_equal_layout(layout, arena):
    a = arena(4, BS)
    space = space_of(layout, a)
    assert (space.blocks_dir, space.payload_bytes, space.arena_addr, space.slot_bytes, space.num_slots,
            space.pid) == (layout.blocks_dir, BS, a.ctypes.data, BS, 4, os.getpid())
    rng = np.random.default_rng(1)
    digests = [bytes(16), b"\xff" * 16] + [rng.bytes(16) for _ in range(200)] + [key_digest(b"k")]
    for d in digests:
        path = space.block_path(d)
        assert path == layout.block_path(d) == f"{layout.blocks_dir}/{_native.block_name(d)}"
        tmp = space.tmp_path(d)
        assert re.fullmatch(re.escape(path) + rf"\.tmp\.{os.getpid()}\.[1-9][0-9]*", tmp), tmp
        assert Layout.digest_from_name(os.path.basename(path)) == d


def test_entries_are_submit_entries(layout, arena):
    a = arena(4, 2 * BS)
    space = space_of(layout, a)
    d = digests_of(b"a", b"b", b"c")
    da, db, dc = d[:16], d[16:32], d[32:]
    base = a.ctypes.data
    assert space.entries(Op.READ_BLOCK, d, np.array([2, 0, 3], dtype=np.int64)) == [
        (space.block_path(da), BS, base + 2 * 2 * BS, da),
        (space.block_path(db), BS, base, db),
        (space.block_path(dc), BS, base + 3 * 2 * BS, dc),
    ]
    victim = key_digest(b"old")
    w = space.entries(Op.WRITE_BLOCK, d, array("q", [1, 2, 3]), {1: victim})
    first = seq_of(w[0][0])
    assert w == [
        (f"{space.block_path(da)}.tmp.{os.getpid()}.{first}", space.block_path(da), BS, base + 2 * BS, da),
        (f"{space.block_path(db)}.tmp.{os.getpid()}.{first + 1}", space.block_path(db), BS, base + 4 * BS, db,
         space.block_path(victim)),
        (f"{space.block_path(dc)}.tmp.{os.getpid()}.{first + 2}", space.block_path(dc), BS, base + 6 * BS, dc),
    ]
    assert space.entries(Op.UNLINK, d) == [(space.block_path(x),) for x in (da, db, dc)]
    # digests as bytearray / a (n, 16) uint8 array; slots as bytes of native int64
    raw = np.frombuffer(d, dtype=np.uint8).reshape(3, 16)
    slots = np.array([0, 1, 2], dtype=np.int64)
    assert (space.entries(Op.READ_BLOCK, bytearray(d), slots.tobytes())
            == space.entries(Op.READ_BLOCK, raw, slots)
            == space.entries(Op.READ_BLOCK, memoryview(d), array("q", [0, 1, 2])))


def test_tmp_sequence_is_shared_with_layout(layout, arena):
    space = space_of(layout, arena(2, BS))
    d = key_digest(b"x")
    s1 = seq_of(layout.tmp_path(d))
    s2 = seq_of(space.tmp_path(d))
    s3 = _native.tmp_sequence()
    w = space.entries(Op.WRITE_BLOCK, d * 2, array("q", [0, 1]))
    s6 = seq_of(layout.tmp_path(d))
    assert [s2, s3, seq_of(w[0][0]), seq_of(w[1][0]), s6] == [s1 + 1, s1 + 2, s1 + 3, s1 + 4, s1 + 5]


def test_tmp_names_never_repeat_across_threads(layout, arena):
    space = space_of(layout, arena(1, BS))
    d = key_digest(b"t")
    per_thread = 2000
    got: list[list[str]] = [[] for _ in range(4)]

    def run(k: int) -> None:
        for _ in range(per_thread):
            got[k].append(space.tmp_path(d) if k % 2 else layout.tmp_path(d))

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    names = [n for g in got for n in g]
    assert len(set(names)) == len(names) == 4 * per_thread
    for g in got:  # each thread's names in increasing sequence
        seqs = [seq_of(n) for n in g]
        assert seqs == sorted(seqs)


# ------------------------------------------------------------------------- engines


def test_store_load_unlink_round_trip(engine, layout, arena):
    n = 5
    src = arena(n, BS)
    src[:] = np.random.default_rng(7).integers(0, 256, src.shape, dtype=np.uint8)
    space = space_of(layout, src)
    keys = [f"key{i}".encode() for i in range(n)]
    d = digests_of(*keys)
    slots = np.array([3, 0, 4, 1, 2], dtype=np.int64)
    engine.submit_blocks(11, Op.WRITE_BLOCK, space, d, slots, direct=False)
    engine.drain()
    (job,) = engine.poll()
    assert (job.job_id, job.op, job.results) == (11, Op.WRITE_BLOCK, [BS] * n)
    assert block_files(layout) == sorted(_native.block_name(d[16 * i:16 * i + 16]) for i in range(n))
    for i in range(n):
        h = read_header(space.block_path(d[16 * i:16 * i + 16]))
        assert (h.key_digest, h.payload_bytes) == (d[16 * i:16 * i + 16], BS)
    assert engine.stats()["bytes_written"] == n * BS

    dst = arena(n, BS)
    back = space_of(layout, dst)
    order = array("q", [4, 2, 0, 1, 3])  # slot of each digest in dst
    engine.submit_blocks(12, Op.READ_BLOCK, back, d, order, direct=False)
    engine.drain()
    (job,) = engine.poll()
    assert (job.job_id, job.op, job.results) == (12, Op.READ_BLOCK, [BS] * n)
    for i in range(n):
        assert np.array_equal(dst[order[i]], src[slots[i]]), i

    engine.submit_blocks(13, Op.UNLINK, space, d[16:] + key_digest(b"never stored"))
    engine.drain()
    (job,) = engine.poll()
    assert job.results == [0] * (n - 1) + [-errno.ENOENT]
    assert block_files(layout) == [_native.block_name(d[:16])]


def test_direct_round_trip_and_alignment_checks(direct_root, arena):
    layout = Layout(direct_root)
    e = make_engine("uring")
    try:
        src = arena(3, BS)
        src[:] = np.random.default_rng(3).integers(0, 256, src.shape, dtype=np.uint8)
        space = space_of(layout, src)
        d = digests_of(b"a", b"b", b"c")
        e.submit_blocks(1, Op.WRITE_BLOCK, space, d, np.array([0, 1, 2], dtype=np.int64))
        e.drain()
        assert [j.results for j in e.poll()] == [[BS] * 3]
        dst = arena(3, BS)
        e.submit_blocks(2, Op.READ_BLOCK, space_of(layout, dst), d, np.array([2, 1, 0], dtype=np.int64))
        e.drain()
        assert [j.results for j in e.poll()] == [[BS] * 3]
        assert np.array_equal(dst[::-1], src)

        # O_DIRECT's alignment, as submit checks it: a slot address off the page, a payload length
        raw = arena(1, 3 * BS)
        odd = BlockSpace(layout.blocks_dir, BS, raw.ctypes.data, BS + 512, 2)
        with pytest.raises(ValueError) as ei:
            e.submit_blocks(3, Op.READ_BLOCK, odd, d[:32], np.array([0, 1], dtype=np.int64))
        addr = raw.ctypes.data + BS + 512
        assert str(ei.value) == (f"entry 1 ({odd.block_path(d[16:32])}): host address {addr:#x} is not a "
                                 "multiple of 4096 bytes, the memory alignment O_DIRECT needs here; use "
                                 "page-aligned memory")
        short = BlockSpace(layout.blocks_dir, 1000, raw.ctypes.data, 4096, 2)
        with pytest.raises(ValueError) as ei:
            e.submit_blocks(4, Op.READ_BLOCK, short, d[:16], np.array([0], dtype=np.int64))
        assert str(ei.value) == (f"entry 0 ({short.block_path(d[:16])}): length 1000 is not a multiple "
                                 "of 4096 bytes, the O_DIRECT I/O alignment here")
        assert e.pending_jobs() == 0 and e.stats()["jobs_submitted"] == 2
    finally:
        e.shutdown()


def test_jobs_built_in_finished_jobs_carry_nothing_over(engine, layout, arena):
    """Engines build a new job in a finished one (its requests' names reuse their memory): a
    store after a recycling store recycles nothing, a smaller read after a larger store reads
    exactly its blocks, an unlink after them removes exactly its files."""
    a = arena(4, BS)
    a[:] = np.random.default_rng(9).integers(0, 256, a.shape, dtype=np.uint8)
    space = space_of(layout, a)
    old = digests_of(b"o0", b"o1", b"o2")
    engine.submit_blocks(1, Op.WRITE_BLOCK, space, old, array("q", [0, 1, 2]), None, _native.SubmitOptions(direct=False))
    engine.drain()
    assert [j.results for j in engine.poll()] == [[BS] * 3]
    new = digests_of(b"n0")
    engine.submit_blocks(2, Op.WRITE_BLOCK, space, new, array("q", [3]), {0: old[:16]}, direct=False)
    engine.drain()
    assert [j.results for j in engine.poll()] == [[BS]]
    recycled = engine.stats()["recycled"]
    more = digests_of(b"m0", b"m1")
    engine.submit_blocks(3, Op.WRITE_BLOCK, space, more, array("q", [1, 2]), direct=False)  # no victim now
    engine.drain()
    assert [j.results for j in engine.poll()] == [[BS, BS]]
    assert engine.stats()["recycled"] == recycled
    assert block_files(layout) == sorted(_native.block_name(x) for x in _split16(old[16:] + new + more))
    dst = arena(1, BS)
    engine.submit_blocks(4, Op.READ_BLOCK, space_of(layout, dst), new, array("q", [0]), direct=False)
    engine.drain()
    assert [j.results for j in engine.poll()] == [[BS]]
    assert np.array_equal(dst[0], a[3])
    engine.submit_blocks(5, Op.UNLINK, space, more[:16])
    engine.drain()
    assert [j.results for j in engine.poll()] == [[0]]
    assert block_files(layout) == sorted(_native.block_name(x) for x in _split16(old[16:] + new + more[16:]))


def _split16(b: bytes) -> list[bytes]:
    return [b[i:i + 16] for i in range(0, len(b), 16)]


def test_recycle_victims(engine, layout, arena):
    a = arena(3, BS)
    a[:] = np.random.default_rng(5).integers(0, 256, a.shape, dtype=np.uint8)
    space = space_of(layout, a)
    old = digests_of(b"old0", b"old1")
    assert run_job(engine, Op.WRITE_BLOCK, space.entries(Op.WRITE_BLOCK, old, array("q", [0, 1])),
                   direct=False) == [BS, BS]
    inode = os.stat(space.block_path(old[16:])).st_ino
    new = digests_of(b"new0", b"new1")
    before = engine.stats()["recycled"]
    engine.submit_blocks(5, Op.WRITE_BLOCK, space, new, array("q", [2, 0]), {0: old[16:]}, direct=False)
    engine.drain()
    assert [j.results for j in engine.poll()] == [[BS, BS]]
    assert engine.stats()["recycled"] - before == 1
    assert not os.path.exists(space.block_path(old[16:]))  # the victim's file is gone...
    assert os.stat(space.block_path(new[:16])).st_ino == inode  # ...reused for the new block
    assert block_files(layout) == sorted(_native.block_name(x) for x in (old[:16], new[:16], new[16:]))
    dst = arena(2, BS)
    assert run_job(engine, Op.READ_BLOCK, space_of(layout, dst).entries(Op.READ_BLOCK, new, array("q", [0, 1])),
                   direct=False) == [BS, BS]
    assert np.array_equal(dst[0], a[2]) and np.array_equal(dst[1], a[0])


# ------------------------------------------------------------------------- errors


def test_block_space_value_errors(arena):
    a = arena(1, BS)
    addr = a.ctypes.data
    cases = [
        (("", BS, addr, BS, 1), "blocks_dir is empty"),
        (("/x\0y", BS, addr, BS, 1), "blocks_dir contains a NUL byte"),
        (("/" + "d" * 4019, BS, addr, BS, 1),
         "blocks_dir is 4020 bytes, more than 4019: its block files' names would not fit PATH_MAX (4096)"),
        (("/b", 0, addr, BS, 1), "payload_bytes is 0"),
        (("/b", GiB + 1, addr, GiB + 1, 1), f"payload_bytes {GiB + 1} exceeds the 1 GiB per-request limit"),
        (("/b", BS, addr, BS - 1, 1), f"slot_bytes {BS - 1} is smaller than payload_bytes {BS}"),
        (("/b", BS, 0, BS, 1), "arena_addr is 0 (NULL)"),
        (("/b", BS, addr, BS, 0), "num_slots is 0"),
        (("/b", BS, (1 << 64) - BS, BS, 2),
         f"the arena (num_slots 2 * slot_bytes {BS} from arena_addr) runs past the end of the address space"),
    ]
    for args, text in cases:
        with pytest.raises(ValueError) as ei:
            BlockSpace(*args)
        assert str(ei.value) == text, args
    BlockSpace("/" + "d" * 4018, GiB, addr, GiB, 1)  # the limits themselves are taken
    space = BlockSpace("/b", BS, addr, BS, 1)
    for call in (space.block_path, space.tmp_path):
        with pytest.raises(ValueError) as ei:
            call(b"x" * 15)
        assert str(ei.value) == "key digest must be 16 bytes, got 15"


@pytest.mark.parametrize("bad, what", [
    ("read_block", "str 'read_block'"), ("WRITE_BLOCK", "str 'WRITE_BLOCK'"), ("unlink", "str 'unlink'"),
    ("bogus", "str 'bogus'"), (int(Op.READ_BLOCK), "int"), (None, "NoneType"),
], ids=["read_block", "WRITE_BLOCK", "unlink", "bogus", "int", "None"])
def test_submit_blocks_and_entries_take_only_an_op(engine, layout, arena, bad, what):
    """Ops cross to Python as the enum only: submit_blocks and BlockSpace.entries with an op's
    name (or anything not an Op) are a TypeError naming it; nothing is queued or written."""
    a = arena(2, BS)
    space = space_of(layout, a)
    d = digests_of(b"a", b"b")
    s2 = np.array([0, 1], dtype=np.int64)
    text = f"op must be a pykvtier._native.Op (e.g. Op.READ_BLOCK), not {what}"
    before = engine.stats()
    slots = None if bad == "unlink" else s2
    with pytest.raises(TypeError) as ei:
        engine.submit_blocks(1, bad, space, d, slots, direct=False)
    assert str(ei.value) == text
    with pytest.raises(TypeError) as ei:
        engine.submit_blocks(1, bad, space, d, slots, options=_native.SubmitOptions(direct=False))
    assert str(ei.value) == text
    with pytest.raises(TypeError) as ei:
        space.entries(bad, d, slots)
    assert str(ei.value) == text
    assert engine.stats() == before and before["jobs_submitted"] == 0
    assert engine.pending_jobs() == 0 and engine.poll() == []
    assert block_files(layout) == []


def test_submit_blocks_value_errors(engine, layout, arena):
    a = arena(2, BS)
    space = space_of(layout, a)
    d = digests_of(b"a", b"b")
    s2 = np.array([0, 1], dtype=np.int64)
    WB, RB, UN = Op.WRITE_BLOCK, Op.READ_BLOCK, Op.UNLINK
    value_errors = [
        ((Op.READ, d, s2), {}, "op must be READ_BLOCK, WRITE_BLOCK or UNLINK for block requests, not read"),
        ((RB, d + b"x", s2), {}, "digests must be n * 16 bytes (16-byte key digests), got 33 bytes"),
        ((RB, b"", s2), {}, "digests is empty: no blocks"),
        ((RB, d, None), {}, "slots is required for read_block"),
        ((WB, d, None), {}, "slots is required for write_block"),
        ((UN, d, s2), {}, "slots must be None for UNLINK (no memory is moved)"),
        ((RB, d, np.array([0, 2], dtype=np.int64)), {}, "slots[1] = 2 is outside [0, 2), the space's slots"),
        ((WB, d, array("q", [-1, 0])), {}, "slots[0] = -1 is outside [0, 2), the space's slots"),
        ((RB, d, np.array([0], dtype=np.int64)), {}, "slots has 1 items for 2 digests (2 int64 expected)"),
        ((RB, d, b"\0" * 24), {}, "slots has 24 bytes for 2 digests (2 int64 expected)"),
        ((RB, d, np.array([0, 1], dtype=np.int32)), {},
         "slots must be int64 (numpy int64, array('q'), or bytes of native int64), got items of format 'i' "
         "(4 bytes)"),
        ((RB, d, s2, {0: d[:16]}), {}, "victims are for WRITE_BLOCK only, not read_block"),
        ((WB, d, s2, {2: d[:16]}), {}, "victims: entry index 2 is outside [0, 2)"),
        ((WB, d, s2, {1: b"short"}), {}, "victims[1]: key digest must be 16 bytes, got 5"),
        ((RB, d, s2), {"verify": "all"}, "verify must be \"payload\" or \"header\", got 'all'"),
        ((RB, d, s2), {"align": 3000}, "align must be a power of two"),
        ((WB, d, s2), {"file_mode": 0o400},
         "file_mode must be permission bits (within 0o777) with owner read and write (0o600) set, got 0o400"),
    ]
    type_errors = [
        ((RB, [1, 2], s2), "digests must be a contiguous buffer (bytes, bytearray, a numpy array), not list"),
        ((RB, d, [0, 1]), "slots must be a contiguous buffer (bytes, bytearray, a numpy array), not list"),
        ((RB, np.zeros((4, 16), dtype=np.uint8)[::2], s2),
         "digests must be a contiguous buffer (bytes, bytearray, a numpy array), not ndarray"),
        ((WB, d, s2, [d[:16]]), "victims must be None or a dict {entry index: victim digest}, not list"),
        ((WB, d, s2, {"0": d[:16]}), "victims: keys must be entry indexes (int), not str"),
        ((WB, d, s2, {0: "x" * 16}), "victims[0] must be a 16-byte key digest (bytes), not str"),
    ]
    for args, kw, text in value_errors:
        with pytest.raises(ValueError) as ei:
            engine.submit_blocks(1, args[0], space, *args[1:], direct=False, **kw)
        assert str(ei.value) == text, args
        if not kw:  # BlockSpace.entries: the same checks
            with pytest.raises(ValueError) as ei:
                space.entries(*args)
            assert str(ei.value) == text, args
    for args, text in type_errors:
        with pytest.raises(TypeError) as ei:
            engine.submit_blocks(1, args[0], space, *args[1:], direct=False)
        assert str(ei.value) == text, args
        with pytest.raises(TypeError) as ei:
            space.entries(*args)
        assert str(ei.value) == text, args
    with pytest.raises(TypeError):
        engine.submit_blocks(1, RB, "not a space", d, s2)
    # nothing was queued, nothing written
    assert engine.pending_jobs() == 0 and engine.poll() == []
    assert engine.stats()["jobs_submitted"] == 0
    assert block_files(layout) == []


def test_submit_options():
    """SubmitOptions: the submit keywords checked once, mem_align resolved, as_kwargs for Python
    engines; the same ValueErrors as the keywords."""
    o = _native.SubmitOptions()
    assert (o.direct, o.align, o.mem_align, o.fsync, o.file_mode, o.verify) == (True, 4096, 4096, False, 0o600,
                                                                                "payload")
    o = _native.SubmitOptions(direct=False, align=512, fsync=True, file_mode=0o640, verify="header")
    assert o.mem_align == 512  # 0: align
    assert o.as_kwargs() == {"direct": False, "align": 512, "mem_align": 512, "fsync": True, "file_mode": 0o640,
                             "verify": "header"}
    assert repr(o) == ("SubmitOptions(direct=False, align=512, mem_align=512, fsync=True, file_mode=0o640, "
                       "verify='header')")
    assert _native.SubmitOptions(align=512, mem_align=4096).mem_align == 4096
    for kw, text in [({"verify": "all"}, "verify must be \"payload\" or \"header\", got 'all'"),
                     ({"align": 3000}, "align must be a power of two"),
                     ({"mem_align": 48}, "mem_align must be a power of two"),
                     ({"file_mode": 0o1600}, "file_mode must be permission bits (within 0o777) with owner read "
                                             "and write (0o600) set, got 0o1600")]:
        with pytest.raises(ValueError) as ei:
            _native.SubmitOptions(**kw)
        assert str(ei.value) == text, kw
    with pytest.raises(TypeError):
        _native.SubmitOptions(False)  # keywords only


def test_submit_blocks_options_apply(engine, layout, arena):
    """A SubmitOptions given to submit_blocks is the job's: verify="header" loads a block whose
    payload was changed on disk (its checksum is not read), verify="payload" refuses it. Options
    and keywords together, or options of another type, raise before anything is queued."""
    src = arena(2, BS)
    src[:] = np.random.default_rng(3).integers(0, 256, src.shape, dtype=np.uint8)
    space = space_of(layout, src)
    d = digests_of(b"x", b"y")
    buffered = _native.SubmitOptions(direct=False)
    engine.submit_blocks(1, Op.WRITE_BLOCK, space, d, np.array([0, 1], dtype=np.int64), None, buffered)
    engine.drain()
    assert [j.results for j in engine.poll()] == [[BS, BS]]
    path = space.block_path(d[:16])
    with open(path, "r+b") as f:  # one payload byte changed: the header still matches
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    dst = arena(2, BS)
    back = space_of(layout, dst)
    header = _native.SubmitOptions(direct=False, verify="header")
    engine.submit_blocks(2, Op.READ_BLOCK, back, d, np.array([0, 1], dtype=np.int64), None, header)
    engine.drain()
    assert [j.results for j in engine.poll()] == [[BS, BS]]
    expected = src[0].copy()
    expected[-1] ^= 0xFF
    assert np.array_equal(dst[0], expected) and np.array_equal(dst[1], src[1])
    engine.submit_blocks(3, Op.READ_BLOCK, back, d, np.array([0, 1], dtype=np.int64), None, buffered)
    engine.drain()
    assert [j.results for j in engine.poll()] == [[int(_native.BlockError.CHECKSUM), BS]]
    s2 = np.array([0, 1], dtype=np.int64)
    with pytest.raises(ValueError) as ei:
        engine.submit_blocks(4, Op.READ_BLOCK, back, d, s2, None, buffered, direct=False)
    assert str(ei.value) == "submit_blocks takes options (a SubmitOptions) or the option keywords, not both"
    with pytest.raises(TypeError) as ei:
        engine.submit_blocks(5, Op.READ_BLOCK, back, d, s2, None, {"direct": False})
    assert str(ei.value) == "options must be a pykvtier._native.SubmitOptions or None, not dict"
    assert engine.pending_jobs() == 0 and engine.poll() == []


@pytest.mark.parametrize("workers", [1, 2])
def test_uring_wakeups_from_threads(layout, workers):
    """Jobs submitted from two threads at once to a uring engine (one eventfd write wakes a worker
    for every job queued before it looks at the queues): every job finishes; none is left queued
    behind a wake-up that was not written (engine.wait would time out)."""
    e = _native.Engine(queue_depth=8, workers=workers)
    space = BlockSpace(layout.blocks_dir, BS, 4096, BS, 1)  # UNLINK moves no memory
    for i in range(5):  # one at a time: each job finds the worker asleep, with nothing in flight
        e.submit_blocks(100_000 + i, Op.UNLINK, space, key_digest(b"one%d" % i))
        assert e.wait(30.0), f"job {100_000 + i} not finished after 30 s: a lost wake-up"
        assert [(j.job_id, j.results) for j in e.poll()] == [(100_000 + i, [-errno.ENOENT])]
    n = 300

    def submit(base: int) -> None:
        for i in range(n):
            e.submit_blocks(base + i, Op.UNLINK, space, key_digest(b"absent%d" % (base + i)))

    threads = [threading.Thread(target=submit, args=(b,)) for b in (0, 10_000)]
    for t in threads:
        t.start()
    got: dict[int, list[int]] = {}
    while len(got) < 2 * n:
        for j in e.poll():
            got[j.job_id] = j.results
        if len(got) < 2 * n and not e.wait(30.0) and e.pending_jobs() > 0:
            pytest.fail(f"{e.pending_jobs()} jobs still pending after 30 s: a lost wake-up")
    for t in threads:
        t.join()
    assert sorted(got) == list(range(n)) + list(range(10_000, 10_000 + n))
    assert set(map(tuple, got.values())) == {(-errno.ENOENT,)}
    e.shutdown()


# ------------------------------------------------------------------------- the bounce engine


@pytest.mark.parametrize("host", ["uring", "posix"])
def test_bounce_engine_submit_blocks(layout, arena, host):
    h = make_engine(host)
    copier = HostCopier()
    eng = BounceEngine(h, copier, BS, bounce_slots=3, chunk_blocks=2)
    try:
        n = 5
        dev = arena(n, BS)  # the "device" arena
        dev[:] = np.random.default_rng(11).integers(0, 256, dev.shape, dtype=np.uint8)
        space = space_of(layout, dev)
        d = digests_of(*[f"b{i}".encode() for i in range(n)])
        eng.submit_blocks(21, Op.WRITE_BLOCK, space, d, np.arange(n, dtype=np.int64), direct=False)
        eng.drain()
        (job,) = eng.poll()
        assert (job.job_id, job.op, job.results) == (21, Op.WRITE_BLOCK, [BS] * n)
        assert eng.copy_stats()["d2h_copies"] == n
        assert block_files(layout) == sorted(_native.block_name(d[16 * i:16 * i + 16]) for i in range(n))

        dev2 = arena(n, BS)
        eng.submit_blocks(22, Op.READ_BLOCK, space_of(layout, dev2), d, np.arange(n - 1, -1, -1, dtype=np.int64),
                          None, _native.SubmitOptions(direct=False))
        eng.drain()
        (job,) = eng.poll()
        assert (job.job_id, job.results) == (22, [BS] * n)
        assert np.array_equal(dev2[::-1], dev)
        assert eng.copy_stats()["h2d_copies"] == n

        with pytest.raises(ValueError) as ei:
            eng.submit_blocks(23, Op.WRITE_BLOCK, space, d[:32], array("q", [0, 1]), {1: d[32:48]})
        assert re.fullmatch(re.escape(f"entry 1 ({space.block_path(d[16:32])}.tmp.{os.getpid()}.") +
                            r"[0-9]+\): this engine does not recycle block files", str(ei.value))
        with pytest.raises(ValueError) as ei:
            eng.submit_blocks(24, Op.READ_BLOCK, space, d, None)
        assert str(ei.value) == "slots is required for read_block"
        with pytest.raises(ValueError) as ei:
            eng.submit_blocks(24, Op.READ_BLOCK, space, d, np.arange(n, dtype=np.int64), None,
                              _native.SubmitOptions(direct=False), direct=False)
        assert str(ei.value) == "submit_blocks takes options (a SubmitOptions) or the option keywords, not both"

        eng.submit_blocks(25, Op.UNLINK, space, d[:16] + key_digest(b"absent"))
        eng.drain()
        assert [(j.job_id, j.results) for j in eng.poll()] == [(25, [0, -errno.ENOENT])]
        assert eng.pending_jobs() == 0
        assert eng.stats()["jobs_submitted"] == 3
    finally:
        eng.shutdown()
        h.shutdown()


# ------------------------------------------------------------------------- the gds engine


def test_gds_engine_submit_blocks(layout, arena):
    """The gds module's submit_blocks takes _native's BlockSpace (one type across the modules) and
    draws its temporaries from the same sequence; runs where pykvtier._gds loads (no GPU needed:
    unlinks move no memory)."""
    from pykvtier.gpu import load_gds_module

    gds, reason = load_gds_module()
    if gds is None:
        pytest.skip(f"pykvtier._gds does not load here: {reason}")
    eng = gds.GdsEngine(io_threads=2, compat="on", checksum="host")
    try:
        space = space_of(layout, arena(2, BS))
        d = digests_of(b"g0", b"g1")
        with open(space.block_path(d[:16]), "wb"):
            pass
        eng.submit_blocks(1, Op.UNLINK, space, d)
        eng.drain()
        assert [(j.job_id, j.results) for j in eng.poll()] == [(1, [0, -errno.ENOENT])]
        first = _native.tmp_sequence()
        with pytest.raises(ValueError) as ei:
            eng.submit_blocks(2, Op.WRITE_BLOCK, space, d, array("q", [0, 1]), {1: d[:16]})
        assert str(ei.value) == (f"entry 1 ({space.block_path(d[16:])}.tmp.{os.getpid()}.{first + 2}): "
                                 "this engine does not recycle block files")
        assert _native.tmp_sequence() == first + 3
        assert eng.pending_jobs() == 0 and eng.stats()["jobs_submitted"] == 1
    finally:
        eng.shutdown()
