"""A CPU model of the checks torch's CUDA grouped GEMMs make, read from torch's sources.

Modeled on torch 2.13.0's sources (the headers ship in the wheel:
``torch/include/ATen/native/GroupedMMUtils.h``,
``torch/include/ATen/native/cuda/GroupMMCommon.cuh``; and the same tree's
``aten/src/ATen/native/cuda/GroupedBlas.cpp``, ``GroupMM.cu``, ``ScaledGroupMM.cu``):

- host checks (``_grouped_mm_validate_inputs``, ``check_valid_strides_and_return_transposed``,
  ``_scaled_grouped_mm_cuda``, ``_check_scales_fp8_rowwise``): dtypes, dims, a
  16-byte aligned base pointer, one unit stride and a 16-byte multiple for the other,
  int32 1-D offsets, the fp8 kernel's row-major A and column-major B, K and N multiples
  of 16, fp32 scales of the shapes the kernel reads, bf16 output, and the devices the
  kernels are built for (majors 9 and 10; ``_grouped_mm`` elsewhere takes a fallback
  that reads the offsets on the host, recorded as ``fast=False``);
- device asserts (``prepare_grouped_gemm_data``, one thread per group): every group's
  size ``delta >= 0``; for every group but the last, a size that moves a TMA address
  along the jagged dim a multiple of 16 bytes (2-D × 2-D: A when row-major, B when
  column-major; 2-D × 3-D: A when column-major; 3-D × 2-D: B when row-major, and the
  output); the offsets within the operands; and, computed here from the same pointer
  arithmetic, each group's base address of A, B and the output 16-byte aligned.
  ``strict_empty`` adds an older kernel's rule (``GroupMMCommon.cuh`` before the
  ``delta >= 0`` form): in the 2-D × 2-D case an empty group is refused unless A is
  column-major and B row-major.

A call that passes runs torch's own meta kernel on meta tensors of the same sizes and
strides (its shape and dtype must match), then computes the product on the CPU
(``_grouped_mm``'s CPU kernel; ``_scaled_grouped_mm``: codes times scales in fp32, the
scales applied as the kernel's epilogue applies them). What the CUDA kernels leave
unwritten (rows past the last offset; an empty group's 2-D × 2-D output) is NaN here,
so a caller that reads it fails.
"""

from __future__ import annotations

import dataclasses

import torch

from mixprec.experts import grouped as gr
from mixprec.experts import scaled_grouped as sg

__all__ = ["CudaCheckError", "CudaGroupedModel", "Call", "stand_in"]

_REAL_GROUPED = torch._grouped_mm
_REAL_SCALED = torch._scaled_grouped_mm
_E4M3 = torch.float8_e4m3fn


class CudaCheckError(RuntimeError):
    """A check torch's CUDA grouped GEMM would fail (host: an error; device: an assert
    that poisons the CUDA context)."""


@dataclasses.dataclass(frozen=True)
class Call:
    op: str
    layout: str  # "2d-3d", "2d-2d", ...
    a_row_major: bool
    b_row_major: bool
    fast: bool  # the CUTLASS kernel (False: the fallback that reads offs on the host)
    groups: int


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise CudaCheckError(msg)


def _transposed(mat: torch.Tensor) -> bool:
    """``check_valid_strides_and_return_transposed``: True for column-major."""
    end = mat.dim() - 1
    align = 16 // mat.element_size()
    st, sz = mat.stride(), mat.shape
    _check(mat.data_ptr() % 16 == 0, "expected data_ptr to be aligned to 16 bytes")
    if st[end - 1] == 1 and st[end] >= max(1, sz[end - 1]):
        _check(st[end] % align == 0, "strides should be multiple of 16 bytes")
        return True
    if st[end] == 1 and st[end - 1] >= max(1, sz[end]):
        _check(st[end - 1] % align == 0, "strides should be multiple of 16 bytes")
        return False
    raise CudaCheckError(f"Invalid strides/sizes, got {st} for strides and {tuple(sz)} "
                         "for sizes")


def _meta(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _out_strides(shape: list[int], dtype: torch.dtype, same_dims: bool) -> list[int]:
    """``create_grouped_gemm_output_tensor``'s strides: the last dim padded to 16 bytes."""
    align = 16 // dtype.itemsize
    padded = -(-shape[-1] // align) * align
    return [shape[1] * padded, padded, 1] if same_dims else [padded, 1]


class CudaGroupedModel:
    """Stands in for ``torch._grouped_mm`` and ``torch._scaled_grouped_mm`` on a CUDA
    device of compute ``capability``; ``calls`` lists what it was asked."""

    def __init__(self, capability: tuple[int, int] = (9, 0), strict_empty: bool = True):
        self.capability, self.strict_empty = capability, strict_empty
        self.calls: list[Call] = []

    # -- host checks --------------------------------------------------------------------

    def _common(self, a, b, offs, bias):
        _check(a.dim() in (2, 3) and b.dim() in (2, 3), "mat_a/mat_b has to be 2 or 3d")
        if a.dim() == 3 or b.dim() == 3:
            _check(a.shape[-1] == b.shape[-2],
                   "contraction dimension of mat_a and mat_b must match")
        _check((offs is not None) == (a.dim() == 2 or b.dim() == 2),
               "Have to provide offsets if there is a 2d matrix")
        if offs is not None:
            _check(offs.dim() == 1, "offs has to be 1D")
            _check(offs.dtype == torch.int32, "Offsets have to be int32")
        _check(bias is None, "Bias not supported yet")
        if a.dim() == 2 and b.dim() == 3:
            _check(offs.shape[0] == b.shape[0], "matrix batch sizes have to match")

    def grouped_mm(self, mat_a, mat_b, offs=None, bias=None, out_dtype=None):
        """``_grouped_mm_cuda``."""
        ok = (torch.bfloat16, torch.float32, torch.float16)
        _check(mat_a.dtype in ok and mat_b.dtype in ok,
               f"Expected mat_a/mat_b to be Float32, BFloat16 or Float16, got "
               f"{mat_a.dtype}, {mat_b.dtype}")
        self._common(mat_a, mat_b, offs, bias)
        _transposed(mat_a), _transposed(mat_b)
        _check((out_dtype or mat_a.dtype) == mat_a.dtype,
               "Grouped gemm output dtype must match `mat_a` dtype")
        fast = (self.capability[0] in (9, 10) and mat_a.dtype == torch.bfloat16
                and mat_b.dtype == torch.bfloat16)
        if fast:
            self._device(mat_a, mat_b, offs, mat_a.dtype, torch.bfloat16)
        self._record("_grouped_mm", mat_a, mat_b, offs, fast)
        want = _REAL_GROUPED(_meta(mat_a), _meta(mat_b), offs=_meta(offs)) if fast else None
        out = _REAL_GROUPED(mat_a, mat_b, offs=offs)
        return self._unwritten(out, want, mat_a, mat_b, offs)

    def scaled_grouped_mm(self, mat_a, mat_b, scale_a, scale_b, offs=None, bias=None,
                          scale_result=None, out_dtype=None, use_fast_accum=False):
        """``_scaled_grouped_mm_cuda`` on its fp8 rowwise (fp32 scales) kernel."""
        _check(self.capability[0] in (9, 10), "torch._scaled_grouped_mm is only supported "
               "on CUDA devices with compute capability = [9.0, 10.0], or ROCm MI300+")
        _check(not _transposed(mat_a), "Expected mat1 to not be transposed")
        _check(_transposed(mat_b), "Expected mat2 to be transposed")
        self._common(mat_a, mat_b, offs, bias)
        _check(mat_a.shape[-1] % 16 == 0,
               f"Expected trailing dimension of mat_a to be divisible by 16 but got "
               f"mat1 shape: ({tuple(mat_a.shape)}).")
        _check(mat_b.shape[-2] % 16 == 0 and mat_b.shape[-1] % 16 == 0,
               f"Expected mat_b shape to be divisible by 16 but got mat_b shape: "
               f"({tuple(mat_b.shape)}).")
        _check(scale_result is None, "Scale result not supported yet")
        _check(scale_a.dtype == torch.float32 and scale_b.dtype == torch.float32,
               "For FP8 tensorwise and rowwise, both scales must both be float32 tensors.")
        mult = offs.shape[0] if mat_a.dim() == 2 and mat_b.dim() == 2 else 1
        for mat, scale, dim, i in ((mat_a, scale_a, 0, 0), (mat_b, scale_b, 1, 1)):
            if mat.dim() == 2:
                _check(scale.dim() == 1, f"scale must be a 1D tensor, arg {i}")
                _check(scale.is_contiguous(), f"scale must be contiguous for arg {i}")
                _check(scale.shape[0] == mat.shape[dim] * mult,
                       f"scale must have the same length as mat for arg {i}")
            else:
                _check(scale.dim() == 2, f"scale must be a 2D tensor for arg {i}")
                _check(scale.stride(1) == 1, "scale must be contiguous in the last "
                       f"dimension for arg {i}")
                _check(scale.shape[0] == mat.shape[0], "scale must have the same batch "
                       f"dimension as mat for arg {i}")
                _check(scale.shape[1] == mat.shape[1 + dim], "scale must have the same "
                       f"first dimension as mat for arg {i}")
        _check((out_dtype or torch.bfloat16) == torch.bfloat16,
               "Only bf16 high precision output types are supported for grouped gemm")
        _check(mat_a.dtype == _E4M3 and mat_b.dtype == _E4M3,
               f"Expected mat_a/mat_b to be Float8_e4m3 matrix got {mat_a.dtype}")
        self._device(mat_a, mat_b, offs, _E4M3, torch.bfloat16)
        self._record("_scaled_grouped_mm", mat_a, mat_b, offs, True)
        want = _REAL_SCALED(_meta(mat_a), _meta(mat_b), _meta(scale_a), _meta(scale_b),
                            offs=_meta(offs), out_dtype=torch.bfloat16)
        out = self._scaled_reference(mat_a, mat_b, scale_a, scale_b, offs)
        return self._unwritten(out, want, mat_a, mat_b, offs)

    # -- device asserts -----------------------------------------------------------------

    def _device(self, a, b, offs, dtype_in, dtype_out):
        """``prepare_grouped_gemm_data``, one loop step per CUDA thread (group)."""
        a_row, b_row = a.stride(-1) == 1, b.stride(-1) == 1
        m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
        if a.dim() == 2 and b.dim() == 2:
            groups, k = offs.shape[0], -1
        elif a.dim() == 2:
            groups, m = b.shape[0], -1
        elif b.dim() == 2:
            groups, n = a.shape[0], -1
        else:
            groups = a.shape[0]
        _check(groups < 1024, "Can't process more than 1024 groups")
        if offs is None:
            return
        ends = offs.tolist()
        out_shape = ([a.shape[0], b.shape[-1]] if m < 0 else [a.shape[1], b.shape[1]]
                     if n < 0 else [groups, a.shape[0], b.shape[1]])
        out_stride = _out_strides(out_shape, dtype_out, a.dim() == b.dim())
        sa, sb = a.stride(), b.stride()
        ia, ib, io = a.element_size(), b.element_size(), dtype_out.itemsize
        for tid in range(groups):
            start = 0 if tid == 0 else ends[tid - 1]
            delta = ends[tid] - start
            _check(delta >= 0, "expected gemm dimension to be greater or equal 0")
            if self.strict_empty and k < 0 and not (not a_row and b_row):
                _check(delta > 0, "expected offsets to be greater than 0 (an empty group "
                       "in a 2-D x 2-D product whose A is not column-major)")
            if tid < groups - 1:
                msg = "expected {} tensor dynamic dimension byte size to be non-negative " \
                      "multiple of 16 (group {} of {} rows)"
                if (k < 0 and a_row) or (m < 0 and not a_row):
                    _check(delta % (16 // ia) == 0, msg.format("input", tid, delta))
                if (k < 0 and not b_row) or (n < 0 and b_row):
                    _check(delta % (16 // ib) == 0, msg.format("input", tid, delta))
                if n < 0:
                    _check(delta % (16 // io) == 0, msg.format("output", tid, delta))
            if m < 0:
                _check(ends[tid] <= a.shape[0], "expected offset to be less than tensor size")
                pa, pb, po = start * sa[0] * ia, tid * sb[0] * ib, start * out_stride[0] * io
            elif n < 0:
                _check(ends[tid] <= b.shape[1], "expected offset to be less than tensor size")
                pa, pb, po = tid * sa[0] * ia, start * sb[1] * ib, start * io
            else:
                _check(ends[tid] <= a.shape[1] and ends[tid] <= b.shape[0],
                       "expected offset to be less than tensor size")
                pa, pb, po = start * sa[1] * ia, start * sb[0] * ib, tid * out_stride[0] * io
            for name, base, off in (("A", a.data_ptr(), pa), ("B", b.data_ptr(), pb),
                                    ("output", 0, po)):
                _check((base + off) % 16 == 0, f"group {tid}'s {name} address is not "
                       "16-byte aligned (TMA)")

    # -- results ------------------------------------------------------------------------

    def _record(self, op, a, b, offs, fast):
        layout = f"{a.dim()}d-{b.dim()}d"
        groups = offs.shape[0] if offs is not None else a.shape[0]
        self.calls.append(Call(op, layout, a.stride(-1) == 1, b.stride(-1) == 1, fast,
                               groups))

    @staticmethod
    def _scaled_reference(a, b, scale_a, scale_b, offs):
        """2-D × 3-D: each group's rows, the fp32 accumulator times A's row scale, then
        B's column scale (the epilogue's order), rounded once to bf16."""
        _check(a.dim() == 2 and b.dim() == 3, "this model covers the 2-D x 3-D case only")
        out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.bfloat16)
        start = 0
        for g, end in enumerate(offs.tolist()):
            acc = a[start:end].float() @ b[g].float()
            out[start:end] = (scale_b[g].float() * (scale_a[start:end, None].float() * acc)
                              ).to(torch.bfloat16)
            start = end
        return out

    @staticmethod
    def _unwritten(out, want, a, b, offs):
        """``out`` with what the CUDA kernel does not write set to NaN; its shape and
        dtype checked against torch's meta kernel (``want``)."""
        if want is not None:
            _check(tuple(want.shape) == tuple(out.shape) and want.dtype == out.dtype,
                   f"meta kernel: {tuple(want.shape)} {want.dtype}, model: "
                   f"{tuple(out.shape)} {out.dtype}")
        out = out.clone()
        ends = offs.tolist() if offs is not None else []
        if a.dim() == 2 and b.dim() == 3:
            out[(ends[-1] if ends else 0):] = float("nan")
        elif a.dim() == 2 and b.dim() == 2:
            for g, (s, e) in enumerate(zip([0, *ends[:-1]], ends)):
                if s == e:
                    out[g] = float("nan")
        return out


def stand_in(monkeypatch, capability: tuple[int, int] = (9, 0),
             strict_empty: bool = True) -> CudaGroupedModel:
    """The CPU standing in for a GPU of ``capability``: the experts take their GPU routes
    (``bf16_only``, the capability monkeypatched) and torch's grouped kernels are
    replaced by the model of their CUDA checks, which is returned."""
    model = CudaGroupedModel(capability, strict_empty=strict_empty)
    monkeypatch.setattr(gr, "bf16_only", lambda device: True)
    monkeypatch.setattr(sg, "_capability", lambda device: capability)
    monkeypatch.setattr(torch, "_grouped_mm", model.grouped_mm)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", model.scaled_grouped_mm)
    return model
