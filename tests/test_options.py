"""DiskTier's options and jobs checked at construction / submit (issue #9 items 4, 6, 12).

Each bad option is an exception of one type whose message names the option, raised before the
root is touched; each job's keys and slot ids are taken once, so one-shot iterables report
their failures exactly.
"""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest

from pykvtier import DiskTier, TransferJob, host_arena
from pykvtier.layout import HEADER_BYTES, key_digest

BS = 64 << 10
FB = BS + HEADER_BYTES




def fill(arr: np.ndarray, seed: int) -> np.ndarray:
    arr[...] = np.random.default_rng(seed).integers(0, 256, arr.shape, dtype=np.uint8)
    return arr


def finish(tier: DiskTier):
    tier.drain()
    return tier.get_finished_jobs()


# ------------------------------------------------------------------------- item 4: one-shot keys


def test_store_with_generator_keys_reports_the_failed_key(root, make_tier, arena):
    """keys (and slot_ids) as generators: taken once at submit, so the result names exactly
    the key whose write failed (its fan-out directory replaced by a file: ENOTDIR)."""
    tier = make_tier(root)
    a = fill(arena(4, BS), 1)
    tier.set_arena(a)
    keys = [b"g-%d" % i for i in range(4)]
    subs = {key_digest(k).hex()[:2] for k in keys}
    assert len(subs) == 4  # each key in its own fan-out directory
    bad = keys[2]
    fan = os.path.dirname(tier.layout.block_path(key_digest(bad)))
    os.rmdir(fan)
    with open(fan, "w"):
        pass
    tier.submit_store(TransferJob(1, (k for k in keys), [0, 1, 2, 3]))
    (res,) = finish(tier)
    assert res.job_id == 1 and res.is_load is False and res.success is False
    assert list(res.failed_keys) == [bad]
    assert res.failed_keys[bad].startswith("ENOTDIR")
    assert res.successful_keys == [keys[0], keys[1], keys[3]]
    assert res.transfer_bytes == 3 * BS
    assert tier.num_blocks == 3 and tier.used_bytes == 3 * FB


def test_load_with_generator_keys_reports_the_failed_keys(root, make_tier, arena):
    """A load's generator keys: one key absent (settled without I/O), one block corrupt (failed
    by the engine): both in failed_keys, the others loaded byte-exact."""
    tier = make_tier(root)
    a = fill(arena(4, BS), 2)
    tier.set_arena(a)
    keys = [b"l-%d" % i for i in range(3)]
    tier.submit_store(TransferJob(1, keys, [0, 1, 2]))
    (res,) = finish(tier)
    assert res.success is True
    src = a.copy()
    path = tier.layout.block_path(key_digest(keys[1]))
    with open(path, "r+b") as f:  # one payload byte flipped: checksum mismatch
        f.seek(HEADER_BYTES + 100)
        b = f.read(1)
        f.seek(HEADER_BYTES + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    a[:] = 0
    want = [keys[0], keys[1], b"absent", keys[2]]
    tier.submit_load(TransferJob(2, (k for k in want), [3, 2, 1, 0]))
    (res,) = finish(tier)
    assert res.job_id == 2 and res.is_load is True and res.success is False
    assert res.failed_keys == {keys[1]: "payload checksum mismatch (corrupt bytes)",
                               b"absent": "not in the tier"}
    assert res.successful_keys == [keys[0], keys[2]]
    assert res.transfer_bytes == 2 * BS
    assert np.array_equal(a[3], src[0]) and np.array_equal(a[0], src[2])


def test_slot_ids_may_be_one_shot_too(root, make_tier, arena):
    tier = make_tier(root)
    a = fill(arena(2, BS), 5)
    tier.set_arena(a)
    tier.submit_store(TransferJob(1, iter([b"x", b"y"]), iter([1, 0])))
    (res,) = finish(tier)
    assert res.success is True and res.transfer_bytes == 2 * BS
    src = a.copy()
    a[:] = 0
    tier.submit_load(TransferJob(2, iter([b"x", b"y"]), iter([0, 1])))
    (res,) = finish(tier)
    assert res.success is True
    assert np.array_equal(a[0], src[1]) and np.array_equal(a[1], src[0])


# ------------------------------------------------------------------------- item 12: options

BAD_OPTIONS = [
    # (keyword arguments, exception type, text the message contains)
    ({"probe_ttl_s": "x"}, TypeError, "probe_ttl_s must be a number of seconds, not str"),
    ({"probe_ttl_s": True}, TypeError, "probe_ttl_s must be a number of seconds, not bool"),
    ({"probe_ttl_s": -1}, ValueError, "probe_ttl_s must be >= 0 seconds, got -1.0"),
    ({"probe_ttl_s": float("nan")}, ValueError, "probe_ttl_s must be >= 0 seconds, got nan"),
    ({"direct": "no"}, ValueError, "direct must be None ('auto'), True or False, got 'no'"),
    ({"direct": 1}, ValueError, "direct must be None ('auto'), True or False, got 1"),
    ({"block_size_bytes": True}, TypeError, "block_size_bytes must be an integer, not bool"),
    ({"block_size_bytes": 4096.0}, TypeError, "block_size_bytes must be an integer, not float"),
    ({"block_size_bytes": 0}, ValueError, "block_size_bytes must be a positive int <= 1073741824"),
    ({"block_size_bytes": 2**31}, ValueError, "block_size_bytes must be a positive int <= 1073741824"),
    ({"block_size_bytes": 2**30 + 1}, ValueError, "got 1073741825"),
    ({"root_dir": ""}, ValueError, "root_dir must not be empty"),
    ({"root_dir": 5}, TypeError, "root_dir must be a str or os.PathLike, not int"),
    ({"root_dir": None}, TypeError, "root_dir must be a str or os.PathLike, not NoneType"),
    ({"max_inflight_bytes": 2**70}, ValueError, "max_inflight_bytes must be at most 2**48"),
    ({"max_inflight_bytes": 2**48 + 1}, ValueError, "max_inflight_bytes must be at most 2**48"),
    ({"max_inflight_bytes": 0}, ValueError, "max_inflight_bytes must be positive, got 0"),
    ({"max_inflight_bytes": "1G"}, TypeError, "max_inflight_bytes must be an integer, not str"),
    ({"capacity_bytes": -1}, ValueError, "capacity_bytes=-1 cannot hold one block"),
    ({"capacity_bytes": True}, TypeError, "capacity_bytes must be an integer, not bool"),
    ({"queue_depth": 0}, ValueError, "queue_depth must be in 1..4096, got 0"),
    ({"queue_depth": True}, TypeError, "queue_depth must be an integer, not bool"),
    ({"min_free_bytes": -1}, ValueError, "min_free_bytes must be >= 0, got -1"),
    ({"min_free_bytes": "5%"}, TypeError, "min_free_bytes must be an integer, not str"),
    ({"recycle": 1}, ValueError, "recycle must be True or False, got 1"),
    ({"shared": None}, ValueError, "shared must be True or False, got None"),
    ({"fsync": "yes"}, ValueError, "fsync must be True or False, got 'yes'"),
]


@pytest.mark.parametrize("kw,exc,text", BAD_OPTIONS,
                         ids=[f"{next(iter(k))}={next(iter(k.values()))!r}" for k, _, _ in BAD_OPTIONS])
def test_bad_option_is_named_before_the_root_is_touched(root, kw, exc, text):
    where = os.path.join(root, "tier")
    kw = dict(kw)
    args = (kw.pop("root_dir", where), kw.pop("block_size_bytes", BS))
    with pytest.raises(exc) as info:
        DiskTier(*args, **kw)
    assert text in str(info.value)
    assert not os.path.exists(where)  # nothing created


def test_edge_values_are_taken(root, make_tier):
    t = make_tier(os.path.join(root, "a"), block_size_bytes=np.int64(2**30), probe_ttl_s=0,
                  max_inflight_bytes=2**48, min_free_bytes=0)
    assert (t.block_size_bytes, t.file_bytes, t.probe_ttl_s, t.min_free_bytes) == (
        2**30, 2**30 + HEADER_BYTES, 0.0, 0)
    assert type(t.block_size_bytes) is int and type(t.probe_ttl_s) is float
    t = make_tier(os.path.join(root, "b"), probe_ttl_s=5, direct=False)
    assert t.probe_ttl_s == 5.0 and t.direct is False


def test_direct_true_with_an_unaligned_block_size_fails_at_construction(direct_root):
    with pytest.raises(ValueError) as info:
        DiskTier(direct_root, BS + 512, direct=True)
    assert str(info.value) == (f"direct=True but block_size_bytes={BS + 512} is not a multiple "
                               f"of 4096 bytes, the O_DIRECT alignment at "
                               f"{os.path.realpath(direct_root)}")


def test_arena_rows_shorter_than_a_block_are_an_error(root, make_tier):
    """host_arena(8, BS / 2) for BS blocks was taken as 4 slots of BS."""
    tier = make_tier(root)
    half = host_arena(8, BS // 2)
    with pytest.raises(ValueError) as info:
        tier.set_arena(half)
    assert str(info.value) == (f"arena slots of {BS // 2} bytes are smaller than a block "
                               f"({BS} bytes)")
    with pytest.raises(ValueError) as info:
        tier.set_arena(half, slot_bytes=BS)
    assert str(info.value) == (f"arena rows of {BS // 2} bytes are shorter than slot_bytes={BS}: "
                               "a multi-dimensional arena has one slot per row")
    with pytest.raises(ValueError, match="smaller than a block"):
        DiskTier(os.path.join(root, "other"), BS, arena=host_arena(8, BS // 2))
    with pytest.raises(RuntimeError, match="no arena"):
        tier.submit_store(TransferJob(1, [b"k"], [0]))  # none of them was taken


def test_arena_rows_longer_than_a_block_are_one_slot_each(root, make_tier):
    """A (4, 2*BS) arena has 4 slots (one per row), not 8 of BS: slot 3 is row 3."""
    tier = make_tier(root)
    a = fill(host_arena(4, 2 * BS), 3)
    arena = tier.set_arena(a)
    assert (arena.num_slots, arena.slot_bytes) == (4, 2 * BS)
    src = a.copy()
    tier.submit_store(TransferJob(1, [b"r3", b"r1"], [3, 1]))
    (res,) = finish(tier)
    assert res.success is True and res.transfer_bytes == 2 * BS
    a[:] = 0
    tier.submit_load(TransferJob(2, [b"r3", b"r1"], [0, 2]))
    (res,) = finish(tier)
    assert res.success is True
    assert np.array_equal(a[0, :BS], src[3, :BS]) and np.array_equal(a[2, :BS], src[1, :BS])
    assert not a[0, BS:].any() and not a[1].any() and not a[3].any()
    with pytest.raises(ValueError, match=r"slot 4 outside the arena \(0\.\.3\)"):
        tier.submit_load(TransferJob(3, [b"r3"], [4]))


# ------------------------------------------------------------------------- item 6: fsync policy


def test_fsync_turns_recycling_off(root, make_tier, arena):
    """With fsync=True an evicted block's file is unlinked, never renamed to a new block's
    temporary name (that rename would need one more directory fsync per store)."""
    tier = make_tier(root, fsync=True, recycle=True, capacity_bytes=2 * FB)
    assert tier.recycle is False
    assert make_tier(os.path.join(root, "plain"), recycle=True).recycle is True
    a = fill(arena(4, BS), 4)
    tier.set_arena(a)
    keys = [b"f-%d" % i for i in range(4)]
    for job_id, ks, slots in ((1, keys[:2], [0, 1]), (2, keys[2:], [2, 3])):
        tier.submit_store(TransferJob(job_id, ks, slots))
        (res,) = finish(tier)
        assert res.success is True and res.transfer_bytes == 2 * BS
    tier.drain()
    tier.get_finished_jobs()
    s = tier.stats()
    assert (s["evictions"], s["evictions_recycled"], s["files_recycled"]) == (2, 0, 0)
    files = sorted(glob.glob(os.path.join(tier.layout.blocks_dir, "*", "*")))
    assert files == sorted(tier.layout.block_path(key_digest(k)) for k in keys[2:])


@pytest.mark.parametrize("given, want", [
    ("640", 0o640), ("0640", 0o640), ("0o640", 0o640), (0o640, 0o640), (416, 0o640), (0o600, 0o600)])
def test_file_mode_spellings(given, want):
    from pykvtier.layout import check_file_mode
    assert check_file_mode(given) == want


def test_a_bare_640_from_yaml_is_named_as_the_number_it_is():
    """YAML and JSON read an unquoted 640 as the number 640 (0o1200): the error says so and
    how to write octal 640."""
    from pykvtier.layout import check_file_mode
    with pytest.raises(ValueError) as err:
        check_file_mode(640)
    assert str(err.value) == (
        "mode must be file permission bits within 0o666 with owner read and write set (e.g. "
        "0o600, 0o640, 0o660), got 0o1200 (the number 640; for octal 640 write the string \"640\")")
    with pytest.raises(ValueError) as err:
        check_file_mode(0o744)  # 484: no octal-looking number, no hint
    assert str(err.value).endswith("got 0o744")
