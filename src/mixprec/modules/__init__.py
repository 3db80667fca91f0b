"""The quantized modules a converted model runs: ``linear`` (``QuantizedLinear``, also
``Float8Linear`` and ``Int8Linear``: an ``nn.Linear`` whose three GEMMs run on a Linear
format's casts). The experts' modules are in ``mixprec.experts``; the swap that puts
these in a model is ``mixprec.engine.convert``."""

from mixprec._imports import lazy_exports

#: public name -> the submodule that defines it
_EXPORTS = {
    "QuantizedLinear": "linear",
    "Float8Linear": "linear",
    "Int8Linear": "linear",
}

__all__ = list(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
