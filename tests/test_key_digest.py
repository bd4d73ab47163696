"""The key digest in C++ (libb2): _native.key_digest / key_digests and layout.key_digest equal
hashlib's BLAKE2b-128 for every key, for each accepted key type, and refuse other types by name;
and the build names libb2's packages where libb2 is missing."""

from __future__ import annotations

import array
import glob
import hashlib
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

from pykvtier import _native
from pykvtier.layout import key_digest


def _ref(key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=16).digest()


def test_equals_hashlib_for_every_length_up_to_300():
    rng = random.Random(10)
    for n in range(301):
        key = rng.randbytes(n)
        assert _native.key_digest(key) == _ref(key), n
        assert key_digest(key) == _ref(key), n


def test_equals_hashlib_for_random_keys():
    rng = random.Random(11)
    keys = [rng.randbytes(rng.choice((1, 8, 16, 32, 64, 127, 128, 129, 255, 256, 257, 1000, 4097)))
            for _ in range(5000)]
    assert [_native.key_digest(k) for k in keys] == [_ref(k) for k in keys]


def test_known_values():
    # BLAKE2b-128 of b"" and b"abc" (as hashlib computes them, written out)
    assert key_digest(b"").hex() == "cae66941d9efbd404e4d88758ea67670"
    assert key_digest(b"abc").hex() == "cf4ab791c62b8d2b2109c90275287816"


def test_bytearray_and_memoryview_hash_their_bytes():
    rng = random.Random(12)
    for n in (0, 1, 16, 129, 1024):
        key = rng.randbytes(n)
        assert _native.key_digest(bytearray(key)) == _ref(key)
        assert _native.key_digest(memoryview(key)) == _ref(key)
        assert _native.key_digest(memoryview(bytearray(key))) == _ref(key)
    big = rng.randbytes(300)
    assert _native.key_digest(memoryview(big)[7:200]) == _ref(big[7:200])
    # a memoryview of another format is hashed as its raw bytes, like hashlib does
    q = array.array("q", [1, -2, 3 << 40])
    assert _native.key_digest(memoryview(q)) == _ref(q.tobytes()) == hashlib.blake2b(q, digest_size=16).digest()


def test_key_digests_is_the_concatenation_in_order():
    rng = random.Random(13)
    keys = [rng.randbytes(rng.randrange(0, 300)) for _ in range(2000)]
    mixed = [bytearray(k) if i % 3 == 1 else memoryview(k) if i % 3 == 2 else k for i, k in enumerate(keys)]
    want = b"".join(_ref(k) for k in keys)
    assert len(want) == 16 * 2000
    assert _native.key_digests(keys) == want
    assert _native.key_digests(tuple(keys)) == want
    assert _native.key_digests(mixed) == want
    assert _native.key_digests([]) == b""
    assert _native.key_digests(()) == b""


@pytest.mark.parametrize("key, name", [("abc", "str"), (None, "NoneType"), (12, "int"),
                                       (array.array("b", b"ab"), "array"), ([b"a"], "list")])
def test_key_of_another_type_is_a_type_error(key, name):
    with pytest.raises(TypeError) as e:
        _native.key_digest(key)
    assert str(e.value) == f"key must be bytes, not {name}"
    with pytest.raises(TypeError) as e:
        key_digest(key)
    assert str(e.value) == f"key must be bytes, not {name}"


def test_keys_of_another_type_name_the_index():
    with pytest.raises(TypeError) as e:
        _native.key_digests([b"a", bytearray(b"b"), "c", 4])
    assert str(e.value) == "keys[2] must be bytes, not str"
    with pytest.raises(TypeError) as e:
        _native.key_digests((None,))
    assert str(e.value) == "keys[0] must be bytes, not NoneType"


def test_keys_that_are_not_a_list_or_tuple_are_a_type_error():
    for keys, name in ((b"abc", "bytes"), (iter([b"a"]), "list_iterator"), ({b"a"}, "set"), (None, "NoneType")):
        with pytest.raises(TypeError) as e:
            _native.key_digests(keys)
        assert str(e.value) == f"keys must be a list or tuple of bytes, not {name}"


def test_non_contiguous_and_released_memoryviews_are_refused():
    data = bytes(range(64))
    strided = memoryview(data)[::2]
    with pytest.raises(ValueError) as e:
        _native.key_digest(strided)
    assert str(e.value) == "key must be a C-contiguous buffer; this memoryview is not"
    with pytest.raises(ValueError) as e:
        _native.key_digests([data, strided])
    assert str(e.value) == "keys[1] must be a C-contiguous buffer; this memoryview is not"
    released = memoryview(data)
    released.release()
    with pytest.raises(ValueError, match="released memoryview"):
        _native.key_digest(released)


# --- the build: CMake names libb2's packages when libb2 is missing ---------------------------

_CMAKE = shutil.which("cmake")
_REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def _configure(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """CMake's configure of the repository in a fresh build folder, gds off."""
    pybind11 = pytest.importorskip("pybind11", reason="pybind11 (a build requirement) is not installed")
    build = tempfile.mkdtemp(prefix="pykvtier-cmake-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else tmp_path)
    try:
        return subprocess.run([_CMAKE, "-S", _REPO, "-B", build, f"-DPython_EXECUTABLE={sys.executable}",
                               "-DPYKVTIER_GDS=OFF", f"-Dpybind11_DIR={pybind11.get_cmake_dir()}", *args],
                              capture_output=True, text=True, cwd=tmp_path, timeout=300)
    finally:
        shutil.rmtree(build, ignore_errors=True)


def _error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode != 0, proc.stdout[-3000:]
    return " ".join(proc.stderr.split())


@pytest.mark.skipif(_CMAKE is None, reason="cmake is not installed")
def test_configure_reports_libb2(tmp_path):
    proc = _configure(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"pykvtier: linking libb2 (statically|dynamically): /\S*libb2\.(a|so)", proc.stdout)


@pytest.mark.skipif(_CMAKE is None, reason="cmake is not installed")
def test_missing_libb2_header_names_its_packages(tmp_path):
    empty = tmp_path / "include"
    empty.mkdir()
    err = _error(_configure(tmp_path, f"-DB2_INCLUDE_DIR={empty}"))
    assert "libb2's header blake2.h (BLAKE2, for the key digest) not found" in err
    assert "apt-get install libb2-dev" in err and "dnf install libb2-devel" in err


@pytest.mark.skipif(_CMAKE is None, reason="cmake is not installed")
def test_missing_libb2_library_names_its_packages(tmp_path):
    # CMake's find_library ignores every folder holding a libb2 library (and what links there).
    found = [p for d in ("/usr/local/lib", "/usr/local/lib64", "/usr/lib", "/usr/lib64", "/lib", "/lib64")
             for p in glob.glob(f"{d}/libb2.*") + glob.glob(f"{d}/*/libb2.*")]
    dirs = sorted({os.path.dirname(p) for p in found} | {os.path.dirname(os.path.realpath(p)) for p in found})
    if not dirs:
        pytest.skip("no libb2 library in the standard library folders to hide")
    err = _error(_configure(tmp_path, f"-DCMAKE_IGNORE_PATH={';'.join(dirs)}"))
    assert "libb2's library (libb2.a or libb2.so, BLAKE2 for the key digest) not found" in err
    assert "apt-get install libb2-dev" in err and "dnf install libb2-devel" in err
