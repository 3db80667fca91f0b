"""Writes ``optim_0_2.pt``: mixprec.optim checkpoints as mixprec 0.2.0 wrote them
(block states in 0.2's layout: rows padded to 256-element blocks, linear int8 codes,
fp8 second moments as square roots), with the gradients of the steps that follow and the
weights 0.2.0 reached after them. tests/optim/test_optim_checkpoints.py loads them with the
current version. This file was run once with mixprec 0.2.0; run with a later version
it writes that version's format instead, so the committed .pt is the record.

    python tests/data/optim_0_2.py
"""

import copy
from pathlib import Path

import torch

from mixprec.optim import AdamW

CASES = {  # name: (states, write, weight dtype)
    "sr": ("fp32", "stochastic", torch.bfloat16),
    "lean": ("int8", "stochastic", torch.bfloat16),
    "fp8": ("fp8", "nearest", torch.float32),
}
SHAPES = ((48, 96), (20, 300), (96,))


def grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=g) for s in SHAPES]


def main() -> None:
    out = {}
    for name, (states, write, dtype) in CASES.items():
        g = torch.Generator().manual_seed(7)
        params = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]
        opt = AdamW(params, lr=1e-2, weight_decay=0.1, states=states, write=write, seed=5)
        for step in range(3):
            for p, gr in zip(params, grads(step)):
                p.grad = gr.to(dtype)
            opt.step()
        saved = {"optim": copy.deepcopy(opt.state_dict()),  # not the live tensors
                 "params": [p.detach().clone() for p in params]}
        for step in range(3, 5):
            for p, gr in zip(params, grads(step)):
                p.grad = gr.to(dtype)
            opt.step()
        saved["after"] = [p.detach().clone() for p in params]
        out[name] = saved
    torch.save(out, Path(__file__).with_suffix(".pt"))


if __name__ == "__main__":
    main()
