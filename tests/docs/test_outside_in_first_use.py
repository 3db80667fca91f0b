"""First use as the manual tells it (README, the doctor, memory, your-loop and MoE guides,
troubleshooting, ``--help``): each figure against a reference of its own: torch's AdamW in
fp32, transformers' models from the same config, hand and published counts, torch's
``FlopCounterMode``."""

from __future__ import annotations

import copy
import json
import math
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, Qwen3MoeConfig

import mixprec
from helpers.paths import ROOT
from mixprec import MixedPrecision
from mixprec.memory import estimate, param_count, spec_from_config

SRC = str(ROOT / "src")


def _run(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _cli(*args: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "mixprec", *args], cwd, timeout)


def _block(page: str, after: str, lang: str) -> str:
    """The first fenced ``lang`` block of a docs page after the text ``after``."""
    text = (ROOT / page).read_text()
    start = text.index(f"```{lang}\n", text.index(after)) + len(lang) + 4
    return text[start:text.index("```", start)]


# ---------------------------------------------------------------- 1. the doctor


def _conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3),
                         nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 5))


_G = torch.Generator().manual_seed(1)
_X = torch.randn(6, 16, 3, 8, 8, generator=_G)
_Y = torch.randint(0, 5, (6, 16), generator=_G)


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    return F.cross_entropy(model(_X[step % 6]), _Y[step % 6])


def _adamw_fp32(lr: float, steps: int) -> tuple[list[float], float]:
    """torch's AdamW in fp32 on the same model and batches: the losses and the first
    step's ||dw|| / ||w|| over all parameters."""
    model = _conv_net()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    w0 = torch.cat([p.detach().flatten() for p in model.parameters()])
    losses, ratio = [], 0.0
    for i in range(steps):
        loss = _loss(model, i)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if i == 0:
            w1 = torch.cat([p.detach().flatten() for p in model.parameters()])
            ratio = ((w1 - w0).norm() / w0.norm()).item()
    return losses, ratio


@pytest.mark.parametrize("lr", [10.0, 100.0])
def test_doctor_names_the_learning_rate_of_a_conv_net_trained_too_fast(lr):
    report = mixprec.doctor(_conv_net, _loss, "bf16-master", steps=6, lr=lr,
                            reference_steps=0)
    ref_losses, ref_ratio = _adamw_fp32(lr, 6)
    # the guide's rule on fp32's losses: tenfold up and staying up is loss-diverging, a
    # spike it recovers from is update-ratio (lr 10: 4.7e6, then back to 6x; lr 100: 44x)
    stays_up = ref_losses[-1] > 10 * ref_losses[0]
    assert max(ref_losses) > 1e4 * ref_losses[0]
    code, severity = ("loss-diverging", "error") if stays_up else ("update-ratio", "warning")
    found = {f.code: f for f in report.findings}
    assert code in found and not report.ok, str(report)
    assert {"loss-diverging", "update-ratio"} - {code} - set(found)   # not both
    finding = found[code]
    assert str(finding.severity).lower().endswith(severity)
    assert f"lr {lr:g}" in finding.title and "learning rate" in finding.advice
    losses = report.facts["losses"]
    assert losses[0] == pytest.approx(ref_losses[0], rel=2e-2)    # the same model and data
    if stays_up:
        assert finding.data["lr"] == lr
        assert finding.data["loss_growth"] == pytest.approx(max(losses) / losses[0],
                                                            rel=1e-3)
    # AdamW's first step moves each element by ~lr: the recorded ratio is fp32's
    assert report.facts["update_ratios"][0] == pytest.approx(ref_ratio, rel=0.02)
    suggested = float(re.search(r"about lr ([0-9.e+-]+)", finding.advice).group(1))
    assert suggested == pytest.approx(lr * 0.01 / ref_ratio, rel=0.05)
    assert "warm" in finding.advice and "max_grad_norm" in finding.advice


def test_doctor_finds_nothing_wrong_at_a_sane_learning_rate():
    report = mixprec.doctor(_conv_net, _loss, "bf16-master", steps=6, lr=1e-3,
                            reference_steps=0)
    _, ref_ratio = _adamw_fp32(1e-3, 1)
    assert report.ok, str(report)
    assert not {"loss-diverging", "update-ratio"} & set(report.codes())
    ratios = report.facts["update_ratios"]
    assert max(ratios) < 0.1                                # "every step's ratio below 0.1"
    assert ratios[0] == pytest.approx(ref_ratio, rel=0.02)


def test_doctor_cli_on_the_workbench_gpt_at_lr_10(tmp_path):
    out = _cli("doctor", "--recipe", "bf16-master", "--lr", "10", "--json",
               "--reference-steps", "0", cwd=tmp_path)
    report = json.loads(out.stdout)
    assert report["recipe"] == "bf16-master" and report["ok"] is False
    div = [f for f in report["findings"] if f["code"] == "loss-diverging"]
    assert len(div) == 1 and div[0]["severity"] == "error"
    assert "lr 10" in div[0]["title"] and div[0]["data"]["lr"] == 10.0
    losses = report["facts"]["losses"]
    # the workbench starts near a uniform guess over its 256 byte values ...
    assert losses[0] == pytest.approx(math.log(256), abs=0.5)
    # ... and grows tenfold or more, as the guide says (5.3 to ~5e3)
    assert div[0]["data"]["loss_growth"] == pytest.approx(max(losses) / losses[0], rel=1e-3)
    assert max(losses) > 10 * losses[0]


# ---------------------------------------------------------------- 2. memory

_SMALL = dict(hidden_size=96, intermediate_size=160, num_hidden_layers=3,
              num_attention_heads=6, num_key_value_heads=2, vocab_size=300)


def _hand_count(c, *, qk_norm: bool = False) -> int:
    """A decoder's parameters counted by hand: attention, gated MLP or experts with
    their router, two RMSNorms a layer (and Qwen3's per-head q/k norms), the final
    norm, the embedding and an untied head."""
    h, hd = c.hidden_size, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    attn = 2 * h * q + 2 * h * kv + (2 * hd if qk_norm else 0)
    experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    if experts:
        width = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
        mlp = experts * 3 * h * width + h * experts
    else:
        mlp = 3 * h * c.intermediate_size
    embed = c.vocab_size * h * (1 if c.tie_word_embeddings else 2)
    return c.num_hidden_layers * (attn + mlp + 2 * h) + h + embed


def _llama(h, ffn, layers, heads, kv, vocab, **kw):
    return LlamaConfig(hidden_size=h, intermediate_size=ffn, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                       tie_word_embeddings=kw.pop("tie_word_embeddings", False), **kw)


def _configs():
    return {
        "llama": LlamaConfig(**_SMALL, tie_word_embeddings=False),
        "llama-tied": LlamaConfig(**_SMALL, tie_word_embeddings=True),
        "mixtral": MixtralConfig(**_SMALL, num_local_experts=4, num_experts_per_tok=2),
        "qwen3-moe": Qwen3MoeConfig(**_SMALL, head_dim=32, moe_intermediate_size=48,
                                    num_experts=6, num_experts_per_tok=2,
                                    tie_word_embeddings=False),
        "llama-3-8b": _llama(4096, 14336, 32, 32, 8, 128256),
        "llama-3-70b": _llama(8192, 28672, 80, 64, 8, 128256),
        "mixtral-8x7b": MixtralConfig(),        # transformers' defaults are Mixtral-8x7B's
        "qwen3-30b-a3b": Qwen3MoeConfig(hidden_size=2048, num_hidden_layers=48,
                                        num_attention_heads=32, num_key_value_heads=4,
                                        head_dim=128, moe_intermediate_size=768,
                                        num_experts=128, num_experts_per_tok=8,
                                        vocab_size=151936, tie_word_embeddings=False),
    }


PUBLISHED = {"llama-3-8b": (8.03e9, 0.005e9), "llama-3-70b": (70.55e9, 0.005e9),
             "mixtral-8x7b": (46.70e9, 0.005e9), "qwen3-30b-a3b": (30.5e9, 0.05e9)}


def _real_count(config) -> int:
    """The parameters of the transformers model built from ``config`` (on the meta
    device for the large ones: shapes only)."""
    device = "cpu" if config.hidden_size < 1024 else "meta"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", ["llama", "llama-tied", "mixtral", "llama-3-8b",
                                  "llama-3-70b", "mixtral-8x7b", "qwen3-30b-a3b"])
def test_param_count_from_a_config_equals_the_model_built_from_it(name):
    config = _configs()[name]
    counted = param_count(spec_from_config(config, seq_len=128))
    qk_norm = name.startswith("qwen3")     # Qwen3's per-head q/k norms
    assert counted == _real_count(config) == _hand_count(config, qk_norm=qk_norm)
    if name in PUBLISHED:
        value, half_digit = PUBLISHED[name]
        assert abs(counted - value) <= half_digit


@pytest.mark.parametrize("name", ["qwen3-moe", "qwen3-30b-a3b"])
def test_param_count_of_qwen3_moe_includes_its_qk_norms(name):
    config = _configs()[name]
    assert _real_count(config) == _hand_count(config, qk_norm=True)      # the reference
    assert param_count(spec_from_config(config, seq_len=128)) == _real_count(config)


def test_estimate_prices_a_config_per_item_under_zero3():
    config = _configs()["llama-3-8b"]
    n = _hand_count(config)
    spec = spec_from_config(config, seq_len=4096, attention="flash", dropout=False)
    items = estimate(spec, "bf16-master", zero_stage=3, world_size=64).items
    # bf16 params 2, fp32 grads 4, fp32 masters 4, AdamW's two fp32 moments 8, over 64
    for item, per_param in (("params", 2), ("grads", 4), ("master", 4), ("optimizer", 8)):
        assert items[item] == pytest.approx(per_param * n / 64, rel=1e-9), item
    assert items["activations"] > 0
    # fp8 under ZeRO-3: each rank holds every Linear's whole cast, 1 byte an element of
    # the layers' Linears and experts, 2 for the bf16 copies of routers and head
    c, h = _configs()["mixtral-8x7b"], 4096
    layer = 2 * h * h + 2 * h * 1024 + 8 * 3 * h * c.intermediate_size
    casts = c.num_hidden_layers * layer + 2 * (c.num_hidden_layers * h * 8 + c.vocab_size * h)
    spec = spec_from_config(c, seq_len=4096, attention="flash", dropout=False)
    fp8 = estimate(spec, "fp8", zero_stage=3, world_size=64).items
    assert fp8["weight_casts"] == casts
    assert fp8["params"] == pytest.approx(4 * _hand_count(c) / 64, rel=1e-9)


@pytest.mark.parametrize("name", ["llama-3-70b", "mixtral-8x7b"])
def test_memory_cli_reads_a_config_json(tmp_path, name):
    config = _configs()[name]
    config.save_pretrained(tmp_path / name)
    out = _cli("memory", "--config", str(tmp_path / name), "--seq", "256",
               "--recipe", "bf16-master;fp8", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    n = _hand_count(config)
    assert f"{n / 1e9:.2f}B (counted from the shapes)" in out.stdout
    row = re.search(r"params\s*│\s*([\d,.]+)\s*│\s*([\d,.]+)", out.stdout)
    bf16_gb, fp8_gb = (float(v.replace(",", "")) for v in row.groups())
    assert bf16_gb == pytest.approx(round(2 * n / 1e9, 2), abs=0.006)   # bf16 working copy
    assert fp8_gb == pytest.approx(round(4 * n / 1e9, 2), abs=0.006)    # fp32, own masters


# ---------------------------------------------------------------- 3. README


QUICK_CHECK = """
import json
w_mp = {k: v.detach().clone() for k, v in weights.items()}
torch.manual_seed(0)
exec(MODEL_AND_DATA)
ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
w0 = {k: v.detach().clone() for k, v in model.state_dict().items()}
for x, y in batches:
    ref_opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    ref_opt.step()
print(json.dumps({
    "dtypes": sorted({str(v.dtype) for v in w_mp.values()}),
    "keys": sorted(w_mp) == sorted(model.state_dict()),
    "moved": sum((w_mp[k] - w0[k]).norm().item() for k in w0),
    "off_ref": sum((w_mp[k] - v).norm().item() for k, v in model.state_dict().items()),
    "skipped": int(engine.skipped_steps), "scale": float(engine.scale),
}))
"""


def test_readme_quick_start_pasted_in_a_fresh_interpreter(tmp_path):
    block = _block("README.md", "## Quick start", "python")
    lines = block.splitlines()
    model_and_data = "\n".join(ln for ln in lines if ln.startswith(("model =", "batches =")))
    script = ("import torch\ntorch.manual_seed(0)\n" + block
              + f"\nMODEL_AND_DATA = {model_and_data!r}\n" + QUICK_CHECK)
    out = _run([sys.executable, "-c", script], tmp_path)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert (tmp_path / "ckpt.pt").stat().st_size > 0
    assert got["keys"] and got["dtypes"] == ["torch.float32"]     # fp32 masters
    assert got["skipped"] == 0 and got["scale"] == 1.0            # bf16 needs no scaling
    # ten bf16-master steps land where fp32 AdamW with clipping does, far closer than
    # the distance they travelled
    assert got["off_ref"] < 0.1 * got["moved"]


def test_recipe_fp32_is_plain_torch_training():
    model, ref = _conv_net(), _conv_net()
    data = list(zip(_X, _Y))
    engine = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "fp32")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for x, y in data:
        with engine.autocast():
            loss = F.cross_entropy(model(x), y)
        engine.backward(loss)
        engine.step()
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(engine.export_state_dict()[k], v, rtol=1e-6, atol=1e-7)
    # bf16-sr writes weights itself: torch's AdamW is refused, naming mixprec's optimizer
    with pytest.raises(ValueError, match=r"torch's AdamW cannot .* mixprec\.optim\.AdamW"):
        MixedPrecision(ref, torch.optim.AdamW(ref.parameters()), "bf16-sr")


def _table_row(text: str, name: str) -> list[float]:
    row = re.search(rf"│ {name}\s*│(.*)│\s*$", text, re.M).group(1)
    return [float(v.strip().replace(",", "")) for v in row.split("│")]


def test_readme_one_liners_formats_and_memory(tmp_path):
    out = _cli("formats", "--value", "2048", "--update", "1e-4", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    for fmt, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16),
                       ("fp16", torch.float16), ("fp8_e5m2", torch.float8_e5m2)):
        spacing = torch.finfo(dtype).eps * 2048                 # one ulp at 2048
        row = re.search(rf"│ {fmt}\s*│\s*2048\s*│[^│]*│\s*([0-9.e+-]+)\s*│", out.stdout)
        assert float(row.group(1)) == pytest.approx(spacing, rel=1e-5), fmt
        w = torch.tensor(2048.0, dtype=dtype).float()
        assert (w + 1e-4).to(dtype).item() == 2048.0             # the update vanishes
    # e4m3 tops out at 448 and has no inf: an IEEE-style cast overflows to NaN
    assert re.search(r"│ fp8_e4m3\s*│\s*nan", out.stdout)
    assert np.isnan(np.float32(2048).astype(ml_dtypes.float8_e4m3fn).astype(np.float32))

    out = _cli("memory", "--params", "70B", "--recipe", "fp32;bf16-master;bf16-lean",
               cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    n = 70e9
    int8_states = 2 * (1 + 4 / 256) * n                          # 1 byte + a scale per 256
    expect = {"params": [4 * n, 2 * n, 2 * n], "grads": [4 * n, 4 * n, 2 * n],
              "master": [0, 4 * n, 0], "optimizer": [8 * n, 8 * n, int8_states]}
    expect["total"] = [sum(col) for col in zip(*expect.values())]
    for item, want in expect.items():
        assert _table_row(out.stdout, item) == pytest.approx([w / 1e9 for w in want],
                                                             abs=0.006), item


@pytest.mark.long
def test_compare_piped_prints_its_progress(tmp_path):
    out = _cli("compare", "--size", "tiny", "--steps", "4", "--recipes", "fp32,bf16",
               "--out", str(tmp_path / "runs"), cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr
    err = out.stderr
    assert "compare: training fp32 (1 of 2), 4 steps" in err
    assert "compare: training bf16 (2 of 2), 4 steps" in err
    done = re.search(r"compare: bf16 done in \d+ s: validation loss ([\d.]+)", err)
    assert done and "compare: the doctor on bf16" in err
    # one plain line per step here (a tenth of 4 steps rounds to each), never a bar
    steps = re.findall(r"^bf16: step (\d+)/4  loss ([\d.]+)", err, re.M)
    assert [int(s) for s, _ in steps] == [1, 2, 3, 4]
    logged = [json.loads(ln) for ln in (tmp_path / "runs" / "bf16" / "metrics.jsonl")
              .read_text().splitlines()]
    train = [r["loss"] for r in logged if "loss" in r]
    assert [float(v) for _, v in steps] == pytest.approx(train, abs=5e-4)
    assert float(steps[0][1]) == pytest.approx(math.log(256), abs=0.5)  # uniform over bytes
    assert (tmp_path / "runs" / "report.html").exists()


# ---------------------------------------------------------------- 4. coverage


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(48, 128)
        self.blocks = nn.ModuleList([nn.Linear(128, 128) for _ in range(4)])
        self.aux = nn.Linear(128, 256)              # never reached by the forward
        self.wide = nn.Linear(128, 384, bias=False)
        self.narrow = nn.Linear(384, 128)
        self.out = nn.Linear(128, 20)

    def forward(self, x):
        x = torch.relu(self.inp(x))
        for b in self.blocks:
            x = x + torch.relu(b(x))
        x = x + torch.relu(self.blocks[0](x))         # blocks.0 runs twice
        return self.out(self.narrow(torch.relu(self.wide(x))))


WEIGHTS = {"inp": 48 * 128, **{f"blocks.{i}": 128 * 128 for i in range(4)},
           "aux": 128 * 256, "wide": 128 * 384, "narrow": 384 * 128, "out": 128 * 20}
KEPT_RULES = "layer:blocks.1=bf16,layer:narrow=bf16,layer:inp=bf16"


def _flops_by_module(net: nn.Module, x: torch.Tensor) -> dict[str, int]:
    with FlopCounterMode(display=False) as counter:
        net(x)
    counts = counter.get_flop_counts()
    return {name: sum(counts.get(f"Net.{name}", {}).values()) for name in WEIGHTS}


def _engine(recipe: str) -> tuple[MixedPrecision, mixprec.engine.coverage.Coverage, dict[str, int]]:
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(3, 5, 48)
    flops = _flops_by_module(copy.deepcopy(net), x)
    engine = MixedPrecision(net, torch.optim.AdamW(net.parameters()), recipe)
    with engine.autocast():
        by_flops = engine.coverage_flops(lambda: net(x))
    return engine, by_flops, flops


def test_coverage_under_bf16_master_is_all_16_bit():
    engine, by_flops, flops = _engine("bf16-master")
    cov = engine.coverage
    total = sum(WEIGHTS.values())
    assert cov.total == total
    assert cov.shares() == {"bf16": 1.0} and cov.low_precision_share == 0.0
    assert cov.kept() == []                                  # nothing is called kept
    assert str(cov).splitlines()[0] == (f"coverage: 100% of {total:,} matmul weight "
                                        "parameters in 16 bits (bf16), 0% below 16 bits")
    assert by_flops.total == sum(flops.values())             # torch's own FLOP count
    assert by_flops.shares() == {"bf16": 1.0}


def test_coverage_under_fp8_current_counts_the_kept_modules():
    engine, by_flops, flops = _engine("fp8-current," + KEPT_RULES)
    cov = engine.coverage
    kept = {"narrow": "rule layer:narrow=bf16", "blocks.1": "rule layer:blocks.1=bf16",
            "inp": "rule layer:inp=bf16", "out": "output head: the last Linear"}
    total = sum(WEIGHTS.values())
    high = sum(WEIGHTS[k] for k in kept) / total
    assert cov.high_precision_share == pytest.approx(high)
    assert cov.low_precision_share == pytest.approx(1 - high)
    assert cov.shares() == pytest.approx({"bf16": high, "fp8-current": 1 - high})
    linear = sum(v for k, v in WEIGHTS.items() if k != "out")
    assert cov.by_kind()["linear"]["bf16"] == pytest.approx(
        sum(WEIGHTS[k] for k in kept if k != "out") / linear)
    assert cov.by_kind()["head"] == {"bf16": 1.0}
    rows = cov.kept()                                        # largest first
    assert [(r.name, r.params, r.reason) for r in rows] == sorted(
        ((k, WEIGHTS[k], why) for k, why in kept.items()), key=lambda r: -r[1])
    lines = str(cov).splitlines()
    assert lines[0] == (f"coverage: {round(100 * high)}% of {total:,} matmul weight "
                        f"parameters in 16 bits (bf16), {round(100 * (1 - high))}% below "
                        "16 bits (fp8-current)")
    assert [ln for ln in lines if ln.lstrip().startswith("kept")] == [
        f"  kept {r.name} ({r.params:,}): {r.reason}" for r in rows[:3]]
    assert lines[-1].strip() == (f"... and 1 more kept in bf16 ({rows[3].params:,}; "
                                 "engine.coverage.kept() lists them)")
    # by FLOPs: blocks.0 counts twice, aux (never run) not at all, as torch counts them
    assert flops["blocks.0"] == 2 * flops["blocks.1"] and flops["aux"] == 0
    assert by_flops.total == sum(flops.values())
    high_flops = sum(flops[k] for k in kept) / sum(flops.values())
    assert by_flops.shares() == pytest.approx({"bf16": high_flops,
                                               "fp8-current": 1 - high_flops})


def test_moe_guide_coverage_block_is_what_its_example_prints(tmp_path):
    page = "docs/guides/moe.md"
    code = _block(page, "## transformers' MoE models", "python")
    printed = _block(page, "## transformers' MoE models", "text")
    out = _run([sys.executable, "-c", code], tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout == printed
    # 2 layers: q, o 64x64; k, v 64x32; 4 experts of 3 x 64x64; a 64x4 router; head 128x64
    layer = 2 * 64 * 64 + 2 * 64 * 32 + 4 * 3 * 64 * 64 + 64 * 4
    assert f"of {2 * layer + 128 * 64:,} matmul weight" in printed


def test_a_recipe_leaving_most_weights_in_16_bits_warns_once():
    torch.manual_seed(0)
    net = Net()
    kept = ("wide", "narrow", "inp", "out")                 # the head is kept by default
    high = sum(WEIGHTS[k] for k in kept) / sum(WEIGHTS.values())
    assert high > 0.5                                       # more than half: the guide warns
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = MixedPrecision(net, torch.optim.AdamW(net.parameters()),
                                "fp8-current,layer:wide=bf16,layer:narrow=bf16,layer:inp=bf16")
        str(engine.coverage)
    said = [str(w.message) for w in caught if "low precision" in str(w.message)]
    assert len(said) == 1, said
    assert f"only {round(100 * (1 - high))}%" in said[0]
    assert all(f"{k} (49,152 parameters)" in said[0] for k in ("wide", "narrow"))
    assert engine.coverage.high_precision_share == pytest.approx(high)
