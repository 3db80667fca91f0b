"""The workbench-GPT shape and batch that benchmarks/engine.py, emulate.py and doctor.py
share (defaults: the issues' 6-layer d=512 GPT, batch 8 x 256 tokens)."""

from __future__ import annotations

import argparse

from mixprec.workbench import GPTConfig

__all__ = ["add_gpt_arguments", "gpt_config"]


def add_gpt_arguments(ap: argparse.ArgumentParser, steps: int) -> None:
    """--layers --d-model --heads --batch --seq, and --steps (timed steps) at ``steps``."""
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=steps)


def gpt_config(args: argparse.Namespace) -> GPTConfig:
    """The GPTConfig those arguments name."""
    return GPTConfig(n_layers=args.layers, d_model=args.d_model, n_heads=args.heads,
                     seq_len=args.seq)
