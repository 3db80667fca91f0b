"""Swap a model's eligible nn.Linear modules for Float8Linear, and say why for the rest.

Example::

    report = mixprec.fp8.convert(model, "fp8")
    print(report)            # converted layers, and each one left alone with its reason

Default policy: convert every plain ``nn.Linear`` (and GPT-2-style ``Conv1D``, as used by
transformers' GPT-2 family) whose dims are multiples of 16, except
the output head. The head is the last Linear, or one whose weight is tied to an
embedding: its logits feed the loss directly and fp8 costs the most accuracy there.
``filter(module, fqn) -> bool`` replaces the policy (dims still apply). The swap reuses the
same Parameter objects, so an optimizer already built over the model keeps working.
"""

from __future__ import annotations

import math
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from mixprec.fp8.linear import Float8Linear, is_conv1d
from mixprec.recipe import Recipe

__all__ = ["convert", "plan", "ConvertReport"]


@dataclass(frozen=True)
class ConvertReport:
    """What ``convert`` did: fqns converted, and (fqn, reason) for each Linear skipped."""

    converted: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...]

    def __str__(self) -> str:
        lines = [f"fp8: converted {len(self.converted)} Linear(s), left "
                 f"{len(self.skipped)} in higher precision"]
        lines += [f"  fp8   {fqn}" for fqn in self.converted]
        lines += [f"  kept  {fqn}: {why}" for fqn, why in self.skipped]
        return "\n".join(lines)


def plan(model: nn.Module, filter: Callable[[nn.Module, str], bool] | None = None,
         keep_last: int = 0, keep_fraction: float = 0.0
         ) -> list[tuple[str, nn.Module, str | None]]:
    """Each Linear (or GPT-2 ``Conv1D``) of ``model`` with the reason it stays in high
    precision (None: fp8). ``keep_last``: the model's last N Linears stay too (the
    recipe's ``bf16_last_layers``; the output head, kept anyway, is one of them);
    ``keep_fraction``: or that share of them, rounded up, where it is more (the
    recipe's ``bf16_last_fraction``)."""
    linears = [(fqn, m) for fqn, m in model.named_modules()
               if (isinstance(m, nn.Linear) or is_conv1d(m))
               and not isinstance(m, Float8Linear)]
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    last = linears[-1][0] if linears else None
    out = []
    for fqn, m in linears:
        why = None
        d_in, d_out = m.weight.shape[::-1] if not is_conv1d(m) else m.weight.shape
        if type(m) is not nn.Linear and not is_conv1d(m):
            why = (f"{type(m).__name__} is a Linear subclass whose owner may use its weight "
                   "directly (e.g. nn.MultiheadAttention.out_proj)")
        elif filter is not None:
            if not filter(m, fqn):
                why = "filter returned False"
        elif id(m.weight) in tied:
            why = "output head: weight tied to an embedding"
        elif fqn == last:
            why = "output head: the last Linear"
        if why is None and (d_in % 16 or d_out % 16):
            why = (f"in_features={d_in}, out_features={d_out}: fp8 GEMMs "
                   "need both divisible by 16")
        out.append((fqn, m, why))
    by_share = math.ceil(keep_fraction * len(out) - 1e-9)
    keep, rule = ((by_share, f"bf16_last_fraction={keep_fraction:g}")
                  if by_share > keep_last else (keep_last, "bf16_last_layers"))
    for i in range(max(0, len(out) - keep), len(out)):
        fqn, m, why = out[i]
        if why is None:
            out[i] = (fqn, m, f"one of the last {keep} Linears ({rule})")
    return out


def convert(model: nn.Module, recipe: Recipe | str | None = None, *,
            filter: Callable[[nn.Module, str], bool] | None = None,
            allow_none: bool = False) -> ConvertReport:
    """Replace eligible ``nn.Linear`` modules of ``model`` in place; return a report.

    A recipe that would convert nothing (every Linear too small, the head, or one of
    the last ``bf16_last_layers``) trains nothing in fp8: that raises ``ValueError``
    naming each Linear and why, unless ``allow_none`` or a ``filter`` says the choice
    was the user's (then it warns)."""
    r = Recipe.coerce(recipe or "fp8")
    converted, skipped = [], []
    for fqn, m, why in plan(model, filter, r.bf16_last_layers, r.bf16_last_fraction):
        if why is not None:
            skipped.append((fqn, why))
            continue
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        # NVFP4's stochastic rounding: each module's own stream, fixed by its name
        setattr(parent, child, Float8Linear.from_linear(m, r, seed=zlib.crc32(fqn.encode())))
        converted.append(fqn)
    report = ConvertReport(tuple(converted), tuple(skipped))
    if not converted:
        why = ("; ".join(f"{f}: {w}" for f, w in skipped[:8]) if skipped
               else "the model has no nn.Linear")
        if not (allow_none or filter is not None):
            raise ValueError(
                f"recipe {str(r)!r} converts no Linear of this model, so nothing would "
                f"run in fp8 ({why}). Use a 16-bit recipe (bf16-master), lower "
                "bf16_last_layers or bf16_last_fraction, give the Linears dims "
                "divisible by 16, or pass "
                "allow_none=True (MixedPrecision: fp8_filter=...) to train it so anyway")
        warnings.warn(f"fp8: no Linear was converted, so nothing runs in fp8 ({why})",
                      stacklevel=2)
    return report
