"""pykvtier as a storage backend of SGLang's hierarchical cache (HiCache).

SGLang (0.5.23 is the reference) loads it from config alone, no patch to SGLang::

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
      --hicache-storage-backend dynamic \\
      --hicache-storage-backend-extra-config '{"backend_name": "pykvtier",
        "module_path": "pykvtier.integrations.sglang", "class_name": "PyKVTierHiCache",
        "interface_v1": 1, "root_dir": ["/mnt/nvme0/kv", "/mnt/nvme1/kv"],
        "capacity_bytes": 1000000000000}'

SGLang's ``StorageBackendFactory`` imports this module and builds the class as
``cls(storage_config, kwargs)`` (``storage_config.extra_config`` is the JSON above; ``kwargs``
is ``{}``), then hands it the host memory pool (``register_mem_pool_host``). The options are the
fields of :class:`PyKVTierHiCacheConfig`; an unknown key is an error naming it.

How it maps onto pykvtier (docs/design.md, "SGLang HiCache"):

- A page (``page_size`` tokens of every layer) is stored as block files of one
  :class:`~pykvtier.tier.DiskTier` per root; a key's shard is chosen from its block's digest.
  Where the pool's layout keeps a page in at most two contiguous, 4096-aligned regions
  (``page_first``, ``page_first_direct``, ``page_head``: ``is_stride_page_aligned()``), the
  pool's own memory is every tier's arena, registered once as io_uring fixed buffers: a page
  of an MHA model is two blocks (its K and its V region), of an MLA model one, moved by
  address with O_DIRECT, no copy (``zero_copy``). Else (``layer_first``, unaligned pages, the
  legacy tensor methods) a page is one block in SGLang's flat page order, moved through a
  page-aligned staging arena of ``staging_pages`` slots and copied to or from the pool by the
  pool's own ``get_data_page`` / ``set_from_flat_data_page``.
- Blocks live in a namespace directory per model, pool kind, layout, dtype, page geometry and
  rank (``ROOT/pykvtier-sglang/<model>_<hash>``): two models or layouts sharing a root never
  see each other's pages. An MLA model's ranks share one directory (its pages are the same on
  every rank; only the writer rank stores, as ``HiCacheStorageConfig.is_storage_writer``), so
  with more than one rank its tiers are opened ``shared``.
- Threads: SGLang calls ``batch_exists`` (prefetch thread), gets (prefetch I/O thread) and sets
  (backup thread) at the same time, and ``clear``/``get_stats`` from the scheduler. Every
  DiskTier call is made holding the backend's one lock, none of which waits on the disk
  (DiskTier's single-thread rule, kept); a thread whose get or set is in flight waits on a
  condition without the lock, while one collector thread per root waits on that root's engine
  (GIL released) and hands out finished jobs. So a get's disk wait never delays an existence
  check, which the index answers in microseconds. On a ``shared`` root, keys the index does not
  know are probed in one batch of ``statx`` (one io_uring submit) inside ``batch_exists``.
- ``bypass: auto`` (off by default; docs/design.md "Load or recompute"): ``batch_exists``
  answers at most the ``k`` of :func:`pykvtier.costmodel.loadable_prefix` of the leading pages
  it found: their load (``page_bytes`` each, behind the blocks of the loads in flight, at a
  moving estimate of the finished loads' bandwidth or ``bypass_bytes_per_s`` before the first)
  against the prefill of their ``page_size`` tokens each on ``tp_size`` GPUs, from the token
  after the pages SGLang passes as ``extra_info.prefix_keys`` (with
  ``hicache_storage_pass_prefix_keys``; else the first key is taken at token 0, which counts
  the attention over the prefix already on the GPU or host as free and leans to recomputing).
  SGLang then loads those pages and recomputes the rest. The pages answered missing so are
  counted (``stats()["bypassed_hits"]``, ``["bypassed_requests"]``); ``exists`` is not capped.

Importing this module imports SGLang; importing ``pykvtier`` never does.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from .. import _native
from ..buffers import host_arena
from ..config import DiskTierConfig
from ..tier import DiskTier, LookupResult
from .bypass import PrefixBypass, bypass_docs, check_bypass
from .options import AdapterOptions, open_namespace_tiers, opt
from .shards import Shards

__all__ = ["PyKVTierHiCache", "PyKVTierHiCacheConfig"]

logger = logging.getLogger("pykvtier")

#: Extra-config keys SGLang itself reads (and leaves in the dict) or may inject: accepted, not ours.
SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "file_storage_path",
    "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys", "tp_lcm_size"})
#: Layouts whose pages are at most two contiguous regions (K, V) of the pool.
_PAGE_LAYOUTS = ("page_first", "page_first_direct", "page_head")
_ALIGN = 4096
_BYPASS_DOCS = bypass_docs("pages", "SGLang's tensor-parallel size (`tp_size`)")


@dataclass(frozen=True)
class PyKVTierHiCacheConfig(AdapterOptions):
    """The backend's options: the keys of ``--hicache-storage-backend-extra-config`` besides
    SGLang's own (``backend_name``, ``module_path``, ``class_name``, ``interface_v1``, and the
    ones SGLang pops or injects: :data:`SGLANG_KEYS`). Checked here, before any root is touched:
    ValueError naming the key. Fields hold normalized values (``root_dir``: a list of paths,
    ``direct``: None for "auto", ``mode``: an int)."""

    _who: ClassVar[str] = "PyKVTierHiCache"

    shared: bool = opt(
        False, "the roots are shared with other SGLang instances or nodes: pages the index does "
               "not know are probed (one batch of `statx` per `batch_exists`); on for MLA models "
               "with more than one rank")
    zero_copy: Any = opt(
        "auto", "`\"auto\"`: pages move by address between the files and the host pool where "
                "its layout allows (`page_first*`, `page_head`, 4096-aligned pages, "
                "`interface_v1`); `false`: always through the staging arena", '`"auto"`')
    staging_pages: int = opt(
        64, "pages of the staging arena (layouts or paths without zero copy); a get or set "
            "batch moves them in chunks of a quarter, two chunks in flight (the copies of one "
            "overlap the other's I/O)")
    bypass: str = opt("off", _BYPASS_DOCS["bypass"].replace(
        "answer missing", "answer missing in `batch_exists`"))
    bypass_model: str | None = opt(None, _BYPASS_DOCS["bypass_model"])
    bypass_gpu: str = opt("h100", _BYPASS_DOCS["bypass_gpu"])
    bypass_mfu: float = opt(0.5, _BYPASS_DOCS["bypass_mfu"])
    bypass_bytes_per_s: float | None = opt(None, _BYPASS_DOCS["bypass_bytes_per_s"])

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> PyKVTierHiCacheConfig:
        """The config of SGLang's extra config dict; ValueError naming an unknown key, a missing
        ``root_dir``, or a bad value."""
        extra = dict(extra or {})
        names = [f.name for f in fields(cls)]
        ours = {k: v for k, v in extra.items() if k not in SGLANG_KEYS}
        unknown = sorted(set(ours) - set(names))
        if unknown:
            raise ValueError(
                f"PyKVTierHiCache: unknown option{'s' if len(unknown) > 1 else ''} "
                f"{', '.join(map(repr, unknown))} in --hicache-storage-backend-extra-config; "
                f"accepted: {', '.join(names)}")
        if "root_dir" not in ours:
            raise ValueError("PyKVTierHiCache: 'root_dir' is required in "
                             "--hicache-storage-backend-extra-config (a directory, or a list "
                             "of directories, one per drive)")
        return cls(**ours)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._positive("staging_pages")
        if self.staging_pages < 2:
            raise self._bad(f"staging_pages must be at least 2, got {self.staging_pages}")
        if self.zero_copy not in ("auto", False):
            raise self._bad(f"zero_copy must be \"auto\" or false, got {self.zero_copy!r}")
        check_bypass(self)


@dataclass
class _Geometry:
    """How the pages of one host pool become blocks."""

    zero_copy: bool
    blocks_per_page: int  # block files per page (zero copy: the page's regions; else 1)
    block_bytes: int  # payload bytes of one block
    page_bytes: int  # a page's bytes, all its blocks
    base: int = 0  # zero copy: the pool's address (the arena)


class PyKVTierHiCache(HiCacheStorage):
    """SGLang HiCache storage backend on local NVMe (or any POSIX file system), through pykvtier.

    Built by SGLang's ``StorageBackendFactory`` as ``PyKVTierHiCache(storage_config, kwargs)``;
    the options come from ``storage_config.extra_config`` (:class:`PyKVTierHiCacheConfig`). The
    roots are opened when SGLang registers the host pool (:meth:`register_mem_pool_host`, the
    page geometry comes from it); until then every page is missing.

    Semantics as SGLang's ``HiCacheStorage``: :meth:`batch_exists` is the number of leading keys
    whose pages are all here (a page missing in the middle stops the count), from the index
    without waiting on the disk; :meth:`batch_get_v1` / :meth:`batch_set_v1` return one bool
    per key (a page whose load failed verification is quarantined and answers missing from then
    on; other pages of the batch are unaffected); the legacy :meth:`batch_get` returns one
    tensor or None per key, :meth:`batch_set` all-or-nothing. Thread-safe as SGLang calls it
    (see the module docstring). Errors: ValueError at construction or registration for bad
    options, a root in use, or a pool layout it cannot store (naming them); a failed page is a
    False or None, logged by the tier, never an exception on the I/O threads.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        if kwargs:
            raise ValueError(f"PyKVTierHiCache: unexpected constructor arguments "
                             f"{sorted(kwargs)}; options go in the extra config")
        self.storage_config = storage_config
        extra = storage_config.extra_config or {}
        self.config = PyKVTierHiCacheConfig.from_extra_config(extra)
        self.interface_v1 = bool(extra.get("interface_v1", 0))
        self.is_writer = bool(storage_config.is_storage_writer)
        self.is_mla = bool(storage_config.is_mla_model)
        cfg = self.config
        split = (f" (capacity_bytes={cfg.capacity_bytes} split over {len(cfg.root_dir)} roots)"
                 if cfg.capacity_bytes is not None and len(cfg.root_dir) > 1 else "")
        try:  # every DiskTier option checked before any root is touched
            DiskTierConfig(cfg.root_dir[0], _ALIGN, **cfg.disk_tier_options(cfg.shared))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"PyKVTierHiCache{split}: {exc}") from exc
        self._cv = threading.Condition(threading.Lock())  # also the Shards' lock
        self._shards: Shards | None = None  # the roots' tiers, once a pool is registered
        self._closed = False
        self.namespace_dirs: list[str] = []
        self._geometry: _Geometry | None = None
        self._pool: Any = None
        self._staging: Any = None  # torch uint8 (slots, block_bytes) over the staging arena
        self._free_staging: list[int] = []
        self._keep_metrics = bool(getattr(storage_config, "enable_storage_metrics", True))
        self._metrics = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                         "backup_bandwidth": []}
        self._counts = {"pages_loaded": 0, "pages_load_failed": 0, "pages_stored": 0,
                        "pages_store_failed": 0, "sets_skipped_not_writer": 0}
        self.registered_pools = {}
        #: bypass: auto (None when off): the recompute estimate on SGLang's TP GPUs, the
        #: bandwidth estimate, the counters; guarded by the lock.
        self._bypass = (PrefixBypass(cfg, int(getattr(storage_config, "tp_size", 1) or 1))
                        if cfg.bypass == "auto" else None)
        self.prefill = self._bypass.prefill if self._bypass is not None else None
        self.bandwidth = self._bypass.bandwidth if self._bypass is not None else None

    @property
    def _tiers(self) -> list[DiskTier]:
        """The roots' tiers (none before a pool is registered)."""
        return self._shards.tiers if self._shards is not None else []

    @property
    def _closing(self) -> bool:
        return self._closed or (self._shards is not None and self._shards.closing)

    def _shard(self, digest: bytes) -> int:
        return self._shards.shard(digest)

    # ------------------------------------------------------------------ registration

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Takes SGLang's host pool (an ``MHATokenToKVPoolHost`` or ``MLATokenToKVPoolHost``)
        and opens the roots for its page geometry. Called once, on the scheduler thread, before
        any I/O. ValueError for a pool it cannot store, a root that cannot be used or is locked."""
        if self._pool is mem_pool_host:
            return
        if self._pool is not None:
            raise ValueError("PyKVTierHiCache: a second host pool was registered; one backend "
                             "serves one pool")
        self.mem_pool_host = mem_pool_host
        geo = self._page_geometry(mem_pool_host)
        shared = self.config.shared
        if self.is_mla and self.storage_config.tp_size > 1 and not shared:
            shared = True  # the writer rank's pages must be visible to the other ranks
            logger.info("pykvtier: MLA model on %d ranks: the ranks share one directory per root "
                        "(shared=True)", self.storage_config.tp_size)
        self._open_roots(mem_pool_host, geo, shared)
        self._pool = mem_pool_host
        self._geometry = geo
        logger.info("pykvtier: SGLang HiCache backend on %s: %s layout, %d-byte pages as %d "
                    "block%s each, %s, engine %s, O_DIRECT %s", self.namespace_dirs,
                    mem_pool_host.layout, geo.page_bytes, geo.blocks_per_page,
                    "s" if geo.blocks_per_page > 1 else "",
                    "zero copy" if geo.zero_copy else "staging arena",
                    self._tiers[0].engine_name, all(t.direct for t in self._tiers))

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """SGLang's hybrid controller registers its pools by name: the KV pool is the one of
        :meth:`register_mem_pool_host`; any other (Mamba, SWA, indexer sidecars) is refused in
        :meth:`on_host_pools_registered`."""
        self.registered_pools[str(getattr(host_pool_name, "value", host_pool_name))] = host_pool

    def on_host_pools_registered(self) -> None:
        """ValueError when a sidecar pool (hybrid models' v2 interface) was registered: this
        backend stores KV pages only (SGLang then fails the attach, naming it)."""
        others = sorted(k for k in self.registered_pools if k != "kv")
        if others:
            raise ValueError(f"PyKVTierHiCache: host pools {others} are not supported (hybrid "
                             "models' sidecar pools need SGLang's v2 storage interface); only "
                             "the KV pool is stored")
        if self._pool is None:
            raise ValueError("PyKVTierHiCache: no host pool registered")

    def _page_geometry(self, pool: Any) -> _Geometry:
        layout = getattr(pool, "layout", None)
        try:
            dummy = pool.get_dummy_flat_data_page()
        except Exception as exc:
            raise ValueError(f"PyKVTierHiCache: host pool {type(pool).__name__} (layout "
                             f"{layout!r}) has no flat page: {exc}") from exc
        page_bytes = int(dummy.numel() * dummy.element_size())
        if page_bytes <= 0:
            raise ValueError(f"PyKVTierHiCache: host pool {type(pool).__name__} has empty pages")
        flat = _Geometry(False, 1, page_bytes, page_bytes)
        if not (self.interface_v1 and self.config.zero_copy == "auto" and layout in _PAGE_LAYOUTS
                and pool.is_stride_page_aligned(_ALIGN)):
            return flat
        ptrs, sizes = pool.get_page_buffer_meta(torch.arange(pool.page_size, dtype=torch.int64))
        buf = pool.kv_buffer
        base = int(buf.data_ptr())
        n = len(ptrs)
        if (n not in (1, 2) or len(set(sizes)) != 1 or sizes[0] * n != page_bytes
                or base % _ALIGN or not buf.is_contiguous()):
            return flat
        return _Geometry(True, n, int(sizes[0]), page_bytes, base)

    def _namespace(self, pool: Any, geo: _Geometry) -> tuple[str, dict[str, Any]]:
        """The directory name of this model, pool and rank inside ROOT/pykvtier-sglang, and the
        run config it stands for (written beside the blocks)."""
        sc = self.storage_config
        dummy = pool.get_dummy_flat_data_page()
        run = {
            "model_name": sc.model_name, "pool": type(pool).__name__,
            "layout": pool.layout, "dtype": str(pool.dtype), "page_size": int(pool.page_size),
            "page_bytes": geo.page_bytes, "flat_page_shape": list(dummy.shape),
            "blocks_per_page": geo.blocks_per_page, "is_mla_model": self.is_mla,
            "pp": [sc.pp_rank, sc.pp_size], "attn_cp": [sc.attn_cp_rank, sc.attn_cp_size],
            # DP attention: replicas share the attention TP rank, told apart by dp_rank; each
            # has its own directory (its own lock), as one instance per replica does
            "dp_rank": int(getattr(sc, "dp_rank", 0) or 0),
        }
        if not self.is_mla:  # MLA pages are the same on every rank: one directory for all
            run["tp"] = [sc.tp_rank, sc.tp_size]
            if getattr(sc, "should_split_heads", False):
                run["tp_lcm_size"] = sc.tp_lcm_size
        h = hashlib.blake2b(json.dumps(run, sort_keys=True).encode(), digest_size=8).hexdigest()
        model = re.sub(r"[^A-Za-z0-9._-]+", "-", str(sc.model_name or "model")).strip("-")[:80]
        return f"{model or 'model'}_{h}", run

    def _open_roots(self, pool: Any, geo: _Geometry, shared: bool) -> None:
        cfg = self.config
        name, run = self._namespace(pool, geo)
        opts = cfg.disk_tier_options(shared)
        split = (f" (capacity_bytes={cfg.capacity_bytes} split over {len(cfg.root_dir)} roots)"
                 if cfg.capacity_bytes is not None and len(cfg.root_dir) > 1 else "")
        if geo.zero_copy:
            arena: Any = pool.kv_buffer.view(-1).view(torch.uint8).view(-1, geo.block_bytes)
        else:
            slots = cfg.staging_pages
            staging = host_arena(slots, -(-geo.block_bytes // _ALIGN) * _ALIGN)
            arena = staging
            self._staging = torch.from_numpy(staging)
            self._free_staging = list(range(slots))
        tiers, self.namespace_dirs = open_namespace_tiers(
            "PyKVTierHiCache", cfg.root_dir, "pykvtier-sglang", name, run, geo.block_bytes, opts,
            arena, split=split, instance="SGLang instance")
        arena_slots = tiers[0].arena.num_slots
        self._tier_options, self._arena = opts, arena
        # Several roots share the pool: its slots are claimed across them (Shards.claims).
        claims = _native.SlotClaims(arena_slots) if len(tiers) > 1 else None
        self._shards = Shards(tiers, "SGLang", cv=self._cv, claims=claims)

    # ------------------------------------------------------------------ keys

    def _block_keys(self, keys: Sequence[str]) -> list[bytes]:
        """Every block key of ``keys``' pages, page by page (a page's blocks in region order)."""
        for k in keys:
            if not isinstance(k, str):
                raise TypeError(f"PyKVTierHiCache: keys must be str (SGLang's page hashes), got "
                                f"{type(k).__name__} {k!r}")
        n = self._geometry.blocks_per_page if self._geometry else 1
        if n == 1:
            return [k.encode() for k in keys]
        return [f"{k}:{j}".encode() for k in keys for j in range(n)]

    # ------------------------------------------------------------------ existence

    def exists(self, key: str) -> bool:
        """Whether ``key``'s page is here (all its blocks); never capped by ``bypass``."""
        return self._exists([key], None, cap=False) == 1

    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """The number of leading ``keys`` whose pages are all here and loadable, as SGLang's
        ``HiCacheStorage.batch_exists`` (a prefix count, not a list). From the index: never
        waits on the disk for keys it knows; on a ``shared`` root the others are probed in one
        batch (one io_uring submit of ``statx``) and waited for. Any thread.

        With ``bypass: auto`` at most the pages that load faster than they recompute
        (:meth:`_cap`): SGLang loads that prefix and recomputes the rest."""
        return self._exists(keys, extra_info, cap=True)

    def _exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None,
                cap: bool) -> int:
        bkeys = self._block_keys(keys)
        if not keys or not self._tiers:
            return 0
        per = self._geometry.blocks_per_page
        with self._cv:
            if self._closing:
                return 0
            answers = self._shards.lookup(bkeys)
            if LookupResult.RETRY in answers and any(t.config.shared for t in self._tiers):
                answers = self._shards.settle(bkeys, answers)  # (a key still RETRY: absent)
            ok = [a is LookupResult.HIT or a is LookupResult.HIT_PENDING for a in answers]
            n = next((i for i in range(len(keys)) if not all(ok[i * per:(i + 1) * per])),
                     len(keys))
            if cap and self._bypass is not None and n:
                n = self._cap(n, extra_info)
        return n

    def _cap(self, hits: int, extra_info: HiCacheStorageExtraInfo | None) -> int:
        """bypass: auto, holding the lock: of ``hits`` leading pages, the ``k`` of
        ``loadable_prefix``: ``page_bytes`` a page, ``page_size`` tokens a page from the token
        after ``extra_info.prefix_keys`` (0 without them), behind the blocks of the loads in
        flight (``Shards.loading_blocks``)."""
        geo, ps = self._geometry, int(self._pool.page_size)
        prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        start = len(prefix) * ps if prefix else 0
        queued = self._shards.loading_blocks() * geo.block_bytes
        return self._bypass.cap(hits, geo.page_bytes, ps, start, queued)

    def _measured(self, call: Any) -> None:
        """A load's jobs finished: to the bandwidth estimate (bypass: auto)."""
        if self._bypass is not None:
            with self._cv:
                self._bypass.measured(call.results)

    # ------------------------------------------------------------------ jobs

    def _run(self, bkeys: list[bytes], slots: list[int], is_load: bool) -> dict[bytes, bool]:
        """Moves blocks ``bkeys`` to/from arena ``slots`` and waits (without the lock) for the
        result: block key -> success (all False once closing). A load feeds the bandwidth
        estimate (bypass: auto)."""
        call = self._shards.submit(bkeys, slots, is_load)
        ok = self._shards.wait(call)
        if is_load:
            self._measured(call)
        return ok

    def _host_pages(self, host_indices: Any, n: int) -> np.ndarray:
        """The first token slot of each of the ``n`` pages of ``host_indices`` (a 1-D integer
        tensor of ``n * page_size`` token slots, each page a run first..first+page_size-1 from
        a page boundary, inside the pool). ValueError / TypeError naming host_indices else."""
        ps, size = self._pool.page_size, int(self._pool.size)
        if not isinstance(host_indices, torch.Tensor):
            raise TypeError(f"PyKVTierHiCache: host_indices must be a torch.Tensor, not "
                            f"{type(host_indices).__name__}")
        if host_indices.dim() != 1 or host_indices.dtype.is_floating_point or \
                host_indices.dtype == torch.bool:
            raise ValueError(f"PyKVTierHiCache: host_indices must be a 1-D integer tensor of "
                             f"token slots, got shape {tuple(host_indices.shape)} "
                             f"{host_indices.dtype}")
        if host_indices.numel() != n * ps:
            raise ValueError(f"PyKVTierHiCache: {host_indices.numel()} host_indices for {n} "
                             f"pages of {ps} tokens (want {n * ps})")
        idx = host_indices.to(torch.int64).cpu().reshape(n, ps)
        first = idx[:, 0]
        bad = (first % ps != 0) | (first < 0) | (first + ps > size)
        bad |= (idx != first[:, None] + torch.arange(ps)).any(dim=1)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(
                f"PyKVTierHiCache: host_indices of page {i} ({idx[i, 0]}..{idx[i, -1]}) are not "
                f"one page of the pool: each page must be {ps} consecutive token slots from a "
                f"multiple of {ps} (a page boundary), within the pool's {size} slots")
        return first.numpy()

    def _zero_copy_slots(self, host_indices: torch.Tensor, n: int) -> list[int]:
        """Arena slots (of block_bytes in the pool) of every block of the ``n`` pages."""
        self._host_pages(host_indices, n)  # (checked before the pool reads them)
        geo = self._geometry
        ptrs, _ = self._pool.get_page_buffer_meta(host_indices)
        off = np.asarray(ptrs, dtype=np.int64) - geo.base
        if len(off) != n * geo.blocks_per_page or (off % geo.block_bytes).any():
            raise ValueError("PyKVTierHiCache: the pool's page regions moved off the block grid")
        return (off // geo.block_bytes).tolist()

    def _take_staging(self, want: int, wait: bool) -> list[int]:
        """Up to ``want`` staging slots, at most a quarter of the arena; with ``wait``, waits
        for one to be free, else takes what is free now (maybe none). Holding the lock."""
        cap = max(1, len(self._staging) // 4)
        if wait:
            self._cv.wait_for(lambda: self._free_staging or self._closing)
        n = min(want, cap, len(self._free_staging))
        got, self._free_staging = self._free_staging[:n], self._free_staging[n:]
        return got

    def _give_staging(self, slots: list[int]) -> None:
        with self._cv:
            self._free_staging.extend(slots)
            self._cv.notify_all()

    def _staged(self, keys: list[str], is_load: bool, fill: Any, drain: Any) -> list[bool]:
        """Moves pages through the staging arena in chunks, two in flight: ``fill(i, slot)``
        puts page i's bytes in a slot before a store, ``drain(i, slot)`` takes them out after
        a load, while the next chunk's I/O runs. A call holds at most half the arena (two
        chunks of a quarter) and waits for slots only while it holds none, so concurrent
        calls never wait on each other's slots in a circle."""
        out = [False] * len(keys)
        pending: list[tuple[int, list[int], Any]] = []  # (first page, slots, submit handle)
        i = 0
        try:
            while i < len(keys) or pending:
                while i < len(keys) and len(pending) < 2:
                    with self._cv:
                        if self._closing:
                            break
                        slots = self._take_staging(len(keys) - i, wait=not pending)
                    if not slots:
                        break
                    try:
                        if not is_load:
                            for j, s in enumerate(slots):
                                fill(i + j, s)
                        handle = self._shards.submit(self._block_keys(keys[i:i + len(slots)]),
                                                     slots, is_load)
                    except BaseException:
                        self._give_staging(slots)
                        raise
                    pending.append((i, slots, handle))
                    i += len(slots)
                if not pending:
                    break  # closing
                first, slots, handle = pending.pop(0)
                try:
                    ok = self._shards.wait(handle)
                    if is_load:
                        self._measured(handle)
                    for j, (k, s) in enumerate(zip(handle.keys, slots)):
                        if ok[k] and is_load:
                            drain(first + j, s)
                        out[first + j] = ok[k]
                finally:
                    self._give_staging(slots)
        finally:
            for _, slots, handle in pending:  # (an exception above: let their I/O finish)
                self._shards.wait(handle)
                self._give_staging(slots)
        return out

    # ------------------------------------------------------------------ v1: host pool slots

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Loads the pages of ``keys`` into the host pool at ``host_indices`` (token slots,
        ``len(keys) * page_size`` of them, as SGLang's ``HiCacheStorage.batch_get_v1``); one
        bool per key. Zero copy where the layout allows, else through the staging arena. Pages
        that fail leave their pool slots undefined (SGLang uses only the leading True ones)."""
        t0 = time.monotonic()
        out = self._move_v1(keys, host_indices, is_load=True)
        self._account(out, True, time.monotonic() - t0)
        return out

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Stores the host pool's pages at ``host_indices`` under ``keys``, as SGLang's
        ``HiCacheStorage.batch_set_v1``; one bool per key (a page already here is True, and not
        written again). On an MLA rank that is not the writer (``is_storage_writer``) nothing
        is written and every key is True: the writer rank stores the same pages."""
        if not self.is_writer:
            self._counts["sets_skipped_not_writer"] += len(keys)
            return [True] * len(keys)
        t0 = time.monotonic()
        out = self._move_v1(keys, host_indices, is_load=False)
        self._account(out, False, time.monotonic() - t0)
        return out

    def _move_v1(self, keys: list[str], host_indices: torch.Tensor, is_load: bool) -> list[bool]:
        if not keys:
            return []
        if self._pool is None:
            return [False] * len(keys)
        if self._geometry.zero_copy:
            per = self._geometry.blocks_per_page
            bkeys = self._block_keys(keys)
            ok = self._run(bkeys, self._zero_copy_slots(host_indices, len(keys)), is_load)
            return [all(ok[b] for b in bkeys[i * per:(i + 1) * per]) for i in range(len(keys))]
        pages = self._host_pages(host_indices, len(keys))
        pool, staging = self._pool, self._staging
        nb = self._geometry.block_bytes

        def fill(i: int, s: int) -> None:  # one strided copy, in the flat page's order
            page = pool.get_data_page(int(pages[i]), flat=False)
            staging[s, :nb].view(pool.dtype).view(page.shape).copy_(page)

        def drain(i: int, s: int) -> None:
            pool.set_from_flat_data_page(int(pages[i]), staging[s, :nb].view(pool.dtype))

        return self._staged(keys, is_load, fill, drain)

    # ------------------------------------------------------------------ legacy: tensors

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """The page of ``key`` as a flat tensor (into ``target_location`` when given), or None."""
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[Any]:
        """Loads pages as flat tensors, as SGLang's ``HiCacheStorage.batch_get``:
        ``target_locations[i]`` (a tensor of one flat page, as ``get_dummy_flat_data_page``)
        receives page i, else a new tensor is made; None for a page that is not here or failed.
        Needs the staging arena (a backend built without zero copy: ``interface_v1`` off,
        ``zero_copy: false`` or a ``layer_first`` pool); RuntimeError on a zero-copy backend,
        whose arena is the pool."""
        if not keys:
            return []
        self._need_staging("batch_get")
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        if len(targets) != len(keys):
            raise ValueError(f"PyKVTierHiCache: {len(targets)} target locations for "
                             f"{len(keys)} keys")
        nb = self._geometry.block_bytes
        out: list[Any] = [None] * len(keys)

        for t in targets:
            if t is not None:
                _as_bytes(t, nb)  # (checks type and size before any I/O)

        def drain(i: int, s: int) -> None:
            t = targets[i]
            if t is None:
                t = self._pool.get_dummy_flat_data_page()
            # Into the caller's tensor itself, strided or not, in its logical (C) order.
            t.copy_(self._staging[s, :nb].view(t.dtype).view(t.shape))
            out[i] = t

        t0 = time.monotonic()
        ok = self._staged(list(keys), True, None, drain)
        self._account(ok, True, time.monotonic() - t0)
        return out

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        """Stores one flat page tensor under ``key``: ``batch_set([key], [value])``."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Stores flat page tensors (``values[i]``, as ``get_data_page(flat=True)``) under
        ``keys``, as SGLang's ``HiCacheStorage.batch_set``: True when every page is stored
        (pages stored before a failure stay). ValueError for a value of the wrong size.
        Needs the staging arena (see :meth:`batch_get`)."""
        if not keys:
            return True
        if not self.is_writer:
            self._counts["sets_skipped_not_writer"] += len(keys)
            return True
        self._need_staging("batch_set")
        vals = list(values) if values is not None else []
        if len(vals) != len(keys):
            raise ValueError(f"PyKVTierHiCache: {len(vals)} values for {len(keys)} keys")
        nb = self._geometry.block_bytes
        srcs = [_as_bytes(v, nb) for v in vals]

        def fill(i: int, s: int) -> None:
            self._staging[s, :nb].copy_(srcs[i])

        t0 = time.monotonic()
        ok = self._staged(list(keys), False, fill, None)
        self._account(ok, False, time.monotonic() - t0)
        return all(ok)

    def _need_staging(self, what: str) -> None:
        if self._pool is None:
            raise RuntimeError(f"PyKVTierHiCache.{what}: no host pool registered yet")
        if self._geometry.zero_copy:
            raise RuntimeError(
                f"PyKVTierHiCache.{what}: this backend moves pages zero-copy between the files "
                "and the host pool (interface_v1); the legacy tensor methods need the staging "
                "arena: set zero_copy: false, or drop interface_v1")

    # ------------------------------------------------------------------ metrics, clear, close

    def _account(self, ok: list[bool], is_load: bool, seconds: float) -> None:
        if self._geometry is None:  # (no pool registered: every page answered missing)
            return
        good = sum(ok)
        gbps = good * self._geometry.page_bytes / 1e9 / seconds if seconds > 0 else 0.0
        side = "prefetch" if is_load else "backup"
        with self._cv:
            if is_load:
                self._counts["pages_loaded"] += good
                self._counts["pages_load_failed"] += len(ok) - good
            else:
                self._counts["pages_stored"] += good
                self._counts["pages_store_failed"] += len(ok) - good
            if self._keep_metrics:  # (else get_stats() is never called: nothing would drain them)
                self._metrics[f"{side}_pgs"].append(good)
                self._metrics[f"{side}_bandwidth"].append(gbps)

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` of the batches since the last call (pages and GB/s per
        get and set batch), for ``--enable-storage-metrics`` (without it,
        ``storage_config.enable_storage_metrics`` is false and none are kept); scheduler
        thread."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._cv:
            m, self._metrics = self._metrics, {k: [] for k in self._metrics}
        return StorageMetrics(**m)

    def stats(self) -> dict[str, int]:
        """The tiers' counters summed over the roots (``DiskTier.stats()`` keys, as the vLLM
        adapter's metrics), plus the backend's page counts and the bypass counters (the vLLM
        adapter's names): ``bypassed_hits`` (pages here that ``batch_exists`` answered missing,
        their load slower than their recompute), ``bypassed_requests`` (its calls that did);
        0 with ``bypass: off``. SGLang's ``get_stats()`` (``StorageMetrics``) has fixed fields
        and carries none of them."""
        with self._cv:
            total: dict[str, int] = dict(self._counts)
            for t in self._tiers:
                for k, v in t.stats().items():
                    total[k] = total.get(k, 0) + v
            if self._bypass is not None:
                total.update(self._bypass.stats())
            else:
                total.update(bypassed_hits=0, bypassed_requests=0)
        return total

    def clear(self) -> None:
        """Removes every page of this model and rank from every root (SGLang's admin "clear
        storage"): waits for the batches in flight, then empties the namespace directories and
        reopens them. Gets and sets that arrive meanwhile wait."""
        sh = self._shards
        if sh is None or self._closing:
            return
        with sh.paused():
            if self._closing:
                return
            for i, t in enumerate(sh.tiers):
                t.shutdown()
                try:
                    entries = list(os.scandir(t.layout.blocks_dir))
                except FileNotFoundError:  # removed behind our back: nothing to clear
                    entries = []
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.path, ignore_errors=True)
                    else:
                        os.unlink(entry.path)
                sh.tiers[i] = DiskTier(self.namespace_dirs[i], t.block_size_bytes,
                                       **self._tier_options)
                sh.tiers[i].set_arena(self._arena)

    def close(self) -> None:
        """Finishes the batches in flight, stops the collector threads and shuts the tiers down
        (SGLang calls it on detach). Idempotent."""
        if self._shards is not None:
            self._shards.close()  # (idempotent; wakes calls waiting for staging slots)
        self._closed = True


def _as_bytes(t: Any, nbytes: int) -> torch.Tensor:
    """A flat page tensor as ``nbytes`` uint8 (ValueError naming the sizes otherwise)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"PyKVTierHiCache: a page must be a torch.Tensor, not {type(t).__name__}")
    if not t.is_contiguous():
        t = t.contiguous()
    b = t.reshape(-1).view(torch.uint8)
    if b.numel() != nbytes:
        raise ValueError(f"PyKVTierHiCache: a page tensor of {b.numel()} bytes, pages here are "
                         f"{nbytes} bytes")
    return b
