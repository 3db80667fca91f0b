"""The composition matrix's Lightning cells (tests/helpers/matrix_cells.py's ``lightning``
builder): Lightning's own ``Trainer`` drives mixprec's ``MixedPrecisionPlugin`` on the
matrix's MLP, with Lightning's strategies (``"ddp"``, ``ModelParallelStrategy``), its
``gradient_clip_val`` and its ``ModelCheckpoint``/``fit(ckpt_path=...)`` resume.

One ``torchrun`` launch of tests/helpers/lightning_matrix.py on 2 gloo processes runs
every launched cell in turn; the reference is the engine's own one-process run of the
same model, data, optimizer and clip (tests/helpers/matrix_workers.py's
``reference``, what the engine's cells compare with). Lightning's ``FSDPStrategy``
(FSDP1) needs a GPU to build; the plugin it refuses is checked where the Trainer sets
it."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from helpers import matrix_workers as mw  # noqa: E402
from helpers.launch import free_port  # noqa: E402
from helpers.matrix_cells import FORMATS, Cell, cells_of  # noqa: E402
from helpers.paths import ROOT  # noqa: E402
from mixprec.integrations.lightning import MixedPrecisionPlugin  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")

STEPS = 6
#: this module's cells of the composition matrix
MATRIX = cells_of("tests/integrations/test_lightning_matrix.py")
TRAINS = [c for c in MATRIX if c.refuses is None]
#: refused before a launch could run them: Lightning's FSDP1 strategy builds on a GPU only
UNLAUNCHED = {"lit-fsdp1"}
REFUSES = [c for c in MATRIX if c.refuses is not None and c.layout not in UNLAUNCHED]
BUILT_ELSEWHERE = [c for c in MATRIX if c.layout in UNLAUNCHED]
SCENARIOS = [f"{c.layout}:{c.recipe}" for c in TRAINS + REFUSES]


def _param(cell: Cell):
    marks = [] if cell.fast else [pytest.mark.long]
    if cell.defect is not None:
        marks.append(pytest.mark.xfail(strict=True, reason=cell.defect))
    return pytest.param(cell, id=f"{cell.layout}-{cell.recipe}", marks=marks)


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """tests/helpers/lightning_matrix.py under ``torchrun --nproc-per-node 2`` (gloo):
    each rank's records, scenario -> record."""
    out = tmp_path_factory.mktemp("lightning-matrix")
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()),
         str(ROOT / "tests" / "helpers" / "lightning_matrix.py"), str(out), *SCENARIOS],
        cwd=out, env={**os.environ, "OMP_NUM_THREADS": "1",  # the script imports helpers
                      "PYTHONPATH": os.pathsep.join(filter(None, [
                          str(ROOT / "tests"), str(ROOT / "src"),
                          os.environ.get("PYTHONPATH")]))},
        capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    got = [torch.load(out / f"records_rank{r}.pt", weights_only=False) for r in range(2)]
    assert got[0]["world"] == got[1]["world"] == 2
    return got


@functools.cache
def _reference(recipe: str) -> dict:
    return mw.reference(recipe, STEPS)


@pytest.mark.parametrize("cell", [_param(c) for c in TRAINS])
def test_lightnings_trainer_on_two_ranks_trains_like_one_process(ranks, cell):
    """``Trainer(strategy=..., devices=2, plugins=[MixedPrecisionPlugin(recipe)],
    gradient_clip_val=1.0)``: every step's global loss (the ranks' mean) within the
    cell's tolerance of the engine's one process, every grad norm within the format's,
    no skip, both ranks the same losses, norms and skips; the coverage and the swapped
    Linears the one process's; a fresh Trainer resuming from ``ModelCheckpoint``'s
    step-3 checkpoint (``fit(ckpt_path=...)``) repeats steps 4 to 6 exactly."""
    name = f"{cell.layout}:{cell.recipe}"
    two = [r[name] for r in ranks]
    for r in two:
        assert "error" not in r, r.get("trace", r.get("error"))
    fmt, ref = FORMATS[cell.fmt], _reference(cell.recipe)
    norm_tol = fmt.norm_tol if cell.norm_tol is None else cell.norm_tol
    print(f"{cell.id}: losses {_rel(two[0]['losses'], ref['losses']):.2e}, norms "
          f"{_rel(two[0]['norms'], ref['norms']):.2e} against one process")
    for r in two:
        assert r["parallel"] == {"lit-ddp": "ddp"}.get(cell.layout, "fsdp")
        assert _rel(r["losses"], ref["losses"]) <= cell.tol, (r["losses"], ref["losses"])
        assert _rel(r["norms"], ref["norms"]) <= norm_tol, (r["norms"], ref["norms"])
        assert r["skipped"] == [False] * STEPS
        assert bool(r["quantized"]) == fmt.quantized
        assert r["quantized"] == ref["quantized"] and r["coverage"] == ref["coverage"]
        assert {"step=3.ckpt", "step=6.ckpt"} <= set(r["checkpoints"])
        assert "losses" in r["resumed"], r["resumed"]
        assert r["resumed"]["losses"] == r["losses"][STEPS // 2:], r["resumed"]
        assert r["resumed"]["norms"] == r["norms"][STEPS // 2:]
        assert r["resumed"]["skipped"] == r["skipped"][STEPS // 2:]
    assert two[0]["losses"] == two[1]["losses"]
    assert two[0]["norms"] == two[1]["norms"]
    assert two[0]["skipped"] == two[1]["skipped"]
    assert torch.tensor(two[0]["norms"]).isfinite().all()


@pytest.mark.parametrize("cell", [_param(c) for c in REFUSES])
def test_a_layout_the_plugin_cannot_run_is_refused_on_every_rank(ranks, cell):
    """``ModelParallelStrategy(tensor_parallel_size=2)`` and a ``configure_model`` that
    calls ``fully_shard`` itself: the fit raises on both ranks at set-up, naming the
    fix, before a step runs."""
    for r in ranks:
        record = r[f"{cell.layout}:{cell.recipe}"]
        assert cell.refuses in record.get("error", ""), record


@pytest.mark.parametrize("cell", [_param(c) for c in BUILT_ELSEWHERE])
def test_lightnings_fsdp1_strategy_takes_no_precision_plugin_but_its_own(cell):
    """Lightning's ``FSDPStrategy`` wraps the module in FSDP1's flat parameters and
    accepts only its own ``FSDPPrecision``: the Trainer sets ``plugins=[...]``'s
    precision plugin on the strategy, which raises (on CPU, the Trainer refuses the
    strategy before that: FSDP1 needs a GPU)."""
    from lightning.pytorch.strategies import FSDPStrategy

    with pytest.raises(TypeError) as err:
        FSDPStrategy().precision_plugin = MixedPrecisionPlugin(cell.recipe)
    assert cell.refuses in str(err.value), str(err.value)
    with pytest.raises(ValueError, match="requires a GPU accelerator"):
        pl.Trainer(accelerator="cpu", devices=1, strategy="fsdp",
                   plugins=[MixedPrecisionPlugin(cell.recipe)])


def test_the_engines_fsdp_units_under_lightning_are_a_module_lists_elements():
    """A LightningModule holding its blocks in a ``ModuleList`` directly (as the
    matrix's MLP does): the units are the list's elements and the other children, not
    the list, which ``fully_shard`` refuses (it has no forward)."""
    from torch import nn

    from mixprec.integrations.lightning import _lightning_units

    net = mw.make_model()
    module = pl.LightningModule()
    module.norm, module.blocks, module.head = net.norm, net.blocks, net.head
    module.extra = nn.ModuleDict({"a": nn.Linear(2, 2)})
    unit = _lightning_units(module)
    chosen = sorted(n for n, m in module.named_modules() if unit(m))
    assert chosen == ["blocks.0", "blocks.1", "extra.a", "head", "norm"]
