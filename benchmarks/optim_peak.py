"""Peak memory of one optimizer step, in bytes per parameter above the steady state.

    python benchmarks/optim_peak.py                  # 4096² and a 131072×1024 embedding
    python benchmarks/optim_peak.py --shapes 4096x4096
    python benchmarks/optim_peak.py --engine 250000x128   # MixedPrecision.step()

Each case runs in a fresh process with glibc's mmap threshold fixed at 64 KiB, so every
large tensor is its own mapping and freed memory leaves the resident set at once. The
process takes one step (which creates the states), resets its resident-set high-water mark
(``/proc/self/clear_refs``), takes a second and reads ``VmHWM``: the peak of that step
less the resident set before it is the step's scratch. Linux only.

``--engine``: the whole ``MixedPrecision.step()`` (norm, clip, optimizer, refresh, zero)
of an embedding table under each recipe with a ``mixprec.optim`` AdamW, its first step
too (above the states it creates)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

#: (label, optimizer, states, write, weight dtype)
CASES = [
    ("bf16-lean (int8 states, stochastic, bf16 weights)", "mixprec", "int8", "stochastic",
     "bf16"),
    ("bf16-sr (stochastic writes)", "mixprec", "fp32", "stochastic", "bf16"),
    ("bf16-kahan", "mixprec", "fp32", "kahan", "bf16"),
    ("bf16-remainder", "mixprec", "fp32", "remainder", "bf16"),
    ("int8 states, fp32 weights", "mixprec", "int8", "nearest", "fp32"),
    ("fp8 states, fp32 weights", "mixprec", "fp8", "nearest", "fp32"),
    ("int4 states, fp32 weights", "mixprec", "int4", "nearest", "fp32"),
    ("bf16 states, fp32 weights", "mixprec", "bf16", "nearest", "fp32"),
    ("mixprec AdamW, fp32", "mixprec", "fp32", "nearest", "fp32"),
    ("torch AdamW, fp32", "torch", "fp32", "nearest", "fp32"),
    ("torch AdamW, bf16 weights", "torch", "fp32", "nearest", "bf16"),
]


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def step_peak(shape: tuple[int, ...], optimizer: str, states: str, write: str,
              dtype: str) -> float:
    """This process: the extra bytes per parameter at the peak of one step."""
    import torch

    from mixprec.optim import AdamW

    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    p = torch.nn.Parameter(torch.randn(shape).to(dt))
    opt = (torch.optim.AdamW([p], foreach=False) if optimizer == "torch"
           else AdamW([p], states=states, write=write))
    p.grad = torch.randn(shape).to(dt)
    opt.step()  # creates the states
    before = _rss("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    opt.step()
    return (_rss("VmHWM:") - before) / p.numel()


#: recipes of ``--engine``: every write rule, and the master and plain ones
ENGINE_RECIPES = ["bf16-lean", "bf16-sr", "bf16-kahan", "bf16-remainder", "bf16-master",
                  "bf16", "fp32"]


def engine_step_peak(shape: tuple[int, ...], recipe: str) -> tuple[float, float]:
    """This process: extra bytes per parameter at the peak of ``MixedPrecision.step()``
    on ``nn.Embedding(*shape)`` under ``recipe`` (with ``max_grad_norm``), for its first
    step (less the optimizer states it creates) and its second."""
    import warnings

    import torch

    from mixprec import MixedPrecision, Recipe
    from mixprec.optim import AdamW

    torch.manual_seed(0)
    model = torch.nn.Embedding(*shape)
    r = Recipe.coerce(recipe)
    opt = AdamW(model.parameters(), states=r.states, write=r.write)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # which kernels this chip has fast
        engine = MixedPrecision(model, opt, r, max_grad_norm=1.0)
    tokens = torch.randint(0, shape[0], (4096,), generator=torch.Generator().manual_seed(1))
    n, out = model.weight.numel(), []
    for _ in range(2):
        with engine.autocast():
            loss = model(tokens).float().square().mean()
        engine.backward(loss)
        kept = _state_bytes(opt)
        before = _rss("VmRSS:")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        engine.step()
        out.append((_rss("VmHWM:") - before - (_state_bytes(opt) - kept)) / n)
    return out[0], out[1]


def _state_bytes(opt) -> int:
    return sum(t.numel() * t.element_size() for st in opt.state.values()
               for t in st.values() if hasattr(t, "numel"))


def run_engine(shape: tuple[int, ...], recipes: list[str]) -> list[tuple[float, float]]:
    """``engine_step_peak`` of each recipe, each in a fresh process on one thread (the
    peak does not depend on it; on a busy 2-core machine two threads made each step
    ~10x slower). ``MIXPREC_EMULATE`` (tests' ``--path``) passes on."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    out = []
    for recipe in recipes:
        arg = json.dumps({"engine": recipe, "shape": shape})
        run = subprocess.run([sys.executable, __file__, "--child", arg], env=env,
                             capture_output=True, text=True, check=True, timeout=600)
        out.append(tuple(json.loads(run.stdout.strip().splitlines()[-1])))
    return out


def run_cases(shape: tuple[int, ...], cases: list[tuple], chunk: int | None = None
              ) -> list[float]:
    """``step_peak`` of each case, one after another in a fresh process (see the module
    docstring); ``chunk``: the optimizer's piece size (``mixprec.optim.pieces.CHUNK``)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "2"}
    arg = json.dumps({"shape": shape, "cases": [c[1:] for c in cases], "chunk": chunk})
    out = subprocess.run([sys.executable, __file__, "--child", arg], env=env,
                         capture_output=True, text=True, check=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="4096x4096,131072x1024")
    ap.add_argument("--engine", default=None, metavar="SHAPE",
                    help="measure MixedPrecision.step() on an embedding of this shape")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        spec = json.loads(args.child)
        if spec.get("engine"):
            print(json.dumps(engine_step_peak(tuple(spec["shape"]), spec["engine"])))
            return
        if spec.get("chunk"):
            import mixprec.optim.pieces as chunking

            chunking.CHUNK = int(spec["chunk"])
        print(json.dumps([step_peak(tuple(spec["shape"]), *c) for c in spec["cases"]]))
        return
    import platform

    import torch

    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.backends.cpu.get_cpu_capability()}")
    if args.engine:
        from mixprec.engine.devices import has_fast_kernels, pinned_emulation

        shape = tuple(int(x) for x in args.engine.split("x"))
        pinned = pinned_emulation()
        real = not pinned if pinned is not None else has_fast_kernels("cpu", "bf16")
        print(f"# 16-bit path: {'real bf16 kernels' if real else 'emulated'}")
        print(f"| MixedPrecision.step(), {'×'.join(map(str, shape))} | first | second |")
        print("|---|---|---|")
        for recipe in ENGINE_RECIPES:
            ((first, second),) = run_engine(shape, [recipe])
            print(f"| {recipe} | {first:.2f} | {second:.2f} |", flush=True)
        return
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    print("| step | " + " | ".join("×".join(map(str, s)) for s in shapes) + " |")
    print("|---|" + "---|" * len(shapes))
    for case in CASES:  # a process per case and shape: nothing carried between them
        cells = [f"{run_cases(s, [case])[0]:.2f}" for s in shapes]
        print(f"| {case[0]} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
