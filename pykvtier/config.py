"""DiskTier's options as one validated dataclass, :class:`DiskTierConfig`.

``DiskTier(root_dir, block_size_bytes, **options)`` builds one; ``DiskTier.from_config(config)``
takes one. Each field's ``metadata`` holds its README text (``doc``) and, where the default is
not its repr, the default as the README writes it (``default_text``): :func:`options_table`
renders the README's option table from them (``python -P -m pykvtier.config README.md`` rewrites
the tables in place; tests/test_config.py checks they are current).
"""

from __future__ import annotations

import dataclasses
import numbers
import operator
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from .engines.gpu import DeviceOptions
from .layout import HEADER_BYTES, QUARANTINE_MAX_FILES, check_file_mode

__all__ = ["VERIFY_MODES", "DiskTierConfig", "options_table"]

VERIFY_MODES = ("payload", "header")
MAX_BLOCK_BYTES = 1 << 30  # the engines' per-request limit (kMaxRequestBytes)
MAX_INFLIGHT_BYTES = 1 << 48  # a bound the engines' uint64 byte budgets never overflow at
MAX_SPACE_BYTES = 1 << 62  # capacity_bytes, min_free_bytes: block counts stay C integers
ENGINES = ("auto", "uring", "posix")


def as_int(v: Any, what: str) -> int:
    """An integer (int, numpy integer...), never a float, str or bool; TypeError otherwise."""
    if isinstance(v, bool):
        raise TypeError(f"{what} must be an integer, not bool")
    try:
        return operator.index(v)
    except TypeError:
        raise TypeError(f"{what} must be an integer, not {type(v).__name__}") from None


def check_verify(v: Any, what: str = "verify") -> str:
    """``v`` as a verify mode ("payload" or "header"); ValueError naming ``what`` else."""
    if v not in VERIFY_MODES:
        raise ValueError(f"{what} must be 'payload' or 'header', got {v!r}")
    return v


def _opt(default: Any, doc: str, default_text: str | None = None, **kw: Any) -> Any:
    meta = {"doc": doc} if default_text is None else {"doc": doc, "default_text": default_text}
    return field(default=default, metadata=meta, **kw)


@dataclass(frozen=True)
class DiskTierConfig:
    """Every option of :class:`~pykvtier.tier.DiskTier` (see each field's ``doc``), checked
    here: TypeError for a value of the wrong type, ValueError for one out of range, each naming
    the option, before anything on disk is touched. Fields hold the normalized values (ints,
    a float ``probe_ttl_s``, DeviceOptions ``device_path``)."""

    root_dir: str | os.PathLike = field(metadata={
        "doc": "directory of the tier (created if missing); several processes may share it "
               "(`shared=True`)", "default_text": "required"})
    block_size_bytes: int = field(metadata={
        "doc": "payload bytes per block (2 MiB = 16 tokens of Llama-3-8B bf16), 1 .. 1 GiB; a "
               "block file is this plus a 4096-byte header", "default_text": "required"})
    capacity_bytes: int | None = _opt(
        None, "limit on block-file bytes; least recently used blocks are evicted (never one "
              "being read); `None`: what the file system holds, less `min_free_bytes`")
    min_free_bytes: int | None = _opt(
        None, "free space kept on the root's file system: a store that would go below it evicts "
              "least recently used blocks first, or fails when none can be evicted; `None`: 5 % "
              "of the file system")
    shared: bool = _opt(
        False, "the root is shared with other processes: keys the index does not know are "
               "probed asynchronously (RETRY meanwhile) instead of answered MISS")
    direct: bool | None = _opt(
        None, "O_DIRECT; `None` (or `\"auto\"`): where the file system accepts it (a buffered "
              "fallback is logged and counted in `stats()[\"direct_fallbacks\"]`)")
    queue_depth: int = _opt(64, "block requests in flight in the engine, 1 .. 4096")
    max_inflight_bytes: int = _opt(256 << 20, "payload bytes in flight in the engine",
                                   "256 MiB")
    store_share: float = _opt(
        0.5, "share of the engine's `queue_depth` and `max_inflight_bytes` that stores (and "
             "unlinks) may hold, in (0, 1]: loads are issued first, but wait at the device behind "
             "the stores already issued; less cuts load latency under a store burst and store "
             "GB/s with it (BENCHMARKS.md, \"Loads behind stores\")")
    probe_ttl_s: float = _opt(1.0, "seconds a probe's \"not found\" stays a MISS (`shared`)")
    fsync: bool = _opt(
        False, "durable stores: each block file fdatasync'ed before its rename, each directory "
               "renamed into fsync'ed (once per job) before the job is reported; turns `recycle` "
               "off")
    engine: str = _opt("auto", "`uring` (fio's `io_uring` too), `posix`, or `auto` (io_uring "
                               "where the kernel allows it, else posix, logged)")
    device_path: Any = _opt(
        "auto", "for a CUDA arena: `auto`, `gds`, `kvikio-compat`, `bounce`, or a "
                "`pykvtier.gpu.DeviceOptions` (see GPU)")
    track_removals: bool = _opt(
        False, "remember the digests of blocks that stop being loadable for `take_removed()`")
    recycle: bool = _opt(
        True, "a store that needs room takes over the evicted block's file instead of unlinking "
              "it and creating one; never with `shared`, `fsync` or device arenas")
    mode: int = _opt(0o600, "permission bits of the files the tier creates (an int, or octal "
                            "digits as chmod takes them: `\"640\"`); its directories get the "
                            "matching x bits (0o640 -> 0o750). Within 0o666, owner read and write "
                            "set", "`0o600`")
    quarantine_max_files: int = _opt(
        QUARANTINE_MAX_FILES, "entries kept in `ROOT/quarantine/`; the oldest are removed "
                              "past it")
    verify: str = _opt(
        "payload", "what a load checks: `payload` (header, key digest, length and the "
                   "payload's XXH3-64) or `header` (all but the payload checksum, which stores "
                   "then do not compute: for file systems with data checksums, e.g. btrfs, ZFS)")

    def __post_init__(self) -> None:
        set_ = object.__setattr__.__get__(self)  # (frozen: the normalized values go in once)
        if not isinstance(self.root_dir, (str, os.PathLike)):
            raise TypeError(f"root_dir must be a str or os.PathLike, not "
                            f"{type(self.root_dir).__name__}")
        bs = as_int(self.block_size_bytes, "block_size_bytes")
        if not 1 <= bs <= MAX_BLOCK_BYTES:
            raise ValueError(f"block_size_bytes must be a positive int <= {MAX_BLOCK_BYTES} (the "
                             f"engines' per-request limit), got {bs}")
        set_("block_size_bytes", bs)
        for name in ("capacity_bytes", "min_free_bytes"):
            v = getattr(self, name)
            if v is not None:
                set_(name, as_int(v, name))
                if getattr(self, name) > MAX_SPACE_BYTES:
                    raise ValueError(f"{name} must be at most 2**62 bytes (4 EiB), got "
                                     f"{getattr(self, name)}")
        if self.min_free_bytes is not None and self.min_free_bytes < 0:
            raise ValueError(f"min_free_bytes must be >= 0, got {self.min_free_bytes}")
        set_("queue_depth", as_int(self.queue_depth, "queue_depth"))
        if not 1 <= self.queue_depth <= 4096:
            raise ValueError(f"queue_depth must be in 1..4096, got {self.queue_depth}")
        mib = as_int(self.max_inflight_bytes, "max_inflight_bytes")
        if mib <= 0:
            raise ValueError(f"max_inflight_bytes must be positive, got {mib}")
        if mib > MAX_INFLIGHT_BYTES:
            raise ValueError(f"max_inflight_bytes must be at most 2**48 = {MAX_INFLIGHT_BYTES}, "
                             f"got {mib}")
        set_("max_inflight_bytes", mib)
        share = self.store_share
        if isinstance(share, bool) or not isinstance(share, numbers.Real):
            raise TypeError(f"store_share must be a number in (0, 1], not {type(share).__name__}")
        if not 0 < share <= 1:  # (also NaN; compared as given: float(10**400) would overflow)
            raise ValueError(f"store_share must be in (0, 1], got {share!r}")
        set_("store_share", float(share))
        ttl = self.probe_ttl_s
        if isinstance(ttl, bool) or not isinstance(ttl, numbers.Real):
            raise TypeError(f"probe_ttl_s must be a number of seconds, not {type(ttl).__name__}")
        if not float(ttl) >= 0:  # (also NaN)
            raise ValueError(f"probe_ttl_s must be >= 0 seconds, got {float(ttl)}")
        set_("probe_ttl_s", float(ttl))
        if self.direct == "auto":  # (the vLLM adapter's spelling of None)
            set_("direct", None)
        if self.direct is not None and not isinstance(self.direct, bool):
            raise ValueError(f"direct must be None ('auto'), True or False, got {self.direct!r}")
        if self.capacity_bytes is not None and self.capacity_bytes < bs + HEADER_BYTES:
            raise ValueError(f"capacity_bytes={self.capacity_bytes} cannot hold one block "
                             f"({bs + HEADER_BYTES} bytes with its header)")
        if self.engine == "io_uring":  # (fio's name of it)
            set_("engine", "uring")
        if self.engine not in ENGINES:
            raise ValueError(f"unknown engine {self.engine!r}: expected 'auto', 'uring' or 'posix'")
        set_("device_path", DeviceOptions.of(self.device_path))
        for name in ("shared", "fsync", "recycle", "track_removals"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        set_("mode", check_file_mode(self.mode))
        set_("quarantine_max_files", as_int(self.quarantine_max_files, "quarantine_max_files"))
        if self.quarantine_max_files < 0:
            raise ValueError(f"quarantine_max_files must be >= 0, got {self.quarantine_max_files}")
        check_verify(self.verify)


# ---------------------------------------------------------------------------- README tables

def _default_text(f: dataclasses.Field, style: str) -> str:
    text = f.metadata.get("default_text")
    if text is not None:
        return text
    v = f.default
    if style == "json":
        return "none" if v is None else "true" if v is True else "false" if v is False else (
            f"`{v}`" if isinstance(v, str) else str(v))
    return f"`{v!r}`"


def options_table(cls: type, style: str = "python") -> str:
    """The README's option table of the dataclass ``cls``: one row per field, in field order,
    with its default (``style`` "python": reprs; "json": as a JSON config writes them) and doc."""
    head = "| option | default | what |" if style == "python" else "| key | default | what |"
    rows = [head, "| --- | --- | --- |"]
    for f in dataclasses.fields(cls):
        if f.metadata.get("doc") is None:
            continue
        rows.append(f"| `{f.name}` | {_default_text(f, style)} | {f.metadata['doc']} |")
    return "\n".join(rows) + "\n"


_MARK = re.compile(r"(<!-- options of (\w+)(?: \((\w+)\))?: generated[^>]*-->\n)(.*?)(<!-- end -->)", re.S)


def _table_classes() -> dict[str, type]:
    out: dict[str, type] = {"DiskTierConfig": DiskTierConfig}
    try:
        from .integrations.vllm import PyKVTierConfig
    except ImportError:  # vLLM not installed: its table is left as it is
        pass
    else:
        out["PyKVTierConfig"] = PyKVTierConfig
    try:
        from .integrations.sglang import PyKVTierHiCacheConfig
    except ImportError:  # SGLang not installed (or not importable here): its table stays
        pass
    else:
        out["PyKVTierHiCacheConfig"] = PyKVTierHiCacheConfig
    try:
        from .integrations.lmcache import PyKVTierLMCacheConfig
    except ImportError:  # LMCache not installed: its table stays
        pass
    else:
        out["PyKVTierLMCacheConfig"] = PyKVTierLMCacheConfig
    try:
        from .integrations.lmcache_l2 import PyKVTierL2Options
    except ImportError:  # LMCache not installed: its table stays
        pass
    else:
        out["PyKVTierL2Options"] = PyKVTierL2Options
    return out


def render_tables(text: str, classes: dict[str, type] | None = None) -> str:
    """``text`` (the README) with every generated option table between its markers
    (``<!-- options of NAME[ (style)]: generated ... -->`` ... ``<!-- end -->``) rendered anew
    from the dataclass NAME; tables of classes not in ``classes`` stay as they are."""
    classes = _table_classes() if classes is None else classes

    def sub(m: re.Match) -> str:
        cls = classes.get(m.group(2))
        if cls is None:
            return m.group(0)
        return m.group(1) + options_table(cls, m.group(3) or "python") + m.group(5)

    return _MARK.sub(sub, text)


if __name__ == "__main__":  # python -P -m pykvtier.config README.md: rewrites its tables
    for path in sys.argv[1:]:
        with open(path) as fh:
            old = fh.read()
        new = render_tables(old)
        if new != old:
            with open(path, "w") as fh:
                fh.write(new)
            print(f"{path}: option tables updated")
