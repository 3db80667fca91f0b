"""A small GPT for the workbench, in the spirit of nanoGPT: readable in one sitting.

Pre-LayerNorm blocks, causal self-attention through ``F.scaled_dot_product_attention``,
a GELU MLP, learned positions, and an output head tied to the token embedding. Byte
level by default (vocab 256), so the built-in corpus needs no tokenizer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "GPT", "SIZES"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of the model. ``d_model`` must be a multiple of ``n_heads``."""

    vocab: int = 256
    seq_len: int = 256
    n_layers: int = 6
    d_model: int = 512
    n_heads: int = 8
    ffn_mult: int = 4
    tie_head: bool = True

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not a multiple of "
                             f"n_heads={self.n_heads}")
        for name in ("vocab", "seq_len", "n_layers", "d_model", "n_heads", "ffn_mult"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def n_params(self) -> int:
        """Trainable parameters (tied head counted once)."""
        d, f = self.d_model, self.ffn_mult * self.d_model
        per_layer = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
        head = 0 if self.tie_head else self.vocab * d
        return self.vocab * d + self.seq_len * d + self.n_layers * per_layer + 2 * d + head

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6·N for the weights plus attention (PaLM, App. B)."""
        n = self.n_params - self.seq_len * self.d_model
        return 6 * n + 12 * self.n_layers * self.d_model * self.seq_len


SIZES = {
    "tiny": GPTConfig(seq_len=64, n_layers=2, d_model=64, n_heads=4),
    "small": GPTConfig(seq_len=128, n_layers=4, d_model=128, n_heads=4),
    "medium": GPTConfig(seq_len=128, n_layers=4, d_model=256, n_heads=4),
    "base": GPTConfig(),  # 6 layers, d=512: the benchmark model
    # compute-bound on an H100/H200 (benchmarks/gpu.sh): ~600M parameters
    "large": GPTConfig(seq_len=2048, n_layers=12, d_model=2048, n_heads=16),
}


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.n_heads = c.n_heads
        self.ln1 = nn.LayerNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.proj = nn.Linear(c.d_model, c.d_model)
        self.ln2 = nn.LayerNorm(c.d_model)
        self.fc = nn.Linear(c.d_model, c.ffn_mult * c.d_model)
        self.out = nn.Linear(c.ffn_mult * c.d_model, c.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        # (b, t, d) -> (b, heads, t, d_head)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)
                   for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Decoder-only transformer; ``forward(idx, targets)`` returns logits, or the loss."""

    def __init__(self, config: GPTConfig | None = None, **overrides: Any) -> None:
        super().__init__()
        c = self.config = config or GPTConfig(**overrides)
        self.tok = nn.Embedding(c.vocab, c.d_model)
        self.pos = nn.Embedding(c.seq_len, c.d_model)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.ln_f = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab, bias=False)
        if c.tie_head:
            self.head.weight = self.tok.weight
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "out.weight")):  # GPT-2 residual scaling
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * c.n_layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (b, t, vocab) for token ids ``idx`` (b, t); with ``targets``, the
        mean cross-entropy instead."""
        b, t = idx.shape
        if t > self.config.seq_len:
            raise ValueError(f"sequence of {t} tokens exceeds seq_len={self.config.seq_len}")
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
