"""The options every engine adapter's tiers share (SGLang HiCache, LMCache), checked once.

:class:`AdapterOptions` holds the DiskTier options an adapter passes to each root's tier, with
``root_dir`` one path or a list (one per drive) and ``capacity_bytes`` split evenly over the
roots. An adapter subclasses it (adding its own fields after these, and its name in ``_who``
for the messages); the README's option tables are generated from the subclasses' fields
(``python -P -m pykvtier.config README.md``). Importing this module imports no engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .. import __version__
from ..config import check_verify
from ..layout import RootLockedError, check_file_mode, make_namespace_dir
from ..tier import DiskTier

__all__ = ["AdapterOptions", "check_root", "open_namespace_tiers", "opt"]


def opt(default: Any, doc: str, default_text: str | None = None) -> Any:
    """A dataclass field with its README text (``doc``) and, where the default is not its repr,
    the default as the README writes it (``default_text``)."""
    meta = {"doc": doc} if default_text is None else {"doc": doc, "default_text": default_text}
    return field(default=default, metadata=meta)


def roots_of(who: str, root_dir: Any) -> list[str]:
    """``root_dir`` (a path or a non-empty list of paths) as a list of paths, ``~`` expanded;
    ValueError (prefixed ``who``) for anything else or a directory listed twice."""
    given = [root_dir] if isinstance(root_dir, (str, os.PathLike)) else root_dir
    if not isinstance(given, (list, tuple)) or not given:
        raise ValueError(f"{who}: root_dir must be a path or a non-empty list of paths "
                         f"(one per drive), got {root_dir!r}")
    roots = []
    for r in given:
        p = os.fspath(r) if isinstance(r, (str, os.PathLike)) else r
        if not isinstance(p, str) or not p or "\0" in p:
            raise ValueError(f"{who}: root_dir entry {r!r} is not a usable path")
        roots.append(os.path.expanduser(p))
    if len({os.path.realpath(r) for r in roots}) != len(roots):
        raise ValueError(f"{who}: root_dir lists a directory twice: {roots}")
    return roots


def check_root(who: str, root: str) -> None:
    """ValueError (prefixed ``who``) naming ``root`` when it (or, missing, the directory it
    would be made in) is not a writable directory; touches nothing."""
    p = os.path.abspath(root)
    while not os.path.lexists(p):
        p = os.path.dirname(p)
    if not os.path.isdir(p):
        raise ValueError(f"{who}: root {root!r}: {p} is not a directory")
    if not os.access(p, os.W_OK | os.X_OK):
        raise ValueError(f"{who}: root {root!r}: {p} is not writable (read-only file system or "
                         "permissions): root_dir must be a writable directory")


def open_namespace_tiers(who: str, roots: list[str], kind: str, name: str, meta: dict[str, Any],
                         block_bytes: int, tier_options: dict[str, Any], arena: Any, *,
                         spanning: bool = False, split: str = "",
                         instance: str = "instance") -> tuple[list[DiskTier], list[str]]:
    """One DiskTier per root, in the namespace directory ``ROOT/<kind>/<name>`` (made by
    ``make_namespace_dir``, ``config.json`` = ``{"format": kind, "pykvtier_version", **meta}``),
    each given ``arena`` (registered once: fixed buffers; ``spanning`` as
    ``DiskTier.set_arena``). Returns (tiers, namespace directories), in root order. ValueError
    prefixed ``who`` naming the root: its directory cannot be made, it is locked by another
    tier (the holders' pids, and what to do: ``instance`` names what should get its own root),
    or the tier refuses it (its message, with ``split`` after the root); the tiers already opened
    are shut down then."""
    mode = tier_options["mode"]
    tiers: list[DiskTier] = []
    dirs: list[str] = []
    try:
        for root in roots:
            parent = os.path.join(root, kind)
            ns = os.path.join(parent, name)
            try:
                make_namespace_dir(parent, ns, mode, {"format": kind,
                                                      "pykvtier_version": __version__, **meta})
            except OSError as exc:
                raise ValueError(f"{who}: root {root!r}: cannot create the {kind} directory "
                                 f"({exc.filename}: {exc.strerror})") from exc
            try:
                tier = DiskTier(ns, block_bytes, **tier_options)
            except RootLockedError as exc:
                raise ValueError(
                    f"{who}: root {root!r} is in use by pid "
                    f"{', '.join(map(str, exc.holders)) or 'unknown'}: its directory {ns} is "
                    f"locked. Give each {instance} its own root_dir, or set shared: true on "
                    "every instance that shares it on purpose") from exc
            except ValueError as exc:
                raise ValueError(f"{who}: root {root!r}{split}: {exc}") from exc
            tiers.append(tier)
            dirs.append(ns)
            tier.set_arena(arena, spanning=spanning)
    except BaseException:
        for t in tiers:
            t.shutdown()
        raise
    return tiers, dirs


@dataclass(frozen=True)
class AdapterOptions:
    """DiskTier options of an adapter's roots. Checked at construction (ValueError naming the
    option, prefixed with the adapter's name); fields hold normalized values (``root_dir``: a
    list of paths, ``direct``: None for "auto", ``mode``: an int, ``probe_ttl_s``: a float)."""

    _who: ClassVar[str] = "pykvtier"

    root_dir: Any = field(default=None, metadata={
        "doc": "a directory, or a list (one per NVMe drive); blocks are sharded across them by "
               "digest, so keep the list and its order fixed", "default_text": "required"})
    capacity_bytes: int | None = opt(
        None, "total block-file bytes of this rank, split evenly over the roots; least recently "
              "used pages are evicted (never one being read)")
    shared: bool = opt(False, "the roots are shared with other instances or nodes: blocks the "
                              "index does not know are probed")
    engine: str = opt("auto", "`uring`, `posix`, or `auto` (io_uring where the kernel allows "
                              "it, else posix, logged)")
    queue_depth: int = opt(64, "block requests in flight per root")
    max_inflight_bytes: int = opt(256 << 20, "payload bytes in flight per root", "256 MiB")
    direct: Any = opt("auto", "`true`: O_DIRECT (refused at start-up where it cannot work); "
                              "`false`: buffered; `\"auto\"`: where the file system takes it",
                      '`"auto"`')
    fsync: bool = opt(False, "durable stores: each block file fdatasync'ed, each directory "
                             "fsync'ed once per batch, before the set returns")
    mode: Any = opt(0o600, "permission bits of the files the backend creates (`\"640\"` or "
                           "`416` in JSON, `\"640\"` or `0640` in YAML: a bare 640 is the "
                           "number 640); directories get the matching x bits", "`0o600`")
    min_free_bytes: int | None = opt(
        None, "free space kept on each root's file system; `null`: 5 %", "5 % of the file system")
    probe_ttl_s: float = opt(1.0, "how long a probe's \"not found\" stays a miss (`shared`)")
    verify: str = opt("payload", "what a load checks: `payload` (header, key digest, length and "
                                 "the payload's XXH3-64) or `header` (all but the payload "
                                 "checksum, for file systems that checksum data)")

    def _bad(self, what: str) -> ValueError:
        return ValueError(f"{self._who}: {what}")

    def _positive(self, key: str) -> None:
        v = getattr(self, key)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise self._bad(f"{key} must be a positive integer, got {v!r}")

    def __post_init__(self) -> None:
        set_ = object.__setattr__.__get__(self)
        set_("root_dir", roots_of(self._who, self.root_dir))
        if self.capacity_bytes is not None:
            self._positive("capacity_bytes")
        for key in ("queue_depth", "max_inflight_bytes"):
            self._positive(key)
        ttl = self.probe_ttl_s
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl >= 0:
            raise self._bad(f"probe_ttl_s must be a number >= 0 (seconds), got {ttl!r}")
        set_("probe_ttl_s", float(ttl))
        for key in ("shared", "fsync"):
            if not isinstance(getattr(self, key), bool):
                raise self._bad(f"{key} must be true or false, got {getattr(self, key)!r}")
        direct = None if self.direct == "auto" else self.direct
        if direct is not None and not isinstance(direct, bool):
            raise self._bad(f"direct must be true, false or \"auto\", got {self.direct!r}")
        set_("direct", direct)
        try:
            set_("mode", check_file_mode(self.mode, "mode"))
            check_verify(self.verify)
        except (TypeError, ValueError) as exc:
            raise self._bad(str(exc)) from None
        v = self.min_free_bytes
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise self._bad(f"min_free_bytes must be null or an integer >= 0, got {v!r}")

    def disk_tier_options(self, shared: bool) -> dict[str, Any]:
        """The DiskTier keywords of every root's tier (capacity split over the roots)."""
        return dict(
            capacity_bytes=None if self.capacity_bytes is None
            else self.capacity_bytes // len(self.root_dir),
            shared=shared, direct=self.direct, queue_depth=self.queue_depth,
            max_inflight_bytes=self.max_inflight_bytes, probe_ttl_s=self.probe_ttl_s,
            fsync=self.fsync, engine=self.engine, mode=self.mode,
            min_free_bytes=self.min_free_bytes, verify=self.verify)
