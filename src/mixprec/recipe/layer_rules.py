"""Per-module rules in a recipe: which Linears run which fp8/fp4 format, which of the
model's last Linears stay in bf16 (``LastLayers``), and which parameters keep their
optimizer states in how many bits.

A rule is a ``key:PATTERN=VALUE`` fragment of a recipe string, after the preset and
its overrides::

    >>> from mixprec import Recipe
    >>> r = Recipe.parse("fp8-current,layer:blocks.*.fc=mxfp8,layer:head=bf16,"
    ...                  "states:*.emb=int8")
    >>> r.layer_format("blocks.3.fc"), r.layer_format("head"), r.layer_format("x")
    ('mxfp8', 'bf16', 'fp8-current')
    >>> r.state_format("tok.emb.weight"), r.state_format("head.weight")
    ('int8', 'fp32')
    >>> Recipe.parse(str(r)) == r
    True

- ``layer:PATTERN=FORMAT`` matches module names (``fnmatch``, as
  ``model.named_modules()`` spells them) and sets the compute format of the matched
  Linears: ``bf16`` (kept in the recipe's high precision, as the output head is) or an
  fp8 preset (``fp8``, ``fp8-current``, ``fp8-rowwise``, ``fp8-block``, ``mxfp8``,
  ``nvfp4``), whose scaling and element format replace the recipe's for that Linear;
  every other fp8 setting (margin, GEMM route, ...) is the recipe's, where the format
  has it. A rule matching a transformers experts module (``layer:*.experts=mxfp8``)
  sets its experts' format (``mixprec.experts.hook``). Layer rules need an fp8 recipe
  (``compute=fp8``): it is what runs the rest of the model under bf16.
  A rule overrides the default policy (the head and ``LastLayers``), never a
  Linear subclass whose owner may read its weight directly; a Linear's dims never
  keep it (the GEMM routes pad: ``mixprec.formats.padding``).
- ``states:PATTERN=FORMAT`` matches the name of the module that owns a parameter and
  sets the format of that parameter's optimizer states (``fp32``, ``bf16``, ``fp8``,
  ``int8``, ``int4``; ``mixprec.optim``). A parameter that several modules share (an
  output head tied to its embedding) is one tensor with one set of states: it is ruled
  by the name ``model.named_parameters()`` gives it, its first owner's.

Rules are ordered: for each module, the first rule of its kind that matches decides,
and a module no rule matches takes the recipe's own setting.
"""

from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass
from typing import Literal

from mixprec.formats import state_formats
from mixprec.recipe.presets import LINEAR_PRESETS

__all__ = ["LayerRule", "LastLayers", "STATE_RULE_FORMATS", "RULE_KINDS",
           "parse_rule", "first_match", "owner_of", "layer_formats"]

#: what a ``states:`` rule may set (``mixprec.formats.state_formats``' registry)
STATE_RULE_FORMATS = state_formats.names()
RULE_KINDS = ("layer", "states")

RuleKind = Literal["layer", "states"]
# names as named_modules() writes them, with fnmatch's * ? [ ] ! among them
_PATTERN = re.compile(r"^[A-Za-z0-9_.*?\[\]!\-]+$")


@dataclass(frozen=True)
class LayerRule:
    """One rule: modules whose name matches ``pattern`` (fnmatch) get ``value`` for
    ``kind`` (``layer``: the Linear's compute format; ``states``: its parameters'
    optimizer-state format)."""

    kind: RuleKind
    pattern: str
    value: str

    def __post_init__(self) -> None:
        if self.kind not in RULE_KINDS:
            raise ValueError(f"recipe rule {self}: unknown kind {self.kind!r}; valid: "
                             f"{', '.join(RULE_KINDS)} (layer:PATTERN=FORMAT, "
                             "states:PATTERN=FORMAT)")
        if not isinstance(self.pattern, str) or not _PATTERN.match(self.pattern):
            raise ValueError(
                f"recipe rule {self}: pattern {self.pattern!r} is not a module name "
                "pattern; use the names model.named_modules() gives, with fnmatch's * ? "
                "[...] (no spaces, commas, semicolons, colons or '=')")
        valid = layer_formats() if self.kind == "layer" else STATE_RULE_FORMATS
        if self.value not in valid:
            raise ValueError(f"recipe rule {self}: unknown format {self.value!r} for "
                             f"{self.kind}:; valid: {', '.join(valid)}")

    def __str__(self) -> str:
        return f"{self.kind}:{self.pattern}={self.value}"

    def matches(self, name: str) -> bool:
        """Whether the module name ``name`` matches this rule's pattern."""
        return fnmatch.fnmatchcase(name, self.pattern)


@dataclass(frozen=True, kw_only=True)
class LastLayers:
    """The default policy's tail: the model's last Linears that stay in bf16 under a
    recipe with a Linear format (``recipe.last_layers``; ``mixprec.engine.convert``
    keeps them). A ``layer:`` rule that names one of them decides for it instead."""

    #: the model's last N Linears stay in bf16 (the output head among them)
    bf16_last_layers: int = 0
    #: this share of the model's Linears, rounded up, stays in bf16 too (whichever of
    #: this and ``bf16_last_layers`` keeps more)
    bf16_last_fraction: float = 0.0

    def __post_init__(self) -> None:
        n = self.bf16_last_layers
        if not (isinstance(n, int) and not isinstance(n, bool) and n >= 0):
            raise ValueError(f"recipe field 'bf16_last_layers': {n!r} is invalid; it must "
                             "be an integer >= 0")
        share = self.bf16_last_fraction
        if not (isinstance(share, (int, float)) and not isinstance(share, bool)
                and math.isfinite(share) and 0 <= share < 1):
            raise ValueError(f"recipe field 'bf16_last_fraction': {share!r} is invalid; "
                             "it must be a share in [0, 1) (0.15: the last 15% of the "
                             "Linears)")


def layer_formats() -> tuple[str, ...]:
    """What a ``layer:`` rule may set: ``bf16``, or a preset with a Linear format."""
    return ("bf16", *LINEAR_PRESETS)


def __getattr__(name: str):
    if name == "LAYER_FORMATS":  # read from the presets when asked (``layer_formats``)
        return layer_formats()
    raise AttributeError(f"module 'mixprec.recipe.layer_rules' has no attribute {name!r}")


def parse_rule(fragment: str) -> LayerRule:
    """``"layer:blocks.*.fc=mxfp8"`` -> ``LayerRule("layer", "blocks.*.fc", "mxfp8")``."""
    head, eq, value = fragment.partition("=")
    kind, colon, pattern = head.partition(":")
    if not (eq and colon):
        raise ValueError(f"recipe rule {fragment!r} is not KIND:PATTERN=FORMAT (e.g. "
                         "layer:blocks.*.fc=mxfp8 or states:*.emb=int8)")
    return LayerRule(kind.strip().lower(), pattern.strip(), value.strip().lower())


def first_match(rules: tuple[LayerRule, ...], kind: str, name: str) -> LayerRule | None:
    """The first rule of ``kind`` whose pattern matches ``name`` (None: no rule does)."""
    for rule in rules:
        if rule.kind == kind and rule.matches(name):
            return rule
    return None


def owner_of(param_name: str) -> str:
    """The name of the module that owns parameter ``param_name`` (``""``: the root)."""
    return param_name.rpartition(".")[0]
