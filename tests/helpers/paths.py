"""Where the repository's pieces lie, for tests that read docs, examples, data or
benchmarks, or start scripts: the same from any test folder."""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["ROOT", "TESTS", "HELPERS", "DATA", "DOCS", "EXAMPLES", "BENCHMARKS", "SRC",
           "benchmark"]

#: the repository's root
ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
#: this package: the rank functions and the scripts the tests start
HELPERS = TESTS / "helpers"
#: golden files written by earlier releases (and the scripts that wrote them)
DATA = TESTS / "data"
DOCS = ROOT / "docs"
EXAMPLES = ROOT / "examples"
BENCHMARKS = ROOT / "benchmarks"
SRC = ROOT / "src" / "mixprec"


def benchmark(name: str):
    """The module ``benchmarks/<name>.py``, loaded from its file (benchmarks are scripts,
    not a package), for tests that run a benchmark's measurement."""
    path = BENCHMARKS / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
