"""mixprec.export.save on a plain module: the safetensors file holds each quantized
Linear's codes and scales as its schema lays them out, compressed-tensors' own
decompressor (and transformers' fine-grained fp8 arithmetic) reads back mixprec's cast
of the fp32 master (float64 reference, rounded as the loader rounds), the JSON
description names the schema, the 16-bit Linears and the config; what cannot be
exported is refused naming the fix."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

import mixprec
from mixprec.export import save, schema_for
from mixprec.export.schema import on_grid
from mixprec.export.sites import quantized_sites
from mixprec.formats.gemm import FORMATS

RECIPES = ("fp8", "fp8-current", "fp8-rowwise", "fp8-block", "mxfp8", "nvfp4", "int8-rowwise")


def _engine(recipe: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(),
                          nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))
    engine = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                    recipe=recipe)
    x = torch.randn(32, 64)
    with engine.autocast():
        loss = model(x).float().square().mean()
    engine.backward(loss)
    engine.step()
    return model, engine


def _reference(site, master: torch.Tensor) -> torch.Tensor:
    """The forward's weight cast of ``master``, its value in float64."""
    q = site.quantizer.cast(master, "weight", 1, site.state)
    s = q.scale_inv.double()
    if q.outer is not None:
        s = s * q.outer.double()
    if q.rows or q.cols:
        s = s.repeat_interleave(q.rows, 0)[:master.shape[0]]
        s = s.repeat_interleave(q.cols, 1)[:, :master.shape[1]]
    return q.data.double() * s


def _read_back(schema: str, config: dict, tensors: dict, module: str) -> torch.Tensor:
    """``module``'s weight as its loader dequantizes it."""
    local = {k.removeprefix(module + "."): v for k, v in tensors.items()
             if k.startswith(module + ".")}
    if config["quant_method"] == "fp8":  # transformers' Fp8Dequantize arithmetic
        w, s = local["weight"], local["weight_scale_inv"]
        b = config["weight_block_size"]
        s = s.repeat_interleave(b[0], 0)[:w.shape[0]].repeat_interleave(b[1], 1)
        return w.float() * s[:, :w.shape[1]]
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    parsed = QuantizationConfig.model_validate(config)  # it parses as compressed-tensors'
    assert parsed.format == config["format"] and parsed.ignore == config["ignore"]
    scheme = QuantizationScheme.model_validate(config["config_groups"]["group_0"])
    compressor = BaseCompressor.get_value_from_registry(config["format"])
    return compressor.decompress(local, scheme)["weight"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_save_writes_the_trained_casts_and_the_loader_reads_them_back(tmp_path, recipe):
    from safetensors.torch import load_file

    if recipe != "fp8-block":
        pytest.importorskip("compressed_tensors")
    model, engine = _engine(recipe)
    masters = engine.export_state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported = save(engine, tmp_path / "m.safetensors")
    tensors = load_file(tmp_path / "m.safetensors")
    desc = json.loads((tmp_path / "m.safetensors.json").read_text())
    assert desc["schema"] == exported.schema.name
    # the output head stays in 16 bits (and the Linear before it, under nvfp4's preset)
    kept = ["4", "6"] if recipe == "nvfp4" else ["6"]
    assert desc["kept_16bit"] == kept
    assert all(tensors[f"{k}.weight"].dtype == torch.bfloat16 for k in kept)
    sites = quantized_sites(engine.module)
    assert sorted(desc["quantized"]) == sorted({"0", "2", "4"} - set(kept)) == sorted(
        p.removesuffix(".weight") for p in sites)
    for name, site in sites.items():
        ref = _reference(site, masters[name])
        got = _read_back(exported.schema.name, desc["quantization_config"], tensors,
                         name.removesuffix(".weight")).double()
        if recipe == "nvfp4":  # dequantized to bf16, its e4m3 scale over the global one
            assert torch.equal(got == 0, ref == 0)
            err = ((got - ref).abs() / ref.abs())[ref != 0]
            assert float(err.max()) <= 2.0**-8 + 2.0**-22
        else:  # the fp32 product of code and scale: float64's, rounded once
            assert torch.equal(got.float(), ref.float()), name
    # only NVFP4's loader divides by the global scale the cast multiplies by its inverse:
    # its error is the fp32 rounding of that quotient (0 where it happens to be exact)
    if recipe == "nvfp4":
        assert 0 <= exported.loader_error <= 2.0**-21, exported.loader_error
    else:
        assert exported.loader_error == 0


def test_quantized_weights_take_about_a_byte_or_half_a_byte_per_element(tmp_path):
    from safetensors.torch import load_file

    pytest.importorskip("compressed_tensors")
    _, engine = _engine("nvfp4")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save(engine, tmp_path / "m.safetensors")
    t = load_file(tmp_path / "m.safetensors")
    # the nvfp4 preset keeps its last two Linears in bf16; the first is packed
    assert t["0.weight_packed"].shape == (128, 32) and t["0.weight_packed"].dtype == torch.uint8
    assert t["0.weight_scale"].shape == (128, 4)
    assert t["0.weight_scale"].dtype == torch.float8_e4m3fn


def test_a_format_without_a_serving_schema_and_a_16_bit_model_are_refused(tmp_path):
    with pytest.raises(NotImplementedError, match="quantized=False"):
        schema_for(FORMATS["mxfp6"]())
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    with pytest.raises(ValueError, match="quantized=False"):
        save(model, tmp_path / "m.safetensors")
    pytest.importorskip("transformers")
    with pytest.raises(TypeError, match="mixprec.export.save"):
        mixprec.export.save_pretrained(model, tmp_path)


def test_a_scale_split_off_the_middle_of_a_block_is_refused():
    s = torch.ones(256, 128)
    s[128:] = 2.0
    assert on_grid(s, 128, 128, "w").tolist() == [[1.0], [2.0]]
    with pytest.raises(ValueError, match="not constant over the schema's 128x128"):
        on_grid(s[64:192], 128, 128, "w")
