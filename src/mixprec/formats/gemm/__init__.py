"""The registry of Linear formats: each fp8 / fp4 scaling by the name a recipe string
gives it (``fp8_scaling=NAME``). A new format is one file with a ``LinearFormat``
subclass and one entry here."""

from __future__ import annotations

from mixprec.formats.gemm.base import LinearFormat
from mixprec.formats.gemm.block import BlockScaling
from mixprec.formats.gemm.current import CurrentScaling
from mixprec.formats.gemm.delayed import DelayedScaling
from mixprec.formats.gemm.int8 import Int8Rowwise
from mixprec.formats.gemm.mx import MXScaling
from mixprec.formats.gemm.mxfp6 import MXFP6Scaling
from mixprec.formats.gemm.nvfp4 import NVFP4Scaling
from mixprec.formats.gemm.rowwise import RowwiseScaling

__all__ = ["LinearFormat", "FORMATS", "DEFAULT_FORMAT", "format_class", "DelayedScaling",
           "CurrentScaling", "RowwiseScaling", "BlockScaling", "MXScaling", "NVFP4Scaling",
           "Int8Rowwise", "MXFP6Scaling"]

#: the format ``compute=fp8`` takes where ``fp8_scaling`` is not given
DEFAULT_FORMAT = "delayed"

#: every Linear format by its name (a recipe's ``fp8_scaling``)
FORMATS: dict[str, type[LinearFormat]] = {f.name: f for f in (
    DelayedScaling, CurrentScaling, RowwiseScaling, BlockScaling, MXScaling, NVFP4Scaling,
    Int8Rowwise, MXFP6Scaling)}


def format_class(name: str) -> type[LinearFormat]:
    """The format class registered as ``name``; ``ValueError`` naming the valid ones."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"recipe field 'fp8_scaling': unknown value {name!r}; valid: "
                         f"{', '.join(FORMATS)}") from None
