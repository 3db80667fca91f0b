"""One name-to-dtype table: ``mixprec.formats.elements`` (``dtype_of``, ``name_of``), and no other
module of the package builds one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import mixprec
from mixprec.formats import elements as formats

SRC = Path(mixprec.__file__).parent
#: the element table, where it lives now and where the formats package will hold it
HOME = {SRC / "formats.py", SRC / "formats" / "elements.py"}


def _is_dtype(node: ast.AST) -> bool:
    """``torch.<a dtype>``."""
    return (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "torch"
            and isinstance(getattr(torch, node.attr, None), torch.dtype))


def _is_format_name(node: ast.AST) -> bool:
    """A string ``mixprec.formats.elements.get`` reads as a format (a name or an alias)."""
    if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
        return False
    try:
        formats.get(node.value)
    except ValueError:
        return False
    return True


def _pairs(node: ast.AST):
    """(key, value) pairs a dict literal, ``dict(name=...)`` or a sequence of 2-tuples
    spells."""
    if isinstance(node, ast.Dict):
        yield from ((k, v) for k, v in zip(node.keys, node.values) if k is not None)
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
          and node.func.id == "dict"):
        yield from ((ast.Constant(k.arg), k.value) for k in node.keywords if k.arg)
    elif isinstance(node, (ast.Tuple, ast.List)):
        for e in node.elts:
            if isinstance(e, ast.Tuple) and len(e.elts) == 2:
                yield e.elts[0], e.elts[1]


def _name_dtype_tables(tree: ast.AST) -> list[int]:
    """Lines where a name is paired with a torch dtype (either way round)."""
    return sorted({node.lineno for node in ast.walk(tree) for k, v in _pairs(node)
                   if (_is_format_name(k) and _is_dtype(v))
                   or (_is_dtype(k) and _is_format_name(v))})


def test_no_module_but_the_element_table_pairs_format_names_with_dtypes():
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        if path in HOME:
            continue
        lines = _name_dtype_tables(ast.parse(path.read_text(), str(path)))
        if lines:
            found[str(path.relative_to(SRC))] = lines
    assert not found, ("name-to-dtype tables outside mixprec.formats.elements (use "
                       f"formats.dtype_of / formats.name_of): {found}")


def test_the_scan_finds_the_tables_it_forbids():
    for text in ('T = {"bf16": torch.bfloat16}', "T = {torch.float16: 'half'}",
                 "T = dict(fp16=torch.float16)",
                 "T = (('bf16', torch.bfloat16), ('fp16', torch.float16))"):
        assert _name_dtype_tables(ast.parse(text)) == [1], text
    for text in ('k = {**kw, "dtype": torch.float32}', 'T = {"bf16": 2, "fp16": 2}'):
        assert _name_dtype_tables(ast.parse(text)) == [], text


def test_dtype_of_and_name_of_are_torchs_dtypes():
    want = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
            "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
    for name, dtype in want.items():
        assert formats.dtype_of(name) is dtype
        assert formats.name_of(dtype) == name
    assert formats.dtype_of("half") is torch.float16  # aliases as get() reads them
    assert formats.dtype_of(torch.bfloat16) is torch.bfloat16
    for dtype in (torch.float64, torch.int8, torch.uint8):
        assert formats.name_of(dtype) is None
    with pytest.raises(ValueError, match=r"'tf32' has no torch dtype; formats with one: "
                                         r"fp32, bf16, fp16, fp8_e4m3, fp8_e5m2"):
        formats.dtype_of("tf32")
    with pytest.raises(ValueError, match="unknown format 'fp7'"):
        formats.dtype_of("fp7")
