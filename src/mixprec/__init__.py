"""mixprec: mixed-precision training for PyTorch.

Public API: ``formats`` (number formats and exact rounding), ``Recipe`` (which
precision each part of training uses).
"""

from mixprec import formats
from mixprec.recipe import PRESETS, Recipe

__all__ = ["formats", "Recipe", "PRESETS", "__version__"]
__version__ = "0.1.0"
