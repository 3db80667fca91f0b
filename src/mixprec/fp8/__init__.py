"""The names ``mixprec.fp8`` exported before its modules moved (the formats and their
casts and GEMMs to ``mixprec.formats``, the quantized Linear to ``mixprec.modules``, the
module swap to ``mixprec.engine.convert``, FSDP gathers and tensor parallelism to
``mixprec.parallel``). Importing this package warns once; it and its old submodule paths
work until the release after 0.3."""

import warnings

from mixprec._imports import lazy_exports

warnings.warn("mixprec.fp8 moved: import the formats from mixprec.formats, QuantizedLinear "
              "from mixprec.modules, convert from mixprec.engine.convert and the tensor-"
              "parallel and FSDP pieces from mixprec.parallel; the old path works until the "
              "release after 0.3", DeprecationWarning, stacklevel=2)

#: public name -> the module that defines it now
_EXPORTS = {
    "QuantizedLinear": "mixprec.modules.linear",
    "Float8Linear": "mixprec.modules.linear",
    "Int8Linear": "mixprec.modules.linear",
    "quantized_mm": "mixprec.formats.mm",
    "convert": "mixprec.engine.convert",
    "ConvertReport": "mixprec.engine.convert",
    "layer_formats": "mixprec.engine.convert",
    "fp8_gemm": "mixprec.formats.tensor_gemm",
    "gemm_route": "mixprec.formats.route",
    "LinearFormat": "mixprec.formats.gemm",
    "FORMATS": "mixprec.formats.gemm",
    "Int8Rowwise": "mixprec.formats.gemm",
    "Quantizer": "mixprec.recipe.linear_format",
    "QUANTIZERS": "mixprec.recipe.linear_format",
    "quantizer_for": "mixprec.recipe.linear_format",
    "Quantized": "mixprec.formats.quantized",
    "amax_to_scale": "mixprec.formats.scaling",
    "cast_to_fp8": "mixprec.formats.scaling",
    "cast_rowwise": "mixprec.formats.scaling",
    "update_delayed_scales": "mixprec.formats.scaling",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, absolute=True)
