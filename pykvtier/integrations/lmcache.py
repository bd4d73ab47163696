"""pykvtier as an LMCache storage plug-in (LMCache 0.5.6 is the reference).

LMCache loads it from its config alone, no patch to LMCache (``lmcache.yaml``)::

    chunk_size: 256
    local_cpu: true
    max_local_cpu_size: 20
    storage_plugins: ["pykvtier"]
    extra_config:
      storage_plugin.pykvtier.module_path: pykvtier.integrations.lmcache
      storage_plugin.pykvtier.class_name: PyKVTierStoragePlugin
      storage_plugin.pykvtier.root_dir: ["/mnt/nvme0/kv", "/mnt/nvme1/kv"]
      storage_plugin.pykvtier.capacity_bytes: 1000000000000

LMCache's ``storage_plugin_launcher`` imports this module and builds the class as
``PyKVTierStoragePlugin(config=, dst_device=, metadata=, local_cpu_backend=, loop=)``; its
StorageManager then calls it after its own tiers (LocalCPUBackend, LocalDiskBackend, ...). The
options are the ``extra_config`` keys ``storage_plugin.<name>.<option>`` (<name> as listed in
``storage_plugins``; the fields of :class:`PyKVTierLMCacheConfig`); an unknown one is an error
naming it.

How it maps onto pykvtier (docs/design.md, "LMCache"):

- A chunk (LMCache's memory object of ``chunk_size`` tokens of every layer) is one block file
  of one :class:`~pykvtier.tier.DiskTier` per root; a key's root is chosen from its block's
  digest. The block key is ``CacheEngineKey.to_string()``. The memory objects live in
  LocalCPUBackend's allocator arena, which is every tier's arena (registered once as io_uring
  fixed buffers, ``spanning``: a block starts at whatever page the allocator gave the object):
  full chunks move by address, O_DIRECT, no copy, in both directions.
- Any other object (a partial last chunk with ``save_unfull_chunk``, another format) is
  *packed*: copied into a block-sized staging object of the same arena with a record of its
  true length, shapes, dtypes and format at the end of the block, stored under the block key
  plus ``"\\0packed"``; a load reads the block and copies the object out. Never a wrong length.
- Blocks live in a namespace directory per model, rank, dtype, KV shape, chunk size and format
  (``ROOT/pykvtier-lmcache/<model>_<hash>``, ``config.json`` beside), so two models or ranks
  sharing a root never see each other's chunks, and a restart finds its chunks (the index is
  rebuilt from the files).
- Threads: LMCache calls puts, lookups and gets on its callers' threads and its event loop's;
  every DiskTier call is made under one lock, none waits on the disk (:mod:`.shards`).
- Shut-down: LMCache's ``StorageManager.close`` frees LocalCPUBackend's arena *before* it closes
  the plug-ins, so the plug-in wraps that backend's ``close``: every put and get in flight
  finishes first, and nothing reads or writes the arena after it is freed.
- ``bypass: auto`` (off by default; docs/design.md "Load or recompute"): LMCache looks a
  request's chunks up as a prefix, tier by tier (``StorageManager.batched_contains``: each tier
  gets the keys after the chunks the tiers above it hold, and answers how many of them it holds
  in a row), so :meth:`PyKVTierStoragePlugin.batched_contains` (and ``batched_async_contains``)
  answers at most the ``k`` of :func:`pykvtier.costmodel.loadable_prefix` of the chunks it
  found: their load (a block each, behind the blocks of the loads in flight, at a moving
  estimate of the finished loads' bandwidth or ``bypass_bytes_per_s`` before the first) against
  the prefill of their ``chunk_size`` tokens each on ``world_size`` GPUs. LMCache does not tell
  a tier where its keys start in the prompt: the first is taken at token 0 (the attention over
  the chunks before it counted as free), and chunks the engine already holds on the GPU are
  counted as loads; both lean to recomputing. Only the ``k`` chunks are pinned. A lookup's
  loadable chunks are remembered until a get reads them (at most 65,536 keys, oldest dropped),
  and a later ``batched_contains`` of such chunks only (LMCache's retrieve asks again, in
  ``StorageManager.get_block_mapping``) answers them without deciding again, so a retrieve
  never loses chunks its lookup promised. ``contains`` is not capped. Counted:
  ``stats()["bypassed_hits"]``, ``["bypassed_requests"]``.

Importing this module imports LMCache; importing ``pykvtier`` never does.
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import json
import logging
import math
import re
import struct
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from ..config import DiskTierConfig
from ..tier import LookupResult
from .bypass import PrefixBypass, bypass_docs, check_bypass
from .options import AdapterOptions, check_root, open_namespace_tiers, opt
from .shards import Shards

__all__ = ["PyKVTierLMCacheConfig", "PyKVTierStoragePlugin"]

logger = logging.getLogger("pykvtier")

_ALIGN = 4096
_DEFAULT_NAME = "pykvtier"
#: Keys of the plug-in's extra_config prefix that LMCache itself reads.
LMCACHE_KEYS = frozenset({"module_path", "class_name"})
#: A packed block's record, at the end of its payload: magic, JSON length (u32), then the JSON.
_PACKED_MAGIC = b"PKVLMCP1"
_PACKED_TAG = b"\0packed"
_RECORD_MAX = 4096  # bytes at most of a packed record
#: Answers of a stored, loadable block: HIT_PENDING is a HIT whose block is being read (or pinned).
_STORED = (LookupResult.HIT, LookupResult.HIT_PENDING)
_BYPASS_DOCS = bypass_docs("chunks", "LMCache's world size (tensor parallel)")
#: bypass: auto: the loadable chunks of recent lookups kept until a get reads them, at most.
_PROMISED_MAX = 1 << 16


@dataclass(frozen=True)
class PyKVTierLMCacheConfig(AdapterOptions):
    """The plug-in's options: the ``extra_config`` keys ``storage_plugin.<name>.<option>``
    besides LMCache's own ``module_path`` and ``class_name``. Checked before any root is
    touched: ValueError naming the key."""

    _who: ClassVar[str] = "PyKVTierStoragePlugin"

    capacity_bytes: int | None = opt(
        None, "total block-file bytes of this worker, split evenly over the roots; least "
              "recently used chunks are evicted (never one being read, nor a pinned one)")
    shared: bool = opt(
        False, "the roots are shared with other LMCache instances or nodes: chunks the index "
               "does not know are probed (one batch of `statx` per lookup)")
    fsync: bool = opt(False, "durable puts: each block file fdatasync'ed, each directory "
                             "fsync'ed once per batch, before the put is reported complete")
    bypass: str = opt("off", _BYPASS_DOCS["bypass"].replace(
        "answer missing", "answer missing in a lookup (`batched_contains`)"))
    bypass_model: str | None = opt(None, _BYPASS_DOCS["bypass_model"])
    bypass_gpu: str = opt("h100", _BYPASS_DOCS["bypass_gpu"])
    bypass_mfu: float = opt(0.5, _BYPASS_DOCS["bypass_mfu"])
    bypass_bytes_per_s: float | None = opt(None, _BYPASS_DOCS["bypass_bytes_per_s"])

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bypass(self)

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None, name: str) -> PyKVTierLMCacheConfig:
        """The options under ``storage_plugin.<name>.`` of LMCache's ``extra_config``;
        ValueError naming an unknown key, a missing ``root_dir``, or a bad value."""
        prefix = f"storage_plugin.{name}."
        ours = {k[len(prefix):]: v for k, v in (extra or {}).items()
                if isinstance(k, str) and k.startswith(prefix) and k[len(prefix):] not in LMCACHE_KEYS}
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(ours) - set(names))
        if unknown:
            raise ValueError(
                f"PyKVTierStoragePlugin: unknown option{'s' if len(unknown) > 1 else ''} "
                f"{', '.join(prefix + k for k in unknown)} in LMCache's extra_config; "
                f"accepted: {', '.join(prefix + n for n in names)}")
        if "root_dir" not in ours:
            raise ValueError(f"PyKVTierStoragePlugin: '{prefix}root_dir' is required in "
                             "LMCache's extra_config (a directory, or a list of directories, "
                             "one per drive)")
        return cls(**ours)


@dataclass(frozen=True)
class _Format:
    """A memory object's layout: what LMCache's allocator takes to rebuild it."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    fmt: int
    nbytes: int  # logical bytes (MemoryObj.get_size())

    @classmethod
    def of(cls, obj: Any) -> _Format:
        m = obj.meta
        shapes = m.shapes if m.shapes is not None else [m.shape]
        dtypes = m.dtypes if m.dtypes is not None else [m.dtype]
        return cls(tuple(tuple(int(x) for x in s) for s in shapes),
                   tuple(str(d).removeprefix("torch.") for d in dtypes),
                   int(m.fmt.value), int(obj.get_size()))

    def allocate(self, backend: Any, busy_loop: bool = True) -> Any:
        """A memory object of this format from LMCache's allocator, or None (no room)."""
        return backend.allocate([torch.Size(s) for s in self.shapes],
                                [getattr(torch, d) for d in self.dtypes],
                                MemoryFormat(self.fmt), busy_loop=busy_loop)

    def record(self) -> bytes:
        body = json.dumps({"shapes": self.shapes, "dtypes": self.dtypes, "fmt": self.fmt,
                           "nbytes": self.nbytes}, separators=(",", ":")).encode()
        return _PACKED_MAGIC + struct.pack("<I", len(body)) + body

    @classmethod
    def from_record(cls, tail: bytes, block_bytes: int) -> _Format:
        """The format in a packed block's last bytes; ValueError when they hold none, or one
        that cannot be this block's (shapes, dtypes or format unknown, a length that is not
        the shapes' or that does not fit the block beside its record)."""
        i = tail.rfind(_PACKED_MAGIC)
        if i < 0:
            raise ValueError("no packed record")
        (n,) = struct.unpack_from("<I", tail, i + len(_PACKED_MAGIC))
        body = tail[i + len(_PACKED_MAGIC) + 4:i + len(_PACKED_MAGIC) + 4 + n]
        if len(body) != n or i + len(_PACKED_MAGIC) + 4 + n != len(tail):
            raise ValueError("truncated packed record")
        d = json.loads(body)
        if not isinstance(d, dict):
            raise ValueError("packed record is not an object")
        shapes, dtypes, fmt, nbytes = d["shapes"], d["dtypes"], d["fmt"], d["nbytes"]
        if (not isinstance(shapes, list) or not isinstance(dtypes, list) or not shapes
                or len(shapes) != len(dtypes)
                or not all(isinstance(s, list) and all(type(x) is int and x >= 0 for x in s)
                           for s in shapes)
                or not all(isinstance(t, str) and isinstance(getattr(torch, t, None), torch.dtype)
                           for t in dtypes)
                or type(fmt) is not int or type(nbytes) is not int):
            raise ValueError("malformed packed record")
        MemoryFormat(fmt)  # ValueError: not a format
        true = sum(math.prod(s) * getattr(torch, t).itemsize for s, t in zip(shapes, dtypes))
        if nbytes != true or nbytes + 4 + len(_PACKED_MAGIC) + n > block_bytes:
            raise ValueError(f"packed record says {nbytes} bytes ({shapes}): not an object of a "
                             f"{block_bytes}-byte block")
        return cls(tuple(tuple(s) for s in shapes), tuple(dtypes), fmt, nbytes)


def _key_bytes(key: Any) -> bytes:
    """The block key of an LMCache key: ``CacheEngineKey.to_string()`` (stable across runs)."""
    to_string = getattr(key, "to_string", None)
    s = to_string() if callable(to_string) else None
    if not isinstance(s, str):
        raise TypeError(f"PyKVTierStoragePlugin: keys must be LMCache CacheEngineKeys, not "
                        f"{type(key).__name__}")
    return s.encode()


def _format_of(obj: Any, i: int) -> _Format:
    """The format of ``objs[i]`` of a put; TypeError when it is not an LMCache MemoryObj."""
    if not isinstance(obj, MemoryObj):
        raise TypeError(f"PyKVTierStoragePlugin: objs[{i}] must be an LMCache MemoryObj, not "
                        f"{type(obj).__name__}")
    return _Format.of(obj)


class PyKVTierStoragePlugin(StoragePluginInterface):
    """LMCache storage plug-in on local NVMe (or any POSIX file system), through pykvtier.

    Built by LMCache's ``storage_plugin_launcher`` as
    ``PyKVTierStoragePlugin(config=, dst_device=, metadata=, local_cpu_backend=, loop=)``; the
    options are ``config.extra_config["storage_plugin.<name>.<option>"]``
    (:class:`PyKVTierLMCacheConfig`), <name> being the entry of ``config.storage_plugins``
    whose module_path and class_name name this class.

    Semantics as LMCache's ``StorageBackendInterface``: :meth:`batched_submit_put_task` is
    asynchronous (it returns at once; each stored key's future resolves and
    ``on_complete_callback(key)`` runs once, when its block is renamed into place);
    :meth:`contains` / :meth:`batched_contains` answer from the index without waiting on the
    disk (on a ``shared`` root, keys the index does not know are probed in one batch and waited
    for); :meth:`get_blocking` / :meth:`batched_get_blocking` return memory objects allocated
    from ``local_cpu_backend`` (the caller owns one reference) or None for a chunk that is
    absent or failed verification (quarantined, then absent; the other chunks are unaffected);
    :meth:`pin` keeps a chunk from eviction until :meth:`unpin`. Thread-safe. Errors: ValueError
    at construction for bad options, a root in use, or an LMCache configuration it cannot store
    (naming them; LMCache logs it and runs without the plug-in).
    """

    def __init__(self, config: Any = None, dst_device: str = "cpu", metadata: Any = None,
                 local_cpu_backend: Any = None, loop: Any = None) -> None:
        super().__init__(dst_device=dst_device, config=config, metadata=metadata,
                         local_cpu_backend=local_cpu_backend, loop=loop)
        self.name = _DEFAULT_NAME
        self._shards: Shards | None = None
        self._closed = False
        self._putting: dict[bytes, Any] = {}  # block key -> LMCache key, puts in flight
        self._pins: dict[bytes, tuple[Any, bytes, int]] = {}  # block key -> (tier, digest, count)
        self._lock_free = threading.Lock()  # close() once
        self._final_stats: dict[str, int] | None = None
        self._active = 0  # calls using the arena now (close() waits for them)
        self._bypass: PrefixBypass | None = None  # bypass: auto (guarded by the shards' lock)
        self._promised: OrderedDict[bytes, None] = OrderedDict()  # loadable, not yet read
        self.prefill = self.bandwidth = None
        self.counts = {"puts_zero_copy": 0, "puts_packed": 0, "puts_copied": 0,
                       "puts_skipped_present": 0,
                       "puts_failed": 0, "puts_refused_no_memory": 0, "gets_hit": 0,
                       "gets_missed": 0, "gets_failed": 0, "gets_no_memory": 0}
        try:
            self._start()
        except Exception as exc:
            # LMCache's launcher logs a constructor's error in one line and goes on without the
            # plug-in: say here what failed, with the fix.
            logger.error("pykvtier: LMCache storage plug-in %r not started: %s", self.name, exc)
            raise

    # ------------------------------------------------------------------ start-up

    def _find_name(self) -> str:
        """This plug-in's name: the ``storage_plugins`` entry whose module_path/class_name in
        extra_config name this class (LMCache does not pass it)."""
        extra = getattr(self.config, "extra_config", None) or {}
        mine = []
        for name in getattr(self.config, "storage_plugins", None) or []:
            mod = extra.get(f"storage_plugin.{name}.module_path")
            cls = extra.get(f"storage_plugin.{name}.class_name")
            if mod == type(self).__module__ and cls == type(self).__name__:
                mine.append(name)
        if len(mine) > 1:
            raise ValueError(f"storage_plugins lists this class under several names {mine}: "
                             "list it once (one plug-in serves several roots: root_dir takes a list)")
        return mine[0] if mine else _DEFAULT_NAME

    def _start(self) -> None:
        if self.config is None or self.metadata is None or self.local_cpu_backend is None:
            raise ValueError("built without LMCache's config, metadata or local_cpu_backend "
                             "(LMCache's storage_plugin_launcher passes all three)")
        self.name = self._find_name()
        cfg = PyKVTierLMCacheConfig.from_extra_config(self.config.extra_config, self.name)
        self.options = cfg
        if getattr(self.config, "use_layerwise", False):
            raise ValueError("use_layerwise is not supported (a chunk per layer would take a "
                             "whole chunk's block); turn it off to use pykvtier")
        arena, align = self._arena()
        self._align = align
        md = self.metadata
        fmt = MemoryFormat.KV_MLA_FMT if md.use_mla else MemoryFormat.KV_2LTD
        shapes = md.get_shapes(self.config.chunk_size)
        dtypes = md.get_dtypes()
        nbytes = sum(math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes))
        self.full = _Format(tuple(tuple(int(x) for x in s) for s in shapes),
                            tuple(str(d).removeprefix("torch.") for d in dtypes), int(fmt.value),
                            int(nbytes))
        self.block_bytes = -(-nbytes // _ALIGN) * _ALIGN
        #: A packed block's staging object: a full chunk's allocation (one block of the arena;
        #: LMCache's allocator takes KV formats only).
        self._staging_format = self.full
        opts = cfg.disk_tier_options(cfg.shared)
        split = (f" (capacity_bytes={cfg.capacity_bytes} split over {len(cfg.root_dir)} roots)"
                 if cfg.capacity_bytes is not None and len(cfg.root_dir) > 1 else "")
        try:  # every DiskTier option checked before any root is touched
            DiskTierConfig(cfg.root_dir[0], self.block_bytes, **opts)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"PyKVTierStoragePlugin: {exc}{split}; a block is one LMCache chunk "
                             f"of {nbytes} bytes (chunk_size={self.config.chunk_size})") from exc
        for root in cfg.root_dir:  # every root checked before any is touched
            check_root("PyKVTierStoragePlugin", root)
        name, run = self._namespace()
        tiers, self.namespace_dirs = open_namespace_tiers(
            "PyKVTierStoragePlugin", cfg.root_dir, "pykvtier-lmcache", name, run, self.block_bytes,
            opts, arena, spanning=True, split=split, instance="LMCache instance")
        self._arena_addr, self._arena_end = int(arena.data_ptr()), int(arena.data_ptr()) + arena.numel()
        self._shards = Shards(tiers, f"lmcache-{self.name}")
        if cfg.bypass == "auto":  # the prefill of a chunk's tokens, split over the TP workers
            self._bypass = PrefixBypass(cfg, int(md.world_size or 1))
            self.prefill, self.bandwidth = self._bypass.prefill, self._bypass.bandwidth
        # LMCache's StorageManager.close() closes LocalCPUBackend, which frees the arena, before
        # it closes the plug-ins: drain first (no put or get in flight touches freed memory).
        backend, original = self.local_cpu_backend, self.local_cpu_backend.close

        def close_after_pykvtier(*args: Any, **kwargs: Any) -> Any:
            self.close()
            return original(*args, **kwargs)

        backend.close = close_after_pykvtier
        logger.info("pykvtier: LMCache plug-in %r on %s: %d-byte chunks (%s), %s", self.name,
                    ", ".join(self.namespace_dirs), self.full.nbytes, MemoryFormat(fmt).name,
                    "O_DIRECT" if tiers[0].direct else "buffered")

    def _arena(self) -> tuple[Any, int]:
        """LocalCPUBackend's allocator arena as a uint8 tensor, and its alignment."""
        alloc = getattr(self.local_cpu_backend, "memory_allocator", None)
        buf = getattr(alloc, "buffer", None)
        if buf is None:
            buf = getattr(getattr(alloc, "pin_allocator", None), "buffer", None)
        if not isinstance(buf, torch.Tensor) or buf.device.type != "cpu":
            raise ValueError(f"LMCache's CPU allocator ({type(alloc).__name__}) exposes no host "
                             "arena (a CPU tensor 'buffer'); pykvtier needs LocalCPUBackend's "
                             "MixedMemoryAllocator")
        align = int(getattr(alloc, "align_bytes", _ALIGN) or _ALIGN)
        if align % _ALIGN or buf.data_ptr() % _ALIGN:
            raise ValueError(f"LMCache's allocator aligns objects to {align} bytes (arena at "
                             f"{buf.data_ptr():#x}); pykvtier needs {_ALIGN}-byte alignment "
                             "for O_DIRECT: leave extra_config local_cpu.pinned_align_bytes at "
                             "its default (4096) or a multiple of it")
        return buf.view(-1).view(torch.uint8), align

    def _namespace(self) -> tuple[str, dict[str, Any]]:
        md = self.metadata
        run = {
            "model_name": md.model_name, "world_size": int(md.world_size),
            "worker_id": int(md.worker_id), "kv_dtype": str(md.kv_dtype),
            "kv_shape": [int(x) for x in md.kv_shape], "chunk_size": int(self.config.chunk_size),
            "use_mla": bool(md.use_mla), "chunk_shapes": [list(s) for s in self.full.shapes],
            "chunk_dtypes": list(self.full.dtypes), "chunk_fmt": self.full.fmt,
            "block_bytes": self.block_bytes,
        }
        h = hashlib.blake2b(json.dumps(run, sort_keys=True).encode(), digest_size=8).hexdigest()
        model = re.sub(r"[^A-Za-z0-9._-]+", "-", str(md.model_name or "model")).strip("-")[:80]
        return f"{model or 'model'}_{h}", run

    # ------------------------------------------------------------------ lookups

    def _where(self, kb: bytes) -> tuple[LookupResult, bool]:
        """(answer, packed) of block key ``kb``: the full block's answer, else the packed
        one's where that is a HIT (call holding the lock)."""
        sh = self._shards
        a = sh.lookup([kb])[0]
        if a in _STORED:
            return a, False
        p = sh.lookup([kb + _PACKED_TAG])[0]
        if p in _STORED:
            return p, True
        return (LookupResult.RETRY if LookupResult.RETRY in (a, p) else a), False

    def _answers(self, kbs: list[bytes]) -> list[tuple[LookupResult, bool]]:
        """_where of every key, probes of a shared root settled (call holding the lock)."""
        got = [self._where(kb) for kb in kbs]
        if self.options.shared and any(a is LookupResult.RETRY for a, _ in got):
            both = [k for kb in kbs for k in (kb, kb + _PACKED_TAG)]
            self._shards.settle(both, self._shards.lookup(both))
            got = [self._where(kb) for kb in kbs]
        return got

    def contains(self, key: Any, pin: bool = False) -> bool:
        """Whether ``key``'s chunk is stored here (a put in flight is not: see
        :meth:`exists_in_put_tasks`); with ``pin`` it is also pinned. As LMCache's
        ``StorageBackendInterface.contains``. Any thread; never waits on the disk for a key
        the index knows. Never capped by ``bypass``."""
        return self._contains([key], pin, cap=False) == 1

    def batched_contains(self, keys: list[Any], pin: bool = False) -> int:
        """The number of leading ``keys`` stored here (a prefix count), as LMCache's
        ``StorageBackendInterface.batched_contains``; with ``pin`` those are pinned. With
        ``bypass: auto`` at most the chunks that load faster than they recompute
        (:meth:`_cap`; module docs)."""
        return self._contains(keys, pin, cap=True)

    def _contains(self, keys: list[Any], pin: bool, cap: bool) -> int:
        kbs = [_key_bytes(k) for k in keys]
        if self._shards is None or self._closed or not kbs:
            return 0
        with self._shards.cv:
            if self._closed:
                return 0
            found = []
            for kb, (a, packed) in zip(kbs, self._answers(kbs)):
                if a not in _STORED:
                    break
                found.append((kb, packed))
            if cap and self._bypass is not None and found:
                found = found[:self._cap([kb for kb, _ in found])]
            n = 0
            for kb, packed in found:
                if pin and not self._pin_locked(kb, packed):
                    break
                n += 1
        return n

    def _cap(self, kbs: list[bytes]) -> int:
        """bypass: auto, holding the lock: how many of the stored leading chunks ``kbs`` to
        answer. All of them when every one is a chunk a lookup answered loadable and no get
        has read since (a retrieve asking again); else the ``k`` of ``loadable_prefix`` (a
        block of ``chunk_size`` tokens each, the first at token 0, behind the blocks of the
        loads in flight), its chunks remembered as loadable."""
        if all(kb in self._promised for kb in kbs):
            return len(kbs)
        k = self._bypass.cap(len(kbs), self.block_bytes, int(self.config.chunk_size), 0,
                             self._shards.loading_blocks() * self.block_bytes)
        for kb in kbs[:k]:
            self._promised[kb] = None
            self._promised.move_to_end(kb)
        while len(self._promised) > _PROMISED_MAX:
            self._promised.popitem(last=False)
        return k

    async def batched_async_contains(self, lookup_id: str, keys: list[Any], pin: bool = False) -> int:
        """:meth:`batched_contains` for LMCache's asynchronous loading (``enable_async_loading``),
        awaited on its event loop: it answers from the index (a shared root's probes are waited
        for on a worker thread, not on the loop)."""
        if self.options.shared:
            return await asyncio.get_running_loop().run_in_executor(
                None, self.batched_contains, keys, pin)
        return self.batched_contains(keys, pin)

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[Any],
                                       transfer_spec: Any = None) -> list[Any]:
        """The loaded prefix of ``keys``' chunks (memory objects, the caller owns one reference
        each), for LMCache's asynchronous loading; the disk is waited for on a worker thread,
        never on LMCache's event loop. Objects after the first missing chunk are released."""
        objs = await asyncio.get_running_loop().run_in_executor(None, self.batched_get_blocking, keys)
        n = next((i for i, o in enumerate(objs) if o is None), len(objs))
        for o in objs[n:]:
            if o is not None:
                o.ref_count_down()
        return objs[:n]

    def exists_in_put_tasks(self, key: Any) -> bool:
        """Whether a put of ``key`` is in flight here."""
        return _key_bytes(key) in self._putting

    # ------------------------------------------------------------------ pins, removal

    def _pin_locked(self, kb: bytes, packed: bool) -> bool:
        held = self._pins.get(kb)
        if held is not None:
            tier, d, n = held
            if tier.pin([d])[0]:
                self._pins[kb] = (tier, d, n + 1)
                return True
            return False
        tier, d = self._shards.tier_of(kb + _PACKED_TAG if packed else kb)
        if tier.pin([d])[0]:
            self._pins[kb] = (tier, d, 1)
            return True
        return False

    def pin(self, key: Any) -> bool:
        """Keeps ``key``'s chunk from eviction and removal until as many :meth:`unpin` calls;
        False when it is not stored here. As LMCache's ``StorageBackendInterface.pin``."""
        kb = _key_bytes(key)
        if self._shards is None or self._closed:
            return False
        with self._shards.cv:
            a, packed = self._where(kb)
            return a in _STORED and self._pin_locked(kb, packed)

    def unpin(self, key: Any) -> bool:
        """Releases one :meth:`pin` of ``key``; False when this plug-in holds no pin of it
        (LMCache unpins a lookup's keys on every tier)."""
        kb = _key_bytes(key)
        if self._shards is None:
            return False
        with self._shards.cv:
            held = self._pins.pop(kb, None)
            if held is None:
                return False
            tier, d, n = held
            tier.unpin([d])
            if n > 1:
                self._pins[kb] = (tier, d, n - 1)
        return True

    def remove(self, key: Any, force: bool = True) -> bool:
        """Removes ``key``'s chunk (its file unlinked asynchronously); False when it is not
        stored here, is being read, or is pinned (``force`` does not override a pin: a pinned
        chunk is one a lookup promised). As LMCache's ``StorageBackendInterface.remove``."""
        kb = _key_bytes(key)
        if self._shards is None or self._closed:
            return False
        with self._shards.cv:
            if kb in self._pins:
                return False
            a, packed = self._where(kb)
            if a not in _STORED:
                return False
            tier, d = self._shards.tier_of(kb + _PACKED_TAG if packed else kb)
            return tier.remove([d])[0]

    # ------------------------------------------------------------------ puts

    def _slot(self, obj: Any) -> int | None:
        """The arena slot (page) of a memory object that can move without a copy, else None."""
        addr = int(obj.data_ptr)
        if (addr % _ALIGN or addr < self._arena_addr
                or addr + self.block_bytes > self._arena_end
                or int(obj.get_physical_size()) < self.block_bytes):
            return None
        return (addr - self._arena_addr) // _ALIGN

    def batched_submit_put_task(self, keys: list[Any], objs: list[Any], transfer_spec: Any = None,
                                on_complete_callback: Any = None) -> list[Future] | None:
        """Stores the chunks of ``keys`` from memory objects ``objs``, asynchronously: returns
        at once one Future per key submitted (True once its block is in place, False if it
        failed, e.g. no room or no staging memory; keys already stored or in flight, or given
        twice, are skipped, as LocalDiskBackend skips them), or None when none was.
        ``on_complete_callback(key)`` runs once per key stored, on a pykvtier thread (its
        exceptions are logged). Each object is referenced (``ref_count_up``) until its write
        finished. Full chunks in LocalCPUBackend's arena are written from their own memory (no
        copy); others are copied into a staging object (with their record when they are not
        full chunks: packed). As LMCache's ``StorageBackendInterface.batched_submit_put_task``.
        TypeError for a key that is not a CacheEngineKey or an object that is not a MemoryObj,
        ValueError for lists of different lengths: nothing is stored then."""
        keys, objs = list(keys), list(objs)
        if len(keys) != len(objs):
            raise ValueError(f"PyKVTierStoragePlugin: {len(keys)} keys but {len(objs)} memory objects")
        kbs = [_key_bytes(k) for k in keys]
        fmts = [_format_of(o, i) for i, o in enumerate(objs)]
        sh = self._begin()
        if sh is None:
            return None
        try:
            return self._put(sh, keys, kbs, objs, fmts, on_complete_callback)
        finally:
            self._end()

    def _put(self, sh: Shards, keys: list[Any], kbs: list[bytes], objs: list[Any],
             fmts: list[_Format], on_complete_callback: Any) -> list[Future] | None:
        todo: list[tuple[Any, bytes, Any, _Format]] = []
        with sh.cv:
            for key, kb, obj, fmt in zip(keys, kbs, objs, fmts):
                if kb in self._putting:  # in flight (or given twice in this call)
                    continue
                a, _ = self._where(kb)
                if a in _STORED:
                    self.counts["puts_skipped_present"] += 1
                    continue
                self._putting[kb] = key
                todo.append((key, kb, obj, fmt))
        if not todo:
            return None
        bkeys, slots, held = [], [], []
        futures: dict[bytes, tuple[Any, bytes, Future]] = {}
        out: list[Future] = []
        refused: list[bytes] = []
        n = {"puts_zero_copy": 0, "puts_packed": 0, "puts_copied": 0}
        try:
            for key, kb, obj, fmt in todo:
                slot = self._slot(obj) if fmt == self.full else None
                if slot is not None:
                    obj.ref_count_up()
                    bk = kb
                    held.append(obj)
                    n["puts_zero_copy"] += 1
                else:
                    staged = self._pack(obj, fmt)
                    if staged is None:
                        refused.append(kb)
                        fut: Future = Future()
                        fut.set_result(False)
                        out.append(fut)
                        continue
                    bk = kb if fmt == self.full else kb + _PACKED_TAG
                    slot = self._slot(staged)
                    held.append(staged)
                    n["puts_packed" if fmt != self.full else "puts_copied"] += 1
                bkeys.append(bk)
                slots.append(slot)
                futures[bk] = (key, kb, Future())
                out.append(futures[bk][2])
        except BaseException:
            with sh.cv:
                for _, kb, _, _ in todo:
                    self._putting.pop(kb, None)
            for o in held:
                o.ref_count_down()
            raise
        with sh.cv:
            for kb in refused:
                del self._putting[kb]
            for k, v in n.items():
                self.counts[k] += v
        if not bkeys:
            return out

        def finished(ok: dict[bytes, bool]) -> None:
            with sh.cv:
                for bk, (_, kb, _) in futures.items():
                    self._putting.pop(kb, None)
                    if not ok[bk]:
                        self.counts["puts_failed"] += 1
            for obj in held:
                obj.ref_count_down()
            for bk, (key, _, fut) in futures.items():
                fut.set_result(ok[bk])
                if ok[bk] and on_complete_callback is not None:
                    try:
                        on_complete_callback(key)
                    except Exception:
                        logger.exception("pykvtier: LMCache put callback for %s failed", key)

        sh.submit(bkeys, slots, False, finished)
        return out

    def _pack(self, obj: Any, fmt: _Format) -> Any:
        """A staging object (one block, in the arena) holding ``obj``'s bytes and, unless it is
        a full chunk (one outside the arena), at its end the record of its format; None
        (logged, counted) when it cannot be made."""
        packed = fmt != self.full
        rec = fmt.record() if packed else b""
        if fmt.nbytes + len(rec) > self.block_bytes or len(rec) > _RECORD_MAX:
            with self._shards.cv:
                self.counts["puts_failed"] += 1
            logger.warning("pykvtier: LMCache object of %d bytes (%s) does not fit a %d-byte "
                           "block with its record; not stored", fmt.nbytes, fmt.shapes,
                           self.block_bytes)
            return None
        staged = self._staging_format.allocate(self.local_cpu_backend, busy_loop=False)
        if staged is None:
            with self._shards.cv:
                self.counts["puts_refused_no_memory"] += 1
            logger.warning("pykvtier: no LMCache CPU memory for a chunk's staging object; "
                           "not stored")
            return None
        if self._slot(staged) is None:  # (an allocator outside the arena: not this one)
            staged.ref_count_down()
            with self._shards.cv:
                self.counts["puts_failed"] += 1
            return None
        base = int(staged.data_ptr)
        ctypes.memmove(base, int(obj.data_ptr), fmt.nbytes)
        ctypes.memset(base + fmt.nbytes, 0, self.block_bytes - fmt.nbytes - len(rec))
        if rec:
            ctypes.memmove(base + self.block_bytes - len(rec), rec, len(rec))
        return staged

    # ------------------------------------------------------------------ gets

    def get_blocking(self, key: Any) -> Any:
        """``key``'s chunk as a memory object from ``local_cpu_backend`` (the caller owns one
        reference), or None (absent, failed verification, or no CPU memory now: LocalCPUBackend
        full of objects it cannot evict; the get never waits for memory, so a batch larger
        than the CPU tier cannot wait on memory it holds itself). As LMCache's
        ``StorageBackendInterface.get_blocking``. Waits for the disk, not holding the lock."""
        return self.batched_get_blocking([key])[0]

    def batched_get_blocking(self, keys: list[Any]) -> list[Any]:
        """The chunks of ``keys``, as :meth:`get_blocking` each, read in one batch (one job per
        root): a list of memory objects or None, in key order."""
        kbs = [_key_bytes(k) for k in keys]
        out: list[Any] = [None] * len(kbs)
        if not kbs:
            return out
        sh = self._begin()
        if sh is None:
            return out
        n = dict.fromkeys(("gets_hit", "gets_missed", "gets_failed", "gets_no_memory"), 0)
        try:
            self._get(sh, kbs, out, n)
        finally:
            with sh.cv:
                for k, v in n.items():
                    self.counts[k] += v
            self._end()
        return out

    def _get(self, sh: Shards, kbs: list[bytes], out: list[Any], n: dict[str, int]) -> None:
        with sh.cv:
            where = self._answers(kbs)
            for kb in kbs:  # (bypass: the lookup's promise is kept: read now)
                self._promised.pop(kb, None)
        bkeys, slots, objs, idx, packed = [], [], [], [], []
        for i, (kb, (a, is_packed)) in enumerate(zip(kbs, where)):
            if a not in _STORED:
                n["gets_missed"] += 1
                continue
            fmt = self._staging_format if is_packed else self.full
            obj = fmt.allocate(self.local_cpu_backend, busy_loop=False)
            slot = None if obj is None else self._slot(obj)
            if slot is None:
                if obj is not None:
                    obj.ref_count_down()
                n["gets_no_memory"] += 1
                continue
            bkeys.append(kb + _PACKED_TAG if is_packed else kb)
            slots.append(slot)
            objs.append(obj)
            idx.append(i)
            packed.append(is_packed)
        if not bkeys:
            return
        call = sh.submit(bkeys, slots, True)
        ok = sh.wait(call)
        if self._bypass is not None:
            with sh.cv:
                self._bypass.measured(call.results)
        for bk, obj, i, is_packed in zip(bkeys, objs, idx, packed):
            if not ok[bk]:
                obj.ref_count_down()
                n["gets_failed"] += 1
                continue
            if is_packed:
                obj = self._unpack(obj, n)
                if obj is None:
                    continue  # (counted by _unpack)
            out[i] = obj
            n["gets_hit"] += 1

    def _unpack(self, staged: Any, n: dict[str, int]) -> Any:
        """The object a packed block holds (staged: the block, loaded), staged released; None
        counted in ``n`` (``gets_no_memory`` or ``gets_failed``)."""
        base = int(staged.data_ptr)
        try:
            tail = ctypes.string_at(base + self.block_bytes - _RECORD_MAX, _RECORD_MAX)
            fmt = _Format.from_record(tail, self.block_bytes)
            obj = fmt.allocate(self.local_cpu_backend, busy_loop=False)
            if obj is None:
                n["gets_no_memory"] += 1
                return None
            if int(obj.get_size()) != fmt.nbytes:
                obj.ref_count_down()
                raise ValueError(f"record says {fmt.nbytes} bytes, the allocator made "
                                 f"{obj.get_size()}")
            ctypes.memmove(int(obj.data_ptr), base, fmt.nbytes)
            return obj
        except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as exc:
            logger.warning("pykvtier: a packed LMCache chunk's record is unreadable (%s); "
                           "treated as missing", exc)
            n["gets_failed"] += 1
            return None
        finally:
            staged.ref_count_down()

    # ------------------------------------------------------------------ the rest

    def get_allocator_backend(self) -> Any:
        """``local_cpu_backend``: LMCache hands puts the objects it allocated (no copy)."""
        return self.local_cpu_backend

    def stats(self) -> dict[str, int]:
        """The plug-in's counts (``puts_zero_copy``, ``puts_packed``, ``gets_hit``, ...), the
        bypass counters (the vLLM adapter's names: ``bypassed_hits``, chunks stored here that a
        lookup answered missing, their load slower than their recompute;
        ``bypassed_requests``, the lookups that did; 0 with ``bypass: off``) and its tiers'
        DiskTier counters, summed over the roots."""
        out = dict(self.counts)
        out.update(self._bypass.stats() if self._bypass is not None
                   else {"bypassed_hits": 0, "bypassed_requests": 0})
        tiers = self._final_stats if self._final_stats is not None else self._tier_stats()
        for k, v in tiers.items():
            out[k] = out.get(k, 0) + v
        return out

    def _tier_stats(self) -> dict[str, int]:
        out: dict[str, int] = {}
        if self._shards is not None:
            with self._shards.cv:
                for t in self._shards.tiers:
                    if not t._closed:
                        for k, v in t.stats().items():
                            if isinstance(v, (int, float)) and not isinstance(v, bool):
                                out[k] = out.get(k, 0) + v
        return out

    def close(self) -> None:
        """Waits for every call using LocalCPUBackend's arena (puts being submitted, gets) and
        every put and get in flight (their callbacks run), then shuts the tiers down; calls
        made from then on answer as for an absent chunk (False, 0, None). Idempotent; called
        by LMCache's StorageManager.close (through LocalCPUBackend's close, before the arena is
        freed, and again as a plug-in)."""
        with self._lock_free:
            sh = self._shards
            if self._closed or sh is None:
                self._closed = True
                return
            with sh.cv:
                self._closed = True
                sh.cv.wait_for(lambda: self._active == 0)
                for tier, d, n in self._pins.values():
                    tier.unpin([d] * n)
                self._pins.clear()
        sh.drain()
        self._final_stats = self._tier_stats()  # stats() after close: the last figures
        sh.close()

    def _begin(self) -> Shards | None:
        """The shards, counting the caller as using the arena until :meth:`_end`; None once
        closed (or closing)."""
        sh = self._shards
        if sh is None or self._closed:
            return None
        with sh.cv:
            if self._closed:
                return None
            self._active += 1
        return sh

    def _end(self) -> None:
        sh = self._shards
        with sh.cv:
            self._active -= 1
            if self._active == 0:
                sh.cv.notify_all()
