"""GPU destinations: what the GPU paths can use here, and how loads reach a device arena.

A :class:`~pykvtier.tier.DiskTier` whose arena is a CUDA tensor loads blocks into (and stores them
from) device slots by one of three paths, chosen once per arena by :func:`choose_path` from
:func:`gds_status` and announced once in the log (see :mod:`pykvtier.engines.gpu`):

``gds``
    The gds engine (``pykvtier._gds``, C++ on libkvikio): cuFile reads straight from the file into
    GPU memory (GPUDirect Storage, NVMe -> GPU DMA). Block headers are read into host memory and
    checked there; payload checksums are checked by a CUDA kernel, one launch per job.
``bounce``
    The host engine (io_uring, or the posix engine) reads into a pinned host bounce arena, verifies
    each block there, and a side CUDA stream copies it to the device slot, chunk by chunk, so copies
    overlap the next reads (:class:`pykvtier.engines.bounce.BounceEngine`).
``kvikio-compat``
    The gds engine with kvikio's compatibility mode: POSIX reads into kvikio's pinned buffers and
    copies, from kvikio's side.

``auto`` (the default) takes ``gds`` where GPUDirect Storage really works here (the engine was
built, libcufile loads, the cuFile driver reports nvidia-fs, and kvikio registers a file at the
tier's root with cuFile), else ``bounce`` over io_uring, else ``kvikio-compat`` where io_uring is
unavailable, else ``bounce`` over the posix engine. Each decision carries its reason
(:class:`PathChoice`), which ``pykvtier doctor`` prints too.
"""

from __future__ import annotations

import ctypes
import glob
import importlib
import os
from typing import Any, Callable

from . import _native
from .engines.bounce import TorchCopier
from .engines.gpu import PATHS, DeviceOptions, PathChoice, choose_path

__all__ = [
    "DeviceOptions",
    "PATHS",
    "PathChoice",
    "TorchCopier",
    "choose_path",
    "gds_status",
    "load_gds_module",
]


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
