"""engine.save_pretrained writes what was trained: config-built tiny Llama and
Qwen3-MoE models trained two steps under fp8-current, fp8-block, mxfp8 and nvfp4 load
with ``AutoModelForCausalLM.from_pretrained`` on a CPU, their weights take at most 0.7x
a bf16 save's bytes, every quantized projection loads as mixprec's cast of its fp32
master (the reference: the format's cast, dequantized in float64 and rounded as the
loader rounds), and the logits are within 10% relative L2 of the engine's forward."""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

import mixprec  # noqa: E402
from helpers import moe_models  # noqa: E402
from mixprec.export.sites import quantized_sites  # noqa: E402

RECIPES = ("fp8-current", "fp8-block", "mxfp8", "nvfp4")
KINDS = ("llama", "qwen3_moe")
#: transformers 5.25 dequantizes compressed-tensors experts as plain (weight, scale)
#: pairs: MXFP8's e8m0 bytes are multiplied as numbers (the load raises) and NVFP4's
#: global scale is left out. vLLM reads both; the values are checked with
#: compressed-tensors' own decompressor in test_export_files.py
TRANSFORMERS_EXPERTS_BUG = {("mxfp8", "qwen3_moe"), ("nvfp4", "qwen3_moe")}


def _config(kind: str):
    if kind == "llama":
        return transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=moe_models.VOCAB,
            max_position_embeddings=64, head_dim=16)
    return moe_models.config(kind)


def _trained(recipe: str, kind: str):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(kind), dtype=torch.float32)
    engine = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                    recipe=recipe)
    for ids in moe_models.markov_batches(2):
        with engine.autocast():
            loss = model(ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    return model, engine


def _reference(site, master: torch.Tensor) -> torch.Tensor:
    """The forward's weight cast of ``master``, its value in float64 (each expert's
    slice cast on its own), independently of the export's code."""
    def one(w):
        q = site.quantizer.cast(w, "weight", 1, site.state)
        s = q.scale_inv.double()
        if q.outer is not None:
            s = s * q.outer.double()
        if q.rows or q.cols:
            s = s.repeat_interleave(q.rows, 0)[:w.shape[0]].repeat_interleave(q.cols, 1)
            s = s[:, :w.shape[1]]
        return q.data.double() * s
    return torch.stack([one(w) for w in master]) if master.dim() == 3 else one(master)


def _on_disk(kind: str, name: str, ref: torch.Tensor) -> dict[str, torch.Tensor]:
    """A quantized parameter's reference by on-disk module: Qwen3-MoE's fused experts
    projections split per expert (gate_up_proj: gate rows, then up rows)."""
    if ref.dim() == 2:
        return {name.removesuffix(".weight"): ref}
    base, _, proj = name.rpartition(".")
    out = {}
    for e, w in enumerate(ref):
        if proj == "gate_up_proj":
            half = w.shape[0] // 2
            out[f"{base}.{e}.gate_proj"], out[f"{base}.{e}.up_proj"] = w[:half], w[half:]
        else:
            out[f"{base}.{e}.{proj}"] = w
    return out


def _decompressed(config: dict, tensors: dict, module: str) -> torch.Tensor:
    """``module``'s weight as compressed-tensors' own decompressor reads it."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    local = {k.removeprefix(module + "."): v for k, v in tensors.items()
             if k.startswith(module + ".")}
    scheme = QuantizationScheme.model_validate(config["config_groups"]["group_0"])
    return BaseCompressor.get_value_from_registry(config["format"]).decompress(
        local, scheme)["weight"]


def _joined(kind: str, name: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """``_on_disk``'s pieces of parameter ``name`` put back together."""
    if len(parts) == 1:
        return next(iter(parts.values()))
    base, _, proj = name.rpartition(".")
    experts = len(parts) // (2 if proj == "gate_up_proj" else 1)
    if proj == "gate_up_proj":
        return torch.stack([torch.cat([parts[f"{base}.{e}.gate_proj"],
                                       parts[f"{base}.{e}.up_proj"]]) for e in range(experts)])
    return torch.stack([parts[f"{base}.{e}.{proj}"] for e in range(experts)])


def _check_loaded(recipe: str, got: dict, sites: dict, masters: dict, written: dict):
    """Every quantized weight transformers loaded is mixprec's cast of its master."""
    assert sites
    for name, site in sites.items():
        ref = _reference(site, masters[name])
        if recipe == "nvfp4":
            # compressed-tensors dequantizes NVFP4 to bf16 as code x fp32(scale / global
            # scale), where the cast multiplies by its descale G: the loaded weight is
            # that, on the cast's codes and e4m3 scales and a global scale within one
            # fp32 step of 1/G, and within bf16's rounding of the trained values
            q = site.quantizer.cast(masters[name], "weight", 1, site.state)
            gs = written[name.removesuffix("weight") + "weight_global_scale"]
            assert float((gs.double() * q.outer.double() - 1).abs()) <= 2.0**-23, name
            s = q.scale_inv.repeat_interleave(q.rows, 0).repeat_interleave(q.cols, 1)
            assert torch.equal(got[name], (q.data.float() * (s / gs)).bfloat16().float())
            err = ((got[name].double() - ref).abs() / ref.abs())[ref != 0]
            assert float(err.max()) <= 2.0**-8 + 2.0**-22, name
        else:  # the loader's fp32 product: the float64 product rounded once to fp32
            assert torch.equal(got[name], ref.float()), name


def _bytes(state: dict) -> int:
    return sum(v.numel() * v.element_size() for v in state.values())


#: the served logits against the engine's forward: NVFP4's trained forward casts every
#: activation to e2m1 as well, the weights-only checkpoint's server multiplies them in 16
#: bits, and on the tiny Llama that activation error alone is over the 10% bound
#: (measured 0.1227 relative L2; Qwen3-MoE 0.0931). The weights themselves load exactly.
LOGITS_OVER = {("nvfp4", "llama"): "the trained forward's e2m1 activation casts: 12.3%"}


def _cells():
    return [pytest.param(r, k, marks=[pytest.mark.xfail(strict=True, raises=AssertionError,
                                                   reason=LOGITS_OVER[r, k])]
                         if (r, k) in LOGITS_OVER else [])
            for r in RECIPES for k in KINDS]


@pytest.mark.long
@pytest.mark.parametrize("recipe,kind", _cells())
def test_a_trained_model_loads_in_transformers_as_it_was_trained(tmp_path, recipe, kind):
    from safetensors.torch import load_file

    model, engine = _trained(recipe, kind)
    masters = engine.export_state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported = engine.save_pretrained(tmp_path / "q")
    engine.module.save_pretrained(tmp_path / "bf16",
                                  state_dict=engine.export_state_dict(torch.bfloat16))
    written = load_file(tmp_path / "q" / "model.safetensors")
    ratio = (_bytes(written)
             / _bytes(load_file(tmp_path / "bf16" / "model.safetensors")))
    assert ratio <= 0.7, ratio
    sites = quantized_sites(engine.module)
    refs = {k: v for name, site in sites.items()
            for k, v in _on_disk(kind, name, _reference(site, masters[name])).items()}
    if exported.schema.quant_method == "compressed-tensors":
        # compressed-tensors' own decompressor reads back every projection, experts too
        config = exported.quantization_config()
        for module, ref in refs.items():
            got = _decompressed(config, written, module).double()
            if recipe == "nvfp4":  # in bf16, its e4m3 scale over the global one
                assert torch.equal(got == 0, ref == 0), module
                err = ((got - ref).abs() / ref.abs())[ref != 0]
                assert float(err.max()) <= 2.0**-8 + 2.0**-22, module
            else:
                assert torch.equal(got.float(), ref.float()), module
    if (recipe, kind) in TRANSFORMERS_EXPERTS_BUG:
        # the export says so; the served model here: the 16-bit save with every
        # quantized weight as compressed-tensors' decompressor reads it
        assert any("MoE experts wrongly" in n for n in exported.notes)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16",
                                                                   dtype=torch.float32)
        config = exported.quantization_config()
        with torch.no_grad():
            for name in sites:
                parts = _on_disk(kind, name, masters[name])
                values = {m: _decompressed(config, written, m).float() for m in parts}
                loaded.get_parameter(name).copy_(_joined(kind, name, values))
    else:
        kw = {}
        if exported.schema.quant_method == "compressed-tensors":
            kw["quantization_config"] = transformers.CompressedTensorsConfig(dequantize=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded = transformers.AutoModelForCausalLM.from_pretrained(
                tmp_path / "q", dtype=torch.float32, **kw)
        _check_loaded(recipe, loaded.state_dict(), sites, masters, written)
    ids = moe_models.markov_batches(1, seed=1)[0]
    with torch.no_grad():
        with engine.autocast():
            trained = model(ids).logits.double()
        served = loaded(ids).logits.double()
    rel = float((served - trained).norm() / trained.norm())
    print(f"{recipe} {kind}: bytes {ratio:.3f} of bf16, logits rel L2 {rel:.4f}")
    assert rel < 0.10, rel  # over it: LOGITS_OVER


@pytest.mark.long
def test_quantized_false_writes_the_fp32_masters(tmp_path):
    model, engine = _trained("fp8-current", "llama")
    assert engine.save_pretrained(tmp_path, quantized=False) is None
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    masters = engine.export_state_dict()
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, masters[k]), k


def test_engine_save_pretrained_loads_back_as_the_trained_casts(tmp_path):
    """The default suite's case: a one-layer Llama, one step of fp8-current."""
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=64, head_dim=16)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    engine = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                    recipe="fp8-current")
    ids = torch.randint(0, 64, (2, 8))
    with engine.autocast():
        loss = model(ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    exported = engine.save_pretrained(tmp_path)
    assert exported.schema.name == "float-tensor" and exported.ignore == ["lm_head"]
    assert exported.loader_error == 0.0 and not exported.notes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, dtype=torch.float32,
            quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
    masters = engine.export_state_dict()
    sites = quantized_sites(engine.module)
    assert len(sites) == 7
    for name, site in sites.items():
        assert torch.equal(loaded.get_parameter(name), _reference(site, masters[name]).float())
    assert loaded.lm_head.weight.dtype == torch.float32
    assert torch.equal(loaded.lm_head.weight, masters["lm_head.weight"].bfloat16().float())
