"""The small configs a Recipe is composed of: the precision of each part of a step, the
loss scale, the optimizer states with their write rule, and how the quantized Linears'
weights and partial sums cross the ranks. Each is a keyword-only frozen dataclass
validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal, get_args, get_origin, get_type_hints

from mixprec.recipe.layer_rules import STATE_RULE_FORMATS
from mixprec.recipe.rules import check_loss_numbers

__all__ = ["Precision", "LossScale", "OptimStates", "LayoutOptions", "KEEP_FP32_CHOICES",
           "DEFAULT_KEEP_FP32", "MX_COMPUTE", "LINEAR_COMPUTE"]

ComputeDtype = Literal["fp32", "tf32", "bf16", "fp16", "fp8",
                       "fp8_e4m3", "fp8_e5m2", "fp6_e3m2", "fp6_e2m3", "fp4_e2m1"]
StoreDtype = Literal["fp32", "bf16", "fp16"]

#: the compute that runs a Linear format (``Recipe.linear``) on the Linears, bf16 elsewhere
LINEAR_COMPUTE = "fp8"

#: compute formats that mean OCP MX block scaling (emulated: no torch kernels for them)
MX_COMPUTE = ("fp8_e4m3", "fp8_e5m2", "fp6_e3m2", "fp6_e2m3", "fp4_e2m1")

#: What ``keep_fp32`` may name: module families and functional ops run in FP32.
KEEP_FP32_CHOICES = (
    "layer_norm", "rms_norm", "group_norm", "batch_norm", "instance_norm",
    "softmax", "log_softmax", "loss",
    # torch.nn.utils.parametrize modules (spectral_norm, weight_norm, orthogonal): the
    # weight they compute from the stored one is computed in fp32
    "parametrizations",
    # opt-in: SDPA's backward on the CPU in fp32 (mixprec.engine.attention); slower, more exact
    "attention_backward",
)
DEFAULT_KEEP_FP32 = (
    "layer_norm", "rms_norm", "group_norm", "batch_norm", "softmax", "log_softmax", "loss",
    "parametrizations",
)


def _check_choices(obj, names: dict[str, str] | None = None) -> None:
    """Every ``Literal`` field of ``obj`` holds one of its values (``names``: the
    recipe-string name of a field where it differs)."""
    hints = get_type_hints(type(obj))
    for f in fields(obj):
        hint = hints[f.name]
        choices = get_args(hint) if get_origin(hint) is Literal else ()
        v = getattr(obj, f.name)
        if choices and v not in choices:
            name = (names or {}).get(f.name, f.name)
            raise ValueError(f"recipe field {name!r}: unknown value {v!r}; "
                             f"valid: {', '.join(map(str, choices))}")


@dataclass(frozen=True, kw_only=True)
class Precision:
    """What each part of a step computes or is stored in (mixprec format names)."""

    #: matmul/conv inputs: the autocast dtype; ``fp8`` runs the recipe's Linear format
    #: on the Linears and bf16 autocast elsewhere; ``tf32`` sets torch's matmul knobs; an
    #: OCP MX element format (``fp8_e4m3`` ... ``fp4_e2m1``) is block-scaled, emulated
    compute: ComputeDtype = "fp32"
    #: the dtype the model's parameters are stored in (the working copy)
    params: StoreDtype = "fp32"
    #: ``fp32`` keeps an fp32 master copy that the optimizer updates
    master: Literal["fp32", "none"] = "none"
    #: the dtype gradients are accumulated in across micro-batches
    grads: StoreDtype = "fp32"
    #: ``plain`` additions or ``kahan`` (compensated) summation of the gradients
    grad_accum: Literal["plain", "kahan"] = "plain"
    #: the weight-gradient GEMM's output: ``compute`` (rounded as autocast does) or
    #: ``fp32`` (added to the fp32 buffers unrounded; ``mixprec.engine.wgrad``)
    wgrad: Literal["compute", "fp32"] = "compute"
    #: the dtype gradients are reduced in across data-parallel ranks
    comm: StoreDtype = "fp32"
    #: module families and ops computed in fp32 (``KEEP_FP32_CHOICES``)
    keep_fp32: tuple[str, ...] = DEFAULT_KEEP_FP32
    #: round to the compute format on fp32 kernels (True), never (False), or where the
    #: device has no fast kernel for it (None, ``auto``)
    emulate: bool | None = None

    def __post_init__(self) -> None:
        _check_choices(self)
        ok = isinstance(self.keep_fp32, tuple)
        bad = [k for k in self.keep_fp32 if k not in KEEP_FP32_CHOICES] if ok else []
        if bad or not ok:
            raise ValueError(
                f"recipe field 'keep_fp32': unknown entries {bad or self.keep_fp32!r}; "
                f"valid: {', '.join(KEEP_FP32_CHOICES)} (join several with '+', or 'none')")
        if not (self.emulate is None or isinstance(self.emulate, bool)):
            raise ValueError(f"recipe field 'emulate': {self.emulate!r} is invalid; it "
                             "must be true, false or auto")
        if self.compute in MX_COMPUTE and self.emulate is False:
            raise ValueError(
                f"recipe: compute={self.compute!r} (MX block scaling) has no torch "
                "kernels; it runs emulated only. Drop emulate=false (or set emulate=true).")


@dataclass(frozen=True, kw_only=True)
class LossScale:
    """The loss scale: ``none``, ``static`` (always ``init_scale``) or ``dynamic`` (any
    inf/NaN skips the step and, after ``hysteresis`` overflows in a row, multiplies the
    scale by ``backoff_factor``; ``growth_interval`` clean steps multiply it by
    ``growth_factor``; always within [``min_scale``, ``max_scale``])."""

    #: ``none``, ``static`` or ``dynamic`` (the recipe string's ``loss_scale``)
    kind: Literal["none", "static", "dynamic"] = "none"
    #: the first scale (the only one under ``static``)
    init_scale: float = 2.0**16
    #: the factor a clean ``growth_interval`` multiplies the scale by
    growth_factor: float = 2.0
    #: the factor an overflow multiplies the scale by
    backoff_factor: float = 0.5
    #: clean steps in a row before the scale grows
    growth_interval: int = 2000
    #: overflows in a row before the scale backs off
    hysteresis: int = 1
    #: the scale never goes below this
    min_scale: float = 1.0
    #: the scale never goes above this
    max_scale: float = 2.0**24
    #: after this many skipped steps in a row the engine warns or raises (0: never)
    skip_limit: int = 100
    #: what the engine does at ``skip_limit``
    on_skip_limit: Literal["warn", "raise"] = "warn"

    def __post_init__(self) -> None:
        _check_choices(self, {"kind": "loss_scale"})
        check_loss_numbers(self)


@dataclass(frozen=True, kw_only=True)
class OptimStates:
    """What the optimizer's states are stored in, and how an update lands in 16-bit
    weights without a master; both need a ``mixprec.optim`` optimizer unless fp32 /
    nearest."""

    #: the optimizer states' format (``mixprec.recipe.layer_rules.STATE_RULE_FORMATS``: fp32,
    #: bf16, fp8, int8, int4)
    states: str = "fp32"
    #: ``nearest``, ``stochastic``, ``kahan`` or ``remainder``
    write: Literal["nearest", "stochastic", "kahan", "remainder"] = "nearest"

    def __post_init__(self) -> None:
        _check_choices(self)
        if self.states not in STATE_RULE_FORMATS:
            raise ValueError(f"recipe field 'states': unknown value {self.states!r}; "
                             f"valid: {', '.join(STATE_RULE_FORMATS)}")


@dataclass(frozen=True, kw_only=True)
class LayoutOptions:
    """How the quantized Linears of a recipe with a Linear format (``compute='fp8'``)
    cross the ranks: what ``mixprec.parallel`` reads (``recipe.layout``). Every Linear
    format takes them; a ``layer:`` rule's format keeps the recipe's."""

    #: under ``parallel="fsdp"``, FSDP2 gathers the weights as the codes and scales of
    #: their casts (``mixprec.parallel.gather``); a weight whose shards cannot be cast as
    #: their rows of the whole weight is gathered in 16 bits, with a warning
    fp8_all_gather: bool = False
    #: under tensor parallelism, the dtype a Linear's partial sums are summed in across
    #: the ranks (a rowwise Linear's output, a colwise one's input gradient): ``fp32``
    #: (the GEMM's accumulator, rounded once after the sum, as one process rounds it;
    #: twice the bytes of a 16-bit output) or ``compute`` (each rank's sum rounded to
    #: the 16-bit output first, as torchao and Transformer Engine reduce):
    #: ``mixprec.parallel.tensor_parallel``
    tp_reduce: Literal["fp32", "compute"] = "fp32"

    def __post_init__(self) -> None:
        if not isinstance(self.fp8_all_gather, bool):
            raise ValueError(f"recipe field 'fp8_all_gather': {self.fp8_all_gather!r} is "
                             "invalid; it must be true or false")
        _check_choices(self)
