"""The GPU run's results as Markdown tables, ready for docs/benchmarks.md.

    python benchmarks/gpu_tables.py gpu-results > gpu-results/tables.md

Reads ``bench.jsonl`` and ``preflight.jsonl`` in the results folder that
``benchmarks/gpu.sh`` wrote (it runs this at its end: ``tables.md``) and prints one
table per kind of line: the GEMM table, the GPT per recipe (eager), the Qwen3-MoE
steps, the grouped GEMM cases, the compiled steps, and the preflight's checks that did
not pass. Lines that are not JSON, and fields a line lacks, are left out; it imports
no torch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _lines(path: Path) -> list[dict]:
    out = []
    for text in path.read_text().splitlines() if path.exists() else ():
        try:
            out.append(json.loads(text))
        except json.JSONDecodeError:
            continue
    return out


def _f(v, fmt: str = ".2f", suffix: str = "") -> str:
    return "–" if not isinstance(v, (int, float)) else f"{v:{fmt}}{suffix}"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(r) + " |" for r in rows), ""]


def _why(x: dict) -> str:
    return str(x.get("error") or x.get("reason") or x.get("status"))[:160].replace("|", "/")


def tables(folder: Path) -> list[str]:
    """Every table of the run in ``folder``, as Markdown lines."""
    lines = _lines(folder / "bench.jsonl")
    out: list[str] = []
    gemm = [x for x in lines if x.get("bench") == "gemm"]
    if gemm:
        out += ["## GEMMs: each format's forward GEMM against bf16 `torch.mm`", ""]
        out += _table(["M×K×N", "format", "route", "GEMM (ms)", "TFLOP/s",
                       "with casts (ms)", "TFLOP/s", "vs bf16 (time)", "vs fp64"],
                      [[f"{x['m']}×{x['k']}×{x['n']}", x["format"], str(x.get("route")),
                        _f(x.get("gemm_ms"), ".3f"), _f(x.get("gemm_tflops"), ".3g"),
                        _f(x.get("with_casts_ms"), ".3f"),
                        _f(x.get("with_casts_tflops"), ".3g"), _f(x.get("vs_bf16"), ".2f", "x"),
                        _f(x.get("vs_fp64"), ".1e")] if x.get("status") == "ok" else
                       [f"{x['m']}×{x['k']}×{x['n']}", x["format"], _why(x), *["–"] * 6]
                       for x in gemm])
    steps = [x for x in lines if "recipe" in x and "bench" not in x]
    for title, pick in (("Workbench GPT, eager", lambda x: x.get("model") == "gpt"
                         and not x.get("compile")),
                        ("Qwen3-MoE (config-built), eager", lambda x: x.get("model") ==
                         "qwen3_moe" and not x.get("compile")),
                        ("Compiled against eager", lambda x: x.get("compile")),
                        ("Steps without a line of their own", lambda x: "model" not in x)):
        rows = [x for x in steps if pick(x)]
        if not rows:
            continue
        out += [f"## {title}", ""]
        out += _table(["recipe", "model", "step (ms)", "compiled (ms)", "tokens/s", "MFU",
                       "peak (GB)", "routes", "status"],
                      [[x["recipe"], str(x.get("model", x.get("step", "–"))),
                        _f(x.get("step_ms"), ".1f"), _f(x.get("compiled_step_ms"), ".1f"),
                        _f(x.get("tokens_per_s"), ".0f"), _f(x.get("mfu"), ".1%"),
                        _f((x.get("max_memory_allocated") or 0) / 1e9 or None, ".1f"),
                        json.dumps(x.get("fp8_routes") or x.get("experts_formats") or {}
                                   ).replace("|", "/"),
                        "ok" if x.get("status") == "ok" else _why(x)] for x in rows])
    grouped = [x for x in lines if x.get("bench") == "grouped_gemm"]
    if grouped:
        out += ["## Grouped GEMM (forward + dgrad + wgrad), one process per case", ""]
        out += _table(["case", "route", "ms", "TFLOP/s", "loop (ms)", "vs bf16 grouped",
                       "vs loop", "vs fp64", "status"],
                      [[str(x.get("case")), str(x.get("route", "–")), _f(x.get("ms")),
                        _f(x.get("tflops"), ".3g"), _f(x.get("loop_ms")),
                        _f(x.get("vs_bf16_grouped"), ".2f", "x"),
                        _f(x.get("vs_loop"), ".1e"), _f(x.get("vs_fp64"), ".1e"),
                        "ok" if x.get("status") == "ok" else _why(x)] for x in grouped])
    bad = [x for x in _lines(folder / "preflight.jsonl") if x.get("status") != "ok"]
    if bad:
        out += ["## Preflight checks that did not pass", ""]
        out += _table(["check", "status", "why"],
                      [[x.get("check", "?"), str(x.get("status")), _why(x)] for x in bad])
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: gpu_tables.py RESULTS_FOLDER", file=sys.stderr)
        return 2
    print("\n".join(tables(Path(argv[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
