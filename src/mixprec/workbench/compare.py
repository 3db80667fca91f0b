"""``mixprec compare``: train several recipes from the same seed and data and report.

Writes ``report.json`` (every number) and ``report.html`` (one self-contained file: inline
SVG charts, no network) to ``out``: loss curves, final validation loss against fp32,
tokens/s and speed-up, memory by category (``memory.measure``), the loss-scale trace and
skipped steps, and the doctor's findings for each recipe.

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
import html
import io
import json
import math
import platform
import time
import warnings
from collections.abc import Iterable
from pathlib import Path

import torch

from mixprec.diagnostics.findings import Finding
from mixprec.recipe import Recipe
from mixprec.workbench.train import TrainConfig, TrainResult, train

__all__ = ["compare", "DEFAULT_RECIPES", "SCENARIOS", "write_report"]

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


def compare(recipes: Iterable[str] | None = None, *, steps: int = 150, size: str = "medium",
            batch: int = 16, seq: int | None = None, lr: float = 3e-3, seed: int = 0,
            out: str | Path = "runs/compare", scenario: str | None = None,
            progress: bool | None = None, doctor_steps: int = 2) -> dict:
    """Run each recipe and write the report; returns the report dict.

    An entry is a recipe, a plan file (``*.json``) or ``plan`` (plan this model now):
    see the module docstring."""
    extra = {}
    story = None
    if scenario is not None:
        if scenario not in SCENARIOS:
            raise ValueError(f"scenario {scenario!r}; valid: {', '.join(SCENARIOS)}")
        sc = SCENARIOS[scenario]
        recipes = recipes or sc["recipes"]
        extra, story = sc["config"], sc["story"]
    entries = _entries(list(recipes or DEFAULT_RECIPES), size, batch, seq, seed)
    out = Path(out)
    results: dict[str, TrainResult] = {}
    walls = {}
    for label, (r, _) in entries.items():
        cfg = TrainConfig(recipe=r, steps=steps, size=size, batch=batch, seq=seq, lr=lr,
                          seed=seed, eval_every=max(1, steps // 6), ckpt_every=steps,
                          **extra)
        t = time.perf_counter()
        results[label] = train(cfg, out / _slug(label), progress=progress,
                               measure_memory=True)
        walls[label] = time.perf_counter() - t
    plans = {label: p for label, (_, p) in entries.items() if p is not None}
    findings = _doctor(results, doctor_steps, plans) if doctor_steps else {}
    report = _report_dict(results, walls, findings, scenario, story)
    for row in report["summary"]:
        label = row["recipe"]
        row["recipe_string"] = entries[label][0]
        if label in plans:
            row["plan"] = {"recipe": str(plans[label].recipe),
                           "rows": [dataclasses.asdict(x) for x in plans[label].rows],
                           "table": plans[label].table()}
    write_report(report, out)
    return report


def _entries(recipes: list[str], size, batch, seq, seed) -> dict:
    """``{label: (recipe string, plan or None)}``; every recipe is checked and every
    plan made or loaded before any training."""
    from mixprec.workbench.planning import resolve_entry

    out: dict = {}
    for entry in recipes:
        label, r, p = resolve_entry(entry, size=size, batch=batch, seq=seq, seed=seed)
        Recipe.coerce(r)  # fail before any training
        if label in out and label != entry:  # plan.json beside plan: the path labels it
            label = entry
        out[label] = (r, p)
    return out


def _slug(recipe: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in recipe)


def _doctor(results, steps, plans=None) -> dict:
    from mixprec.diagnostics import doctor
    from mixprec.workbench.data import load_corpus, sample_batch
    from mixprec.workbench.model import GPT, SIZES

    out = {}
    for r, res in results.items():
        cfg = res.config
        mcfg = dataclasses.replace(SIZES[cfg.size], seq_len=cfg.seq_len)
        corpus = load_corpus(max_bytes=200_000, seed=cfg.seed)
        g = torch.Generator().manual_seed(cfg.seed)
        data = [sample_batch(corpus.train, 4, cfg.seq_len, g) for _ in range(steps)]

        def factory(mcfg=mcfg):
            torch.manual_seed(0)
            return GPT(mcfg)

        def batch_fn(model, step, data=data, mult=cfg.loss_multiplier):
            x, y = data[step % len(data)]
            return model(x, y) * mult

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rep = doctor(factory, batch_fn, (plans or {}).get(r, cfg.recipe), steps=steps,
                         reference_steps=0)
        found = list(rep.findings) + slow_step_findings(r, results, rep.facts)
        out[r] = [dataclasses.asdict(f) for f in found]
    return out


#: a recipe whose training step takes longer than this many fp32 steps is flagged
SLOW_STEP = 2.0


def slow_step_findings(recipe: str, results: dict, facts: dict) -> list[Finding]:
    """A warning when ``recipe`` trained at under 1/``SLOW_STEP`` of fp32's tokens/s in
    the same comparison, with the cause: the kernels it ran on (the auto choices and
    the measured rates) and where the doctor's profile says its step's time goes."""
    base, res = results.get("fp32"), results[recipe]
    if base is None or recipe == "fp32" or not res.tokens_per_s:
        return []
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
            "speedup_vs_fp32": (res.tokens_per_s / base.tokens_per_s if base else None),
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
        "curves": {r: {"steps": [s["step"] for s in res.steps],
                       "loss": [s["loss"] for s in res.steps],
                       "scale": [s["scale"] for s in res.steps],
                       "skipped": [s["skipped"] for s in res.steps],
                       "val_steps": [e["step"] for e in res.evals],
                       "val_loss": [e["val_loss"] for e in res.evals]}
                   for r, res in results.items()},
    }


# --- the HTML report ---------------------------------------------------------------------

def _svg(fig) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]


def _charts(report: dict) -> dict[str, str]:
    """The report's charts as SVG strings: losses, throughput, memory, loss scale."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("the compare report draws with matplotlib: pip install "
                          "'mixprec[cli]' (or matplotlib)") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves, rows = report["curves"], report["summary"]

    def smooth(ys):  # trailing mean over ~1/30 of the run
        k = max(1, len(ys) // 30)
        return [sum(ys[max(0, i - k):i + 1]) / len(ys[max(0, i - k):i + 1])
                for i in range(len(ys))]

    def lines(x_key, y_of, ylabel, title, **style):
        fig, ax = plt.subplots(figsize=(7, 3.6))
        for r, c in curves.items():
            ax.plot(c[x_key], y_of(c), label=r, **style)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
        ax.set_title(title)
        return _svg(fig)

    return {
        "train_loss": lines("steps", lambda c: smooth(c["loss"]), "train loss (smoothed)",
                            "Training loss"),
        "val_loss": lines("val_steps", lambda c: c["val_loss"], "validation loss (fp32 eval)",
                          "Validation loss", marker="o"),
        "speed": _speed_chart(plt, rows),
        "memory": _memory_chart(plt, rows),
        "scale": _scale_chart(plt, curves),
    }


def _speed_chart(plt, rows: list[dict]) -> str:
    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = [r["recipe"] for r in rows]
    ax.bar(names, [r["tokens_per_s"] for r in rows], color="tab:blue")
    for i, r in enumerate(rows):
        if r["speedup_vs_fp32"]:
            ax.text(i, r["tokens_per_s"], f"{r['speedup_vs_fp32']:.2f}x", ha="center",
                    va="bottom", fontsize=8)
    ax.set_ylabel("tokens/s")
    ax.set_title("Throughput (median step, label: speed-up over fp32)")
    ax.tick_params(axis="x", labelsize=8)
    return _svg(fig)


def _memory_chart(plt, rows: list[dict]) -> str:
    fig, ax = plt.subplots(figsize=(7, 3.6))
    names = [r["recipe"] for r in rows]
    items = sorted({k for r in rows for k in r["memory_bytes"]})
    bottom = [0.0] * len(rows)
    for k in items:
        vals = [r["memory_bytes"].get(k, 0) / 2**20 for r in rows]
        ax.bar(names, vals, bottom=bottom, label=k)
        bottom = [a + b for a, b in zip(bottom, vals)]
    ax.set_ylabel("MiB (measured)")
    ax.set_title("Memory by category: model states and one forward's saved tensors")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    ax.tick_params(axis="x", labelsize=8)
    return _svg(fig)


def _scale_chart(plt, curves: dict) -> str:
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for r, c in curves.items():
        ax.plot(c["steps"], c["scale"], label=r)
        sk = [s for s, k in zip(c["steps"], c["skipped"]) if k]
        if sk:
            ax.scatter(sk, [c["scale"][c["steps"].index(s)] for s in sk], marker="x",
                       color="red", zorder=3)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale")
    ax.set_title("Loss scale (x: skipped steps)")
    ax.legend(fontsize=8)
    return _svg(fig)


def _share(v) -> str:
    return "–" if v is None else f"{v:.0%}"


def _fmt(v, pct=False, digits=4):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if pct:
        return f"{v * 100:+.2f}%"
    return f"{v:,.{digits}g}" if isinstance(v, float) else str(v)


def _plan_html(row: dict) -> str:
    """One plan entry's table: each Linear's format, states, predicted speed-up, SQNR,
    saved bytes and the reason, with the recipe it trained under."""
    p = row["plan"]
    head = "".join(f"<th>{h}</th>" for h in ("layer", "shape", "choice", "states",
                                             "speed-up", "SQNR dB", "saved MB", "reason"))
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in (
            x["layer"], "x".join(map(str, x["shape"])), x["choice"], x["states"],
            f"{x['speedup']:.2f}x", "–" if x["sqnr"] is None else f"{x['sqnr']:.1f}",
            f"{x['saved_bytes'] / 1e6:.2f}", x["reason"])) + "</tr>"
        for x in p["rows"])
    return (f"<h3>{html.escape(row['recipe'])}</h3><p><code>{html.escape(p['recipe'])}"
            f"</code></p><table class='plan'><tr>{head}</tr>{body}</table>")


def write_report(report: dict, out: str | Path) -> Path:
    """``out/report.json`` and the self-contained ``out/report.html``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    charts = _charts(report)
    rows = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in (
            r["recipe"], _fmt(r["final_val_loss"]), _fmt(r["val_loss_vs_fp32"], pct=True),
            f"{r['tokens_per_s']:,.0f}",
            _fmt(r["speedup_vs_fp32"], digits=3) + ("x" if r["speedup_vs_fp32"] else ""),
            f"{sum(r['memory_bytes'].values()) / 2**20:,.1f} MiB",
            _share(r.get("matmul_weights_low_precision")),
            r["skipped_steps"], "yes" if r["emulated"] else "no",
            f"{r['loss_first5']:.3f} → {r['loss_last5']:.3f}" +
            (" (NaN seen)" if r["nan_loss"] else ""))) + "</tr>"
        for r in report["summary"])
    finds = "".join(
        f"<li><b>{html.escape(r['recipe'])}</b>: " + (
            "<ul>" + "".join(f"<li class='{f['severity']}'>[{f['severity']}] "
                             f"{html.escape(f['title'])}<br><small>{html.escape(f['advice'])}"
                             "</small></li>" for f in r["findings"]) + "</ul>"
            if r["findings"] else "no findings") + "</li>"
        for r in report["summary"])
    story = (f"<p class='story'>{html.escape(report['story'])}</p>" if report.get("story")
             else "")
    cfg = html.escape(json.dumps(report["config"]))
    figs = "".join(f"<figure id='{k}'>{v}</figure>" for k, v in charts.items())
    plans = "".join(_plan_html(r) for r in report["summary"] if r.get("plan"))
    plans = f"<h2>Plans</h2><div id='plans'>{plans}</div>" if plans else ""
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>mixprec compare</title>
<style>
body{{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222}}
table{{border-collapse:collapse;font-size:14px}} td,th{{border:1px solid #ccc;padding:4px 8px;
text-align:right}} td:first-child{{text-align:left}} th{{background:#f3f3f3}}
.grid{{display:grid;grid-template-columns:1fr 1fr;gap:1em}} figure{{margin:0}}
figure svg{{width:100%;height:auto}} .story{{background:#fff7e0;padding:.6em;border-left:4px
solid #e0a800}} li.error{{color:#b00}} li.warning{{color:#a60}} small{{color:#555}}
</style></head><body>
<h1>mixprec compare{" — scenario " + html.escape(report["scenario"]) if report.get("scenario")
                    else ""}</h1>
{story}
<p>Workbench GPT on the built-in corpus (the Python standard library's source), same seed
and data for every recipe. Machine: {html.escape(report["machine"])}.<br>
<small>config: {cfg}</small></p>
<table id="summary"><tr><th>recipe</th><th>final val loss</th><th>vs fp32</th>
<th>tokens/s</th><th>speed-up</th><th>memory</th><th>low-precision matmul weights</th>
<th>skipped</th><th>emulated</th>
<th>train loss (first 5 → last 5)</th></tr>{rows}</table>
<div class="grid">{figs}</div>
{plans}
<h2>Doctor's findings</h2><ul id="findings">{finds}</ul>
</body></html>"""
    path = out / "report.html"
    path.write_text(page)
    return path
