"""The experts' grouped GEMM per route and format, forward + backward, on one device.

    python benchmarks/grouped_gemm.py [--device cpu] [--tokens 2048] [--experts 8]
                                      [--k 512] [--n 1024] [--repeats 5]
                                      [--formats fp8,mxfp8] [--out results.jsonl]

Tokens are routed to the experts unevenly (one expert gets none). Baselines: the bf16
grouped GEMM (``torch._grouped_mm`` on bf16 operands) and a bf16 per-expert loop of
``torch.mm``; then ``mixprec.experts.grouped_mm`` for each linear format on its
``loop`` route (the exact reference), its ``grouped`` route and, where the format and
device allow it (``scaled_grouped_applies``: CUDA compute capability 9.x or 10.x,
per-tensor or rowwise e4m3),
its ``scaled_grouped`` route. The ``route`` column is the route that ran (a block
format's ``grouped`` on a GPU runs the loop). Each case's output and both gradients are
checked against the loop route of its format (``vs loop``: the largest of the three
max-abs-error / max-abs ratios) and its output against the float64 product (``vs
fp64``); each call starts from the format's initial scaling state, and a format that
rounds gradients stochastically (NVFP4) is checked in its round-to-nearest twin (the
routes draw their random numbers differently: the loop from a generator per expert,
the grouped route by place in one stream) and timed as it is. A case that
raises prints its error and the others go on. Every case runs in turn, round-robin,
and the table reports the median over the rounds, so a noisy neighbour hits every case
alike. ``--out`` appends one JSON line per case (``"bench": "grouped_gemm"``). Timings
are never asserted anywhere: on a shared host they are noisy.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import warnings

import torch

from mixprec.experts import ExpertsFormat, grouped_mm
from mixprec.experts.grouped import _route
from mixprec.experts.scaled_grouped import scaled_grouped_applies

FORMATS = ["fp8", "fp8-current", "fp8-rowwise", "fp8-block", "mxfp8", "nvfp4"]


def _grads(y, x, w):
    y.float().sum().backward()
    return y.detach().float(), x.grad.float(), w.grad.float()


def _bf16_grouped(x, w, offs):
    x, w = x.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    return _grads(torch._grouped_mm(x, w.transpose(1, 2), offs=offs), x, w)


def _bf16_loop(x, w, offs):
    x, w = x.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    start, outs = 0, []
    for e, end in enumerate(offs.tolist()):
        outs.append(x[start:end] @ w[e].t())
        start = end
    outs.append(x.new_zeros(x.shape[0] - start, w.shape[1]))
    return _grads(torch.cat(outs), x, w)


def _mixprec(fmt, route):
    initial = {k: v.clone() for k, v in fmt.state_dict().items()}

    def run(x, w, offs):  # from the same scaling state and rounding stream each call
        fmt.load_state_dict(initial)
        x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
        return _grads(grouped_mm(x, w, offs, fmt, route=route, out_dtype=torch.bfloat16),
                      x, w)
    return run


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _operands(args, experts: int, device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, args.k, generator=g)
    w = torch.randn(experts, args.n, args.k, generator=g) / args.k ** 0.5
    share = torch.rand(experts, generator=g)
    share[1] = 0  # an expert without tokens
    counts = (share / share.sum() * args.tokens).floor().long()
    counts[0] += args.tokens - counts.sum()
    return x.to(device), w.to(device), counts.cumsum(0).to(torch.int32).to(device)


def _cases(formats, device, k, n):
    cases = {("bf16", "torch._grouped_mm"): (_bf16_grouped,) * 2,
             ("bf16", "loop"): (_bf16_loop,) * 2}
    for name in formats:
        fmt = ExpertsFormat(name, device=device)
        routes = ["loop", "grouped"]
        if scaled_grouped_applies(fmt, device, k, n):
            routes.append("scaled_grouped")
        twin = (ExpertsFormat(f"{name},nvfp4_sr=false", device=device)
                if fmt.quantizer.stochastic_grads else fmt)
        for route in routes:
            with warnings.catch_warnings():  # the label says what ran instead
                warnings.simplefilter("ignore")
                ran = _route(route, fmt, device, k, n)
            label = route if ran == route else f"{route}->{ran}"
            cases[(name, label)] = (_mixprec(fmt, route), _mixprec(twin, route))
    return cases


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def bench(args, experts: int) -> list[dict]:
    """Every case at ``experts`` experts: its check against the loop route and float64,
    and its median time; a case that raises gets its error instead."""
    x, w, offs = _operands(args, experts, args.device)
    ref64 = torch.zeros(args.tokens, args.n, dtype=torch.float64, device=args.device)
    start = 0
    for e, end in enumerate(offs.tolist()):
        ref64[start:end] = x[start:end].double() @ w[e].double().t()
        start = end
    cases, rows, loops = _cases(args.formats, args.device, args.k, args.n), {}, {}
    for (name, route), (_, fn) in cases.items():  # the checks, and the first-call costs
        row = {"bench": "grouped_gemm", "format": name, "route": route, "experts": experts,
               "tokens": args.tokens, "k": args.k, "n": args.n, "device": args.device}
        try:
            out = fn(x, w, offs)
            _sync(args.device)
            if route == "loop":
                loops[name] = out
            ref = loops.get(name if name != "bf16" else None)
            row.update(status="ok", vs_fp64=_rel(out[0].double(), ref64),
                       vs_loop=max(map(_rel, out, ref)) if ref else None)
        except Exception as e:  # one failing route prints and the others go on
            row.update(status="error", error=f"{type(e).__name__}: {e}"[:500])
        rows[(name, route)] = row
    times: dict = {c: [] for c in cases if rows[c]["status"] == "ok"}
    for _ in range(args.repeats):
        for c in times:
            try:
                _sync(args.device)
                t = time.perf_counter()
                cases[c][0](x, w, offs)
                _sync(args.device)
                times[c].append(time.perf_counter() - t)
            except Exception as e:
                rows[c].update(status="error", error=f"{type(e).__name__}: {e}"[:500])
    flops = 3 * 2 * args.tokens * args.k * args.n  # forward, dgrad, wgrad
    base = statistics.median(times.get(("bf16", "torch._grouped_mm")) or [float("nan")])
    for c, ts in times.items():
        if ts and rows[c]["status"] == "ok":
            t = statistics.median(ts)
            rows[c].update(ms=t * 1e3, tflops=flops / t / 1e12, vs_bf16_grouped=t / base)
    return list(rows.values())


def _print(rows: list[dict]) -> None:
    print(f"| {'format':<12} | {'route':<24} | {'ms':>8} | {'TFLOP/s':>8} | "
          f"{'vs bf16 grouped':>15} | {'vs loop':>8} | {'vs fp64':>8} |")
    print(f"|{'-' * 14}|{'-' * 26}|{'-' * 10}|{'-' * 10}|{'-' * 17}|{'-' * 10}|{'-' * 10}|")
    for r in rows:
        if r["status"] != "ok":
            print(f"| {r['format']:<12} | {r['route']:<24} | error: {r['error']}")
            continue
        ms = f"{r['ms']:>8.2f} | {r['tflops']:>8.3f} | {r['vs_bf16_grouped']:>14.2f}x" \
            if "ms" in r else f"{'':>8} | {'':>8} | {'':>15}"
        loop = f"{r['vs_loop']:>8.1e}" if r["vs_loop"] is not None else f"{'':>8}"
        print(f"| {r['format']:<12} | {r['route']:<24} | {ms} | {loop} | "
              f"{r['vs_fp64']:>8.1e} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--experts", default="8", help="expert counts, comma-separated")
    ap.add_argument("--k", type=int, default=512)
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--out", default=None, help="append one JSON line per case")
    args = ap.parse_args()
    args.formats = [f for f in args.formats.split(",") if f]
    dev = torch.device(args.device)
    where = (torch.cuda.get_device_name(dev) if dev.type == "cuda"
             else platform.processor() or platform.machine())
    for experts in map(int, args.experts.split(",")):
        print(f"# grouped GEMM fwd+bwd: {args.tokens} tokens, {experts} experts, "
              f"K={args.k}, N={args.n}; median of {args.repeats}; torch "
              f"{torch.__version__}, {torch.get_num_threads()} threads, {where}")
        rows = bench(args, experts)
        _print(rows)
        if args.out:
            with open(args.out, "a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
