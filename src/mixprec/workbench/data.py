"""The built-in corpus: the Python standard library's own source, as bytes.

No download: the files come from the running interpreter's installation
(``sysconfig.get_paths()["stdlib"]``). Tokens are bytes (vocab 256). Files are
shuffled with ``seed`` and split whole between train and validation, so no file
straddles the split. The same interpreter and seed always give the same corpus.
"""

from __future__ import annotations

import hashlib
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["Corpus", "load_corpus", "sample_batch", "val_batches"]


@dataclass(frozen=True)
class Corpus:
    """Byte tensors (uint8) for training and validation, and where they came from."""

    train: torch.Tensor
    val: torch.Tensor
    source: str
    n_files: int

    @property
    def fingerprint(self) -> str:
        """Short hash of the bytes: two runs on the same data share it."""
        h = hashlib.sha256(self.train.numpy().tobytes())
        h.update(self.val.numpy().tobytes())
        return h.hexdigest()[:12]


def load_corpus(max_bytes: int = 4_000_000, val_fraction: float = 0.1, seed: int = 0,
                root: str | Path | None = None) -> Corpus:
    """Read up to ``max_bytes`` of ``*.py`` files under the stdlib (or ``root``)."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    base = Path(root or sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in base.rglob("*.py")
                   if "site-packages" not in p.parts and "dist-packages" not in p.parts)
    if not files:
        raise FileNotFoundError(f"no .py files under {base}; pass root= to a source tree")
    random.Random(seed).shuffle(files)
    chunks, total = [], 0
    for p in files:
        try:
            b = p.read_bytes()
        except OSError:
            continue
        chunks.append(b)
        total += len(b)
        if total >= max_bytes and len(chunks) >= 10:  # at least a few files per split
            break
    if len(chunks) < 2:
        raise FileNotFoundError(f"need at least 2 readable .py files under {base}")
    n_val = min(max(1, int(len(chunks) * val_fraction)), len(chunks) - 1)
    as_tensor = lambda bs: torch.frombuffer(bytearray(b"".join(bs)), dtype=torch.uint8)  # noqa: E731
    return Corpus(train=as_tensor(chunks[n_val:]), val=as_tensor(chunks[:n_val]),
                  source=str(base), n_files=len(chunks))


def sample_batch(data: torch.Tensor, batch: int, seq: int,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` random windows of ``seq + 1`` bytes: inputs and next-byte targets."""
    if data.numel() <= seq + 1:
        raise ValueError(f"corpus of {data.numel()} bytes is too short for seq={seq}")
    starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=generator)
    win = torch.stack([data[s:s + seq + 1] for s in starts.tolist()]).long()
    return win[:, :-1], win[:, 1:]


def val_batches(data: torch.Tensor, batch: int, seq: int, n: int = 8
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed list of validation batches (evenly spaced windows): same every call."""
    span = data.numel() - seq - 1
    starts = torch.linspace(0, span - 1, n * batch).long().tolist()
    out = []
    for i in range(n):
        win = torch.stack([data[s:s + seq + 1] for s in starts[i * batch:(i + 1) * batch]])
        out.append((win[:, :-1].long(), win[:, 1:].long()))
    return out
