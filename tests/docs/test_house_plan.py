"""The house plan, enforced: the core never imports the rooms on top of it (cli,
workbench, integrations) nor rich or matplotlib, and no module imports another in a
cycle. Imports are read from the source (every ``import`` statement, function-level
ones included), so a lazy import counts as much as a top-level one."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import ClassVar

import mixprec.formats.gemm as gemm
from helpers.paths import SRC
from mixprec.formats.gemm import FORMATS, LinearFormat, base

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
    for room in ("mixprec.parallel.layouts", "mixprec.parallel.comm", "mixprec.engine.build",
                 "mixprec.engine.step", "mixprec.engine.param_state", "mixprec.engine.scaler",
                 "mixprec.checkpoint.core"):
        top = {"mixprec.engine.facade", "mixprec.parallel.distributed"}
        assert not top & _reach(graph, room), room
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


#: the floors of the picture in docs/development.md: a room imports its own floor or below
FLOORS = {"_imports": 0, "formats": 0, "recipe": 1, "optim": 2, "parallel": 3, "modules": 4,
          "experts": 5, "engine": 6, "checkpoint": 7, "export": 8, "memory": 9, "diagnostics": 9,
          "planner": 10, "integrations": 10, "workbench": 11, "cli": 11, "__main__": 11,
          "fp8": 11}
#: rooms above their package's floor: the layouts and the step's rooms on the engine,
#: the facades over checkpoints, the doctor over the planner's advice
ROOM_FLOORS = {"mixprec.parallel.layouts": 6, "mixprec.parallel.comm": 6,
               "mixprec.parallel.pipeline": 6, "mixprec.parallel.ep_layout": 6,
               "mixprec.parallel.pipeline_mesh": 6,
               "mixprec.engine.build": 6.5, "mixprec.engine.step": 6.5,
               "mixprec.engine.facade": 8, "mixprec.engine.persist": 8,
               "mixprec.parallel.distributed": 8,
               "mixprec.diagnostics.doctor": 10.5}
#: the downward-pointing exceptions that remain (none: a new one fails)
KNOWN_UPWARD: set[tuple[str, str]] = set()


def _floor(module: str) -> float:
    if module in ROOM_FLOORS:
        return ROOM_FLOORS[module]
    return FLOORS.get(module.split(".")[1], 0) if module.count(".") else 0


def test_no_room_imports_a_floor_above_it_beyond_the_known_knot():
    graph, _ = _graph()
    upward = {(m.split(".")[1], d.split(".")[1]) for m, deps in graph.items()
              if m.count(".") for d in deps if d.count(".")
              and m.split(".")[1] != d.split(".")[1] and _floor(d) > _floor(m)}
    assert upward == KNOWN_UPWARD, (f"new: {sorted(upward - KNOWN_UPWARD)}; "
                                    f"gone, strike them: {sorted(KNOWN_UPWARD - upward)}")


#: function-level imports of mixprec modules (``if TYPE_CHECKING:`` ones included): each
#: says on its line why it is not at the top of its module
FUNCTION_LEVEL_IMPORTS = 0


def _nested_mixprec_imports() -> list[tuple[Path, ast.stmt]]:
    """Every import of a mixprec module that is not a statement at its module's top."""
    out = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text())
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top:
                names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                         else [a.name for a in node.names])
                if any(n.startswith("mixprec") for n in names):
                    out.append((path, node))
    return out


def test_function_level_imports_do_not_grow():
    count = len(_nested_mixprec_imports())
    assert count <= FUNCTION_LEVEL_IMPORTS, count


def test_each_function_level_import_says_why_on_its_line():
    bare = []
    for path, node in _nested_mixprec_imports():
        lines = path.read_text().splitlines()[node.lineno - 1:node.end_lineno]
        if not any("#" in line for line in lines):
            bare.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert not bare, f"function-level imports without a reason on the line: {bare}"


def _import_bound(tree: ast.Module) -> set[str]:
    """The names ``tree``'s import statements bind (``import a.b`` binds ``a``)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            out |= {a.asname or a.name for a in node.names}
    return out


def _module_level(body: list[ast.stmt]):
    """The statements run at import: ``body`` and what its ``if``/``try``/``with`` hold,
    not function or class bodies."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            yield from _module_level(getattr(node, field, None) or [])


def _assigned_elsewhere(tree: ast.Module) -> list[str]:
    """``x.attr = ...`` (or ``setattr(x, ...)``) at import time, ``x`` an imported name."""
    bound, out = _import_bound(tree), []
    for node in _module_level(tree.body):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name) and node.value.func.id == "setattr"
                and node.value.args):
            targets = [ast.Attribute(value=node.value.args[0], attr="?")]
        for t in targets:
            root = t
            while isinstance(root, (ast.Attribute, ast.Subscript)):
                root = root.value
            if (isinstance(t, ast.Attribute) and isinstance(root, ast.Name)
                    and root.id in bound):
                out.append(f"{ast.unparse(t)} (line {node.lineno})")
    return out


def test_no_module_sets_another_modules_globals_at_import():
    """A module's globals are its own: one that another module fills in is registered
    through a function of the module that owns it (``route.register_measured_route``)."""
    bad = {str(p.relative_to(SRC)): found for p in sorted(SRC.rglob("*.py"))
           if (found := _assigned_elsewhere(ast.parse(p.read_text())))}
    assert not bad, bad


def test_the_assignment_check_sees_an_imported_modules_attribute():
    """The check would pass vacuously if it missed the pattern it forbids."""
    tree = ast.parse("from mixprec.fp8 import route as r\nimport torch\n"
                     "r.measured_route = print\nif True:\n    torch.x.y = 1\n"
                     "setattr(r, 'a', 1)\nclass C: pass\nC.a = 1\n")
    assert _assigned_elsewhere(tree) == ["r.measured_route (line 3)", "torch.x.y (line 5)",
                                         "r.? (line 6)"]


def _format_classes() -> set[str]:
    """The names of the GEMM format classes and the mixins they are built from."""
    names = {c.__name__ for c in gemm.FORMATS.values()}
    for c in gemm.FORMATS.values():
        names |= {b.__name__ for b in c.__mro__ if b.__module__.startswith("mixprec.")}
    return names | {n for n in base.__all__ if n[0].isupper()}


def _branches_on(tree: ast.Module, classes: set[str]) -> list[str]:
    """``isinstance`` / ``issubclass`` calls in ``tree`` naming one of ``classes``."""
    out = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2):
            named = {n.id if isinstance(n, ast.Name) else n.attr
                     for n in ast.walk(node.args[1]) if isinstance(n, (ast.Name, ast.Attribute))}
            if named & classes:
                out.append(f"line {node.lineno}: {ast.unparse(node)}")
    return out


def test_nothing_outside_the_formats_branches_on_a_format_class():
    """A format answers for itself: no room outside ``mixprec.formats`` asks which class
    a format is (but the recipe's check that its ``linear`` is a format at all)."""
    classes = _format_classes() - {"LinearFormat"}
    bad = {str(p.relative_to(SRC)): found for p in sorted(SRC.rglob("*.py"))
           if p.relative_to(SRC).parts[0] != "formats"
           and (found := _branches_on(ast.parse(p.read_text()), classes))}
    assert not bad, bad


def test_the_branch_check_sees_a_branch():
    """The check would pass vacuously if it missed the pattern it forbids."""
    tree = ast.parse("if isinstance(f, (gemm.MXScaling, int)): pass\n"
                     "issubclass(type(f), Int8Rowwise)\nisinstance(f, str)\n")
    assert len(_branches_on(tree, _format_classes())) == 2


#: the GEMM formats' own names: a module named for one outside ``mixprec.formats`` would
#: be a per-format copy of what the format owns
_FORMAT_WORDS = ("delayed", "current", "rowwise", "block", "mx", "nvfp4", "int8", "fp4")


def test_no_module_outside_the_formats_is_named_for_a_format():
    per_format = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                        if p.relative_to(SRC).parts[0] not in ("formats", "fp8")
                        and any(w in p.stem.split("_") for w in _FORMAT_WORDS))
    assert not per_format, per_format
#: the most capability attributes a Linear format declares (``LinearFormat``'s ClassVars
#: besides its ``name``); every other fact about a format derives from them
FORMAT_CAPABILITIES = 8


def _class_vars(cls: type) -> set[str]:
    """The names ``cls``'s own body annotates as ``ClassVar`` (annotations are strings
    under ``from __future__ import annotations``, or typing objects)."""
    return {n for n, a in vars(cls).get("__annotations__", {}).items()
            if (a if isinstance(a, str) else repr(a)).split("[")[0].split(".")[-1]
            == "ClassVar"}


def test_a_linear_format_declares_at_most_eight_capabilities():
    base = _class_vars(LinearFormat) - {"name"}
    assert {"kernel", "scales"} <= base  # the count sees the declared ones: not vacuous
    assert len(base) <= FORMAT_CAPABILITIES, sorted(base)
    # a format (or a mixin it takes) sets the base's capabilities, and declares no other
    seen = set()
    for fmt in FORMATS.values():
        for cls in fmt.__mro__:
            if cls.__module__.startswith("mixprec."):
                extra = _class_vars(cls) - base - {"name"}
                assert not extra, (cls.__name__, sorted(extra))
                seen.add(cls.__name__)
    assert {"TileScaled", "PerTensor", "LinearFormat"} <= seen


def test_the_capability_count_sees_a_new_class_var():
    """The count would pass vacuously if it missed the annotations it counts."""
    ns: dict = {}
    exec("from __future__ import annotations\nfrom typing import ClassVar\n"
         "class F:\n    name: ClassVar[str] = 'f'\n    tile: ClassVar[int] = 1\n"
         "    field: int = 0\n", ns)
    assert _class_vars(ns["F"]) == {"name", "tile"}

    class G:
        flag: ClassVar[bool] = True
    assert _class_vars(G) == {"flag"}
