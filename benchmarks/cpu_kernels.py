"""What this CPU's own kernels do: the rates behind the ``auto`` choices and how exactly
its 16-bit kernels round. The figures the README quotes for a CPU's kernels.

    python benchmarks/cpu_kernels.py

1. matmul GFLOP/s in fp32, bf16 and fp16, and the three fp8 GEMM routes at 1024×256×1024
   (``torch._scaled_mm``; exact upcast to bf16 + bf16 GEMM; exact upcast to fp32 + fp32
   GEMM), best of a few calls, with what ``fp8_gemm=auto`` picks here;
2. the share of this CPU's real bf16/fp16 conv2d outputs and gradients that equal the
   float64 result rounded once, and the largest relative error: a unit that accumulates
   in fp32 gets ~100%; the software fallbacks of a CPU without such units do not;
3. where transformers is installed: a tiny GPT-2 under ``bf16-master`` trained 3 steps
   with and without activation checkpointing, on this CPU's default kernels (emulated
   where it has no bf16 units), and the relative loss differences.
"""

from __future__ import annotations

import time
import warnings

import torch
import torch.nn.functional as F

from mixprec import MixedPrecision
from mixprec.engine import devices as kernels
from mixprec.workbench.compare import cpu_name


def _best(fn, n=5) -> float:
    fn()
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def rates() -> None:
    g = torch.Generator().manual_seed(0)
    print("## matmul rates (GFLOP/s)")
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        print(f"{str(dt):<16} {kernels.matmul_gflops('cpu', dt, 512, 0.2):>8.1f}  (512²)")
    m, k, n = 1024, 256, 1024
    a = torch.randn(m, k, generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, generator=g).to(torch.float8_e4m3fn).t()
    one = torch.ones(())
    routes = {
        "scaled_mm": lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one,
                                              out_dtype=torch.bfloat16),
        "dequant": lambda: torch.mm(a.to(torch.bfloat16), b.to(torch.bfloat16)),
        "dequant_fp32": lambda: torch.mm(a.float(), b.float()).bfloat16(),
    }
    print(f"\n## fp8 GEMM routes, {m}x{k}x{n} (GFLOP/s)")
    for name, fn in routes.items():
        print(f"{name:<16} {2 * m * k * n / _best(fn) / 1e9:>8.1f}")
    print(f"fp8_gemm=auto picks: {kernels.fp8_gemm_route('cpu')}")


def conv_rounding() -> None:
    print("\n## real conv2d kernels against float64 rounded once "
          "(share equal; largest |error| / max(|ref|, 1e-3))")
    torch.manual_seed(0)
    for dt in (torch.bfloat16, torch.float16):
        x = torch.randn(4, 3, 16, 16).to(dt).requires_grad_()
        w = torch.randn(8, 3, 3, 3).to(dt).requires_grad_()
        y = F.conv2d(x, w, padding=1)
        g = torch.randn_like(y)
        gx, gw = torch.autograd.grad(y, (x, w), g)
        xd, wd = (t.detach().double().requires_grad_() for t in (x, w))
        yd = F.conv2d(xd, wd, padding=1)
        rx, rw = torch.autograd.grad(yd, (xd, wd), g.double())
        for name, got, ref in (("output", y, yd), ("dgrad", gx, rx), ("wgrad", gw, rw)):
            same = (got.double() == ref.to(dt).double()).float().mean().item()
            err = ((got.double() - ref).abs() / ref.abs().clamp(min=1e-3)).max().item()
            print(f"{str(dt):<16} {name:<7} {same:>7.1%}  {err:>9.3g}")


def hf_checkpointing() -> None:
    try:
        import transformers
    except ImportError:
        print("\n## transformers not installed: checkpointing comparison skipped")
        return

    def losses(checkpointing):
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                      n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(cfg)
        if checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        engine = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                "bf16-master")
        idx = torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(1))
        out = []
        for _ in range(3):
            with engine.autocast():
                loss = model(input_ids=idx, labels=idx).loss
            engine.backward(loss)
            engine.step()
            out.append(loss.item())
        return out, engine.kernels.describe()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain, how = losses(False)
        ckpt, _ = losses(True)
    print(f"\n## GPT-2 (tiny) bf16-master, activation checkpointing vs not ({how})")
    for step, (a, b) in enumerate(zip(plain, ckpt)):
        print(f"step {step}: loss {a:.7f} vs {b:.7f}, relative difference {abs(b / a - 1):.2g}")


def main() -> None:
    print(f"# benchmarks/cpu_kernels.py: {cpu_name()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    rates()
    conv_rounding()
    hf_checkpointing()


if __name__ == "__main__":
    main()
