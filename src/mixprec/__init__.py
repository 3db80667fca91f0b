"""mixprec: mixed-precision training for PyTorch.

Public API: ``formats`` (number formats and exact rounding), ``Recipe`` (which
precision each part of training uses), ``MixedPrecision`` (the training engine),
``LossScaler`` and ``precision_context``.
"""

from mixprec import fp8
from mixprec.diagnostics import doctor
from mixprec.engine.context import precision_context
from mixprec.engine.facade import MixedPrecision, StepResult
from mixprec.engine.scaler import LossScaler
from mixprec.engine.watch import SkipLimitError
from mixprec.formats import elements as formats
from mixprec.parallel import distributed
from mixprec.planner import Plan, plan
from mixprec.recipe import PRESETS, Recipe

__all__ = ["distributed", "formats", "fp8", "Recipe", "PRESETS", "MixedPrecision",
           "StepResult", "SkipLimitError", "LossScaler", "precision_context", "doctor",
           "plan", "Plan",
           "__version__"]
__version__ = "0.2.0"
