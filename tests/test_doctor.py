"""`pykvtier doctor`: runs on any machine, text and JSON, and explains what it found."""

from __future__ import annotations

import json
import os

import pytest

from pykvtier import doctor
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
    assert {"direct", "mem_align", "offset_align", "dioalign_from_statx", "reason"} <= set(r["o_direct"])
    assert {"soft", "hard", "unlimited", "note"} <= set(rep["memlock"])
    assert {"devices", "driver_version", "nvidia_smi", "torch", "cuda_available"} <= set(rep["gpu"])
    g = rep["gds"]
    assert {"built", "build_reason", "importable", "usable", "reason", "packages", "nvidia_fs_module",
            "run_udev_readable", "cufile_json"} <= set(g)
    p = rep["paths"]
    assert p["host_engine"] in ("uring", "posix") and p["device"]["path"] in ("gds", "bounce", "kvikio-compat")
    assert p["device"]["reason"]
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
    assert rep["paths"]["device"]["reason"] in text
    if not rep["gpu"]["devices"] and not rep["gds"].get("cuda_devices"):
        assert "GPU             none (" in text and "no GPU here" in text


def test_missing_root_probes_its_parent_and_no_gpu(tmp_path, capsys):
    missing = tmp_path / "not" / "yet"
    assert main(["doctor", "--root", str(missing), "--no-gpu"]) == 0
    out = capsys.readouterr().out
    assert f"{missing} (missing; probed {tmp_path})" in out
    assert "not probed (--no-gpu)" in out
    assert not missing.exists()
