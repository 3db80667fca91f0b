"""The workbench: a small GPT and what the CLI trains. The library never imports this."""

from mixprec.workbench.model import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
