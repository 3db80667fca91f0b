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

    def one_step(recipe):
        m = model("mixtral")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine = MixedPrecision(m, torch.optim.SGD(m.parameters(), lr=0.1), recipe,
                                    parallel="fsdp")
        before = engine.comm_stats.totals()
        ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
        with engine.autocast():
            loss = engine.model(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        key = ("all_gather", "weights", torch.float32)
        sent = engine.comm_stats.totals().get(key, 0) - before.get(key, 0)
        params = [p.full_tensor().clone() for p in engine.master_params]
        return m, engine, caught, sent, params

    m, engine, caught, sent, params = one_step("fp8-current,fp8_all_gather=true")
    falls = [f for f in engine.comm_stats.fallbacks if f.what.startswith("experts:")]
    assert sorted(f.what for f in falls) == [
        f"experts:model.layers.{i}.mlp.experts.{p}" for i in (0, 1)
        for p in ("down_proj", "gate_up_proj")]
    assert {f.sent for f in falls} == {torch.float32}
    said = [w for w in caught if "experts:" in str(w.message)]
    assert len(said) == 1 and "gathered as codes and scales" in str(said[0].message)
    # each gather of an experts weight is recorded (fp32, whole on one rank): the
    # forward's and the backward's (FSDP reshards after the forward)
    experts = sum(p.numel() * 4 for p in m.parameters() if p.dim() == 3)
    assert sent == 2 * experts
    (finding,) = audit_comm(engine)
    assert finding.code == "comm-fallback" and "experts:model.layers.0" in finding.evidence
    # the recording hooks gather what FSDP gathers: the step is bit for bit the same
    *_, plain = one_step("fp8-current")
    assert all(torch.equal(a, b) for a, b in zip(params, plain))
