"""The one-shot GPU run (benchmarks/gpu.sh) and what it stands on: its dry run on this
CPU, a crashed or interrupted step, the preflight's checks and budget, one bench
recipe per process, the per-test time box, and the bench building one recipe at a
time on its device."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch

from conftest import benchmark
from mixprec.recipe import BLOCK_SCALINGS, Recipe
from mixprec.workbench import GPT

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ROOT = Path(__file__).resolve().parents[1]
FILES = {"summary.txt", "preflight.jsonl", "tests.xml", "tests.log", "bench.jsonl",
         "plan.txt", "nvidia-smi.csv", "rest.tar.gz"}


def test_gpu_recipes_parse_and_the_dequantizing_ones_come_last():
    listed = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_bench.py"),
                             "--list"], capture_output=True, text=True, timeout=60)
    rows = [line.split("\t") for line in listed.stdout.splitlines()]
    recipes = [Recipe.coerce(r) for r, _ in rows]
    assert len(recipes) == 11 and all(int(box) >= 20 for _, box in rows)
    block = [r.compute == "fp8" and r.fp8_scaling in BLOCK_SCALINGS for r in recipes]
    assert block == [False] * 8 + [True] * 3


def test_gpu_bench_writes_its_line_when_the_recipe_fails_or_is_interrupted(
        tmp_path, monkeypatch, capsys):
    import mixprec.workbench.bench as bench_mod

    mod = benchmark("gpu_bench")
    out = tmp_path / "bench.jsonl"
    args = ["--device", "cpu", "--size", "tiny", "--out", str(out)]
    assert mod.main(["--recipe", "no-such-recipe", *args]) == 1

    def interrupted(*a, **k):
        raise KeyboardInterrupt("SIGTERM")

    monkeypatch.setattr(bench_mod, "bench", interrupted)
    assert mod.main(["--recipe", "bf16", *args]) == 1
    a, b = (json.loads(x) for x in out.read_text().splitlines())
    assert a["status"] == "error" and a["error"].startswith("ValueError")
    assert "no-such-recipe" in a["error"] and "Traceback" in a["traceback"]
    assert b["status"] == "error" and b["error"].startswith("interrupted (SIGTERM)")
    assert capsys.readouterr().out.count("\n") == 2  # each line printed too


def _dequant_kernel(a, b, out_dtype, kind):
    return (a.dequant() @ b.dequant()).to(out_dtype)


@pytest.mark.parametrize("name", ["block:fwd:fp32:M=30", "mx:dgrad:bf16:M=30",
                                  "nvfp4:wgrad:fp32:M=200"])
def test_preflight_block_check_measures_the_kernel_against_float64(monkeypatch, name):
    """The block checks on this CPU with a stand-in kernel: the exact dequantizing
    GEMM reads ~0 error, one 1% off reads 1%, one that raises is an error line."""
    import mixprec.fp8.scaled_mm as sm

    pf = benchmark("gpu_preflight")
    monkeypatch.setattr(sm, "block_scaled_mm", _dequant_kernel)
    good = pf.run_check(name, "cpu")
    tol = 4e-3 if ":bf16:" in name else 1e-6
    assert good["status"] == "ok" and good["rel_err"] < tol and good["finite"]
    m = int(name.rsplit("=", 1)[1])
    tokens = 208 if name.startswith("nvfp4:wgrad") else m  # the 16x16 Hadamard pads them
    assert good["shape"] == {"fwd": [m, 200, 136], "dgrad": [m, 136, 200],
                             "wgrad": [136, tokens, 200]}[name.split(":")[1]]
    monkeypatch.setattr(sm, "block_scaled_mm", lambda *a: _dequant_kernel(*a) * 1.01)
    assert pf.run_check(name, "cpu")["rel_err"] == pytest.approx(0.01, abs=4e-3)

    def raising(*a):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(sm, "block_scaled_mm", raising)
    bad = pf.run_check(name, "cpu")
    assert bad["status"] == "error" and "illegal memory access" in bad["error"]


def test_preflight_keeps_its_budget_and_skips_cuda_checks_on_a_cpu(tmp_path, monkeypatch):
    """A check that hangs is killed when the budget ends and the one behind it is
    marked not run; on a CPU the CUDA-only checks are skipped without a process."""
    pf = benchmark("gpu_preflight")
    real = subprocess.Popen
    monkeypatch.setattr(pf.subprocess, "Popen",
                        lambda cmd, **kw: real(["sleep", "30"], **kw))
    out = tmp_path / "pf.jsonl"
    t = time.monotonic()
    assert pf.run_all("cuda", str(out), budget=2, jobs=1, timeout=30,
                      only=["env", "probe:mx"]) == 1
    assert time.monotonic() - t < 10
    a, b = (json.loads(x) for x in out.read_text().splitlines())
    assert a["check"] == "env" and a["error"].startswith("timed out after")
    assert b == {"check": "probe:mx", "status": "skipped",
                 "reason": "not run: the preflight budget of 2 s ended"}

    out2 = tmp_path / "cpu.jsonl"
    assert pf.run_all("cpu", str(out2), 5, 1, 5, only=["probe:nvfp4", "fp8:rowwise:bf16:M=1"
                                                       ]) == 0
    assert [json.loads(x)["reason"] for x in out2.read_text().splitlines()] == [
        "skipped: no CUDA (device cpu)"] * 2
    died = pf._child_line("env", -11, "", "Fatal Python error: Segmentation fault")
    assert died["error"].endswith("exit -11 (SIGSEGV)") and "Fatal" in died["stderr"]


def test_time_box_plugin_fails_a_slow_test_and_runs_the_rest(tmp_path):
    (tmp_path / "test_two.py").write_text(
        "import time\n\ndef test_slow():\n    time.sleep(30)\n\n"
        "def test_fast():\n    assert True\n")
    t = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "pytest_time_box", "--time-box", "1",
         "-p", "no:cacheprovider", "test_two.py"], cwd=tmp_path, capture_output=True,
        text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT / "benchmarks")})
    assert run.returncode == 1 and time.monotonic() - t < 20, run.stdout[-2000:]
    assert "ran past its time box of 1 s" in run.stdout
    assert "1 failed, 1 passed" in run.stdout


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
