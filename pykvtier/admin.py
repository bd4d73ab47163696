"""Operators' commands on a tier's root: ``pykvtier du``, ``fsck``, ``gc``, ``quarantine``.

A tool, not part of the library (the library never imports it). Each command works on a root
made by :class:`~pykvtier.DiskTier` (``ROOT/blocks/00..ff``, ``ROOT/quarantine``) and takes the
root's lock as a tier does (:func:`pykvtier.layout.lock_root`): read-only commands (``du``,
``fsck`` without ``--repair``, listing the quarantine) a shared lock, so they run beside
``shared=True`` tiers; commands that change the root (``fsck --repair``, ``gc``,
``quarantine --empty``) an exclusive one. A root held by a running non-shared tier is refused
(exit 2, the holder's pid named).

Scans never follow symbolic links (``os.scandir``, ``follow_symlinks=False``): a link at a block
name or a fan-out directory name is reported as a non-block entry, and ``--repair`` moves the
link itself, never its target.

Functions (for scripts and tests; each returns the dict that ``--json`` prints):
:func:`disk_usage`, :func:`fsck`, :func:`gc`, :func:`quarantine_list`, :func:`quarantine_empty`.
They raise :class:`AdminError` (a ValueError naming the path) for a root they cannot use and
:class:`pykvtier.layout.RootLockedError` for a locked root.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import stat
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "AdminError",
    "Subcommand",
    "disk_usage",
    "fsck",
    "gc",
    "quarantine_list",
    "quarantine_empty",
    "du_command",
    "fsck_command",
    "gc_command",
    "quarantine_command",
    "CORRUPT_REASONS",
]

#: fsck's reasons a block file fails verification, in report order.
CORRUPT_REASONS = ("header", "key_mismatch", "length", "checksum", "short", "io_error")

_MTIME_NOTE = ("file modification times, the order a tier's eviction starts from after a "
               "restart; loads do not update them")
_ARENA_BYTES = 256 << 20  # fsck's host arena: this many bytes at most (at least one block per job)
_PAGE = 4096


class AdminError(ValueError):
    """The root cannot be used by an operators' command (the message names the path)."""


# ---------------------------------------------------------------------------- the root


@dataclass
class _BlockFile:
    path: str
    digest: bytes
    size: int
    mtime_ns: int


@dataclass
class _Scan:
    """What one walk of ``ROOT/blocks`` found (no link followed)."""

    blocks: list[_BlockFile] = field(default_factory=list)  # regular, one link, right fan-out dir
    non_block: list[tuple[str, str]] = field(default_factory=list)  # (path, what it is instead)
    temporaries: list[tuple[str, int, int]] = field(default_factory=list)  # (path, writer pid, bytes)
    other_files: list[str] = field(default_factory=list)  # names that are none of the tier's
    errors: list[tuple[str, str]] = field(default_factory=list)  # (path, why it could not be read)


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return what
    return "not a regular file"


def _is_fanout_name(name: str) -> bool:
    return len(name) == 2 and all(c in "0123456789abcdef" for c in name)


def _open_root(root: str | os.PathLike) -> str:
    """The root's real path (as Layout resolves it: ``~`` expanded as a shell would, then
    ``realpath``); AdminError unless it holds a tier's ``blocks`` directory (a real directory,
    not a link)."""
    if not os.fspath(root):
        raise AdminError("root '' is empty (it would mean the current directory)")
    path = os.path.realpath(os.path.expanduser(os.fspath(root)))
    if not os.path.isdir(path):
        why = "not a directory" if os.path.exists(path) else "no such directory"
        raise AdminError(f"root {path}: {why}")
    blocks = os.path.join(path, "blocks")
    try:
        st = os.lstat(blocks)
    except FileNotFoundError:
        raise AdminError(f"root {path}: not a pykvtier root (no blocks/ directory)") from None
    except OSError as exc:
        raise AdminError(f"root {path}: cannot read {blocks} ({exc.strerror})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise AdminError(f"root {path}: {blocks} is {_kind(st.st_mode)}, not a directory "
                         "(a DiskTier opening the root moves it aside)")
    return path


@contextlib.contextmanager
def _locked(root: str, shared: bool) -> Iterator[None]:
    """Holds the root's lock (shared or exclusive) as a tier does; RootLockedError if a tier
    holds it in the other mode."""
    from . import layout

    try:
        lock = layout.lock_root(root, shared=shared)
    except layout.RootLockedError:
        raise
    except ValueError as exc:
        # A read-only file system where the lock file was never made: no tier writes there
        # either, so a read-only command goes on unlocked.
        if not (shared and os.statvfs(root).f_flag & os.ST_RDONLY):
            raise AdminError(str(exc)) from None
        lock = None
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def _scan(root: str) -> _Scan:
    """Walks ``ROOT/blocks/<fan-out>/`` in sorted order without following any link."""
    from .layout import Layout

    out = _Scan()
    blocks_dir = os.path.join(root, "blocks")
    try:
        with os.scandir(blocks_dir) as it:
            top = sorted(it, key=lambda de: de.name)
    except OSError as exc:
        raise AdminError(f"root {root}: cannot list {blocks_dir} ({exc.strerror})") from None
    for sub in top:
        if not _is_fanout_name(sub.name):
            out.other_files.append(sub.path)
            continue
        try:
            sub_st = sub.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(sub_st.st_mode):
            out.non_block.append((sub.path, f"fan-out directory name held by {_kind(sub_st.st_mode)}"))
            continue
        try:
            with os.scandir(sub.path) as it:
                entries = sorted(it, key=lambda de: de.name)
        except OSError as exc:
            out.errors.append((sub.path, exc.strerror or str(exc)))
            continue
        for de in entries:
            try:
                st = de.stat(follow_symlinks=False)
            except FileNotFoundError:  # removed meanwhile (a root shared with running tiers)
                continue
            digest = Layout.digest_from_name(de.name)
            if digest is not None:
                if not stat.S_ISREG(st.st_mode):
                    out.non_block.append((de.path, _kind(st.st_mode)))
                elif st.st_nlink != 1:
                    out.non_block.append((de.path, f"a file with {st.st_nlink} hard links"))
                elif de.name[:2] != sub.name:
                    out.non_block.append((de.path, f"a block file outside its fan-out directory "
                                                   f"blocks/{de.name[:2]}"))
                else:
                    out.blocks.append(_BlockFile(de.path, digest, st.st_size, st.st_mtime_ns))
                continue
            owner = Layout.tmp_owner(de.name)
            if owner is not None:
                out.temporaries.append((de.path, owner, st.st_size))
            else:
                out.other_files.append(de.path)
    return out


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _temporaries(scan: _Scan) -> dict[str, Any]:
    groups = {"live": {"files": 0, "bytes": 0, "pids": set()},
              "dead": {"files": 0, "bytes": 0, "pids": set()}}
    alive: dict[int, bool] = {}
    for _path, pid, size in scan.temporaries:
        if pid not in alive:
            alive[pid] = _pid_alive(pid)
        g = groups["live" if alive[pid] else "dead"]
        g["files"] += 1
        g["bytes"] += size
        g["pids"].add(pid)
    for g in groups.values():
        g["pids"] = sorted(g["pids"])
    return groups


def _quarantine_usage(root: str) -> dict[str, Any]:
    from .layout import quarantine_usage

    files, nbytes = quarantine_usage(root)
    return {"path": os.path.join(root, "quarantine"), "files": files, "bytes": nbytes}


def _root_block_size(root: str) -> tuple[int | None, str]:
    """The root's block size and where it came from: the root marker, else the first block
    header that parses (the rule and the code DiskTier applies to a root without a marker)."""
    from . import layout

    cfg = layout.read_root_config(root)
    if cfg is not None:
        return int(cfg["block_size_bytes"]), "root marker"
    first = layout.Layout(root, make_dirs=False)._first_block_size()
    if first is not None:
        return int(first[0]), f"header of {first[1]} (no root marker)"
    return None, "no root marker and no block header that parses"


def _repair(root: str, problems: list[dict[str, Any]]) -> tuple[int, list[dict[str, str]], int]:
    """Moves each problem entry into the quarantine as DiskTier does (Quarantine.move_in: the
    entry itself, named ``NAME.TIME``, the quarantine kept to its bound). A fan-out name that
    is not a real directory is moved aside and recreated by Layout.make_dirs(), with the mode
    of ``blocks/`` (with the rest of what a tier's start-up does to the directories: missing
    fan-outs made, dead processes' O_DIRECT probe files removed). Returns (entries moved,
    [{path, error}], entries in the quarantine after)."""
    from .layout import Layout, Quarantine

    mode = stat.S_IMODE(os.lstat(os.path.join(root, "blocks")).st_mode)
    lay = Layout(root, dir_mode=mode, make_dirs=False)
    lay.make_dirs()
    aside = set(lay.moved_aside)
    q = Quarantine(lay)
    moved = 0
    failures: list[dict[str, str]] = []
    for p in problems:
        if not p.get("movable", True):
            continue
        rel = os.path.relpath(p["path"], lay.blocks_dir).split(os.sep)
        if len(rel) == 1:  # a fan-out name (blocks/ab): make_dirs() moved it
            hit = [a for a in aside if a.startswith(f"blocks-{rel[0]}.")]
            if hit:
                p["moved_to"] = os.path.join(lay.quarantine_dir, hit[0])
                moved += 1
            continue
        try:
            dfd = lay.open_dir("blocks", rel[0])
            try:
                qname = q.move_in(dfd, rel[1])
            finally:
                os.close(dfd)
        except OSError as exc:
            failures.append({"path": p["path"], "error": exc.strerror or str(exc)})
            continue
        if qname is not None:
            p["moved_to"] = os.path.join(lay.quarantine_dir, qname)
            moved += 1
    return moved, failures, q.files


def _file_system(root: str) -> dict[str, Any]:
    st = os.statvfs(root)
    return {"free_bytes": st.f_bavail * st.f_frsize, "total_bytes": st.f_blocks * st.f_frsize}


def _iso(ns: int | None) -> str | None:
    if ns is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(ns / 1e9))


# ---------------------------------------------------------------------------- du


def disk_usage(root: str | os.PathLike) -> dict[str, Any]:
    """What a root holds. Read-only (a shared lock on the root).

    Returns a dict: ``root``; ``block_size_bytes`` and ``block_size_from`` (root marker, else
    the first header); ``blocks`` / ``bytes`` (block files: regular files at block names);
    ``by_block_size``: a list of {block_size_bytes (file bytes - header; None for files shorter
    than a header), file_bytes, blocks, bytes, matches_root}; ``non_block_entries``;
    ``other_files``; ``quarantine`` {path, files, bytes}; ``temporaries`` {live, dead: {files,
    bytes, pids}} by whether the writer pid runs; ``oldest_use`` / ``newest_use`` (ns since the
    epoch, file mtimes: ``use_from`` says so), ``file_system`` {free_bytes, total_bytes}.
    Raises AdminError, RootLockedError."""
    from .layout import HEADER_BYTES

    path = _open_root(root)
    with _locked(path, shared=True):
        scan = _scan(path)
        block_size, source = _root_block_size(path)
        quarantine = _quarantine_usage(path)
    sizes: dict[int, list[int]] = {}
    for b in scan.blocks:
        g = sizes.setdefault(b.size, [0, 0])
        g[0] += 1
        g[1] += b.size
    by_size = [{"block_size_bytes": fb - HEADER_BYTES if fb >= HEADER_BYTES else None,
                "file_bytes": fb, "blocks": n, "bytes": nbytes,
                "matches_root": block_size is not None and fb == block_size + HEADER_BYTES}
               for fb, (n, nbytes) in sorted(sizes.items())]
    mtimes = [b.mtime_ns for b in scan.blocks]
    return {
        "root": path,
        "block_size_bytes": block_size,
        "block_size_from": source,
        "blocks": len(scan.blocks),
        "bytes": sum(b.size for b in scan.blocks),
        "by_block_size": by_size,
        "non_block_entries": len(scan.non_block),
        "other_files": len(scan.other_files),
        "unreadable_dirs": [p for p, _ in scan.errors],
        "quarantine": quarantine,
        "temporaries": _temporaries(scan),
        "oldest_use": min(mtimes) if mtimes else None,
        "newest_use": max(mtimes) if mtimes else None,
        "use_from": _MTIME_NOTE,
        "file_system": _file_system(path),
    }


def _format_du(r: dict[str, Any]) -> str:
    fb = _format_bytes
    size = (f"{r['block_size_bytes']} bytes per block ({r['block_size_from']})"
            if r["block_size_bytes"] is not None else r["block_size_from"])
    lines = [f"root         {r['root']}", f"block size   {size}",
             f"blocks       {r['blocks']} files, {fb(r['bytes'])}"]
    for g in r["by_block_size"]:
        bs = ("shorter than a header" if g["block_size_bytes"] is None
              else f"{g['file_bytes']}-byte files ({g['block_size_bytes']}-byte blocks)")
        mark = "" if g["matches_root"] else "  (not this root's size: a tier quarantines them)"
        lines.append(f"  {bs:<40} {g['blocks']} files, {fb(g['bytes'])}{mark}")
    if r["non_block_entries"] or r["other_files"]:
        lines.append(f"other        {r['non_block_entries']} non-block entries at block names, "
                     f"{r['other_files']} other files (pykvtier fsck lists them)")
    q = r["quarantine"]
    lines.append(f"quarantine   {q['files']} files, {fb(q['bytes'])}")
    for state in ("live", "dead"):
        t = r["temporaries"][state]
        pids = ", ".join(map(str, t["pids"][:8])) + (" ..." if len(t["pids"]) > 8 else "")
        lines.append(f"temporaries  {state}: {t['files']} files, {fb(t['bytes'])}"
                     + (f" (writer pids {pids})" if t["pids"] else ""))
    if r["oldest_use"] is not None:
        lines.append(f"oldest use   {_iso(r['oldest_use'])}")
        lines.append(f"newest use   {_iso(r['newest_use'])}  ({r['use_from']})")
    fs = r["file_system"]
    lines.append(f"free space   {fb(fs['free_bytes'])} of {fb(fs['total_bytes'])}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- fsck


def _reason(res: int, block_size: int) -> str:
    """fsck's word for one read_block result: "ok", one of CORRUPT_REASONS, or "vanished"."""
    from . import _native

    if res == block_size:
        return "ok"
    codes = {_native.ERR_BAD_HEADER: "header", _native.ERR_KEY_MISMATCH: "key_mismatch",
             _native.ERR_LENGTH: "length", _native.ERR_CHECKSUM: "checksum",
             _native.ERR_SHORT: "short"}
    if res in codes:
        return codes[res]
    if res == -errno.ENOENT:
        return "vanished"
    if res >= 0:  # fewer bytes than a block and no error: the engine calls that short
        return "short"
    return "io_error"


def _other_size(b: _BlockFile, block_size: int) -> int | None:
    """The payload length of a file shorter than this root's blocks whose header is valid and
    whose size matches that header (a whole block of a smaller block size), else None."""
    from .layout import HEADER_BYTES, read_header

    try:
        fd = os.open(b.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:  # through the descriptor just opened (a regular file, fstat says): no link followed
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        h = read_header(f"/proc/self/fd/{fd}")
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    if h.header_ok() and h.payload_bytes != block_size and b.size == h.payload_bytes + HEADER_BYTES:
        return int(h.payload_bytes)
    return None


def _direct_ok(path: str, block_size: int) -> bool:
    if block_size % _PAGE:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    os.close(fd)
    return True


def _read_blocks(blocks: list[_BlockFile], block_size: int, *, direct: bool, engine: str,
                 batch: int, jobs_in_flight: int, progress: Callable[[int], None]
                 ) -> tuple[list[int], str]:
    """Reads and verifies every block through an engine: jobs of ``batch`` read_block entries
    into a page-aligned host arena, ``jobs_in_flight`` at a time. Returns (one result per
    block, the engine's name)."""
    from . import _native
    from .buffers import host_arena
    from .engines import make_host_engine
    from .layout import HEADER_BYTES

    slot = -(-block_size // _PAGE) * _PAGE
    per_job = max(1, min(batch, _ARENA_BYTES // slot // jobs_in_flight))
    arena = host_arena(per_job * jobs_in_flight, slot)
    addr = arena.ctypes.data
    eng = make_host_engine(engine, 64, max(256 << 20, 2 * (slot + HEADER_BYTES)))
    name = eng.name
    results: list[int] = [0] * len(blocks)
    try:
        eng.register_buffer(addr, arena.nbytes)
        eng.await_buffers()
        free = list(range(jobs_in_flight))
        inflight: dict[int, tuple[int, range]] = {}
        nxt = 0
        job_id = 0
        while nxt < len(blocks) or inflight:
            while free and nxt < len(blocks):
                group = free.pop()
                idx = range(nxt, min(len(blocks), nxt + per_job))
                nxt = idx.stop
                base = addr + group * per_job * slot
                entries = [(blocks[i].path, block_size, base + j * slot, blocks[i].digest)
                           for j, i in enumerate(idx)]
                job_id += 1
                eng.submit(job_id, _native.Op.READ_BLOCK, entries, direct=direct, align=_PAGE, mem_align=_PAGE)
                inflight[job_id] = (group, idx)
            eng.wait(None)
            for job in eng.poll():
                group, idx = inflight.pop(job.job_id)
                for i, r in zip(idx, job.results):
                    results[i] = r
                free.append(group)
                progress(len(idx))
    finally:
        eng.shutdown()
    return results, name


def fsck(root: str | os.PathLike, *, repair: bool = False, progress: bool = False,
         engine: str = "auto", batch: int = 64, jobs_in_flight: int = 4) -> dict[str, Any]:
    """Verifies every block file of a root (header, key digest, payload length, payload
    checksum) by reading it through the engine (io_uring, or posix where io_uring is refused),
    ``batch`` blocks per job, ``jobs_in_flight`` jobs at a time; O_DIRECT where the file system
    takes it. ``repair``: moves every corrupt block and non-block entry to ``ROOT/quarantine``
    (exclusive lock); without it nothing on disk changes (shared lock). ``progress``: a tqdm
    bar on stderr.

    Returns a dict: ``root``, ``block_size_bytes``, ``block_size_from``, ``engine``,
    ``direct``, ``checked`` (block files read), ``ok``, ``corrupt`` {reason: count for every
    reason of CORRUPT_REASONS}, ``non_block_entries``, ``vanished`` (removed by a running
    shared tier during the check), ``problems`` (a list of {path, reason, detail}: reason one
    of CORRUPT_REASONS or "non_block"; ``moved_to`` once repaired), ``repaired`` (entries
    moved), ``repair_failures`` ({path, error}), with ``repair``: ``quarantine_files`` after
    (the quarantine keeps at most QUARANTINE_MAX_FILES, as a tier's: the oldest entries go
    first), ``temporaries``, ``other_files`` (names that are none of the tier's: not
    touched), ``clean`` (no problem found). Raises AdminError, RootLockedError."""
    from ._native import result_text

    path = _open_root(root)
    with _locked(path, shared=not repair):
        scan = _scan(path)
        block_size, source = _root_block_size(path)
        out: dict[str, Any] = {"root": path, "block_size_bytes": block_size,
                               "block_size_from": source, "engine": None, "direct": None,
                               "checked": len(scan.blocks), "ok": 0,
                               "corrupt": dict.fromkeys(CORRUPT_REASONS, 0),
                               "non_block_entries": len(scan.non_block), "vanished": 0}
        problems = [{"path": p, "reason": "non_block", "detail": what} for p, what in scan.non_block]
        problems += [{"path": p, "reason": "io_error", "movable": False,
                      "detail": f"cannot list the directory: {why}"} for p, why in scan.errors]
        out["corrupt"]["io_error"] += len(scan.errors)
        if scan.blocks and block_size is None:
            for b in scan.blocks:
                problems.append({"path": b.path, "reason": "header", "detail": source})
            out["corrupt"]["header"] += len(scan.blocks)
        elif scan.blocks:
            from .layout import HEADER_BYTES

            bar = None
            if progress:
                from tqdm import tqdm

                bar = tqdm(total=len(scan.blocks), unit="block", desc="fsck", file=sys.stderr)
            try:
                tick = bar.update if bar is not None else (lambda n: None)
                direct = _direct_ok(scan.blocks[0].path, block_size)
                results, out["engine"] = _read_blocks(
                    scan.blocks, block_size, direct=direct, engine=engine, batch=batch,
                    jobs_in_flight=jobs_in_flight, progress=tick)
                out["direct"] = direct
                if direct:  # a file the file system will not read with O_DIRECT: read it buffered
                    again = [i for i, r in enumerate(results) if r == -errno.EINVAL]
                    if again:
                        res2, _ = _read_blocks([scan.blocks[i] for i in again], block_size,
                                               direct=False, engine=engine, batch=batch,
                                               jobs_in_flight=jobs_in_flight, progress=lambda n: None)
                        for i, r in zip(again, res2):
                            results[i] = r
                        out["direct"] = len(again) < len(results)
            finally:
                if bar is not None:
                    bar.close()
            for b, res in zip(scan.blocks, results):
                why = _reason(res, block_size)
                other = _other_size(b, block_size) if why == "short" else None
                if other is not None:  # whole, of another block size: not truncated
                    why, detail = "length", (f"a whole block of {other} payload bytes; this "
                                             f"root's blocks have {block_size}")
                elif why == "ok" and b.size != block_size + HEADER_BYTES:
                    # a valid block followed by extra bytes: a tier takes it for another size
                    why, detail = "length", (f"file is {b.size} bytes, a block of this root "
                                             f"{block_size + HEADER_BYTES}")
                else:
                    detail = result_text(res) if res < 0 else f"{res} payload bytes read"
                if why == "ok":
                    out["ok"] += 1
                elif why == "vanished":
                    out["vanished"] += 1
                else:
                    out["corrupt"][why] += 1
                    problems.append({"path": b.path, "reason": why, "detail": detail})
        out["problems"] = problems
        out["repaired"] = 0
        out["repair_failures"] = []
        if repair and problems:
            out["repaired"], out["repair_failures"], out["quarantine_files"] = _repair(path, problems)
        out["temporaries"] = _temporaries(scan)
        out["other_files"] = scan.other_files
        out["clean"] = not problems
    return out


def _format_fsck(r: dict[str, Any], repair: bool) -> str:
    c = r["corrupt"]
    corrupt = sum(c.values())
    if r["block_size_bytes"] is not None:
        how = f"{r['block_size_bytes']}-byte blocks ({r['block_size_from']})"
    else:
        how = r["block_size_from"]
    if r["engine"]:
        how += f", {r['engine']} engine, " + ("O_DIRECT" if r["direct"] else "buffered reads")
    lines = [f"pykvtier fsck {r['root']}: {r['checked']} block files checked; {how}",
             f"  ok          {r['ok']}",
             f"  corrupt     {corrupt}  (header {c['header']}, key mismatch {c['key_mismatch']}, "
             f"length {c['length']}, checksum {c['checksum']}, short {c['short']}, "
             f"I/O errors {c['io_error']})",
             f"  non-block   {r['non_block_entries']}  (links, directories, hard-linked or misplaced "
             "files at block names)"]
    if r["vanished"]:
        lines.append(f"  vanished    {r['vanished']}  (removed by a running tier during the check)")
    t = r["temporaries"]
    lines.append(f"  temporaries {t['live']['files']} of live writers, {t['dead']['files']} of dead "
                 "ones (a tier's start-up removes those)")
    if r["other_files"]:
        lines.append(f"  other files {len(r['other_files'])} (not the tier's; left alone)")
    shown = r["problems"][:20]
    for p in shown:
        lines.append(f"  {p['reason']}: {p['path']}: {p['detail']}")
    if len(r["problems"]) > len(shown):
        lines.append(f"  ... and {len(r['problems']) - len(shown)} more (--json lists all)")
    if repair:
        lines.append(f"repaired: {r['repaired']} moved to {os.path.join(r['root'], 'quarantine')}"
                     + (f" (it holds {r['quarantine_files']})" if "quarantine_files" in r else ""))
        for f in r["repair_failures"]:
            lines.append(f"  cannot move {f['path']}: {f['error']}")
    elif r["problems"]:
        lines.append("nothing changed; run with --repair to move them to the quarantine")
    else:
        lines.append("clean")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- gc


def gc(root: str | os.PathLike, capacity_bytes: int) -> dict[str, Any]:
    """Shrinks a root's block files to at most ``capacity_bytes`` (file bytes, as a tier's
    ``capacity_bytes`` counts them) by removing the least recently used first: oldest file
    mtime first (the order a tier evicts in after a restart), ties by name. Exclusive lock.

    Returns a dict: ``root``, ``capacity_bytes``, ``before`` / ``removed`` / ``kept``
    {blocks, bytes}, ``failures`` ({path, error}: files that could not be removed, still
    counted in ``kept``), ``use_from``. Raises AdminError, RootLockedError, ValueError for a
    negative capacity."""
    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 0:
        raise ValueError(f"capacity_bytes must be a byte count >= 0, got {capacity_bytes!r}")
    from .layout import Layout

    path = _open_root(root)
    with _locked(path, shared=False):
        blocks = sorted(_scan(path).blocks, key=lambda b: (b.mtime_ns, b.path))
        total = sum(b.size for b in blocks)
        out: dict[str, Any] = {"root": path, "capacity_bytes": capacity_bytes,
                               "before": {"blocks": len(blocks), "bytes": total},
                               "removed": {"blocks": 0, "bytes": 0}, "failures": [],
                               "use_from": _MTIME_NOTE}
        kept = total
        lay = Layout(path, make_dirs=False)
        for b in blocks:
            if kept <= capacity_bytes:
                break
            try:  # relative to the real fan-out (O_NOFOLLOW): a link put there since the scan
                fan, name = os.path.split(b.path)  # fails ELOOP, nothing outside is removed
                dfd = lay.open_dir("blocks", os.path.basename(fan))
                try:
                    os.unlink(name, dir_fd=dfd)
                finally:
                    os.close(dfd)
            except FileNotFoundError:
                kept -= b.size
                continue
            except OSError as exc:
                out["failures"].append({"path": b.path, "error": exc.strerror or str(exc)})
                continue
            kept -= b.size
            out["removed"]["blocks"] += 1
            out["removed"]["bytes"] += b.size
        out["kept"] = {"blocks": len(blocks) - out["removed"]["blocks"], "bytes": kept}
    return out


def _format_gc(r: dict[str, Any]) -> str:
    fb = _format_bytes
    lines = [f"pykvtier gc {r['root']}: capacity {fb(r['capacity_bytes'])}",
             f"  before   {r['before']['blocks']} blocks, {fb(r['before']['bytes'])}",
             f"  removed  {r['removed']['blocks']} blocks, {fb(r['removed']['bytes'])} "
             "(least recently used first, by file mtime)",
             f"  kept     {r['kept']['blocks']} blocks, {fb(r['kept']['bytes'])}"]
    for f in r["failures"]:
        lines.append(f"  cannot remove {f['path']}: {f['error']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- quarantine


def quarantine_list(root: str | os.PathLike) -> dict[str, Any]:
    """What ``ROOT/quarantine`` holds: {root, path, files, bytes} (entries, and the bytes of
    their regular files). Shared lock. Raises AdminError, RootLockedError."""
    path = _open_root(root)
    with _locked(path, shared=True):
        q = _quarantine_usage(path)
    return {"root": path, **q}


def quarantine_empty(root: str | os.PathLike) -> dict[str, Any]:
    """Removes everything in ``ROOT/quarantine`` (:func:`pykvtier.layout.empty_quarantine`):
    {root, path, removed_files, removed_bytes}. Exclusive lock. Raises AdminError,
    RootLockedError, OSError."""
    from . import layout

    path = _open_root(root)
    with _locked(path, shared=False):
        files, nbytes = layout.empty_quarantine(path)
    return {"root": path, "path": os.path.join(path, "quarantine"), "removed_files": files,
            "removed_bytes": nbytes}


# ---------------------------------------------------------------------------- command line


@dataclass(frozen=True)
class Subcommand:
    """One ``pykvtier`` subcommand as :mod:`pykvtier.cli` takes it."""

    HELP: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _format_bytes(n: int) -> str:
    from .toolkit import format_bytes

    return format_bytes(n) if n < 1024 else f"{format_bytes(n)} ({n} bytes)"


def _root_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("root", metavar="ROOT", help="the tier's root directory (DiskTier's root_dir)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _guarded(name: str, body: Callable[[], int]) -> int:
    """Runs a command body; a locked or unusable root (RootLockedError, AdminError, a malformed
    marker, an OSError naming the path) is one line on stderr and exit 2."""
    try:
        return body()
    except (ValueError, OSError) as exc:  # RootLockedError, AdminError, a malformed root marker
        print(f"pykvtier {name}: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


def _emit(args: argparse.Namespace, result: dict[str, Any], text: str) -> None:
    print(json.dumps(result, indent=2, sort_keys=True, default=str) if args.json else text)


def _du_run(args: argparse.Namespace) -> int:
    def body() -> int:
        r = disk_usage(args.root)
        _emit(args, r, "" if args.json else _format_du(r))
        return 0

    return _guarded("du", body)


def _fsck_args(p: argparse.ArgumentParser) -> None:
    _root_arg(p)
    p.add_argument("--repair", action="store_true",
                   help="move the corrupt blocks and non-block entries to ROOT/quarantine "
                        "(without it nothing on disk changes)")
    p.add_argument("--engine", choices=("auto", "uring", "posix"), default="auto",
                   help="engine that reads the blocks (default: io_uring where the kernel allows it)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _fsck_run(args: argparse.Namespace) -> int:
    def body() -> int:
        show = not (args.json or args.no_progress) and sys.stderr.isatty()
        r = fsck(args.root, repair=args.repair, progress=show, engine=args.engine)
        _emit(args, r, "" if args.json else _format_fsck(r, args.repair))
        return 0 if r["clean"] and not r["repair_failures"] else 1

    return _guarded("fsck", body)


def _capacity_arg(text: str) -> int:
    from .toolkit import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _gc_args(p: argparse.ArgumentParser) -> None:
    _root_arg(p)
    p.add_argument("--capacity", metavar="BYTES", type=_capacity_arg, required=True,
                   help="keep at most this many block file bytes (e.g. 500GiB, 64M, 1000000000)")


def _gc_run(args: argparse.Namespace) -> int:
    def body() -> int:
        r = gc(args.root, args.capacity)
        _emit(args, r, "" if args.json else _format_gc(r))
        return 1 if r["failures"] else 0

    return _guarded("gc", body)


def _quarantine_args(p: argparse.ArgumentParser) -> None:
    _root_arg(p)
    p.add_argument("--empty", action="store_true", help="remove everything in ROOT/quarantine")


def _quarantine_run(args: argparse.Namespace) -> int:
    def body() -> int:
        if args.empty:
            r = quarantine_empty(args.root)
            text = f"removed {r['removed_files']} files, {_format_bytes(r['removed_bytes'])} from {r['path']}"
        else:
            r = quarantine_list(args.root)
            text = f"{r['path']}: {r['files']} files, {_format_bytes(r['bytes'])}"
        _emit(args, r, text)
        return 0

    return _guarded("quarantine", body)


du_command = Subcommand(
    "a root's blocks and bytes per block size, quarantine, temporaries, oldest/newest use, free space",
    _root_arg, _du_run)
fsck_command = Subcommand(
    "verify every block's header and checksum (io_uring, batched); --repair quarantines the bad ones",
    _fsck_args, _fsck_run)
gc_command = Subcommand(
    "shrink a root's blocks to --capacity bytes, least recently used (oldest mtime) first",
    _gc_args, _gc_run)
quarantine_command = Subcommand(
    "list (files, bytes) or --empty a root's quarantine", _quarantine_args, _quarantine_run)
