"""Engine checkpoints written by older mixprec versions: what their layout lacks, and
how it reads.

- No ``"layout"`` entry (written before layouts were recorded): a checkpoint of one
  rank holds every tensor whole, one of several ranks may hold FSDP shards
  (``saved_layout``).
- mixprec 0.2's Float8Linears saved delayed-scaling buffers under every scaling; for a
  scaling that keeps no history they are dropped (``stale_model_keys``; the module's own
  ``load_state_dict`` drops them as it loads).
- No ``"rng"`` entry (written before random streams were saved): the model and
  optimizer resume exactly, the random streams stay as they are, with one warning
  (``warn_no_random_streams``).

Optimizer states of an older storage layout are ``mixprec.optim.compat``'s.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable

from torch import nn

from mixprec.modules.linear import legacy_scaling_keys

__all__ = ["saved_layout", "stale_model_keys", "warn_no_random_streams"]


def saved_layout(state: dict) -> str:
    """An engine state's layout: ``"full"``, ``"sharded"`` or ``"reshardable"``."""
    return state.get("layout", "full" if state.get("world_size", 1) == 1 else "sharded")


def stale_model_keys(module: nn.Module, keys: Iterable[str]) -> set[str]:
    """The model keys among ``keys`` that name mixprec 0.2's scaling buffers which
    ``module``'s Float8Linears no longer hold (left out of the model check)."""
    return legacy_scaling_keys(module, dict.fromkeys(keys))


def warn_no_random_streams(path: str | os.PathLike[str]) -> None:
    """The one warning for a checkpoint written before random streams were saved."""
    warnings.warn(
        f"checkpoint {str(path)!r} holds no random streams (written by an older "
        "mixprec): the model and optimizer resume exactly, but dropout and other "
        "random ops draw from the streams as they are now. Save it again to store "
        "them", stacklevel=5)
