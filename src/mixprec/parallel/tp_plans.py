"""``QuantizedColwiseParallel``: torch's ``ColwiseParallel`` plan for a Linear whose
input comes sharded along the tokens (``SequenceParallel`` before it), that lets a
quantized Linear gather the input as its format's fp8 codes instead of 16 bits
(torchao's ``Float8ColwiseParallel`` does the same for its float8 Linears).

    >>> from torch.distributed.tensor import Shard
    >>> from torch.distributed.tensor.parallel import SequenceParallel
    >>> plan = {"norm": SequenceParallel(),
    ...         "fc": QuantizedColwiseParallel(input_layouts=Shard(1))}

Any other module the plan takes (a Linear the recipe keeps in 16 bits, an Embedding)
gets torch's ``ColwiseParallel`` behaviour: its input gathered before its forward. The
plan's own redistributions (that input gather and its gradient's reduce-scatter, an
output redistributed to ``output_layouts``) are recorded in the engine's ``CommStats``
(``what="activations"``, ``"input_grads"``, ``"outputs"``; this rank's local bytes)
where the engine attached it to the module (``tp_comm_stats``).
"""

from __future__ import annotations

from functools import partial

from torch import nn
from torch.distributed.tensor import DTensor, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel

__all__ = ["QuantizedColwiseParallel"]


def _collective(src, dst, ndim: int) -> str | None:
    """The collective that redistributes placement ``src`` to ``dst`` on a 1-D mesh
    (of a tensor of ``ndim`` dims)."""
    if src.is_partial():
        return "all_reduce" if dst.is_replicate() else "reduce_scatter" if \
            dst.is_shard() else None
    if src.is_shard() and dst.is_replicate():
        return "all_gather"
    if src.is_shard() and dst.is_shard() and src.dim % ndim != dst.dim % ndim:
        return "all_to_all"
    return None


def _record(mod: nn.Module, t: DTensor, dst, what: str) -> None:
    """Record in ``mod``'s ``tp_comm_stats`` the collective that places ``t`` as ``dst``."""
    stats = getattr(mod, "tp_comm_stats", None)
    op = _collective(t.placements[0], dst, t.ndim)
    if stats is not None and op is not None:
        stats.record(t.to_local(), op=op, what=what)


class QuantizedColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` whose input hook hands a quantized Linear its input as it
    came, sharded along the tokens: the Linear casts its rows and all-gathers the codes
    (``mixprec.parallel.tensor_parallel``). The hooks read the module they run on, so they
    keep working after ``mixprec.engine.convert`` swapped the Linear."""

    def _keeps_shards(self, mod: nn.Module) -> bool:
        return (hasattr(mod, "quantizer") and self.input_layouts[0].is_shard()
                and self.desired_input_layouts[0].is_replicate())

    def _input(self, mesh, mod: nn.Module, inputs):
        if not self._keeps_shards(mod):
            x = inputs[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, self.input_layouts, run_check=False)
            _record(mod, x, self.desired_input_layouts[0], "activations")
            x = ColwiseParallel._prepare_input_fn(self.input_layouts,
                                                  self.desired_input_layouts, mod, (x,),
                                                  mesh)
            if x.requires_grad and self.input_layouts != self.desired_input_layouts:
                src = self.input_layouts[0]  # the gradient goes back to the input's layout
                x.register_hook(lambda g: _record(mod, g, src, "input_grads"))
            return x
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

        def output(m, inputs, outputs):
            if isinstance(outputs, DTensor):
                _record(m, outputs, self.output_layouts[0], "outputs")
            return out(m, outputs, device_mesh)

        module.register_forward_hook(output)
        module.tp_records_plan = True  # the engine attaches its CommStats
        return module
