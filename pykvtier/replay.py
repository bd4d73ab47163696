"""``pykvtier replay``: replay a KV-cache trace against a :class:`~pykvtier.DiskTier`.

Requests arrive at their trace timestamps (``--speed``; ``--as-fast-as-possible``: one after
the other) and a scheduler step every ``--step-ms`` takes those that arrived (see
:class:`ReplayDriver`). For each request the replay does what an inference engine does with a
secondary tier:

1. **phase 1** - look up the request's prefix blocks in order and stop at the first MISS;
   a RETRY is asked again after a scheduler step (``tier.on_step_end()``) until it resolves;
2. **phase 2** - load the hit prefix into slots of a page-aligned host arena (one load job
   per request) and check every loaded byte against the bytes the block's key stands for;
3. "compute" the rest of the prompt - generate the missed blocks' bytes deterministically
   from their keys - and store them (one store job per request). Stores run in the
   background while the next requests are looked up and loaded, as in an engine.

A trace block (512 tokens) is split into ``512 / tokens_per_block`` engine blocks of the
model's real KV size (:mod:`pykvtier.models`); engine block ``(hash_id, i)`` has the key
:func:`block_key`. The replay moves the first of them up to ``--kv-sample`` bytes (a trace
block is hit or missed whole; :func:`moved_per_trace_block`). What the hits were worth (TTFT
and GPU time with and without the tier, ``--bypass auto``) is estimated by :class:`_Worth`
on :mod:`pykvtier.costmodel`.

The block bytes are a 4 KiB random table XORed with a 64-bit word derived from the key and the
page index, so every 4 KiB page differs by key and by page index and a block costs one memory
pass to make and one to check.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import itertools
import json
import math
import mmap
import os
import resource
import shutil
import signal
import struct
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from . import models as _models
from .toolkit import format_bytes, jsonable, parse_size
from .trace import TRACE_BLOCK_TOKENS, Request, TraceFormatError, load_trace

__all__ = [
    "DEFAULT_MODEL",
    "DEFAULT_TOKENS_PER_BLOCK",
    "DEFAULT_MAX_REQUESTS",
    "DEFAULT_CAPACITY",
    "DEFAULT_SPEED",
    "DEFAULT_STEP_MS",
    "DEFAULT_KV_SAMPLE",
    "ReplayConfig",
    "ReplayConfigError",
    "ReplaySummary",
    "BlockPattern",
    "block_key",
    "parse_size",
    "format_bytes",
    "ReplayCounters",
    "ReplayDriver",
    "DriverOptions",
    "moved_per_trace_block",
    "run_replay",
    "write_plot",
    "NODES_DEAL",
    "NodeResult",
    "NodesReplay",
    "run_nodes",
    "format_nodes",
    "add_arguments",
    "main",
]

# Defaults: about a minute on a 2-core VM with a ~1 GB/s virtual disk, with the capacity
# well below the working set so the tier has to evict. See `pykvtier replay --help`.
DEFAULT_MODEL = "qwen2.5-7b"
DEFAULT_TOKENS_PER_BLOCK = 16  # vLLM's default block: 16 x 56 KiB = 896 KiB, 32 per trace block
DEFAULT_MAX_REQUESTS = 800
DEFAULT_CAPACITY = "8GiB"
#: The command's default arrival-time speed (trace seconds per second); ReplayConfig's default
#: (speed None) replays back to back.
DEFAULT_SPEED = 6.0
DEFAULT_STEP_MS = 10.0
#: KV moved per 512-token trace block by default: its first engine blocks up to this size, at
#: least one (every block of the `tiny` model; one of the real models' blocks).
DEFAULT_KV_SAMPLE = "1MiB"
DEFAULT_GPU = "h100"
DEFAULT_MFU = 0.5
BYPASS_MODES = ("off", "auto")
TIER_KINDS = ("pykvtier", "vllm-fs")

#: Arena size the auto rule aims for (slots for at least two requests when it fits).
ARENA_SOFT_LIMIT_BYTES = 4 << 30

PAGE_BYTES = 4096
_WORDS_PER_PAGE = PAGE_BYTES // 8
_KEY = struct.Struct("<4sQII")  # tag, trace hash id, sub-block index, block size in bytes
_KEY_TAG = b"mck1"
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_TABLE_SEED = 0x6B76_7469_6572  # "kvtier"
_LOOKUP_RETRY_DEADLINE_S = 30.0
_STALL_DEADLINE_S = 300.0  # no job finished for this long while jobs are in flight: give up
_MAX_ERROR_SAMPLES = 20  # error messages kept for the summary
# Store failures that are the tier declining a block under capacity pressure (blocks being
# written or read hold the space, or the key's old file is still being evicted): an engine
# just does not cache those blocks. Counted and shown, but not errors.
_STORE_REJECTIONS = ("no capacity", "block is being evicted")


class ReplayConfigError(ValueError):
    """The replay cannot run with these settings (message says why)."""


def _plural(n: int, noun: str, plural: str | None = None) -> str:
    """``1 request``, ``2 requests`` (``plural``: the plural where it is not noun + "s")."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


# --------------------------------------------------------------------------------------
# keys and block bytes


def block_key(hash_id: int, sub_index: int, block_size_bytes: int) -> bytes:
    """Key of engine block ``sub_index`` of trace block ``hash_id`` (20 bytes).

    The block size is part of the key: the same trace block replayed with another model or
    block size is other content, and a shared root must never confuse the two.
    """
    return _KEY.pack(_KEY_TAG, hash_id, sub_index, block_size_bytes)


def _key_word(key: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


class BlockPattern:
    """Deterministic, cheap block contents: ``table[w] ^ (kw + page * GOLDEN)``.

    ``table`` is one fixed random 4 KiB page; ``kw`` is a 64-bit digest of the key. Filling
    or checking a block is one vectorised pass over it.
    """

    def __init__(self, block_size_bytes: int) -> None:
        if block_size_bytes <= 0 or block_size_bytes % 8:
            raise ValueError(f"block size must be a positive multiple of 8, got {block_size_bytes}")
        self.block_size = block_size_bytes
        self.words = block_size_bytes // 8
        self.full_pages, self.tail_words = divmod(self.words, _WORDS_PER_PAGE)
        npages = self.full_pages + (1 if self.tail_words else 0)
        self.table = np.random.Generator(np.random.PCG64(_TABLE_SEED)).integers(
            0, 2**64, size=_WORDS_PER_PAGE, dtype=np.uint64, endpoint=False
        )
        self._page_offsets = np.arange(npages, dtype=np.uint64) * _GOLDEN
        self._salts = np.empty(npages, dtype=np.uint64)
        self._scratch = np.empty(self.words, dtype=np.uint64)

    def fill(self, out: np.ndarray, key: bytes) -> None:
        """Write the block of ``key`` into ``out`` (a uint64 array of ``words`` elements)."""
        np.add(self._page_offsets, np.uint64(_key_word(key)), out=self._salts)
        salts = self._salts
        fp = self.full_pages
        if fp:
            np.bitwise_xor(
                self.table[None, :],
                salts[:fp, None],
                out=out[: fp * _WORDS_PER_PAGE].reshape(fp, _WORDS_PER_PAGE),
            )
        if self.tail_words:
            np.bitwise_xor(
                self.table[: self.tail_words], salts[fp], out=out[fp * _WORDS_PER_PAGE :]
            )

    def expected(self, key: bytes) -> np.ndarray:
        """The block of ``key`` (a reused scratch array: copy it to keep it)."""
        self.fill(self._scratch, key)
        return self._scratch

    def matches(self, data: np.ndarray, key: bytes) -> bool:
        """Whether ``data`` (uint64 view of one block) holds exactly the block of ``key``."""
        return bool(np.array_equal(data, self.expected(key)))

    def block_bytes(self, key: bytes) -> bytes:
        return self.expected(key).tobytes()


# --------------------------------------------------------------------------------------
# configuration and result


@dataclass
class ReplayConfig:
    """What to replay, and how. Sizes in bytes."""

    trace: str | None = None  # None: the bundled Mooncake conversation trace
    model: str = DEFAULT_MODEL
    tokens_per_block: int = DEFAULT_TOKENS_PER_BLOCK
    max_requests: int | None = DEFAULT_MAX_REQUESTS
    capacity_bytes: int | None = parse_size(DEFAULT_CAPACITY)
    root: str | None = None  # None: a temporary directory, removed at the end
    engine: str = "auto"
    recycle: bool = True  # stores at capacity take over the evicted files (DiskTier(recycle=))
    store_share: float = 0.5  # DiskTier(store_share=): the share of the engine stores may hold
    progress: bool = True
    arena_bytes: int | None = None  # None: auto (see _arena_slots)
    #: None: back to back, each request's load waited for before the next (as fast as
    #: possible); X: requests arrive at their trace timestamps compressed X times, a scheduler
    #: step every ``step_ms`` (see ReplayDriver)
    speed: float | None = None
    step_ms: float = DEFAULT_STEP_MS
    #: the trace time (ms) arrivals count from; None: the first request's timestamp
    time_origin_ms: int | None = None
    #: KV bytes moved per trace block: its first engine blocks up to this size (at least one);
    #: the others are counted with them (hit or missed together). None: every engine block
    kv_sample_bytes: int | None = parse_size(DEFAULT_KV_SAMPLE)
    gpu: str = DEFAULT_GPU  # the prefill cost model's GPU (pykvtier.costmodel.GPU_PRESETS)
    mfu: float = DEFAULT_MFU
    bypass: str = "off"  # "auto": load only the prefix that loads faster than it recomputes
    #: a modeled disk for the estimates: load times = full KV bytes / (disk_gbps x 1e9 B/s)
    disk_gbps: float | None = None
    tier: str = "pykvtier"  # or "vllm-fs": vLLM's own fs tier (pykvtier.replay_tiers)


@dataclass
class ReplaySummary:
    """Result of a replay. ``ok`` is False if any block failed verification or any error."""

    trace: str
    model: str
    tokens_per_block: int
    block_size_bytes: int
    engine: str
    root: str
    root_removed: bool
    capacity_bytes: int | None
    arena_bytes: int
    requests: int
    blocks_requested: int
    blocks_looked_up: int
    blocks_hit: int
    blocks_hit_pending: int
    lookup_retries: int
    block_hit_ratio: float
    byte_hit_ratio: float
    prompt_kv_bytes: int
    hit_kv_bytes: int
    load_jobs: int
    store_jobs: int
    blocks_loaded: int
    blocks_stored: int
    bytes_loaded: int
    bytes_stored: int
    load_busy_s: float
    store_busy_s: float
    load_gbps: float
    store_gbps: float
    load_latency_ms_p50: float | None
    load_latency_ms_p99: float | None
    load_latency_ms_max: float | None
    cpu_s: float
    cpu_s_per_gib: float | None
    harness_cpu_s: float
    tier_cpu_s_per_gib: float | None
    evictions: int
    verification_failures: int
    tier_verify_failures: int
    load_failed_keys: int
    store_failed_keys: int
    store_rejected_keys: int
    errors: int
    failure_reasons: dict[str, int]
    error_samples: list[str]
    wall_s: float  # the whole replay: set-up + run + clean-up
    tier_stats: dict[str, Any] = field(default_factory=dict)
    setup_s: float = 0.0  # reading the trace, the arena and its prefault, the tier's start
    run_s: float = 0.0  # the replay itself, to the tier's drain
    cleanup_s: float = 0.0  # the tier's shutdown, removing the temporary root
    tier_kind: str = "pykvtier"
    # the schedule: speed None is back to back (as fast as possible)
    speed: float | None = None
    step_ms: float | None = None
    steps: int = 0
    max_requests_per_step: int = 0
    requests_deferred: int = 0
    requests_deferred_retry: int = 0
    schedule_wait_ms_p50: float | None = None  # arrival to lookup
    schedule_wait_ms_p99: float | None = None
    # the KV moved: the first moved_per_trace_block of each trace block's engine blocks
    blocks_per_trace_block: int = 0
    moved_per_trace_block: int = 0
    store_share: float | None = None  # DiskTier(store_share=) (None: not a DiskTier of the replay's)
    # what the hits were worth (pykvtier.costmodel; see format_summary and --help)
    gpu: str | None = None
    mfu: float | None = None
    load_time_source: str | None = None
    disk_gbps: float | None = None
    bypass: str = "off"
    blocks_bypassed: int = 0
    requests_bypassed: int = 0
    prefill_gpu_s_no_tier: float | None = None  # every prompt computed in full
    prefill_gpu_s_saved: float | None = None  # the prefill of the tokens loaded instead
    load_s_of_hits: float | None = None  # the load time of those tokens (load_time_source)
    requests_loaded: int = 0  # requests with a load
    requests_load_faster: int = 0  # of those, loaded faster than their tokens compute
    ttft_ms_no_tier_p50: float | None = None
    ttft_ms_no_tier_p99: float | None = None
    ttft_ms_tier_p50: float | None = None  # with the tier (and --bypass, where on)
    ttft_ms_tier_p99: float | None = None
    ttft_ms_no_bypass_p50: float | None = None  # --bypass auto with --disk-gbps: every hit loaded
    ttft_ms_no_bypass_p99: float | None = None
    break_even_gbps_block0: float | None = None  # an engine block at token 0
    break_even_gbps_hits: float | None = None  # the KV of this replay's loaded tokens / their prefill

    @property
    def ok(self) -> bool:
        return self.verification_failures == 0 and self.errors == 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        return d


# --------------------------------------------------------------------------------------
# the replay


class _Progress:
    """The replay's progress bar: tqdm on stderr, drawn only where stderr is a terminal (and
    ``enabled``).

    ``advance()`` once per request replayed; ``show(text)`` whenever the counts it describes
    change (a job finished, a request done): the bar is redrawn at most every ``interval``
    seconds, and ``close()`` draws it once more, so it ends on the final counts."""

    def __init__(self, total: int, enabled: bool, interval: float = 0.1) -> None:
        from tqdm import tqdm

        self._interval = interval
        self._last = 0.0  # when the postfix was last drawn
        self._postfix = ""
        # disable=None: no bar when stderr is not a terminal (logs, pipes)
        self._bar = tqdm(total=total, unit="req", desc="replay", file=sys.stderr, dynamic_ncols=True,
                         disable=None if enabled else True, mininterval=interval)

    def show(self, postfix: str) -> None:
        if postfix == self._postfix:
            return
        self._postfix = postfix
        now = time.monotonic()
        if now - self._last >= self._interval:
            self._last = now
            self._bar.set_postfix_str(postfix, refresh=True)

    def advance(self) -> None:
        self._bar.update(1)  # draws (with the postfix) at most every `interval` seconds

    def close(self) -> None:
        self._bar.set_postfix_str(self._postfix, refresh=False)
        self._bar.close()  # draws the final state


@dataclass
class _Req:
    """One request as the driver replayed it (times: the driver's clock, seconds)."""

    index: int
    req: Request
    keys: list[bytes]  # its engine blocks' keys, those the replay moves
    arrival_t: float  # when it arrived (the driver's clock); its trace time is trace_s
    trace_s: float  # its trace timestamp, seconds from the time origin
    step: int = -1  # the scheduler step that looked it up (-1: back to back)
    hits: int = 0  # blocks its lookups found, in order from the first
    loads: int = 0  # of those, loaded (the others bypassed)
    sched_t: float = math.nan  # when it was looked up
    load_s: float | None = None  # its load job's submit to finish
    deferred: int = 0  # steps it was put off (a RETRY, or no free slots)
    retry_since: float | None = None  # first RETRY with nothing of the replay's in flight


@dataclass
class _Pending:
    is_load: bool
    keys: list[bytes]
    slots: list[int]
    submit_t: float
    req: _Req | None = None
    then: Callable[[], None] | None = None  # after it finished (a load: its request's store)


def _percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Linear-interpolation percentile (numpy's default) of already sorted values."""
    if not sorted_values:
        return None
    return float(np.percentile(np.asarray(sorted_values), q))


def _union_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length of the union of [start, end] intervals."""
    total = 0.0
    cur_s = cur_e = None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        elif e > cur_e:
            cur_e = e
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def _arena_slots(max_blocks: int, block_size: int, arena_bytes: int | None, serving: bool = False) -> int:
    """Slots of the host arena: at least the largest request; room for two when it fits (four
    when requests arrive by time: several are in flight at once)."""
    need = max(1, max_blocks)
    if arena_bytes is not None:
        slots = arena_bytes // block_size
        if slots < need:
            raise ReplayConfigError(
                f"arena of {format_bytes(arena_bytes)} holds {_plural(slots, 'block')} of "
                f"{format_bytes(block_size)}, but the largest request needs {need}"
            )
        return slots
    return max(need, min((4 if serving else 2) * need, ARENA_SOFT_LIMIT_BYTES // block_size))


def _allocate_arena(nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    """Anonymous private mapping: page-aligned, zero-filled, faulted in here (before the
    replay's clock starts) where the kernel can populate it in one call. OSError (ENOMEM)
    where the memory is not there: the mapping is refused, or faulting it in failed."""
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:  # transparent huge pages: ~500x fewer page faults to touch (or pin) the arena
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    if sys.platform.startswith("linux"):
        try:
            # MADV_POPULATE_WRITE (Linux 5.14): the io_uring engine pins the arena when it
            # registers it, which faults it in; without that (posix engine) the first fill of
            # each page would fault it in the middle of the measured replay instead.
            mm.madvise(getattr(mmap, "MADV_POPULATE_WRITE", 23))
        except OSError as exc:
            if exc.errno == errno.ENOMEM:  # the pages are not there: no replay either
                mm.close()
                raise
            # older kernel (EINVAL): faulted in on first touch
    arr = np.frombuffer(mm, dtype=np.uint8)
    assert arr.ctypes.data % PAGE_BYTES == 0
    return mm, arr


class _DefaultAction(BaseException):
    """A signal whose action was the default (terminate) stopped the replay: raised to unwind
    it, and the signal is sent again with that action once the clean-up is done."""


class _SignalGuard:
    """SIGINT and SIGTERM during one replay (main thread; elsewhere it does nothing).

    A signal is handed at once to the handler the caller had (Ctrl-C raises KeyboardInterrupt,
    ``pykvtier replay`` raises its SIGTERM exception), except while ``hold`` is set (creating
    the temporary root, the clean-up): then it is kept, and delivered by :meth:`check` or
    :meth:`release`. Once one was delivered, later ones are dropped: a second Ctrl-C never
    aborts the clean-up. Setting ``hold`` is a plain attribute store, during which CPython runs
    no signal handler, so the first statement of a ``finally`` can set it.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.hold = False
        self.pending: int | None = None  # a signal not yet delivered
        self.delivered: int | None = None  # the signal whose exception unwinds the replay
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # Python runs signal handlers in the main thread only
        for signum in self.SIGNALS:
            previous = signal.getsignal(signum)
            if previous is None or previous == signal.SIG_IGN:
                continue  # a handler installed outside Python, or an ignored signal: left alone
            self._previous[signum] = previous
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.pending is None and self.delivered is None:
            self.pending = signum
        if not self.hold and self.delivered is None:
            self._deliver(frame)

    def _deliver(self, frame: Any = None) -> None:
        signum, self.pending = self.pending, None
        if signum is None:
            return
        self.delivered = signum
        handler = self._previous.get(signum, signal.SIG_DFL)
        if not callable(handler):
            raise _DefaultAction(signum)
        handler(signum, frame)  # raises, as a rule
        self.delivered = None  # the caller's handler chose to carry on: so does the replay

    def check(self) -> None:
        """Delivers a signal kept while ``hold`` was set, or again one whose exception did not
        stop the replay (raised inside a ``__del__`` or a callback, where Python drops it)."""
        if self.delivered is not None:
            self.pending, self.delivered = self.delivered, None
        if self.pending is not None and not self.hold:
            self._deliver()

    def release(self, unwinding: bool) -> None:
        """End of the replay (``hold`` set; ``unwinding``: an exception propagates): the
        caller's handlers back, then the signal is sent again to the process if one came and
        its exception is not what unwinds the replay (it came during the clean-up, or its
        exception was dropped), or if its action is the default (the process ends with it)."""
        previous, self._previous = self._previous, {}
        try:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        finally:
            again = self.pending
            if self.delivered is not None:
                default = not callable(previous.get(self.delivered))
                again = self.delivered if default or not unwinding else None
            self.pending = self.delivered = None
            if again is not None and again in previous:
                signal.raise_signal(again)  # runs the restored handler now (or its default)


_REMOVE_THREADS = 8


def _remove_blocks_in_parallel(path: str) -> None:
    """A first pass of :func:`_remove_tree`: the fan-out directories of each ``blocks/`` within
    three levels under ``path``, by 8 threads (no link followed; errors left to the serial pass).
    Unlinking large block files on ext4 waits for the journal: in parallel the waits overlap
    (7,800 files of 896 KiB on this project's VM: 7.7 s one by one, 3.1 s by 8 threads)."""
    dirs: list[str] = []

    def subdirs(d: str) -> list[os.DirEntry]:
        try:
            with os.scandir(d) as it:
                return [e for e in it if e.is_dir(follow_symlinks=False)]
        except OSError:
            return []

    def scan(d: str, depth: int) -> None:
        for e in subdirs(d):
            if e.name == "blocks":
                dirs.extend(x.path for x in subdirs(e.path))
            elif depth < 3:
                scan(e.path, depth + 1)

    scan(path, 0)
    if len(dirs) < 2:
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(_REMOVE_THREADS, thread_name_prefix="pykvtier-rm") as pool:
        list(pool.map(lambda d: shutil.rmtree(d, ignore_errors=True), dirs))


def _remove_tree(path: str) -> bool:
    """Removes the directory tree at ``path`` (links are removed, never followed). True when
    nothing is left there (a path already gone counts); else says why on stderr, naming it."""
    failures: list[str] = []
    _remove_blocks_in_parallel(path)

    def failed(func: Any, name: str, exc: Any) -> None:
        exc = exc[1] if isinstance(exc, tuple) else exc
        if not isinstance(exc, FileNotFoundError):
            failures.append(f"{name}: {getattr(exc, 'strerror', None) or exc}")

    for _ in range(2):  # a second pass for what the first could not remove
        if sys.version_info >= (3, 12):
            shutil.rmtree(path, onexc=failed)
        else:
            shutil.rmtree(path, onerror=failed)
        if not os.path.lexists(path):
            return True
    print(f"pykvtier replay: could not remove the temporary root {path}: "
          f"{failures[0] if failures else 'it is still there'}", file=sys.stderr)
    return False


def _rusage_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _default_tier_factory(root: str, block_size: int, capacity: int | None, engine: str,
                          recycle: bool = True, store_share: float = 0.5):
    from . import DiskTier

    return DiskTier(root, block_size, capacity_bytes=capacity, engine=engine, recycle=recycle,
                    store_share=store_share)


@dataclass
class ReplayCounters:
    """What a replay counted so far. Blocks and bytes moved count when their job finishes;
    ``harness_cpu_s`` is the replay's own work (making and checking block bytes)."""

    blocks_requested: int = 0
    blocks_looked_up: int = 0
    blocks_hit: int = 0
    blocks_hit_pending: int = 0
    lookup_retries: int = 0
    load_jobs: int = 0
    store_jobs: int = 0
    blocks_loaded: int = 0
    blocks_stored: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0
    verification_failures: int = 0
    load_failed_keys: int = 0
    store_failed_keys: int = 0
    store_rejected_keys: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    harness_cpu_s: float = 0.0
    failure_reasons: dict[str, int] = field(default_factory=dict)  # "load: <reason>" -> keys
    error_samples: list[str] = field(default_factory=list)  # the first _MAX_ERROR_SAMPLES
    load_intervals: list[tuple[float, float]] = field(default_factory=list)  # (submit, finish) s
    store_intervals: list[tuple[float, float]] = field(default_factory=list)
    load_latencies: list[float] = field(default_factory=list)  # seconds per load job
    blocks_bypassed: int = 0  # hit blocks not loaded: --bypass auto recomputes them (faster)
    requests_bypassed: int = 0  # requests with blocks bypassed
    requests_deferred: int = 0  # a request put off to the next step (a RETRY, or no free slots)
    requests_deferred_retry: int = 0  # of those, for a RETRY
    steps: int = 0  # scheduler steps run (arrival-time replay)
    max_requests_per_step: int = 0

    def error(self, msg: str, count: int = 1) -> None:
        """``count`` errors, described by ``msg``."""
        self.errors += count
        self.sample(msg)

    def sample(self, msg: str) -> None:
        if len(self.error_samples) < _MAX_ERROR_SAMPLES:
            self.error_samples.append(msg)

    def key_failed(self, kind: str, reason: str) -> None:
        name = f"{kind}: {reason}"
        self.failure_reasons[name] = self.failure_reasons.get(name, 0) + 1

    @property
    def block_hit_ratio(self) -> float:
        return self.blocks_hit / self.blocks_requested if self.blocks_requested else 0.0


class _Worth:
    """What a replay's hits were worth, by the prefill cost model (:mod:`pykvtier.costmodel`).

    A request of ``L`` prompt tokens whose first ``h`` tokens were loaded (``h`` = blocks
    loaded x the tokens one moved block stands for, at most ``L``):

    - without the tier: TTFT = P(L), the prefill of the whole prompt;
    - with it: TTFT = T_load + (P(L) - P(h)): its load job first, then the prefill of the
      rest (load, then compute: what vLLM does; no overlap of the two is assumed);
    - GPU time saved: P(h). ``P`` is ``PrefillModel.prefix_seconds`` (the rest:
      ``block_seconds(h, L - h)``, attention over the loaded prefix included).

    ``T_load`` is the request's load job, submit to finish, as measured (``scale`` 1), times
    ``scale`` when the replay moved 1 in ``scale`` of the KV; with ``disk_gbps``, the full
    KV bytes of the loaded blocks / (disk_gbps x 1e9 B/s) instead. The GPU is taken to be free
    for each request (no batching, no queue): TTFT counts from the step that looked it up.

    ``--bypass auto`` (``bypass``): a request loads its hits' first ``k`` =
    ``loadable_prefix(hits, unit_bytes, queued, bandwidth, recompute)`` blocks, ``recompute``
    each block's ``block_seconds``. On the measured disk ``bandwidth`` is ``estimate`` (default
    a :class:`costmodel.BandwidthEstimate` fed by the replay's finished loads: their bytes over
    the time the disk was busy with them; none yet: every hit is loaded), ``queued`` the full
    bytes of the loads in flight; on the modeled one ``disk_gbps``, and no queue (each load is
    served on its own, as its modeled time counts it).
    """

    def __init__(self, costmodel: Any, prefill: Any, tokens_per_block: int, unit_tokens: int,
                 unit_bytes: int, scale: int, bypass: bool, disk_gbps: float | None,
                 estimate: Any = None) -> None:
        self.costmodel = costmodel
        self.prefill = prefill
        self.tokens_per_block = tokens_per_block
        self.unit_tokens = unit_tokens  # prompt tokens one moved block stands for
        self.unit_bytes = unit_bytes  # and their KV bytes
        self.scale = scale  # full KV bytes / bytes moved
        self.bypass = bypass
        self.disk_bps = None if disk_gbps is None else disk_gbps * 1e9
        self.estimate = estimate if estimate is not None else costmodel.BandwidthEstimate()

    def source(self) -> str:
        if self.disk_bps is not None:
            return f"modeled: full KV bytes / {self.disk_bps / 1e9:g} GB/s"
        if self.scale > 1:
            return f"measured x {self.scale} (the replay moved 1/{self.scale} of the KV)"
        return "measured"

    def bandwidth(self) -> float | None:
        return self.disk_bps if self.disk_bps is not None else self.estimate.bytes_per_s

    def loads_finished(self, nbytes: int, seconds: float, now: float) -> None:
        if self.disk_bps is None:
            self.estimate.update(nbytes, seconds, now=now)

    def recompute_seconds(self, input_length: int, blocks: int) -> list[float]:
        ut = self.unit_tokens
        return [self.prefill.block_seconds(i * ut, max(0, min(ut, input_length - i * ut)))
                for i in range(blocks)]

    def loadable(self, rq: _Req, hits: int, moved_bytes_in_flight: int) -> int:
        bw = self.bandwidth()
        if not bw:
            return hits  # no estimate yet: load, and measure
        # the modeled disk serves each request's load on its own (as its TTFT counts it)
        queued = 0 if self.disk_bps is not None else moved_bytes_in_flight * self.scale
        k = self.costmodel.loadable_prefix(hits, self.unit_bytes, queued, bw,
                                           self.recompute_seconds(rq.req.input_length, hits))
        return max(0, min(hits, int(k)))

    def load_seconds(self, rq: _Req, blocks: int) -> float | None:
        if not blocks:
            return 0.0
        if self.disk_bps is not None:
            return blocks * self.unit_bytes / self.disk_bps
        return None if rq.load_s is None else rq.load_s * self.scale

    def ttft(self, rq: _Req, blocks: int) -> tuple[float, float, float, float] | None:
        """(TTFT without the tier, with ``blocks`` loaded, P(h), T_load) in seconds; None
        without a load time."""
        L = rq.req.input_length
        h = min(blocks * self.unit_tokens, L)
        t_load = self.load_seconds(rq, blocks)
        if t_load is None:
            return None
        p_all = self.prefill.prefix_seconds(L)
        rest = self.prefill.block_seconds(h, L - h) if L > h else 0.0
        return p_all, t_load + rest, p_all - rest, t_load

    def figures(self, records: Sequence[_Req]) -> dict[str, Any]:
        """The summary's fields (ReplaySummary names) and the per-request series for a plot."""
        none: list[float] = []
        tier: list[float] = []
        no_bypass: list[float] = []
        saved = none_total = load_total = 0.0
        loaded = faster = 0
        loaded_bytes = 0
        series = []
        for rq in records:
            if math.isnan(rq.sched_t):
                continue  # never looked up
            t = self.ttft(rq, rq.loads)
            if t is None:
                continue  # its load did not finish
            p_all, with_tier, p_h, t_load = t
            none.append(p_all)
            tier.append(with_tier)
            none_total += p_all
            saved += p_h
            row = {"trace_s": rq.trace_s, "ttft_no_tier_s": p_all, "ttft_tier_s": with_tier}
            if rq.loads:
                loaded += 1
                load_total += t_load
                faster += t_load < p_h
                loaded_bytes += rq.loads * self.unit_bytes
            if self.bypass and self.disk_bps is not None:
                nb = self.ttft(rq, rq.hits)
                no_bypass.append(nb[1])
                row["ttft_no_bypass_s"] = nb[1]
            series.append(row)

        def ms(values: list[float], q: float) -> float | None:
            return None if not values else _percentile(sorted(values), q) * 1e3

        return {
            "load_time_source": self.source(),
            "prefill_gpu_s_no_tier": none_total,
            "prefill_gpu_s_saved": saved,
            "load_s_of_hits": load_total,
            "requests_loaded": loaded,
            "requests_load_faster": faster,
            "ttft_ms_no_tier_p50": ms(none, 50), "ttft_ms_no_tier_p99": ms(none, 99),
            "ttft_ms_tier_p50": ms(tier, 50), "ttft_ms_tier_p99": ms(tier, 99),
            "ttft_ms_no_bypass_p50": ms(no_bypass, 50), "ttft_ms_no_bypass_p99": ms(no_bypass, 99),
            "break_even_gbps_block0": self.prefill.break_even_bytes_per_s(0, self.tokens_per_block) / 1e9,
            "break_even_gbps_hits": loaded_bytes / saved / 1e9 if saved > 0 else None,
        }, series


@dataclass
class DriverOptions:
    """How a :class:`ReplayDriver` schedules (see :class:`ReplayConfig`) and what it estimates.

    ``clock`` and ``sleep`` are its time source (the schedule, load times, TTFT): tests give a
    fake clock whose ``sleep`` advances it; the wall time and the stall watchdog stay real."""

    speed: float | None = None  # None: back to back
    step_ms: float = DEFAULT_STEP_MS
    time_origin_ms: int | None = None
    moved_per_trace_block: int | None = None  # None: every engine block of a trace block
    worth: Any = None  # a _Worth: prefill model, bandwidth estimate, --bypass auto
    clock: Callable[[], float] = time.perf_counter
    sleep: Callable[[float], None] = time.sleep


class ReplayDriver:
    """One replay against an open tier, as an engine drives a secondary tier (the module
    docstring's phases); stores run in the background.

    Back to back (``options.speed`` None): request by request, each one's lookups, its load job
    waited for, then its store job. By arrival time: request i arrives at ``(timestamp_i -
    origin) / speed`` seconds into the run; a scheduler step runs every ``step_ms`` (on the
    first boundary after the previous one ended: a late step batches more) and takes the
    requests that arrived, first come first served: each one's lookups, then its one load job
    submitted at once, its store job once that load finished (at once when nothing hit). A
    request whose lookups meet a RETRY before the first MISS (a block being written, a shared
    tier's probe) is asked again at the next step, as vLLM's scheduler does; one that finds no
    free arena slots waits with those after it. ``tier.on_step_end()`` ends each step.

    ``tier``: a DiskTier (or what a ``tier_factory`` makes) whose arena is ``arena``, a uint8
    array of whole blocks of ``block_size`` bytes, each a slot. ``guard`` delivers the signals
    it kept; ``progress`` shows the counts. Main thread only; one replay per driver.
    Raises RuntimeError when the tier stops finishing jobs or the arena runs out.
    """

    def __init__(self, tier: Any, arena: np.ndarray, block_size: int, tokens_per_block: int,
                 guard: _SignalGuard, progress: _Progress, options: DriverOptions | None = None) -> None:
        from .tier import LookupResult, TransferJob

        self._lookup_result, self._job = LookupResult, TransferJob
        self.tier = tier
        self.block_size = block_size
        self.tokens_per_block = tokens_per_block
        self.subblocks = TRACE_BLOCK_TOKENS // tokens_per_block  # engine blocks per trace block
        self.options = options = options or DriverOptions()
        moved = options.moved_per_trace_block or self.subblocks
        if moved < 1 or self.subblocks % moved:
            raise ValueError(f"moved_per_trace_block {moved} does not divide {self.subblocks}")
        self.moved = moved  # engine blocks moved per trace block: its first `moved`
        self.unit_tokens = TRACE_BLOCK_TOKENS // moved  # prompt tokens one moved block stands for
        self._now = options.clock
        self.pattern = BlockPattern(block_size)
        self.counters = ReplayCounters()
        self.records: list[_Req] = []
        #: (driver clock, load bytes in flight, store bytes in flight): by arrival time once per
        #: step and after each wait for jobs between steps and at the end (stores are submitted
        #: as loads finish, between steps: a sample per step alone misses them); back to back
        #: once per request
        self.queue_samples: list[tuple[float, int, int]] = []
        self.t0 = math.nan  # the driver clock at the start of the run
        self.progress = progress
        self._guard = guard
        self._arena64 = arena.view(np.uint64)
        self._words = block_size // 8
        # LIFO: reuse the slots freed last (warm in cache and already faulted in)
        self._free_slots = list(range(arena.nbytes // block_size - 1, -1, -1))
        self._pending: dict[int, _Pending] = {}
        self._inflight_bytes = [0, 0]  # stores, loads
        self._last_load_done = -math.inf
        self._job_ids = itertools.count(1)
        self._last_finish = time.monotonic()  # when a job last finished (stall detection)
        self._waiting = 0  # requests arrived and not yet looked up (arrival-time replay)
        self._origin: int | None = None  # the time origin (ms of trace time)

    def run(self, requests: Sequence[Request]) -> tuple[float, float]:
        """Replays ``requests`` (in order, or by arrival time), then waits for every job and
        drains the tier. Returns (wall seconds, CPU seconds of the process)."""
        cpu0 = _rusage_cpu()
        t_start = time.perf_counter()
        self.t0 = self._now()
        self._origin = self._origin_ms(requests)
        try:
            if self.options.speed is None:
                for req in requests:
                    self._guard.check()
                    self.replay_request(req)
                    self.progress.show(self.bar_text())
                    self.progress.advance()
            else:
                self.serve(requests)
            while self._pending:
                self.wait_some(1.0)
                if self.options.speed is not None:
                    self._sample_queue()
            self.tier.drain()
            self.handle(self.tier.get_finished_jobs())
        finally:
            self.progress.close()
        return time.perf_counter() - t_start, _rusage_cpu() - cpu0

    # ---------------------------------------------------------------- requests

    def _origin_ms(self, requests: Sequence[Request]) -> int:
        o = self.options.time_origin_ms
        return o if o is not None else (requests[0].timestamp_ms if requests else 0)

    def arrive(self, req: Request, arrival_t: float, trace_s: float) -> _Req:
        """The request's record: its keys (those the replay moves) and counts."""
        c = self.counters
        t0 = time.thread_time()
        keys = [block_key(h, s, self.block_size) for h in req.hash_ids for s in range(self.moved)]
        c.harness_cpu_s += time.thread_time() - t0
        c.blocks_requested += len(keys)
        c.prompt_tokens += req.input_length
        rq = _Req(len(self.records), req, keys, arrival_t, trace_s)
        self.records.append(rq)
        return rq

    def replay_request(self, req: Request) -> None:
        """Back to back: phase 1 (longest held prefix), phase 2 (load it, check it), then store
        the rest."""
        c = self.counters
        if self._origin is None:
            self._origin = self._origin_ms([req])
        rq = self.arrive(req, self._now(), (req.timestamp_ms - self._origin) / 1000)
        keys = rq.keys
        hits = self.longest_prefix(keys)
        rq.hits = hits
        c.hit_tokens += min(hits * self.unit_tokens, req.input_length)
        slots = self.take_slots(len(keys))
        rq.sched_t = self._now()
        k = rq.loads = self._loadable(rq, hits)
        if k:
            self.load(keys[:k], slots[:k], rq)
        else:
            self.poll()
        self._free_slots.extend(slots[k:hits])  # bypassed: recomputed, not loaded nor stored
        if hits < len(keys):
            self.store(keys[hits:], slots[hits:])
        self.poll()
        self._sample_queue()

    def serve(self, requests: Sequence[Request]) -> None:
        """By arrival time (see the class docstring): returns once every request was looked up
        and its jobs submitted."""
        o = self.options
        step_s = o.step_ms / 1000.0
        origin = self._origin = self._origin_ms(requests)
        trace_s = [(r.timestamp_ms - origin) / 1000 for r in requests]
        arrivals = [max(0.0, t / o.speed) for t in trace_s]  # seconds into the run
        waiting: list[_Req] = []
        nxt, step, n = 0, 0, len(requests)
        while nxt < n or waiting:
            self._guard.check()
            now = self._now()
            due = self.t0 + step * step_s
            if now < due:
                self._idle(due - now)
                continue
            rel = now - self.t0
            while nxt < n and arrivals[nxt] <= rel:
                waiting.append(self.arrive(requests[nxt], self.t0 + arrivals[nxt], trace_s[nxt]))
                nxt += 1
            self._waiting = len(waiting)
            self.step(waiting, step, now)
            self._waiting = len(waiting)
            self.tier.on_step_end()
            self.poll()
            self._sample_queue(now)
            self.counters.steps += 1
            step = max(step + 1, math.floor(rel / step_s) + 1)
            if not waiting and nxt < n:  # nothing to do until the next arrival
                step = max(step, math.ceil(arrivals[nxt] / step_s - 1e-9))

    def step(self, waiting: list[_Req], step: int, now: float) -> None:
        """One scheduler step over the requests that arrived (first come, first served)."""
        c = self.counters
        scheduled = i = 0
        while i < len(waiting):
            rq = waiting[i]
            if len(self._free_slots) < len(rq.keys):
                # no room in the arena (the engine's memory) for it: it and those after it wait
                for r in waiting[i:]:
                    r.deferred += 1
                c.requests_deferred += len(waiting) - i
                break
            hits = self._prefix_or_retry(rq, now)
            if hits is None:  # a RETRY before the first MISS: asked again at the next step
                rq.deferred += 1
                c.requests_deferred += 1
                c.requests_deferred_retry += 1
                i += 1
                continue
            del waiting[i]
            rq.step, rq.sched_t, rq.hits = step, now, hits
            self._schedule(rq, hits)
            scheduled += 1
        c.max_requests_per_step = max(c.max_requests_per_step, scheduled)

    def _prefix_or_retry(self, rq: _Req, now: float) -> int | None:
        """The request's lookups in order up to the first MISS: the hits before it, or None
        at a RETRY (nothing counted but the RETRY). A RETRY that outlasts
        _LOOKUP_RETRY_DEADLINE_S with nothing of the replay's in flight is an error, a MISS."""
        c = self.counters
        R = self._lookup_result
        hits = pending = looked = 0
        for key in rq.keys:
            res = self.tier.lookup(key)
            if res == R.RETRY:
                c.lookup_retries += 1
                if self._pending:  # a store of ours may be what it waits for
                    rq.retry_since = None
                    return None
                if rq.retry_since is None:
                    rq.retry_since = now
                    return None
                if now - rq.retry_since <= _LOOKUP_RETRY_DEADLINE_S:
                    return None
                c.error(f"lookup of {key.hex()} still RETRY after {_LOOKUP_RETRY_DEADLINE_S:.0f} s "
                        "with nothing in flight; treated as MISS")
                res = R.MISS
            looked += 1
            if res == R.HIT:
                hits += 1
            elif res == R.HIT_PENDING:
                hits += 1
                pending += 1
            else:
                break
        c.blocks_looked_up += looked
        c.blocks_hit += hits
        c.blocks_hit_pending += pending
        return hits

    def _schedule(self, rq: _Req, hits: int) -> None:
        """A looked-up request: its load job now, its store job once the load finished."""
        c = self.counters
        keys = rq.keys
        c.hit_tokens += min(hits * self.unit_tokens, rq.req.input_length)
        slots = self.take_slots(len(keys))
        k = rq.loads = self._loadable(rq, hits)
        self._free_slots.extend(slots[k:hits])  # bypassed: recomputed, not loaded nor stored

        def store() -> None:
            self.store(keys[hits:], slots[hits:])

        then = store if hits < len(keys) else None
        if k:
            self._submit(True, keys[:k], slots[:k], rq, then)
        elif then is not None:
            then()
        self.progress.show(self.bar_text())
        self.progress.advance()

    def _loadable(self, rq: _Req, hits: int) -> int:
        """Of ``hits`` blocks found, how many to load: all, or with --bypass auto the prefix
        that loads no slower than it recomputes (bytes in flight counted)."""
        w = self.options.worth
        if not hits or w is None or not w.bypass:
            return hits
        k = w.loadable(rq, hits, self._inflight_bytes[1])
        if k < hits:
            self.counters.blocks_bypassed += hits - k
            self.counters.requests_bypassed += 1
        return k

    def _idle(self, seconds: float) -> None:
        """Until the next step: waits for jobs (handled as they finish), or sleeps."""
        if self._pending:
            self.wait_some(min(seconds, 1.0))
            self._sample_queue()
        else:
            self.options.sleep(seconds)

    def _sample_queue(self, now: float | None = None) -> None:
        self.queue_samples.append((self._now() if now is None else now, self._inflight_bytes[1],
                                   self._inflight_bytes[0]))

    # ---------------------------------------------------------------- back to back

    def longest_prefix(self, keys: Sequence[bytes]) -> int:
        """Looks ``keys`` up in order up to the first MISS; the number of hits before it."""
        c = self.counters
        hits = 0
        for key in keys:
            res = self.lookup(key)
            c.blocks_looked_up += 1
            if res == self._lookup_result.HIT:
                hits += 1
            elif res == self._lookup_result.HIT_PENDING:
                hits += 1
                c.blocks_hit_pending += 1
            else:
                break
        self.tier.on_step_end()
        c.blocks_hit += hits
        return hits

    def load(self, keys: list[bytes], slots: list[int], req: _Req | None = None) -> None:
        """One load job for ``keys`` into ``slots``; returns once it finished (and was checked)."""
        jid = self._submit(True, keys, slots, req)
        while jid in self._pending:
            self.wait_some(1.0)

    def store(self, keys: list[bytes], slots: list[int]) -> None:
        """Makes the blocks of ``keys`` in ``slots`` and submits one store job (not waited for)."""
        t0 = time.thread_time()
        for key, slot in zip(keys, slots):
            self.pattern.fill(self.slot_view(slot), key)
        self.counters.harness_cpu_s += time.thread_time() - t0
        self._submit(False, keys, slots)

    def _submit(self, is_load: bool, keys: list[bytes], slots: list[int], req: _Req | None = None,
                then: Callable[[], None] | None = None) -> int:
        jid = next(self._job_ids)
        self._pending[jid] = _Pending(is_load, keys, slots, self._now(), req, then)
        job = self._job(jid, keys, slots)
        if is_load:
            self.tier.submit_load(job)
            self.counters.load_jobs += 1
        else:
            self.tier.submit_store(job)
            self.counters.store_jobs += 1
        self._inflight_bytes[is_load] += len(keys) * self.block_size
        return jid

    def slot_view(self, slot: int) -> np.ndarray:
        """The uint64 words of arena slot ``slot``."""
        return self._arena64[slot * self._words : (slot + 1) * self._words]

    def lookup(self, key: bytes) -> Any:
        """The tier's answer for ``key``, asked again after a scheduler step while it is RETRY.
        A RETRY that outlasts _LOOKUP_RETRY_DEADLINE_S with nothing in flight is an error, MISS."""
        deadline = None
        while True:
            res = self.tier.lookup(key)
            if res != self._lookup_result.RETRY:
                return res
            self.counters.lookup_retries += 1
            self.tier.on_step_end()  # the next scheduler step: flushes the existence probe
            if self._pending:
                # a block being written answers RETRY until its store lands, however long that
                # takes; wait_some() gives up only if the tier stops finishing jobs
                deadline = None
                self.wait_some(0.01)
                continue
            # nothing of ours in flight: only an existence probe can be pending
            if deadline is None:
                deadline = time.monotonic() + _LOOKUP_RETRY_DEADLINE_S
            elif time.monotonic() > deadline:
                self.counters.error(f"lookup of {key.hex()} still RETRY after {_LOOKUP_RETRY_DEADLINE_S:.0f} s "
                                    "with nothing in flight; treated as MISS")
                return self._lookup_result.MISS
            time.sleep(0.0002)

    def take_slots(self, n: int) -> list[int]:
        """``n`` free arena slots, waiting for jobs in flight to free them."""
        while len(self._free_slots) < n:
            if not self._pending:
                raise RuntimeError(f"arena exhausted: need {_plural(n, 'slot')}, {len(self._free_slots)} free, "
                                   "nothing in flight")
            self.wait_some(0.1)
        return [self._free_slots.pop() for _ in range(n)]

    def poll(self) -> None:
        if self._pending:
            self.handle(self.tier.get_finished_jobs())

    def wait_some(self, timeout: float = 0.05) -> None:
        """Waits up to ``timeout`` s for jobs and handles them; RuntimeError once none finished
        for _STALL_DEADLINE_S with jobs in flight."""
        self._guard.check()
        results = self.tier.wait(timeout_s=timeout)
        if results:
            self.handle(results)
        elif self._pending and time.monotonic() - self._last_finish > _STALL_DEADLINE_S:
            raise RuntimeError(
                f"tier stalled: {_plural(len(self._pending), 'job')} in flight and none finished for "
                f"{_STALL_DEADLINE_S:.0f} s (job ids {sorted(self._pending)[:8]})"
            )

    def handle(self, results: Iterable[Any]) -> None:
        """Counts finished jobs (JobResults), checks loaded bytes, frees their slots; a load's
        request then submits its store."""
        now = self._now()
        loads: list[_Pending] = []
        for r in results:
            self._last_finish = time.monotonic()
            p = self._pending.pop(r.job_id, None)
            if p is None:
                self.counters.error(f"job {r.job_id}: finished but was never submitted (or finished twice)")
                continue
            if bool(r.is_load) != p.is_load:
                self.counters.error(f"job {r.job_id}: reported is_load={r.is_load}, "
                                    f"submitted as {'load' if p.is_load else 'store'}")
            self._inflight_bytes[p.is_load] -= len(p.keys) * self.block_size
            if r.successful_keys is None:
                ok_keys = set(p.keys) if r.success else set()
            else:
                ok_keys = set(r.successful_keys)
            self._count_failures(r, p, ok_keys)
            if p.is_load:
                self._check_loaded(r, p, ok_keys, now)
                loads.append(p)
            else:
                self._count_stored(r, p, ok_keys, now)
            self._free_slots.extend(p.slots)
            if p.then is not None:
                p.then()
        if loads:
            self._loads_finished(loads, now)
        self.progress.show(self.bar_text())

    def _loads_finished(self, loads: list[_Pending], now: float) -> None:
        """The bandwidth estimate learns the loads that finished: their bytes over the time the
        disk was busy with them (since the last load finished, or since they were submitted)."""
        for p in loads:
            if p.req is not None:
                p.req.load_s = now - p.submit_t
        w = self.options.worth
        start = max(min(p.submit_t for p in loads), self._last_load_done)
        self._last_load_done = now
        if w is not None and now > start:
            w.loads_finished(sum(len(p.keys) for p in loads) * self.block_size, now - start, now)

    def _count_failures(self, r: Any, p: _Pending, ok_keys: set[bytes]) -> None:
        """Keys of job ``r`` not in ``ok_keys``: a store the tier declined under capacity
        pressure is counted, not an error; any other failed key is an error."""
        c = self.counters
        reasons = getattr(r, "failed_keys", None) or {}
        kind = "load" if p.is_load else "store"
        hard = []
        for k in (k for k in p.keys if k not in ok_keys):
            reason = str(reasons.get(k, "no reason given"))
            c.key_failed(kind, reason)
            if p.is_load:
                c.load_failed_keys += 1
                hard.append(k)
            elif reason.startswith(_STORE_REJECTIONS):
                c.store_rejected_keys += 1
            else:
                c.store_failed_keys += 1
                hard.append(k)
        if hard:
            c.error(f"{kind} job {r.job_id}: {len(hard)} of {_plural(len(p.keys), 'key')} failed "
                    f"(first {hard[0].hex()}: {reasons.get(hard[0], 'no reason given')})", len(hard))

    def _check_loaded(self, r: Any, p: _Pending, ok_keys: set[bytes], now: float) -> None:
        c = self.counters
        c.load_intervals.append((p.submit_t, now))
        c.load_latencies.append(now - p.submit_t)
        t0 = time.thread_time()
        loaded = 0
        for key, slot in zip(p.keys, p.slots):
            if key not in ok_keys:
                continue
            loaded += 1
            if not self.pattern.matches(self.slot_view(slot), key):
                c.verification_failures += 1
                c.sample(f"load job {r.job_id}: block {key.hex()} (slot {slot}) has the wrong bytes")
        c.harness_cpu_s += time.thread_time() - t0
        c.blocks_loaded += loaded
        c.bytes_loaded += self.block_size * loaded

    def _count_stored(self, r: Any, p: _Pending, ok_keys: set[bytes], now: float) -> None:
        c = self.counters
        c.store_intervals.append((p.submit_t, now))
        n_ok = sum(1 for k in p.keys if k in ok_keys)
        c.blocks_stored += n_ok
        written = r.transfer_bytes
        c.bytes_stored += int(written) if written is not None else self.block_size * n_ok

    def bar_text(self) -> str:
        """What the progress bar shows: the summary's figures so far (stores count when they
        finish, as in the summary), and the stores still in flight."""
        c = self.counters
        storing = sum(1 for p in self._pending.values() if not p.is_load)
        return (f"hit {c.block_hit_ratio:.2%}, loaded {format_bytes(c.bytes_loaded)}, "
                f"stored {format_bytes(c.bytes_stored)}"
                + (f" (+{storing} store job{'s' if storing != 1 else ''} in flight)" if storing else "")
                + (f", {self._waiting} waiting" if self._waiting else ""))


def _requests_of(config: ReplayConfig, requests: Sequence[Request] | None) -> tuple[list[Request], str]:
    """The requests to replay and the trace's name for the summary."""
    if requests is None:
        requests = load_trace(config.trace, config.max_requests)
        trace_name = config.trace if config.trace is not None else "<bundled mooncake_conversation_trace.jsonl.gz>"
        if not requests:
            raise ReplayConfigError(f"{trace_name}: the trace holds no requests")
        return list(requests), str(trace_name)
    requests = list(requests)
    if config.max_requests is not None:
        requests = requests[: config.max_requests]
    return requests, "<in-memory>" if config.trace is None else str(config.trace)


def _open_given_root(root: str) -> str:
    """``root`` (``~`` expanded, as a shell would) as an absolute path, made (0700) if missing;
    ReplayConfigError naming it. An empty root is refused, as DiskTier and the operators'
    commands refuse it: it would mean the current directory (``--root "$UNSET"``)."""
    if not root:
        raise ReplayConfigError("root '' is empty (it would mean the current directory)")
    root = os.path.abspath(os.path.expanduser(root))
    if os.path.exists(root) and not os.path.isdir(root):
        raise ReplayConfigError(f"cannot open the tier at {root}: not a directory")
    try:
        os.makedirs(root, 0o700, exist_ok=True)
    except OSError as exc:
        raise ReplayConfigError(f"cannot open the tier at {root}: {exc.strerror}") from exc
    return root


def _summarize(driver: ReplayDriver, config: ReplayConfig, model: str, trace_name: str,
               root: str, arena_bytes: int, nrequests: int, wall: float, cpu: float) -> ReplaySummary:
    c = driver.counters
    stats = dict(driver.tier.stats())
    engine_name = str(stats.get("engine") or getattr(driver.tier, "engine_name", None) or config.engine)
    if "direct" in stats:
        engine_name += ", O_DIRECT" if stats["direct"] else ", buffered I/O"
    tier_verify = int(stats.get("verify_failures", 0) or 0)
    if tier_verify:
        c.error(f"the tier found {_plural(tier_verify, 'block')} on disk that failed their checksum/identity "
                "proof", 0)
    kv_per_token = _models.get_preset(config.model).kv_bytes_per_token
    moved_gib = (c.bytes_loaded + c.bytes_stored) / (1 << 30)
    load_busy = _union_seconds(c.load_intervals)
    store_busy = _union_seconds(c.store_intervals)
    lat = sorted(c.load_latencies)
    counted = ({f.name for f in fields(ReplaySummary)} & {f.name for f in fields(ReplayCounters)}
               - {"errors", "failure_reasons", "error_samples"})
    waits = sorted(r.sched_t - r.arrival_t for r in driver.records
                   if not math.isnan(r.sched_t)) if driver.options.speed is not None else []
    worth = driver.options.worth
    figures, series = worth.figures(driver.records) if worth is not None else ({}, [])
    summary = ReplaySummary(
        **{name: getattr(c, name) for name in counted},
        trace=trace_name, model=model, tokens_per_block=driver.tokens_per_block,
        block_size_bytes=driver.block_size, engine=engine_name, root=root, root_removed=False,
        capacity_bytes=config.capacity_bytes, arena_bytes=arena_bytes, requests=nrequests,
        block_hit_ratio=c.block_hit_ratio,
        byte_hit_ratio=c.hit_tokens / c.prompt_tokens if c.prompt_tokens else 0.0,
        prompt_kv_bytes=c.prompt_tokens * kv_per_token,
        hit_kv_bytes=c.hit_tokens * kv_per_token,
        load_busy_s=load_busy,
        store_busy_s=store_busy,
        load_gbps=c.bytes_loaded / load_busy / 1e9 if load_busy > 0 else 0.0,
        store_gbps=c.bytes_stored / store_busy / 1e9 if store_busy > 0 else 0.0,
        load_latency_ms_p50=None if not lat else _percentile(lat, 50) * 1e3,
        load_latency_ms_p99=None if not lat else _percentile(lat, 99) * 1e3,
        load_latency_ms_max=None if not lat else lat[-1] * 1e3,
        cpu_s=cpu,
        cpu_s_per_gib=cpu / moved_gib if moved_gib > 0 else None,
        tier_cpu_s_per_gib=max(0.0, cpu - c.harness_cpu_s) / moved_gib if moved_gib > 0 else None,
        evictions=int(stats.get("evictions", 0) or 0),
        tier_verify_failures=tier_verify,
        errors=c.errors + tier_verify,
        failure_reasons=dict(sorted(c.failure_reasons.items(), key=lambda kv: -kv[1])),
        error_samples=c.error_samples,
        wall_s=wall,
        run_s=wall,
        tier_stats={k: jsonable(v) for k, v in stats.items()},
        tier_kind=config.tier,
        speed=driver.options.speed,
        step_ms=None if driver.options.speed is None else driver.options.step_ms,
        schedule_wait_ms_p50=None if not waits else _percentile(waits, 50) * 1e3,
        schedule_wait_ms_p99=None if not waits else _percentile(waits, 99) * 1e3,
        blocks_per_trace_block=driver.subblocks,
        moved_per_trace_block=driver.moved,
        gpu=None if worth is None else config.gpu,
        mfu=None if worth is None else config.mfu,
        disk_gbps=config.disk_gbps,
        bypass=config.bypass,
        store_share=config.store_share if config.tier == "pykvtier" else None,
        **figures,
    )
    summary.timeline = _timeline(driver, series)
    return summary


def _timeline(driver: ReplayDriver, series: list[dict[str, Any]]) -> dict[str, Any]:
    """What --plot draws, against trace time (s from the time origin): per request its hit
    ratio, measured load time and TTFTs; the bytes of the loads and of the stores in flight
    (ReplayDriver.queue_samples: at each step and each wait for jobs; back to back: per
    request). Not part of the summary's fields (nor its JSON)."""
    speed = driver.options.speed
    reqs = [r for r in driver.records if not math.isnan(r.sched_t)]
    if speed is None:  # back to back: a sample after each request, at its trace time
        qx = [r.trace_s for r in reqs][: len(driver.queue_samples)]
    else:
        qx = [(t - driver.t0) * speed for t, _, _ in driver.queue_samples]
    return {
        "speed": speed,
        "trace_s": [r.trace_s for r in reqs],
        "hit_ratio": [r.hits / len(r.keys) if r.keys else 0.0 for r in reqs],
        "hits": [r.hits for r in reqs],
        "blocks": [len(r.keys) for r in reqs],
        "load_ms": [(r.trace_s, r.load_s * 1e3) for r in reqs if r.load_s is not None],
        "queue": [(x, lb, sb) for x, (_, lb, sb) in zip(qx, driver.queue_samples)],
        "ttft": series,
    }


class _Opened:
    """What a replay opened and its clean-up closes: the tier, the arena's mapping, the
    temporary root."""

    def __init__(self) -> None:
        self.tier: Any = None
        self.mm: mmap.mmap | None = None
        self.temp_root: str | None = None

    def close(self, guard: _SignalGuard, unwinding: bool) -> bool:
        """Shuts the tier down (in-flight I/O finishes: nothing writes under the root after
        it), unmaps the arena, removes the temporary root; then the guard's release. Whether
        the temporary root is gone. The first shutdown error is raised unless ``unwinding``
        (then printed)."""
        errors: list[BaseException] = []
        if self.tier is not None:
            try:
                self.tier.shutdown()
            except Exception as exc:  # noqa: BLE001 - the root is removed all the same
                errors.append(exc)
            self.tier = None
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:
                pass  # something still holds a view (the tier); the GC unmaps it later
        root_removed = _remove_tree(self.temp_root) if self.temp_root is not None else False
        guard.release(unwinding)  # raises for a signal that came during the clean-up
        if errors:
            if not unwinding:
                raise errors[0]
            print(f"pykvtier replay: shutting the tier down failed: {errors[0]!r}", file=sys.stderr)
        return root_removed


def _arena_enomem(nslots: int, need: int, block_size: int, nrequests: int, exc: OSError) -> str:
    """The one-line error for an arena the memory cannot hold, with the ways out."""
    arena = nslots * block_size
    smaller = (f", a smaller --arena (down to {format_bytes(need * block_size)}, the largest request)"
               if nslots > need else "")
    largest = "the request" if nrequests == 1 else f"the largest of the {nrequests} requests"
    return (f"cannot allocate the host arena of {format_bytes(arena)} ({_plural(nslots, 'block')} of "
            f"{format_bytes(block_size)}; {largest} needs {need}): "
            f"{exc.strerror or os.strerror(errno.ENOMEM)}; replay fewer requests (--max-requests N), "
            f"a smaller model (--model){smaller}, or run where more memory is free")


def run_replay(
    config: ReplayConfig,
    requests: Sequence[Request] | None = None,
    *,
    tier_factory: Callable[[str, int, int | None, str], Any] | None = None,
    driver_factory: Callable[..., ReplayDriver] | None = None,
    clock: Callable[[], float] | None = None,
    sleep: Callable[[float], None] | None = None,
    prefill: Any = None,
    bandwidth: Any = None,
) -> ReplaySummary:
    """Replay ``requests`` (default: ``load_trace(config.trace, config.max_requests)``).

    ``tier_factory(root, block_size_bytes, capacity_bytes, engine)`` makes the tier
    (default: :class:`pykvtier.DiskTier`, or with ``config.tier`` "vllm-fs" vLLM's fs tier);
    ``driver_factory`` takes ReplayDriver's arguments and makes the driver (default:
    ReplayDriver; ``--nodes`` records keys through a subclass). ``clock`` and ``sleep`` are the
    driver's time source (default ``time.perf_counter``, ``time.sleep``; see DriverOptions);
    ``prefill`` replaces the cost model's ``PrefillModel(model, gpu, mfu)`` (its
    ``block_seconds``, ``prefix_seconds``, ``break_even_bytes_per_s``); ``bandwidth`` the
    measured disk's bandwidth estimate for ``--bypass auto`` (e.g. a
    ``costmodel.FixedBandwidth``; default a fresh ``BandwidthEstimate``).

    Without ``config.root`` the blocks go to a temporary directory, removed when the replay
    ends, however it ends: an error, or SIGINT/SIGTERM at any point (called from the main
    thread). A signal raises what the caller's handler raises (KeyboardInterrupt for Ctrl-C);
    one whose action is the default ends the process with it once the clean-up is done. The
    clean-up (tier shutdown: in-flight I/O finishes; arena; removal) is not interrupted by
    further signals; one arriving during it is delivered after it.
    """
    t_begin = time.perf_counter()
    preset = _models.get_preset(config.model)
    tpb = _models.validate_tokens_per_block(config.tokens_per_block)
    bs = preset.block_size_bytes(tpb)
    _check_schedule(config)
    subblocks = TRACE_BLOCK_TOKENS // tpb
    moved = moved_per_trace_block(bs, subblocks, config.kv_sample_bytes)
    worth = _make_worth(config, preset, tpb, bs, subblocks, moved, prefill, bandwidth)
    requests, trace_name = _requests_of(config, requests)
    max_blocks = max((len(r.hash_ids) * moved for r in requests), default=1)
    nslots = _arena_slots(max_blocks, bs, config.arena_bytes, config.speed is not None)
    root = _open_given_root(config.root) if config.root is not None else None
    factory = tier_factory or _tier_factory(config)
    options = DriverOptions(speed=config.speed, step_ms=config.step_ms,
                            time_origin_ms=config.time_origin_ms, moved_per_trace_block=moved,
                            worth=worth, clock=clock or time.perf_counter, sleep=sleep or time.sleep)
    opened = _Opened()
    driver = arena = None
    guard = _SignalGuard()
    try:
        guard.install()
        if root is None:
            guard.hold = True  # the directory exists only once its path is recorded
            root = opened.temp_root = tempfile.mkdtemp(prefix="pykvtier-replay-")
            guard.hold = False
            guard.check()
        try:
            opened.mm, arena = _allocate_arena(nslots * bs)
        except OSError as exc:
            if exc.errno != errno.ENOMEM:
                raise
            raise ReplayConfigError(_arena_enomem(nslots, max(1, max_blocks), bs, len(requests), exc)) from exc
        try:
            opened.tier = factory(root, bs, config.capacity_bytes, config.engine)
        except ValueError as exc:  # bad engine, unusable root, capacity below one block, ...
            raise ReplayConfigError(f"cannot open the tier at {root}: {exc}") from exc
        opened.tier.set_arena(arena)
        driver = (driver_factory or ReplayDriver)(opened.tier, arena, bs, tpb, guard,
                                                  _Progress(len(requests), config.progress), options)
        setup = time.perf_counter() - t_begin
        wall, cpu = driver.run(requests)
        summary = _summarize(driver, config, preset.name, trace_name, root, nslots * bs, len(requests),
                             wall, cpu)
        t_cleanup = time.perf_counter()
    finally:
        guard.hold = True  # first (a plain store: no signal handler runs before it)
        unwinding = sys.exc_info()[1] is not None
        driver = arena = None  # noqa: F841 - drop our views so the mapping can close
        root_removed = opened.close(guard, unwinding)
    summary.root_removed = root_removed
    summary.setup_s = setup
    summary.cleanup_s = time.perf_counter() - t_cleanup
    summary.wall_s = time.perf_counter() - t_begin
    return summary


def moved_per_trace_block(block_size: int, subblocks: int, kv_sample_bytes: int | None) -> int:
    """Engine blocks the replay moves of each trace block's ``subblocks``: every one
    (``kv_sample_bytes`` None), else its first ``n``, the largest divisor of ``subblocks`` whose
    blocks fit ``kv_sample_bytes`` (at least one)."""
    if kv_sample_bytes is None:
        return subblocks
    if kv_sample_bytes <= 0:
        raise ReplayConfigError(f"the KV sample must be positive, got {kv_sample_bytes} B")
    fit = max(1, kv_sample_bytes // block_size)
    return max(d for d in range(1, subblocks + 1) if subblocks % d == 0 and d <= fit)


def _check_schedule(config: ReplayConfig) -> None:
    if config.speed is not None and not (config.speed > 0 and math.isfinite(config.speed)):
        raise ReplayConfigError(f"the speed must be a positive number, got {config.speed}")
    if not (config.step_ms > 0 and math.isfinite(config.step_ms)):
        raise ReplayConfigError(f"the scheduler step must be a positive number of ms, got {config.step_ms}")
    if config.bypass not in BYPASS_MODES:
        raise ReplayConfigError(f"bypass must be one of {', '.join(BYPASS_MODES)}, got {config.bypass!r}")
    if config.disk_gbps is not None and not (config.disk_gbps > 0 and math.isfinite(config.disk_gbps)):
        raise ReplayConfigError(f"the modeled disk's GB/s must be positive, got {config.disk_gbps}")
    if not (0 < config.mfu <= 1):
        raise ReplayConfigError(f"the MFU must be in (0, 1], got {config.mfu}")
    if config.tier not in TIER_KINDS:
        raise ReplayConfigError(f"tier must be one of {', '.join(TIER_KINDS)}, got {config.tier!r}")


def _make_worth(config: ReplayConfig, preset: _models.ModelPreset, tpb: int, bs: int, subblocks: int,
                moved: int, prefill: Any = None, bandwidth: Any = None) -> _Worth:
    """The replay's cost model (:class:`_Worth`) for ``config``."""
    from . import costmodel

    if prefill is None:
        try:
            gpu = costmodel.get_gpu(config.gpu)
        except (KeyError, ValueError) as exc:
            raise ReplayConfigError(str(exc.args[0] if exc.args else exc)) from None
        prefill = costmodel.PrefillModel(preset, gpu, mfu=config.mfu)
    scale = subblocks // moved
    return _Worth(costmodel, prefill, tpb, TRACE_BLOCK_TOKENS // moved, bs * scale, scale,
                  config.bypass == "auto", config.disk_gbps, bandwidth)


def _tier_factory(config: ReplayConfig) -> Callable[[str, int, int | None, str], Any]:
    """The tier ``config.tier`` names: pykvtier's DiskTier, or vLLM's own fs tier."""
    if config.tier == "vllm-fs":
        from . import replay_tiers

        try:
            return replay_tiers.vllm_fs_tier_factory(config)
        except replay_tiers.TierUnavailableError as exc:
            raise ReplayConfigError(str(exc)) from None
    return lambda r, b, c, e: _default_tier_factory(r, b, c, e, config.recycle,
                                                    config.store_share)


# --------------------------------------------------------------------------------------
# the replay across nodes (``pykvtier replay --nodes ROOT_A,ROOT_B``)

#: How ``--nodes`` deals the requests out: request i (in trace order) to node i mod N. The
#: Mooncake format has no conversation or session field to deal by; dealing by order spreads
#: the prefixes that later requests reuse over the nodes, as a balancer without prefix affinity.
NODES_DEAL = "round robin by request order"
_NODES_DIR_PREFIX = "pykvtier-replay-nodes-"
#: A load's reasons for a block its lookup found that left the shared root before the load: its
#: file gone (ENOENT), or the root's evictor's announcement of its eviction applied meanwhile
#: (the tier refuses the load without I/O).
_LOST_REASONS = ("ENOENT", "not in the tier")


class _CountingPattern(BlockPattern):
    """A BlockPattern that counts the bytes :meth:`matches` compared (``bytes_compared``)."""

    def __init__(self, block_size_bytes: int) -> None:
        super().__init__(block_size_bytes)
        self.bytes_compared = 0

    def matches(self, data: np.ndarray, key: bytes) -> bool:
        self.bytes_compared += data.nbytes
        return super().matches(data, key)


class _VerifyCountingDriver(ReplayDriver):
    """ReplayDriver whose checks of loaded blocks count the bytes they compared
    (``pattern.bytes_compared``); nothing else differs."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.pattern = _CountingPattern(self.block_size)


class _NodeDriver(_VerifyCountingDriver):
    """The driver of one node of ``--nodes``. Besides what ReplayDriver counts, it records each
    key it stored (``stored``: the submit time of its first successful store) and each block it
    loaded and checked (``loaded``, ``loaded_t``: key and the time its load finished, in order),
    and counts a load of a block that left the shared root after this node's lookup found it
    (evicted: its file gone, ENOENT, or the eviction announced to this tier in between, "not in
    the tier"; an engine recomputes the block) in ``load_lost_keys`` instead of as an error. Times are ``time.perf_counter()``: on Linux the machine's monotonic
    clock, one clock for all the node processes (they run on this machine)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.stored: dict[bytes, float] = {}
        self.loaded: list[bytes] = []
        self.loaded_t: list[float] = []
        self.load_lost_keys = 0

    def _count_failures(self, r: Any, p: _Pending, ok_keys: set[bytes]) -> None:
        if p.is_load:
            reasons = getattr(r, "failed_keys", None) or {}
            lost = {k for k in p.keys
                    if k not in ok_keys and str(reasons.get(k, "")).startswith(_LOST_REASONS)}
            if lost:
                self.load_lost_keys += sum(1 for k in p.keys if k in lost)
                ok_keys = ok_keys | lost  # (not failures; _check_loaded still skips them)
        super()._count_failures(r, p, ok_keys)

    def _check_loaded(self, r: Any, p: _Pending, ok_keys: set[bytes], now: float) -> None:
        super()._check_loaded(r, p, ok_keys, now)
        for key in p.keys:
            if key in ok_keys:
                self.loaded.append(key)
                self.loaded_t.append(now)

    def _count_stored(self, r: Any, p: _Pending, ok_keys: set[bytes], now: float) -> None:
        super()._count_stored(r, p, ok_keys, now)
        for key in p.keys:
            if key in ok_keys:
                self.stored.setdefault(key, p.submit_t)


def _shared_tier(root: str, block_size: int, capacity: int | None, engine: str) -> Any:
    """A node's tier: :class:`pykvtier.DiskTier` with ``shared=True``."""
    from . import DiskTier

    return DiskTier(root, block_size, capacity_bytes=capacity, engine=engine, shared=True)


def _node_main(conn: Any, start: Any, root: str, config: ReplayConfig, requests: list[Request],
               tier_factory: Callable[[str, int, int | None, str], Any]) -> None:
    """One node of ``--nodes``, in a process of its own (spawned): replays ``requests`` on the
    tier ``tier_factory`` makes at ``root`` once every node's tier is open (``start``, a
    barrier), and sends ``("ok", payload)`` through ``conn``, or ``(kind, message)``."""
    drivers: list[_NodeDriver] = []

    def factory(r: str, bs: int, cap: int | None, engine: str) -> Any:
        tier = tier_factory(r, bs, cap, engine)
        try:
            start.wait()  # every node's tier is open: the replays start together
        except BaseException:
            tier.shutdown()
            raise
        return tier

    def make_driver(*args: Any) -> _NodeDriver:
        drivers.append(_NodeDriver(*args))
        return drivers[-1]

    try:
        s = run_replay(config, requests, tier_factory=factory, driver_factory=make_driver)
    except KeyboardInterrupt:
        sys.exit(130)  # (the parent reports the interruption)
    except threading.BrokenBarrierError:
        conn.send(("aborted", "stopped before its replay started: another node failed"))
        sys.exit(1)
    except (ReplayConfigError, _models.UnknownModelError) as exc:
        conn.send(("config", str(exc)))
        sys.exit(2)
    except Exception as exc:  # noqa: BLE001 - reported by the parent, which fails the run
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        sys.exit(1)
    d = drivers[0]
    conn.send(("ok", {
        "summary": s.to_dict(),
        "stored_keys": b"".join(d.stored), "stored_t": list(d.stored.values()),
        "loaded_keys": b"".join(d.loaded), "loaded_t": d.loaded_t,
        "bytes_verified": d.pattern.bytes_compared, "load_lost_keys": d.load_lost_keys,
        "load_latencies": d.counters.load_latencies, "load_intervals": d.counters.load_intervals,
    }))


def _summary_of(d: dict[str, Any]) -> ReplaySummary:
    return ReplaySummary(**{f.name: d[f.name] for f in fields(ReplaySummary)})


def _split_keys(joined: bytes) -> list[bytes]:
    return [joined[i : i + _KEY.size] for i in range(0, len(joined), _KEY.size)]


@dataclass
class NodeResult:
    """One node of a ``--nodes`` replay: its summary and what it stored and loaded."""

    node: int
    root: str
    summary: ReplaySummary
    stored: dict[bytes, float]  # key -> submit time of its first successful store
    loaded: list[bytes]  # each block it loaded and checked, in order (a key once per load)
    loaded_t: list[float]  # when each of those loads finished
    bytes_verified: int  # bytes its checks compared with the key's bytes
    load_lost_keys: int  # blocks its lookup found that were evicted before the load
    load_latencies: list[float]
    load_intervals: list[tuple[float, float]]
    #: per loaded block, who had stored its key (the join of every node's stored keys):
    #: "own" (this node alone), "cross-node" (other nodes alone), "both" (this node and another:
    #: which copy was read cannot be told), "none" (no node of the run: must not happen)
    loaded_from: list[str] = field(default_factory=list)
    #: cross-node blocks whose every other-node store was submitted after the load finished
    #: (impossible: the join would be wrong); must be 0
    cross_stored_after_load: int = 0

    def count(self, source: str) -> int:
        return sum(1 for s in self.loaded_from if s == source)


@dataclass
class NodesReplay:
    """Result of :func:`run_nodes`: every node's replay, their total, and the single-node
    replay of the same requests."""

    trace: str
    deal: str
    base: str  # the fresh directory (under the first root) that held both runs' roots
    base_removed: bool
    nodes: list[NodeResult]
    single: ReplaySummary  # a plain replay (one process, shared=False) of all the requests
    single_bytes_verified: int
    total: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # what fails the run besides the summaries

    @property
    def ok(self) -> bool:
        return not self.problems and self.single.ok and all(n.summary.ok for n in self.nodes)

    def to_dict(self) -> dict[str, Any]:
        nodes = []
        for n in self.nodes:
            nodes.append({"node": n.node, **_nodes_row([n]), "summary": n.summary.to_dict()})
        return {
            "trace": self.trace, "deal": self.deal, "base": self.base,
            "base_removed": self.base_removed, "nodes": nodes, "total": self.total,
            "single_node": {**_single_row(self.single, self.single_bytes_verified),
                            "summary": self.single.to_dict()},
            "problems": self.problems, "ok": self.ok,
        }


def _nodes_row(nodes: Sequence[NodeResult]) -> dict[str, Any]:
    """The figures of one node, or the total of several (sums; latency percentiles over all
    their loads; GB/s: the bytes over the union of the time their loads were in flight)."""
    ss = [n.summary for n in nodes]

    def total(name: str) -> int:
        return sum(int(getattr(s, name)) for s in ss)

    lat = sorted(x for n in nodes for x in n.load_latencies)
    busy = _union_seconds(iv for n in nodes for iv in n.load_intervals)
    requested, looked_up, loaded = total("blocks_requested"), total("blocks_looked_up"), total("blocks_loaded")
    cross = sum(n.count("cross-node") for n in nodes)
    return {
        "root": nodes[0].root if len(nodes) == 1 else [n.root for n in nodes],
        "requests": total("requests"),
        "blocks_requested": requested,
        "blocks_looked_up": looked_up,
        "blocks_hit": total("blocks_hit"),
        "block_hit_ratio": total("blocks_hit") / requested if requested else 0.0,
        "blocks_loaded": loaded,
        "blocks_loaded_cross_node": cross,
        "blocks_loaded_both": sum(n.count("both") for n in nodes),
        "blocks_loaded_own": sum(n.count("own") for n in nodes),
        "blocks_loaded_unattributed": sum(n.count("none") for n in nodes),
        "cross_node_hit_ratio": cross / loaded if loaded else 0.0,
        "cross_node_of_looked_up": cross / looked_up if looked_up else 0.0,
        "cross_stored_after_load": sum(n.cross_stored_after_load for n in nodes),
        "load_lost_keys": sum(n.load_lost_keys for n in nodes),
        "bytes_loaded": total("bytes_loaded"),
        "bytes_verified": sum(n.bytes_verified for n in nodes),
        "load_latency_ms_p50": None if not lat else _percentile(lat, 50) * 1e3,
        "load_latency_ms_p99": None if not lat else _percentile(lat, 99) * 1e3,
        "load_latency_ms_max": None if not lat else lat[-1] * 1e3,
        "load_busy_s": busy,
        "load_gbps": sum(s.bytes_loaded for s in ss) / busy / 1e9 if busy > 0 else 0.0,
        "blocks_stored": total("blocks_stored"),
        "bytes_stored": total("bytes_stored"),
        "distinct_keys_stored": len(set().union(*(n.stored for n in nodes))),
        # the tier's own evictions, and those it made as the shared root's evictor
        "evictions": sum(int(s.evictions) + int(s.tier_stats.get("shared_evictions", 0) or 0) for s in ss),
        "verification_failures": total("verification_failures"),
        "errors": total("errors"),
        "cpu_s": sum(s.cpu_s for s in ss),
        "wall_s": max(s.wall_s for s in ss),
    }


def _single_row(s: ReplaySummary, bytes_verified: int) -> dict[str, Any]:
    """The single-node replay's figures under _nodes_row's names (no cross-node ones)."""
    names = ("requests", "blocks_requested", "blocks_looked_up", "blocks_hit", "block_hit_ratio",
             "blocks_loaded", "bytes_loaded", "load_latency_ms_p50", "load_latency_ms_p99",
             "load_latency_ms_max", "load_busy_s", "load_gbps", "blocks_stored", "bytes_stored",
             "evictions", "verification_failures", "errors", "cpu_s", "wall_s")
    return {"root": s.root, **{k: getattr(s, k) for k in names}, "bytes_verified": bytes_verified}


def _attribute(nodes: Sequence[NodeResult]) -> None:
    """Fills each node's ``loaded_from`` by the join of every node's stored keys, and its
    ``cross_stored_after_load``."""
    storers: dict[bytes, int] = {}  # key -> bit mask of the nodes that stored it
    for n in nodes:
        bit = 1 << n.node
        for key in n.stored:
            storers[key] = storers.get(key, 0) | bit
    for n in nodes:
        me = 1 << n.node
        out = n.loaded_from = []
        for key, t in zip(n.loaded, n.loaded_t):
            mask = storers.get(key, 0)
            if not mask:
                out.append("none")
            elif mask == me:
                out.append("own")
            elif mask & me:
                out.append("both")
            else:
                out.append("cross-node")
                if not any(o.stored[key] < t for o in nodes if mask >> o.node & 1):
                    n.cross_stored_after_load += 1


def _node_roots(roots: Sequence[str]) -> list[str]:
    """The roots of ``--nodes``: absolute paths of existing directories, at least two."""
    if len(roots) < 2:
        raise ReplayConfigError(f"--nodes needs at least two roots (comma-separated), got {len(roots)}")
    out = []
    for r in roots:
        if not r:
            raise ReplayConfigError("--nodes: an empty root (it would mean the current directory)")
        path = os.path.abspath(os.path.expanduser(r))
        if not os.path.isdir(path):
            raise ReplayConfigError(f"--nodes: {path} is not a directory (each root is a node's "
                                    "mount of one shared directory)")
        out.append(path)
    return out


def _check_one_directory(roots: Sequence[str], name: str) -> None:
    """``name`` (a fresh directory under the first root, holding a file ``check`` with a token)
    shows the same file through every root; else ReplayConfigError: they are not one
    directory, and no node could find another's blocks."""
    with open(os.path.join(roots[0], name, "check"), "rb") as f:
        token = f.read()
    for r in roots[1:]:
        try:
            with open(os.path.join(r, name, "check"), "rb") as f:
                seen = f.read()
        except OSError as exc:
            seen = exc
        if seen != token:
            why = (seen.strerror or str(seen)) if isinstance(seen, OSError) else "other bytes"
            raise ReplayConfigError(
                f"--nodes: {r} does not show what was written through {roots[0]} "
                f"({os.path.join(r, name, 'check')}: {why}): the roots must be mounts of one "
                "shared directory (or one path given twice)")


def _deal(requests: Sequence[Request], n: int) -> list[list[Request]]:
    """:data:`NODES_DEAL`: request i to node i mod n, each node's share in trace order."""
    return [list(requests[i::n]) for i in range(n)]


def _run_node_processes(config: ReplayConfig, node_roots: Sequence[str],
                        shares: Sequence[list[Request]],
                        tier_factory: Callable[[str, int, int | None, str], Any]) -> list[dict[str, Any]]:
    """Runs a process per node (spawned, concurrent: each starts its replay once all tiers are
    open) and returns their payloads in node order; ReplayConfigError or RuntimeError naming
    the first node that failed. Children still running when this unwinds are sent SIGTERM
    (their replay cleans up) and waited for."""
    import multiprocessing
    from multiprocessing.connection import wait as wait_any

    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(len(node_roots))
    procs: list[Any] = []
    conns: dict[Any, int] = {}
    results: list[Any] = [None] * len(node_roots)
    try:
        for i, (root, share) in enumerate(zip(node_roots, shares)):
            recv, send = ctx.Pipe(duplex=False)
            node_config = ReplayConfig(**{**asdict(config), "root": root, "progress": False})
            p = ctx.Process(target=_node_main, args=(send, start, root, node_config, share, tier_factory),
                            name=f"pykvtier-replay-node{i}", daemon=True)
            p.start()
            send.close()
            procs.append(p)
            conns[recv] = i
        while conns:
            for conn in wait_any(list(conns)):
                i = conns.pop(conn)
                try:
                    results[i] = conn.recv()
                except EOFError:  # it ended without a word
                    procs[i].join()
                    results[i] = ("died", f"ended with exit status {procs[i].exitcode} before its result")
                conn.close()
                if results[i][0] != "ok":
                    start.abort()  # the others stop waiting for it
        for p in procs:
            p.join()
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join()
    failed = [(i, r) for i, r in enumerate(results) if r[0] != "ok"]
    first = next((f for f in failed if f[1][0] != "aborted"), failed[0] if failed else None)
    if first is not None:
        i, (kind, msg) = first
        err = ReplayConfigError if kind == "config" else RuntimeError
        raise err(f"node {i} ({node_roots[i]}): {msg}")
    bad = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"node {bad[0][0]} ({node_roots[bad[0][0]]}) sent its result but ended "
                           f"with exit status {bad[0][1]}")
    return [r[1] for r in results]


def run_nodes(config: ReplayConfig, roots: Sequence[str], requests: Sequence[Request] | None = None,
              *, tier_factory: Callable[[str, int, int | None, str], Any] | None = None) -> NodesReplay:
    """The replay across nodes: the requests (default: ``load_trace(config.trace,
    config.max_requests)``) dealt out (:data:`NODES_DEAL`) to one process per root, each
    replaying its share on a ``shared=True`` tier, all at once; beside it a plain replay of all
    the requests by one process (``shared=False``), first.

    Each of ``roots`` is one node's mount of one shared directory (or the same path more than
    once). Under the first, a fresh directory (``pykvtier-replay-nodes-*``) holds ``nodes/``, the
    nodes' tier root (seen through each root), and ``single/``, the single-node replay's; it is
    removed at the end, however the run ends (as :func:`run_replay`'s temporary root).
    ``config.root`` must be None. ``tier_factory(root, block_size_bytes, capacity_bytes,
    engine)`` makes each node's tier, in its process (so a module-level function; default:
    :class:`pykvtier.DiskTier` with ``shared=True``); the single node's is run_replay's default.

    After the run, every node's stored keys are joined with every node's loaded blocks: a block
    a node loaded whose key only other nodes stored is a cross-node hit. The run fails
    (``ok`` False, ``problems``) when a summary does (a wrong byte, an error), when the bytes a
    node's checks compared differ from its blocks loaded x block size, or when the join finds a
    loaded block no node stored (or a cross-node hit stored only after it was loaded).
    """
    if config.root is not None:
        raise ReplayConfigError("--nodes takes the roots: no --root with it")
    roots = _node_roots(roots)
    _models.get_preset(config.model)
    _models.validate_tokens_per_block(config.tokens_per_block)
    requests, trace_name = _requests_of(config, requests)
    if config.time_origin_ms is None and requests:  # arrivals by time: one clock for every node
        config = ReplayConfig(**{**asdict(config), "time_origin_ms": requests[0].timestamp_ms})
    shares = _deal(requests, len(roots))
    guard = _SignalGuard()
    base: str | None = None
    base_removed = False
    try:
        guard.install()
        guard.hold = True  # the directory exists only once its path is recorded
        try:
            base = tempfile.mkdtemp(prefix=_NODES_DIR_PREFIX, dir=roots[0])
        except OSError as exc:
            raise ReplayConfigError(f"--nodes: cannot make a directory under {roots[0]}: "
                                    f"{exc.strerror}") from exc
        finally:
            guard.hold = False
        guard.check()
        name = os.path.basename(base)
        with open(os.path.join(base, "check"), "wb") as f:
            f.write(os.urandom(16))
        os.mkdir(os.path.join(base, "nodes"), 0o700)
        _check_one_directory(roots, name)
        node_roots = [os.path.join(r, name, "nodes") for r in roots]

        counting: list[_VerifyCountingDriver] = []

        def single_driver(*args: Any) -> _VerifyCountingDriver:
            counting.append(_VerifyCountingDriver(*args))
            return counting[-1]

        single = run_replay(ReplayConfig(**{**asdict(config), "root": os.path.join(base, "single")}),
                            requests, driver_factory=single_driver)  # (its bar, where config.progress)
        if config.progress and sys.stderr.isatty():
            print(f"pykvtier replay --nodes: the single node is done; now {len(roots)} node processes "
                  "(no progress bars)", file=sys.stderr)
        payloads = _run_node_processes(config, node_roots, shares, tier_factory or _shared_tier)
    finally:
        guard.hold = True  # first (a plain store: no signal handler runs before it)
        unwinding = sys.exc_info()[1] is not None
        if base is not None:
            base_removed = _remove_tree(base)
        guard.release(unwinding)
    nodes = []
    for i, (root, pl) in enumerate(zip(node_roots, payloads)):
        nodes.append(NodeResult(
            node=i, root=root, summary=_summary_of(pl["summary"]),
            stored=dict(zip(_split_keys(pl["stored_keys"]), pl["stored_t"])),
            loaded=_split_keys(pl["loaded_keys"]), loaded_t=list(pl["loaded_t"]),
            bytes_verified=pl["bytes_verified"], load_lost_keys=pl["load_lost_keys"],
            load_latencies=list(pl["load_latencies"]),
            load_intervals=[tuple(iv) for iv in pl["load_intervals"]]))
    _attribute(nodes)
    out = NodesReplay(trace=trace_name, deal=NODES_DEAL, base=base, base_removed=base_removed,
                      nodes=nodes, single=single, single_bytes_verified=counting[0].pattern.bytes_compared)
    out.total = _nodes_row(nodes)
    bs = single.block_size_bytes
    for label, loaded, verified in (
            [(f"node {n.node}", n.summary.blocks_loaded, n.bytes_verified) for n in nodes]
            + [("the single node", single.blocks_loaded, out.single_bytes_verified)]):
        if verified != loaded * bs:
            out.problems.append(f"{label}: its checks compared {verified} B, but it loaded "
                                f"{loaded} blocks x {bs} B = {loaded * bs} B")
    if out.total["blocks_loaded_unattributed"]:
        out.problems.append(f"{_plural(out.total['blocks_loaded_unattributed'], 'loaded block')} "
                            "whose key no node of this run stored")
    if out.total["cross_stored_after_load"]:
        out.problems.append(f"{_plural(out.total['cross_stored_after_load'], 'cross-node hit')} "
                            "loaded before the other node's store of it was submitted")
    return out


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    fmt = lambda cells: "  " + "  ".join(  # noqa: E731
        c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return [fmt(header), *map(fmt, rows)]


def format_nodes(r: NodesReplay) -> str:
    """The text report of :func:`run_nodes`."""
    s1 = r.single
    n0 = r.nodes[0].summary
    cap = "unlimited" if s1.capacity_bytes is None else format_bytes(s1.capacity_bytes)
    engines = sorted({n.summary.engine for n in r.nodes})
    rows = [(f"node {n.node}", _nodes_row([n])) for n in r.nodes]
    rows.append(("total", r.total))
    single = _single_row(s1, r.single_bytes_verified)

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v:.2%}"

    def num(v: Any) -> str:
        return "-" if v is None else str(v)

    def ms(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.2f}"

    hits = [[label, str(d["requests"]), str(d["blocks_requested"]), str(d["blocks_looked_up"]),
             str(d["blocks_hit"]), pct(d["block_hit_ratio"]), str(d["blocks_loaded"]),
             num(d.get("blocks_loaded_cross_node")), pct(d.get("cross_node_hit_ratio")),
             pct(d.get("cross_node_of_looked_up")), num(d.get("blocks_loaded_both")),
             num(d.get("blocks_loaded_own")), num(d.get("load_lost_keys"))]
            for label, d in [*rows, ("single node", single)]]
    io = [[label, format_bytes(d["bytes_loaded"]), format_bytes(d["bytes_verified"]),
           ms(d["load_latency_ms_p50"]), ms(d["load_latency_ms_p99"]), f"{d['load_gbps']:.2f}",
           str(d["blocks_stored"]), str(d["evictions"]), str(d["verification_failures"]),
           str(d["errors"]), f"{d['wall_s']:.2f}"]
          for label, d in [*rows, ("single node", single)]]
    lines = [
        f"pykvtier replay --nodes: {_plural(s1.requests, 'request')} of {r.trace}, dealt {r.deal} "
        f"to {len(r.nodes)} nodes (a process each, shared=True, all at once), and by a single "
        "node (a plain replay, one process, before them)",
        f"  model {n0.model}, {n0.tokens_per_block} tokens/block -> blocks of "
        f"{format_bytes(n0.block_size_bytes)} ({n0.block_size_bytes} B); engine {', '.join(engines)}"
        f" (single node: {s1.engine}); capacity {cap} (each tier's capacity_bytes); arena "
        f"{format_bytes(n0.arena_bytes)} per process",
        *[f"  node {n.node}  {n.root}" for n in r.nodes],
        f"  single  {s1.root}",
        f"  (both under {r.base}{', removed' if r.base_removed else ', NOT removed'})",
        "",
        *_table(["", "requests", "blocks", "looked up", "hit", "hit ratio", "loaded", "cross-node",
                 "/loaded", "/looked up", "both", "own", "lost"], hits),
        "",
        *_table(["", "loaded", "verified", "p50 ms", "p99 ms", "GB/s", "stored", "evictions",
                 "wrong blocks", "errors", "wall s"], io),
        "",
        "  blocks: requested; hit ratio: hit / requested; loaded: blocks loaded and checked;",
        "  cross-node: loaded blocks whose key only other nodes stored (the join of every node's",
        "  stored keys), of all loaded and of all looked up; both: stored by this node and another",
        "  (which copy was read cannot be told); own: stored by this node alone; lost: found by the",
        "  lookup but evicted from the shared root before the load (recomputed, not an error);",
        "  evictions: made by that tier (a node's: as the shared root's evictor).",
        "  verified: bytes compared with the key's bytes (every loaded byte); p50/p99: per-request",
        "  load latency; GB/s: loaded bytes / time loads were in flight (total: the nodes' union).",
    ]
    for n in r.nodes:
        s = n.summary
        for reason, k in s.failure_reasons.items():
            lines.append(f"  node {n.node} - {k} x {reason}")
        for msg in s.error_samples:
            lines.append(f"  node {n.node} ! {msg}")
    for reason, k in s1.failure_reasons.items():
        lines.append(f"  single - {k} x {reason}")
    for msg in s1.error_samples:
        lines.append(f"  single ! {msg}")
    for p in r.problems:
        lines.append(f"  ! {p}")
    lines.append("  OK" if r.ok else "  FAILED")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# CLI


def format_summary(s: ReplaySummary) -> str:
    def ms(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.2f} ms"

    cap = "unlimited" if s.capacity_bytes is None else format_bytes(s.capacity_bytes)
    per_gib = "n/a" if s.cpu_s_per_gib is None else f"{s.cpu_s_per_gib:.2f} CPU s/GiB moved"
    tier_per_gib = "n/a" if s.tier_cpu_s_per_gib is None else f"{s.tier_cpu_s_per_gib:.2f} s/GiB"
    written = s.bytes_stored // s.block_size_bytes if s.block_size_bytes else 0
    recycled = s.tier_stats.get("files_recycled")
    lines = [
        f"pykvtier replay: {_plural(s.requests, 'request')} of {s.trace}",
        f"  model {s.model}, {s.tokens_per_block} tokens/block -> blocks of {format_bytes(s.block_size_bytes)} "
        f"({s.block_size_bytes} B); engine {s.engine}; capacity {cap}; arena {format_bytes(s.arena_bytes)}",
        f"  root {s.root}{' (removed)' if s.root_removed else ''}",
        f"  blocks      {s.blocks_requested} requested, {s.blocks_looked_up} looked up, {s.blocks_hit} hit"
        f" ({s.blocks_hit_pending} pending), {_plural(s.lookup_retries, 'RETRY answer')}",
        # the token figure counts the prompt's tokens (its last block may be partly filled);
        # loaded and stored count whole blocks
        f"  hit ratio   blocks {s.block_hit_ratio:.2%}, prompt tokens {s.byte_hit_ratio:.2%} "
        f"(KV of the tokens hit: {format_bytes(s.hit_kv_bytes)} of {format_bytes(s.prompt_kv_bytes)})",
        f"  loaded      {format_bytes(s.bytes_loaded)} in {_plural(s.load_jobs, 'job')}"
        f" ({_plural(s.blocks_loaded, 'whole block')}), {s.load_busy_s:.2f} s busy"
        f" -> {_load_gbps(s)} (GB = 1e9 B); per-request latency p50 {ms(s.load_latency_ms_p50)},"
        f" p99 {ms(s.load_latency_ms_p99)}, max {ms(s.load_latency_ms_max)}",
        f"  stored      {format_bytes(s.bytes_stored)} in {_plural(s.store_jobs, 'job')}"
        f" ({_plural(written, 'whole block')} written), {s.store_busy_s:.2f} s busy"
        f" -> {s.store_gbps:.2f} GB/s; {_plural(s.store_rejected_keys, 'block')} declined by the tier"
        " (capacity)",
        *_schedule_lines(s),
        f"  CPU         {s.cpu_s:.2f} s, {per_gib} (tier alone {tier_per_gib};"
        f" replay's fill+verify {s.harness_cpu_s:.2f} s)",
        f"  evictions   {s.evictions}"
        + (f" ({_plural(recycled, 'file')} taken over by stores)" if recycled else ""),
        f"  verification failures {s.verification_failures}, errors {s.errors}"
        f" (load failures {s.load_failed_keys}, store failures {s.store_failed_keys},"
        f" tier checksum failures {s.tier_verify_failures})",
        *_worth_lines(s),
        f"  wall        {s.wall_s:.2f} s: set-up {s.setup_s:.2f} s (trace, arena and its prefault,"
        f" the tier's start), replay {s.run_s:.2f} s, clean-up {s.cleanup_s:.2f} s",
    ]
    for reason, n in s.failure_reasons.items():
        lines.append(f"  - {n} x {reason}")
    for msg in s.error_samples:
        lines.append(f"  ! {msg}")
    lines.append("  OK" if s.ok else "  FAILED")
    return "\n".join(lines)


PLOT_EXTRA = "pip install 'pykvtier[plot]'"


def _need_matplotlib() -> Any:
    """matplotlib's pyplot on the Agg backend; ReplayConfigError naming the extra without it."""
    try:
        import matplotlib
    except ImportError:
        raise ReplayConfigError(f"--plot needs matplotlib, which is not installed: {PLOT_EXTRA} "
                                "(or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_path_problem(path: str) -> str | None:
    """Why ``--plot PATH`` could not be written (checked before the replay), or None: the plot
    is a PNG (a ``.png`` name), into a directory that exists and can be written."""
    if not path.lower().endswith(".png"):
        return f"the plot is a PNG: give a FILE.png, got {path!r}"
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        return f"no directory {d} to write {path} into"
    if os.path.isdir(path):
        return f"{path} is a directory"
    if not os.access(d, os.W_OK | os.X_OK):
        return f"cannot write into {d}"
    return None


def write_plot(s: ReplaySummary, path: str) -> None:
    """Four panels against trace time (s): the hit ratio (each request's, and the run's so far),
    each request's measured load time, the bytes of the loads and stores in flight, and TTFT
    without the tier, with it (and with every hit loaded, for --bypass auto with --disk-gbps)."""
    plt = _need_matplotlib()
    tl = getattr(s, "timeline", None) or {}
    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    mode = "back to back" if s.speed is None else f"{s.speed:g}x the trace's pace"
    fig.suptitle(f"pykvtier replay: {_plural(s.requests, 'request')} of {s.trace}\n{s.model}, "
                 f"{format_bytes(s.block_size_bytes)} blocks, {s.engine}, {mode}; estimates on {s.gpu}",
                 fontsize=10)
    xs, hr = tl.get("trace_s", []), tl.get("hit_ratio", [])
    ax = axes[0]
    ax.scatter(xs, hr, s=4, alpha=0.4, label="request")
    if xs:
        blocks = np.maximum(np.cumsum(tl.get("blocks", [])), 1)
        ax.plot(xs, np.cumsum(tl.get("hits", [])) / blocks, color="C1", label="the run's so far")
    ax.set_ylabel("block hit ratio")
    ax.legend(loc="upper left", fontsize=8)
    ax = axes[1]
    load = tl.get("load_ms", [])
    ax.scatter([x for x, _ in load], [y for _, y in load], s=4, color="C2")
    ax.set_ylabel("load job, ms\n(measured, KV moved)")
    ax = axes[2]
    q = tl.get("queue", [])
    ax.plot([x for x, _, _ in q], [lb / 2**20 for _, lb, _ in q], label="loads", color="C2")
    ax.plot([x for x, _, _ in q], [sb / 2**20 for _, _, sb in q], label="stores", color="C3", alpha=0.7)
    ax.set_ylabel("in flight, MiB\n(KV moved)")
    ax.legend(loc="upper left", fontsize=8)
    ax = axes[3]
    tt = tl.get("ttft", [])
    ax.scatter([r["trace_s"] for r in tt], [r["ttft_no_tier_s"] for r in tt], s=4, label="without the tier",
               color="C0", alpha=0.5)
    ax.scatter([r["trace_s"] for r in tt], [r["ttft_tier_s"] for r in tt], s=4, color="C1", alpha=0.5,
               label="with it" + (" (bypass auto)" if s.bypass == "auto" else ""))
    nb = [r for r in tt if "ttft_no_bypass_s" in r]
    if nb:
        ax.scatter([r["trace_s"] for r in nb], [r["ttft_no_bypass_s"] for r in nb], s=4, color="C4",
                   alpha=0.5, label="with it, every hit loaded")
    ax.set_yscale("log")
    ax.set_ylabel("TTFT, s (estimate:\nload, then compute)")
    ax.set_xlabel("trace time, s")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(path, format="png", dpi=100)
    finally:
        plt.close(fig)


def _seconds(v: float | None) -> str:
    """``812 ms``, ``6.10 s``; under 10 ms with two significant digits (``0.42 ms``), so that a
    small model's prefill does not read as 0."""
    if v is None:
        return "n/a"
    if v >= 1:
        return f"{v:.2f} s"
    if v * 1e3 >= 10 or v == 0:
        return f"{v * 1e3:.0f} ms"
    return f"{v * 1e3:.2g} ms"


def _schedule_lines(s: ReplaySummary) -> list[str]:
    if s.speed is None:
        lines = ["  schedule    back to back (as fast as possible: arrival times ignored), each load"
                 " waited for"]
    else:
        waits = ("" if s.schedule_wait_ms_p50 is None else
                 f"; arrival to lookup p50 {s.schedule_wait_ms_p50:.1f} ms, p99 {s.schedule_wait_ms_p99:.1f} ms")
        lines = [f"  schedule    by arrival time at {s.speed:g}x the trace's pace, a step every {s.step_ms:g} ms:"
                 f" {_plural(s.steps, 'step')}, at most {s.max_requests_per_step} requests a step,"
                 f" {_plural(s.requests_deferred, 'request')} put off a step ({s.requests_deferred_retry} for a RETRY,"
                 f" {s.requests_deferred - s.requests_deferred_retry} for want of free slots){waits}"]
    if s.moved_per_trace_block and s.moved_per_trace_block < s.blocks_per_trace_block:
        lines.append(f"  KV moved    the first {s.moved_per_trace_block} of each 512-token trace block's "
                     f"{s.blocks_per_trace_block} engine blocks ({format_bytes(s.moved_per_trace_block * s.block_size_bytes)}"
                     f" of {format_bytes(s.blocks_per_trace_block * s.block_size_bytes)}); the others count"
                     " as hit or missed with them (--kv-sample)")
    return lines


def _num(v: float) -> str:
    """``562.8``, ``0.0123``: one decimal from 10 up, else three significant digits."""
    return f"{v:.1f}" if abs(v) >= 10 else f"{v:.3g}"


def _load_gbps(s: ReplaySummary) -> str:
    """The measured load GB/s, or n/a when nothing was loaded (every hit bypassed, or none)."""
    return f"{s.load_gbps:.2f} GB/s" if s.bytes_loaded else "n/a (nothing loaded)"


def _gbps(v: float) -> str:
    return f"{v:.2f} GB/s" if v >= 0.1 else f"{v:.3g} GB/s"


def _worth_lines(s: ReplaySummary) -> list[str]:
    """The summary's lines on what the hits were worth (the cost model's estimates)."""
    if s.prefill_gpu_s_no_tier is None:
        return []
    saved = s.prefill_gpu_s_saved or 0.0
    share = saved / s.prefill_gpu_s_no_tier if s.prefill_gpu_s_no_tier else 0.0
    ms = lambda v: _seconds(None if v is None else v / 1e3)  # noqa: E731
    lines = [
        f"  worth       estimates: {s.model} prefill on {s.gpu} at MFU {s.mfu:g}; load times {s.load_time_source}",
        f"    prefill   {_num(s.prefill_gpu_s_no_tier)} GPU-s without the tier; {_num(saved)} GPU-s saved"
        f" ({share:.1%}) for {_num(s.load_s_of_hits)} s of loads; {s.requests_load_faster} of"
        f" {_plural(s.requests_loaded, 'request')} loaded faster than their tokens compute",
        f"    TTFT      without the tier p50 {ms(s.ttft_ms_no_tier_p50)}, p99 {ms(s.ttft_ms_no_tier_p99)};"
        f" with it{' (bypass auto)' if s.bypass == 'auto' else ''} p50 {ms(s.ttft_ms_tier_p50)},"
        f" p99 {ms(s.ttft_ms_tier_p99)} (load, then compute the rest)",
    ]
    if s.bypass == "auto":
        nb = ("n/a without --disk-gbps (compare a run without --bypass)" if s.ttft_ms_no_bypass_p50 is None
              else f"p50 {ms(s.ttft_ms_no_bypass_p50)}, p99 {ms(s.ttft_ms_no_bypass_p99)}")
        lines.append(f"    bypass    {_plural(s.blocks_bypassed, 'hit block')} of {_plural(s.requests_bypassed, 'request')}"
                     f" recomputed instead of loaded; TTFT with every hit loaded: {nb}")
    hits = "" if s.break_even_gbps_hits is None else f", {_gbps(s.break_even_gbps_hits)} for this replay's loaded prefixes"
    lines.append(f"    break-even disk {_gbps(s.break_even_gbps_block0)} for a block at token 0{hits};"
                 f" this disk's loads here: {_load_gbps(s)}"
                 + ("" if s.disk_gbps is None else f" (modeled: {s.disk_gbps:g} GB/s)"))
    return lines


def _size_arg(text: str) -> int | None:
    if text.strip().lower() in ("none", "unlimited", "inf"):
        return None
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return v


def _share_arg(text: str) -> float:
    """A number in (0, 1]: --store-share, --mfu."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text}")
    return v


def _gpu_names() -> str:
    from . import costmodel

    return ", ".join(costmodel.GPU_PRESETS)


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


HELP = "replay a KV-cache trace (default: bundled Mooncake conversation) against the disk tier"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    presets = ", ".join(
        f"{p.name} ({p.kv_bytes_per_token} B/token)" for p in _models.PRESETS.values()
    )
    parser.description = (
        "Replay a KV-cache trace against a DiskTier as a serving engine would: requests arrive at "
        "the trace's timestamps (--speed), a scheduler step looks up each arrived request's prefix "
        "blocks (stop at the first MISS), loads its hits into a host arena in one job and checks "
        "every byte, then stores its missed blocks. Prints hit ratios, GB/s, load latency, CPU per "
        "GiB, evictions and verification failures, and what the hits were worth: prefill GPU-seconds "
        "saved, TTFT p50/p99 with and without the tier, the break-even disk bandwidth of the model "
        "on the GPU. Exits 1 if any block failed verification or any error occurred."
    )
    parser.epilog = (
        "Estimates (pykvtier.costmodel): for a request of L prompt tokens whose first h tokens were "
        "loaded, P(n) the prefill seconds of tokens 0..n-1 (FLOPs, attention's quadratic part "
        "included, at --mfu of the --gpu's peak dense bf16 FLOP/s): TTFT without the tier = P(L); "
        "with it = T_load + (P(L) - P(h)): its load, then the prefill of the rest (what vLLM does; "
        "no overlap); GPU time saved = P(h). T_load is the request's measured load job (submit to "
        "finish) times full KV / KV moved (--kv-sample), or with --disk-gbps X its blocks' full KV "
        "bytes / X. The GPU is taken to be free for each request; TTFT counts from the step that "
        "looked it up. Measured: hit ratios, bytes, load latency, GB/s, CPU; modeled: prefill "
        "times, the unmoved KV's load time, and with --disk-gbps every load time. See docs/design.md, "
        "'The replay as a server sees it'."
    )
    parser.add_argument(
        "trace", nargs="?", default=None,
        help="trace file (.jsonl or .jsonl.gz, Mooncake format); default: the bundled "
        "Mooncake FAST'25 conversation trace",
    )
    parser.add_argument("--model", metavar="NAME", default=DEFAULT_MODEL, help=f"model preset (default {DEFAULT_MODEL}); one of: {presets}")
    parser.add_argument(
        "--tokens-per-block", metavar="N", type=_positive_int, default=DEFAULT_TOKENS_PER_BLOCK,
        help=f"tokens per engine block, a divisor of {TRACE_BLOCK_TOKENS} (default {DEFAULT_TOKENS_PER_BLOCK})",
    )
    parser.add_argument(
        "--max-requests", metavar="N", default=str(DEFAULT_MAX_REQUESTS),
        help=f"replay only the first N requests; 'all' for the whole trace (default {DEFAULT_MAX_REQUESTS})",
    )
    parser.add_argument(
        "--capacity", metavar="SIZE", type=_size_arg, default=parse_size(DEFAULT_CAPACITY),
        help=f"tier capacity: 8GiB or 8G (powers of 1024), 500MB (powers of 1000), or 'none' for "
        f"unlimited (default {DEFAULT_CAPACITY})",
    )
    parser.add_argument(
        "--root", metavar="DIR", default=None,
        help="directory for the block files (kept; created if missing, ~ expanded); default: a new "
        "temporary directory, removed at the end",
    )
    parser.add_argument("--engine", choices=("auto", "uring", "posix"), default="auto",
                        help="I/O engine: uring (io_uring), posix (preadv/pwritev threads), or auto: "
                        "uring where io_uring works, else posix (default auto)")
    parser.add_argument("--arena", metavar="SIZE", type=_size_arg, default=None,
                        help="host arena size (default: room for the largest request twice, "
                        f"within {format_bytes(ARENA_SOFT_LIMIT_BYTES)}; never less than the largest request)")
    parser.add_argument("--no-recycle", action="store_true",
                        help="evict by unlinking files and create a new one per store (DiskTier(recycle=False));"
                        " default: stores at capacity take over the evicted files")
    parser.add_argument("--store-share", metavar="F", type=_share_arg, default=None,
                        help="share of the engine's queue depth and in-flight bytes the tier's stores "
                        "may hold, in (0, 1] (DiskTier(store_share=); default 0.5): loads wait at the "
                        "device behind the stores already issued, so less cuts load latency during "
                        "store bursts, and store GB/s with it")
    parser.add_argument(
        "--nodes", metavar="ROOT_A,ROOT_B[,...]", default=None,
        help="the replay across nodes: each ROOT is one node's mount of one shared directory (two "
        "mounts of a distributed file system; one path given twice for a local test). Under the "
        "first ROOT a fresh directory holds the nodes' tier root and the single node's, removed at "
        "the end. One process per ROOT replays its share of the requests on a shared=True tier (no "
        "recycling), all at once; the requests are dealt round robin by request order (request i "
        "to node i mod N: the Mooncake format has no conversation or session field to deal by, and "
        "dealing by order spreads the prefixes later requests reuse over the nodes, as a balancer "
        "without prefix affinity does). Before them a plain replay of all the requests by one "
        "process (the single node). Reports per node, in total and for the single node: requests, "
        "hit ratio, cross-node hits (loaded blocks whose key only another node stored: the join of "
        "every node's stored keys with its loaded blocks; blocks this node and another both stored "
        "are counted apart) over blocks loaded and over blocks looked up, bytes verified, load "
        "p50/p99, GB/s; exits 1 on any wrong byte, error or inconsistent count. --capacity is "
        "each tier's capacity_bytes, --arena each process's")
    parser.add_argument(
        "--tier", choices=TIER_KINDS, default="pykvtier",
        help="the tier replayed: pykvtier (its DiskTier; default) or vllm-fs: vLLM's own fs tier "
        "(FileSystemTierManager of vLLM 0.33, where vLLM is installed: pykvtier.replay_tiers), "
        "the same trace, driver and checks; --engine, --no-recycle, --store-share and --nodes are "
        "pykvtier's")
    parser.add_argument(
        "--speed", metavar="X", type=_positive_float, default=None,
        help="requests arrive at their trace timestamps compressed X times (trace seconds per "
        f"second; default {DEFAULT_SPEED:g}); a scheduler step every --step-ms batches those that "
        "arrived: their lookups, one load job per request, each request's store once its load "
        "finished (at once when nothing hit); a RETRY puts a request off to the next step")
    parser.add_argument("--as-fast-as-possible", action="store_true",
                        help="ignore arrival times: request after request, each load waited for "
                        "before the next request (the replay of earlier releases)")
    parser.add_argument("--step-ms", metavar="MS", type=_positive_float, default=None,
                        help=f"scheduler step in ms of the replay's time (default {DEFAULT_STEP_MS:g})")
    parser.add_argument(
        "--kv-sample", metavar="SIZE", type=_size_arg, default=parse_size(DEFAULT_KV_SAMPLE),
        help="KV the replay moves of each 512-token trace block: its first engine blocks up to "
        f"SIZE, at least one (default {DEFAULT_KV_SAMPLE}: one block of a real model, every block "
        "of tiny); the trace block's other engine blocks count as hit or missed with them (a trace "
        "block is hit or missed whole), the estimates count every token, and measured load times "
        "are scaled by full KV / KV moved. 'all' moves every engine block")
    parser.add_argument("--gpu", metavar="NAME", default=DEFAULT_GPU,
                        help=f"GPU of the prefill estimates (default {DEFAULT_GPU}); one of: {_gpu_names()}")
    parser.add_argument("--mfu", metavar="F", type=_share_arg, default=DEFAULT_MFU,
                        help=f"model FLOPs utilisation of the prefill estimates, in (0, 1] (default {DEFAULT_MFU:g})")
    parser.add_argument(
        "--bypass", choices=BYPASS_MODES, default="off",
        help="auto: each request loads only the prefix of its hits that loads no slower than it "
        "recomputes (pykvtier.costmodel.loadable_prefix: the bandwidth a moving estimate of this "
        "replay's finished loads with the bytes of the loads in flight queued before it, or "
        "--disk-gbps with no queue); the rest of its hits are recomputed, counted as bypassed "
        "(default off)")
    parser.add_argument(
        "--disk-gbps", metavar="X", type=_positive_float, default=None,
        help="model a disk of X GB/s (1e9 B/s) for the estimates: a request's load time is its "
        "loaded blocks' full KV bytes / X, each load served on its own, instead of the measured "
        "time (the real I/O still runs and every byte is verified; hit ratios and load latencies "
        "printed are measured); with --bypass auto the TTFT with every hit loaded is shown too")
    parser.add_argument(
        "--plot", metavar="FILE.png", default=None,
        help="draw hit ratio, load latency and bytes in flight over trace time, and TTFT with and "
        "without the tier, into FILE.png (needs matplotlib: pip install 'pykvtier[plot]')")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the text summary")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (it is shown only when stderr is a terminal, never with --json)")


def run(args: argparse.Namespace) -> int:
    if str(args.max_requests).strip().lower() == "all":
        max_requests = None
    else:
        try:
            max_requests = _positive_int(str(args.max_requests))
        except argparse.ArgumentTypeError as exc:
            print(f"pykvtier replay: --max-requests: {exc}", file=sys.stderr)
            return 2
    # options that would be silently ignored with the others given
    if args.as_fast_as_possible and (args.speed is not None or args.step_ms is not None):
        print("pykvtier replay: --as-fast-as-possible replays back to back, arrival times ignored: "
              "no --speed or --step-ms with it", file=sys.stderr)
        return 2
    if args.tier != "pykvtier" and (args.store_share is not None or args.no_recycle):
        print(f"pykvtier replay: --store-share and --no-recycle set pykvtier's DiskTier: not with "
              f"--tier {args.tier}", file=sys.stderr)
        return 2
    from . import costmodel

    for option, check in (("--model", lambda: _models.get_preset(args.model)),
                          ("--tokens-per-block", lambda: _models.validate_tokens_per_block(args.tokens_per_block)),
                          ("--gpu", lambda: costmodel.get_gpu(args.gpu))):
        try:
            check()
        except ValueError as exc:
            print(f"pykvtier replay: {option}: {exc}", file=sys.stderr)
            return 2
    config = ReplayConfig(
        trace=args.trace,
        model=args.model,
        tokens_per_block=args.tokens_per_block,
        max_requests=max_requests,
        capacity_bytes=args.capacity,
        root=args.root,
        engine=args.engine,
        recycle=not args.no_recycle,
        store_share=0.5 if args.store_share is None else args.store_share,
        progress=not (args.no_progress or args.json),
        arena_bytes=args.arena,
        speed=None if args.as_fast_as_possible else (DEFAULT_SPEED if args.speed is None else args.speed),
        step_ms=DEFAULT_STEP_MS if args.step_ms is None else args.step_ms,
        kv_sample_bytes=args.kv_sample,
        gpu=args.gpu,
        mfu=args.mfu,
        bypass=args.bypass,
        disk_gbps=args.disk_gbps,
        tier=args.tier,
    )
    if getattr(args, "nodes", None) is not None:
        if args.plot is not None or args.tier != "pykvtier":
            print("pykvtier replay: --nodes replays pykvtier's shared tiers; no --plot or --tier with it",
                  file=sys.stderr)
            return 2
        return _run_nodes_command(args, config)
    if args.plot is not None:
        problem = _plot_path_problem(args.plot)
        if problem is not None:  # said before the replay, not after it
            print(f"pykvtier replay: --plot: {problem}", file=sys.stderr)
            return 2
    try:
        if args.plot is not None:
            _need_matplotlib()
        summary = run_replay(config)
    except (FileNotFoundError, TraceFormatError, ReplayConfigError, _models.UnknownModelError) as exc:
        print(f"pykvtier replay: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary.to_dict(), sort_keys=False))
    else:
        print(format_summary(summary))
    if args.plot is not None:
        try:
            write_plot(summary, args.plot)
        except OSError as exc:
            print(f"pykvtier replay: cannot write the plot {args.plot}: {exc.strerror or exc}", file=sys.stderr)
            return 1
        print(f"pykvtier replay: plot written to {args.plot}", file=sys.stderr)
    return 0 if summary.ok else 1


def _run_nodes_command(args: argparse.Namespace, config: ReplayConfig) -> int:
    """``pykvtier replay --nodes``: exit 0 all verified and consistent, 1 not, 2 usage."""
    try:
        if config.root is not None:
            raise ReplayConfigError("--nodes takes the roots: no --root with it")
        result = run_nodes(config, args.nodes.split(","))
    except (FileNotFoundError, TraceFormatError, ReplayConfigError, _models.UnknownModelError) as exc:
        print(f"pykvtier replay: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # a node failed (its message says how)
        print(f"pykvtier replay: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result.to_dict(), sort_keys=False))
    else:
        print(format_nodes(result))
    return 0 if result.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pykvtier.replay``: the same as ``pykvtier replay``."""
    parser = argparse.ArgumentParser(prog="pykvtier replay")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
