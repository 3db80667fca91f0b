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

from helpers.paths import ROOT, benchmark
from mixprec.recipe import Recipe
from mixprec.workbench import GPT

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

FILES = {"summary.txt", "tables.md", "preflight.jsonl", "tests.xml", "tests.log",
         "bench.jsonl", "nvidia-smi.csv", "rest.tar.gz"}
NEEDS_TWO = ["tp", "fsdp", "ddp"]


def gpu_sh(out: Path, **env) -> tuple[subprocess.CompletedProcess, float]:
    """``bash benchmarks/gpu.sh --dry-run`` into ``out`` with this interpreter."""
    t = time.monotonic()
    run = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--dry-run"],
                         env={**os.environ, "OUT": str(out), "PY": sys.executable, **env},
                         capture_output=True, text=True, timeout=2520)  # the dry budget
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


def plan(*args: str) -> tuple[dict[str, int], list[tuple[str, int]]]:
    """``gpu.sh --plan``: its header's numbers and its (step, box) lines, in order."""
    run = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--plan", *args],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    head, *rest = run.stdout.splitlines()
    words = head.lstrip("# ").replace(",", "").split()
    nums = {words[i]: int(words[i + 1]) for i in range(0, len(words) - 1, 3)}
    return nums, [(n, int(b)) for n, b in (x.split("\t") for x in rest)]


def test_the_plan_fits_its_budget_with_the_most_valuable_figures_first():
    """The GPU plan: boxes that add up to at most the 7 minutes less the summary's
    reserve, the steps in the order of their value, compile last; the dry run's plan
    is the same steps, every box and the budget scaled alike."""
    nums, steps = plan()
    names, boxes = [n for n, _ in steps], [b for _, b in steps]
    assert nums["budget"] == 420 and nums["scale"] == 1
    assert sum(boxes) <= nums["budget"] - nums["summary"]
    assert min(boxes) >= 10 and len(set(names)) == len(names)
    assert names[:3] == ["env", "preflight", "gemm"]
    bench = [n for n in names if n.startswith("bench:")]
    assert names[3:3 + len(bench)] == bench
    recipes = [Recipe.coerce(n[6:]) for n in bench]
    assert str(recipes[0]) == "bf16-master" and {"fp8-current", "int8-rowwise", "mxfp8"} <= {
        n[6:] for n in bench}
    assert [r.block_scaled for r in recipes] == sorted(r.block_scaled for r in recipes)
    rest = names[3 + len(bench):]
    assert rest[:4] == ["moe:fp8-current", "moe:mxfp8", "grouped", "tests"]
    assert rest[4:] and all(n.startswith("compile:") for n in rest[4:])
    dry_nums, dry = plan("--dry-run")
    assert [n for n, _ in dry] == names and dry_nums["scale"] > 1
    assert [b for _, b in dry] == [b * dry_nums["scale"] for b in boxes]
    assert dry_nums["budget"] == nums["budget"] * dry_nums["scale"]


def test_the_script_runs_its_steps_in_the_plans_order():
    """Each step the script runs is a step of the plan, in the plan's order (the plan
    is what the boxes test reads)."""
    text = (ROOT / "benchmarks" / "gpu.sh").read_text()
    body = text[text.index("# ---- the steps"):]
    import re

    called = re.findall(r'^\s*step "?([a-z0-9:$-]+)', body, flags=re.M)
    expanded = []
    for c in called:
        if c == "bench:$r":
            expanded.append("bench:*")
        elif c in ("moe:$r", "compile:$r"):
            expanded += [c.replace("$r", r) for r in (("fp8-current", "mxfp8")
                         if c.startswith("moe") else ("bf16-master", "fp8-current"))]
        else:
            expanded.append(c)
    names = ["bench:*" if n.startswith("bench:") else n for n, _ in plan()[1]]
    assert expanded == [n for i, n in enumerate(names) if n != "bench:*"
                        or names[i - 1] != "bench:*"]


@pytest.mark.long  # every step of the GPU script, dry: 5-15 min on a shared 2-core CPU
def test_dry_run_writes_every_file_and_a_crashed_step_costs_only_its_own(tmp_path):
    """The whole run on this CPU, bench's first recipe crashing (SIGSEGV): every result
    file is there, 8 at most; every step ran within its box with its exit code; the
    other lines (recipes, the MoE steps, the GEMM table, the grouped cases, the
    compiled steps), the preflight's lines and the JUnit file are complete; the summary
    names what one GPU cannot run."""
    pf = benchmark("gpu_preflight")
    run, took = gpu_sh(tmp_path, MIXPREC_GPU_SH_RECIPES="bf16-master;mxfp8",
                       MIXPREC_GPU_SH_FAIL="bench:bf16-master")
    assert run.returncode == 0, run.stderr[-3000:]
    assert {p.name for p in tmp_path.iterdir()} == FILES
    steps, notes = summary(tmp_path)
    nums, planned = plan("--dry-run")
    assert list(steps) == NEEDS_TWO + [n for n, _ in planned if not n.startswith("bench:")
                                       or n[6:] in ("bf16-master", "mxfp8")]
    for n in NEEDS_TWO:
        assert steps[n][0] == "none" and steps[n][2].startswith("not run: needs 2 GPUs")
    assert steps["bench:bf16-master"][0] == "139"  # 128 + SIGSEGV
    box = dict(planned)
    for name, (rc, wall, _) in steps.items():
        if name in NEEDS_TWO or name == "bench:bf16-master":
            continue
        assert rc == "0", (name, steps[name], run.stdout[-2000:])
        assert wall <= box[name] + 6  # within its box (and the grace)
    assert notes[-1].endswith("finished") and took < nums["budget"]

    lines = [json.loads(x) for x in (tmp_path / "bench.jsonl").read_text().splitlines()]
    gpt = [b for b in lines if "recipe" in b and b.get("model") == "gpt"
           and not b.get("compile")]
    assert [b["recipe"] for b in lines if b.get("step") == "bench:bf16-master"] == [
        "bf16-master"]
    crashed = next(b for b in lines if b.get("step") == "bench:bf16-master")
    assert crashed["status"] == "error" and "exit 139" in crashed["error"]
    (ok,) = gpt
    assert ok["recipe"] == "mxfp8" and ok["status"] == "ok" and ok["step_ms"] > 0
    assert ok["fp8_routes"] == {"dequant_fp32": 8}  # 2 blocks x qkv, proj, fc, out
    assert ok["max_memory_allocated"] is None and ok["probe_route"] == "dequant_fp32"
    moe = {b["recipe"]: b for b in lines if b.get("model") == "qwen3_moe"
           and not b.get("compile")}
    assert set(moe) == {"fp8-current", "mxfp8"}
    for r, b in moe.items():  # 2 layers x (gate-up, down): every experts GEMM converted
        assert b["status"] == "ok" and b["finite"], b
        assert sum(b["experts_formats"].values()) == 4
        assert all(f.startswith(r) for f in b["experts_formats"])
    compiled = {(b["model"], b["recipe"]): b for b in lines if b.get("compile")}
    assert set(compiled) == {("gpt", "bf16-master"), ("gpt", "fp8-current"),
                             ("qwen3_moe", "fp8-current")}
    assert all(b["status"] == "ok" and b["compiled_step_ms"] > 0 for b in compiled.values())
    gemm = [b for b in lines if b.get("bench") == "gemm"]
    assert len(gemm) == 2 * 7 and all(b["status"] == "ok" for b in gemm)
    grouped = {b["case"]: b for b in lines if b.get("bench") == "grouped_gemm"}
    assert set(grouped) == {"4:bf16", "4:fp8-current:grouped", "4:mxfp8:grouped"}
    assert all(b["status"] == "ok" for b in grouped.values()), grouped
    # on a CPU the grouped route's products are the loop's: equal to fp32 roundings
    assert all(b["vs_loop"] < 2e-2 for c, b in grouped.items() if c != "4:bf16")
    tables = (tmp_path / "tables.md").read_text()
    for title in ("## GEMMs", "## Workbench GPT, eager", "## Qwen3-MoE", "## Grouped GEMM",
                  "## Compiled against eager", "## Steps without a line of their own"):
        assert title in tables

    lines = [json.loads(x) for x in (tmp_path / "preflight.jsonl").read_text().splitlines()]
    assert sorted(x["check"] for x in lines) == sorted(pf.checks())
    for x in lines:
        left_out = x["check"].split(":")[0] in pf.CUDA_ONLY or x["check"] in pf.CPU_SKIP
        assert x["status"] == ("skipped" if left_out else "ok"), x
    env = next(x for x in lines if x["check"] == "env")
    assert env["torch"] == torch.__version__ and "fp32_precision_state" in env
    assert ET.parse(tmp_path / "tests.xml").getroot().iter("testcase")
    with tarfile.open(tmp_path / "rest.tar.gz") as tar:
        packed = {Path(n).name for n in tar.getnames()}
    assert {"env.txt", "preflight.log", "gemm.log", "grouped.log", "bench-bf16-master.log",
            "bench-mxfp8.log", "moe-mxfp8.log", "compile-moe.log"} <= packed


def test_sigterm_mid_run_leaves_the_summary_and_names_what_did_not_run(tmp_path):
    """The script told to stop as the preflight starts: the step is interrupted, the
    steps after it are listed as not run, each one-recipe step has its line, the logs
    are packed, and the script exits with SIGTERM's status."""
    run, _ = gpu_sh(tmp_path, MIXPREC_GPU_SH_RECIPES="bf16;mxfp8",
                    MIXPREC_GPU_SH_KILL="preflight")
    assert run.returncode == 143, run.stderr[-2000:]
    steps, notes = summary(tmp_path)
    assert steps["env"][0] == "0"
    assert steps["preflight"][2] == "interrupted: the script got SIGTERM"
    later = [n for n, _ in plan()[1]][3:]
    later = [n for n in later if not n.startswith("bench:")]
    for name in ("gemm", "bench:bf16", "bench:mxfp8", *later):
        assert steps[name][:1] == ("none",) and "not run" in steps[name][2]
    assert notes[-1].endswith("interrupted by SIGTERM")
    names = {p.name for p in tmp_path.iterdir()}
    assert len(names) <= 8 and {"summary.txt", "rest.tar.gz", "bench.jsonl"} <= names
    bench = [json.loads(x) for x in (tmp_path / "bench.jsonl").read_text().splitlines()]
    assert [(b["step"], b["status"]) for b in bench] == [
        (n, "skipped") for n in ("bench:bf16", "bench:mxfp8", "moe:fp8-current",
                                 "moe:mxfp8", *(n for n in later if n.startswith("compile")))]
    with tarfile.open(tmp_path / "rest.tar.gz") as tar:
        assert "env.txt" in {Path(n).name for n in tar.getnames()}


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
    import mixprec.formats.scaled_mm as sm

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


def test_grouped_cases_run_one_per_process_and_a_crash_costs_its_line(tmp_path,
                                                                       monkeypatch):
    """The parent lists the cases in a child, runs each in its own, and writes each
    line as the case ends: a case whose process dies (SIGSEGV, as after a device-side
    assert) gets an error line and the next case still runs; the cases left when the
    budget ends are skipped lines; times are put over the bf16 grouped GEMM's."""
    mod = benchmark("gpu_grouped")
    calls, clock = [], [0.0]
    answers = {"8:bf16": (0, {"case": "8:bf16", "status": "ok", "ms": 2.0}),
               "8:fp8-current:grouped": (-11, None),
               "8:mxfp8:grouped": (0, {"case": "8:mxfp8:grouped", "status": "ok",
                                       "ms": 5.0})}

    def run(cmd, **kw):
        calls.append(cmd[cmd.index("--one") + 1] if "--one" in cmd else "--list")
        clock[0] += 10
        if "--list" in cmd:
            return subprocess.CompletedProcess(cmd, 0, "\n".join([*answers, "8:nvfp4:grouped"]),
                                               "")
        rc, line = answers[calls[-1]]
        return subprocess.CompletedProcess(cmd, rc, json.dumps(line) if line else "",
                                           "Fatal Python error: Segmentation fault")

    monkeypatch.setattr(mod.subprocess, "run", run)
    monkeypatch.setattr(mod.time, "monotonic", lambda: clock[0])
    out = tmp_path / "bench.jsonl"
    args = mod.argparse.Namespace(budget=39, timeout=30, out=str(out))
    assert mod.run_all(args, ["--device", "cuda"]) == 1
    assert calls == ["--list", "8:bf16", "8:fp8-current:grouped", "8:mxfp8:grouped"]
    lines = {x["case"]: x for x in map(json.loads, out.read_text().splitlines())}
    assert list(lines) == [*answers, "8:nvfp4:grouped"]
    assert lines["8:fp8-current:grouped"]["error"].endswith("exit -11 (SIGSEGV)")
    assert "Segmentation" in lines["8:fp8-current:grouped"]["stderr"]
    assert lines["8:mxfp8:grouped"]["vs_bf16_grouped"] == 2.5
    assert lines["8:nvfp4:grouped"]["status"] == "skipped"
    assert mod._without(["--out", "x", "--budget=3", "--k", "64"], ("--out", "--budget")) == [
        "--k", "64"]


@pytest.mark.parametrize("fmt,lo,hi", [(None, 0, 1e-2), ("fp8-current", 1e-2, 0.1),
                                       ("int8-rowwise", 1e-3, 3e-2), ("mxfp8", 1e-2, 0.1)])
def test_gemm_table_row_checks_each_format_against_float64(fmt, lo, hi):
    """A row of the GEMM table on this CPU: the format's GEMM against the float64
    product of the unquantized operands: bf16's error under 1%, e4m3's a few percent
    (so the format did apply), int8's in between; times and rates positive."""
    mod = benchmark("gpu_gemm")
    row = mod.row(fmt, 40, 200, 136, torch.device("cpu"), repeats=1)
    assert lo < row["vs_fp64"] < hi, row
    assert row["gemm_ms"] > 0 and row["with_casts_tflops"] > 0
    assert row["format"] == (fmt or "bf16") and (fmt is None) == (row["route"] == "torch.mm")


def test_tables_read_every_kind_of_line(tmp_path):
    (tmp_path / "bench.jsonl").write_text("\n".join(json.dumps(x) for x in [
        {"bench": "gemm", "format": "bf16", "m": 8, "k": 8, "n": 8, "status": "ok",
         "route": "torch.mm", "gemm_ms": 1.0, "with_casts_ms": 1.0, "vs_bf16": 1.0},
        {"bench": "gemm", "format": "nvfp4", "m": 8, "k": 8, "n": 8, "status": "error",
         "error": "RuntimeError: boom"},
        {"recipe": "fp8-current", "model": "gpt", "status": "ok", "step_ms": 12.5,
         "fp8_routes": {"scaled_mm": 48}},
        {"recipe": "mxfp8", "model": "qwen3_moe", "compile": True, "status": "ok",
         "step_ms": 3.0, "compiled_step_ms": 2.0},
        {"step": "moe:mxfp8", "recipe": "mxfp8", "status": "skipped", "error": "not run"},
        {"bench": "grouped_gemm", "case": "8:fp8:grouped", "status": "ok", "ms": 4.0,
         "vs_bf16_grouped": 1.5}]) + "\nnot json\n")
    (tmp_path / "preflight.jsonl").write_text(json.dumps(
        {"check": "mx:fwd:bf16:M=1", "status": "error", "error": "illegal address"}))
    text = "\n".join(benchmark("gpu_tables").tables(tmp_path))
    assert "| 8×8×8 | nvfp4 | RuntimeError: boom |" in text
    assert "| fp8-current | gpt | 12.5 | – |" in text and '{"scaled_mm": 48}' in text
    assert "## Compiled against eager" in text and "| 3.0 | 2.0 |" in text
    assert "| mxfp8 | moe:mxfp8 |" in text and "| 8:fp8:grouped |" in text
    assert "| 1.50x |" in text and "| mx:fwd:bf16:M=1 | error | illegal address |" in text
