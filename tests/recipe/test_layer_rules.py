"""Per-module rules in a recipe: parsing, printing, validation and matching (the other
rooms' use of them is tested beside each room: fp8 swap and checkpoints in
test_layer_rules_fp8.py, optimizer states and memory in test_layer_rules_states.py,
the planner in test_planner.py)."""

from __future__ import annotations

import fnmatch
import io

import pytest
import torch

from mixprec import PRESETS, Recipe
from mixprec.formats.gemm import DelayedScaling
from mixprec.recipe import Precision
from mixprec.recipe.layer_rules import LAYER_FORMATS, LayerRule, parse_rule

TEXT = ("fp8-current,margin=1,layer:blocks.*.fc=mxfp8,layer:head=bf16,"
        "layer:blocks.1?.qkv=fp8-rowwise,states:*.emb=int8,states:blocks.*=bf16")


def test_rules_round_trip_through_str_and_keep_their_order():
    r = Recipe.parse(TEXT)
    assert str(r) == TEXT
    assert Recipe.parse(str(r)) == r
    assert [str(x) for x in r.layers] == TEXT.split(",")[2:]
    assert r.base == Recipe.parse("fp8-current,margin=1") and r.base.layers == ()


def test_rules_travel_in_a_weights_only_checkpoint():
    r = Recipe.parse(TEXT)
    buf = io.BytesIO()
    torch.save({"recipe": r}, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True)["recipe"] == r


@pytest.mark.parametrize("name", ["blocks.0.fc", "blocks.12.fc", "head", "blocks.13.qkv",
                                  "blocks.3.qkv", "emb", "tok.emb", "blocks.2.emb"])
def test_the_first_matching_rule_decides_as_fnmatch_does(name):
    r = Recipe.parse(TEXT)
    rules = [x for x in r.layers if x.kind == "layer"]
    want = next((x.value for x in rules if fnmatch.fnmatchcase(name, x.pattern)),
                "fp8-current")
    assert r.layer_format(name) == want
    states = [x for x in r.layers if x.kind == "states"]
    want_s = next((x.value for x in states if fnmatch.fnmatchcase(name, x.pattern)),
                  "fp32")
    assert r.state_format(f"{name}.weight") == want_s


def test_state_rules_match_the_module_that_owns_the_parameter():
    r = Recipe.parse("bf16-master,states:0=int8,states:*.emb=int4")
    assert r.state_format("0.weight") == "int8" and r.state_format("0.bias") == "int8"
    assert r.state_format("1.weight") == "fp32"
    assert r.state_format("tok.emb.weight") == "int4"
    assert r.needs_mixprec_optim
    assert not Recipe.parse("bf16-master,states:0=fp32").needs_mixprec_optim


@pytest.mark.parametrize("fmt", [f for f in LAYER_FORMATS if f != "bf16"])
def test_for_layer_takes_the_presets_scaling_and_format_and_keeps_the_rest(fmt):
    r = Recipe.parse(f"fp8,margin=2,fp8_gemm=dequant_fp32,layer:x={fmt}")
    got = r.for_layer("x")
    flat, want = got.flat(), PRESETS[fmt].flat()
    assert (flat["fp8_scaling"], flat["fp8_format"]) == (want["fp8_scaling"],
                                                         want["fp8_format"])
    # a format without a margin (MX, NVFP4) has none to keep
    assert (getattr(got.linear, "margin", 2), got.linear.fp8_gemm, got.layers) == (
        2, "dequant_fp32", ())
    assert r.for_layer("unmatched") == r.base


def test_a_bf16_layer_has_no_fp8_recipe():
    r = Recipe.parse("fp8,layer:head=bf16")
    with pytest.raises(ValueError, match="kept in bf16"):
        r.for_layer("head")


@pytest.mark.parametrize("text,match", [
    ("bf16,layer:x=fp8", "compute='bf16'.*Start from an fp8 preset"),
    ("fp8,layer:x=fp9", "unknown format 'fp9'.*valid: bf16, fp8"),
    ("fp8,states:x=int3", "unknown format 'int3'.*valid: fp32"),
    ("fp8,layer:a b=fp8", "not a module name pattern"),
    ("fp8,layer:=bf16", "not a module name pattern"),
    ("fp8,layer:x=bf16,layer:x=fp8", "given twice"),
    ("fp8,rule:x=bf16", "unknown kind 'rule'"),
])
def test_bad_rules_name_the_rule_and_the_choices(text, match):
    with pytest.raises(ValueError, match=match):
        Recipe.parse(text)


def test_a_fragment_without_a_kind_is_refused_with_the_syntax():
    with pytest.raises(ValueError, match="KIND:PATTERN=FORMAT"):
        parse_rule("blocks.*.fc")
    with pytest.raises(ValueError, match="not a tuple of"):
        Recipe(precision=Precision(compute="fp8"), linear=DelayedScaling(),
               layers=("layer:x=bf16",))


def test_states_rules_work_on_any_recipe():
    r = Recipe.parse("bf16-lean,states:head=fp32")
    assert r.state_format("head.weight") == "fp32" and r.state_format("x.weight") == "int8"
    assert LayerRule("states", "head", "fp32").matches("head")
