"""Small models of several kinds (an MLP, a CNN, a tied-embedding LM, a hand-written
RMSNorm, the workbench GPT) and a learnable token stream to train them on."""

from __future__ import annotations

import torch
from torch import nn

from mixprec.workbench import GPT, GPTConfig

__all__ = ["mlp", "cnn", "LlamaRMSNorm", "TiedLM", "tiny_gpt", "pattern_losses"]


def mlp(seed: int = 0, d_in: int = 16, hidden: int = 32, d_out: int = 4) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.LayerNorm(hidden), nn.GELU(),
                         nn.Linear(hidden, d_out))


def cnn(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


class LlamaRMSNorm(nn.Module):
    """A third-party style RMSNorm that does the arithmetic by hand (matched by class
    name, as transformers' is)."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class TiedLM(nn.Module):
    """Embedding whose weight is reused as the output head (shared parameter)."""

    def __init__(self, vocab: int = 32, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.mix(self.emb(idx))))


def tiny_gpt(seed: int = 0, **kw) -> GPT:
    torch.manual_seed(seed)
    cfg = dict(vocab=64, seq_len=32, n_layers=2, d_model=32, n_heads=2)
    cfg.update(kw)
    return GPT(GPTConfig(**cfg))


def pattern_losses(engine, model, steps: int, period: int = 5, batch: int = 8,
                   device: str = "cpu", check_applied: bool = False) -> list[float]:
    """Train ``model`` through ``engine`` on a learnable stream (a random pattern of
    ``period`` tokens, repeated, at random offsets) and return the loss per step."""
    g = torch.Generator().manual_seed(0)
    seq = model.config.seq_len
    pattern = torch.randint(0, model.config.vocab, (period,), generator=g)
    losses = []
    for _ in range(steps):
        off = torch.randint(0, period, (batch,), generator=g)
        idx = pattern[(torch.arange(seq + 1)[None] + off[:, None]) % period].to(device)
        with engine.autocast():
            loss = model(idx[:, :-1], idx[:, 1:])
        engine.backward(loss)
        result = engine.step()
        if check_applied:
            assert not bool(result.skipped)
        losses.append(loss.item())
    return losses
