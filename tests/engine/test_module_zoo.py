"""Any nn.Module: torch's own building blocks train under every recipe family.

Each model takes two steps through the engine; its gradient norm must be finite and
agree with plain fp32 training of the same model to the compute format's precision.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec import MixedPrecision

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _models():
    return {
        "transformer": (lambda: nn.TransformerEncoderLayer(32, 4, 64, batch_first=True,
                                                           dropout=0.0),
                        lambda: torch.randn(4, 10, 32)),
        "transformer-norm-first": (lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(
            32, 4, 64, batch_first=True, norm_first=True, dropout=0.0), 2),
            lambda: torch.randn(4, 10, 32)),
        "multihead-attention": (lambda: nn.MultiheadAttention(32, 4, batch_first=True),
                                lambda: torch.randn(4, 10, 32)),
        "lstm": (lambda: nn.LSTM(16, 32, batch_first=True), lambda: torch.randn(4, 10, 16)),
        "gru": (lambda: nn.GRU(16, 32, num_layers=2), lambda: torch.randn(10, 4, 16)),
        "conv-transpose-groupnorm": (lambda: nn.Sequential(
            nn.ConvTranspose2d(3, 8, 3, stride=2), nn.GroupNorm(2, 8), nn.SiLU(),
            nn.Conv2d(8, 4, 3)), lambda: torch.randn(2, 3, 8, 8)),
        "conv1d-batchnorm": (lambda: nn.Sequential(
            nn.Conv1d(4, 8, 5), nn.BatchNorm1d(8), nn.ReLU(), nn.AdaptiveMaxPool1d(1),
            nn.Flatten(), nn.Linear(8, 2)), lambda: torch.randn(4, 4, 20)),
        "embedding-bag": (lambda: nn.EmbeddingBag(50, 16, mode="mean"),
                          lambda: torch.randint(0, 50, (4, 6))),
        "rmsnorm-mish": (lambda: nn.Sequential(nn.Linear(16, 32), nn.RMSNorm(32), nn.Mish(),
                                               nn.Linear(32, 4)), lambda: torch.randn(4, 16)),
        "bilinear": (lambda: nn.Bilinear(8, 8, 4), lambda: torch.randn(4, 8)),
        "instancenorm-prelu": (lambda: nn.Sequential(
            nn.Conv2d(3, 4, 3), nn.InstanceNorm2d(4, affine=True), nn.PReLU(), nn.Flatten()),
            lambda: torch.randn(2, 3, 6, 6)),
    }


MODELS = _models()
RECIPES = ["bf16", "bf16-master", "fp16-master,init_scale=256", "bf16-master,wgrad=fp32",
           "fp8"]


def _forward(model, x):
    if isinstance(model, nn.MultiheadAttention):
        return model(x, x, x, need_weights=False)[0]
    if isinstance(model, nn.Bilinear):
        return model(x, x.flip(0))
    y = model(x)
    return y[0] if isinstance(y, tuple) else y


def _grad_norms(name, recipe, steps=2):
    make, data = MODELS[name]
    torch.manual_seed(0)
    model, x = make(), data()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    try:
        engine = MixedPrecision(model, opt, recipe)
    except ValueError as e:  # only the head is a Linear: fp8 must be asked for anyway
        assert "converts no Linear" in str(e)
        with pytest.warns(UserWarning, match="no Linear was converted"):
            engine = MixedPrecision(model, opt, recipe, fp8_filter=lambda m, fqn: False)
    norms = []
    for _ in range(steps):
        with engine.autocast():
            loss = _forward(model, x).float().square().mean()
        engine.backward(loss)
        res = engine.step()
        assert not bool(res.skipped)
        norms.append(float(res.grad_norm))
    return norms


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", list(MODELS))
def test_builtin_module_trains_and_matches_fp32(name, recipe):
    got, want = _grad_norms(name, recipe), _grad_norms(name, "fp32")
    assert all(torch.isfinite(torch.tensor(got)))
    # bf16 keeps 8 significant bits; through a few layers the norm stays within a few %
    assert got == pytest.approx(want, rel=0.05)
