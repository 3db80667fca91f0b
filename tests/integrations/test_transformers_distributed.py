"""mixprec over a model transformers sharded at load (``from_pretrained(dir,
distributed_config=DistributedConfig(...))``): the swap carries transformers' plan
wrappers. The trainings over every ``DistributedConfig`` layout (FSDP2, tensor and
expert parallelism, HSDP, TP x FSDP), each against one process, are cells of the
composition matrix (tests/helpers/matrix_cells.py, run by tests/parallel/test_matrix.py
with ``helpers.hf_distcfg_workers``)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from transformers.distributed.tensor_parallel import TensorParallelLayer

from mixprec.engine.convert import convert
from mixprec.modules.linear import Float8Linear

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning",
                                        "ignore::FutureWarning")


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
