"""``mixprec compare``: train several recipes from the same seed and data and report.

Writes ``report.json`` (every number) and ``report.html`` (one self-contained file: inline
SVG charts, no network) to ``out``: loss curves, final validation loss against fp32,
tokens/s and speed-up (none where the steps' timings disagree: ``TrainResult.timing``;
the report says by how much), memory by category (``memory.measure``), the loss-scale
trace and skipped steps, and the doctor's findings for each recipe.

An entry may be a plan: a path ending in ``.json`` written by ``mixprec plan`` (trained
under its recipe, labelled by the file's stem) or ``plan``, a plan made now for this
model (``mixprec.workbench.planning``). The report shows each plan's table, and the
doctor checks its fp8/fp4 layers against the plan's SQNR floor.

``scenario="overflow"`` (fp16 without loss scaling) trains with the loss multiplied by
1e-7, as when a sum-reduced loss is divided by a huge token count. AdamW's updates do not
depend on the gradient's scale, so fp32 and bf16 train as usual. In fp16 with no loss
scaling the gradients fall below 6e-8 and flush to zero, and training stalls. Dynamic
loss scaling multiplies them back into fp16's range, and the run trains.
"""

from __future__ import annotations

import dataclasses
import math
import platform
import sys
import time
import warnings
from collections.abc import Iterable
from pathlib import Path

import torch

from mixprec.diagnostics import doctor
from mixprec.diagnostics.findings import Finding
from mixprec.workbench.data import load_corpus, sample_batch
from mixprec.workbench.model import GPT, SIZES
from mixprec.workbench.planning import resolve_entry
from mixprec.workbench.report import write_report
from mixprec.workbench.train import TrainConfig, TrainResult, first_recipe, train

__all__ = ["compare", "CompareInterrupted", "DEFAULT_RECIPES", "SCENARIOS", "write_report",
           "slow_step_findings", "cpu_name"]

DEFAULT_RECIPES = ("fp32", "bf16", "bf16-master", "fp16", "fp8")
SCENARIOS = {
    "overflow": {
        "recipes": ("fp32", "bf16", "fp16,loss_scale=none", "fp16"),
        "config": {"loss_multiplier": 1e-7, "max_grad_norm": None},
        "story": ("Loss multiplied by 1e-7: fp16 gradients without loss scaling flush to "
                  "zero (below 6e-8) and training stalls; dynamic loss scaling brings them "
                  "back into range; bf16 has fp32's range and needs no scaling."),
    },
}


class CompareInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped ``compare``: ``report`` is the report of the recipes that
    finished, written to ``out`` (None where none had finished), and ``during`` what was
    running (``"bf16's training"``)."""

    def __init__(self, report: dict | None, during: str) -> None:
        super().__init__(during)
        self.report, self.during = report, during


def compare(recipes: Iterable[str] | None = None, *, steps: int = 150, size: str = "medium",
            batch: int = 16, seq: int | None = None, lr: float = 3e-3, seed: int = 0,
            out: str | Path = "runs/compare", scenario: str | None = None,
            progress: bool | None = None, doctor_steps: int = 2) -> dict:
    """Run each recipe and write the report; returns the report dict.

    An entry is a recipe, a plan file (``*.json``) or ``plan`` (plan this model now):
    see the module docstring. ``progress`` (None or True) prints a line per phase on
    stderr (training each recipe, the doctor on each) and each run's progress
    (``train``); False prints nothing. Ctrl-C writes the report of the recipes that
    finished and raises ``CompareInterrupted``."""
    extra = {}
    story = None
    if scenario is not None:
        if scenario not in SCENARIOS:
            raise ValueError(f"scenario {scenario!r}; valid: {', '.join(SCENARIOS)}")
        sc = SCENARIOS[scenario]
        recipes = recipes or sc["recipes"]
        extra, story = sc["config"], sc["story"]
    say = (lambda line: None) if progress is False else _say  # noqa: E731
    out = Path(out)
    entries: dict = {}
    results: dict[str, TrainResult] = {}
    walls: dict[str, float] = {}
    findings: dict[str, list] = {}
    during = "planning"
    try:
        entries = _entries(list(recipes or DEFAULT_RECIPES), size, batch, seq, seed)
        for k, (label, (r, _)) in enumerate(entries.items(), 1):
            during = f"{label}'s training"
            say(f"compare: training {label} ({k} of {len(entries)}), {steps} steps")
            cfg = TrainConfig(recipe=r, steps=steps, size=size, batch=batch, seq=seq, lr=lr,
                              seed=seed, eval_every=max(1, steps // 6), ckpt_every=steps,
                              **extra)
            t = time.perf_counter()
            res = train(cfg, out / _slug(label), progress=progress, measure_memory=True)
            walls[label] = time.perf_counter() - t
            results[label] = res
            say(f"compare: {label} done in {walls[label]:.0f} s: validation loss "
                f"{res.final_val_loss:.4f}, {res.tokens_per_s:,.0f} tokens/s")
        plans = {label: p for label, (_, p) in entries.items() if p is not None}
        for label in results if doctor_steps else ():
            during = f"the doctor on {label}"
            say(f"compare: the doctor on {label} ({doctor_steps} steps)")
            findings[label] = _doctor(label, results, doctor_steps, plans.get(label))
    except KeyboardInterrupt:
        report = (_finish(entries, results, walls, findings, scenario, story, out,
                          interrupted=during) if results else None)
        raise CompareInterrupted(report, during) from None
    return _finish(entries, results, walls, findings, scenario, story, out)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _finish(entries: dict, results: dict, walls: dict, findings: dict, scenario, story,
            out: Path, interrupted: str | None = None) -> dict:
    """The report of the recipes in ``results``, written to ``out``; ``interrupted``
    names what a Ctrl-C stopped (the report then holds the recipes that finished)."""
    report = _report_dict(results, walls, findings, scenario, story)
    report["interrupted"] = interrupted
    for row in report["summary"]:
        label = row["recipe"]
        row["recipe_string"], plan = entries[label]
        if plan is not None:
            row["plan"] = {"recipe": str(plan.recipe),
                           "rows": [dataclasses.asdict(x) for x in plan.rows],
                           "table": plan.table()}
    write_report(report, out)
    return report


def _entries(recipes: list[str], size, batch, seq, seed) -> dict:
    """``{label: (recipe string, plan or None)}``; every recipe is checked and every
    plan made or loaded before any training."""
    out: dict = {}
    for entry in recipes:
        label, r, p = resolve_entry(entry, size=size, batch=batch, seq=seq, seed=seed)
        first_recipe(r)  # fail before any training
        if label in out and label != entry:  # plan.json beside plan: the path labels it
            label = entry
        out[label] = (r, p)
    return out


def _slug(recipe: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in recipe)


def _doctor(label: str, results: dict, steps: int, plan=None) -> list[dict]:
    """The doctor's findings on ``label``'s recipe (or its plan), on a fresh model of
    the run's size and the run's data, and ``slow_step_findings`` against fp32."""
    cfg = results[label].config
    mcfg = dataclasses.replace(SIZES[cfg.size], seq_len=cfg.seq_len)
    corpus = load_corpus(max_bytes=200_000, seed=cfg.seed)
    g = torch.Generator().manual_seed(cfg.seed)
    data = [sample_batch(corpus.train, 4, cfg.seq_len, g) for _ in range(steps)]

    def factory():
        torch.manual_seed(0)
        return GPT(mcfg)

    def batch_fn(model, step):
        x, y = data[step % len(data)]
        return model(x, y) * cfg.loss_multiplier

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # a precision schedule: the doctor reads its first phase
        rep = doctor(factory, batch_fn, plan if plan is not None else first_recipe(cfg.recipe),
                     steps=steps, reference_steps=0)
    found = list(rep.findings) + slow_step_findings(label, results, rep.facts)
    return [dataclasses.asdict(f) for f in found]


#: a recipe whose training step takes longer than this many fp32 steps is flagged
SLOW_STEP = 2.0


def slow_step_findings(recipe: str, results: dict, facts: dict) -> list[Finding]:
    """A warning when ``recipe`` trained at under 1/``SLOW_STEP`` of fp32's tokens/s in
    the same comparison, with the cause: the kernels it ran on (the auto choices and
    the measured rates) and where the doctor's profile says its step's time goes.
    Where the steps of either disagree (``TrainResult.timing``), an ``info`` finding
    says by how much instead, and no advice is given."""
    base, res = results.get("fp32"), results[recipe]
    if base is None or recipe == "fp32" or not res.tokens_per_s:
        return []
    noisy = [t for t in (base.timing, res.timing) if t.noisy]
    if noisy:  # no advice from steps that disagree (``diagnostics.noise``)
        return [Finding(
            "info", "timing-noisy",
            f"{recipe}'s and fp32's step timings disagree: no speed advice is drawn "
            "from them", "; ".join(map(str, noisy)),
            "the machine was busy (other processes held the cores): rerun on an idle "
            "machine before choosing a recipe by speed",
            {"spread": max(t.spread for t in noisy)})]
    ratio = base.tokens_per_s / res.tokens_per_s
    if ratio <= SLOW_STEP:
        return []
    ops = (facts.get("time_shares") or {}).get("ops", [])[:3]
    where = ", ".join(f"{op} {ms:.1f} ms" for op, ms in ops)
    emulated = ("it is emulated (no fast kernel for its format here), which costs "
                "rounding passes on fp32 kernels; " if res.emulated else "")
    return [Finding(
        "warning", "step-slow",
        f"{recipe}'s step takes {ratio:.1f}x the fp32 step here",
        f"{res.tokens_per_s:,.0f} tokens/s against fp32's {base.tokens_per_s:,.0f}; "
        f"kernels: {res.kernels}" + (f"; the largest ops per step: {where}" if where else ""),
        emulated + "on this device train in fp32 (or a recipe whose kernels are fast "
        "here) and keep this recipe for hardware that has them; the largest ops above "
        "say where its time goes", {"ratio": ratio})]


def cpu_name() -> str:
    """The CPU's model name and torch's capability (``AVX2``, ``AVX512``...): a figure
    means little without the chip it came from, and these differ run to run."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name} ({torch.backends.cpu.get_cpu_capability()})"


def _report_dict(results, walls, findings, scenario, story) -> dict:
    base = results.get("fp32")
    base_noisy = base is not None and base.timing.noisy
    rows = []
    for r, res in results.items():
        losses = [s["loss"] for s in res.steps]
        head = [x for x in losses[:5] if math.isfinite(x)]
        tail = [x for x in losses[-5:] if math.isfinite(x)]
        rows.append({
            "recipe": r,
            "final_val_loss": res.final_val_loss,
            "val_loss_vs_fp32": (res.final_val_loss / base.final_val_loss - 1
                                 if base and base is not res else 0.0 if base else None),
            "tokens_per_s": res.tokens_per_s,
            # no speed-up from steps that disagree: "timing" says by how much
            "speedup_vs_fp32": (res.tokens_per_s / base.tokens_per_s if base and not (
                base_noisy or res.timing.noisy) else None),
            "timing": res.timing.as_dict(),
            "skipped_steps": res.skipped,
            "emulated": res.emulated,
            "memory_bytes": res.memory,
            "loss_first5": sum(head) / len(head) if head else math.nan,
            "loss_last5": sum(tail) / len(tail) if tail else math.nan,
            "nan_loss": any(not math.isfinite(x) for x in losses),
            "wall_s": walls[r],
            "fp8": res.fp8_report,
            "matmul_weights_low_precision": res.coverage.get("low_precision"),
            "matmul_weights_by_format": res.coverage.get("by_kind"),
            "findings": findings.get(r, []),
        })
    cfg = next(iter(results.values())).config
    return {
        "scenario": scenario, "story": story,
        "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "recipe"},
        "machine": f"{cpu_name()}, {torch.get_num_threads()} threads, torch "
                   f"{torch.__version__}",
        "summary": rows,
        "timing_noise": [str(res.timing) for res in results.values() if res.timing.noisy],
        "curves": {r: {"steps": [s["step"] for s in res.steps],
                       "loss": [s["loss"] for s in res.steps],
                       "scale": [s["scale"] for s in res.steps],
                       "skipped": [s["skipped"] for s in res.steps],
                       "val_steps": [e["step"] for e in res.evals],
                       "val_loss": [e["val_loss"] for e in res.evals]}
                   for r, res in results.items()},
    }
