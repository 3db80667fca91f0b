"""FP8 and FP4 training: quantizers, Float8Linear and the module swap.

``quantizers`` (one object per scaling: delayed, current, rowwise, block, MX, NVFP4,
and the registry ``quantizer_for`` reads a recipe with; ``int8_rowwise``, INT8 rowwise
training, adds itself there), ``quantized`` (what a cast
returns: codes, scales, dequantize, transpose), ``scaling`` / ``blocks`` / ``nvfp4``
(the casts), ``gemm`` (the per-tensor and rowwise GEMM routes), ``scaled_mm`` (the
block-scaled ones), ``route`` (which route a Linear takes: one decision), ``linear``
(Float8Linear: one autograd Function for every scaling), ``convert`` (swap a model's
eligible nn.Linear modules, as the recipe's ``layer:`` rules say; ``layer_formats``),
``gather`` (FSDP2's fp8 all-gather).
"""

from mixprec.fp8.convert import ConvertReport, convert, layer_formats
from mixprec.fp8.gemm import fp8_gemm
from mixprec.fp8.int8_rowwise import Int8Rowwise  # in its own file: registers itself
from mixprec.fp8.linear import Float8Linear
from mixprec.fp8.quantized import Quantized
from mixprec.fp8.quantizers import QUANTIZERS, Quantizer, quantizer_for
from mixprec.fp8.route import gemm_route
from mixprec.fp8.scaling import (
    amax_to_scale,
    cast_rowwise,
    cast_to_fp8,
    update_delayed_scales,
)

__all__ = ["Float8Linear", "convert", "ConvertReport", "layer_formats", "fp8_gemm",
           "gemm_route",
           "Quantizer", "Quantized", "QUANTIZERS", "quantizer_for", "Int8Rowwise",
           "amax_to_scale", "cast_to_fp8", "cast_rowwise", "update_delayed_scales"]
