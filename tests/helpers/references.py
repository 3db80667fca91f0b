"""Independent references the format tests round against."""

from __future__ import annotations

__all__ = ["ml_dtypes_formats"]


def ml_dtypes_formats() -> dict:
    """mixprec's format names and ml_dtypes' (or numpy's) types for them: the independent
    reference the format tests round against."""
    import ml_dtypes
    import numpy as np

    return {"bf16": ml_dtypes.bfloat16, "fp16": np.float16,
            "fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2,
            "fp6_e3m2": ml_dtypes.float6_e3m2fn, "fp6_e2m3": ml_dtypes.float6_e2m3fn,
            "fp4_e2m1": ml_dtypes.float4_e2m1fn, "e8m0": ml_dtypes.float8_e8m0fnu}
