"""DiskTier: the engine-agnostic secondary tier (phase 1 lookup, phase 2 load/store).

Thread rules: a DiskTier is not thread-safe; call it from one thread at a time (an engine's
scheduler). It never blocks in :meth:`lookup`, :meth:`submit_load`, :meth:`submit_store`,
:meth:`get_finished_jobs` or :meth:`on_step_end`; the I/O runs on the C++ engine's own rings
and threads. :meth:`wait`, :meth:`drain` and :meth:`shutdown` block, with the GIL released.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import functools
import logging
import math
import operator
import os
import stat
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import _native
from .buffers import Arena, as_arena
from .config import DiskTierConfig
from .engines import Op, make_host_engine
from .layout import (
    BLOCK_SUFFIX,
    HEADER_BYTES,
    Layout,
    Quarantine,
    dir_mode_of,
    key_digest,
    lock_root,
)
from .probe import ExistenceProbe
from .sharing import RootKeeper

__all__ = ["DiskTier", "JobResult", "LookupResult", "TransferJob"]

logger = logging.getLogger("pykvtier")


class LookupResult(enum.Enum):
    """Phase-1 answer, with the names of vLLM's ``LookupResult`` (vllm.v1.kv_offload.base).

    HIT: on disk, whole, loadable now. MISS: not here (absent, a probe found nothing, or a load
    of it failed). RETRY: ask again next step (probe in flight, or the block is being written).
    HIT_PENDING: a load of it is already in flight; do not start a second one.
    """

    MISS = 0
    HIT = 1
    HIT_PENDING = 2
    RETRY = 3


#: _native.BlockIndex's answers (0..3) as LookupResult; 4: not indexed (a shared tier probes).
_ANSWERS = (LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY, LookupResult.HIT_PENDING)
_ANSWER_CODE = {r: i for i, r in enumerate(_ANSWERS)}
_UNKNOWN = 4


@dataclass
class TransferJob:
    """A batch of keys moved together, as vLLM's ``TransferJob``.

    ``keys[i]`` moves to/from arena slot ``slot_ids[i]`` (bytes
    ``[slot * slot_bytes, (slot + 1) * slot_bytes)`` of the arena). ``job_id`` is the caller's;
    it must not be reused while the job is in flight. The engine reads a store's slots and writes a
    load's slots at any time until the job is reported finished: do not change a store's slots,
    nor use a load's, before then (a block stored from a slot changed meanwhile holds, and
    checksums, whatever the slot held when its write ran).
    """

    job_id: int
    keys: Sequence[bytes]
    slot_ids: Sequence[int]


@dataclass
class JobResult:
    """A finished job, reported once by :meth:`DiskTier.get_finished_jobs`.

    ``success``: every key succeeded. ``successful_keys``: on partial failure the keys that
    succeeded, else None (all share ``success``), as vLLM's ``JobResult``. ``failed_keys``: key ->
    reason. ``transfer_time``: seconds from the first SQE to the last completion.
    ``transfer_bytes``: payload bytes moved.
    """

    job_id: int
    success: bool
    successful_keys: list[bytes] | None = None
    transfer_time: float | None = None
    transfer_bytes: int | None = None
    is_load: bool = True
    failed_keys: dict[bytes, str] = field(default_factory=dict)
    submits: int = 0


# _native.BlockIndex's block states (BlockState) and admission codes (Admit).
_PRESENT, _WRITING, _REMOVING = 1, 2, 3
_ADMIT_OK, _ADMIT_PRESENT, _ADMIT_REMOVING, _ADMIT_NEEDS_ROOM = 0, 5, 4, 6
_LOAD_REFUSED = {1: "an earlier load of this block failed", 2: "not in the tier",
                 3: "block is writing", 4: "block is removing"}


def _split(digests: bytes) -> list[bytes]:
    """A buffer of 16-byte digests as a list of them."""
    return [digests[i:i + 16] for i in range(0, len(digests), 16)]


@dataclass(slots=True)
class _Pending:
    """A caller's job on its way through the engine."""

    job: TransferJob
    is_load: bool
    job_keys: list[bytes]  # the job's keys, taken once at submit (job.keys may be one-shot)
    keys: list[bytes]  # keys handed to the engine, in entry order
    digests: bytes  # their key digests, 16 bytes each, in entry order
    slots: bytes  # their arena slots, one native int64 each, in entry order
    done: dict[bytes, str | None]  # keys settled before the engine: None = ok, str = failure
    victims: dict[int, bytes] = field(default_factory=dict)  # entry -> evicted block it reuses
    retried: bool = False  # a store whose keys that met a full file system were written again
    transfer_s: float = 0.0  # summed over its engine jobs
    submits: int = 0
    moved_bytes: int = 0
    claimed: bytes = b""  # the job's slots (all of them), claimed until it is reported
    grant_deadline: float = 0.0  # a shared tier's store waiting for room: when it gives up


_CORRUPT = frozenset(int(v) for v in _native.BlockError.__members__.values())  # failed checks
_INTERNAL_JOB = 1 << 62  # engine job ids of the tier's own jobs (evictions)
_NO_SPACE = (-errno.ENOSPC, -errno.EDQUOT)  # a store meeting these evicts and is retried once
_MEMORY_FS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}  # statfs f_type: memory, not disk
_FS_CHECK_S = 0.1  # statvfs of the root at most this often (stores in between are counted)
_NO_FS_FIGURES = 1 << 62  # free bytes assumed where the file system reports no sizes
_LEFTOVER_RETRY_S = 1.0  # removal of leftover files retried at most this often
_WARN_INTERVAL_S = 5.0  # per-key failures: one aggregated WARNING line at most this often
_GRANT_WAIT_S = 10.0  # a shared tier's store waits this long at most for the evictor's grant
_now = time.monotonic  # the clock of the three above and of probe_ttl_s (tests replace it)
_open_tiers: weakref.WeakSet[DiskTier] = weakref.WeakSet()  # this process's tiers not shut down


_TIER_STATS = (
    "lookups", "hits", "misses", "retries", "hit_pending", "loads_submitted", "stores_submitted",
    "stores_skipped_present", "blocks_loaded", "blocks_stored", "bytes_loaded", "bytes_stored",
    "load_failures", "store_failures", "verify_failures", "quarantined", "evictions",
    "eviction_failures", "capacity_rejections", "probes", "probe_hits", "probe_results_applied",
    "stale_temporaries_removed", "direct_fallbacks", "malformed_block_files", "evictions_recycled",
    "store_retries", "leftovers_removed", "loads_refused", "blocks_removed",
    "stores_waited_for_grant", "shared_evictions_applied", "loads_gone", "stores_refused_evicting")


_OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(DiskTierConfig)) - {"root_dir",
                                                                                  "block_size_bytes"}


def _describe(res: int) -> str:
    return _native.result_text(res)


def _undo_on_failure(init: Any) -> Any:
    """Wraps DiskTier._start: when it raises, what it took (root lock, engine, probe ring) is
    let go before the error propagates."""

    @functools.wraps(init)
    def wrapper(self: DiskTier, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except BaseException:
            self._abandon()
            raise

    return wrapper


def _as_key(key: Any) -> bytes:
    """``key`` as bytes: bytes as is; any other buffer but str (bytearray, memoryview, a numpy
    array, strided or not) as its logical bytes, as _native.check_job and BlockIndex.lookup_key
    take it. TypeError else."""
    if isinstance(key, bytes):
        return key
    if isinstance(key, (bytearray, memoryview)):
        return bytes(key)
    if not isinstance(key, str):
        try:
            return memoryview(key).tobytes()
        except TypeError:
            pass
    raise TypeError(f"key must be bytes, not {type(key).__name__}")


#: SQ ring of a shared tier's existence probe: a probe storm of a few thousand unknown keys
#: (one step's worth) goes out in one io_uring_submit.
_PROBE_RING_ENTRIES = 4096
#: Completed probe results get_finished_jobs() applies at most per call (lookup() applies only
#: its own key's, on_step_end() all): a storm of one ring's worth is applied before the next
#: step's lookups, a larger one is spread over calls.
_FINISHED_PROBE_SLICE = _PROBE_RING_ENTRIES


def _packed_block_paths(layout: Layout, digests: list[bytes]) -> tuple[Any, int]:
    """``layout.block_path`` of each digest as one buffer of NUL-padded slots of ``stride``
    bytes (ExistenceProbe.submit_packed's form), built with NumPy rather than per digest.
    The name pattern is read off ``block_path`` of the first digest; should it ever not be
    PREFIX/hh/HEX+SUFFIX, the paths are joined one by one instead."""
    import numpy as np

    n = len(digests)
    h0 = digests[0].hex().encode()
    sample = os.fsencode(layout.block_path(digests[0]))
    at = sample.rfind(h0)
    hexs = b"".join(digests).hex().encode()
    w = len(h0)
    if at > 3 and sample[at - 3:at] == h0[:2] + b"/" and at + w < len(sample) and len(hexs) == n * w:
        prefix, suffix = sample[:at - 3], sample[at + w:]
        p, stride = len(prefix), len(sample) + 1  # the last byte of each slot stays NUL
        slot = np.dtype({"names": ["prefix", "fan", "slash", "hex", "suffix"],
                         "formats": [f"S{p}", "S2", "S1", f"S{w}", f"S{len(suffix)}"],
                         "offsets": [0, p, p + 2, p + 3, p + 3 + w], "itemsize": stride})
        out = np.zeros(n, dtype=slot)
        out["prefix"] = prefix
        out["fan"] = np.ndarray((n,), dtype="S2", buffer=hexs, strides=(w,))
        out["slash"] = b"/"
        out["hex"] = np.frombuffer(hexs, dtype=f"S{w}")
        out["suffix"] = suffix
        return out, stride
    raws = [os.fsencode(layout.block_path(d)) for d in digests]
    stride = max(map(len, raws)) + 1
    return b"".join(r.ljust(stride, b"\0") for r in raws), stride


class DiskTier:
    """A secondary KV-cache tier on a POSIX directory, loaded and stored through io_uring.

    Args:
        root_dir: directory of the tier (created if missing). Several processes may share it
            (``shared=True``): blocks are content-addressed, written under temporary names and
            renamed into place.
        block_size_bytes: payload bytes per block (e.g. 2 MiB = 16 tokens of Llama-3-8B bf16),
            1 .. 1 GiB (the engines' per-request limit). A block file is this plus a 4096-byte
            header.
        capacity_bytes: limit on block file bytes (``used_bytes``); least recently used blocks
            are evicted to make room (never one that a load is reading). None: what the file
            system holds, less ``min_free_bytes``. With ``shared=True`` the limit of the whole
            root, all the tiers sharing it together (give them the same value): the root's
            evictor, one of them, evicts root-wide least recently used blocks and grants each
            tier room before it writes (:mod:`pykvtier.sharing`); a store waits for its grant
            (up to 10 s, then the keys without room fail "no capacity") without blocking the
            caller.
        min_free_bytes: free space kept on the root's file system (statvfs, checked at most
            every 100 ms; the tier's own stores and evictions are counted in between): a store
            that would bring it below evicts least recently used blocks first, or fails when
            none can be evicted. Applies with or without ``capacity_bytes``. None: 5 % of the
            file system's size. Whatever the reserve, a store that meets a full file system
            (ENOSPC, EDQUOT) evicts as many blocks and is written once more.
        shared: keys the index does not know may have been written by another process or node:
            they are probed (asynchronously, RETRY meanwhile) instead of answered MISS. The
            tier is a member of the root's shared capacity (see ``capacity_bytes``): it never
            evicts on its own; blocks another member evicted leave its index within a round of
            its keeper thread (10 ms, plus the file system's metadata cache) and answer MISS
            (``stats()["shared_evictions_applied"]``; a load that meets a block removed before
            that is a MISS too, ``["loads_gone"]``). Needs ``flock`` that holds across nodes.
        direct: use O_DIRECT. None: where the file system accepts it (probed once); a buffered
            fallback is logged and counted in ``stats()["direct_fallbacks"]``.
        queue_depth: block requests in flight in the engine.
        max_inflight_bytes: payload bytes in flight in the engine.
        store_share: the share, in (0, 1], of ``queue_depth`` and ``max_inflight_bytes`` that
            stores and unlinks may hold (the posix engine: of its threads). Loads are issued
            before queued stores but wait at the device behind the stores already issued: a
            smaller share cuts load latency during store bursts, and store bandwidth with it.
        probe_ttl_s: seconds (a number >= 0) a probe's "not found" stays a MISS before it is
            probed again.
        fsync: durable stores: each block file is fdatasync'ed before it is renamed into place,
            and the directories of a job's renames are fsync'ed (each once) before the job is
            reported. Turns ``recycle`` off (see there).
        engine: "uring" (io_uring), "posix" (preadv/pwritev thread pool), or "auto": io_uring
            where the kernel allows it, else posix, announced in the log.
        arena: optional arena (see :meth:`set_arena`).
        device_path: for a CUDA arena, how blocks reach it: "auto", "gds", "kvikio-compat",
            "bounce", or a :class:`pykvtier.gpu.DeviceOptions` (see :mod:`pykvtier.gpu`).
        track_removals: remember the digests of blocks that stop being loadable (evicted, or
            their load failed) for :meth:`take_removed`, e.g. to announce removals to an
            engine's KV events. Off by default (the list would grow unread).
        recycle: when a store needs room, reuse the evicted block's file for the new block
            (renamed to the new block's temporary name and overwritten in place, then renamed
            into place as any store) instead of unlinking it and creating a file: the file
            system allocates and frees no inode or extent (several times less CPU per store
            under eviction churn on ext4). Never with ``shared=True`` (another process may be
            reading the evicted file), nor with ``fsync=True`` (the victim's rename to the
            temporary name would need one more directory fsync per store to be durable; without
            it, after a power loss the victim's old name can come back holding the new block's
            bytes), nor for device arenas; blocks evicted for other reasons (start-up over
            capacity, unreadable files) are unlinked. ``self.recycle`` says whether it is on.
        mode: permission bits of the files the tier creates (default 0o600: KV blocks are user
            data); its directories get the matching x bits (0o600 -> 0o700, 0o640 -> 0o750,
            0o660 -> 0o770). Within 0o666, owner read and write set.
        quarantine_max_files: entries kept in ``ROOT/quarantine/``; the oldest are removed past
            it (counted in ``stats()["quarantine_files"]``, ``["quarantine_bytes"]``).
        verify: what a load checks: "payload" (the default: header, key digest, length and the
            payload's XXH3-64) or "header" (all but the payload checksum, which stores then do
            not compute either; for file systems that checksum data themselves, e.g. btrfs,
            ZFS). A block stored without a payload checksum is loaded with the header checks by
            a "payload" tier too (counted in ``stats()["loads_unchecked_payload"]``).

    The options (all but ``arena``) are the fields of :class:`pykvtier.config.DiskTierConfig`,
    checked there before anything on disk is touched; ``DiskTier.from_config`` takes one, and
    ``self.config`` is the tier's.

    The root is locked from here until :meth:`shutdown` (``flock`` on ``ROOT/.pykvtier.lock``:
    exclusive for ``shared=False``, shared for ``shared=True``), and records its block size in
    ``ROOT/pykvtier-root.json``.

    Files the tier or its engine could not remove (a failed store's temporary, an evicted
    block whose unlink failed) stay counted in ``used_bytes`` (``stats()["leftover_files"]``)
    and their removal is retried at most once a second from :meth:`get_finished_jobs`; a key
    whose old block file is among them cannot be stored meanwhile. Per-key failures (stores,
    loads, evictions) are logged aggregated: one WARNING line with counts per reason, the
    first at once, then at most one every 5 s.

    Raises TypeError for an option of the wrong type, ValueError for an out-of-range option
    (each naming the option), a bad block size, an unusable root, a root holding blocks of another
    block size (naming both sizes), or io_uring being unavailable;
    :class:`pykvtier.layout.RootLockedError` (a ValueError naming the holder's pid) when
    another tier holds the root (any tier for ``shared=False``; a ``shared=False`` one for
    ``shared=True``).
    """

    def __init__(self, root_dir: str | os.PathLike, block_size_bytes: int, *, arena: Any = None,
                 **options: Any) -> None:
        unknown = sorted(set(options) - _OPTION_NAMES)
        if unknown:
            raise TypeError(f"DiskTier: unknown option{'s' if len(unknown) > 1 else ''} "
                            f"{', '.join(map(repr, unknown))}; accepted: {', '.join(sorted(_OPTION_NAMES))}")
        self._start(DiskTierConfig(root_dir, block_size_bytes, **options), arena)

    @classmethod
    def from_config(cls, config: DiskTierConfig, arena: Any = None) -> DiskTier:
        """A tier with the options of ``config`` (see :class:`pykvtier.config.DiskTierConfig`)."""
        tier = cls.__new__(cls)
        tier._start(config, arena)
        return tier

    @_undo_on_failure
    def _start(self, cfg: DiskTierConfig, arena: Any) -> None:
        self.config = cfg
        self._device_options = cfg.device_path
        self.device_path = None  # the pykvtier.gpu.PathChoice of a device arena
        self.block_size_bytes = cfg.block_size_bytes
        self.file_bytes = cfg.block_size_bytes + HEADER_BYTES
        self.capacity_bytes = cfg.capacity_bytes
        self.shared, self.fsync, self.verify = cfg.shared, cfg.fsync, cfg.verify
        self.recycle = cfg.recycle and not cfg.shared and not cfg.fsync
        self.probe_ttl_s = cfg.probe_ttl_s
        self.file_mode = cfg.mode
        self.dir_mode = dir_mode_of(cfg.mode)
        self._stats: dict[str, int] = dict.fromkeys(_TIER_STATS, 0)
        self.layout = Layout(cfg.root_dir, self.dir_mode, make_dirs=False)
        # Locked before anything under the root changes; released by shutdown() (or at once
        # when the start fails: _undo_on_failure).
        self._root_lock = lock_root(self.layout.root, cfg.shared, file_mode=self.file_mode)
        self.layout.make_dirs()
        self.layout.check_block_size(cfg.block_size_bytes, self.file_mode)
        self._quarantine_box = Quarantine(self.layout, cfg.quarantine_max_files)
        self.direct = self._choose_direct(cfg.direct)
        self._submit_options = _native.SubmitOptions(  # every block job's, checked once
            direct=self.direct, align=self.align, mem_align=self.mem_align, fsync=self.fsync,
            file_mode=self.file_mode, verify=self.verify)
        self._host_engine = make_host_engine(cfg.engine, cfg.queue_depth, cfg.max_inflight_bytes,
                                             cfg.store_share)
        self._probe = ExistenceProbe(entries=_PROBE_RING_ENTRIES) if cfg.shared else None
        self._init_state(cfg)
        if cfg.shared:
            self._keeper = RootKeeper(self.layout.root, self.layout.blocks_dir,
                                      self.layout.block_path, Layout.digest_from_name,
                                      self.file_bytes, cfg.capacity_bytes, self.min_free_bytes,
                                      self.file_mode, self.dir_mode)
        self._use_engine()
        # Temporaries named with this pid belong to a live writer if another tier of this
        # process uses the root; else they are a dead process's (pid reused) and are swept.
        self._own_pid_live = any(t.layout.root == self.layout.root for t in _open_tiers)
        _open_tiers.add(self)
        self._scan()
        if arena is not None:
            self.set_arena(arena)

    def _choose_direct(self, direct: bool | None) -> bool:
        """O_DIRECT or not (``direct`` None: where the root takes it); sets the alignments.
        ValueError when direct=True cannot work at the root."""
        dio = _native.probe_direct(self.layout.blocks_dir)
        self.align = max(4096, int(dio["offset_align"]))
        self.mem_align = max(4096, int(dio["mem_align"]))
        # Header and payload are each O_DIRECT transfers: both sizes must be aligned.
        unaligned = next((f"{what}={n} is not a multiple of {self.align}" for what, n in
                          (("block_size_bytes", self.block_size_bytes), ("header", HEADER_BYTES))
                          if n % self.align), None)
        if direct is None:
            direct = bool(dio["direct"]) and unaligned is None
            if not direct:
                why = dio["reason"] if not dio["direct"] else unaligned
                logger.warning("pykvtier: O_DIRECT not used at %s (%s); buffered I/O instead",
                               self.layout.root, why)
                self._stats["direct_fallbacks"] += 1
        elif direct and not dio["direct"]:
            raise ValueError(f"direct=True but {self.layout.root} refuses O_DIRECT: {dio['reason']}")
        elif direct and unaligned is not None:
            raise ValueError(f"direct=True but {unaligned} bytes, the O_DIRECT alignment at "
                             f"{self.layout.root}")
        return direct

    def _init_state(self, cfg: DiskTierConfig) -> None:
        """The index, the jobs in flight and the bookkeeping, empty."""
        # digest -> state, loads reading it, failed mark; LRU order of present blocks
        self._bindex = _native.BlockIndex(unknown_is_miss=not cfg.shared)
        self._used_bytes = 0  # file bytes of present + writing + removing blocks
        self._space: Any = None  # _native.BlockSpace of the arena (set_arena)
        self._claims: Any = None  # _native.SlotClaims: slots loads in flight write (set_arena)
        self._removed: list[bytes] | None = [] if cfg.track_removals else None
        self._keeper: RootKeeper | None = None  # a shared root's capacity (pykvtier.sharing)
        self._awaiting: list[_Pending] = []  # a shared tier's stores waiting for a grant, FIFO
        # digests the root's evictor evicted that were being read, pinned or written here then
        self._evicted_later: dict[bytes, None] = {}
        # digest -> its index in the next probe batch (first asked first), until the step's end
        self._probe_wanted: dict[bytes, int] = {}
        # probe batches in flight: (first ticket, digest -> index), digests whose result was not
        # applied yet; a batch leaves the list once empty
        self._probing: list[tuple[int, dict[bytes, int]]] = []
        self._probe_misses: dict[bytes, float] = {}  # digest -> time the MISS expires
        self._pending: dict[int, _Pending] = {}  # engine job id -> caller job
        self._evicting: dict[int, list[bytes]] = {}  # engine job id -> digests being removed
        self._retry_after: dict[int, _Pending] = {}  # eviction's engine job id -> store to retry
        self._polled: list = []  # engine results polled, not settled yet (see drain)
        self._writing = 0  # WRITING blocks
        self._recycle_failures_seen = 0
        self._leftovers: dict[str, bytes | None] = {}  # unremovable file -> digest of its name
        self._leftover_digests: set[bytes] = set()  # block names among them
        self._leftover_retry_at = 0.0
        self._warn_counts: dict[tuple[str, str], list] = {}  # (what, reason) -> [count, a path]
        self._warn_at = 0.0
        min_free = cfg.min_free_bytes
        if min_free is None:  # 5 % of the file system
            try:
                st = os.statvfs(self.layout.blocks_dir)
                min_free = st.f_blocks * st.f_frsize // 20
            except OSError:
                min_free = 0
        self.min_free_bytes = min_free
        if cfg.capacity_bytes is None and not cfg.shared:
            self._warn_memory_root()
        self._fs_free = 0  # estimated free bytes of the root's file system (see _fs_room)
        self._fs_checked_at = -math.inf
        self._ready: list[JobResult] = []  # results settled without the engine
        self._job_ids: set[int] = set()  # caller job ids in flight
        self._next_engine_job = 1
        self._arena: Arena | None = None
        self._closed = False

    # ------------------------------------------------------------------ set-up

    def _scan(self) -> None:
        """Rebuilds the index from the blocks on disk, removes stale temporaries and moves what
        is not a block file of this tier to the quarantine. Lists, unlinks and renames relative
        to descriptors of the real fan-out directories: nothing is followed through a link (a
        fan-out replaced by a link since Layout.make_dirs() is skipped, with a warning)."""
        found: list[tuple[float, bytes]] = []
        now = time.time()
        bfd = self.layout.open_dir("blocks")
        try:
            for i in range(256):
                sub = f"{i:02x}"
                try:
                    dfd = Layout.open_subdir(bfd, sub)
                except OSError as exc:
                    logger.warning("pykvtier: %s/%s not scanned: %s", self.layout.blocks_dir, sub,
                                   exc.strerror)
                    continue
                try:
                    self._scan_dir(dfd, sub, now, found)
                finally:
                    os.close(dfd)
        finally:
            os.close(bfd)
        if self._stats["malformed_block_files"]:
            logger.warning("pykvtier: %d entries under %s at block names are not %d-byte block "
                           "files in their fan-out directory (truncated, not regular files, "
                           "misnamed or misplaced); moved to %s",
                           self._stats["malformed_block_files"], self.layout.blocks_dir,
                           self.file_bytes, self.layout.quarantine_dir)
        found.sort()
        add = self._bindex.add_present
        for _, digest in found:
            add(digest)
        self._used_bytes = len(found) * self.file_bytes
        if (self.capacity_bytes is not None and self._used_bytes > self.capacity_bytes
                and self._keeper is None):  # (a shared root's evictor keeps its capacity)
            self._evict(self._used_bytes - self.capacity_bytes)

    def _scan_dir(self, dfd: int, sub: str, now: float, found: list[tuple[float, bytes]]) -> None:
        """One fan-out directory of :meth:`_scan` (``dfd``: its descriptor)."""
        with os.scandir(dfd) as it:
            entries = list(it)
        for de in entries:
            digest = Layout.digest_from_name(de.name)
            if (digest is None and de.name.endswith(BLOCK_SUFFIX)) or (
                    digest is not None and de.name[:2] != sub):
                # A name no block of this tier has (upper-case hex, spaces...) or a block
                # outside its fan-out: never loaded (lookups would miss it or count it twice).
                self._stats["malformed_block_files"] += 1
                self._quarantine_entry(dfd, sub, de.name)
                continue
            if digest is not None:
                try:
                    st = de.stat(follow_symlinks=False) if de.is_file(
                        follow_symlinks=False) else None
                except FileNotFoundError:  # removed meanwhile (a root shared with others)
                    continue
                if st is None or st.st_size != self.file_bytes:
                    # The root's marker says the block size, so this is no block of any tier
                    # (truncated, a directory, a link...): moved out of the way, so that storing
                    # the key again works.
                    self._stats["malformed_block_files"] += 1
                    self._quarantine_entry(dfd, sub, de.name)
                    continue
                found.append((st.st_mtime, digest))
                continue
            owner = Layout.tmp_owner(de.name)
            if owner is None or not self._stale_tmp(owner, dfd, de.name, now, self._own_pid_live,
                                                    self.shared):
                continue
            path = os.path.join(self.layout.blocks_dir, sub, de.name)
            try:
                os.unlink(de.name, dir_fd=dfd)
                self._stats["stale_temporaries_removed"] += 1
            except FileNotFoundError:
                pass
            except OSError as exc:  # e.g. a directory left at a temporary name
                logger.warning("pykvtier: cannot remove stale temporary %s (%s); moving it to %s",
                               path, exc, self.layout.quarantine_dir)
                self._quarantine_entry(dfd, sub, de.name)

    def _warn_memory_root(self) -> None:
        """A root on tmpfs/ramfs without capacity_bytes whose file system is larger (less
        min_free_bytes) than the memory available: its blocks could take memory the machine
        does not have (tmpfs's size is not free memory), so say so once."""
        try:
            name = _MEMORY_FS.get(_native.statfs_type(self.layout.root))
            st = os.statvfs(self.layout.root)
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            return
        room = st.f_blocks * st.f_frsize - self.min_free_bytes
        if name is not None and (st.f_blocks == 0 or room > available):
            logger.warning("pykvtier: root %s is on %s (memory): with capacity_bytes=None its "
                           "blocks may use %s, more than the %.1f GiB of memory available; set "
                           "capacity_bytes", self.layout.root, name,
                           "memory without bound" if st.f_blocks == 0 else
                           f"{room / 2**30:.1f} GiB", available / 2**30)

    @staticmethod
    def _stale_tmp(owner: int, dfd: int, name: str, now: float, own_pid_live: bool,
                   shared: bool) -> bool:
        """Whether a temporary (named with its writer's pid ``owner``) is a dead writer's. On a
        shared root by age only: its writer may be in another pid namespace or on another node."""
        if not shared:
            if owner <= 0 or (owner == os.getpid() and not own_pid_live):
                return True
            try:
                os.kill(owner, 0)
            except ProcessLookupError:
                return True
            except PermissionError:
                pass
        try:  # a live writer never takes an hour
            return now - os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mtime > 3600
        except FileNotFoundError:
            return False

    @property
    def arena(self) -> Arena | None:
        """The host arena :meth:`set_arena` set (None before)."""
        return self._arena

    def set_arena(self, buffer: Any, slot_bytes: int | None = None, *, spanning: bool = False) -> Arena:
        """Sets the host arena that jobs' ``slot_ids`` index, and registers it as io_uring fixed
        buffers. ``buffer``: numpy array, buffer-protocol object or CPU torch tensor, writable,
        page-aligned. ``slot_bytes`` >= block_size_bytes: by default a multi-dimensional
        arena's row (one slot per row; a row shorter than a block is a ValueError), else
        ``block_size_bytes``.
        ``spanning=True`` (host arenas): blocks may start at any slot, slots being ``slot_bytes``
        apart (default and minimum: the O_DIRECT memory alignment, 4096; a multiple of it), and
        a block covers ``ceil(block_size_bytes / slot_bytes)`` consecutive slots: for an
        allocator's arena whose objects start at any page (LMCache's). Slot ``s`` is bytes
        ``[s * slot_bytes, + block_size_bytes)``; jobs in flight may not cover one slot twice
        unless all of them are stores (ValueError naming the slot, as for plain slots).
        A CUDA tensor makes a device arena: blocks move by the path of ``device_path``
        (:mod:`pykvtier.engines.gpu`; ``self.device_path`` says which and why).
        Raises ValueError (naming address and alignment) for misaligned or read-only memory.
        Blocks until the engine has registered (pinned) the memory: a one-time cost.
        Call only while no job is in flight."""
        if self._closed:
            raise RuntimeError("DiskTier is shut down")
        if self._pending:
            raise RuntimeError("set_arena() while jobs are in flight")
        if not isinstance(spanning, bool):
            raise TypeError(f"spanning must be a bool, got {spanning!r}")
        if spanning:
            if slot_bytes is None:
                slot_bytes = self.mem_align
            if isinstance(slot_bytes, bool) or not isinstance(slot_bytes, int):
                raise TypeError(f"slot_bytes must be an int, got {slot_bytes!r}")
            if slot_bytes <= 0 or slot_bytes % self.mem_align:
                raise ValueError(f"a spanning arena's slot_bytes ({slot_bytes}) must be a positive "
                                 f"multiple of {self.mem_align}")
        arena = as_arena(buffer, slot_bytes, default_slot_bytes=self.block_size_bytes)
        if spanning:
            if arena.device != "cpu":
                raise ValueError("a spanning arena is host memory; a device arena's slots are apart")
            span = -(-self.block_size_bytes // arena.slot_bytes)
            if arena.nbytes // arena.slot_bytes < span:
                raise ValueError(f"arena of {arena.nbytes} bytes is smaller than one block "
                                 f"({self.block_size_bytes} bytes)")
            arena = dataclasses.replace(arena, span=span)
        if arena.readonly:
            raise ValueError("arena is read-only: loads must write into it")
        if not spanning and arena.slot_bytes < self.block_size_bytes:
            raise ValueError(f"arena slots of {arena.slot_bytes} bytes are smaller than a block "
                             f"({self.block_size_bytes} bytes)")
        if arena.device != "cpu":
            self._attach_device_arena(arena)
            return arena
        if self.device_path is not None:
            raise ValueError("this tier moves blocks to a device arena; use another DiskTier for a host arena")
        if self.direct:
            for what, v in (("address", arena.addr), ("slot stride", arena.slot_bytes)):
                if v % self.mem_align:
                    raise ValueError(
                        f"arena {what} {hex(v) if what == 'address' else v} is not a multiple of "
                        f"{self.mem_align} bytes, the page alignment pykvtier asks of O_DIRECT "
                        f"arenas at {self.layout.root}; use page-aligned memory, e.g. "
                        "pykvtier.host_arena()")
        self._engine.unregister_buffers()
        self._engine.register_buffer(arena.addr, arena.nbytes)
        # Registration pins (and faults in) the whole arena: a one-time cost, paid here.
        failures = self._engine.stats()["buffer_registration_failures"]
        self._engine.await_buffers()
        st = self._engine.stats()
        if st["buffer_registration_failures"] > failures:
            logger.warning("pykvtier: registering the arena as io_uring fixed buffers failed (%s); "
                           "loads use plain reads (raise RLIMIT_MEMLOCK to fix)",
                           os.strerror(st["buffer_registration_errno"]))
        if self._arena is not None and self._arena is not arena:
            self._arena.release()  # the rings have let go of it (await_buffers)
        self._arena = arena
        self._space = self._block_space(arena)
        self._claims = _native.SlotClaims(arena.num_slots, arena.span)
        return arena

    def _block_space(self, arena: Arena) -> Any:
        """Where the engine's block requests go: this root's block files, ``arena``'s slots."""
        return _native.BlockSpace(self.layout.blocks_dir, self.block_size_bytes, arena.addr,
                                  arena.slot_bytes, arena.num_slots, arena.span > 1)

    def _use_engine(self, build: Any = None) -> None:
        """The one place the tier's engine is set: the host engine, or with ``build`` (host
        engine -> (engine, name)) a device arena's. The current engine is drained and its
        evictions applied first; a device arena's engine is shut down before the next one is
        built (both drive the host engine's registered buffers)."""
        old = self.__dict__.get("_engine")
        if old is not None:
            old.drain()
            self._collect()  # no caller job is in flight: only the tier's evictions
            if old is not self._host_engine:
                old.shutdown()
        self._engine, name = self._host_engine, self._host_engine.name
        if build is not None:
            self._engine, name = build(self._host_engine)
        self.engine_name = name

    def _attach_device_arena(self, arena: Arena) -> None:
        """Points the tier at the device ``arena`` through the path of ``device_path`` (see
        :mod:`pykvtier.engines.gpu`); ValueError when a forced path cannot work here."""
        from .engines.gpu import choose_device_path, device_engine

        opts = self._device_options
        choice = choose_device_path(self._host_engine, opts, self.layout.blocks_dir)
        self._use_engine(lambda host: device_engine(host, arena, opts, choice, str(self.layout.root),
                                                    self.block_size_bytes))
        self.device_path = choice
        self._arena = arena
        self._space = self._block_space(arena)
        self._claims = _native.SlotClaims(arena.num_slots)

    # ------------------------------------------------------------------ phase 1

    def lookup(self, key: bytes) -> LookupResult:
        """Is ``key``'s block here? Never blocks (microseconds); see :class:`LookupResult`.
        Semantics as docs/design.md's table and vLLM's SecondaryTierManager.lookup, plus HIT_PENDING
        for a block whose load is in flight. TypeError for a key that is not bytes."""
        r = self._bindex.lookup_key(key)  # (RuntimeError once shut down)
        if r != _UNKNOWN:
            return _ANSWERS[r]
        return self._counted(self._lookup_unknown(key_digest(_as_key(key))))

    @property
    def lookup_code(self) -> Any:
        """:meth:`lookup` as a function of the key returning an int: 0 HIT, 1 MISS, 2 RETRY,
        3 HIT_PENDING, or 4 for a key the index does not know on a ``shared`` tier (call
        :meth:`lookup` for its answer then). One call into C++ per key, for integrations that
        map the answer to their own type (e.g. the vLLM adapter); valid for the tier's life."""
        return self._bindex.lookup_key

    def lookup_digest(self, digest: bytes) -> LookupResult:
        """:meth:`lookup` of the key whose :func:`~pykvtier.layout.key_digest` is ``digest``
        (for callers that computed it already, e.g. to pick a shard)."""
        r = self._bindex.lookup(digest)
        if r != _UNKNOWN:
            return _ANSWERS[r]
        return self._counted(self._lookup_unknown(digest))

    def holds(self, digest: bytes) -> bool:
        """Whether the block of the key whose key_digest is ``digest`` is in the tier now (stored
        and not being evicted), from the index alone: no probe, nothing counted (lookup's
        statistics are the engine's questions). For an adapter's stored events."""
        return self._bindex.state(digest) == _PRESENT

    def pin(self, digests: Iterable[bytes]) -> list[bool]:
        """Holds blocks against eviction and removal, as a load in flight holds the block it
        reads, until :meth:`unpin`: one bool per digest (16-byte key digests), True where the
        block is present (and now pinned; pinned twice, it needs two unpins), False where it is
        not (nothing held). A pinned block still counts in ``used_bytes``: with every block
        pinned, stores needing room fail. For engines with pin/unpin semantics (LMCache's
        ``StorageBackendInterface.pin``)."""
        ds = list(digests)
        if self._closed:
            raise RuntimeError("DiskTier is shut down")
        codes = self._bindex.admit_loads(b"".join(ds))
        out = [True] * len(ds) if codes is None else [c == _ADMIT_OK for c in codes]
        if self._keeper is not None:  # in use: the root's evictor takes older blocks first
            self._keeper.used([d for d, ok in zip(ds, out) if ok])
        return out

    def unpin(self, digests: Iterable[bytes]) -> None:
        """Releases what :meth:`pin` held (only digests it answered True for, once per True). A
        pinned block whose load failed meanwhile is dropped with its last pin."""
        ds = b"".join(digests)
        if ds and not self._closed:
            self._used_bytes -= self._bindex.finish_loads(ds) * self.file_bytes

    def remove(self, digests: Iterable[bytes]) -> list[bool]:
        """Removes present blocks that no load reads and nobody pinned: from now on MISS (the
        files are unlinked asynchronously, as evictions are); one bool per digest, True where
        removed. Counted in ``stats()["blocks_removed"]``; announced by :meth:`take_removed`.
        For engines' explicit removal (LMCache's ``remove``)."""
        if self._closed:
            raise RuntimeError("DiskTier is shut down")
        out, gone = [], []
        for d in digests:
            ok = bool(self._bindex.set_removing(d))
            out.append(ok)
            if ok:
                gone.append(d)
        if gone:
            self._stats["blocks_removed"] += len(gone)
            if self._removed is not None:
                self._removed.extend(gone)
            self._used_bytes -= len(gone) * self.file_bytes
            self._fs_free += len(gone) * self.file_bytes
            self._unlink_async(gone)
        return out

    def _counted(self, r: LookupResult) -> LookupResult:
        self._bindex.count(_ANSWER_CODE[r])
        return r

    def _lookup_unknown(self, digest: bytes) -> LookupResult:
        """A shared tier's lookup of a digest the index does not hold: its probe's answer, or a
        probe asked for (RETRY)."""
        for first, batch in self._probing:
            i = batch.get(digest)
            if i is not None:  # in flight: applies this key's probe result only, if it completed
                r = self._probe.take(first + i)
                if r is None:
                    return LookupResult.RETRY
                self._apply_probe(digest, r.size_bytes, r.error, r.mode, r.nlink, _now())
                if digest in self._bindex:  # it was not before: the probe found the block
                    return LookupResult.HIT
                # not found: a MISS for probe_ttl_s (0: expired already, probed again)
                return LookupResult.MISS if self.probe_ttl_s > 0 else self._lookup_unknown(digest)
        if digest in self._probe_wanted:
            return LookupResult.RETRY
        expiry = self._probe_misses.get(digest)
        if expiry is not None:
            if _now() < expiry:
                return LookupResult.MISS
            del self._probe_misses[digest]
        self._probe_wanted[digest] = len(self._probe_wanted)
        return LookupResult.RETRY

    def on_step_end(self) -> None:
        """Once per scheduler step: applies the existence probes that completed, then submits
        those gathered since the last step (one call into C: one batch of statx SQEs, one
        io_uring_submit while the batch fits the ring). Never waits. Also retries the removal
        of leftover files, as :meth:`get_finished_jobs` does. A no-op once shut down (as
        collecting results stays possible; calls that start work raise RuntimeError then)."""
        if self._closed:
            return
        if self._leftovers:
            self._retry_leftovers()
        if self._keeper is not None:
            self._shared_round()
        if self._probe is None:
            return
        if self._probing:
            self._apply_probes()
        if self._probe_wanted:
            wanted, self._probe_wanted = self._probe_wanted, {}
            digests = list(wanted)
            paths, stride = _packed_block_paths(self.layout, digests)
            first = self._probe.submit_packed(digests, paths, stride)
            self._probing.append((first, wanted))
            self._stats["probes"] += len(digests)

    @property
    def probes_in_flight(self) -> bool:
        """Whether existence probes submitted (by :meth:`on_step_end`) have not all been
        applied yet: a key they cover answers RETRY until :meth:`apply_probes` (or its own
        lookup) applies its result. For integrations that answer an existence question within
        one call (SGLang's ``HiCacheStorage.batch_exists``): on_step_end() once, then
        apply_probes() until this is False. Probes asked for but not submitted do not count."""
        return bool(self._probing)

    def apply_probes(self) -> None:
        """Applies the existence probes that completed, without waiting and without submitting
        the ones asked for since (:meth:`on_step_end` does both). A no-op once shut down, or on
        a tier that is not ``shared``."""
        if not self._closed and self._probe is not None and self._probing:
            self._apply_probes()

    def _apply_probes(self, results: Iterable | None = None, max_results: int | None = None) -> None:
        """Applies completed existence probes (polled without waiting; at most ``max_results``,
        all when None), or ``results`` (ProbeResult items)."""
        if results is None:
            c = self._probe.poll_columns(max_results)
            results = zip(c.tokens, c.sizes, c.errors, c.modes, c.nlinks)
        now = _now()
        apply = self._apply_probe
        for digest, size, err, mode, nlink in results:
            apply(digest, size, err, mode, nlink, now)

    def _apply_probe(self, digest: bytes, size: int | None, err: int, mode: int, nlink: int,
                     now: float) -> None:
        """One probe's answer: a HIT only for a regular file (statx does not follow a link),
        with one link, of the block file size."""
        for entry in self._probing:
            if entry[1].pop(digest, None) is not None:
                if not entry[1]:
                    self._probing.remove(entry)
                break
        self._stats["probe_results_applied"] += 1
        if digest in self._bindex:
            return
        if (err == 0 and size == self.file_bytes and nlink == 1 and stat.S_ISREG(mode)
                and self._bindex.add_present(digest)):  # (not a failed block)
            self._used_bytes += self.file_bytes
            self._stats["probe_hits"] += 1
        else:
            self._probe_misses[digest] = now + self.probe_ttl_s

    def touch(self, keys: Iterable[bytes], digests: Iterable[bytes] | None = None) -> None:
        """Marks blocks as recently used (eviction order). ``digests``: the keys'
        :func:`~pykvtier.layout.key_digest`, where the caller has them (``keys`` is then unused).
        RuntimeError once shut down."""
        if self._closed:
            raise RuntimeError("DiskTier is shut down")
        if digests is None:
            self._bindex.touch(_native.key_digests([_as_key(k) for k in keys]))
        else:
            self._bindex.touch(b"".join(digests))

    # ------------------------------------------------------------------ phase 2

    def _check_job(self, job: TransferJob, digests: Iterable[bytes] | None, unique_slots: bool
                   ) -> tuple[list[bytes], bytes, bytes]:
        """The job's keys (a new list of bytes), key digests (16 bytes each) and slots (one
        native int64 each), each of job.keys, job.slot_ids and ``digests`` iterated once, checked in
        one call (_native.check_job: job id, in-flight ids, keys, slots, digests)."""
        if self._closed:
            raise RuntimeError("DiskTier is shut down")
        if self._arena is None:
            raise RuntimeError("no arena: call set_arena() first")
        if digests is not None and not isinstance(digests, (list, tuple)):
            digests = list(digests)
        return _native.check_job(job, self._arena.num_slots, unique_slots, digests, self._job_ids)

    def submit_load(self, job: TransferJob, digests: Sequence[bytes] | None = None) -> None:
        """Loads ``job.keys`` into their arena slots. Returns at once; the result comes from
        :meth:`get_finished_jobs`. A key that is not a HIT fails (reported per key) without I/O.
        ``digests``: the keys' :func:`~pykvtier.layout.key_digest`, one per key, where the
        caller computed them already (else computed here).
        Raises ValueError/TypeError for a malformed job (nothing is submitted then), e.g. two
        keys into one slot (their reads would race, and each block's checksum is verified over
        the bytes in its slot)."""
        keys, digests, slots = self._check_job(job, digests, unique_slots=True)
        self._claims.claim(job.job_id, slots, True)  # ValueError: a slot another job uses
        codes = self._bindex.admit_loads(digests)  # None: every key admitted
        pend = _Pending(job, True, keys, keys, digests, slots, {}, claimed=slots)
        if codes is not None:
            keep = [i for i, c in enumerate(codes) if c == _ADMIT_OK]
            for i, c in enumerate(codes):
                if c != _ADMIT_OK:
                    pend.done[keys[i]] = _LOAD_REFUSED[c]
                    self._stats["loads_refused"] += 1
                    self._warn("loads refused without I/O", _LOAD_REFUSED[c],
                               self.layout.block_path(digests[16 * i:16 * i + 16]))
            pend.keys = [keys[i] for i in keep]
            pend.digests = b"".join(digests[16 * i:16 * i + 16] for i in keep)
            pend.slots = b"".join(slots[8 * i:8 * i + 8] for i in keep)
        self._stats["loads_submitted"] += 1
        self._dispatch(pend, Op.READ_BLOCK)

    def submit_store(self, job: TransferJob, digests: Sequence[bytes] | None = None) -> None:
        """Stores the arena slots of ``job.keys``. Returns at once. Keys already present (or
        being written) are skipped and count as stored; eviction makes room (see
        ``capacity_bytes``, ``min_free_bytes``); a key that cannot get room fails (reported per
        key). A key that meets a full file system (ENOSPC, EDQUOT) evicts as many blocks and is
        written once more before the job is reported. ``digests``: as for :meth:`submit_load`."""
        keys, digests, slots = self._check_job(job, digests, unique_slots=False)
        self._claims.claim(job.job_id, slots, False)  # ValueError: a slot a load is filling
        pend = _Pending(job, False, keys, keys, digests, slots, {}, claimed=slots)
        self._stats["stores_submitted"] += 1
        if self._keeper is not None and (self._awaiting or self._grant_needed(digests) > 0):
            # A shared root: its new blocks wait for the evictor's grant (FIFO), applied from
            # get_finished_jobs(), on_step_end(), wait() and drain().
            pend.grant_deadline = _now() + _GRANT_WAIT_S
            self._awaiting.append(pend)
            self._job_ids.add(operator.index(job.job_id))
            self._stats["stores_waited_for_grant"] += 1
            self._announce_want()
            return
        self._admit_store(pend)

    def _grant_needed(self, digests: bytes) -> int:
        """A shared tier's store: bytes of its new blocks beyond what its grant leaves."""
        _, codes = self._bindex.admit_stores(digests, 0)  # (max_new 0: the index is unchanged)
        if codes is None:
            return 0
        new = {digests[16 * i:16 * i + 16] for i, c in enumerate(codes) if c == _ADMIT_NEEDS_ROOM}
        return len(new) * self.file_bytes - self._keeper.room()

    def _announce_want(self) -> None:
        """Tells the root's evictor how many bytes this tier's waiting stores need, and of
        those the first one (the evictor grants first stores whole, first come first served)."""
        fb = self.file_bytes
        need = first = 0
        for pend in self._awaiting:
            _, codes = self._bindex.admit_stores(pend.digests, 0)
            if codes is not None:
                need += len({pend.digests[16 * i:16 * i + 16] for i, c in enumerate(codes)
                             if c == _ADMIT_NEEDS_ROOM}) * fb
            if pend is self._awaiting[0]:
                first = need
        self._keeper.want(need, first)

    def _admit_waiting(self) -> None:
        """Admits a shared tier's waiting stores, in order, once the grant covers each (or its
        wait is over: the keys without room then fail "no capacity")."""
        if not self._awaiting:
            return
        now = _now()
        while self._awaiting:
            pend = self._awaiting[0]
            if now < pend.grant_deadline and self._grant_needed(pend.digests) > 0:
                break
            self._awaiting.pop(0)
            try:
                self._admit_store(pend)
            except Exception as exc:  # the engine refused the entries: the job fails, reported
                logger.error("pykvtier: a store waiting for room could not be submitted: %s", exc)
                pend.done.update((k, f"submit failed: {exc}") for k in pend.job_keys)
                pend.claimed = b""  # (released by _unadmit)
                self._ready.append(self._result(pend))
        self._announce_want()

    def _admit_store(self, pend: _Pending) -> None:
        """Admits a store's keys into the index (room from capacity and free space, or a shared
        root's grant) and hands the new ones to the engine."""
        keys, digests, slots = pend.keys, pend.digests, pend.slots
        fb = self.file_bytes
        if self._keeper is not None:
            room = self._keeper.room()
        else:
            room = self._fs_room()  # the free-space estimate (statvfs at most every _FS_CHECK_S)
            if self.capacity_bytes is not None:
                room = min(room, self.capacity_bytes - self._used_bytes)
        # New blocks that fit without eviction are admitted in one call; the rest (and every key
        # while leftover files hold block names) take the per-key path below.
        max_new = 0 if self._leftover_digests else max(0, min(room // fb, len(keys)))
        n_new, codes = self._bindex.admit_stores(digests, max_new)
        if self._keeper is not None and n_new:
            self._keeper.reserve(n_new * fb)  # (within room(): the grant only grows meanwhile)
        self._used_bytes += n_new * fb
        self._fs_free -= n_new * fb
        self._writing += n_new
        if codes is not None:
            self._admit_stores_slowly(pend, keys, slots, digests, codes)
        if self._probe_misses:
            for d in _split(pend.digests):
                self._probe_misses.pop(d, None)
        self._dispatch(pend, Op.WRITE_BLOCK)

    def _admit_stores_slowly(self, pend: _Pending, keys: list[bytes], slots: bytes,
                             digests: bytes, codes: bytes) -> None:
        """The keys of a store the index did not admit at once: present ones skipped, evicted
        ones refused, new ones given room one by one (evicting, perhaps recycling a victim's
        file). Sets the pending job's entries."""
        done, index = pend.done, self._bindex
        pend.keys, slot_parts, parts = [], [], []
        # The job's blocks already present count as stored: none is evicted to make room for
        # its new ones (moved to most recently used, and kept out of the victims).
        keep = [digests[16 * i:16 * i + 16] for i, c in enumerate(codes) if c == _ADMIT_PRESENT
                or (c == _ADMIT_NEEDS_ROOM and index.state(digests[16 * i:16 * i + 16]) == _PRESENT)]
        if keep:
            index.touch(b"".join(keep))
        for i, c in enumerate(codes):
            key, digest = keys[i], digests[16 * i:16 * i + 16]
            if c == _ADMIT_NEEDS_ROOM:
                st = index.state(digest)  # (a key given twice: the first one's entry)
                c = _ADMIT_PRESENT if st in (_PRESENT, _WRITING) else (
                    _ADMIT_REMOVING if st == _REMOVING else c)
            if c == _ADMIT_PRESENT:
                done[key] = None
                self._stats["stores_skipped_present"] += 1
                continue
            if c == _ADMIT_REMOVING:
                done[key] = "block is being evicted"
                self._stats["stores_refused_evicting"] += 1
                continue
            if c == _ADMIT_NEEDS_ROOM:
                if digest in self._leftover_digests:
                    done[key] = "an earlier file of this block could not be removed yet"
                    continue
                room = self._reserve(recycle=True, keep=keep)
                if room is False:
                    self._refuse_store(done, key)
                    continue
                index.insert_writing(digest)
                self._writing += 1
                if room is not True:  # an evicted block's file to reuse
                    pend.victims[len(parts)] = room
            pend.keys.append(key)
            slot_parts.append(slots[8 * i:8 * i + 8])
            parts.append(digest)
        pend.digests = b"".join(parts)
        pend.slots = b"".join(slot_parts)

    def _refuse_store(self, done: dict, key: bytes) -> None:
        """A key that gets no room: failed, counted, warned about."""
        done[key] = (
            f"no capacity: the shared root's evictor granted no room within {_GRANT_WAIT_S:g} s "
            f"({self._keeper.describe()})"
            if self._keeper is not None else
            "no capacity: every block is in use"
            if self.capacity_bytes is not None
            and self._used_bytes + self.file_bytes > self.capacity_bytes
            else f"no room: free space at {self.layout.root} is below min_free_bytes="
                 f"{self.min_free_bytes} and every block is in use")
        self._stats["capacity_rejections"] += 1
        self._warn("stores refused", done[key], self.layout.root)

    def _submit(self, op: Any, pend: _Pending) -> int:
        """Hands the pending job's blocks to the engine as one job; returns its engine job id."""
        eid = self._next_engine_job
        self._next_engine_job += 1
        self._engine.submit_blocks(eid, op, self._space, pend.digests, pend.slots,
                                   pend.victims or None, self._submit_options)
        return eid

    def _dispatch(self, pend: _Pending, op: Any) -> None:
        job_id = operator.index(pend.job.job_id)  # (an int: as JobResult reports it)
        if not pend.digests:
            self._ready.append(self._result(pend))
            self._job_ids.add(job_id)
            return
        try:
            eid = self._submit(op, pend)
        except Exception:
            self._unadmit(pend)
            raise
        self._pending[eid] = pend
        self._job_ids.add(job_id)

    def _unadmit(self, pend: _Pending) -> None:
        """Undoes the admission of a job the engine refused at submit (nothing of it ran: no
        failure is counted or logged; the caller has the exception)."""
        fb = self.file_bytes
        for v in pend.victims.values():  # their files were not touched: blocks again
            if self._bindex.restore(v):
                self._used_bytes += fb
        pend.victims.clear()
        if pend.is_load:
            self._used_bytes -= self._bindex.finish_loads(pend.digests) * fb
        else:
            for d in _split(pend.digests):
                self._forget_writing(d)
            if self._keeper is not None:
                self._keeper.settle(len(pend.digests) // 16 * fb)
        self._claims.release(pend.claimed, pend.is_load)

    def _reserve(self, recycle: bool = False, keep: Iterable[bytes] = ()) -> bool | bytes:
        """Makes room for one block file: True (room), False (no room: capacity or the file
        system's free space above ``min_free_bytes`` exhausted by blocks in use), or, with
        ``recycle`` where the tier recycles, the digest of the evicted block whose file the new
        block takes over (its bytes stay counted; it needs no new space). Blocks in ``keep``
        (digests) are not evicted for it."""
        fb = self.file_bytes
        if self._keeper is not None:  # a shared root: its evictor makes the room
            if not self._keeper.reserve(fb):
                return False
            self._used_bytes += fb
            self._fs_free -= fb
            return True
        cap_need = -1 if self.capacity_bytes is None else (
            self._used_bytes + fb - self.capacity_bytes)
        free_need = fb - self._fs_room()  # > 0: this block would eat into min_free_bytes
        if cap_need <= 0 and free_need <= 0:
            self._used_bytes += fb
            self._fs_free -= fb
            return True
        victim: bytes | None = None
        if recycle and self.recycle and self.device_path is None:
            for victim in self._take_victims(1, keep):
                self._stats["evictions_recycled"] += 1
                cap_need -= fb
                free_need -= fb
        need = max(cap_need, free_need)
        if need > 0:
            self._evict(need, keep)
        if victim is not None:
            return victim  # REMOVING until the store that reuses its file finished
        if ((self.capacity_bytes is None or self._used_bytes + fb <= self.capacity_bytes)
                and self._fs_room() >= fb):
            self._used_bytes += fb
            self._fs_free -= fb
            return True
        return False

    def _fs_room(self) -> int:
        """Bytes the root's file system is estimated to have free beyond ``min_free_bytes``:
        statvfs at most every _FS_CHECK_S (less the writes, plus the unlinks, in flight), and
        the tier's own stores and evictions since then."""
        now = _now()
        if now >= self._fs_checked_at + _FS_CHECK_S:
            try:
                st = os.statvfs(self.layout.blocks_dir)
            except OSError as exc:
                logger.debug("pykvtier: statvfs(%s): %s", self.layout.blocks_dir, exc)
                st = None
            if st is None or st.f_blocks == 0:
                # No space figures (statvfs failed, or a file system that reports none: ramfs,
                # some FUSE layers): the reserve cannot be kept; ENOSPC handling still applies.
                self._fs_free = _NO_FS_FIGURES
            else:
                unlinking = sum(map(len, self._evicting.values()))
                self._fs_free = (st.f_bavail * st.f_frsize
                                 - (self._writing - unlinking) * self.file_bytes)
            self._fs_checked_at = now
        return self._fs_free - self.min_free_bytes

    def _take_victims(self, n: int, keep: Iterable[bytes] = ()) -> list[bytes]:
        """Evicts up to n least recently used blocks not being read (nor in ``keep``): out of
        the LRU, REMOVING (their files are still there), counted. Returns their digests."""
        victims = self._bindex.take_victims(n, list(keep) or None)
        self._stats["evictions"] += len(victims)
        if self._removed is not None:
            self._removed.extend(victims)
        return victims

    def _evict(self, need_bytes: int, keep: Iterable[bytes] = ()) -> int | None:
        """Removes least recently used blocks not being read until need_bytes are freed;
        returns the engine job id of their unlinks (None: nothing to evict). The files are
        unlinked asynchronously by the engine; their bytes stop counting at once (the names
        are REMOVING until then: a store of such a key fails meanwhile). A file whose unlink
        fails is counted again and retried (a leftover)."""
        victims = self._take_victims(-(-need_bytes // self.file_bytes), keep)
        if not victims:
            return None
        self._used_bytes -= len(victims) * self.file_bytes
        self._fs_free += len(victims) * self.file_bytes
        return self._unlink_async(victims)

    def _unlink_async(self, digests: list[bytes]) -> int | None:
        """Removes block files through the engine (a store-priority job); its engine job id."""
        if not digests:
            return None
        eid = _INTERNAL_JOB + self._next_engine_job
        self._next_engine_job += 1
        self._engine.submit(eid, Op.UNLINK, [self.layout.block_path(d) for d in digests])
        self._evicting[eid] = digests
        return eid

    # ------------------------------------------------------------------ completion

    def get_finished_jobs(self) -> list[JobResult]:
        """Jobs finished since the last call, each exactly once. Never blocks. Also retries
        the removal of leftover files (at most every second) and logs the failures counted
        since the last report (at most one line every few seconds)."""
        if self._closed:  # settled by shutdown(): reported once more, nothing else done
            out, self._ready = self._ready, []
            self._job_ids.difference_update(r.job_id for r in out)
            return out
        if self._keeper is not None:
            self._shared_round()
        self._collect()
        out, self._ready = self._ready, []
        if out:  # a job id is in flight until its result is reported
            self._job_ids.difference_update(r.job_id for r in out)
        if self._leftovers:
            self._retry_leftovers()
        if self._warn_counts:
            self._flush_warnings()
        if self._probing:  # a bounded slice: the rest is applied by lookup() and on_step_end()
            self._apply_probes(max_results=_FINISHED_PROBE_SLICE)
        return out

    def _shared_round(self) -> None:
        """A shared tier: drops the blocks the root's evictor announced (a MISS from now on, for
        probe_ttl_s, as after a probe's "not found"), then admits the stores its grant covers.
        A block being read, pinned or written here when its eviction is announced is dropped
        once it can be (at a later round)."""
        gone = self._keeper.take_evicted()
        if self._evicted_later:
            gone = [*self._evicted_later, *gone]
            self._evicted_later = {}
        if gone:
            expiry = _now() + self.probe_ttl_s
            n = 0
            for d in gone:
                if self._bindex.set_removing(d):  # present and not being read
                    self._bindex.forget_removed(d)
                    self._used_bytes -= self.file_bytes
                    if self._removed is not None:
                        self._removed.append(d)
                    self._probe_misses[d] = expiry
                    n += 1
                elif self._bindex.state(d) in (_PRESENT, _WRITING):
                    self._evicted_later[d] = None  # (its file is gone: kept, it would be a HIT)
                elif d not in self._bindex and d not in self._probe_wanted:
                    self._probe_misses[d] = expiry
            self._stats["shared_evictions_applied"] += n
        if self._awaiting:
            self._admit_waiting()

    def _poll(self) -> None:
        """Moves what the engine finished to self._polled (not settled yet)."""
        self._polled.extend(self._engine.poll())
        for path in self._engine.take_leftovers():  # before settling: a victim's name stays refused
            self._add_leftover(path)

    def _collect(self) -> None:
        """Settles what the engine finished (results into self._ready)."""
        self._poll()
        finished, self._polled = self._polled, []
        for job in finished:
            eid = job.job_id
            if eid in self._evicting:
                self._finish_eviction(eid, job.results)
                pend = self._retry_after.pop(eid, None)
                if pend is not None:
                    self._resubmit(pend)
                continue
            res = self._settle(self._pending.pop(eid), job.results, job.transfer_s, job.submits)
            if res is not None:
                self._ready.append(res)

    def _finish_eviction(self, eid: int, results: list[int]) -> None:
        for digest, res in zip(self._evicting.pop(eid), results):
            self._bindex.forget_removed(digest)
            if res < 0 and res != -errno.ENOENT:
                self._stats["eviction_failures"] += 1
                path = self.layout.block_path(digest)
                self._warn("evicted files could not be removed (counted; removal retried)",
                           _describe(res), path)
                self._add_leftover(path, digest)

    def _settle(self, pend: _Pending, results: list[int], transfer_s: float = 0.0,
                submits: int = 0) -> JobResult | None:
        """Applies an engine job's results; the caller's result, or None while a store's keys
        that met a full file system are retried (see _retry_store)."""
        pend.transfer_s += transfer_s
        pend.submits += submits
        all_ok = min(results) >= 0
        moved = sum(results) if all_ok else sum(r for r in results if r > 0)
        pend.moved_bytes += moved
        st = self._stats
        no_space: list[tuple[int, int]] = []  # (index in pend.keys, result)
        if pend.is_load:
            self._used_bytes -= self._bindex.finish_loads(pend.digests) * self.file_bytes
            if self._keeper is not None:  # in use: the root's evictor takes older blocks first
                self._keeper.used(list(_split(pend.digests)) if all_ok else [
                    pend.digests[16 * i:16 * i + 16] for i, r in enumerate(results) if r >= 0])
            st["blocks_loaded"] += len(results) if all_ok else sum(r >= 0 for r in results)
            st["bytes_loaded"] += moved
            if not all_ok:
                for i, res in enumerate(results):
                    if res < 0:
                        st["load_failures"] += 1
                        self._load_failed(pend.digests[16 * i:16 * i + 16], res)
                        pend.done[pend.keys[i]] = _describe(res)
        else:
            if self._keeper is not None:  # each entry's reservation is done with (a shared
                self._keeper.settle(len(results) * self.file_bytes)  # tier never retries)
            n_ok = self._bindex.finish_stores(pend.digests, results)
            self._writing -= n_ok
            st["blocks_stored"] += n_ok
            st["bytes_stored"] += moved
            if not all_ok:
                for i, res in enumerate(results):
                    if res >= 0:
                        continue
                    if res in _NO_SPACE and not pend.retried:
                        no_space.append((i, res))  # stays WRITING, its bytes counted
                        continue
                    self._store_failed(pend.digests[16 * i:16 * i + 16], res)
                    pend.done[pend.keys[i]] = _describe(res)
        if pend.victims:  # renamed away and reused, or removed by the engine
            for v in pend.victims.values():
                self._bindex.forget_removed(v)
            pend.victims = {}
            failures = self._engine.stats()["recycle_failures"]
            if failures > self._recycle_failures_seen:
                for _ in range(failures - self._recycle_failures_seen):
                    self._warn("evicted files could be neither reused nor removed",
                               "recycling failed", self.layout.blocks_dir)
                self._recycle_failures_seen = failures
        if no_space and self._retry_store(pend, no_space):
            return None
        return self._result(pend)

    def _store_failed(self, digest: bytes, res: int) -> None:
        self._stats["store_failures"] += 1
        self._forget_writing(digest)
        self._warn("stores failed", _describe(res), self.layout.block_path(digest))

    def _forget_writing(self, digest: bytes) -> None:
        """A WRITING block whose store will not happen: out of the index, its bytes free again."""
        if self._bindex.erase_writing(digest):
            self._writing -= 1
            self._used_bytes -= self.file_bytes
            self._fs_free += self.file_bytes

    def _retry_store(self, pend: _Pending, no_space: list[tuple[int, int]]) -> bool:
        """Keys of a store that met a full file system (ENOSPC, EDQUOT): evicts as many least
        recently used blocks and writes the keys again (once) when their unlinks finished; the
        caller's job is reported after that. False (the keys failed) when nothing can be
        evicted."""
        self._fs_checked_at = -math.inf  # free space is not what it was estimated to be
        eid = None if self._keeper is not None else self._evict(  # (shared: the evictor's job)
            len(no_space) * self.file_bytes, keep=_split(pend.digests))  # not its own
        if eid is None:
            for i, res in no_space:
                self._store_failed(pend.digests[16 * i:16 * i + 16], res)
                pend.done[pend.keys[i]] = _describe(res)
            return False
        pend.retried = True
        # The engine names a new temporary each (the failed one may be a leftover); no file
        # is recycled.
        pend.keys = [pend.keys[i] for i, _ in no_space]
        pend.digests = b"".join(pend.digests[16 * i:16 * i + 16] for i, _ in no_space)
        pend.slots = b"".join(pend.slots[8 * i:8 * i + 8] for i, _ in no_space)
        self._stats["store_retries"] += len(no_space)
        self._retry_after[eid] = pend
        return True

    def _continue_retries(self) -> bool:
        """For drain(): settles only the engine jobs a store's retry needs settled (a store whose
        keys met ENOSPC/EDQUOT, an eviction a retry waits on); the others stay unsettled for
        get_finished_jobs(). True when it submitted more I/O."""
        self._poll()
        keep: list = []
        more = False
        for item in self._polled:
            eid, results = item.job_id, item.results
            if eid in self._retry_after:
                self._finish_eviction(eid, results)
                self._resubmit(self._retry_after.pop(eid))
                more = True
                continue
            pend = self._pending.get(eid)
            if (pend is None or pend.is_load or pend.retried
                    or not any(r in _NO_SPACE for r in results)):
                keep.append(item)
                continue
            res = self._settle(self._pending.pop(eid), results, item.transfer_s, item.submits)
            if res is None:
                more = True
            else:
                self._ready.append(res)
        self._polled = keep
        return more

    def _resubmit(self, pend: _Pending) -> None:
        """Writes a store's retried keys (see _retry_store) once the evictions made room."""
        try:
            eid = self._submit(Op.WRITE_BLOCK, pend)
        except Exception as exc:  # the engine took these entries once: not expected
            logger.error("pykvtier: resubmitting a store failed: %s", exc)
            self._ready.append(self._settle(pend, [-errno.EIO] * len(pend.keys)))
            return
        self._pending[eid] = pend

    def _result(self, pend: _Pending) -> JobResult:
        """The caller's result of a job done with (its slots released)."""
        self._claims.release(pend.claimed, pend.is_load)
        keys = pend.job_keys
        done = pend.done
        failed = {k: done[k] for k in keys if done.get(k) is not None} if done else {}
        ok_keys = [k for k in keys if k not in failed]
        success = not failed
        return JobResult(
            job_id=operator.index(pend.job.job_id),
            success=success,
            successful_keys=None if success or not ok_keys else ok_keys,
            transfer_time=pend.transfer_s,
            transfer_bytes=pend.moved_bytes,
            is_load=pend.is_load,
            failed_keys=failed,
            submits=pend.submits,
        )

    # ------------------------------------------------------------------ leftovers, warnings

    def _add_leftover(self, path: str, digest: bytes | None = None) -> None:
        """A file the tier or its engine could not remove: counted in used_bytes (a whole
        block file) until _retry_leftovers removed it; a block name among them is refused to
        stores meanwhile (the retry would remove the new block)."""
        if path in self._leftovers:
            return
        if digest is None:
            digest = Layout.digest_from_name(os.path.basename(path))  # None: a temporary
        self._leftovers[path] = digest
        if digest is not None:
            self._leftover_digests.add(digest)
        self._used_bytes += self.file_bytes

    def _forget_leftover(self, path: str) -> None:
        digest = self._leftovers.pop(path)
        if digest is not None:
            self._leftover_digests.discard(digest)
        self._used_bytes -= self.file_bytes

    def _retry_leftovers(self) -> None:
        """Unlinks leftover files again, at most every _LEFTOVER_RETRY_S, through the real
        fan-out directory (no link followed); a name the index holds again is left alone."""
        now = _now()
        if now < self._leftover_retry_at:
            return
        self._leftover_retry_at = now + _LEFTOVER_RETRY_S
        for path, digest in list(self._leftovers.items()):
            fanout, name = os.path.split(path)
            blocks, sub = os.path.split(fanout)
            if (digest is not None and digest in self._bindex) or blocks != self.layout.blocks_dir:
                self._forget_leftover(path)  # a block again (counted by the index), or not ours
                continue
            try:
                dfd = self.layout.open_dir("blocks", sub)
                try:
                    try:
                        os.unlink(name, dir_fd=dfd)
                    except IsADirectoryError:  # a directory at a block name: no block file
                        self._quarantine_entry(dfd, sub, name)
                        os.stat(name, dir_fd=dfd, follow_symlinks=False)  # not moved?
                        continue
                finally:
                    os.close(dfd)
            except FileNotFoundError:
                pass
            except OSError:
                continue  # still there: next time
            self._forget_leftover(path)
            self._stats["leftovers_removed"] += 1

    def _warn(self, what: str, reason: str, example: str) -> None:
        """Counts a failure for the aggregated warning (see _flush_warnings)."""
        seen = self._warn_counts.get((what, reason))
        if seen is None:
            self._warn_counts[(what, reason)] = [1, example]
        else:
            seen[0] += 1
        self._flush_warnings()

    def _flush_warnings(self, force: bool = False) -> None:
        """Logs the failures counted since the last line, per reason, in one WARNING line: at
        once for the first, then at most every _WARN_INTERVAL_S (``force``: now)."""
        now = _now()
        if not self._warn_counts or (now < self._warn_at and not force):
            return
        self._warn_at = now + _WARN_INTERVAL_S
        parts = [f"{n} {what} ({reason}; e.g. {example})"
                 for (what, reason), (n, example) in self._warn_counts.items()]
        self._warn_counts.clear()
        logger.warning("pykvtier: %s: %s", self.layout.root, "; ".join(parts))

    def _load_failed(self, digest: bytes, res: int) -> None:
        """A load failed: the key is a MISS from now on; a corrupt file is quarantined. On a
        shared root a file that is gone (ENOENT) is forgotten instead, not marked failed: another
        process or node removed it; the key is a MISS for probe_ttl_s, as after a probe's "not
        found", then a lookup probes the root again (it may be stored again). Not probed at
        once: a node's file system client may still stat the removed file from its attribute
        cache (JuiceFS 1 s, NFS more), and each such probe was a HIT whose load failed again."""
        path = self.layout.block_path(digest)
        if res == -errno.ENOENT and self.shared:
            self._stats["loads_gone"] += 1
            self._warn("loads failed", _describe(res), path)
            if self._bindex.set_removing(digest):  # (else the last load reading it does this)
                self._used_bytes -= self.file_bytes
                self._bindex.forget_removed(digest)
                if self._removed is not None:
                    self._removed.append(digest)
            self._probe_misses[digest] = _now() + self.probe_ttl_s
            return
        if self._bindex.mark_failed(digest) and self._removed is not None:
            self._removed.append(digest)
        if res in _CORRUPT:
            self._stats["verify_failures"] += 1
            self._quarantine(path, digest)
            self._warn("blocks failed verification (quarantined)", _describe(res), path)
        else:
            self._warn("loads failed", _describe(res), path)
            # The file is still there but unreadable: remove it (bytes freed at once), unless
            # loads still read it.
            if res != -errno.ENOENT and self._bindex.set_removing(digest):
                self._used_bytes -= self.file_bytes
                self._unlink_async([digest])
        self._drop_failed(digest)

    def _quarantine(self, path: str, digest: bytes) -> None:
        """Moves the block file of ``digest`` (at ``path``) to the quarantine folder, through
        the real fan-out directory only (a link in its place is not followed)."""
        h = digest.hex()
        try:
            dfd = self.layout.open_dir("blocks", h[:2])
        except OSError as exc:
            logger.warning("pykvtier: cannot quarantine %s: %s", path, exc.strerror)
            return
        try:
            self._quarantine_entry(dfd, h[:2], os.path.basename(path))
        finally:
            os.close(dfd)

    def _quarantine_entry(self, dfd: int, sub: str, name: str) -> None:
        """Moves the entry ``name`` of the fan-out ``sub`` (open at ``dfd``) to the quarantine."""
        try:
            if self._quarantine_box.move_in(dfd, name) is not None:
                self._stats["quarantined"] += 1
        except OSError as exc:
            logger.warning("pykvtier: cannot quarantine %s: %s",
                           os.path.join(self.layout.blocks_dir, sub, name), exc)

    def _drop_failed(self, digest: bytes) -> None:
        """Forgets a failed block once no load reads it any more."""
        if self._bindex.drop_failed(digest):
            self._used_bytes -= self.file_bytes

    def take_removed(self) -> list[bytes]:
        """Digests (see :func:`~pykvtier.layout.key_digest`) of blocks that stopped being
        loadable since the last call: evicted, or their load failed. Each removal is reported
        once; a block stored again and removed again is reported again. Empty unless the tier
        was made with ``track_removals=True``. Never blocks."""
        if not self._removed:
            return []
        out, self._removed = self._removed, []
        return out

    # ------------------------------------------------------------------ waiting, shutdown

    def has_pending_work(self) -> bool:
        """True while jobs, evictions or probes are in flight or results wait to be collected."""
        if self._closed:  # shutdown() drained everything; only uncollected results are left
            return bool(self._ready or self._polled or self._engine.pending_jobs())
        return bool(self._pending or self._evicting or self._ready or self._polled or self._probing
                    or self._probe_wanted or self._awaiting)

    def wait(self, timeout_s: float | None = None) -> list[JobResult]:
        """Blocks (GIL released) until at least one job finished or nothing is pending, or
        timeout_s seconds; returns the finished jobs as :meth:`get_finished_jobs`."""
        if not self._ready and not self._polled:
            if self._awaiting and not self._pending and not self._evicting:
                self._keeper.wait_grant(self._grant_wait_left(timeout_s))
            else:
                self._engine.wait(timeout_s)
        return self.get_finished_jobs()

    def _grant_wait_left(self, timeout_s: float | None = None) -> float:
        """Seconds to wait for a grant: until the first waiting store gives up (or timeout_s)."""
        left = max(0.0, self._awaiting[0].grant_deadline - _now()) + 0.001
        return left if timeout_s is None else min(left, max(0.0, timeout_s))

    def drain(self) -> None:
        """Blocks until every submitted job and eviction finished (results stay available to
        :meth:`get_finished_jobs`) and in-flight probes were applied. Never aborts I/O."""
        self._engine.drain()
        while self._continue_retries():
            self._engine.drain()
        while self._awaiting:  # a shared tier's stores waiting for room: until granted or given up
            self._shared_round()
            if self._awaiting:
                self._keeper.wait_grant(self._grant_wait_left())
                self._shared_round()
            self._engine.drain()
            while self._continue_retries():
                self._engine.drain()
        if self._probe is not None and self._probing:
            self._apply_probes(self._probe.wait())

    def shutdown(self) -> None:
        """Finishes in-flight I/O, then releases the engine's threads, rings and descriptors and
        the probe's ring, lets go of the arena (its owner may free it) and releases the root's
        lock (another tier may open the root then). Idempotent."""
        if self._closed:
            return
        self.drain()
        # Settle every finished job while the engine and the root's lock are still held (a failed
        # load's file is removed now, not after the lock is released); the results stay for
        # get_finished_jobs().
        while True:
            self._collect()
            if not (self._engine.pending_jobs() or self._polled or self._retry_after):
                break
            self.drain()
        if self._leftovers:  # a last try (the next start sweeps stale temporaries)
            self._leftover_retry_at = 0.0
            self._retry_leftovers()
        self._flush_warnings(force=True)
        self._closed = True
        self._bindex.close()
        _open_tiers.discard(self)
        try:
            if self._engine is not self._host_engine:
                self._engine.shutdown()
            self._host_engine.shutdown()
            if self._probe is not None:
                self._probe.close()
            if self._keeper is not None:
                self._keeper.close()
            if self._arena is not None:  # no I/O can touch it now: let its owner free it
                self._arena.release()
        finally:
            self._root_lock.release()

    def _abandon(self) -> None:
        """Lets go of what a failed start took (see _undo_on_failure); never raises."""
        self._closed = True
        if "_bindex" in self.__dict__:
            self._bindex.close()
        _open_tiers.discard(self)
        for name, close in (("_engine", "shutdown"), ("_host_engine", "shutdown"), ("_probe", "close"),
                            ("_keeper", "close"), ("_root_lock", "release")):
            obj = self.__dict__.get(name)
            if obj is not None:
                try:
                    getattr(obj, close)()
                except Exception:  # the original error is the one to report
                    logger.debug("pykvtier: %s.%s() after a failed start", name, close,
                                 exc_info=True)

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ figures

    @property
    def used_bytes(self) -> int:
        """Block file bytes present, being written or being removed (what capacity limits)."""
        return self._used_bytes

    @property
    def engine(self) -> Any:
        """The engine the tier's jobs go to now (a :class:`pykvtier.engines.Engine`; its name is
        ``engine_name``), for its ``stats()`` and ``pending_jobs()``. Read-only: the tier sets it
        (host engine, or a device arena's); jobs submitted to it directly bypass the index."""
        return self._engine

    @property
    def num_blocks(self) -> int:
        """Blocks present (loadable now)."""
        return self._bindex.present

    def stats(self) -> dict[str, int]:
        """Counters of this tier and its engine (see the keys), plus ``used_bytes``."""
        s = dict(self._stats)
        s.update(self._bindex.counts())
        eng = self._engine.stats()
        s["submits"] = eng["submits"]
        s["engine_sqes"] = eng["sqes"]
        s["fixed_buffer_ios"] = eng["fixed_buffer_ios"]
        s["buffer_registration_failures"] = eng["buffer_registration_failures"]
        s["files_recycled"] = eng["recycled"]
        s["recycle_failures"] = eng["recycle_failures"]
        s["loads_unchecked_payload"] = eng["loads_unchecked_payload"]
        s["used_bytes"] = self._used_bytes
        s["leftover_files"] = len(self._leftovers)
        s["blocks_present"] = self._bindex.present
        s["direct"] = int(self.direct)
        s["quarantine_files"] = self._quarantine_box.files
        s["quarantine_bytes"] = self._quarantine_box.bytes
        k = self._keeper
        if k is not None:  # a shared root's capacity: this member's figures
            s.update(k.stats)
            s["shared_evictor"] = int(k.is_evictor)
            s["shared_granted_bytes"] = k.granted
            s["shared_reserved_bytes"] = k.reserved
            s["stores_waiting_for_grant"] = len(self._awaiting)
        return s
