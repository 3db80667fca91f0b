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
    "mixprec.fp32_precision": "mixprec.engine.fp32_precision",
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
        sys.meta_path.append(_MovedFinder())


def lazy_exports(package: str, exports: dict[str, str]):
    """A package's ``__getattr__`` and ``__dir__`` for its public names, each imported from
    its submodule (``exports``: name -> submodule) on first use: the package's own
    submodules are imported by rooms below the one that defines the names, which must not
    pull it in with them."""

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)

    def __dir__() -> list[str]:
        return sorted([*vars(sys.modules[package]), *exports])

    return __getattr__, __dir__
