"""A Linear format holds its number format only: how the quantized Linears cross the
ranks (``fp8_all_gather``, ``tp_reduce``) and which Linears stay in bf16
(``bf16_last_layers``, ``bf16_last_fraction``) are the recipe's (``LayoutOptions``,
``LastLayers``), so no format may grow them back as dataclass fields."""

from __future__ import annotations

import dataclasses

from mixprec.formats.gemm import FORMATS, LinearFormat
from mixprec.recipe import LastLayers, LayoutOptions

#: the options that left the formats, by name (what recipe strings write)
RECIPE_OPTIONS = {"fp8_all_gather", "tp_reduce", "bf16_last_layers", "bf16_last_fraction"}


def _every_format_class() -> set[type]:
    """``LinearFormat``, the registry's formats and every subclass loaded."""
    out, todo = set(), [LinearFormat, *FORMATS.values()]
    while todo:
        cls = todo.pop()
        if cls not in out:
            out.add(cls)
            todo += cls.__subclasses__()
    return out


def test_no_linear_format_field_is_a_layout_or_last_layers_option():
    classes = _every_format_class()
    assert set(FORMATS.values()) <= classes and len(classes) > len(FORMATS)
    held = {cls.__name__: sorted(RECIPE_OPTIONS & {f.name for f in dataclasses.fields(cls)})
            for cls in classes}
    assert not any(held.values()), f"recipe options back on a format: {held}"


def test_the_options_are_the_recipe_configs_fields():
    """The control: the names the scan looks for are exactly the recipe configs' fields."""
    fields = {f.name for c in (LayoutOptions, LastLayers) for f in dataclasses.fields(c)}
    assert fields == RECIPE_OPTIONS
