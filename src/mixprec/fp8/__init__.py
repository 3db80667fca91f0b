"""FP8 and FP4 Linears: the formats (``formats``: one object per scaling, and the
registry), the casts (``scaling``, ``blocks``, ``nvfp4``), the GEMM routes (``route``,
``gemm``, ``scaled_mm``), the quantized GEMM (``mm.quantized_mm``, which
``QuantizedLinear``, grouped expert GEMMs and tensor-parallel shards call), the Linear
(``linear``), the module swap (``convert``), FSDP2's fp8 all-gather (``gather``) and
tensor-parallel shards (``tensor_parallel``; the sequence-parallel plan ``tp_plans``).
"""

from mixprec.fp8.convert import ConvertReport, convert, layer_formats
from mixprec.fp8.formats import FORMATS, Int8Rowwise, LinearFormat
from mixprec.fp8.gemm import fp8_gemm
from mixprec.fp8.linear import Float8Linear, Int8Linear, QuantizedLinear
from mixprec.fp8.mm import quantized_mm
from mixprec.fp8.quantized import Quantized
from mixprec.fp8.quantizers import QUANTIZERS, Quantizer, quantizer_for
from mixprec.fp8.route import gemm_route
from mixprec.fp8.scaling import (
    amax_to_scale,
    cast_rowwise,
    cast_to_fp8,
    update_delayed_scales,
)

__all__ = ["QuantizedLinear", "Float8Linear", "Int8Linear", "quantized_mm", "convert",
           "ConvertReport", "layer_formats", "fp8_gemm", "gemm_route", "LinearFormat", "FORMATS",
           "Quantizer", "Quantized", "QUANTIZERS", "quantizer_for", "Int8Rowwise",
           "amax_to_scale", "cast_to_fp8", "cast_rowwise", "update_delayed_scales"]
