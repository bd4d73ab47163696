"""Tiers ``pykvtier replay`` can drive besides :class:`~pykvtier.DiskTier`: vLLM's own fs tier.

``--tier vllm-fs`` replays the same trace, with the same driver and the same checks, through
vLLM 0.33's ``FileSystemTierManager`` (``vllm.v1.kv_offload.tiering.fs.manager``), so the
whole main job can be compared side by side. :class:`VllmFsTier` gives that tier the interface
the replay driver uses (the DiskTier calls of :class:`pykvtier.replay.ReplayDriver`), and
drives the fs tier through vLLM's own interface, as vLLM's ``TieringOffloadingManager`` does:
one ``ReqContext`` per request (``on_new_request`` / ``on_request_finished``), ``lookup(key,
ctx)`` with its asynchronous existence probe resolved by ``on_schedule_end``, vLLM
``TransferJob``\\ s (``chunk_ids`` = the replay's arena slots) to ``submit_load`` /
``submit_store``, ``get_finished_jobs``, ``drain_jobs`` and ``shutdown``.

:func:`vllm_fs_tier` has the signature of the replay's tier factories (``root, block_size,
capacity, engine, recycle=True``); :func:`make_vllm_fs_tier_factory` checks that vLLM imports
(else :class:`TierUnavailableError`, naming the ``pip install``) and returns one with options.
A tool, not library: the replay sits above it (``pyproject.toml``'s import contracts).
"""

from __future__ import annotations

import functools
import itertools
import os
import queue
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np

from .tier import JobResult, LookupResult, TransferJob

__all__ = [
    "VLLM_INSTALL_HINT",
    "TierUnavailableError",
    "vllm_unavailable_reason",
    "VllmFsTier",
    "vllm_fs_tier",
    "make_vllm_fs_tier_factory",
    "vllm_fs_tier_factory",
]

#: How to install the vLLM the fs tier comes from (CPU-only machine; requirements-vllm.txt).
VLLM_INSTALL_HINT = ("pip install torch==2.13.0 && pip install --no-deps -r requirements-vllm.txt "
                     "(from pykvtier's source tree; with vLLM's own dependencies: "
                     "pip install 'pykvtier[vllm]')")

_FS_MODULE = "vllm.v1.kv_offload.tiering.fs.manager"
_PROBE_DEADLINE_S = 30.0  # an existence probe of vLLM's lookup thread should take microseconds


class TierUnavailableError(ImportError, ValueError):
    """The tier cannot be made here: vLLM (its ``kv_offload.tiering`` fs tier) does not import.
    The message says why and names the ``pip install``. An ImportError, and a ValueError so that
    :func:`pykvtier.replay.run_replay` reports it as a ReplayConfigError where the factory
    raises it."""


@dataclass(frozen=True)
class _Vllm:
    """The vLLM classes the adapter uses (imported on first use: vLLM is optional)."""

    LookupResult: Any
    ReqContext: Any
    ScheduleEndContext: Any
    make_offload_key: Callable[[bytes, int], bytes]
    TransferJob: Any
    SecondaryTierFactory: Any
    FileSystemTierManager: Any
    make_spec: Callable[[int, str, dict], Any]
    backend: str


def offloading_spec(block_size: int, tier_configs: list[dict], *, model_name: str,
                    cpu_bytes: int, engine_id: str) -> Any:
    """The TieringOffloadingSpec vLLM's OffloadingConnector makes from its config: one KV group
    of 16 tokens per block, one worker, one chunk of ``block_size`` bytes per block, a CPU tier
    of ``cpu_bytes`` and ``tier_configs`` as its secondary tiers (vLLM's fs tier's FileMapper
    names its files from ``model_name``). Imports vLLM (ImportError where it is missing)."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    cfg = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layers.0",),
                                      group_id=0),),
        worker_kv_bytes_per_block=block_size, enable_kv_cache_events=False,
        extra_config={"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": cpu_bytes,
                      "secondary_tiers": list(tier_configs)},
        engine_id=engine_id,
        model=OffloadingModelConfig(name=model_name, dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=True))
    return OffloadingSpecFactory.create_spec(cfg)


@functools.lru_cache(maxsize=1)
def _import_vllm_cached() -> _Vllm:
    from vllm.v1.kv_offload.base import (
        LookupResult as VLookupResult,
    )
    from vllm.v1.kv_offload.base import (
        ReqContext,
        ScheduleEndContext,
        make_offload_key,
    )
    from vllm.v1.kv_offload.tiering.base import TransferJob as VTransferJob
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    from vllm.v1.kv_offload.tiering.fs import io as fs_io
    from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

    def make_spec(block_size: int, model_name: str, tier_config: dict) -> Any:
        return offloading_spec(block_size, [tier_config], model_name=model_name,
                               cpu_bytes=block_size,
                               engine_id=f"pykvtier-replay-{os.getpid()}")

    backend = ("C extension vllm.fs_io_C" if getattr(fs_io, "_HAS_FSIO_C", False)
               else "pure Python")
    return _Vllm(VLookupResult, ReqContext, ScheduleEndContext, make_offload_key, VTransferJob,
                 SecondaryTierFactory, FileSystemTierManager, make_spec, backend)


def _import_vllm() -> _Vllm:
    """vLLM's classes, or TierUnavailableError saying why and how to install it."""
    try:
        return _import_vllm_cached()
    except Exception as exc:  # noqa: BLE001 - any import failure means: no usable vLLM here
        raise TierUnavailableError(
            f"--tier vllm-fs needs vLLM's fs tier ({_FS_MODULE}.FileSystemTierManager, "
            f"vLLM 0.33), which does not import here ({type(exc).__name__}: {exc}); "
            f"install it with: {VLLM_INSTALL_HINT}") from exc


def vllm_unavailable_reason() -> str | None:
    """None where vLLM's fs tier imports; else the TierUnavailableError's message."""
    try:
        _import_vllm()
    except TierUnavailableError as exc:
        return str(exc)
    return None


@dataclass
class _Job:
    is_load: bool
    keys: list[bytes]  # the replay's keys sent to the fs tier
    okeys: list[bytes]  # theirs as vLLM OffloadKeys (key + group index 0)
    declined: dict[bytes, str]  # a store's keys not sent (no room for them): key -> reason
    reserved: int = 0  # a store's bytes of blocks new to the tier (room taken until it ends)


class VllmFsTier:
    """vLLM 0.33's ``FileSystemTierManager`` with the DiskTier interface the replay drives.

    Replay calls (``pykvtier/replay.py``: ``tier.`` in ReplayDriver, run_replay, _summarize):
    ``set_arena(arena)``, ``lookup(key)`` -> :class:`~pykvtier.tier.LookupResult`,
    ``on_step_end()``, ``submit_load(job)`` / ``submit_store(job)`` with
    :class:`~pykvtier.tier.TransferJob`, ``get_finished_jobs()`` / ``wait(timeout_s=)`` ->
    :class:`~pykvtier.tier.JobResult` (with ``is_load`` and ``failed_keys``), ``drain()``,
    ``stats()``, ``engine_name``, ``shutdown()``; besides, ``touch``, ``used_bytes``,
    ``num_blocks``, ``direct``, ``has_pending_work()``.

    **The arena.** The fs tier copies to and from the ``primary_kv_view`` it is built with (in
    vLLM the CPU tier's shared mapping), block ``chunk_id`` at ``chunk_id * block_size``:
    :meth:`set_arena` builds it on the replay's arena (a ``(slots, block_size)`` memoryview),
    so a load's ``os.readv`` lands in the replay's slot itself and a store writes from it, and
    the replay checks the bytes where they landed. The tier is made there (vLLM's
    ``SecondaryTierFactory`` with ``{"type": "fs", "root_dir": root}`` and a
    TieringOffloadingSpec), so nothing but ``set_arena`` works before it.

    **What vLLM's fs tier lacks.** No capacity and no eviction: every stored block stays
    until something outside removes it, and stores go on until the file system is full
    (then they fail with ENOSPC). So that a replay cannot fill the disk, and so that its
    figures are those of the fs tier on a disk of ``capacity_bytes``, the adapter declines
    (before vLLM sees them) a store's new blocks that would take ``used_bytes`` (the blocks
    this tier stored, x block size: vLLM's files hold the payload alone) past
    ``capacity_bytes`` (reason "no capacity: ...", which the replay counts as declined, not as
    an error), and those that would leave less than ``min_free_bytes`` free on the root's
    file system (default 5 % of it, as DiskTier; reason "no room: ...", a store failure, as
    DiskTier's). Nothing is ever evicted, so once full the tier caches nothing new: the
    blocks it keeps are the first ones stored. ``enforce_capacity=False``: the capacity is
    only reported (``stats()["bytes_over_capacity"]``; the free-space floor still holds).
    No checksum or identity check of a loaded block (a
    file of the right size is loaded as it is; only a short read fails, and removes the file).
    No partial result for a failed store (:meth:`get_finished_jobs` finds the stored keys by
    their files). No HIT_PENDING and no RETRY for a block being written: in vLLM the CPU tier
    holds such blocks and answers for them; the replay has no CPU tier, so here, as DiskTier
    does, a key of a store in flight answers RETRY (until its result was collected) and a key
    of a load in flight HIT_PENDING.

    **Lookups.** The fs tier's lookup of a key it has no verdict on answers RETRY and queues
    an existence probe (``os.path.exists`` of the block's file) that its lookup thread runs
    once ``on_schedule_end`` flushes the step's batch; the verdict stays cached for the
    request's ``ReqContext``. vLLM's scheduler keeps scanning a request's keys past a RETRY,
    so a request's probes go out in one batch and cost it one step. The replay asks key by key
    and stops at a RETRY (asking again after a step), so passed through, the fs tier's RETRY
    would cost a step per key of every prefix, which vLLM does not pay. So :meth:`lookup`
    takes the probe's step at once: on the fs tier's RETRY it calls ``on_schedule_end``,
    waits (blocked, no polling) for the lookup thread's answer and asks again
    (``stats()["probe_steps"]``, ``["probe_wait_us"]``): the answer is the fs tier's, got
    through its own probe, without the step. A request ends (``on_request_finished``: its
    cached verdicts go) at the first lookup after a submit, so a block stored since is
    probed again, as a new request does in vLLM.

    Not thread-safe: one thread drives it (as the replay does; vLLM calls its tiers under the
    manager's lock).
    """

    def __init__(self, root: str, block_size: int, capacity_bytes: int | None = None, *,
                 enforce_capacity: bool = True, min_free_bytes: int | None = None,
                 n_read_threads: int = 16, n_write_threads: int = 16,
                 model_name: str = "pykvtier-replay") -> None:
        self._v = _import_vllm()
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block size must be a positive number of bytes, got {block_size!r}")
        if capacity_bytes is not None and capacity_bytes < block_size:
            raise ValueError(f"capacity {capacity_bytes} B is less than one block ({block_size} B)")
        if not root:
            raise ValueError("root '' is empty (it would mean the current directory)")
        self.root = os.path.abspath(root)
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise ValueError(f"{self.root} is not a directory")
        if min_free_bytes is not None and min_free_bytes < 0:
            raise ValueError(f"min_free_bytes must be >= 0, got {min_free_bytes}")
        self.block_size = block_size
        self.capacity_bytes = capacity_bytes
        self.enforce_capacity = bool(enforce_capacity)
        self._min_free_arg = min_free_bytes
        self.min_free_bytes = 0  # set when the root exists (set_arena)
        self._reserved = 0  # bytes of new blocks in stores in flight
        self._tier_config = {"type": "fs", "root_dir": self.root, "n_read_threads": n_read_threads,
                             "n_write_threads": n_write_threads}
        self._model_name = model_name
        self.engine_name = f"vllm-fs ({self._v.backend})"
        self._fs: Any = None  # the FileSystemTierManager, made by set_arena
        self._view: memoryview | None = None
        self._nslots = 0
        self._closed = False
        self._jobs: dict[int, _Job] = {}
        self._storing: dict[bytes, int] = {}  # key -> store jobs of it in flight
        self._loading: dict[bytes, int] = {}
        self._present: set[bytes] = set()  # keys stored through this tier
        self._ready: list[JobResult] = []  # collected at shutdown, not yet handed out
        self._ctx: Any = None  # the current request's vLLM ReqContext
        self._submitted = False  # a job was submitted since the current request's lookups
        self._req_ids = itertools.count()
        self._schedule_end = self._v.ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
        self._answers = {self._v.LookupResult.HIT: LookupResult.HIT,
                         self._v.LookupResult.MISS: LookupResult.MISS,
                         self._v.LookupResult.RETRY: LookupResult.RETRY,
                         self._v.LookupResult.HIT_PENDING: LookupResult.HIT_PENDING}
        self._stats = dict.fromkeys((
            "lookups", "hits", "misses", "retries", "hit_pending", "probe_steps",
            "loads_submitted", "stores_submitted", "stores_skipped_present", "blocks_loaded",
            "blocks_stored", "bytes_loaded", "bytes_stored", "load_failures", "store_failures",
            "capacity_rejections", "no_room_failures", "vllm_requests"), 0)
        self._probe_wait_s = 0.0

    # ------------------------------------------------------------------ set-up

    def set_arena(self, buffer: Any, slot_bytes: int | None = None) -> None:
        """Makes the fs tier over ``buffer`` (the replay's host arena: a uint8 array, or any
        buffer, of whole blocks; slot ``i`` is bytes ``[i * block_size, (i + 1) * block_size)``)
        as its primary view: jobs' ``slot_ids`` are its ``chunk_ids``. Once."""
        if self._closed:
            raise RuntimeError("the tier is shut down")
        if self._fs is not None:
            raise RuntimeError("set_arena: the fs tier has its arena already (vLLM fixes its "
                               "primary view when the tier is made)")
        bs = self.block_size if slot_bytes is None else slot_bytes
        if bs != self.block_size:
            raise ValueError(f"slot_bytes {bs} != the block size {self.block_size}: vLLM's fs tier "
                             "moves one block per slot (its view's row stride)")
        arr = np.frombuffer(buffer, dtype=np.uint8) if not isinstance(buffer, np.ndarray) \
            else buffer.reshape(-1).view(np.uint8)
        if arr.nbytes < bs or arr.nbytes % bs:
            raise ValueError(f"arena of {arr.nbytes} B is not a whole number of {bs} B blocks")
        self._nslots = arr.nbytes // bs
        view = memoryview(arr.reshape(self._nslots, bs))
        spec = self._v.make_spec(bs, self._model_name, self._tier_config)
        os.makedirs(self.root, 0o700, exist_ok=True)
        if self._min_free_arg is None:  # 5 % of the file system, as DiskTier
            st = os.statvfs(self.root)
            self.min_free_bytes = st.f_blocks * st.f_frsize // 20
        else:
            self.min_free_bytes = self._min_free_arg
        try:
            self._fs = self._v.SecondaryTierFactory.create_secondary_tier(dict(self._tier_config),
                                                                           view, spec)
        except BaseException:
            view.release()
            raise
        self._view = view

    def _tier(self) -> Any:
        if self._fs is None:
            raise RuntimeError("the tier is shut down" if self._closed
                               else "set_arena() first: vLLM's fs tier is made over the arena")
        return self._fs

    @property
    def direct(self) -> bool:
        """Whether the fs tier uses O_DIRECT (its own probe of the root; else buffered I/O)."""
        return bool(self._fs is not None and self._fs._use_o_direct)

    def file_of(self, key: bytes) -> str:
        """The path of ``key``'s block file (vLLM's FileMapper)."""
        return self._tier().file_mapper.get_file_name(self._okey(key))

    def _okey(self, key: bytes) -> bytes:
        return self._v.make_offload_key(bytes(key), 0)

    # ------------------------------------------------------------------ lookups

    def _context(self) -> Any:
        """The current request's ReqContext; a lookup after a submit starts the next request
        (the previous one finishes: the fs tier drops its cached verdicts)."""
        fs = self._tier()
        if self._submitted and self._ctx is not None:
            fs.on_request_finished(self._ctx)
            self._ctx = None
        self._submitted = False
        if self._ctx is None:
            self._ctx = self._v.ReqContext(req_id=f"pykvtier-replay-{next(self._req_ids)}")
            fs.on_new_request(self._ctx)
            self._stats["vllm_requests"] += 1
        return self._ctx

    def lookup(self, key: bytes) -> LookupResult:
        """HIT: its file is there (the fs tier's probe). MISS: not there (or a load of it
        failed). RETRY: a store of it is in flight (until its result is collected), or the fs
        tier's probe did not answer within 30 s. HIT_PENDING: a load of it is in flight."""
        st = self._stats
        st["lookups"] += 1
        if key in self._storing:
            st["retries"] += 1
            return LookupResult.RETRY
        if key in self._loading:
            st["hit_pending"] += 1
            return LookupResult.HIT_PENDING
        ctx = self._context()
        okey = self._okey(key)
        res = self._fs.lookup(okey, ctx)
        if res is self._v.LookupResult.RETRY:
            res = self._resolve(okey, ctx)
        out = self._answers[res]
        st[{LookupResult.HIT: "hits", LookupResult.MISS: "misses", LookupResult.RETRY: "retries",
            LookupResult.HIT_PENDING: "hit_pending"}[out]] += 1
        return out

    def _resolve(self, okey: bytes, ctx: Any) -> Any:
        """The fs tier's verdict on ``okey`` after the scheduler steps its probe needs: a step
        flushes the probe batch (``on_schedule_end``), then waits for the lookup thread's
        answer, which the next lookup applies."""
        fs, retry = self._fs, self._v.LookupResult.RETRY
        deadline = time.monotonic() + _PROBE_DEADLINE_S
        while True:
            posted = self._flush()  # applies the answers in, posts the keys not yet asked
            if not posted:  # okey's probe went out before: its answer may be in now
                res = fs.lookup(okey, ctx)
                if res is not retry:
                    return res
            left = deadline - time.monotonic()
            if left <= 0:
                return retry
            # the answer naming okey is on its way (in slices: should no batch come after all,
            # a flush and a lookup again)
            self._wait_probe(min(left, 0.05))
            if posted:
                res = fs.lookup(okey, ctx)  # the first lookup since the flush applies it
                if res is not retry:
                    return res

    def _flush(self) -> bool:
        """The fs tier's ``on_schedule_end``; whether it posted keys to its lookup thread."""
        batch = getattr(getattr(self._fs, "_lookup_manager", None), "_lookup_batch", None)
        posted = True if batch is None else bool(batch)  # (another vLLM: assume it did)
        self._fs.on_schedule_end(self._schedule_end)
        if posted:
            self._stats["probe_steps"] += 1
        return posted

    def _wait_probe(self, timeout: float) -> None:
        """Blocks until the fs tier's lookup thread posted a result batch (or ``timeout``); the
        batch stays queued for the fs tier's own drain (vLLM 0.33's AsyncLookupManager)."""
        t0 = time.perf_counter()
        results = getattr(getattr(self._fs, "_lookup_manager", None), "_pending_results", None)
        try:
            if results is None:  # another vLLM: give its thread a moment
                time.sleep(min(0.0002, max(0.0, timeout)))
                return
            try:
                batch = results.get(timeout=max(0.0, timeout))
            except queue.Empty:
                return
            results.put(batch)  # the order of batches does not matter (each names its keys)
        finally:
            self._probe_wait_s += time.perf_counter() - t0

    def on_step_end(self) -> None:
        """The scheduler step's end: the fs tier's ``on_schedule_end`` (applies the lookup
        thread's answers; flushes a probe batch, if any)."""
        self._tier()
        self._flush()

    def touch(self, keys: Iterable[bytes], digests: Iterable[bytes] | None = None) -> None:
        """The fs tier's ``touch`` (a no-op there: it keeps no recency, it never evicts)."""
        self._tier().touch([self._okey(k) for k in keys], self._context())

    # ------------------------------------------------------------------ jobs

    def submit_load(self, job: TransferJob) -> None:
        """Loads ``job.keys`` into the arena slots ``job.slot_ids`` (one vLLM promotion job)."""
        self._submit(job, True)

    def submit_store(self, job: TransferJob) -> None:
        """Stores the arena slots ``job.slot_ids`` as ``job.keys`` (one vLLM cascade job)."""
        self._submit(job, False)

    def _submit(self, job: TransferJob, is_load: bool) -> None:
        fs = self._tier()
        keys = [bytes(k) for k in job.keys]
        slots = [int(s) for s in job.slot_ids]
        if len(keys) != len(slots):
            raise ValueError(f"job {job.job_id}: {len(keys)} keys but {len(slots)} slots")
        if job.job_id in self._jobs:
            raise ValueError(f"job id {job.job_id} is already in flight")
        bad = [s for s in slots if not 0 <= s < self._nslots]
        if bad:
            raise ValueError(f"job {job.job_id}: slot {bad[0]} is outside the arena's "
                             f"{self._nslots} slots")
        ctx = self._context() if self._ctx is None else self._ctx
        self._submitted = True
        declined: dict[bytes, str] = {}
        reserved = 0
        if not is_load:
            self._stats["stores_submitted"] += 1
            keys, slots, declined, reserved = self._admit(keys, slots)
            if not keys:  # nothing to write: finished now, nothing sent to vLLM
                self._ready.append(self._declined_result(job.job_id, declined))
                return
        okeys = [self._okey(k) for k in keys]
        vjob = self._v.TransferJob(job_id=job.job_id, keys=okeys,
                                   chunk_ids=np.asarray(slots, dtype=np.int64),
                                   is_promotion=is_load, req_context=ctx)
        self._jobs[job.job_id] = _Job(is_load, keys, okeys, declined, reserved)
        self._reserved += reserved
        inflight = self._loading if is_load else self._storing
        for k in keys:
            inflight[k] = inflight.get(k, 0) + 1
        if is_load:
            self._stats["loads_submitted"] += 1
            fs.submit_load(vjob)
        else:
            fs.submit_store(vjob)

    def _admit(self, keys: list[bytes], slots: list[int]
               ) -> tuple[list[bytes], list[int], dict[bytes, str], int]:
        """A store's keys that get room: (keys, slots, declined key -> reason, bytes of the new
        blocks). A key already stored, or in a store in flight, needs none (vLLM's fs tier
        skips a file that is there); a new one needs a block within the capacity (if enforced)
        and above the free-space floor."""
        bs = self.block_size
        cap = self.capacity_bytes if self.enforce_capacity else None
        st = os.statvfs(self.root)
        free = st.f_bavail * st.f_frsize - self._reserved  # (stores in flight: not all written yet)
        out_k: list[bytes] = []
        out_s: list[int] = []
        declined: dict[bytes, str] = {}
        new: set[bytes] = set()
        for k, slot in zip(keys, slots):
            if k in self._present or k in self._storing or k in new:
                out_k.append(k)
                out_s.append(slot)
                continue
            taken = self.used_bytes + self._reserved + len(new) * bs
            if cap is not None and taken + bs > cap:
                declined[k] = (f"no capacity: the tier holds {taken} B of its {cap} B (vLLM's fs tier "
                               "never evicts)")
                self._stats["capacity_rejections"] += 1
            elif free - (len(new) + 1) * bs < self.min_free_bytes:
                declined[k] = (f"no room: free space at {self.root} is below min_free_bytes="
                               f"{self.min_free_bytes} (vLLM's fs tier never evicts)")
                self._stats["no_room_failures"] += 1
                self._stats["store_failures"] += 1
            else:
                new.add(k)
                out_k.append(k)
                out_s.append(slot)
        return out_k, out_s, declined, len(new) * bs

    @staticmethod
    def _declined_result(job_id: int, declined: dict[bytes, str]) -> JobResult:
        return JobResult(job_id=job_id, success=False, successful_keys=[], transfer_time=0.0,
                         transfer_bytes=0, is_load=False, failed_keys=dict(declined), submits=0)

    def get_finished_jobs(self) -> list[JobResult]:
        """Jobs finished since the last call, each once, as :class:`pykvtier.tier.JobResult`
        (``successful_keys`` and ``failed_keys`` in the replay's keys)."""
        out, self._ready = self._ready, []
        if self._fs is None:
            return out
        for r in self._fs.get_finished_jobs():
            j = self._jobs.pop(r.job_id, None)
            if j is None:  # not ours (cannot happen: every job goes through _submit)
                continue
            out.append(self._result(r, j))
        return out

    def _result(self, r: Any, j: _Job) -> JobResult:
        st = self._stats
        bs = self.block_size
        inflight = self._loading if j.is_load else self._storing
        for k in j.keys:
            n = inflight.get(k, 0) - 1
            if n > 0:
                inflight[k] = n
            else:
                inflight.pop(k, None)
        if r.success:
            ok = list(j.keys)
        elif j.is_load:  # a batched load stops at the first bad block: the ones before it loaded
            ok = j.keys[:len(list(r.successful_keys or ()))]
        else:  # a failed store says nothing of its blocks: those whose file is there are stored
            ok = [k for k, ok_ in zip(j.keys, j.okeys)
                  if os.path.exists(self._fs.file_mapper.get_file_name(ok_))]
        ok_set = set(ok)
        self._reserved -= j.reserved
        failed: dict[bytes, str] = {}
        for k, okey in zip(j.keys, j.okeys):
            if k in ok_set:
                continue
            gone = not os.path.exists(self._fs.file_mapper.get_file_name(okey))
            if j.is_load:
                failed[k] = ("ENOENT: no block file (vLLM fs tier)" if gone else
                             "vLLM fs tier: load failed (short read or I/O error; vLLM logs it)")
            else:
                failed[k] = "vLLM fs tier: store failed (vLLM logs the error)"
        if j.is_load:
            st["blocks_loaded"] += len(ok)
            st["bytes_loaded"] += len(ok) * bs
            st["load_failures"] += len(failed)
            moved = len(ok) * bs
        else:
            new = [k for k in ok if k not in self._present]
            self._present.update(new)
            st["blocks_stored"] += len(new)
            st["bytes_stored"] += len(new) * bs
            st["stores_skipped_present"] += len(ok) - len(new)
            st["store_failures"] += len(failed)
            moved = len(new) * bs
            failed.update(j.declined)  # (counted when declined)
        return JobResult(job_id=r.job_id, success=not failed,
                         successful_keys=None if not failed else ok,
                         transfer_time=r.transfer_time, transfer_bytes=moved, is_load=j.is_load,
                         failed_keys=failed, submits=1)

    def has_pending_work(self) -> bool:
        """Jobs in flight or results not yet collected."""
        return bool(self._jobs or self._ready)

    def wait(self, timeout_s: float | None = None) -> list[JobResult]:
        """Blocks until a job finished, nothing is in flight, or ``timeout_s``; returns the
        finished jobs as :meth:`get_finished_jobs`."""
        out = self.get_finished_jobs()
        if out or self._fs is None:
            return out
        if self._jobs:
            pool = getattr(self._fs, "_pool", None)
            cond = getattr(pool, "_condition", None)
            if cond is None:  # another vLLM: a short nap
                time.sleep(min(0.001, timeout_s if timeout_s is not None else 0.001))
            else:  # vLLM 0.33's DualQueueThreadPool notifies its condition at each job's end
                with cond:
                    cond.wait_for(lambda: pool._finished_q or pool._inflight_jobs == 0, timeout_s)
        return self.get_finished_jobs()

    def drain(self) -> None:
        """Blocks until every submitted job finished (the fs tier's ``drain_jobs``); results
        stay for :meth:`get_finished_jobs`."""
        if self._fs is not None:
            self._fs.drain_jobs()

    def shutdown(self) -> None:
        """Lets every submitted job finish (results stay for :meth:`get_finished_jobs`), ends
        the current request, shuts the fs tier down (its I/O and lookup threads) and lets go
        of the arena. Idempotent."""
        if self._closed:
            return
        self._closed = True
        fs = self._fs
        if fs is None:
            return
        try:
            fs.drain_jobs()  # vLLM's shutdown drops queued jobs: they finish first
            self._ready = self.get_finished_jobs()
            if self._ctx is not None:
                fs.on_request_finished(self._ctx)
                self._ctx = None
        finally:
            self._fs = None
            fs.shutdown()
            fs._primary_kv_view = None  # noqa: SLF001 - the arena's owner may unmap it now
            if self._view is not None:
                try:
                    self._view.release()
                except BufferError:  # a slice still exported somewhere: the GC lets go of it
                    pass
                self._view = None

    def __enter__(self) -> VllmFsTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ figures

    @property
    def used_bytes(self) -> int:
        """Bytes of the block files this tier stored (block size each: vLLM's files hold the
        payload alone). Nothing is ever evicted, so it only grows."""
        return len(self._present) * self.block_size

    @property
    def num_blocks(self) -> int:
        """Blocks stored through this tier (all still there: it never evicts)."""
        return len(self._present)

    def stats(self) -> dict[str, int]:
        """The replay's counters where the fs tier has them (``blocks_loaded``,
        ``bytes_loaded``, ``blocks_stored``, ``bytes_stored``, ``load_failures``,
        ``store_failures``, lookups and their answers, jobs submitted), ``used_bytes``,
        ``blocks_present``, ``direct``, the probe steps of lookups (``probe_steps``,
        ``probe_wait_us``), the stores' blocks declined (``capacity_rejections``; and
        ``no_room_failures``, counted in ``store_failures`` too), ``min_free_bytes`` and, with a
        capacity, ``capacity_bytes`` and ``bytes_over_capacity``. No ``evictions`` nor
        ``verify_failures``: it has neither."""
        s = dict(self._stats)
        s["probe_wait_us"] = int(self._probe_wait_s * 1e6)
        s["used_bytes"] = self.used_bytes
        s["blocks_present"] = len(self._present)
        s["direct"] = int(self.direct)
        s["min_free_bytes"] = self.min_free_bytes
        s["io_threads"] = int(self._tier_config["n_read_threads"]) + int(
            self._tier_config["n_write_threads"])
        if self.capacity_bytes is not None:
            s["capacity_bytes"] = self.capacity_bytes
            s["bytes_over_capacity"] = max(0, self.used_bytes - self.capacity_bytes)
        return s


def vllm_fs_tier(root: str, block_size: int, capacity: int | None, engine: str = "auto",
                 recycle: bool = True, **options: Any) -> VllmFsTier:
    """A :class:`VllmFsTier` at ``root``: the replay's tier factory signature (that of
    ``pykvtier.replay._default_tier_factory``). ``engine``: pykvtier's I/O engine, which vLLM's
    fs tier does not use: only ``"auto"``. ``recycle``: ignored (it never evicts, so there
    are no evicted files to take over). ``options``: VllmFsTier's keywords. TierUnavailableError
    (a ValueError) where vLLM does not import; ValueError for bad settings."""
    if engine != "auto":
        raise ValueError(f"engine {engine!r} is pykvtier's I/O engine; vLLM's fs tier does its own "
                         "I/O (a thread pool of os.open/os.readv/os.write, or vllm.fs_io_C): "
                         "leave --engine at auto with --tier vllm-fs")
    return VllmFsTier(root, block_size, capacity, **options)


def make_vllm_fs_tier_factory(**options: Any) -> Callable[..., VllmFsTier]:
    """``factory(root, block_size, capacity, engine, recycle=True)`` making a
    :class:`VllmFsTier` with ``options`` (``enforce_capacity``, ``min_free_bytes``,
    ``n_read_threads``, ``n_write_threads``, ``model_name``), for
    ``run_replay(..., tier_factory=...)``; picklable (``--nodes`` spawns processes).
    TierUnavailableError now, naming the ``pip install``, where vLLM's fs tier does not
    import; ValueError for an unknown option."""
    _import_vllm()
    bad = set(options) - {"enforce_capacity", "min_free_bytes", "n_read_threads", "n_write_threads",
                          "model_name"}
    if bad:
        raise ValueError(f"unknown vllm-fs tier option(s): {', '.join(sorted(bad))}")
    return functools.partial(vllm_fs_tier, **options)


def vllm_fs_tier_factory(config: Any = None, **options: Any) -> Callable[..., VllmFsTier]:
    """:func:`make_vllm_fs_tier_factory` for a replay's ``config`` (a ReplayConfig: nothing
    of it changes the fs tier; ``recycle`` is ignored, ``engine`` checked when the tier is
    made)."""
    return make_vllm_fs_tier_factory(**options)

