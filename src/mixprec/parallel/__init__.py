"""How a step runs across processes: one interface over a single process, DDP, FSDP2 and
tensor parallelism (``layouts``), the user's entry (``distributed``), the collectives
and their agreements (``comm``) and what crossed the wire (``comm_stats``)."""

import importlib

#: public name -> the submodule that defines it
_EXPORTS = {
    "Parallel": "layouts",
    "SingleProcess": "layouts",
    "DDP": "layouts",
    "FSDP": "layouts",
    "TP": "layouts",
    "make_parallel": "layouts",
    "check_parallel_recipe": "layouts",
    "resolve_parallel": "layouts",
    "has_dtensor_params": "layouts",
    "tp_formats": "layouts",
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
