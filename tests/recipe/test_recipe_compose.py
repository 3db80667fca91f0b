"""The composed Recipe: its string form is the flat one users know (pinned against the
flat Recipe it replaced), fields of one format exist on that format only, and old
flat pickles load."""

from __future__ import annotations

import io
import pickle

import pytest
import torch

from helpers.paths import DATA
from mixprec.formats.gemm import FORMATS, CurrentScaling, MXScaling, NVFP4Scaling
from mixprec.recipe import PRESETS, LastLayers, LayoutOptions, LossScale, Precision, Recipe

#: recipe strings and the ``str()`` the flat Recipe (36 fields in one dataclass) gave them
PINNED = [
    ('fp32', 'fp32'),
    ('tf32', 'tf32'),
    ('bf16', 'bf16'),
    ('bf16-master', 'bf16-master'),
    ('fp16', 'fp16'),
    ('fp16-master', 'fp16-master'),
    ('fp8', 'fp8'),
    ('fp8-current', 'fp8-current'),
    ('fp8-rowwise', 'fp8-rowwise'),
    ('fp8-block', 'fp8-block'),
    ('mxfp8', 'mxfp8'),
    ('nvfp4', 'nvfp4'),
    ('bf16-sr', 'bf16-sr'),
    ('bf16-kahan', 'bf16-kahan'),
    ('bf16-remainder', 'bf16-remainder'),
    ('bf16-lean', 'bf16-lean'),
    ('fp16,init_scale=1024,growth_interval=3', 'fp16,init_scale=1024.0,growth_interval=3'),
    ('bf16,grads=bf16', 'bf16,grads=bf16'),
    ('compute=bf16,params=fp32,master=none', 'bf16'),
    ('bf16,keep_fp32=softmax+loss', 'bf16,keep_fp32=softmax+loss'),
    ('bf16,keep_fp32=none', 'bf16,keep_fp32=none'),
    ('fp16,emulate=true', 'fp16,emulate=true'),
    ('fp16,emulate=auto', 'fp16'),
    ('fp8,margin=2,amax_history_len=4', 'fp8,amax_history_len=4,margin=2'),
    ('fp8,amax_compute_algo=most_recent', 'fp8,amax_compute_algo=most_recent'),
    ('fp8,fp8_format=e4m3', 'fp8,fp8_format=e4m3'),
    ('fp8-current,margin=1,fp8_gemm=dequant', 'fp8-current,margin=1,fp8_gemm=dequant'),
    ('fp8-current,fp8_gemm=dequant_fp32', 'fp8-current,fp8_gemm=dequant_fp32'),
    ('fp8,fp8_gemm=scaled_mm', 'fp8,fp8_gemm=scaled_mm'),
    ('fp8,fp8_scaling=current', 'fp8-current'),
    ('fp8,fp8_scaling=rowwise', 'fp8-rowwise'),
    ('fp8,fp8_scaling=block', 'fp8,fp8_scaling=block'),
    ('fp8,fp8_scaling=mx', 'fp8,fp8_scaling=mx'),
    ('fp8,fp8_scaling=nvfp4', 'fp8,fp8_scaling=nvfp4'),
    ('fp8-current,fp8_scaling=delayed', 'fp8'),
    ('fp8-block,fp8_scaling=mx', 'mxfp8'),
    ('fp8-block,block_scales=pow2', 'fp8-block,block_scales=pow2'),
    ('fp8-block,fp8_format=hybrid', 'fp8,fp8_scaling=block'),
    ('mxfp8,mx_rounding=floor', 'mxfp8,mx_rounding=floor'),
    ('mxfp8,fp8_format=hybrid', 'fp8,fp8_scaling=mx'),
    ('nvfp4,nvfp4_2d=false', 'nvfp4,nvfp4_2d=false'),
    ('nvfp4,nvfp4_rht=false,nvfp4_sr=false', 'nvfp4,nvfp4_rht=false,nvfp4_sr=false'),
    ('nvfp4,bf16_last_layers=0', 'fp8,fp8_scaling=nvfp4'),
    ('nvfp4,bf16_last_fraction=0.15', 'nvfp4,bf16_last_fraction=0.15'),
    ('nvfp4,bf16_last_layers=0,bf16_last_fraction=0.15',
     'fp8,fp8_scaling=nvfp4,bf16_last_fraction=0.15'),
    ('fp8,bf16_last_layers=3', 'fp8,bf16_last_layers=3'),
    ('fp8,fp8_all_gather=true', 'fp8,fp8_all_gather=true'),
    ('fp8-current,fp8_all_gather=true', 'fp8-current,fp8_all_gather=true'),
    ('bf16-master,compute=fp8,fp8_scaling=current', 'bf16-master,compute=fp8,fp8_scaling=current'),
    ('bf16-master,compute=fp8', 'bf16-master,compute=fp8'),
    ('fp8,params=bf16,master=fp32', 'bf16-master,compute=fp8'),
    ('fp8-current,fp8_format=e4m3,margin=1', 'fp8-current,fp8_format=e4m3,margin=1'),
    ('fp8-rowwise,fp8_format=e4m3,fp8_gemm=scaled_mm',
     'fp8-rowwise,fp8_format=e4m3,fp8_gemm=scaled_mm'),
    ('fp8,emulate=false,fp8_gemm=dequant_fp32', 'fp8,emulate=false,fp8_gemm=dequant_fp32'),
    ('nvfp4,emulate=false,fp8_gemm=dequant_fp32', 'nvfp4,emulate=false,fp8_gemm=dequant_fp32'),
    ('fp16-master,skip_limit=0', 'fp16-master,skip_limit=0'),
    ('fp16-master,on_skip_limit=raise', 'fp16-master,on_skip_limit=raise'),
    ('fp16,hysteresis=2,min_scale=2.0,max_scale=65536.0',
     'fp16,hysteresis=2,min_scale=2.0,max_scale=65536.0'),
    ('fp16,loss_scale=static,init_scale=128', 'fp16,loss_scale=static,init_scale=128.0'),
    ('bf16,wgrad=fp32', 'bf16,wgrad=fp32'),
    ('bf16-master,grad_accum=kahan', 'bf16-master,grad_accum=kahan'),
    ('bf16,comm=bf16', 'bf16,comm=bf16'),
    ('bf16-master,states=int8', 'bf16-master,states=int8'),
    ('bf16-sr,states=bf16', 'bf16-sr,states=bf16'),
    ('bf16-kahan,grads=bf16', 'bf16-kahan,grads=bf16'),
    ('compute=fp8_e4m3', 'fp32,compute=fp8_e4m3'),
    ('compute=fp4_e2m1,emulate=true', 'fp32,compute=fp4_e2m1,emulate=true'),
    ('compute=fp6_e3m2', 'fp32,compute=fp6_e3m2'),
    ('tf32,keep_fp32=layer_norm', 'tf32,keep_fp32=layer_norm'),
    ('fp8-current,layer:blocks.*.fc=mxfp8,layer:head=bf16,states:*.emb=int8',
     'fp8-current,layer:blocks.*.fc=mxfp8,layer:head=bf16,states:*.emb=int8'),
    ('fp8,layer:x=nvfp4', 'fp8,layer:x=nvfp4'),
    ('bf16-master,states:0=int8,states:*.emb=int4', 'bf16-master,states:0=int8,states:*.emb=int4'),
    ('bf16-lean,states:head=fp32', 'bf16-lean,states:head=fp32'),
    ('fp8-current,margin=2,fp8_gemm=dequant_fp32,layer:x=mxfp8',
     'fp8-current,margin=2,fp8_gemm=dequant_fp32,layer:x=mxfp8'),
    ('nvfp4,layer:out=fp8-current', 'nvfp4,layer:out=fp8-current'),
    ('fp8-current,fp8_all_gather=true,layer:mid=fp8',
     'fp8-current,fp8_all_gather=true,layer:mid=fp8'),
    ('compute=fp16,params=fp16,master=fp32,loss_scale=dynamic', 'fp16-master'),
    ('fp8-rowwise,fp8_gemm=dequant', 'fp8-rowwise,fp8_gemm=dequant'),
    ('mxfp8,mx_rounding=even,fp8_gemm=dequant_fp32',
     'mxfp8,fp8_gemm=dequant_fp32,mx_rounding=even'),
    ('fp8-block,fp8_gemm=scaled_mm', 'fp8-block,fp8_gemm=scaled_mm'),
    ('fp8,compute=bf16', 'bf16'),
    ('fp8-block,compute=fp8', 'fp8-block'),
    ('bf16,keep_fp32=attention_backward+softmax', 'bf16,keep_fp32=attention_backward+softmax'),
]


@pytest.mark.parametrize("text,want", PINNED)
def test_every_string_reads_back_as_the_flat_recipe_wrote_it(text, want):
    r = Recipe.parse(text)
    assert str(r) == want
    assert Recipe.parse(want) == r


def test_a_recipe_is_composed_of_configs_and_a_format_object():
    r = Recipe.parse("fp8-current,margin=1,fp8_gemm=dequant,init_scale=8")
    assert r.precision == Precision(compute="fp8")
    assert r.loss == LossScale(init_scale=8.0)
    assert r.linear == CurrentScaling(margin=1, fp8_gemm="dequant")
    assert Recipe(precision=Precision(compute="fp8"), linear=MXScaling()) == PRESETS["mxfp8"]
    assert Recipe(precision=Precision(compute="fp8"), linear=NVFP4Scaling()) == \
        PRESETS["nvfp4"]
    assert PRESETS["bf16"].linear is None


@pytest.mark.parametrize("text,match", [
    ("fp8-block,mx_rounding=ceil", r"mx_rounding with fp8_scaling='block'.*fp8_scaling=mx"),
    ("mxfp8,margin=1", r"margin with fp8_scaling='mx'"),
    ("fp8-rowwise,amax_history_len=32", r"amax_history_len with fp8_scaling='rowwise'"),
    ("bf16,fp8_scaling=rowwise,margin=1", r"fp8_scaling, margin set with compute='bf16'"),
    ("nvfp4,fp8_format=e4m3", r"fp8_format with fp8_scaling='nvfp4'"),
])
def test_a_field_the_format_does_not_have_is_refused(text, match):
    with pytest.raises(ValueError, match=match):
        Recipe.parse(text)


def test_each_format_validates_its_own_fields():
    with pytest.raises(ValueError, match="'mx_rounding': unknown value 'up'"):
        MXScaling(mx_rounding="up")
    with pytest.raises(ValueError, match="'margin': -1 is invalid"):
        CurrentScaling(margin=-1)
    with pytest.raises(TypeError):
        CurrentScaling(1)  # keyword-only
    with pytest.raises(ValueError, match="compute='fp8' needs one"):
        Recipe(precision=Precision(compute="fp8"))
    assert set(FORMATS) == {"delayed", "current", "rowwise", "block", "mx", "nvfp4", "int8",
                            "mxfp6"}


@pytest.mark.parametrize("text", [t for t, _ in PINNED])
def test_new_pickles_are_the_string_and_load_with_weights_only(text):
    r = Recipe.parse(text)
    assert len(pickle.dumps(r)) < 120 + len(str(r))
    buf = io.BytesIO()
    torch.save({"recipe": r}, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True)["recipe"] == r


def test_recipes_pickled_flat_by_mixprec_0_3_load_as_the_same_recipes():
    """``tests/data/recipe_0_3.py`` wrote them with the flat 36-field Recipe."""

    saved = torch.load(DATA / "recipe_0_3.pt", weights_only=True)
    assert len(saved) == 9
    for text, r in saved.items():
        assert type(r) is Recipe and r == Recipe.parse(text) and str(r) == text
        assert r.linear is None or r.linear == Recipe.parse(text).linear


def test_layout_and_last_layers_are_the_recipes_and_a_layer_rule_keeps_them():
    """``fp8_all_gather``, ``tp_reduce`` and the last-layers rule are read into the
    recipe's ``layout`` and ``last_layers`` (not its format); a ``layer:`` rule's recipe
    keeps them, whatever format the rule names."""
    r = Recipe.parse("fp8-current,fp8_all_gather=true,tp_reduce=compute,bf16_last_layers=3,"
                     "bf16_last_fraction=0.25,layer:a=mxfp8,layer:b=nvfp4")
    assert r.layout == LayoutOptions(fp8_all_gather=True, tp_reduce="compute")
    assert r.last_layers == LastLayers(bf16_last_layers=3, bf16_last_fraction=0.25)
    for name, fmt in (("a", MXScaling), ("b", NVFP4Scaling), ("c", CurrentScaling)):
        own = r.for_layer(name)
        assert type(own.linear) is fmt and own.layout == r.layout, name
        assert own.last_layers == r.last_layers, name
    assert PRESETS["nvfp4"].last_layers == LastLayers(bf16_last_layers=2)
    assert PRESETS["bf16"].layout == LayoutOptions()


def test_layout_and_last_layers_need_a_linear_format_in_python_too():
    with pytest.raises(ValueError, match=r"fp8_all_gather, bf16_last_layers set with "
                                         r"compute='bf16'.*Linear preset"):
        Recipe(precision=Precision(compute="bf16"),
               layout=LayoutOptions(fp8_all_gather=True),
               last_layers=LastLayers(bf16_last_layers=1))
    with pytest.raises(ValueError, match="'tp_reduce': unknown value 'bf16'; valid: fp32, "
                                         "compute"):
        LayoutOptions(tp_reduce="bf16")
    with pytest.raises(ValueError, match="'fp8_all_gather': 1 is invalid; it must be true "
                                         "or false"):
        LayoutOptions(fp8_all_gather=1)
    with pytest.raises(ValueError, match="'bf16_last_layers': True is invalid"):
        LastLayers(bf16_last_layers=True)
    with pytest.raises(NotImplementedError, match="fp8_scaling=int8: this format's weight "
                                                  "casts cannot be gathered"):
        Recipe(precision=Precision(compute="fp8"), linear=FORMATS["int8"](),
               layout=LayoutOptions(fp8_all_gather=True))
