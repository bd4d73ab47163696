"""The key digest in C++ (libb2): _native.key_digest / key_digests and layout.key_digest equal
hashlib's BLAKE2b-128 for every key, for each accepted key type, and refuse other types by name."""

from __future__ import annotations

import array
import hashlib
import random

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
