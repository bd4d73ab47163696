"""Trace parsing (pykvtier.trace), model presets (pykvtier.models), size parsing and block bytes."""

from __future__ import annotations

import gzip
import json
from importlib import resources

import numpy as np
import pytest

from pykvtier import models
from pykvtier.trace import (
    TRACE_BLOCK_TOKENS,
    Request,
    TraceFormatError,
    bundled_trace,
    iter_trace,
    load_trace,
)

LINES = [
    {"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [0, 1]},
    {"timestamp": 5, "input_length": 600, "output_length": 3, "hash_ids": [0, 2]},
    {"timestamp": 9, "input_length": 100, "output_length": 0, "hash_ids": [7]},
]


def _write(path, lines, compress=False):
    text = "".join(json.dumps(x) + "\n" for x in lines)
    if compress:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return str(path)


# --- trace -----------------------------------------------------------------------------


def test_trace_block_tokens():
    assert TRACE_BLOCK_TOKENS == 512


@pytest.mark.parametrize("compress,name", [(False, "t.jsonl"), (True, "t.jsonl.gz"), (True, "gz-without-suffix.jsonl")])
def test_load_plain_and_gzip(tmp_path, compress, name):
    path = _write(tmp_path / name, LINES, compress)
    reqs = load_trace(path)
    assert reqs == [
        Request(0, 1000, 10, (0, 1)),
        Request(5, 600, 3, (0, 2)),
        Request(9, 100, 0, (7,)),
    ]
    assert isinstance(reqs[0].hash_ids, tuple)
    assert reqs[0].num_blocks == 2


def test_max_requests_and_blank_lines(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text("\n" + json.dumps(LINES[0]) + "\n\n" + json.dumps(LINES[1]) + "\n" + json.dumps(LINES[2]))
    assert len(load_trace(str(p))) == 3  # no trailing newline is fine too
    assert [r.timestamp_ms for r in load_trace(str(p), max_requests=2)] == [0, 5]
    assert len(load_trace(str(p), max_requests=10)) == 3
    with pytest.raises(ValueError):
        load_trace(str(p), max_requests=0)


@pytest.mark.parametrize(
    "bad,needle",
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1}', "missing field 'hash_ids'"),
        ('{"input_length": 5, "output_length": 1, "hash_ids": []}', "missing field 'timestamp'"),
        ('{"timestamp": 0, "input_length": "5", "output_length": 1, "hash_ids": []}', "'input_length' must be an integer"),
        ('{"timestamp": 0, "input_length": -1, "output_length": 1, "hash_ids": []}', "'input_length' must be >= 0"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": 3}', "'hash_ids' must be a list"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, -2]}', "hash_ids[1]"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [true]}', "hash_ids[0]"),
        ('{"timestamp": 0.5, "input_length": 5, "output_length": 1, "hash_ids": []}', "'timestamp' must be an integer"),
    ],
)
@pytest.mark.parametrize("compress", [False, True])
def test_malformed_line_names_file_and_line(tmp_path, bad, needle, compress):
    path = tmp_path / ("bad.jsonl.gz" if compress else "bad.jsonl")
    text = json.dumps(LINES[0]) + "\n\n" + bad + "\n" + json.dumps(LINES[1]) + "\n"
    if compress:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    with pytest.raises(TraceFormatError) as ei:
        load_trace(str(path))
    err = ei.value
    assert err.lineno == 3
    assert err.source == str(path)
    assert str(err).startswith(f"{path}:3: ")
    assert needle in str(err)
    # the lines before the bad one are still readable
    assert load_trace(str(path), max_requests=1) == [Request(0, 1000, 10, (0, 1))]


def test_integral_float_timestamp_accepted(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 3.0, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n')
    assert load_trace(str(p)) == [Request(3, 1, 1, (1,))]


def test_truncated_gzip_is_a_trace_error(tmp_path):
    good = _write(tmp_path / "g.jsonl.gz", LINES * 200, compress=True)
    data = open(good, "rb").read()
    bad = tmp_path / "trunc.jsonl.gz"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceFormatError, match="trunc.jsonl.gz"):
        load_trace(str(bad))


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_trace(str(tmp_path / "nope.jsonl"))


def test_bundled_trace_is_the_mooncake_conversation_trace():
    data_dir = resources.files("pykvtier") / "data"
    assert not (data_dir / "__init__.py").is_file()  # plain data folder, not a package
    assert (data_dir / "README.md").is_file()
    readme = (data_dir / "README.md").read_text(encoding="utf-8")
    assert "kvcache-ai/Mooncake" in readme and "Apache License 2.0" in readme
    assert "FAST25-release/traces/" in readme
    lic = (data_dir / "LICENSE-mooncake-trace.txt").read_text(encoding="utf-8")
    assert "Apache-2.0" in lic and "Apache License, Version 2.0" in lic
    assert bundled_trace().is_file()

    first = load_trace(None, max_requests=2)
    assert first[0] == Request(0, 6758, 500, tuple(range(14)))
    assert first[1].hash_ids == (0,) + tuple(range(14, 28))

    reqs = list(iter_trace())  # the whole trace: numbers from its README
    assert len(reqs) == 12031
    assert sum(r.num_blocks for r in reqs) == 288500
    assert len({h for r in reqs for h in r.hash_ids}) == 182790
    assert all(r.num_blocks == -(-r.input_length // TRACE_BLOCK_TOKENS) for r in reqs)
    assert reqs[-1].timestamp_ms == 3536999


# --- models ----------------------------------------------------------------------------


def test_preset_kv_bytes_per_token_exact():
    assert models.get_preset("llama-3-8b").kv_bytes_per_token == 32 * 8 * 128 * 2 * 2 == 131072
    assert models.get_preset("qwen2.5-7b").kv_bytes_per_token == 28 * 4 * 128 * 2 * 2 == 57344
    assert models.get_preset("llama-3-70b").kv_bytes_per_token == 80 * 8 * 128 * 2 * 2 == 327680
    assert models.get_preset("tiny").kv_bytes_per_token == 256
    for p in models.PRESETS.values():
        assert p.dtype_bytes == 2  # bf16


def test_block_size_bytes_exact():
    assert models.block_size_bytes("llama-3-8b", 16) == 2 * 1024 * 1024  # docs/design.md's example
    assert models.block_size_bytes("qwen2.5-7b", 32) == 1835008  # 1.75 MiB
    assert models.block_size_bytes("llama-3-70b", 512) == 327680 * 512
    assert models.block_size_bytes(models.get_preset("tiny"), 64) == 16384
    assert models.get_preset("QWEN2.5-7B").name == "qwen2.5-7b"
    assert models.sub_blocks_per_trace_block(32) == 16
    assert models.sub_blocks_per_trace_block(512) == 1
    assert models.sub_blocks_per_trace_block(1) == 512


@pytest.mark.parametrize("tpb", [0, -16, 3, 48, 1024, 513, 16.0, True])
def test_tokens_per_block_must_divide_512(tpb):
    with pytest.raises(ValueError, match="tokens_per_block"):
        models.block_size_bytes("llama-3-8b", tpb)


def test_unknown_preset_lists_known_ones():
    with pytest.raises(models.UnknownModelError) as ei:
        models.get_preset("gpt-5")
    msg = str(ei.value)
    assert "gpt-5" in msg
    for name in ("llama-3-8b", "qwen2.5-7b", "llama-3-70b", "tiny"):
        assert name in msg
    assert isinstance(ei.value, ValueError)


# --- sizes, keys, block bytes ------------------------------------------------------------


def test_parse_size():
    from pykvtier.replay import parse_size

    assert parse_size("8GiB") == parse_size("8G") == parse_size("8g") == 8 << 30
    assert parse_size("8GB") == 8 * 10**9
    assert parse_size("1.5GiB") == 3 << 29
    assert parse_size("512M") == parse_size("512 MiB") == 512 << 20
    assert parse_size("4096") == parse_size("4096B") == 4096
    assert parse_size("2k") == 2048 and parse_size("1T") == 1 << 40
    assert parse_size(123) == 123
    for bad in ("", "abc", "8 XB", "-1G", "1.5"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_block_keys_and_pattern():
    from pykvtier.replay import BlockPattern, block_key

    bs = models.block_size_bytes("tiny", 64)
    k = block_key(7, 3, bs)
    assert k == block_key(7, 3, bs) and len(k) == 20
    assert len({block_key(h, s, bs) for h in range(50) for s in range(8)}) == 400
    assert block_key(7, 3, bs) != block_key(7, 3, bs * 2)  # block size is part of the key

    pat = BlockPattern(bs)
    a = pat.block_bytes(k)
    assert len(a) == bs and a == BlockPattern(bs).block_bytes(k)  # deterministic across instances
    pages = [a[i : i + 4096] for i in range(0, bs, 4096)]
    assert len(set(pages)) == len(pages)  # every 4 KiB page differs by page index
    b = pat.block_bytes(block_key(7, 4, bs))
    assert all(pa != pb for pa, pb in zip(pages, (b[i : i + 4096] for i in range(0, bs, 4096))))

    buf = np.frombuffer(bytearray(a), dtype=np.uint64).copy()
    assert pat.matches(buf, k)
    buf.view(np.uint8)[bs - 1] ^= 1  # one flipped bit anywhere is caught
    assert not pat.matches(buf, k)
    assert not pat.matches(np.frombuffer(b, dtype=np.uint64), k)

    odd = BlockPattern(256 + 4096)  # not a multiple of a page: the tail is filled too
    out = np.zeros((256 + 4096) // 8, dtype=np.uint64)
    odd.fill(out, k)
    assert odd.matches(out, k) and out[-1] != 0
