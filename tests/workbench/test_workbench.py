"""The workbench: corpus, training, atomic checkpoints and resume, compare, the report."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from helpers import children
from mixprec.cli import main
from mixprec.workbench.compare import compare
from mixprec.workbench.data import load_corpus, sample_batch
from mixprec.workbench.train import CheckpointError, TrainConfig, _build, train

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TINY = dict(size="tiny", batch=4, steps=12, eval_every=6, ckpt_every=3,
            corpus_bytes=300_000)


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text()
            .splitlines() if "loss" in json.loads(line)]


def test_corpus_is_deterministic_and_split_by_file():
    a, b = load_corpus(max_bytes=200_000, seed=3), load_corpus(max_bytes=200_000, seed=3)
    assert a.fingerprint == b.fingerprint and a.val.numel() > 0 and a.train.numel() > 0
    assert load_corpus(max_bytes=200_000, seed=4).fingerprint != a.fingerprint
    x, y = sample_batch(a.train, 2, 16, torch.Generator().manual_seed(0))
    assert torch.equal(x[:, 1:], y[:, :-1])


@pytest.mark.paths
@pytest.mark.parametrize("recipe", [  # fp8's resume: test_extending_a_finished_fp8_run...
    "fp16-master", pytest.param("fp8", marks=pytest.mark.long)])
def test_resume_in_process_is_bit_identical(tmp_path, recipe):
    cfg = TrainConfig(recipe=recipe, **TINY)
    full = train(cfg, tmp_path / "full", progress=False)
    part = tmp_path / "part"
    train(cfg, part, progress=False, stop_after=7)  # checkpoints at 3 and 6; step 7 lost
    train(cfg, part, resume=True, progress=False)
    assert losses(part) == [s["loss"] for s in full.steps]


def test_extending_a_finished_fp8_run_matches_the_longer_run(tmp_path):
    """A run of 7 steps ends with an evaluation, then is resumed to 12: the same losses
    as 12 steps in one go. The final evaluation used to write its amaxes into fp8's
    delayed-scaling history, and the extended run diverged from step 8 on."""
    full = train(TrainConfig(recipe="fp8", **TINY), tmp_path / "full", progress=False)
    short = {**TINY, "steps": 7}
    train(TrainConfig(recipe="fp8", **short), tmp_path / "part", progress=False)
    train(TrainConfig(recipe="fp8", **TINY), tmp_path / "part", resume=True, progress=False)
    assert losses(tmp_path / "part") == [s["loss"] for s in full.steps]


def _run(args, kill_after_ckpt=None):
    """Run ``children.workbench_run(out, recipe, steps, resume)`` in a child process; with
    ``kill_after_ckpt=(path, delay)``, SIGKILL it ``delay`` seconds after it writes a
    checkpoint of its own (polled, so a slow start cannot make the kill land before any
    checkpoint exists)."""
    out, recipe, steps, *resume = args
    p = multiprocessing.get_context("forkserver").Process(
        target=children.workbench_run, args=(out, recipe, int(steps), bool(resume)))
    p.start()
    if kill_after_ckpt is None:
        p.join(timeout=120)
        assert p.exitcode == 0, f"the run failed (exit code {p.exitcode}); see its stderr"
        return True
    ckpt, delay = kill_after_ckpt
    before = ckpt.stat().st_mtime_ns if ckpt.exists() else None
    deadline = time.monotonic() + 120
    while p.is_alive() and time.monotonic() < deadline:
        if ckpt.exists() and ckpt.stat().st_mtime_ns != before:
            break
        time.sleep(0.01)
    time.sleep(delay)
    alive = p.is_alive()  # a run that has ended is reaped here: nothing left to kill
    if alive:
        os.kill(p.pid, signal.SIGKILL)  # no chance to clean up, mid-write included
    p.join()
    # a run that ended before the kill must have ended well, not crashed
    assert alive or p.exitcode == 0, f"the run failed (exit code {p.exitcode})"
    return alive


@pytest.mark.parametrize("recipe", [pytest.param("bf16", marks=pytest.mark.paths), "fp16"])
def test_sigkill_at_random_moments_then_resume_is_bit_identical(tmp_path, recipe):
    steps = 40
    ref = tmp_path / "ref"
    _run([str(ref), recipe, str(steps)])
    out = tmp_path / "killed"
    rng = random.Random(recipe)
    ckpt = out / "ckpt.pt"
    killed = [_run([str(out), recipe, str(steps)], kill_after_ckpt=(ckpt, rng.uniform(0, 0.3)))]
    for _ in range(3):
        assert ckpt.exists()  # each kill landed after a checkpoint was written
        killed.append(_run([str(out), recipe, str(steps), "resume"],
                           kill_after_ckpt=(ckpt, rng.uniform(0.0, 0.3))))
    assert sum(killed) >= 2, killed  # mid-run kills, not kills of finished processes
    _run([str(out), recipe, str(steps), "resume"])
    assert losses(out) == losses(ref)
    torch.load(out / "ckpt.pt", weights_only=True)  # ckpt.pt is always a complete file


def test_torn_temp_file_is_ignored_and_corrupt_checkpoint_is_a_clear_error(tmp_path):
    cfg = TrainConfig(recipe="bf16", **{**TINY, "steps": 6})
    out = tmp_path / "run"
    train(cfg, out, progress=False)
    (out / "ckpt.pt.tmp").write_bytes(b"PK\x03\x04 half a zip")  # killed mid-write
    train(TrainConfig(**{**cfg.__dict__, "steps": 9}), out, resume=True, progress=False)
    good = (out / "ckpt.pt").read_bytes()
    (out / "ckpt.pt").write_bytes(good[: len(good) // 2])  # truncated on disk
    before = (out / "metrics.jsonl").read_bytes()
    with pytest.raises(CheckpointError, match="unreadable.*truncated or corrupt"):
        train(TrainConfig(**{**cfg.__dict__, "steps": 12}), out, resume=True, progress=False)
    assert (out / "metrics.jsonl").read_bytes() == before  # nothing overwritten


def test_resume_with_another_recipe_or_size_is_refused(tmp_path):
    out = tmp_path / "run"
    train(TrainConfig(recipe="bf16", **{**TINY, "steps": 3}), out, progress=False)
    before = (out / "ckpt.pt").read_bytes()
    with pytest.raises(CheckpointError, match="recipe='bf16'.*recipe='fp32'"):
        train(TrainConfig(recipe="fp32", **{**TINY, "steps": 6}), out, resume=True,
              progress=False)
    with pytest.raises(CheckpointError, match="size='tiny'.*size='small'"):
        train(TrainConfig(recipe="bf16", **{**TINY, "size": "small", "steps": 6}), out,
              resume=True, progress=False)
    assert (out / "ckpt.pt").read_bytes() == before


def test_cli_errors(tmp_path, capsys):
    assert main(["train", "--recipe", "bf17", "--out", str(tmp_path / "x")]) == 2
    assert "unknown preset 'bf17'" in capsys.readouterr().err
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if os.geteuid() != 0:  # root can write anywhere
        assert main(["train", "--out", str(ro / "sub"), "--steps", "1"]) == 2
        assert "not writable" in capsys.readouterr().err
    assert main(["train", "--size", "tiny", "--out", str(tmp_path / "n"), "--resume"]) == 2
    assert "no checkpoint" in capsys.readouterr().err
    assert main(["compare", "--recipes", "fp32,bf99", "--out", str(tmp_path / "c")]) == 2
    assert not (tmp_path / "c").exists()  # validated before any training


def test_unwritable_out_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(PermissionError, match="not writable"):
        train(TrainConfig(**TINY), blocker / "sub", progress=False)


@pytest.mark.long  # 40 steps of four recipes
def test_overflow_scenario_outcome_from_the_runs_own_metrics(tmp_path):
    rep = compare(steps=40, size="tiny", batch=8, out=tmp_path, scenario="overflow",
                  progress=False, doctor_steps=0)
    rows = {r["recipe"]: r for r in rep["summary"]}
    stalled = rows["fp16,loss_scale=none"]
    # fp16 without loss scaling: the gradients flush to zero and the loss does not move
    assert stalled["nan_loss"] or stalled["loss_last5"] > 0.97 * stalled["loss_first5"]
    for r in ("fp32", "bf16", "fp16"):  # the others learn
        assert rows[r]["loss_last5"] < 0.85 * rows[r]["loss_first5"], (r, rows[r])
    assert "stalls" in rep["story"]


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


@pytest.mark.skipif(_chromium() is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_report_renders_in_headless_chromium(tmp_path):
    compare(["fp32", "bf16", "fp16"], steps=8, size="tiny", batch=4, out=tmp_path,
            progress=False, doctor_steps=1)
    page = tmp_path / "report.html"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update",
             "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([_chromium(), *flags, "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert "<table" in html and "fp16" in html
    for fig in ("train_loss", "val_loss", "speed", "memory", "scale"):
        start = html.index(f'id="{fig}"')
        body = html[start:html.index("</figure>", start)]
        assert "<svg" in body and body.count("<path") >= 3, fig  # drawn, not empty
    shot = tmp_path / "report.png"
    r = subprocess.run([_chromium(), *flags, "--window-size=1200,1600",
                        f"--screenshot={shot}", page.as_uri()],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and shot.stat().st_size > 20_000
    print(f"report screenshot: {shot}")


def test_bench_reports_every_column(capsys):
    assert main(["bench", "--size", "tiny", "--batch", "2", "--seq", "32", "--steps", "1",
                 "--recipes", "fp32,bf16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["recipe"]: r for r in out["rows"]}
    assert rows["fp32"]["speedup_vs_fp32"] == 1.0
    for r in rows.values():
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] and r["peak_gflops"] > 0
        assert r["overhead_vs_hand"] is not None and r["model_state_bytes"] > 0


def test_bench_table_without_fp32_and_with_long_recipe_names(capsys):
    """No fp32 row (no speed-up baseline) and a recipe with options (no hand-written
    twin, a long name): the table prints dashes and stays aligned."""
    assert main(["bench", "--size", "tiny", "--batch", "2", "--seq", "32", "--steps", "1",
                 "--recipes", "bf16;bf16-master,wgrad=fp32"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    head, rows = lines[1], lines[2:-3]
    assert lines[-3].startswith("overhead: median over rounds")
    # each recipe's kernel choices, with the readings behind them (unless pinned)
    assert [x.split(":")[0] for x in lines[-2:]] == ["kernels bf16",
                                                     "kernels bf16-master,wgrad=fp32"]
    assert all("emulate=" in x and ("measured on one thread, alternating: bf16 " in x
                                    or "decided by MIXPREC_EMULATE" in x)
               for x in lines[-2:])
    assert [r.split()[0] for r in rows] == ["bf16", "bf16-master,wgrad=fp32"]
    assert all(len(r) == len(head) for r in rows)
    assert all(r.split()[3] == "–" for r in rows)          # no fp32 baseline


def test_bench_table_columns_fit_figures_wider_than_usual():
    """A loaded machine's figures (a step of 12 s, a rate in the millions, a 5-digit
    overhead) widen their column: every column still ends where its heading ends."""
    from mixprec.workbench.bench import format_table

    def row(recipe, ms, tok, ov):
        return {"recipe": recipe, "step_ms": ms, "tokens_per_s": tok, "speedup_vs_fp32": 1.0,
                "gflops": 123456.0, "peak_gflops": 9.0, "mfu": 13717.0,
                "overhead_vs_hand": ov, "overhead_iqr": (ov - 1, ov + 1) if ov else None,
                "model_state_bytes": 2**20, "kernels": "emulate=off"}

    result = {"model": "gpt", "size": "tiny", "batch": 2, "seq": 32, "device": "cpu",
              "torch": "2", "threads": 2, "steps": 3,
              "rows": [row("fp32", 12345.6, 12_345_678.0, 123.45),
                       row("bf16-master,wgrad=fp32", 1.0, 3.0, None)]}
    lines = format_table(result).splitlines()
    head, rows = lines[1], lines[2:4]
    ends = [m.end() for m in re.finditer(r"\S+(?: \S+)*", head)][1:]  # right-aligned
    for r in rows:
        assert len(r) == len(head), (r, head)
        assert all(r[e - 1] != " " and (e == len(r) or r[e] == " ") for e in ends), (r, head)


def test_bench_compile_times_each_recipe_compiled_and_torchaos_beside_fp8(capsys,
                                                                         monkeypatch):
    """``--compile``: each recipe's compiled twin and, beside ``fp8-current``, torchao's
    compiled float8 on the same Linears, interleaved in the recipe's phase. dynamo's
    ``eager`` backend stands in for inductor here (the plumbing, not the kernels:
    tests/engine/test_compile.py compiles every recipe with inductor)."""
    import functools

    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear as AoLinear

    from mixprec.workbench import bench as bench_mod

    built = []
    real = bench_mod._torchao_loop

    def spy(model, *args):
        step = real(model, *args)
        built.append(sorted(n for n, m in model.named_modules() if isinstance(m, AoLinear)))
        return step

    monkeypatch.setattr(bench_mod, "_torchao_loop", spy)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    assert main(["bench", "--size", "tiny", "--batch", "2", "--seq", "32", "--steps", "2",
                 "--recipes", "bf16,fp8-current", "--compile", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["recipe"]: r for r in out["rows"]}
    assert out["compile"] is True
    for r in rows.values():
        assert r["compiled_step_ms"] > 0 and r["compile_speedup"] > 0
    assert rows["bf16"]["vs_torchao"] is None
    ao = rows["fp8-current"]
    # torchao converted exactly the Linears mixprec converted (the head stays)
    assert len(built) == 1 and built[0] and not any("head" in n for n in built[0])
    table = bench_mod.format_table(out)
    assert "vs torchao" in table and "fp8-current" in table.split("vs torchao")[1]
    if ao["torchao_error"] is not None:  # a CPU whose oneDNN has no fp8 matmul (AVX2)
        assert ao["torchao_step_ms"] is None and "torchao beside fp8-current failed" in table
    else:
        assert ao["torchao_step_ms"] > 0 and ao["vs_torchao_iqr"][0] <= ao["vs_torchao"]


def test_bench_compile_reports_a_peer_that_fails_and_goes_on(capsys, monkeypatch):
    """torchao's float8 GEMM has no CPU kernel where oneDNN lacks fp8 (AVX2 chips): the
    bench says so in the row and the table, and times the rest."""
    import functools

    from mixprec.workbench import bench as bench_mod

    def failing(*args):
        def step():
            raise RuntimeError("could not create a primitive descriptor for the matmul")
        return step

    monkeypatch.setattr(bench_mod, "_has_torchao", lambda: True)
    monkeypatch.setattr(bench_mod, "_torchao_loop", failing)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    out = bench_mod.bench(["fp8-current"], size="tiny", batch=2, seq=32, steps=2,
                          compile=True)
    row = out["rows"][0]
    assert row["torchao_error"].startswith("RuntimeError: could not create")
    assert row["vs_torchao"] is None and row["compiled_step_ms"] > 0
    assert "torchao beside fp8-current failed" in bench_mod.format_table(out)


def test_paired_overhead_is_the_median_of_per_round_ratios():
    from mixprec.workbench.bench import paired_overhead

    # the host slows down halfway: each round's pair still reads +10%
    base = [1.0, 1.0, 1.0, 3.0, 3.0]
    med, q25, q75 = paired_overhead([1.1 * b for b in base], base)
    assert (med, q25, q75) == pytest.approx((0.1, 0.1, 0.1))
    med, q25, q75 = paired_overhead([1.0, 1.1, 1.2, 1.3], [1.0] * 4)
    assert (med, q25, q75) == pytest.approx((0.15, 0.075, 0.225))
    with pytest.raises(ValueError, match="same number"):
        paired_overhead([1.0], [1.0, 2.0])


def test_compare_flags_a_recipe_whose_step_is_over_twice_fp32s_with_the_cause():
    from mixprec.workbench.compare import slow_step_findings
    from mixprec.workbench.train import TrainConfig, TrainResult

    def result(recipe, tps, emulated=False):
        return TrainResult(TrainConfig(recipe=recipe), steps=[{"tokens_per_s": tps}] * 10,
                           emulated=emulated, kernels="emulate=on (measured on one thread, ...)")

    results = {"fp32": result("fp32", 6000.0), "bf16": result("bf16", 5000.0, True),
               "fp8": result("fp8", 326.0)}
    facts = {"time_shares": {"ops": [("aten::mm", 40.0), ("aten::_to_copy", 9.5)]}}
    assert slow_step_findings("bf16", results, facts) == []   # 1.2x: not flagged
    assert slow_step_findings("fp32", results, facts) == []
    (f,) = slow_step_findings("fp8", results, facts)           # fp8 at 0.05x of fp32
    assert f.code == "step-slow" and f.severity == "warning"
    assert "18.4x the fp32 step" in f.title
    assert "aten::mm 40.0 ms" in f.evidence and "kernels: emulate=on" in f.evidence
    slow = {**results, "bf16": result("bf16", 1000.0, True)}
    assert "it is emulated" in slow_step_findings("bf16", slow, {})[0].advice


def test_compare_and_doctor_report_the_engines_coverage(tmp_path):
    """The compare report's low-precision share of the matmul weights is the engine's
    coverage of the same model under the same recipe, and the doctor states the same."""
    import warnings

    from mixprec import MixedPrecision
    from mixprec.diagnostics import doctor
    from mixprec.workbench.model import GPT, SIZES

    rep = compare(["bf16", "fp8-current"], steps=2, size="tiny", batch=4, out=tmp_path,
                  progress=False, doctor_steps=0)
    rows = {r["recipe"]: r for r in rep["summary"]}
    torch.manual_seed(0)
    model = GPT(SIZES["tiny"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = MixedPrecision(model, torch.optim.AdamW(model.parameters()), "fp8-current")
    cov = engine.coverage
    # the tiny GPT: the head (tied to the embedding) stays bf16, the blocks' Linears fp8
    assert 0.5 < cov.low_precision_share < 1.0
    assert rows["fp8-current"]["matmul_weights_low_precision"] == cov.low_precision_share
    assert rows["fp8-current"]["matmul_weights_by_format"] == cov.by_kind()
    assert rows["bf16"]["matmul_weights_low_precision"] == 0.0
    html = (tmp_path / "report.html").read_text()
    assert f"<td>{cov.low_precision_share:.0%}</td>" in html

    def batch_fn(m, i):
        x = torch.randint(0, SIZES["tiny"].vocab, (2, 16), generator=torch.Generator()
                          .manual_seed(i))
        return m(x, x)

    def factory():
        torch.manual_seed(0)
        return GPT(SIZES["tiny"])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = doctor(factory, batch_fn, "fp8-current", steps=1, reference_steps=0)
    assert found.facts["matmul_weights_low_precision"] == cov.low_precision_share


def test_a_precision_schedule_is_a_workbench_recipe():
    """``mixprec compare`` and ``mixprec train`` take a schedule's string form: the
    engine follows it over the run's steps; a malformed one fails before training."""
    cfg = TrainConfig(recipe="fp8>bf16-master@0.5", **{**TINY, "steps": 4})
    _, _, engine = _build(cfg, None, torch.device("cpu"))
    assert engine.schedule.starts() == (0, 2) and str(engine.recipe) == "fp8"
    with pytest.raises(ValueError, match="no @START"):
        TrainConfig(recipe="fp8>bf16-master", **TINY)


@pytest.mark.long
def test_a_scheduled_workbench_run_resumes_across_the_switch(tmp_path):
    cfg = TrainConfig(recipe="fp8>bf16-master@0.5", **TINY)  # switches after step 6
    full = train(cfg, tmp_path / "full", progress=False)
    part = tmp_path / "part"
    train(cfg, part, progress=False, stop_after=5)  # checkpoint at 3, in the fp8 phase
    train(cfg, part, resume=True, progress=False)
    assert losses(part) == [s["loss"] for s in full.steps]
