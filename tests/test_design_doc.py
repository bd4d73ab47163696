"""docs/design.md names files and functions (the "life of a load" and "life of a store" walk
through them): each path it names exists in the repository, and each function or method named on
the same line as a path is defined in one of that line's files. A rename that leaves the design
document behind fails here."""

from __future__ import annotations

import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(REPO, "docs", "design.md")
_TICKED = re.compile(r"`([^`\n]+)`")
_PATH = re.compile(r"^(?:pykvtier|csrc|bench|tests|scripts|docs|cmake)/[\w./-]*[\w-]$")
_NAME = re.compile(r"^(?:[A-Za-z_]\w*(?:\.|::))*[A-Za-z_]\w*(?:\(\))?$")
_SOURCE_EXT = (".py", ".cpp", ".hpp", ".cu", ".h")


def _lines() -> list[tuple[int, str]]:
    with open(DOC, encoding="utf-8") as f:
        return list(enumerate(f.read().splitlines(), 1))


def _defines(path: str, name: str) -> bool:
    """Whether the file at ``path`` defines ``name`` (its last dotted / :: component): a Python
    def/class/assignment, or a C++ declaration or definition of that name."""
    with open(os.path.join(REPO, path), encoding="utf-8", errors="replace") as f:
        text = f.read()
    last = re.split(r"\.|::", name.removesuffix("()"))[-1]
    if path.endswith(".py"):
        pat = rf"^\s*(?:async\s+def|def|class)\s+{re.escape(last)}\b|^\s*{re.escape(last)}\s*[:=]"
    else:
        pat = (rf"\b{re.escape(last)}\s*\(|\b(?:class|struct|enum(?:\s+class)?|using)\s+"
               rf"{re.escape(last)}\b|\b{re.escape(last)}\s*=|\b{re.escape(last)}\s*;|\b{re.escape(last)}\s*\{{")
    return re.search(pat, text, re.M) is not None


def test_the_design_document_is_in_the_repository():
    assert os.path.isfile(DOC), "docs/design.md is missing"
    text = open(DOC, encoding="utf-8").read()
    for heading in ("Life of a load", "Life of a store"):
        assert re.search(rf"^#+\s*{heading}", text, re.M | re.I), heading


def test_every_path_it_names_exists():
    missing = []
    for no, line in _lines():
        for tok in _TICKED.findall(line):
            tok = tok.split(":")[0] if re.match(r"^[\w./-]+:\d+$", tok) else tok
            if _PATH.match(tok) and not os.path.exists(os.path.join(REPO, tok)):
                missing.append(f"line {no}: {tok}")
    assert missing == []


def test_every_function_named_beside_a_path_is_defined_there():
    wrong = []
    checked = 0
    for no, line in _lines():
        ticked = _TICKED.findall(line)
        paths = [t for t in ticked if _PATH.match(t) and t.endswith(_SOURCE_EXT)
                 and os.path.isfile(os.path.join(REPO, t))]
        if not paths:
            continue
        for tok in ticked:
            if tok in paths or not _NAME.match(tok) or ("." not in tok and "::" not in tok
                                                         and not tok.endswith("()")):
                continue  # plain words in backticks (options, values) are not checked
            checked += 1
            if not any(_defines(p, tok) for p in paths):
                wrong.append(f"line {no}: {tok} not found in {', '.join(paths)}")
    assert wrong == []
    if checked == 0:
        pytest.fail("docs/design.md names no function beside a file: the life-of sections "
                    "must name file and function for each step")
