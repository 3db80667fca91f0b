"""Atomic, reshardable checkpoints of an engine's parts (``core``), with the RNG states
(``rng``), tensor-parallel shards (``tensor_parallel``), pipeline stages keyed by their
names in the whole model (``pipeline``), resharding across world sizes and degrees
(``resharding``) and the older layouts that still load (``compat``)."""

from mixprec._imports import lazy_exports

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
    "stage_module": "pipeline",
}

__all__ = list(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
