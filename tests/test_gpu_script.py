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
import tarfile
import time
import weakref
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from conftest import benchmark
from mixprec.recipe import Recipe
from mixprec.workbench import GPT

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ROOT = Path(__file__).resolve().parents[1]
FILES = {"summary.txt", "preflight.jsonl", "tests.xml", "tests.log", "bench.jsonl",
         "plan.txt", "nvidia-smi.csv", "rest.tar.gz"}


def gpu_sh(out: Path, **env) -> tuple[subprocess.CompletedProcess, float]:
    """``bash benchmarks/gpu.sh --dry-run`` into ``out`` with this interpreter."""
    t = time.monotonic()
    run = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--dry-run"],
                         env={**os.environ, "OUT": str(out), "PY": sys.executable, **env},
                         capture_output=True, text=True, timeout=600)
    return run, time.monotonic() - t


def summary(out: Path) -> tuple[dict[str, tuple[str, float, str]], list[str]]:
    """summary.txt's steps (name -> exit, wall seconds, note) and its comment lines."""
    steps, notes = {}, []
    for line in (out / "summary.txt").read_text().splitlines():
        if line.startswith("#"):
            notes.append(line)
        else:
            name, rc, wall, note = line.split("\t")
            steps[name] = (rc, float(wall), note)
    return steps, notes


@pytest.mark.long  # every step of the GPU script, dry: about 40 s on a 2-core CPU
def test_dry_run_writes_every_file_and_a_crashed_step_costs_only_its_own(tmp_path):
    """The whole run on this CPU, bench's first recipe crashing (SIGSEGV): every result
    file is there, 8 at most; every step has its exit code and wall time; the other
    recipe's line, the preflight's lines and the JUnit file are complete."""
    pf = benchmark("gpu_preflight")
    run, took = gpu_sh(tmp_path, MIXPREC_GPU_SH_RECIPES="bf16;mxfp8",
                       MIXPREC_GPU_SH_FAIL="bench:bf16")
    assert run.returncode == 0, run.stderr[-3000:]
    assert {p.name for p in tmp_path.iterdir()} == FILES
    steps, notes = summary(tmp_path)
    assert list(steps) == ["env", "preflight", "tests", "compile", "grouped",
                           "bench:bf16", "bench:mxfp8", "plan"]
    assert steps["bench:bf16"][0] == "139"  # 128 + SIGSEGV
    for name in ("env", "preflight", "tests", "compile", "grouped", "bench:mxfp8"):
        assert steps[name][0] == "0", (name, steps[name], run.stdout[-2000:])
    # the planner's survey may outrun its 30 s box on a loaded 2-core host: then SIGINT
    assert steps["plan"][0] in ("0", "124") and (tmp_path / "plan.txt").stat().st_size
    assert all(0 <= wall <= 70 for _, wall, _ in steps.values())  # boxes of 60 s at most
    assert notes[-1].endswith("finished") and took < 420

    lines = [json.loads(x) for x in (tmp_path / "bench.jsonl").read_text().splitlines()]
    bench = [b for b in lines if b.get("bench") != "grouped_gemm"]
    assert [b["recipe"] for b in bench] == ["bf16", "mxfp8"]
    # the grouped GEMM: both baselines and every format's loop and grouped routes, each
    # checked against its loop route (on a CPU the grouped route's products are the
    # loop's, so the gradients agree to an fp32 rounding; NVFP4 checked in its
    # round-to-nearest twin: the routes draw their random numbers differently)
    grouped = {(g["format"], g["route"]): g for g in lines if g.get("bench") == "grouped_gemm"}
    assert len(grouped) == 2 + 2 * 6 and all(g["status"] == "ok" for g in grouped.values())
    assert all(g["vs_loop"] < 2e-2 and g["ms"] > 0 for g in grouped.values()
               if g["format"] != "bf16")
    assert bench[0]["status"] == "error" and "exit 139" in bench[0]["error"]
    ok = bench[1]
    assert ok["status"] == "ok" and ok["step_ms"] > 0 and ok["tokens_per_s"] > 0
    assert ok["fp8_routes"] == {"dequant_fp32": 8}  # 2 blocks x qkv, proj, fc, out
    assert ok["max_memory_allocated"] is None and ok["probe_route"] == "dequant_fp32"

    lines = [json.loads(x) for x in (tmp_path / "preflight.jsonl").read_text().splitlines()]
    assert sorted(x["check"] for x in lines) == sorted(pf.checks())
    for x in lines:
        left_out = x["check"].split(":")[0] in pf.CUDA_ONLY or x["check"] in pf.CPU_SKIP
        assert x["status"] == ("skipped" if left_out else "ok"), x
    assert {x["check"] for x in lines if x["status"] == "ok"} == {
        "env", "engine:mxfp8", "tf32-legacy:allow_tf32", "tf32-legacy:high"}
    env = next(x for x in lines if x["check"] == "env")
    assert env["torch"] == torch.__version__ and "fp32_precision_state" in env

    cases = ET.parse(tmp_path / "tests.xml").getroot().iter("testcase")
    names = [c.get("name") for c in cases]
    assert names and not any("compile" in n for n in names)
    with tarfile.open(tmp_path / "rest.tar.gz") as tar:
        packed = {Path(n).name for n in tar.getnames()}
    assert {"env.txt", "preflight.log", "grouped.log", "bench-bf16.log",
            "bench-mxfp8.log", "compile.xml"} <= packed


def test_sigterm_mid_run_leaves_the_summary_and_names_what_did_not_run(tmp_path):
    """The script told to stop as the preflight starts: the step is interrupted, the
    steps after it are listed as not run, each recipe has its line, the logs are
    packed, and the script exits with SIGTERM's status."""
    run, _ = gpu_sh(tmp_path, MIXPREC_GPU_SH_RECIPES="bf16;mxfp8",
                    MIXPREC_GPU_SH_KILL="preflight")
    assert run.returncode == 143, run.stderr[-2000:]
    steps, notes = summary(tmp_path)
    assert steps["env"][0] == "0"
    assert steps["preflight"][2] == "interrupted: the script got SIGTERM"
    for name in ("tests", "compile", "grouped", "bench:bf16", "bench:mxfp8", "plan"):
        assert steps[name][:1] == ("none",) and "not run" in steps[name][2]
    assert notes[-1].endswith("interrupted by SIGTERM")
    names = {p.name for p in tmp_path.iterdir()}
    assert len(names) <= 8 and {"summary.txt", "rest.tar.gz", "bench.jsonl"} <= names
    bench = [json.loads(x) for x in (tmp_path / "bench.jsonl").read_text().splitlines()]
    assert [(b["recipe"], b["status"]) for b in bench] == [("bf16", "skipped"),
                                                           ("mxfp8", "skipped")]
    with tarfile.open(tmp_path / "rest.tar.gz") as tar:
        assert "env.txt" in {Path(n).name for n in tar.getnames()}


def test_gpu_recipes_parse_and_the_dequantizing_ones_come_last():
    listed = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_bench.py"),
                             "--list"], capture_output=True, text=True, timeout=60)
    rows = [line.split("\t") for line in listed.stdout.splitlines()]
    recipes = [Recipe.coerce(r) for r, _ in rows]
    assert len(recipes) == 11 and all(int(box) >= 20 for _, box in rows)
    block = [r.block_scaled for r in recipes]
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
        "import signal, time\n\ndef test_slow():\n    time.sleep(30)\n\n"
        "def test_fast():  # its own box is armed, the slow test's is gone\n"
        "    assert 0.0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 1.0\n"
        "    assert signal.getsignal(signal.SIGALRM) is not signal.SIG_DFL\n")
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
    out = bench_mod.bench(["fp32", "mxfp8"], size="tiny", batch=2, seq=32, steps=1,
                          warmup=0)
    assert alive_at_build == [0, 0]  # was [0, 2]: fp32's model and its twin's
    fp32, mx = out["rows"]
    assert fp32["fp8_routes"] == {}
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


def test_grouped_gemm_bench_reports_a_failing_route_and_goes_on(monkeypatch):
    """One route raising (fp8's grouped) gives its row the error; every other case is
    checked and timed: the grouped routes equal the loop's products on a CPU."""
    mod = benchmark("grouped_gemm")
    inner = mod.grouped_mm

    def failing(x, w, offs, fmt, route, out_dtype):
        if fmt.format_name == "fp8" and route == "grouped":
            raise RuntimeError("no kernel")
        return inner(x, w, offs, fmt, route=route, out_dtype=out_dtype)

    monkeypatch.setattr(mod, "grouped_mm", failing)
    args = mod.argparse.Namespace(device="cpu", tokens=40, k=32, n=64, repeats=1,
                                  formats=["fp8", "fp8-current"])
    rows = {(r["format"], r["route"]): r for r in mod.bench(args, 4)}
    assert list(rows) == [("bf16", "torch._grouped_mm"), ("bf16", "loop"), ("fp8", "loop"),
                          ("fp8", "grouped"), ("fp8-current", "loop"),
                          ("fp8-current", "grouped")]
    assert rows[("fp8", "grouped")]["status"] == "error"
    assert "RuntimeError: no kernel" in rows[("fp8", "grouped")]["error"]
    ok = [r for k, r in rows.items() if k != ("fp8", "grouped")]
    assert all(r["status"] == "ok" and r["ms"] > 0 for r in ok)
    assert rows[("fp8", "loop")]["vs_loop"] == 0
    assert 0 < rows[("fp8-current", "grouped")]["vs_loop"] < 2e-2  # bf16 output roundings
    # e4m3 against float64: a few percent; the bf16 baselines far closer
    assert 1e-2 < rows[("fp8", "loop")]["vs_fp64"] < 0.1
    assert rows[("bf16", "loop")]["vs_fp64"] < 1e-2
