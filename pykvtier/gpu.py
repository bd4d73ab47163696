"""GPU destinations: device arenas, the gds engine, and the honest fallbacks.

A :class:`~pykvtier.tier.DiskTier` whose arena is a CUDA tensor loads blocks into (and stores them
from) device slots. One of three paths does the work, chosen once per arena by
:func:`choose_path` from :func:`gds_status` and announced once in the log:

``gds``
    The gds engine (``pykvtier._gds``, C++ on libkvikio): cuFile reads straight from the file into
    GPU memory (GPUDirect Storage, NVMe -> GPU DMA). Block headers are read into host memory and
    checked there; payload checksums are checked by a CUDA kernel, one launch per job.
``bounce``
    The host engine (io_uring, or the posix engine) reads into a pinned host bounce arena, verifies
    each block there, and a side CUDA stream copies it to the device slot, chunk by chunk, so copies
    overlap the next reads (:class:`pykvtier.bounce.BounceEngine`).
``kvikio-compat``
    The gds engine with kvikio's compatibility mode: POSIX reads into kvikio's pinned buffers and
    copies, from kvikio's side.

``auto`` (the default) takes ``gds`` where GPUDirect Storage really works here (the engine was
built, libcufile loads, the cuFile driver reports nvidia-fs, and kvikio registers a file at the
tier's root with cuFile), else ``bounce`` over io_uring, else ``kvikio-compat`` where io_uring is
unavailable, else ``bounce`` over the posix engine. Each decision carries its reason
(:class:`PathChoice`), which ``pykvtier doctor`` prints too.

Everything here that touches a GPU goes through injectable pieces (the status dict, the gds engine
factory, the copier), so the selection and dispatch run and are tested on machines without one.
"""

from __future__ import annotations

import ctypes
import glob
import importlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from . import _native
from .bounce import BounceEngine

__all__ = [
    "DeviceOptions",
    "GdsPathEngine",
    "PATHS",
    "PathChoice",
    "TorchCopier",
    "attach_device_arena",
    "choose_path",
    "gds_status",
    "load_gds_module",
]

logger = logging.getLogger("pykvtier")

PATHS = ("gds", "kvikio-compat", "bounce")


@dataclass
class DeviceOptions:
    """How a tier moves blocks to and from a device arena (``DiskTier(device_path=...)`` takes one
    of these or just the path name).

    path: "auto", "gds", "kvikio-compat" or "bounce" (see the module docs).
    io_threads: requests in flight in the gds engine.
    verify: the gds engine's payload checksum: "auto" (on the device where the kernel was built,
        else on the host), "device", "host", "header" (not checked; for measuring).
    bounce_slots: pinned host slots of the bounce path (``bounce_slots * block`` bytes pinned).
    chunk_blocks: blocks per host job of the bounce path (the copy/read overlap granularity).
    """

    path: str = "auto"
    io_threads: int = 16
    verify: str = "auto"
    bounce_slots: int = 64
    chunk_blocks: int = 4

    @classmethod
    def of(cls, value: Any) -> DeviceOptions:
        if isinstance(value, DeviceOptions):
            return value
        if isinstance(value, str):
            if value not in ("auto",) + PATHS:
                raise ValueError(f"unknown device_path {value!r}: expected 'auto', " +
                                 ", ".join(repr(p) for p in PATHS))
            return cls(path=value)
        raise TypeError(f"device_path must be a str or DeviceOptions, not {type(value).__name__}")


@dataclass(frozen=True)
class PathChoice:
    """The path a device arena's loads take, and why. ``fallback``: GDS was wanted (auto) but is
    not usable here."""

    path: str
    reason: str
    fallback: bool = False


# ---------------------------------------------------------------------------- the gds module

_gds_cache: dict[str, Any] = {}


def _preload_cufile() -> str | None:
    """Loads libcufile globally so that kvikio's dlopen finds it (the nvidia-cufile wheel's copy is
    not on the loader's path). Returns the path loaded, or None (then kvikio looks on its own)."""
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib  # type: ignore[import-not-found]

        lib = load_nvidia_dynamic_lib("cufile")
        return getattr(lib, "abs_path", None) or "cuda.pathfinder"
    except Exception:  # not installed, or no cufile there: search the wheels ourselves
        pass
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    for d in (spec.submodule_search_locations or []) if spec else []:
        for so in sorted(glob.glob(os.path.join(d, "*", "lib*", "libcufile.so.0"))):
            try:
                ctypes.CDLL(so, mode=ctypes.RTLD_GLOBAL)
                return so
            except OSError:
                continue
    return None


def load_gds_module(refresh: bool = False) -> tuple[Any, str]:
    """The ``pykvtier._gds`` module, or None, and a sentence saying why not (or how it loaded).

    Loads what libkvikio needs first (librapids_logger, libkvikio, libcufile from their wheels)."""
    if _gds_cache and not refresh:
        return _gds_cache["module"], _gds_cache["reason"]
    info = _native.gds_build_info()
    module, reason = None, info["reason"]
    if info["built"]:
        notes = []
        for name in ("rapids_logger", "libkvikio"):
            try:
                importlib.import_module(name).load_library()
            except ModuleNotFoundError:
                pass  # a system / conda install: the loader finds the libraries itself
            except Exception as exc:
                notes.append(f"{name}.load_library(): {exc}")
        _preload_cufile()
        try:
            module = importlib.import_module("pykvtier._gds")
            reason = f"{info['reason']}; loaded"
        except ImportError as exc:
            reason = f"built, but cannot be loaded: {exc}" + (f" ({'; '.join(notes)})" if notes else "")
    _gds_cache.update(module=module, reason=reason)
    return module, reason


_root_probes: dict[str, dict] = {}


def gds_status(root: str | os.PathLike | None = None, refresh: bool = False,
               loader: Callable[..., tuple[Any, str]] | None = None) -> dict[str, Any]:
    """What the GPU paths can use here, as a dict (stable keys; ``pykvtier doctor --json`` prints it):

    built, build_reason, build_kvikio_version: how pykvtier._gds was built.
    importable, import_reason: whether it loads now.
    kvikio_version, cufile_library, cufile_available, cufile_version, gds_available, nvfs_version,
    compat_mode_default, compat_mode_preferred, cuda_devices, cuda_error, device_verify_built,
    notes: from the engine (None / defaults where it does not load).
    root_probe: where ``root`` is given and the engine loads: would kvikio use cuFile for a file
    there (``compat`` False) or POSIX I/O (``compat`` True), and why.
    usable: GPUDirect Storage really works (for files at root, if given). reason: why (not).
    """
    info = _native.gds_build_info()
    module, import_reason = (loader or load_gds_module)(refresh=refresh) if info["built"] else (None, info["reason"])
    st: dict[str, Any] = {
        "built": bool(info["built"]),
        "build_reason": info["reason"],
        "build_kvikio_version": info["kvikio_version"] or None,
        "importable": module is not None,
        "import_reason": import_reason,
        "kvikio_version": None,
        "cufile_library": False,
        "cufile_available": False,
        "cufile_version": None,
        "gds_available": False,
        "nvfs_version": None,
        "compat_mode_default": None,
        "compat_mode_preferred": None,
        "cuda_devices": 0,
        "cuda_error": None,
        "device_verify_built": bool(info.get("device_verify_built")),
        "notes": [],
        "root_probe": None,
    }
    if module is not None:
        rt = dict(module.status())
        for k in ("kvikio_version", "cufile_library", "cufile_available", "cufile_version", "gds_available",
                  "nvfs_version", "compat_mode_default", "compat_mode_preferred", "cuda_devices",
                  "device_verify_built", "notes"):
            if k in rt:
                st[k] = rt[k]
        st["cuda_error"] = rt.get("cuda_error") or None
        if root is not None and st["cuda_devices"]:
            key = os.fspath(root)
            probe = _root_probes.get(key)
            if refresh or probe is None:
                probe = dict(module.probe_file(key))
                if os.path.isdir(key):  # (a missing folder is probed again once it exists)
                    _root_probes[key] = probe
            st["root_probe"] = probe
    st["usable"], st["reason"] = _gds_verdict(st, root)
    return st


def _gds_verdict(st: dict[str, Any], root: Any) -> tuple[bool, str]:
    if not st["built"]:
        return False, f"gds engine {st['build_reason']}"
    if not st["importable"]:
        return False, f"gds engine {st['import_reason']}"
    if not st["cuda_devices"]:
        return False, "no CUDA device visible" + (f" ({st['cuda_error']})" if st.get("cuda_error") else "")
    if not st["cufile_library"]:
        return False, "libcufile cannot be loaded (pip install nvidia-cufile, or the CUDA toolkit's GDS part)"
    if not st["cufile_available"]:
        return False, "cuFile is unusable here: /run/udev is not readable (a container without it) or WSL"
    if not st["gds_available"]:
        return False, ("the cuFile driver reports no nvidia-fs (the GDS kernel module is not loaded): "
                       "cuFile would only emulate GPUDirect Storage")
    probe = st.get("root_probe")
    if probe is not None and (not probe.get("opened") or probe.get("compat")):
        return False, f"GPUDirect Storage refused for files at {root}: {probe.get('reason')}"
    return True, (f"GPUDirect Storage usable (nvidia-fs {st['nvfs_version']}, cuFile "
                  f"{st['cufile_version']}, kvikio {st['kvikio_version']})")


def choose_path(status: dict[str, Any], requested: str = "auto", host_engine: str = "uring") -> PathChoice:
    """The path loads into a device arena take (see the module docs). ``status``: a
    :func:`gds_status` dict; ``host_engine``: "uring" or "posix", the tier's host engine.
    Raises ValueError when a forced path cannot work here (the gds engine does not load)."""
    if requested in ("gds", "kvikio-compat"):
        if not status["importable"]:
            raise ValueError(f"device_path={requested!r}, but the gds engine is unavailable: "
                             f"{status['reason']}")
        if requested == "gds":
            return PathChoice("gds", status["reason"] if status["usable"]
                              else f"requested, though {status['reason']}")
        return PathChoice("kvikio-compat", "requested: kvikio's compatibility mode (POSIX reads + copies)")
    if requested == "bounce":
        return PathChoice("bounce", f"requested: the {host_engine} engine into pinned host memory + copies")
    if requested != "auto":
        raise ValueError(f"unknown device_path {requested!r}: expected 'auto', " + ", ".join(map(repr, PATHS)))
    if status["usable"]:
        return PathChoice("gds", status["reason"])
    why = status["reason"]
    if host_engine == "uring":
        return PathChoice("bounce", f"{why}; loads take io_uring into a pinned bounce arena, then "
                                    "host-to-device copies overlapped per chunk", True)
    if status["importable"] and status["cuda_devices"]:
        return PathChoice("kvikio-compat", f"{why}; io_uring is unavailable, so loads take kvikio's "
                                           "compatibility mode (POSIX reads + copies)", True)
    return PathChoice("bounce", f"{why}; loads take the posix engine into a pinned bounce arena, then "
                                "host-to-device copies", True)


# ---------------------------------------------------------------------------- engines

class GdsPathEngine:
    """The gds engine plus the tier's former host engine (kept idle; shut down with it)."""

    def __init__(self, gds: Any, host_engine: Any) -> None:
        self.gds = gds
        self.host_engine = host_engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self.gds, name)

    def shutdown(self) -> None:
        self.gds.shutdown()
        self.host_engine.shutdown()


class TorchCopier:
    """The bounce path's copier (see :class:`pykvtier.bounce.Copier`) for a CUDA torch tensor:
    copies on a side stream of the tensor's device, one CUDA event per marked copy (per chunk)."""

    def __init__(self, device_tensor: Any) -> None:
        import torch

        self._torch = torch
        if not device_tensor.is_contiguous():
            raise ValueError("device arena is not contiguous")
        self.device = device_tensor.device
        self._dev = device_tensor.reshape(-1).view(torch.uint8)
        self._dev_base = int(device_tensor.data_ptr())
        self._dev_len = self._dev.numel()
        self.stream = torch.cuda.Stream(device=self.device)
        self._host: Any = None
        self._host_base = 0

    def alloc_host(self, nbytes: int) -> tuple[int, Any]:
        t = self._torch.empty(nbytes, dtype=self._torch.uint8, pin_memory=True)
        if t.data_ptr() % 4096:  # cudaHostAlloc memory is page-aligned; be sure anyway
            t = self._torch.empty(nbytes + 4096, dtype=self._torch.uint8, pin_memory=True)
        self._host, self._host_base = t, int(t.data_ptr())
        return self._host_base + (-self._host_base) % 4096, t

    def _views(self, dev_addr: int, host_addr: int, n: int) -> tuple[Any, Any]:
        d, h = dev_addr - self._dev_base, host_addr - self._host_base
        if not (0 <= d and d + n <= self._dev_len and 0 <= h and h + n <= self._host.numel()):
            raise ValueError(f"copy of {n} bytes outside the arenas (device offset {d}, host offset {h})")
        return self._dev[d:d + n], self._host[h:h + n]

    def fence(self) -> Any:
        ev = self._torch.cuda.Event()
        ev.record(self._torch.cuda.current_stream(self.device))
        return ev

    def _marked(self, mark: bool) -> Any:
        if not mark:
            return None
        ev = self._torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def h2d(self, dst: int, src: int, nbytes: int, mark: bool = True) -> Any:
        dev, host = self._views(dst, src, nbytes)
        with self._torch.cuda.stream(self.stream):
            dev.copy_(host, non_blocking=True)
            return self._marked(mark)

    def d2h(self, dst: int, src: int, nbytes: int, after: Any = None, mark: bool = True) -> Any:
        dev, host = self._views(src, dst, nbytes)
        with self._torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            host.copy_(dev, non_blocking=True)
            return self._marked(mark)

    def done(self, token: Any) -> bool:
        return token is None or bool(token.query())

    def wait(self, token: Any) -> None:
        if token is not None:
            token.synchronize()


@dataclass
class _Hooks:
    """What attach_device_arena uses; tests replace these to run without a GPU."""

    status: Callable[..., dict] = gds_status
    make_gds: Callable[..., Any] | None = None  # (io_threads, compat, verify) -> engine
    make_copier: Callable[[Any], Any] | None = None  # (arena) -> copier
    announced: set = field(default_factory=set)


hooks = _Hooks()


def _default_make_gds(io_threads: int, compat: str, verify: str) -> Any:
    module, reason = load_gds_module()
    if module is None:
        raise ValueError(f"the gds engine is unavailable: {reason}")
    return module.GdsEngine(io_threads=io_threads, compat=compat, verify=verify)


def _default_make_copier(arena: Any) -> Any:
    return TorchCopier(arena.owner)


def _announce(root: str, choice: PathChoice) -> None:
    key = (root, choice.path, choice.reason)
    if key in hooks.announced:
        return
    hooks.announced.add(key)
    level = logging.WARNING if choice.fallback else logging.INFO
    logger.log(level, "pykvtier: loads into GPU memory at %s take the %s path: %s", root, choice.path,
               choice.reason)


def attach_device_arena(tier: Any, arena: Any, options: Any = None) -> PathChoice:
    """Points ``tier`` at a device ``arena``: picks the path, builds its engine in place of the
    tier's host engine (which it keeps, for a later arena), registers the arena, and says once in
    the log which path loads take and why. Called by :meth:`DiskTier.set_arena`; the tier has no
    job in flight then. Evictions still in flight in the old engine are finished first."""
    opts = DeviceOptions.of(options if options is not None else getattr(tier, "_device_options", "auto"))
    old = tier._engine
    host = getattr(old, "host_engine", old)
    old.drain()
    for eid, _op, results, *_ in old.poll():  # only the tier's evictions can be here
        tier._finish_eviction(eid, results)
    host_name = "posix" if type(host).__name__ == "PosixEngine" else "uring"
    status = hooks.status(tier.layout.blocks_dir)
    choice = choose_path(status, opts.path, host_name)
    if old is not host:  # a device arena before: retire its engine, keep the host engine
        if isinstance(old, BounceEngine):
            old.detach()
        else:
            old.gds.shutdown()
    if choice.path == "bounce":
        copier = (hooks.make_copier or _default_make_copier)(arena)
        engine: Any = BounceEngine(host, copier, tier.block_size_bytes, bounce_slots=opts.bounce_slots,
                                   chunk_blocks=opts.chunk_blocks)
        tier.engine_name = f"bounce+{host_name}"
    else:
        compat = "on" if choice.path == "kvikio-compat" else ("off" if opts.path == "gds" else "auto")
        gds = (hooks.make_gds or _default_make_gds)(opts.io_threads, compat, opts.verify)
        host.unregister_buffers()
        engine = GdsPathEngine(gds, host)
        engine.register_buffer(arena.addr, arena.nbytes)
        tier.engine_name = choice.path
    tier._engine = engine
    tier.device_path = choice
    _announce(str(tier.layout.root), choice)
    return choice

