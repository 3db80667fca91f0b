"""Recipe: which precision each part of training lives in, as one frozen value.

A recipe is data. It is built from a named preset plus ``key=value`` overrides::

    >>> from mixprec import Recipe
    >>> r = Recipe.parse("fp16,init_scale=1024,growth_interval=3")
    >>> r.compute, r.loss_scale, r.init_scale
    ('fp16', 'dynamic', 1024.0)
    >>> Recipe.parse(str(r)) == r
    True

Everything in mixprec that takes a recipe accepts a ``Recipe`` or such a string
(``Recipe.coerce``). Bad input raises ``ValueError`` naming the field, the value and the
valid choices; combinations that cannot train raise, useless-but-harmless ones warn.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

import torch

from mixprec.layer_rules import LayerRule, first_match, owner_of, parse_rule
from mixprec.recipe_rules import MX_COMPUTE, check_numbers, refuse_impossible, warn_useless

__all__ = ["Recipe", "PRESETS", "MX_COMPUTE", "BLOCK_SCALINGS", "KEEP_FP32_CHOICES",
           "DEFAULT_KEEP_FP32", "preset_names"]

ComputeDtype = Literal["fp32", "tf32", "bf16", "fp16", "fp8",
                       "fp8_e4m3", "fp8_e5m2", "fp6_e3m2", "fp6_e2m3", "fp4_e2m1"]
StoreDtype = Literal["fp32", "bf16", "fp16"]
MasterDtype = Literal["fp32", "none"]
LossScaleKind = Literal["none", "static", "dynamic"]
Fp8Scaling = Literal["delayed", "current", "rowwise", "block", "mx", "nvfp4", "int8"]
BlockScales = Literal["fp32", "pow2"]
MxRounding = Literal["rceil", "floor", "ceil", "even"]
Fp8Format = Literal["hybrid", "e4m3"]
AmaxAlgo = Literal["max", "most_recent"]
Fp8Gemm = Literal["auto", "scaled_mm", "dequant", "dequant_fp32"]
OnSkipLimit = Literal["warn", "raise"]
GradAccum = Literal["plain", "kahan"]
Wgrad = Literal["compute", "fp32"]
StateDtype = Literal["fp32", "bf16", "fp8", "int8", "int4"]
WriteRule = Literal["nearest", "stochastic", "kahan", "remainder"]

#: What ``keep_fp32`` may name: module families and functional ops run in FP32.
KEEP_FP32_CHOICES = (
    "layer_norm", "rms_norm", "group_norm", "batch_norm", "instance_norm",
    "softmax", "log_softmax", "loss",
    # torch.nn.utils.parametrize modules (spectral_norm, weight_norm, orthogonal): the
    # weight they compute from the stored one is computed in fp32
    "parametrizations",
    # opt-in: SDPA's backward on the CPU in fp32 (mixprec.attention); slower, more exact
    "attention_backward",
)
DEFAULT_KEEP_FP32 = (
    "layer_norm", "rms_norm", "group_norm", "batch_norm", "softmax", "log_softmax", "loss",
    "parametrizations",
)

#: the fp8 scalings with a scale per block, whose GEMMs take the block-scaled routes
BLOCK_SCALINGS = ("block", "mx", "nvfp4")

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """The precision of every part of a training step.

    >>> r = Recipe.parse("fp16-master,init_scale=1024")
    >>> r.compute, r.params, r.master, r.loss_scale, r.init_scale
    ('fp16', 'fp16', 'fp32', 'dynamic', 1024.0)
    >>> Recipe.parse(str(r)) == r
    True

    Fields (dtype names are mixprec format names):

    - ``compute``: precision of matmul/conv inputs (autocast dtype; ``fp8`` converts
      Linears to FP8 and runs the rest under bf16 autocast; ``tf32`` sets torch's matmul
      precision knobs).
    - ``params``: dtype the model's parameters are stored in (the working copy).
    - ``master``: ``fp32`` keeps an FP32 master copy that the optimizer updates.
    - ``states``: what the optimizer's states are stored in (``fp32``, ``bf16``, ``fp8``,
      ``int8`` or ``int4``), and ``write``: how an update lands in 16-bit weights without a
      master (``nearest``, ``stochastic``, ``kahan`` or ``remainder``). Both need a
      ``mixprec.optim`` optimizer unless they are fp32 / nearest.
    - ``grads``: dtype gradients are accumulated in across micro-batches;
      ``grad_accum``: ``plain`` additions or ``kahan`` (compensated) summation.
    - ``wgrad``: precision of the weight-gradient GEMM's output: ``compute`` (rounded to
      the compute dtype, as autocast does) or ``fp32`` (added to the fp32 buffers
      unrounded; ``mixprec.wgrad``).
    - ``comm``: dtype gradients are reduced in across data-parallel ranks.
    - ``loss_scale``: ``none``, ``static`` (always ``init_scale``) or ``dynamic``; the
      dynamic rule: any inf/NaN skips the step and, after ``hysteresis`` consecutive
      overflows, multiplies the scale by ``backoff_factor`` (not below ``min_scale``);
      ``growth_interval`` clean steps in a row multiply it by ``growth_factor`` (not
      above ``max_scale``).
    - ``skip_limit`` / ``on_skip_limit``: after this many consecutive skipped steps the
      engine warns or raises, so a run never skips silently forever (0 disables).
    - ``keep_fp32``: module families and ops computed in FP32 (``KEEP_FP32_CHOICES``).
    - ``emulate``: round to the compute format exactly on fp32 kernels instead of running
      the format's own kernels (``true``), never (``false``), or ``auto`` (the default,
      ``None``): emulate where the device has no fast kernel for the format (fp16 on a
      CPU; the MX formats everywhere).
    - ``compute`` may also name an OCP MX element format (``fp8_e4m3``, ``fp8_e5m2``,
      ``fp6_e3m2``, ``fp6_e2m3``, ``fp4_e2m1``): matmul operands are block-scaled (32
      elements per e8m0 scale) and always emulated.
    - fp8: ``fp8_scaling`` (per tensor, delayed from an amax history or current; or
      ``rowwise``: current, one scale per row of each GEMM operand; ``block``:
      DeepSeek-V3's 1×128 tiles for activations and gradients, 128×128 blocks for
      weights, with ``block_scales`` fp32 or ``pow2``; ``mx``: MXFP8, 1×32 tiles with
      e8m0 scales whose exponent ``mx_rounding`` picks: ``rceil``, NVIDIA's rule and
      the default, or the OCP spec's ``floor``, which saturates a block's largest
      elements, or ``ceil``, ``even``: ``mixprec.fp8.blocks``; ``nvfp4``: e2m1
      elements with an e4m3 scale per 16 and an fp32 scale per tensor, whose parts
      switch with ``nvfp4_2d`` (16×16 weight blocks), ``nvfp4_rht`` (random Hadamard
      transform of the wgrad operands) and ``nvfp4_sr`` (stochastic rounding of the
      gradients): ``mixprec.fp8.nvfp4``; ``int8``: int8 forward and dgrad GEMMs with
      a scale per row, wgrad in bf16: ``mixprec.fp8.int8_rowwise``),
      ``bf16_last_layers`` (the model's last N
      Linears stay in bf16, the output head among them), ``bf16_last_fraction`` (that
      share of the model's Linears, rounded up, stays in bf16 too: whichever of the
      two keeps more), ``fp8_all_gather`` (under
      ``parallel="fsdp"``, per-tensor scaling: FSDP2 gathers the Float8Linear weights
      as e4m3 bytes, a quarter of fp32's: ``mixprec.fp8.gather``),
      ``fp8_format``
      (``hybrid``: e4m3 forward, e5m2 gradients; or ``e4m3`` everywhere),
      ``amax_history_len``, ``amax_compute_algo``, ``margin`` (scale = max / amax / 2^m),
      ``fp8_gemm`` (``scaled_mm``: torch's scaled matmul, refused where the device
      lacks it; ``dequant``: exact upcast + bf16/fp32 GEMM; ``dequant_fp32``: exact
      upcast + fp32 GEMM; ``auto``: the kernel where the GPU has it, block-scaled ones
      after a probe, else the dequantizing GEMM with a warning; the fastest measured on
      the CPU: ``mixprec.fp8.route``).
    - ``layers``: per-module rules, ``layer:PATTERN=FORMAT`` (a Linear's fp8 format, or
      bf16) and ``states:PATTERN=FORMAT`` (its parameters' optimizer states), matched
      against module names, first match wins (``mixprec.layer_rules``).
    """

    compute: ComputeDtype = "fp32"
    params: StoreDtype = "fp32"
    master: MasterDtype = "none"
    states: StateDtype = "fp32"
    write: WriteRule = "nearest"
    grads: StoreDtype = "fp32"
    grad_accum: GradAccum = "plain"
    wgrad: Wgrad = "compute"
    comm: StoreDtype = "fp32"
    loss_scale: LossScaleKind = "none"
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    skip_limit: int = 100
    on_skip_limit: OnSkipLimit = "warn"
    keep_fp32: tuple[str, ...] = DEFAULT_KEEP_FP32
    emulate: bool | None = None
    fp8_scaling: Fp8Scaling = "delayed"
    fp8_format: Fp8Format = "hybrid"
    amax_history_len: int = 16
    amax_compute_algo: AmaxAlgo = "max"
    margin: int = 0
    fp8_gemm: Fp8Gemm = "auto"
    block_scales: BlockScales = "fp32"
    mx_rounding: MxRounding = "rceil"
    nvfp4_2d: bool = True
    nvfp4_rht: bool = True
    nvfp4_sr: bool = True
    bf16_last_layers: int = 0
    bf16_last_fraction: float = 0.0
    fp8_all_gather: bool = False
    #: per-module rules (``mixprec.layer_rules``): ``layer:PATTERN=FORMAT`` and
    #: ``states:PATTERN=FORMAT`` fragments, first match wins
    layers: tuple[LayerRule, ...] = ()

    def __post_init__(self) -> None:
        for f in fields(self):
            choices = _literal_choices(f.name)
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(
                    f"recipe field {f.name!r}: unknown value {getattr(self, f.name)!r}; "
                    f"valid: {', '.join(map(str, choices))}"
                )
        ok = isinstance(self.keep_fp32, tuple)
        bad = [k for k in self.keep_fp32 if k not in KEEP_FP32_CHOICES] if ok else []
        if bad or not ok:
            raise ValueError(
                f"recipe field 'keep_fp32': unknown entries {bad or self.keep_fp32!r}; "
                f"valid: {', '.join(KEEP_FP32_CHOICES)} (join several with '+', or 'none')"
            )
        check_numbers(self)
        _check_layers(self)
        refuse_impossible(self)
        warn_useless(self, _DEFAULTS)

    # --- parsing ------------------------------------------------------------------

    @classmethod
    def parse(cls, text: str) -> Recipe:
        """Parse ``"preset[,key=value...]"`` or ``"key=value,..."`` (preset ``fp32``).

        Values are validated as for the constructor; each key may appear once.
        ``keep_fp32`` takes ``+``-joined names (``keep_fp32=layer_norm+softmax``) or
        ``none``; booleans take true/false/1/0/yes/no.
        """
        if not isinstance(text, str):
            raise ValueError(f"recipe must be a string or Recipe, got {type(text).__name__}")
        parts = [p.strip() for p in text.split(",")]
        if not text.strip() or any(p == "" for p in parts):
            raise ValueError(f"recipe {text!r}: empty fragment; expected "
                             f"'preset[,key=value...]' with a preset from {preset_names()}")
        base = "fp32"
        if "=" not in parts[0]:
            base = parts.pop(0).lower()
            if base not in PRESETS:
                raise ValueError(f"recipe {text!r}: unknown preset {base!r}; "
                                 f"valid presets: {', '.join(preset_names())}")
        overrides: dict[str, Any] = {}
        rules: list[LayerRule] = []
        names = [f.name for f in fields(cls) if f.name != "layers"]
        for p in parts:
            if ":" in p.partition("=")[0]:
                rules.append(parse_rule(p))
                continue
            if "=" not in p:
                raise ValueError(f"recipe {text!r}: fragment {p!r} is not key=value (only "
                                 "the first fragment may be a preset name)")
            key, _, raw = p.partition("=")
            key, raw = key.strip(), raw.strip()
            if key not in names:
                raise ValueError(f"recipe {text!r}: unknown field {key!r}; "
                                 f"valid fields: {', '.join(names)}")
            if key in overrides:
                raise ValueError(f"recipe {text!r}: field {key!r} given twice")
            overrides[key] = _convert(key, raw)
        if rules:
            overrides["layers"] = tuple(rules)
        return PRESETS[base].replace(**overrides) if overrides else PRESETS[base]

    @classmethod
    def coerce(cls, recipe: Recipe | str) -> Recipe:
        """A Recipe from a Recipe or a recipe string."""
        if isinstance(recipe, Recipe):
            return recipe
        return cls.parse(recipe)

    def replace(self, **changes: Any) -> Recipe:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def __str__(self) -> str:
        best_name, best_diff = "fp32", None
        for name, p in PRESETS.items():
            diff = _diff(p, self)
            if best_diff is None or len(diff) < len(best_diff):
                best_name, best_diff = name, diff
        return ",".join([best_name, *(f"{k}={_format(v)}" for k, v in best_diff),
                         *map(str, self.layers)])

    # --- derived facts used by the engine -----------------------------------------

    @property
    def compute_dtype(self) -> torch.dtype:
        """torch dtype of the autocast region (fp8 recipes: bf16 around the fp8 Linears)."""
        return {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
                "fp16": torch.float16}.get(self.compute, torch.bfloat16)

    @property
    def param_dtype(self) -> torch.dtype:
        """torch dtype of the working parameters (``params``)."""
        return _TORCH[self.params]

    @property
    def grad_dtype(self) -> torch.dtype:
        """torch dtype of the gradient accumulation buffers (``grads``)."""
        return _TORCH[self.grads]

    @property
    def comm_dtype(self) -> torch.dtype:
        """torch dtype gradients travel in between ranks (``comm``)."""
        return _TORCH[self.comm]

    @property
    def uses_autocast(self) -> bool:
        """Whether the forward runs under torch.autocast (every compute but fp32/tf32)."""
        return self.compute not in ("fp32", "tf32")

    @property
    def is_mx(self) -> bool:
        """Whether ``compute`` is an OCP MX block-scaled format (emulated only)."""
        return self.compute in MX_COMPUTE

    @property
    def block_scaled(self) -> bool:
        """Whether an fp8 recipe scales per block (``block``, ``mx``, ``nvfp4``): its
        GEMMs run torch's block-scaled kernels on CUDA or the exact dequantizing fp32
        GEMM (``mixprec.fp8.route``), not the per-tensor routes."""
        return self.compute == "fp8" and self.fp8_scaling in BLOCK_SCALINGS

    @property
    def needs_mixprec_optim(self) -> bool:
        """Whether the optimizer must be ``mixprec.optim``'s: the states are stored below
        fp32, or updates land in 16-bit weights by a rule (torch's optimizers do
        neither)."""
        return (self.states != "fp32" or self.write != "nearest"
                or any(r.kind == "states" and r.value != "fp32" for r in self.layers))

    # --- per-module rules (mixprec.layer_rules) -------------------------------------

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
        return self.replace(layers=()) if self.layers else self

    @property
    def fp8_name(self) -> str | None:
        """The fp8 preset whose scaling and element format this recipe has (``fp8``,
        ``fp8-current``, ...; None for a recipe that is not fp8)."""
        if self.compute != "fp8":
            return None
        return _FP8_NAMES.get(self.fp8_scaling)

    def layer_format(self, module_name: str) -> str:
        """The compute format of the Linear named ``module_name``: its ``layer:`` rule's
        (``bf16`` or an fp8 preset name), else this recipe's own (the fp8 preset of its
        scaling, or ``compute``). The head and ``bf16_last_layers`` still apply to
        Linears no rule names (``mixprec.fp8.convert``)."""
        rule = first_match(self.layers, "layer", module_name)
        if rule is not None:
            return rule.value
        return self.fp8_name or self.compute

    def for_layer(self, module_name: str) -> Recipe:
        """The recipe a Linear named ``module_name`` runs its fp8 GEMMs with: this one,
        with the scaling and element format of its ``layer:`` rule's preset, and no
        rules."""
        rule = first_match(self.layers, "layer", module_name)
        if rule is None:
            return self.base
        name = rule.value
        if name == "bf16":
            raise ValueError(f"Linear {module_name!r} is kept in bf16 by its rule; it "
                             "has no fp8 recipe")
        preset = PRESETS[name]
        own = self.base
        if (preset.fp8_scaling, preset.fp8_format) == (own.fp8_scaling, own.fp8_format):
            return own
        with warnings.catch_warnings():  # the recipe's other fp8 fields, harmless here
            warnings.simplefilter("ignore")
            return own.replace(fp8_scaling=preset.fp8_scaling,
                               fp8_format=preset.fp8_format)

    def state_format(self, param_name: str) -> str:
        """The format of the optimizer states of the parameter named ``param_name``:
        the first ``states:`` rule matching the module that owns it, else ``states``."""
        rule = first_match(self.layers, "states", owner_of(param_name))
        return rule.value if rule is not None else self.states

    @property
    def has_fp32_islands(self) -> bool:
        """Whether ``keep_fp32`` applies: something runs or is stored in low precision."""
        return bool(self.keep_fp32) and (self.uses_autocast or self.params != "fp32")

    @property
    def emulatable(self) -> bool:
        """Whether emulation has anything to do: autocast runs in a 16-bit or MX format
        (fp8 recipes are exact already: Float8Linear rounds with the fp8 casts)."""
        return self.uses_autocast and self.compute != "fp8"


#: each field's default, for the checks that tell a set field from an untouched one
_DEFAULTS = {f.name: f.default for f in fields(Recipe)}

_TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

_LITERALS = {
    "compute": ComputeDtype, "params": StoreDtype, "master": MasterDtype, "grads": StoreDtype,
    "comm": StoreDtype, "states": StateDtype, "write": WriteRule, "grad_accum": GradAccum,
    "wgrad": Wgrad, "loss_scale": LossScaleKind,
    "on_skip_limit": OnSkipLimit,
    "fp8_scaling": Fp8Scaling, "fp8_format": Fp8Format, "amax_compute_algo": AmaxAlgo,
    "fp8_gemm": Fp8Gemm, "block_scales": BlockScales, "mx_rounding": MxRounding,
}


def _literal_choices(name: str) -> tuple:
    lit = _LITERALS.get(name)
    return get_args(lit) if lit is not None else ()


def _convert(key: str, raw: str) -> Any:
    if key in _LITERALS:
        return raw.lower()
    if key == "keep_fp32":
        if raw.lower() == "none":
            return ()
        return tuple(x.strip().lower() for x in raw.split("+"))
    default = next(f.default for f in fields(Recipe) if f.name == key)
    if isinstance(default, bool):
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise ValueError(f"recipe field {key!r}: {raw!r} is not valid; use true or false")
    if key == "emulate":
        if raw.lower() == "auto":
            return None
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise ValueError(f"recipe field 'emulate': {raw!r} is not valid; "
                         "use true, false or auto")
    try:
        if isinstance(default, int):
            return int(raw)
        v = float(raw)
    except ValueError:
        kind = "an integer" if isinstance(default, int) else "a number"
        raise ValueError(f"recipe field {key!r}: {raw!r} is not {kind}") from None
    return v


def _format(v: Any) -> str:
    if v is None:
        return "auto"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, tuple):
        return "+".join(v) if v else "none"
    if isinstance(v, float):
        return repr(v)
    return str(v)


def _diff(a: Recipe, b: Recipe) -> list[tuple[str, Any]]:
    return [(f.name, getattr(b, f.name)) for f in fields(Recipe)
            if f.name != "layers" and getattr(a, f.name) != getattr(b, f.name)]


def _check_layers(r: Recipe) -> None:
    """Rules are LayerRules, each (kind, pattern) once; layer rules need an fp8 recipe."""
    if not isinstance(r.layers, tuple) or not all(isinstance(x, LayerRule)
                                                  for x in r.layers):
        raise ValueError(f"recipe field 'layers': {r.layers!r} is not a tuple of "
                         "mixprec.layer_rules.LayerRule; write rules as "
                         "layer:PATTERN=FORMAT or states:PATTERN=FORMAT fragments")
    seen = set()
    for rule in r.layers:
        if (rule.kind, rule.pattern) in seen:
            raise ValueError(f"recipe rule {rule}: {rule.kind}:{rule.pattern} is given "
                             "twice; keep one (the first that matches decides)")
        seen.add((rule.kind, rule.pattern))
    layer = [str(x) for x in r.layers if x.kind == "layer"]
    if layer and r.compute != "fp8":
        raise ValueError(
            f"recipe rules {', '.join(layer)} with compute={r.compute!r}: layer rules "
            "choose among fp8 formats and bf16 inside an fp8 recipe, which runs the rest "
            "of the model under bf16. Start from an fp8 preset (e.g. 'fp8-current,"
            f"{layer[0]}') or drop them.")


PRESETS: dict[str, Recipe] = {
    "fp32": Recipe(),
    "tf32": Recipe(compute="tf32"),
    "bf16": Recipe(compute="bf16"),
    "bf16-master": Recipe(compute="bf16", params="bf16", master="fp32"),
    "fp16": Recipe(compute="fp16", loss_scale="dynamic"),
    "fp16-master": Recipe(compute="fp16", params="fp16", master="fp32", loss_scale="dynamic"),
    "fp8": Recipe(compute="fp8"),
    "fp8-current": Recipe(compute="fp8", fp8_scaling="current"),
    "fp8-rowwise": Recipe(compute="fp8", fp8_scaling="rowwise"),
    # block scales, e4m3 everywhere: DeepSeek-V3's recipe, and OCP MXFP8
    "fp8-block": Recipe(compute="fp8", fp8_scaling="block", fp8_format="e4m3"),
    "mxfp8": Recipe(compute="fp8", fp8_scaling="mx", fp8_format="e4m3"),
    # NVIDIA's NVFP4 pretraining recipe; the last two Linears stay in bf16
    "nvfp4": Recipe(compute="fp8", fp8_scaling="nvfp4", bf16_last_layers=2),
    # int8 forward and dgrad GEMMs, rowwise scales, wgrad in bf16 (mixprec.fp8.int8_rowwise)
    "int8-rowwise": Recipe(compute="fp8", fp8_scaling="int8"),
    # bf16 weights without an fp32 master, kept accurate by the write rule
    "bf16-sr": Recipe(compute="bf16", params="bf16", write="stochastic"),
    "bf16-kahan": Recipe(compute="bf16", params="bf16", write="kahan"),
    "bf16-remainder": Recipe(compute="bf16", params="bf16", write="remainder"),
    # the fewest bytes: bf16 weights and gradients, int8 moments (6 bytes per parameter)
    "bf16-lean": Recipe(compute="bf16", params="bf16", grads="bf16", write="stochastic",
                        states="int8"),
}

#: fp8_scaling -> the fp8 preset named for it (each preset's element format)
_FP8_NAMES = {"delayed": "fp8", "current": "fp8-current", "rowwise": "fp8-rowwise",
              "block": "fp8-block", "mx": "mxfp8", "nvfp4": "nvfp4", "int8": "int8-rowwise"}


def preset_names() -> list[str]:
    """Names accepted by ``Recipe.parse`` as the first field (fp32, bf16, ...)."""
    return list(PRESETS)


torch.serialization.add_safe_globals([Recipe, LayerRule])
