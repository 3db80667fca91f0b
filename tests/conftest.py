"""Shared test helpers: small models of several kinds, and CUDA skipping."""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch
from torch import nn

from mixprec.engine.devices import EMULATE_ENV
from mixprec.workbench import GPT, GPTConfig

# Tests that need other processes (distributed ranks, runs killed with SIGKILL) fork them
# from a forkserver that has imported torch, mixprec and the child functions once. A
# child then starts in ~0.2 s instead of ~6 s of interpreter start and imports (torch's
# optimizers import torch._dynamo on construction, ~3 s), and is still a fresh process
# forked from a server that has run nothing. The server is single-threaded, so the fork
# is safe. The command-line and torchrun tests still start real interpreters.
multiprocessing.set_forkserver_preload(
    ["torch", "torch._dynamo", "torch.distributed.fsdp", "mixprec", "mixprec.workbench.train",
     "dist_workers", "tp_workers", "tp_fp8_workers", "tp_loop_workers",
     "children"])


def pytest_addoption(parser):
    parser.addoption(
        "--path", choices=("auto", "real", "emulated"), default="auto",
        help="the 16-bit path every emulate=auto choice takes in this run and in the "
             "processes it starts: 'real' bf16/fp16 kernels, 'emulated' on fp32 kernels, "
             "or 'auto' (measured on this CPU). Sets MIXPREC_EMULATE.")
    parser.addoption(
        "--long", action="store_true", default=False,
        help="also run the tests marked `long` (many-step trainings and multi-rank "
             "cases; CI runs them in a pass of their own: `./dev test --long -m long`)")


def pytest_configure(config):
    # before any child process starts (the forkserver inherits the environment)
    path = config.getoption("--path")
    if path != "auto":
        os.environ[EMULATE_ENV] = "off" if path == "real" else "on"


def pytest_report_header(config):
    from mixprec.engine.devices import has_fast_kernels

    pinned = os.environ.get(EMULATE_ENV)
    real = has_fast_kernels("cpu", "bf16")
    return (f"mixprec 16-bit path: {'real kernels' if real else 'emulated'} "
            f"({EMULATE_ENV}={pinned})" if pinned else
            f"mixprec 16-bit path: {'real kernels' if real else 'emulated'} (measured, "
            f"{torch.backends.cpu.get_cpu_capability()})")


def pytest_collection_modifyitems(config, items):
    long = pytest.mark.skip(reason="a long test: run with --long (CI's own pass)")
    cuda = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
    for item in items:
        if "long" in item.keywords and not config.getoption("--long"):
            item.add_marker(long)
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(cuda)


def require_cpu_scaled_mm() -> None:
    """Skip the calling test unless torch._scaled_mm runs on this CPU now. Under
    ``ONEDNN_MAX_CPU_ISA=AVX2`` on an AVX-512 chip (the mimic of a CPU without bf16
    units) oneDNN stops creating its fp8 matmul once a 16-bit matmul has run."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    one = torch.ones(())
    try:
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._scaled_mm does not run on this CPU here: {str(e)[:80]}")


@pytest.fixture
def measured(monkeypatch):
    """No pinned path (``--path``): for tests of what ``auto`` measures and decides."""
    monkeypatch.delenv(EMULATE_ENV, raising=False)


@pytest.fixture
def gemm_timer(monkeypatch):
    """``gemm_timer(one_thread, loaded)``: the matmul timer of ``mixprec.engine.devices`` reads
    GFLOP/s by torch dtype, ``one_thread[dtype]`` on one thread and ``loaded[dtype]`` on
    two, as a multi-threaded GEMM does on a host whose other core is busy (it waits at
    its barriers). For bf16/fp16, ``one_thread`` may give a list of (rate, fp32's rate)
    rounds instead: each fp32 call reads the round of the dtype timed just before it.
    No path is pinned; the readings' caches are emptied before and after."""
    import itertools

    import mixprec.engine.devices as k

    def clear():
        for cached in (k.matmul_gflops, k._speed_reading, k._route_reading):
            cached.cache_clear()

    monkeypatch.delenv(EMULATE_ENV, raising=False)
    threads = torch.get_num_threads()
    clear()

    def set_rates(one_thread: dict, loaded: dict) -> None:
        fp32 = one_thread[torch.float32]
        rounds = {dt: iter(v) if isinstance(v, list) else itertools.repeat((v, fp32))
                  for dt, v in one_thread.items() if dt != torch.float32}
        last = [(fp32, fp32)]

        def timer(dev, dt, n, seconds):
            if torch.get_num_threads() > 1:
                return loaded[dt]
            if dt == torch.float32:
                return last[0][1]
            last[0] = next(rounds[dt])
            return last[0][0]

        monkeypatch.setattr(k, "_gflops", timer)
        torch.set_num_threads(2)

    yield set_rates
    torch.set_num_threads(threads)
    clear()


#: GFLOP/s on the AMD EPYC with AVX-512 BF16 and no fp16 units, one thread (quiet), and
#: multi-threaded while another process held a core: read in back-to-back runs
EPYC_ONE_THREAD = {torch.float32: 100.0, torch.bfloat16: 200.0, torch.float16: 2.3}
EPYC_LOADED = {torch.float32: 1.4, torch.bfloat16: 2.8, torch.float16: 2.3}


def set_speeds(monkeypatch, rates: dict | None = None, scaled_mm: float = 0.0,
               bf16: float = 1.0, fp16: float = 1.0) -> None:
    """Make every reading of ``mixprec.engine.devices`` (each round alike) see these rates:
    GFLOP/s by torch dtype (fp32, bf16, fp16; else ``bf16`` and ``fp16`` against fp32's
    1.0) and ``torch._scaled_mm``'s."""
    import mixprec.engine.devices as k

    rates = rates or {torch.float32: 1.0, torch.bfloat16: bf16, torch.float16: fp16}
    names = {torch.bfloat16: "bf16", torch.float16: "fp16"}
    monkeypatch.setattr(k, "speed_reading", lambda dev, dt: k.SpeedReading(
        name=names[dt], base="fp32", rounds=(rates[dt] / rates[torch.float32],)))
    monkeypatch.setattr(k, "route_reading", lambda dev, route: k.SpeedReading(
        name="scaled_mm", base=route, rounds=(scaled_mm / rates[
            torch.bfloat16 if route == "dequant" else torch.float32],)))


def ml_dtypes_formats() -> dict:
    """mixprec's format names and ml_dtypes' (or numpy's) types for them: the independent
    reference the format tests round against."""
    import ml_dtypes
    import numpy as np

    return {"bf16": ml_dtypes.bfloat16, "fp16": np.float16,
            "fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2,
            "fp6_e3m2": ml_dtypes.float6_e3m2fn, "fp6_e2m3": ml_dtypes.float6_e2m3fn,
            "fp4_e2m1": ml_dtypes.float4_e2m1fn, "e8m0": ml_dtypes.float8_e8m0fnu}


def mlp(seed: int = 0, d_in: int = 16, hidden: int = 32, d_out: int = 4) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.LayerNorm(hidden), nn.GELU(),
                         nn.Linear(hidden, d_out))


def cnn(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


class LlamaRMSNorm(nn.Module):
    """A third-party style RMSNorm that does the arithmetic by hand (matched by class
    name, as transformers' is)."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class TiedLM(nn.Module):
    """Embedding whose weight is reused as the output head (shared parameter)."""

    def __init__(self, vocab: int = 32, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.mix(self.emb(idx))))


def tiny_gpt(seed: int = 0, **kw) -> GPT:
    torch.manual_seed(seed)
    cfg = dict(vocab=64, seq_len=32, n_layers=2, d_model=32, n_heads=2)
    cfg.update(kw)
    return GPT(GPTConfig(**cfg))


def pattern_losses(engine, model, steps: int, period: int = 5, batch: int = 8,
                   device: str = "cpu", check_applied: bool = False) -> list[float]:
    """Train ``model`` through ``engine`` on a learnable stream (a random pattern of
    ``period`` tokens, repeated, at random offsets) and return the loss per step."""
    g = torch.Generator().manual_seed(0)
    seq = model.config.seq_len
    pattern = torch.randint(0, model.config.vocab, (period,), generator=g)
    losses = []
    for _ in range(steps):
        off = torch.randint(0, period, (batch,), generator=g)
        idx = pattern[(torch.arange(seq + 1)[None] + off[:, None]) % period].to(device)
        with engine.autocast():
            loss = model(idx[:, :-1], idx[:, 1:])
        engine.backward(loss)
        result = engine.step()
        if check_applied:
            assert not bool(result.skipped)
        losses.append(loss.item())
    return losses


EXAMPLES = __import__("pathlib").Path(__file__).resolve().parents[1] / "examples"


def free_port() -> int:
    """A TCP port nothing listens on now (for a launcher's rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_rank_records(argv: list[str], record, cwd) -> tuple[dict, dict]:
    """Run an example that trains on 2 processes and writes each rank's JSON record to
    ``record`` (rank 0) and ``record.rank1``; returns both records. The run must succeed
    and both ranks must have seen a world of 2, with the engine's DDP."""
    import json
    import os
    import subprocess
    from pathlib import Path

    run = subprocess.run(argv, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    r0, r1 = (json.loads(Path(p).read_text()) for p in (record, f"{record}.rank1"))
    assert r0["world"] == r1["world"] == 2
    return r0, r1


def benchmark(name: str):
    """The module ``benchmarks/<name>.py``, loaded from its file (benchmarks are scripts,
    not a package), for tests that run a benchmark's measurement."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
