"""One tier root shared by two nodes on a distributed file system (issue 13; marked ``sharedfs``).

The file system is JuiceFS (Redis metadata, a local directory as object store) mounted twice
through FUSE by ``scripts/sharedfs.sh up``: two mounts are two nodes, each with its own JuiceFS
client and its own kernel caches (JuiceFS's defaults: 1 s attribute and entry caches, no
negative entry cache). The ``sharedfs`` fixture (tests/conftest.py) finds the mounts, or skips
saying why. Every tier of "node A" opens the root through mount A, every tier of "node B"
through mount B; both are ``shared=True`` (the root's flock is held cluster-wide by JuiceFS).

Time: the tier's clock (``pykvtier.tier._now``, probe_ttl_s) is a fake one the tests move;
I/O finishes through ``drain()``; no sleeps, no timed asserts. Every loaded byte is compared
with what was stored.
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys

import numpy as np
import pytest

from pykvtier import DiskTier, LookupResult, TransferJob, _native
from pykvtier.doctor import _size
from pykvtier.layout import HEADER_BYTES, BlockHeader, RootLockedError, key_digest

pytestmark = pytest.mark.sharedfs

BS = 256 << 10  # payload bytes per block
HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
ENOENT = "ENOENT: No such file or directory"





def keys_of(n: int, tag: bytes = b"k") -> list[bytes]:
    return [b"%s-%d" % (tag, i) for i in range(n)]


def data_of(keys: list[bytes]) -> np.ndarray:
    """(len(keys), BS) uint8: each key's own random bytes."""
    return np.stack([np.random.default_rng(int.from_bytes(key_digest(k)[:8], "little"))
                     .integers(0, 256, BS, dtype=np.uint8) for k in keys])


def run(tier: DiskTier, job: TransferJob, load: bool):
    """Submits one job, drains, returns its JobResult (and checks it is the only one)."""
    (tier.submit_load if load else tier.submit_store)(job)
    tier.drain()
    (res,) = tier.get_finished_jobs()
    assert res.job_id == job.job_id and not tier.has_pending_work()
    return res


def store(tier: DiskTier, arena: np.ndarray, keys: list[bytes], job_id: int = 1) -> None:
    arena[: len(keys)] = data_of(keys)
    res = run(tier, TransferJob(job_id, keys, list(range(len(keys)))), load=False)
    assert res.success and res.failed_keys == {}, res.failed_keys


class Answers(list):
    """Lookup answers, whose repr adds the raw probe results they came from (statx error,
    size, link count per key): what a failed assert shows."""

    raw: list

    def __repr__(self) -> str:
        return f"{list.__repr__(self)} (probe results (key, errno, size, nlink): {self.raw})"


def probe(tier: DiskTier, keys: list[bytes]) -> list[LookupResult]:
    """A scheduler's step on a shared tier: lookups (unknown keys: RETRY, probe queued), the
    step's end (probes submitted), their completion (drain applies them), lookups again."""
    assert [tier.lookup(k) for k in keys] == [RETRY] * len(keys)
    raw, apply = [], tier._apply_probe
    names = {key_digest(k): k for k in keys}

    def logged(digest, size, err, mode, nlink, now):
        raw.append((names.get(digest), err, size, nlink))
        return apply(digest, size, err, mode, nlink, now)

    tier._apply_probe = logged
    try:
        tier.on_step_end()
        tier.drain()
        out = Answers(tier.lookup(k) for k in keys)
    finally:
        del tier._apply_probe
    out.raw = raw
    return out


@pytest.fixture
def nodes(shared_roots, make_tier, arena):
    """nodes(**options) -> ((tier A, arena A), (tier B, arena B)): shared tiers of one root,
    through mount A and mount B; options for both (``a_engine``: A's engine alone)."""

    def make(a_engine=None, **kw):
        ra, rb = shared_roots
        out = []
        for root, eng in ((ra, {} if a_engine is None else {"engine": a_engine}), (rb, {})):
            a = arena(8, BS)
            out.append((make_tier(root, shared=True, arena=a, **{**kw, **eng}), a))
        return out

    return make


def test_two_mounts_are_two_clients_of_one_volume(sharedfs):
    a, b = sharedfs
    from conftest import mount_fstype

    assert mount_fstype(a) == mount_fstype(b) == "fuse.juicefs"
    assert os.stat(a).st_dev != os.stat(b).st_dev  # two mounts (two FUSE connections)
    assert os.statvfs(a).f_blocks == os.statvfs(b).f_blocks  # one volume
    name = f"hello-{os.getpid()}"
    with open(os.path.join(a, name), "wb") as f:
        f.write(b"through A")
    try:
        with open(os.path.join(b, name), "rb") as f:
            assert f.read() == b"through A"
    finally:
        os.unlink(os.path.join(a, name))


@pytest.mark.parametrize("engine", ["uring", "posix"])
def test_stored_through_a_hits_after_its_probe_and_loads_byte_exact_through_b(nodes, engine, clock):
    (ta, aa), (tb, ab) = nodes(engine=engine)  # (both nodes with `engine`)
    keys = keys_of(4)
    assert probe(tb, keys) == [MISS] * 4  # nothing there yet: a MISS for probe_ttl_s
    store(ta, aa, keys)
    clock.t += tb.probe_ttl_s  # the MISSes expire
    assert probe(tb, keys) == [HIT] * 4
    res = run(tb, TransferJob(2, keys, [4, 5, 6, 7]), load=True)
    assert res.success and res.failed_keys == {}
    assert np.array_equal(ab[4:8], data_of(keys))
    st = tb.stats()
    assert (st["probes"], st["probe_hits"], st["blocks_loaded"], st["load_failures"]) == (8, 4, 4, 0)
    assert st["blocks_present"] == 4 and st["used_bytes"] == 4 * (BS + HEADER_BYTES)
    assert ta.stats()["blocks_stored"] == 4


def test_fsync_stores_through_a_load_through_b(nodes, clock):
    (ta, aa), (tb, ab) = nodes(fsync=True, a_engine="uring")  # (directory fsyncs on a FUSE mount)
    keys = keys_of(3)
    store(ta, aa, keys)
    assert probe(tb, keys) == [HIT] * 3
    assert run(tb, TransferJob(2, keys, [4, 5, 6]), load=True).success
    assert np.array_equal(ab[4:7], data_of(keys))


def test_a_probes_miss_is_trusted_for_probe_ttl_s_then_probed_again(nodes, clock):
    (ta, aa), (tb, ab) = nodes(probe_ttl_s=5.0)
    (k,) = keys_of(1)
    assert probe(tb, [k]) == [MISS]
    store(ta, aa, [k])  # A stores it after B's probe said "not found"
    clock.t += 4.999
    assert tb.lookup(k) is MISS  # still trusted: no probe asked
    tb.on_step_end()
    assert tb.stats()["probes"] == 1
    clock.t += 0.001  # probe_ttl_s passed
    assert probe(tb, [k]) == [HIT]  # (probe() asserts the RETRY first)
    assert tb.stats()["probes"] == 2
    assert run(tb, TransferJob(2, [k], [5]), load=True).success
    assert np.array_equal(ab[5], data_of([k])[0])


def test_probe_ttl_zero_never_answers_a_stale_miss(nodes, clock):
    (ta, aa), (tb, ab) = nodes(probe_ttl_s=0)
    (k,) = keys_of(1)
    assert probe(tb, [k]) == [RETRY]  # "not found" expired at once: asked again
    store(ta, aa, [k])
    tb.on_step_end()
    tb.drain()
    assert tb.lookup(k) is HIT
    assert tb.stats()["probes"] == 2


def test_removed_through_a_then_loaded_through_b_fails_that_block_alone(nodes, clock):
    """A removes a block B found by its probe: B's load fails with ENOENT for that block alone,
    the others load byte-exact, B's index drops the entry (no failed mark, no quarantine) and a
    lookup probes again; A storing the block again makes it a HIT on B. (An eviction is
    announced to B instead: tests/test_shared_capacity.py.)"""
    (ta, aa), (tb, ab) = nodes(capacity_bytes=None)
    keys = keys_of(3)
    store(ta, aa, keys)
    assert probe(tb, keys) == [HIT] * 3
    assert ta.remove([key_digest(keys[0])]) == [True]
    ta.drain()  # the unlink is done
    assert ta.get_finished_jobs() == []  # (collected: A's index forgets the block)
    # Gone through A. (Through B a stat may still find it for up to JuiceFS's attribute cache,
    # 1 s: not asserted either way; B's open of it fails ENOENT both ways.)
    assert not os.path.exists(ta.layout.block_path(key_digest(keys[0])))
    assert [tb.lookup(k) for k in keys] == [HIT] * 3  # B cannot know yet
    res = run(tb, TransferJob(7, keys, [3, 4, 5]), load=True)
    assert (res.success, res.failed_keys, res.successful_keys) == (False, {keys[0]: ENOENT}, keys[1:])
    assert np.array_equal(ab[4:6], data_of(keys[1:]))
    assert not ab[3].any()  # the failed slot holds no stale bytes
    st = tb.stats()
    assert (st["load_failures"], st["blocks_loaded"], st["quarantined"], st["blocks_present"]) == (1, 2, 0, 2)
    assert st["used_bytes"] == 2 * (BS + HEADER_BYTES)
    # Forgotten, and a MISS for probe_ttl_s, as after a probe's "not found": not probed at once
    # (B's JuiceFS client may still stat the removed file from its attribute cache: a HIT whose
    # load would fail again).
    probes = tb.stats()["probes"]
    assert tb.lookup(keys[0]) is MISS
    tb.on_step_end()
    assert tb.stats()["probes"] == probes
    store(ta, aa, keys[:1], job_id=3)  # A stores it again
    clock.t += tb.probe_ttl_s
    assert probe(tb, keys[:1]) == [HIT]
    assert tb.stats()["probes"] == probes + 1
    # (B's load of it is not asserted: for JuiceFS's entry cache, 1 s after B last looked the
    # name up, B's kernel still maps it to the removed file, and an open fails ENOENT; after
    # that it loads. No clock of the test's moves that cache.)


JUICEFS_ALIGNMENT_PROBE = (
    "an O_DIRECT write of 4096 B at file offset 1: taken (4096 B); "
    "an O_DIRECT write of 4096 B from memory 1 byte past its alignment: taken (4096 B)")


def test_o_direct_on_juicefs_is_accepted_and_not_enforced(shared_roots, make_tier, arena):
    """What JuiceFS (FUSE) does with O_DIRECT, and what DiskTier chooses there: the probe finds
    O_DIRECT accepted; no STATX_DIOALIGN, so 4096 is assumed; JuiceFS does not enforce any
    alignment (an O_DIRECT write and read at offset 1 of 3 bytes succeed), which the probe
    reports (alignment_enforced False: O_DIRECT there is not the block layer's direct path).
    DiskTier(direct=None) uses O_DIRECT with 4096."""
    ra, rb = shared_roots
    dio = _native.probe_direct(ra)
    assert dio == {"direct": True, "mem_align": 4096, "offset_align": 4096,
                   "dioalign_from_statx": False, "reason": "ok", "alignment_enforced": False,
                   "alignment_probe": JUICEFS_ALIGNMENT_PROBE}
    path = os.path.join(ra, "odirect")
    buf = mmap.mmap(-1, 8192)
    buf.write(b"x" * 8192)
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
    try:
        assert os.pwrite(fd, buf, 0) == 8192
        assert os.pwrite(fd, b"abc", 1) == 3  # unaligned memory, offset and length: accepted
    finally:
        os.close(fd)
    fd = os.open(os.path.join(rb, "odirect"), os.O_RDONLY | os.O_DIRECT)
    try:
        assert os.pread(fd, 5, 1) == b"abcxx"  # through the other node, unaligned too
    finally:
        os.close(fd)
    t = make_tier(ra, shared=True, arena=arena(4, BS))
    assert (t.direct, t.align, t.mem_align, t.stats()["direct_fallbacks"]) == (True, 4096, 4096, 0)


def test_doctor_reports_fuse_juicefs(sharedfs):
    a, _ = sharedfs
    out = subprocess.run(
        [sys.executable, "-P", "-c", "import sys; from pykvtier.cli import main; "
         "sys.exit(main(sys.argv[1:]))", "doctor", "--root", a, "--json", "--no-gpu"],
        check=True, capture_output=True, text=True).stdout
    root = json.loads(out)["root"]
    assert (root["fstype"], root["source"], root["mount"]) == ("fuse.juicefs", "JuiceFS:pykvtier", a)
    assert root["o_direct"] == {"direct": True, "mem_align": 4096, "offset_align": 4096,
                                "dioalign_from_statx": False, "reason": "ok", "alignment_enforced": False,
                                "alignment_probe": JUICEFS_ALIGNMENT_PROBE}
    assert root["statfs_type"] == 0x65735546  # FUSE_SUPER_MAGIC
    assert root["data_checksums"]["checksums"] is False
    text = subprocess.run(
        [sys.executable, "-P", "-c", "import sys; from pykvtier.cli import main; "
         "sys.exit(main(sys.argv[1:]))", "doctor", "--root", a, "--no-gpu"],
        check=True, capture_output=True, text=True).stdout
    lines = text.splitlines()
    assert [ln for ln in lines if ln.startswith("root  ")] == [
        f"root            {a}: fuse.juicefs on JuiceFS:pykvtier, {_size(root['free_bytes'])} free; "
        "statfs f_type 0x65735546"]
    at = lines.index("O_DIRECT        yes; DIO alignment: memory 4096 B, offset 4096 B (assumed (no STATX_DIOALIGN))")
    assert lines[at + 1:at + 3] == [
        " " * 16 + "alignment enforced: no (unaligned O_DIRECT transfers are taken): O_DIRECT here is not the "
                   "block layer's direct path (FUSE, tmpfs and NFS take any alignment, through the FUSE daemon, "
                   "the page cache or the server; btrfs falls back to buffered I/O for an unaligned transfer)",
        " " * 16 + "probed: " + JUICEFS_ALIGNMENT_PROBE]


def test_the_roots_lock_holds_across_nodes(shared_roots, make_tier):
    """JuiceFS keeps flock locks cluster-wide: a shared=False tier on node A keeps node B out,
    and shared tiers on B keep an exclusive one on A out. The holder is on another node: this
    kernel's /proc/locks does not list it ("pid unknown")."""
    ra, rb = shared_roots
    excl = make_tier(ra)
    for shared, mode in ((True, "a shared lock (shared=True)"), (False, "an exclusive lock (shared=False)")):
        with pytest.raises(RootLockedError) as ei:
            DiskTier(rb, BS, shared=shared)
        assert str(ei.value) == (
            f"root {rb} is in use: a lock on {rb}/.pykvtier.lock is held by pid unknown; asked "
            f"for {mode}. A shared=False tier needs its root to itself; shared=True tiers share "
            "a root with each other only")
    excl.shutdown()
    make_tier(rb, shared=True)
    make_tier(ra, shared=True)  # shared with shared: both nodes
    with pytest.raises(RootLockedError):
        DiskTier(ra, BS)


# ------------------------------------------------------------------------- vLLM


def test_vllm_managers_on_two_nodes_one_stores_the_other_hits_and_loads(shared_roots):
    """Two vLLM TieringOffloadingManagers (as tests/test_vllm.py builds them), shared=True, one
    per node: the first offloads 4 chunks to its PyKVTier; the second, on the other mount,
    finds them by its probes and promotes them byte-exact."""
    import test_vllm as tv  # (skips here without vLLM, as that module does)

    ra, rb = shared_roots
    made = []
    try:
        def scheduler(root):
            spec = tv.OffloadingSpecFactory.create_spec(tv.offloading_config(
                [tv.tier_config(root, shared=True, probe_ttl_s=3600.0)], num_chunks=8))
            m = spec.get_manager()
            made.append(m)
            return tv.Scheduler(m)

        sa, sb = scheduler(ra), scheduler(rb)
        assert [os.path.relpath(d, ra) for d in sa.tier.namespace_dirs] == \
            [os.path.relpath(d, rb) for d in sb.tier.namespace_dirs]  # one namespace
        keys = [tv.key(i) for i in range(4)]
        w = sa.request("writer")
        sa.offload(w, keys)
        sa.end_step()
        sa.io()
        sa.step()
        assert sa.tier.stats()["blocks_stored"] == 4
        sa.finish(w)

        r = sb.request("reader")
        assert sb.lookup(r, keys) == [tv.RETRY] * 4  # unknown on B: probed
        sb.end_step()
        sb.io()
        assert sb.lookup(r, keys) == [tv.HIT_PENDING] * 4  # found: promoted
        sb.end_step()
        sb.io()
        assert sb.lookup(r, keys) == [tv.HIT] * 4
        assert sb.loaded_bytes(r, keys) == [tv.payload(k) for k in keys]
        st = sb.tier.stats()
        assert (st["probes"], st["probe_hits"], st["blocks_loaded"], st["load_failures"]) == (4, 4, 4, 0)
        sb.finish(r)
    finally:
        for m in made:
            m.shutdown()


@pytest.mark.parametrize("engine, fsync", [("uring", False), ("uring", True), ("posix", False)])
def test_a_store_reported_done_is_whole_on_the_other_node(shared_roots, make_tier, arena, engine, fsync):
    """Right after each store through A is reported, B stats the block file, then reads it: it
    must be the whole block file, byte-exact (close-to-open: what one node reported stored,
    another can read). JuiceFS commits a file's data and length at FUSE FLUSH, which only a
    close through the file system's ->flush sends: the io_uring engine closes a store's file
    so (a regular descriptor; a close of a fixed-file slot skips ->flush, and B saw 8 % of
    these files 0 bytes long before that was fixed), the posix engine with close(2)."""
    ra, rb = shared_roots
    a = arena(1, BS)
    a[0] = data_of([b"whole"])[0]
    ta = make_tier(ra, shared=True, arena=a, engine=engine, fsync=fsync)
    sizes, wrong = [], []
    for i in range(200):  # one block per store: the window right after each report
        (k,) = keys_of(1, b"whole-%d" % i)
        res = run(ta, TransferJob(i + 1, [k], [0]), load=False)
        assert res.success
        on_b = ta.layout.block_path(key_digest(k)).replace(ra, rb, 1)
        sizes.append(os.stat(on_b).st_size)
        with open(on_b, "rb") as f:
            raw = f.read()
        h = BlockHeader.parse(raw)
        if not (len(raw) == BS + HEADER_BYTES and h.ok and h.key_digest == key_digest(k)
                and h.payload_bytes == BS and raw[HEADER_BYTES:] == a[0].tobytes()):
            wrong.append((i, len(raw), h.ok))
    short = [s for s in sizes if s != BS + HEADER_BYTES]
    assert short == [], f"{len(short)} of 200 block files seen short through B: sizes {sorted(set(short))}"
    assert wrong == [], f"{len(wrong)} of 200 block files read through B are not what A stored: {wrong[:8]}"


# ------------------------------------------------------------------------- replay --nodes


def test_replay_nodes_over_the_two_mounts(shared_roots):
    """`pykvtier replay --nodes A,B` over the two mounts: node 0's process opens the root through
    mount A, node 1's through mount B, with a slice of the bundled trace (tiny model, unlimited
    capacity); the same relations as on one local directory (tests/test_replay_nodes.py): every
    loaded byte verified, cross-node hits are blocks only the other node stored, totals the
    nodes' sums, the single node replayed the same requests."""
    from test_replay_nodes import _config, check_nodes_relations

    from pykvtier.replay import run_nodes
    from pykvtier.trace import load_trace

    ra, rb = shared_roots
    requests = load_trace(None, max_requests=60)
    r = run_nodes(_config(), [ra, rb], requests)
    check_nodes_relations(r, requests, [ra, rb])
    assert r.nodes[0].root.startswith(ra + os.sep) and r.nodes[1].root.startswith(rb + os.sep)
    assert sum(n.load_lost_keys for n in r.nodes) == 0  # (nothing evicted)
