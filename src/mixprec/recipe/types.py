"""Recipe: the precision of every part of a training step, composed of small configs.

``precision`` (``Precision``), ``loss`` (``LossScale``), ``linear`` (the Linears' fp8 /
fp4 format, an object of ``mixprec.formats.gemm``, or None), with it ``layout`` (how
the quantized Linears cross the ranks, ``LayoutOptions``) and ``last_layers`` (the last
Linears kept in bf16, ``mixprec.recipe.layer_rules.LastLayers``), ``optim``
(``OptimStates``) and ``layers`` (per-module rules, ``mixprec.recipe.layer_rules``). A
field that cannot apply does not exist or keeps its default; combinations that cannot
train raise. The string form and ``str()`` are ``mixprec.recipe.syntax``'s.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from mixprec.formats import elements as formats
from mixprec.formats.gemm import FORMATS, LinearFormat, format_class
from mixprec.recipe.configs import (
    LINEAR_COMPUTE,
    MX_COMPUTE,
    LayoutOptions,
    LossScale,
    OptimStates,
    Precision,
)
from mixprec.recipe.layer_rules import LastLayers, LayerRule, first_match, owner_of
from mixprec.recipe.presets import LINEAR_PRESETS, PRESET_FIELDS
from mixprec.recipe.rules import refuse_impossible, warn_useless
from mixprec.recipe.syntax import FLAT_DEFAULTS, format_text, parse_text, preset_flat

__all__ = ["Recipe", "PRESETS", "from_string"]

_PRECISION = tuple(f.name for f in fields(Precision))
_LOSS = tuple(f.name for f in fields(LossScale) if f.name != "kind")
_OPTIM = tuple(f.name for f in fields(OptimStates))
_LAYOUT = tuple(f.name for f in fields(LayoutOptions))
_LAST = tuple(f.name for f in fields(LastLayers))
#: the computes whose own dtype autocast (or fp32) runs in; tf32 stores fp32, fp8 and
#: fp4 run the rest of the model in bf16
_OWN_DTYPE = ("fp32", "bf16", "fp16")


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """The precision of every part of a training step.

    >>> r = Recipe.parse("fp8-current,margin=1,fp8_gemm=dequant")
    >>> r.compute, r.params, r.linear.name, r.linear.margin, r.linear.fp8_gemm
    ('fp8', 'fp32', 'current', 1, 'dequant')
    >>> Recipe.parse(str(r)) == r
    True

    Everything in mixprec that takes a recipe accepts a ``Recipe`` or such a string
    (``Recipe.coerce``). Read-only conveniences name the configs' fields (``r.compute``,
    ``r.params``, ``r.loss_scale`` for ``r.loss.kind``, ``r.init_scale``, ``r.states``):
    a public shorthand for users; mixprec's own code reads the composed path
    (``r.precision.compute``, ``r.loss.kind``, ``r.optim.states``).
    """

    #: what each part of a step computes or is stored in
    precision: Precision = field(default_factory=Precision)
    #: the loss scale
    loss: LossScale = field(default_factory=LossScale)
    #: the Linears' fp8 / fp4 format (``compute='fp8'``), else None
    linear: LinearFormat | None = None
    #: how the quantized Linears' weights and partial sums cross the ranks (with a
    #: Linear format; its defaults without one)
    layout: LayoutOptions = field(default_factory=LayoutOptions)
    #: the model's last Linears kept in bf16 (with a Linear format; its defaults without
    #: one); None: the format's preset's (``nvfp4`` keeps the last two)
    last_layers: LastLayers | None = None
    #: the optimizer states' format and write rule
    optim: OptimStates = field(default_factory=OptimStates)
    #: per-module rules, ``layer:PATTERN=FORMAT`` and ``states:PATTERN=FORMAT``, first
    #: match wins
    layers: tuple[LayerRule, ...] = ()

    def __post_init__(self) -> None:
        if self.last_layers is None:
            fmt = self.linear if isinstance(self.linear, LinearFormat) else None
            object.__setattr__(self, "last_layers", _preset_last_layers(fmt))
        for name, kind in (("precision", Precision), ("loss", LossScale),
                           ("optim", OptimStates), ("layout", LayoutOptions),
                           ("last_layers", LastLayers)):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"recipe field {name!r}: {getattr(self, name)!r} is not "
                                 f"a {kind.__name__}; build one, e.g. {kind.__name__}()")
        if self.linear is not None and not isinstance(self.linear, LinearFormat):
            raise ValueError(f"recipe field 'linear': {self.linear!r} is not a Linear "
                             f"format; use one of mixprec.formats.gemm ({', '.join(FORMATS)}"
                             ") or None")
        if (self.precision.compute == LINEAR_COMPUTE) != (self.linear is not None):
            raise ValueError(
                f"recipe: compute={self.precision.compute!r} with linear={self.linear!r}: a Linear "
                "format runs under compute='fp8' and compute='fp8' needs one. Pass both "
                "(Precision(compute='fp8'), linear=CurrentScaling()) or neither.")
        _check_linear_options(self)
        _check_layers(self)
        refuse_impossible(self)
        warn_useless(self)

    # --- the string form ------------------------------------------------------------

    @classmethod
    def parse(cls, text: str) -> Recipe:
        """Parse ``"preset[,key=value...][,kind:PATTERN=FORMAT...]"`` (preset ``fp32``
        where the first fragment is a ``key=value``). A key the recipe's Linear format
        does not have is refused."""
        base, overrides, rules = parse_text(text)
        if not overrides and not rules:
            return PRESETS[base]
        return _from_flat({**preset_flat(base), **overrides}, set(overrides), rules)

    @classmethod
    def coerce(cls, recipe: Recipe | str) -> Recipe:
        """A Recipe from a Recipe or a recipe string."""
        return recipe if isinstance(recipe, Recipe) else cls.parse(recipe)

    def __str__(self) -> str:
        return format_text(self.flat(), self.layers)

    def flat(self) -> dict[str, Any]:
        """Every field as the string syntax names it (a key the Linear format lacks at
        its default)."""
        out = dict(FLAT_DEFAULTS)
        out.update({k: getattr(self.precision, k) for k in _PRECISION})
        out.update({k: getattr(self.loss, k) for k in _LOSS}, loss_scale=self.loss.kind)
        out.update({k: getattr(self.optim, k) for k in _OPTIM})
        if self.linear is not None:
            out["fp8_scaling"] = self.linear.name
            out.update({f.name: getattr(self.linear, f.name)
                        for f in fields(self.linear)})
            out.update({k: getattr(self.layout, k) for k in _LAYOUT})
            out.update({k: getattr(self.last_layers, k) for k in _LAST})
        return out

    def replace(self, **changes: Any) -> Recipe:
        """A copy with some fields changed (validated again): the configs by name
        (``precision=``, ``linear=``, ...) or any key of the string syntax
        (``margin=1``)."""
        own = {k: changes.pop(k) for k in list(changes) if k in _FIELDS}
        r = dataclasses.replace(self, **own) if own else self
        if not changes:
            return r
        return _from_flat({**r.flat(), **changes}, set(changes), r.layers)

    def __reduce__(self):
        return from_string, (str(self),)

    def __setstate__(self, state: dict) -> None:
        """A Recipe pickled by mixprec 0.2/0.3 (one flat field dict) or this one."""
        if "precision" not in state:
            flat = {k: v for k, v in state.items() if k in FLAT_DEFAULTS}
            new = _from_flat({**FLAT_DEFAULTS, **flat}, set(), state.get("layers", ()))
            state = {f.name: getattr(new, f.name) for f in fields(Recipe)}
        for k, v in state.items():
            object.__setattr__(self, k, v)

    # --- derived facts ----------------------------------------------------------------

    @property
    def compute_dtype(self) -> torch.dtype:
        """torch dtype of the autocast region (fp8 recipes: bf16 around the fp8 Linears)."""
        compute = self.precision.compute
        if compute == "tf32":
            return torch.float32
        return formats.dtype_of(compute) if compute in _OWN_DTYPE else torch.bfloat16

    @property
    def param_dtype(self) -> torch.dtype:
        """torch dtype of the working parameters (``params``)."""
        return formats.dtype_of(self.precision.params)

    @property
    def grad_dtype(self) -> torch.dtype:
        """torch dtype of the gradient accumulation buffers (``grads``)."""
        return formats.dtype_of(self.precision.grads)

    @property
    def comm_dtype(self) -> torch.dtype:
        """torch dtype gradients travel in between ranks (``comm``)."""
        return formats.dtype_of(self.precision.comm)

    @property
    def uses_autocast(self) -> bool:
        """Whether the forward runs under torch.autocast (every compute but fp32/tf32)."""
        return self.precision.compute not in ("fp32", "tf32")

    @property
    def is_mx(self) -> bool:
        """Whether ``compute`` is an OCP MX block-scaled format (emulated only)."""
        return self.precision.compute in MX_COMPUTE

    @property
    def block_scaled(self) -> bool:
        """Whether the Linear format scales per block: its GEMMs run torch's
        block-scaled kernels on CUDA or the exact dequantizing fp32 GEMM."""
        return self.linear is not None and self.linear.block_scaled

    @property
    def needs_mixprec_optim(self) -> bool:
        """Whether the optimizer must be ``mixprec.optim``'s: the states are stored below
        fp32, or updates land in 16-bit weights by a rule (torch's do neither)."""
        return (self.optim.states != "fp32" or self.optim.write != "nearest"
                or any(r.kind == "states" and r.value != "fp32" for r in self.layers))

    @property
    def has_fp32_islands(self) -> bool:
        """Whether ``keep_fp32`` applies: something runs or is stored in low precision."""
        return bool(self.precision.keep_fp32) and (self.uses_autocast
                                                   or self.precision.params != "fp32")

    @property
    def emulatable(self) -> bool:
        """Whether emulation has anything to do: autocast runs in a 16-bit or MX format
        (a Linear format rounds with its own casts)."""
        return self.uses_autocast and self.linear is None

    # --- per-module rules (mixprec.recipe.layer_rules) -------------------------------------

    @property
    def layer_rules(self) -> tuple[LayerRule, ...]:
        """The ``layer:`` rules (the Linears' compute formats), in order."""
        return tuple(r for r in self.layers if r.kind == "layer")

    @property
    def state_rules(self) -> tuple[LayerRule, ...]:
        """The ``states:`` rules (the parameters' optimizer-state formats), in order."""
        return tuple(r for r in self.layers if r.kind == "states")

    @property
    def base(self) -> Recipe:
        """This recipe without its per-module rules."""
        return dataclasses.replace(self, layers=()) if self.layers else self

    @property
    def fp8_name(self) -> str | None:
        """The preset named for this recipe's Linear format (None without one)."""
        if self.linear is None:
            return None
        return next(n for n in LINEAR_PRESETS if preset_flat(n)["fp8_scaling"]
                    == self.linear.name)

    def layer_format(self, module_name: str) -> str:
        """The compute format of the Linear named ``module_name``: its ``layer:`` rule's
        (``bf16`` or a Linear preset's name), else this recipe's own."""
        rule = first_match(self.layers, "layer", module_name)
        if rule is not None:
            return rule.value
        return self.fp8_name or self.precision.compute

    def for_layer(self, module_name: str) -> Recipe:
        """The recipe a Linear named ``module_name`` runs with: this one, with the
        format (scaling and element format) of its ``layer:`` rule's preset, keeping
        this recipe's settings that the format has, and no rules."""
        rule = first_match(self.layers, "layer", module_name)
        if rule is None:
            return self.base
        if rule.value == "bf16":
            raise ValueError(f"Linear {module_name!r} is kept in bf16 by its rule; it "
                             "has no fp8 recipe")
        return self.with_format(rule.value)

    def with_format(self, preset: str) -> Recipe:
        """This recipe without rules, with the Linear format (scaling and element
        format) of ``preset`` (a name of ``LINEAR_PRESETS``), keeping the settings of
        this recipe's format that the new one has."""
        own, theirs = self.base.flat(), preset_flat(preset)
        keys = ("compute", "fp8_scaling", "fp8_format")
        if all(own[k] == theirs[k] for k in keys):
            return self.base
        return _from_flat({**own, **{k: theirs[k] for k in keys}}, set(), ())

    def state_format(self, param_name: str) -> str:
        """The format of the optimizer states of the parameter named ``param_name``:
        the first ``states:`` rule matching the module that owns it, else ``states``."""
        rule = first_match(self.layers, "states", owner_of(param_name))
        return rule.value if rule is not None else self.optim.states


_FIELDS = {f.name for f in fields(Recipe)}


def _convenience(config: str, cls: type, name: str, attr: str | None = None) -> property:
    attr = attr or name
    ftype = {f.name: f.type for f in fields(cls)}[attr]

    def get(self: Recipe) -> Any:
        return getattr(getattr(self, config), attr)

    get.__annotations__["return"] = ftype
    get.__doc__ = (f"``{config}.{attr}`` (read-only convenience for users; mixprec's own "
                   f"code reads ``{config}.{attr}``).")
    return property(get)


for _n in _PRECISION:
    setattr(Recipe, _n, _convenience("precision", Precision, _n))
for _n in _LOSS:
    setattr(Recipe, _n, _convenience("loss", LossScale, _n))
for _n in _OPTIM:
    setattr(Recipe, _n, _convenience("optim", OptimStates, _n))
Recipe.loss_scale = _convenience("loss", LossScale, "loss_scale", "kind")


def _from_flat(flat: dict[str, Any], given: set[str], layers) -> Recipe:
    """A Recipe from flat fields; a key in ``given`` that the result's Linear format
    lacks is refused (other such keys are dropped: their defaults, a preset's)."""
    precision = Precision(**{k: flat[k] for k in _PRECISION})
    loss = LossScale(kind=flat["loss_scale"], **{k: flat[k] for k in _LOSS})
    optim = OptimStates(**{k: flat[k] for k in _OPTIM})
    linear, own = None, set()
    layout, last = LayoutOptions(), LastLayers()
    if flat["compute"] == LINEAR_COMPUTE:
        cls = format_class(flat["fp8_scaling"])
        mine = {f.name for f in fields(cls)}
        own = mine | {"fp8_scaling", *_LAYOUT, *_LAST}
        _refuse_foreign(given, own, flat)
        linear = cls(**{k: flat[k] for k in mine})
        last = LastLayers(**{k: flat[k] for k in _LAST})
        layout = LayoutOptions(**{k: flat[k] for k in _LAYOUT})
    else:
        _refuse_foreign(given, own, flat)
    return Recipe(precision=precision, loss=loss, linear=linear, layout=layout,
                  last_layers=last, optim=optim, layers=layers)


def _refuse_foreign(given: set[str], own: set[str], flat: dict[str, Any]) -> None:
    """Keys of a Linear format given to a recipe whose format does not have them."""
    linear_keys = [k for k in FLAT_DEFAULTS if k in ("fp8_scaling", *_LAYOUT, *_LAST)
                   or any(k in {f.name for f in fields(c)} for c in FORMATS.values())]
    foreign = [k for k in linear_keys if k in given and k not in own]
    if not foreign:
        return
    if not own:
        raise ValueError(
            f"recipe: {', '.join(foreign)} set with compute={flat['compute']!r}: these are "
            "fields of a Linear format, which compute=fp8 has. Drop them, or start from "
            f"a Linear preset ({', '.join(LINEAR_PRESETS)}).")
    having = {k: [n for n, c in FORMATS.items() if k in {f.name for f in fields(c)}]
              for k in foreign}
    where = "; ".join(f"{k}: fp8_scaling={'/'.join(v)}" for k, v in having.items())
    raise ValueError(
        f"recipe: {', '.join(foreign)} with fp8_scaling={flat['fp8_scaling']!r}: the "
        f"{flat['fp8_scaling']} format has no such field ({where}). Drop "
        f"{'it' if len(foreign) == 1 else 'them'}, or use a format that has it.")


def _preset_last_layers(linear: LinearFormat | None) -> LastLayers:
    """The last layers a recipe built without them keeps: those of its format's preset
    (the first Linear preset of that ``fp8_scaling``); none without a format."""
    name = None if linear is None else next(
        (n for n in LINEAR_PRESETS if preset_flat(n)["fp8_scaling"] == linear.name), None)
    if name is None:
        return LastLayers()
    flat = preset_flat(name)
    return LastLayers(**{k: flat[k] for k in _LAST})


def _check_linear_options(r: Recipe) -> None:
    """The layout and last-layers options apply to a recipe with a Linear format; FSDP2
    gathers the weight casts of a format that has gatherable ones."""
    if r.linear is None:
        set_ = [k for cfg, keys in ((r.layout, _LAYOUT), (r.last_layers, _LAST))
                for k in keys if getattr(cfg, k) != FLAT_DEFAULTS[k]]
        if set_:
            raise ValueError(
                f"recipe: {', '.join(set_)} set with compute={r.precision.compute!r}: "
                "these apply to the Linears of a Linear format, which compute=fp8 has. "
                "Drop them, or start from a Linear preset "
                f"({', '.join(LINEAR_PRESETS)}).")
    elif r.layout.fp8_all_gather and not r.linear.gathers_casts:
        raise NotImplementedError(
            f"recipe: fp8_all_gather with fp8_scaling={r.linear.name}: this format's "
            "weight casts cannot be gathered as codes. Use another fp8_scaling "
            "(delayed, current, rowwise, block, mx, nvfp4), or drop fp8_all_gather.")


def _check_layers(r: Recipe) -> None:
    """Rules are LayerRules, each (kind, pattern) once; layer rules need a Linear format."""
    if not isinstance(r.layers, tuple) or not all(isinstance(x, LayerRule)
                                                  for x in r.layers):
        raise ValueError(f"recipe field 'layers': {r.layers!r} is not a tuple of "
                         "mixprec.recipe.layer_rules.LayerRule; write rules as "
                         "layer:PATTERN=FORMAT or states:PATTERN=FORMAT fragments")
    seen = set()
    for rule in r.layers:
        if (rule.kind, rule.pattern) in seen:
            raise ValueError(f"recipe rule {rule}: {rule.kind}:{rule.pattern} is given "
                             "twice; keep one (the first that matches decides)")
        seen.add((rule.kind, rule.pattern))
    layer = [str(x) for x in r.layers if x.kind == "layer"]
    if layer and r.linear is None:
        raise ValueError(
            f"recipe rules {', '.join(layer)} with compute={r.precision.compute!r}: layer rules "
            "choose among fp8 formats and bf16 inside an fp8 recipe, which runs the rest "
            "of the model under bf16. Start from an fp8 preset (e.g. 'fp8-current,"
            f"{layer[0]}') or drop them.")


def from_string(text: str) -> Recipe:
    """``Recipe.parse``: what a pickled Recipe is rebuilt with (its string form)."""
    return Recipe.parse(text)


PRESETS: dict[str, Recipe] = {
    name: _from_flat(preset_flat(name), set(), ()) for name in PRESET_FIELDS}

Recipe.__module__ = "mixprec.recipe"
# LayerRule also by its module before the packages (mixprec.layer_rules), which
# checkpoints of 0.3 name
torch.serialization.add_safe_globals([Recipe, LayerRule, from_string,
                                      (LayerRule, "mixprec.layer_rules.LayerRule")])
