"""mixprec's formats inside DeepSpeed ZeRO 1-3 (``mixprec.integrations.deepspeed``),
through Accelerate's ``Accelerator(deepspeed_plugin=...)`` loop and the HF Trainer's
``deepspeed=`` config, on DeepSpeed's CPU accelerator over gloo.

The fast tests: what the recipe asks that DeepSpeed owns is handed over in one message
naming which component runs what, or refused in one error naming each bad value, the
valid ones and the fix. The long ones (tests/helpers/ds_workers.py, one launch on two
ranks, one on one process): ZeRO 2 and 3 under bf16 with the fp8-current Linears train
6 steps with the global loss of each step within the fp8 tolerance of one process's,
and coverage reports the Linears in fp8-current."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from helpers.launch import free_port
from helpers.matrix_cells import Cell, cells_of
from helpers.paths import ROOT
from mixprec import doctor
from mixprec.integrations import deepspeed as ds
from mixprec.optim import AdamW

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

BF16 = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}
#: this module's cells of the composition matrix (tests/helpers/matrix_cells.py): each
#: carries its tolerance on each step's global loss against one process (the fp8 one)
MATRIX = cells_of("tests/integrations/test_deepspeed.py")
_FRONTEND = {"ds-accelerate": "accelerate", "ds-trainer": "trainer"}


def _stage(cell: Cell) -> int:
    return int(cell.builder.removeprefix("deepspeed-zero"))


def _scenario(cell: Cell) -> str:
    """tests/helpers/ds_workers.py's scenario for a cell: ``frontend:stage``."""
    return f"{_FRONTEND[cell.layout]}:{_stage(cell)}"


def _param(cell: Cell):
    return pytest.param(cell, id=_scenario(cell))


TRAINS = [c for c in MATRIX if c.refuses is None]
REFUSES = [c for c in MATRIX if c.refuses is not None]
#: ZeRO 2 and 3 on each frontend; ZeRO-1 (Accelerate's loop) has its own test
CELLS = [c for c in TRAINS if _stage(c) != 1]
ZERO_1 = [c for c in TRAINS if _stage(c) == 1]
#: the one-process launch: each frontend once (on one process ZeRO's stages compute
#: alike), a bf16 run (no swap), the DeepSpeed-free run
ONE = ["accelerate:2", "trainer:2", "accelerate:2:bf16", "mixprec"]
TWO = [*(_scenario(c) for c in CELLS + ZERO_1), "trainer:2:bf16-lean"]


def test_the_hand_over_is_one_message_naming_what_each_component_runs():
    with pytest.warns(UserWarning) as seen:
        said = ds.split("fp8-current", BF16, engine_kwargs={"max_grad_norm": 1.0})
    assert len(seen) == 1 and str(seen[0].message) == said
    assert "ZeRO-2, bf16" in said and "mixprec runs the recipe's Linear format " \
        "(fp8-current)" in said
    for part in ("working weights in bf16 with fp32 masters", "params=fp32, master=none",
                 "the optimizer step", "no loss scaling", "gradient clipping to 1",
                 "keep_fp32="):
        assert part in said, part
    # the config's own clip is what DeepSpeed runs; fp16 keeps its dynamic scale
    fp16 = ds.split("fp8-current,params=bf16", {"fp16": {"enabled": "auto"},
                                                "gradient_clipping": 0.5},
                    auto="fp16", warn=False)
    assert "weights in fp16" in fp16 and "its dynamic loss scale" in fp16
    assert "gradient clipping to 0.5" in fp16


def test_what_deepspeed_cannot_run_is_refused_at_once_naming_the_fix():
    opt = AdamW([nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError) as err:
        ds.split("bf16-lean", BF16, optimizer=opt,
                 engine_kwargs={"loss_scaler": object(), "parallel_kwargs": {}, "foo": 1})
    msg = str(err.value)
    assert "cannot run 6 of its settings" in msg
    for part in ("write='stochastic'", "valid: nearest", "states=int8", "valid: fp32",
                 "AdamW (mixprec.optim)", "torch.optim.AdamW",
                 "loss_scaler=...: DeepSpeed owns it; set it in the DeepSpeed config's "
                 "fp16 section", "zero_optimization section",
                 "foo: not an argument under DeepSpeed; valid: fp8_filter, max_grad_norm"):
        assert part in msg, part
    with pytest.raises(ValueError, match=r"compute='fp16'.*valid: bf16 or a Linear "
                                         r"format.*\"fp16\": \{\"enabled\": true\}"):
        ds.split("fp16-master", BF16, warn=False)
    with pytest.raises(ValueError, match="grad_accum='kahan'.*valid: plain"):
        ds.split("bf16-master,grad_accum=kahan", BF16, warn=False)
    assert ds.ds_dtype({"bf16": {"enabled": "auto"}}, auto="bf16") == "bf16"
    assert ds.ds_dtype({}) == "fp32" and ds.ds_stage({}) == 0


def _accelerator(config, mixed="bf16"):
    plugin = SimpleNamespace(deepspeed_config=config)
    calls = []
    acc = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin),
                          mixed_precision=mixed, process_index=0, is_main_process=True,
                          prepare=lambda *objs: calls.append(objs) or objs,
                          register_save_state_pre_hook=calls.append,
                          register_load_state_pre_hook=calls.append)
    return acc, calls


def test_prepare_swaps_first_hands_the_clip_to_deepspeed_and_coverage_reads_it():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 16))
    opt = torch.optim.AdamW(net.parameters())
    config = {"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 3},
              "gradient_clipping": "auto"}
    acc, calls = _accelerator(config)
    with pytest.warns(UserWarning, match="ZeRO-3, bf16"):
        out = ds.prepare(acc, (net, opt), "fp8-current", {"max_grad_norm": 2.0})
    assert out == (net, opt) and calls[0] == (net, opt)
    assert len(calls) == 3  # accelerator.save_state / load_state carry mixprec's part
    assert config["gradient_clipping"] == 2.0
    # ZeRO-3 partitions the weights in place: coverage counts them whole
    net[0].weight.ds_numel = net[0].weight.numel()
    net[0].weight.data = torch.empty(0)
    cov = ds.coverage(_wrapped(net))  # DeepSpeed's engine holds the model as .module
    assert {r.name: r.format for r in cov.rows} == {"0": "fp8-current",
                                                    "1": "fp8-current", "2": "bf16"}
    assert cov.total == 2 * 32 * 32 + 32 * 16
    acc2, _ = _accelerator({"gradient_clipping": 1.0})
    with pytest.raises(ValueError, match=r"max_grad_norm=2.0.*gradient_clipping=1.0.*"
                                         r"Fix: drop max_grad_norm"):
        ds.prepare(acc2, (nn.Linear(4, 4),), "fp8-current", {"max_grad_norm": 2.0})
    with pytest.raises(ValueError, match="carries no mixprec formats"):
        ds.coverage(nn.Linear(4, 4))


def _wrapped(net: nn.Module) -> nn.Module:
    outer = nn.Module()
    outer.module = net
    return outer


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """tests/helpers/ds_workers.py on 2 ranks and on one process (torchrun, gloo,
    DeepSpeed's CPU accelerator); each launch's records."""
    from helpers import ds_workers  # imports DeepSpeed: only where the long tests run

    out = tmp_path_factory.mktemp("deepspeed")
    ds_workers.save_model(str(out / "model"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"),
                                          os.environ.get("PYTHONPATH", "")])}
    script = str(ROOT / "tests" / "helpers" / "ds_workers.py")
    got = {}
    for world, scenarios in ((2, TWO), (1, ONE)):
        run = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
             "--master-port", str(free_port()), script, str(out), *scenarios],
            cwd=out, env=env, capture_output=True, text=True, timeout=400)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
        got[world] = torch.load(out / f"records{world}.pt", weights_only=False)
    return got


def _rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == 6
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.long
@pytest.mark.parametrize("cell", [_param(c) for c in CELLS])
def test_zero_on_two_ranks_trains_as_one_process_with_the_linears_in_fp8(records, cell):
    key = _scenario(cell)
    two, one = records[2][key], records[1][key.split(":")[0] + ":2"]
    assert records[2]["world"] == 2 and records[1]["world"] == 1
    assert two["engine"] == "DeepSpeedEngine" and not two.get("mixprec_engine")
    alone = records[1]["mixprec"]["losses"]
    print(f"{key}: {_rel(two['losses'], one['losses']):.2e} against one process, "
          f"{_rel(two['losses'], alone):.2e} against mixprec's engine without DeepSpeed")
    assert _rel(two["losses"], one["losses"]) <= cell.tol
    # against the same training without DeepSpeed (mixprec's engine, bf16 + fp32 masters)
    assert _rel(two["losses"], alone) <= cell.tol
    formats = two["formats"]
    linears = {n: f for n, f in formats.items() if n.endswith("_proj")}
    assert len(linears) == 14 and set(linears.values()) == {"fp8-current"}
    assert formats["lm_head"] == "bf16" and two["low"] == pytest.approx(0.9)
    assert two["total"] == one["total"] == 81920  # ZeRO-3's partitions counted whole
    # the swap is what runs: the same DeepSpeed training without it computes otherwise
    assert one["losses"][0] != records[1]["accelerate:2:bf16"]["losses"][0]


@pytest.mark.long
@pytest.mark.parametrize("cell", [_param(c) for c in ZERO_1])
def test_zero_1_trains_and_the_trainer_refuses_what_deepspeed_cannot_run(records, cell):
    assert _scenario(cell) == "accelerate:1"
    two, one = records[2]["accelerate:1"], records[1]["accelerate:2"]
    print(f"accelerate:1: {_rel(two['losses'], one['losses']):.2e} against one process")
    assert _rel(two["losses"], one["losses"]) <= cell.tol
    assert two["losses"][-1] < two["losses"][0]
    assert set(two["formats"].values()) == {"fp8-current", "bf16"}
    err = records[2]["trainer:2:bf16-lean"]["error"]
    assert "recipe 'bf16-lean' under DeepSpeed (ZeRO-2, bf16)" in err
    assert "write='stochastic'" in err and "states=int8" in err


@pytest.mark.parametrize("cell", [pytest.param(c, id=_scenario(c) + ":" + c.fmt)
                                  for c in REFUSES])
def test_a_matrix_cell_deepspeed_cannot_run_is_refused_before_the_swap(cell):
    """The refusing cells of the composition matrix: the recipe under the stage's bf16
    config is refused by the hand-over both frontends run first (``swap`` calls
    ``split``), the model left as it was."""
    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    config = {"bf16": {"enabled": True}, "zero_optimization": {"stage": _stage(cell)}}
    with pytest.raises(ValueError) as err:
        ds.swap(net, cell.recipe, config)
    assert cell.refuses in str(err.value), str(err.value)
    assert type(net[0]) is nn.Linear


def test_the_doctor_refuses_a_model_zero_3_partitioned_naming_the_fix():
    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    net[0].weight.ds_id = 0  # what deepspeed.zero.Init leaves on a partitioned parameter
    with pytest.raises(NotImplementedError, match=r"ZeRO-3 partitioned.*Pass a factory "
                                                  r"that builds the model unpartitioned"):
        doctor(net, lambda m, i: m(torch.ones(2, 8)).sum(), "fp8-current", steps=1)


def test_the_swap_runs_the_experts_in_the_recipes_format_and_keeps_the_parameters():
    """What DeepSpeed then wraps: a transformers MoE's experts and Linears in
    fp8-current, the router and head kept, every Parameter the optimizer holds the same
    object; a forward and backward run in bf16."""
    from helpers import moe_models  # transformers' model code: only where this test runs

    net = moe_models.model("qwen3_moe").to(torch.bfloat16)
    before = [id(p) for p in net.parameters()]
    with pytest.warns(UserWarning, match="ZeRO-3, bf16"):
        formats = ds.swap(net, "fp8-current", {"bf16": {"enabled": True},
                                               "zero_optimization": {"stage": 3}})
    assert [id(p) for p in net.parameters()] == before
    assert set(formats.experts.values()) == {"fp8-current"}
    cov = ds.coverage(net)
    kinds = {r.kind: r.format for r in cov.rows if r.kind in ("experts", "router", "head")}
    assert kinds == {"experts": "fp8-current", "router": "bf16", "head": "bf16"}
    ids = moe_models.markov_batches(1, batch=2, seq=8)[0]
    net(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for n, p in net.named_parameters() if "experts" in n)
    assert ds.swap(net, "fp8-current", {}) is formats  # a second call: as it was
