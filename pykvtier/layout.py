"""On-disk layout of a pykvtier root: block file names, header format, temporaries, quarantine.

::

    ROOT/blocks/ab/ab12…ef.kvb          one block: 4096-byte header + payload
    ROOT/blocks/ab/ab12…ef.kvb.tmp.PID.N  a block being written (renamed into place when whole)
    ROOT/quarantine/ab12…ef.kvb.TIME    blocks that failed verification, kept for inspection

File names are the hex BLAKE2b-128 digest of the key (never raw key bytes), fanned out over
256 directories by the digest's first byte. The header layout is defined in
``csrc/block_format.hpp``; :func:`read_header` parses it for tools and tests.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import struct
from dataclasses import dataclass

from . import _native

__all__ = [
    "BLOCK_SUFFIX",
    "HEADER_BYTES",
    "BlockHeader",
    "Layout",
    "key_digest",
    "read_header",
]

HEADER_BYTES: int = _native.HEADER_BYTES
BLOCK_SUFFIX = ".kvb"
TMP_MARK = ".tmp."
# magic, version, header_bytes, payload_bytes, key digest, payload xxh3, header xxh3
_HEADER = struct.Struct("<8sIIQ16sQQ")
# Temporaries are named by pid and this process-wide sequence: two Layouts of one root in one
# process (two tiers sharing a directory) must never pick the same name.
_tmp_seq = itertools.count(1)


def key_digest(key: bytes) -> bytes:
    """The 16-byte BLAKE2b digest that names ``key``'s block file and is stored in its header."""
    return hashlib.blake2b(key, digest_size=16).digest()


@dataclass(frozen=True)
class BlockHeader:
    magic: bytes
    version: int
    header_bytes: int
    payload_bytes: int
    key_digest: bytes
    payload_xxh3: int
    header_xxh3: int

    def header_ok(self) -> bool:
        """Magic, version and the header's own checksum are right."""
        packed = _HEADER.pack(
            self.magic, self.version, self.header_bytes, self.payload_bytes,
            self.key_digest, self.payload_xxh3, 0,
        )
        return (
            self.magic == _native.MAGIC
            and self.version == _native.FORMAT_VERSION
            and self.header_bytes == HEADER_BYTES
            and _native.xxh3_64(packed[: _HEADER.size - 8]) == self.header_xxh3
        )


def read_header(path: str | os.PathLike) -> BlockHeader:
    """Parses the header of the block file at ``path``. Raises OSError, or ValueError if short."""
    with open(path, "rb") as f:
        raw = f.read(_HEADER.size)
    if len(raw) < _HEADER.size:
        raise ValueError(f"{os.fspath(path)}: {len(raw)} bytes, shorter than a block header")
    return BlockHeader(*_HEADER.unpack(raw))


class Layout:
    """Paths of one root directory. Creates ``blocks/00..ff`` and ``quarantine/`` on init."""

    def __init__(self, root_dir: str | os.PathLike) -> None:
        """Raises ValueError naming the root when it is not a directory or its directories
        cannot be created (e.g. a read-only file system, no permission)."""
        self.root = os.path.abspath(os.fspath(root_dir))
        self.blocks_dir = os.path.join(self.root, "blocks")
        self.quarantine_dir = os.path.join(self.root, "quarantine")
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise ValueError(f"root {self.root} is not a directory")
        try:
            os.makedirs(self.quarantine_dir, exist_ok=True)
            for i in range(256):
                os.makedirs(os.path.join(self.blocks_dir, f"{i:02x}"), exist_ok=True)
        except OSError as exc:
            raise ValueError(f"root {self.root}: cannot create the tier's directories "
                             f"({exc.filename}: {exc.strerror})") from exc
        self._pid = os.getpid()

    def block_path(self, digest: bytes) -> str:
        h = digest.hex()
        return f"{self.blocks_dir}/{h[:2]}/{h}{BLOCK_SUFFIX}"

    def tmp_path(self, digest: bytes) -> str:
        """A fresh temporary name beside the block's final name (same directory: atomic rename)."""
        return f"{self.block_path(digest)}{TMP_MARK}{self._pid}.{next(_tmp_seq)}"

    def quarantine_path(self, digest: bytes, stamp: int) -> str:
        return os.path.join(self.quarantine_dir, f"{digest.hex()}{BLOCK_SUFFIX}.{stamp}")

    @staticmethod
    def digest_from_name(name: str) -> bytes | None:
        """The digest a final block file name stands for, or None if it is not one."""
        if not name.endswith(BLOCK_SUFFIX) or len(name) != 32 + len(BLOCK_SUFFIX):
            return None
        try:
            return bytes.fromhex(name[:32])
        except ValueError:
            return None

    @staticmethod
    def tmp_owner(name: str) -> int | None:
        """The PID that wrote a temporary, or None if ``name`` is not a temporary."""
        i = name.find(BLOCK_SUFFIX + TMP_MARK)
        if i < 0:
            return None
        try:
            return int(name[i + len(BLOCK_SUFFIX) + len(TMP_MARK):].split(".")[0])
        except ValueError:
            return -1
