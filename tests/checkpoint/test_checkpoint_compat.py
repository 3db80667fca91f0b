"""Engine checkpoints written before layouts were recorded load as they were meant."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec import MixedPrecision
from mixprec.checkpoint.compat import saved_layout


def _engine():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    return MixedPrecision(model, torch.optim.AdamW(model.parameters()), "bf16-master")


def test_a_state_without_a_layout_is_whole_from_one_rank_and_shards_from_several():
    assert saved_layout({}) == "full" and saved_layout({"world_size": 1}) == "full"
    assert saved_layout({"world_size": 2}) == "sharded"
    assert saved_layout({"world_size": 2, "layout": "full"}) == "full"


def test_a_layoutless_engine_state_of_one_rank_loads_and_one_of_two_is_refused():
    a, b = _engine(), _engine()
    with a.autocast():
        loss = a.module(torch.ones(4, 8)).float().sum()
    a.backward(loss)
    a.step()
    state = a.state_dict()
    del state["layout"]
    b.load_state_dict(state)
    assert all(torch.equal(x, y) for x, y in zip(a.module.parameters(),
                                                  b.module.parameters()))
    with pytest.raises(ValueError, match="FSDP shards of 2 rank"):
        b.load_state_dict({**state, "world_size": 2})
