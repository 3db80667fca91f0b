"""mixprec: mixed-precision training for PyTorch.

Public API: ``formats`` (number formats and exact rounding), ``Recipe`` (which
precision each part of training uses), ``MixedPrecision`` (the training engine),
``PrecisionSchedule`` (recipes by step), ``LossScaler`` and ``precision_context``.
"""

import importlib
import sys

from mixprec import _imports, formats, modules
from mixprec.diagnostics import doctor
from mixprec.engine.context import precision_context
from mixprec.engine.facade import MixedPrecision, StepResult
from mixprec.engine.scaler import LossScaler
from mixprec.engine.watch import SkipLimitError
from mixprec.parallel import distributed
from mixprec.planner import Plan, plan
from mixprec.recipe import PRESETS, PrecisionSchedule, Recipe

__all__ = ["distributed", "formats", "modules", "Recipe", "PrecisionSchedule", "PRESETS",
           "MixedPrecision",
           "StepResult", "SkipLimitError", "LossScaler", "precision_context", "doctor",
           "plan", "Plan",
           "__version__"]
__version__ = "0.2.0"
_imports.install()
# the user's entry keeps its short path, as a public name rather than a deprecated one
sys.modules.setdefault("mixprec.distributed", distributed)


def __getattr__(name: str):
    """``mixprec.fp8``, the package whose modules moved, on first use (it warns)."""
    if name == "fp8":
        return importlib.import_module("mixprec.fp8")
    raise AttributeError(f"module 'mixprec' has no attribute {name!r}")
