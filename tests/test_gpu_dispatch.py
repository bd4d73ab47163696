"""GPU destinations without a GPU: path selection, status, the bounce engine and device-arena
dispatch through DiskTier / Promoter, with the GPU parts replaced by fakes (a "device" arena in
host memory, HostCopier for the copies, the posix engine standing in for the gds engine)."""

from __future__ import annotations

import errno
import logging
import os

import numpy as np
import pytest

from pykvtier import DiskTier, LookupResult, Promoter, TransferJob, _native, gpu
from pykvtier.buffers import Arena, as_arena
from pykvtier.engines import gpu as engines_gpu
from pykvtier.engines import STATS_KEYS, Op, run_job
from pykvtier.engines.bounce import BounceEngine, HostCopier
from pykvtier.layout import key_digest
from pykvtier.posix_engine import PosixEngine

BS = 64 << 10


def status(**kw):
    st = {
        "built": True, "build_reason": "built against kvikio 26.10.0", "build_kvikio_version": "26.10.0",
        "importable": True, "import_reason": "loaded", "kvikio_version": "26.10.0",
        "cufile_library": True, "cufile_available": True, "cufile_version": 1190,
        "gds_available": True, "nvfs_version": "2.26", "compat_mode_default": "AUTO",
        "compat_mode_preferred": False, "cuda_devices": 1, "cuda_error": None,
        "device_verify_built": True, "notes": [], "root_probe": None,
    }
    st.update(kw)
    st["usable"], st["reason"] = gpu._gds_verdict(st, "/root/of/tier")
    return st


# ------------------------------------------------------------------ selection


def test_gds_when_usable():
    st = status()
    assert st["usable"] and "GPUDirect Storage usable" in st["reason"]
    c = gpu.choose_path(st)
    assert c.path == "gds" and not c.fallback


@pytest.mark.parametrize("kw, why", [
    (dict(built=False, build_reason="not built: kvikio not found at build time"), "kvikio not found"),
    (dict(importable=False, import_reason="built, but cannot be loaded: libkvikio.so"), "cannot be loaded"),
    (dict(cuda_devices=0, cuda_error="no CUDA-capable device is detected"), "no CUDA device"),
    (dict(cufile_library=False), "libcufile"),
    (dict(cufile_available=False), "/run/udev"),
    (dict(gds_available=False), "nvidia-fs"),
    (dict(root_probe={"opened": True, "compat": True, "reason": "kvikio chose its compatibility mode"}),
     "refused for files at"),
])
def test_fallback_to_bounce_over_uring_with_the_reason(kw, why):
    st = status(**kw)
    assert not st["usable"] and why in st["reason"]
    c = gpu.choose_path(st, "auto", "uring")
    assert c.path == "bounce" and c.fallback
    assert why in c.reason and "io_uring" in c.reason


def test_without_io_uring_kvikio_compat_beats_the_posix_bounce():
    c = gpu.choose_path(status(gds_available=False), "auto", "posix")
    assert c.path == "kvikio-compat" and c.fallback and "io_uring is unavailable" in c.reason
    c = gpu.choose_path(status(built=False, importable=False, build_reason="not built"), "auto", "posix")
    assert c.path == "bounce" and "posix engine" in c.reason


def test_forced_paths():
    assert gpu.choose_path(status(gds_available=False), "gds").path == "gds"
    assert "requested, though" in gpu.choose_path(status(gds_available=False), "gds").reason
    assert gpu.choose_path(status(), "kvikio-compat").path == "kvikio-compat"
    assert gpu.choose_path(status(built=False), "bounce").path == "bounce"
    for p in ("gds", "kvikio-compat"):
        with pytest.raises(ValueError, match="gds engine is unavailable"):
            gpu.choose_path(status(importable=False, import_reason="no libkvikio"), p)
    with pytest.raises(ValueError, match="unknown device_path"):
        gpu.choose_path(status(), "nvme")


def test_device_options():
    assert gpu.DeviceOptions.of("bounce").path == "bounce"
    o = gpu.DeviceOptions(path="gds", io_threads=4)
    assert gpu.DeviceOptions.of(o) is o
    with pytest.raises(ValueError, match="unknown device_path"):
        gpu.DeviceOptions.of("fast")
    with pytest.raises(TypeError):
        gpu.DeviceOptions.of(3)
    with pytest.raises(ValueError, match="DeviceOptions.checksum must be 'auto', 'device' or 'host', got 'header'"):
        gpu.DeviceOptions(checksum="header")
    with pytest.raises(ValueError, match="DeviceOptions.bounce_slots must be an int >= 1, got 0"):
        gpu.DeviceOptions(bounce_slots=0)
    with pytest.raises(ValueError, match="unknown device_path"):
        DiskTier("/nonexistent-never-created", BS, device_path="fast")


# ------------------------------------------------------------------ status


def test_status_here_explains_itself(tmp_path):
    info = _native.gds_build_info()
    assert set(info) == {"built", "device_verify_built", "reason", "kvikio_version"}
    st = gpu.gds_status(tmp_path)
    for k in ("built", "build_reason", "importable", "import_reason", "cuda_devices", "cufile_available",
              "gds_available", "usable", "reason", "root_probe", "notes"):
        assert k in st
    if not info["built"]:
        assert not st["importable"] and not st["usable"]
        assert st["reason"].startswith("gds engine not built")


class FakeGdsModule:
    """Stands in for pykvtier._gds: status() and probe_file() as the real module returns them."""

    def __init__(self, gds=True, compat_at_root=False):
        self.gds, self.compat, self.probed = gds, compat_at_root, []

    def status(self):
        return {"kvikio_version": "26.10.0", "device_verify_built": True, "cufile_library": True,
                "cufile_available": True, "cufile_version": 1190, "compat_mode_default": "AUTO",
                "compat_mode_preferred": not self.gds, "gds_available": self.gds,
                "nvfs_version": "2.26" if self.gds else None, "nvfs_allow_compat_mode": True,
                "cuda_devices": 1, "cuda_error": "", "cuda_runtime_version": 13000,
                "cuda_driver_version": 13000, "kvikio_threads": 1, "kvikio_task_size": 4 << 20, "notes": []}

    def probe_file(self, d):
        self.probed.append(d)
        return {"opened": True, "compat": self.compat, "direct_fd": True, "reason": "fake"}


def test_status_maps_the_engine_report(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu._native, "gds_build_info", lambda: {
        "built": True, "device_verify_built": True, "reason": "built against kvikio 26.10.0",
        "kvikio_version": "26.10.0"})
    fake = FakeGdsModule()
    gpu.gds_status(tmp_path / "a", loader=lambda refresh: (fake, "loaded"))
    (tmp_path / "a").mkdir()  # a folder probed before it existed is probed again
    (tmp_path / "b").mkdir()
    st = gpu.gds_status(tmp_path / "a", loader=lambda refresh: (fake, "loaded"))
    assert fake.probed == [str(tmp_path / "a")] * 2
    fake.probed.clear()
    st = gpu.gds_status(tmp_path / "a", refresh=True, loader=lambda refresh: (fake, "loaded"))
    assert st["usable"] and st["root_probe"]["compat"] is False and st["nvfs_version"] == "2.26"
    assert fake.probed == [str(tmp_path / "a")]
    gpu.gds_status(tmp_path / "a", loader=lambda refresh: (fake, "loaded"))
    assert len(fake.probed) == 1  # one probe per root
    fake2 = FakeGdsModule(compat_at_root=True)
    st = gpu.gds_status(tmp_path / "b", loader=lambda refresh: (fake2, "loaded"))
    assert not st["usable"] and "refused for files at" in st["reason"]
    st = gpu.gds_status(None, loader=lambda refresh: (FakeGdsModule(gds=False), "loaded"))
    assert not st["usable"] and "nvidia-fs" in st["reason"] and st["root_probe"] is None


# ------------------------------------------------------------------ the bounce engine


def write_blocks(root, n, bs=BS, seed=1):
    """Stores n random blocks through the uring engine; returns (paths, digests, payloads)."""
    eng = _native.Engine(queue_depth=8)
    data = np.random.default_rng(seed).integers(0, 256, (n, bs), dtype=np.uint8)
    paths, digests = [], []
    entries = []
    for i in range(n):
        d = key_digest(f"key-{seed}-{i}".encode())
        p = os.path.join(root, f"b{i}")
        paths.append(p)
        digests.append(d)
        entries.append((p + ".tmp", p, bs, int(data[i].ctypes.data), d))
    assert run_job(eng, Op.WRITE_BLOCK, entries, direct=False) == [bs] * n
    eng.shutdown()
    return paths, digests, data


@pytest.mark.parametrize("host", ["uring", "posix"])
def test_bounce_engine_round_trip_more_blocks_than_slots(root, host, aligned):
    n = 11
    paths, digests, data = write_blocks(root, n)
    h = _native.Engine(queue_depth=8) if host == "uring" else PosixEngine(queue_depth=8)
    copier = HostCopier()
    eng = BounceEngine(h, copier, BS, bounce_slots=3, chunk_blocks=2)
    dev = aligned(n * BS).reshape(n, BS)  # the "device" arena
    entries = [(paths[i], BS, int(dev[i].ctypes.data), digests[i]) for i in range(n)]
    eng.submit(7, Op.READ_BLOCK, entries, direct=False)
    eng.drain()
    (job,) = eng.poll()
    assert (job.job_id, job.op, job.results, job.submits) == (7, Op.READ_BLOCK, [BS] * n, 1)
    assert np.array_equal(dev, data)
    st = eng.copy_stats()
    assert st == {"chunks": 6, "h2d_copies": n, "d2h_copies": 0, "copy_failures": 0, "slots_free": 3}
    assert copier.copies == n
    s = eng.stats()
    assert set(s) == set(STATS_KEYS)
    assert (s["jobs_submitted"], s["jobs_finished"], s["requests_ok"], s["bytes_read"]) == (1, 1, n, n * BS)

    # store from the device arena, read back through the host engine alone
    dev2 = aligned(2 * BS, fill=9).reshape(2, BS)
    out = [os.path.join(root, f"s{i}") for i in range(2)]
    dg = [key_digest(b"s0"), key_digest(b"s1")]
    res = run_job(eng, Op.WRITE_BLOCK, [(out[i] + ".tmp", out[i], BS, int(dev2[i].ctypes.data), dg[i])
                                  for i in range(2)], direct=False)
    assert res == [BS, BS] and eng.copy_stats()["d2h_copies"] == 2
    back = aligned(BS)
    assert run_job(eng, Op.READ_BLOCK, [(out[1], BS, int(back.ctypes.data), dg[1])], direct=False) == [BS]
    assert np.array_equal(back, dev2[1])
    # unlink passes through to the host engine
    assert run_job(eng, Op.UNLINK, [out[0], out[0] + ".missing"]) == [0, -errno.ENOENT]
    eng.shutdown()  # the host engine stays its caller's, running
    assert run_job(h, Op.UNLINK, [out[1]]) == [0]
    h.shutdown()


@pytest.mark.parametrize("bad, what", [("read_block", "str 'read_block'"), ("write_block", "str 'write_block'"),
                                       ("unlink", "str 'unlink'"), (3, "int")],
                         ids=["read_block", "write_block", "unlink", "int"])
def test_bounce_engine_takes_only_an_op(root, aligned, bad, what):
    """BounceEngine.submit and submit_blocks refuse an op that is not an Op member (a str
    included) with the C++ engines' TypeError, before anything: no job, no copy, no host job."""
    h = _native.Engine(queue_depth=8)
    copier = HostCopier()
    eng = BounceEngine(h, copier, BS, bounce_slots=2, chunk_blocks=1)
    try:
        dev = aligned(2 * BS).reshape(2, BS)
        p = os.path.join(root, "b0")
        entries = {"read_block": [(p, BS, int(dev[0].ctypes.data), key_digest(b"k"))],
                   "unlink": [p]}.get(bad, [(p + ".tmp", p, BS, int(dev[0].ctypes.data), key_digest(b"k"))])
        space = _native.BlockSpace(os.path.join(root, "blocks"), BS, int(dev.ctypes.data), BS, 2)
        d = key_digest(b"k")
        slots = None if bad == "unlink" else np.array([0], dtype=np.int64)
        before, copies = eng.stats(), eng.copy_stats()
        text = f"op must be a pykvtier._native.Op (e.g. Op.READ_BLOCK), not {what}"
        with pytest.raises(TypeError) as ei:
            eng.submit(1, bad, entries, direct=False)
        assert str(ei.value) == text
        with pytest.raises(TypeError) as ei:
            eng.submit_blocks(2, bad, space, d, slots, direct=False)
        assert str(ei.value) == text
        with pytest.raises(TypeError) as ei:
            run_job(eng, bad, entries, direct=False)
        assert str(ei.value) == text
        assert eng.stats() == before and before["jobs_submitted"] == 0
        assert eng.copy_stats() == copies and copier.copies == 0
        assert eng.pending_jobs() == 0 and eng.poll() == [] and h.pending_jobs() == 0
        assert os.listdir(root) == []
    finally:
        eng.shutdown()
        h.shutdown()


class DeferredCopier(HostCopier):
    """Copies run only when a marker is waited for or found done (as on a CUDA stream, in order):
    the engine must not report a job before its chunk's marked copy completed."""

    def __init__(self):
        super().__init__()
        self.pending, self.next, self.markers, self.polls = [], 0, 0, 0

    def _flush(self, token):
        while self.pending and self.pending[0][0] <= token:
            _, dst, src, n = self.pending.pop(0)
            self._copy(dst, src, n)

    def h2d(self, dst, src, nbytes, mark=True):
        self.next += 1
        self.pending.append((self.next, dst, src, nbytes))
        if mark:
            self.markers += 1
            return self.next
        return None

    def d2h(self, dst, src, nbytes, after=None, mark=True):
        return self.h2d(dst, src, nbytes, mark)

    def done(self, token):
        if token is None:
            return True
        self.polls += 1
        if self.polls % 2:  # "still running" every other time: the engine must wait
            return False
        self._flush(token)
        return True

    def wait(self, token):
        if token is not None:
            self._flush(token)


def test_bounce_engine_waits_for_each_chunks_marked_copy(root, aligned):
    n = 10
    paths, digests, data = write_blocks(root, n, seed=4)
    copier = DeferredCopier()
    eng = BounceEngine(_native.Engine(queue_depth=8), copier, BS, bounce_slots=6, chunk_blocks=3)
    dev = aligned(n * BS).reshape(n, BS)
    res = run_job(eng, Op.READ_BLOCK, [(paths[i], BS, int(dev[i].ctypes.data), digests[i]) for i in range(n)],
                  direct=False)
    assert res == [BS] * n and np.array_equal(dev, data)
    assert copier.markers == 4 and copier.copies == n and not copier.pending  # one marker per chunk
    dev2 = aligned(2 * BS, fill=11).reshape(2, BS)
    out = [os.path.join(root, f"w{i}") for i in range(2)]
    dg = [key_digest(b"w0"), key_digest(b"w1")]
    assert run_job(eng, Op.WRITE_BLOCK, [(out[i] + ".tmp", out[i], BS, int(dev2[i].ctypes.data), dg[i])
                                   for i in range(2)], direct=False) == [BS, BS]
    back = aligned(2 * BS).reshape(2, BS)
    h = _native.Engine(queue_depth=4)
    assert run_job(h, Op.READ_BLOCK, [(out[i], BS, int(back[i].ctypes.data), dg[i]) for i in range(2)],
                 direct=False) == [BS, BS]
    assert np.array_equal(back, dev2)
    h.shutdown()
    eng.shutdown()
    eng.host_engine.shutdown()


def test_bounce_engine_a_copy_that_fails_late(root, aligned):
    """A copy whose error shows when it is polled (as a CUDA error would): its chunk's keys fail."""
    paths, digests, data = write_blocks(root, 4, seed=6)

    class Late(DeferredCopier):
        def done(self, token):
            if token == 2:  # the first chunk's marker
                raise RuntimeError("an illegal memory access was encountered (injected)")
            return super().done(token)

        def wait(self, token):
            if token == 2:
                raise RuntimeError("an illegal memory access was encountered (injected)")
            super().wait(token)

    eng = BounceEngine(_native.Engine(queue_depth=8), Late(), BS, bounce_slots=2, chunk_blocks=2)
    dev = aligned(4 * BS).reshape(4, BS)
    res = run_job(eng, Op.READ_BLOCK, [(paths[i], BS, int(dev[i].ctypes.data), digests[i]) for i in range(4)],
                  direct=False)
    assert res == [-errno.EIO, -errno.EIO, BS, BS] and np.array_equal(dev[2:], data[2:])
    assert eng.copy_stats()["copy_failures"] == 1 and eng.copy_stats()["slots_free"] == 2
    eng.shutdown()
    eng.host_engine.shutdown()


def test_bounce_engine_partial_failure_and_copy_failure(root, aligned):
    paths, digests, data = write_blocks(root, 4, seed=3)
    with open(paths[2], "r+b") as f:  # corrupt one payload byte
        f.seek(4096 + 100)
        b = f.read(1)
        f.seek(4096 + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    os.unlink(paths[3])
    copier = HostCopier()
    eng = BounceEngine(_native.Engine(queue_depth=8), copier, BS, bounce_slots=4, chunk_blocks=4)
    dev = aligned(4 * BS).reshape(4, BS)
    entries = [(paths[i], BS, int(dev[i].ctypes.data), digests[i]) for i in range(4)]
    res = run_job(eng, Op.READ_BLOCK, entries, direct=False)
    assert res[:2] == [BS, BS] and res[2] == _native.ERR_CHECKSUM and res[3] == -errno.ENOENT
    assert np.array_equal(dev[:2], data[:2])
    assert copier.copies == 2  # failed blocks are not copied to the device

    copier.fail_next = 1
    dev[:] = 0
    res = run_job(eng, Op.READ_BLOCK, entries[:2], direct=False)
    assert res == [-errno.EIO, -errno.EIO] and eng.copy_stats()["copy_failures"] == 1
    assert eng.copy_stats()["slots_free"] == 4  # slots came back
    assert run_job(eng, Op.READ_BLOCK, entries[:1], direct=False) == [BS]
    with pytest.raises(ValueError, match="does not fit a bounce slot"):
        eng.submit(1, Op.READ_BLOCK, [(paths[0], 2 * BS, int(dev[0].ctypes.data), digests[0])])
    eng.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        eng.submit(2, Op.READ_BLOCK, entries[:1])
    eng.host_engine.shutdown()


# ------------------------------------------------------------------ DiskTier with a device arena


class FakeTensor:
    """Looks like a CUDA torch tensor to as_arena (device, contiguity, data_ptr, sizes)."""

    __module__ = "torch.fake"

    class _Dev:
        type = "cuda"

        def __str__(self):
            return "cuda:0"

    def __init__(self, arr):
        self.arr, self.device = arr, self._Dev()

    def is_contiguous(self):
        return True

    def data_ptr(self):
        return int(self.arr.ctypes.data)

    def numel(self):
        return self.arr.size

    def element_size(self):
        return 1

    def dim(self):
        return self.arr.ndim

    def stride(self, i=None):
        return self.arr.strides[i] if i is not None else self.arr.strides


def test_as_arena_takes_cuda_tensors_and_arenas(aligned):
    t = FakeTensor(aligned(4 * BS).reshape(4, BS))
    a = as_arena(t)
    assert a.device == "cuda:0" and a.slot_bytes == BS and a.num_slots == 4 and a.addr == t.data_ptr()
    assert as_arena(a) is a
    t.device.type = "mps"
    with pytest.raises(ValueError, match="CPU or CUDA"):
        as_arena(t)


@pytest.fixture
def fake_gpu(monkeypatch):
    """Replaces the GPU parts of pykvtier.gpu: returns a setter for the status; copies are memmoves,
    the "gds engine" is the posix engine working on host memory."""
    state = {"status": status(gds_available=False), "made_gds": [], "copiers": []}

    def make_gds(io_threads, compat, verify):
        state["made_gds"].append((io_threads, compat, verify))
        return PosixEngine(queue_depth=8)

    def make_copier(arena):
        state["copiers"].append(HostCopier())
        return state["copiers"][-1]

    monkeypatch.setattr(engines_gpu, "hooks", engines_gpu._Hooks(
        status=lambda root: state["status"], make_gds=make_gds, make_copier=make_copier))
    return state


def device_arena(aligned, n):
    arr = aligned(n * BS).reshape(n, BS)
    return Arena(int(arr.ctypes.data), arr.nbytes, BS, False, arr, device="cuda:0"), arr


def round_trip(tier, aligned, n=6, seed=5):
    src_arena, src = device_arena(aligned, n)
    src[:] = np.random.default_rng(seed).integers(0, 256, src.shape, dtype=np.uint8)
    tier.set_arena(src_arena)
    keys = [f"k{seed}-{i}".encode() for i in range(n)]
    tier.submit_store(TransferJob(1, keys, list(range(n))))
    tier.drain()
    (r,) = tier.get_finished_jobs()
    assert r.success and not r.is_load
    dst_arena, dst = device_arena(aligned, n)
    tier.set_arena(dst_arena)
    assert all(tier.lookup(k) is LookupResult.HIT for k in keys)
    tier.submit_load(TransferJob(2, keys[::-1], list(range(n))))
    tier.drain()
    (r,) = tier.get_finished_jobs()
    assert r.success and r.transfer_bytes == n * BS
    assert np.array_equal(dst[::-1], src)
    return keys, dst


def test_tier_device_arena_takes_the_bounce_fallback_and_says_so(root, aligned, fake_gpu, caplog):
    with caplog.at_level(logging.INFO, logger="pykvtier"), DiskTier(root, BS, direct=False) as tier:
        keys, dst = round_trip(tier, aligned)
        assert tier.device_path.path == "bounce" and tier.device_path.fallback
        assert tier.engine_name == "bounce+uring"
        msgs = [r for r in caplog.records if "take the bounce path" in r.getMessage()]
        assert len(msgs) == 1 and msgs[0].levelno == logging.WARNING  # once, for two arenas
        assert "nvidia-fs" in msgs[0].getMessage()
        assert not fake_gpu["made_gds"]
        assert tier.stats()["blocks_loaded"] == 6
        # a bounce engine per arena: the store's 6 copies to pinned slots, the load's 6 back
        assert [c.copies for c in fake_gpu["copiers"]] == [6, 6]
        # partial failure: a missing file is a per-key failure and then a MISS
        os.unlink(tier.layout.block_path(key_digest(keys[0])))
        tier.submit_load(TransferJob(3, keys[:2], [0, 1]))
        tier.drain()
        (r,) = tier.get_finished_jobs()
        assert not r.success and r.successful_keys == [keys[1]] and keys[0] in r.failed_keys
        assert tier.lookup(keys[0]) is LookupResult.MISS
        with pytest.raises(ValueError, match="device arena"):
            tier.set_arena(aligned(4 * BS).reshape(4, BS))


def test_tier_device_arena_takes_gds_where_usable(root, aligned, fake_gpu, caplog):
    fake_gpu["status"] = status()
    with caplog.at_level(logging.INFO, logger="pykvtier"), \
            DiskTier(root, BS, direct=False, device_path=gpu.DeviceOptions(io_threads=3, checksum="host")) as tier:
        round_trip(tier, aligned)
        assert tier.device_path.path == "gds" and not tier.device_path.fallback
        assert tier.engine_name == "gds"
        assert fake_gpu["made_gds"] == [(3, "auto", "host")] * 2  # one engine per arena
        assert any("take the gds path" in r.getMessage() and r.levelno == logging.INFO
                   for r in caplog.records)


def test_tier_forced_paths(root, aligned, fake_gpu):
    with DiskTier(root, BS, direct=False, device_path="kvikio-compat") as tier:
        round_trip(tier, aligned)
        assert tier.device_path.path == "kvikio-compat" and fake_gpu["made_gds"][0][1] == "on"
    fake_gpu["made_gds"].clear()
    fake_gpu["status"] = status()
    with DiskTier(root, BS, direct=False, device_path="bounce") as tier:
        round_trip(tier, aligned, seed=6)
        assert tier.device_path.path == "bounce" and not fake_gpu["made_gds"]
    fake_gpu["status"] = status(importable=False, import_reason="no libkvikio")
    with DiskTier(root, BS, direct=False, device_path="gds") as tier:
        arena, _ = device_arena(aligned, 2)
        with pytest.raises(ValueError, match="gds engine is unavailable"):
            tier.set_arena(arena)


def test_eviction_in_flight_survives_the_switch_to_a_device_arena(root, aligned, fake_gpu):
    with DiskTier(root, BS, direct=False) as tier:
        host = aligned(3 * BS).reshape(3, BS)
        tier.set_arena(host)
        tier.submit_store(TransferJob(1, [b"a", b"b", b"c"], [0, 1, 2]))
        tier.drain()
        tier.get_finished_jobs()
        tier._evict(tier.file_bytes)  # an unlink job in flight in the host engine
        assert tier.has_pending_work()
        arena, _ = device_arena(aligned, 2)
        tier.set_arena(arena)  # drains it and applies its result before swapping engines
        assert tier.num_blocks == 2 and tier.stats()["evictions"] == 1
        assert not tier.has_pending_work() and tier.lookup(b"a") is LookupResult.MISS
        assert not os.path.exists(tier.layout.block_path(key_digest(b"a")))


def test_promoter_targets_device_slots(root, aligned, fake_gpu):
    with DiskTier(root, BS, direct=False) as tier:
        keys, src = round_trip(tier, aligned, n=4, seed=8)
        src = src[::-1]  # round_trip loaded the keys in reverse order
        arena, dev = device_arena(aligned, 5)
        tier.set_arena(arena)
        pr = Promoter(tier)
        pr.promote("r1", keys[:2], [0, 1])
        pr.promote("r2", keys[1:], [2, 3, 4])  # keys[1] shared: read once, into r1's slot
        pr.on_step_end()
        assert pr.jobs_submitted == 2
        done = {}
        while len(done) < 2:
            for r in pr.wait(5.0):
                done[r.request_id] = r
        assert done["r1"].loaded == {keys[0]: 0, keys[1]: 1}
        assert done["r2"].loaded == {keys[1]: 1, keys[2]: 3, keys[3]: 4}
        for k, slot in {**done["r1"].loaded, **done["r2"].loaded}.items():
            assert np.array_equal(dev[slot], src[keys.index(k)])
        assert tier.stats()["blocks_loaded"] == 4 + 4  # round_trip's 4, then 4 (k1 read once)


def test_xxh3_lane_formulation_matches_xxhash():
    """_native._xxh3_lanes runs the device kernel's arithmetic and chunk schedule (xxh3_lanes.hpp:
    16 XXH3 blocks of 1 KiB staged per chunk, then the tail) on the host: it must be XXH3-64 at
    every boundary of blocks, tail stripes and chunks, or the GPU would quarantine good blocks."""
    rng = np.random.default_rng(0)
    kib = 1024
    lengths = {241, 255, 256, 257, 1023, 1024, 1025, 1088, 1089, 2048, 2049, 4096 + 7, 65536, 2 << 20,
               (2 << 20) + 8, (2 << 20) - 8}
    for blocks in (15, 16, 17, 31, 32, 33, 48, 64):  # whole blocks around one, two, three chunks
        for extra in (0, 1, 63, 64, 65, kib - 1):
            lengths.add(blocks * kib + extra)
    lengths |= {int(n) for n in rng.integers(241, 80 * kib, 40)}
    data = rng.integers(0, 256, (2 << 20) + 64, dtype=np.uint8)
    for n in sorted(lengths):
        for off in (0, 16, 3):  # the host reference takes any alignment (the kernel: 16 bytes)
            b = data[off:off + n]
            assert _native._xxh3_lanes(b) == _native.xxh3_64(b), (n, off)
    # a flipped bit anywhere (first block, a chunk boundary, the last stripe) changes the hash
    b = data[:(33 * kib) + 100].copy()
    h = _native._xxh3_lanes(b)
    for pos in (0, 16 * kib - 1, 16 * kib, 32 * kib + 5, len(b) - 1):
        b[pos] ^= 1
        assert _native._xxh3_lanes(b) == _native.xxh3_64(b) != h, pos
        b[pos] ^= 1
    with pytest.raises(ValueError):
        _native._xxh3_lanes(b[:240])


# The CUDA names csrc/gds_verify.cu uses, for compiling it as plain C++: one thread per CUDA
# thread (256 std::threads per CUDA block, the blocks one after the other), __syncthreads as a
# std::barrier, __shared__ as a static, the lane shuffle through a slot array.
_FAKE_CUDA_RUNTIME = r"""
#pragma once
#include <barrier>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __constant__
#define __shared__ static
#define __launch_bounds__(n)
#define __align__(n) __attribute__((aligned(n)))
struct uint4 { uint32_t x, y, z, w; };
struct dim3_ { unsigned x; };
inline thread_local dim3_ threadIdx, blockIdx;
using cudaStream_t = void*;
inline int cudaGetLastError() { return 0; }
inline std::barrier<>* pykv_block_barrier;
inline std::barrier<>* pykv_lane_barrier;
inline uint64_t pykv_lane_slots[32];
inline void __syncthreads() { pykv_block_barrier->arrive_and_wait(); }
inline uint64_t __shfl_sync(unsigned mask, uint64_t v, int src) {
  if (mask != 0xFFu) std::abort();  // (only the 8 XXH3 lanes shuffle)
  pykv_lane_slots[threadIdx.x] = v;
  pykv_lane_barrier->arrive_and_wait();
  const uint64_t r = pykv_lane_slots[src];
  pykv_lane_barrier->arrive_and_wait();
  return r;
}
template <class... A>
void pykv_launch(void (*kernel)(A...), unsigned blocks, unsigned threads, A... args) {
  for (unsigned b = 0; b < blocks; ++b) {
    std::barrier<> all(threads), lanes(8);
    pykv_block_barrier = &all;
    pykv_lane_barrier = &lanes;
    std::vector<std::thread> ts;
    for (unsigned t = 0; t < threads; ++t)
      ts.emplace_back([=] { threadIdx.x = t; blockIdx.x = b; kernel(args...); });
    for (auto& th : ts) th.join();
  }
}
"""

_EMULATION_MAIN = r"""
#define XXH_INLINE_ALL
#include <xxhash.h>
#include <cstdio>
#include <cstdlib>
int main(int argc, char** argv) {
  using namespace pykvtier::gds;
  std::vector<HashTask> tasks;
  std::vector<uint8_t*> bufs;
  for (int i = 1; i < argc; ++i) {
    const uint64_t n = std::strtoull(argv[i], nullptr, 10);
    auto* p = static_cast<uint8_t*>(std::aligned_alloc(16, (n + 15) / 16 * 16));
    for (uint64_t k = 0; k < n; ++k) p[k] = uint8_t((k * 2654435761u + i * 40503u) >> 7);
    tasks.push_back({p, n});
    bufs.push_back(p);
  }
  std::vector<uint64_t> out(tasks.size(), 0);
  if (launch_xxh3_long(tasks.data(), out.data(), unsigned(tasks.size()), nullptr) != 0) return 2;
  int bad = 0;
  for (size_t i = 0; i < tasks.size(); ++i) {
    const uint64_t want = XXH3_64bits(tasks[i].ptr, tasks[i].len);
    std::printf("%llu %016llx %016llx%s\n", (unsigned long long)tasks[i].len, (unsigned long long)out[i],
                (unsigned long long)want, out[i] == want ? "" : " MISMATCH");
    bad += out[i] != want;
  }
  return bad ? 1 : 0;
}
"""


@pytest.mark.parametrize("sanitize", [False, True], ids=["plain", "tsan"])
def test_device_checksum_kernel_source_emulated_on_the_cpu(tmp_path, sanitize):
    """csrc/gds_verify.cu itself (its staging copy, double buffering, barriers and lane shuffle),
    compiled as C++ with CUDA's names emulated by threads, gives XXH3-64; under ThreadSanitizer a
    chunk read while the loaders overwrite it would be reported as a data race."""
    import re
    import shutil
    import subprocess

    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    import glob

    (cu,) = glob.glob(os.path.join(repo, "csrc", "**", "gds_verify.cu"), recursive=True)
    src = open(cu).read()
    # the include dirs: every folder of csrc/ with headers (the tree's layout may change)
    incs = sorted({os.path.dirname(h) for h in glob.glob(os.path.join(repo, "csrc", "**", "*.hpp"),
                                                         recursive=True)} | {os.path.join(repo, "csrc")})
    src, n = re.subn(r"(\w+)<<<\s*([^,]+),\s*([^,]+),.*?>>>\(([^)]*)\);", r"pykv_launch(\1, \2, \3, \4);", src)
    assert n == 1, "the kernel launch in gds_verify.cu was not recognised"
    (tmp_path / "cuda_runtime.h").write_text(_FAKE_CUDA_RUNTIME)
    (tmp_path / "emul.cpp").write_text(src + _EMULATION_MAIN)
    flags = ["-fsanitize=thread", "-O1", "-g"] if sanitize else ["-O2"]
    cmd = [cxx, "-std=c++20", "-pthread", *flags, "-I", str(tmp_path), *(f"-I{d}" for d in incs),
           str(tmp_path / "emul.cpp"), "-o", str(tmp_path / "emul")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        if "xxhash.h" in r.stderr or (sanitize and "tsan" in r.stderr.lower()):
            pytest.skip(f"cannot build the emulation here: {r.stderr.strip().splitlines()[-1]}")
        raise AssertionError(r.stderr)
    kib = 1024
    # 0, 1, 2 and several chunks of whole blocks (16 per chunk, double-buffered), each with and
    # without tail stripes; the tsan run keeps to the shorter ones (it is ~10x slower)
    lengths = [241, 1000, 1024, 1025, 16 * kib, 16 * kib + 1, 16 * kib + 80, 17 * kib, 32 * kib + 1,
               33 * kib + 700, 48 * kib + 1]
    if not sanitize:
        lengths += [65536 + 4096, 1 << 20, (2 << 20) + 8]
    r = subprocess.run([str(tmp_path / "emul"), *map(str, lengths)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "WARNING: ThreadSanitizer" not in r.stderr, r.stdout + r.stderr[-4000:]
    assert len(r.stdout.splitlines()) == len(lengths)


def test_gds_engine_plumbing_without_a_gpu(tmp_path):
    """Where pykvtier._gds was built (kvikio at build time) it loads and works as an engine even
    on a machine without a GPU: status, job queue, unlinks, refusing host addresses."""
    mod, reason = gpu.load_gds_module()
    if mod is None:
        pytest.skip(f"gds engine unavailable: {reason}")
    st = mod.status()
    assert {"kvikio_version", "cufile_library", "cufile_available", "gds_available", "cuda_devices",
            "compat_mode_default", "notes"} <= set(st)
    for bad in (dict(checksum="fast"), dict(compat="maybe"), dict(io_threads=0)):
        with pytest.raises(ValueError):
            mod.GdsEngine(**bad)
    eng = mod.GdsEngine(io_threads=2, compat="on", checksum="host")
    assert (eng.io_threads, eng.compat, eng.checksum) == (2, "on", "host")
    f = tmp_path / "x"
    f.write_bytes(b"1")
    eng.submit(5, Op.UNLINK, [str(f), str(tmp_path / "missing")])
    eng.drain()
    (job,) = eng.poll()
    assert (job.job_id, job.op, job.results) == (5, Op.UNLINK, [0, -errno.ENOENT]) and not f.exists()
    host = np.zeros(BS, np.uint8)
    with pytest.raises(ValueError, match="entry 0"):
        eng.submit(6, Op.READ_BLOCK, [(str(f), BS, int(host.ctypes.data), key_digest(b"x"))])
    with pytest.raises(TypeError) as ei:
        eng.submit(7, "read_block", [(str(f), BS, int(host.ctypes.data), key_digest(b"x"))])
    assert str(ei.value) == "op must be a pykvtier._native.Op (e.g. Op.READ_BLOCK), not str 'read_block'"
    with pytest.raises(TypeError, match="not str 'unlink'"):
        eng.submit_blocks(8, "unlink", _native.BlockSpace(str(tmp_path), BS, int(host.ctypes.data), BS, 1),
                          key_digest(b"x"))
    s = eng.stats()
    assert s["jobs_finished"] == 1 and s["requests_failed"] == 1 and {"submits", "fixed_buffer_ios"} <= set(s)
    eng.shutdown()
