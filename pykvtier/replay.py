"""``pykvtier replay``: replay a KV-cache trace against a :class:`~pykvtier.DiskTier`.

For each request, in trace order, the replay does what an inference engine does with a
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
:func:`block_key`. The block bytes are a 4 KiB random table XORed with a 64-bit word derived
from the key and the page index, so every 4 KiB page differs by key and by page index and a
block costs one memory pass to make and one to check.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
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
from dataclasses import asdict, dataclass, field
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
    "ReplayConfig",
    "ReplayConfigError",
    "ReplaySummary",
    "BlockPattern",
    "block_key",
    "parse_size",
    "format_bytes",
    "run_replay",
    "add_arguments",
    "main",
]

# Defaults: about a minute on a 2-core VM with a ~1 GB/s virtual disk, with the capacity
# well below the working set so the tier has to evict. See `pykvtier replay --help`.
DEFAULT_MODEL = "qwen2.5-7b"
DEFAULT_TOKENS_PER_BLOCK = 32  # 32 x 56 KiB = 1.75 MiB blocks, 16 per trace block
DEFAULT_MAX_REQUESTS = 40
DEFAULT_CAPACITY = "8GiB"

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
# Store failures that are the tier declining a block under capacity pressure (blocks being
# written or read hold the space, or the key's old file is still being evicted): an engine
# just does not cache those blocks. Counted and shown, but not errors.
_STORE_REJECTIONS = ("no capacity", "block is being evicted")


class ReplayConfigError(ValueError):
    """The replay cannot run with these settings (message says why)."""


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
    progress: bool = True
    arena_bytes: int | None = None  # None: auto (see _arena_slots)


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
    wall_s: float
    tier_stats: dict[str, Any] = field(default_factory=dict)

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
    """tqdm when available, else a line on stderr about once a second.

    ``advance()`` once per request replayed; ``show(text)`` whenever the counts it describes
    change (a job finished, a request done): the bar is redrawn at most every ``interval``
    seconds, and ``close()`` draws it once more, so it ends on the final counts."""

    def __init__(self, total: int, enabled: bool, interval: float = 0.1) -> None:
        self._bar = None
        self._enabled = enabled
        self._total = total
        self._n = 0
        self._interval = interval
        self._last = 0.0  # when the bar or line was last drawn
        self._postfix = ""
        self._drawn: tuple[int, str] | None = None  # what the fallback line last printed
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            self._interval = max(interval, 1.0)
            return
        # disable=None: no bar when stderr is not a terminal (logs, pipes)
        self._bar = tqdm(total=total, unit="req", desc="replay", file=sys.stderr, dynamic_ncols=True,
                         disable=None, mininterval=interval)

    @property
    def postfix(self) -> str:
        return self._postfix

    def show(self, postfix: str) -> None:
        if postfix == self._postfix:
            return
        self._postfix = postfix
        if self._enabled:
            self._draw(final=False)

    def advance(self) -> None:
        self._n += 1
        if self._bar is not None:
            self._bar.update(1)  # draws (with the postfix) at most every `interval` seconds
        elif self._enabled:
            self._draw(final=self._n == self._total)

    def _draw(self, final: bool) -> None:
        now = time.monotonic()
        if not final and now - self._last < self._interval:
            return
        self._last = now
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix, refresh=True)
        elif (self._n, self._postfix) != self._drawn:
            self._drawn = (self._n, self._postfix)
            print(f"replay: {self._n}/{self._total} requests  {self._postfix}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix, refresh=False)
            self._bar.close()  # draws the final state
        elif self._enabled:
            self._draw(final=True)


@dataclass
class _Pending:
    is_load: bool
    keys: list[bytes]
    slots: list[int]
    submit_t: float


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


def _arena_slots(max_blocks: int, block_size: int, arena_bytes: int | None) -> int:
    """Slots of the host arena: at least the largest request; room for two when it fits."""
    need = max(1, max_blocks)
    if arena_bytes is not None:
        slots = arena_bytes // block_size
        if slots < need:
            raise ReplayConfigError(
                f"arena of {format_bytes(arena_bytes)} holds {slots} blocks of "
                f"{format_bytes(block_size)}, but the largest request needs {need}"
            )
        return slots
    return max(need, min(2 * need, ARENA_SOFT_LIMIT_BYTES // block_size))


def _allocate_arena(nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    """Anonymous private mapping: page-aligned, zero-filled, faulted in here (before the
    replay's clock starts) where the kernel can populate it in one call."""
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
        except OSError:
            pass  # older kernel: faulted in on first touch
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


def _remove_tree(path: str) -> bool:
    """Removes the directory tree at ``path`` (links are removed, never followed). True when
    nothing is left there (a path already gone counts); else says why on stderr, naming it."""
    failures: list[str] = []

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
                          recycle: bool = True):
    from . import DiskTier

    return DiskTier(root, block_size, capacity_bytes=capacity, engine=engine, recycle=recycle)


def run_replay(
    config: ReplayConfig,
    requests: Sequence[Request] | None = None,
    *,
    tier_factory: Callable[[str, int, int | None, str], Any] | None = None,
) -> ReplaySummary:
    """Replay ``requests`` (default: ``load_trace(config.trace, config.max_requests)``).

    ``tier_factory(root, block_size_bytes, capacity_bytes, engine)`` makes the tier
    (default: :class:`pykvtier.DiskTier`).

    Without ``config.root`` the blocks go to a temporary directory, removed when the replay
    ends, however it ends: an error, or SIGINT/SIGTERM at any point (called from the main
    thread). A signal raises what the caller's handler raises (KeyboardInterrupt for Ctrl-C);
    one whose action is the default ends the process with it once the clean-up is done. The
    clean-up (tier shutdown: in-flight I/O finishes; arena; removal) is not interrupted by
    further signals; one arriving during it is delivered after it.
    """
    from . import LookupResult, TransferJob

    preset = _models.get_preset(config.model)
    tpb = _models.validate_tokens_per_block(config.tokens_per_block)
    spb = TRACE_BLOCK_TOKENS // tpb
    bs = preset.block_size_bytes(tpb)
    kv_per_token = preset.kv_bytes_per_token

    if requests is None:
        requests = load_trace(config.trace, config.max_requests)
        trace_name = config.trace if config.trace is not None else "<bundled mooncake_conversation_trace.jsonl.gz>"
        if not requests:
            raise ReplayConfigError(f"{trace_name}: the trace holds no requests")
    else:
        requests = list(requests)
        if config.max_requests is not None:
            requests = requests[: config.max_requests]
        trace_name = "<in-memory>" if config.trace is None else config.trace

    max_blocks = max((len(r.hash_ids) * spb for r in requests), default=1)
    nslots = _arena_slots(max_blocks, bs, config.arena_bytes)
    words_per_block = bs // 8
    pattern = BlockPattern(bs)

    root_given = config.root is not None
    if root_given:
        root = os.path.abspath(config.root)
        if os.path.exists(root) and not os.path.isdir(root):
            raise ReplayConfigError(f"cannot open the tier at {root}: not a directory")
        try:
            os.makedirs(root, 0o700, exist_ok=True)
        except OSError as exc:
            raise ReplayConfigError(f"cannot open the tier at {root}: {exc.strerror}") from exc

    factory = tier_factory or (lambda r, b, c, e: _default_tier_factory(r, b, c, e, config.recycle))
    mm = None
    tier = None
    temp_root = None  # the temporary root, once it exists: removed by the clean-up below
    root_removed = False
    guard = _SignalGuard()
    try:
        guard.install()
        if not root_given:
            guard.hold = True  # the directory exists only once its path is recorded
            root = temp_root = tempfile.mkdtemp(prefix="pykvtier-replay-")
            guard.hold = False
            guard.check()
        mm, arena = _allocate_arena(nslots * bs)
        arena64 = arena.view(np.uint64)
        try:
            tier = factory(root, bs, config.capacity_bytes, config.engine)
        except ValueError as exc:  # bad engine, unusable root, capacity below one block, ...
            raise ReplayConfigError(f"cannot open the tier at {root}: {exc}") from exc
        tier.set_arena(arena)

        def slot_view(slot: int) -> np.ndarray:
            return arena64[slot * words_per_block : (slot + 1) * words_per_block]

        # LIFO: reuse the slots freed last (warm in cache and already faulted in)
        free_slots: list[int] = list(range(nslots - 1, -1, -1))
        pending: dict[int, _Pending] = {}
        job_ids = itertools.count(1)

        # counters
        c = dict(
            blocks_requested=0, blocks_looked_up=0, blocks_hit=0, blocks_hit_pending=0,
            lookup_retries=0, load_jobs=0, store_jobs=0, blocks_loaded=0, blocks_stored=0,
            bytes_loaded=0, bytes_stored=0, verification_failures=0, errors=0,
            prompt_tokens=0, hit_tokens=0, load_failed_keys=0, store_failed_keys=0,
            store_rejected_keys=0,
        )
        failure_reasons: dict[str, int] = {}
        error_samples: list[str] = []
        load_intervals: list[tuple[float, float]] = []
        store_intervals: list[tuple[float, float]] = []
        load_latencies: list[float] = []
        harness_cpu = 0.0

        def error(msg: str, count: int = 1) -> None:
            c["errors"] += count
            if len(error_samples) < 20:
                error_samples.append(msg)

        last_finish = [time.monotonic()]  # when a job last finished (stall detection)

        def handle(results: Iterable[Any]) -> None:
            nonlocal harness_cpu
            now = time.perf_counter()
            for r in results:
                last_finish[0] = time.monotonic()
                p = pending.pop(r.job_id, None)
                if p is None:
                    error(f"job {r.job_id}: finished but was never submitted (or finished twice)")
                    continue
                if bool(r.is_load) != p.is_load:
                    error(f"job {r.job_id}: reported is_load={r.is_load}, submitted as {'load' if p.is_load else 'store'}")
                if r.successful_keys is None:
                    ok_keys = set(p.keys) if r.success else set()
                else:
                    ok_keys = set(r.successful_keys)
                failed = [k for k in p.keys if k not in ok_keys]
                if failed:
                    reasons = getattr(r, "failed_keys", None) or {}
                    kind = "load" if p.is_load else "store"
                    hard = []
                    for k in failed:
                        reason = str(reasons.get(k, "no reason given"))
                        failure_reasons[f"{kind}: {reason}"] = failure_reasons.get(f"{kind}: {reason}", 0) + 1
                        if p.is_load:
                            c["load_failed_keys"] += 1
                            hard.append(k)
                        elif reason.startswith(_STORE_REJECTIONS):
                            c["store_rejected_keys"] += 1  # the tier declined it: capacity pressure
                        else:
                            c["store_failed_keys"] += 1
                            hard.append(k)
                    if hard:
                        error(
                            f"{kind} job {r.job_id}: {len(hard)} of {len(p.keys)} keys failed "
                            f"(first {hard[0].hex()}: {reasons.get(hard[0], 'no reason given')})",
                            len(hard),
                        )
                if p.is_load:
                    load_intervals.append((p.submit_t, now))
                    load_latencies.append(now - p.submit_t)
                    t0 = time.thread_time()
                    for key, slot in zip(p.keys, p.slots):
                        if key in ok_keys:
                            c["blocks_loaded"] += 1
                            if not pattern.matches(slot_view(slot), key):
                                c["verification_failures"] += 1
                                if len(error_samples) < 20:
                                    error_samples.append(f"load job {r.job_id}: block {key.hex()} (slot {slot}) has the wrong bytes")
                    harness_cpu += time.thread_time() - t0
                    c["bytes_loaded"] += bs * sum(1 for k in p.keys if k in ok_keys)
                else:
                    store_intervals.append((p.submit_t, now))
                    written = r.transfer_bytes
                    n_ok = sum(1 for k in p.keys if k in ok_keys)
                    c["blocks_stored"] += n_ok
                    c["bytes_stored"] += int(written) if written is not None else bs * n_ok
                free_slots.extend(p.slots)
            progress.show(bar_text())

        def bar_text() -> str:
            """What the bar shows: the summary's figures so far (stores count when they finish,
            as in the summary), and the stores still in flight."""
            storing = sum(1 for p in pending.values() if not p.is_load)
            return (f"hit {c['blocks_hit'] / c['blocks_requested'] if c['blocks_requested'] else 0.0:.2%}, "
                    f"loaded {format_bytes(c['bytes_loaded'])}, stored {format_bytes(c['bytes_stored'])}"
                    + (f" (+{storing} store job{'s' if storing != 1 else ''} in flight)" if storing else ""))

        def poll() -> None:
            if pending:
                handle(tier.get_finished_jobs())

        def wait_some(timeout: float = 0.05) -> None:
            guard.check()
            results = tier.wait(timeout_s=timeout)
            if results:
                handle(results)
            elif pending and time.monotonic() - last_finish[0] > _STALL_DEADLINE_S:
                raise RuntimeError(
                    f"tier stalled: {len(pending)} job(s) in flight and none finished for "
                    f"{_STALL_DEADLINE_S:.0f} s (job ids {sorted(pending)[:8]})"
                )

        def lookup(key: bytes):
            deadline = None
            while True:
                res = tier.lookup(key)
                if res != LookupResult.RETRY:
                    return res
                c["lookup_retries"] += 1
                tier.on_step_end()  # the next scheduler step: flushes the existence probe
                if pending:
                    # A block being written answers RETRY until its store lands, however long
                    # that takes; wait_some() gives up only if the tier stops finishing jobs.
                    deadline = None
                    wait_some(0.01)
                else:
                    # Nothing of ours in flight: only an existence probe can be pending.
                    if deadline is None:
                        deadline = time.monotonic() + _LOOKUP_RETRY_DEADLINE_S
                    elif time.monotonic() > deadline:
                        error(f"lookup of {key.hex()} still RETRY after {_LOOKUP_RETRY_DEADLINE_S:.0f} s "
                              "with nothing in flight; treated as MISS")
                        return LookupResult.MISS
                    time.sleep(0.0002)

        def take_slots(n: int) -> list[int]:
            while len(free_slots) < n:
                if not pending:
                    raise RuntimeError(f"arena exhausted: need {n} slots, {len(free_slots)} free, nothing in flight")
                wait_some(0.1)
            return [free_slots.pop() for _ in range(n)]

        progress = _Progress(len(requests), config.progress)
        cpu0 = _rusage_cpu()
        t_start = time.perf_counter()
        try:
            for req in requests:
                guard.check()
                t0 = time.thread_time()
                keys = [block_key(h, s, bs) for h in req.hash_ids for s in range(spb)]
                harness_cpu += time.thread_time() - t0
                n = len(keys)
                c["blocks_requested"] += n
                c["prompt_tokens"] += req.input_length

                # phase 1: the longest prefix the tier holds
                hits = 0
                for key in keys:
                    res = lookup(key)
                    c["blocks_looked_up"] += 1
                    if res == LookupResult.HIT:
                        hits += 1
                    elif res == LookupResult.HIT_PENDING:
                        hits += 1
                        c["blocks_hit_pending"] += 1
                    else:
                        break
                tier.on_step_end()
                c["blocks_hit"] += hits
                c["hit_tokens"] += min(hits * tpb, req.input_length)

                slots = take_slots(n)
                # phase 2: promote the prefix (one job), wait for it, check every byte
                if hits:
                    jid = next(job_ids)
                    p = _Pending(True, keys[:hits], slots[:hits], time.perf_counter())
                    pending[jid] = p
                    tier.submit_load(TransferJob(jid, p.keys, p.slots))
                    c["load_jobs"] += 1
                    while jid in pending:
                        wait_some(1.0)
                else:
                    poll()
                # "compute" the rest of the prompt, then cascade it (one job, in the background)
                if hits < n:
                    t0 = time.thread_time()
                    for key, slot in zip(keys[hits:], slots[hits:]):
                        pattern.fill(slot_view(slot), key)
                    harness_cpu += time.thread_time() - t0
                    jid = next(job_ids)
                    p = _Pending(False, keys[hits:], slots[hits:], time.perf_counter())
                    pending[jid] = p
                    tier.submit_store(TransferJob(jid, p.keys, p.slots))
                    c["store_jobs"] += 1
                poll()
                progress.show(bar_text())
                progress.advance()
            while pending:
                wait_some(1.0)
            tier.drain()
            handle(tier.get_finished_jobs())
        finally:
            progress.close()
        wall = time.perf_counter() - t_start
        cpu = _rusage_cpu() - cpu0

        stats = dict(tier.stats())
        engine_name = str(stats.get("engine") or getattr(tier, "engine_name", None) or config.engine)
        if "direct" in stats:
            engine_name += ", O_DIRECT" if stats["direct"] else ", buffered I/O"
        tier_verify = int(stats.get("verify_failures", 0) or 0)
        if tier_verify:
            error(f"the tier found {tier_verify} block(s) on disk that failed their checksum/identity proof", 0)

        moved_gib = (c["bytes_loaded"] + c["bytes_stored"]) / (1 << 30)
        load_busy = _union_seconds(load_intervals)
        store_busy = _union_seconds(store_intervals)
        lat = sorted(load_latencies)
        summary = ReplaySummary(
            trace=str(trace_name),
            model=preset.name,
            tokens_per_block=tpb,
            block_size_bytes=bs,
            engine=engine_name,
            root=root,
            root_removed=False,
            capacity_bytes=config.capacity_bytes,
            arena_bytes=nslots * bs,
            requests=len(requests),
            blocks_requested=c["blocks_requested"],
            blocks_looked_up=c["blocks_looked_up"],
            blocks_hit=c["blocks_hit"],
            blocks_hit_pending=c["blocks_hit_pending"],
            lookup_retries=c["lookup_retries"],
            block_hit_ratio=c["blocks_hit"] / c["blocks_requested"] if c["blocks_requested"] else 0.0,
            byte_hit_ratio=c["hit_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0,
            prompt_kv_bytes=c["prompt_tokens"] * kv_per_token,
            hit_kv_bytes=c["hit_tokens"] * kv_per_token,
            load_jobs=c["load_jobs"],
            store_jobs=c["store_jobs"],
            blocks_loaded=c["blocks_loaded"],
            blocks_stored=c["blocks_stored"],
            bytes_loaded=c["bytes_loaded"],
            bytes_stored=c["bytes_stored"],
            load_busy_s=load_busy,
            store_busy_s=store_busy,
            load_gbps=c["bytes_loaded"] / load_busy / 1e9 if load_busy > 0 else 0.0,
            store_gbps=c["bytes_stored"] / store_busy / 1e9 if store_busy > 0 else 0.0,
            load_latency_ms_p50=None if not lat else _percentile(lat, 50) * 1e3,
            load_latency_ms_p99=None if not lat else _percentile(lat, 99) * 1e3,
            load_latency_ms_max=None if not lat else lat[-1] * 1e3,
            cpu_s=cpu,
            cpu_s_per_gib=cpu / moved_gib if moved_gib > 0 else None,
            harness_cpu_s=harness_cpu,
            tier_cpu_s_per_gib=max(0.0, cpu - harness_cpu) / moved_gib if moved_gib > 0 else None,
            evictions=int(stats.get("evictions", 0) or 0),
            verification_failures=c["verification_failures"],
            tier_verify_failures=tier_verify,
            load_failed_keys=c["load_failed_keys"],
            store_failed_keys=c["store_failed_keys"],
            store_rejected_keys=c["store_rejected_keys"],
            errors=c["errors"] + tier_verify,
            failure_reasons=dict(sorted(failure_reasons.items(), key=lambda kv: -kv[1])),
            error_samples=error_samples,
            wall_s=wall,
            tier_stats={k: jsonable(v) for k, v in stats.items()},
        )
    finally:
        guard.hold = True  # first (a plain store: no signal handler runs before it)
        unwinding = sys.exc_info()[1] is not None
        errors: list[BaseException] = []
        if tier is not None:
            try:
                tier.shutdown()  # in-flight I/O finishes: nothing writes under the root after it
            except Exception as exc:  # noqa: BLE001 - the root is removed all the same
                errors.append(exc)
            tier = None
        if mm is not None:
            arena = arena64 = None  # noqa: F841 - drop our views so the mapping can close
            try:
                mm.close()
            except BufferError:
                pass  # something still holds a view (the tier); the GC unmaps it later
        if temp_root is not None:
            root_removed = _remove_tree(temp_root)
        guard.release(unwinding)  # raises for a signal that came during the clean-up
        if errors:
            if not unwinding:
                raise errors[0]
            print(f"pykvtier replay: shutting the tier down failed: {errors[0]!r}", file=sys.stderr)
    summary.root_removed = root_removed
    return summary


# --------------------------------------------------------------------------------------
# CLI


def format_summary(s: ReplaySummary) -> str:
    def ms(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.2f} ms"

    cap = "unlimited" if s.capacity_bytes is None else format_bytes(s.capacity_bytes)
    per_gib = "n/a" if s.cpu_s_per_gib is None else f"{s.cpu_s_per_gib:.2f} CPU s/GiB moved"
    tier_per_gib = "n/a" if s.tier_cpu_s_per_gib is None else f"{s.tier_cpu_s_per_gib:.2f} s/GiB"
    lines = [
        f"pykvtier replay: {s.requests} requests of {s.trace}",
        f"  model {s.model}, {s.tokens_per_block} tokens/block -> blocks of {format_bytes(s.block_size_bytes)} "
        f"({s.block_size_bytes} B); engine {s.engine}; capacity {cap}; arena {format_bytes(s.arena_bytes)}",
        f"  root {s.root}{' (removed)' if s.root_removed else ''}",
        f"  blocks      {s.blocks_requested} requested, {s.blocks_looked_up} looked up, {s.blocks_hit} hit"
        f" ({s.blocks_hit_pending} pending), {s.lookup_retries} RETRY answers",
        f"  hit ratio   blocks {s.block_hit_ratio:.2%}, bytes {s.byte_hit_ratio:.2%} "
        f"({format_bytes(s.hit_kv_bytes)} of {format_bytes(s.prompt_kv_bytes)} prompt KV)",
        f"  loaded      {format_bytes(s.bytes_loaded)} in {s.load_jobs} jobs, {s.load_busy_s:.2f} s busy"
        f" -> {s.load_gbps:.2f} GB/s; per-request latency p50 {ms(s.load_latency_ms_p50)},"
        f" p99 {ms(s.load_latency_ms_p99)}, max {ms(s.load_latency_ms_max)}",
        f"  stored      {format_bytes(s.bytes_stored)} in {s.store_jobs} jobs, {s.store_busy_s:.2f} s busy"
        f" -> {s.store_gbps:.2f} GB/s; {s.store_rejected_keys} blocks declined by the tier (capacity)",
        f"  CPU         {s.cpu_s:.2f} s, {per_gib} (tier alone {tier_per_gib};"
        f" replay's fill+verify {s.harness_cpu_s:.2f} s)",
        f"  evictions   {s.evictions}"
        + (f" ({s.tier_stats['files_recycled']} files taken over by stores)"
           if s.tier_stats.get("files_recycled") else ""),
        f"  verification failures {s.verification_failures}, errors {s.errors}"
        f" (load failures {s.load_failed_keys}, store failures {s.store_failed_keys},"
        f" tier checksum failures {s.tier_verify_failures})",
        f"  wall        {s.wall_s:.2f} s",
    ]
    for reason, n in s.failure_reasons.items():
        lines.append(f"  - {n} x {reason}")
    for msg in s.error_samples:
        lines.append(f"  ! {msg}")
    lines.append("  OK" if s.ok else "  FAILED")
    return "\n".join(lines)


def _size_arg(text: str) -> int | None:
    if text.strip().lower() in ("none", "unlimited", "inf"):
        return None
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
        "Replay a KV-cache trace against a DiskTier as an engine would: look up each request's "
        "prefix blocks (stop at the first MISS), load the hits into a host arena and check every "
        "byte, then store the missed blocks. Prints hit ratios, GB/s, load latency, CPU per GiB, "
        "evictions and verification failures; exits 1 if any block failed verification or any "
        "error occurred."
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
        help="directory for the block files (kept); default: a new temporary directory, removed at the end",
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
    try:
        _models.get_preset(args.model)
        _models.validate_tokens_per_block(args.tokens_per_block)
    except ValueError as exc:
        print(f"pykvtier replay: {exc}", file=sys.stderr)
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
        progress=not (args.no_progress or args.json),
        arena_bytes=args.arena,
    )
    try:
        summary = run_replay(config)
    except (FileNotFoundError, TraceFormatError, ReplayConfigError, _models.UnknownModelError) as exc:
        print(f"pykvtier replay: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary.to_dict(), sort_keys=False))
    else:
        print(format_summary(summary))
    return 0 if summary.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pykvtier.replay``: the same as ``pykvtier replay``."""
    parser = argparse.ArgumentParser(prog="pykvtier replay")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
