"""Breaking tests: attacks on the issue #9 hardening (planted links, odd entries, bad markers,
full disks, option checks, operators' commands) that found a real problem. Each asserts exact
values; nothing is timed and no sleep synchronizes anything."""

from __future__ import annotations

import json
import os

import pytest

from pykvtier import DiskTier, layout

BS = 4096


def test_lock_file_hard_linked_to_an_outside_file_is_not_written(root, tmp_path):
    """A hard link at ROOT/.pykvtier.lock to a file outside the root: the exclusive holder's
    pid hint (ftruncate + pwrite) must not land in that file."""
    outside = tmp_path / "victim"
    outside.write_bytes(b"VICTIM DATA\n")
    try:
        os.link(outside, os.path.join(root, layout.LOCK_NAME))
    except OSError as exc:  # tmp_path on another file system than the root
        pytest.skip(f"cannot hard-link across {tmp_path} and {root}: {exc}")
    with pytest.raises(ValueError) as ei:
        DiskTier(root, BS)
    assert str(ei.value) == (f"root {os.path.realpath(root)}: its lock file "
                             f"{os.path.realpath(root)}/{layout.LOCK_NAME} has 2 hard links "
                             "(one may be outside the root); remove it")
    assert outside.read_bytes() == b"VICTIM DATA\n"


def test_deeply_nested_marker_is_a_value_error_naming_it(root):
    """A marker of deeply nested JSON was a RecursionError (not naming the marker)."""
    path = os.path.join(root, layout.ROOT_MARKER)
    with open(path, "w") as f:
        f.write("[" * 20000 + "]" * 20000)
    with pytest.raises(ValueError) as ei:
        layout.read_root_config(root)
    assert str(ei.value).startswith(f"root marker {os.path.realpath(path)} is not JSON (")
    with pytest.raises(ValueError) as ei:
        DiskTier(root, BS)
    assert str(ei.value).startswith(f"root marker {os.path.realpath(path)} is not JSON (")
