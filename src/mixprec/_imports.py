"""How mixprec's modules are reached: old import paths of modules that moved into
packages (``import mixprec.scaler`` still works, returns the module at its new path, the
same object, so monkeypatching it patches the code, and warns once with the new path;
installed by ``mixprec/__init__``), and the packages' public names, imported on first
use (``lazy_exports``)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__all__ = ["MOVED", "install", "lazy_exports"]

#: old module path -> new module path (removed in the release after 0.3)
MOVED = {
    "mixprec.engine_facade": "mixprec.engine.facade",
    "mixprec.setup": "mixprec.engine.build",
    "mixprec.master": "mixprec.engine.param_state",
    "mixprec.scaler": "mixprec.engine.scaler",
    "mixprec.context": "mixprec.engine.context",
    "mixprec.checks": "mixprec.engine.checks",
    "mixprec.step": "mixprec.engine.step",
    "mixprec.emulate": "mixprec.engine.emulate",
    "mixprec.emulate_attention": "mixprec.engine.emulate_attention",
    "mixprec.attention": "mixprec.engine.attention",
    "mixprec.engine.fp32_precision": "mixprec.formats.fp32_precision",
    "mixprec.fp32_precision": "mixprec.formats.fp32_precision",
    "mixprec.kernels": "mixprec.engine.devices",
    "mixprec.gradnorm": "mixprec.engine.gradnorm",
    "mixprec.wgrad": "mixprec.engine.wgrad",
    "mixprec.coverage": "mixprec.engine.coverage",
    "mixprec.watch": "mixprec.engine.watch",
    "mixprec.comm": "mixprec.parallel.comm",
    "mixprec.comm_stats": "mixprec.parallel.comm_stats",
    "mixprec.checkpoint_compat": "mixprec.checkpoint.compat",
    "mixprec.checkpoint_resharding": "mixprec.checkpoint.resharding",
    "mixprec.checkpoint_tp": "mixprec.checkpoint.tensor_parallel",
    "mixprec.rng": "mixprec.checkpoint.rng",
    "mixprec.layer_rules": "mixprec.recipe.layer_rules",
    "mixprec.recipe_rules": "mixprec.recipe.rules",
    "mixprec.fp8.formats": "mixprec.formats.gemm",
    "mixprec.fp8.formats.base": "mixprec.formats.gemm.base",
    "mixprec.fp8.formats.block": "mixprec.formats.gemm.block",
    "mixprec.fp8.formats.current": "mixprec.formats.gemm.current",
    "mixprec.fp8.formats.delayed": "mixprec.formats.gemm.delayed",
    "mixprec.fp8.formats.int8": "mixprec.formats.gemm.int8",
    "mixprec.fp8.formats.mx": "mixprec.formats.gemm.mx",
    "mixprec.fp8.formats.nvfp4": "mixprec.formats.gemm.nvfp4",
    "mixprec.fp8.formats.per_tensor": "mixprec.formats.gemm.per_tensor",
    "mixprec.fp8.formats.rowwise": "mixprec.formats.gemm.rowwise",
    "mixprec.fp8.formats.segments": "mixprec.formats.segments",
    "mixprec.fp8.quantized": "mixprec.formats.quantized",
    "mixprec.fp8.scaling": "mixprec.formats.scaling",
    "mixprec.fp8.blocks": "mixprec.formats.blocks",
    "mixprec.fp8.nvfp4": "mixprec.formats.fp4",
    "mixprec.fp8.padding": "mixprec.formats.padding",
    "mixprec.fp8.scaled_mm": "mixprec.formats.scaled_mm",
    "mixprec.fp8.route": "mixprec.formats.route",
    "mixprec.fp8.gemm": "mixprec.formats.tensor_gemm",
    "mixprec.fp8.mm": "mixprec.formats.mm",
    "mixprec.fp8.quantizers": "mixprec.recipe.linear_format",
    "mixprec.fp8.tp_agree": "mixprec.parallel.tp_agree",
    "mixprec.fp8.tensor_parallel": "mixprec.parallel.tensor_parallel",
    "mixprec.fp8.tp_plans": "mixprec.parallel.tp_plans",
    "mixprec.fp8.gather": "mixprec.parallel.gather",
    "mixprec.fp8.gather_casts": "mixprec.parallel.gather_casts",
    "mixprec.fp8.linear": "mixprec.modules.linear",
    "mixprec.fp8.convert": "mixprec.engine.convert",
}
del MOVED["mixprec.engine_facade"]  # mixprec.engine is the package: it exports the same


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec):
        module = importlib.import_module(self.new)
        self.spec = module.__spec__  # the import system sets the alias's spec on it
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = self.spec


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        warnings.warn(f"{fullname} moved to {new}; the old path works until the release "
                      f"after 0.3: import {new} instead", DeprecationWarning, stacklevel=3)
        return importlib.util.spec_from_loader(fullname, _Alias(new))


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())  # before the path finder: an old path under
        # an aliased package (mixprec.fp8.formats.base) must not load its file a second time


def lazy_exports(package: str, exports: dict[str, str], absolute: bool = False):
    """A package's ``__getattr__`` and ``__dir__`` for its public names, each imported from
    its submodule (``exports``: name -> submodule) on first use: the package's own
    submodules are imported by rooms below the one that defines the names, which must not
    pull it in with them; ``absolute``: ``exports`` names whole module paths)."""

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        where = exports[name] if absolute else f"{package}.{exports[name]}"
        return getattr(importlib.import_module(where), name)

    def __dir__() -> list[str]:
        return sorted([*vars(sys.modules[package]), *exports])

    return __getattr__, __dir__
