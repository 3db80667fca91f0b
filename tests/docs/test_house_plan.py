"""The house plan, enforced: the core never imports the rooms on top of it (cli,
workbench, integrations) nor rich or matplotlib, and no module imports another in a
cycle. Imports are read from the source (every ``import`` statement, function-level
ones included), so a lazy import counts as much as a top-level one."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers.paths import SRC

#: the rooms that sit on top: they may import anything, nothing in the core imports them
TOP = ("mixprec.cli", "mixprec.workbench", "mixprec.integrations", "mixprec.__main__")
FORBIDDEN = TOP + ("rich", "matplotlib")
#: the one place the core draws: doctor(plots=dir) writes histograms (matplotlib, imported
#: only when asked for)
ALLOWED = {("mixprec.diagnostics.plots", "matplotlib")}


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every module an ``import`` or ``from ... import`` in ``path`` names (absolute and
    relative), anywhere in the file."""
    mod = _module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")
                parent = parent[:len(parent) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}  # a submodule imported by name
    return out


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in SRC.rglob("*.py")}
    return {m: {i for i in _imports(p) if i in files} for m, p in files.items()}, files


def _core(name: str) -> bool:
    return not any(name == t or name.startswith(t + ".") for t in TOP)


def test_the_core_imports_nothing_on_top_of_it():
    _, files = _graph()
    bad = sorted((m, i) for m, p in files.items() if _core(m) for i in _imports(p)
                 if any(i == f or i.startswith(f + ".") for f in FORBIDDEN)
                 and (m, i.split(".")[0]) not in ALLOWED)
    assert not bad, f"core modules importing cli/workbench/integrations/rich/matplotlib: {bad}"


def test_there_is_no_import_cycle():
    graph, _ = _graph()
    # a package's __init__ re-exporting its submodules is not a cycle of the rooms
    edges = {m: {i for i in deps if not m.startswith(i + ".") and i != m
}
             for m, deps in graph.items()}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for d in sorted(edges.get(m, ())):
            if state.get(d) == 1:
                cycle = path[path.index(d):] + [d]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        path.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for d in graph.get(todo.pop(), ()):
            if d not in seen and not start.startswith(d + "."):
                seen.add(d)
                todo.append(d)
    return seen


def test_the_step_rooms_stay_below_the_engine():
    """The engine sits on parallel, setup and step; none of them (nor what they import)
    reaches back up to it, and the user's ``distributed.prepare`` sits above it."""
    graph, _ = _graph()
    for room in ("mixprec.parallel.layouts", "mixprec.parallel.comm", "mixprec.engine.build", "mixprec.engine.step",
                 "mixprec.engine.param_state", "mixprec.engine.scaler", "mixprec.checkpoint.core"):
        assert not {"mixprec.engine.facade", "mixprec.parallel.distributed"} & _reach(graph, room), room
    assert "mixprec.engine.facade" in graph["mixprec.parallel.distributed"]
    assert "mixprec.parallel.distributed" not in _reach(graph, "mixprec.engine.facade")


def test_the_walk_sees_imports_inside_functions():
    """The check would be empty if it missed lazy imports: cli imports rich in one."""
    assert "rich.console" in _imports(SRC / "cli" / "__init__.py")
    assert not _core("mixprec.cli.doctor") and _core("mixprec.diagnostics.doctor")


def test_importing_mixprec_does_not_load_torch_dynamo():
    """torch._dynamo costs ~2 s of every process's start (each rank, each CLI call);
    mixprec loads it only once torch.compile is in use (``wgrad.compile_safe``)."""
    import subprocess
    import sys

    code = "import sys, mixprec, mixprec.cli; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"
