"""pykvtier as an LMCache multiprocess-mode L2 adapter (LMCache 0.5.6 is the reference).

LMCache's multiprocess server takes L2 adapters as ``--l2-adapter <JSON>``; this one is the
``"plugin"`` type, built by LMCache's own factory (``plugin_l2_adapter.py``) from the JSON
alone, no patch to LMCache::

    --l2-adapter '{"type": "plugin",
                   "module_path": "pykvtier.integrations.lmcache_l2",
                   "class_name": "PyKVTierL2Adapter",
                   "adapter_params": {"root_dir": ["/mnt/nvme0/kv", "/mnt/nvme1/kv"],
                                      "capacity_bytes": 1000000000000}}'

The factory finds :class:`PyKVTierL2AdapterConfig` by its name (``<class_name>Config``), builds
it from ``adapter_params`` (the fields of :class:`PyKVTierL2Options`; an unknown key is an error
naming it and listing the accepted ones) and calls
``PyKVTierL2Adapter(config, l1_memory_desc=...)``. A plain dict works too.

How it maps onto pykvtier:

- Zero copy. ``l1_memory_desc`` (LMCache's L1 arena: ``ptr``, ``size``) is registered once per
  tier as a *spanning* arena (io_uring fixed buffers; a block starts at whatever 4096-byte page
  the L1 allocator gave the object): an object moves from and into its own L1 memory by address,
  O_DIRECT where the file system takes it, no copy in either direction. An object outside the
  arena, not 4096-aligned, or whose physical size is smaller than its block cannot move that
  way: its key fails (store: the task is reported failed; load: its bit is false), logged and
  counted (``stats()["stores_refused"]``, ``["loads_refused"]``); without ``l1_memory_desc``
  the adapter is not built (ValueError).
- Namespaces. Blocks live in ``ROOT/pykvtier-lmcache-l2/<model>_<hash>/`` (``config.json``
  beside), one namespace per model *and object size* (the logical byte size of the objects,
  ``MemoryObj.get_size()``; a block is that rounded up to 4096): the first store of a model at
  a size creates it; a load reads only from the namespace of its object's size, so an object
  never comes back with another length; a lookup asks every namespace of the key's model. At
  construction the namespaces already on the roots are opened (their index rebuilt from the
  files), so a restarted server finds its blocks; on ``shared`` roots, lookups also open the
  namespaces other servers made since (looked for at once for a model it has none of, else
  at most once per ``probe_ttl_s``: a new object size of a known model waits that long).
- Keys: ``model@<kv_rank %08x>@<group %x>@<chunk_hash hex>[@<cache_salt>]`` as bytes.
- Lookup-and-lock pins each block found (``DiskTier.pin``): eviction and ``delete`` never take
  it until as many ``submit_unlock`` calls. Loads verify each block (header, key digest,
  length, checksum); a block that fails is quarantined and its bit is false, the others true.
- Threads: LMCache's store and prefetch controllers call from their threads. Each namespace's
  DiskTiers sit behind one :class:`~pykvtier.integrations.shards.Shards` (every DiskTier call
  under its lock, none waiting on the disk; one collector thread per root); a store's or load's
  completion is recorded and signalled on its eventfd by the collector that finishes its last
  job. A lookup is answered from the index at once (on a ``shared`` root, keys the index does
  not know are probed on a worker thread first).
- Usage: stores, deletions and evictions are reported through the base class's ``_notify_*``
  helpers (for LMCache's eviction policies and events); :meth:`get_usage` counts every block
  on disk, those found at start-up included. ``capacity_bytes`` bounds each namespace.
- No ``bypass`` (load or recompute, docs/design.md "Load or recompute"; the storage plug-in
  and the other adapters have it): a lookup here is no prefix count. LMCache's prefetch
  controller hands every L2 adapter all of a request's keys, flattened over its key groups,
  the chunks L1 holds included, and takes back one bit per key; its own load plan then picks
  the prefix, preferring L1. The keys (``ObjectKey``: model, rank, group, chunk hash) carry no
  token count or position, so the adapter cannot tell which of its hits the plan would load nor
  what recomputing them costs; a cap belongs in the controller's plan.

Importing this module imports LMCache; importing ``pykvtier`` never does.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import json
import logging
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any, ClassVar

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import AdapterUsage, L2AdapterInterface
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.platform import create_event_notifier

from ..config import DiskTierConfig
from ..layout import RootLockedError, dir_mode_of, key_digest, lock_root
from ..tier import DiskTier, LookupResult
from .options import AdapterOptions, check_root, open_namespace_tiers, opt
from .shards import Shards

__all__ = ["PyKVTierL2Adapter", "PyKVTierL2AdapterConfig", "PyKVTierL2Options",
           "object_key_bytes"]

logger = logging.getLogger("pykvtier")

_ALIGN = 4096
_WHO = "PyKVTierL2Adapter"
_DIR = "pykvtier-lmcache-l2"
_FORMAT = "pykvtier-lmcache-l2"
#: Answers of a stored, loadable block (HIT_PENDING: being read, or pinned).
_STORED = (LookupResult.HIT, LookupResult.HIT_PENDING)


@dataclass(frozen=True)
class PyKVTierL2Options(AdapterOptions):
    """The adapter's options: the keys of ``adapter_params``. Checked before any root is
    touched (ValueError naming the option)."""

    _who: ClassVar[str] = _WHO

    capacity_bytes: int | None = opt(
        None, "block-file bytes of each namespace (one model at one object size), split evenly "
              "over the roots; least recently used blocks are evicted (never a locked one)")
    shared: bool = opt(
        False, "the roots are shared with other LMCache servers: blocks the index does not know "
               "are probed (lookups then complete on a worker thread)")
    fsync: bool = opt(False, "durable stores: each block file fdatasync'ed, each directory "
                             "fsync'ed once per batch, before the store task completes")


class PyKVTierL2AdapterConfig(L2AdapterConfigBase):
    """What LMCache's plugin factory builds from ``adapter_params`` (found by its name,
    ``PyKVTierL2Adapter`` + ``Config``): ``options``, a :class:`PyKVTierL2Options`."""

    def __init__(self, options: PyKVTierL2Options) -> None:
        self.options = options

    @classmethod
    def from_dict(cls, d: dict) -> PyKVTierL2AdapterConfig:
        """The options in ``d`` (``adapter_params``); ValueError naming an unknown key (and
        listing the accepted ones), a missing ``root_dir``, or a bad value."""
        if not isinstance(d, dict):
            raise ValueError(f"{_WHO}: adapter_params must be a JSON object, got {d!r}")
        names = [f.name for f in fields(PyKVTierL2Options)]
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise ValueError(
                f"{_WHO}: unknown option{'s' if len(unknown) > 1 else ''} "
                f"{', '.join(map(str, unknown))} in adapter_params; accepted: {', '.join(names)}")
        if "root_dir" not in d:
            raise ValueError(f"{_WHO}: adapter_params.root_dir is required (a directory, or a "
                             "list of directories, one per drive)")
        return cls(PyKVTierL2Options(**d))

    @classmethod
    def help(cls) -> str:
        return ("pykvtier L2 adapter (type \"plugin\", module_path "
                "\"pykvtier.integrations.lmcache_l2\", class_name \"PyKVTierL2Adapter\"); "
                "adapter_params: " + ", ".join(f.name for f in fields(PyKVTierL2Options))
                + " (root_dir required)")


def object_key_bytes(key: Any) -> bytes:
    """The block key of an LMCache ``ObjectKey``: every field, stable across processes."""
    try:
        s = (f"{key.model_name}@{int(key.kv_rank):08x}@{int(key.object_group_id):x}@"
             f"{bytes(key.chunk_hash).hex()}")
        salt = key.cache_salt
    except (AttributeError, TypeError, ValueError):
        raise TypeError(f"{_WHO}: keys must be LMCache ObjectKeys, not {type(key).__name__}") from None
    return (s + f"@{salt}" if salt else s).encode()


def _size_of(obj: Any, i: int) -> int:
    """``objects[i]``'s logical size (``MemoryObj.get_size()``); TypeError naming it when it is
    no memory object."""
    try:
        return int(obj.get_size())
    except (AttributeError, TypeError, ValueError):
        raise TypeError(f"{_WHO}: objects[{i}] must be an LMCache MemoryObj, not "
                        f"{type(obj).__name__}") from None


def namespace_name(model: str, object_bytes: int) -> str:
    """The directory name of the namespace of ``model``'s objects of ``object_bytes`` bytes."""
    h = hashlib.blake2b(json.dumps({"model_name": model, "object_bytes": object_bytes},
                                   sort_keys=True).encode(), digest_size=8).hexdigest()
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", model).strip("-")[:80]
    return f"{safe or 'model'}_{h}"


class _Namespace:
    """One model's objects of one size: its DiskTiers (one per root) behind one Shards, and
    what the adapter keeps about them (guarded by ``shards.cv``)."""

    def __init__(self, model: str, object_bytes: int, shards: Shards, dirs: list[str]) -> None:
        self.model = model
        self.object_bytes = object_bytes
        self.block_bytes = -(-object_bytes // _ALIGN) * _ALIGN
        self.shards = shards
        self.dirs = dirs
        self.pins: dict[bytes, tuple[DiskTier, bytes, int]] = {}  # block key -> (tier, digest, n)
        self.putting: set[bytes] = set()  # block keys being stored
        self.known: dict[bytes, tuple[Any, int]] = {}  # digest -> (ObjectKey, size) we stored

    def take_removed(self) -> list[tuple[Any, int]]:
        """The (key, size) of the blocks we stored that stopped being loadable since the last
        call (evicted, deleted, failed a load). Call holding ``shards.cv``."""
        out = []
        for t in self.shards.tiers:
            for d in t.take_removed():
                ks = self.known.pop(d, None)
                if ks is not None:
                    out.append(ks)
        return out


class _Task:
    """A store or load task: its parts (one per namespace, plus the submitter's own) and what
    they found. Guarded by the adapter's ``_lock``."""

    __slots__ = ("tid", "left", "ok", "nbytes", "bitmap")

    def __init__(self, tid: int, bitmap: Any = None) -> None:
        self.tid = tid
        self.left = 1  # the submitter's own part: done when every part was submitted
        self.ok = True
        self.nbytes = 0
        self.bitmap = bitmap


class PyKVTierL2Adapter(L2AdapterInterface):
    """LMCache L2 adapter on local NVMe (or any POSIX file system), through pykvtier.

    Built by LMCache's plugin factory as ``PyKVTierL2Adapter(config, l1_memory_desc=...)``
    (``config``: a :class:`PyKVTierL2AdapterConfig`, or the ``adapter_params`` dict).
    Semantics as LMCache's ``L2AdapterInterface``; every method is thread-safe and none waits
    on the disk:

    - :meth:`submit_store_task` returns a task id at once; keys already stored or being stored
      are skipped (they count as stored); once every block is in place the task's
      ``L2StoreResult`` (bytes newly written, or failure when any key was refused or failed)
      is ready for :meth:`pop_completed_store_tasks` and the store eventfd is signalled.
    - :meth:`submit_lookup_and_lock_task`: bit i set when key i is stored here, and then
      pinned; :meth:`submit_unlock` releases one pin per key (unknown keys ignored).
    - :meth:`submit_load_task` reads each key's block into its object (the caller's L1 memory,
      valid until the result is taken); bit i false for a key absent, failing verification
      (quarantined, then absent), of another size, or whose object cannot be moved by
      address.
    - :meth:`delete` removes blocks (not locked or being read ones), listeners told.
    - :meth:`close` waits for every task in flight (its result recorded, its eventfd
      signalled), releases the pins and shuts the tiers down; submits then raise RuntimeError.

    Errors at construction (ValueError): bad options, no ``l1_memory_desc`` or one that is not
    4096-aligned, a root that is not a writable directory, or a namespace in use by another
    process (non-``shared``).
    """

    def __init__(self, config: PyKVTierL2AdapterConfig | dict, l1_memory_desc: Any = None) -> None:
        if isinstance(config, dict):
            config = PyKVTierL2AdapterConfig.from_dict(config)
        if not isinstance(config, PyKVTierL2AdapterConfig):
            raise TypeError(f"{_WHO}: config must be a PyKVTierL2AdapterConfig or a dict, not "
                            f"{type(config).__name__}")
        opts = config.options
        super().__init__(max_capacity_bytes=opts.capacity_bytes or 0)
        self.options = opts
        self._lock = threading.Lock()  # leaf lock: task results, counts
        self._ns_lock = threading.Lock()  # namespace creation (never taken holding another)
        self._state = threading.Condition(threading.Lock())  # closed, active calls
        self._closed = False
        self._active = 0
        self._ids = itertools.count()
        self._namespaces: dict[tuple[str, int], _Namespace] = {}
        self._by_model: dict[str, list[_Namespace]] = {}
        self._store_results: dict[int, L2StoreResult] = {}
        self._lookup_results: dict[int, Any] = {}
        self._load_results: dict[int, Any] = {}
        self.counts = dict.fromkeys(
            ("stores_zero_copy", "stores_skipped_present", "stores_failed", "stores_refused",
             "lookups_hit", "lookups_missed", "loads_hit", "loads_failed", "loads_refused",
             "deletes"), 0)
        self._root_locks: list[Any] = []  # layout.RootLock of each root's adapter directory
        self._start(l1_memory_desc)
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        self._worker = (ThreadPoolExecutor(1, thread_name_prefix="pykvtier-l2-lookup")
                        if opts.shared else None)
        self._scanned = time.monotonic()

    # ------------------------------------------------------------------ start-up

    def _start(self, desc: Any) -> None:
        opts = self.options
        if desc is None:
            raise ValueError(f"{_WHO}: built without l1_memory_desc: it moves objects by address "
                             "within LMCache's L1 arena (LMCache's MP server passes it; call "
                             "create_l2_adapter(config, l1_memory_desc))")
        ptr, size = int(desc.ptr), int(desc.size)
        if ptr % _ALIGN or size < _ALIGN:
            raise ValueError(f"{_WHO}: LMCache's L1 arena at {ptr:#x} ({size} bytes) is not "
                             f"{_ALIGN}-byte aligned: pykvtier moves objects by address with "
                             "O_DIRECT")
        align = int(getattr(desc, "align_bytes", _ALIGN) or 0)
        if align % _ALIGN:
            logger.warning("pykvtier: LMCache's L1 allocator aligns objects to %d bytes; objects "
                           "not on a %d-byte boundary are refused (keep the L1 align_bytes at "
                           "4096 or a multiple)", align, _ALIGN)
        self._arena = (ctypes.c_ubyte * size).from_address(ptr)
        self._arena_addr, self._arena_end = ptr, ptr + size
        self._tier_opts = dict(opts.disk_tier_options(opts.shared), track_removals=True)
        try:  # every DiskTier option checked before any root is touched
            DiskTierConfig(opts.root_dir[0], _ALIGN, **self._tier_opts)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{_WHO}: {exc}") from exc
        for root in opts.root_dir:
            check_root(_WHO, root)
        # The roots' adapter directories are held from start (their namespaces are opened
        # lazily, each locked by its tiers): a second unshared adapter is refused here, not at
        # its first store.
        for root in opts.root_dir:
            parent = os.path.join(root, _DIR)
            try:
                os.makedirs(parent, mode=dir_mode_of(opts.mode), exist_ok=True)
                self._root_locks.append(lock_root(parent, opts.shared, file_mode=opts.mode))
            except RootLockedError as exc:
                self._release_roots()
                raise ValueError(
                    f"{_WHO}: root {root!r} is in use by pid "
                    f"{', '.join(map(str, exc.holders)) or 'unknown'}: {parent} is locked. Give "
                    "each LMCache server its own root_dir, or set shared: true on every "
                    "instance that shares it on purpose") from exc
            except (OSError, ValueError) as exc:
                self._release_roots()
                raise ValueError(f"{_WHO}: root {root!r}: {exc}") from exc
        found: set[tuple[str, int]] = set()
        for root in opts.root_dir:
            found.update(self._scan(os.path.join(root, _DIR)))
        try:
            for model, nbytes in sorted(found):
                self._open(model, nbytes)
        except BaseException:
            self._shutdown_namespaces()
            self._release_roots()
            raise
        logger.info("pykvtier: LMCache L2 adapter on %s: %d namespace(s) found, L1 arena of %d "
                    "bytes", ", ".join(opts.root_dir), len(found), size)

    @staticmethod
    def _scan(parent: str) -> list[tuple[str, int]]:
        """(model, object bytes) of the namespaces in ``parent`` (their config.json)."""
        out = []
        try:
            names = sorted(os.listdir(parent))
        except FileNotFoundError:
            return out
        for name in names:
            if name.startswith("."):  # (the adapter directory's lock file)
                continue
            try:
                with open(os.path.join(parent, name, "config.json")) as f:
                    cfg = json.load(f)
                model, nbytes = cfg["model_name"], cfg["object_bytes"]
                if (cfg.get("format") != _FORMAT or not isinstance(model, str)
                        or type(nbytes) is not int or nbytes <= 0):
                    raise ValueError("not a pykvtier L2 namespace")
                if namespace_name(model, nbytes) != name:
                    raise ValueError("its name is not its config's")
            except FileNotFoundError:
                continue
            except (OSError, ValueError, KeyError, TypeError) as exc:
                logger.warning("pykvtier: %s skipped: %s", os.path.join(parent, name), exc)
                continue
            out.append((model, nbytes))
        return out

    def _open(self, model: str, object_bytes: int) -> _Namespace:
        """The namespace of ``model``'s objects of ``object_bytes`` bytes on every root, made
        if missing (call holding ``_ns_lock``, or from the constructor)."""
        ns_key = (model, object_bytes)
        have = self._namespaces.get(ns_key)
        if have is not None:
            return have
        name = namespace_name(model, object_bytes)
        block = -(-object_bytes // _ALIGN) * _ALIGN
        meta = {"model_name": model, "object_bytes": object_bytes, "block_bytes": block}
        tiers, dirs = open_namespace_tiers(_WHO, self.options.root_dir, _DIR, name, meta, block,
                                           self._tier_opts, self._arena, spanning=True,
                                           instance="LMCache server")
        short = re.sub(r"[^A-Za-z0-9]+", "-", model)[-24:]
        space = _Namespace(model, object_bytes, Shards(tiers, f"lmcache-l2-{short}"), dirs)
        self._namespaces[ns_key] = space
        self._by_model[model] = [*self._by_model.get(model, []), space]
        logger.info("pykvtier: LMCache L2 namespace %s: %r, %d-byte objects (%s)", name, model,
                    object_bytes, "O_DIRECT" if tiers[0].direct else "buffered")
        return space

    def _namespace_for_store(self, model: str, object_bytes: int) -> _Namespace:
        space = self._namespaces.get((model, object_bytes))
        if space is not None:
            return space
        with self._ns_lock:
            return self._open(model, object_bytes)

    def _spaces(self, model: str) -> list[_Namespace]:
        return self._by_model.get(model, [])  # (a list replaced, never mutated: safe to read)

    def _slot(self, space: _Namespace, obj: Any) -> int | None:
        """The arena slot (page) of a memory object that moves by address into or from a block
        of ``space``, else None."""
        try:
            addr = int(obj.data_ptr)
            phys = int(obj.get_physical_size())
        except (AttributeError, TypeError, NotImplementedError):
            return None
        if (addr % _ALIGN or addr < self._arena_addr
                or addr + space.block_bytes > self._arena_end or phys < space.block_bytes):
            return None
        return (addr - self._arena_addr) // _ALIGN

    # ------------------------------------------------------------------ calls in and out

    def _begin(self) -> int:
        """A new task id, the caller counted as active until :meth:`_end`; RuntimeError once
        closed."""
        with self._state:
            if self._closed:
                raise RuntimeError(f"{_WHO} is closed")
            self._active += 1
        with self._lock:
            return next(self._ids)

    def _end(self) -> None:
        with self._state:
            self._active -= 1
            if self._active == 0:
                self._state.notify_all()

    def _count(self, **n: int) -> None:
        with self._lock:
            for k, v in n.items():
                self.counts[k] += v

    # ------------------------------------------------------------------ event fds

    def get_store_event_fd(self) -> int:
        return self._store_efd.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookup_efd.fileno()

    def get_load_event_fd(self) -> int:
        return self._load_efd.fileno()

    # ------------------------------------------------------------------ store

    def submit_store_task(self, keys: list[Any], objects: list[Any]) -> int:
        """Stores ``objects[i]`` under ``keys[i]``, asynchronously (see the class)."""
        keys, objects = list(keys), list(objects)
        if len(keys) != len(objects):
            raise ValueError(f"{_WHO}: {len(keys)} keys but {len(objects)} memory objects")
        bks = [object_key_bytes(k) for k in keys]
        sizes = [_size_of(o, i) for i, o in enumerate(objects)]  # (before a task id is taken)
        tid = self._begin()
        task = _Task(tid)
        try:
            parts: dict[int, tuple[_Namespace, list[bytes], list[int], list[Any]]] = {}
            refused = 0
            for key, bk, obj, nbytes in zip(keys, bks, objects, sizes):
                try:
                    space = self._namespace_for_store(key.model_name, nbytes)
                except ValueError as exc:
                    logger.warning("pykvtier: LMCache L2 store of %s refused: %s", key, exc)
                    refused += 1
                    continue
                slot = self._slot(space, obj)
                if slot is None:
                    logger.warning("pykvtier: LMCache L2 store of %s refused: its object (at "
                                   "%#x, %d bytes) is not a %d-aligned object of the L1 arena",
                                   key, int(obj.data_ptr), int(obj.get_physical_size()), _ALIGN)
                    refused += 1
                    continue
                _, pb, ps, pk = parts.setdefault(id(space), (space, [], [], []))
                pb.append(bk)
                ps.append(slot)
                pk.append(key)
            if refused:
                task.ok = False
                self._count(stores_refused=refused)
            for space, pb, ps, pk in parts.values():
                self._submit_store(task, space, pb, ps, pk)
        finally:
            self._part_done(task, is_store=True)
            self._end()
        return tid

    def _submit_store(self, task: _Task, space: _Namespace, bks: list[bytes], slots: list[int],
                      keys: list[Any]) -> None:
        sh = space.shards
        todo_b, todo_s, todo_k = [], [], []
        with sh.cv:
            answers = sh.lookup(bks)
            for bk, slot, key, a in zip(bks, slots, keys, answers):
                if bk in space.putting or a in _STORED:
                    continue  # stored, being stored, or given twice
                space.putting.add(bk)
                todo_b.append(bk)
                todo_s.append(slot)
                todo_k.append(key)
        skipped = len(bks) - len(todo_b)
        if skipped:
            self._count(stores_skipped_present=skipped)
        if not todo_b:
            return
        with self._lock:
            task.left += 1

        sh.submit(todo_b, todo_s, False,
                  lambda ok: self._stored(task, space, todo_b, todo_k, ok))

    def _stored(self, task: _Task, space: _Namespace, bks: list[bytes],
                keys: list[Any], ok: dict[bytes, bool]) -> None:
        """A store part's completion (on a collector thread)."""
        size = space.object_bytes
        stored = [k for bk, k in zip(bks, keys) if ok[bk]]
        with space.shards.cv:
            for bk, key in zip(bks, keys):
                space.putting.discard(bk)
                if ok[bk]:
                    space.known[key_digest(bk)] = (key, size)
            removed = space.take_removed()
        failed = len(bks) - len(stored)
        self._count(stores_zero_copy=len(stored), stores_failed=failed)
        if stored:
            self._notify_keys_stored(stored, [size] * len(stored))
        self._notify_removed(removed)
        with self._lock:
            task.nbytes += size * len(stored)
            if failed:
                task.ok = False
        self._part_done(task, is_store=True)

    def pop_completed_store_tasks(self) -> dict[int, L2StoreResult]:
        with self._lock:
            out, self._store_results = self._store_results, {}
        return out

    # ------------------------------------------------------------------ task completion

    def _part_done(self, task: _Task, is_store: bool) -> None:
        """One part of ``task`` finished; the last one records the task's result and signals
        its eventfd."""
        with self._lock:
            task.left -= 1
            if task.left:
                return
            tid = task.tid
            if is_store:
                self._store_results[tid] = L2StoreResult(task.ok, task.nbytes)
            else:
                self._load_results[tid] = task.bitmap
        (self._store_efd if is_store else self._load_efd).notify()

    # ------------------------------------------------------------------ lookup and lock

    def submit_lookup_and_lock_task(self, keys: list[Any], group_layout_descs: Any = None) -> int:
        """Looks ``keys`` up and pins those stored here; the bitmap is ready at once (on a
        ``shared`` root, once the unknown keys' probes completed)."""
        keys = list(keys)
        bks = [object_key_bytes(k) for k in keys]
        tid = self._begin()
        try:
            if self._worker is not None:
                self._active_for_worker()
                self._worker.submit(self._lookup_on_worker, tid, keys, bks)
            else:
                self._lookup_done(tid, self._lookup_lock(keys, bks, settle=False))
        finally:
            self._end()
        return tid

    def _active_for_worker(self) -> None:
        with self._state:
            self._active += 1

    def _lookup_on_worker(self, tid: int, keys: list[Any], bks: list[bytes]) -> None:
        try:
            try:
                # a model with no namespace here yet: look at once (another server may have
                # just made it), else at most once per probe_ttl_s
                self._rescan(force=any(k.model_name not in self._by_model for k in keys))
                bitmap = self._lookup_lock(keys, bks, settle=True)
            except Exception:
                logger.exception("pykvtier: LMCache L2 lookup failed; answered absent")
                bitmap = Bitmap(len(keys))
            self._lookup_done(tid, bitmap)
        finally:
            self._end()  # (after the eventfd is signalled: close() waits for it)

    def _rescan(self, force: bool = False) -> None:
        """``shared`` roots: opens the namespaces other servers made since the last look (at
        most once per ``probe_ttl_s`` unless ``force``; on the lookup worker thread)."""
        now = time.monotonic()
        if not force and now - self._scanned < self.options.probe_ttl_s:
            return
        self._scanned = now
        found: set[tuple[str, int]] = set()
        for root in self.options.root_dir:
            found.update(self._scan(os.path.join(root, _DIR)))
        for ns_key in sorted(found - set(self._namespaces)):
            with self._ns_lock:
                try:
                    self._open(*ns_key)
                except ValueError as exc:
                    logger.warning("pykvtier: LMCache L2 namespace of %r not opened: %s",
                                   ns_key[0], exc)

    def _lookup_done(self, tid: int, bitmap: Any) -> None:
        with self._lock:
            self._lookup_results[tid] = bitmap
            n = bitmap.popcount()
            self.counts["lookups_hit"] += n
            self.counts["lookups_missed"] += bitmap.size() - n
        self._lookup_efd.notify()

    def _lookup_lock(self, keys: list[Any], bks: list[bytes], settle: bool) -> Any:
        bitmap = Bitmap(len(keys))
        by_model: dict[str, list[int]] = {}
        for i, k in enumerate(keys):
            by_model.setdefault(k.model_name, []).append(i)
        for model, idxs in by_model.items():
            for space in self._spaces(model):
                if not idxs:
                    break
                sh = space.shards
                sub = [bks[i] for i in idxs]
                left = []
                with sh.cv:
                    answers = sh.lookup(sub)
                    if settle and LookupResult.RETRY in answers:
                        answers = sh.settle(sub, answers)
                    for i, bk, a in zip(idxs, sub, answers):
                        if a in _STORED and self._pin(space, bk):
                            bitmap.set(i)
                        else:
                            left.append(i)
                idxs = left
        return bitmap

    def _pin(self, space: _Namespace, bk: bytes) -> bool:
        """Pins block ``bk`` of ``space`` once more (call holding its cv)."""
        held = space.pins.get(bk)
        if held is not None:
            tier, d, n = held
        else:
            (tier, d), n = space.shards.tier_of(bk), 0
        if not tier.pin([d])[0]:
            return False
        space.pins[bk] = (tier, d, n + 1)
        return True

    def query_lookup_and_lock_result(self, task_id: int) -> Any:
        with self._lock:
            return self._lookup_results.pop(task_id, None)

    def submit_unlock(self, keys: list[Any]) -> None:
        """Releases one lookup's pin of each key (keys never locked, or unlocked already, are
        ignored). Never fails, never waits on the disk."""
        for key in keys:
            try:
                bk = object_key_bytes(key)
                for space in self._spaces(key.model_name):
                    with space.shards.cv:
                        held = space.pins.pop(bk, None)
                        if held is None:
                            continue
                        tier, d, n = held
                        if n > 1:
                            space.pins[bk] = (tier, d, n - 1)
                        tier.unpin([d])
                        break
            except Exception:  # (the caller never retries: log and go on)
                logger.exception("pykvtier: LMCache L2 unlock of %r failed", key)

    # ------------------------------------------------------------------ load

    def submit_load_task(self, keys: list[Any], objects: list[Any]) -> int:
        """Reads each key's block into ``objects[i]``, asynchronously (see the class)."""
        keys, objects = list(keys), list(objects)
        if len(keys) != len(objects):
            raise ValueError(f"{_WHO}: {len(keys)} keys but {len(objects)} memory objects")
        bks = [object_key_bytes(k) for k in keys]
        tid = self._begin()
        task = _Task(tid, Bitmap(len(keys)))
        try:
            parts: dict[int, tuple[_Namespace, list[bytes], list[int], list[int]]] = {}
            refused = missed = 0
            seen: set[bytes] = set()
            for i, (key, bk, obj) in enumerate(zip(keys, bks, objects)):
                try:
                    nbytes = int(obj.get_size())
                except (AttributeError, TypeError):
                    nbytes = -1
                space = self._namespaces.get((key.model_name, nbytes))
                if space is None or bk in seen:
                    missed += 1  # no block of this object's size (or the key given twice)
                    continue
                slot = self._slot(space, obj)
                if slot is None:
                    refused += 1
                    logger.warning("pykvtier: LMCache L2 load of %s refused: its object is not a "
                                   "%d-aligned object of the L1 arena", key, _ALIGN)
                    continue
                seen.add(bk)
                _, pb, ps, pi = parts.setdefault(id(space), (space, [], [], []))
                pb.append(bk)
                ps.append(slot)
                pi.append(i)
            self._count(loads_refused=refused, loads_failed=missed)
            for space, pb, ps, pi in parts.values():
                with self._lock:
                    task.left += 1
                space.shards.submit(
                    pb, ps, True,
                    lambda ok, space=space, pb=pb, pi=pi: self._loaded(task, space, keys, pb, pi, ok))
        finally:
            self._part_done(task, is_store=False)
            self._end()
        return tid

    def _loaded(self, task: _Task, space: _Namespace, keys: list[Any], bks: list[bytes],
                idxs: list[int], ok: dict[bytes, bool]) -> None:
        """A load part's completion (on a collector thread)."""
        hit = [i for bk, i in zip(bks, idxs) if ok[bk]]
        with space.shards.cv:
            removed = space.take_removed()  # (blocks that failed verification among them)
        self._count(loads_hit=len(hit), loads_failed=len(bks) - len(hit))
        if hit:
            self._notify_keys_accessed([keys[i] for i in hit])
        self._notify_removed(removed)
        with self._lock:
            for i in hit:
                task.bitmap.set(i)
        self._part_done(task, is_store=False)

    def query_load_result(self, task_id: int) -> Any:
        with self._lock:
            return self._load_results.pop(task_id, None)

    # ------------------------------------------------------------------ delete, usage, status

    def delete(self, keys: list[Any]) -> None:
        """Removes the blocks of ``keys`` (their files unlinked asynchronously); a locked block
        or one being read stays. Listeners are told of the removed keys we stored."""
        with self._state:
            if self._closed:
                return
            self._active += 1
        try:
            touched: dict[int, _Namespace] = {}
            n = 0
            for key in keys:
                bk = object_key_bytes(key)
                for space in self._spaces(key.model_name):
                    with space.shards.cv:
                        if bk in space.pins:
                            continue
                        tier, d = space.shards.tier_of(bk)
                        if tier.remove([d])[0]:
                            n += 1
                            touched[id(space)] = space
            self._count(deletes=n)
            for space in touched.values():
                with space.shards.cv:
                    removed = space.take_removed()
                self._notify_removed(removed)
        finally:
            self._end()

    def _notify_removed(self, removed: list[tuple[Any, int]]) -> None:
        if removed:
            self._notify_keys_deleted([k for k, _ in removed], [s for _, s in removed])

    def get_usage(self) -> AdapterUsage:
        """Bytes of every block on disk (those found at start-up included: logical object
        bytes), capacity ``capacity_bytes`` per namespace (0: unbounded), and the per
        cache_salt bytes of the blocks this process stored (the base class's counts)."""
        total = 0
        spaces = list(self._namespaces.values())
        for space in spaces:
            with space.shards.cv:
                if not self._closed:
                    total += space.object_bytes * sum(t.num_blocks for t in space.shards.tiers)
        with self._usage_lock:
            salts = {k: v for k, v in self._bytes_by_cache_salt.items() if v > 0}
        return AdapterUsage(total_bytes_used=total,
                            total_capacity_bytes=self._max_capacity_bytes * max(1, len(spaces)),
                            bytes_by_cache_salt=MappingProxyType(salts))

    def report_status(self) -> dict:
        with self._lock:
            counts = dict(self.counts)
        return {"is_healthy": not self._closed, "type": _WHO,
                "namespaces": [s.dirs[0] for s in list(self._namespaces.values())], **counts}

    def stats(self) -> dict[str, int]:
        """The adapter's counts (``stores_zero_copy``, ``loads_hit``, ...)."""
        with self._lock:
            return dict(self.counts)

    # ------------------------------------------------------------------ close

    def close(self) -> None:
        """Waits for the calls and tasks in flight (their results recorded, eventfds
        signalled), releases the pins, shuts the tiers down and closes the eventfds.
        Idempotent."""
        with self._state:
            if self._closed:
                return
            self._closed = True
            self._state.wait_for(lambda: self._active == 0)
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        for space in list(self._namespaces.values()):
            space.shards.drain()
        self._shutdown_namespaces()
        self._release_roots()
        for efd in (self._store_efd, self._lookup_efd, self._load_efd):
            efd.close()

    def _release_roots(self) -> None:
        for lock in self._root_locks:
            lock.release()
        self._root_locks.clear()

    def _shutdown_namespaces(self) -> None:
        for space in list(self._namespaces.values()):
            with space.shards.cv:
                for tier, d, n in space.pins.values():
                    tier.unpin([d] * n)
                space.pins.clear()
            space.shards.close()
