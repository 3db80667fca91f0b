"""Under ``fp32`` with ``max_grad_norm`` the engine's step is plain torch's
``torch.nn.utils.clip_grad_norm_`` followed by the same optimizer, bit for bit: torch's
AdamW, Adam and SGD in their foreach, fused and for-loop forms, with a norm that clips
every step, one that clips some steps and one that never clips. A non-finite gradient
is skipped where plain torch would find a non-finite norm."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec import MixedPrecision
from mixprec.engine.gradnorm import BIG

STEPS = 20
BAD_STEP = 13  # the loss, and every gradient, is NaN there

OPTIMIZERS = {
    "AdamW": lambda ps, **kw: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.05, **kw),
    "Adam": lambda ps, **kw: torch.optim.Adam(ps, lr=1e-2, **kw),
    "SGD": lambda ps, **kw: torch.optim.SGD(ps, lr=0.05, momentum=0.9, **kw),
}
FORMS = {"foreach": {"foreach": True}, "fused": {"fused": True},
         "for-loop": {"foreach": False}}


class Net(nn.Module):
    """Odd shapes, an embedding, a norm, and a Linear large enough (66049 weights) for
    the dot-per-tensor norm of a step that does not clip."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(97, 13)
        self.body = nn.Sequential(nn.Linear(13, 257), nn.GELU(), nn.Linear(257, 257),
                                  nn.LayerNorm(257), nn.Tanh(), nn.Linear(257, 29),
                                  nn.GELU(), nn.Linear(29, 5))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.body(self.emb(tokens).mean(1))


@pytest.fixture(autouse=True)
def one_thread():
    """The model is tiny: one thread (on a busy 2-core machine OpenMP's waits made each
    case 10x slower). Engine and plain torch run under the same setting."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 97, (24, 3), generator=g), torch.randint(0, 5, (24,), generator=g))
            for _ in range(STEPS)]


def _loss(model, x, y, step):
    loss = F.cross_entropy(model(x), y)
    return loss * math.nan if step == BAD_STEP else loss


@pytest.mark.parametrize("max_norm", [0.05, 1.0, 100.0])
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fp32_clip_and_step_equal_plain_torch_bit_for_bit(name, form, max_norm):
    torch.manual_seed(0)
    model = Net()
    assert max(p.numel() for p in model.parameters()) >= BIG
    plain = copy.deepcopy(model)
    make = OPTIMIZERS[name]
    opt = make(plain.parameters(), **FORMS[form])
    engine = MixedPrecision(model, make(model.parameters(), **FORMS[form]), "fp32",
                            max_grad_norm=max_norm)
    clipped = 0
    for step, (x, y) in enumerate(_batches()):
        with engine.autocast():
            engine.backward(_loss(model, x, y, step))
        result = engine.step()

        _loss(plain, x, y, step).backward()
        norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), max_norm)
        if torch.isfinite(norm):  # the engine's rule: a non-finite norm skips the step
            opt.step()
        opt.zero_grad()

        assert bool(result.skipped) is (step == BAD_STEP)
        assert torch.equal(result.grad_norm, norm) or step == BAD_STEP, (step, result, norm)
        clipped += bool(norm > max_norm)
        for (pname, a), b in zip(model.named_parameters(), plain.parameters()):
            assert torch.equal(a, b), (step, pname, (a - b).abs().max().item())
    for a, b in zip(engine.optimizers[0].state.values(), opt.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in b), name  # moments, step counts
    # the norms clip every step, some steps (the first ones), none
    assert clipped == {0.05: STEPS - 1, 100.0: 0}.get(max_norm, clipped)
    assert max_norm != 1.0 or 0 < clipped < STEPS - 1, clipped
