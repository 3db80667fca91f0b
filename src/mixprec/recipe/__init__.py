"""Recipes: which precision each part of training lives in, as one frozen value built
from small configs (``types``), named presets (``presets``) and the short-string syntax
(``syntax``)::

    >>> from mixprec import Recipe
    >>> r = Recipe.parse("fp16,init_scale=1024,growth_interval=3")
    >>> r.compute, r.loss_scale, r.init_scale
    ('fp16', 'dynamic', 1024.0)
    >>> Recipe.parse(str(r)) == r
    True
"""

from mixprec.recipe.configs import (
    DEFAULT_KEEP_FP32,
    KEEP_FP32_CHOICES,
    MX_COMPUTE,
    LayoutOptions,
    LossScale,
    OptimStates,
    Precision,
)
from mixprec.recipe.layer_rules import LastLayers
from mixprec.recipe.presets import LINEAR_PRESETS, preset_names
from mixprec.recipe.schedule import PrecisionSchedule
from mixprec.recipe.types import PRESETS, Recipe

__all__ = ["Recipe", "PrecisionSchedule", "Precision", "LossScale", "OptimStates",
           "LayoutOptions", "LastLayers",
           "PRESETS", "LINEAR_PRESETS",
           "MX_COMPUTE", "KEEP_FP32_CHOICES", "DEFAULT_KEEP_FP32", "preset_names"]
