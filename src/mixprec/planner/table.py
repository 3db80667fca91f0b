"""A plan as text: its table, columns as wide as their widest cell, and its summary.

``COLUMNS`` names and explains every column (``mixprec plan --help`` and the guide
print the same words). ``render(plan)`` lays the rows out with two spaces between
columns, each as wide as its header or its widest cell, so no format name runs into
the next column; then the summary: the recipe, the predicted step as the sum of the
terms it is made of (the 16-bit recipe's measured step, the fp8 recipe around the
Linears, the ``step ms`` column, the optimizer states), the peak, and the share of the
matmul FLOPs the plan runs below 16 bits with why the rest stays in bf16.
"""

from __future__ import annotations

import textwrap
from typing import Any

from mixprec.planner.timing import BF16

#: a ``planning.Plan`` (which renders itself with this module: not imported here)
Plan = Any

__all__ = ["COLUMNS", "render", "columns_help", "kept_because"]

#: every column of the table and what it says
COLUMNS = {
    "layer": "the Linear's (or experts module's) name in the model",
    "shape": "in x out features (an experts module: hidden x intermediate width)",
    "choice": "the format its GEMMs run in (bf16: kept at 16 bits)",
    "states": "the format of its optimizer states (AdamW's two moments)",
    "speed-up": "its forward + backward in its format over in bf16, timed alone on this "
                "device (above 1: faster)",
    "step ms": "what it adds to the predicted step in its format, in ms, scaled to the "
               "whole model (negative: it saves); the predicted step adds these up",
    "SQNR dB": "the worst of its output, dgrad and wgrad against bf16, in dB (higher is "
               "closer; - for bf16)",
    "saved MB": "the activation bytes it keeps for backward in its format (casts of its "
                "input and weight; MB = 1e6 bytes)",
    "reason": "why it got its format",
}

_RIGHT = {"shape", "speed-up", "step ms", "SQNR dB", "saved MB"}


def columns_help(width: int = 88) -> str:
    """The columns and their meaning, one a paragraph (for ``--help``)."""
    return "\n".join(textwrap.fill(what, width, initial_indent=f"  {name:<9} ",
                                   subsequent_indent=" " * 12)
                     for name, what in COLUMNS.items())


def _cells(plan: Plan) -> list[list[str]]:
    rows = []
    for r in plan.rows:
        rows.append([r.layer, f"{r.shape[0]}x{r.shape[1]}", r.choice, r.states,
                     f"{r.speedup:.2f}x", f"{r.delta_s * 1e3:+.2f}",
                     "-" if r.sqnr is None else f"{r.sqnr:.1f}",
                     f"{r.saved_bytes / 1e6:.2f}", r.reason])
    return rows


def render(plan: Plan) -> str:
    """The table, then the summary (module docstring)."""
    head = list(COLUMNS)
    rows = _cells(plan)
    widths = [max([len(h)] + [len(row[i]) for row in rows]) for i, h in enumerate(head)]
    lines = []
    for cells in [head, *rows]:
        out = [c if i == len(head) - 1 else
               c.rjust(widths[i]) if head[i] in _RIGHT else c.ljust(widths[i])
               for i, c in enumerate(cells)]
        lines.append("  ".join(out).rstrip())
    for name, why in plan.state_reasons.items():
        lines.append(f"  {name}: {why}")
    for name, why in plan.not_planned.items():
        lines.append(f"  not planned: {name}: {why}")
    return "\n".join(lines + summary(plan))


def _ms(x: float) -> str:
    return f"{'-' if x < 0 else '+'} {abs(x) * 1e3:.1f} ms"


def summary(plan: Plan) -> list[str]:
    """The lines under the table (module docstring)."""
    b16 = plan.baseline["16-bit"]
    terms = plan.step_terms
    lines = [f"recipe: {plan.recipe}"]
    if terms:
        linears = sum(r.delta_s for r in plan.rows)
        lines.append(
            f"predicted step {plan.predicted_step_s * 1e3:.1f} ms = "
            f"{terms['base'] * 1e3:.1f} ms (the 16-bit recipe, measured) "
            f"{_ms(terms['shell'])} (the fp8 recipe around the Linears: its step with "
            f"none converted, measured, less the 16-bit one) {_ms(linears)} (the step "
            f"ms column) {_ms(terms['states'])} (optimizer states), on {plan.device}")
    else:
        lines.append(f"predicted step {plan.predicted_step_s * 1e3:.1f} ms (16-bit "
                     f"recipe measured {b16['step_s'] * 1e3:.1f} ms) on {plan.device}")
    lines.append(f"predicted peak {plan.predicted_peak / 1e6:.1f} MB (16-bit recipe "
                 f"measured {b16['peak'] / 1e6:.1f} MB)")
    if plan.low_precision_share is not None:
        lines.append(coverage_line(plan))
    if plan.loss_delta is not None:
        lines.append(f"calibration loss vs the 16-bit recipe: {plan.loss_delta:+.3%}")
    if plan.timing_noise:
        lines.append("timings noisy: " + "; ".join(plan.timing_noise))
    return lines


def coverage_line(plan: Plan) -> str:
    """The share of the matmul FLOPs below 16 bits and, where that leaves the model
    mostly in 16 bits, why the rest stays in bf16 (by share of the FLOPs)."""
    share = plan.low_precision_share or 0.0
    low = [r for r in plan.rows if r.choice != BF16]
    text = (f"coverage: {share:.0%} of the matmul FLOPs below 16 bits "
            f"({len(low)} of {len(plan.rows)} planned layers)")
    if share >= 0.5 or not plan.kept_flops:
        return text
    total = sum(plan.kept_flops.values()) or 1.0
    why = ", ".join(f"{v / total:.0%} {k}" for k, v in
                    sorted(plan.kept_flops.items(), key=lambda kv: -kv[1]) if v > 0)
    return (text + f"; the plan leaves the model mostly in 16 bits. The rest stays "
            f"bf16 because (share of it): {why}")


def kept_because(reason: str) -> str:
    """Why a layer stays in bf16, as a category, from its row's reason."""
    if "timings disagree" in reason:
        return "its timings disagree (no speed advice from them)"
    if "SQNR" in reason:
        return "below the SQNR floor"
    if "calibration loss" in reason:
        return "moved back to hold max_loss"
    if "saturates" in reason:
        return "delayed scaling saturates"
    if "no fp8 format measured" in reason:
        return "no fp8/fp4 format among the candidates"
    if "no gradient" in reason:
        return "no gradient on the calibration batches"
    if reason.startswith("bf16: fastest") or "step is slower" in reason:
        return "slower in fp8/fp4 than in bf16 on this device"
    return "no fp8/fp4 format can take it"
