"""mixprec: mixed-precision training for PyTorch.

Public API: ``formats`` (number formats and exact rounding), ``Recipe`` (which
precision each part of training uses), ``MixedPrecision`` (the training engine),
``LossScaler`` and ``precision_context``.
"""

from mixprec import distributed, formats, fp8
from mixprec.context import precision_context
from mixprec.diagnostics import doctor
from mixprec.engine import MixedPrecision, StepResult
from mixprec.planner import Plan, plan
from mixprec.recipe import PRESETS, Recipe
from mixprec.scaler import LossScaler
from mixprec.watch import SkipLimitError

__all__ = ["distributed", "formats", "fp8", "Recipe", "PRESETS", "MixedPrecision",
           "StepResult", "SkipLimitError", "LossScaler", "precision_context", "doctor",
           "plan", "Plan",
           "__version__"]
__version__ = "0.2.0"
