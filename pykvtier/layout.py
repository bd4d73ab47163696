"""On-disk layout of a pykvtier root: block file names, header format, temporaries, quarantine,
the root's marker and lock.

::

    ROOT/pykvtier-root.json                {"format": 1, "block_size_bytes": N}, written once
    ROOT/.pykvtier.lock                    flock'ed by every tier open on the root (never removed)
    ROOT/blocks/ab/ab12…ef.kvb             one block: 4096-byte header + payload
    ROOT/blocks/ab/ab12…ef.kvb.tmp.PID.N   a block being written (renamed into place when whole)
    ROOT/quarantine/ab12…ef.kvb.TIME       entries that failed verification, kept for inspection

File names are the hex BLAKE2b-128 digest of the key (never raw key bytes), fanned out over
256 directories by the digest's first byte. The header layout is defined once, in
``csrc/include/pykvtier/block_format.hpp``; :func:`read_header` parses it (through
``_native.parse_header``) for tools and tests.

Nothing here follows a symbolic link below the root: the root is canonicalized with
``os.path.realpath``, directories are opened component by component with ``O_NOFOLLOW``, and
entries are listed, renamed and removed relative to those descriptors. An entry where a
directory belongs that is not a real directory (a link, a file) is moved into the quarantine
(the entry itself, never what a link points at) and the directory is created.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import shutil
import stat
import threading
import time
import weakref
from dataclasses import dataclass

from . import _native

__all__ = [
    "BLOCK_SUFFIX",
    "HEADER_BYTES",
    "LOCK_NAME",
    "QUARANTINE_MAX_FILES",
    "ROOT_MARKER",
    "BlockHeader",
    "Layout",
    "Quarantine",
    "RootLock",
    "RootLockedError",
    "check_file_mode",
    "dir_mode_of",
    "empty_quarantine",
    "key_digest",
    "lock_root",
    "quarantine_usage",
    "read_header",
    "read_root_config",
]

logger = logging.getLogger("pykvtier")

HEADER_BYTES: int = _native.HEADER_BYTES
BLOCK_SUFFIX = ".kvb"
TMP_MARK = ".tmp."
_OCTAL_MODE = re.compile(r"(?:0[oO])?0*([0-7]{1,4})")  # check_file_mode's string spelling
_BLOCK_NAME = re.compile(r"[0-9a-f]{32}\.kvb")  # a block file's name (Layout.block_path)
_PID_MAX = (1 << 22)  # Linux's PID_MAX_LIMIT: a larger number in a temporary's name is no pid
ROOT_MARKER = "pykvtier-root.json"
ROOT_FORMAT = 1
LOCK_NAME = ".pykvtier.lock"
PROBE_MARK = ".pykvtier-direct-probe-"  # the engine's O_DIRECT probe file, in blocks/
QUARANTINE_MAX_FILES = 256
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
HEADER_PARSE_BYTES = 64  # the header's fields, any version: what _native.parse_header needs
# Temporaries are named by pid and the process's one sequence (_native.tmp_sequence, which
# _native.BlockSpace's temporaries draw from too): no two temporary names of the process repeat.
_tmp_seq = _native.tmp_sequence


#: ``key_digest(key) -> bytes``: the 16-byte BLAKE2b digest that names ``key``'s block file and
#: is stored in its header; equals ``hashlib.blake2b(key, digest_size=16).digest()``. ``key``:
#: bytes, bytearray or a C-contiguous memoryview; TypeError for another type. C++ (libb2),
#: thread-safe. ``_native.key_digests(keys)`` gives a list's digests as one bytes object.
key_digest = _native.key_digest


def check_file_mode(mode: object, what: str = "mode") -> int:
    """``mode`` as the permission bits of block files: an int, or a string of octal digits as
    chmod takes them ("640", "0640", "0o640": a config file's spelling), with no bits outside
    0o666 and owner read+write set (0o600, 0o640, 0o660...). TypeError/ValueError naming
    ``what``."""
    given_int = not isinstance(mode, str)
    if isinstance(mode, str):
        m = _OCTAL_MODE.fullmatch(mode)
        if m is None:
            raise ValueError(f"{what} must be file permission bits, an int or a string of octal "
                             f"digits such as \"640\", got {mode!r}")
        mode = int(m.group(1), 8)
    if isinstance(mode, bool) or not isinstance(mode, int):
        raise TypeError(f"{what} must be an int of permission bits (e.g. 0o600), "
                        f"not {type(mode).__name__}")
    if mode < 0 or mode & ~0o666 or mode & 0o600 != 0o600:
        hint = ""
        if given_int and mode > 0o666 and set(str(mode)) <= set("01234567"):
            # 640 in YAML/JSON is the number 640 (0o1200), not octal 640
            hint = f" (the number {mode}; for octal {mode} write the string \"{mode}\")"
        raise ValueError(f"{what} must be file permission bits within 0o666 with owner read and "
                         f"write set (e.g. 0o600, 0o640, 0o660), got {oct(mode)}{hint}")
    return mode


def dir_mode_of(file_mode: int) -> int:
    """The directory mode matching a file mode: x wherever r is set (0o600 -> 0o700,
    0o640 -> 0o750, 0o660 -> 0o770)."""
    return file_mode | ((file_mode & 0o444) >> 2)


@dataclass(frozen=True)
class BlockHeader:
    """A block file's header as ``_native.parse_header`` reads it (the format is defined once,
    in ``csrc/include/pykvtier/block_format.hpp``): any version in ``_native.FORMAT_VERSIONS``.
    ``payload_checksum`` is False for a block stored with ``verify="header"``."""

    magic: bytes
    version: int
    header_bytes: int
    payload_bytes: int
    key_digest: bytes
    payload_xxh3: int
    flags: int
    payload_checksum: bool
    ok: bool

    @classmethod
    def parse(cls, raw: bytes) -> BlockHeader:
        """The header at the start of ``raw`` (``HEADER_PARSE_BYTES`` suffice). Never raises:
        ``ok`` is False for a short or damaged header."""
        h = _native.parse_header(raw)
        return cls(bytes(raw[:8]), h["version"], h["header_bytes"], h["payload_bytes"],
                   bytes(h["key_digest"]), h["payload_xxh3"], h["flags"],
                   h["payload_checksum"], h["header_ok"])

    def header_ok(self) -> bool:
        """Magic, a known version and flags, the header size and its own checksum are right."""
        return self.ok


def read_header(path: str | os.PathLike) -> BlockHeader:
    """Parses the header of the block file at ``path``. Raises OSError, or ValueError if the file
    is shorter than a header's fields."""
    with open(path, "rb") as f:
        raw = f.read(HEADER_PARSE_BYTES)
    if len(raw) < HEADER_PARSE_BYTES:
        raise ValueError(f"{os.fspath(path)}: {len(raw)} bytes, shorter than a block header")
    return BlockHeader.parse(raw)


def _canonical_root(root_dir: str | os.PathLike) -> str:
    p = os.fspath(root_dir)
    if isinstance(p, bytes):
        p = os.fsdecode(p)
    if not p:
        raise ValueError("root_dir must not be empty (it would mean the current directory)")
    if "\0" in p:
        raise ValueError(f"root_dir {p!r} contains a NUL byte (no path can)")
    # "~" and "~user" as a shell would expand them (a root from a JSON config never met a shell)
    return os.path.realpath(os.path.expanduser(p))


def _open_dir(path: str, *names: str) -> int:
    """A descriptor of the directory ``path/names[0]/names[1]/...``, each component opened with
    O_NOFOLLOW relative to the one before (``path`` itself is canonical). OSError: ELOOP or
    ENOTDIR where a component is not a real directory, ENOENT where it is missing."""
    fd = os.open(path, _DIR_FLAGS)
    for name in names:
        try:
            nfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
        finally:
            os.close(fd)
        fd = nfd
    return fd


def _stamp_of(name: str) -> int | None:
    """The ns time stamp a quarantine entry's name ends with (``NAME.TIME``), or None."""
    tail = name.rpartition(".")[2]
    return int(tail) if tail.isdigit() else None


def _entry_bytes(dir_fd: int, name: str, st: os.stat_result) -> int:
    """Bytes of the regular files in a quarantine entry (itself, or below it for a directory)."""
    if stat.S_ISREG(st.st_mode):
        return st.st_size
    if not stat.S_ISDIR(st.st_mode):
        return 0
    total = 0
    try:
        for _, _, files, fd in os.fwalk(name, dir_fd=dir_fd, follow_symlinks=False):
            for f in files:
                try:
                    s = os.stat(f, dir_fd=fd, follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(s.st_mode):
                    total += s.st_size
    except OSError:
        pass
    return total


def _remove_entry(dir_fd: int, name: str, background: bool = False) -> None:
    """Removes a quarantine entry: a file or link is unlinked, a real directory removed with
    its contents (shutil.rmtree, descriptor-based: it follows no link); with ``background`` by
    a thread of its own, so that the caller (the scheduler's thread) does not wait on a large
    tree."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode) and not background:
        shutil.rmtree(name, dir_fd=dir_fd)
    elif stat.S_ISDIR(st.st_mode):
        fd = os.dup(dir_fd)

        def remove() -> None:
            try:
                shutil.rmtree(name, dir_fd=fd)
            except OSError as exc:
                logger.warning("pykvtier: cannot remove old quarantine entry %s: %s", name, exc)
            finally:
                os.close(fd)

        threading.Thread(target=remove, name="pykvtier-quarantine-trim", daemon=True).start()
    else:
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass


class Layout:
    """Paths of one root directory. Creates the root and (``make_dirs``) ``blocks/00..ff`` and
    ``quarantine/`` with mode ``dir_mode``, following no link (see the module doc)."""

    def __init__(self, root_dir: str | os.PathLike, dir_mode: int = 0o700, *,
                 make_dirs: bool = True) -> None:
        """``root_dir`` is canonicalized (``os.path.realpath``) into ``self.root``.
        Raises ValueError naming the root when it is empty, not a directory, or it or its
        directories cannot be created (e.g. a read-only file system, no permission)."""
        self.root = _canonical_root(root_dir)
        self.dir_mode = dir_mode
        self.blocks_dir = os.path.join(self.root, "blocks")
        self.quarantine_dir = os.path.join(self.root, "quarantine")
        self.marker_path = os.path.join(self.root, ROOT_MARKER)
        self.lock_path = os.path.join(self.root, LOCK_NAME)
        self.moved_aside: list[str] = []  # quarantine names of entries moved for make_dirs()
        if os.path.lexists(self.root) and not os.path.isdir(self.root):
            raise ValueError(f"root {self.root} is not a directory")
        try:
            if not os.path.isdir(self.root):
                os.makedirs(self.root, mode=dir_mode, exist_ok=True)
                fd = os.open(self.root, _DIR_FLAGS)
                try:
                    os.fchmod(fd, dir_mode)
                finally:
                    os.close(fd)
        except OSError as exc:
            raise ValueError(f"root {self.root}: cannot create the tier's directories "
                             f"({exc.filename or self.root}: {exc.strerror})") from exc
        self._pid = os.getpid()
        if make_dirs:
            self.make_dirs()

    # ------------------------------------------------------------------ directories

    def make_dirs(self) -> None:
        """Creates ``quarantine/``, ``blocks/`` and ``blocks/00..ff`` where missing (mode
        ``dir_mode``); an entry at one of those names that is not a real directory is moved
        into the quarantine and replaced by a directory. Removes leftover O_DIRECT probe files
        of dead processes from ``blocks/``. ValueError naming the root on failure."""
        try:
            rfd = _open_dir(self.root)
            try:
                qfd = self._real_dir(rfd, "quarantine", None, "quarantine")
                try:
                    bfd = self._real_dir(rfd, "blocks", qfd, "blocks")
                    try:
                        for i in range(256):
                            os.close(self._real_dir(bfd, f"{i:02x}", qfd, f"blocks-{i:02x}"))
                        self._sweep_probe_files(bfd)
                    finally:
                        os.close(bfd)
                finally:
                    os.close(qfd)
            finally:
                os.close(rfd)
        except OSError as exc:
            raise ValueError(f"root {self.root}: cannot create the tier's directories "
                             f"({exc.filename or self.root}: {exc.strerror})") from exc

    def _real_dir(self, parent_fd: int, name: str, qfd: int | None, label: str) -> int:
        """A descriptor of the real directory ``name`` in ``parent_fd``, created if missing;
        what stands there instead is moved into the quarantine (``qfd``; None: ``name`` is the
        quarantine itself, moved aside through the root first)."""
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            stamp = time.time_ns()
            qname = f"{label}.{stamp}"
            if qfd is None:  # the quarantine: aside in the root, then into the new quarantine
                aside = f".{label}.bad.{stamp}"
                os.rename(name, aside, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
                fd = self._mkdir(parent_fd, name)
                os.rename(aside, qname, src_dir_fd=parent_fd, dst_dir_fd=fd)
                self._aside(name, qname)
                return fd
            os.rename(name, qname, src_dir_fd=parent_fd, dst_dir_fd=qfd)
            self._aside(name, qname)
        return self._mkdir(parent_fd, name)

    def _aside(self, name: str, qname: str) -> None:
        self.moved_aside.append(qname)
        logger.warning("pykvtier: %s: %r was not a real directory (a link or a file); moved to "
                       "%s and replaced by a directory", self.root, name,
                       os.path.join(self.quarantine_dir, qname))

    def _mkdir(self, parent_fd: int, name: str) -> int:
        try:
            os.mkdir(name, self.dir_mode, dir_fd=parent_fd)
            created = True
        except FileExistsError:  # made meanwhile by another process
            created = False
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        if created:
            os.fchmod(fd, self.dir_mode)  # exactly dir_mode, whatever the umask
        return fd

    def _sweep_probe_files(self, bfd: int) -> None:
        for name in os.listdir(bfd):
            if not name.startswith(PROBE_MARK):
                continue
            digits = name[len(PROBE_MARK):].split(".")[0].split("-")[0]
            owner = int(digits) if digits.isdigit() else -1
            if owner > 0 and owner != self._pid and _alive(owner):
                continue  # a live process's probe, removed by that process
            try:
                os.unlink(name, dir_fd=bfd)
                logger.info("pykvtier: removed a leftover O_DIRECT probe file %s/%s",
                            self.blocks_dir, name)
            except FileNotFoundError:
                pass
            except OSError as exc:
                logger.warning("pykvtier: cannot remove leftover probe file %s/%s: %s",
                               self.blocks_dir, name, exc.strerror)

    @staticmethod
    def open_subdir(parent_fd: int, name: str) -> int:
        """A descriptor (the caller closes it) of the real directory ``name`` in ``parent_fd``.
        OSError ELOOP/ENOTDIR when it is a link or not a directory."""
        return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)

    def open_dir(self, *names: str) -> int:
        """A descriptor (the caller closes it) of ``ROOT/names...``, following no link.
        OSError ELOOP/ENOTDIR where a component is not a real directory."""
        return _open_dir(self.root, *names)

    # ------------------------------------------------------------------ block size marker

    def check_block_size(self, block_size_bytes: int, file_mode: int = 0o600) -> None:
        """Refuses a root that holds blocks of another size, and records this size in
        ``ROOT/pykvtier-root.json`` when the root has no marker yet. Without a marker the first
        valid block header's payload length decides. ValueError naming the root and both sizes
        (or the marker, when it is malformed). A marker that cannot be written (full disk,
        read-only) is logged, not fatal."""
        cfg = read_root_config(self.root)
        if cfg is None:
            found = self._first_block_size()
            if found is not None and found[0] != block_size_bytes:
                raise self._size_error(found[0], block_size_bytes, f"block file {found[1]}")
            cfg = self._write_marker(block_size_bytes, file_mode)
            if cfg is None:
                return
        if cfg["block_size_bytes"] != block_size_bytes:
            raise self._size_error(cfg["block_size_bytes"], block_size_bytes, self.marker_path)

    def _size_error(self, theirs: int, ours: int, where: str) -> ValueError:
        return ValueError(
            f"root {self.root} holds blocks of block_size_bytes={theirs} (from {where}); this "
            f"tier has block_size_bytes={ours}: give each block size its own root_dir")

    def _first_block_size(self) -> tuple[int, str] | None:
        """(payload bytes, path) of the first block file with a valid header, or None."""
        try:
            bfd = self.open_dir("blocks")
        except FileNotFoundError:
            return None
        try:
            for i in range(256):
                sub = f"{i:02x}"
                try:
                    dfd = os.open(sub, _DIR_FLAGS, dir_fd=bfd)
                except OSError:
                    continue
                try:
                    with os.scandir(dfd) as it:
                        for de in it:
                            if (Layout.digest_from_name(de.name) is None
                                    or not de.is_file(follow_symlinks=False)):
                                continue
                            try:
                                ffd = os.open(de.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                                              dir_fd=dfd)
                            except OSError:
                                continue
                            try:
                                raw = os.pread(ffd, HEADER_PARSE_BYTES, 0)
                            except OSError:
                                continue
                            finally:
                                os.close(ffd)
                            h = BlockHeader.parse(raw)
                            if h.ok:
                                return h.payload_bytes, os.path.join(self.blocks_dir, sub, de.name)
                finally:
                    os.close(dfd)
        finally:
            os.close(bfd)
        return None

    def _write_marker(self, block_size_bytes: int, file_mode: int) -> dict | None:
        """Writes the marker once (temporary, then a hard link: an existing marker is never
        replaced) and returns the marker then in place; None when it cannot be written."""
        text = json.dumps({"format": ROOT_FORMAT, "block_size_bytes": block_size_bytes}) + "\n"
        tmp = f".{ROOT_MARKER}{TMP_MARK}{self._pid}.{_tmp_seq()}"
        try:
            rfd = _open_dir(self.root)
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | os.O_CLOEXEC, file_mode, dir_fd=rfd)
                try:
                    os.fchmod(fd, file_mode)
                    os.write(fd, text.encode())
                    os.fsync(fd)
                finally:
                    os.close(fd)
                try:
                    try:
                        os.link(tmp, ROOT_MARKER, src_dir_fd=rfd, dst_dir_fd=rfd,
                                follow_symlinks=False)
                    except FileExistsError:
                        pass  # another process wrote it first: its marker decides
                    except OSError as exc:
                        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS):
                            raise
                        # no hard links on this file system: rename, unless one appeared
                        if not os.path.lexists(self.marker_path):
                            os.rename(tmp, ROOT_MARKER, src_dir_fd=rfd, dst_dir_fd=rfd)
                finally:
                    try:
                        os.unlink(tmp, dir_fd=rfd)
                    except FileNotFoundError:
                        pass
            finally:
                os.close(rfd)
        except OSError as exc:
            logger.warning("pykvtier: cannot write the root marker %s (%s); the root's block "
                           "size is not recorded", self.marker_path, exc.strerror)
            return None
        return read_root_config(self.root)

    # ------------------------------------------------------------------ names

    def block_path(self, digest: bytes) -> str:
        h = digest.hex()
        return f"{self.blocks_dir}/{h[:2]}/{h}{BLOCK_SUFFIX}"

    def tmp_path(self, digest: bytes) -> str:
        """A fresh temporary name beside the block's final name (same directory: atomic rename)."""
        return f"{self.block_path(digest)}{TMP_MARK}{self._pid}.{_tmp_seq()}"

    def quarantine_path(self, digest: bytes, stamp: int) -> str:
        return os.path.join(self.quarantine_dir, f"{digest.hex()}{BLOCK_SUFFIX}.{stamp}")

    @staticmethod
    def digest_from_name(name: str) -> bytes | None:
        """The digest a final block file name stands for, or None if it is not one."""
        if _BLOCK_NAME.fullmatch(name) is None:  # 32 lower-case hex digits, as block_path
            return None
        return bytes.fromhex(name[:32])

    @staticmethod
    def tmp_owner(name: str) -> int | None:
        """The PID that wrote a temporary, or None if ``name`` is not a temporary."""
        i = name.find(BLOCK_SUFFIX + TMP_MARK)
        if i < 0:
            return None
        try:
            pid = int(name[i + len(BLOCK_SUFFIX) + len(TMP_MARK):].split(".")[0])
        except ValueError:
            return -1
        return pid if pid <= _PID_MAX else -1  # (beyond any pid: no process's)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


# ---------------------------------------------------------------------- root marker


def read_root_config(root: str | os.PathLike) -> dict | None:
    """The root's marker ``ROOT/pykvtier-root.json`` as a dict (keys ``format``,
    ``block_size_bytes``), or None when the root has none. ValueError naming the marker when it
    is malformed, of an unknown format, or not a regular file."""
    root = _canonical_root(root)
    path = os.path.join(root, ROOT_MARKER)
    try:
        rfd = _open_dir(root)
    except FileNotFoundError:
        return None
    try:
        fd = os.open(ROOT_MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                     dir_fd=rfd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ValueError(f"root marker {path}: cannot read it ({exc.strerror})") from exc
    finally:
        os.close(rfd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"root marker {path} is not a regular file")
        raw = os.read(fd, 1 << 16)
    finally:
        os.close(fd)
    try:
        cfg = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # (RecursionError: nested too deep)
        raise ValueError(f"root marker {path} is not JSON ({exc})") from None
    fmt = cfg.get("format") if isinstance(cfg, dict) else None
    if isinstance(fmt, bool) or fmt != ROOT_FORMAT:  # (True == 1 in Python)
        raise ValueError(f"root marker {path}: unknown format (expected "
                         f'{{"format": {ROOT_FORMAT}, "block_size_bytes": N}}, got {raw[:200]!r})')
    bs = cfg.get("block_size_bytes")
    if isinstance(bs, bool) or not isinstance(bs, int) or bs <= 0:
        raise ValueError(f"root marker {path}: block_size_bytes must be a positive int, got {bs!r}")
    return cfg


# ---------------------------------------------------------------------- quarantine


class Quarantine:
    """The quarantine folder of one root as one tier sees it: at most ``max_files`` entries
    (oldest, by the time stamp their names end with, removed first), counted in ``files`` and
    ``bytes`` (counted once at construction, then adjusted on each move and removal: entries
    other processes add to a shared root are seen at the next start)."""

    def __init__(self, layout: Layout, max_files: int = QUARANTINE_MAX_FILES) -> None:
        self.layout = layout
        self.max_files = max_files
        self._entries: list[tuple[int, str, int]] = []  # (stamp ns, name, bytes), oldest first
        self.files = 0
        self.bytes = 0
        qfd = layout.open_dir("quarantine")
        try:
            with os.scandir(qfd) as it:
                for de in it:
                    try:
                        st = de.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    stamp = _stamp_of(de.name)
                    self._entries.append((st.st_mtime_ns if stamp is None else stamp, de.name,
                                          _entry_bytes(qfd, de.name, st)))
            self._entries.sort()
            self.files = len(self._entries)
            self.bytes = sum(e[2] for e in self._entries)
            self._trim(qfd)
        finally:
            os.close(qfd)

    def move_in(self, dir_fd: int, name: str) -> str | None:
        """Moves the entry ``name`` of the directory ``dir_fd`` (the entry itself: a link is
        moved, not followed) into the quarantine as ``NAME.TIME``; removes the oldest entries
        past ``max_files``. Returns the quarantine name, None when the entry is gone. OSError
        when it cannot be moved."""
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        stamp = time.time_ns()
        qname = f"{name}.{stamp}"
        qfd = self.layout.open_dir("quarantine")
        try:
            try:
                os.rename(name, qname, src_dir_fd=dir_fd, dst_dir_fd=qfd)
            except FileNotFoundError:
                return None
            # A directory's contents are not walked here (the caller may be the scheduler's
            # thread): they are counted at the next start.
            self.added(qname, st.st_size if stat.S_ISREG(st.st_mode) else 0, stamp)
            self._trim(qfd)
        finally:
            os.close(qfd)
        return qname

    def added(self, qname: str, nbytes: int, stamp: int | None = None) -> None:
        """Counts an entry something else moved in (e.g. :meth:`Layout.make_dirs`)."""
        self._entries.append((stamp if stamp is not None else time.time_ns(), qname, nbytes))
        self.files += 1
        self.bytes += nbytes

    def _trim(self, qfd: int) -> None:
        if len(self._entries) <= self.max_files:
            return
        self._entries.sort()
        n = len(self._entries) - self.max_files
        old, self._entries = self._entries[:n], self._entries[n:]
        for _, name, nbytes in old:
            try:
                _remove_entry(qfd, name, background=True)
            except OSError as exc:
                logger.warning("pykvtier: cannot remove old quarantine entry %s: %s",
                               os.path.join(self.layout.quarantine_dir, name), exc.strerror)
            self.files -= 1
            self.bytes -= nbytes


def quarantine_usage(root: str | os.PathLike) -> tuple[int, int]:
    """(entries, bytes of their regular files) in ``ROOT/quarantine/``; (0, 0) without one."""
    try:
        qfd = _open_dir(_canonical_root(root), "quarantine")
    except (FileNotFoundError, NotADirectoryError):
        return 0, 0
    files = nbytes = 0
    try:
        with os.scandir(qfd) as it:
            for de in it:
                try:
                    st = de.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                files += 1
                nbytes += _entry_bytes(qfd, de.name, st)
    finally:
        os.close(qfd)
    return files, nbytes


def empty_quarantine(root: str | os.PathLike) -> tuple[int, int]:
    """Removes every entry of ``ROOT/quarantine/`` (following no link) and returns (entries,
    bytes) removed. A running tier's quarantine counters are not told (they catch up at its
    next start). OSError when an entry cannot be removed (what was removed stays removed)."""
    try:
        qfd = _open_dir(_canonical_root(root), "quarantine")
    except (FileNotFoundError, NotADirectoryError):
        return 0, 0
    files = nbytes = 0
    try:
        with os.scandir(qfd) as it:
            names = list(it)
        for de in names:
            try:
                st = de.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            b = _entry_bytes(qfd, de.name, st)
            _remove_entry(qfd, de.name)
            files += 1
            nbytes += b
    finally:
        os.close(qfd)
    return files, nbytes


# ---------------------------------------------------------------------- root lock


class RootLockedError(ValueError):
    """The root is locked by a tier that excludes this one. ``root``, ``shared`` (the mode
    asked for), ``holders`` (pids holding the lock, [] when they cannot be known)."""

    def __init__(self, root: str, shared: bool, held: str, holders: list[int]) -> None:
        self.root = root
        self.shared = shared
        self.holders = holders
        me = os.getpid()
        who = ", ".join(f"{p} (this process)" if p == me else str(p) for p in holders)
        asked = "a shared lock (shared=True)" if shared else "an exclusive lock (shared=False)"
        super().__init__(
            f"root {root} is in use: {held} lock on {os.path.join(root, LOCK_NAME)} is held by "
            f"pid {who or 'unknown'}; asked for {asked}. A shared=False tier needs its root to "
            "itself; shared=True tiers share a root with each other only")


def _drop_locks_in_child() -> None:
    """After fork(): the child closes its copies of the lock descriptors (the flock stays the
    parent's; a child that kept them would keep the root locked after the parent's shutdown)."""
    for lock in list(_held_locks):
        fd, lock._fd = lock._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


class RootLock:
    """A held flock on ``ROOT/.pykvtier.lock`` (shared or exclusive), held until
    :meth:`release` (or the object is collected). The lock file is never removed."""

    _fd: int | None = None  # (before __init__ sets it: a signal may interrupt it; __del__ runs)

    def __init__(self, root: str, fd: int, shared: bool) -> None:
        self.root = root
        self.path = os.path.join(root, LOCK_NAME)
        self.shared = shared
        self._fd: int | None = fd
        _held_locks.add(self)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Releases the lock: ``flock(LOCK_UN)``, then closes its descriptor. Idempotent.
        Unlocking first releases the lock even where a copy of the descriptor lives on (a child
        forked before its at-fork hook closed its copy, a dup): they share the lock."""
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    def __enter__(self) -> RootLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()

    @staticmethod
    def holders(root: str | os.PathLike) -> list[int]:
        """Pids holding a flock on the root's lock file (from /proc/locks; without it, the pid
        an exclusive holder wrote into the file, when the lock is held). [] when none."""
        root = _canonical_root(root)
        try:
            rfd = _open_dir(root)
        except OSError:
            return []
        try:
            fd = os.open(LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                         dir_fd=rfd)
        except OSError:
            return []
        finally:
            os.close(rfd)
        try:
            return [p for p, _ in _flock_holders(fd)]
        finally:
            os.close(fd)


_held_locks: weakref.WeakSet[RootLock] = weakref.WeakSet()
os.register_at_fork(after_in_child=_drop_locks_in_child)


def _flock_holders(fd: int) -> list[tuple[int, bool]]:
    """(pid, exclusive) of each flock holder of the file open at ``fd``, pids sorted."""
    st = os.fstat(fd)
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = None
    if lines is not None:
        exact: list[tuple[int, bool]] = []
        by_inode: list[tuple[int, bool]] = []
        for line in lines:
            parts = line.split()
            if len(parts) < 6 or parts[1] != "FLOCK":
                continue  # waiters ("->"), POSIX/OFD locks, leases
            try:
                pid = int(parts[4])
                major, minor, ino = parts[5].split(":")
                dev = (int(major, 16), int(minor, 16))
                ino_n = int(ino)
            except ValueError:
                continue
            if ino_n != st.st_ino:
                continue
            item = (pid, parts[3] == "WRITE")
            by_inode.append(item)
            if dev == (os.major(st.st_dev), os.minor(st.st_dev)):
                exact.append(item)
        # btrfs subvolumes report another st_dev than the superblock's: inode alone then
        return sorted(set(exact or by_inode))
    # No /proc/locks: is it held at all, and by whom (an exclusive holder's pid)?
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            pid = int(os.pread(fd, 32, 0).split()[0])
        except (OSError, ValueError, IndexError):
            return []
        return [(pid, True)] if pid > 0 and _alive(pid) else []
    fcntl.flock(fd, fcntl.LOCK_UN)
    return []


def lock_root(root: str | os.PathLike, shared: bool, *, file_mode: int = 0o600) -> RootLock:
    """Takes the root's lock: ``flock(LOCK_SH | LOCK_NB)`` with ``shared``, else
    ``LOCK_EX | LOCK_NB`` (the holder's pid is written into the lock file). The lock file
    ``ROOT/.pykvtier.lock`` is created (mode ``file_mode``) if missing and never removed.
    Raises RootLockedError (a ValueError) naming the root, the modes and the holder pid(s) when
    another holder excludes this one; ValueError naming the path when the root is not a
    directory or the lock file cannot be opened. Never blocks."""
    root = _canonical_root(root)
    path = os.path.join(root, LOCK_NAME)
    try:
        rfd = _open_dir(root)
    except OSError as exc:
        raise ValueError(f"root {root}: cannot open it to lock it ({exc.strerror})") from exc
    try:
        flags = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        try:
            fd = os.open(LOCK_NAME, flags | os.O_RDWR | os.O_CREAT | os.O_EXCL, file_mode,
                         dir_fd=rfd)
            os.fchmod(fd, file_mode)
        except FileExistsError:
            try:
                fd = os.open(LOCK_NAME, flags | os.O_RDWR, dir_fd=rfd)
            except OSError as exc:  # another user's root shared on purpose, a read-only file
                if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):  # system: a read
                    raise                                                      # fd locks too
                fd = os.open(LOCK_NAME, flags | os.O_RDONLY, dir_fd=rfd)
    except OSError as exc:
        raise ValueError(f"root {root}: cannot open its lock file {path} ({exc.strerror})") from exc
    finally:
        os.close(rfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"root {root}: its lock file {path} is not a regular file")
        nlink = st.st_nlink
        if nlink != 1:  # the pid hint below would be written into a file outside the root
            raise ValueError(f"root {root}: its lock file {path} has {nlink} hard links (one "
                             "may be outside the root); remove it")
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            holders = _flock_holders(fd)
            held = ("an exclusive (shared=False)" if any(x for _, x in holders)
                    else "a shared (shared=True)" if holders else "a")
            raise RootLockedError(root, shared, held, [p for p, _ in holders]) from None
    except BaseException:
        os.close(fd)
        raise
    if not shared:
        try:  # a hint for tools without /proc/locks; /proc/locks is the truth
            os.ftruncate(fd, 0)
            os.pwrite(fd, b"%d\n" % os.getpid(), 0)
        except OSError:
            pass  # read-only descriptor, full disk: the lock itself holds
    return RootLock(root, fd, shared)


def make_namespace_dir(parent: str, ns: str, mode: int, config: dict) -> None:
    """An integration's namespace directory ``ns`` inside ``parent`` (e.g.
    ROOT/pykvtier/<model>_<hash>), both made if missing with the directory mode of ``mode``
    exactly (whatever the umask; a missing root above them gets the default mode), and
    ``ns/config.json`` holding ``config`` (the run config the namespace stands for), written
    once (temporary, then renamed) with file mode ``mode``. OSError as the system raises it."""
    for d in (parent, ns):
        try:
            os.makedirs(d, dir_mode_of(mode))
        except FileExistsError:
            continue
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.fchmod(fd, dir_mode_of(mode))
        finally:
            os.close(fd)
    path = os.path.join(ns, "config.json")
    if not os.path.exists(path):
        tmp = f"{path}.tmp.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
        with open(fd, "w") as f:
            os.fchmod(fd, mode)
            json.dump(config, f, indent=2, sort_keys=True)
        os.replace(tmp, path)
