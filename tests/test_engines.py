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
    assert run_job(engine, Op.WRITE, [(path, 0, 4096, a)], direct=False) == [4096]
    assert run_job(engine, Op.READ, [(path, 0, 4096, b)], direct=False) == [4096]
    assert dst.raw == b"k" * 4096
    assert run_job(engine, Op.READ, [(str(tmp_path / "missing"), 0, 4096, b)], direct=False) == [-2]
    assert engine.pending_jobs() == 0 and engine.poll() == []


def test_run_job_keeps_other_jobs(engine, tmp_path):
    src, a = _buf(b"z")
    path = str(tmp_path / "g")
    engine.submit(7, Op.WRITE, [(path, 0, 4096, a)], direct=False)
    engine.drain()
    kept: list = []
    assert run_job(engine, Op.READ, [(path, 0, 4096, a)], direct=False, keep=kept) == [4096]
    assert [(j.job_id, j.op, list(j.results)) for j in kept] == [(7, Op.WRITE, [4096])]

    engine.submit(8, Op.WRITE, [(path, 0, 4096, a)], direct=False)
    engine.drain()
    with pytest.raises(ForeignJobs, match=r"ids \[8\]") as info:
        run_job(engine, Op.READ, [(path, 0, 4096, a)], direct=False)
    assert info.value.results == [4096]
    assert [j.job_id for j in info.value.jobs] == [8]


@pytest.mark.parametrize("bad, what", [("read", "str 'read'"), ("write_block", "str 'write_block'"),
                                       ("frobnicate", "str 'frobnicate'"), (1, "int")],
                         ids=["read", "write_block", "frobnicate", "int"])
def test_run_job_takes_only_an_op(engine, tmp_path, bad, what):
    """run_job refuses an op that is not an Op member (a str included) with the engines'
    TypeError before it calls submit: nothing is queued, nothing written."""
    src, a = _buf(b"k")
    path = str(tmp_path / "f")
    with pytest.raises(TypeError) as ei:
        run_job(engine, bad, [(path, 0, 4096, a)], direct=False)
    assert str(ei.value) == f"op must be a pykvtier._native.Op (e.g. Op.READ_BLOCK), not {what}"
    assert engine.stats()["jobs_submitted"] == 0
    assert engine.pending_jobs() == 0 and engine.poll() == []
    assert list(tmp_path.iterdir()) == []


def test_run_job_checks_the_op_before_calling_submit():
    """Also for an engine that would take anything: run_job itself checks the op."""
    calls = []

    class Lenient:
        def submit(self, *args, **kw):
            calls.append(args)

    with pytest.raises(TypeError, match=r"^op must be a pykvtier\._native\.Op \(e\.g\. Op\.READ_BLOCK\), "
                                        r"not str 'read'$"):
        run_job(Lenient(), "read", [])
    assert calls == []
