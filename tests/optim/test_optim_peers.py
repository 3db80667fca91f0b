"""mixprec.optim's coded states against torchao's (AdamW8bit, AdamWFp8, AdamW4bit):
bytes per tensor on shapes whose rows do not divide into 256-element blocks, and the
accuracy of the update the stored moments give, on a small conv/embedding model."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import mixprec.optim as mo
from mixprec.optim.states import decode, encode

ao = pytest.importorskip("torchao.optim")

PEERS = {"int8": "AdamW8bit", "fp8": "AdamWFp8", "int4": "AdamW4bit"}
#: rows of 257, a 3×3 conv over 64 channels (rows of 576), rows of 384: every element
#: count divides by torchao's blocks, so torchao quantizes them all
SHAPES = ((1024, 257), (64, 64, 3, 3), (96, 384))


def _state_bytes(opt) -> int:
    total = 0
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.ndim:
                inner = ([getattr(v, n) for n in v.__tensor_flatten__()[0]]
                         if hasattr(v, "__tensor_flatten__") else [v])
                total += sum(t.numel() * t.element_size() for t in inner)
    return total


def _one_step(make, shape) -> int:
    p = nn.Parameter(torch.randn(shape))
    opt = make([p])
    p.grad = torch.randn(shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step()
    return _state_bytes(opt)


def _torchao_state_bytes(cls_name: str, shape) -> int:
    """The bytes of the two moments torchao's optimizer makes for a parameter of
    ``shape``, from its own ``_new_buffer`` (what its first step calls; the step itself
    is compiled with inductor, which the state sizes do not need)."""
    p = nn.Parameter(torch.randn(shape))
    opt = getattr(ao, cls_name)([p])
    total = 0
    for v in (opt._new_buffer(p, True), opt._new_buffer(p, False)):
        inner = ([getattr(v, n) for n in v.__tensor_flatten__()[0]]
                 if hasattr(v, "__tensor_flatten__") else [v])
        total += sum(t.numel() * t.element_size() for t in inner)
    return total


@pytest.mark.parametrize("states", list(PEERS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_state_bytes_per_tensor_are_at_most_1_03x_torchaos(states, shape):
    ours = _one_step(lambda ps: mo.AdamW(ps, states=states), shape)
    theirs = _torchao_state_bytes(PEERS[states], shape)
    numel = torch.Size(shape).numel()
    assert theirs < 4 * numel  # torchao did quantize this tensor
    assert ours <= 1.03 * theirs, (ours / theirs)


def _moments(steps: int = 10):
    """Adam's moments after ``steps`` of a small model: a skewed embedding (rows seen
    rarely), a 3×3 conv over 64 channels, torch's AdamW in fp32."""
    torch.manual_seed(0)
    emb, conv = nn.Embedding(1024, 257), nn.Conv2d(64, 64, 3, padding=1)
    stem, head = nn.Conv2d(3, 64, 3, padding=1), nn.Linear(257 + 64, 10)
    params = [*emb.parameters(), *conv.parameters(), *stem.parameters(), *head.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3)
    for _ in range(steps):
        img, y = torch.randn(8, 3, 12, 12), torch.randint(0, 10, (8,))
        tok = (torch.rand(8, 16) ** 3 * 1024).long()
        a = conv(torch.relu(stem(img))).mean((2, 3))
        loss = nn.functional.cross_entropy(head(torch.cat([a, emb(tok).mean(1)], 1)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [(opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"], steps)
            for p in (emb.weight, conv.weight)]


def _update(m, v, t):
    return (m / (1 - 0.9 ** t)) / ((v / (1 - 0.999 ** t)).sqrt() + 1e-8)


def _far_off(mq, vq, m, v, t) -> float:
    """Share of elements whose update is more than 50% off the fp32 states' one."""
    u, uq = _update(m, v, t), _update(mq, vq, t)
    nz = u != 0
    return ((uq - u).abs() > 0.5 * u.abs())[nz].float().mean().item()


def _mean_error(mq, vq, m, v, t) -> float:
    u, uq = _update(m, v, t), _update(mq, vq, t)
    return ((uq - u).abs().sum() / u.abs().sum()).item()


def _torchao(cls_name, x, signed):
    import torchao.optim.subclass_8bit as s8
    import torchao.optim.subclass_fp8 as sf

    if cls_name == "fp8":
        st = sf.OptimStateFp8.zeros(x.shape, block_size=256)
    else:
        st = s8.OptimState8bit.zeros(x.shape, signed=signed, block_size=256)
    st.copy_(x)
    return st.dequantize()


def _linear_int8(x):  # a per-row linear grid (what a plain int8 map does)
    s = x.abs().amax(-1, keepdim=True) / 127
    return torch.where(s > 0, x / s, 0).round() * s


def test_int8_first_moment_has_no_more_far_off_updates_than_torchaos():
    for m, v, t in _moments():
        ours = decode(encode(m, "int8"), "int8", m)
        theirs = _torchao("int8", m, signed=True)
        assert _far_off(ours, v, m, v, t) <= _far_off(theirs, v, m, v, t)
        # the control: a linear int8 grid misses by over 50% on a share of elements
        assert _far_off(_linear_int8(m.reshape(m.shape[0], -1)).view(m.shape), v, m, v,
                        t) > 1e-3


def test_int8_second_moment_updates_are_as_close_as_torchaos():
    for m, v, t in _moments():
        ours = decode(encode(v, "int8", signed=False), "int8", v, signed=False)
        theirs = _torchao("int8", v, signed=False)
        assert _far_off(m, ours, m, v, t) <= _far_off(m, theirs, m, v, t)
        assert _mean_error(m, ours, m, v, t) <= _mean_error(m, theirs, m, v, t)


def test_fp8_second_moment_updates_are_as_close_as_torchaos():
    """fp8 stores v itself (as torchao's AdamWFp8), its zero code read as the smallest
    subnormal: the same mean update error or lower, and no more far-off updates."""
    for m, v, t in _moments():
        ours = decode(encode(v, "fp8", signed=False), "fp8", v, signed=False)
        theirs = _torchao("fp8", v, signed=False)
        assert _mean_error(m, ours, m, v, t) <= 1.001 * _mean_error(m, theirs, m, v, t)
        assert _far_off(m, ours, m, v, t) <= _far_off(m, theirs, m, v, t)
        # the control: its square root in e4m3 (mixprec 0.2's rule) errs twice as much
        r = v.sqrt().reshape(v.shape[0], -1)
        s = r.abs().amax(-1, keepdim=True) / 448
        old = (torch.where(s > 0, r / s, 0).to(torch.float8_e4m3fn).float() * s).square()
        assert _mean_error(m, old.view(v.shape), m, v, t) > 1.5 * _mean_error(m, ours, m,
                                                                               v, t)
