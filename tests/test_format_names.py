"""Format knowledge lives in the format: outside a format's own file, the registry and
the presets, no module of mixprec names a scaling or a Linear preset in code, nor asks
``compute == "fp8"``; it asks the recipe's format object instead."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "mixprec"

#: where names may appear: each format's file and the registry, and the preset list
ALLOWED = {*(p.relative_to(SRC).as_posix() for p in (SRC / "fp8" / "formats").glob("*.py")),
           "recipe/presets.py"}
#: the scalings' names, the Linear presets' names and the flush views'
NAMES = {"delayed", "current", "rowwise", "block", "mx", "nvfp4", "mxfp8", "fp8-current",
         "fp8-rowwise", "fp8-block", "per block", "per-tensor"}


def _docstrings(tree: ast.AST) -> set[int]:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, kinds) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def _fp8(node: ast.AST) -> bool:
    elts = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return any(isinstance(e, ast.Constant) and e.value == "fp8" for e in elts)


def offences(source: str) -> list[tuple[int, str]]:
    """(line, what) of each format name in code (not in a docstring) and each
    comparison of a ``compute`` with ``"fp8"``."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value in NAMES and id(node) not in docs:
            out.append((node.lineno, repr(node.value)))
        if isinstance(node, ast.Compare):
            left = node.left
            named = (isinstance(left, ast.Attribute) and left.attr == "compute" or
                     isinstance(left, ast.Subscript) and isinstance(left.slice, ast.Constant)
                     and left.slice.value == "compute")
            if named and any(_fp8(c) for c in node.comparators):
                out.append((node.lineno, "compute compared with 'fp8'"))
    return out


def test_no_module_outside_the_formats_and_presets_names_a_format():
    found = [f"{p.relative_to(SRC).as_posix()}:{line}: {what}"
             for p in sorted(SRC.rglob("*.py")) if p.relative_to(SRC).as_posix() not in ALLOWED
             for line, what in offences(p.read_text())]
    assert found == []


def test_the_scan_sees_a_branch_on_a_name_and_on_compute():
    code = ('"""doc: nvfp4 is fine here"""\n'
            'if fmt == "nvfp4" or r.compute == "fp8" or flat["compute"] in ("fp8",):\n'
            '    x = "the block kernel"\n')
    assert sorted(offences(code)) == [(2, "'nvfp4'"), (2, "compute compared with 'fp8'"),
                                      (2, "compute compared with 'fp8'")]
