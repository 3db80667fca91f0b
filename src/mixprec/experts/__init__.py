"""Mixture-of-experts in low precision: the quantized grouped GEMM and the experts hook.

``format`` (ExpertsFormat: one projection's format and scaling state), ``grouped``
(``grouped_mm``: the grouped GEMM, forward and backward, on three routes),
``codes_grouped`` (the GPU routes: bf16 codes, scales after, no host read),
``scaled_grouped`` (torch's fp8 grouped kernel), ``adapter`` (the calls into the
quantizer interface), ``hook`` (transformers' experts modules run ``grouped_mm``
through their own ``ExpertsInterface``), ``dispatch`` (expert parallelism's token
exchange, in the format), ``expert_parallel`` (transformers' experts modules cut over an
EP group).
"""

from mixprec.experts.expert_parallel import ExpertShards, expert_parallel
from mixprec.experts.format import ExpertsFormat, experts_formats
from mixprec.experts.grouped import ROUTES, group_bounds, grouped_mm

__all__ = ["ExpertsFormat", "experts_formats", "grouped_mm", "group_bounds", "ROUTES",
           "expert_parallel", "ExpertShards"]
