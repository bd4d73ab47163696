"""The engine of a device arena: which path (:func:`choose_path`) and its engine
(:func:`device_engine`). Called by :meth:`pykvtier.tier.DiskTier.set_arena` for a CUDA arena.

Paths: ``gds`` (the gds engine, ``pykvtier._gds``: cuFile reads straight into GPU memory, block
headers checked on the host, payload checksums by a CUDA kernel), ``bounce`` (the host engine into
a pinned bounce arena, then copies: :class:`pykvtier.engines.bounce.BounceEngine`),
``kvikio-compat`` (the gds engine in kvikio's compatibility mode: POSIX reads into kvikio's pinned
buffers, then copies). ``auto`` takes ``gds`` where GPUDirect Storage really works here, else
``bounce`` over io_uring, else ``kvikio-compat`` where io_uring is unavailable, else ``bounce``
over the posix engine; each choice carries its reason (:class:`PathChoice`).

The GPU-touching pieces (the status, the gds engine factory, the copier) are :data:`hooks`, so
the selection and dispatch run and are tested on machines without a GPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from .bounce import BounceEngine, TorchCopier

__all__ = ["PATHS", "DeviceOptions", "PathChoice", "choose_device_path", "choose_path", "device_engine", "hooks"]

logger = logging.getLogger("pykvtier")

PATHS = ("gds", "kvikio-compat", "bounce")


@dataclass(frozen=True)
class DeviceOptions:
    """How a tier moves blocks to and from a device arena (``DiskTier(device_path=...)`` takes one
    of these or just the path name). Checked here: ValueError naming the field.

    path: "auto", "gds", "kvikio-compat" or "bounce" (see the module docs).
    io_threads: requests in flight in the gds engine.
    checksum: where the gds engine computes payload checksums: "auto" (on the device where the
        kernel was built, else on the host), "device", "host". (Not checking them at all is
        the tier's ``verify="header"``.)
    bounce_slots: pinned host slots of the bounce path (``bounce_slots * block`` bytes pinned).
    chunk_blocks: blocks per host job of the bounce path (the copy/read overlap granularity).
    """

    path: str = "auto"
    io_threads: int = 16
    checksum: str = "auto"
    bounce_slots: int = 64
    chunk_blocks: int = 4

    def __post_init__(self) -> None:
        if self.path not in ("auto",) + PATHS:
            raise ValueError(f"unknown device_path {self.path!r}: expected 'auto', " +
                             ", ".join(repr(p) for p in PATHS))
        if self.checksum not in ("auto", "device", "host"):
            raise ValueError(f"DeviceOptions.checksum must be 'auto', 'device' or 'host', got "
                             f"{self.checksum!r}")
        for name in ("io_threads", "bounce_slots", "chunk_blocks"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"DeviceOptions.{name} must be an int >= 1, got {v!r}")

    @classmethod
    def of(cls, value: Any) -> DeviceOptions:
        """``value`` as DeviceOptions (a path name, or DeviceOptions itself). ValueError for an
        unknown path, TypeError for another type."""
        if isinstance(value, DeviceOptions):
            return value
        if isinstance(value, str):
            return cls(path=value)
        raise TypeError(f"device_path must be a str or DeviceOptions, not {type(value).__name__}")


@dataclass(frozen=True)
class PathChoice:
    """The path a device arena's loads take, and why. ``fallback``: GDS was wanted (auto) but is
    not usable here."""

    path: str
    reason: str
    fallback: bool = False


def choose_path(status: dict[str, Any], requested: str = "auto", host_engine: str = "uring") -> PathChoice:
    """The path loads into a device arena take (see the module docs). ``status``: a
    :func:`pykvtier.gpu.gds_status` dict; ``host_engine``: "uring" or "posix", the tier's host
    engine. Raises ValueError when a forced path cannot work here (the gds engine does not load)."""
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


def _default_status(root: str) -> dict[str, Any]:
    from ..gpu import gds_status

    return gds_status(root)


def _default_make_gds(io_threads: int, compat: str, checksum: str) -> Any:
    from ..gpu import load_gds_module

    module, reason = load_gds_module()
    if module is None:
        raise ValueError(f"the gds engine is unavailable: {reason}")
    return module.GdsEngine(io_threads=io_threads, compat=compat, checksum=checksum)


def _default_make_copier(arena: Any) -> Any:
    return TorchCopier(arena.owner)


@dataclass
class _Hooks:
    """The GPU-touching pieces :func:`device_engine` uses; tests replace them."""

    status: Callable[[str], dict] = _default_status  # (blocks dir) -> gds_status dict
    make_gds: Callable[[int, str, str], Any] = _default_make_gds  # (io_threads, compat, checksum)
    make_copier: Callable[[Any], Any] = _default_make_copier  # (arena) -> Copier
    announced: set = field(default_factory=set)


hooks = _Hooks()


def _announce(root: str, choice: PathChoice) -> None:
    key = (root, choice.path, choice.reason)
    if key in hooks.announced:
        return
    hooks.announced.add(key)
    level = logging.WARNING if choice.fallback else logging.INFO
    logger.log(level, "pykvtier: loads into GPU memory at %s take the %s path: %s", root, choice.path,
               choice.reason)


def choose_device_path(host: Any, options: DeviceOptions, blocks_dir: str) -> PathChoice:
    """The path for a device arena of a tier whose host engine is ``host`` and whose blocks are
    in ``blocks_dir`` (:func:`choose_path` on the status there). ValueError when a forced path
    cannot work here."""
    return choose_path(hooks.status(blocks_dir), options.path, host.name)


def device_engine(host: Any, arena: Any, options: DeviceOptions, choice: PathChoice, root: str,
                  block_size_bytes: int) -> tuple[Any, str]:
    """The engine of ``choice``'s path for the device ``arena`` (registered with it), and the
    name the tier reports for it ("bounce+uring", "bounce+posix", "gds", "kvikio-compat"); says
    once per root and choice in the log which path loads take and why. ``host``: the tier's idle
    host engine (the bounce path drives it; the gds paths leave it idle, its buffers
    unregistered). The engine returned does not own ``host``."""
    if choice.path == "bounce":
        engine: Any = BounceEngine(host, hooks.make_copier(arena), block_size_bytes,
                                   bounce_slots=options.bounce_slots, chunk_blocks=options.chunk_blocks)
        name = engine.name
    else:
        compat = "on" if choice.path == "kvikio-compat" else ("off" if options.path == "gds" else "auto")
        engine = hooks.make_gds(options.io_threads, compat, options.checksum)
        host.unregister_buffers()
        engine.register_buffer(arena.addr, arena.nbytes)
        name = choice.path
    _announce(root, choice)
    return engine, name
