"""Format knowledge lives in the format: outside a format's own file, the registry and
the presets, no module of mixprec names a scaling or a Linear preset in code, nor asks
``compute == "fp8"``; it asks the recipe's format object instead."""

from __future__ import annotations

import ast

from helpers.paths import SRC

#: where names may appear: each format's file and the registry, and the preset list
ALLOWED = {*(p.relative_to(SRC).as_posix() for p in (SRC / "formats" / "gemm").glob("*.py")),
           "recipe/presets.py"}
#: the scalings' names, the Linear presets' names and the flush views'
NAMES = {"delayed", "current", "rowwise", "block", "mx", "nvfp4", "int8", "mxfp8",
         "fp8-current", "fp8-rowwise", "fp8-block", "int8-rowwise", "per block",
         "per-tensor"}
#: ``"int8"`` is also an optimizer-state format (``mixprec.optim.STATE_FORMATS``), which
#: is all these modules mean by it
STATE_FORMAT_MODULES = {"optim/states.py", "formats/state_formats.py", "optim/compat.py",
                        "recipe/layer_rules.py", "cli/plan.py", "planner/choose.py",
                        "planner/planning.py"}
#: the export's schemas carry the serving formats' own names (compressed-tensors'
#: ``mxfp8``/``nvfp4`` schemes, transformers' ``fp8-block`` label) and its chooser reads the
#: element kind ``int8``: names of the files written, not of mixprec's formats
EXPORT_MODULES = {"export/compressed.py", "export/finegrained.py", "export/choice.py"}
#: ``"rowwise"`` is also one of torchao's float8 recipes, which the bench's peer table
#: (keyed by format class) names
TORCHAO_MODULES = {"workbench/bench.py"}


def _docstrings(tree: ast.AST) -> set[int]:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, kinds) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def _fp8(node: ast.AST) -> bool:
    elts = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return any(isinstance(e, ast.Constant) and e.value == "fp8" for e in elts)


def offences(source: str, other_meaning: frozenset[str] = frozenset()
             ) -> list[tuple[int, str]]:
    """(line, what) of each format name in code (not in a docstring; not one of
    ``other_meaning``, names the module uses for something else) and each comparison of
    a ``compute`` with ``"fp8"``."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    names = NAMES - other_meaning
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value in names and id(node) not in docs:
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
    found = []
    for p in sorted(SRC.rglob("*.py")):
        rel = p.relative_to(SRC).as_posix()
        other = frozenset({"int8"} if rel in STATE_FORMAT_MODULES else
                          {"rowwise"} if rel in TORCHAO_MODULES else
                          {"mxfp8", "nvfp4", "fp8-block", "int8"} if rel in EXPORT_MODULES
                          else ())
        if rel not in ALLOWED:
            found += [f"{rel}:{line}: {what}" for line, what in offences(p.read_text(), other)]
    assert found == []


def test_the_scan_sees_a_branch_on_a_name_and_on_compute():
    code = ('"""doc: nvfp4 is fine here"""\n'
            'if fmt == "nvfp4" or r.compute == "fp8" or flat["compute"] in ("fp8",):\n'
            '    x = "the block kernel"\n'
            'y = fmt in ("int8", "int8-rowwise")\n')
    assert sorted(offences(code)) == [(2, "'nvfp4'"), (2, "compute compared with 'fp8'"),
                                      (2, "compute compared with 'fp8'"),
                                      (4, "'int8'"), (4, "'int8-rowwise'")]
    # an optimizer-state module's int8 is its state format; int8-rowwise is still seen
    assert sorted(offences(code, frozenset({"int8"}))) == [
        (2, "'nvfp4'"), (2, "compute compared with 'fp8'"),
        (2, "compute compared with 'fp8'"), (4, "'int8-rowwise'")]
