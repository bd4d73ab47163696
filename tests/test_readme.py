"""The README's engine example runs as printed (with the storage root moved under the test's)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def test_readme_engine_example_runs(root):
    with open(README) as f:
        text = f.read()
    section = text[text.index("## Using it from an engine"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert '"/var/tmp/kv"' in code
    code = code.replace('"/var/tmp/kv"', repr(os.path.join(root, "kv")))
    for run in range(2):  # the second run finds the block already stored
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
        assert proc.returncode == 0, proc.stderr[-2000:]
        lines = proc.stdout.splitlines()
        assert lines[-2:] == ["1 True {}", "2 True {}"]
        first = ["LookupResult.MISS", "LookupResult.RETRY", "LookupResult.HIT"]
        assert lines[:3] == (first if run == 0 else ["LookupResult.HIT"] * 3)
        assert lines[3] == "LookupResult.HIT_PENDING"


def test_a_source_tree_without_compiled_modules_says_so(tmp_path):
    # A checkout in the working directory shadows the installed package (README: run scripts
    # from outside the repository's root); the import error says that, not "circular import".
    import shutil

    import pykvtier

    src = os.path.dirname(pykvtier.__file__)
    shutil.copytree(src, tmp_path / "pykvtier", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    proc = subprocess.run([sys.executable, "-S", "-c", "import pykvtier"], capture_output=True,
                          text=True, cwd=tmp_path)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ImportError: pykvtier: {tmp_path / 'pykvtier'} has no compiled modules")
    assert "shadows the installed package" in last


def test_in_tree_python_commands_use_dash_P():
    """Every ``python -c`` / ``python -m`` the README prints carries ``-P`` (Python 3.11+): run
    in the clone's root, where the user is after setup, the source tree's ``pykvtier/`` would
    otherwise shadow the installed package."""
    with open(README) as f:
        text = f.read()
    found = re.findall(r"\bpython3?((?:\s+-[A-Za-z]+)*?)\s+-([cm])\b", text)
    assert len(found) >= 2
    assert [flags for flags, _ in found if "-P" not in flags.split()] == []


def test_readme_gds_status_command_runs_in_a_source_tree(tmp_path):
    """The README's gds status one-liner, run where a source tree without compiled modules is
    the working directory (a clone's root): it imports the installed package and prints the
    status dictionary. (Without ``-P`` a regular install fails there; an editable install's
    import hook finds its own tree first, so only the command as printed is checked.)"""
    import shlex
    import shutil

    import pykvtier

    if sys.version_info < (3, 11):
        pytest.skip("-P needs Python 3.11")
    with open(README) as f:
        (cmd,) = re.findall(r'`(python -P -c "from pykvtier import gpu; [^`]*)`', f.read())
    shutil.copytree(os.path.dirname(pykvtier.__file__), tmp_path / "pykvtier",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    argv = shlex.split(cmd)
    proc = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("{'built': ")
