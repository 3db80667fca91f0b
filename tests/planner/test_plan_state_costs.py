"""The planner's optimizer-state timings (``timing.state_step_costs``) step as training
does: on a new gradient each step, so the int8 encoder does the work a training step
makes it do."""

from __future__ import annotations

import torch

import mixprec.formats.state_formats as state_formats
import mixprec.planner.timing as timing
from mixprec.optim import AdamW

#: 16 copies a timed step (``state_step_costs``' rule): 262144 elements per state
SHAPE = (64, 256)
#: half the width of the band around a tie that the int8 encoder rounds again
EPS = 2.0**-12


def _near_tie(y: torch.Tensor, k: int) -> torch.Tensor:
    """Where ``k * y^(1/4)``, in float64, lies within ``EPS`` of a tie (``n + 0.5``)."""
    v = y.double().sqrt().sqrt() * k
    return (v - v.floor() - 0.5).abs() < EPS


def test_state_timings_step_on_new_gradients_as_training_does(monkeypatch):
    grads, ties = [], []
    real_step, real_root = AdamW.step, state_formats._root4_times

    def step(self, *args, **kwargs):
        grads.append(torch.cat([p.grad.flatten() for g in self.param_groups
                                for p in g["params"]]))
        ties.append([0, 0])
        return real_step(self, *args, **kwargs)

    def root(y, k):
        near = _near_tie(y, k)
        ties[-1][0] += int(near.sum())
        ties[-1][1] += near.numel()
        return real_root(y, k)

    monkeypatch.setattr(AdamW, "step", step)
    monkeypatch.setattr(state_formats, "_root4_times", root)
    timing.clear_cache()
    got = timing.state_step_costs([SHAPE], ["int8"], seconds=0.0)
    assert got[("int8", SHAPE)] > 0 and got[("fused", SHAPE)] > 0
    assert len(grads) >= 4  # the step that creates the states, then 3 rounds at least
    for before, now in zip(grads, grads[1:]):
        assert not torch.equal(before, now)  # each timed step has a gradient of its own
    # codes near a tie take as large a share of the elements as values spread evenly
    # over a code give (the band's width, 2 * EPS); on one gradient stepped again and
    # again the states settle away from the ties and the timed steps found none
    for near, total in ties[1:]:
        assert total == 2 * 16 * SHAPE[0] * SHAPE[1]  # both moments of the 16 copies
        assert 0.5 * 2 * EPS < near / total < 2 * 2 * EPS
