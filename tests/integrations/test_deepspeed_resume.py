"""Checkpoints and fp16 under DeepSpeed with mixprec's quantized Linears
(``mixprec.integrations.deepspeed.save_state`` / ``load_state``, the HF Trainer's
checkpoints, ``accelerator.save_state``), on DeepSpeed's CPU accelerator over gloo.

The fast tests: mixprec's part of a checkpoint (the record, each rank's scaling state)
round-trips against the tensors saved, a different recipe is refused naming the fix, and
fp16 configs hand the loss scale to DeepSpeed. The long ones (tests/helpers/
ds_resume_workers.py, one launch on two ranks, one on one process): the HF Trainer
(ZeRO 2 and 3, fp8-current; ZeRO-2 with delayed scaling) and Accelerate (ZeRO-3,
delayed scaling) resumed from step 3 repeat the straight run's losses, fp32 masters and
each rank's scaling state bit for bit; under DeepSpeed's ``fp16`` an inf injected on one
rank skips the step on both, as on one process, and the losses follow one process's."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from helpers.launch import free_port
from helpers.paths import ROOT
from mixprec.integrations import deepspeed as ds

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

BF16 = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}
FP16 = {"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}}
#: the bound on each step's global loss against one process (fp8's, as the matrix's
#: DeepSpeed cells)
TOL = 5e-2
RESUMES = ["trainer:2:fp8-current", "trainer:3:fp8-current", "trainer:2:fp8",
           "accelerate:3:fp8"]
INF_AT = 2  # the step whose loss is multiplied by inf (on rank 1 of 2)
#: under DeepSpeed's fp16: a recipe's quantized Linears, and the recipe the matrix's
#: bf16 cells refuse (compute='fp16'), which this config runs
FP16_RECIPES = ["fp8-current", "fp16-master"]
TWO = [*RESUMES, *(f"fp16:2:{r}:{INF_AT}:1" for r in FP16_RECIPES)]
ONE = [*(f"fp16:2:{r}:{INF_AT}:0" for r in FP16_RECIPES), "trainer:2:fp8"]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 16))


def test_mixprecs_part_of_a_checkpoint_round_trips_and_each_rank_keeps_its_own(tmp_path):
    net = _net()
    with pytest.warns(UserWarning, match="ZeRO-2, bf16"):
        ds.swap(net, "fp8", BF16)  # delayed scaling: an amax history per Linear
    net(torch.randn(4, 32)).sum().backward()  # a training step records amaxes
    state = ds._scaling(net)
    assert state and all(k.startswith(("0.", "1.")) for k in state)
    saved = {k: v.clone() for k, v in state.items()}
    ds.save_state(net, str(tmp_path), rank=0, main=True, step=3)
    with torch.no_grad():  # rank 1 saw other inputs: its history differs
        for t in state.values():
            t.mul_(2).add_(1)
    ds.save_state(net, str(tmp_path), rank=1, main=False, step=3)
    assert sorted(os.listdir(tmp_path)) == [ds.RECORD_FILE, "mixprec_scaling_rank0.pt",
                                           "mixprec_scaling_rank1.pt"]
    record = ds.load_state(net, str(tmp_path), rank=0)
    assert record["recipe"] == "fp8" and record["step"] == 3 and record["stage"] == 2
    assert record["formats"] == {"0": "fp8", "1": "fp8", "2": "bf16"}
    for k, t in ds._scaling(net).items():
        assert torch.equal(t, saved[k]), k
    ds.load_state(net, str(tmp_path), rank=1)
    for k, t in ds._scaling(net).items():
        assert torch.equal(t, saved[k] * 2 + 1), k
    with pytest.warns(UserWarning, match="rank 2 keeps the scaling state DeepSpeed "
                                         "restored"):
        ds.load_state(net, str(tmp_path), rank=2)
    # a scaling without history (fp8-current) saves the record alone
    cur = _net()
    ds.swap(cur, "fp8-current", BF16)
    ds.save_state(cur, str(tmp_path / "cur"), rank=0)
    assert os.listdir(tmp_path / "cur") == [ds.RECORD_FILE]
    (tmp_path / "plain").mkdir()  # a DeepSpeed checkpoint saved without mixprec
    with pytest.warns(UserWarning, match="holds no mixprec_deepspeed.json"):
        assert ds.load_state(cur, str(tmp_path / "plain")) is None


def _engine(applied: list[bool]) -> SimpleNamespace:
    """What step_scales reads of DeepSpeed's engine."""
    return SimpleNamespace(step=lambda: None, is_gradient_accumulation_boundary=lambda: True,
                           was_step_applied=lambda: applied[0])


def test_delayed_scaling_moves_after_each_deepspeed_step_and_a_skip_drops_its_amaxes():
    net = _net()
    ds.swap(net, "fp8", BF16)
    applied = [True]
    engine = _engine(applied)
    assert ds.step_scales(engine, net) and not ds.step_scales(engine, net)  # once
    x = torch.randn(4, 32, dtype=torch.float64).float()
    net(x).sum().backward()
    lin = net[0]
    hist = lin.fp8_amax_history.clone()
    assert float(hist[0, 0]) == float(x.abs().max())  # the input's amax, recorded
    engine.step()
    # the scale: the fp8 maximum over the history's max (margin 0), in float64
    want = float(lin.fp8_max[0].double() / x.abs().max().double())
    assert float(lin.fp8_scale[0]) == pytest.approx(want, rel=1e-6)
    assert torch.equal(lin.fp8_amax_history[:, 1], hist[:, 0])
    assert not bool(lin.fp8_amax_history[:, 0].any())
    scale = lin.fp8_scale.clone()
    net(x * 1e3).sum().backward()
    applied[0] = False  # DeepSpeed skipped the step (an overflow)
    engine.step()
    assert torch.equal(lin.fp8_scale, scale)
    assert not bool(lin.fp8_amax_history[:, 0].any())
    cur = _net()
    ds.swap(cur, "fp8-current", BF16)
    assert not ds.step_scales(_engine(applied), cur)  # no state to move


def test_a_checkpoint_of_another_recipe_is_refused_naming_the_fix(tmp_path):
    net = _net()
    ds.swap(net, "fp8", BF16)
    ds.save_state(net, str(tmp_path))
    other = _net()
    ds.swap(other, "fp8-current", BF16)
    with pytest.raises(ValueError, match=r"saved under recipe 'fp8', this run's is "
                                         r"'fp8-current'.*Fix: resume with recipe='fp8'"):
        ds.load_state(other, str(tmp_path))
    with pytest.raises(ValueError, match="carries no mixprec formats: save_state"):
        ds.save_state(nn.Linear(2, 2), str(tmp_path))


def test_fp16_configs_hand_the_loss_scale_to_deepspeed_and_bf16_ones_name_it():
    """Under DeepSpeed's fp16 the recipe's loss scale is DeepSpeed's dynamic scaler, once
    (mixprec scales nothing: no engine runs); a recipe computing in fp16 under a bf16
    config is refused naming the fp16 config that runs it."""
    said = ds.split("fp16-master", FP16, warn=False)
    assert "weights in fp16 with fp32 masters" in said
    assert "its dynamic loss scale (the recipe's loss_scale=dynamic)" in said
    said = ds.split("fp8-current", FP16, warn=False)
    assert "the layers around the Linears in fp16" in said
    assert "its dynamic loss scale (the recipe's loss_scale=none)" in said
    with pytest.raises(ValueError, match=r"compute='fp16': DeepSpeed computes in its "
                                         r"config's dtype, bf16.*\"fp16\": \{\"enabled\": "
                                         r"true\}.*TrainingArguments\(fp16=True\)"):
        ds.split("fp16-master", BF16, warn=False)


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """tests/helpers/ds_resume_workers.py on 2 ranks and on one process."""
    from helpers import ds_workers  # imports DeepSpeed: only where the long tests run

    out = tmp_path_factory.mktemp("deepspeed_resume")
    ds_workers.save_model(str(out / "model"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"),
                                          os.environ.get("PYTHONPATH", "")])}
    script = str(ROOT / "tests" / "helpers" / "ds_resume_workers.py")
    got = {}
    for world, scenarios in ((2, TWO), (1, ONE)):
        run = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
             "--master-port", str(free_port()), script, str(out), *scenarios],
            cwd=out, env=env, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
        got[world] = torch.load(out / f"resume{world}.pt", weights_only=False)
    return got


@pytest.mark.long
@pytest.mark.parametrize("key", RESUMES)
def test_a_resumed_run_repeats_the_straight_one_bit_for_bit(records, key):
    got = records[2][key]
    straight, resumed = got["straight"], got["resumed"]
    kind, stage, recipe = key.split(":")
    assert straight["step"] == resumed["step"] == 6
    assert len(straight["losses"]) == 6
    assert resumed["losses"][-3:] == straight["losses"][3:]
    assert straight["losses"][-1] < straight["losses"][0]
    assert straight["weights"].keys() == resumed["weights"].keys()
    for name, w in straight["weights"].items():
        assert torch.equal(w, resumed["weights"][name]), name
    # mixprec's part of DeepSpeed's checkpoint: the record, each rank's scaling state
    record = got["record"]
    assert record["recipe"] == recipe and record["stage"] == int(stage)
    assert record["step"] == 3 and record["dtype"] == "bf16"
    projs = {n: f for n, f in record["formats"].items() if n.endswith("_proj")}
    assert len(projs) == 14 and set(projs.values()) == {recipe}
    assert ds.RECORD_FILE in got["files"]
    ranks = straight["scaling"]
    assert len(ranks) == 2
    if recipe == "fp8-current":  # current scaling keeps no history
        assert ranks == [{}, {}] and not record["scaling_state"]
        return
    assert {"mixprec_scaling_rank0.pt", "mixprec_scaling_rank1.pt"} <= set(got["files"])
    # delayed scaling moved after each of DeepSpeed's steps, the ranks' amaxes agreed
    for k, t in ranks[0].items():
        assert torch.equal(t, ranks[1][k]), k
        if k.endswith("fp8_amax_history"):  # 6 steps: 5 rolled columns, column 0 free
            assert bool((t[:, 1:6] > 0).all()) and not bool(t[:, 0].any()), k
        if k.endswith("fp8_scale"):
            assert not bool((t == 1).any()), k
    for r in range(2):
        for k, t in ranks[r].items():
            assert torch.equal(t, resumed["scaling"][r][k]), (r, k)


@pytest.mark.long
def test_delayed_scaling_on_two_ranks_trains_as_one_process(records):
    two = records[2]["trainer:2:fp8"]["straight"]["losses"]
    one = records[1]["trainer:2:fp8"]["straight"]["losses"]
    rel = max(abs(a - b) / abs(b) for a, b in zip(two, one))
    print(f"fp8 delayed, Trainer ZeRO-2, 2 ranks against one process: {rel:.2e}")
    assert rel <= TOL


@pytest.mark.long
@pytest.mark.parametrize("recipe", FP16_RECIPES)
def test_fp16_skips_an_injected_inf_on_both_ranks_and_trains_as_one_process(records,
                                                                            recipe):
    two = records[2][f"fp16:2:{recipe}:{INF_AT}:1"]
    one = records[1][f"fp16:2:{recipe}:{INF_AT}:0"]
    assert two["dtype"] == "torch.float16"
    projs = {f for n, f in two["formats"].items() if n.endswith("_proj")}
    assert projs == ({"fp8-current"} if recipe == "fp8-current" else {"fp16"})
    want = [i == INF_AT for i in range(6)]
    for rank in two["ranks"] + one["ranks"]:
        assert rank["skipped"] == want
        # DeepSpeed's scaler (hysteresis 1) halves the scale at the skipped step, once
        assert rank["scales"] == [256.0] * INF_AT + [128.0] * (6 - INF_AT)
    assert two["skipped_steps"] == one["skipped_steps"] == 1
    rel = max(abs(a - b) / abs(b) for a, b in zip(two["losses"], one["losses"]))
    print(f"fp16 ZeRO-2 {recipe}, 2 ranks against one process: {rel:.2e}")
    assert rel <= TOL
    assert two["losses"][-1] < two["losses"][0]


def test_the_experts_scaling_state_is_saved_and_restored_with_the_linears(tmp_path):
    from helpers import moe_models  # transformers' model code: only where this test runs

    net = moe_models.model("qwen3_moe")
    ds.swap(net, "fp8", {"zero_optimization": {"stage": 3}})
    state = ds._scaling(net)
    experts = [k for k in state if ".experts." in k]
    assert experts and any("fp8_amax_history" in k for k in experts)
    with torch.no_grad():
        for i, t in enumerate(state.values()):
            t.fill_(i + 0.5)
    ds.save_state(net, str(tmp_path), rank=1, main=True)
    with torch.no_grad():
        for t in state.values():
            t.zero_()
    assert ds.load_state(net, str(tmp_path), rank=1)["dtype"] == "fp32"
    for i, t in enumerate(ds._scaling(net).values()):
        assert torch.all(t == i + 0.5)
