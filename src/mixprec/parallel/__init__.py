"""How a step runs across processes: one interface over a single process, DDP, FSDP2 and
tensor parallelism (``layouts``), the user's entry (``distributed``), the collectives
and their agreements (``comm``) and what crossed the wire (``comm_stats``)."""

from mixprec._imports import lazy_exports

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


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
