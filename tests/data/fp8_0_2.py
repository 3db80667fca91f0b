"""Writes ``fp8_0_2.pt``: fp8 casts, Float8Linear steps and engine checkpoints as
mixprec 0.2.0 computed and wrote them. tests/formats/test_quantizers.py checks that the current
version casts bit for bit as 0.2.0 did and resumes its checkpoints (whose Float8Linears
carried delayed-scaling buffers under every scaling). This file was run once with
mixprec 0.2.0; run with a later version it records that version instead, so the
committed .pt is the record.

    python tests/data/fp8_0_2.py
"""

import io
from pathlib import Path

import torch
from torch import nn

import mixprec
from mixprec.formats.blocks import cast_blocks, cast_mx, cast_tiles
from mixprec.formats.fp4 import cast_nvfp4
from mixprec.formats.scaling import cast_rowwise
from mixprec.modules.linear import Float8Linear

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
#: the Float8Linear cases: every scaling and its settings
LINEARS = ("fp8", "fp8-current", "fp8-rowwise", "fp8-block", "fp8-block,block_scales=pow2",
           "mxfp8", "mxfp8,mx_rounding=floor", "nvfp4",
           "nvfp4,nvfp4_2d=false,nvfp4_rht=false,nvfp4_sr=false",
           "fp8-current,fp8_format=e4m3,margin=1")
#: the engine checkpoints: a scaling without history, NVFP4's counter, delayed scaling
CHECKPOINTS = ("fp8-current", "nvfp4", "fp8")


def hard_tensor(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Magnitudes over 10^±4, a zero row, an outlier, −0 and subnormals."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-4, 4, cols)
    x[1] = 0
    x[2, 3] = 1e4 * x[2].abs().max()
    x[3, :4] = torch.tensor([-0.0, 1e-40, -1e-39, 2.0**-130])
    return x


def casts() -> dict:
    x = hard_tensor(40, 160, 0)
    out = {"x": x}
    for dim in (0, 1):
        for dt, name in ((E4M3, "e4m3"), (E5M2, "e5m2")):
            c, inv = cast_rowwise(x, dim, dt, 0)
            out[f"rowwise/{name}/{dim}"] = (c.view(torch.uint8), inv)
            t = cast_tiles(x, dim, dt)
            out[f"tiles/{name}/{dim}"] = (t.codes.view(torch.uint8), t.inv)
            for rounding in ("rceil", "floor", "ceil", "even"):
                m = cast_mx(x, dim, dt, rounding)
                out[f"mx/{rounding}/{name}/{dim}"] = (m.codes.view(torch.uint8), m.inv)
        out[f"nvfp4/{dim}"] = cast_nvfp4(x, dim).dequant()
    b = cast_blocks(x, E4M3, pow2=True)
    out["blocks/pow2"] = (b.codes.view(torch.uint8), b.inv)
    out["nvfp4/square"] = cast_nvfp4(x, square=True).dequant()
    out["nvfp4/sr"] = cast_nvfp4(x, 1, generator=torch.Generator().manual_seed(3)).dequant()
    return out


def linears() -> dict:
    out = {}
    for recipe in LINEARS:
        torch.manual_seed(0)
        lin = nn.Linear(32, 48)
        f = Float8Linear.from_linear(lin, f"{recipe},fp8_gemm=dequant_fp32", seed=11)
        res = []
        for step in range(3):
            x = hard_tensor(20, 32, step + 1).requires_grad_()
            with torch.autocast("cpu", torch.bfloat16, enabled=step == 1):
                y = f(x)
            y.float().backward(hard_tensor(20, 48, step + 7) * 1e-3)
            res += [y.detach().float(), x.grad, lin.weight.grad, lin.bias.grad]
            lin.weight.grad = lin.bias.grad = None
            f.update_scales()
        out[recipe] = res
    return out


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.GELU(),
                         nn.Linear(32, 16))


def batch(step: int) -> torch.Tensor:
    return torch.randn(24, 32, generator=torch.Generator().manual_seed(100 + step))


def checkpoints() -> dict:
    out = {}
    for recipe in CHECKPOINTS:
        m = model()
        engine = mixprec.MixedPrecision(m, torch.optim.AdamW(m.parameters(), lr=1e-2),
                                        f"{recipe},emulate=false,fp8_gemm=dequant_fp32")
        losses = []
        for step in range(4):
            if step == 2:
                buf = io.BytesIO()
                torch.save(engine.state_dict(), buf)
                saved = buf.getvalue()
            with engine.autocast():
                loss = m(batch(step)).float().square().mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out[recipe] = {"state": saved, "losses": losses,
                       "weights": {k: v.detach().float().clone()
                                   for k, v in m.state_dict().items()
                                   if not k.split(".")[-1].startswith(("fp8", "nvfp4"))}}
    return out


def main() -> None:
    data = {"version": mixprec.__version__, "casts": casts(), "linears": linears(),
            "checkpoints": checkpoints()}
    torch.save(data, Path(__file__).with_suffix(".pt"))


if __name__ == "__main__":
    main()
