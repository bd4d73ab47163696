"""``pykvtier doctor``: what this machine gives pykvtier, and the path loads will take.

Reports the kernel; io_uring (whether rings can be set up, which setup flags and opcodes work, and
the operations the engine relies on really run in the root: openat into a fixed-file slot, fixed
reads/writes, statx, renameat, unlinkat); the root's file system (mountinfo's type and statfs's
f_type); O_DIRECT at the root, its DIO alignment (statx STATX_DIOALIGN) and whether the file
system enforces it (an unaligned O_DIRECT transfer refused: O_DIRECT reaches the block layer;
taken: FUSE, tmpfs, NFS); whether the root's file system checksums file data (then the tier's
``verify="header"`` is suggested); RLIMIT_MEMLOCK (registered buffers pin memory); the GPU and driver; kvikio,
cuFile / GPUDirect Storage; and the paths host-arena and GPU-arena loads take, with the reason.
Runs everywhere (a machine without a GPU, kvikio or even io_uring is explained, not an error);
``--json`` prints the same as one JSON object (keys: see :func:`collect`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
from typing import Any

HELP = "explain this machine: kernel, io_uring, O_DIRECT, memlock, GPU, kvikio/GDS, and the load paths"

__all__ = ["HELP", "add_arguments", "collect", "data_checksums", "format_text", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root", default=None,
                   help="the tier's directory to probe (O_DIRECT, DIO alignment, io_uring file ops, "
                        "cuFile; a missing one: the directory it would be created in); default: the "
                        "current directory")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--no-gpu", action="store_true",
                   help="skip the GPU probes that load CUDA libraries (torch, the gds engine)")


# ---------------------------------------------------------------------------- probes


def _kernel() -> dict[str, Any]:
    u = platform.uname()
    return {"system": u.system, "release": u.release, "version": u.version, "machine": u.machine}


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _io_uring(root: str | None) -> dict[str, Any]:
    from . import _native

    out: dict[str, Any] = {"io_uring_disabled_sysctl": _read("/proc/sys/kernel/io_uring_disabled")}
    out.update(_native.probe_uring(root or ""))
    try:
        e = _native.Engine(queue_depth=1)
        e.shutdown()
        out["engine"] = "uring"
        out["engine_reason"] = "the io_uring engine starts here"
    except ValueError as exc:
        out["engine"] = "posix"
        out["engine_reason"] = f"{exc}: the posix engine (preadv/pwritev threads) is used instead"
    return out


def _mount_of(path: str) -> dict[str, Any]:
    """The mount holding path: its mount point, file system type, source and options (the
    mount's, then the super block's, from mountinfo)."""
    best: dict[str, Any] = {}
    real = os.path.realpath(path)
    for line in (_read("/proc/self/mountinfo") or "").splitlines():
        parts = line.split()
        if "-" not in parts:
            continue
        sep = parts.index("-")
        mnt = parts[4].replace("\\040", " ")
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best.get("mount", "")):
            options = parts[5].split(",") + (parts[sep + 3].split(",") if len(parts) > sep + 3 else [])
            best = {"mount": mnt, "fstype": parts[sep + 1], "source": parts[sep + 2],
                    "mount_options": options}
    return best


_FS_IOC_GETFLAGS = 0x80086601  # _IOR('f', 1, long)
_FS_NOCOW_FL = 0x00800000  # chattr +C


def _has_nocow(path: str) -> bool | None:
    """Whether ``path`` carries the No_COW attribute (``chattr +C``: btrfs gives files made
    under it no data checksums); None where its flags cannot be read."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        flags = bytearray(8)
        fcntl.ioctl(fd, _FS_IOC_GETFLAGS, flags, True)
    except OSError:
        return None
    finally:
        os.close(fd)
    return bool(int.from_bytes(flags[:4], sys.byteorder) & _FS_NOCOW_FL)


def data_checksums(fstype: str | None, mount_options: list[str] | tuple[str, ...] = (),
                   nocow: bool | None = False) -> dict[str, Any]:
    """Whether a file system checksums the file data it stores, so that a corrupted payload
    fails the read there: btrfs (unless mounted ``nodatasum``/``nodatacow`` or the root
    directory is No_COW, ``nocow``), ZFS and bcachefs (unless ``data_checksum=none``) do;
    ext4, XFS, tmpfs and the rest do not. Returns {"checksums": bool, "reason": str,
    "suggested_verify": "header" | "payload"} (the tier's ``verify`` option)."""
    opts = {o.strip() for o in mount_options}
    fs = (fstype or "").lower()
    if fs == "btrfs":
        off = sorted(opts & {"nodatasum", "nodatacow"})
        if off:
            ok, reason = False, f"btrfs mounted {','.join(off)}: data blocks carry no checksums"
        elif nocow:
            ok, reason = False, "btrfs, but the root directory is No_COW (chattr +C): files made in it carry no data checksums"
        else:
            ok, reason = True, "btrfs checksums every data block and fails a read whose bytes do not match"
    elif fs == "zfs":
        ok, reason = True, "ZFS checksums every block (checksum property, on by default) and fails or repairs a mismatch"
    elif fs == "bcachefs":
        if "data_checksum=none" in opts:
            ok, reason = False, "bcachefs mounted data_checksum=none"
        else:
            ok, reason = True, "bcachefs checksums data (data_checksum, on by default)"
    elif fs:
        ok, reason = False, f"{fstype} does not checksum file data"
    else:
        ok, reason = False, "file system type unknown"
    return {"checksums": ok, "reason": reason, "suggested_verify": "header" if ok else "payload"}


#: Directories whose entries are mount points by convention (fstab's, udisks').
_MOUNT_DIRS = ("/mnt", "/media", "/run/media")


def unmounted_warning(path: str, exists: bool, probe_dir: str, mount: dict[str, Any]) -> str | None:
    """Why a root at ``path`` may be meant for a file system that is not mounted, or None.

    ``probe_dir``: the root itself when it ``exists``, else its nearest existing ancestor (where
    the tier would create it, with its missing parents); ``mount``: the mount holding
    ``probe_dir`` (:func:`_mount_of`). A warning only where that is the file system of ``/``
    and either the path lies under ``/mnt``, ``/media`` or ``/run/media`` (where devices are
    mounted: nothing is, on the way to the root), or, for a missing root, its parent is missing
    too (the tier would create a new tree on ``/``, as for a mount point that is not there)."""
    if mount.get("mount") != "/":
        return None
    fs = f"{mount.get('fstype', '?')} on {mount.get('source', '?')}"
    verb = "is" if exists else "would be created"
    under = next((d for d in _MOUNT_DIRS if path.startswith(d + "/")), None)
    if under is not None:
        return (f"{path} is under {under}, where devices are mounted, but nothing is mounted on the way "
                f"to it: the root {verb} on the file system of / ({fs}); mount the device first, "
                "or pass the root you meant")
    if not exists and os.path.dirname(path) != probe_dir:
        first = os.path.join(probe_dir, os.path.relpath(path, probe_dir).split(os.sep)[0])
        return (f"{first} does not exist: the tier would create it and the directories below it on the "
                f"file system of / ({fs}); if a device should be mounted at {first}, mount it first")
    return None


def _root(root: str) -> dict[str, Any]:
    from . import _native

    out: dict[str, Any] = {"path": os.path.abspath(root), "exists": os.path.isdir(root)}
    probe_dir = root
    if os.path.exists(root) and not out["exists"]:
        out["problem"] = "not a directory: the tier cannot use it"
    if not out["exists"]:  # probe its nearest existing parent: where the tier would be created
        probe_dir = os.path.abspath(root)
        while not os.path.isdir(probe_dir):
            probe_dir = os.path.dirname(probe_dir)
        out["probed_instead"] = probe_dir
    out.update(_mount_of(probe_dir))
    try:  # the file system as the kernel names it to the engine (FUSE: 0x65735546, NFS: 0x6969)
        out["statfs_type"] = _native.statfs_type(probe_dir)
    except OSError:
        out["statfs_type"] = None
    if not os.path.lexists(root):
        out["created_under"] = probe_dir  # the existing directory the tier would create it in
    out["mount_warning"] = (None if "problem" in out  # not a directory: nothing to create
                            else unmounted_warning(out["path"], out["exists"], probe_dir, out))
    out["data_checksums"] = data_checksums(out.get("fstype"), out.get("mount_options", ()),
                                           _has_nocow(probe_dir))
    try:
        st = os.statvfs(probe_dir)
        out["free_bytes"] = st.f_bavail * st.f_frsize
    except OSError:
        out["free_bytes"] = None
    try:
        out["o_direct"] = dict(_native.probe_direct(probe_dir))
    except ValueError as exc:  # no file can be created there: no tier either
        out["o_direct"] = {"direct": False, "reason": str(exc), "mem_align": None, "offset_align": None,
                           "dioalign_from_statx": False, "alignment_enforced": None,
                           "alignment_probe": "not probed: no file can be created there"}
        out.setdefault("problem", f"not usable: {exc}")
    out["writable"] = os.access(probe_dir, os.W_OK)
    out["probe_dir"] = probe_dir
    if out["exists"]:  # what a tier left there: its block size, its quarantine
        from . import layout

        try:
            cfg = layout.read_root_config(root)
            out["block_size_bytes"] = cfg["block_size_bytes"] if cfg else None
        except ValueError as exc:
            out["block_size_bytes"] = None
            out["marker_problem"] = str(exc)
        out["quarantine_files"], out["quarantine_bytes"] = layout.quarantine_usage(root)
    return out


def _memlock() -> dict[str, Any]:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    fmt = lambda v: None if v == resource.RLIM_INFINITY else v  # noqa: E731
    root = os.geteuid() == 0
    return {"soft": fmt(soft), "hard": fmt(hard), "unlimited": soft == resource.RLIM_INFINITY,
            "euid0": root,
            "note": ("registered (fixed) buffers pin the arena; pinned bytes count against RLIMIT_MEMLOCK "
                     "unless the process has CAP_IPC_LOCK" + (" (root: it has)" if root else "") +
                     "; where registration fails the engine reads into plain memory and counts it")}


def _versions(*names: str) -> dict[str, str]:
    out = {}
    for n in names:
        try:
            out[n] = importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def _gpu(no_gpu: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"devices": [], "driver_version": None, "nvidia_smi": None, "torch": None,
                           "torch_cuda": None, "cuda_available": False, "no_gpu": no_gpu}
    drv = _read("/proc/driver/nvidia/version")
    if drv:
        out["proc_driver"] = drv.splitlines()[0]
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            r = subprocess.run([smi, "--query-gpu=index,name,driver_version,memory.total,pci.bus_id",
                                "--format=csv,noheader"], capture_output=True, text=True, timeout=15)
            rows = [[c.strip() for c in line.split(",")] for line in r.stdout.strip().splitlines() if line]
            out["nvidia_smi"] = rows if r.returncode == 0 else f"exit {r.returncode}: {r.stderr.strip()[:200]}"
            if r.returncode == 0 and rows:
                out["driver_version"] = rows[0][2]
        except (OSError, subprocess.SubprocessError) as exc:
            out["nvidia_smi"] = f"failed: {exc}"
    if not no_gpu and importlib.util.find_spec("torch") is not None:
        try:
            import torch

            out["torch"] = torch.__version__
            out["torch_cuda"] = torch.version.cuda
            out["cuda_available"] = bool(torch.cuda.is_available())
            if out["cuda_available"]:
                for i in range(torch.cuda.device_count()):
                    p = torch.cuda.get_device_properties(i)
                    out["devices"].append({"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                                           "memory_bytes": int(p.total_memory)})
        except Exception as exc:  # a broken torch install is worth reporting, not dying on
            out["torch_error"] = f"{type(exc).__name__}: {exc}"
    return out


def _gds(root: str | None, no_gpu: bool) -> dict[str, Any]:
    from . import _native, gpu

    if no_gpu:
        info = _native.gds_build_info()
        st: dict[str, Any] = {"built": info["built"], "build_reason": info["reason"], "importable": None,
                              "usable": False, "reason": "not probed (--no-gpu)"}
    else:
        st = gpu.gds_status(root)
    st["packages"] = _versions("kvikio-cu12", "kvikio-cu13", "libkvikio-cu12", "libkvikio-cu13",
                               "rapids-logger", "nvidia-cufile", "nvidia-cufile-cu12", "cuda-pathfinder")
    st["nvidia_fs_module"] = os.path.isdir("/sys/module/nvidia_fs") or os.path.exists("/proc/driver/nvidia-fs")
    st["run_udev_readable"] = os.access("/run/udev", os.R_OK)
    cfg = os.environ.get("CUFILE_ENV_PATH_JSON") or "/etc/cufile.json"
    st["cufile_json"] = cfg if os.path.isfile(cfg) else None
    st["kvikio_env"] = {k: v for k, v in os.environ.items() if k.startswith("KVIKIO_")}
    return st


def _paths(report: dict[str, Any]) -> dict[str, Any]:
    from . import gpu

    uring, root, gds = report["io_uring"], report["root"], report["gds"]
    host = uring["engine"]
    od = root["o_direct"]
    host_io = "O_DIRECT" if od.get("direct") else f"buffered I/O ({od.get('reason')})"
    out: dict[str, Any] = {
        "host_engine": host,
        "host_io": host_io,
        "host": f"{'io_uring' if host == 'uring' else 'posix'} engine, {host_io}",
    }
    if gds.get("importable") is None:  # --no-gpu
        out["device"] = {"path": None, "reason": "not probed (--no-gpu)", "fallback": None}
        return out
    choice = gpu.choose_path(gds, "auto", host)
    gpu_here = bool(report["gpu"]["devices"]) or bool(gds.get("cuda_devices"))
    out["device"] = {"path": choice.path, "reason": choice.reason, "fallback": choice.fallback,
                     "gpu_present": gpu_here}
    return out


def collect(root: str | None = None, no_gpu: bool = False) -> dict[str, Any]:
    """Everything ``doctor`` reports, as a dict with the keys: pykvtier, kernel, io_uring, root,
    memlock, gpu, gds, paths (each a dict). ``root``: the tier's directory (``~`` expanded as a
    shell would; None: the current directory; "" is refused with a ValueError, as DiskTier
    refuses it)."""
    from . import __version__

    if root == "":
        raise ValueError("root '' is empty (it would mean the current directory)")
    root_dir = os.path.expanduser(root) if root is not None else os.getcwd()
    r = _root(root_dir)
    report: dict[str, Any] = {
        "pykvtier": {"version": __version__, "python": sys.version.split()[0], "executable": sys.executable},
        "kernel": _kernel(),
    }
    # the io_uring file checks run in a scratch directory inside the root (removed after)
    scratch = None
    if r.get("writable"):
        try:
            scratch = tempfile.mkdtemp(prefix=".pykvtier-doctor-", dir=r["probe_dir"])
        except OSError:
            scratch = None
    try:
        report["io_uring"] = _io_uring(scratch)
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    report["root"] = r
    report["memlock"] = _memlock()
    report["gpu"] = _gpu(no_gpu)
    report["gds"] = _gds(r["probe_dir"], no_gpu)
    report["paths"] = _paths(report)
    return report


# ---------------------------------------------------------------------------- text


def _size(n: int | None) -> str:
    if n is None:
        return "unlimited"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _marks(d: dict[str, bool]) -> str:
    return " ".join(f"{k}{'+' if v else '-'}" for k, v in d.items())


class _Rows:
    """The report's lines: a 16-column label, then text; continuation lines indented."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, label: str, text: str, *more: str) -> None:
        self.lines.append(f"{label:<16}{text}")
        for m in more:
            self.lines.append(f"{'':<16}{m}")


def _io_uring_rows(row: _Rows, u: dict[str, Any]) -> None:
    if not u["available"]:
        row("io_uring", f"unavailable: {u['error']}"
            + (f" (kernel.io_uring_disabled={u['io_uring_disabled_sysctl']})"
               if u.get("io_uring_disabled_sysctl") not in (None, "0") else ""),
            u["engine_reason"])
        return
    checks = u.get("checks", {})
    failed = [f"{n} ({d})" for n, (ok, d) in checks.items() if not ok]
    row("io_uring", f"available; engine: {u['engine']}",
        "setup flags: " + _marks(u["setup_flags"]),
        "ops: " + _marks(u["ops"]),
        "features: " + " ".join(u["features"]),
        ("checks run in the root: " + _marks({n: ok for n, (ok, _) in checks.items()}))
        + ("" if not failed else "; failed: " + "; ".join(failed)))


def _alignment_lines(od: dict[str, Any]) -> list[str]:
    """What the O_DIRECT probe found of alignment: enforced or not, what it means, what was tried."""
    enforced = od.get("alignment_enforced")
    if enforced is True:
        what = ("alignment enforced: yes (an unaligned O_DIRECT transfer is refused): O_DIRECT "
                "goes to the block layer")
    elif enforced is False:
        what = ("alignment enforced: no (unaligned O_DIRECT transfers are taken): O_DIRECT here is "
                "not the block layer's direct path (FUSE, tmpfs and NFS take any alignment, through "
                "the FUSE daemon, the page cache or the server; btrfs falls back to buffered I/O for "
                "an unaligned transfer)")
    else:
        what = "alignment enforced: unknown"
    probed = od.get("alignment_probe")
    return [what] + ([f"probed: {probed}"] if probed else [])


def _root_rows(row: _Rows, r: dict[str, Any]) -> None:
    fs = f"{r.get('fstype', '?')} on {r.get('source', '?')}"
    ftype = r.get("statfs_type")
    free = f"{_size(r.get('free_bytes'))} free" + (f"; statfs f_type {ftype:#x}" if isinstance(ftype, int) else "")
    if r.get("created_under"):
        row("root", f"{r['path']}: missing; the tier would create it under {r['created_under']}, "
                    f"on {fs} (mounted at {r.get('mount', '?')}), {free}")
    elif not r["exists"]:  # not a directory
        row("root", f"{r['path']} (probed {r['probe_dir']}): {fs}, {free}")
    else:
        row("root", f"{r['path']}: {fs}, {free}")
    if r.get("mount_warning"):
        row("root WARNING", r["mount_warning"])
    if "quarantine_files" in r:
        bs = r["block_size_bytes"]
        row("root contents",
            (f"block_size_bytes={bs}" if bs else r.get("marker_problem") or "no block size recorded yet")
            + f"; quarantine: {r['quarantine_files']} entries, {_size(r['quarantine_bytes'])}")
    od = r["o_direct"]
    if r.get("problem"):
        row("root PROBLEM", r["problem"], "pykvtier cannot store blocks here (doctor exits 1)")
    elif od.get("direct"):
        src = "statx STATX_DIOALIGN" if od.get("dioalign_from_statx") else "assumed (no STATX_DIOALIGN)"
        row("O_DIRECT", f"yes; DIO alignment: memory {od['mem_align']} B, offset {od['offset_align']} B ({src})",
            *_alignment_lines(od))
    else:
        row("O_DIRECT", f"no: {od.get('reason')}; the tier falls back to buffered I/O (logged, counted)")
    cs = r["data_checksums"]
    if cs["checksums"]:
        row("data checksums", f"yes: {cs['reason']}",
            "suggested: verify=\"header\" (the file system checks the payload; the tier still "
            "checks header, key and length)")
    else:
        row("data checksums", f"no: {cs['reason']}",
            "keep verify=\"payload\" (the default: the tier checks every payload it loads)")


def _gpu_rows(row: _Rows, g: dict[str, Any]) -> None:
    if g["devices"]:
        devs = "; ".join(f"cuda:{d['index']} {d['name']} (sm {d['capability']}, {_size(d['memory_bytes'])})"
                         for d in g["devices"])
        row("GPU", devs, f"driver {g['driver_version'] or g.get('proc_driver') or '?'}; torch {g['torch']} "
                         f"(CUDA {g['torch_cuda']})")
    elif isinstance(g["nvidia_smi"], list) and g["nvidia_smi"]:
        row("GPU", "; ".join(f"{r_[1]} (driver {r_[2]})" for r_ in g["nvidia_smi"]),
            f"torch: {g['torch'] or 'not installed'}" + (f" ({g.get('torch_error')})" if g.get("torch_error") else ""))
    else:
        why = [f"torch {g['torch']} sees no CUDA device" if g["torch"]
               else "torch not probed (--no-gpu)" if g.get("no_gpu")
               else "torch not installed",
               "nvidia-smi not found" if g["nvidia_smi"] is None else f"nvidia-smi: {g['nvidia_smi']}"]
        if not g.get("proc_driver"):
            why.append("no NVIDIA driver loaded (/proc/driver/nvidia)")
        row("GPU", "none (" + "; ".join(why) + ")")


def _kvikio_row(row: _Rows, s: dict[str, Any]) -> None:
    """The gds engine's build/import state (the cuFile / GDS row refers to it)."""
    pk = s.get("packages") or {}
    kv = s.get("kvikio_version") or s.get("build_kvikio_version")
    if not s.get("built"):
        engine_state = f"gds engine {s.get('build_reason')}"
    elif s.get("importable") is None:  # --no-gpu: built, not loaded
        engine_state = f"gds engine {s.get('build_reason')}; not loaded (--no-gpu)"
    elif s.get("importable"):
        engine_state = f"gds engine {s.get('build_reason')}; loads"
    else:
        engine_state = f"gds engine {s.get('build_reason')}; {s.get('import_reason')}"
    row("kvikio", (f"{kv}" if kv else "none") + (f"; packages: {', '.join(f'{a} {b}' for a, b in pk.items())}"
                                                 if pk else "; no kvikio / libkvikio package installed"),
        engine_state)


def _gds_row(row: _Rows, s: dict[str, Any]) -> None:
    gds_reason = s.get("reason", "")
    engine_down = not s.get("built") or s.get("importable") is False
    if s.get("usable"):
        gds_text = f"usable: {gds_reason}"
    elif s.get("importable") is not None and engine_down:
        gds_text = "not usable: the gds engine " + ("is not built" if not s.get("built") else "does not load") \
            + " (see kvikio)"
    else:
        gds_text = f"not usable: {gds_reason}"
    gds_lines = [f"nvidia-fs module: {'loaded' if s['nvidia_fs_module'] else 'not loaded'}; "
                 f"/run/udev: {'readable' if s['run_udev_readable'] else 'not readable'}; "
                 f"cufile.json: {s['cufile_json'] or 'none'}"]
    if s.get("importable"):
        gds_lines.append(f"libcufile: {'loads' if s.get('cufile_library') else 'missing'} "
                         f"(version {s.get('cufile_version')}); driver: "
                         f"{'nvidia-fs ' + str(s.get('nvfs_version')) if s.get('gds_available') else 'no nvidia-fs'}; "
                         f"kvikio compat mode default {s.get('compat_mode_default')}")
        if s.get("root_probe"):
            gds_lines.append(f"at the root: {s['root_probe'].get('reason')}")
        for n in s.get("notes") or []:
            gds_lines.append(f"note: {n}")
    row("cuFile / GDS", gds_text, *gds_lines)


def _loads_row(row: _Rows, pa: dict[str, Any], gds_reason: str) -> None:
    dev = pa["device"]
    if dev["path"] is None:
        dev_text = "not probed (--no-gpu)"
    else:
        why = dev["reason"]
        # the path's reason starts with the GDS verdict, already given in the cuFile / GDS row
        if gds_reason and why == gds_reason:
            why = "GPUDirect Storage (see cuFile / GDS)"
        elif gds_reason and why.startswith(gds_reason + "; "):
            why = why[len(gds_reason) + 2:] + " (GDS not usable: see cuFile / GDS)"
        dev_text = f"{dev['path']} path: {why}"
        if not dev.get("gpu_present"):
            dev_text = f"no GPU here; where a CUDA arena is set, the {dev_text}"
    row("loads", f"host arenas: {pa['host']}", f"GPU arenas: {dev_text}")


def format_text(rep: dict[str, Any]) -> str:
    """The report of :func:`collect` as text, one labelled row per subject; each fact once."""
    row = _Rows()
    p, k = rep["pykvtier"], rep["kernel"]
    row.lines.append(f"pykvtier doctor: pykvtier {p['version']}, Python {p['python']}")
    row("kernel", f"{k['system']} {k['release']} {k['machine']}")
    _io_uring_rows(row, rep["io_uring"])
    _root_rows(row, rep["root"])
    m = rep["memlock"]
    row("RLIMIT_MEMLOCK", f"soft {_size(m['soft'])}, hard {_size(m['hard'])}" + (", euid 0" if m["euid0"] else ""),
        m["note"])
    _gpu_rows(row, rep["gpu"])
    _kvikio_row(row, rep["gds"])
    _gds_row(row, rep["gds"])
    _loads_row(row, rep["paths"], rep["gds"].get("reason", ""))
    return "\n".join(row.lines)


def run(args: argparse.Namespace) -> int:
    """Prints the report; exits 1 when the root cannot hold a tier, 2 for an empty --root, else 0."""
    if args.root == "":
        print("pykvtier doctor: root '' is empty (it would mean the current directory)", file=sys.stderr)
        return 2
    rep = collect(args.root, no_gpu=args.no_gpu)
    if args.json:
        print(json.dumps(rep, indent=2, sort_keys=True, default=str))
    else:
        print(format_text(rep))
    return 1 if rep["root"].get("problem") else 0
