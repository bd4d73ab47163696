"""pykvtier.engines: run_job (plain submit-and-wait) over every host engine."""

import ctypes

import pytest

from pykvtier import _native
from pykvtier.engines import ForeignJobs, Op, run_job


@pytest.fixture(params=["uring", "posix"])
def engine(request):
    e = _native.Engine(32) if request.param == "uring" else _native.PosixEngine(32)
    yield e
    e.shutdown()


def _buf(fill: bytes):
    b = ctypes.create_string_buffer(fill * 4096, 4096)
    return b, ctypes.addressof(b)


def test_run_job_writes_and_reads_back(engine, tmp_path):
    src, a = _buf(b"k")
    dst, b = _buf(b"\0")
    path = str(tmp_path / "f")
    assert run_job(engine, "write", [(path, 0, 4096, a)], direct=False) == [4096]
    assert run_job(engine, "read", [(path, 0, 4096, b)], direct=False) == [4096]
    assert dst.raw == b"k" * 4096
    assert run_job(engine, "read", [(str(tmp_path / "missing"), 0, 4096, b)], direct=False) == [-2]
    assert engine.pending_jobs() == 0 and engine.poll() == []


def test_run_job_keeps_other_jobs(engine, tmp_path):
    src, a = _buf(b"z")
    path = str(tmp_path / "g")
    engine.submit(7, "write", [(path, 0, 4096, a)], direct=False)
    engine.drain()
    kept: list = []
    assert run_job(engine, "read", [(path, 0, 4096, a)], direct=False, keep=kept) == [4096]
    assert [(j.job_id, j.op, list(j.results)) for j in kept] == [(7, Op.WRITE, [4096])]

    engine.submit(8, "write", [(path, 0, 4096, a)], direct=False)
    engine.drain()
    with pytest.raises(ForeignJobs, match=r"ids \[8\]") as info:
        run_job(engine, "read", [(path, 0, 4096, a)], direct=False)
    assert info.value.results == [4096]
    assert [j.job_id for j in info.value.jobs] == [8]


def test_run_job_bad_op_raises_before_queueing(engine, tmp_path):
    with pytest.raises(ValueError):
        run_job(engine, "frobnicate", [], direct=False)
    assert engine.pending_jobs() == 0
