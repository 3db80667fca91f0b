"""Recipe: presets, the string form, validation messages, checkpoint safety."""

from __future__ import annotations

import dataclasses
import io
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mixprec.recipe import PRESETS, Precision, Recipe, preset_names


@pytest.mark.parametrize("name", preset_names())
def test_presets_round_trip(name):
    r = PRESETS[name]
    assert str(r) == name
    assert Recipe.parse(str(r)) == r
    assert Recipe.coerce(name) is r


def test_fp16_master_is_seed_000_loop():
    r = Recipe.parse("fp16-master")
    assert (r.compute, r.params, r.master, r.grads, r.loss_scale) == (
        "fp16", "fp16", "fp32", "fp32", "dynamic")
    assert (r.init_scale, r.growth_factor, r.backoff_factor, r.growth_interval) == (
        2.0**16, 2.0, 0.5, 2000)


@pytest.mark.parametrize(
    "text,field,value",
    [
        ("fp16,init_scale=1024,growth_interval=3", "growth_interval", 3),
        ("bf16,grads=bf16", "grads", "bf16"),
        ("compute=bf16,params=fp32,master=none", "compute", "bf16"),
        ("bf16,keep_fp32=softmax+loss", "keep_fp32", ("softmax", "loss")),
        ("bf16,keep_fp32=none", "keep_fp32", ()),
        ("fp16,emulate=true", "emulate", True),
        ("fp8,margin=2,amax_history_len=4", "margin", 2),
    ],
)
def test_parse_overrides_round_trip(text, field, value):
    r = Recipe.parse(text)
    assert r.flat()[field] == value  # the string syntax's view (margin: r.linear's)
    assert Recipe.parse(str(r)) == r


@pytest.mark.parametrize(
    "text,needle",
    [
        ("fp16,colour=red", "unknown field 'colour'"),
        ("fp16,compute=fp12", "'compute': unknown value 'fp12'"),
        ("fp16,init_scale=1,init_scale=2", "field 'init_scale' given twice"),
        ("fp16,dynamic", "fragment 'dynamic' is not key=value"),
        ("fp17", "unknown preset 'fp17'"),
        ("fp16,", "empty fragment"),
        ("compute=fp16,params=fp16", "params='fp16' with master='none' and loss_scale='none'"),
        ("fp8,params=fp16", "compute='fp8' with params='fp16'"),
        ("fp16,init_scale=-4", "'init_scale'"),
        ("fp16,growth_factor=0.5", "'growth_factor'"),
        ("fp16,backoff_factor=2", "'backoff_factor'"),
        ("fp16,growth_interval=0", "'growth_interval'"),
        ("fp16,hysteresis=x", "'hysteresis': 'x' is not an integer"),
        ("fp16,min_scale=8,max_scale=4", "'min_scale'"),
        ("fp16,init_scale=1e9", "'init_scale'"),
        ("bf16,keep_fp32=softmax+conv", "'keep_fp32': unknown entries ['conv']"),
        ("bf16,emulate=maybe", "'emulate'"),
        ("bf16,grads=fp16", "grads='fp16' with loss_scale='none'"),
        ("fp16,on_skip_limit=ignore", "'on_skip_limit'"),
    ],
)
def test_bad_input_names_the_field(text, needle):
    with pytest.raises(ValueError) as e:
        Recipe.parse(text)
    assert needle in str(e.value)


def test_fp16_params_without_scaling_names_the_fix():
    with pytest.raises(ValueError, match="fp16-master"):
        Recipe(precision=Precision(compute="fp16", params="fp16"))


def test_useless_combinations_warn():
    with pytest.warns(UserWarning, match="scaling buys nothing"):
        Recipe.parse("bf16,loss_scale=dynamic")
    with pytest.warns(UserWarning, match="second fp32 copy"):
        Recipe.parse("fp32,master=fp32")
    # a field the recipe's Linear format does not have does not exist: refused
    with pytest.raises(ValueError, match="fp8_scaling, margin set with compute='bf16'"):
        Recipe.parse("bf16,fp8_scaling=rowwise,margin=1")
    with pytest.raises(ValueError, match="amax_history_len with fp8_scaling='rowwise'"):
        Recipe.parse("fp8-rowwise,amax_history_len=32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Recipe.parse("fp8,amax_history_len=32,margin=1")   # delayed: they apply
        Recipe.parse("fp8-current,margin=2")               # margin applies to every scaling


def test_recipe_is_frozen_and_keyword_only():
    r = Recipe()
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.compute = "bf16"  # type: ignore[misc]
    with pytest.raises(TypeError):
        Recipe("bf16")  # type: ignore[misc]


def test_loads_with_weights_only():
    buf = io.BytesIO()
    torch.save({"recipe": PRESETS["fp16-master"]}, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True)["recipe"] == PRESETS["fp16-master"]


_KEYS = ["compute", "params", "master", "grads", "loss_scale", "init_scale", "hysteresis",
         "keep_fp32", "emulate", "margin", "nonsense", ""]
_VALUES = ["fp16", "bf16", "fp32", "none", "dynamic", "1e9", "-1", "0", "3", "nan", "inf",
           "softmax+loss", "true", "x", "", "=", "fp8"]


@pytest.mark.filterwarnings("ignore:recipe. :UserWarning")  # advice on valid but unwise combos
@settings(max_examples=400, deadline=None)
@given(st.one_of(
    st.text(max_size=40),
    st.lists(st.tuples(st.sampled_from(_KEYS), st.sampled_from(_VALUES)), max_size=4).map(
        lambda kv: ",".join(["fp16", *(f"{k}={v}" for k, v in kv)])),
    st.lists(st.sampled_from(preset_names() + ["=", ",", "x=y"]), max_size=3).map(",".join),
))
def test_fuzzed_strings_raise_only_value_error(text):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            r = Recipe.parse(text)
        except ValueError:
            return
    assert Recipe.parse(str(r)) == r


@pytest.mark.parametrize("text,field", [
    ("fp16,growth_factor=inf", "growth_factor"), ("fp16,growth_factor=nan", "growth_factor"),
    ("fp16,growth_factor=1e30", "growth_factor"), ("fp16,backoff_factor=nan", "backoff_factor"),
    ("fp16,backoff_factor=-inf", "backoff_factor"), ("fp16,max_scale=inf", "max_scale"),
])
def test_non_finite_or_absurd_scaler_factors_are_refused_naming_the_field(text, field):
    """Found by fuzzing Recipe.parse: growth_factor=inf was accepted (the scale would jump
    to max_scale, or to inf without a cap, after the first growth interval)."""
    with pytest.raises(ValueError, match=f"recipe field '{field}'"):
        Recipe.parse(text)
