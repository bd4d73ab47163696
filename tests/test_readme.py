"""The README's engine example runs as printed (with the storage root moved under the test's)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

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
