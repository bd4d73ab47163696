"""Adversarial tests of PyKVTierHiCache (pykvtier.integrations.sglang) under SGLang 0.5.23.

Each test is one attempt to break the backend as a user or operator could: bad extra-config
options, malformed host indices and keys, damaged or foreign block files, a full file system, a
killed writer, two backends on one root, calls racing close()/clear(), huge existence batches,
MLA ranks. Tests marked ``xfail(strict=True)`` expose a bug (the reason says which); they flip
to failures once it is fixed. Helpers (real SGLang host pools, the backend as SGLang's factory
builds it) come from tests/test_sglang.py.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

import sglang_torchvision_stub  # (tests/ is on sys.path, as for conftest)

pytestmark = pytest.mark.sglang

sglang_torchvision_stub.install()
try:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from pykvtier.integrations.sglang import PyKVTierHiCache
    from pykvtier.layout import key_digest
    from test_sglang import (P, build, extra, fill_random, keys_of, mha_host, mla_host, page,
                             storage_config)
except ImportError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"SGLang is not installed ({exc})", allow_module_level=True)

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def backends():
    made = []
    yield made
    for b in made:
        b.close()


def hkeys(n, tag):
    """``n`` 64-hex-digit keys, distinct per tag (keys_of's tag is cut off past one digit)."""
    return [hashlib.sha256(f"{tag}-{i}".encode()).hexdigest() for i in range(n)]


def block_path(b, key, j=None):
    """The block file of ``key`` (region ``j`` of an MHA zero-copy page)."""
    bk = key if j is None else f"{key}:{j}"
    d = key_digest(bk.encode())
    shard = b._shard(d) if len(b._tiers) > 1 else 0
    return b._tiers[shard].layout.block_path(d)


def pages_at(host, idx):
    return [page(host, t) for t in idx[::P]]


def wipe(host):
    host.kv_buffer.view(-1).view(torch.uint8)[:] = 0


# ---------------------------------------------------------------------------- options


@pytest.mark.parametrize("options,named", [
    ({"capacity_bytes": "100"}, "capacity_bytes must be a positive integer, got '100'"),
    ({"capacity_bytes": -1}, "capacity_bytes must be a positive integer, got -1"),
    ({"capacity_bytes": 1e12}, "capacity_bytes must be a positive integer, got 1000000000000.0"),
    ({"capacity_bytes": True}, "capacity_bytes must be a positive integer, got True"),
    ({"queue_depth": "64"}, "queue_depth must be a positive integer, got '64'"),
    ({"queue_depth": 1 << 30}, "queue_depth must be in 1..4096"),
    ({"max_inflight_bytes": 0}, "max_inflight_bytes must be a positive integer, got 0"),
    ({"staging_pages": 1}, "staging_pages must be at least 2"),
    ({"staging_pages": True}, "staging_pages must be a positive integer, got True"),
    ({"direct": "yes"}, "direct must be true, false or \"auto\", got 'yes'"),
    ({"direct": 1}, "direct must be true, false or \"auto\", got 1"),
    ({"shared": "true"}, "shared must be true or false, got 'true'"),
    ({"fsync": 1}, "fsync must be true or false, got 1"),
    ({"mode": "abc"}, "mode must be file permission bits"),
    ({"mode": 0o400}, "mode must be file permission bits within 0o666 with owner read and "
                      "write set"),
    ({"mode": 0o777}, "mode must be file permission bits within 0o666"),
    ({"min_free_bytes": -1}, "min_free_bytes must be null or an integer >= 0, got -1"),
    ({"probe_ttl_s": float("nan")}, "probe_ttl_s must be a number >= 0"),
    ({"probe_ttl_s": "1"}, "probe_ttl_s must be a number >= 0 \\(seconds\\), got '1'"),
    ({"verify": "none"}, "verify must be 'payload' or 'header', got 'none'"),
    ({"zero_copy": True}, "zero_copy must be \"auto\" or false, got True"),
    ({"engine": "spdk"}, "engine"),
    ({"Root_dir": "/x"}, "unknown option 'Root_dir'"),
    ({"capacity": 1, "qd": 2}, "unknown options 'capacity', 'qd'"),
    ({"root_dir": ""}, "root_dir entry '' is not a usable path"),
    ({"root_dir": []}, "root_dir must be a path or a non-empty list"),
    ({"root_dir": 123}, "root_dir must be a path or a non-empty list"),
    ({"root_dir": ["/a\0b"]}, "root_dir entry '/a\\\\x00b' is not a usable path"),
])
def test_bad_option_is_refused_naming_the_key(root, options, named):
    """Every bad option: ValueError naming the key and the value, raised by SGLang's factory
    (it re-raises the constructor's error) before anything is created under the root."""
    _, host = mha_host("page_first")
    with pytest.raises(ValueError, match=named):
        StorageBackendFactory.create_backend("dynamic", storage_config(extra(root, **options)),
                                             host)
    assert os.listdir(root) == []  # nothing touched


def test_root_listed_twice_and_capacity_below_one_block(root):
    _, host = mha_host("page_first")
    with pytest.raises(ValueError, match="root_dir lists a directory twice"):
        build(host, [root, root + "/"])
    with pytest.raises(ValueError, match="capacity_bytes=1 cannot hold one block"):
        build(host, root, capacity_bytes=1)


def test_interface_v1_string_zero_is_read_as_sglang_reads_it(root, backends):
    """``"interface_v1": "0"`` is truthy for SGLang's controller
    (``bool(extra_config.get("interface_v1", 0))``, cache_controller.py:664: the zero-copy
    page functions) and for the backend alike: both take the v1 path, so they agree."""
    _, host = mha_host("page_first")
    b = build(host, root, interface_v1="0")
    backends.append(b)
    assert b.interface_v1 is True and b._geometry.zero_copy is True
    assert bool(b.storage_config.extra_config.get("interface_v1", 0)) is True


def test_unusable_roots_name_the_root(root):
    _, host = mha_host("page_first")
    f = os.path.join(root, "afile")
    open(f, "w").close()
    good = os.path.join(root, "good")
    with pytest.raises(ValueError, match=r"root '.*afile': cannot create the pykvtier-sglang "
                                         r"directory .*Not a directory"):
        build(host, [good, f])
    # the first root, opened before the second failed, was let go: usable at once
    build(host, good).close()


# ---------------------------------------------------------------------------- host indices, keys


def _zc_and_staging():
    return [("page_first", "auto"), ("page_first", False), ("layer_first", "auto")]


@pytest.mark.parametrize("layout,zc", _zc_and_staging())
def test_empty_batches(root, backends, layout, zc):
    _, host = mha_host(layout)
    b = build(host, root, zero_copy=zc)
    backends.append(b)
    assert b.batch_set_v1([], host.alloc(0)) == []
    assert b.batch_get_v1([], host.alloc(0)) == []
    assert b.batch_exists([]) == 0
    assert b.batch_set([], []) is True and b.batch_get([]) == []
    assert b.stats()["stores_submitted"] == 0 and b.stats()["loads_submitted"] == 0


def test_calls_before_registration_answer_missing(root, backends):
    _, host = mha_host("page_first")
    early = StorageBackendFactory.create_backend("dynamic", storage_config(extra(root)), host)
    backends.append(early)
    k = keys_of(2)
    assert early.batch_exists(k) == 0
    assert early.batch_get_v1(k, host.alloc(2 * P)) == [False, False]
    assert early.batch_set_v1(k, host.alloc(2 * P)) == [False, False]


@pytest.mark.parametrize("layout,zc", _zc_and_staging())
def test_duplicate_keys_in_one_batch(root, backends, layout, zc):
    _, host = mha_host(layout)
    b = build(host, root, zero_copy=zc)
    backends.append(b)
    fill_random(host, 4)
    k = hkeys(2, "dup")
    src = host.alloc(3 * P)
    want = pages_at(host, src)
    # the same key twice (from different slots): the first one's bytes are the page
    assert b.batch_set_v1([k[0], k[0], k[1]], src) == [True, True, True]
    dst = host.alloc(3 * P)
    wipe(host)
    assert b.batch_get_v1([k[0], k[1], k[0]], dst) == [True, True, True]
    got = pages_at(host, dst)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[0])
    assert torch.equal(got[1], want[2])
    per = b._geometry.blocks_per_page
    assert b.stats()["blocks_stored"] == 2 * per


def test_wrong_length_host_indices_zero_copy_name_the_indices(root, backends):
    _, host = mha_host("page_first")
    b = build(host, root)
    backends.append(b)
    assert b._geometry.zero_copy
    src = host.alloc(3 * P)
    k = hkeys(2, "len")
    for idx in (src[:3 * P], src[:P + 4], src[:0], src[:2 * P].reshape(2, P)):
        with pytest.raises(ValueError, match="host_indices"):
            b.batch_set_v1(k, idx)
        with pytest.raises(ValueError, match="host_indices"):
            b.batch_get_v1(k, idx)
    assert b.batch_exists(k) == 0  # nothing stored by the refused calls


def test_wrong_length_host_indices_staging_name_the_indices(root, backends):
    _, host = mha_host("layer_first")
    b = build(host, root)
    backends.append(b)
    src = host.alloc(3 * P)
    k = hkeys(2, "len")
    with pytest.raises(ValueError, match=r"48 host_indices for 2 pages of 16 tokens \(want 32\)"):
        b.batch_set_v1(k, src[:3 * P])
    with pytest.raises(ValueError, match="20 host_indices for 2 pages of 16 tokens"):
        b.batch_get_v1(k, src[:20])
    assert b.batch_exists(k) == 0


@pytest.mark.parametrize("bad", [10 ** 6, -16])
def test_out_of_pool_host_index_staging_is_a_clear_error(root, backends, bad):
    _, host = mha_host("layer_first")
    b = build(host, root)
    backends.append(b)
    k = hkeys(1, "oob")
    idx = torch.arange(bad, bad + P)
    with pytest.raises(ValueError, match="host_indices"):
        b.batch_set_v1(k, idx)
    with pytest.raises(ValueError, match="host_indices"):
        b.batch_get_v1(k, idx)


def test_out_of_pool_host_index_zero_copy_is_a_clear_error(root, backends):
    _, host = mha_host("page_first")
    b = build(host, root)
    backends.append(b)
    fill_random(host, 2)
    k = hkeys(2, "oob")
    with pytest.raises(ValueError, match=r"host_indices of page 0 \(1000000\.\.1000015\) are not "
                                         r"one page of the pool"):
        b.batch_set_v1(k[:1], torch.arange(10 ** 6, 10 ** 6 + P))
    assert b.batch_exists(k) == 0
    src = host.alloc(P)
    want = page(host, src[0])
    assert b.batch_set_v1(k[1:], src) == [True]  # the next batch carries on
    dst = host.alloc(P)
    assert b.batch_get_v1(k[1:], dst) == [True] and torch.equal(page(host, dst[0]), want)


@pytest.mark.parametrize("zc", ["auto", False])
def test_non_contiguous_page_indices_are_refused(root, backends, zc):
    _, host = mha_host("page_first")
    b = build(host, root, zero_copy=zc)
    backends.append(b)
    fill_random(host, 3)
    base = host.alloc(4 * P)
    idx = torch.cat([base[:P // 2], base[2 * P:2 * P + P // 2]])
    k = hkeys(1, "nc")
    with pytest.raises(ValueError, match="host_indices|host indices"):
        b.batch_set_v1(k, idx)


def test_unaligned_host_indices_zero_copy_name_the_indices(root, backends):
    _, host = mha_host("page_first")
    b = build(host, root)
    backends.append(b)
    src = host.alloc(2 * P)
    with pytest.raises(ValueError, match="host_indices.*page boundary"):
        b.batch_set_v1(hkeys(1, "ua"), src[8:8 + P])


@pytest.mark.parametrize("zc", ["auto", False])
def test_non_str_keys_are_a_clear_error(root, backends, zc):
    _, host = mha_host("page_first")
    b = build(host, root, zero_copy=zc)
    backends.append(b)
    src = host.alloc(P)
    for bad in (12, b"abc"):
        with pytest.raises(TypeError, match="key"):
            b.batch_set_v1([bad], src)
        with pytest.raises(TypeError, match="key"):
            b.batch_exists([bad])
    assert b.batch_exists(["12"]) == 0


def test_two_roots_same_slots_in_one_get_never_report_a_wrong_page(root, backends):
    _, host = mla_host("page_first")
    roots = [os.path.join(root, "r0"), os.path.join(root, "r1")]
    b = build(host, roots, mla=True)
    backends.append(b)
    fill_random(host, 6)
    cand = hkeys(64, "xs")
    shards = {b._shard(key_digest(k.encode())) for k in cand}
    assert shards == {0, 1}
    k0 = next(k for k in cand if b._shard(key_digest(k.encode())) == 0)
    k1 = next(k for k in cand if b._shard(key_digest(k.encode())) == 1)
    src = host.alloc(2 * P)
    want = dict(zip((k0, k1), pages_at(host, src)))
    assert not torch.equal(want[k0], want[k1])
    assert b.batch_set_v1([k0, k1], src) == [True, True]
    dst = host.alloc(P)
    wipe(host)
    got = b.batch_get_v1([k0, k1], torch.cat([dst, dst]))
    for k, ok in zip((k0, k1), got):
        if ok:
            assert torch.equal(page(host, dst[0]), want[k]), f"{k[:8]} reported loaded"
    # bad input loses nothing: both pages are still here and load byte-exact
    assert b.batch_exists([k0, k1]) == 2
    dst2 = host.alloc(2 * P)
    assert b.batch_get_v1([k0, k1], dst2) == [True, True]
    assert [torch.equal(g, want[k]) for g, k in zip(pages_at(host, dst2), (k0, k1))] == [True] * 2


def test_one_root_same_slots_in_one_get_are_refused(root, backends):
    _, host = mla_host("page_first")
    b = build(host, root, mla=True)
    backends.append(b)
    fill_random(host, 6)
    k = hkeys(3, "ss")
    src = host.alloc(3 * P)
    want = pages_at(host, src)
    assert b.batch_set_v1(k, src) == [True] * 3
    dst = host.alloc(P)
    assert b.batch_get_v1(k[:2], torch.cat([dst, dst])) == [False, False]
    dst2 = host.alloc(P)  # the next batch carries on
    assert b.batch_get_v1(k[2:], dst2) == [True] and torch.equal(page(host, dst2[0]), want[2])


# ---------------------------------------------------------------------------- damaged files


@pytest.mark.parametrize("kind,zc", [("mha", "auto"), ("mha", False), ("mla", "auto")])
def test_damaged_block_files_fail_alone_and_answer_missing(root, backends, kind, zc):
    """Truncated, zero-byte, foreign (another key's block copied in), a directory, a symlink to
    a good block, removed (ENOENT), and a corrupt header or a lost V region: each page fails
    alone, answers missing from then on, and can be stored again."""
    _, host = (mha_host if kind == "mha" else mla_host)("page_first")
    b = build(host, root, mla=kind == "mla", zero_copy=zc)
    backends.append(b)
    per = b._geometry.blocks_per_page
    fill_random(host, 3)
    k = hkeys(9, "dmg")
    src = host.alloc(9 * P)
    want = pages_at(host, src)
    assert b.batch_set_v1(k, src) == [True] * 9
    j = 0 if per == 2 else None
    path = [block_path(b, key, j) for key in k]
    with open(path[1], "r+b") as f:
        f.truncate(5000)
    open(path[2], "w").close()
    shutil.copyfile(path[8], path[3])
    os.unlink(path[4])
    os.mkdir(path[4])
    os.unlink(path[5])
    os.symlink(path[8], path[5])
    os.unlink(path[6])
    if per == 2:
        os.unlink(block_path(b, k[7], 1))
    else:
        with open(path[7], "r+b") as f:
            f.seek(10)
            f.write(b"\xff\xff")
    assert b.batch_exists(k) == 9  # from the index: nothing is read to answer it
    wipe(host)
    dst = host.alloc(9 * P)
    good = [True] + [False] * 7 + [True]
    assert b.batch_get_v1(k, dst) == good
    got = pages_at(host, dst)
    assert torch.equal(got[0], want[0]) and torch.equal(got[8], want[8])
    assert [b.exists(key) for key in k] == good
    assert b.batch_exists(k) == 1
    assert b.batch_get_v1(k, dst) == good  # and fail again without I/O
    st = b.stats()
    # truncated, zero-byte, foreign, and (one block per page) the corrupt header
    assert (st["pages_load_failed"], st["verify_failures"]) == (14, 3 if per == 2 else 4), st
    fill_random(host, 3)  # the same bytes as the first time at src
    assert b.batch_set_v1(k, src) == [True] * 9
    wipe(host)
    dst = host.alloc(9 * P)
    assert b.batch_get_v1(k, dst) == [True] * 9
    assert all(torch.equal(g, w) for g, w in zip(pages_at(host, dst), want))


def test_damaged_files_found_at_restart_are_missing(root):
    _, host = mha_host("page_first")
    b = build(host, root)
    fill_random(host, 8)
    k = hkeys(6, "rs")
    src = host.alloc(6 * P)
    want = pages_at(host, src)
    assert b.batch_set_v1(k, src) == [True] * 6
    b.close()
    with open(block_path(b, k[1], 0), "r+b") as f:
        f.truncate(100)
    open(block_path(b, k[2], 1), "w").close()
    os.unlink(block_path(b, k[3], 0))
    os.symlink(block_path(b, k[0], 0), block_path(b, k[3], 0))
    b2 = build(host, root)
    try:
        assert [b2.exists(key) for key in k] == [True, False, False, False, True, True]
        wipe(host)
        dst = host.alloc(6 * P)
        assert b2.batch_get_v1(k, dst) == [True, False, False, False, True, True]
        got = pages_at(host, dst)
        assert all(torch.equal(got[i], want[i]) for i in (0, 4, 5))
        assert b2.stats()["malformed_block_files"] == 3
    finally:
        b2.close()


_FIFO_SCRIPT = """
import os, sys, threading
sys.path.insert(0, {tests!r})
import sglang_torchvision_stub
sglang_torchvision_stub.install()
import torch
from test_sglang import build, fill_random, keys_of, mla_host, P
from pykvtier.layout import key_digest
_, host = mla_host("page_first")
b = build(host, sys.argv[1], mla=True, direct=False, engine=sys.argv[2])
fill_random(host, 3)
keys = keys_of(3)
assert b.batch_set_v1(keys, host.alloc(3 * P)) == [True] * 3
p = b._tiers[0].layout.block_path(key_digest(keys[1].encode()))
os.unlink(p)
os.mkfifo(p, 0o600)
res = []
t = threading.Thread(target=lambda: res.append(b.batch_get_v1(keys, host.alloc(3 * P))),
                     daemon=True)
t.start()
t.join(30)
print("RESULT", res[0] if res else "HUNG", flush=True)
os._exit(0)
"""


@pytest.mark.parametrize("engine", [
    "posix",
    pytest.param("uring", marks=pytest.mark.xfail(strict=True, reason=(
        "uring engine with buffered I/O (direct: false, or a file system without O_DIRECT): "
        "a FIFO put at a block's name makes the load's open/read wait for a writer forever: "
        "batch_get_v1 never returns (the prefetch I/O thread hangs) and close(), which waits "
        "for batches in flight, would hang the scheduler's detach too; the posix engine fails "
        "the page ([True, False, True]), and with O_DIRECT the open fails EINVAL")))])
def test_fifo_at_a_block_name_fails_the_page_and_does_not_hang(root, engine):
    out = subprocess.run([sys.executable, "-P", "-c", _FIFO_SCRIPT.format(tests=TESTS), root, engine],
                         capture_output=True, text=True, timeout=240)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line is not None, out.stderr[-2000:]
    assert line == "RESULT [True, False, True]"


def test_legacy_get_into_non_contiguous_target_is_byte_exact_or_refused(root, backends):
    _, host = mha_host("layer_first")
    b = build(host, root, interface_v1=0)
    backends.append(b)
    shape = host.get_dummy_flat_data_page().shape
    g = torch.Generator().manual_seed(1)
    v = torch.randint(-100, 100, shape, generator=g).to(torch.bfloat16)
    k = hkeys(1, "nct")[0]
    assert b.batch_set([k], [v]) is True
    target = torch.zeros(2 * shape[0], dtype=torch.bfloat16)[::2]
    assert not target.is_contiguous() and target.shape == shape
    try:
        out = b.batch_get([k], [target])
    except ValueError:
        return  # refused: acceptable
    if out[0] is not None:
        assert torch.equal(out[0].contiguous().view(torch.uint8), v.view(torch.uint8))


def test_legacy_set_from_non_contiguous_value_is_byte_exact(root, backends):
    _, host = mha_host("layer_first")
    b = build(host, root, interface_v1=0)
    backends.append(b)
    shape = host.get_dummy_flat_data_page().shape
    g = torch.Generator().manual_seed(2)
    v = torch.randint(-100, 100, (2 * shape[0],), generator=g).to(torch.bfloat16)[::2]
    k = hkeys(1, "ncv")[0]
    assert b.batch_set([k], [v]) is True
    out = b.batch_get([k])
    assert torch.equal(out[0].view(torch.uint8), v.contiguous().view(torch.uint8))


# ---------------------------------------------------------------------------- full disk


@pytest.fixture
def small_fs(tmp_path):
    """A 4 MiB tmpfs (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = str(tmp_path / "mnt")
    os.makedirs(mnt)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", mnt],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", mnt])


def _fill_fs(path, leave):
    st = os.statvfs(os.path.dirname(path))
    free = st.f_bavail * st.f_frsize
    with open(path, "wb") as f:
        try:
            f.write(b"\1" * max(0, free - leave))
        except OSError:
            pass





def test_full_disk_set_fails_cleanly_then_stores_again(small_fs, frozen_clock):
    _, host = mha_host("page_first", tokens=4096)
    b = build(host, os.path.join(small_fs, "kv"), min_free_bytes=0)
    try:
        fill_random(host, 5)
        k = hkeys(12, "full")
        src = host.alloc(12 * P)
        want = pages_at(host, src)
        _fill_fs(os.path.join(small_fs, "ballast"), 0)
        frozen_clock()
        assert b.batch_set_v1(k[:4], src[:4 * P]) == [False] * 4
        assert b.batch_exists(k) == 0
        assert glob.glob(os.path.join(b.namespace_dirs[0], "blocks", "*", "*")) == []
        os.unlink(os.path.join(small_fs, "ballast"))
        frozen_clock()
        assert b.batch_set_v1(k, src) == [True] * 12
        wipe(host)
        dst = host.alloc(12 * P)
        assert b.batch_get_v1(k, dst) == [True] * 12
        assert all(torch.equal(g, w) for g, w in zip(pages_at(host, dst), want))
        st = b.stats()
        assert (st["pages_store_failed"], st["pages_stored"]) == (4, 12)
    finally:
        b.close()


def test_disk_full_midway_evicts_old_pages_never_partial(small_fs, frozen_clock):
    """Room for 10 pages left; 20 stored in two batches, then the file system fills behind
    the backend's back (its statvfs estimate is stale: the stores meet ENOSPC): the newest
    pages are kept, the oldest evicted whole, every page that answers is byte-exact."""
    _, host = mha_host("page_first", tokens=8192)
    b = build(host, os.path.join(small_fs, "kv"), min_free_bytes=0)
    try:
        fill_random(host, 5)
        k = hkeys(30, "mid")
        src = host.alloc(30 * P)
        want = pages_at(host, src)
        _fill_fs(os.path.join(small_fs, "ballast"), 10 * 16384 + 4096)
        frozen_clock()
        assert b.batch_set_v1(k[:10], src[:10 * P]) == [True] * 10
        assert b.batch_set_v1(k[10:20], src[10 * P:20 * P]) == [True] * 10
        assert b.batch_exists(k[10:20]) == 10
        _fill_fs(os.path.join(small_fs, "ballast2"), 0)  # not seen: the clock stands still
        out = b.batch_set_v1(k[20:25], src[20 * P:25 * P])
        present = [b.exists(x) for x in k[:25]]
        wipe(host)
        dst = host.alloc(25 * P)
        got = b.batch_get_v1(k[:25], dst)
        assert got == present
        assert sum(present) >= 10
        for i, ok in enumerate(got):
            if ok:
                assert torch.equal(page(host, dst[i * P]), want[i])
        for i in range(20, 25):
            assert out[i - 20] == present[i]
        assert glob.glob(os.path.join(b.namespace_dirs[0], "blocks", "*", "*.tmp.*")) == []
    finally:
        b.close()


def test_capacity_keeps_the_total_bounded(root, backends):
    _, host = mha_host("page_first", tokens=8192)
    cap = 10 * 2 * 8192  # 10 pages: two 4096-byte blocks each, plus a header per block
    b = build(host, root, capacity_bytes=cap)
    backends.append(b)
    fill_random(host, 9)
    for r in range(6):
        k = hkeys(8, f"cap{r}")
        src = host.alloc(8 * P)
        want = pages_at(host, src)
        assert b.batch_set_v1(k, src) == [True] * 8
        assert b.stats()["used_bytes"] <= cap
        files = glob.glob(os.path.join(b.namespace_dirs[0], "blocks", "*", "*"))
        assert len(files) * 8192 <= cap
        dst = host.alloc(8 * P)
        assert b.batch_get_v1(k, dst) == [True] * 8
        assert all(torch.equal(g, w) for g, w in zip(pages_at(host, dst), want))
        host.free(src)
        host.free(dst)
    # one batch bigger than the capacity: the pages that fit are stored, the rest fail, the
    # count of leading True is what SGLang takes
    k = hkeys(14, "big")
    out = b.batch_set_v1(k, host.alloc(14 * P))
    assert out == [True] * 10 + [False] * 4
    assert b.batch_exists(k) == 10


# ---------------------------------------------------------------------------- restart


_KILL_SCRIPT = """
import hashlib, os, sys
sys.path.insert(0, {tests!r})
import sglang_torchvision_stub
sglang_torchvision_stub.install()
import torch
from test_sglang import build, fill_random, mha_host, P

def hkeys(n, tag):
    return [hashlib.sha256(f"{{tag}}-{{i}}".encode()).hexdigest() for i in range(n)]

_, host = mha_host("page_first", tokens=8192)
fill_random(host, 5)
b = build(host, sys.argv[1])
assert b.batch_set_v1(hkeys(20, "a"), torch.arange(0, 20 * P)) == [True] * 20
print("STORED", flush=True)
i = 0
while True:
    print(f"BATCH {{i}}", flush=True)
    b.batch_set_v1(hkeys(128, f"b{{i}}"), torch.arange(20 * P, 148 * P))
    i += 1
"""


def test_restart_after_sigkill_mid_set(root):
    """A process storing pages is SIGKILLed mid-batch; a dead writer's temporaries and a
    half-written block at its final name are planted too. The next backend opens the root,
    sweeps the temporaries, finds every complete page byte-exact and never a partial one."""
    proc = subprocess.Popen([sys.executable, "-P", "-c", _KILL_SCRIPT.format(tests=TESTS), root],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    batches = 0
    try:
        for line in proc.stdout:
            if line.startswith("BATCH"):
                batches = int(line.split()[1]) + 1
                if batches == 4:
                    break
        assert batches == 4, proc.stderr.read()[-2000:]
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    _, host = mha_host("page_first", tokens=8192)
    fill_random(host, 5)
    a = hkeys(20, "a")
    want_a = pages_at(host, torch.arange(0, 20 * P))
    want_b = pages_at(host, torch.arange(20 * P, 148 * P))
    ns = glob.glob(os.path.join(root, "pykvtier-sglang", "*"))
    assert len(ns) == 1
    blocks = os.path.join(ns[0], "blocks")
    # a dead writer's temporaries, and a torn block file at a final name (a key never stored)
    planted = []
    for i, key in enumerate(hkeys(3, "tmp")):
        d = key_digest(f"{key}:0".encode()).hex()
        p = os.path.join(blocks, d[:2], f"{d}.kvb.tmp.{proc.pid}.{i}")
        with open(p, "wb") as f:
            f.write(b"\0" * 5000)
        planted.append(p)
    torn = hkeys(1, "torn")[0]
    d = key_digest(f"{torn}:0".encode()).hex()
    with open(os.path.join(blocks, d[:2], f"{d}.kvb"), "wb") as f:
        f.write(b"\0" * 6000)
    d1 = key_digest(f"{torn}:1".encode()).hex()
    with open(os.path.join(blocks, d1[:2], f"{d1}.kvb"), "wb") as f:
        f.write(b"\0" * 8192)  # the right size, not a block
    b = build(host, root)
    try:
        assert glob.glob(os.path.join(blocks, "*", "*.tmp.*")) == []
        assert not any(os.path.exists(p) for p in planted)
        assert b.batch_exists(a) == 20
        wipe(host)
        dst = host.alloc(20 * P)
        assert b.batch_get_v1(a, dst) == [True] * 20
        assert all(torch.equal(g, w) for g, w in zip(pages_at(host, dst), want_a))
        checked = 0
        for r in range(batches):
            k = hkeys(128, f"b{r}")
            dst = host.alloc(128 * P)
            wipe(host)
            got = b.batch_get_v1(k, dst)
            for i, ok in enumerate(got):
                if ok:
                    assert torch.equal(page(host, dst[i * P]), want_b[i])
                    checked += 1
            host.free(dst)
        assert checked >= 3 * 128  # batches 0..2 were complete before the kill
        assert b.exists(torn) is False
        assert b.batch_get_v1([torn], host.alloc(P)) == [False]
    finally:
        b.close()


# ---------------------------------------------------------------------------- two backends


def test_same_model_and_rank_on_one_root_is_refused(root, backends):
    _, host = mha_host("page_first")
    a = build(host, root)
    backends.append(a)
    with pytest.raises(ValueError, match=r"is in use by pid \d+.*set shared: true on every "
                                         r"instance"):
        build(host, root)
    with pytest.raises(ValueError, match=r"is in use by pid \d+"):
        build(host, root, shared=True)  # a shared tier next to an exclusive one: refused too


def test_shared_true_on_both_sees_each_others_pages(root, backends):
    _, host = mha_host("page_first")
    a = build(host, root, shared=True)
    backends.append(a)
    b = build(host, root, shared=True, probe_ttl_s=0)
    backends.append(b)
    with pytest.raises(ValueError, match="is in use"):
        build(host, root)  # an exclusive one next to shared ones
    fill_random(host, 3)
    k = hkeys(6, "sh")
    src = host.alloc(6 * P)
    want = pages_at(host, src)
    assert b.batch_exists(k) == 0
    assert a.batch_set_v1(k[:3], src[:3 * P]) == [True] * 3
    assert b.batch_set_v1(k[3:], src[3 * P:]) == [True] * 3
    assert b.batch_exists(k) == 6  # k[:3] by probes
    for x in (a, b):
        assert x.batch_exists(k) == 6  # (a get of a key the index never saw fails unprobed)
        wipe(host)
        dst = host.alloc(6 * P)
        assert x.batch_get_v1(k, dst) == [True] * 6
        assert all(torch.equal(g, w) for g, w in zip(pages_at(host, dst), want))
    # b clears the shared directory: a's index is stale, its loads fail (ENOENT) and are
    # forgotten; pages a stores afterwards are seen by b
    b.clear()
    assert b.batch_exists(k) == 0
    assert a.batch_get_v1(k, host.alloc(6 * P)) == [False] * 6
    k2 = hkeys(4, "sh2")
    src2 = host.alloc(4 * P)
    want2 = pages_at(host, src2)
    assert a.batch_set_v1(k2, src2) == [True] * 4
    assert b.batch_exists(k2) == 4
    dst = host.alloc(4 * P)
    assert b.batch_get_v1(k2, dst) == [True] * 4
    assert all(torch.equal(g, w) for g, w in zip(pages_at(host, dst), want2))


def _dp_config(root, dp_rank, mla):
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=True, is_page_first_layout=True,
        model_name="org/model", dp_rank=dp_rank, extra_config=extra(root))


@pytest.mark.parametrize("mla", [False, True])
def test_dp_attention_replicas_share_a_root(root, backends, mla):
    _, host = (mla_host if mla else mha_host)("page_first")
    made = []
    for dp in (0, 1):
        b = StorageBackendFactory.create_backend("dynamic", _dp_config(root, dp, mla), host)
        backends.append(b)
        b.register_mem_pool_host(host)
        made.append(b)
    fill_random(host, 1)
    k = hkeys(2, "dp")
    src = host.alloc(2 * P)
    want = pages_at(host, src)
    assert made[0].batch_set_v1(k, src) == [True, True]
    assert made[1].batch_set_v1(k, src) == [True, True]
    dst = host.alloc(2 * P)
    assert made[1].batch_get_v1(k, dst) == [True, True]
    assert all(torch.equal(g, w) for g, w in zip(pages_at(host, dst), want))


# ---------------------------------------------------------------------------- close / clear


def test_clear_after_close_leaves_the_root_free_and_the_pages_alone(root):
    _, host = mha_host("page_first")
    b = build(host, root)
    fill_random(host, 2)
    k = hkeys(4, "cc")
    src = host.alloc(4 * P)
    want = pages_at(host, src)
    assert b.batch_set_v1(k, src) == [True] * 4
    b.close()
    b.clear()  # a late admin "clear storage" racing detach
    b.close()
    b2 = build(host, root)
    try:
        dst = host.alloc(4 * P)
        assert b2.batch_get_v1(k, dst) == [True] * 4
        assert all(torch.equal(g, w) for g, w in zip(pages_at(host, dst), want))
    finally:
        b2.close()


def test_calls_after_close_answer_missing(root):
    _, host = mha_host("page_first")
    b = build(host, root)
    fill_random(host, 2)
    k = hkeys(3, "ac")
    src = host.alloc(3 * P)
    assert b.batch_set_v1(k, src) == [True] * 3
    b.close()
    b.close()  # idempotent
    assert b.batch_get_v1(k, host.alloc(3 * P)) == [False] * 3
    assert b.batch_set_v1(hkeys(2, "ac2"), host.alloc(2 * P)) == [False] * 2
    assert b.stats()["blocks_stored"] == 6
    assert b.batch_exists(k) == 0


def test_close_while_a_get_is_in_flight(root):
    """close() from another thread while a get's jobs are in the engine: the get finishes
    (byte-exact), close returns, later calls answer False."""
    _, host = mha_host("page_first", tokens=8192)
    b = build(host, root)
    fill_random(host, 4)
    k = hkeys(256, "cf")
    src = host.alloc(256 * P)
    want = pages_at(host, src)
    assert b.batch_set_v1(k, src) == [True] * 256
    wipe(host)
    dst = host.alloc(256 * P)
    res = []
    t = threading.Thread(target=lambda: res.append(b.batch_get_v1(k, dst)))
    tier = b._tiers[0]
    with b._cv:
        t.start()
        # the get's jobs are submitted (counted before the collectors are woken)
        b._cv.wait_for(lambda: tier.stats()["loads_submitted"] > 0)
    b.close()  # waits for them
    t.join()
    assert res[0] == [True] * 256
    assert all(torch.equal(g, w) for g, w in zip(pages_at(host, dst), want))
    assert b.batch_get_v1(k[:2], host.alloc(2 * P)) == [False, False]
    build(host, root).close()  # the root is free again


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_clear_and_stats_while_gets_and_sets_run(root, backends, layout):
    """A getter and a setter thread loop over 64 fixed key -> page pairs while the main thread
    clears 20 times and reads stats()/get_stats(); every page a get reports loaded is the
    page of its key, nothing raises, and after the last clear + a set everything is found."""
    _, host = mha_host(layout, tokens=8192)
    b = build(host, root)
    backends.append(b)
    fill_random(host, 12)
    k = hkeys(64, "cl")
    src = host.alloc(64 * P)
    want = pages_at(host, src)
    dst = host.alloc(64 * P)
    errors = []
    stop = threading.Event()
    rounds = {"get": 0, "set": 0, "checked": 0}

    def getter():
        try:
            while not stop.is_set():
                n = b.batch_exists(k)
                got = b.batch_get_v1(k[:n], dst[:n * P]) if n else []
                for i, ok in enumerate(got):
                    if ok:
                        if not torch.equal(page(host, dst[i * P]), want[i]):
                            errors.append(f"page {i} differs")
                        rounds["checked"] += 1
                rounds["get"] += 1
        except Exception as exc:  # noqa: BLE001
            errors.append(repr(exc))

    def setter():
        try:
            while not stop.is_set():
                b.batch_set_v1(k, src)
                rounds["set"] += 1
        except Exception as exc:  # noqa: BLE001
            errors.append(repr(exc))

    threads = [threading.Thread(target=getter), threading.Thread(target=setter)]
    for t in threads:
        t.start()
    try:
        for _ in range(20):
            b.clear()
            b.stats()
            b.get_stats()
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert errors == []
    assert rounds["set"] > 0 and rounds["get"] > 0
    assert b.batch_set_v1(k, src) == [True] * 64
    assert b.batch_exists(k) == 64


# ---------------------------------------------------------------------------- existence


def test_batch_exists_with_thousands_of_keys(root, backends):
    """The hybrid controller passes a whole request's keys in one call."""
    _, host = mha_host("page_first", tokens=8192)
    b = build(host, root)
    backends.append(b)
    fill_random(host, 1)
    k = hkeys(6000, "many")
    src = host.alloc(256 * P)
    for c in range(0, 3000, 256):
        part = k[c:min(c + 256, 3000)]
        assert all(b.batch_set_v1(part, src[:len(part) * P]))
    assert b.batch_exists(k) == 3000
    assert b.batch_exists(k[2990:]) == 10
    assert b.batch_exists(k[3000:]) == 0
    assert b.batch_exists(k[:3000] * 3) == 9000


def test_shared_batch_exists_with_more_unknown_keys_than_the_probe_ring(root, backends):
    """12000 block probes (6000 pages of 2 blocks) against a 4096-entry probe ring."""
    _, host = mha_host("page_first", tokens=8192)
    a = build(host, root, shared=True)
    backends.append(a)
    b = build(host, root, shared=True, probe_ttl_s=0)
    backends.append(b)
    fill_random(host, 1)
    k = hkeys(6000, "ring")
    src = host.alloc(256 * P)
    for c in range(0, 3000, 256):
        part = k[c:min(c + 256, 3000)]
        assert all(a.batch_set_v1(part, src[:len(part) * P]))
    assert b.batch_exists(k) == 3000
    assert b.batch_exists(k) == 3000
    assert b.batch_exists(k[2990:]) == 10


def test_shared_probe_wait_does_not_hold_the_backends_lock(root, backends):
    """While batch_exists waits for its probes, another thread gets the backend's lock: the
    first wait lets a stats() call from another thread run to its end."""
    _, host = mla_host("page_first")
    writer = build(host, root, mla=True, tp_rank=0, tp_size=2)
    backends.append(writer)
    reader = build(host, root, mla=True, tp_rank=1, tp_size=2)
    backends.append(reader)
    real_wait = reader._cv.wait
    seen = []
    me = threading.current_thread()  # batch_exists' thread (the collectors wait on this lock too)

    def wait(timeout=None):
        if seen or threading.current_thread() is not me:
            return real_wait(timeout)
        done = threading.Event()

        def other():
            reader.stats()  # takes the lock
            done.set()
            with reader._cv:
                reader._cv.notify_all()

        t = threading.Thread(target=other)
        t.start()
        real_wait(30)  # returns once other() ran (its notify needs the lock this releases)
        seen.append(done.is_set())
        t.join()
        return True

    reader._cv.wait = wait
    assert reader.batch_exists(hkeys(8, "probe")) == 0
    assert seen == [True]


# ---------------------------------------------------------------------------- MLA ranks


def test_mla_reader_after_the_writer_evicts_and_stores_again(root, backends):
    """MLA on 2 ranks (shared directory): the writer's capacity evicts pages the reader found
    by probing; the reader's loads of them fail alone (ENOENT, forgotten), and once the writer
    stores them again the reader finds and loads them byte-exact."""
    _, host = mla_host("page_first", tokens=4096)
    writer = build(host, root, mla=True, tp_rank=0, tp_size=2, capacity_bytes=8 * 8192)
    backends.append(writer)
    reader = build(host, root, mla=True, tp_rank=1, tp_size=2, probe_ttl_s=0)
    backends.append(reader)
    fill_random(host, 7)
    k = hkeys(16, "mla")
    src = host.alloc(16 * P)
    want = pages_at(host, src)
    assert reader.batch_set_v1(k, src) == [True] * 16  # not the writer: skipped
    assert writer.batch_set_v1(k[:8], src[:8 * P]) == [True] * 8
    assert reader.batch_exists(k[:8]) == 8
    assert writer.batch_set_v1(k[8:], src[8 * P:]) == [True] * 8  # evicts k[:8]
    assert writer.batch_exists(k[:8]) == 0
    assert reader.batch_get_v1(k[:8], host.alloc(8 * P)) == [False] * 8
    assert reader.batch_exists(k[:8]) == 0
    assert writer.batch_set_v1(k[:4], src[:4 * P]) == [True] * 4
    assert reader.batch_exists(k[:4]) == 4
    wipe(host)
    dst = host.alloc(4 * P)
    assert reader.batch_get_v1(k[:4], dst) == [True] * 4
    assert all(torch.equal(g, w) for g, w in zip(pages_at(host, dst), want[:4]))


def test_mla_non_writer_legacy_set_and_v1_set_store_nothing(root, backends):
    _, host = mla_host("page_first")
    writer = build(host, root, mla=True, tp_rank=0, tp_size=4)
    backends.append(writer)
    readers = [build(host, root, mla=True, tp_rank=r, tp_size=4, probe_ttl_s=0)
               for r in (1, 2, 3)]
    backends.extend(readers)
    assert all(r._tiers[0].config.shared for r in readers + [writer])
    fill_random(host, 3)
    k = hkeys(5, "nw")
    src = host.alloc(5 * P)
    for r in readers:
        assert r.batch_set_v1(k, src) == [True] * 5
    assert glob.glob(os.path.join(writer.namespace_dirs[0], "blocks", "*", "*")) == []
    assert all(r.batch_exists(k) == 0 for r in readers)
    assert writer.batch_set_v1(k, src) == [True] * 5
    assert [r.batch_exists(k) for r in readers] == [5, 5, 5]


def test_clear_after_the_namespace_directory_was_removed_keeps_serving(root, backends):
    """An operator removed the backend's directory behind its back: clear() reopens the tiers
    (the directory made again) instead of raising and leaving them shut down."""
    _, host = mha_host("page_first")
    b = build(host, root)
    backends.append(b)
    fill_random(host, 3)
    k = hkeys(2, "gone")
    assert b.batch_set_v1(k, host.alloc(2 * P)) == [True, True]
    shutil.rmtree(b.namespace_dirs[0])
    b.clear()
    assert b.batch_exists(k) == 0
    assert b.batch_set_v1(k, host.alloc(2 * P)) == [True, True]
    assert b.batch_exists(k) == 2
