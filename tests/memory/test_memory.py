"""The memory planner against published memory tables, the ZeRO paper, and measured bytes."""

from __future__ import annotations

import pytest
import torch

from helpers.models import TiedLM
from mixprec import MixedPrecision
from mixprec.cli import main
from mixprec.memory import TransformerSpec, activation_bytes, estimate, measure, parse_count
from mixprec.workbench import GPT, GPTConfig

pytestmark = pytest.mark.filterwarnings("ignore:fp16 compute on the CPU:UserWarning",
                                        "ignore:fp16 has no fast kernels:UserWarning")

PURE_FP16 = "fp16,params=fp16,grads=fp16"          # no master: states in fp16 too
MIXED_FP16_GRADS = "fp16-master,grads=fp16"        # fp16 working copy and grads, fp32 rest


def gb(b, item=None):
    return round(b.gb(item), 6)


@pytest.mark.filterwarnings("ignore:recipe. params='fp16' with master='none':UserWarning")
def test_a_70b_model_as_commonly_tabulated():  # the pure-fp16 row, which mixprec warns about
    fp32 = estimate("70B", "fp32")
    assert (gb(fp32, "params"), gb(fp32, "grads"), gb(fp32, "optimizer"), gb(fp32)) == (
        280, 280, 560, 1120)
    pure = estimate("70B", PURE_FP16)
    assert (gb(pure, "params"), gb(pure, "grads"), gb(pure, "optimizer"), gb(pure)) == (
        140, 140, 280, 560)
    mixed = estimate("70B", MIXED_FP16_GRADS)
    # the usual "~840 GB" row is 140 + 140 + 560: it leaves out the fp32 master (280)
    assert gb(mixed, "params") + gb(mixed, "grads") + gb(mixed, "optimizer") == 840
    assert gb(mixed, "master") == 280 and gb(mixed) == 1120


def test_a_100b_model_as_commonly_tabulated():
    fp32 = estimate("100B", "fp32")
    assert (gb(fp32, "params"), gb(fp32, "optimizer"), gb(fp32, "grads"), gb(fp32)) == (
        400, 800, 400, 1600)
    mixed = estimate("100B", MIXED_FP16_GRADS)
    assert (gb(mixed, "params"), gb(mixed, "grads")) == (200, 200)
    # the usual 1400 GB = master 400 + states 800 + fp16 grads 200, without the fp16
    # working copy (200) that forward and backward run on
    assert gb(mixed, "master") + gb(mixed, "optimizer") + gb(mixed, "grads") == 1400
    assert gb(mixed) == 1600


def test_a_7b_model_as_commonly_tabulated():
    fp32 = estimate("7B", "fp32")
    assert (gb(fp32, "params"), gb(fp32)) == (28, 112)
    mixed = estimate("7B", MIXED_FP16_GRADS)
    # the usual 84 GB counts one Adam moment (28); AdamW keeps two (56): 14+14+28+56
    assert gb(mixed) == 112
    assert gb(mixed) - gb(mixed, "optimizer") / 2 == 84


@pytest.mark.parametrize("stage,want,exact", [(0, 120.0, 120.0), (1, 31.4, 30 + 90 / 64),
                                              (2, 16.6, 15 + 105 / 64), (3, 1.9, 120 / 64)])
def test_zero_paper_example(stage, want, exact):
    """Rajbhandari et al. 2020, Fig. 1: 7.5B params, Adam, 64 ranks, fp16 params/grads,
    K = 12. The paper prints one decimal; stage 3 is exactly 1.875 GB (1.3% below 1.9)."""
    b = estimate(7.5e9, MIXED_FP16_GRADS, optimizer="adam", zero_stage=stage, world_size=64)
    assert b.gb() == pytest.approx(exact, rel=1e-12)
    assert round(b.gb(), 1) == want


def test_parse_count_and_errors():
    assert parse_count("70B") == 70_000_000_000
    assert parse_count("7.5e9") == 7_500_000_000
    assert parse_count("350M") == 350_000_000
    with pytest.raises(ValueError, match="'seventy'"):
        parse_count("seventy")
    with pytest.raises(ValueError, match="zero_stage"):
        estimate("1B", "fp32", zero_stage=4)
    with pytest.raises(ValueError, match="optimizer 'lion'"):
        estimate("1B", "fp32", optimizer="lion")


def test_korthikanti_formula_defaults():
    spec = TransformerSpec(layers=1, hidden=1024, heads=16, seq_len=2048, micro_batch=1)
    s, b, h, a = 2048, 1, 1024, 16
    assert activation_bytes(spec) == s * b * h * (34 + 5 * a * s / h)
    flash = TransformerSpec(layers=1, hidden=1024, heads=16, seq_len=2048, attention="flash")
    assert activation_bytes(flash) == 34 * s * b * h + 4 * a * s * b
    full = TransformerSpec(layers=3, hidden=1024, heads=16, seq_len=2048, recompute="full")
    assert activation_bytes(full) == 3 * 2 * s * b * h


@pytest.mark.parametrize("t", [1, 2, 8])
def test_korthikanti_formula_under_tensor_parallelism(t):
    """§4.2.2 of the paper: ``s·b·h·(10 + 24/t + 5·a·s/(h·t))`` per layer."""
    s, b, h, a = 2048, 2, 1024, 16
    spec = TransformerSpec(layers=1, hidden=h, heads=a, seq_len=s, micro_batch=b,
                           tensor_parallel=t)
    assert activation_bytes(spec) == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    # separate q, k, v Linears: two more 16-bit copies of the attention's input
    sep = TransformerSpec(layers=1, hidden=h, heads=a, seq_len=s, micro_batch=b,
                          tensor_parallel=t, qkv_linears=3)
    assert activation_bytes(sep) - activation_bytes(spec) == 2 * 2 * s * b * h
    assert activation_bytes(sep, 4) == activation_bytes(
        TransformerSpec(layers=1, hidden=h, heads=a, seq_len=s, micro_batch=b,
                        tensor_parallel=t), 4)  # fp32: the three read one tensor
    for bad in (dict(tensor_parallel=0), dict(qkv_linears=2)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            activation_bytes(TransformerSpec(layers=1, hidden=h, heads=a, seq_len=s, **bad))


# --- measure() equals estimate() -------------------------------------------------------

MODEL_STATES = ("params", "grads", "master", "optimizer", "fp8", "buffers")


def _engine_after_a_step(model, recipe, batch_fn):
    engine = MixedPrecision(model, torch.optim.AdamW(model.parameters(), fused=True), recipe)
    for i in range(2):  # after step 1 the optimizer states exist; after backward 2, grads
        with engine.autocast():
            loss = batch_fn(model)
        engine.backward(loss)
        if i == 0:
            engine.step()
    return engine


def _gpt_loss(idx):
    return lambda m: m(idx[:, :-1], idx[:, 1:])


@pytest.mark.parametrize("recipe", ["fp32", "bf16", "bf16-master", "fp16-master",
                                    "fp16-master,emulate=false", "fp8", "fp8-block",
                                    "nvfp4"])
def test_measure_equals_estimate_on_gpt(recipe):
    torch.manual_seed(0)
    cfg = GPTConfig(n_layers=2, d_model=64, n_heads=4, seq_len=64)
    idx = torch.randint(0, 256, (4, 65))
    model = GPT(cfg)
    predicted = estimate(model, recipe)  # before the engine (fp8 counts eligible Linears)
    engine = _engine_after_a_step(model, recipe, _gpt_loss(idx))
    got = measure(model, engine)
    for item in MODEL_STATES:
        assert got[item] == predicted[item], (recipe, item, got[item], predicted[item])


@pytest.mark.parametrize("recipe", ["fp32", "bf16", "bf16-master", "fp16-master", "fp8"])
def test_measure_equals_estimate_on_tied_mlp(recipe):
    torch.manual_seed(0)
    model = TiedLM(vocab=64, d=32)
    idx = torch.randint(0, 64, (8, 16))

    def loss(m):
        return torch.nn.functional.cross_entropy(m(idx).flatten(0, 1).float(), idx.flatten())

    predicted = estimate(model, recipe)
    engine = _engine_after_a_step(model, recipe, loss)
    got = measure(model, engine)
    for item in MODEL_STATES:
        assert got[item] == predicted[item], (recipe, item, got[item], predicted[item])


@pytest.mark.parametrize("recipe", ["fp32", "bf16-master", "fp8", "fp8-rowwise"])
def test_activations_within_10_percent_of_formula(recipe):
    """The GPT uses F.scaled_dot_product_attention (flash path, no dropout)."""
    torch.manual_seed(0)
    cfg = GPTConfig(n_layers=4, d_model=128, n_heads=4, seq_len=128)
    idx = torch.randint(0, 256, (8, 129))
    model = GPT(cfg)
    engine = _engine_after_a_step(model, recipe, _gpt_loss(idx))
    before = [b.clone() for b in model.buffers()]
    got = measure(model, engine, (idx[:, :-1], idx[:, 1:]))
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers()))  # restored
    spec = TransformerSpec(layers=4, hidden=128, heads=4, seq_len=128, micro_batch=8,
                           vocab=256, attention="flash", dropout=False)
    want = estimate(model, recipe, activations=spec)["activations"]
    assert got["activations"] == pytest.approx(want, rel=0.10)
    if recipe.startswith("fp8"):
        assert got["weight_casts"] > 0  # fp8 copies of the weights, counted apart


def test_cli_memory_table_and_plot(tmp_path, capsys):
    png, svg = tmp_path / "m.png", tmp_path / "m.svg"
    assert main(["memory", "--params", "70B", "--recipe", "fp32,bf16-master,fp16-master",
                 "--device-memory", "80GB", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "1,120.00" in out and "fits 80 GB?" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert main(["memory", "--params", "7.5B", "--recipe", "fp16-master,grads=fp16",
                 "--zero", "3", "--gpus", "64", "--plot", str(svg)]) == 0
    assert "<svg" in svg.read_text()[:500]
    assert "1.88" in capsys.readouterr().out
    assert main(["memory", "--params", "1B", "--plot", str(tmp_path / "x.jpg")]) == 2


@pytest.mark.parametrize("recipe", ["fp32", "bf16", "bf16-master", "fp16-master", "fp8"])
def test_measure_equals_estimate_with_frozen_parameters(recipe):
    """Frozen parameters (a fine-tuned model's frozen base) have no gradient, master or
    optimizer state, and the engine leaves them in their own dtype."""
    torch.manual_seed(0)
    cfg = GPTConfig(n_layers=2, d_model=64, n_heads=4, seq_len=64)
    idx = torch.randint(0, 256, (4, 65))
    model = GPT(cfg)
    for blk in model.blocks[:1]:
        blk.requires_grad_(False)
    if recipe != "fp32":  # (fp32 compute cannot take bf16 weights)
        model.blocks[0].fc.bfloat16()  # a frozen part already stored in bf16
    predicted = estimate(model, recipe)
    engine = _engine_after_a_step(model, recipe, _gpt_loss(idx))
    got = measure(model, engine)
    for item in MODEL_STATES:
        assert got[item] == predicted[item], (recipe, item, got[item], predicted[item])



@pytest.mark.parametrize("name,make", [
    ("adam", lambda ps: torch.optim.Adam(ps)),
    ("sgd_momentum", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
    ("sgd", lambda ps: torch.optim.SGD(ps, lr=0.1)),
    ("adagrad", lambda ps: torch.optim.Adagrad(ps)),
    ("rmsprop", lambda ps: torch.optim.RMSprop(ps)),
    ("adadelta", lambda ps: torch.optim.Adadelta(ps)),
    ("adamax", lambda ps: torch.optim.Adamax(ps)),
    ("nadam", lambda ps: torch.optim.NAdam(ps)),
    ("radam", lambda ps: torch.optim.RAdam(ps)),
])
@pytest.mark.parametrize("recipe", ["bf16", "bf16-master"])
def test_measure_equals_estimate_for_each_optimizer(name, make, recipe):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layers=1, d_model=32, n_heads=2, seq_len=16))
    idx = torch.randint(0, 256, (2, 17))
    predicted = estimate(model, recipe, optimizer=name)
    engine = MixedPrecision(model, make(model.parameters()), recipe)
    with engine.autocast():
        loss = _gpt_loss(idx)(model)
    engine.backward(loss)
    engine.step()
    got = measure(model, engine)["optimizer"]
    assert got == predicted["optimizer"], (got, predicted["optimizer"])
    assert (got > 0) == (name != "sgd")


def test_the_ledger_holds_what_it_counted_so_a_freed_address_is_not_skipped_later():
    """A temporary counted early and then freed must not lend its address to a later
    tensor: the pointer check would skip the later one (one fp8 weight cast went
    uncounted under FSDP this way)."""
    from mixprec.memory.ledger import _Ledger

    for n in (256, 6912, 65536, 1 << 20):  # the allocator reuses some of these sizes
        led = _Ledger()
        led.add("gradients", [torch.empty(n)])  # dropped by the caller at once
        later = [torch.empty(n) for _ in range(8)]  # the allocator's next blocks
        led.add("weight_casts", later)
        assert led.items["weight_casts"] == 8 * n * 4, n
