"""mixprec over a model transformers sharded at load (``from_pretrained(dir,
distributed_config=DistributedConfig(...))``): FSDP2, transformers' tensor-parallel plan,
and expert parallelism beside FSDP, each on 2 gloo ranks, trained 6 AdamW steps by an
engine built over the sharded model as the README says (``MixedPrecision(model, opt,
recipe)``, no ``parallel=``), against the same model, recipe and data in one process
(``helpers.hf_distcfg_workers``)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from transformers.distributed.tensor_parallel import TensorParallelLayer

from helpers import hf_distcfg_workers as w
from helpers.ranks import spawn_tp
from mixprec.engine.convert import convert
from mixprec.modules.linear import Float8Linear

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning",
                                        "ignore::FutureWarning")

STEPS = 6
FSDP = {"fsdp_size": 2}
TP = {"tp_size": 2}
EP_FSDP = {"ep_size": 2, "fsdp_size": 2}
EP_TP = {"ep_size": 2, "tp_size": 2}
HSDP = {"dp_replicate_size": 2}
#: the tolerance on the global loss of every step against one process: bf16-master's
#: is FSDP's distributed tolerance (tests/parallel/test_distributed.py), fp8's the
#: tensor-parallel one of the recipes as they come (tests/parallel/test_tensor_parallel_fp8.py)
TOL = {"fp32": 1e-5, "bf16-master": 1e-2, "fp8-current": 5e-2, "fp8-block": 5e-2}
#: the gradient norms against one process: a 16-bit run's norms wander from one
#: process's as the rounding of partial sums differs (measured: bf16-master 2.4e-2 to
#: 6.9e-2, fp8-current 6.8e-2 to 1.9e-1, fp32 8.7e-6); a norm that missed a shard's
#: squares or counted a replica twice is off by 30% to 40%
NORM_TOL = {"fp32": 5e-5, "bf16-master": 0.1, "fp8-current": 0.25, "fp8-block": 0.25}


def _cell(kind, layout, recipe, long=True):
    marks = [pytest.mark.long] if long else []
    return pytest.param(kind, layout, recipe, marks=marks,
                        id=f"{kind}-{'x'.join(f'{k[:-5]}{v}' for k, v in layout.items())}-{recipe}")


CELLS = [
    # the fast pass: transformers' TP under bf16-master (a vocab-parallel embedding's
    # whole gradient for its shard), FSDP2 under fp8 (the swap after fully_shard)
    _cell("qwen3_moe", TP, "bf16-master", long=False),
    _cell("qwen3_moe", FSDP, "fp8-current", long=False),
    _cell("qwen3_moe", FSDP, "bf16-master"),
    _cell("qwen3_moe", TP, "fp8-current"),
    _cell("qwen3_moe", EP_FSDP, "bf16-master"),
    _cell("qwen3_moe", EP_FSDP, "fp8-current"),
    _cell("qwen3_moe", EP_TP, "fp8-current"),
    _cell("qwen3_moe", HSDP, "bf16-master"),
    # 128 x 128 blocks: FSDP2 gathers the weights whole, so no shard cut refuses them
    _cell("qwen3_moe", FSDP, "fp8-block"),
    _cell("qwen3_moe", TP, "fp32"),
    _cell("qwen3_moe", FSDP, "fp32"),
    _cell("llama", FSDP, "bf16-master"),
    _cell("llama", FSDP, "fp8-current"),
    _cell("llama", TP, "bf16-master"),
    _cell("llama", TP, "fp8-current"),
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-distcfg")
    return {kind: w.save_model(kind, str(root / kind)) for kind in w.KINDS}


@functools.cache
def _reference(model_dir: str, recipe: str) -> dict:
    return w.reference(model_dir, recipe, STEPS)


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("kind,layout,recipe", CELLS)
def test_a_model_transformers_sharded_trains_like_one_process(model_dirs, kind, layout,
                                                               recipe):
    """Each rank's engine trains transformers' shards: the loss of every step (the mean
    over the data-parallel ranks' halves of the batch, or the whole batch under TP)
    within the recipe's tolerance of one process's (measured on an AMD EPYC,
    qwen3_moe: bf16-master 3.3e-4 FSDP, 3.6e-3 TP, 1.0e-3 EP x FSDP; fp8-current
    4.8e-3, 1.5e-3, 3.1e-3, 8.6e-3 EP x TP; fp8-block 2.2e-3 FSDP; HSDP bf16-master
    3.0e-4; fp32 2e-7 FSDP and TP; llama: bf16-master 2.7e-4 FSDP, 2.1e-3 TP;
    fp8-current 4.9e-3, 6.9e-3), the same Linears quantized, the same gradient norm
    and no skip on both ranks. What it guards: fp8 meeting FSDP's whole weights on
    the Linears the swap replaced and losing transformers' plan wrappers (a DTensor
    met a plain tensor in a norm), fp8-block keeping every Linear in 16 bits for
    FSDP's shard cuts, and bf16-master under TP adding the embedding's whole
    gradient into its shard. ``parallel="fsdp"`` over FSDP2's shards is refused at
    build, naming the route."""
    ranks = spawn_tp(w.train, model_dirs[kind], layout, recipe, STEPS, name="hfdist")
    for r in ranks:
        assert "error" not in r, r.get("trace")
    ref = _reference(model_dirs[kind], recipe)
    for r in ranks:
        assert _rel(r["losses"], ref["losses"]) <= TOL[recipe], (r["losses"], ref["losses"])
        assert _rel(r["norms"], ref["norms"]) <= NORM_TOL[recipe], (r["norms"], ref["norms"])
        assert r["skipped"] == [False] * STEPS
        assert r["quantized"] == ref["quantized"]
        assert bool(r["quantized"]) == recipe.startswith("fp8")
        if "fsdp_size" in layout or "dp_replicate_size" in layout:
            assert "FSDP2 sharded already" in r["refused_fsdp"]
    assert ranks[0]["norms"] == ranks[1]["norms"]
    assert ranks[0]["losses"] == ranks[1]["losses"]
    assert torch.tensor(ranks[0]["norms"]).isfinite().all()


class _Doubled(TensorParallelLayer):
    """A transformers plan style whose wrapper doubles the module's output."""

    def transform_output_post_forward(self, module, output, mesh, config=None):
        return output * 2


def test_the_swap_carries_a_forward_transformers_plan_put_on_the_linear():
    """transformers' plans replace a Linear's ``forward`` by a wrapper closing over the
    module and its own forward: the quantized Linear that replaces it runs the wrapper
    around its own forward (twice the quantized output here), as the plan's input and
    output transforms must run under the engine; a wrapper that does not close over the
    module (no way to point it at the new one) keeps that Linear in 16 bits, said why."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32),
                        nn.Linear(32, 8))
    plain = copy.deepcopy(net)
    _Doubled().install_forward(net[0], None)
    net[1].forward = functools.partial(nn.Linear.forward, net[1])
    report = convert(net, "fp8-current")
    convert(plain, "fp8-current")
    x = torch.randn(4, 32)
    assert isinstance(net[0], Float8Linear)
    assert torch.equal(net[0](x), 2 * plain[0](x))
    assert dict(report.skipped)["1"].startswith("its forward is replaced on the instance")
    assert type(net[1]) is nn.Linear and isinstance(plain[1], Float8Linear)
    assert torch.equal(net[2](x), plain[2](x))  # the others as before
