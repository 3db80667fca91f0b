"""Numerics diagnostics: per-layer statistics, non-finite tracing, the fp32 reference
comparison, audits, and the doctor that turns them into advice."""

from mixprec.diagnostics.audit import (
    audit_comm,
    audit_dtypes,
    audit_kernel_speed,
    audit_scale_history,
    matmul_coverage,
)
from mixprec.diagnostics.doctor import doctor
from mixprec.diagnostics.dynamics import WeightWatch, audit_dynamics, divergence
from mixprec.diagnostics.findings import Finding, Report
from mixprec.diagnostics.fp8range import audit_fp8_ranges, fp8_ranges
from mixprec.diagnostics.monitor import NumericsMonitor
from mixprec.diagnostics.reference import compare_to_fp32
from mixprec.diagnostics.timeshare import audit_time_shares, time_shares
from mixprec.diagnostics.trace import trace_nonfinite
from mixprec.diagnostics.updates import audit_vanished_updates, vanished_updates

__all__ = ["doctor", "Finding", "Report", "NumericsMonitor", "trace_nonfinite",
           "compare_to_fp32", "audit_dtypes", "audit_scale_history", "matmul_coverage",
           "audit_kernel_speed", "fp8_ranges", "audit_fp8_ranges", "time_shares",
           "audit_time_shares", "vanished_updates", "audit_vanished_updates", "audit_comm",
           "WeightWatch", "divergence", "audit_dynamics"]
