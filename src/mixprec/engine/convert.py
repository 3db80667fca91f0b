"""Swap a model's eligible nn.Linear modules for Float8Linear, and say why for the rest.

Example::

    report = mixprec.engine.convert.convert(model, "fp8")
    print(report)            # converted layers, and each one left alone with its reason

Default policy: convert every plain ``nn.Linear`` (and GPT-2-style ``Conv1D``, as used by
transformers' GPT-2 family), whatever its dims (the GEMM routes pad where a kernel needs
it: ``mixprec.formats.padding``), except the output head. The head is the last Linear, or
one whose weight is tied to an embedding: its logits feed the loss directly and fp8
costs the most accuracy there. ``filter(module, fqn) -> bool`` replaces the policy. The
swap reuses the same Parameter objects, so an optimizer already built over the model
keeps working.

A recipe's ``layer:`` rules (``mixprec.recipe.layer_rules``) decide before the policy and the
filter: a Linear matched by ``layer:PATTERN=bf16`` is kept, one matched by an fp8 preset
(``layer:blocks.*.fc=mxfp8``) is converted with that preset's scaling
(``Recipe.for_layer``), head or not. A Linear subclass, whose owner may use its weight
directly, is kept even where a rule asked fp8 for it, with a reason naming the rule.
``layer_formats`` says what each Linear will run in without converting anything.
"""

from __future__ import annotations

import math
import warnings
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from torch import nn

from mixprec.experts.hook import is_experts
from mixprec.modules.linear import Float8Linear, is_conv1d
from mixprec.parallel.presharded import (
    forward_refusal,
    fsdp_tp_specs,
    fsdp_whole_params,
    rebind_fsdp,
)
from mixprec.parallel.tensor_parallel import is_dtensor, spec_refusal, tp_refusal
from mixprec.recipe import Recipe
from mixprec.recipe.layer_rules import LayerRule, first_match


def _coerce(recipe: Recipe | str) -> Recipe:
    """``Recipe.coerce``."""
    return Recipe.coerce(recipe)

__all__ = ["convert", "plan", "layer_formats", "ConvertReport"]


@dataclass(frozen=True)
class ConvertReport:
    """What ``convert`` did: fqns converted, and (fqn, reason) for each Linear skipped;
    ``formats``: each of those Linears' format, the fp8 preset a converted one runs
    (``fp8-current``, ``mxfp8``, ...) or ``bf16`` for a kept one (``layer_formats``)."""

    converted: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...]
    formats: Mapping[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"converted {len(self.converted)} Linear(s) to their low-precision "
                 f"format, left {len(self.skipped)} in higher precision"]
        lines += [f"  conv  {fqn}" + (f": {self.formats[fqn]}" if fqn in self.formats
                                      else "") for fqn in self.converted]
        lines += [f"  kept  {fqn}: {why}" for fqn, why in self.skipped]
        return "\n".join(lines)


def plan(model: nn.Module, filter: Callable[[nn.Module, str], bool] | None = None,
         keep_last: int = 0, keep_fraction: float = 0.0, *,
         rules: tuple[LayerRule, ...] = ()
         ) -> list[tuple[str, nn.Module, str | None]]:
    """Each Linear (or GPT-2 ``Conv1D``) of ``model`` with the reason it stays in high
    precision (None: fp8). ``keep_last``: the model's last N Linears stay too (the
    recipe's ``bf16_last_layers``; the output head, kept anyway, is one of them);
    ``keep_fraction``: or that share of them, rounded up, where it is more (the
    recipe's ``bf16_last_fraction``). ``rules``: a recipe's ``layer:`` rules, which
    decide for the Linears they match before the policy and ``filter`` do (``bf16``
    keeps one; an fp8 preset converts it where its dims and class allow)."""
    linears = [(fqn, m) for fqn, m in model.named_modules()
               if (isinstance(m, nn.Linear) or is_conv1d(m))
               and not isinstance(m, Float8Linear)]
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    last = linears[-1][0] if linears else None
    out, ruled = [], set()
    for fqn, m in linears:
        rule = first_match(rules, "layer", fqn)
        if rule is not None:
            ruled.add(fqn)
            out.append((fqn, m, _by_rule(m, rule)))
            continue
        why = None
        if type(m) is not nn.Linear and not is_conv1d(m):
            why = _subclass_reason(m)
        elif filter is not None:
            if not filter(m, fqn):
                why = "filter returned False"
        elif id(m.weight) in tied:
            why = "output head: weight tied to an embedding"
        elif fqn == last:
            why = "output head: the last Linear"
        out.append((fqn, m, why))
    by_share = math.ceil(keep_fraction * len(out) - 1e-9)
    keep, rule = ((by_share, f"bf16_last_fraction={keep_fraction:g}")
                  if by_share > keep_last else (keep_last, "bf16_last_layers"))
    for i in range(max(0, len(out) - keep), len(out)):
        fqn, m, why = out[i]
        if why is None and fqn not in ruled:  # a rule names this one: it decides
            out[i] = (fqn, m, f"one of the last {keep} Linears ({rule})")
    return out


def _subclass_reason(m: nn.Module) -> str:
    return (f"{type(m).__name__} is a Linear subclass whose owner may use its weight "
            "directly (e.g. nn.MultiheadAttention.out_proj)")


def _by_rule(m: nn.Module, rule: LayerRule) -> str | None:
    """Why a Linear matched by ``rule`` stays in high precision (None: it converts)."""
    if rule.value == "bf16":
        return f"rule {rule}"
    if type(m) is nn.Linear or is_conv1d(m):
        return None
    return (f"{_subclass_reason(m)}; rule {rule} asked for {rule.value}, which cannot "
            "apply here")


def _decide(model: nn.Module, r: Recipe, filter) -> list[tuple[str, nn.Module, str,
                                                                str | None]]:
    """``plan`` under recipe ``r``, with each Linear's format (``layer_formats``)."""
    rows = plan(model, filter, r.last_layers.bf16_last_layers,
                r.last_layers.bf16_last_fraction, rules=r.layer_rules)
    whole = fsdp_whole_params(model)  # FSDP2 gathers them whole: no shard to refuse
    specs = fsdp_tp_specs(model)  # FSDP2 over a plan: the forward sees the plan's shard
    rows = [(fqn, m, why if why is not None else _sharding_reason(m, r, fqn, whole, specs))
            for fqn, m, why in rows]
    return [(fqn, m, "bf16" if why is not None else r.layer_format(fqn), why)
            for fqn, m, why in rows]


def _sharding_reason(m: nn.Module, r: Recipe, fqn: str,
                     whole: frozenset[int] = frozenset(),
                     specs: Mapping[int, object] | None = None) -> str | None:
    """Why the Linear ``fqn``, whose weight a tensor-parallel plan sharded, cannot run
    its format on the shards (``mixprec.parallel.tensor_parallel.tp_refusal``; None: it can,
    or its weight is no DTensor, or one FSDP2 gathers whole for the forward: its id in
    ``whole``; where FSDP2 shards the plan's DTensor further, the forward's, its spec in
    ``specs``, is judged), or why a forward a plan put on it cannot follow it
    (``mixprec.parallel.presharded.forward_refusal``)."""
    if (why := forward_refusal(m)) is not None:
        return why
    if not is_dtensor(m.weight) or id(m.weight) in whole:
        return None
    fmt = r.for_layer(fqn).linear
    if id(m.weight) in (specs or {}):
        return spec_refusal(fmt, specs[id(m.weight)], transposed=is_conv1d(m))
    return tp_refusal(fmt, m.weight.t() if is_conv1d(m) else m.weight)


def layer_formats(model: nn.Module, recipe: Recipe | str,
                  filter: Callable[[nn.Module, str], bool] | None = None
                  ) -> dict[str, str]:
    """Every Linear (and GPT-2 ``Conv1D``) of ``model`` by name -> the format it will
    run in under ``recipe``: for an fp8 recipe, the fp8 preset of each Linear
    ``convert(model, recipe, filter=filter)`` would convert (``"fp8-current"``,
    ``"mxfp8"``, ... as its ``layer:`` rule or the recipe's scaling says) and
    ``"bf16"`` for each it would keep (the head, a rule's ``bf16``, a Linear
    subclass, ...). A model that holds Float8Linears already (converted by hand, or by an
    engine) is read as it is, as the engine leaves it: each Float8Linear runs its own
    preset, every other Linear bf16. For a recipe without fp8 every Linear runs in its
    ``compute`` (``"bf16"``, ``"fp32"``, ...). Nothing is converted.

    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 16))
    >>> layer_formats(net, "fp8-current,layer:1=mxfp8")
    {'0': 'fp8-current', '1': 'mxfp8', '2': 'bf16'}
    """
    r = _coerce(recipe)
    done = any(isinstance(m, Float8Linear) for m in model.modules())
    decided = ({fqn: fmt for fqn, _, fmt, _ in _decide(model, r, filter)}
               if r.linear is not None and not done else {})
    rest = "bf16" if r.linear is not None else r.precision.compute
    out = {}
    for fqn, m in model.named_modules():
        if isinstance(m, Float8Linear):
            out[fqn] = m.fp8_recipe.fp8_name
        elif isinstance(m, nn.Linear) or is_conv1d(m):
            out[fqn] = decided.get(fqn, rest)
    return out


def convert(model: nn.Module, recipe: Recipe | str | None = None, *,
            filter: Callable[[nn.Module, str], bool] | None = None,
            allow_none: bool = False,
            routes: Mapping[str, str] | None = None) -> ConvertReport:
    """Replace eligible ``nn.Linear`` modules of ``model`` in place; return a report.

    A Linear matched by one of the recipe's ``layer:`` rules runs the rule's format
    (``Recipe.for_layer``), or stays in bf16; a rule that decides for no Linear of the
    model warns (its pattern is likely wrong). A recipe that would convert nothing
    (every Linear the head, a Linear subclass, or one of the last ``bf16_last_layers``)
    trains nothing in fp8: that raises ``ValueError`` naming each Linear and why, unless
    ``allow_none`` or a ``filter`` says the choice was the user's (then it warns).
    ``routes``: the fp8 GEMM route (``fp8_gemm``) for each ``fp8_scaling`` (the engine
    passes the ones it measured, ``KernelChoices.fp8_gemm_routes``); a scaling it does
    not name keeps the recipe's.

    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 16))
    >>> report = convert(net, "fp8-current,layer:1=mxfp8,layer:2=fp8-current")
    >>> [net[i].scaling for i in range(3)], report.formats["1"]
    (['current', 'mx', 'current'], 'mxfp8')
    """
    r = _coerce(recipe or "fp8")
    rows = _decide(model, r, filter)
    _warn_unused_rules(model, r)
    converted, skipped, swaps = [], [], {}
    whole = fsdp_whole_params(model)
    for fqn, m, _, why in rows:
        if why is not None:
            skipped.append((fqn, why))
            if why.startswith("tensor parallel:"):  # the user asked for fp8 here
                warnings.warn(f"fp8: {fqn} is kept in 16 bits under {why[17:]}",
                              stacklevel=2)
            continue
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        # NVFP4's stochastic rounding: each module's own stream, fixed by its name
        swaps[m] = Float8Linear.from_linear(m, _layer_recipe(r, fqn, routes),
                                            seed=zlib.crc32(fqn.encode()))
        if id(m.weight) in whole:  # FSDP2's shard, gathered whole: no tensor-parallel
            swaps[m]._tp_layout = None  # layout (its casts agree with no other rank)
        setattr(parent, child, swaps[m])
        converted.append(fqn)
    rebind_fsdp(model, swaps)  # sharded before the swap: FSDP unshards into the new ones
    report = ConvertReport(tuple(converted), tuple(skipped),
                           {fqn: fmt for fqn, _, fmt, _ in rows})
    if not converted:
        why = ("; ".join(f"{f}: {w}" for f, w in skipped[:8]) if skipped
               else "the model has no nn.Linear")
        if not (allow_none or filter is not None):
            raise ValueError(
                f"recipe {str(r)!r} converts no Linear of this model, so nothing would "
                f"run in fp8 ({why}). Use a 16-bit recipe (bf16-master), lower "
                "bf16_last_layers or bf16_last_fraction, or train it so anyway: "
                "MixedPrecision(..., fp8_filter=lambda module, name: True) or "
                "fp8.convert(..., "
                "allow_none=True) make this a warning")
        warnings.warn(f"fp8: no Linear was converted, so nothing runs in fp8 ({why})",
                      stacklevel=2)
    return report


def _layer_recipe(r: Recipe, fqn: str, routes: Mapping[str, str] | None) -> Recipe:
    """The recipe the Linear ``fqn`` runs with: its rule's scaling, on its route."""
    own = r.for_layer(fqn)
    route = (routes or {}).get(own.linear.name, own.linear.fp8_gemm)
    if route == own.linear.fp8_gemm:
        return own
    return own.replace(fp8_gemm=route)


def _warn_unused_rules(model: nn.Module, r: Recipe) -> None:
    """One warning naming each ``layer:`` rule that decides for no Linear of the model."""
    if not r.layer_rules:
        return
    names = [fqn for fqn, m in model.named_modules()
             if isinstance(m, nn.Linear) or is_conv1d(m) or is_experts(m)]
    used = {first_match(r.layer_rules, "layer", n) for n in names}
    unused = [rule for rule in r.layer_rules if rule not in used]
    if not unused:
        return
    shadowed = [str(x) for x in unused if any(x.matches(n) for n in names)]
    sample = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
    warnings.warn(
        f"recipe rule(s) {', '.join(map(str, unused))} match no Linear of this model"
        + (f" ({', '.join(shadowed)}: every Linear it matches is taken by an earlier "
           "rule; the first match wins)" if shadowed else "")
        + f"; its Linears are named {sample or '(none)'}. Patterns match whole module "
        "names (fnmatch): write e.g. 'layer:blocks.*.fc=mxfp8', or drop the rule.",
        stacklevel=3)
