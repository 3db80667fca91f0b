"""The experts' grouped GEMM on a GPU, one case per process, one JSON line per case.

    python benchmarks/gpu_grouped.py --device cuda --tokens 4096 --experts 8,64 \\
        --k 2048 --n 4096 --out gpu-results/bench.jsonl --budget 50
    python benchmarks/gpu_grouped.py --one 8:fp8-current:scaled_grouped --device cuda

The cases of ``benchmarks/grouped_gemm.py`` (its routing, one expert without tokens;
its checks), each in its own process, so a device-side assert (which poisons its
process's CUDA context) or a crash costs that case's line only. A case is an expert
count, a format and a route: ``E:bf16`` times ``torch._grouped_mm`` on bf16 operands
and the bf16 per-expert loop; ``E:FORMAT:ROUTE`` times the format's ``ROUTE`` and its
``loop`` route interleaved, and checks ROUTE's output and both gradients against the
loop's (``vs_loop``) and its output against float64 (``vs_fp64``). The parent lists
the cases in a child too (the routes that apply depend on the device), then runs them
one at a time, fastest-to-read first, and appends each line to ``--out`` as the case
ends; within ``--budget`` seconds (the cases it could not start: ``skipped`` lines).
``vs_bf16_grouped``: the case's time over the bf16 grouped GEMM's at the same expert
count. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import traceback


def _grouped_gemm():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import grouped_gemm

    return grouped_gemm


def case_names(args) -> list[str]:
    """Every case on ``args.device``: per expert count, the bf16 baselines, then each
    format's routes other than ``loop`` (its label says where a route falls back)."""
    gg = _grouped_gemm()
    names = []
    for e in args.experts:
        names.append(f"{e}:bf16")
        for fmt, label in gg._cases(args.formats, args.device, args.k, args.n):
            if fmt != "bf16" and label != "loop":
                names.append(f"{e}:{fmt}:{label.split('->')[0]}")
    return names


def run_case(name: str, args) -> dict:
    """One case in this process: its line (``status`` ok or error)."""
    import torch

    gg = _grouped_gemm()
    parts = name.split(":")
    experts, fmt = int(parts[0]), parts[1]
    line = {"bench": "grouped_gemm", "case": name, "format": fmt, "experts": experts,
            "tokens": args.tokens, "k": args.k, "n": args.n, "device": args.device}
    t0 = time.perf_counter()
    try:
        x, w, offs = gg._operands(args, experts, args.device)
        ref64 = torch.zeros(args.tokens, args.n, dtype=torch.float64, device=args.device)
        start = 0
        for e, end in enumerate(offs.tolist()):
            ref64[start:end] = x[start:end].double() @ w[e].double().t()
            start = end
        cases = gg._cases([] if fmt == "bf16" else [fmt], args.device, args.k, args.n)
        if fmt == "bf16":
            mine, loop = ("bf16", "torch._grouped_mm"), ("bf16", "loop")
        else:
            mine = next(c for c in cases if c[0] == fmt and c[1].split("->")[0] == parts[2])
            loop = (fmt, "loop")
        line["route"] = mine[1]
        ref = cases[loop][1](x, w, offs)
        out = cases[mine][1](x, w, offs)
        gg._sync(args.device)
        line.update(vs_fp64=gg._rel(out[0].double(), ref64),
                    vs_loop=max(map(gg._rel, out, ref)) if fmt != "bf16" else None)
        times = {mine: [], loop: []}
        for i in range(args.repeats):
            for c in (mine, loop) if i % 2 == 0 else (loop, mine):
                gg._sync(args.device)
                t = time.perf_counter()
                cases[c][0](x, w, offs)
                gg._sync(args.device)
                times[c].append(time.perf_counter() - t)
        flops = 3 * 2 * args.tokens * args.k * args.n
        ms = statistics.median(times[mine])
        line.update(status="ok", ms=ms * 1e3, tflops=flops / ms / 1e12,
                    loop_ms=statistics.median(times[loop]) * 1e3)
    except Exception as e:
        line.update(status="error", error=f"{type(e).__name__}: {e}"[:1000],
                    traceback=traceback.format_exc()[-2000:])
    line["seconds"] = round(time.perf_counter() - t0, 2)
    return line


def _child_line(name: str, proc: subprocess.CompletedProcess) -> dict:
    """The child's JSON line, or an error line with its exit code and stderr's tail."""
    for text in reversed(proc.stdout.splitlines()):
        if text.startswith("{"):
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                break
    rc = proc.returncode
    why = f"exit {rc}" + (f" ({signal.Signals(-rc).name})" if rc < 0 else "")
    return {"bench": "grouped_gemm", "case": name, "status": "error",
            "error": f"the case's process died: {why}", "stderr": proc.stderr[-2000:]}


def run_all(args, argv: list[str]) -> int:
    """List the cases in a child, then run each in its own, within ``args.budget``;
    one line per case to ``args.out`` (and stdout) as each ends."""
    end = time.monotonic() + args.budget
    me = [sys.executable, os.path.abspath(__file__), *argv]
    base: dict[int, float] = {}
    failed = False

    def emit(line: dict) -> None:
        nonlocal failed
        failed |= line.get("status") == "error"
        e = line.get("experts")
        if line.get("format") == "bf16" and "ms" in line:
            base[e] = line["ms"]
        if "ms" in line and e in base:
            line["vs_bf16_grouped"] = line["ms"] / base[e]
        text = json.dumps(line, default=str)
        print(text, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(text + "\n")

    todo: list[str] = []
    try:
        listed = subprocess.run([*me, "--list"], capture_output=True, text=True,
                                timeout=max(1.0, end - time.monotonic()))
        todo = [x for x in listed.stdout.splitlines() if x.count(":") >= 1]
        if listed.returncode or not todo:
            emit({"bench": "grouped_gemm", "case": "list", "status": "error",
                  "error": f"listing the cases failed: exit {listed.returncode}",
                  "stderr": listed.stderr[-2000:]})
        while todo:
            name = todo[0]
            left = end - time.monotonic()
            if left < 2:
                break
            try:
                proc = subprocess.run([*me, "--one", name], capture_output=True, text=True,
                                      timeout=min(args.timeout, left))
                line = _child_line(name, proc)
            except subprocess.TimeoutExpired as e:
                line = {"bench": "grouped_gemm", "case": name, "status": "error",
                        "error": f"timed out after {e.timeout:.0f} s"}
            todo.pop(0)
            emit({"experts": int(name.split(":")[0]), "format": name.split(":")[1], **line})
        reason = f"not run: the budget of {args.budget:.0f} s ended"
    except (KeyboardInterrupt, subprocess.TimeoutExpired):
        reason = "not run: the step's time box ended"
        if todo:
            emit({"bench": "grouped_gemm", "case": todo.pop(0), "status": "error",
                  "error": "interrupted: the step's time box ended"})
    for name in todo:
        emit({"bench": "grouped_gemm", "case": name, "status": "skipped", "reason": reason})
    return 1 if failed else 0


def _interrupted(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--experts", default="8", help="expert counts, comma-separated")
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--formats", default="fp8-current,fp8-rowwise,mxfp8,fp8-block,nvfp4,fp8")
    ap.add_argument("--budget", type=float, default=50.0, help="seconds for every case")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds per case")
    ap.add_argument("--out", help="append one JSON line per case to this file")
    ap.add_argument("--list", action="store_true", help="print the cases, one a line")
    ap.add_argument("--one", help="run this one case here and print its line")
    args = ap.parse_args(argv)
    args.experts = [int(e) for e in args.experts.split(",") if e]
    args.formats = [f for f in args.formats.split(",") if f]
    if args.list:
        print("\n".join(case_names(args)))
        return 0
    if args.one:
        print(json.dumps(run_case(args.one, args), default=str), flush=True)
        return 0
    signal.signal(signal.SIGTERM, _interrupted)
    return run_all(args, _without(argv, ("--out", "--budget", "--timeout")))


def _without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """``argv`` less each of ``flags`` and its value (``--flag v`` or ``--flag=v``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        elif not a.startswith(tuple(f + "=" for f in flags)):
            out.append(a)
    return out


if __name__ == "__main__":
    sys.exit(main())
