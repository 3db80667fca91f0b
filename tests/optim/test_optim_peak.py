"""The optimizer step's peak memory, measured: a 4096² parameter's step needs at most
about one byte per parameter above the steady state, under every write rule and state
format, and the engine's whole step on an embedding table stays within the pieces'
scratch, its first step included (benchmarks/optim_peak.py measures the resident set's
high-water mark)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from helpers.paths import benchmark


def _bench():
    return benchmark("optim_peak")


needs_linux = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not Path("/proc/self/clear_refs").exists(),
    reason="measures the resident set's high-water mark through /proc (Linux)")


@needs_linux
def test_the_step_peak_is_at_most_one_byte_per_parameter():
    """Measured ~0.2 B/param for decoded states and ~0.5 for 16-bit writes (the pieces'
    fixed ~8 MiB of scratch over 16.8M parameters); before the step ran in pieces
    these were 20 and 56 to 64 B/param."""
    bench = _bench()
    # the costliest write rule on int8 states, and decoded int8 and int4 states on fp32
    # weights (the benchmark adds sr, kahan, remainder, fp8 and bf16 states, and an
    # embedding-shaped tensor)
    wanted = ("bf16-lean", "int8 states", "int4 states")
    cases = [c for c in bench.CASES if c[0].startswith(wanted)]
    peaks = bench.run_cases((4096, 4096), cases)
    got = {c[0]: round(p, 2) for c, p in zip(cases, peaks)}
    assert all(p <= 1.0 for p in peaks), got


@needs_linux
def test_the_measurement_sees_a_whole_tensor_step():
    """The same measurement of one piece the size of the tensor (512×4096) reads the
    full-size scratch (>= 40 B/param for stochastic writes on int8 states): the bound
    above is the pieces', not a blind spot of the measurement."""
    bench = _bench()
    (lean,) = [c for c in bench.CASES if c[0].startswith("bf16-lean")]
    (peak,) = bench.run_cases((512, 4096), [lean], chunk=1 << 40)
    assert peak >= 40, peak


@needs_linux
@pytest.mark.paths
def test_the_engines_step_on_an_embedding_stays_within_the_pieces_scratch():
    """``MixedPrecision.step()`` under bf16-lean (bf16 gradients, int8 states, stochastic
    writes, max_grad_norm) on a 65536×96 embedding (rows narrower than a state block):
    measured 7.6 to 8.0 MiB above the steady state, and the first step 15 MiB above the
    states it creates, on either 16-bit path. A whole-tensor fp32 temporary of this
    table is 24 MiB: the global norm upcast the bf16 gradient whole (steady steps read
    24 MiB), and the first step decoded and updated the table in one piece (370 to
    390 MiB). (The emulated refresh's bf16 copy, 12 MiB here, is tests/engine/test_master.py's.)"""
    bench = _bench()
    shape = (65536, 96)
    ((first, later),) = bench.run_engine(shape, ["bf16-lean"])
    mib = [round(x * shape[0] * shape[1] / 2**20, 1) for x in (first, later)]
    assert mib[1] <= 16 and mib[0] <= 32, mib
