"""mixprec inside the trainers people already use. Each module imports its framework
(an optional extra: ``pip install mixprec[lightning]``); the core never imports them.

- ``mixprec.integrations.lightning``: ``MixedPrecisionPlugin``, a Lightning precision
  plugin that runs the engine underneath ``Trainer``;
- ``mixprec.integrations.fabric``: ``setup_fabric``, ``fabric.setup`` under a recipe
  (also importable from ``mixprec.integrations.lightning``);
- ``mixprec.integrations.transformers``: ``MixedPrecisionTrainer``, a Hugging Face
  ``Trainer`` whose step, backward and forward go through the engine;
- ``mixprec.integrations.accelerate``: ``prepare``, ``accelerator.prepare`` for an
  Accelerate loop whose backward and step are the engine's;
- ``mixprec.integrations.deepspeed``: the recipe's Linear formats inside DeepSpeed's
  engine (ZeRO 1-3), which the two above take under a DeepSpeed config.

Importing an integration prints nothing: where a framework's own import pulls in a peer
that logs on every import (transformers' model code imports torchao when it is
installed, whose optional CUDA kernels fail to load on a machine without them, and
whose enums meet a deprecation warning of torch's), ``quiet_peer_import`` drops exactly
those lines while mixprec imports the framework. Every other log line and warning
passes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

__all__: list[str] = []

#: logger -> words of the lines it logs on import that say nothing about the run
PEER_NOISE = {
    "torchao": ("Failed to load ", "Skipping import of cpp extensions"),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported",),
}


class _DropNoise(logging.Filter):
    def __init__(self, words: tuple[str, ...]) -> None:
        super().__init__()
        self.words = words

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(w in message for w in self.words)


@contextlib.contextmanager
def quiet_peer_import() -> Iterator[None]:
    """Within: the lines of ``PEER_NOISE`` are dropped (their loggers' other records
    pass); after, the loggers are as they were.

    >>> import logging
    >>> with quiet_peer_import():
    ...     logging.getLogger("torchao").warning("Failed to load x.so")  # dropped
    """
    added = [(logging.getLogger(name), _DropNoise(words))
             for name, words in PEER_NOISE.items()]
    for logger, f in added:
        logger.addFilter(f)
    try:
        yield
    finally:
        for logger, f in added:
            logger.removeFilter(f)
