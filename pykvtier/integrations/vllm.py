"""pykvtier as an out-of-tree secondary tier of vLLM's tiered KV offloading.

vLLM (>= 0.32; 0.33.0 is the reference) loads it from config alone, no patch to vLLM::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 34359738368,
        "secondary_tiers": [{"type": "PyKVTier", "module_path": "pykvtier.integrations.vllm",
                             "root_dir": ["/mnt/nvme0/kv", "/mnt/nvme1/kv"],
                             "capacity_bytes": 1000000000000}]}}'

vLLM's ``SecondaryTierFactory`` imports this module, takes the class named by ``type`` and calls
it with ``offloading_spec``, ``primary_kv_view``, ``tier_type``, ``backpressure_detector`` and
every other key of the tier's config as a keyword argument (see :class:`PyKVTier` for them).

How it maps onto pykvtier:

- One :class:`~pykvtier.tier.DiskTier` per root directory (one per NVMe drive); a key's shard
  is chosen from its BLAKE2b digest (the digest that also names its block file), so keep the
  list of roots, and its order, fixed. ``capacity_bytes`` is the total, split evenly.
- Inside each root the blocks live in a namespace directory named like vLLM's own fs tier
  does (model, dtype, block layout, ... hashed by vLLM's ``FileMapper``), under
  ``ROOT/pykvtier/``: two models or layouts sharing a root never see each other's blocks.
- ``primary_kv_view`` (vLLM's CPU tier, shape ``(num_chunks, stride)``) is the arena of every
  DiskTier: registered once per engine as io_uring fixed buffers; ``TransferJob.chunk_ids``
  are its rows; the C++ engine reads and writes the rows by address (no Python copy).
- ``lookup`` answers HIT, MISS or RETRY only: DiskTier's HIT_PENDING (a load of the block is
  already in flight) is a HIT here, since vLLM's manager makes HIT_PENDING of a tier's HIT
  itself and treats anything else as a miss.
- ``bypass: auto`` (off by default): a request's hits answer MISS from the block where loading
  them stops paying off (:func:`pykvtier.costmodel.loadable_prefix`; docs/design.md "Load or
  recompute"). vLLM asks a tier one key at a time (per KV-cache group: in prompt order, or
  from the end for a sliding-window group), with the request's ``ReqContext`` (the same object
  for all its lookups, every step) and each key's end-token position in it
  (``get_offload_key_position``), and starts a promotion on every HIT, so the tier cannot see
  which hits follow when it answers the first. If a position's keys (one per group) would load
  in time for the prompt's first block, every block is worth loading (recompute grows along the
  prompt) and the adapter answers HIT at once; else it answers RETRY for the request's hits
  that step (vLLM keeps scanning on RETRY and starts no promotion), counting each key, and
  decides on the request's next lookup with the count: HIT up to position k, MISS past it
  (kept in the ``ReqContext``'s state for the request's later steps; made again after a
  preemption).

Importing this module imports vLLM; importing ``pykvtier`` never does.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from .. import __version__, _native
from ..config import DiskTierConfig, check_verify
from ..costmodel import BandwidthEstimate, PrefillModel, loadable_prefix
from ..models import get_preset
from ..layout import RootLockedError, check_file_mode, key_digest, make_namespace_dir
from ..tier import DiskTier
from ..tier import JobResult as TierJobResult
from ..tier import LookupResult as TierLookupResult
from ..tier import TransferJob as TierTransferJob
from .bypass import check_bypass

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

__all__ = ["PyKVTier", "PyKVTierConfig", "PyKVTierInfo", "PyKVTierMetrics"]

logger = logging.getLogger("pykvtier")

# DiskTier's four answers -> the three vLLM takes from a tier.
_LOOKUP = {
    TierLookupResult.HIT: LookupResult.HIT,
    TierLookupResult.HIT_PENDING: LookupResult.HIT,
    TierLookupResult.RETRY: LookupResult.RETRY,
    TierLookupResult.MISS: LookupResult.MISS,
}
#: DiskTier.lookup_code's answers (0 HIT, 1 MISS, 2 RETRY, 3 HIT_PENDING) as vLLM's.
_LOOKUP_CODE = (LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY, LookupResult.HIT)

class PyKVTierMetrics:
    """Prometheus metric names of the tier's own figures; counters and gauges are labelled by
    ``root`` (the root_dir entry, one series per drive)."""

    READ_BYTES = "pykvtier:read_bytes"
    WRITE_BYTES = "pykvtier:write_bytes"
    READ_TIME = "pykvtier:read_time_seconds"
    WRITE_TIME = "pykvtier:write_time_seconds"
    BLOCKS_READ = "pykvtier:blocks_read"
    BLOCKS_WRITTEN = "pykvtier:blocks_written"
    LOAD_FAILURES = "pykvtier:load_failures"
    LOADS_REFUSED = "pykvtier:loads_refused"
    STORE_FAILURES = "pykvtier:store_failures"
    VERIFY_FAILURES = "pykvtier:verify_failures"
    EVICTIONS = "pykvtier:evictions"
    EVICTION_FAILURES = "pykvtier:eviction_failures"
    FILES_RECYCLED = "pykvtier:files_recycled"
    RECYCLE_FAILURES = "pykvtier:recycle_failures"
    CAPACITY_REJECTIONS = "pykvtier:capacity_rejections"
    DIRECT_FALLBACKS = "pykvtier:direct_fallbacks"
    ENGINE_FALLBACKS = "pykvtier:engine_fallbacks"
    LOOKUPS = "pykvtier:lookups"
    LOOKUP_HITS = "pykvtier:lookup_hits"
    PROBES = "pykvtier:probes"
    SUBMITS = "pykvtier:io_uring_submits"
    USED_BYTES = "pykvtier:used_bytes"
    BLOCKS_PRESENT = "pykvtier:blocks_present"
    LOAD_JOB_TIME = "pykvtier:load_job_seconds"
    STORE_JOB_TIME = "pykvtier:store_job_seconds"
    BYPASSED_HITS = "pykvtier:bypassed_hits"
    BYPASSED_REQUESTS = "pykvtier:bypassed_requests"
    BYPASS_DEFERRALS = "pykvtier:bypass_deferrals"


_LABELS = ("root",)
# counter metric -> (DiskTier.stats() key, documentation)
_COUNTERS = {
    PyKVTierMetrics.READ_BYTES: ("bytes_loaded", "Payload bytes read from the disk tier."),
    PyKVTierMetrics.WRITE_BYTES: ("bytes_stored", "Payload bytes written to the disk tier."),
    PyKVTierMetrics.BLOCKS_READ: ("blocks_loaded", "Blocks read (and verified) from the disk tier."),
    PyKVTierMetrics.BLOCKS_WRITTEN: ("blocks_stored", "Blocks written to the disk tier."),
    PyKVTierMetrics.LOAD_FAILURES: (
        "load_failures", "Block loads that failed (missing, unreadable or corrupt file)."),
    PyKVTierMetrics.LOADS_REFUSED: (
        "loads_refused", "Block loads refused without I/O (not a HIT when submitted: evicted, "
        "being written, or failed before)."),
    PyKVTierMetrics.STORE_FAILURES: ("store_failures", "Block stores that failed."),
    PyKVTierMetrics.VERIFY_FAILURES: (
        "verify_failures", "Blocks that failed verification on load (and were quarantined)."),
    PyKVTierMetrics.EVICTIONS: ("evictions", "Blocks evicted to stay within capacity_bytes."),
    PyKVTierMetrics.EVICTION_FAILURES: ("eviction_failures", "Evictions whose unlink failed."),
    PyKVTierMetrics.FILES_RECYCLED: (
        "files_recycled", "Evicted block files taken over by stores (no unlink, no create)."),
    PyKVTierMetrics.RECYCLE_FAILURES: (
        "recycle_failures", "Evicted block files that could be neither reused nor removed."),
    PyKVTierMetrics.CAPACITY_REJECTIONS: (
        "capacity_rejections", "Blocks not stored: every block was in use."),
    PyKVTierMetrics.DIRECT_FALLBACKS: (
        "direct_fallbacks", "Roots where O_DIRECT was refused and buffered I/O is used."),
    PyKVTierMetrics.LOOKUPS: ("lookups", "Phase-1 lookups answered."),
    PyKVTierMetrics.LOOKUP_HITS: ("hits", "Phase-1 lookups answered HIT."),
    PyKVTierMetrics.PROBES: ("probes", "Asynchronous existence probes (statx) submitted."),
    PyKVTierMetrics.SUBMITS: ("submits", "io_uring_submit calls that carried block I/O."),
}
# bypass counters (the adapter's, not a root's) -> (PyKVTier.stats() key, documentation)
_BYPASS_COUNTERS = {
    PyKVTierMetrics.BYPASSED_HITS: (
        "bypassed_hits", "Blocks the tier held but answered MISS (bypass: auto): loading them "
        "would have been slower than recomputing them."),
    PyKVTierMetrics.BYPASSED_REQUESTS: (
        "bypassed_requests", "Requests with blocks answered MISS by bypass: auto."),
    PyKVTierMetrics.BYPASS_DEFERRALS: (
        "bypass_deferrals", "Requests answered RETRY for one step to count their hits "
        "(bypass: auto, the first hit not worth loading alone)."),
}


@dataclass(frozen=True)
class PyKVTierInfo:
    """Static facts of one PyKVTier, published on vllm:kv_offload_config_info (vLLM >= 0.33;
    shaped as vLLM's ``ConfigInfo``: one label per field, None written "None")."""

    pykvtier_version: str
    # Data path: "uring" (io_uring) or "posix" (preadv/pwritev pool, where io_uring is refused).
    pykvtier_engine: str
    # O_DIRECT on every root.
    pykvtier_direct: bool
    pykvtier_roots: int
    pykvtier_root_dir: str
    pykvtier_capacity_bytes: int | None
    pykvtier_block_bytes: int
    pykvtier_shared: bool
    pykvtier_queue_depth: int

    @classmethod
    def config_info_keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def as_config_info(self) -> dict[str, str | int | float | bool]:
        return {f.name: "None" if (v := getattr(self, f.name)) is None else v
                for f in fields(self)}


@dataclass
class _Job:
    """A vLLM job on its way through one or more DiskTiers (one part per shard)."""

    job_id: int
    is_load: bool
    parts: dict[int, list[bytes]]  # shard -> its keys (only kept when there are several)
    claimed: bytes = b""  # its chunk rows (int64) in PyKVTier._claims (several roots only)
    refused: int = 0  # later jobs with its id, refused: reported failed right after it
    success: bool = True
    ok_keys: list[bytes] = field(default_factory=list)
    transfer_time: float = 0.0
    transfer_bytes: int = 0


def _failed(job_id: int) -> JobResult:
    """The result of a job refused before any I/O."""
    return JobResult(job_id, False, transfer_time=0.0, transfer_bytes=0)


def _check_flag(key: str, v: Any) -> bool:
    """A boolean config key: true/false only (a string such as "false" would read as true)."""
    if not isinstance(v, bool):
        raise ValueError(f"PyKVTier: {key} must be true or false, got {v!r}")
    return v


def _check_number(key: str, v: Any, kind: type) -> Any:
    """A numeric config key (an int, or a float for kind=float), never a bool or a string."""
    ok = (int,) if kind is int else (int, float)
    if isinstance(v, bool) or not isinstance(v, ok) or v <= 0:
        what = "positive integer" if kind is int else "positive number"
        raise ValueError(f"PyKVTier: {key} must be a {what}, got {v!r}")
    return kind(v)


def _check_mode(v: Any) -> int:
    """``mode``: file permission bits, an int (0o640 in Python, 416 in JSON) or a string of
    octal digits ("640", "0o640", "0640"); see DiskTier(mode=) (layout.check_file_mode)."""
    try:
        return check_file_mode(v, "mode")
    except (TypeError, ValueError) as exc:
        raise ValueError(f"PyKVTier: {exc}") from None


def _key(default: Any, doc: str, default_text: str | None = None) -> Any:
    meta = {"doc": doc} if default_text is None else {"doc": doc, "default_text": default_text}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class PyKVTierConfig:
    """The tier's config keys (vLLM's ``secondary_tiers`` entry, less the factory's own), each
    checked here: ValueError naming the key. Fields hold the normalized values (``root_dir``: a
    list of paths; ``direct``: None for "auto"; ``mode``: an int; ``locality``: vLLM's
    ``Locality`` or None). :meth:`from_options` refuses unknown keys, naming them."""

    root_dir: Any = field(default=None, metadata={
        "doc": "a directory, or a list (one per NVMe drive); blocks are sharded across them by "
               "key digest, so keep the list and its order fixed", "default_text": "required"})
    capacity_bytes: int | None = _key(
        None, "total block-file bytes, split evenly over the roots; least recently used blocks "
              "are evicted (never one being read); `touch()` from vLLM counts as a use")
    locality: Any = _key(
        None, "`LOCAL` or `REMOTE`, as vLLM's `Locality` (events, per-request tier filters)")
    enable_kv_events: bool = _key(
        False, "KV events for this tier: stored, and removed when a block is evicted or its load "
               "fails (needs vLLM's KV cache events on)")
    shared: bool = _key(
        False, "the roots are shared with other vLLM instances: unknown keys are probed (batched "
               "`statx` through io_uring, submitted from `on_schedule_end`) and answer RETRY for "
               "one step")
    engine: str = _key("auto", "`uring`, `posix`, or `auto` (io_uring where the kernel allows "
                               "it, else posix, logged)")
    queue_depth: int = _key(64, "block requests in flight per root")
    max_inflight_bytes: int = _key(256 << 20, "payload bytes in flight per root", "256 MiB")
    direct: Any = _key(
        "auto", "`true`: O_DIRECT, refused at start-up where the file system or block size "
                "cannot take it; `false`: buffered; `\"auto\"` or `null`: where the file system "
                "takes it (a fallback is logged and counted)", '`"auto"`')
    fsync: bool = _key(
        False, "durable stores: each block file fdatasync'ed and each directory it is renamed "
               "into fsync'ed (once per job) before the job is reported; turns recycling off "
               "(see \"What a crash or power loss can do\")")
    mode: Any = _key(
        0o600, "permission bits of the files the tier creates (blocks, `config.json`); its "
               "directories get the matching x bits (0o640 → 0o750). JSON has no octal: write "
               "`\"640\"` or `416`. Within 0o666, owner read and write set", "`0o600`")
    min_free_bytes: int | None = _key(
        None, "free space kept on each root's file system (each root's own, not split); a store "
              "that would go below it evicts least recently used blocks first; `null`: 5 %",
        "5 % of the file system")
    probe_ttl_s: float = _key(1.0, "how long a probe's \"not found\" stays a MISS (`shared`)")
    recycle: bool = _key(
        True, "a store that needs room takes over the evicted block's file (renamed, "
              "overwritten, renamed into place) instead of unlinking it and creating one: no "
              "inode or extent allocation per store; never on `shared` roots")
    verify: str = _key(
        "payload", "what a load checks: `payload` (header, key digest, length and the payload's "
                   "XXH3-64) or `header` (all but the payload checksum, which stores then skip "
                   "too: for file systems that checksum data, e.g. btrfs, ZFS)")
    bypass: str = _key(
        "off", "`auto`: a request loads only the prefix of its hits that loads no slower than "
               "the GPU recomputes it; its other hits answer MISS, counted "
               "(`pykvtier:bypassed_hits`; see \"Load or recompute\"); `off`: every hit is a HIT")
    bypass_model: str | None = _key(
        None, "model preset of the recompute estimate: `llama-3-8b`, `qwen2.5-7b`, "
              "`llama-3-70b`; required with `bypass: auto`")
    bypass_gpu: str = _key(
        "h100", "GPU preset of the recompute estimate (`h100`, `h200`, `a100`, `l40s`: peak dense "
                "bf16 FLOP/s), times vLLM's tensor-parallel size")
    bypass_mfu: float = _key(0.5, "model FLOPs utilization of the recompute estimate, in (0, 1]")
    bypass_bytes_per_s: float | None = _key(
        None, "load bandwidth (bytes/s) assumed until a load has been measured (then a moving "
              "estimate of the finished loads, half-life 5 s); `null`: every hit loads until then")

    @classmethod
    def from_options(cls, tier_type: str, options: dict[str, Any]) -> PyKVTierConfig:
        """The config of the keyword arguments vLLM's factory passed; ValueError naming any
        unknown key, a missing ``root_dir``, or a bad value."""
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise ValueError(
                f"secondary tier {tier_type!r} (PyKVTier): unknown config key"
                f"{'s' if len(unknown) > 1 else ''} {', '.join(repr(k) for k in unknown)}; "
                f"accepted keys: {', '.join(names)}")
        if "root_dir" not in options:
            raise ValueError(f"secondary tier {tier_type!r} (PyKVTier): 'root_dir' is required "
                             "(a directory, or a list of directories, one per drive)")
        return cls(**options)

    def __post_init__(self) -> None:
        set_ = object.__setattr__.__get__(self)  # (frozen: the normalized values go in once)
        set_("root_dir", _roots(self.root_dir))
        if self.capacity_bytes is not None:
            _check_number("capacity_bytes", self.capacity_bytes, int)
        for key in ("queue_depth", "max_inflight_bytes"):
            _check_number(key, getattr(self, key), int)
        set_("probe_ttl_s", _check_number("probe_ttl_s", self.probe_ttl_s, float))
        for key in ("enable_kv_events", "fsync", "shared", "recycle"):
            _check_flag(key, getattr(self, key))
        direct = None if self.direct == "auto" else self.direct
        if direct is not None and not isinstance(direct, bool):
            raise ValueError(f"PyKVTier: direct must be true, false, null or \"auto\", got {direct!r}")
        set_("direct", direct)
        set_("mode", _check_mode(self.mode))
        v = self.min_free_bytes
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ValueError(f"PyKVTier: min_free_bytes must be null or an integer >= 0 (bytes), "
                             f"got {v!r}")
        if self.locality is not None:
            try:
                set_("locality", Locality(self.locality))
            except ValueError:
                raise ValueError(f"PyKVTier: locality must be one of "
                                 f"{[loc.value for loc in Locality]}, got {self.locality!r}") from None
        try:
            check_verify(self.verify)
        except ValueError as exc:
            raise ValueError(f"PyKVTier: {exc}") from None
        check_bypass(self)

    def _bad(self, what: str) -> ValueError:
        """The ValueError of a bad option (for :func:`~pykvtier.integrations.bypass.check_bypass`)."""
        return ValueError(f"PyKVTier: {what}")

    def disk_tier_options(self) -> dict[str, Any]:
        """The DiskTier keywords every root's tier gets (capacity split over the roots)."""
        return dict(
            capacity_bytes=None if self.capacity_bytes is None
            else self.capacity_bytes // len(self.root_dir),
            shared=self.shared, direct=self.direct, queue_depth=self.queue_depth,
            max_inflight_bytes=self.max_inflight_bytes, probe_ttl_s=self.probe_ttl_s,
            fsync=self.fsync, engine=self.engine, recycle=self.recycle, mode=self.mode,
            min_free_bytes=self.min_free_bytes, verify=self.verify)


def _locked(root: str, ns: str, shared: bool, exc: RootLockedError) -> ValueError:
    """The start-up error for a namespace directory locked by another tier, in the config's
    terms: what holds it, and what to do."""
    me = os.getpid()
    who = ", ".join(f"{p} (this process)" if p == me else str(p) for p in exc.holders) or \
        "unknown"
    if shared:
        what = ("a tier with shared: false holds it (exclusively). Set shared: true on every "
                "vLLM instance that shares this root_dir on purpose")
    else:
        what = ("another tier holds it (an instance of the same model and layout). Give each "
                "vLLM instance its own root_dir entry, or set shared: true on every instance "
                "if they share it on purpose")
    return ValueError(f"PyKVTier: root {root!r} is in use by pid {who}: its directory for this "
                      f"model ({ns}) is locked ({exc.root}/.pykvtier.lock) and {what}")


def _roots(root_dir: Any) -> list[str]:
    if isinstance(root_dir, (str, os.PathLike)):
        given = [root_dir]
    elif isinstance(root_dir, (list, tuple)) and root_dir:
        given = list(root_dir)
    else:
        raise ValueError(
            f"PyKVTier: root_dir must be a path or a non-empty list of paths (one per drive), "
            f"got {root_dir!r}")
    roots = []
    for r in given:
        p = os.fspath(r) if isinstance(r, (str, os.PathLike)) else r
        if not isinstance(p, str):
            raise TypeError(f"PyKVTier: root_dir entries must be paths (str or os.PathLike "
                            f"giving a str), got {type(r).__name__} {r!r}")
        if not p:
            raise ValueError(f"PyKVTier: root_dir {root_dir!r} names an empty path (it would "
                             "mean the current directory)")
        if "\0" in p:
            raise ValueError(f"PyKVTier: root_dir entry {p!r} contains a NUL byte (no path can)")
        roots.append(p)
    seen = set()
    for r in roots:
        a = os.path.realpath(r)
        if a in seen:
            raise ValueError(f"PyKVTier: root_dir lists {r!r} twice")
        seen.add(a)
    return roots


@dataclass
class _BypassState:
    """A request's bypass decision, kept in its ``ReqContext`` (:class:`_BypassStates`):
    ``cutoff``, the end-token position past which its hits answer MISS (``math.inf``: none;
    None: not decided yet); while undecided, ``counted``: the hits answered RETRY in step
    ``step``, each key (one per KV-cache group at a position) with its end position."""

    cutoff: float | None = None
    counted: dict[bytes, int] | None = None
    step: int = -1

    def reset(self) -> None:
        self.cutoff = None
        self.counted = None
        self.step = -1


class _BypassStates(dict):
    """A request's :class:`_BypassState` per PyKVTier (``id`` of the tier): the ReqContext's
    state is keyed by type, and a manager may hold several PyKVTier tiers."""


class PyKVTier(SecondaryTierManager):
    """vLLM secondary tier on local NVMe (or any POSIX file system), through pykvtier.

    Config keys (keyword arguments): the fields of :class:`PyKVTierConfig`, each with its
    default and meaning (the README's table is generated from them); any other key is an error
    naming it. ``root_dir`` is required: a directory, or a list of directories, one per drive;
    keys are sharded across them by digest (keep the list fixed). ``capacity_bytes`` is the
    total, split evenly across roots; ``min_free_bytes`` is each root's own.

    Each root's directory for this model is locked while the tier runs (exclusively unless
    ``shared``): a second instance on it fails at start-up with a ValueError naming the root
    and the holder's pid.

    Jobs: every submitted job is reported once by :meth:`get_finished_jobs`, also after
    :meth:`shutdown` (which finishes the jobs in flight). A job the tier refuses (logged) is
    reported failed, having touched no chunk row and no block:

    - With several roots, the chunk rows of the jobs in flight are claimed across the shards,
      as one root's DiskTier claims its slots: a load into a row another load fills or a store
      in flight reads, and a store from a row a load fills, are refused (the two would race in
      the row: wrong bytes reported loaded, or intact blocks quarantined). The rows are claimed
      at submit and released when the job is reported.
    - A job whose id is still held (submitted, its result not yet returned by
      get_finished_jobs) is refused before any root sees it. vLLM's manager never does this
      (its ids come from a counter), and it keeps one entry per id, popped by the first result
      with that id (a later result with it fails its assertion). So the refusal never comes
      first: the first job's own result is reported as if there had been no reuse, and the
      refused job's failure right after it, in the same call. A caller that matches results
      to its jobs by id, in submission order, gets the first job's outcome intact (a failure
      reported first would be taken for the first job's, failing keys it moved and dropping
      its real result).
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **options: Any,
    ) -> None:
        cfg = PyKVTierConfig.from_options(tier_type, options)
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.config = cfg
        if cfg.locality is not None:
            self.locality = cfg.locality
        view = primary_kv_view
        if view.ndim != 2 or not view.c_contiguous:
            raise ValueError(f"PyKVTier: primary_kv_view must be a C-contiguous (num_chunks, "
                             f"stride) view, got shape {view.shape}")
        self.num_chunks = view.shape[0]
        self._events: list[OffloadingEvent] | None = None
        if cfg.enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self._events = []
            else:
                logger.warning("pykvtier: enable_kv_events is set on secondary tier %r but KV "
                               "cache events are off globally; the tier emits none", tier_type)
        # digest -> key of blocks announced as stored and not yet as removed
        self._announced: dict[bytes, bytes] = {}
        self.roots = cfg.root_dir
        self._open_roots(cfg, offloading_spec, view)
        self._single = self._tiers[0] if len(self._tiers) == 1 else None
        self._single_code = self._single.lookup_code if self._single is not None else None
        self.engine_name = self._tiers[0].engine_name
        self.direct = all(t.direct for t in self._tiers)
        self._jobs: dict[int, _Job] = {}  # submitted to a DiskTier, not reported yet
        self._ready: list[JobResult] = []
        self._ready_ids: set[int] = set()  # the job ids in _ready
        # Several roots: the chunk rows jobs in flight use, over every shard (one DiskTier
        # claims its own slots; the shards do not see each other's).
        self._claims = (_native.SlotClaims(self.num_chunks) if self._single is None else None)
        # figures for get_stats(): last DiskTier.stats() per root, times and job durations since
        self._last_stats: list[dict[str, int]] = [{} for _ in self._tiers]
        self._times = [[0.0, 0.0] for _ in self._tiers]  # per root: [read s, write s]
        self._job_times: list[tuple[bool, float]] = []  # (is_load, transfer seconds)
        self._fallbacks_reported = False
        self._closed = False
        self._init_bypass(cfg, offloading_spec)
        block = self.block_size_bytes
        self._info = PyKVTierInfo(
            pykvtier_version=__version__, pykvtier_engine=self.engine_name,
            pykvtier_direct=self.direct, pykvtier_roots=len(self.roots),
            pykvtier_root_dir=",".join(self.roots), pykvtier_capacity_bytes=cfg.capacity_bytes,
            pykvtier_block_bytes=block, pykvtier_shared=cfg.shared,
            pykvtier_queue_depth=cfg.queue_depth)
        logger.info("pykvtier: vLLM tier %r on %s: %d-byte blocks, engine %s, O_DIRECT %s, "
                    "capacity %s", tier_type, self.namespace_dirs, block, self.engine_name,
                    self.direct, cfg.capacity_bytes)

    def _init_bypass(self, cfg: PyKVTierConfig, spec: OffloadingSpec) -> None:
        """bypass: auto's cost model: the recompute estimate over vLLM's tensor-parallel GPUs,
        a key's tokens (a chunk: GPU block tokens x blocks_per_chunk, of the first KV group),
        the bandwidth estimate; counters."""
        self.bypassed_hits = 0
        self.bypassed_requests = 0
        self.bypass_deferrals = 0
        self._bypass_reported = {k: 0 for k, _ in _BYPASS_COUNTERS.values()}
        self._step = 0  # scheduler steps ended (on_schedule_end)
        self._step_hits = 0  # HITs answered this step: promotions vLLM submits at its end
        # req_ids preempted (ScheduleEndContext) whose decision is dropped at their next lookup
        self._bypass_preempted: set[str] = set()
        self.prefill: PrefillModel | None = None
        self.bandwidth: BandwidthEstimate | None = None
        if cfg.bypass != "auto":
            return
        tp = getattr(getattr(getattr(spec, "config", None), "parallel", None), "tp_size", 1) or 1
        self.prefill = PrefillModel(get_preset(cfg.bypass_model), cfg.bypass_gpu, cfg.bypass_mfu,
                                    gpus=int(tp))
        self.tokens_per_key = int(spec.tokens_per_block[0]) * int(spec.blocks_per_chunk)
        # KV-cache groups: vLLM's keys at one position, one per group (a row each)
        self.kv_groups = len(spec.tokens_per_block)
        # the cheapest key to recompute: the prompt's first (recompute grows along the prompt)
        self._first_key_s = self.prefill.block_seconds(0, self.tokens_per_key)
        self.bandwidth = BandwidthEstimate(cfg.bypass_bytes_per_s)

    def _open_roots(self, cfg: PyKVTierConfig, spec: OffloadingSpec, view: memoryview) -> None:
        """One DiskTier per root, in its namespace directory, the primary view as its arena;
        every tier opened is shut down again when one fails (ValueError naming the root)."""
        opts = dict(cfg.disk_tier_options(), track_removals=self._events is not None)
        block = self.block_size_bytes  # the row stride, set by the base class
        self.namespace_dirs: list[str] = []
        self._tiers: list[DiskTier] = []
        split = (f" (capacity_bytes={cfg.capacity_bytes} split over {len(cfg.root_dir)} roots)"
                 if cfg.capacity_bytes is not None and len(cfg.root_dir) > 1 else "")
        try:  # every DiskTier option checked before any root is touched
            DiskTierConfig(cfg.root_dir[0], block, **opts)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"PyKVTier{split}: {exc}") from exc
        try:
            for root in cfg.root_dir:
                try:
                    ns = self._namespace_dir(root, spec, cfg.mode)
                except OSError as exc:
                    raise ValueError(f"PyKVTier: root {root!r}: cannot create the tier's directory "
                                     f"({exc.filename}: {exc.strerror})") from exc
                try:
                    tier = DiskTier(ns, block, **opts)
                except RootLockedError as exc:
                    err = _locked(root, ns, cfg.shared, exc)
                    logger.error("%s", err)
                    raise err from exc
                except ValueError as exc:
                    raise ValueError(f"PyKVTier: root {root!r}{split}: {exc}") from exc
                self._tiers.append(tier)
                self.namespace_dirs.append(ns)
                # Registers the primary view as the engine's fixed buffers (pins it, once).
                tier.set_arena(view, slot_bytes=block)
        except BaseException:
            for t in self._tiers:
                t.shutdown()
            raise

    @staticmethod
    def _namespace_dir(root: str, spec: OffloadingSpec, mode: int = 0o600) -> str:
        """ROOT/pykvtier/<model>_<hash of the run config>_r<rank>, named by vLLM's FileMapper
        (as vLLM's fs tier names its own), with the run config written beside the blocks.
        Directories made here get the dir mode of ``mode``, config.json ``mode`` itself."""
        mapper = FileMapper.from_offloading_spec(
            root_dir=os.path.join(root, "pykvtier"), offloading_spec=spec,
            blocks_per_file=spec.blocks_per_chunk, parallel_agnostic=True)
        ns = f"{mapper.base_path}_r{mapper.rank}"
        make_namespace_dir(os.path.join(root, "pykvtier"), ns, mode,
                           {"format": "pykvtier", "pykvtier_version": __version__,
                            **mapper.get_run_config()})
        return ns

    # ------------------------------------------------------------------ phase 1

    def _shard(self, digest: bytes) -> int:
        """The shard of the key whose key_digest is ``digest``."""
        return int.from_bytes(digest[:8], "little") % len(self._tiers)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT, MISS or RETRY from the in-memory index; never blocks (see DiskTier.lookup).
        With ``bypass: auto``, a request's hits past its loadable prefix answer MISS, and its
        hits answer RETRY for one step while they are counted (module docs, _lookup_bypass)."""
        if self.prefill is not None:
            return self._lookup_bypass(key, req_context)
        if self._single_code is not None:
            r = self._single_code(key)  # one call into the tier's index
            return _LOOKUP_CODE[r] if r < 4 else _LOOKUP[self._single.lookup(key)]
        d = key_digest(key)  # once: the shard and the tier's index
        return _LOOKUP[self._tiers[self._shard(d)].lookup_digest(d)]

    def _lookup(self, key: OffloadKey) -> LookupResult:
        """The answer without bypass (lookup's own path, for _lookup_bypass)."""
        if self._single_code is not None:
            r = self._single_code(key)  # one call into the tier's index
            return _LOOKUP_CODE[r] if r < 4 else _LOOKUP[self._single.lookup(key)]
        d = key_digest(key)  # once: the shard and the tier's index
        return _LOOKUP[self._tiers[self._shard(d)].lookup_digest(d)]

    def _lookup_bypass(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        """bypass: auto. A key without a position in its request (``get_offload_key_position``
        None) is answered as without bypass. Else, per request (a :class:`_BypassState` in its
        ReqContext):

        - decided: a HIT past the cutoff position answers MISS;
        - its first HIT: no bandwidth estimate yet, or a position's keys (one per KV-cache
          group) load in time for the prompt's first block, the cheapest to recompute
          (``loadable_prefix(1, ...) == 1``, the bytes queued = this tier's load jobs in flight
          and this step's HITs): then every block pays off whatever its position and whichever
          order vLLM asks in (its sliding-window lookup scans from the end): HIT, and every later
          one (no cutoff); else RETRY, and this step's HITs of the request are counted, per key
          (RETRY each);
        - its first lookup in a later step decides (:meth:`_decide`) on the counted keys sorted
          by position: cutoff = the end of the last position of the loadable prefix (none when
          it is all of them), ``bypassed_hits += keys past it``;
        - preempted (``ScheduleEndContext.preempted_req_ids``): decided again when it resumes.
        """
        plain = self._lookup(key)
        end = ctx.get_offload_key_position(key) if ctx is not None else None
        if end is None:
            if plain is LookupResult.HIT:
                self._step_hits += 1
            return plain
        states = ctx.get_state(_BypassStates)
        if states is None:
            states = _BypassStates()
            ctx.set_state(states)
        st = states.get(id(self))
        if st is None:
            st = states[id(self)] = _BypassState()
        if self._bypass_preempted and ctx.req_id in self._bypass_preempted:
            self._bypass_preempted.discard(ctx.req_id)
            st.reset()  # the queue and the request's hits have changed since
        if st.cutoff is None and st.counted is not None and st.step != self._step:
            self._decide(st)
        if st.cutoff is not None:
            if plain is LookupResult.HIT:
                if end > st.cutoff:
                    return LookupResult.MISS
                self._step_hits += 1
            return plain
        if plain is not LookupResult.HIT:
            return plain
        if st.counted is not None:  # this step's count
            st.counted[key] = end
            return LookupResult.RETRY
        bw = self.bandwidth.bytes_per_s
        if not bw or loadable_prefix(1, self.block_size_bytes * self.kv_groups,
                                     self._queued_bytes(), bw, [self._first_key_s]) == 1:
            st.cutoff = math.inf  # (recompute grows along the prompt: all the hits load)
            self._step_hits += 1
            return plain
        st.counted = {key: end}
        st.step = self._step
        self.bypass_deferrals += 1
        return LookupResult.RETRY

    def _decide(self, st: _BypassState) -> None:
        """The cutoff of the counted hits: ``loadable_prefix``'s rule over their positions in
        prompt order, a position loading every key counted at it (one per KV-cache group,
        ``block_size_bytes`` each) and saving its recompute once."""
        per_end = Counter(st.counted.values())
        st.counted = None
        ends = sorted(per_end)
        total = sum(per_end.values())
        bw = self.bandwidth.bytes_per_s
        k = len(ends)  # positions loaded
        if bw:  # (as loadable_prefix: (Q + bytes) / W <= the recompute seconds, summed)
            load_bytes = self._queued_bytes()
            saved = 0.0
            k = 0
            for i, e in enumerate(ends, 1):
                load_bytes += per_end[e] * self.block_size_bytes
                saved += self._recompute_seconds(e)
                if load_bytes / bw <= saved:
                    k = i
        st.cutoff = math.inf if k == len(ends) else (ends[k - 1] if k else 0)
        if k < len(ends):
            self.bypassed_hits += total - sum(per_end[e] for e in ends[:k])
            self.bypassed_requests += 1

    def _recompute_seconds(self, end: int) -> float:
        """Recompute seconds of the key ending at token ``end``: its ``tokens_per_key`` tokens
        (fewer at the prompt's start)."""
        start = max(0, end - self.tokens_per_key)
        return self.prefill.block_seconds(start, end - start)

    def _queued_bytes(self) -> int:
        """Bytes queued ahead of a new load: the keys of this tier's load jobs not reported
        yet, and the HITs answered this step (vLLM submits their loads at the step's end)."""
        keys = sum(len(ks) for j in self._jobs.values() if j.is_load for ks in j.parts.values())
        return self.block_size_bytes * (keys + self._step_hits)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        if self._single is not None:
            self._single.touch(keys)
            return
        parts: dict[int, list[bytes]] = {}
        for k in keys:
            d = key_digest(k)
            parts.setdefault(self._shard(d), []).append(d)
        for i, ds in parts.items():
            self._tiers[i].touch((), digests=ds)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """Submits the step's existence probes (shared roots): one batch per root. With
        ``bypass: auto``, the preempted requests' decisions are dropped (made again on resume)."""
        for tier in self._tiers:
            tier.on_step_end()
        self._step += 1
        self._step_hits = 0
        if self.prefill is not None and context.preempted_req_ids:
            self._bypass_preempted.update(context.preempted_req_ids)

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._bypass_preempted.discard(req_context.req_id)

    # ------------------------------------------------------------------ phase 2

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, is_load=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, is_load=True)

    def _submit(self, job: TransferJob, is_load: bool) -> None:
        """Hands the job to its shard(s); never raises for a job vLLM already registered: a
        part that cannot be submitted fails its keys, reported by get_finished_jobs()."""
        job_id = job.job_id
        if job_id in self._jobs or job_id in self._ready_ids:
            self._refuse_reused_id(job, is_load)
            return
        keys = list(job.keys)
        chunk_ids = job.chunk_ids
        if len(chunk_ids) != len(keys):
            logger.error("pykvtier: job %d has %d keys but %d chunk_ids; failed", job_id,
                         len(keys), len(chunk_ids))
            self._report(_failed(job_id))
            return
        if not keys:
            self._report(JobResult(job_id, True, transfer_time=0.0, transfer_bytes=0))
            return
        claimed = b""
        if self._single is not None:  # its DiskTier refuses a load giving a slot twice, claims
            # the slots, and reads a numpy array of chunk ids in place
            parts = {0: (keys, chunk_ids, None)}
        else:
            rows = (chunk_ids.tolist() if hasattr(chunk_ids, "tolist")
                    else [int(c) for c in chunk_ids])
            if is_load and len(set(rows)) != len(rows):  # a row per key across the shards too
                twice = next(r for r, n in Counter(rows).items() if n > 1)
                logger.error("pykvtier: load job %d (%d keys) not submitted: chunk %d given twice;"
                             " a load needs a chunk per key", job_id, len(keys), twice)
                self._report(_failed(job_id))
                return
            parts = {}  # each key's digest once: its shard, then the tier's index and file name
            for k, r in zip(keys, rows):
                d = key_digest(k)
                ks, rs, ds = parts.setdefault(self._shard(d), ([], [], []))
                ks.append(k)
                rs.append(r)
                ds.append(d)
            try:  # the rows, across the shards: refused when another job in flight races in one
                claimed = np.asarray(rows, np.int64).tobytes()
                self._claims.claim(job_id, claimed, is_load)
            except (ValueError, TypeError, OverflowError) as exc:
                logger.error("pykvtier: %s job %d (%d keys) not submitted: %s",
                             "load" if is_load else "store", job_id, len(keys), exc)
                self._report(_failed(job_id))
                return
        state = _Job(job_id, is_load, {}, claimed)
        submit = DiskTier.submit_load if is_load else DiskTier.submit_store
        for i, (ks, rs, ds) in parts.items():
            try:
                submit(self._tiers[i], TierTransferJob(job_id, ks, rs), ds)
            except Exception as exc:  # noqa: BLE001 - reported as the keys' failure
                logger.error("pykvtier: %s job %d (%d keys) not submitted to %s: %s",
                             "load" if is_load else "store", job_id, len(ks),
                             self._tiers[i].layout.root, exc)
                state.success = False
                continue
            state.parts[i] = ks
        if state.parts:
            self._jobs[job_id] = state  # its rows stay claimed until it is reported
        else:
            if claimed:
                self._claims.release(claimed, is_load)
            self._report(_failed(job_id))

    def _refuse_reused_id(self, job: TransferJob, is_load: bool) -> None:
        """A job whose id is held by a job not reported yet: refused, reported failed right
        after that job (see the class docstring)."""
        logger.error("pykvtier: %s job %d (%d keys) not submitted: job id %d is in use by a job "
                     "not reported yet; reported failed after it", "load" if is_load else "store",
                     job.job_id, len(job.keys), job.job_id)
        first = self._jobs.get(job.job_id)
        if first is not None:
            first.refused += 1
        else:  # the first's result waits in _ready: this one after it
            self._report(_failed(job.job_id))

    def _report(self, result: JobResult) -> None:
        """A result for the next get_finished_jobs()."""
        self._ready.append(result)
        self._ready_ids.add(result.job_id)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Every submitted job exactly once; never blocks. Partial loads carry
        ``successful_keys``; ``transfer_time`` is the engine's (first SQE to last completion)."""
        out, self._ready = self._ready, []
        self._ready_ids.clear()
        for i, tier in enumerate(self._tiers):
            for r in tier.get_finished_jobs():
                self._merge(i, r, out)
        if self._events is not None:
            self._collect_removals()
        return out

    def _merge(self, shard: int, r: TierJobResult, out: list[JobResult]) -> None:
        """Takes one shard's result of a job; once every part is in, appends the job's result
        (and the failures of the jobs refused for reusing its id) to ``out``."""
        job = self._jobs.get(r.job_id)
        keys = None if job is None else job.parts.pop(shard, None)
        if keys is None:  # (never expected: every part is submitted and reported once)
            logger.error("pykvtier: %s reported job %s, which it has no part of in flight; "
                         "ignored", self._tiers[shard].layout.root, r.job_id)
            return
        t = r.transfer_time or 0.0
        self._times[shard][0 if job.is_load else 1] += t
        job.transfer_time = max(job.transfer_time, t)  # parts run side by side
        job.transfer_bytes += r.transfer_bytes or 0
        if r.success:
            ok = keys
        else:
            job.success = False
            ok = list(r.successful_keys or ())
        if job.is_load:
            job.ok_keys.extend(ok)
        elif self._events is not None and ok:
            self._announce_stored(ok, self._tiers[shard])
        if job.parts:
            return
        del self._jobs[r.job_id]
        if job.claimed:
            self._claims.release(job.claimed, job.is_load)
        self._job_times.append((job.is_load, job.transfer_time))
        if job.is_load and self.bandwidth is not None and job.transfer_bytes and job.transfer_time:
            self.bandwidth.update(job.transfer_bytes, job.transfer_time)
        out.append(JobResult(
            job_id=job.job_id,
            success=job.success,
            successful_keys=(tuple(job.ok_keys) if job.is_load and not job.success
                             and job.ok_keys else None),
            transfer_time=job.transfer_time,
            transfer_bytes=job.transfer_bytes,
        ))
        out.extend(_failed(job.job_id) for _ in range(job.refused))

    # ------------------------------------------------------------------ events

    def _announce_stored(self, keys: list[bytes], tier: DiskTier) -> None:
        """A stored event for the keys of a store job the tier holds now and that were not
        announced: a key skipped as present may have been evicted before its job was reported
        (its removed event went out then; announcing it would leave it stored for consumers)."""
        new = []
        for k in keys:
            d = key_digest(k)
            if d not in self._announced and tier.holds(d):
                self._announced[d] = k
                new.append(k)
        if new:
            self._events.append(OffloadingEvent(keys=new, medium=self.medium, removed=False,
                                                locality=self.locality))

    def _collect_removals(self) -> None:
        gone = []
        for tier in self._tiers:
            for d in tier.take_removed():
                k = self._announced.pop(d, None)
                if k is not None:
                    gone.append(k)
        if gone:
            self._events.append(OffloadingEvent(keys=gone, medium=self.medium, removed=True,
                                                locality=self.locality))

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Stored events for blocks this tier wrote (each block announced once), and removed
        events when such a block is evicted or its load failed. None unless enable_kv_events."""
        if self._events is None:
            return
        self._collect_removals()
        events, self._events = self._events, []
        yield from events

    # ------------------------------------------------------------------ waiting, shutdown

    def has_pending_work(self) -> bool:
        return bool(self._ready) or any(t.has_pending_work() for t in self._tiers)

    def wait(self, timeout_s: float | None = None) -> None:
        """Blocks (GIL released) until some job finished (its result then waits for
        :meth:`get_finished_jobs`), nothing is in flight, or ``timeout_s`` passed. Not part of
        vLLM's interface (vLLM polls once per step): for benchmarks and callers that block."""
        if self._ready:
            return
        if self._single is not None:
            tiers, slice_s = [(0, self._single)], timeout_s
        else:
            tiers, slice_s = list(enumerate(self._tiers)), 0.0005
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._ready and self.has_pending_work():
            for i, tier in tiers:
                done: list[JobResult] = []
                for r in tier.wait(slice_s):
                    self._merge(i, r, done)
                for d in done:
                    self._report(d)
                if self._ready:
                    return
            if deadline is not None and time.monotonic() >= deadline:
                return

    def drain_jobs(self) -> None:
        """Blocks (GIL released) until no I/O of any submitted job touches the primary view;
        in-flight reads and writes finish, none is aborted. Results stay for
        get_finished_jobs()."""
        for tier in self._tiers:
            tier.drain()

    def shutdown(self) -> None:
        """Finishes in-flight I/O, then releases the engines (threads, rings, registered
        buffers, descriptors) and the references to the primary view. Idempotent. The jobs
        that were in flight are reported by the next get_finished_jobs(), each once."""
        if self._closed:
            return
        self._closed = True
        errors = []
        for tier in self._tiers:
            try:
                tier.shutdown()
            except Exception as exc:  # noqa: BLE001 - every root gets its shutdown
                errors.append(exc)
                logger.exception("pykvtier: shutting down %s failed", tier.layout.root)
        if errors:
            raise errors[0]

    # ------------------------------------------------------------------ figures

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        defs: dict[str, OffloadingMetricMetadata] = {
            name: OffloadingCounterMetadata(documentation=doc, labelnames=_LABELS)
            for name, (_key, doc) in _COUNTERS.items()
        }
        M = PyKVTierMetrics
        defs[M.READ_TIME] = OffloadingCounterMetadata(
            documentation="Seconds the disk tier's engine spent on load jobs (first SQE to "
                          "last completion, summed over jobs).", labelnames=_LABELS)
        defs[M.WRITE_TIME] = OffloadingCounterMetadata(
            documentation="Seconds the disk tier's engine spent on store jobs.",
            labelnames=_LABELS)
        defs[M.ENGINE_FALLBACKS] = OffloadingCounterMetadata(
            documentation="Roots on the posix engine because io_uring was refused.",
            labelnames=_LABELS)
        defs[M.USED_BYTES] = OffloadingGaugeMetadata(
            documentation="Block-file bytes held by the disk tier (what capacity_bytes limits).",
            labelnames=_LABELS)
        defs[M.BLOCKS_PRESENT] = OffloadingGaugeMetadata(
            documentation="Blocks loadable from the disk tier.", labelnames=_LABELS)
        buckets = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
        defs[M.LOAD_JOB_TIME] = OffloadingHistogramMetadata(
            documentation="Seconds per load job in the disk tier's engine.", buckets=buckets)
        defs[M.STORE_JOB_TIME] = OffloadingHistogramMetadata(
            documentation="Seconds per store job in the disk tier's engine.", buckets=buckets)
        for name, (_key, doc) in _BYPASS_COUNTERS.items():
            defs[name] = OffloadingCounterMetadata(documentation=doc)
        return defs

    def get_stats(self) -> OffloadingConnectorStats | None:
        """The tier's own figures since the last call: bytes, blocks and seconds moved,
        failures, verification failures, evictions, fallbacks; gauges of used bytes/blocks."""
        M = PyKVTierMetrics
        stats = OffloadingConnectorStats()
        for i, tier in enumerate(self._tiers):
            label = (self.roots[i],)
            cur = tier.stats()
            last = self._last_stats[i]
            for name, (key, _doc) in _COUNTERS.items():
                delta = cur[key] - last.get(key, 0)
                if delta:
                    stats.increase_counter(name, delta, label)
            self._last_stats[i] = cur
            read_s, write_s = self._times[i]
            if read_s:
                stats.increase_counter(M.READ_TIME, read_s, label)
            if write_s:
                stats.increase_counter(M.WRITE_TIME, write_s, label)
            self._times[i] = [0.0, 0.0]
            if (not self._fallbacks_reported and self.config.engine == "auto"
                    and tier.engine_name != "uring"):
                stats.increase_counter(M.ENGINE_FALLBACKS, 1, label)
            stats.set_gauge(M.USED_BYTES, cur["used_bytes"], label)
            stats.set_gauge(M.BLOCKS_PRESENT, cur["blocks_present"], label)
        self._fallbacks_reported = True
        for name, (key, _doc) in _BYPASS_COUNTERS.items():
            cur = getattr(self, key)
            if cur != self._bypass_reported[key]:
                stats.increase_counter(name, cur - self._bypass_reported[key])
                self._bypass_reported[key] = cur
        for is_load, t in self._job_times:
            stats.observe_histogram(M.LOAD_JOB_TIME if is_load else M.STORE_JOB_TIME, t)
        self._job_times.clear()
        return None if stats.is_empty() else stats

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return PyKVTierInfo.config_info_keys()

    def config_info(self) -> dict[str, str | int | float | bool]:
        return self._info.as_config_info()

    def stats(self) -> dict[str, int]:
        """DiskTier.stats() summed over the roots (for tests, benchmarks and logs), and the
        bypass counters: ``bypassed_hits`` (blocks held but answered MISS), ``bypassed_requests``,
        ``bypass_deferrals`` (requests answered RETRY a step to count their hits)."""
        total: dict[str, int] = {}
        for tier in self._tiers:
            for k, v in tier.stats().items():
                total[k] = total.get(k, 0) + v
        for key, _doc in _BYPASS_COUNTERS.values():
            total[key] = getattr(self, key)
        return total

    @property
    def tiers(self) -> list[DiskTier]:
        """The DiskTier of each root, in root_dir order."""
        return list(self._tiers)
