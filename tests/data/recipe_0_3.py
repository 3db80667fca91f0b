"""Writes recipe_0_3.pt: Recipes pickled by mixprec 0.3, whose Recipe was one flat
dataclass of 36 fields. Run with mixprec 0.3 on the path (``PYTHONPATH=<0.3>/src``)."""

import torch

from mixprec.recipe import Recipe

TEXTS = ("fp32", "fp16-master,init_scale=1024.0", "bf16-lean", "fp8",
         "fp8-current,margin=1,fp8_gemm=dequant", "fp8-block,block_scales=pow2",
         "mxfp8,mx_rounding=floor", "nvfp4,nvfp4_rht=false,bf16_last_fraction=0.15",
         "fp8,amax_history_len=4,fp8_all_gather=true,layer:head=bf16,states:*.emb=int8")

if __name__ == "__main__":
    torch.save({t: Recipe.parse(t) for t in TEXTS}, "tests/data/recipe_0_3.pt")
