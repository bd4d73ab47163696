"""pykvtier._native.BlockIndex: the tier's per-key state machine, exact codes and counts."""

import hashlib
import struct

import numpy as np

import pytest

from pykvtier import TransferJob, _native

HIT, MISS, RETRY, HIT_PENDING, UNKNOWN = range(5)
ABSENT, PRESENT, WRITING, REMOVING, FAILED = range(5)
OK, A_FAILED, A_ABSENT, A_WRITING, A_REMOVING, A_PRESENT, NEEDS_ROOM = range(7)


def d(i: int) -> bytes:
    return hashlib.blake2b(b"key-%d" % i, digest_size=16).digest()


def stored(index, *ids):
    buf = b"".join(d(i) for i in ids)
    n, codes = index.admit_stores(buf, len(ids))
    assert (n, codes) == (len(ids), None)
    assert index.finish_stores(buf, [1] * len(ids)) == len(ids)


def test_store_then_lookup_and_load_states():
    ix = _native.BlockIndex(unknown_is_miss=True)
    assert ix.lookup(d(1)) == MISS
    n, codes = ix.admit_stores(d(1) + d(2), 2)
    assert (n, codes) == (2, None)
    assert ix.state(d(1)) == WRITING and ix.lookup(d(1)) == RETRY
    assert len(ix) == 2 and ix.present == 0
    assert ix.finish_stores(d(1) + d(2), [4096, -5]) == 1
    assert ix.state(d(1)) == PRESENT and ix.state(d(2)) == WRITING  # a failure stays for the caller
    assert ix.erase_writing(d(2)) is True and ix.state(d(2)) == ABSENT and len(ix) == 1
    assert ix.lookup(d(1)) == HIT
    assert ix.admit_loads(d(1) + d(1)) is None
    assert ix.readers(d(1)) == 2 and ix.lookup(d(1)) == HIT_PENDING
    assert ix.finish_loads(d(1) + d(1)) == 0
    assert ix.readers(d(1)) == 0 and ix.lookup(d(1)) == HIT
    assert ix.counts() == {"lookups": 5, "hits": 2, "misses": 1, "retries": 1, "hit_pending": 1}


def test_admit_codes_for_each_refusal():
    ix = _native.BlockIndex(unknown_is_miss=True)
    stored(ix, 1, 2)
    assert ix.admit_stores(d(3), 1) == (1, None)  # 3 writing
    assert ix.take_victims(1) == [d(1)]  # 1 removing
    ix.mark_failed(d(2))
    codes = ix.admit_loads(d(1) + d(2) + d(3) + d(4))
    assert list(codes) == [A_REMOVING, A_FAILED, A_WRITING, A_ABSENT]
    assert ix.readers(d(2)) == 0
    # stores: present/writing skipped, removing refused, new ones beyond max_new need room
    n, codes = ix.admit_stores(d(2) + d(3) + d(1) + d(5) + d(6) + d(5), 1)
    assert n == 1 and list(codes) == [A_PRESENT, A_PRESENT, A_REMOVING, OK, NEEDS_ROOM, A_PRESENT]


def test_failed_block_is_dropped_when_its_last_reader_finishes():
    ix = _native.BlockIndex(unknown_is_miss=True)
    stored(ix, 1)
    assert ix.admit_loads(d(1) + d(1)) is None
    assert ix.mark_failed(d(1)) is True and ix.mark_failed(d(1)) is False
    assert ix.lookup(d(1)) == HIT_PENDING  # loads in flight
    assert ix.drop_failed(d(1)) is False  # still read
    assert ix.finish_loads(d(1)) == 0
    assert ix.finish_loads(d(1)) == 1  # the last reader: dropped
    assert ix.state(d(1)) == FAILED and d(1) not in ix and len(ix) == 0 and ix.present == 0
    assert ix.lookup(d(1)) == MISS
    assert ix.add_present(d(1)) is False  # a probe or scan does not bring it back
    assert ix.admit_stores(d(1), 1) == (1, None)  # a store does, failed mark cleared
    assert ix.failed(d(1)) is False and ix.state(d(1)) == WRITING


def test_lru_order_touch_victims_restore_forget():
    ix = _native.BlockIndex(unknown_is_miss=True)
    stored(ix, 1, 2, 3, 4)
    assert ix.lru_order() == [d(1), d(2), d(3), d(4)]
    ix.touch(d(1) + d(9))
    assert ix.lru_order() == [d(2), d(3), d(4), d(1)]
    assert ix.admit_loads(d(2)) is None  # read (and now the most recent): never a victim
    assert ix.take_victims(2, keep=[d(3)]) == [d(4), d(1)]
    assert ix.state(d(4)) == REMOVING and ix.lookup(d(4)) == MISS
    assert ix.lru_order() == [d(3), d(2)] and ix.present == 2 and len(ix) == 4
    assert ix.restore(d(4)) is True and ix.lru_order() == [d(4), d(3), d(2)]
    assert ix.forget_removed(d(1)) is True and ix.state(d(1)) == ABSENT and len(ix) == 3
    assert ix.forget_removed(d(1)) is False and ix.restore(d(2)) is False


def test_set_removing_only_unread_present():
    ix = _native.BlockIndex(unknown_is_miss=True)
    stored(ix, 1, 2)
    assert ix.admit_loads(d(1)) is None
    assert ix.set_removing(d(1)) is False
    assert ix.set_removing(d(2)) is True and ix.state(d(2)) == REMOVING
    ix.mark_failed(d(2))
    assert ix.forget_removed(d(2)) is True and ix.state(d(2)) == FAILED  # the mark stays


def test_shared_unknown_and_counting():
    ix = _native.BlockIndex(unknown_is_miss=False)
    assert ix.lookup(d(1)) == UNKNOWN
    assert ix.counts()["lookups"] == 0  # answered by the caller, which counts it
    ix.count(RETRY)
    assert ix.counts() == {"lookups": 1, "hits": 0, "misses": 0, "retries": 1, "hit_pending": 0}
    with pytest.raises(ValueError, match="answer must be 0..3"):
        ix.count(4)


def test_lookup_key_digests_the_key_and_close_refuses():
    ix = _native.BlockIndex(unknown_is_miss=True)
    stored(ix, 7)
    assert ix.lookup_key(b"key-7") == HIT
    assert ix.lookup_key(bytearray(b"key-7")) == HIT
    assert ix.lookup_key(memoryview(b"key-7")) == HIT
    assert ix.lookup_key(b"key-8") == MISS
    with pytest.raises(TypeError, match="key must be bytes, not str"):
        ix.lookup_key("key-7")
    ix.close()
    with pytest.raises(RuntimeError, match="DiskTier is shut down"):
        ix.lookup_key(b"key-7")
    with pytest.raises(RuntimeError, match="DiskTier is shut down"):
        ix.lookup(d(7))


def test_bad_digests():
    ix = _native.BlockIndex(unknown_is_miss=True)
    with pytest.raises(ValueError, match="digest must be 16 bytes, got 15"):
        ix.lookup(b"x" * 15)
    with pytest.raises(TypeError, match="digest must be bytes, not str"):
        ix.state("x" * 16)
    with pytest.raises(ValueError, match="digests: 17 bytes is not a multiple of 16"):
        ix.admit_loads(b"x" * 17)
    with pytest.raises(TypeError, match="digests must be a buffer"):
        ix.admit_loads(5)
    with pytest.raises(ValueError, match="2 digests but 1 results"):
        ix.finish_stores(d(1) + d(2), [1])
    assert ix.admit_loads(b"") is None and len(ix) == 0


def test_lookup_key_hashes_a_strided_key_as_its_bytes():
    import numpy as np

    ix = _native.BlockIndex(unknown_is_miss=True)
    stored(ix, 7)
    raw = bytearray(b"key-7" * 2)
    raw[::2], raw[1::2] = b"key-7", b"xxxxx"
    mv = memoryview(bytes(raw))[::2]  # bytes b"key-7", memory b"kxeyx..."
    assert bytes(mv) == b"key-7" and ix.lookup_key(mv) == HIT
    assert ix.lookup_key(np.frombuffer(b"7-yek", np.uint8)[::-1]) == HIT
    assert ix.lookup_key(np.frombuffer(bytes(raw), np.uint8).reshape(5, 2)[:, 0]) == HIT
    assert ix.lookup_key(memoryview(b"kkey-7")[1:]) == HIT  # contiguous slice, hashed in place
    assert ix.lookup_key(memoryview(b"kxexyx")[::2]) == MISS  # b"key", not b"kxe"
    assert ix.counts()["hits"] == 4 and ix.counts()["misses"] == 1


def test_digest_batches_must_be_contiguous():
    import numpy as np

    ix = _native.BlockIndex(unknown_is_miss=True)
    stored(ix, 1, 2)
    both = np.frombuffer(d(1) + d(2), np.uint8)
    assert ix.admit_loads(both) is None and ix.readers(d(1)) == 1  # contiguous numpy: fine
    assert ix.finish_loads(both.view(np.uint64)) == 0 and ix.readers(d(2)) == 0  # any item size
    spread = np.frombuffer(b"".join(bytes([x, 0]) for x in d(1)), np.uint8)[::2]
    assert spread.tobytes() == d(1)
    msg = "digests must be a C-contiguous buffer of 16-byte digests; this {} is not contiguous"
    calls = {"touch": lambda x: ix.touch(x), "admit_loads": lambda x: ix.admit_loads(x),
             "finish_loads": lambda x: ix.finish_loads(x),
             "admit_stores": lambda x: ix.admit_stores(x, 1),
             "finish_stores": lambda x: ix.finish_stores(x, [1])}
    for name, call in calls.items():
        for bad, tname in ((spread, "ndarray"), (memoryview(bytes(spread.base))[::2], "memoryview"),
                           (both[::-1][:16], "ndarray")):
            with pytest.raises(TypeError) as e:
                call(bad)
            assert (name, str(e.value)) == (name, msg.format(tname))
    assert ix.lru_order() == [d(1), d(2)] and ix.readers(d(1)) == 0 and len(ix) == 2  # as loaded


@pytest.mark.parametrize("job_id, shown", [(2**63, "9223372036854775808"), (-1, "-1"),
                                            (-(2**64), str(-(2**64)))])
def test_check_job_job_id_range(job_id, shown):
    job = TransferJob(job_id, [b"a"], [0])
    with pytest.raises(ValueError) as e:
        _native.check_job(job, 4, True)
    assert str(e.value) == f"job_id {shown} must be in [0, 2**63)"
    with pytest.raises(TypeError) as e:
        _native.check_job(TransferJob(1.0, [b"a"], [0]), 4, True)
    assert str(e.value) == "job_id must be an integer, not float"
    keys, digests, slots = _native.check_job(TransferJob(2**63 - 1, (b"a",), [3]), 4, True)
    assert keys == [b"a"]
    assert digests == hashlib.blake2b(b"a", digest_size=16).digest()
    assert slots == struct.pack("=q", 3)


@pytest.mark.parametrize("slots", [
    np.array([3, 0, 2], dtype=np.int64), np.array([3, 0, 2], dtype=np.uint8),
    np.array([9, 3, 7, 0, 5, 2], dtype=np.int32)[1::2],  # strided: read by its strides
    np.array([2, 0, 3], dtype=np.int16)[::-1], [3, 0, 2], (np.int64(3), 0, np.uint16(2))])
def test_check_job_slot_ids_any_integer_sequence(slots):
    keys, digests, packed = _native.check_job(TransferJob(5, [b"x", b"y", b"z"], slots), 4, True)
    assert struct.unpack("=3q", packed) == (3, 0, 2)
    assert digests == b"".join(hashlib.blake2b(k, digest_size=16).digest() for k in keys)


@pytest.mark.parametrize("slots, exc, msg", [
    (np.array([0, -1], dtype=np.int64), ValueError, "job 5: slot -1 outside the arena (0..3)"),
    (np.array([0, 4], dtype=np.uint64), ValueError, "job 5: slot 4 outside the arena (0..3)"),
    (np.array([0, 1, 2], dtype=np.int64), ValueError, "job 5: 2 keys but 3 slot_ids"),
    (np.array([0.0, 1.0]), TypeError, "job 5: slot id must be an integer, not float64"),
    ([0, True], TypeError, "job 5: slot id must be an integer, not bool"),
    (b"\x00\x01", TypeError, "job 5: slot_ids must be a sequence of ints, not one bytes"),
    (7, TypeError, "job 5: slot_ids must be a sequence of ints, not int"),
    ([1, 1], ValueError, "job 5: slot 1 given twice; a load needs a slot per key"),
])
def test_check_job_bad_slot_ids(slots, exc, msg):
    with pytest.raises(exc) as e:
        _native.check_job(TransferJob(5, [b"x", b"y"], slots), 4, True)
    assert str(e.value) == msg


def test_check_job_in_flight_and_keys():
    with pytest.raises(ValueError) as e:
        _native.check_job(TransferJob(7, [b"x"], [0]), 4, True, None, {6, 7})
    assert str(e.value) == ("job_id 7 is already in flight (or its result not yet reported by "
                            "get_finished_jobs())")
    keys, _, _ = _native.check_job(TransferJob(7, [b"x"], [0]), 4, True, None, {6})
    assert keys == [b"x"]
    for bad, msg in ((b"xy", "job 7: keys must be a sequence of keys (bytes), not one bytes: wrap a "
                              "single key in a list"),
                     (["x"], "job 7: key must be bytes, not str"),
                     (5, "job 7: keys must be a sequence of keys (bytes), not int")):
        with pytest.raises(TypeError) as e:
            _native.check_job(TransferJob(7, bad, [0]), 4, True)
        assert str(e.value) == msg
    given = [bytearray(b"ab"), memoryview(b"cd"), np.frombuffer(b"efgh", np.uint8)[::2]]
    keys, digests, _ = _native.check_job(TransferJob(7, given, [0, 1, 2]), 4, True)
    assert keys == [b"ab", b"cd", b"eg"] and all(type(k) is bytes for k in keys)
    assert type(given[0]) is bytearray  # the caller's list is left as it was


class _Model:
    """The index's state machine in plain Python (block_index.hpp's contract), for the
    randomized comparison below."""

    def __init__(self):
        self.e = {}  # digest -> [state, readers, failed]
        self.lru = []  # present blocks, least recently used first

    def indexed(self, dg):
        return dg in self.e and self.e[dg][0] in (PRESENT, WRITING, REMOVING)

    def back(self, dg):
        if dg in self.lru:
            self.lru.remove(dg)
        self.lru.append(dg)

    def drop_lru(self, dg):
        if dg in self.lru:
            self.lru.remove(dg)

    def tombstone(self, dg):
        self.drop_lru(dg)
        self.e[dg][0], self.e[dg][1] = FAILED, 0

    def add_present(self, dg):
        if self.indexed(dg) or (dg in self.e and self.e[dg][2]):
            return False
        self.e[dg] = [PRESENT, 0, False]
        self.back(dg)
        return True

    def insert_writing(self, dg):
        if self.indexed(dg):
            return False
        self.e[dg] = [WRITING, 0, False]
        return True

    def finish_store(self, dg):
        if dg in self.e and self.e[dg][0] == WRITING:
            self.e[dg][0] = PRESENT
            self.back(dg)
            return 1
        return 0

    def erase_writing(self, dg):
        if dg in self.e and self.e[dg][0] == WRITING:
            del self.e[dg]
            return True
        return False

    def set_removing(self, dg):
        if dg in self.e and self.e[dg][0] == PRESENT and self.e[dg][1] == 0:
            self.drop_lru(dg)
            self.e[dg][0] = REMOVING
            return True
        return False

    def forget_removed(self, dg):
        if dg not in self.e or self.e[dg][0] != REMOVING:
            return False
        if self.e[dg][2]:
            self.tombstone(dg)
        else:
            self.drop_lru(dg)
            del self.e[dg]
        return True

    def restore(self, dg):
        if dg not in self.e or self.e[dg][0] != REMOVING:
            return False
        self.e[dg][0] = PRESENT
        self.drop_lru(dg)
        self.lru.insert(0, dg)
        return True

    def mark_failed(self, dg):
        if dg not in self.e:
            self.e[dg] = [FAILED, 0, False]
        was = self.e[dg][2]
        self.e[dg][2] = True
        return not was

    def admit_load(self, dg):
        if dg not in self.e:
            return A_ABSENT
        st, _, failed = self.e[dg]
        if failed:
            return A_FAILED
        c = {PRESENT: OK, WRITING: A_WRITING, REMOVING: A_REMOVING}.get(st, A_ABSENT)
        if c == OK:
            self.e[dg][1] += 1
            self.back(dg)
        return c

    def finish_load(self, dg):
        if dg not in self.e or self.e[dg][1] == 0:
            return 0
        self.e[dg][1] -= 1
        if self.e[dg][1] == 0 and self.e[dg][2] and self.e[dg][0] == PRESENT:
            self.tombstone(dg)
            return 1
        return 0

    def take_victims(self, n, keep):
        out = []
        for dg in list(self.lru):
            if len(out) == n:
                break
            if self.e[dg][1] or dg in keep:
                continue
            self.lru.remove(dg)
            self.e[dg][0] = REMOVING
            out.append(dg)
        return out


def test_index_matches_a_model_under_random_operations():
    """The open-addressing table (backward-shift deletion, growth) and the index-linked LRU
    list against a plain-Python model: 40,000 seeded random operations over 3,000 digests
    (entries inserted, erased and reused many times), states, readers, failed marks, the LRU
    order and the counts compared throughout."""
    import random

    rng = random.Random(7)
    pool = [d(i) for i in range(3000)]
    ix, m = _native.BlockIndex(unknown_is_miss=True), _Model()
    for step in range(40_000):
        dg = rng.choice(pool)
        op = rng.randrange(12)
        if op == 0:
            assert ix.add_present(dg) == m.add_present(dg)
        elif op == 1:
            assert ix.insert_writing(dg) == m.insert_writing(dg)
        elif op == 2:
            assert ix.finish_stores(dg, [0]) == m.finish_store(dg)
        elif op == 3:
            assert ix.erase_writing(dg) == m.erase_writing(dg)
        elif op == 4:
            assert ix.set_removing(dg) == m.set_removing(dg)
        elif op == 5:
            assert ix.forget_removed(dg) == m.forget_removed(dg)
        elif op == 6:
            assert ix.restore(dg) == m.restore(dg)
        elif op == 7 and rng.random() < 0.2:
            assert ix.mark_failed(dg) == m.mark_failed(dg)
        elif op == 8:
            codes = ix.admit_loads(dg)
            assert (OK if codes is None else codes[0]) == m.admit_load(dg)
        elif op == 9:
            assert ix.finish_loads(dg) == m.finish_load(dg)
        elif op == 10:
            keep = set(rng.sample(pool, 3))
            n = rng.randrange(4)
            assert ix.take_victims(n, list(keep)) == m.take_victims(n, keep)
        else:
            buf = b"".join(rng.sample(pool, 4))
            ix.touch(buf)
            for x in (buf[i:i + 16] for i in range(0, 64, 16)):
                if x in m.lru:
                    m.back(x)
        if step % 2000 == 0 or step == 39_999:
            assert ix.lru_order() == m.lru
            assert len(ix) == sum(m.indexed(x) for x in pool) and ix.present == len(m.lru)
            for x in pool:
                st = m.e.get(x, [ABSENT, 0, False])
                assert (ix.state(x), ix.readers(x), ix.failed(x)) == tuple(st), (step, x.hex())
