"""``QuantizedColwiseParallel``: torch's ``ColwiseParallel`` plan for a Linear whose
input comes sharded along the tokens (``SequenceParallel`` before it), that lets a
quantized Linear gather the input as its format's fp8 codes instead of 16 bits
(torchao's ``Float8ColwiseParallel`` does the same for its float8 Linears).

    >>> from torch.distributed.tensor import Shard
    >>> from torch.distributed.tensor.parallel import SequenceParallel
    >>> plan = {"norm": SequenceParallel(),
    ...         "fc": QuantizedColwiseParallel(input_layouts=Shard(1))}

Any other module the plan takes (a Linear the recipe keeps in 16 bits, an Embedding)
gets torch's ``ColwiseParallel`` behaviour: its input gathered before its forward.
"""

from __future__ import annotations

from functools import partial

from torch import nn
from torch.distributed.tensor import DTensor, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel

__all__ = ["QuantizedColwiseParallel"]


class QuantizedColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` whose input hook hands a quantized Linear its input as it
    came, sharded along the tokens: the Linear casts its rows and all-gathers the codes
    (``mixprec.fp8.tensor_parallel``). The hooks read the module they run on, so they
    keep working after ``mixprec.fp8.convert`` swapped the Linear."""

    def _keeps_shards(self, mod: nn.Module) -> bool:
        return (hasattr(mod, "quantizer") and self.input_layouts[0].is_shard()
                and self.desired_input_layouts[0].is_replicate())

    def _input(self, mesh, mod: nn.Module, inputs):
        if not self._keeps_shards(mod):
            return ColwiseParallel._prepare_input_fn(self.input_layouts,
                                                     self.desired_input_layouts, mod,
                                                     inputs, mesh)
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, self.input_layouts, run_check=False)
        return x

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            return super()._apply(module, device_mesh)
        fn = (self._partition_linear_fn if isinstance(module, nn.Linear)
              else self._partition_embedding_fn)
        module = distribute_module(module, device_mesh, fn)
        module.register_forward_pre_hook(lambda m, inputs: self._input(device_mesh, m,
                                                                       inputs))
        out = partial(ColwiseParallel._prepare_output_fn, self.output_layouts,
                      self.use_local_output)
        module.register_forward_hook(lambda m, inputs, outputs: out(m, outputs,
                                                                    device_mesh))
        return module
