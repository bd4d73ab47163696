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
