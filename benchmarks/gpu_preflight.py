"""Preflight of a lent GPU: what its kernels do before anything is timed on them.

    python benchmarks/gpu_preflight.py --device cuda --out gpu-results/preflight.jsonl
    python benchmarks/gpu_preflight.py --one block:fwd:bf16:M=30 --device cuda

Each check runs in its own process (``--one``), several at a time, so a kernel that
leaves a sticky CUDA error (an illegal address poisons its process's context) costs
that check only. The parent imports no torch; it writes one JSON line per check as
each ends (``status``: ``ok``, ``error`` with the message, or ``skipped`` with the
reason) and keeps within ``--budget`` seconds, marking what it had to cut.

- ``env``: capability, versions, and the fp32 matmul precision state (each knob read
  on its own: a legacy read raises once the new API set it);
- ``fp8:{tensorwise,rowwise}:{bf16,fp32}:M=..``: ``torch._scaled_mm`` through
  ``mixprec.formats.tensor_gemm`` on odd shapes (K=200, N=136: both padded to 16);
- ``{block,mx,nvfp4}:{fwd,dgrad,wgrad}:{bf16,fp32}:M=..``: each block-scaled pair on
  ``mixprec.formats.scaled_mm.block_scaled_mm`` (1x128 x 128x128 fp8; MX e8m0 1x32;
  NVFP4) at M tokens, against mixprec's dequantized operands multiplied in float64;
- ``probe:{block,mx,nvfp4}``: the route ``fp8_gemm=auto`` takes (the probe) and its
  warnings; ``engine:{fp8-block,mxfp8,nvfp4}``: ``engine.kernels`` and the route each
  fp8 Linear took after one training step of a small GPT;
- ``tf32-legacy:{allow_tf32,high}``: one mxfp8 Linear forward and backward after the
  user set TF32 through the legacy API, its forward against float64, and whether the
  user's setting is the same afterwards.

On a CPU (``--device cpu``, ``benchmarks/gpu.sh --dry-run``) the CUDA-only checks, and
the engine checks that would repeat ``engine:mxfp8``'s route there, are recorded as
skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
import warnings

#: K and N of the GEMM checks: neither a multiple of 16, 32 nor 128, so every padding
#: path runs
K, N = 200, 136
BLOCK_RECIPES = {"block": "fp8-block", "mx": "mxfp8", "nvfp4": "nvfp4"}
CUDA_ONLY = ("fp8", "block", "mx", "nvfp4", "probe")
#: checks a CPU run leaves out, and why
CPU_SKIP = {f"engine:{r}": "skipped: off CUDA every block scaling takes the dequantizing "
                           "route, which engine:mxfp8 runs" for r in ("fp8-block", "nvfp4")}


def checks() -> list[str]:
    """Every check's name, the most telling first (a cut budget drops the tail)."""
    names = ["env", *(f"probe:{k}" for k in BLOCK_RECIPES),
             *(f"engine:{r}" for r in BLOCK_RECIPES.values()),
             "tf32-legacy:allow_tf32", "tf32-legacy:high"]
    for m in (30, 1, 200):
        names += [f"{k}:fwd:{o}:M={m}" for k in BLOCK_RECIPES for o in ("bf16", "fp32")]
        names += [f"fp8:{s}:{o}:M={m}" for s in ("tensorwise", "rowwise")
                  for o in ("bf16", "fp32")]
    names += [f"{k}:dgrad:bf16:M=30" for k in BLOCK_RECIPES]
    names += [f"{k}:wgrad:fp32:M={m}" for m in (30, 200) for k in BLOCK_RECIPES]
    names += [f"{k}:fwd:{o}:M=16384" for k in BLOCK_RECIPES for o in ("bf16", "fp32")]
    return names


# ---- the checks (run in a child) -------------------------------------------------


def _precision_state() -> dict:
    """Every fp32 matmul precision knob, each read on its own."""
    import torch

    reads = {"float32_matmul_precision": torch.get_float32_matmul_precision,
             "cuda.matmul.fp32_precision": lambda: torch.backends.cuda.matmul.fp32_precision,
             "cuda.matmul.allow_tf32": lambda: torch.backends.cuda.matmul.allow_tf32,
             "cudnn.allow_tf32": lambda: torch.backends.cudnn.allow_tf32,
             "mkldnn.matmul.fp32_precision":
                 lambda: torch.backends.mkldnn.matmul.fp32_precision,
             "fp32_precision": lambda: torch.backends.fp32_precision}
    out = {}
    for name, read in reads.items():
        try:
            out[name] = read()
        except Exception as e:
            out[name] = f"raises {type(e).__name__}: {str(e)[:200]}"
    return out


def _env(device: str) -> dict:
    import importlib.metadata as md
    import platform

    import torch

    import mixprec

    out = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "mixprec": mixprec.__version__,
           "cuda_available": torch.cuda.is_available(),
           "fp32_precision_state": _precision_state()}
    for pkg in ("transformers", "triton", "numpy", "accelerate", "torchao", "lightning"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out.update(device=p.name, capability=list(torch.cuda.get_device_capability()),
                   sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1),
                   cudnn=torch.backends.cudnn.version(),
                   float8_types=[d for d in ("float8_e8m0fnu", "float4_e2m1fn_x2")
                                 if hasattr(torch, d)])
    else:
        out["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return out


def _rel(got, want) -> dict:
    """Relative Frobenius error and the largest error over the largest |want|."""
    got, want = got.double(), want.double()
    err = (got - want)
    return {"rel_err": (err.norm() / want.norm().clamp_min(1e-300)).item(),
            "max_err_over_max": (err.abs().amax() / want.abs().amax().clamp_min(1e-300)
                                 ).item(),
            "finite": bool(got.isfinite().all())}


def _operands(m: int, device: str):
    import torch

    g = torch.Generator(device).manual_seed(0)
    return (torch.randn(m, K, device=device, generator=g),
            torch.randn(N, K, device=device, generator=g),
            torch.randn(m, N, device=device, generator=g))


def _fp8_pair(scaling: str, out: str, m: int, device: str) -> dict:
    """x (M, K) @ wᵀ on ``torch._scaled_mm`` (mixprec's padding and scales) against
    the same fp8 operands dequantized and multiplied in float64."""
    import torch

    from mixprec.recipe.linear_format import quantizer_for

    q = quantizer_for("fp8-current" if scaling == "tensorwise" else "fp8-rowwise")
    x, w, _ = _operands(m, device)
    xq, wq = q.cast(x, "input", 1, {}), q.cast(w, "weight", 1, {}).t()
    y = q.mm(xq, wq, getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}[out]),
             "scaled_mm")
    want = (xq.codes.double() * xq.inv.double()) @ (wq.codes.double() * wq.inv.double())
    return {"shape": [m, K, N], "out_dtype": str(y.dtype), **_rel(y, want)}


def _block_pair(kind: str, gemm: str, out: str, m: int, device: str) -> dict:
    """One GEMM of a Linear on the block-scaled kernel (forward x @ wᵀ, dgrad g @ w,
    wgrad gᵀ @ x over M tokens), against the dequantized operands in float64."""
    import torch

    from mixprec.formats.scaled_mm import block_scaled_mm
    from mixprec.recipe.linear_format import quantizer_for

    q = quantizer_for(BLOCK_RECIPES[kind])
    x, w, gy = _operands(m, device)
    if gemm == "fwd":
        a, b = q.cast(x, "input", 1, {}), q.cast(w, "weight", 1, {}).t()
    elif gemm == "dgrad":
        a, b = q.cast(gy, "grad_output", 1, {}), q.cast(w, "weight", 0, {})
    else:
        a, b = q.cast(gy, "grad_output", 0, {}).t(), q.cast(x, "input", 0, {})
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[out]
    want = a.dequant().double() @ b.dequant().double()
    y = block_scaled_mm(a, b, dt, q.kernel)
    if device == "cuda":
        torch.cuda.synchronize()
    return {"shape": [a.codes.shape[0], a.codes.shape[1], b.codes.shape[1]],
            "out_dtype": str(y.dtype), **_rel(y, want)}


def _probe(kind: str, device: str) -> dict:
    """The route ``fp8_gemm=auto`` takes for ``kind`` here, the probe's verdict, and
    why (their warnings)."""
    import torch

    from mixprec.formats.route import kernel_missing
    from mixprec.recipe.linear_format import quantizer_for

    q = quantizer_for(BLOCK_RECIPES[kind])
    out = {"capability": (list(torch.cuda.get_device_capability())
                          if torch.cuda.is_available() else None)}
    try:  # the capability rule alone: None where the kernel may run here
        out["kernel_missing"] = kernel_missing(device, q)
    except Exception as e:
        out["kernel_missing"] = f"raises {type(e).__name__}: {e}"
    t = time.perf_counter()
    out["route"] = q.route(device, "auto")
    out["route_seconds"] = round(time.perf_counter() - t, 3)
    try:  # the probe's own verdict, also where the route did not ask it
        from mixprec.formats import scaled_mm

        out["probe_accepts"] = scaled_mm._probe(device, q)
    except Exception as e:
        out["probe_accepts"] = f"raises {type(e).__name__}: {str(e)[:300]}"
    return out


def _engine(recipe: str, device: str) -> dict:
    """``engine.kernels`` and each fp8 Linear's route, before and after one step of a
    2-layer d=256 GPT."""
    import torch

    from mixprec import MixedPrecision
    from mixprec.modules.linear import fp8_modules
    from mixprec.optim import adamw_for
    from mixprec.workbench import GPT, GPTConfig

    def routes(model) -> dict:
        out: dict[str, int] = {}
        for lin in fp8_modules(model).values():
            out[lin.backend] = out.get(lin.backend, 0) + 1
        return out

    torch.manual_seed(0)
    with torch.device(device):
        m = GPT(GPTConfig(vocab=256, seq_len=64, n_layers=2, d_model=256, n_heads=4))
    e = MixedPrecision(m, adamw_for(recipe, m.parameters()), recipe)
    before = {"kernels": e.kernels.as_dict(), "fp8_routes": routes(m)}
    idx = torch.randint(0, 256, (4, 65), device=device)
    with e.autocast():
        loss = m(idx[:, :-1], idx[:, 1:])
    e.backward(loss)
    e.step()
    return {"before_step": before, "kernels": e.kernels.as_dict(),
            "describe": e.kernels.describe(), "fp8_routes": routes(m),
            "loss": loss.item()}


def _tf32_legacy(how: str, device: str) -> dict:
    """One mxfp8 Linear forward and backward after TF32 was set the legacy way, then
    a plain fp32 matmul (a new cuBLAS handle sees the settings)."""
    import torch
    from torch import nn

    from mixprec.modules.linear import Float8Linear
    from mixprec.recipe.linear_format import quantizer_for

    if how == "allow_tf32":
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        torch.set_float32_matmul_precision("high")
    before = _precision_state()
    torch.manual_seed(0)
    lin = Float8Linear.from_linear(nn.Linear(256, 256, device=device), "mxfp8")
    x = torch.randn(30, 256, device=device, requires_grad=True)
    y = lin(x)
    y.square().mean().backward()
    a = torch.randn(64, 64, device=device)
    torch.mm(a, a).sum().item()
    q = quantizer_for("mxfp8")
    want = (q.cast(x.detach(), "input", 1, {}).dequant().double()
            @ q.cast(lin.weight.detach(), "weight", 1, {}).dequant().double().t())
    after = _precision_state()
    return {"route": lin.backend, "forward_vs_float64": _rel(y.detach() - lin.bias, want),
            "grads_finite": bool(x.grad.isfinite().all() and lin.weight.grad.isfinite().all()),
            "state_before": before, "state_after": after, "restored": before == after}


def run_check(name: str, device: str) -> dict:
    """Run check ``name`` in this process: its line (``status`` ok or error)."""
    parts = name.split(":")
    line: dict = {"check": name, "device": device}
    t = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if parts[0] == "env":
                line.update(_env(device))
            elif parts[0] == "fp8":
                line.update(_fp8_pair(parts[1], parts[2], int(parts[3][2:]), device))
            elif parts[0] in BLOCK_RECIPES:
                line.update(_block_pair(parts[0], parts[1], parts[2], int(parts[3][2:]),
                                        device))
            elif parts[0] == "probe":
                line.update(_probe(parts[1], device))
            elif parts[0] == "engine":
                line.update(_engine(parts[1], device))
            elif parts[0] == "tf32-legacy":
                line.update(_tf32_legacy(parts[1], device))
            else:
                raise ValueError(f"check {name!r}; valid: {', '.join(checks())}")
            line["status"] = "ok"
        except Exception as e:
            line.update(status="error", error=f"{type(e).__name__}: {e}"[:2000],
                        traceback=traceback.format_exc()[-2000:])
    line["warnings"] = sorted({f"{w.category.__name__}: {w.message}"[:500]
                               for w in caught})[:10]
    line["seconds"] = round(time.perf_counter() - t, 3)
    return line


# ---- the parent ------------------------------------------------------------------


def _child_line(name: str, rc: int, out: str, err: str) -> dict:
    """The child's JSON line, or an error line with its exit code and stderr's tail."""
    for text in reversed(out.splitlines()):
        if text.startswith("{"):
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                break
    why = f"exit {rc}" + (f" ({signal.Signals(-rc).name})" if rc < 0 else "")
    return {"check": name, "status": "error", "error": f"the check's process died: {why}",
            "stderr": err[-2000:]}


def run_all(device: str, out_path: str | None, budget: float, jobs: int,
            timeout: float, only: list[str] | None = None) -> int:
    """Every check, ``jobs`` processes at a time, within ``budget`` seconds; one line per
    check to ``out_path`` (and stdout) as each ends. Returns 0, or 1 where one errored."""
    end = time.monotonic() + budget
    todo = list(only or checks())
    running: dict[str, tuple[subprocess.Popen, float, object, object]] = {}
    sink = open(out_path, "a") if out_path else None
    failed = False

    def emit(line: dict) -> None:
        nonlocal failed
        failed |= line.get("status") == "error"
        text = json.dumps(line, default=str)
        print(text, flush=True)
        if sink:
            sink.write(text + "\n")
            sink.flush()

    def reap(name: str, why: str | None = None) -> None:
        proc, _, fo, fe = running.pop(name)
        if why:
            proc.kill()
        proc.wait()
        fo.seek(0)
        fe.seek(0)
        out, err = fo.read(), fe.read()
        fo.close()
        fe.close()
        line = _child_line(name, proc.returncode, out, err)
        if why:
            line = {"check": name, "status": "error", "error": why, "stderr": err[-2000:]}
        emit(line)

    import tempfile

    if device != "cuda":
        for name in list(todo):
            why = ("skipped: no CUDA" if name.split(":")[0] in CUDA_ONLY else
                   CPU_SKIP.get(name))
            if why:
                emit({"check": name, "status": "skipped", "reason": f"{why} (device {device})"})
                todo.remove(name)
    try:
        while todo or running:
            now = time.monotonic()
            for name, (proc, t0, _, _) in list(running.items()):
                if proc.poll() is not None:
                    reap(name)
                elif now > min(t0 + timeout, end):
                    reap(name, f"timed out after {now - t0:.0f} s (per-check limit "
                               f"{timeout:.0f} s, preflight budget {budget:.0f} s)")
            while todo and len(running) < jobs and time.monotonic() < end:
                name = todo.pop(0)
                fo, fe = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
                proc = subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), "--one", name,
                     "--device", device], stdout=fo, stderr=fe, text=True)
                running[name] = (proc, time.monotonic(), fo, fe)
            if todo and time.monotonic() >= end and not running:
                for name in todo:
                    emit({"check": name, "status": "skipped",
                          "reason": f"not run: the preflight budget of {budget:.0f} s ended"})
                todo = []
            time.sleep(0.05)
    except KeyboardInterrupt:
        for name in list(running):
            reap(name, "interrupted: the preflight's time box ended")
        for name in todo:
            emit({"check": name, "status": "skipped",
                  "reason": "not run: the preflight's time box ended"})
        return 130
    finally:
        if sink:
            sink.close()
    return 1 if failed else 0


def _interrupted(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--one", help="run this one check here and print its line")
    ap.add_argument("--only", help="comma-separated checks to run (default: all)")
    ap.add_argument("--out", help="append the lines to this file")
    ap.add_argument("--budget", type=float, default=55.0, help="seconds for everything")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds per check")
    ap.add_argument("--jobs", type=int, default=max(1, min(12, (os.cpu_count() or 2) - 2)))
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(run_check(args.one, args.device), default=str), flush=True)
        return 0
    signal.signal(signal.SIGTERM, _interrupted)
    only = args.only.split(",") if args.only else None
    return run_all(args.device, args.out, args.budget, args.jobs, args.timeout, only)


if __name__ == "__main__":
    sys.exit(main())
