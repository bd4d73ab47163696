"""KV-cache request traces (Mooncake format).

A trace is JSON Lines, one request per line::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2]}

``hash_ids`` holds one id per :data:`TRACE_BLOCK_TOKENS`-token prefix block of the prompt;
equal ids mean reusable prefix KV. The Mooncake FAST'25 "Conversation" trace is bundled
(``pykvtier/data/``, Apache-2.0, see the README there) and is the default.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from dataclasses import dataclass
from importlib import resources
from typing import IO, Iterator

__all__ = [
    "TRACE_BLOCK_TOKENS",
    "BUNDLED_TRACE_NAME",
    "Request",
    "TraceFormatError",
    "bundled_trace",
    "iter_trace",
    "load_trace",
]

#: Tokens per trace block: each ``hash_ids`` entry names one block of this many tokens.
TRACE_BLOCK_TOKENS = 512

#: File name of the bundled trace inside ``pykvtier/data/``.
BUNDLED_TRACE_NAME = "mooncake_conversation_trace.jsonl.gz"

_GZIP_MAGIC = b"\x1f\x8b"


class TraceFormatError(ValueError):
    """A trace line is malformed; the message names the file and the 1-based line number."""

    def __init__(self, source: str, lineno: int, reason: str) -> None:
        super().__init__(f"{source}:{lineno}: {reason}")
        self.source = source
        self.lineno = lineno
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a trace."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        """Number of trace blocks (of :data:`TRACE_BLOCK_TOKENS` tokens) in the prompt."""
        return len(self.hash_ids)


def bundled_trace():
    """The bundled Mooncake conversation trace, as an ``importlib.resources`` Traversable."""
    return resources.files("pykvtier") / "data" / BUNDLED_TRACE_NAME


def _open_text(raw: IO[bytes]) -> IO[str]:
    """Wrap a binary stream, gunzipping it if it starts with the gzip magic."""
    buffered = raw if isinstance(raw, io.BufferedReader) else io.BufferedReader(raw)  # type: ignore[arg-type]
    if buffered.peek(2)[:2] == _GZIP_MAGIC:
        return io.TextIOWrapper(gzip.GzipFile(fileobj=buffered, mode="rb"), encoding="utf-8")
    return io.TextIOWrapper(buffered, encoding="utf-8")


def _int_field(obj: dict, name: str, source: str, lineno: int) -> int:
    if name not in obj:
        raise TraceFormatError(source, lineno, f"missing field {name!r}")
    value = obj[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceFormatError(source, lineno, f"field {name!r} must be an integer, got {value!r}")
    if value < 0:
        raise TraceFormatError(source, lineno, f"field {name!r} must be >= 0, got {value}")
    return value


def _parse_line(line: str, source: str, lineno: int) -> Request:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(source, lineno, f"invalid JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise TraceFormatError(source, lineno, f"expected a JSON object, got {type(obj).__name__}")
    timestamp = obj.get("timestamp")
    # Timestamps are integral milliseconds in the Mooncake release; accept integral floats too.
    if isinstance(timestamp, float) and timestamp.is_integer():
        obj["timestamp"] = int(timestamp)
    ts = _int_field(obj, "timestamp", source, lineno)
    input_length = _int_field(obj, "input_length", source, lineno)
    output_length = _int_field(obj, "output_length", source, lineno)
    if "hash_ids" not in obj:
        raise TraceFormatError(source, lineno, "missing field 'hash_ids'")
    raw_ids = obj["hash_ids"]
    if not isinstance(raw_ids, list):
        raise TraceFormatError(source, lineno, f"field 'hash_ids' must be a list, got {type(raw_ids).__name__}")
    for i, h in enumerate(raw_ids):
        if isinstance(h, bool) or not isinstance(h, int) or h < 0:
            raise TraceFormatError(
                source, lineno, f"hash_ids[{i}] must be a non-negative integer, got {h!r}"
            )
        if h >= 1 << 64:
            raise TraceFormatError(source, lineno, f"hash_ids[{i}] does not fit in 64 bits: {h}")
    return Request(ts, input_length, output_length, tuple(raw_ids))


def iter_trace(path: str | os.PathLike[str] | None = None) -> Iterator[Request]:
    """Yield the requests of a trace file (``.jsonl`` or gzip-compressed), in file order.

    ``path=None`` reads the bundled Mooncake conversation trace. Blank lines are skipped;
    a malformed line raises :class:`TraceFormatError` naming the file and line number.
    """
    if path is None:
        source = f"<bundled {BUNDLED_TRACE_NAME}>"
        raw = bundled_trace().open("rb")
    else:
        source = os.fspath(path)
        try:
            raw = open(source, "rb")
        except OSError as exc:
            raise FileNotFoundError(f"cannot open trace {source!r}: {exc.strerror or exc}") from exc
    with raw, _open_text(raw) as text:
        lineno = 0
        try:
            for lineno, line in enumerate(text, start=1):
                if not line.strip():
                    continue
                yield _parse_line(line, source, lineno)
        except (UnicodeDecodeError, EOFError, OSError) as exc:  # bad encoding, truncated/corrupt gzip
            raise TraceFormatError(source, lineno + 1, f"cannot read: {exc}") from exc


def load_trace(
    path: str | os.PathLike[str] | None = None, max_requests: int | None = None
) -> list[Request]:
    """Read a trace into a list: the first ``max_requests`` requests (all if ``None``).

    ``path=None`` reads the bundled Mooncake conversation trace (see ``pykvtier/data/README.md``).
    """
    if max_requests is not None:
        if isinstance(max_requests, bool) or not isinstance(max_requests, int) or max_requests < 1:
            raise ValueError(f"max_requests must be a positive integer or None, got {max_requests!r}")
    out: list[Request] = []
    if max_requests is None:
        return list(iter_trace(path))
    for req in iter_trace(path):
        out.append(req)
        if len(out) >= max_requests:
            break
    return out
