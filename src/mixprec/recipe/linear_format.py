"""The Linear format of a recipe (``quantizer_for``), and the names the formats had when
they were called quantizers (``Quantizer``, ``QUANTIZERS``)."""

from __future__ import annotations

from mixprec.formats.gemm import (
    FORMATS,
    BlockScaling,
    CurrentScaling,
    DelayedScaling,
    LinearFormat,
    MXScaling,
    NVFP4Scaling,
    RowwiseScaling,
)
from mixprec.recipe import Recipe

__all__ = ["Quantizer", "DelayedScaling", "CurrentScaling", "RowwiseScaling",
           "BlockScaling", "MXScaling", "NVFP4Scaling", "QUANTIZERS", "quantizer_for"]

Quantizer = LinearFormat
QUANTIZERS = FORMATS


def quantizer_for(recipe: Recipe | str) -> LinearFormat:
    """``recipe``'s Linear format (``recipe.linear``); ``ValueError`` for a recipe
    without one."""
    r = Recipe.coerce(recipe)
    if r.linear is None:
        raise ValueError(f"recipe {str(r)!r} has no Linear format "
                         f"(compute={r.precision.compute!r}); "
                         "use an fp8 recipe (e.g. 'fp8-current')")
    return r.linear
