"""The one-shot GPU run (benchmarks/gpu.sh) and what it stands on: its dry run on this
CPU, a crashed or interrupted step, the preflight's checks and budget, one bench
recipe per process, the per-test time box, and the bench building one recipe at a
time on its device."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch

from mixprec.workbench import GPT

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ROOT = Path(__file__).resolve().parents[1]
FILES = {"summary.txt", "preflight.jsonl", "tests.xml", "tests.log", "bench.jsonl",
         "plan.txt", "nvidia-smi.csv", "rest.tar.gz"}


class _Tracked(GPT):
    """The workbench GPT, each instance remembered weakly with the default device it
    was built under."""

    live: list = []
    devices: list = []

    def __init__(self, *a, **k):
        _Tracked.devices.append(torch.get_default_device())
        super().__init__(*a, **k)
        _Tracked.live.append(weakref.ref(self))


def test_bench_frees_each_recipe_before_building_the_next(monkeypatch):
    """Each recipe's engine is built with no model of an earlier recipe left (their
    sum, not the largest one, filled a 141 GB GPU); the row says which route each fp8
    Linear took and, off CUDA, has no allocator peak."""
    import mixprec.workbench.bench as bench_mod

    _Tracked.live.clear()
    alive_at_build = []
    real = bench_mod._engine_loop

    def spy(*a, **k):
        gc.collect()
        alive_at_build.append(sum(r() is not None for r in _Tracked.live))
        return real(*a, **k)

    monkeypatch.setattr(bench_mod, "GPT", _Tracked)
    monkeypatch.setattr(bench_mod, "_engine_loop", spy)
    out = bench_mod.bench(["fp32", "mxfp8", "bf16"], size="tiny", batch=2, seq=32,
                          steps=1, warmup=0)
    assert alive_at_build == [0, 0, 0]
    fp32, mx, bf16 = out["rows"]
    assert fp32["fp8_routes"] == {} == bf16["fp8_routes"]
    assert mx["fp8_routes"] == {"dequant_fp32": 8}  # 2 blocks x qkv, proj, fc, out
    assert fp32["max_memory_allocated"] is None and fp32["overhead_vs_hand"] is not None


def test_bench_builds_the_model_on_its_device(monkeypatch):
    import mixprec.workbench.bench as bench_mod

    _Tracked.devices.clear()
    monkeypatch.setattr(bench_mod, "GPT", _Tracked)
    build = bench_mod._workload("gpt", "tiny", 2, 32, torch.device("meta"))[0]
    model = build()
    assert _Tracked.devices == [torch.device("meta")]
    assert {p.device.type for p in model.parameters()} == {"meta"}
