"""FSDP2's ``fp8_all_gather`` and transformers MoE experts: the experts' 3-D weights
are gathered as FSDP holds them, and that is reported, not silent."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_fp8_all_gather_notes_the_experts_weights_it_gathers_whole(one_rank_group):
    """FSDP2 with ``fp8_all_gather``: the experts' 3-D weights are gathered as FSDP holds
    them; each projection is a ``CommStats`` fallback (one warning) and the doctor's
    ``comm-fallback`` finding names it."""
    import warnings

    import torch

    from mixprec import MixedPrecision
    from mixprec.diagnostics import audit_comm
    from moe_helpers import model

    m = model("mixtral")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = MixedPrecision(m, torch.optim.SGD(m.parameters(), lr=0.1),
                                "fp8-current,fp8_all_gather=true", parallel="fsdp")
    falls = [f for f in engine.comm_stats.fallbacks if f.what.startswith("experts:")]
    assert sorted(f.what for f in falls) == [
        f"experts:model.layers.{i}.mlp.experts.{p}" for i in (0, 1)
        for p in ("down_proj", "gate_up_proj")]
    assert {f.sent for f in falls} == {torch.float32}
    said = [w for w in caught if "experts:" in str(w.message)]
    assert len(said) == 1 and "gathered as codes and scales" in str(said[0].message)
    (finding,) = audit_comm(engine)
    assert finding.code == "comm-fallback" and "experts:model.layers.0" in finding.evidence
