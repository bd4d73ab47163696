"""`pykvtier doctor`: runs on any machine, text and JSON, and explains what it found."""

from __future__ import annotations

import json
import os

import pytest

from pykvtier import _native, doctor
from pykvtier.cli import main

SECTIONS = {"pykvtier", "kernel", "io_uring", "root", "memlock", "gpu", "gds", "paths"}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("doctor")
    return str(root), doctor.collect(str(root))


def test_json_has_every_section_and_key(report, capsys):
    root, _ = report
    assert main(["doctor", "--root", root, "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert set(rep) == SECTIONS
    assert {"release", "machine"} <= set(rep["kernel"])
    u = rep["io_uring"]
    assert {"available", "error", "setup_flags", "features", "ops", "checks", "engine", "engine_reason",
            "io_uring_disabled_sysctl"} <= set(u)
    assert set(u["setup_flags"]) == {"SUBMIT_ALL", "COOP_TASKRUN", "SINGLE_ISSUER", "DEFER_TASKRUN"}
    assert {"OPENAT", "READ_FIXED", "STATX", "RENAMEAT", "UNLINKAT"} <= set(u["ops"])
    r = rep["root"]
    assert r["path"] == os.path.abspath(root) and r["exists"] and r["fstype"]
    assert {"direct", "mem_align", "offset_align", "dioalign_from_statx", "reason", "alignment_enforced",
            "alignment_probe"} <= set(r["o_direct"])
    assert r["statfs_type"] == _native.statfs_type(root)
    assert {"soft", "hard", "unlimited", "note"} <= set(rep["memlock"])
    assert {"devices", "driver_version", "nvidia_smi", "torch", "cuda_available"} <= set(rep["gpu"])
    g = rep["gds"]
    assert {"built", "build_reason", "importable", "usable", "reason", "packages", "nvidia_fs_module",
            "run_udev_readable", "cufile_json"} <= set(g)
    p = rep["paths"]
    assert p["host_engine"] in ("uring", "posix") and p["device"]["path"] in ("gds", "bounce", "kvikio-compat")
    assert p["device"]["reason"]
    # the text states each reason once; the JSON keeps them all, in full
    assert g["build_reason"] and g["reason"]
    if not g["usable"]:
        assert p["device"]["reason"].startswith(g["reason"] + "; ")
    if not g["built"]:
        assert g["reason"] == f"gds engine {g['build_reason']}"
    # nothing left behind in the root
    assert os.listdir(root) == []


def test_io_uring_checks_are_real(report):
    _, rep = report
    u = rep["io_uring"]
    if not u["available"]:
        assert u["error"] and u["engine"] == "posix"
        return
    checks = u["checks"]
    assert {"fixed_file_table", "register_buffers_1MiB", "openat_direct", "close_direct", "statx",
            "renameat_noreplace", "unlinkat"} <= set(checks)
    for name, (ok, detail) in checks.items():
        assert isinstance(ok, bool) and detail, name
    if u["engine"] == "uring":  # the engine starts only where its ring set-up works
        assert checks["fixed_file_table"][0] and checks["openat_direct"][0]


def test_text_explains_the_machine(report):
    _, rep = report
    text = doctor.format_text(rep)
    for label in ("kernel", "io_uring", "root", "O_DIRECT", "RLIMIT_MEMLOCK", "GPU", "kvikio",
                  "cuFile / GDS", "loads"):
        assert any(line.startswith(label) for line in text.splitlines()), label
    assert "host arenas:" in text and "GPU arenas:" in text
    dev, gds_reason = rep["paths"]["device"], rep["gds"]["reason"]
    # the GPU-arena path's own part of its reason; the GDS verdict it starts with is in its row
    own = dev["reason"][len(gds_reason) + 2:] if dev["reason"].startswith(gds_reason + "; ") else None
    assert (own or "GPUDirect Storage (see cuFile / GDS)") in text
    assert f"cuFile / GDS    {'usable' if rep['gds']['usable'] else 'not usable'}: " in text
    # each reason once (the JSON has them all, in full)
    assert text.count(rep["gds"]["build_reason"]) == 1
    if not rep["gds"]["usable"]:
        assert text.count(gds_reason) <= 1
    if not rep["gpu"]["devices"] and not rep["gds"].get("cuda_devices"):
        assert "GPU             none (" in text and "no GPU here" in text


def test_missing_root_probes_its_parent_and_no_gpu(tmp_path, capsys):
    missing = tmp_path / "not" / "yet"
    assert main(["doctor", "--root", str(missing), "--no-gpu"]) == 0
    out = capsys.readouterr().out
    mnt = doctor._mount_of(str(tmp_path))
    assert (f"root            {missing}: missing; the tier would create it under {tmp_path}, on "
            f"{mnt['fstype']} on {mnt['source']} (mounted at {mnt['mount']}), ") in out
    assert "not probed (--no-gpu)" in out
    assert not missing.exists()
    r = doctor._root(str(missing))
    assert (r["created_under"], r["probed_instead"], r["exists"]) == (str(tmp_path), str(tmp_path), False)


_ROOT_FS = {"mount": "/", "fstype": "ext4", "source": "/dev/vda"}


def _under_mount_dir(path: str, top: str, exists: bool = False) -> str:
    """doctor's warning for a root under a mount-point directory with nothing mounted there."""
    return (f"{path} is under {top}, where devices are mounted, but nothing is mounted on the way "
            f"to it: the root {'is' if exists else 'would be created'} on the file system of / (ext4 "
            "on /dev/vda); mount the device first, or pass the root you meant")


def _new_tree(first_missing: str) -> str:
    """doctor's warning for a root whose parents are missing too (a new tree on /)."""
    return (f"{first_missing} does not exist: the tier would create it and the directories below it "
            f"on the file system of / (ext4 on /dev/vda); if a device should be mounted at "
            f"{first_missing}, mount it first")


@pytest.mark.parametrize("path,exists,probe_dir,mount,warning", [
    # the first missing component is a mount point by convention: nothing is mounted there
    ("/mnt/nvme0/kv", False, "/mnt", _ROOT_FS, _under_mount_dir("/mnt/nvme0/kv", "/mnt")),
    # the mount point's directory exists (fstab's), the device is not mounted on it
    ("/mnt/nvme0/kv", False, "/mnt/nvme0", _ROOT_FS, _under_mount_dir("/mnt/nvme0/kv", "/mnt")),
    # a root made there earlier, while the device was not mounted
    ("/media/usb/kv", True, "/media/usb/kv", _ROOT_FS,
     _under_mount_dir("/media/usb/kv", "/media", exists=True)),
    ("/run/media/me/disk/kv", False, "/run/media/me", _ROOT_FS,
     _under_mount_dir("/run/media/me/disk/kv", "/run/media")),
    # missing parents: a new tree on /
    ("/nonexist/a/b/kv", False, "/", _ROOT_FS, _new_tree("/nonexist")),
    ("/data/kv", False, "/", _ROOT_FS, _new_tree("/data")),
    ("/var/tmp/a/kv", False, "/var/tmp", _ROOT_FS, _new_tree("/var/tmp/a")),
    # only the root itself is missing, or it exists, outside /mnt and /media: no warning
    ("/var/tmp/kv", False, "/var/tmp", _ROOT_FS, None),
    ("/var/tmp/kv", True, "/var/tmp/kv", _ROOT_FS, None),
    # on a file system other than /'s: mounted, no warning
    ("/mnt/nvme0/kv", False, "/mnt/nvme0", {"mount": "/mnt/nvme0", "fstype": "xfs", "source": "/dev/nvme0n1"},
     None),
    ("/mnt/nvme0/a/b/kv", False, "/mnt/nvme0", {"mount": "/mnt/nvme0", "fstype": "xfs", "source": "/dev/nvme0n1"},
     None),
    ("/tmp/a/kv", False, "/tmp", {"mount": "/tmp", "fstype": "tmpfs", "source": "tmpfs"}, None),
    ("/mntx/kv", False, "/mntx", _ROOT_FS, None),  # /mntx is not /mnt
])
def test_unmounted_warning_rule(path, exists, probe_dir, mount, warning):
    assert doctor.unmounted_warning(path, exists, probe_dir, mount) == warning


def test_missing_root_on_the_root_file_system_warns(tmp_path, capsys, monkeypatch):
    """A root whose parents are missing, on the file system of / (here: reported so): the
    report says where it would be created, on which file system, and warns; exit 0."""
    monkeypatch.setattr(doctor, "_mount_of", lambda path: {**_ROOT_FS, "mount_options": ["rw"]})
    missing = tmp_path / "new" / "kv"
    assert main(["doctor", "--root", str(missing), "--no-gpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    (row,) = [line for line in lines if line.startswith("root            ")]
    assert row.startswith(f"root            {missing}: missing; the tier would create it under {tmp_path}, "
                          "on ext4 on /dev/vda (mounted at /), ")
    assert lines[lines.index(row) + 1] == (
        f"root WARNING    {tmp_path / 'new'} does not exist: the tier would create it and the directories "
        f"below it on the file system of / (ext4 on /dev/vda); if a device should be mounted at "
        f"{tmp_path / 'new'}, mount it first")
    assert not (tmp_path / "new").exists()
    rep = doctor.collect(str(tmp_path / "kv"), no_gpu=True)  # only the root missing: no warning
    assert rep["root"]["mount_warning"] is None and rep["root"]["created_under"] == str(tmp_path)


def test_root_argument_tilde_and_empty(tmp_path, capsys, monkeypatch):
    """``--root '~/kv'`` is $HOME/kv (as a shell would expand it); ``--root ""`` (an unset
    variable) is refused as DiskTier refuses it, not taken for the current directory."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    rep = doctor.collect("~/kv", no_gpu=True)
    assert (rep["root"]["path"], rep["root"]["created_under"]) == (str(tmp_path / "kv"), str(tmp_path))
    assert main(["doctor", "--root", "", "--no-gpu"]) == 2
    assert capsys.readouterr() == ("", "pykvtier doctor: root '' is empty (it would mean the current directory)\n")
    with pytest.raises(ValueError, match=r"^root '' is empty \(it would mean the current directory\)$"):
        doctor.collect("", no_gpu=True)
    assert os.listdir(tmp_path) == []


def test_unusable_root_is_a_problem_and_exit_1(tmp_path, capsys):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    assert main(["doctor", "--root", str(a_file), "--no-gpu"]) == 1
    out = capsys.readouterr().out
    assert "root PROBLEM    not a directory: the tier cannot use it" in out
    assert "falls back to buffered I/O" not in out
    assert "torch not probed (--no-gpu)" in out or "GPU             none" not in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_text_for_other_machines(report):
    """The text for a machine without io_uring, and for a GPU machine with GDS (synthetic reports)."""
    import copy

    _, rep = report
    r = copy.deepcopy(rep)
    r["io_uring"] = {"available": False, "error": "io_uring_setup: EPERM: Operation not permitted",
                     "io_uring_disabled_sysctl": "2", "engine": "posix",
                     "engine_reason": "io_uring unavailable: the posix engine (preadv/pwritev threads) is used instead"}
    r["root"]["o_direct"] = {"direct": False, "reason": "open(O_DIRECT) failed: Invalid argument"}
    r["gpu"].update(devices=[{"index": 0, "name": "NVIDIA H200", "capability": "9.0", "memory_bytes": 150 << 30}],
                    driver_version="580.159.04", torch="2.11.0+cu130", torch_cuda="13.0")
    r["gds"].update(built=True, importable=True, build_reason="built against kvikio 26.10.0",
                    import_reason="loaded", kvikio_version="26.10.0", cufile_library=True, cufile_version=1190,
                    gds_available=True, nvfs_version="2.26", compat_mode_default="AUTO", usable=True,
                    reason="GPUDirect Storage usable (nvidia-fs 2.26, cuFile 1190, kvikio 26.10.0)",
                    root_probe={"opened": True, "compat": False, "reason": "cuFile registered the file: GDS I/O"},
                    notes=[], cuda_devices=1)
    r["paths"] = {"host_engine": "posix", "host_io": "buffered I/O (open(O_DIRECT) failed)",
                  "host": "posix engine, buffered I/O (open(O_DIRECT) failed)",
                  "device": {"path": "gds", "reason": r["gds"]["reason"], "fallback": False, "gpu_present": True}}
    text = doctor.format_text(r)
    assert "io_uring        unavailable: io_uring_setup: EPERM" in text and "kernel.io_uring_disabled=2" in text
    assert "O_DIRECT        no: open(O_DIRECT) failed" in text
    assert "cuda:0 NVIDIA H200 (sm 9.0, 150.0 GiB)" in text and "driver 580.159.04" in text
    assert "cuFile / GDS    usable: GPUDirect Storage usable" in text and "at the root: cuFile registered" in text
    assert "GPU arenas: gds path: GPUDirect Storage (see cuFile / GDS)" in text
    assert text.count("GPUDirect Storage usable (nvidia-fs 2.26") == 1
    assert "kvikio          26.10.0" in text and "gds engine built against kvikio 26.10.0; loads" in text


KVIKIO_MISSING = ("not built: kvikio not found at build time (pip install libkvikio-cu12 or libkvikio-cu13 "
                  "into the build environment, or set kvikio_DIR)")
IMPORT_FAILED = "does not load: libkvikio.so: cannot open shared object file"


@pytest.mark.parametrize("built,importable,gpu_present", [
    (False, False, False), (False, False, True), (True, False, True), (True, False, False)])
def test_kvikio_reason_appears_once(report, capsys, built, importable, gpu_present):
    """The gds engine's build/import reason is one fact: the kvikio row states it, the cuFile /
    GDS row and the GPU-arena path refer to it; the JSON keeps every reason in full."""
    import copy

    from pykvtier import gpu

    _, rep = report
    r = copy.deepcopy(rep)
    r["gds"].update(built=built, importable=importable,
                    build_reason=KVIKIO_MISSING if not built else "built against kvikio 26.10.0",
                    import_reason=KVIKIO_MISSING if not built else IMPORT_FAILED,
                    kvikio_version=None, build_kvikio_version=None if not built else "26.10.0",
                    cuda_devices=0, usable=False, packages={})
    r["gds"]["usable"], r["gds"]["reason"] = gpu._gds_verdict(r["gds"], None)
    r["gpu"]["devices"] = ([{"index": 0, "name": "NVIDIA H200", "capability": "9.0",
                             "memory_bytes": 150 << 30}] if gpu_present else [])
    choice = gpu.choose_path(r["gds"], "auto", "uring")
    r["paths"]["device"] = {"path": choice.path, "reason": choice.reason, "fallback": choice.fallback,
                            "gpu_present": gpu_present}
    text = doctor.format_text(r)
    fact = KVIKIO_MISSING if not built else IMPORT_FAILED
    assert text.count(fact) == 1, text
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("kvikio"))
    assert fact in lines[at + 1] and lines[at + 1].startswith(" " * 16 + "gds engine ")
    assert ("cuFile / GDS    not usable: the gds engine "
            + ("is not built" if not built else "does not load") + " (see kvikio)") in text
    (loads,) = [line for line in lines if "GPU arenas:" in line]
    assert loads.endswith("bounce path: loads take io_uring into a pinned bounce arena, then host-to-device "
                          "copies overlapped per chunk (GDS not usable: see cuFile / GDS)")
    assert ("no GPU here" in loads) is not gpu_present


# ---------------------------------------------------------------------------- data checksums

@pytest.mark.parametrize("fstype,options,nocow,checksums,reason_has", [
    ("btrfs", ["rw", "relatime", "space_cache=v2"], False, True, "btrfs checksums every data block"),
    ("btrfs", ["rw", "nodatasum"], False, False, "mounted nodatasum"),
    ("btrfs", ["rw", "nodatacow"], False, False, "mounted nodatacow"),
    ("btrfs", ["rw"], True, False, "No_COW"),
    ("btrfs", ["rw"], None, True, "btrfs checksums"),  # flags unreadable: the mount decides
    ("zfs", ["rw", "xattr"], False, True, "ZFS checksums every block"),
    ("bcachefs", ["rw"], False, True, "bcachefs checksums data"),
    ("bcachefs", ["rw", "data_checksum=none"], False, False, "data_checksum=none"),
    ("ext4", ["rw", "relatime"], False, False, "ext4 does not checksum file data"),
    ("xfs", ["rw"], False, False, "xfs does not checksum file data"),
    ("tmpfs", ["rw"], True, False, "tmpfs does not checksum file data"),
    (None, [], None, False, "file system type unknown"),
])
def test_data_checksums_decision(fstype, options, nocow, checksums, reason_has):
    d = doctor.data_checksums(fstype, options, nocow)
    assert d["checksums"] is checksums
    assert reason_has in d["reason"]
    assert d["suggested_verify"] == ("header" if checksums else "payload")


def test_root_on_a_file_system_without_data_checksums(tmp_path, capsys):
    """This machine's own roots: the test directory and /dev/shm (tmpfs) where writable."""
    roots = [str(tmp_path)] + (["/dev/shm"] if os.access("/dev/shm", os.W_OK) else [])
    for root in roots:
        assert main(["doctor", "--root", root, "--json", "--no-gpu"]) == 0
        r = json.loads(capsys.readouterr().out)["root"]
        if r["fstype"] in ("btrfs", "zfs", "bcachefs"):
            continue  # a checksumming test directory: covered by the loop-device test below
        assert r["data_checksums"] == {"checksums": False,
                                       "reason": f"{r['fstype']} does not checksum file data",
                                       "suggested_verify": "payload"}
        assert main(["doctor", "--root", root, "--no-gpu"]) == 0
        text = capsys.readouterr().out
        assert f"data checksums  no: {r['fstype']} does not checksum file data\n" in text
        assert 'keep verify="payload"' in text and 'verify="header"' not in text


@pytest.fixture
def btrfs_mount(tmp_path):
    """mount(options) -> a directory on a fresh btrfs (a loop-mounted image file), mounted
    with ``options``; unmounted at the end. Skips without root, mkfs.btrfs or loop mounts."""
    import shutil
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("needs root (mount -o loop)")
    if shutil.which("mkfs.btrfs") is None:
        pytest.skip("mkfs.btrfs not installed (btrfs-progs)")
    image, where = tmp_path / "btrfs.img", tmp_path / "mnt"
    with open(image, "wb") as f:
        f.truncate(256 << 20)
    where.mkdir()
    subprocess.run(["mkfs.btrfs", "-q", str(image)], check=True, capture_output=True)
    mounted = []

    def mount(options: str) -> str:
        if mounted:
            subprocess.run(["umount", str(where)], check=True)
            mounted.clear()
        r = subprocess.run(["mount", "-o", f"loop,{options}", str(image), str(where)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot loop-mount a btrfs image here: {r.stderr.strip()}")
        mounted.append(True)
        return str(where)

    yield mount
    if mounted:
        subprocess.run(["umount", str(where)], check=True)


def _checksums_of(root, capsys) -> tuple[dict, str]:
    assert main(["doctor", "--root", root, "--json", "--no-gpu"]) == 0
    r = json.loads(capsys.readouterr().out)["root"]
    assert main(["doctor", "--root", root, "--no-gpu"]) == 0
    return r, capsys.readouterr().out


def test_btrfs_root_checksums_data_unless_nodatasum_or_nocow(btrfs_mount, capsys):
    import subprocess

    root = btrfs_mount("rw")
    r, text = _checksums_of(root, capsys)
    assert r["fstype"] == "btrfs" and r["mount"] == root
    assert r["data_checksums"] == {
        "checksums": True, "suggested_verify": "header",
        "reason": "btrfs checksums every data block and fails a read whose bytes do not match"}
    assert "data checksums  yes: btrfs checksums every data block" in text
    assert 'suggested: verify="header"' in text

    nocow = os.path.join(root, "nocow")
    os.mkdir(nocow)
    subprocess.run(["chattr", "+C", nocow], check=True)
    r, text = _checksums_of(nocow, capsys)
    assert r["data_checksums"]["checksums"] is False and "No_COW" in r["data_checksums"]["reason"]
    assert r["data_checksums"]["suggested_verify"] == "payload" and 'keep verify="payload"' in text

    root = btrfs_mount("nodatasum")
    r, text = _checksums_of(root, capsys)
    assert "nodatasum" in r["mount_options"]
    assert r["data_checksums"] == {"checksums": False, "suggested_verify": "payload",
                                   "reason": "btrfs mounted nodatasum: data blocks carry no checksums"}
    assert "data checksums  no: btrfs mounted nodatasum" in text


# ------------------------------------------------------------------------- O_DIRECT alignment

EXT4_MAGIC, TMPFS_MAGIC, BTRFS_MAGIC = 0xEF53, 0x01021994, 0x9123683E


def _tries(verb: str, outcome: str, unit: int = 4096) -> str:
    """The probe's alignment_probe where both of its unaligned transfers answered ``outcome``."""
    return (f"an O_DIRECT {verb} of {unit} B at file offset 1: {outcome}; "
            f"an O_DIRECT {verb} of {unit} B from memory 1 byte past its alignment: {outcome}")


def _direct_truth(where: str) -> tuple[bool, bool | None]:
    """What plain syscalls say of where's file system: (an aligned O_DIRECT write works,
    an unaligned one -- at offset 1 -- is refused with EINVAL), without the probe."""
    import errno
    import mmap

    path = os.path.join(where, "truth")
    try:
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600)
    except OSError as exc:
        assert exc.errno == errno.EINVAL
        return False, None
    try:
        buf = mmap.mmap(-1, 8192)  # page-aligned
        assert os.pwrite(fd, memoryview(buf)[:4096], 0) == 4096
        try:
            os.pwrite(fd, memoryview(buf)[:4096], 1)
            return True, False
        except OSError as exc:
            assert exc.errno == errno.EINVAL
            return True, True
    finally:
        os.close(fd)
        os.unlink(path)


def test_alignment_is_enforced_on_ext4(tmp_path, capsys):
    """This machine's test directory is on ext4 (a block device): an unaligned O_DIRECT
    transfer is refused, EINVAL, at an unaligned offset and from unaligned memory alike."""
    if _native.statfs_type(str(tmp_path)) != EXT4_MAGIC:
        pytest.skip(f"{tmp_path} is not on ext4 here")
    p = _native.probe_direct(str(tmp_path))
    assert (p["direct"], p["alignment_enforced"]) == (True, True)
    assert p["alignment_probe"] == _tries("write", "refused, Invalid argument")
    assert os.listdir(tmp_path) == []
    assert main(["doctor", "--root", str(tmp_path), "--json", "--no-gpu"]) == 0
    r = json.loads(capsys.readouterr().out)["root"]
    assert r["o_direct"] == p and r["statfs_type"] == EXT4_MAGIC
    assert main(["doctor", "--root", str(tmp_path), "--no-gpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("O_DIRECT  "))
    assert lines[at + 1:at + 3] == [
        " " * 16 + "alignment enforced: yes (an unaligned O_DIRECT transfer is refused): O_DIRECT goes "
                   "to the block layer",
        " " * 16 + "probed: " + p["alignment_probe"]]
    assert any(ln.startswith("root  ") and ln.endswith("; statfs f_type 0xef53") for ln in lines)


def test_alignment_on_a_fresh_tmpfs_is_what_the_kernel_does():
    """tmpfs: whether it takes O_DIRECT at all depends on the kernel (it does from 6.6, through
    the page cache, so any alignment); the probe must say what plain syscalls find."""
    from test_engine_hardening import mounted

    with mounted("tmpfs", "size=4m") as where:
        direct, enforced = _direct_truth(where)
        p = _native.probe_direct(where)
        assert (p["direct"], p["alignment_enforced"]) == (direct, enforced)
        if direct:  # (this machine's kernel: 6.x, it does; both unaligned writes are taken)
            assert enforced is False
            assert p["alignment_probe"] == _tries("write", "taken (4096 B)")
        else:
            assert p["alignment_probe"] == ""
        assert os.listdir(where) == []
        text = doctor.format_text(doctor.collect(where, no_gpu=True))
        if direct:
            assert ("alignment enforced: no (unaligned O_DIRECT transfers are taken): O_DIRECT here is "
                    "not the block layer's direct path") in text
        assert "; statfs f_type 0x1021994" in text


def test_alignment_on_btrfs_is_not_enforced(btrfs_mount):
    """btrfs takes an unaligned O_DIRECT transfer by falling back to buffered I/O for it, so
    alignment is not enforced there although its aligned O_DIRECT is the direct path."""
    root = btrfs_mount("rw")
    assert _native.statfs_type(root) == BTRFS_MAGIC
    assert _direct_truth(root) == (True, False)
    p = _native.probe_direct(root)
    assert (p["direct"], p["alignment_enforced"]) == (True, False)
    assert p["alignment_probe"] == _tries("write", "taken (4096 B)")


def test_alignment_unknown_without_o_direct(monkeypatch):
    """No O_DIRECT (ramfs refuses it): nothing to probe, unknown; the text says no O_DIRECT."""
    from test_engine_hardening import mounted

    with mounted("ramfs") as where:
        p = _native.probe_direct(where)
        assert (p["direct"], p["alignment_enforced"], p["alignment_probe"]) == (False, None, "")
        text = doctor.format_text(doctor.collect(where, no_gpu=True))
        assert "O_DIRECT        no: open(O_DIRECT) failed: Invalid argument" in text
        assert "alignment enforced" not in text
