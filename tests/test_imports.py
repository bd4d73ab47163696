"""The import contracts of pyproject.toml's ``[tool.importlinter]`` hold: the library never
imports its tools, and every module sits in its layer. Checked with ``lint-imports``
(import-linter, a test extra), on the source tree, and on copies of it with one bad import
injected, to show that the contracts catch it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINT_IMPORTS = os.path.join(os.path.dirname(sys.executable), "lint-imports")
PROBE = "kvlintprobe"  # the package's name in the copies (the installed pykvtier cannot shadow it)
FORBIDDEN = "the library never imports its tools"
LAYERS = "tools above the library"


def _lint(cwd: str) -> tuple[int, str]:
    if not os.path.exists(LINT_IMPORTS):
        pytest.fail(f"{LINT_IMPORTS} is missing: install the test extras (pip install '.[test]')")
    proc = subprocess.run([LINT_IMPORTS, "--no-cache", "--no-logo", "pyproject.toml"], cwd=cwd,
                          capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def _verdicts(output: str) -> dict[str, str]:
    """Contract name -> "KEPT" / "BROKEN", from lint-imports' summary lines."""
    return dict(re.findall(r"^(.+?) (KEPT|BROKEN)\s*$", output, re.MULTILINE))


def _importlinter_config() -> str:
    """pyproject.toml's [tool.importlinter] tables (they end the file)."""
    with open(os.path.join(REPO, "pyproject.toml")) as f:
        text = f.read()
    start = text.index("[tool.importlinter]")
    assert not re.search(r"^\[(?!tool\.importlinter|\[tool\.importlinter)", text[start:], re.MULTILINE), \
        "tables after [tool.importlinter] in pyproject.toml: _importlinter_config() would copy them"
    return text[start:]


@pytest.fixture
def probe_tree(tmp_path):
    """A copy of the package's Python files as ``kvlintprobe`` with the same contracts."""
    shutil.copytree(os.path.join(REPO, "pykvtier"), tmp_path / PROBE,
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "data"))
    (tmp_path / "pyproject.toml").write_text(_importlinter_config().replace("pykvtier", PROBE))
    return tmp_path


def test_the_source_tree_keeps_every_contract():
    rc, out = _lint(REPO)
    assert rc == 0, out
    assert _verdicts(out) == {FORBIDDEN: "KEPT", LAYERS: "KEPT"}, out
    assert "Contracts: 2 kept, 0 broken." in out, out


def test_an_unchanged_copy_keeps_every_contract(probe_tree):
    """The copy the next tests break passes as it is: their failures are the injected imports."""
    rc, out = _lint(str(probe_tree))
    assert rc == 0, out
    assert _verdicts(out) == {FORBIDDEN: "KEPT", LAYERS: "KEPT"}, out


def _append(path, line: str) -> None:
    with open(path, "a") as f:
        f.write(f"\n{line}\n")


def test_a_library_module_importing_a_tool_breaks_both_contracts(probe_tree):
    _append(probe_tree / PROBE / "layout.py", "from .replay import block_key  # noqa: E402")
    rc, out = _lint(str(probe_tree))
    assert rc == 1, out
    assert _verdicts(out) == {FORBIDDEN: "BROKEN", LAYERS: "BROKEN"}, out
    assert f"{PROBE}.layout -> {PROBE}.replay" in out, out


def test_an_indirect_import_through_a_helper_breaks_the_forbidden_contract(probe_tree):
    """tier imports a library module that imports the bench: caught although tier never
    names the bench."""
    (probe_tree / PROBE / "config.py").write_text("from .bench import options  # noqa: F401\n")
    _append(probe_tree / PROBE / "tier.py", "from . import config  # noqa: E402,F401")
    rc, out = _lint(str(probe_tree))
    assert rc == 1, out
    assert _verdicts(out)[FORBIDDEN] == "BROKEN", out
    assert f"{PROBE}.tier -> {PROBE}.config" in out and f"{PROBE}.bench" in out, out


def test_a_module_in_no_layer_breaks_the_layers_contract(probe_tree):
    (probe_tree / PROBE / "stray.py").write_text('"""A module nobody placed."""\n')
    rc, out = _lint(str(probe_tree))
    assert rc == 1, out
    assert _verdicts(out) == {FORBIDDEN: "KEPT", LAYERS: "BROKEN"}, out
    assert f"{PROBE}.stray" in out, out
