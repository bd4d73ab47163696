"""One capacity for a root that several tiers share (``shared=True``: processes of one host, or
nodes mounting one distributed file system).

Every shared tier of a root is a *member*; one member at a time is the root's *evictor*. Members
never evict: before a store writes new block files, its tier reserves their bytes against the
member's *grant*, a cumulative byte count the evictor raises; the evictor alone unlinks blocks,
root-wide least recently used first (by the files' modification times, which members set when
they load a block), and announces each eviction in a log that members read to drop the block
from their index. docs/design.md ("A shared root's capacity") gives the reasoning and the bound:
the bytes on the root stay within what the evictor has counted plus what it granted, whatever
the members' number, their speed, or a member's death.

Files, under ``ROOT/shared/`` (all small; records rewritten in place with a checksum, the log
appended):

- ``members/ID.lock``: held with ``flock(LOCK_EX)`` by member ID for its life (a lock that can be
  taken again means the member is dead); ``members/ID.json``: its ``reserved`` (cumulative bytes
  it reserved for new block files), ``settled`` (of those, the bytes of stores that finished,
  published or failed), ``returned`` (cumulative bytes of its grant it gave back
  unused, after RETURN_IDLE_S without a store waiting) and ``wanted`` (reserved plus returned
  plus the bytes of its stores waiting for room).
- ``evictor.lock``: held by the evictor; the member that takes it next takes over.
- ``grants.json``: the evictor's grants (member ID -> cumulative bytes) and the name of the
  eviction log; ``evicted-GEN.log``: 16-byte key digests of evicted blocks, appended.

Threads: each member runs one daemon thread (``pykvtier-root-keeper``) that publishes the
member's figures, reads the grants and the log, sets use times and, where it holds the evictor's
lock, runs the evictor. The tier's thread only calls :meth:`RootKeeper.reserve`,
:meth:`RootKeeper.want`, :meth:`RootKeeper.used`, :meth:`RootKeeper.take_evicted` and
:meth:`RootKeeper.wait_grant` (the last one blocks, GIL released, and only from drain/wait).
The file system must lock across nodes with ``flock`` (local file systems, JuiceFS, CephFS,
NFSv4; Lustre mounted with ``-o flock``); where it does not, two members may both act as evictor
and the bound no longer holds.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import secrets
import socket
import stat
import threading
import time
import weakref
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

from .layout import Layout

logger = logging.getLogger("pykvtier")

__all__ = ["RootKeeper", "SHARED_DIR"]

SHARED_DIR = "shared"
_MEMBERS = "members"
_GRANTS = "grants.json"
_EVICTOR_LOCK = "evictor.lock"
_DIGEST = 16

#: Seconds between a member's rounds (publish, read grants and log, evict when evictor).
POLL_S = 0.01
#: Seconds between the evictor's liveness checks of the other members.
LIVENESS_S = 1.0
#: Seconds between full rescans of the root by the evictor (its byte count is rebased on them).
RESCAN_S = 30.0
#: A block's use time is set by one member at most once per a quarter of the root's LRU horizon
#: (the age of the blocks the evictor is evicting, which it publishes), within these bounds.
USE_TIME_MIN_S, USE_TIME_MAX_S = 0.05, 10.0
#: The eviction log starts a new generation past this many bytes (64 Ki digests).
LOG_ROTATE_BYTES = _DIGEST << 16
#: Fraction of the capacity the evictor grants the members together beyond what their waiting
#: stores need, from room that is free (never evicted for): a member that keeps storing into a
#: root that is not full seldom waits for a round trip.
HEADROOM = 1 / 8
#: Block files younger than this at the start of a count are left out of its candidates.
COUNT_MARGIN_S = 0.1
#: Block files dated more than this ahead of the evictor's clock (a node whose clock is ahead,
#: or the evictor's behind) are candidates all the same, the newest: else none of them could
#: be evicted until the clocks met.
FUTURE_S = 60.0
#: A temporary nobody wrote for this long is a dead writer's (a member killed in the middle of a
#: store): the evictor's count removes it (a tier's start-up sweep waits an hour on a shared
#: root; meanwhile it took a block of the root's capacity).
STALE_TMP_S = 60.0
#: Seconds without a store waiting after which a member gives back the grant it has not used.
RETURN_IDLE_S = 1.0


#: open(2) flags of every file the keepers use: no link followed, no FIFO waited on.
_OPEN = os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
#: Errors of an open(2) that meets a directory, a symlink or a FIFO without a reader.
_NOT_A_FILE = (errno.EISDIR, errno.ELOOP, errno.ENXIO)


def _open_file(path: str, flags: int, mode: int = 0o644, move_aside: bool = False) -> int:
    """A descriptor of the regular file ``path`` (``_OPEN`` added to ``flags``); OSError
    otherwise (ENOENT, or EINVAL for something that is no regular file). ``move_aside``: a
    directory, symlink, FIFO... at ``path`` is renamed aside (``PATH.moved-HEX``, warned about)
    and the file opened again (for files only the keeper writing it opens for writing: the
    evictor's grants and log, a member's own record, lock files an open cannot have locked)."""
    for attempt in (0, 1):
        try:
            fd = os.open(path, flags | _OPEN, mode)
        except OSError as exc:
            if not (move_aside and attempt == 0 and exc.errno in _NOT_A_FILE):
                raise
        else:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode):
                return fd
            os.close(fd)
            if not (move_aside and attempt == 0):
                raise OSError(errno.EINVAL, "not a regular file", path)
        aside = f"{path}.moved-{secrets.token_hex(4)}"
        os.rename(path, aside)
        logger.warning("pykvtier: shared root: %s was no regular file; moved to %s", path, aside)
    raise AssertionError("unreachable")


def _read_record(path: str) -> dict | None:
    """The record in ``path`` (see _write_record), or None (missing, torn, unreadable, no regular
    file)."""
    try:
        fd = _open_file(path, os.O_RDONLY)
        try:
            data = os.read(fd, 1 << 20)
        finally:
            os.close(fd)
        body, _, rest = data.partition(b"\n")
        if int(rest[:8], 16) != zlib.crc32(body):
            return None  # torn: read while being written
        obj = json.loads(body)
    except (OSError, ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def _write_record(path: str, obj: dict, mode: int) -> None:
    """Writes ``obj`` over the record file ``path`` in place: one line of JSON, one line of its
    CRC-32 (a reader that meets a half-written record finds it torn), blanks up to the file's
    old length. In place, not renamed: another node's client sees the new bytes at its next
    open (JuiceFS: about 1 ms), where a renamed file reaches it only when its cached entry
    expires (1 s). Something else at ``path`` (a directory, a FIFO...) is moved aside."""
    body = json.dumps(obj, separators=(",", ":")).encode()
    data = body + b"\n%08x\n" % zlib.crc32(body)
    fd = _open_file(path, os.O_RDWR | os.O_CREAT, mode, move_aside=True)
    try:
        size = os.fstat(fd).st_size
        if size > len(data):
            data += b" " * (size - len(data))
        done = 0
        while done < len(data):
            done += os.pwrite(fd, data[done:], done)
    finally:
        os.close(fd)  # (close(2): a FUSE or NFS client commits the data here)


def _try_lock(path: str, mode: int, create: bool) -> int | None:
    """A descriptor of ``path`` holding ``flock(LOCK_EX)``, or None when another holds it (or the
    file is missing and not ``create``, or is no regular file: no member's lock). ``create``: a
    directory or symlink at ``path`` (which no member can have locked) is moved aside."""
    try:
        if create:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | _OPEN, mode)
            except OSError as exc:
                if exc.errno not in (errno.EISDIR, errno.ELOOP):
                    raise
                fd = _open_file(path, os.O_RDWR | os.O_CREAT, mode, move_aside=True)
        else:
            fd = _open_file(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    except OSError:
        if create:
            raise
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


_keepers: weakref.WeakSet[RootKeeper] = weakref.WeakSet()


def _drop_locks_in_child() -> None:
    """After fork(): the child closes its copies of its keepers' lock descriptors (without
    unlocking: the flocks stay the parent's). A child that kept them, outliving its parent,
    would keep a dead member alive and the evictor's role taken. The child's keepers run no
    rounds and remove no files (the parent's)."""
    for k in list(_keepers):
        k._thread = None  # (its locks may have been held by it at the fork: new ones)
        k._round, k._mu = threading.Lock(), threading.Condition(threading.Lock())
        for name in ("_member_lock", "_evictor_fd"):
            fd = getattr(k, name)
            setattr(k, name, None)
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass


os.register_at_fork(after_in_child=_drop_locks_in_child)


@dataclass
class _Member:
    """What the evictor knows of one member."""
    reserved: int = 0  # as last read
    settled: int = 0
    returned: int = 0
    wanted: int = 0
    first: int = 0  # ``wanted`` up to its first waiting store only
    granted: int = 0
    base: int = 0  # ``settled`` when the root's bytes were last counted (0: joined since)
    alive: bool = True
    asked: int = -1  # ``first`` when the evictor first saw it (a new store waiting)...
    asked_at: float = 0.0  # ...and when: members are granted in that order


@dataclass
class _Candidate:
    mtime_ns: int
    digest: bytes
    size: int


@dataclass
class _EvictorState:
    """The evictor's books (see docs/design.md): the bytes on the root are at most
    ``counted - freed + sum(granted - base - returned)`` over the members."""
    counted: int = 0  # bytes of block files and temporaries at the last full scan
    freed: int = 0  # bytes unlinked since
    scanned_at: float = -1e18
    members: dict[str, _Member] = field(default_factory=dict)
    candidates: list[_Candidate] = field(default_factory=list)  # oldest last (popped)
    log_gen: int = 0
    grants_written: dict[str, int] = field(default_factory=dict)
    horizon_s: float | None = None  # age of the last block evicted (wall clock), published
    room_written: int = -1  # whole blocks of room last published (at most once a second alone)
    written_at: float = -1e18
    free_bytes: int | None = None  # the file system's free bytes (capacity None), last seen
    liveness_at: float = -1e18
    rescan_soon: bool = True


class RootKeeper:
    """The member side of a shared root's capacity, and the evictor when this member holds its
    lock. Made by a ``shared=True`` :class:`pykvtier.DiskTier` (one per tier); not a public API.

    Args:
        root: the tier's root directory (``Layout.root``).
        blocks_dir: its ``blocks/`` directory.
        block_path: digest -> the block file's path.
        digest_from_name: a file name -> its digest, or None for names that are no block.
        file_bytes: bytes of one block file.
        capacity_bytes: the root-wide limit the evictor keeps (None: the file system's free space
            above ``min_free_bytes``).
        min_free_bytes: free space the evictor keeps on the file system.
        file_mode: permission bits of the files made here.
        start: start the keeper thread (False: rounds run only from :meth:`run_once`, for tests).
    """

    def __init__(self, root: str, blocks_dir: str, block_path: Callable[[bytes], str],
                 digest_from_name: Callable[[str], bytes | None], file_bytes: int,
                 capacity_bytes: int | None, min_free_bytes: int, file_mode: int,
                 dir_mode: int, start: bool = True) -> None:
        self.dir = os.path.join(root, SHARED_DIR)
        self.members_dir = os.path.join(self.dir, _MEMBERS)
        self.blocks_dir = blocks_dir
        self._block_path = block_path
        self._digest_from_name = digest_from_name
        self.file_bytes = file_bytes
        self.capacity_bytes = capacity_bytes
        self.min_free_bytes = min_free_bytes
        self.file_mode = file_mode
        for d in (self.dir, self.members_dir):
            try:
                os.mkdir(d, dir_mode)
            except FileExistsError:
                pass
        self.member_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        # Locked under another name, then renamed: the lock file appears locked (an evictor's
        # liveness check between its creation and its lock would take it for a dead member's).
        tmp = self._member_path(".new")
        self._member_lock = _try_lock(tmp, file_mode, create=True)
        if self._member_lock is None:  # a random name: nobody else holds it
            raise OSError(errno.EBUSY, f"cannot lock {tmp}")
        try:
            os.rename(tmp, self._member_path(".lock"))
        except BaseException:
            os.close(self._member_lock)
            self._member_lock = None
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        _keepers.add(self)
        # --- shared with the tier's thread, under _mu
        self._mu = threading.Condition(threading.Lock())
        self.granted = 0  # cumulative bytes this member may reserve
        self.reserved = 0  # cumulative bytes reserved
        self.settled = 0  # of those, cumulative bytes of stores that finished (ok or failed)
        self.returned = 0  # cumulative bytes of the grant given back unused
        self.wanted = 0
        self.first = 0  # reserved plus returned plus the bytes of the first store waiting
        self._want_at = time.monotonic()  # when a store last waited (or the member started)
        self._short_since: float | None = None  # since when the grant falls short of the first
        self._evicted: list[bytes] = []
        self._used: list[bytes] = []
        self.stats = {"shared_grant_rounds": 0, "shared_evictions": 0, "shared_evicted_seen": 0,
                      "shared_use_times_set": 0, "shared_rescans": 0, "shared_evictor_terms": 0,
                      "shared_dead_members": 0, "shared_round_errors": 0,
                      "shared_stale_temporaries_removed": 0}
        # --- the keeper thread's own
        self._published: tuple[int, ...] | None = None
        self._log_gen: int | None = None
        self._log_offset = 0
        self._used_at: dict[bytes, float] = {}
        self._use_every_s = 1.0  # (until the evictor publishes its horizon)
        self._last_grants: dict = {}  # the grants record last read (for describe())
        self._round_error: str | None = None  # what the last round raised (None: it did not)
        self._capacity_warned = False
        self._evictor_fd: int | None = None
        self._ev: _EvictorState | None = None
        self._evictor_try_at = -1e18
        self._round = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(target=self._run, name="pykvtier-root-keeper",
                                            daemon=True)
            self._thread.start()

    def _member_path(self, suffix: str, member: str | None = None) -> str:
        return os.path.join(self.members_dir, (member or self.member_id) + suffix)

    # ------------------------------------------------------------------ the tier's thread

    def reserve(self, nbytes: int) -> bool:
        """Reserves ``nbytes`` of new block files against this member's grant: True (reserved),
        False (not enough granted; nothing reserved)."""
        with self._mu:
            if self.reserved + self.returned + nbytes > self.granted:
                return False
            self.reserved += nbytes
            self._want_at = time.monotonic()
            if self.wanted < self.reserved + self.returned:
                self.wanted = self.reserved + self.returned
            if self.first < self.reserved + self.returned:
                self.first = self.reserved + self.returned
            return True

    def settle(self, nbytes: int) -> None:
        """``nbytes`` of reserved block files are done with: published, or their store failed."""
        with self._mu:
            self.settled += nbytes

    def room(self) -> int:
        """Bytes this member may reserve now (a store asks before it reserves: the member is
        busy, its unused grant is not given back for RETURN_IDLE_S from now)."""
        with self._mu:
            self._want_at = time.monotonic()
            return self.granted - self.reserved - self.returned

    def want(self, waiting_bytes: int, first_bytes: int | None = None) -> None:
        """Announces ``waiting_bytes`` of stores waiting for room (0: none), ``first_bytes`` of
        them the first store's (None: all), to the evictor at the next round (the thread is
        woken)."""
        with self._mu:
            self.wanted = self.reserved + self.returned + waiting_bytes
            self.first = self.reserved + self.returned + (
                waiting_bytes if first_bytes is None else min(first_bytes, waiting_bytes))
            if waiting_bytes:
                self._want_at = time.monotonic()
        self._wake.set()

    def used(self, digests: list[bytes]) -> None:
        """Blocks this member loaded or pinned: their use times are set (at most once per
        a quarter of the root's LRU horizon each), so the evictor takes them after older ones."""
        if digests:
            with self._mu:
                self._used.extend(digests)

    def take_evicted(self) -> list[bytes]:
        """Digests the evictor announced since the last call (any member's evictor, this one's
        included)."""
        with self._mu:
            out, self._evicted = self._evicted, []
            return out

    def wait_grant(self, timeout_s: float) -> bool:
        """Blocks (GIL released) until the grant grows or ``timeout_s``; True when it grew."""
        with self._mu:
            before = self.granted
            self._wake.set()
            return self._mu.wait_for(lambda: self.granted > before, timeout_s)

    def describe(self) -> str:
        """The root's capacity (the evictor's), this member's grant, the evictor's last word and
        what this member's rounds fail on, if they do: for an error message."""
        g = self._last_grants
        cap = g.get("capacity_bytes", self.capacity_bytes) if g else self.capacity_bytes
        out = f"capacity_bytes={cap} for the root"
        if cap != self.capacity_bytes:
            out += f" (the evictor's; this tier's {self.capacity_bytes})"
        with self._mu:
            out += (f"; this tier's grant {self.granted - self.reserved - self.returned} B "
                    f"unused, {self.wanted - self.reserved - self.returned} B wanted")
        if not g:
            out += f"; no evictor has written {os.path.join(self.dir, _GRANTS)} yet"
        else:
            room, free = g.get("room"), g.get("free_bytes")
            why = f"room {room} B left" if isinstance(room, int) else "room unknown"
            if isinstance(free, int):
                why += f" (the file system's free space {free} B, less min_free_bytes and grants)"
            out += f"; the evictor {g.get('evictor')} reports {why}"
        err = self._round_error
        if err is not None:
            out += f"; this tier's keeper rounds fail: {err}"
        return out

    @property
    def is_evictor(self) -> bool:
        return self._evictor_fd is not None

    def close(self) -> None:
        """Stops the thread, gives up the evictor's lock and this member's files. Idempotent."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._round:
            if self._evictor_fd is not None:
                os.close(self._evictor_fd)
                self._evictor_fd = None
            if self._member_lock is not None:
                for suffix in (".json", ".lock"):
                    try:
                        os.unlink(self._member_path(suffix))
                    except OSError:
                        pass
                os.close(self._member_lock)
                self._member_lock = None

    # ------------------------------------------------------------------ the keeper thread

    def _run(self) -> None:
        logged_at = -1e18
        while not self._stop.is_set():
            try:
                self.run_once()
            except Exception:  # counted; logged at most once a minute; the next round tries again
                self.stats["shared_round_errors"] += 1
                if time.monotonic() >= logged_at + 60.0:
                    logged_at = time.monotonic()
                    logger.exception("pykvtier: shared root %s: keeper round failed (%d so far)",
                                     self.dir, self.stats["shared_round_errors"])
            self._wake.wait(POLL_S)
            self._wake.clear()

    def run_once(self) -> None:
        """One round: publish this member's figures; if no evictor holds the root, try to
        become it; as evictor, count, evict and grant; read the grants and the eviction log;
        set use times. Any thread (rounds are serialized). What a failed round raised is kept
        for :meth:`describe` until a round succeeds."""
        with self._round:
            try:
                self._round_once()
            except Exception as exc:
                self._round_error = f"{type(exc).__name__}: {exc}"
                raise
            self._round_error = None

    def _round_once(self) -> None:
        """run_once's round, under ``_round``."""
        if self._member_lock is None:
            return
        self._publish()
        now = time.monotonic()
        if self._evictor_fd is None and now >= self._evictor_try_at:
            self._evictor_try_at = now + LIVENESS_S
            self._evictor_fd = _try_lock(os.path.join(self.dir, _EVICTOR_LOCK),
                                         self.file_mode, create=True)
            if self._evictor_fd is not None:
                self.stats["shared_evictor_terms"] += 1
                self._ev = self._take_over()
        if self._evictor_fd is not None:
            self._evict_and_grant(now)
            self._publish()  # (the grants below are read back through the file)
        self._read_grants()
        self._read_log()
        self._set_use_times(now)

    def _publish(self) -> None:
        with self._mu:
            unused = self.granted - self.reserved - self.returned
            now = time.monotonic()
            if (unused > 0 and self.wanted <= self.reserved + self.returned
                    and now >= self._want_at + RETURN_IDLE_S):
                self.returned += unused  # idle: the evictor may give it to others
                self.wanted = self.first = self.reserved + self.returned
            # Short of its first waiting store for RETURN_IDLE_S: given back too (the evictor
            # grants in order; held here, it could keep the store before it from its room).
            if not 0 < unused < self.first - self.reserved - self.returned:
                self._short_since = None
            elif self._short_since is None:
                self._short_since = now
            elif now >= self._short_since + RETURN_IDLE_S:
                self.returned += unused  # (the same stores wait: wanted and first move with it)
                self.wanted += unused
                self.first += unused
                self._short_since = None
            figures = (self.reserved, self.settled, self.returned, self.wanted, self.first,
                       self.granted)
        if figures != self._published:
            _write_record(self._member_path(".json"), {
                "reserved": figures[0], "settled": figures[1], "returned": figures[2],
                "wanted": figures[3], "first": figures[4], "granted": figures[5],
                "pid": os.getpid(), "host": socket.gethostname()},
                self.file_mode)
            self._published = figures

    def _read_grants(self) -> None:
        g = _read_record(os.path.join(self.dir, _GRANTS))
        if g is None:
            return
        self._last_grants = g
        cap = g.get("capacity_bytes", self.capacity_bytes)
        if cap != self.capacity_bytes and not self._capacity_warned:
            self._capacity_warned = True
            logger.warning("pykvtier: shared root %s: this tier's capacity_bytes=%s differs from "
                           "the evictor's (%s): the evictor's is the root's", self.dir,
                           self.capacity_bytes, cap)
        grants = g.get("grants")
        mine = grants.get(self.member_id) if isinstance(grants, dict) else None
        if isinstance(mine, int):
            with self._mu:
                if mine > self.granted:
                    self.granted = mine
                    self.stats["shared_grant_rounds"] += 1
                    self._mu.notify_all()
        h = g.get("horizon_s")
        if isinstance(h, (int, float)) and h > 0:
            self._use_every_s = min(USE_TIME_MAX_S, max(USE_TIME_MIN_S, h / 4))
        gen = g.get("log_gen")
        if isinstance(gen, int) and gen != self._log_gen:
            if self._log_gen is None:  # first sight: evictions from now on (the tier's start
                try:                   # scan saw the root after the earlier ones)
                    st = os.stat(self._log_path(gen), follow_symlinks=False)
                    self._log_offset = (st.st_size // _DIGEST * _DIGEST
                                        if stat.S_ISREG(st.st_mode) else 0)
                except OSError:
                    self._log_offset = 0
            else:
                self._read_log()  # the rest of the old generation first
                self._log_offset = 0
            self._log_gen = gen

    def _log_path(self, gen: int) -> str:
        return os.path.join(self.dir, f"evicted-{gen}.log")

    def _read_log(self) -> None:
        if self._log_gen is None:
            return
        try:
            with os.fdopen(_open_file(self._log_path(self._log_gen), os.O_RDONLY), "rb") as f:
                f.seek(self._log_offset)
                data = f.read()
        except OSError:
            return
        n = len(data) - len(data) % _DIGEST
        if not n:
            return
        self._log_offset += n
        digests = [data[i:i + _DIGEST] for i in range(0, n, _DIGEST)]
        with self._mu:
            self._evicted.extend(digests)
            self.stats["shared_evicted_seen"] += len(digests)

    def _set_use_times(self, now: float) -> None:
        with self._mu:
            used, self._used = self._used, []
        every = self._use_every_s
        for d in used:
            if now < self._used_at.get(d, -1e18) + every:
                continue
            self._used_at[d] = now
            try:
                os.utime(self._block_path(d))
                self.stats["shared_use_times_set"] += 1
            except OSError:
                pass  # gone (evicted), or another user's file
        if len(self._used_at) > 1 << 16:
            self._used_at = {d: t for d, t in self._used_at.items() if now < t + every}

    # ------------------------------------------------------------------ the evictor

    def _take_over(self) -> _EvictorState:
        """A new evictor's books: the grants the last one wrote (members keep them), the root
        counted afresh at the first round."""
        ev = _EvictorState()
        g = _read_record(os.path.join(self.dir, _GRANTS)) or {}
        grants = g.get("grants") if isinstance(g.get("grants"), dict) else {}
        for mid, q in grants.items():
            if isinstance(mid, str) and isinstance(q, int):
                # reserved and base stay 0 until the member's file is read: its whole grant
                # counts as unwritten meanwhile
                ev.members[mid] = _Member(granted=q)
        ev.log_gen = int(g.get("log_gen", 0)) + 1 if isinstance(g.get("log_gen", 0), int) else 1
        ev.grants_written = dict(grants)
        return ev

    def _read_members(self, ev: _EvictorState, now: float) -> None:
        """Reads the members' figures; every LIVENESS_S, which of them are dead (their lock can
        be taken): their files are removed and the root recounted."""
        try:
            names = os.listdir(self.members_dir)
        except OSError:
            return
        ids = {n[:-5] for n in names if n.endswith(".json")} | {
            n[:-5] for n in names if n.endswith(".lock")}
        check = now >= ev.liveness_at
        if check:
            ev.liveness_at = now + LIVENESS_S
        for mid in ids:
            m = ev.members.get(mid)
            if m is None:
                m = ev.members[mid] = _Member()
            if check and mid != self.member_id and m.alive:
                fd = _try_lock(self._member_path(".lock", mid), self.file_mode, create=False)
                if fd is not None:  # dead: its grant was the last use of its books
                    try:
                        for suffix in (".json", ".lock"):
                            try:
                                os.unlink(self._member_path(suffix, mid))
                            except OSError:
                                pass
                    finally:
                        os.close(fd)
                    m.alive = False
                    ev.rescan_soon = True
                    self.stats["shared_dead_members"] += 1
                    continue
            f = _read_record(self._member_path(".json", mid))
            if f is not None:
                r, x, w = f.get("reserved"), f.get("returned", 0), f.get("wanted")
                c = f.get("settled", 0)
                if isinstance(r, int) and r >= m.reserved:
                    m.reserved = r
                if isinstance(c, int) and c >= m.settled:
                    m.settled = c
                if isinstance(x, int) and x >= m.returned:
                    m.returned = x
                if isinstance(w, int):
                    m.wanted = w
                    h = f.get("first", w)
                    m.first = min(h, w) if isinstance(h, int) else w
                q = f.get("granted")  # (what it holds: a new evictor without the last grants
                if isinstance(q, int) and q > m.granted:  # record, or a torn one, counts it)
                    m.granted = q
        for mid, m in ev.members.items():  # gone from the directory: dead (removed by another)
            if mid not in ids and m.alive:
                m.alive = False
                ev.rescan_soon = True

    def _rescan(self, ev: _EvictorState, now: float) -> None:
        """Counts the bytes under blocks/ (block files, and temporaries as whole block files) and
        lists the block files by modification time: the books start again from this count.
        Block files newer than the count's start are no candidates until the next count: they
        may be in the count and in a member's grant both (counted twice), and are the newest."""
        # (less a margin: a file system stamps times from a coarse clock, a tick behind, and
        # nodes' clocks differ by a few ms under NTP)
        start_ns = time.time_ns() - int(COUNT_MARGIN_S * 1e9)
        future_ns = start_ns + int((COUNT_MARGIN_S + FUTURE_S) * 1e9)
        stale_ns = start_ns - int(STALE_TMP_S * 1e9)
        self._read_members(ev, now)  # (the figures just before the count: little counted twice)
        for m in ev.members.values():
            # Stores settled before the count are in it; those in flight (a temporary still
            # growing, a rename the listing may miss) stay in granted - base.
            m.base = m.settled
        ev.members = {mid: m for mid, m in ev.members.items() if m.alive}
        counted, cands = 0, []
        for i in range(256):
            sub = os.path.join(self.blocks_dir, f"{i:02x}")
            try:
                it = os.scandir(sub)
            except OSError:
                continue
            with it:
                for de in it:
                    try:
                        st = de.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if not stat.S_ISREG(st.st_mode):
                        continue
                    d = self._digest_from_name(de.name)
                    if d is not None:
                        counted += st.st_size
                        if st.st_mtime_ns < start_ns or st.st_mtime_ns > future_ns:
                            cands.append(_Candidate(st.st_mtime_ns, d, st.st_size))
                    elif (st.st_mtime_ns < stale_ns and Layout.tmp_owner(de.name) is not None
                          and self._remove_stale(os.path.join(sub, de.name))):
                        pass  # a dead writer's temporary (killed in the middle of a store)
                    else:  # a temporary: a whole block file once written
                        counted += max(st.st_size, self.file_bytes)
        cands.sort(key=lambda c: -c.mtime_ns)
        ev.counted, ev.freed, ev.candidates = counted, 0, cands
        ev.scanned_at, ev.rescan_soon = now, False
        self.stats["shared_rescans"] += 1

    def _remove_stale(self, path: str) -> bool:
        """Unlinks a dead writer's temporary; False when it cannot (then it still counts)."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            return True
        except OSError as exc:
            logger.warning("pykvtier: shared root: cannot remove stale temporary %s: %s", path,
                           exc.strerror)
            return False
        self.stats["shared_stale_temporaries_removed"] += 1
        return True

    def _committed(self, ev: _EvictorState) -> int:
        return ev.counted - ev.freed + sum(max(0, m.granted - m.base - m.returned)
                                           for m in ev.members.values())

    def _limit(self, ev: _EvictorState) -> int:
        """The byte count the books may reach: capacity_bytes, or (None) what they count now plus
        the file system's free space above min_free_bytes, less what is granted and unwritten
        (not reserved yet, or reserved by stores in flight: the free space may not show them)."""
        if self.capacity_bytes is not None:
            return self.capacity_bytes
        try:
            st = os.statvfs(self.blocks_dir)
        except OSError:
            return self._committed(ev)
        ev.free_bytes = st.f_bavail * st.f_frsize
        if st.f_blocks == 0:  # no figures (ramfs, some FUSE layers): nothing to keep
            return 1 << 62
        unwritten = sum(max(0, m.granted - m.settled - m.returned) for m in ev.members.values()
                        if m.alive)
        return (self._committed(ev) + st.f_bavail * st.f_frsize - self.min_free_bytes
                - unwritten)

    def _evict(self, ev: _EvictorState, nbytes: int) -> None:
        """Unlinks least recently used block files until ``nbytes`` are freed (or none is left):
        a candidate whose file was used since the count (a newer modification time) is kept.
        The victims are announced before they are unlinked: an evictor that dies in between
        leaves blocks announced and still there (a MISS, found again by a probe), never blocks
        gone and unannounced (a HIT for good on the members that hold them)."""
        victims: list[tuple[_Candidate, str]] = []
        chosen = 0
        while chosen < nbytes and ev.candidates:
            c = ev.candidates.pop()
            path = self._block_path(c.digest)
            try:
                st = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:  # removed by a member (a failed block, remove())
                ev.freed += c.size
                continue
            except OSError:
                continue
            if st.st_mtime_ns != c.mtime_ns:  # used (or stored again) since the count
                continue
            victims.append((c, path))
            chosen += c.size
        if not victims:
            return
        self._append_log(ev, [c.digest for c, _ in victims])
        self.stats["shared_evictions"] += len(victims)
        for c, path in victims:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                logger.warning("pykvtier: shared root: cannot evict %s: %s", path, exc.strerror)
                continue
            ev.freed += c.size
            ev.horizon_s = max(0.0, time.time() - c.mtime_ns / 1e9)

    def _append_log(self, ev: _EvictorState, digests: list[bytes]) -> None:
        path = self._log_path(ev.log_gen)
        fd = _open_file(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, self.file_mode,
                        move_aside=True)
        try:
            os.write(fd, b"".join(digests))
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if size >= LOG_ROTATE_BYTES:
            ev.log_gen += 1
            try:
                os.unlink(self._log_path(ev.log_gen - 2))
            except OSError:
                pass

    def _evict_and_grant(self, now: float) -> None:
        """One round of the evictor: the members' figures, a recount when due, evictions for the
        grants they need, the grants written."""
        ev = self._ev
        if ev.rescan_soon or now - ev.scanned_at >= RESCAN_S:
            self._rescan(ev, now)  # (reads the members' figures first)
        else:
            self._read_members(ev, now)
        live = [m for m in ev.members.values() if m.alive]
        fb = self.file_bytes
        limit = self._limit(ev)
        share = int(limit * HEADROOM) // max(1, len(live)) // fb * fb
        # Evicted for: the members' waiting stores.
        needs = {mid: m.wanted - m.granted for mid, m in ev.members.items()
                 if m.alive and m.wanted > m.granted}
        total = sum(needs.values())
        over = self._committed(ev) + total - limit
        if over > 0:
            self._evict(ev, over)
            if not ev.candidates and self._committed(ev) + total > limit:
                # Every block counted was evicted or used since: count again (once a round at
                # most; amortized, a count per root's worth of evictions), then evict from the
                # new list.
                self._rescan(ev, now)
                over = self._committed(ev) + total - self._limit(ev)
                if over > 0:
                    self._evict(ev, over)
            limit = self._limit(ev)
        room = limit - self._committed(ev)
        for mid in needs:
            m = ev.members[mid]
            if m.first != m.asked:  # a store waiting that was not before: last in line
                m.asked, m.asked_at = m.first, now
        # Each member's first waiting store is granted whole, first come first served (room
        # spread over several members, each short of its store, would let none of them go on
        # while the root stays empty); a store larger than the root gets what there is. Then,
        # if every first store got its room, each member's other waiting stores, all or none.
        order = sorted(needs, key=lambda mid: (ev.members[mid].asked_at, mid))
        blocked = False
        for mid in order:
            m = ev.members[mid]
            need = m.first - m.granted
            if need <= 0:
                continue
            n = need if need <= room else (
                max(0, room) // fb * fb if m.first - m.reserved - m.returned > limit else 0)
            if n > 0:
                m.granted += n
                room -= n
            if n < need:  # the room freed from now on is its own
                blocked = True
                break
        for mid in () if blocked else order:
            m = ev.members[mid]
            if 0 < m.wanted - m.granted <= room:
                room -= m.wanted - m.granted
                m.granted = m.wanted
        for mid in () if blocked else needs:  # then, from room left free, a headroom share each
            n = min(share, room) // fb * fb
            if n > 0:
                ev.members[mid].granted += n
                room -= n
        grants = {mid: m.granted for mid, m in ev.members.items() if m.alive}
        room_blocks = max(0, room) // fb
        if (grants != ev.grants_written or not os.path.exists(os.path.join(self.dir, _GRANTS))
                or (room_blocks != ev.room_written and now >= ev.written_at + 1.0)):
            rec = {"evictor": self.member_id, "log_gen": ev.log_gen, "grants": grants,
                   "horizon_s": ev.horizon_s, "room": room_blocks * fb,
                   "capacity_bytes": self.capacity_bytes}
            if self.capacity_bytes is None:
                rec["free_bytes"] = ev.free_bytes
            _write_record(os.path.join(self.dir, _GRANTS), rec, self.file_mode)
            ev.grants_written, ev.room_written, ev.written_at = grants, room_blocks, now
