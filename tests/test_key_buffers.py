"""Keys given as buffers other than bytes (bytearray, memoryview, numpy arrays; strided or not):
DiskTier.lookup and lookup_code answer for bytes(key), as submit_load/submit_store use it;
job ids outside [0, 2**63) are a ValueError naming job_id. Exact answers and byte-exact loads."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from pykvtier import JobResult, LookupResult, TransferJob
from pykvtier.layout import HEADER_BYTES, key_digest

HIT, MISS = LookupResult.HIT, LookupResult.MISS
BS = 4096


def finish(tier) -> list[JobResult]:
    tier.drain()
    return tier.get_finished_jobs()


def strided(key: bytes) -> memoryview:
    """A non-contiguous memoryview whose bytes are ``key`` (every other byte of a longer buffer)."""
    buf = bytearray(2 * len(key))
    buf[::2] = key
    buf[1::2] = b"0" * len(key)
    mv = memoryview(bytes(buf))[::2]
    assert bytes(mv) == key and not mv.c_contiguous
    return mv


def variants(key: bytes) -> dict:
    """``key`` as several buffer types, each with bytes(v) == key."""
    n = len(key)
    grid = np.zeros((n, 3), np.uint8)
    grid[:, 0] = np.frombuffer(key, np.uint8)
    column = grid[:, 0]  # strided numpy view
    rev = np.frombuffer(key[::-1], np.uint8)[::-1]  # negative stride
    fortran = np.asfortranarray(np.frombuffer(key, np.uint8).reshape(2, n // 2))  # C order != memory
    out = {"bytes": key, "bytearray": bytearray(key), "memoryview": memoryview(key),
           "strided memoryview": strided(key), "numpy": np.frombuffer(key, np.uint8),
           "numpy column": column, "numpy reversed": rev, "numpy fortran": fortran,
           "numpy uint16": np.frombuffer(key, np.uint16)}
    for name, v in out.items():
        assert bytes(v) == key, name
    return out


KEY = b"key-0-abcdefgh"  # 14 bytes: even, for the fortran and uint16 variants
ALIAS = b"k0k0"  # where a strided memoryview of b"kk" points: its raw memory starts b"k0"


@pytest.fixture
def tier(root, make_tier, arena):
    """A tier holding KEY (bytes of slot 0) and ALIAS; (tier, arena)."""
    t = make_tier(root, block_size_bytes=BS)
    a = arena(4, BS)
    a[0] = 7
    a[1] = 9
    t.set_arena(a)
    t.submit_store(TransferJob(1, [KEY, ALIAS], [0, 1]))
    (res,) = finish(t)
    assert res.success is True
    return t, a


def test_lookup_answers_for_the_keys_logical_bytes(tier):
    t, _ = tier
    for name, v in variants(KEY).items():
        assert (name, t.lookup(v), t.lookup_code(v)) == (name, HIT, 0)
    for name, v in variants(b"key-1-abcdefgh").items():  # never stored
        assert (name, t.lookup(v), t.lookup_code(v)) == (name, MISS, 1)
    # b"kk" viewed inside b"k0k0": the raw memory is ALIAS's, the key is not
    assert (t.lookup(strided(b"kk")), t.lookup_code(strided(b"kk"))) == (MISS, 1)
    col = np.frombuffer(b"k0xxk0xx", np.uint8).reshape(2, 4)[:, 0]
    assert bytes(col) == b"kk" and t.lookup(col) is MISS
    s = t.stats()
    assert (s["lookups"], s["hits"], s["misses"]) == (39, 18, 21)


def test_strided_keys_store_and_load_as_their_bytes(root, make_tier, arena):
    t = make_tier(root, block_size_bytes=BS)
    a = arena(4, BS)
    a[0] = np.arange(BS, dtype=np.uint8)
    t.set_arena(a)
    t.submit_store(TransferJob(1, [strided(b"kk")], [0]))
    (res,) = finish(t)
    assert res.success is True and res.failed_keys == {}
    assert t.lookup(b"kk") is HIT and t.lookup(strided(b"kk")) is HIT and t.lookup(b"k0") is MISS
    with open(t.layout.block_path(key_digest(b"kk")), "rb") as f:
        assert f.read()[HEADER_BYTES:] == a[0].tobytes()
    col = np.frombuffer(b"k0xxk0xx", np.uint8).reshape(2, 4)[:, 0]
    t.submit_load(TransferJob(2, [col], [2]))
    (res,) = finish(t)
    assert (res.job_id, res.success, res.failed_keys) == (2, True, {})
    assert a[2].tobytes() == a[0].tobytes()


def test_reversed_view_of_an_mmap_is_hashed_in_bounds(root):
    """The reversed view's buffer pointer is the mapping's last byte: hashing len bytes from it
    would read past the mapping (SIGSEGV). Run in a child so a crash is a failure, not the run's."""
    child = r"""
import mmap, sys
import numpy as np
from pykvtier import DiskTier, TransferJob, host_arena
t = DiskTier(sys.argv[1], 4096)
t.set_arena(host_arena(2, 4096))
m = mmap.mmap(-1, 1 << 20)
m[:] = bytes(range(256)) * 4096
key = np.frombuffer(m, dtype=np.uint8)[::-1]
print(t.lookup_code(key), t.lookup_code(bytes(key)))
t.submit_store(TransferJob(1, [key], [0]))
t.drain()
(r,) = t.get_finished_jobs()
print(r.success, t.lookup_code(key), t.lookup_code(bytes(key)), t.lookup_code(bytes(m)))
del key
t.shutdown()
"""
    p = subprocess.run([sys.executable, "-P", "-c", child, root], capture_output=True, text=True, timeout=120)
    assert (p.returncode, p.stdout.split("\n")) == (0, ["1 1", "True 0 0 1", ""]), p.stderr[-2000:]


def test_numpy_and_strided_keys_load_the_blocks_lookup_answers_for(tier):
    t, a = tier
    col = variants(KEY)["numpy column"]
    t.submit_load(TransferJob(2, [col, strided(ALIAS)], [2, 3]))
    (res,) = finish(t)
    assert (res.success, res.failed_keys) == (True, {})
    assert (a[2] == 7).all() and (a[3] == 9).all()


@pytest.mark.parametrize("job_id, shown", [(2**63, "9223372036854775808"), (2**70, str(2**70)),
                                            (-1, "-1"), (np.int64(-5), "-5")])
def test_job_id_outside_int64_range_is_a_value_error(tier, job_id, shown):
    t, a = tier
    msg = f"job_id {shown} must be in [0, 2**63)"
    with pytest.raises(ValueError) as e:
        t.submit_load(TransferJob(job_id, [KEY], [2]))
    assert str(e.value) == msg
    with pytest.raises(ValueError) as e:
        t.submit_store(TransferJob(job_id, [KEY], [2]))
    assert str(e.value) == msg
    assert t.get_finished_jobs() == [] and not t.has_pending_work()
    t.submit_load(TransferJob(2**63 - 1, [KEY], [2]))  # the largest id, and nothing was lost
    (res,) = finish(t)
    assert (res.job_id, res.success) == (2**63 - 1, True) and (a[2] == 7).all()
