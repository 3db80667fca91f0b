"""Atomic, reshardable checkpoints of an engine's parts (``core``), with the RNG states
(``rng``), tensor-parallel shards (``tensor_parallel``), resharding across world sizes
(``resharding``) and the older layouts that still load (``compat``)."""

import importlib

#: public name -> the submodule that defines it
_EXPORTS = {
    "CheckpointError": "core",
    "save_atomic": "core",
    "load_checkpoint": "core",
    "check_engine_state": "core",
    "engine_state": "core",
    "save_engine": "core",
    "load_engine": "core",
    "restore_engine": "core",
    "fp32_weights": "core",
    "gather_full": "core",
    "shard_full_state": "core",
    "rng_entry": "core",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    """The public names, imported on first use: the package's own submodules are imported
    by rooms below the facade, which must not pull the facade in with them."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
