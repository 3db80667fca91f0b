"""The ``mixprec compare`` report as one self-contained HTML page (inline SVG charts, no
network): the summary table, loss curves, throughput, memory, the loss scale, the plans
and the doctor's findings; ``write_report`` writes it beside ``report.json``."""

from __future__ import annotations

import html
import io
import json
import math
from pathlib import Path

__all__ = ["write_report"]

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


def _speedup(row: dict, report: dict) -> str:
    """The speed-up cell: the figure, "noisy" where the steps behind it disagree
    (``report["timing_noise"]`` says by how much), "–" without an fp32 row."""
    if row["speedup_vs_fp32"] is not None:
        return f"{row['speedup_vs_fp32']:.3g}x"
    return "noisy" if report.get("timing_noise") and any(
        x["recipe"] == "fp32" for x in report["summary"]) else "–"


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
            _speedup(r, report),
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
    if report.get("interrupted"):
        story += (f"<p class='story' id='interrupted'>Interrupted during "
                  f"{html.escape(report['interrupted'])}: the recipes below finished; "
                  "the rest did not run.</p>")
    noise = "".join(f"<li>{html.escape(n)}</li>" for n in report.get("timing_noise", []))
    noise = (f"<div class='story' id='timing-noise'>Timings disagree, so no speed-up is "
             f"given from them (rerun on an idle machine):<ul>{noise}</ul></div>"
             if noise else "")
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
{noise}
<div class="grid">{figs}</div>
{plans}
<h2>Doctor's findings</h2><ul id="findings">{finds}</ul>
</body></html>"""
    path = out / "report.html"
    path.write_text(page)
    return path
