"""FP8 training: Float8Linear (per-tensor or rowwise scaled) and the module swap.

``scaling`` (amax histories; delayed, current and rowwise scales), ``linear``
(Float8Linear and the fp8 GEMM backends), ``convert`` (swap a model's eligible
nn.Linear modules).
"""

from mixprec.fp8.convert import ConvertReport, convert
from mixprec.fp8.linear import Float8Linear, fp8_gemm, gemm_backend
from mixprec.fp8.scaling import (
    amax_to_scale,
    cast_rowwise,
    cast_to_fp8,
    update_delayed_scales,
)

__all__ = ["Float8Linear", "convert", "ConvertReport", "fp8_gemm", "gemm_backend",
           "amax_to_scale", "cast_to_fp8", "cast_rowwise", "update_delayed_scales"]
