"""The kernel-speed probe: measured numbers, cached."""

import torch

from mixprec.kernels import matmul_gflops, relative_speed


def test_probe_measures_and_caches():
    a = matmul_gflops("cpu", torch.float32, 128, 0.01)
    assert a > 0
    assert matmul_gflops("cpu", torch.float32, 128, 0.01) == a  # cached: same number
    assert relative_speed("cpu", torch.float32) == 1.0
