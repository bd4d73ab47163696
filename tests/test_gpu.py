"""On a CUDA machine: device arenas through every path, byte for byte (marked ``gpu``).

Skipped, with the reason, where torch or a CUDA device is missing; the gds engine's tests skip
where it was not built or does not load (``pykvtier doctor`` says why). The same dispatch logic is
tested without a GPU in test_gpu_dispatch.py. scripts/gpu_check.sh runs these on a GPU machine.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: the GPU tests need it")

from pykvtier import DiskTier, LookupResult, Promoter, TransferJob, _native, gpu  # noqa: E402
from pykvtier.engines import run_job  # noqa: E402
from pykvtier.layout import key_digest  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible to torch"),
]

BS = 1 << 20
N = 12


def gds_module():
    mod, reason = gpu.load_gds_module()
    if mod is None:
        pytest.skip(f"gds engine unavailable: {reason}")
    return mod


def paths_here():
    """The paths testable here: bounce always; kvikio-compat where the gds engine loads; gds where
    GPUDirect Storage is usable."""
    out = ["bounce"]
    mod, _ = gpu.load_gds_module()
    if mod is not None:
        out.append("kvikio-compat")
        if gpu.gds_status().get("usable"):
            out.append("gds")
    return out


def device_arena(n=N, fill=None):
    t = torch.empty((n, BS), dtype=torch.uint8, device="cuda")
    if fill is None:
        t.zero_()
    else:
        g = torch.Generator(device="cuda").manual_seed(fill)
        t.copy_(torch.randint(0, 256, (n, BS), dtype=torch.uint8, device="cuda", generator=g))
    return t


@pytest.mark.parametrize("path", ["bounce", "kvikio-compat", "gds"])
def test_device_round_trip_byte_exact(root, path, caplog):
    if path not in paths_here():
        pytest.skip(f"path {path} not available here: {gpu.gds_status().get('reason')}")
    src = device_arena(fill=1)
    keys = [f"rt-{path}-{i}".encode() for i in range(N)]
    with caplog.at_level(logging.INFO, logger="pykvtier"), DiskTier(root, BS, device_path=path) as tier:
        tier.set_arena(src)
        assert tier.device_path.path == path
        tier.submit_store(TransferJob(1, keys, list(range(N))))
        tier.drain()
        (r,) = tier.get_finished_jobs()
        assert r.success, r.failed_keys
        dst = device_arena()
        tier.set_arena(dst)
        perm = list(np.random.default_rng(0).permutation(N))
        tier.submit_load(TransferJob(2, keys, perm))
        tier.drain()
        (r,) = tier.get_finished_jobs()
        assert r.success, r.failed_keys
        torch.cuda.synchronize()
        for i, s in enumerate(perm):
            assert torch.equal(dst[s], src[i]), (path, i)
        assert r.transfer_bytes == N * BS
    # the same files through the host path: one on-disk format
    host = np.zeros((N, BS), dtype=np.uint8)
    with DiskTier(root, BS) as tier:
        tier.set_arena(host)
        tier.submit_load(TransferJob(3, keys, list(range(N))))
        tier.drain()
        (r,) = tier.get_finished_jobs()
        assert r.success
    assert np.array_equal(host, src.cpu().numpy())


@pytest.mark.parametrize("path", ["bounce", "kvikio-compat", "gds"])
def test_device_partial_failure(root, path):
    if path not in paths_here():
        pytest.skip(f"path {path} not available here")
    host = np.random.default_rng(2).integers(0, 256, (4, BS), dtype=np.uint8)
    keys = [f"pf-{path}-{i}".encode() for i in range(4)]
    with DiskTier(root, BS) as tier:  # written through the host path
        tier.set_arena(host)
        tier.submit_store(TransferJob(1, keys, list(range(4))))
        tier.drain()
        assert tier.get_finished_jobs()[0].success
    with DiskTier(root, BS, device_path=path) as tier:
        paths = [tier.layout.block_path(key_digest(k)) for k in keys]
        with open(paths[1], "r+b") as f:  # flip one payload byte: only the checksum can tell
            f.seek(4096 + BS // 2)
            b = f.read(1)
            f.seek(4096 + BS // 2)
            f.write(bytes([b[0] ^ 1]))
        os.unlink(paths[2])
        dst = device_arena(4)
        tier.set_arena(dst)
        tier.submit_load(TransferJob(9, keys, [0, 1, 2, 3]))
        tier.drain()
        (r,) = tier.get_finished_jobs()
        assert not r.success and set(r.successful_keys) == {keys[0], keys[3]}
        assert "checksum" in r.failed_keys[keys[1]] and keys[2] in r.failed_keys
        assert tier.stats()["quarantined"] == 1
        assert tier.lookup(keys[1]) is LookupResult.MISS and tier.lookup(keys[2]) is LookupResult.MISS
        torch.cuda.synchronize()
        assert np.array_equal(dst[0].cpu().numpy(), host[0]) and np.array_equal(dst[3].cpu().numpy(), host[3])


def test_fallback_selection_matches_the_status(root, caplog):
    with caplog.at_level(logging.INFO, logger="pykvtier"), DiskTier(root, BS) as tier:
        st = gpu.gds_status(tier.layout.blocks_dir)
        host = tier.engine_name
        tier.set_arena(device_arena(2))
        want = gpu.choose_path(gpu.gds_status(tier.layout.blocks_dir), "auto", host)
        assert tier.device_path == want
        if st["usable"]:
            assert want.path == "gds" and not want.fallback
        else:
            assert want.fallback and st["reason"] in want.reason
            assert want.path == ("bounce" if host == "uring" else want.path)
    assert any(f"take the {want.path} path" in r.getMessage() for r in caplog.records)


def test_promoter_into_device_slots(root):
    src = device_arena(4, fill=3)
    keys = [f"pr-{i}".encode() for i in range(4)]
    with DiskTier(root, BS) as tier:
        tier.set_arena(src)
        tier.submit_store(TransferJob(1, keys, [0, 1, 2, 3]))
        tier.drain()
        tier.get_finished_jobs()
        dst = device_arena(4)
        tier.set_arena(dst)
        pr = Promoter(tier)
        pr.promote("a", keys[:3], [3, 2, 1])
        pr.promote("b", keys[2:], [0, 0])  # keys[2] shared: read once into a's slot 1
        pr.on_step_end()
        assert pr.jobs_submitted == 2
        done = {}
        while len(done) < 2:
            for res in pr.wait(30.0):
                done[res.request_id] = res
        assert done["b"].loaded == {keys[2]: 1, keys[3]: 0}
        torch.cuda.synchronize()
        for k, s in {**done["a"].loaded, **done["b"].loaded}.items():
            assert torch.equal(dst[s], src[keys.index(k)])


# ------------------------------------------------------------------ the gds engine itself


# (16400: exactly one staged chunk of 16 XXH3 blocks, then only the last stripe; 17408: one chunk
# and 15 tail stripes; 32784: two chunks, the second double-buffered)
@pytest.mark.parametrize("length", [200, 241, 1000, 4096, 16400, 17408, 32784, 65536 + 4096, 1 << 20,
                                    (1 << 20) + 8, 2 << 20])
def test_gds_checksums_agree_with_the_host(root, length):
    """Blocks the gds engine writes (device checksum) read back through the io_uring engine (host
    XXH3), and the other way round: the device kernel computes XXH3-64 exactly."""
    mod = gds_module()
    eng = mod.GdsEngine(io_threads=4, compat="on", checksum="auto")
    n = 4
    src = torch.randint(0, 256, (n, length), dtype=torch.uint8, device="cuda")
    digests = [key_digest(f"ck-{length}-{i}".encode()) for i in range(n)]
    paths = [os.path.join(root, f"c{i}") for i in range(n)]
    res = run_job(eng, _native.WRITE_BLOCK, [(p + ".tmp", p, length, int(src[i].data_ptr()), d)
                                  for i, (p, d) in enumerate(zip(paths, digests))], direct=False)
    assert res == [length] * n, eng.last_error()
    host = _native.Engine(queue_depth=4)
    buf = np.zeros((n, length), dtype=np.uint8)
    assert run_job(host, _native.READ_BLOCK, [(p, length, int(buf[i].ctypes.data), d)
                                              for i, (p, d) in enumerate(zip(paths, digests))],
                   direct=False) == [length] * n
    assert np.array_equal(buf, src.cpu().numpy())
    dst = torch.zeros_like(src)
    res = run_job(eng, _native.READ_BLOCK, [(p, length, int(dst[i].data_ptr()), d)
                                 for i, (p, d) in enumerate(zip(paths, digests))], direct=False)
    assert res == [length] * n, eng.last_error()
    torch.cuda.synchronize()
    assert torch.equal(dst, src)
    st = eng.stats()
    assert st["device_verifications"] + st["host_verifications"] == 2 * n
    if mod.DEVICE_VERIFY_BUILT and length >= 241:  # (rows not 16-byte aligned are hashed on the host)
        assert st["device_verifications"] >= 2 and st["verify_launches"] >= 1
    else:
        assert st["device_verifications"] == 0
    eng.shutdown()
    host.shutdown()


@pytest.mark.parametrize("verify", ["device", "host", "header"])
def test_gds_verify_modes_on_a_corrupt_payload(root, verify):
    mod = gds_module()
    if verify == "device" and not mod.DEVICE_VERIFY_BUILT:
        pytest.skip("built without the device checksum kernel (no nvcc at build time)")
    # device / host: where the payload checksum is computed; header: submit's verify="header"
    eng = mod.GdsEngine(io_threads=2, compat="on", checksum="host" if verify == "header" else verify)
    kw = {"verify": "header"} if verify == "header" else {}
    src = torch.randint(0, 256, (2, BS), dtype=torch.uint8, device="cuda")
    d = [key_digest(b"v0"), key_digest(b"v1")]
    p = [os.path.join(root, "v0"), os.path.join(root, "v1")]
    assert run_job(eng, _native.WRITE_BLOCK, [(p[i] + ".tmp", p[i], BS, int(src[i].data_ptr()), d[i]) for i in range(2)],
                   direct=False, **kw) == [BS, BS]
    with open(p[1], "r+b") as f:
        f.seek(4096 + 7)
        f.write(b"\x00\x01\x02")
    dst = torch.zeros_like(src)
    res = run_job(eng, _native.READ_BLOCK, [(p[i], BS, int(dst[i].data_ptr()), d[i]) for i in range(2)],
                  direct=False, **kw)
    assert res[0] == BS
    if verify == "header":
        assert res[1] == BS  # stored and loaded without a payload checksum: not caught
    else:
        assert res[1] == _native.ERR_CHECKSUM
        assert int(dst[1].count_nonzero()) == 0  # a failed load's bytes do not stay (zeroed)
    assert torch.equal(dst[0], src[0])
    # header checks hold in every mode: another key's block is refused, its memory zeroed
    res = run_job(eng, _native.READ_BLOCK, [(p[0], BS, int(dst[0].data_ptr()), d[1])], direct=False)
    assert res == [_native.ERR_KEY_MISMATCH]
    assert int(dst[0].count_nonzero()) == 0
    with pytest.raises(ValueError, match="not device memory"):
        run_job(eng, _native.READ_BLOCK, [(p[0], BS, int(np.zeros(BS, np.uint8).ctypes.data), d[0])])
    eng.shutdown()
