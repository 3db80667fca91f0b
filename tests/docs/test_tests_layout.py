"""The suite's own layout: every test module sits in the folder of the package it tests
(none at tests/'s root), no basename repeats across folders (pytest imports test modules
by basename), and no test module imports another test module: what several share lives
in ``helpers/``."""

from __future__ import annotations

import ast
from collections import Counter

from helpers.paths import TESTS


def _test_modules() -> list:
    return sorted(TESTS.rglob("test_*.py"))


def _imported_names(path) -> set[str]:
    """Every module an ``import`` or ``from ... import`` in ``path`` names, with each name
    a ``from`` imports (a module may be imported as a name of its package)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            out.add(node.module or "")
            out |= {a.name for a in node.names}
    return out


def test_no_test_module_imports_another_test_module():
    bad = {}
    for p in _test_modules():
        hits = sorted(n for n in _imported_names(p)
                      if any(part.startswith("test_") or part == "conftest"
                             for part in n.split(".")))
        if hits:
            bad[str(p.relative_to(TESTS))] = hits
    assert not bad, f"move what they share into tests/helpers/: {bad}"


def test_the_scan_sees_such_an_import(tmp_path):
    """The control: the scan finds both spellings of an import of a test module."""
    p = tmp_path / "test_x.py"
    p.write_text("import os\nfrom test_engine import spawn\nimport test_tp as t\n"
                 "def f():\n    from conftest import mlp\n")
    assert {"test_engine", "test_tp", "conftest"} <= _imported_names(p)


def test_every_test_module_sits_in_a_package_folder():
    modules = _test_modules()
    assert len(modules) > 90  # the scan found the suite
    at_root = [p.name for p in modules if p.parent == TESTS]
    assert not at_root, f"move these into tests/<package>/: {at_root}"
    in_helpers = [p.name for p in modules if p.parent.name == "helpers"]
    assert not in_helpers, f"helpers/ holds no tests (pytest would collect them): {in_helpers}"


def test_no_basename_repeats_across_folders():
    counts = Counter(p.name for p in _test_modules())
    assert not [n for n, c in counts.items() if c > 1], counts.most_common(3)


def test_no_test_folder_is_a_package():
    """Folders without ``__init__.py``: the modules import by basename, with tests/ on
    the path for ``helpers``."""
    inits = [str(p.relative_to(TESTS)) for p in TESTS.rglob("__init__.py")
             if p.parent != TESTS / "helpers"]
    assert not inits, inits
