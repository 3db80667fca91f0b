"""Number formats: the element table (``elements``: fp32 down to fp8, fp6, fp4 and the
e8m0 scale, exact rounding) is the single source of truth about bits."""

from mixprec.formats.elements import (
    FORMATS,
    Format,
    bits,
    dtype_of,
    get,
    name_of,
    names,
    quantize,
    survival_bound,
    ulp,
)

__all__ = ["Format", "FORMATS", "get", "names", "dtype_of", "name_of", "quantize", "ulp",
           "survival_bound", "bits"]
