"""Pipeline parallelism (``parallel="pp"``) with torch's ``PipelineStage`` and schedules
on two gloo ranks: a four-block model cut into stages trains as one process holding the
whole model does (same micro-batches through ``engine.backward``), every stage skips the
same steps, and the clip norm is the whole pipeline's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from helpers.launch import free_port
from helpers.paths import ROOT
from helpers.pp_workers import pp_runs
from mixprec import MixedPrecision
from mixprec.engine.devices import emulating
from mixprec.engine.scaler import LossScaler
from mixprec.parallel.pipeline import PipelineLoss
from mixprec.recipe import Recipe

#: the loss tolerance against one process, per recipe (the brief of the feature)
TOL = {"bf16-master": 0.02, "fp16-master": 0.02, "fp8-current": 0.05, "fp32": 1e-5}
#: what a bf16 stage sends: bf16, or fp32 tensors where this CPU's 16-bit path is emulated
BF16 = "torch.float32" if emulating(Recipe.coerce("bf16-master"), "cpu") else "torch.bfloat16"
#: the clip norm against one process's: fp32 sums of each stage's squares (measured 1e-7
#: on real 16-bit kernels; 2.7e-4 for bf16-master where the 16-bit path is emulated, whose
#: 16-bit rounding falls elsewhere); a norm missing a stage's
#: squares is off by tens of percent
NORM_TOL = {"bf16-master": 1e-3, "fp16-master": 1e-3, "fp8-current": 1e-3, "fp32": 1e-4}


def _spawn(runs: list[dict]) -> list[dict]:
    tmp = tempfile.mkdtemp(prefix="mixprec-pp-")
    mp.start_processes(pp_runs, args=(2, tmp, runs), nprocs=2, join=True,
                       start_method="forkserver")  # preloaded: see conftest.py
    return [torch.load(os.path.join(tmp, f"pp_rank{r}.pt"), weights_only=False)
            for r in range(2)]


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _check_like_one_process(run: dict, ranks: list[dict], j: int) -> dict:
    """Run ``j`` trained as one process does: the last stage's losses, both stages'
    clip norms (equal on both, the one process's), the weights."""
    r0, r1 = ranks[0]["runs"][j], ranks[1]["runs"][j]
    key = (run["recipe"], run["clip"], run["steps"], run.get("tie", False),
           run.get("windows", 1))
    ref = ranks[0]["refs"][key]
    assert r0["error"] is None and r1["error"] is None, (r0["error"], r1["error"])
    tol = TOL[run["recipe"]]
    assert _rel(r1["losses"], ref["losses"]) <= tol
    assert r0["norms"] == r1["norms"]  # one all-reduce: the same bits on every stage
    assert _rel(r0["norms"], ref["norms"]) <= NORM_TOL[run["recipe"]]
    assert max(ref["norms"]) > run["clip"]  # the clip acted
    weights = {**r0["weights"], **r1["weights"]}
    assert weights.keys() == ref["weights"].keys()
    for k, v in ref["weights"].items():
        assert ((weights[k] - v).abs().max() / v.abs().max()).item() <= max(5 * tol, 1e-5), k
    assert not any(r0["skipped"]) and not any(r1["skipped"])
    return {"loss": _rel(r1["losses"], ref["losses"]), "norm": _rel(r0["norms"], ref["norms"])}


def test_two_1f1b_stages_under_bf16_master_train_like_one_process():
    """The fast case: the boundary is bf16, and torch's scale_grads (on by default)
    divides nothing the engine holds."""
    run = {"recipe": "bf16-master", "name": "Schedule1F1B", "steps": 6, "clip": 0.1}
    ranks = _spawn([run])
    _check_like_one_process(run, ranks, 0)
    assert ranks[0]["runs"][0]["boundary"] == [BF16]


@pytest.mark.long  # one spawn, four trainings and two references: 6-18 s on two cores
@pytest.mark.parametrize("recipe", ["bf16-master", "fp16-master", "fp8-current"])
def test_gpipe_and_1f1b_train_like_one_process_and_skip_together(recipe):
    runs = [{"recipe": recipe, "name": "ScheduleGPipe", "steps": 6, "clip": 0.1},
            {"recipe": recipe, "name": "ScheduleGPipe", "steps": 6, "clip": 0.1,
             "scale_grads": False},
            {"recipe": recipe, "name": "Schedule1F1B", "steps": 6, "clip": 0.1},
            {"recipe": recipe, "name": "Schedule1F1B", "steps": 3, "clip": 0.1,
             "inject": 1}]
    ranks = _spawn(runs)
    for j in range(3):
        _check_like_one_process(runs[j], ranks, j)
    # scale_grads=True or False: the same bits (the engine's gradients never sit in .grad)
    for r in ranks:
        a, b = r["runs"][0], r["runs"][1]
        assert a["losses"] == b["losses"] and a["norms"] == b["norms"]
        assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
    # a non-finite gradient on stage 0 only: both stages skip that step, their weights,
    # masters and optimizer states bit-identical, and keep the same loss scale
    s0, s1 = ranks[0]["runs"][3], ranks[1]["runs"][3]
    assert s0["skipped"] == s1["skipped"] == [False, True, False]
    assert s0["intact"] is True and s1["intact"] is True
    assert s0["scales"] == s1["scales"]
    if recipe == "fp16-master":
        assert s0["scales"][1] == s0["scales"][0] / 2  # the dynamic scale backed off


@pytest.mark.long  # one spawn, six trainings and four references: ~15 s on two cores
def test_interleaved_schedules_train_like_one_process_and_zero_bubble_is_refused(tmp_path):
    runs = [{"recipe": "bf16-master", "name": "ScheduleInterleaved1F1B", "steps": 6,
             "clip": 0.1},
            {"recipe": "bf16-master", "name": "ScheduleLoopedBFS", "steps": 6, "clip": 0.1},
            {"recipe": "fp32", "name": "Schedule1F1B", "steps": 6, "clip": 0.1, "tie": True},
            {"recipe": "bf16-master", "name": "ScheduleInterleavedZeroBubble", "steps": 1,
             "clip": 0.1},
            {"recipe": "fp16-master", "name": "Schedule1F1B", "steps": 2, "clip": 0.1,
             "inject": 0, "ckpt": str(tmp_path / "stage.pt")},
            # two schedule steps per update, where .grad is the accumulator (fp8-current)
            {"recipe": "fp8-current", "name": "Schedule1F1B", "steps": 4, "clip": 0.1,
             "windows": 2}]
    ranks = _spawn(runs)
    for j in (0, 1, 2, 5):
        _check_like_one_process(runs[j], ranks, j)
    # stage 0 ends in an fp32 LayerNorm island: its boundary is fp32, stage 1's bf16
    assert ranks[0]["runs"][0]["boundary"] == ["torch.float32", BF16]
    for r in ranks:
        assert "zero-bubble" in r["runs"][3]["error"]
        assert "Schedule1F1B" in r["runs"][3]["error"]
        # each stage's own checkpoint resumes it bit for bit (a skipped step and the
        # backed-off scale included); a reshardable one of stages that renumber the
        # blocks (no names in the whole model) is refused
        assert r["runs"][4]["resumed"] is True


@pytest.mark.long  # torchrun starts two interpreters: ~20 s on two cores
def test_the_guides_pipeline_script_trains_under_torchrun(tmp_path):
    text = (ROOT / "docs" / "guides" / "pipeline.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", text, re.S)
                if "# torchrun" in b]
    script = tmp_path / "pipeline_train.py"
    script.write_text(block)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run",
                          "--nproc-per-node", "2", f"--master-port={free_port()}",
                          str(script)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    steps = re.findall(r"step (\d): loss ([\d.]+), norm ([\d.]+)", run.stdout)
    assert [s[0] for s in steps] == ["0", "1", "2", "3", "4"]
    assert all(0.5 < float(s[1]) < 3 and float(s[2]) > 0 for s in steps)
    # the stages' checkpoint holds the whole model's entries under the whole model's names
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata
    assert {k for k in md if k.startswith("model.")} == {
        f"model.{i}.{w}" for i in ("0.0", "1.0", "2.0", "3") for w in ("weight", "bias")}


def test_the_pipeline_loss_is_scaled_and_divided_as_backward_takes_it():
    scaler = LossScaler("dynamic", init_scale=1024.0)
    loss = PipelineLoss(F.mse_loss, scaler, divide_by=4)
    out, target = torch.randn(3, 2), torch.randn(3, 2)
    got = loss(out, target)
    want = F.mse_loss(out.double(), target.double()) * 1024 / 4
    assert torch.allclose(got.double(), want, rtol=1e-6)
    assert len(loss.take()) == 1 and loss.take() == []


def test_pipeline_loss_and_pp_need_their_setting():
    model = torch.nn.Linear(4, 2)
    engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16")
    with pytest.raises(ValueError, match="parallel='pp'"):
        engine.pipeline_loss(F.mse_loss)
    with pytest.raises(ValueError, match="initialised process group"):
        MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16",
                       parallel="pp")
